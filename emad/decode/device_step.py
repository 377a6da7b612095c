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

import torch

from emad.decode.step_state import (  # noqa: F401 - the step's pieces, importable from here
    CARRIED,
    CRITERION,
    DEPTH_CAP,
    LAST_PROBE,
    Plan,
    ProbeAt,
    ProbeShape,
    State,
    begin,
    record_of,
    settle,
)
from emad.engine.cost import CostModel
from emad.engine.segments import options_key, own_code
from emad.exits.batching import BATCH_EXITS
from emad.exits.policies import POLICIES


def uses_device_state(stack, method) -> bool:
    """Whether ``method`` decodes on ``stack`` with a :class:`DeviceStep` (its criterion, estimator and policy keep
    their state on the device, and the stack allows it); else the host step (:func:`emad.decode.step.step`)."""
    criterion, estimator = getattr(method, "criterion", None), getattr(method, "estimator", None)
    return (getattr(stack, "device_steps", True) and getattr(criterion, "on_device", False)
            and getattr(estimator, "fusable", False) and POLICIES.get(method.policy).on_device)


class DeviceStep:
    """One method's decode step over a cache's ``B`` rows, as a program over a :class:`State` (see the module
    docstring): :meth:`run` is one step, taken by an executor (:mod:`emad.engine.step_graphs`) that decides how
    ``when any row still runs`` is answered.

    On a compiled stack the program's pieces are compiled once per structure and shared: the reset and embedding
    and the finish by every program of equal probe count, and one settling per probe shape (:class:`ProbeShape`)
    for every probe of that shape and every method of its kind, its probe index a tensor (the layer, costs and the
    estimator's correction are read from tables at it, the readout's translator comes in as an argument). The
    values that differ between points (thresholds, τ − margin) are the tensors of :attr:`tables`, written per
    generation (:meth:`load`).

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
        self.estimator = method.estimator
        self.lanes, self.compile = lanes, compile
        self.view_id = id(getattr(lanes, "view", None))
        width = stack.head.weight.shape[1]
        self.state = State.empty(cache.batch_size, len(self.plan.probes), width, stack.vocab_size, stack.dtype,
                                 stack.device, logits=not lanes.compiled)
        self.tables = {name: t.clone() for name, t in method.criterion.tables(stack.n_layers, stack.device).items()}
        self.names = tuple(sorted(self.tables))
        lens = getattr(getattr(lanes, "view", stack), "lens", None)
        self.translators = [None if lens is None else lens.translators.get(p) for p in self.plan.probes]
        with torch.inference_mode(False):  # normal tensors: a captured step's guards see the same kind every time
            self.ks = [torch.tensor([k], device=stack.device) for k in range(len(self.plan.probes))]  # [1] each
        self.probe_tables = self.plan.tensors(stack.device)
        corrections = _corrections(method.estimator, stack, self.plan.probes)
        if corrections is not None:
            self.probe_tables["corrections"] = corrections
        self.executor = None  # made by the stepper on the first step (it may capture graphs)
        self.logits: torch.Tensor | None = None  # [B, V] the last step's exit readout (a graph's output: read it first)
        self._h: torch.Tensor | None = None

    @staticmethod
    def key_of(stack, method, cache, cost: CostModel) -> tuple:
        """What a program (its state, tables and graphs) is kept for: the plan, the criterion's structure, the
        estimator's options (its corrections are a table, loaded per generation), policy and batch exit rule, the
        batch and the cache's capacity."""
        return (Plan.of(method, stack.n_layers, cost), method.criterion.structure(stack.n_layers),
                options_key(method.estimator, corrections=False), method.policy, method.batch_exit,
                cache.batch_size, cache.capacity, stack.dtype)

    def load(self, method, policy, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Start a generation: every row decodes (:meth:`retire` stops some), from ``tokens`` ``[B]`` at positions
        ``positions`` ``[B]`` (device), capped as ``policy`` (the generation's) says, with ``method``'s tables."""
        st = self.state
        for name, values in method.criterion.tables(self.n_layers, st.token.device).items():
            self.tables[name].copy_(values)
        if "corrections" in self.probe_tables:
            self.probe_tables["corrections"].copy_(_corrections(method.estimator, self.lanes.stack,
                                                                self.plan.probes))
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

    def _call(self, key: tuple, make, *args):
        """``make()``'s function on ``args``: compiled once per ``key`` (each a code object of its own: dynamo counts
        recompiles per code object), or as it is."""
        if self.compile is None:
            return make()(*args)
        return self.compile(key, lambda: own_code(make(), f"emad_step_{key[0]}_{hash(key) & 0xFFFFFFFF:x}"), *args)

    def _block(self, k: int, h: torch.Tensor | None) -> torch.Tensor:
        """Layers up to the ``k``-th probe and its settling (block 0 first resets the step and embeds)."""
        st, lanes, plan = self.state, self.lanes, self.plan
        if k == 0:
            h = self._call(("begin", *self._shapes()), self._make_begin, *self.state)
        h = lanes.run(h, 0 if k == 0 else plan.probes[k - 1], plan.probes[k], st)
        self._settle(k, h)
        return lanes.keep(h)

    def _shapes(self) -> tuple:
        """What every compiled piece of the program specialises on: probes, rows, dtype, the view it reads."""
        return len(self.plan.probes), self.state.running.shape[0], self.state.exit_x.dtype, self.view_id

    def _settle(self, k: int, h: torch.Tensor) -> None:
        shape, translator = self.plan.shape(k), self.translators[k]
        if self.compile is None:
            correction = self.probe_tables["corrections"][k] if "corrections" in self.probe_tables else None
            settle(shape, self.plan.at(k, translator, correction), self.criterion, self.rule, self.lanes, h,
                   self.state, self.tables)
            return
        # a probe not estimated reads neither the criterion's tables nor the estimator's corrections: its settling
        # is the same for every method
        tables = self.tables if shape.estimates else {}
        per_probe = {n: t for n, t in self.probe_tables.items() if shape.estimates or n != "corrections"}
        kind = ((self.criterion.kind(), options_key(self.estimator, corrections=False))
                if shape.estimates else None)
        signature = tuple((n, tuple(t.shape), t.dtype) for n, t in sorted({**per_probe, **tables}.items()))
        key = ("settle", shape, kind, type(self.rule).__name__, translator is None, signature, *self._shapes())
        names = tuple(sorted(tables))
        self._call(key, lambda: self._make_settle(shape, tuple(per_probe), names), h, self.ks[k], translator,
                   *self.state, *per_probe.values(), *(tables[n] for n in names))

    def _finish(self) -> torch.Tensor:
        return self._call(("finish", self.policy.name, *self._shapes()), self._make_finish, *self.state)

    def _make_begin(self):
        lanes = self.lanes

        def begin_step(*tensors):
            st = State(*tensors)
            begin(st)
            return lanes.embed(st)

        return begin_step

    def _make_settle(self, shape: ProbeShape, probe_names: tuple[str, ...], names: tuple[str, ...]):
        criterion, rule, lanes, n = self.criterion, self.rule, self.lanes, len(State._fields)
        m = len(probe_names)

        def settle_probe(h, k, translator, *tensors):
            per_probe = dict(zip(probe_names, tensors[n:n + m]))
            costs, reads = per_probe["probe_costs"][k], per_probe["readout_costs"][k]  # [1, 2] each
            fit = per_probe["corrections"][k] if "corrections" in per_probe else None  # [1, 2]
            at = ProbeAt(k, per_probe["probe_layers"][k], (costs[:, 0], costs[:, 1]), (reads[:, 0], reads[:, 1]),
                         translator, None if fit is None else (fit[:, 0], fit[:, 1]))
            settle(shape, at, criterion, rule, lanes, h, State(*tensors[:n]), dict(zip(names, tensors[n + m:])))

        return settle_probe

    def _make_finish(self):
        lanes, policy = self.lanes, self.policy

        def finish_step(*tensors):
            st = State(*tensors)
            logits = lanes.finish(st)
            st.cap.copy_(policy.next_cap(st.cap, st.depth, st.live))
            return logits

        return finish_step


def _corrections(estimator, stack, probes) -> torch.Tensor | None:
    """The estimator's per-probe ``(slope, intercept)`` ``[P, 2]`` (identity where it has none), or None."""
    table = getattr(estimator, "correction_table", None)
    if table is None:
        return None
    with torch.inference_mode(False):
        return table(stack, probes).to(stack.device)


def rule_of(method):
    """The method's batch exit rule (an instance)."""
    return BATCH_EXITS.get(method.batch_exit)()
