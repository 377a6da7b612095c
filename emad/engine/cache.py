"""Per-layer KV cache with explicit slots and per-layer, per-row validity.

Every token of a batch occupies one *slot* (a column index shared by all rows; left padding occupies slots too).
Each layer keeps its own K/V buffers ``[B, H_kv, S, d_head]`` and a validity mask ``[B, S]``: a slot is valid at
layer ℓ for row b when that row's token in that slot has run layer ℓ (padding never becomes valid). Early exit
leaves holes (a token that exited below ℓ has no K/V at ℓ), which the attention mask hides; policies that let depth
rise fill them later. Nothing else in the project touches K/V.

HF attention modules only call ``cache.update(key, value, layer_idx)``; :class:`CacheView` implements that call
for one (rows, slots) write, so the HF layer modules run unchanged on this cache.
"""

from __future__ import annotations

import torch

Slots = slice | torch.Tensor  # a contiguous range of slots, or scattered slot indices (LongTensor, ascending)


def slot_end(slots: Slots) -> int:
    """One past the last slot."""
    return slots.stop if isinstance(slots, slice) else int(slots[-1]) + 1


def slot_index(slots: Slots, device) -> torch.Tensor:
    """The slots as a LongTensor ``[q]``."""
    return torch.arange(slots.start, slots.stop, device=device) if isinstance(slots, slice) else slots


class KVCache:
    """Preallocated per-layer K/V buffers with per-layer validity.

    Args:
        n_layers: number of decoder layers L.
        batch_size: number of rows B.
        capacity: initial number of slots S (grows by doubling when exceeded).
        device: where buffers live.
    """

    def __init__(self, n_layers: int, batch_size: int, capacity: int, device: torch.device | str):
        self.n_layers = n_layers
        self.batch_size = batch_size
        self.capacity = max(1, capacity)
        self.device = torch.device(device)
        self.keys: list[torch.Tensor | None] = [None] * n_layers  # each [B, H_kv, S, d_head]
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.valid = torch.zeros(n_layers, batch_size, self.capacity, dtype=torch.bool, device=self.device)
        self.real = torch.zeros(batch_size, self.capacity, dtype=torch.bool, device=self.device)  # not padding
        self.n_slots = 0  # slots allocated so far (same for every layer)
        self.padded = False  # any padding slot anywhere (then attention masks are always materialised)
        # per layer: every slot below this watermark is valid for every row (lets us skip mask building)
        self.filled = [0] * n_layers

    # ----------------------------------------------------------------- slots
    def allocate(self, real: torch.Tensor, dense: bool | None = None) -> slice:
        """Reserve slots for new tokens.

        Args:
            real: ``[B, q]`` bool, False where the slot is padding.
            dense: whether every entry of ``real`` is True, when the caller knows (spares reading it back from
                the device).

        Returns:
            The slice of slot indices the tokens occupy.
        """
        q = real.shape[1]
        start, stop = self.n_slots, self.n_slots + q
        self._ensure_capacity(stop)
        self.real[:, start:stop] = real
        self.n_slots = stop
        if not (bool(real.all()) if dense is None else dense):
            self.padded = True
        return slice(start, stop)

    def crop(self, n_slots: int) -> None:
        """Forget every slot from ``n_slots`` on, at every layer and row (e.g. rejected speculative tokens).

        Afterwards the cache is as if only the first ``n_slots`` slots had ever been allocated: their K/V and
        validity are untouched, later slots are invalid and the next :meth:`allocate` starts at ``n_slots``.
        Buffers keep their capacity; stale K/V beyond ``n_slots`` stay hidden until overwritten.

        Raises:
            ValueError: when ``n_slots`` is negative or beyond the slots allocated so far.
        """
        if not 0 <= n_slots <= self.n_slots:
            raise ValueError(f"cannot crop the cache to {n_slots} slots: it holds {self.n_slots}")
        self.valid[:, :, n_slots:] = False
        self.real[:, n_slots:] = False
        self.n_slots = n_slots
        self.filled = [min(f, n_slots) for f in self.filled]

    def copy(self) -> KVCache:
        """An independent copy (buffers cloned): a prompt's pass filled once, decoded on by several methods."""
        out = KVCache.__new__(KVCache)
        out.__dict__.update(self.__dict__)
        out.keys = [None if k is None else k.clone() for k in self.keys]
        out.values = [None if v is None else v.clone() for v in self.values]
        out.valid, out.real, out.filled = self.valid.clone(), self.real.clone(), list(self.filled)
        return out

    def take(self, rows: torch.Tensor) -> KVCache:
        """A cache of the given rows (``[b]`` long, repeats allowed), their K/V and validity copied: prompts
        prefilled once, each continued by several rows (a multiple-choice item's choices)."""
        out = KVCache.__new__(KVCache)
        out.__dict__.update(self.__dict__)
        out.batch_size = len(rows)
        out.keys = [None if k is None else k[rows] for k in self.keys]
        out.values = [None if v is None else v[rows] for v in self.values]
        out.valid, out.real, out.filled = self.valid[:, rows], self.real[rows], list(self.filled)
        return out

    def kept(self, depth: int) -> KVCache:
        """A copy of layers ``1..depth`` over the slots allocated so far (capacity: those slots): what a prompt's
        pass to ``depth`` holds, for a store of passes (:class:`emad.decode.Prefills`)."""
        n = self.n_slots
        out = KVCache.__new__(KVCache)
        out.__dict__.update(self.__dict__)
        out.capacity = max(1, n)
        out.keys = [None if k is None or i >= depth else k[:, :, :n].clone() for i, k in enumerate(self.keys)]
        out.values = [None if v is None or i >= depth else v[:, :, :n].clone() for i, v in enumerate(self.values)]
        out.valid, out.real = self.valid[:, :, :out.capacity].clone(), self.real[:, :out.capacity].clone()
        out.valid[depth:] = False
        out.filled = [f if i < depth else 0 for i, f in enumerate(self.filled)]
        return out

    def load(self, other: KVCache, depth: int | None = None) -> None:
        """Become an independent copy of ``other``'s layers ``1..depth`` (None: all), at this cache's capacity (at
        least ``other``'s slots): a kept prompt pass reused by a new generation — the cache a pass to ``depth``
        made in this cache would be (the K/V of a layer do not depend on the layers after it)."""
        depth = other.n_layers if depth is None else depth
        n, capacity = other.n_slots, max(self.capacity, other.n_slots, 1)

        def widen(t: torch.Tensor) -> torch.Tensor:  # [B, H, S, D] -> [B, H, capacity, D], slots [0, n) copied
            out = t.new_zeros((*t.shape[:2], capacity, *t.shape[3:]))
            out[:, :, :n] = t[:, :, :n]
            return out

        self.keys = [None if k is None or i >= depth else widen(k) for i, k in enumerate(other.keys)]
        self.values = [None if v is None or i >= depth else widen(v) for i, v in enumerate(other.values)]
        self.valid = torch.zeros(other.n_layers, other.batch_size, capacity, dtype=torch.bool, device=other.device)
        self.valid[:depth, :, :n] = other.valid[:depth, :, :n]
        self.real = torch.zeros(other.batch_size, capacity, dtype=torch.bool, device=other.device)
        self.real[:, :n] = other.real[:, :n]
        self.n_layers, self.batch_size, self.capacity, self.device = other.n_layers, other.batch_size, capacity, \
            other.device
        self.n_slots, self.padded = n, other.padded
        self.filled = [f if i < depth else 0 for i, f in enumerate(other.filled)]

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new = max(needed, 2 * self.capacity)
        grow = new - self.capacity

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = grow
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        self.valid = pad(self.valid, 2)
        self.real = pad(self.real, 1)
        self.keys = [None if k is None else pad(k, 2) for k in self.keys]
        self.values = [None if v is None else pad(v, 2) for v in self.values]
        self.capacity = new

    # ----------------------------------------------------------------- queries
    def held(self) -> torch.Tensor:
        """Number of valid positions each row holds at each layer: ``[B, L]``."""
        return self.valid[:, :, : self.n_slots].sum(-1).T

    def is_dense(self, layer: int, rows: torch.Tensor | None, slots: Slots) -> bool:
        """True when every slot before ``slots`` is valid at ``layer`` for all rows and nothing is padded."""
        return (not self.padded and rows is None and isinstance(slots, slice)
                and self.filled[layer] >= slots.start)

    def key_mask(self, layer: int, rows: torch.Tensor | None, slots: Slots) -> torch.Tensor:
        """Which keys ``[0, end(slots))`` are visible at ``layer``, before causality: ``[b, end]`` bool.

        Slots being written now count as valid where they are real tokens.
        """
        valid = self.valid[layer, :, : slot_end(slots)].clone()
        valid[:, slots] = self.real[:, slots]
        return valid if rows is None else valid[rows]

    def view(self, rows: torch.Tensor | None, slots: Slots, kv_only: bool = False) -> CacheView:
        """A write handle for one pass of some rows over some slots (what HF attention modules see).

        With ``kv_only`` the layer is stopped right after its K/V are stored (see :class:`KVWritten`).
        """
        return CacheView(self, rows, slots, kv_only)

    # ----------------------------------------------------------------- writes
    def write(self, layer: int, rows: torch.Tensor | None, slots: Slots, key: torch.Tensor, value: torch.Tensor):
        """Store K/V ``[b, H_kv, q, d_head]`` and return the layer's K/V over ``[0, end(slots))`` for ``rows``."""
        if self.keys[layer] is None:
            shape = (self.batch_size, key.shape[1], self.capacity, key.shape[3])
            self.keys[layer] = key.new_zeros(shape)
            self.values[layer] = value.new_zeros(shape)
        keys, values = self.keys[layer], self.values[layer]
        end = slot_end(slots)
        if rows is None:
            keys[:, :, slots] = key
            values[:, :, slots] = value
            self.valid[layer, :, slots] = self.real[:, slots]
            if isinstance(slots, slice) and self.filled[layer] == slots.start and not self.padded:
                self.filled[layer] = slots.stop
            return keys[:, :, :end], values[:, :, :end]
        if isinstance(slots, slice):
            keys[rows, :, slots] = key
            values[rows, :, slots] = value
            self.valid[layer, rows, slots] = self.real[rows, slots]
        else:  # scattered slots (backfill): one row at a time keeps the indexing plain
            for i, r in enumerate(rows.tolist()):
                keys[r][:, slots] = key[i]
                values[r][:, slots] = value[i]
                self.valid[layer, r, slots] = self.real[r, slots]
        return keys[rows, :, :end], values[rows, :, :end]


class KVWritten(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a ``kv_only`` view right after a layer stored its K/V, to skip the rest of the layer."""


class CacheView:
    """The object HF attention modules receive as ``past_key_values``: routes ``update`` to one write."""

    def __init__(self, cache: KVCache, rows: torch.Tensor | None, slots: Slots, kv_only: bool = False):
        self.cache, self.rows, self.slots, self.kv_only = cache, rows, slots, kv_only

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """HF ``Cache.update`` protocol: store the new K/V, return the layer's full K/V."""
        out = self.cache.write(layer_idx, self.rows, self.slots, key_states, value_states)
        if self.kv_only:
            raise KVWritten
        return out
