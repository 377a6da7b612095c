"""A decode step whose state lives on the device: from its first segment to its token, nothing reads the device.

A method whose criterion tests each probe's estimate against tables (``Criterion.on_device``), whose estimator is a
pure function of the states (``Estimator.fusable``) and whose policy caps depth from the rows' depths alone
(``Policy.on_device``) decodes with a :class:`DeviceStep`: per row, whether it still runs, its depth, cap, first
allowed layer, exit reason, first-probe confidence, entropies ``[B, P]``, probe costs and exit state are tensors of
the batch's ``B`` cache rows, and each probe updates them with tensor operations (:func:`settle`) — the criterion's
test, the monotone cap and the batch exit rule included. The program of a step is

    begin (reset, embed) → block 0 → for k ≥ 1: when any row still runs: block k → finish (exit readout, caps)

where block k runs the layers up to probe k and settles it. How the ``when`` is taken is the executor's
(:mod:`emad.engine.step_graphs`): read on the host (``immediate``), a conditional node of one CUDA graph per token
(``graph-if``), or graphs per block launched one ahead of the decision they wait for (``graph-lookahead``).

Where the rows live is the lanes' (as for the host step, :mod:`emad.decode.lanes`): :class:`RowLanes` (the eager
engine) runs and probes only the rows that still run, picked on the host — the same numbers as the host step, on
a device where reading costs nothing; :class:`MaskLanes` (the compiled engine) runs every row through every block,
rows that left masked, so shapes never change and no block reads the device.

The host learns a step's outcome once, in one copy (tokens, depths, reasons, entropies, costs:
:func:`record_of`), which a generation reads one token late where it can (:mod:`emad.decode.generate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from emad.engine.cost import CostModel
from emad.engine.segments import options_key, own_code
from emad.exits.batching import BATCH_EXITS
from emad.exits.criteria import ProbeView
from emad.exits.policies import POLICIES

CARRIED, CRITERION, DEPTH_CAP, LAST_PROBE = 3, 0, 1, 2  # exit reason codes (decode.step.EXIT_REASONS)


def uses_device_state(stack, method) -> bool:
    """Whether ``method`` decodes on ``stack`` with a :class:`DeviceStep` (its criterion, estimator and policy keep
    their state on the device, and the stack allows it); else the host step (:func:`emad.decode.step.step`)."""
    criterion, estimator = getattr(method, "criterion", None), getattr(method, "estimator", None)
    return (getattr(stack, "device_steps", True) and getattr(criterion, "on_device", False)
            and getattr(estimator, "fusable", False) and POLICIES.get(method.policy).on_device)


@dataclass(frozen=True)
class Plan:
    """What a method's step does at each probe: Python constants, the same for every point of its kind.

    Attributes:
        probes: probe layers (1-based, ascending).
        estimates: per probe, whether it is estimated (the criterion looks at Ĥ there).
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

        def probe_cost(layer: int) -> tuple[float, float]:
            moved = cost.translation(layer)  # the readout's T_ℓ, read before the estimator's head rows
            return spent[0] + moved[0], spent[1] + moved[1]

        return cls(probes=probes,
                   estimates=tuple(criterion.needs_estimate and criterion.wants_estimate(k, p)
                                   for k, p in enumerate(probes)),
                   tests=tuple(p >= criterion.min_exit_layer for p in probes),
                   reads_every_exit=criterion.reads_every_exit,
                   probe_costs=tuple(probe_cost(p) for p in probes),
                   readout_costs=tuple(cost.readout_at(p) for p in probes))


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


def _add(into: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None, value: float) -> None:
    """``into[r] += value`` for the rows where ``mask`` ``[B]`` is True, in place (``rows`` as in :func:`_put`)."""
    if rows is None:
        into.copy_(torch.where(mask, into + value, into))
    else:
        into[rows] += value


def settle(plan: Plan, k: int, criterion, rule, lanes, h: torch.Tensor, st: State, tables: dict) -> None:
    """Settle the ``k``-th probe for the rows still running: estimate where the criterion looks, test, cap, let the
    batch exit rule pick who leaves, record their exits (depth, reason, exit state, costs) — in place, as tensor
    operations (on :class:`RowLanes`, the lanes' row picking reads the device).

    The decisions are those of the host step (:func:`emad.decode.step.step`) row for row: capped rows exit without a
    probe, rows the ``sync`` rule carries are not probed again (unless the criterion reads every exit), and a row
    that leaves takes the probe's readout where it was probed, else a readout at the layer (charged)."""
    layer, last = plan.probes[k], k == len(plan.probes) - 1
    running, ready = st.running, st.ready
    capped = running & (st.cap <= layer)  # [B]
    if plan.reads_every_exit:
        probing = running
    elif last:
        probing = torch.zeros_like(running)
    else:
        probing = running & ~(capped | ready)
    passed = torch.zeros_like(running)
    probe_logits, probed = None, None
    if plan.estimates[k]:
        found = lanes.estimate(h, layer, probing)
        if found is not None:
            est, probed = found  # est over the rows `probed` (None: every row)
            _add(st.flops, probing, probed, plan.probe_costs[k][0])
            _add(st.bytes, probing, probed, plan.probe_costs[k][1])
            if k == 0:
                _put(st.first_conf, probing, probed, est.max_prob.float())
            view = ProbeView(layer, est.entropy, lanes.pick(st.position, probed), lanes.pick(st.first_conf, probed),
                             est.logits, probed)
            if plan.tests[k]:
                exits = criterion.test(view, tables, k)  # [p]
                passed = probing & (exits if probed is None else lanes.spread(exits, probed, running))
            _put(st.entropies[:, k], probing, probed, est.entropy.float())
            probe_logits = criterion.exit_logits(view)
    allowed = running if last else running & (passed | capped | ready)
    st.allowed.copy_(torch.where(allowed & ~ready, layer, st.allowed))  # first allowed here
    leave = rule.leave(allowed, running)
    took = leave & probing if probe_logits is not None else torch.zeros_like(leave)
    read = leave & ~took  # rows read out afresh (charged a readout here)
    _add(st.flops, read, None, plan.readout_costs[k][0])
    _add(st.bytes, read, None, plan.readout_costs[k][1])
    lanes.exit(h, layer, leave, took, probed, probe_logits, st)
    st.depth.copy_(torch.where(leave, layer, st.depth))
    code = torch.where(ready, CARRIED, torch.where(passed, CRITERION, torch.where(capped, DEPTH_CAP, LAST_PROBE)))
    st.reason.copy_(torch.where(leave, code, st.reason))
    staying = running & ~leave
    st.running.copy_(staying)
    st.ready.copy_(allowed & staying)
    st.more[k + 1] = staying.any()


def record_of(st: State, tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """What the host learns of a step, as one ``[B, 7 + P]`` float64 tensor (one copy): per row its token,
    log-probability, depth, reason, first allowed layer, FLOPs and bytes of its probes and exit readout, and its
    entropies at the probes (NaN where not probed)."""
    columns = [tokens.double(), logprobs.double(), st.depth.double(), st.reason.double(), st.allowed.double(),
               st.flops, st.bytes]
    return torch.cat([torch.stack(columns, dim=1), st.entropies.double()], dim=1)


class DeviceStep:
    """One method's decode step over a cache's ``B`` rows, as a program over a :class:`State` (see the module
    docstring): :meth:`run` is one step, taken by an executor (:mod:`emad.engine.step_graphs`) that decides how
    ``when any row still runs`` is answered.

    On a compiled stack the program's pieces — reset and embedding, each probe's settling, the finish — are compiled
    once per kind of method (:meth:`key_of`, and the readout), shared by every point of the kind: the values that differ between
    points (thresholds, τ − margin) are the tensors of :attr:`tables`, written per generation (:meth:`load`).

    Args:
        stack: the reading stack (eager or compiled).
        method: the operating point (:func:`uses_device_state` must hold).
        cache: the generation's cache.
        cost: the stack's cost model.
        lanes: :class:`~emad.decode.lanes.RowLanes` or :class:`~emad.decode.lanes.MaskLanes`.
        compile: ``compile(key, make, *args)`` runs the function ``make()`` returns, compiled once per key (a
            compiled stack's :meth:`~emad.engine.compiled.SegmentRunner.call`); None runs it as it is.
    """

    def __init__(self, stack, method, cache, cost: CostModel, lanes, compile=None):
        self.plan = Plan.of(method, stack.n_layers, cost)
        self.n_layers = stack.n_layers
        self.criterion, self.rule, self.policy = method.criterion, rule_of(method), POLICIES.get(method.policy)
        self.lanes, self.compile = lanes, compile
        self.key = (*self.key_of(stack, method, cache, cost), id(getattr(lanes, "view", None)))
        width = stack.head.weight.shape[1]
        self.state = State.empty(cache.batch_size, len(self.plan.probes), width, stack.vocab_size, stack.dtype,
                                 stack.device, logits=not lanes.compiled)
        self.tables = {name: t.clone() for name, t in method.criterion.tables(stack.n_layers, stack.device).items()}
        self.names = tuple(sorted(self.tables))
        self.executor = None  # made by the stepper on the first step (it may capture graphs)
        self.logits: torch.Tensor | None = None  # [B, V] the last step's exit readout (a graph's output: read it first)
        self._h: torch.Tensor | None = None

    @staticmethod
    def key_of(stack, method, cache, cost: CostModel) -> tuple:
        """What the program's compiled pieces specialise on (besides the readout they read through): the plan, the
        criterion's structure, the estimator's options, policy and batch exit rule, the batch and the cache's
        capacity."""
        return (Plan.of(method, stack.n_layers, cost), method.criterion.structure(stack.n_layers),
                options_key(method.estimator), method.policy, method.batch_exit, cache.batch_size, cache.capacity,
                stack.dtype)

    def load(self, method, policy, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Start a generation: every row decodes (:meth:`retire` stops some), from ``tokens`` ``[B]`` at positions
        ``positions`` ``[B]`` (device), capped as ``policy`` (the generation's) says, with ``method``'s tables."""
        st = self.state
        for name, values in method.criterion.tables(self.n_layers, st.token.device).items():
            self.tables[name].copy_(values)
        st.token.copy_(tokens)
        st.position.copy_(positions)
        st.cap.copy_(policy.first_cap(st.cap.device))

    def run(self, ex) -> None:
        """One step: ``begin``, block 0, each later block when ``ex`` finds a row still running, ``finish``."""
        self._h = self._block(0, None)
        for k in range(1, len(self.plan.probes)):
            if not ex.when(self.state.more[k], lambda k=k: self._body(k)):
                break
        self.logits = self._finish()

    def capture_blocks(self, capture) -> list:
        """Every block as a graph of its own (``capture(fn, inputs, fixed)``, as
        :class:`~emad.engine.compiled._Graph`), each reading the states the one before left, then the finish:
        what the lookahead executor launches."""
        graphs = [capture(lambda: self._block(0, None), (), ())]
        for k in range(1, len(self.plan.probes)):
            graphs.append(capture(lambda k=k, h=graphs[-1].output: self._block(k, h), (), ()))
        graphs.append(capture(self._finish, (), ()))
        self.logits = graphs[-1].output
        return graphs

    def _body(self, k: int) -> None:
        self._h = self._block(k, self._h)

    def _call(self, name: str, make, *args):
        if self.compile is None:
            return make()(*args)
        key = (name, *self.key)  # each piece a code object of its own: dynamo counts recompiles per code object
        return self.compile(key, lambda: own_code(make(), f"emad_step_{name}_{hash(key) & 0xFFFFFFFF:x}"), *args)

    def _flat(self) -> tuple[torch.Tensor, ...]:
        return (*self.state, *(self.tables[n] for n in self.names))

    def _block(self, k: int, h: torch.Tensor | None) -> torch.Tensor:
        """Layers up to the ``k``-th probe and its settling (block 0 first resets the step and embeds)."""
        st, lanes, plan = self.state, self.lanes, self.plan
        if k == 0:
            h = self._call("begin", self._make_begin, *self.state)
        h = lanes.run(h, 0 if k == 0 else plan.probes[k - 1], plan.probes[k], st)
        self._call(f"settle{k}", lambda: self._make_settle(k), h, *self._flat())
        return lanes.keep(h)

    def _finish(self) -> torch.Tensor:
        return self._call("finish", self._make_finish, *self.state)

    def _make_begin(self):
        lanes = self.lanes

        def begin_step(*tensors):
            st = State(*tensors)
            begin(st)
            return lanes.embed(st)

        return begin_step

    def _make_settle(self, k: int):
        plan, criterion, rule, lanes, names, n = (self.plan, self.criterion, self.rule, self.lanes, self.names,
                                                  len(State._fields))

        def settle_probe(h, *tensors):
            settle(plan, k, criterion, rule, lanes, h, State(*tensors[:n]), dict(zip(names, tensors[n:])))

        return settle_probe

    def _make_finish(self):
        lanes, policy = self.lanes, self.policy

        def finish_step(*tensors):
            st = State(*tensors)
            logits = lanes.finish(st)
            st.cap.copy_(policy.next_cap(st.cap, st.depth, st.live))
            return logits

        return finish_step


def rule_of(method):
    """The method's batch exit rule (an instance)."""
    return BATCH_EXITS.get(method.batch_exit)()
