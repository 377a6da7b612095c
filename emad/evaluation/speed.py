"""A point's speed-up, timed where it runs: its generations alternate with full-depth generations of the same
prompts in the same process, and the speed-up is the median of the paired tokens/s ratios; the pairs are kept
(``speed_pairs``) so that the verdict can put a 95% interval on the speed-up (C2).

Timing each point against a full-depth run made in another process (at another time, under another load) turns a
busy machine into a fake slow-down; pairing them in time cancels most of it. The load average around the
measurement is recorded beside it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from emad.decode import Generation, generate
from emad.exits.criteria import Full


def _tokens_per_s(out: Generation) -> float:
    return sum(len(row) for row in out.token_ids) / max(out.seconds, 1e-9)


def point_speedup(stack, tokenizer, method, prepared: Sequence, result, limit: int | None,
                  repeats: int, new_tokens: int | None = None) -> dict[str, Any]:
    """:func:`measure_speedup` of a point on the speed prompts of its first task that has them (first ``limit``),
    preferring a task whose generation of them ``result`` (an :class:`~emad.evaluation.evaluate.Evaluation`) just
    made (fidelity): that generation is then the first sample. ``new_tokens``: generate that many instead of the
    task's own count (the generation already made is then not reused). No prompts: nothing measured."""
    found = [(p, p.task.speed_prompts(p.data, p.settings)) for p in prepared]
    found = sorted([(p, f) for p, f in found if f], key=lambda pf: not result.generated.get(pf[0].name))
    if not found:
        return measure_speedup(stack, tokenizer, method, [], 0, 0)
    p, (prompts, own_tokens) = found[0]
    prompts = prompts[:limit]
    made = None if new_tokens else next((g for g in result.generated.get(p.name, [])
                                         if len(g.token_ids) == len(prompts)), None)
    return measure_speedup(stack, tokenizer, method, prompts, new_tokens or own_tokens, repeats, made)


def measure_speedup(stack, tokenizer, method, prompts: Sequence[Sequence[int]], new_tokens: int,
                    repeats: int, made: Generation | None = None) -> dict[str, Any]:
    """Generate ``prompts`` ``repeats`` times under ``method`` and at full depth, alternating which goes first.

    ``made``: the method's generation of these prompts that was just timed (e.g. by the fidelity task): it is the
    first repeat's own sample, followed by a full-depth generation, so that it is not made again.

    Returns:
        ``speedup`` (median of the per-repeat ratios method tokens/s ÷ full-depth tokens/s), the medians
        ``speed_tokens_per_s`` and ``reference_tokens_per_s``, ``speed_repeats``, ``speed_pairs`` (per repeat,
        ``[method tokens/s, full-depth tokens/s]``), ``speed_new_tokens``, and ``load_avg`` (1-minute load
        average, the larger of before and after). Values are None when ``repeats`` is 0.
    """
    if repeats == 0 or not prompts:
        return {"speedup": None, "speed_tokens_per_s": None, "reference_tokens_per_s": None, "speed_repeats": 0,
                "speed_pairs": [], "speed_new_tokens": None, "load_avg": None}
    before = os.getloadavg()[0]
    own, ref = [], []
    full = Full()
    first = made is not None  # the method went first in repeat 0
    for r in range(repeats):
        for m in ((method, full) if (r % 2 == 0) == first else (full, method)):
            out = made if (m is method and r == 0 and first) else generate(stack, tokenizer, prompts, m, new_tokens)
            (ref if m is full else own).append(_tokens_per_s(out))
    return {"speedup": statistics.median(a / b for a, b in zip(own, ref)),
            "speed_tokens_per_s": statistics.median(own), "reference_tokens_per_s": statistics.median(ref),
            "speed_repeats": repeats, "speed_pairs": [[a, b] for a, b in zip(own, ref)],
            "speed_new_tokens": new_tokens, "load_avg": max(before, os.getloadavg()[0])}
