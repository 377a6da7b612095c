"""Per-row math over a vocabulary, fused: one compiled kernel a function instead of a pass per elementwise op.

A readout's summary (its entropy, max probability, a target's log-probability) or a Jensen–Shannon divergence
reads a ``[rows, V]`` tensor: eager PyTorch makes one pass over it per operation (max, subtract, clamp, exp, sum,
multiply, sum: about ten), so on a CPU these passes cost more than the head product that made the logits.
:func:`fused` compiles such a function once per process (``torch.compile``, shapes dynamic) into a kernel that
reads each row a few times. Where rows are short (a vocabulary under :data:`MIN_WIDTH`: the tests' tiny models) a
call's fixed cost outweighs the passes, and the eager function runs; so does every call where compiling fails
(then for the rest of the process, so that one process never mixes the two) or where ``EMAD_FUSED=0``. Which one
runs depends on the width alone, never on how many rows a call holds, and every reduction is per row: a row's value
does not depend on the other rows of a call of several rows (checked by the tests on calls of a sweep's blocks of 8
rows; a call of one row may split its reduction over the threads and round otherwise); the fused value differs from
the eager one by float rounding.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

import torch

ENV = "EMAD_FUSED"  # 0: every fused function runs eager
MIN_WIDTH = 4096  # the row width (default: the first argument's last dimension) from which a fused function compiles


def fused(fn: Callable | None = None, *, width: Callable[..., int] | None = None) -> Callable:
    """``fn`` compiled on its first call (module docstring); eager on rows narrower than :data:`MIN_WIDTH`, where
    compiling fails, or with ``EMAD_FUSED=0``. ``width`` reads the row width from the arguments (default: the
    first argument's last dimension). Inside a region being compiled (a compiled decode step) ``fn`` is traced
    into that region's graph."""
    if fn is None:
        return functools.partial(fused, width=width)
    state: dict = {}
    width = width or (lambda *args, **kwargs: args[0].shape[-1])

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling() or width(*args, **kwargs) < MIN_WIDTH:
            return fn(*args, **kwargs)
        if "call" not in state:
            state["call"] = fn if os.environ.get(ENV, "1") == "0" else torch.compile(fn, dynamic=True)
        try:
            return state["call"](*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - a backend that cannot compile: eager from here on
            if state["call"] is fn:
                raise
            print(f"emad: {fn.__name__} runs eager ({type(err).__name__}: {str(err).splitlines()[0][:200]})",
                  file=sys.stderr)
            state["call"] = fn
            return fn(*args, **kwargs)

    run.eager = fn
    return run


def second_largest(x: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """Each row's largest value but the one at ``argmax`` (``[..., 1]``): ``[..., V]`` → ``[..., 1]`` (a tie at the
    top gives the top again)."""
    index = torch.arange(x.shape[-1], device=x.device)
    return torch.where(index == argmax, float("-inf"), x).amax(dim=-1, keepdim=True)


def _readout_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple:
    """``(top logit [r], argmax [r], softmax's normaliser [r], the summary)`` of :func:`readout_scores`."""
    top, argmax = logits.max(dim=-1)
    z = (logits.float() - top.float()[:, None]).clamp(min=-80.0)  # [r, V]
    e = torch.exp(z)
    total = e.sum(dim=-1)
    entropy = (total.log() - (e * z).sum(dim=-1) / total).clamp_min(0.0)
    logprob = logits.gather(-1, targets[:, None])[:, 0].float() - top.float() - total.log()
    return top, argmax, total, (entropy, total.reciprocal(), logprob, argmax == targets)


@fused
def readout_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A readout's summary per row, in fp32: ``logits`` ``[r, V]`` and each row's ``targets`` ``[r]`` →
    ``(entropy, max probability, the target's log-probability, whether the target is the argmax)``, each ``[r]``.

    As :func:`emad.engine.entropy.readout_summary` (shifted logits clamped at -80), with the target's
    log-probability its logit less the row's log-sum-exp."""
    return _readout_scores(logits, targets)[3]


@fused
def readout_scores_top2(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`readout_scores` and, fifth, softmax's top-2 gap ``p_(1) − p_(2)`` ``[r]`` in the same kernel:
    ``(1 − exp(l_(2) − l_(1))) · max p`` (as :func:`emad.exits.criteria.top2_gap`, float rounding apart)."""
    top, argmax, total, scores = _readout_scores(logits, targets)
    second = second_largest(logits.float(), argmax[:, None])[:, 0]  # [r]
    return (*scores, (1 - torch.exp(second - top.float())) / total)


@fused
def summary(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`emad.engine.entropy.readout_summary` fused: ``(entropy, argmax, max probability)`` per row of
    ``logits`` ``[..., V]`` (an estimator's own readout, e.g. a low-rank one)."""
    top, argmax = logits.max(dim=-1)
    z = (logits.float() - top.float()[..., None]).clamp(min=-80.0)
    e = torch.exp(z)
    total = e.sum(dim=-1)
    return (total.log() - (e * z).sum(dim=-1) / total).clamp_min(0.0), argmax, total.reciprocal()
