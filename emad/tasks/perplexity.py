"""Perplexity under adaptive depth (DESIGN.md §4): sliding windows whose prefix is prefilled at full depth as a
prompt and whose continuation is scored token by token with generation semantics."""

from __future__ import annotations

import math
from collections.abc import Sequence

from emad.decode import Method, score_adaptive
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
    nll, tokens, flops, full, depth_sum = 0.0, 0, 0.0, 0.0, 0
    per_window: list[list[float]] = []
    for ids in documents:
        for prompt, continuation in windows_with_prefix(ids, window, prefix):
            scored = score_adaptive(stack, prompt, continuation, method)
            if sink is not None:
                sink.append(scored)
            nll += scored.nll
            tokens += len(continuation)
            per_window.append([float(scored.nll), len(continuation)])
            flops += scored.flops
            full += scored.full_flops
            depth_sum += sum(scored.depths)
    if tokens == 0:
        raise ValueError(f"no document is longer than the prefix ({prefix} tokens): nothing to score")
    return {"perplexity": math.exp(nll / tokens), "nll": nll, "tokens": tokens,
            "flops_ratio": flops / full, "mean_depth": depth_sum / tokens, "samples": {"perplexity": per_window}}
