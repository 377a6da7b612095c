"""Teacher-forced token agreement with full depth: the full-depth greedy continuation of each prompt is fed back
under the method, and a position agrees when its exit readout's argmax is the token full depth chose there.

Unlike fidelity (free running), one early disagreement does not derail the rest of a continuation, and the whole
task is teacher forced, so one sweep pass scores it for every point (:class:`emad.decode.Sweep`).
"""

from __future__ import annotations

from collections.abc import Sequence

from emad.decode import Generation, Method, Scored, score_continuations
from emad.decode.results import Request
from emad.engine.stack import LayerStack


def agreement_requests(prompts: Sequence[Sequence[int]], reference: Generation) -> list[Request]:
    """(prompt, [its full-depth greedy continuation]) per prompt whose continuation has at least one token."""
    return [(list(prompt), [list(ids)]) for prompt, ids in zip(prompts, reference.token_ids, strict=True) if ids]


def agreement_metrics(scored: Sequence[Sequence[Scored]]) -> dict:
    """``token_agreement`` (Σ agreeing / Σ positions), ``nll`` per token of the full-depth continuation, the FLOPs
    ratio, and ``samples``: ``[agreeing, positions]`` per prompt."""
    rows = [row[0] for row in scored]
    if not rows:
        raise ValueError("agreement: no prompt has a non-empty full-depth continuation")
    pairs = [[sum(map(int, s.greedy)), len(s.greedy)] for s in rows]
    tokens = sum(n for _, n in pairs)
    return {"token_agreement": sum(a for a, _ in pairs) / tokens, "nll": sum(s.nll for s in rows) / tokens,
            "tokens": tokens, "flops_ratio": sum(s.flops for s in rows) / sum(s.full_flops for s in rows),
            "samples": {"token_agreement": pairs}, "unit_flops": [[s.flops, s.full_flops] for s in rows]}


def agreement(stack: LayerStack, prompts: Sequence[Sequence[int]], reference: Generation, method: Method,
              sink: list | None = None) -> dict:
    """Teacher-forced token agreement of ``method`` with the full-depth ``reference`` generation of ``prompts``."""
    scored = [score_continuations(stack, p, c, method) for p, c in agreement_requests(prompts, reference)]
    if sink is not None:
        sink.extend(s for row in scored for s in row)
    return agreement_metrics(scored)
