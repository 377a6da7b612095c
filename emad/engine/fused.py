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


def second_largest(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Each row's largest value once its largest ``top`` (``[..., 1]``) is taken out, ``[..., V]`` → ``[..., 1]``: the top
    again where it is held more than once. Plain float reductions (no index): on a CPU a value-and-index reduction
    costs several times a maximum."""
    below = torch.where(x < top, x, float("-inf")).amax(dim=-1, keepdim=True)  # [..., 1]
    return torch.where((x == top).sum(dim=-1, keepdim=True) > 1, top, below)


def _readout_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple:
    """``(top logit [r], softmax's normaliser [r], (entropy, max probability, the target's log-probability, whether the
    target's logit is the top), how many logits equal the top [r])``: :func:`readout_scores` before argmax's tie
    rule (:func:`first_at_top`), with no index reduction (a value-and-index reduction vectorises poorly on CPUs:
    a ``[256, 49152]`` readout's costs seven plain maxima)."""
    top = logits.amax(dim=-1)  # [r]
    z = (logits.float() - top.float()[:, None]).clamp(min=-80.0)  # [r, V]
    e = torch.exp(z)
    total = e.sum(dim=-1)
    entropy = (total.log() - (e * z).sum(dim=-1) / total).clamp_min(0.0)
    target = logits.gather(-1, targets[:, None])[:, 0]  # [r]
    logprob = target.float() - top.float() - total.log()
    ties = (logits == top[:, None]).sum(dim=-1)  # [r]
    return top, total, (entropy, total.reciprocal(), logprob, target == top), ties


@fused
def _scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`_readout_scores`' summary and tie counts: ``(entropy, max probability, log-probability, at top, ties)``."""
    _, _, scores, ties = _readout_scores(logits, targets)
    return (*scores, ties)


@fused
def _scores_top2(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`_scores` and, sixth, softmax's top-2 gap ``p_(1) − p_(2)`` ``[r]`` in the same kernel:
    ``(1 − exp(l_(2) − l_(1))) · max p`` (as :func:`emad.exits.criteria.top2_gap`, float rounding apart)."""
    top, total, scores, ties = _readout_scores(logits, targets)
    second = second_largest(logits.float(), top.float()[:, None])[:, 0]  # [r]
    return (*scores, ties, (1 - torch.exp(second - top.float())) / total)


def first_at_top(logits: torch.Tensor, targets: torch.Tensor, at_top: torch.Tensor, ties: torch.Tensor
                 ) -> torch.Tensor:
    """Whether each row's target is its argmax (``[r]`` bool), from whether its logit is the top (``at_top``) and how
    many logits hold the top (``ties``): argmax takes the first of tied indices, so the rows whose target shares the
    top with others are settled by an argmax of theirs alone (rare: exact float ties)."""
    if torch.compiler.is_compiling():  # traced into a larger graph: no data-dependent branch
        return torch.where(ties > 1, logits.argmax(dim=-1) == targets, at_top)
    shared = (at_top & (ties > 1)).nonzero()[:, 0]
    if not len(shared):
        return at_top
    at_top = at_top.clone()
    at_top[shared] = logits[shared].argmax(dim=-1) == targets[shared]
    return at_top


def readout_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A readout's summary per row, in fp32: ``logits`` ``[r, V]`` and each row's ``targets`` ``[r]`` →
    ``(entropy, max probability, the target's log-probability, whether the target is the argmax)``, each ``[r]``.

    As :func:`emad.engine.entropy.readout_summary` (shifted logits clamped at -80), with the target's
    log-probability its logit less the row's log-sum-exp; one fused kernel (:func:`_scores`)."""
    entropy, max_prob, logprob, at_top, ties = _scores(logits, targets)
    return entropy, max_prob, logprob, first_at_top(logits, targets, at_top, ties)


def readout_scores_top2(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`readout_scores` and, fifth, softmax's top-2 gap ``p_(1) − p_(2)`` ``[r]``, in one fused kernel
    (:func:`_scores_top2`)."""
    entropy, max_prob, logprob, at_top, ties, gap = _scores_top2(logits, targets)
    return entropy, max_prob, logprob, first_at_top(logits, targets, at_top, ties), gap


@fused
def summary(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`emad.engine.entropy.readout_summary` fused, without the argmax: ``(entropy, max probability)`` per row of
    ``logits`` ``[..., V]`` (an estimator's own readout, e.g. a low-rank one)."""
    top = logits.amax(dim=-1)
    z = (logits.float() - top.float()[..., None]).clamp(min=-80.0)
    e = torch.exp(z)
    total = e.sum(dim=-1)
    return (total.log() - (e * z).sum(dim=-1) / total).clamp_min(0.0), total.reciprocal()
