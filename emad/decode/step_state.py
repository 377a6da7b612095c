"""The tensors of a device step and the operations that settle a probe (:mod:`emad.decode.device_step` runs them).

:class:`Plan` holds what a method's step does at each probe as Python constants; :class:`State` the per-row tensors
of one step on the device; :func:`settle` updates them at one probe with tensor operations only — the criterion's
test, the monotone cap and the batch exit rule included — from a probe's shape (:class:`ProbeShape`, what compiled
code specialises on) and its values (:class:`ProbeAt`: Python numbers, or tensors read at a probe index so that one
compiled settling serves every probe of its shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from emad.engine.cost import CostModel
from emad.exits.criteria import ProbeView

CARRIED, CRITERION, DEPTH_CAP, LAST_PROBE = 3, 0, 1, 2  # exit reason codes (decode.step.EXIT_REASONS)


@dataclass(frozen=True)
class Plan:
    """What a method's step does at each probe: Python constants, the same for every point of its kind.

    Attributes:
        probes: probe layers (1-based, ascending).
        estimates: per probe, whether it is estimated (the criterion looks at Ĥ there; the last probe only where
            the criterion reads every exit: elsewhere every row still running leaves there whatever Ĥ says).
        tests: per probe, whether the criterion may exit there (at or above its minimum exit layer).
        reads_every_exit: the criterion probes every running row, the last probe included.
        probe_costs: per probe, ``(FLOPs, bytes)`` of one row's probe (estimator and translation).
        readout_costs: per probe, ``(FLOPs, bytes)`` of an exit readout there.
    """

    probes: tuple[int, ...]
    estimates: tuple[bool, ...]
    tests: tuple[bool, ...]
    reads_every_exit: bool
    probe_costs: tuple[tuple[float, float], ...]
    readout_costs: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, method, n_layers: int, cost: CostModel) -> Plan:
        criterion, estimator = method.criterion, method.estimator
        probes = tuple(criterion.probes(n_layers))
        spent = estimator.probe_cost(cost)
        every = criterion.reads_every_exit

        def probe_cost(layer: int) -> tuple[float, float]:
            moved = cost.translation(layer)  # the readout's T_ℓ, read before the estimator's head rows
            return spent[0] + moved[0], spent[1] + moved[1]

        return cls(probes=probes,
                   estimates=tuple(criterion.needs_estimate and criterion.wants_estimate(k, p)
                                   and (every or k < len(probes) - 1) for k, p in enumerate(probes)),
                   tests=tuple(p >= criterion.min_exit_layer for p in probes),
                   reads_every_exit=every,
                   probe_costs=tuple(probe_cost(p) for p in probes),
                   readout_costs=tuple(cost.readout_at(p) for p in probes))

    def shape(self, k: int) -> ProbeShape:
        """The Python constants of the ``k``-th probe's settling (what its compiled code specialises on)."""
        return ProbeShape(first=k == 0, last=k == len(self.probes) - 1, estimates=self.estimates[k],
                          tests=self.tests[k], reads_every_exit=self.reads_every_exit)

    def tensors(self, device) -> dict[str, torch.Tensor]:
        """The per-probe values a compiled settling reads at its probe index: ``probe_layers`` ``[P]`` long,
        ``probe_costs`` and ``readout_costs`` ``[P, 2]`` float64 (FLOPs, bytes)."""
        with torch.inference_mode(False):
            return {"probe_layers": torch.tensor(self.probes, dtype=torch.long, device=device),
                    "probe_costs": torch.tensor(self.probe_costs, dtype=torch.float64, device=device),
                    "readout_costs": torch.tensor(self.readout_costs, dtype=torch.float64, device=device)}

    def at(self, k: int, translator=None, correction=None) -> ProbeAt:
        """The ``k``-th probe's values as Python numbers (a step that runs as it is, uncompiled)."""
        return ProbeAt(k, self.probes[k], self.probe_costs[k], self.readout_costs[k], translator, correction)


class ProbeShape(NamedTuple):
    """What one probe's settling is, besides its values: the first probe (its confidence is kept), the last (every
    row still running leaves), estimated, tested, and whether the criterion reads every exit. Probes equal in it
    (of methods equal in kind) share one compiled settling."""

    first: bool
    last: bool
    estimates: bool
    tests: bool
    reads_every_exit: bool


class ProbeAt(NamedTuple):
    """The values of one probe: Python numbers in a step that runs as it is, ``[1]`` tensors read from the plan's
    tables at a probe index ``[1]`` inside a compiled settling (so one compiled function serves every probe of its
    shape; an index of one element, not 0-d, so that indexing with it is a tensor operation, not a read).

    Attributes:
        k: the probe's index; layer: its layer (1-based).
        probe_cost, readout_cost: ``(FLOPs, bytes)`` of one row's probe, and of an exit readout there.
        translator: the readout's translator T_ℓ at the layer (None: the identity).
        correction: the estimator's ``(slope, intercept)`` at the layer (None: none).
    """

    k: int | torch.Tensor
    layer: int | torch.Tensor
    probe_cost: tuple
    readout_cost: tuple
    translator: object = None
    correction: object = None


class State(NamedTuple):
    """The tensors of a device step (made once per program: a captured graph reads them where they lie).

    Inputs, kept from step to step: ``token`` ``[B]`` long (each row's last token), ``position`` ``[B]`` long (its
    position id), ``live`` ``[B]`` bool (rows being decoded), ``cap`` ``[B]`` long (the policy's depth cap).
    Per step: ``running`` / ``ready`` ``[B]`` bool (still runs / may exit at an earlier probe), ``depth``,
    ``reason``, ``allowed`` ``[B]`` long, ``first_conf`` ``[B]`` float32, ``entropies`` ``[B, P]`` float32 (NaN where
    not probed), ``flops`` / ``bytes`` ``[B]`` float64 (probes and exit readout), ``more`` ``[P + 1]`` bool (entry
    k: a row still runs before block k), ``exit_x`` ``[B, d]`` (the head's input at each row's exit: masked lanes),
    ``logits`` ``[B, V]`` (the exit readout: row lanes).
    """

    token: torch.Tensor
    position: torch.Tensor
    live: torch.Tensor
    cap: torch.Tensor
    running: torch.Tensor
    ready: torch.Tensor
    depth: torch.Tensor
    reason: torch.Tensor
    allowed: torch.Tensor
    first_conf: torch.Tensor
    entropies: torch.Tensor
    flops: torch.Tensor
    bytes: torch.Tensor
    more: torch.Tensor
    exit_x: torch.Tensor
    logits: torch.Tensor

    @classmethod
    def empty(cls, batch: int, probes: int, width: int, vocab: int, dtype, device, logits: bool) -> State:
        """Zeroed tensors for ``batch`` rows and ``probes`` probes (``logits``: room for a ``[B, V]`` readout)."""
        with torch.inference_mode(False):  # normal tensors: a captured step's guards see the same kind every time
            long = dict(dtype=torch.long, device=device)
            flag = dict(dtype=torch.bool, device=device)
            return cls(torch.zeros(batch, **long), torch.zeros(batch, **long), torch.zeros(batch, **flag),
                       torch.zeros(batch, **long), torch.zeros(batch, **flag), torch.zeros(batch, **flag),
                       torch.zeros(batch, **long), torch.zeros(batch, **long), torch.zeros(batch, **long),
                       torch.ones(batch, dtype=torch.float32, device=device),
                       torch.full((batch, probes), math.nan, dtype=torch.float32, device=device),
                       torch.zeros(batch, dtype=torch.float64, device=device),
                       torch.zeros(batch, dtype=torch.float64, device=device), torch.zeros(probes + 1, **flag),
                       torch.zeros(batch, width, dtype=dtype, device=device),
                       torch.zeros(batch if logits else 0, vocab, dtype=dtype, device=device))


def begin(st: State) -> None:
    """Reset the per-step state: every live row runs, nothing decided yet."""
    st.running.copy_(st.live)
    st.ready.zero_()
    st.depth.zero_()
    st.reason.zero_()
    st.allowed.zero_()
    st.first_conf.fill_(1.0)
    st.entropies.fill_(math.nan)
    st.flops.zero_()
    st.bytes.zero_()
    st.more.zero_()


def _put(into: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None, values) -> None:
    """``into[r] = values`` for the rows where ``mask`` ``[B]`` is True, in place; ``values`` are given for every row
    (``rows`` None) or for ``rows`` (the True entries of ``mask``, in order)."""
    if rows is None:
        into.copy_(torch.where(mask, values, into))
    else:
        into[rows] = values


def _put_column(into: torch.Tensor, k, mask: torch.Tensor, rows: torch.Tensor | None, values) -> None:
    """``into[r, k] = values`` ``[B, P]`` as :func:`_put` does for a column (``k`` an int or a ``[1]`` tensor)."""
    if rows is None:
        column = torch.arange(into.shape[1], device=into.device) == k  # [P]
        into.copy_(torch.where(mask[:, None] & column, values[:, None], into))
    else:
        into[rows, k] = values


def _add(into: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None, value) -> None:
    """``into[r] += value`` for the rows where ``mask`` ``[B]`` is True, in place (``rows`` as in :func:`_put`)."""
    if rows is None:
        into.copy_(torch.where(mask, into + value, into))
    else:
        into[rows] += value


def settle(shape: ProbeShape, at: ProbeAt, criterion, rule, lanes, h: torch.Tensor, st: State,
           tables: dict) -> None:
    """Settle a probe for the rows still running: estimate where the criterion looks, test, cap, let the batch exit
    rule pick who leaves, record their exits (depth, reason, exit state, costs) — in place, as tensor operations (on
    :class:`RowLanes`, the lanes' row picking reads the device).

    The decisions are those of the host step (:func:`emad.decode.step.step`) row for row: capped rows exit without a
    probe, rows the ``sync`` rule carries are not probed again (unless the criterion reads every exit), and a row
    that leaves takes the probe's readout where it was probed, else a readout at the layer (charged). A probe does
    what its estimator needs and no more: the head's input (final norm of T_ℓ(h)) once, shared by the estimate and
    the exit, and the NaN/inf check read from the entropy the estimate computed.

    Args:
        shape: the probe's constants (:meth:`Plan.shape`); at: its values (:class:`ProbeAt`).
        h: the states after the probe's layer; st: the step's state; tables: the criterion's (:meth:`load`).
    """
    layer, k = at.layer, at.k
    running, ready = st.running, st.ready
    capped = running & (st.cap <= layer)  # [B]
    if shape.reads_every_exit:
        probing = running
    elif shape.last:
        probing = torch.zeros_like(running)
    else:
        probing = running & ~(capped | ready)
    passed = torch.zeros_like(running)
    probe_logits, probed = None, None
    x = lanes.head_input(h, at)  # [B, d] every row's head input (masked lanes), or None
    if shape.estimates:
        found = lanes.estimate(h, x, at, probing)
        if found is not None:
            est, probed = found  # est over the rows `probed` (None: every row)
            _add(st.flops, probing, probed, at.probe_cost[0])
            _add(st.bytes, probing, probed, at.probe_cost[1])
            if shape.first:
                _put(st.first_conf, probing, probed, est.max_prob.float())
            view = ProbeView(layer, est.entropy, lanes.pick(st.position, probed), lanes.pick(st.first_conf, probed),
                             est.logits, probed)
            if shape.tests:
                exits = criterion.test(view, tables, k)  # [p]
                passed = probing & (exits if probed is None else lanes.spread(exits, probed, running))
            _put_column(st.entropies, k, probing, probed, est.entropy.float())
            probe_logits = criterion.exit_logits(view)
    allowed = running if shape.last else running & (passed | capped | ready)
    st.allowed.copy_(torch.where(allowed & ~ready, layer, st.allowed))  # first allowed here
    leave = rule.leave(allowed, running)
    took = leave & probing if probe_logits is not None else torch.zeros_like(leave)
    read = leave & ~took  # rows read out afresh (charged a readout here)
    _add(st.flops, read, None, at.readout_cost[0])
    _add(st.bytes, read, None, at.readout_cost[1])
    lanes.exit(h, x, at, leave, took, probed, probe_logits, st)
    st.depth.copy_(torch.where(leave, layer, st.depth))
    code = torch.where(ready, CARRIED, torch.where(passed, CRITERION, torch.where(capped, DEPTH_CAP, LAST_PROBE)))
    st.reason.copy_(torch.where(leave, code, st.reason))
    staying = running & ~leave
    st.running.copy_(staying)
    st.ready.copy_(allowed & staying)
    after = torch.arange(st.more.shape[0], device=st.more.device) == k + 1  # [P + 1]
    st.more.copy_(torch.where(after, staying.any(), st.more))


def record_of(st: State, tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """What the host learns of a step, as one ``[B, 7 + P]`` float64 tensor (one copy): per row its token,
    log-probability, depth, reason, first allowed layer, FLOPs and bytes of its probes and exit readout, and its
    entropies at the probes (NaN where not probed)."""
    columns = [tokens.double(), logprobs.double(), st.depth.double(), st.reason.double(), st.allowed.double(),
               st.flops, st.bytes]
    return torch.cat([torch.stack(columns, dim=1), st.entropies.double()], dim=1)
