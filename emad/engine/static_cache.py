"""A KV cache of fixed capacity whose buffers keep their addresses: what a compiled decode step reads and writes.

:class:`StaticKVCache` is a :class:`~emad.engine.cache.KVCache` (same slots, per-layer validity, ``CacheView``
writes, so every eager piece — prefill, policies, scoring — runs on it unchanged) that never grows: its capacity is
fixed when it is made, and a write beyond it is an error. Its tensors live on a :class:`Slab`, which a compiled
stack keeps per (batch size, capacity) and lends to one cache at a time, so the layer segments captured as CUDA
graphs (:mod:`emad.engine.compiled`) find the same K/V buffers at the same addresses generation after
generation. Stale K/V left in a slab by an earlier generation stay hidden: validity is reset on every loan.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from emad.engine.cache import KVCache


@dataclass(eq=False)
class Slab:
    """The tensors of a static cache: K/V buffers ``[B, H_kv, S, d_head]`` per layer (made at the first write, all
    layers at once), validity ``[L, B, S]``, real-token flags ``[B, S]`` and the slot of a decode step's tokens
    ``[1]`` (on the device: a captured step reads it where it lies).

    They are normal tensors wherever they are made, inside ``torch.inference_mode`` or not: a cache made outside it
    can reset them, and a compiled segment's guards (which check a tensor's dispatch keys) accept every slab."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    valid: torch.Tensor
    real: torch.Tensor
    slot: torch.Tensor
    lent_to: weakref.ref | None = field(default=None)

    @classmethod
    @torch.inference_mode(False)
    def empty(cls, n_layers: int, batch_size: int, capacity: int, device: torch.device) -> Slab:
        return cls([None] * n_layers, [None] * n_layers,
                   torch.zeros(n_layers, batch_size, capacity, dtype=torch.bool, device=device),
                   torch.zeros(batch_size, capacity, dtype=torch.bool, device=device),
                   torch.zeros(1, dtype=torch.long, device=device))

    @property
    def free(self) -> bool:
        """True when no live cache holds this slab."""
        return self.lent_to is None or self.lent_to() is None


class CacheFullError(ValueError):
    """A static cache was asked for more slots than its fixed capacity."""


class StaticKVCache(KVCache):
    """A :class:`KVCache` of fixed capacity on a :class:`Slab` (see the module docstring).

    Args:
        n_layers, batch_size, capacity, device: as :class:`KVCache`; ``capacity`` is final.
        slab: the tensors to use (reset here); None makes a slab of its own.
    """

    def __init__(self, n_layers: int, batch_size: int, capacity: int, device: torch.device | str,
                 slab: Slab | None = None):
        super().__init__(n_layers, batch_size, capacity, device)
        if slab is None:
            slab = Slab.empty(n_layers, batch_size, self.capacity, self.device)
        if tuple(slab.valid.shape) != (n_layers, batch_size, self.capacity):
            raise ValueError(f"a slab of shape {tuple(slab.valid.shape)} cannot hold a cache of {n_layers} layers, "
                             f"{batch_size} rows and {self.capacity} slots")
        slab.valid.zero_()
        slab.real.zero_()
        slab.lent_to = weakref.ref(self)
        self.slab = slab
        self.keys, self.values = slab.keys, slab.values  # the slab's lists: buffers made here land on the slab
        self.valid, self.real = slab.valid, slab.real
        self._slot = slab.slot  # [1] a decode step's slot, on the device

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """``slot`` as a device tensor ``[1]`` (filled in place: no host-to-device copy, no new tensor)."""
        self._slot.fill_(slot)
        return self._slot

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            raise CacheFullError(f"a static KV cache holds {self.capacity} slots and {needed} were asked for: make "
                                 f"the cache for the whole generation (prompt + max_new_tokens)")

    def write(self, layer: int, rows, slots, key: torch.Tensor, value: torch.Tensor):
        if self.keys[layer] is None:  # every layer at once: a captured segment finds all its buffers made
            shape = (self.batch_size, key.shape[1], self.capacity, key.shape[3])
            with torch.inference_mode(False):
                for i in range(self.n_layers):
                    if self.keys[i] is None:
                        self.keys[i] = key.new_zeros(shape)
                        self.values[i] = value.new_zeros(shape)
        return super().write(layer, rows, slots, key, value)

    def copy(self) -> StaticKVCache:
        """An independent copy on a slab of its own (a prompt's pass kept for later generations)."""
        out = StaticKVCache(self.n_layers, self.batch_size, self.capacity, self.device)
        out.load(self)
        return out

    def load(self, other: KVCache, depth: int | None = None) -> None:
        """Become a copy of ``other``'s layers ``1..depth`` (None: all; same rows, at most this capacity's slots),
        writing into this cache's own buffers (the layers after ``depth`` keep their buffers, every slot invalid)."""
        depth = other.n_layers if depth is None else depth
        n = other.n_slots
        if other.batch_size != self.batch_size or n > self.capacity:
            raise ValueError(f"cannot load a cache of {other.batch_size} rows x {n} slots into one of "
                             f"{self.batch_size} x {self.capacity}")
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for i, t in enumerate(theirs[:depth]):
                if t is None:
                    continue
                if mine[i] is None:
                    with torch.inference_mode(False):
                        mine[i] = t.new_zeros((*t.shape[:2], self.capacity, *t.shape[3:]))
                mine[i][:, :, :n].copy_(t[:, :, :n])
        self.valid.zero_()
        self.valid[:depth, :, :n].copy_(other.valid[:depth, :, :n])
        self.real.zero_()
        self.real[:, :n].copy_(other.real[:, :n])
        self.n_slots, self.padded = n, other.padded
        self.filled = [f if i < depth else 0 for i, f in enumerate(other.filled)]
