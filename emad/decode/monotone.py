"""Teacher-forced exits under the monotone policy, one pass per probe over the positions still running.

Under the monotone policy a continuation's depths never rise, so at each probe the positions still running form a
prefix ``[0, running)``. At probe ℓ, if the first running position whose criterion passes is i*, then i* exits at ℓ
and so must every later running position (their depth may not exceed i*'s: they are capped, as in generation); the
prefix shrinks to ``[0, i*)``. A position that runs layer ℓ attends there only to earlier positions that also ran
ℓ, so its hidden state is the full-depth pass's: the states may come from running the stack on the prefix
(:func:`emad.decode.score_adaptive`) or from one shared full-depth pass (:mod:`emad.decode.sweep`). A
:class:`StateSource` hides which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from emad.decode.results import Scored
from emad.engine.cost import CostModel
from emad.exits.criteria import ProbeView
from emad.exits.estimators import Estimate


class StateSource(Protocol):
    """Hidden states, estimates and exit scores of a continuation's positions at a probe.

    Attributes:
        positions: ``[m]`` position ids of the continuation's positions (criteria stratify by them).
        memo: what criteria derive from a probe's readout, shared by every method that reads the same states
            (a dict keyed by the criterion, layer included), or None when nothing is shared.
    """

    positions: torch.Tensor
    memo: dict | None

    def run_to(self, probe: int, running: int) -> None:
        """Bring positions ``[0, running)`` to their hidden states after layer ``probe`` (1-based), for the calls at
        ``probe`` that follow; probes come in ascending order. A source that holds every state does nothing."""

    def estimate(self, k: int, probe: int, running: int) -> Estimate:
        """The method's estimate at its ``k``-th probe for positions ``[0, n)``, ``n >= running`` (a source that
        holds every position's state may give them all: criteria decide per row)."""

    def exit_scores(self, probe: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[lo, hi)`` read out at ``probe``: each target's log-probability ``[hi - lo]`` (float32) and
        whether it is the argmax ``[hi - lo]`` (:func:`target_scores`)."""


def target_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each row's target under ``log_softmax(logits)`` (fp32) and whether it is the row's argmax:
    ``[n, V]``, ``[n]`` → ``[n]`` float32, ``[n]`` bool."""
    logprob = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
    return logprob, logits.argmax(-1) == targets


@dataclass
class Exits:
    """Where each of ``m`` positions exited, how it scored its target there, and what it cost beyond its layers.

    Attributes:
        logprob: ``[m]`` the target's log-probability under the exit readout (float32).
        greedy: ``[m]`` whether the target is the exit readout's argmax.
        depth: ``[m]`` its exit layer.
        charged: ``[m]`` FLOPs of its probes and exit readout (float64).
    """

    logprob: torch.Tensor
    greedy: torch.Tensor
    depth: torch.Tensor
    charged: torch.Tensor


def estimated_probes(criterion, n_layers: int) -> list[int]:
    """The probes a criterion estimates under teacher forcing (every one it wants, the last excluded)."""
    probes = criterion.probes(n_layers)
    if not criterion.needs_estimate:
        return []
    return [p for k, p in enumerate(probes[:-1]) if criterion.wants_estimate(k, p)]


def monotone_exits(method, source: StateSource, targets: torch.Tensor, n_layers: int, cost: CostModel,
                   dtype: torch.dtype) -> Exits:
    """Exits of the continuation positions predicting ``targets`` ``[m]`` under ``method`` (monotone policy), from
    ``source``.

    Costs are charged as generation charges them: a probe for each position evaluated at that probe (later
    positions are capped by the first that passes, so the probe is paid up to it), and a readout for each exit
    the estimator did not already read out.
    """
    criterion, estimator = method.criterion, method.estimator
    probes = criterion.probes(n_layers)
    estimated = set(estimated_probes(criterion, n_layers))
    probe_flops, _ = estimator.probe_cost(cost)
    m, device = len(targets), targets.device
    logprob = torch.zeros(m, dtype=torch.float32)
    greedy = torch.zeros(m, dtype=torch.bool)
    depth = torch.zeros(m, dtype=torch.long)
    charged = torch.zeros(m, dtype=torch.float64)
    first_conf = torch.ones(m, device=device)
    criterion.begin(m)
    running = m
    for k, probe in enumerate(probes):
        if running == 0:
            break
        source.run_to(probe, running)
        first, passer = running, None  # first: the first position that passes here; passer: its exit scores
        if probe in estimated:
            est = source.estimate(k, probe, running)
            n = len(est.entropy)  # rows evaluated (>= running; only the first running count)
            if k == 0:
                first_conf[:n] = est.max_prob.float()
            view = ProbeView(probe, est.entropy, source.positions[:n], first_conf[:n], est.logits,
                             torch.arange(n, device=device), source.memo, running)
            criterion.observe(view)
            if probe >= criterion.min_exit_layer:
                hits = criterion.exits(view)[:running].nonzero()
                first = int(hits[0]) if len(hits) else running
            upto = min(first + 1, running)  # the positions this probe was paid for (later ones are capped)
            charged[:upto] += (est.cost[0][:upto] if est.cost is not None else probe_flops) + cost.translation(probe)[0]
            if first < running:
                logits = criterion.exit_logits(view)
                if logits is not None:
                    passer = target_scores(logits[first].to(dtype)[None], targets[first:first + 1])
                elif est.read_out:  # the probe's readout, kept apart by the source: the exit scores are its
                    passer = source.exit_scores(probe, first, first + 1)
        elif k == len(probes) - 1:
            first = 0
        if first < running:
            capped = first
            if passer is not None:  # the passer reads its token from the probe; later positions are capped
                logprob[first], greedy[first] = passer[0][0].cpu(), passer[1][0].cpu()
                capped = first + 1
            if capped < running:
                row_logprob, row_greedy = source.exit_scores(probe, capped, running)
                logprob[capped:running], greedy[capped:running] = row_logprob.cpu(), row_greedy.cpu()
                charged[capped:running] += cost.readout_at(probe)[0]
            depth[first:running] = probe
        running = first
    return Exits(logprob, greedy, depth, charged)


def first_scores(first_logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What scores a continuation's first token from the prompt's readout ``first_logits`` ``[V]``: its
    log-probabilities ``[V]`` (fp32) and its argmax (computed once for every continuation and method that read it)."""
    return torch.log_softmax(first_logits.float(), -1), int(first_logits.argmax())


def scored_from_exits(continuation: Sequence[int], first: tuple[torch.Tensor, int], depth0: int,
                      exits: Exits | None, cost: CostModel, n_prompt: int) -> Scored:
    """The :class:`Scored` of a continuation: its first token scored by ``first`` (:func:`first_scores` of the
    prompt's readout, charged one readout at ``depth0``), the others from ``exits``; each position's layers charged
    with the keys it attends (every earlier position ran at least as deep), and the full-depth cost of the same
    tokens."""
    first_logprobs, first_best = first
    logprobs = [float(first_logprobs[continuation[0]])]
    greedy = [first_best == continuation[0]]
    flops, full = cost.readout_at(depth0)[0], float(cost.readout_flops)
    if exits is None:  # a one-token continuation is read out of the prompt alone
        return Scored(logprobs, [depth0], flops, full, greedy=greedy)
    m = len(continuation) - 1
    logprobs += exits.logprob.tolist()
    greedy += exits.greedy.tolist()
    keys = torch.arange(n_prompt + 1, n_prompt + m + 1)  # [m] keys each attends (earlier positions ran as deep)
    depth = exits.depth.tolist()
    # every term is a whole number of FLOPs below 2^53, so these sums are exact in any order
    flops += float(layer_flops(cost, exits.depth, keys).sum() + exits.charged.sum())
    full += float(full_depth_flops(cost, n_prompt + 1, m))
    return Scored(logprobs, [depth0, *depth], flops, full, greedy=greedy)


def full_depth_flops(cost: CostModel, first_key: int, m: int) -> int:
    """FLOPs of ``m`` tokens at full depth, token ``i`` attending to ``first_key + i`` keys, with one exact readout
    each: :meth:`CostModel.full_depth`'s FLOPs summed, as an integer (exact)."""
    keys = m * first_key + m * (m - 1) // 2
    return m * (2 * sum(cost.layer_params) + cost.readout_flops) + 4 * cost.d_model * cost.n_layers * keys


def layer_flops(cost: CostModel, depth: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[m]`` FLOPs of layers 1..depth[i] for tokens attending to ``keys[i]`` keys (float64):
    ``Σ_{j<D} (2·params_j + 4·keys·d)``."""
    params = torch.tensor([0, *cost.layer_params], dtype=torch.float64).cumsum(0)  # [L + 1]
    depth = depth.long().cpu()
    return 2.0 * params[depth] + 4.0 * keys.double() * cost.d_model * depth.double()
