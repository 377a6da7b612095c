"""Where a decode step's hidden states live between its probes.

An eager stack runs only the rows still running: the states shrink as rows leave (:class:`RunningRows`). A stack
that keeps rows (the compiled one, :mod:`emad.engine.compiled`) runs every cache row through each segment, the rows
that left masked, so that a segment's shapes never change (:class:`MaskedRows`). Either way the step reads the
states of its running rows, in order; the step itself is the same loop.

The step whose state lives on the device (:mod:`emad.decode.device_step`) has lanes of the same two kinds over its
``[B]`` state: :class:`RowLanes` (eager: the running rows picked on the host at each probe) and :class:`MaskLanes`
(compiled: every row, masked, nothing read from the device).
"""

from __future__ import annotations

import weakref

import torch

from emad.decode.step_state import State
from emad.engine.cache import KVCache
from emad.engine.stack import LayerStack
from emad.exits.estimators import Estimate, Estimator

_ON_DEVICE: dict[tuple, torch.Tensor] = {}  # (device, dtype, values) -> the host tensor's copy there
_ON_DEVICE_MAX = 4096


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor of row indices or a row mask on ``device``, copied once per distinct value and kept: a copy
    from pageable host memory waits for the device's queued work, so the step's bookkeeping, which goes from the host
    to the device between a segment and its probe, must not make one each time (read-only; itself on a CPU)."""
    if device.type == "cpu" or t.device == device:
        return t
    key = (str(device), t.dtype, tuple(t.tolist()))
    found = _ON_DEVICE.get(key)
    if found is None:
        if len(_ON_DEVICE) >= _ON_DEVICE_MAX:
            _ON_DEVICE.clear()
        found = _ON_DEVICE[key] = t.to(device)
    return found


class Lanes:
    """The states of one step's rows.

    Args:
        stack, cache: what the step runs on.
        h: ``[b, 1, d]`` the embedded tokens of the step's rows.
        positions: ``[b, 1]`` their position ids.
        rows: ``[b]`` their cache rows.
        slots: the slot of this step's tokens.
    """

    def __init__(self, stack: LayerStack, cache: KVCache, h: torch.Tensor, positions: torch.Tensor,
                 rows: torch.Tensor, slots: slice):
        self.stack, self.cache, self.positions, self.rows, self.slots = stack, cache, positions, rows, slots

    @staticmethod
    def of(stack: LayerStack, cache: KVCache, h: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
           slots: slice) -> Lanes:
        kind = MaskedRows if getattr(stack, "keeps_rows", False) else RunningRows
        return kind(stack, cache, h, positions, rows, slots)

    def run(self, start: int, stop: int, active: torch.Tensor) -> torch.Tensor:
        """Run layers ``[start, stop)`` for the ``active`` step rows (indices into ``rows``); their states
        ``[a, 1, d]``."""
        raise NotImplementedError

    def keep(self, staying: torch.Tensor) -> None:
        """Of the rows active at the last :meth:`run`, only those where ``staying`` ``[a]`` is True run on."""

    def estimate(self, estimator: Estimator, layer: int, probing: torch.Tensor, probed: torch.Tensor) -> Estimate:
        """``estimator``'s estimate at ``layer`` of the active rows where ``probing`` ``[a]`` (host) is True, which
        are the step rows ``probed`` ``[p]`` (on the device)."""
        return estimator.estimate(self.stack, self.active_states[on_device(probing, self.h.device), -1], layer, probed)

    def readout(self, layer: int, reading: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The readout ``[r, V]`` at ``layer`` of the active rows where ``reading`` ``[a]`` (host) is True, which
        are the step rows ``rows`` ``[r]`` (host)."""
        return self.stack.readout(self.active_states[on_device(reading, self.h.device), -1], layer)


class RunningRows(Lanes):
    """Only the running rows' states ``[a, 1, d]``; rows that leave are dropped."""

    def __init__(self, stack, cache, h, positions, rows, slots):
        super().__init__(stack, cache, h, positions, rows, slots)
        self.h = h

    def run(self, start: int, stop: int, active: torch.Tensor) -> torch.Tensor:
        cache_rows = self.rows[active]
        subset = None if len(cache_rows) == self.cache.batch_size else on_device(cache_rows, self.h.device)
        self.h = self.stack.run(self.h, start, stop, self.cache, self.positions[on_device(active, self.h.device)], self.slots,
                                subset)
        return self.h

    def keep(self, staying: torch.Tensor) -> None:
        self.h = self.h[staying]

    @property
    def active_states(self) -> torch.Tensor:
        return self.h


class MaskedRows(Lanes):
    """Every cache row's state ``[B, 1, d]`` (rows outside the step hold zeros); a segment runs them all, only
    the active rows writing K/V (:meth:`~emad.engine.compiled.CompiledStack.run_masked`)."""

    def __init__(self, stack, cache, h, positions, rows, slots):
        super().__init__(stack, cache, h, positions, rows, slots)
        batch = cache.batch_size
        # the step's rows are the cache's, in order: while all of them run, no row is picked or masked out
        self.in_order = len(rows) == batch and bool((rows.cpu() == torch.arange(batch)).all())
        if self.in_order:
            self.h, self.positions = h, positions
            self.every = on_device(torch.ones(batch, dtype=torch.bool), h.device)  # [B] the running mask of them all
            return
        rows_there = on_device(rows, h.device)
        self.h = h.new_zeros(batch, *h.shape[1:]).index_copy_(0, rows_there, h)  # [B, 1, d]
        self.positions = positions.new_zeros(batch, *positions.shape[1:]).index_copy_(0, rows_there, positions)

    def run(self, start: int, stop: int, active: torch.Tensor) -> torch.Tensor:
        batch, device = self.cache.batch_size, self.h.device
        if self.in_order and len(active) == batch:
            self.h = self.stack.run_masked(self.h, start, stop, self.cache, self.positions, self.slots, self.every)
            self.active_states = self.h  # consumed within the step, before this segment's next replay
            return self.active_states
        cache_rows = on_device(self.rows[active], device)
        running = torch.zeros(batch, dtype=torch.bool, device=device)
        running[cache_rows] = True
        self.h = self.stack.run_masked(self.h, start, stop, self.cache, self.positions, self.slots, running)
        self.active_states = self.h[cache_rows]
        return self.active_states

    def estimate(self, estimator: Estimator, layer: int, probing: torch.Tensor, probed: torch.Tensor) -> Estimate:
        """A fusable estimator runs compiled over every cache row (static shapes), its probed rows picked after."""
        if not self.stack.fuses(estimator):
            return super().estimate(estimator, layer, probing, probed)
        picked = on_device(self.rows, self.h.device)[probed]  # [p] the probed rows' cache rows
        entropy, max_prob, logits = self.stack.estimate_all(estimator, layer, self._only(picked))  # [B], [B], [B, V]
        return Estimate(entropy[picked], max_prob[picked], None if logits is None else logits[picked])

    def _only(self, picked: torch.Tensor) -> torch.Tensor:
        """Every cache row's state ``[B, d]``, zero but in the ``picked`` rows: a row that left or finished, whose
        state rode along, cannot trip the readout's NaN/inf check (every row picked: the states as they are)."""
        if len(picked) == self.cache.batch_size:  # picked rows are distinct: all of them
            return self.h[:, -1]
        keep = torch.zeros(self.cache.batch_size, dtype=torch.bool, device=self.h.device)
        keep[picked] = True
        return torch.where(keep[:, None], self.h[:, -1], 0)

    def readout(self, layer: int, reading: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Where probes are fused, the exit readout too: compiled over every cache row, the rows picked after."""
        if not self.stack.fuse_probes:
            return super().readout(layer, reading, rows)
        picked = on_device(self.rows[rows], self.h.device)
        return self.stack.readout_all(layer, self._only(picked))[picked]


class RowLanes:
    """The eager engine's lanes: each block runs, probes and reads out only the rows still running (picked on the
    host at every probe, as the host step does), with the eager stack's own operations.

    Args:
        stack: the reading stack; cache: the generation's cache; estimator: the method's.
    """

    compiled = False

    def __init__(self, stack, cache, estimator):
        self.stack, self.cache, self.estimator = stack, cache, estimator
        self.slots: slice | None = None
        self.active = torch.zeros(0, dtype=torch.long)  # host: the cache rows still running, ascending
        self._staying: torch.Tensor | None = None  # host, over `active`: the rows that stay after the last exit
        self.reads = 0  # host reads of the device (counted: on a device they wait for it)

    def _host(self, mask: torch.Tensor) -> torch.Tensor:
        """The True entries of a ``[B]`` mask as host row indices (a read of the device)."""
        self.reads += 1
        return mask.cpu().nonzero().flatten()

    def embed(self, st: State) -> torch.Tensor:
        self.active = self._host(st.running)
        there = self.active.to(st.token.device)
        return self.stack.embed(st.token[there][:, None], st.position[there][:, None])  # [a, 1, d]

    def run(self, h: torch.Tensor, start: int, stop: int, st: State) -> torch.Tensor:
        there = self.active.to(h.device)
        rows = None if len(self.active) == self.cache.batch_size else there
        return self.stack.run(h, start, stop, self.cache, st.position[there][:, None], self.slots, rows)

    def pick(self, values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return values if rows is None else values[rows]

    def spread(self, values: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: ``values`` ``[p]`` at ``rows``, False elsewhere."""
        out = torch.zeros_like(like)
        out[rows] = values
        return out

    def head_input(self, h: torch.Tensor, probe) -> None:
        """None: each probe and exit reads out its own rows (the host step's operations)."""
        return None

    def estimate(self, h: torch.Tensor, x, probe, probing: torch.Tensor) -> tuple[Estimate, torch.Tensor] | None:
        rows = self._host(probing)
        if len(rows) == 0:
            return None
        at = torch.searchsorted(self.active, rows)  # their places among the running rows' states
        there = rows.to(h.device)
        return self.estimator.estimate(self.stack, h[at.to(h.device), -1], probe.layer, there), there

    def exit(self, h: torch.Tensor, x, probe, leave: torch.Tensor, took: torch.Tensor, probed, probe_logits,
             st: State) -> None:
        layer = probe.layer
        self.reads += 1
        flags = torch.stack([leave, took]).cpu()  # [2, B]: one read
        if not bool(flags[0].any()):
            return
        device = h.device
        if probe_logits is not None and bool(flags[1].any()):
            took_rows = flags[1].nonzero().flatten()
            at = torch.searchsorted(probed.cpu(), took_rows)
            st.logits[took_rows.to(device)] = probe_logits[at.to(device)].to(st.logits.dtype)
        read_rows = (flags[0] & ~flags[1]).nonzero().flatten()
        if len(read_rows):
            at = torch.searchsorted(self.active, read_rows).to(device)
            st.logits[read_rows.to(device)] = self.stack.readout(h[at, -1], layer).to(st.logits.dtype)
        self._staying = ~flags[0][self.active]

    def keep(self, h: torch.Tensor) -> torch.Tensor:
        """The states of the rows that stay after the last :meth:`exit` (all of them when none left)."""
        staying, self._staying = self._staying, None
        if staying is None:
            return h
        self.active = self.active[staying]
        return h[staying.to(h.device)]

    def finish(self, st: State) -> torch.Tensor:
        return st.logits


class MaskLanes:
    """The compiled engine's lanes: every block runs every cache row through its layers (rows that left or are not
    decoded masked: they write no K/V), probes them all, and keeps each row's exit state (the head's input) for one
    readout of every row when the step finishes — static shapes, no read of the device.

    Args:
        stack: the compiled stack; view: the plain view its probes and readouts run on (the runner's, whose
            readouts flag NaN/inf on the device); cache: a static cache on one of the runner's slabs;
            estimator: the method's (its tensors are made before any compilation).
    """

    compiled = True

    def __init__(self, stack, view, cache, estimator):
        self.stack, self.view, self.estimator = stack, view, estimator
        self.cache = cache
        self.reads = 0

    @property
    def cache(self):
        """The generation's cache (held weakly: a kept program does not keep its slab lent)."""
        return self._cache()

    @cache.setter
    def cache(self, cache) -> None:
        self._cache = weakref.ref(cache)

    def embed(self, st: State) -> torch.Tensor:
        return self.view.embed(st.token[:, None], st.position[:, None])  # [B, 1, d]

    def run(self, h: torch.Tensor, start: int, stop: int, st: State) -> torch.Tensor:
        """Layers ``[start, stop)`` for every row, only the running ones writing K/V (a compiled segment)."""
        return self.stack.runner.segment(start, stop, h, st.position[:, None], st.running, self.cache)

    def pick(self, values: torch.Tensor, rows) -> torch.Tensor:
        return values

    def head_input(self, h: torch.Tensor, probe) -> torch.Tensor:
        """Every row's head input at the probe, final_norm(T_ℓ(h)) ``[B, d]`` (``probe.translator``: T_ℓ, None the
        identity): made once, read by the estimate and by the exit."""
        x = h[:, -1]  # [B, d]
        return self.view.final_norm(x if probe.translator is None else probe.translator(x))

    def estimate(self, h: torch.Tensor, x: torch.Tensor, probe, probing: torch.Tensor) -> tuple[Estimate, None]:
        """Every row's estimate from its head input ``x`` ``[B, d]``; a NaN/inf of a probed row's entropy sets the
        runner's flag (rows not probed, whose states rode along, are not read)."""
        est = self.estimator.from_input(self.view, x, probe.correction)
        self.view._unchecked.logical_or_((probing & ~torch.isfinite(est.entropy)).any())
        return est, None

    def exit(self, h: torch.Tensor, x: torch.Tensor, probe, leave: torch.Tensor, took: torch.Tensor, probed,
             probe_logits, st: State) -> None:
        """The leaving rows' head input ``x`` at the probe: their readout is made in :meth:`finish`, the same numbers
        as the probe's readout (one head product of every row, the same shapes)."""
        st.exit_x.copy_(torch.where(leave[:, None], x, st.exit_x))

    def keep(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def finish(self, st: State) -> torch.Tensor:
        return self.view.read(st.exit_x)  # [B, V]
