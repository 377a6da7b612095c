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

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from emad.decode.results import Scored
from emad.engine.cost import CostModel
from emad.exits.criteria import ProbeView
from emad.exits.estimators import Estimate


class StateSource(Protocol):
    """Hidden states, estimates and exit scores of the positions of one or more continuations at a probe.

    Attributes:
        positions: ``[N]`` position ids of the rows (criteria stratify by them).
        memo: what criteria derive from a probe's readout, shared by every method that reads the same states
            (a dict keyed by the criterion, layer included), or None when nothing is shared.
    """

    positions: torch.Tensor
    memo: dict | None

    def run_to(self, probe: int, live: torch.Tensor) -> None:
        """Bring the ``live`` rows (``[N]`` bool, each continuation's running prefix) to their hidden states after
        layer ``probe`` (1-based), for the calls at ``probe`` that follow; probes come in ascending order. A source
        that holds every state does nothing."""

    def estimate(self, k: int, probe: int, live: torch.Tensor) -> Estimate:
        """The method's estimate at its ``k``-th probe for rows ``[0, n)``, covering every ``live`` row (a source
        that holds every row's state may give them all: criteria decide per row)."""

    def exit_scores(self, probe: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` (``[r]`` long, ascending) read out at ``probe``: each target's log-probability ``[r]``
        (float32) and whether it is the argmax ``[r]`` (:func:`target_scores`)."""


def target_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each row's target under ``log_softmax(logits)`` (fp32) and whether it is the row's argmax:
    ``[n, V]``, ``[n]`` → ``[n]`` float32, ``[n]`` bool."""
    logprob = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
    return logprob, logits.argmax(-1) == targets


@dataclass
class Exits:
    """Where each of ``N`` rows exited, how it scored its target there, and what it cost beyond its layers.

    Attributes:
        logprob: ``[N]`` the target's log-probability under the exit readout (float32).
        greedy: ``[N]`` whether the target is the exit readout's argmax.
        depth: ``[N]`` its exit layer.
        charged: ``[N]`` FLOPs of its probes and exit readout (float64).
    """

    logprob: torch.Tensor
    greedy: torch.Tensor
    depth: torch.Tensor
    charged: torch.Tensor


class Segments:
    """The rows of several continuations laid end to end (a continuation's positions are one segment, in order).

    Attributes:
        lengths: ``[S]`` rows per segment (CPU, long).
        offsets: ``[S]`` each segment's first row.
        seg: ``[N]`` each row's segment.
        local: ``[N]`` each row's index within its segment.
    """

    def __init__(self, lengths: Sequence[int]):
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.long)  # [S]
        self.offsets = self.lengths.cumsum(0) - self.lengths  # [S]
        self.seg = torch.repeat_interleave(torch.arange(len(self.lengths)), self.lengths)  # [N]
        self.local = torch.arange(len(self.seg)) - self.offsets[self.seg]  # [N]

    def __len__(self) -> int:
        return len(self.seg)

    def first(self, hits: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """Each segment's first row of ``hits`` as a local index, ``running`` where none: ``hits`` ``[N]`` bool and
        ``running`` ``[S]`` → ``[S]``, or for several methods at once ``[M, N]`` and ``[M, S]`` → ``[M, S]``."""
        if hits.dim() == 1:
            rows = hits.nonzero()[:, 0]
            return running.clone().scatter_reduce_(0, self.seg[rows], self.local[rows], "amin")
        method, rows = hits.nonzero().unbind(1)
        at = method * running.shape[-1] + self.seg[rows]  # [h] each hit's (method, segment), flattened
        return running.flatten().scatter_reduce(0, at, self.local[rows], "amin").view_as(running)

    def below(self, bound: torch.Tensor) -> torch.Tensor:
        """Rows whose local index is below their segment's ``bound``: ``[S]`` → ``[N]`` bool, or ``[M, S]`` →
        ``[M, N]``."""
        return self.local < bound[..., self.seg]


class Need(NamedTuple):
    """What a method's walk (:func:`walk`) reads next: at ``probe``, in ``phase`` (:data:`ESTIMATE`: its estimate
    over the rows it still runs; :data:`EXIT`: the exit scores of the rows that exit there), for ``rows`` (``[N]``
    bool). A driver that holds many walks prepares each phase's reads for all of them at once."""

    probe: int
    phase: int
    rows: torch.Tensor


ESTIMATE, EXIT = 0, 1


def estimated_probes(criterion, n_layers: int) -> list[int]:
    """The probes a criterion estimates under teacher forcing (every one it wants, the last excluded)."""
    probes = criterion.probes(n_layers)
    if not criterion.needs_estimate:
        return []
    return [p for k, p in enumerate(probes[:-1]) if criterion.wants_estimate(k, p)]


def walk(methods: Sequence, source: StateSource, targets: torch.Tensor, n_layers: int, cost: CostModel,
         dtype: torch.dtype, segments: Segments | None = None) -> Generator[Need, None, list[Exits]]:
    """Exits of the rows predicting ``targets`` ``[N]`` under each of ``methods`` (monotone policy), from ``source``:
    a generator that yields a :class:`Need` before each read of the source and returns one :class:`Exits` per
    method.

    The methods walk together, their running prefixes, decisions and charges held as ``[M, ...]`` tensors: they
    must read the same probes through the same estimator, so that one estimate a probe serves them all
    (:func:`walk_key`; one method is the plain case). Each decides on its own rows with its own criterion, and
    reads exactly what it would read alone: a source gives a row the same value whichever rows are asked for.

    ``segments`` lays out several continuations' rows (None: one continuation). Each continuation runs as its own:
    at each probe its running prefix shrinks to its first row whose criterion passes (:mod:`module docstring
    <emad.decode.monotone>`). Costs are charged as generation charges them: a probe for each row evaluated at that
    probe (later rows are capped by the first that passes, so the probe is paid up to it), and a readout for each
    exit the estimator did not already read out.
    """
    criteria, estimator = [method.criterion for method in methods], methods[0].estimator
    probes = criteria[0].probes(n_layers)
    estimated = set(estimated_probes(criteria[0], n_layers))
    probe_flops, _ = estimator.probe_cost(cost)
    segments = segments or Segments([len(targets)])
    m_count, n_rows, device = len(methods), len(targets), targets.device
    logprob = torch.zeros(m_count, n_rows, dtype=torch.float32)
    greedy = torch.zeros(m_count, n_rows, dtype=torch.bool)
    depth = torch.zeros(m_count, n_rows, dtype=torch.long)
    charged = torch.zeros(m_count, n_rows, dtype=torch.float64)
    first_conf = torch.ones(n_rows, device=device)
    for criterion in criteria:
        criterion.begin(n_rows)
    running = segments.lengths.repeat(m_count, 1)  # [M, S] each method's running prefix of each continuation
    for k, probe in enumerate(probes):
        if not bool(running.any()):
            break
        live = segments.below(running)  # [M, N]
        union = live.any(0)  # [N] rows some method still runs
        source.run_to(probe, union)
        first, passer, own = running, None, None
        if probe in estimated:
            yield Need(probe, ESTIMATE, union)
            est = source.estimate(k, probe, union)
            n = len(est.entropy)  # rows evaluated (every live one; the others are never read)
            if k == 0:
                first_conf[:n] = est.max_prob.float()
            hits, views = torch.zeros(m_count, n, dtype=torch.bool), []
            positions, conf, index = source.positions[:n], first_conf[:n], torch.arange(n, device=device)
            running_rows = None if source.memo is None else live[:, :n].to(device)  # [M, n]
            for j, criterion in enumerate(criteria):
                view = ProbeView(probe, est.entropy, positions, conf, est.logits, index, source.memo,
                                 None if running_rows is None else running_rows[j])
                criterion.observe(view)
                if probe >= criterion.min_exit_layer:
                    hits[j] = criterion.exits(view)[:n].cpu()
                views.append(view)
            first = segments.first(hits & live[:, :n], running)  # [M, S]
            paid = segments.below(torch.minimum(first + 1, running))  # [M, N] rows this probe was paid for
            if est.cost is not None:
                charged[:, :n][paid[:, :n]] += est.cost[0].expand(m_count, n)[paid[:, :n]] + cost.translation(probe)[0]
            else:
                charged[paid] += probe_flops + cost.translation(probe)[0]
            exiting = first < running  # [M, S]
            if bool(exiting.any()):
                passer, own = _passers(criteria, views, est, exiting, first, segments, targets, dtype,
                                       logprob, greedy)
        elif k == len(probes) - 1:
            first = torch.zeros_like(running)
        exiting = live & ~segments.below(first)  # [M, N] rows that exit here
        if bool(exiting.any()):
            read, pay = exiting.clone(), exiting.clone()
            if passer is not None:
                pay &= ~passer  # a passer's readout was its probe
                read &= ~(passer & own[:, None])  # one that read its token from its own logits is scored
            wanted = read.any(0)
            if bool(wanted.any()):
                yield Need(probe, EXIT, wanted)
                rows = wanted.nonzero()[:, 0]
                row_logprob, row_greedy = source.exit_scores(probe, rows.to(device))
                every_logprob = torch.zeros(n_rows, dtype=torch.float32)
                every_greedy = torch.zeros(n_rows, dtype=torch.bool)
                every_logprob[rows], every_greedy[rows] = row_logprob.cpu(), row_greedy.cpu()
                logprob = torch.where(read, every_logprob, logprob)
                greedy = torch.where(read, every_greedy, greedy)
            charged[pay] += cost.readout_at(probe)[0]
            depth[exiting] = probe
        running = first
    return [Exits(logprob[j], greedy[j], depth[j], charged[j]) for j in range(m_count)]


def _passers(criteria, views, est, exiting: torch.Tensor, first: torch.Tensor, segments: Segments,
             targets: torch.Tensor, dtype: torch.dtype, logprob: torch.Tensor, greedy: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The passers of an estimated probe (each exiting continuation's first passing row) whose exit needs no readout
    of its own, ``[M, N]`` bool, and per method ``[M]`` whether its passers read their token from logits of their
    own (:meth:`~emad.exits.criteria.Criterion.exit_logits`: scored here into ``logprob`` and ``greedy``) rather
    than from the probe's readout. A method whose estimator read nothing out has no such passers."""
    method, segment = exiting.nonzero().unbind(1)
    passer = torch.zeros(exiting.shape[0], len(segments), dtype=torch.bool)
    passer[method, segments.offsets[segment] + first[method, segment]] = True
    own = torch.zeros(exiting.shape[0], dtype=torch.bool)
    for j in exiting.any(1).nonzero()[:, 0].tolist():
        if criteria[j].tokens_from_readout and est.read_out:
            continue  # the probe's readout (kept apart by the source) scores the passer
        logits = criteria[j].exit_logits(views[j])
        if logits is not None:  # the passer reads its token from the probe; later rows are capped
            rows = passer[j].nonzero()[:, 0]
            device_rows = rows.to(targets.device)
            scores = target_scores(logits[device_rows].to(dtype), targets[device_rows])
            logprob[j, rows], greedy[j, rows] = scores[0].cpu(), scores[1].cpu()
            own[j] = True
        elif not est.read_out:
            passer[j] = False  # nothing read out: every exit reads its scores
    return passer, own


def walk_key(method, n_layers: int, readout_key, estimator_key) -> tuple | None:
    """What methods that :func:`walk` together share (their probes, estimated probes, criterion class, readout and
    estimator keys), or None for a method that walks alone: a criterion whose test keeps no state across probes
    (``on_device``), with an estimator that keeps none either."""
    criterion, estimator = method.criterion, method.estimator
    if not criterion.on_device or estimator.stateful:
        return None
    return (type(criterion).__name__, tuple(criterion.probes(n_layers)),
            tuple(estimated_probes(criterion, n_layers)), readout_key, estimator_key)


def monotone_exits(method, source: StateSource, targets: torch.Tensor, n_layers: int, cost: CostModel,
                   dtype: torch.dtype, segments: Segments | None = None) -> Exits:
    """:func:`walk` of one method, run alone (the source reads what it needs when asked)."""
    steps = walk([method], source, targets, n_layers, cost, dtype, segments)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value[0]


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
