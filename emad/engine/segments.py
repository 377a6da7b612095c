"""What the compiled engine compiles: the layers between two probes for every row of a batch over a static cache
(:func:`masked_segment`), a probe's estimate and a readout, each as a function with a code object of its own.

A segment is a static-shape function of every cache row — hidden states ``[B, 1, d]``, position ids ``[B, 1]``, the
slot as a device tensor ``[1]``, a running mask ``[B]`` — and of its own layers' K/V buffers and validity: rows that
do not run (they exited, or finished) ride along masked, their K/V and validity left as they were, and attention
sees the whole buffer ``[B, H_kv, S, d_head]`` under a validity mask ``[B, 1, 1, S]``. The HF layer modules do the
work, as in the eager :meth:`~emad.engine.stack.LayerStack.run`.
"""

from __future__ import annotations

import types

import torch

from emad.engine.stack import LayerStack


class _MaskedView:
    """What a compiled segment's attention modules see as their cache: the K/V of running rows written at one slot
    (``index_copy_`` at a device-tensor slot, shape-static), the rows not running left as they were.

    The segment's layers call :meth:`update` once each, in order: the buffers are taken by that count, not by the
    layer's own index (which the compiled code then never reads, so segments of equal structure at other layers
    share it)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slot: torch.Tensor,
                 running: torch.Tensor):
        self.keys, self.values, self.slot, self.running = keys, values, slot, running
        self.next = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """HF ``Cache.update``: store ``[B, H_kv, 1, d_head]`` at the slot, return the layer's whole buffers."""
        keep = self.running[:, None, None, None]  # [B, 1, 1, 1]
        i = self.next  # the segment's i-th layer
        self.next += 1
        for buffer, new in ((self.keys[i], key_states), (self.values[i], value_states)):
            old = buffer.index_select(2, self.slot)  # [B, H_kv, 1, d_head]
            buffer.index_copy_(2, self.slot, torch.where(keep, new.to(buffer.dtype), old))
        return self.keys[i], self.values[i]


def segment_kinds(stack: LayerStack, start: int, stop: int) -> tuple[tuple[int | None, int], ...]:
    """What a compiled segment of layers ``[start, stop)`` specialises on, per layer: its attention window (None:
    full) and the first layer of the model that shares its rotary tables. Segments equal in it run the same
    compiled code on their own layers (passed in as arguments)."""
    return tuple((stack.windows[i], stack.rotary_index(i)) for i in range(start, stop))


def masked_segment(stack: LayerStack, kinds: tuple, layers: tuple, h: torch.Tensor, positions: torch.Tensor,
                   slot: torch.Tensor, running: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                   valid: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The layers ``layers`` (consecutive decoder layers, of :func:`segment_kinds` ``kinds``) for one token of every
    row, writing the running rows' K/V and validity.

    Args:
        h: ``[B, 1, d]`` hidden states (rows not running: anything finite).
        positions: ``[B, 1]`` position ids.
        slot: ``[1]`` the slot of this token (a device tensor: a new slot needs no new function).
        running: ``[B]`` bool, the rows whose token runs these layers.
        keys, values: the segment's layers' buffers, each ``[B, H_kv, S, d_head]``.
        valid: ``[n, B, S]`` the segment's layers' validity; real: ``[B, S]`` (the cache's).

    Only the segment's own layers and buffers come in, and nothing reads a layer's index: segments of equal
    structure at any depth run one compiled function.

    Returns:
        ``[B, 1, d]`` the states after the segment's last layer (meaningful for running rows).
    """
    k_pos = torch.arange(valid.shape[-1], device=h.device)[None, :]  # [1, S]
    here = k_pos == slot[:, None]  # [1, S] the token's own slot: visible to every row (no row attends to nothing)
    before = k_pos <= slot[:, None]  # [1, S]
    real_here = real.index_select(1, slot)  # [B, 1]
    view = _MaskedView(keys, values, slot, running)
    rotary: dict = {}
    for i, (layer, (window, rotary_at)) in enumerate(zip(layers, kinds)):
        visible = (valid[i] | here) & before  # [B, S]
        if window is not None:
            visible = visible & (k_pos > slot[:, None] - window)
        kwargs = {stack.adapter.cache_kwarg: view, "use_cache": True, "position_ids": positions,
                  "attention_mask": visible[:, None, None, :]}
        if stack.adapter.rotary is not None:
            kwargs["position_embeddings"] = stack._rotary(h, positions, rotary_at, rotary)
        h = layer(h, **kwargs)
        if isinstance(h, tuple):
            h = h[0]
        written = torch.where(running[:, None], real_here, valid[i].index_select(1, slot))  # [B, 1]
        valid[i].index_copy_(1, slot, written)
    return h


def own_code(fn, name: str):
    """``fn`` with a code object of its own named ``name``: dynamo caches and counts compilations per code object, so
    each segment or probe function keeps its own (no shared recompile limit, no guards of another's)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def segment_function(stack: LayerStack, kinds: tuple, name: str):
    """:func:`masked_segment` for segments of structure ``kinds``, a function of its own called as
    ``fn(h, positions, slot, running, keys, values, valid, real, layers)``."""

    def segment(h, positions, slot, running, keys, values, valid, real, layers):
        return masked_segment(stack, kinds, layers, h, positions, slot, running, keys, values, valid, real)

    return own_code(segment, name)


def estimate_function(view: LayerStack, layer: int, name: str):
    """``estimator.estimate`` at ``layer`` for every row's state ``h`` ``[B, d]`` through ``view`` (whose readout
    defers its NaN/inf check to a device flag), a function of its own. The estimator comes in as an argument, so
    points with equal estimators of other values share the compilation."""

    def estimate(h, estimator):
        est = estimator.estimate(view, h, layer)
        return est.entropy, est.max_prob, est.logits

    return own_code(estimate, name)


def readout_function(view: LayerStack, layer: int, name: str):
    """``view.readout`` at ``layer`` of every row's state ``h`` ``[B, d]``, a function of its own."""

    def readout(h):
        return view.readout(h, layer)

    return own_code(readout, name)


def estimator_signature(estimator, corrections: bool = True) -> tuple:
    """What a compiled estimate specialises on besides tensor shapes: the estimator's kind, options and fitted
    corrections (points sharing them share one compiled function; their tensors are inputs). ``corrections`` False:
    without them (a device step reads them from a table)."""
    correction = (getattr(estimator, "correction", None) or {}) if corrections else {}
    return type(estimator).__name__, repr(estimator.describe()), repr(sorted(correction.items()))


def options_key(estimator, corrections: bool = True) -> tuple:
    """:func:`estimator_signature` and the estimator's options (a shortlist's tokens included): estimators equal in
    it compute the same estimates from the same tensors, so one's compiled probe or captured graph serves another."""
    options = getattr(estimator, "options", dict)()
    return (*estimator_signature(estimator, corrections), repr(sorted(options.items())))
