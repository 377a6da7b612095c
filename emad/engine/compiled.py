"""The compiled layer stack: the layers between two probes as one compiled function over a static KV cache, replayed
as a CUDA graph on CUDA.

A decode step runs its token through segments of layers ``[start, stop)`` (from one probe to the next). On a
:class:`CompiledStack` each segment is a static-shape function of every cache row — hidden states ``[B, 1, d]``,
position ids ``[B, 1]``, the slot as a device tensor ``[1]``, a running mask ``[B]`` — compiled once with
``torch.compile(fullgraph=True)``; rows that do not run (they exited, or finished) ride along masked: their K/V and
validity are left as they were, so a batch never changes shape inside a step. Attention always sees the whole
static buffer ``[B, H_kv, S, d_head]`` under a validity mask ``[B, 1, 1, S]``. On CUDA each segment is captured once
per slab (:mod:`emad.engine.static_cache`) as a CUDA graph and replayed: inputs are copied into the graph's own
tensors, and its output is overwritten by the next replay of the same segment (a step consumes it first).

Everything else — prefill, scattered or partial-row writes (backfill, copy), scoring — runs the HF layers eagerly on
the same static cache, so every policy, estimator and criterion works unchanged. Compiled functions are kept per
model, segment, batch size, capacity and dtype for the life of the process (:class:`SegmentRunner`), so a stage
compiles each layout once and every later point reuses it. Each segment is a function of its own (its own code
object), so dynamo's per-function recompile limit is never shared between segments.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections import OrderedDict
from contextlib import contextmanager

import torch

from emad.engine.cache import KVCache, Slots
from emad.engine.graph_capture import CompileStats, _Graph  # noqa: F401 - _Graph: what tests and benchmarks subclass
from emad.engine.segments import (
    estimate_function,
    estimator_signature,
    options_key,
    readout_function,
    segment_function,
    segment_kinds,
)
from emad.engine.stack import LayerStack
from emad.engine.static_cache import Slab, StaticKVCache
from emad.engine.step_graphs import Always, Immediate, Lookahead, OneGraph, StepGraph, if_nodes_available

CAPACITY_STEP = 128  # static caches are made in multiples of this many slots, so prompts of similar length share


class SegmentRunner:
    """The compiled segments and probe estimates of one model (shared by every view of its stack), made on first use
    and kept.

    Args:
        stack: a view of the model (its layers, adapter and rotary tables are the model's).
        backend: ``torch.compile`` backend (``inductor``).
        graphs: capture CUDA graphs (default: on CUDA).

    Attributes:
        capture: what captures a function and replays it (:class:`_Graph`: a CUDA graph).
        capture_step: what captures a device step's whole program with conditional nodes
            (:class:`~emad.engine.step_graphs.StepGraph`).
        nonfinite: a device flag set by readouts whose NaN/inf check is deferred (compiled probes, and every readout
            of a compiled view inside :meth:`CompiledStack.finite_checks_deferred`).
        programs: device step programs (:class:`~emad.decode.device_step.DeviceStep`) kept per kind of method,
            batch, capacity, readout and slab, with their graphs.
    """

    GRAPHS_PER_ESTIMATE = 32  # captured probe graphs kept per (estimator kind, layer, shape): the points of a block

    def __init__(self, stack: LayerStack, backend: str = "inductor", graphs: bool | None = None):
        self.stack = stack
        self.backend = backend
        self.graphs = stack.device.type == "cuda" if graphs is None else graphs
        self.capture = _Graph
        self.capture_step = StepGraph
        self.programs: dict[tuple, object] = {}
        self.functions: dict[tuple, object] = {}
        self.captured: dict[tuple, _Graph] = {}
        self.estimates: dict[tuple, OrderedDict] = {}  # probe key -> estimator id -> (estimator, graph)
        self.slabs: dict[tuple[int, int], Slab] = {}
        self.views: dict[tuple, LayerStack] = {}
        self.stats = CompileStats()
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=stack.device)
        self.deferring = False
        self._pool = None
        self._ready = weakref.WeakKeyDictionary()  # estimators whose lazy tensors are made -> their signature
        self._called: set[tuple] = set()  # keys of the functions called (compiled) once
        self.if_failed: str | None = None  # why a capture with conditional nodes failed (then: lookahead)
        self._layer_tuples: dict[tuple[int, int], tuple] = {}

    def slab(self, batch_size: int, capacity: int) -> Slab | None:
        """A free slab of ``batch_size`` rows and at least ``capacity`` slots: the largest there is, so that once a
        long generation has compiled a layout every shorter one reuses it; made when none is free and fits."""
        for attempt in range(2):
            fits = [s for (b, c), s in self.slabs.items() if b == batch_size and c >= capacity and s.free]
            if fits:
                return max(fits, key=lambda s: s.valid.shape[-1])
            if (batch_size, capacity) not in self.slabs:
                break
            if attempt == 0:  # lent: perhaps to a cache that only a reference cycle keeps (an exception's frames)
                gc.collect()
        if (batch_size, capacity) in self.slabs:  # the slab of this shape is lent: the cache gets tensors of its own
            return None
        self.slabs[(batch_size, capacity)] = Slab.empty(self.stack.n_layers, batch_size, capacity, self.stack.device)
        return self.slabs[(batch_size, capacity)]

    def run(self, start: int, stop: int, h: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
            running: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """:func:`masked_segment` of layers ``[start, stop)``, compiled (and replayed as a graph on a slab)."""
        batch, capacity = cache.batch_size, cache.capacity
        fixed = (*self._segment_tensors(start, stop, cache), self._layers(start, stop))
        inputs = (h, positions, slot, running)
        fn, key = self._segment_fn(start, stop, cache, inputs)
        if key not in self._called:
            return self.call(key, lambda: fn, *inputs, *fixed)
        if not self.graphs or self.slabs.get((batch, capacity)) is not cache.slab:  # graphs on own slabs only
            with torch.compiler.set_stance("fail_on_recompile"):
                return fn(*inputs, *fixed)
        graph_key = (id(cache.slab), start, stop, batch, capacity, h.dtype)
        graph = self.captured.get(graph_key)
        if graph is None:
            graph = self.captured[graph_key] = self._capture(fn, inputs, fixed)
        return graph(*inputs)

    def call(self, key: tuple, make, *args):
        """``make()`` compiled once per ``key`` and called on ``args`` (the first call compiles, counted; later calls
        may not recompile)."""
        fn = self.functions.get(key)
        if fn is None:
            fn = self._compile(key, make())
        if key not in self._called:
            began = time.perf_counter()
            out = fn(*args)
            self._called.add(key)
            self._count(began, key, compiled=True)
            return out
        with torch.compiler.set_stance("fail_on_recompile"):
            return fn(*args)

    def segment(self, start: int, stop: int, h: torch.Tensor, positions: torch.Tensor, running: torch.Tensor,
                cache: StaticKVCache) -> torch.Tensor:
        """:func:`masked_segment` of layers ``[start, stop)`` over every row of ``cache``, compiled (never a graph of
        its own: a device step captures it inside its own graphs); the slot is the slab's."""
        inputs = (h, positions, cache.slab.slot, running)
        fn, key = self._segment_fn(start, stop, cache, inputs)
        return self.call(key, lambda: fn, *inputs, *self._segment_tensors(start, stop, cache),
                         self._layers(start, stop))

    def _segment_fn(self, start: int, stop: int, cache: StaticKVCache, inputs: tuple) -> tuple:
        """The compiled segment function of layers ``[start, stop)``'s structure (:func:`segment_kinds`) on
        ``cache``'s shapes, and its key: one per structure, shared by the segments of that structure at any depth
        (and per kind of ``inputs``: inference tensors or not, which the guards tell apart)."""
        kinds = segment_kinds(self.stack, start, stop)
        dtype = inputs[0].dtype
        key = ("segment", kinds, cache.batch_size, cache.capacity, dtype, tuple(x.is_inference() for x in inputs))
        fn = self.functions.get(key)
        if fn is None:
            name = f"emad_segment_{stop - start}_b{cache.batch_size}_s{cache.capacity}_{str(dtype).split('.')[-1]}"
            fn = self._compile(key, segment_function(self.stack, kinds, f"{name}_{len(self.functions)}"))
        return fn, key

    @staticmethod
    def _segment_tensors(start: int, stop: int, cache: StaticKVCache) -> tuple:
        return cache.keys[start:stop], cache.values[start:stop], cache.valid[start:stop], cache.real

    def _layers(self, start: int, stop: int) -> tuple:
        """The decoder layers ``[start, stop)`` as a tuple (an argument of a segment function)."""
        found = self._layer_tuples.get((start, stop))
        if found is None:
            found = self._layer_tuples[(start, stop)] = tuple(self.stack.layers[start:stop])
        return found

    def graphs_serve(self, cache) -> bool:
        """Whether steps on ``cache`` replay graphs: graphs are on and the cache is on this runner's own slab."""
        return (self.graphs and isinstance(cache, StaticKVCache)
                and self.slabs.get((cache.batch_size, cache.capacity)) is cache.slab)

    def estimate(self, lens, estimator, layer: int, h: torch.Tensor) -> tuple:
        """``estimator``'s estimate at ``layer`` of every row's state ``h`` ``[B, d]``, read out through ``lens``
        (None: the logit lens): ``(entropy [B], max_prob [B], logits [B, V] or None)``, compiled (a graph per
        estimator on CUDA). Its NaN/inf check goes to :attr:`nonfinite` (read at once unless deferred)."""
        view = self._view(lens)
        signature = self._ready.get(estimator)
        if signature is None:  # eagerly once: shortlists and factorisations are made outside the graph
            estimator.estimate(view, h[:1], layer)
            signature = self._ready[estimator] = estimator_signature(estimator)
        key = ("estimate", signature, layer, *h.shape, h.dtype, id(view))
        fn = self.functions.get(key)
        if fn is None:
            name = f"emad_estimate_{type(estimator).__name__.lower()}_{layer}_b{h.shape[0]}_{len(self.functions)}"
            fn = self._compile(key, estimate_function(view, layer, name))
            began = time.perf_counter()
            out = fn(h, estimator)
            self._count(began, key, compiled=True)
        elif not self.graphs:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = fn(h, estimator)
        else:  # a graph per estimator of equal options (their tensors are equal): new points reuse it
            kept = self.estimates.setdefault(key, OrderedDict())
            options = options_key(estimator)
            if options not in kept:
                kept[options] = (estimator, self._capture(fn, (h,), (estimator,)))  # the estimator kept alive
                if len(kept) > self.GRAPHS_PER_ESTIMATE:
                    kept.popitem(last=False)
            kept.move_to_end(options)
            out = kept[options][1](h)
        if not self.deferring and bool(self.nonfinite):
            self.nonfinite.zero_()
            view._refuse_non_finite()
        return out

    def readout(self, lens, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The readout at ``layer`` of every row's state ``h`` ``[B, d]`` through ``lens``: ``[B, V]``, compiled
        (a graph on CUDA), its NaN/inf check as in :meth:`estimate`."""
        view = self._view(lens)
        key = ("readout", layer, *h.shape, h.dtype, id(view))
        fn = self.functions.get(key)
        if fn is None:
            fn = self._compile(key, readout_function(view, layer, f"emad_readout_{layer}_b{h.shape[0]}_"
                                                                    f"{len(self.functions)}"))
            began = time.perf_counter()
            out = fn(h)
            self._count(began, key, compiled=True)
        elif not self.graphs:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = fn(h)
        else:
            if key not in self.captured:
                self.captured[key] = self._capture(fn, (h,), ())
            out = self.captured[key](h)
        if not self.deferring and bool(self.nonfinite):
            self.nonfinite.zero_()
            view._refuse_non_finite()
        return out

    def _view(self, lens) -> LayerStack:
        """A plain view of the model reading out through ``lens`` whose readouts flag NaN/inf in
        :attr:`nonfinite` (one per set of translators, so compiled probes keep finding the same one)."""
        key = () if lens is None else tuple(id(t) for t in lens.translators.values())
        if key not in self.views:
            view = LayerStack.with_readout(self.stack, lens)
            view.__class__ = LayerStack
            view._unchecked = self.nonfinite
            self.views[key] = view
        return self.views[key]

    def _compile(self, key: tuple, fn):
        self.functions[key] = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.backend)
        return self.functions[key]

    def _capture(self, fn, inputs: tuple, fixed: tuple) -> _Graph:
        began = time.perf_counter()
        with torch.compiler.set_stance("fail_on_recompile"):
            graph = self.capture(fn, inputs, fixed)
        self._count(began, None, compiled=False)
        return graph

    def executor(self, program, cache, branches: str):
        """How ``program`` steps on ``cache`` (:mod:`emad.engine.step_graphs`): one graph with conditional nodes
        (``branches`` ``if``) or graphs per block with one block of lookahead (``lookahead``) where graphs serve the
        cache, else immediately. Before a capture the program runs once with every block taken (its pieces compile
        then, outside the capture); the caller has no row live, so neither changes any state. Captures are counted.

        A capture with conditional nodes that fails falls back to lookahead (and every later program of this runner
        with it); that, and a step on CUDA that runs without graphs, is recorded in :attr:`stats` (``fallbacks``,
        in each run file's settings) and warned about once."""
        if not self.graphs_serve(cache):
            if self.graphs or self.stack.device.type == "cuda":
                why = ("the compiled engine's graphs are off" if not self.graphs else
                       f"the runner's slab of {cache.batch_size} rows x {cache.capacity} slots is lent to another cache")
                self.stats.fell_back(f"decode steps ran without graphs (the immediate executor: one read of the "
                                     f"device per block): {why}")
            return Immediate()
        program.run(Always())
        began = time.perf_counter()
        made = None
        with torch.compiler.set_stance("fail_on_recompile"):
            if branches == "if" and self.if_failed is None:
                try:
                    made, captured = OneGraph(program, self.capture_step), 1
                except Exception as error:  # noqa: BLE001 - any failed capture: the lookahead path, and why
                    self.if_failed = f"{type(error).__name__}: {error}"
                    self.stats.fell_back(f"a decode step's capture with conditional IF nodes failed "
                                         f"({self.if_failed}); steps take graphs per block with lookahead")
            if made is None:
                made = Lookahead(program, lambda fn, inputs, fixed: self.capture(fn, inputs, fixed, self.pool))
                captured = len(made.graphs)
        self._count(began, None, compiled=False)
        self.stats.graphs += captured - 1
        return made

    @property
    def pool(self):
        """One memory pool for every graph of this runner's step programs (replayed one at a time, in order)."""
        if self._pool is None and self.stack.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _count(self, began: float, layout: tuple | None, compiled: bool) -> None:
        if self.stack.device.type == "cuda":
            torch.cuda.synchronize(self.stack.device)
        self.stats.seconds += time.perf_counter() - began
        if compiled:
            self.stats.compilations += 1
            self.stats.layouts.append(layout)
        else:
            self.stats.graphs += 1


RUNNERS_ATTRIBUTE = "_emad_runners"  # a model's runners, by backend, kept on the model itself


def runner_for(stack: LayerStack, backend: str = "inductor") -> SegmentRunner:
    """The process-wide :class:`SegmentRunner` of ``stack``'s model (one per model and backend).

    Runners live on the model (they refer to it, and what they compiled and captured does too): they go with it,
    as one cycle the garbage collector frees, where a registry keyed by the model would keep it alive for ever."""
    per_model = stack.model.__dict__.setdefault(RUNNERS_ATTRIBUTE, {})
    if backend not in per_model:
        per_model[backend] = SegmentRunner(stack, backend)
    return per_model[backend]


class CompiledStack(LayerStack):
    """A view of a :class:`LayerStack` whose decode steps run compiled segments over static caches.

    ``run`` of one token per row, every row, one slot (a decode step) goes through the model's
    :class:`SegmentRunner`; any other call (prefill, backfill, scoring) runs eagerly on the same cache. Views made
    from it (``with_readout``) stay compiled and share its compiled segments.
    """

    engine = "compiled"
    keeps_rows = True
    compiles_shapes = True

    def __init__(self, stack: LayerStack, backend: str = "inductor", fuse_probes: bool | None = None,
                 branches: str | None = None):
        self.__dict__.update(stack.__dict__)
        self.runner = runner_for(stack, backend)
        # where graphs replay, how a device step's later blocks are taken: conditional nodes where CUDA has them
        self.branches = branches or ("if" if if_nodes_available() else "lookahead")
        # probes whose estimator is fusable run compiled over every row (CUDA: a graph each); on a CPU they stay
        # eager, where compiling them costs more than it saves
        self.fuse_probes = self.device.type == "cuda" if fuse_probes is None else fuse_probes

    def fuses(self, estimator) -> bool:
        """Whether a probe by ``estimator`` runs compiled over every row (:meth:`estimate_all`)."""
        return self.fuse_probes and getattr(estimator, "fusable", False)

    def estimate_all(self, estimator, layer: int, h: torch.Tensor) -> tuple:
        """``estimator``'s estimate of every cache row's state ``h`` ``[B, d]`` at ``layer``, compiled
        (:meth:`SegmentRunner.estimate`); a replayed graph's own outputs (as :meth:`run_masked`'s)."""
        return self.runner.estimate(self.lens, estimator, layer, h)

    def readout_all(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The readout at ``layer`` of every cache row's state ``h`` ``[B, d]``, compiled
        (:meth:`SegmentRunner.readout`); a replayed graph's own output (as :meth:`run_masked`'s)."""
        return self.runner.readout(self.lens, layer, h)

    @contextmanager
    def finite_checks_deferred(self):
        """As :meth:`LayerStack.finite_checks_deferred`, covering the compiled probes' readouts too."""
        self.runner.nonfinite.zero_()
        self.runner.deferring = True
        try:
            with super().finite_checks_deferred():
                yield self
            unchecked = bool(self.runner.nonfinite)
        finally:
            self.runner.deferring = False
        if unchecked:
            self.runner.nonfinite.zero_()
            self._refuse_non_finite()

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """A static cache of at least ``capacity`` slots (a multiple of :data:`CAPACITY_STEP`) on the model's largest
        free slab that fits (:meth:`SegmentRunner.slab`)."""
        capacity = -(-max(1, capacity) // CAPACITY_STEP) * CAPACITY_STEP
        slab = self.runner.slab(batch_size, capacity)
        return StaticKVCache(self.n_layers, batch_size, capacity if slab is None else slab.valid.shape[-1], self.device,
                             slab)

    def run(self, h: torch.Tensor, start: int, stop: int, cache: KVCache, positions: torch.Tensor, slots: Slots,
            rows: torch.Tensor | None = None) -> torch.Tensor:
        one_token = (isinstance(cache, StaticKVCache) and rows is None and isinstance(slots, slice)
                     and h.shape[1] == 1 and slots.stop == slots.start + 1)
        if not one_token or start == stop:
            return super().run(h, start, stop, cache, positions, slots, rows)
        running = torch.ones(cache.batch_size, dtype=torch.bool, device=h.device)
        out = self.run_masked(h, start, stop, cache, positions, slots, running)
        return out.clone() if self.runner.graphs else out  # callers may keep it past the next replay (drafters do)

    def run_masked(self, h: torch.Tensor, start: int, stop: int, cache: KVCache, positions: torch.Tensor,
                   slots: slice, running: torch.Tensor) -> torch.Tensor:
        """Layers ``[start, stop)`` for one token of every cache row ``h`` ``[B, 1, d]`` at ``positions``
        ``[B, 1]`` in slot ``slots``; only rows where ``running`` ``[B]`` is True write K/V and validity.

        Where graphs are replayed the states returned are the graph's own output, overwritten by the next replay of
        the same segment: a caller consumes them first (a decode step does) or copies them (:meth:`run` does)."""
        if start == stop:
            return h
        if not isinstance(cache, StaticKVCache):
            raise TypeError("a compiled stack decodes on its own static caches (make them with new_cache)")
        return self.runner.run(start, stop, h, positions, cache.slot_tensor(slots.start), running, cache)
