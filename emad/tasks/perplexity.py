"""Perplexity under adaptive depth (DESIGN.md §4): sliding windows whose prefix is prefilled at full depth as a
prompt and whose continuation is scored token by token with generation semantics."""

from __future__ import annotations

import math
from collections.abc import Sequence

from emad.decode import Method, Scored, score_continuations
from emad.decode.results import Request
from emad.engine.stack import LayerStack


def windows_with_prefix(ids: Sequence[int], window: int, prefix: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, continuation) pairs covering ``ids``: windows of ``window`` tokens whose first ``prefix`` tokens are
    context only; consecutive windows overlap by ``prefix`` so every token after the first ``prefix`` is scored
    exactly once."""
    if not 1 <= prefix < window:
        raise ValueError(f"prefix must be in 1..window-1 (window {window}), got {prefix}")
    out, stride = [], window - prefix
    for start in range(0, max(len(ids) - prefix, 0), stride):
        piece = list(ids[start:start + window])
        if len(piece) > prefix:
            out.append((piece[:prefix], piece[prefix:]))
    return out


def perplexity_requests(documents: Sequence[Sequence[int]], window: int, prefix: int) -> list[Request]:
    """One request (prompt, [continuation]) per window of each document (:func:`windows_with_prefix`)."""
    return [(prompt, [continuation]) for ids in documents for prompt, continuation in windows_with_prefix(
        ids, window, prefix)]


def perplexity_metrics(scored: Sequence[Sequence[Scored]], prefix: int) -> dict:
    """Perplexity from the scored windows (one ``[Scored]`` per request); see :func:`perplexity`."""
    windows = [s for row in scored for s in row]
    tokens = sum(len(s.logprobs) for s in windows)
    if tokens == 0:
        raise ValueError(f"no document is longer than the prefix ({prefix} tokens): nothing to score")
    nll = sum(s.nll for s in windows)
    return {"perplexity": math.exp(nll / tokens), "nll": nll, "tokens": tokens,
            "flops_ratio": sum(s.flops for s in windows) / sum(s.full_flops for s in windows),
            "mean_depth": sum(sum(s.depths) for s in windows) / tokens,
            "samples": {"perplexity": [[float(s.nll), len(s.logprobs)] for s in windows]},
            "unit_flops": [[s.flops, s.full_flops] for s in windows]}


def first_tokens(requests: Sequence[Request], tokens: int) -> list[Request]:
    """The leading requests that score at least ``tokens`` continuation tokens (all of them when fewer)."""
    out, total = [], 0
    for request in requests:
        if total >= tokens:
            break
        out.append(request)
        total += sum(len(c) for c in request[1])
    return out


def perplexity(stack: LayerStack, documents: Sequence[Sequence[int]], method: Method, window: int = 256,
               prefix: int = 64, sink: list | None = None) -> dict:
    """Adaptive-depth perplexity of token-id documents.

    Args:
        sink: when given, every :class:`~emad.decode.Generation` / :class:`~emad.decode.Scored` of the method is
            appended to it (traces, timing).

    Returns:
        ``{"perplexity", "nll", "tokens", "flops_ratio", "mean_depth", "samples"}`` (natural-log NLL summed over
        tokens); ``samples["perplexity"]``: one ``[nll, tokens]`` per window, so perplexity = exp(Σnll / Σtokens).
    """
    scored = [score_continuations(stack, prompt, continuations, method)
              for prompt, continuations in perplexity_requests(documents, window, prefix)]
    if sink is not None:
        sink.extend(s for row in scored for s in row)
    return perplexity_metrics(scored, prefix)
