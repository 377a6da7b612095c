"""Where a decode step's hidden states live between its probes.

An eager stack runs only the rows still running: the states shrink as rows leave (:class:`RunningRows`). A stack
that keeps rows (the compiled one, :mod:`emad.engine.compiled`) runs every cache row through each segment, the rows
that left masked, so that a segment's shapes never change (:class:`MaskedRows`). Either way the step reads the
states of its running rows, in order; the step itself is the same loop.
"""

from __future__ import annotations

import torch

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
