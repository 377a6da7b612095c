"""The layer-stack view of a HF causal LM: ``embed`` → ``run(h, start, stop, ...)`` → ``readout(h, layer)``.

The HF layer modules themselves do the work (no forked model code); this module only feeds them hidden states,
position embeddings, attention masks and a :class:`~emad.engine.cache.KVCache`. Architecture differences live in
:mod:`emad.engine.adapters`. Layers are numbered 1..L in the project's words; ``run(h, start, stop)`` runs the 0-based
half-open range ``[start, stop)``, so ``run(h, 0, D)`` leaves the hidden state at depth D. A stack reads out
through the readout it carries (:mod:`emad.exits.readouts`; the logit lens unless :meth:`LayerStack.with_readout`
gives another).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from functools import cached_property

import torch
from torch import nn

from emad.engine.adapters import Adapter, adapter_for
from emad.engine.cache import KVCache, KVWritten, Slots, slot_end, slot_index


def _resolve(module: nn.Module, dotted: str) -> nn.Module:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


class NonFiniteLogitsError(ValueError):
    """A readout produced NaN or inf (typically an overflow in bfloat16/float16)."""


class LayerStack:
    """Layer-by-layer access to a causal LM.

    Args:
        model: a HF ``*ForCausalLM`` whose ``config.model_type`` is in the adapter table.

    Attributes:
        lens: the readout's translators (an :class:`emad.exits.readouts.Readout`), or None for the logit lens.
    """

    engine = "eager"  # how decode steps run (emad.engine.engines); a compiled view says "compiled"
    keeps_rows = False  # True: a decode step runs every cache row, the rows that left masked (emad.decode.lanes)
    compiles_shapes = False  # True: the first generation of a new shape compiles (warm up on the largest one)
    device_steps = True  # methods that allow it decode with their step's state on the device (emad.decode.device_step)

    def __init__(self, model: nn.Module):
        self.model = model
        self.lens = None
        self.config = model.config
        self.adapter: Adapter = adapter_for(model.config.model_type)
        self.base = _resolve(model, self.adapter.base)
        self.layers: nn.ModuleList = getattr(self.base, self.adapter.layers)
        self.norms = [m for name in self.adapter.final_norm if (m := getattr(self.base, name, None)) is not None]
        self.head: nn.Module = model.get_output_embeddings()
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.windows = [self.adapter.sliding_window(self.config, i) for i in range(len(self.layers))]

    # ------------------------------------------------------------------ facts
    @property
    def n_layers(self) -> int:
        """L, the number of decoder layers."""
        return len(self.layers)

    @cached_property
    def device(self) -> torch.device:
        return self.head.weight.device

    @cached_property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.head.weight.shape[0]

    @property
    def max_positions(self) -> int | None:
        """The model's context length, when the config states one."""
        for key in ("max_position_embeddings", "n_positions"):
            if (value := getattr(self.config, key, None)) is not None:
                return int(value)
        return None

    @property
    def readout_name(self) -> str:
        """``logit`` or the name of the readout this stack carries."""
        return "logit" if self.lens is None else self.lens.name

    def with_readout(self, readout) -> LayerStack:
        """A view of the same model that reads out through ``readout`` (moved to this model's device and dtype)."""
        view = copy.copy(self)
        view.lens = None if readout is None or not readout.layers else readout.to(self.device, self.dtype)
        return view

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache for ``batch_size`` rows and ``capacity`` slots."""
        return KVCache(self.n_layers, batch_size, capacity, self.device)

    # ------------------------------------------------------------------ the three operations
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings: ids ``[B, T]`` → h ``[B, T, d]``."""
        return self.adapter.embed(self.base, ids, positions)

    def run(
        self,
        h: torch.Tensor,
        start: int,
        stop: int,
        cache: KVCache,
        positions: torch.Tensor,
        slots: Slots,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run layers ``[start, stop)`` (0-based) on h ``[b, q, d]``, writing their K/V into ``cache``.

        Args:
            h: hidden states of the ``b`` rows being run, ``[b, q, d]``.
            start: first layer (0-based) to run.
            stop: one past the last layer to run.
            cache: the batch's cache; K/V of these tokens are stored at ``slots`` for ``rows``.
            positions: position ids ``[b, q]`` (rotary / learned positions).
            slots: the cache slots these q tokens occupy (a range, or ascending scattered indices).
            rows: which cache rows ``h`` holds (LongTensor ``[b]``), or None for all rows.

        Returns:
            h after layer ``stop``, ``[b, q, d]``.
        """
        view = cache.view(rows, slots)
        rotary_cache: dict = {}
        for idx in range(start, stop):
            kwargs = {self.adapter.cache_kwarg: view, "use_cache": True, "position_ids": positions}
            if self.adapter.rotary is not None:
                kwargs["position_embeddings"] = self._rotary(h, positions, idx, rotary_cache)
            kwargs["attention_mask"] = self._mask(cache, idx, rows, slots)
            h = self.layers[idx](h, **kwargs)
            if isinstance(h, tuple):
                h = h[0]
        return h

    def write_kv(self, h: torch.Tensor, layer: int, cache: KVCache, positions: torch.Tensor, slots: Slots,
                 rows: torch.Tensor | None = None) -> None:
        """Store at ``layer`` (0-based) the K/V that hidden states ``h`` ``[b, q, d]`` project to, and nothing else.

        The layer runs until its attention has stored K/V (input norm, Q/K/V projections, rotary), then stops:
        the attention itself and the MLP are skipped. Used to propagate a copied state to skipped layers.
        """
        kwargs = {self.adapter.cache_kwarg: cache.view(rows, slots, kv_only=True), "use_cache": True,
                  "position_ids": positions, "attention_mask": None}
        if self.adapter.rotary is not None:
            kwargs["position_embeddings"] = self._rotary(h, positions, layer, {})
        try:
            self.layers[layer](h, **kwargs)
        except KVWritten:
            return
        raise RuntimeError(f"layer {layer} finished without storing K/V: its attention never called the cache")

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The model's final norm (and output projection where one exists): ``[..., d]`` → ``[..., d]``."""
        for norm in self.norms:
            h = norm(h)
        return h

    def translate(self, h: torch.Tensor, layer: int | None) -> torch.Tensor:
        """T_ℓ(h) of the carried readout for hidden states ``[..., d]`` after ``layer`` (None or L: unchanged)."""
        return h if self.lens is None or layer is None else self.lens.translate(h, layer)

    def readout_input(self, h: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """final_norm(T_ℓ(h)) ``[..., d]``: what the head reads (estimators read head rows against it)."""
        return self.final_norm(self.translate(h, layer))

    def readout(self, h: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Logits ``[..., V]`` = head(final_norm(T_ℓ(h))) for ``h`` after layer ``layer`` (default L: T is the
        identity); the final norm is never skipped."""
        return self.read(self.readout_input(h, layer))

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` of the head's input ``x`` ``[..., d]`` (:meth:`readout_input`): the second half of
        :meth:`readout`, for states whose head input was taken at their exit layer."""
        return self._logits(self.head(x))

    def readouts(self, states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """:meth:`readout` of each layer's states ``[m, d]`` through one head product ``[Σm, d] @ [d, V]``: rows of
        a short sequence at several layers read the head's weights once instead of once per layer."""
        inputs = [self.readout_input(h, layer) for layer, h in states.items()]
        logits = self._logits(self.head(torch.cat(inputs)))  # [Σm, V]
        return dict(zip(states, logits.split([len(x) for x in inputs])))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` of the head's input ``x`` ``[..., d]``, softcapped, unchecked: for probes that check
        what they derive from them (an entropy is NaN where its logits hold NaN or +inf)."""
        logits = self.head(x)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Softcap the head's output, refusing NaN or inf (at once, or on leaving :meth:`finite_checks_deferred`)."""
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        # NaN or inf anywhere makes the sum non-finite (a sum of finite logits overflows only past ~1e34 each); one
        # reduction costs a twentieth of an elementwise isfinite on a CPU
        finite = torch.isfinite(logits.sum())
        if self._unchecked is not None:
            self._unchecked |= ~finite  # read once, on leaving the deferred block: no host sync per readout
        elif not bool(finite):
            self._refuse_non_finite()
        return logits

    _unchecked: torch.Tensor | None = None  # inside finite_checks_deferred: a device flag, any readout non-finite

    @contextmanager
    def finite_checks_deferred(self):
        """Inside the block, readouts are checked for NaN or inf on the device and the flag is read once on leaving
        (a decode loop then syncs with the host only where it reads its tokens)."""
        self._unchecked = torch.zeros((), dtype=torch.bool, device=self.device)
        try:
            yield self
            unchecked = bool(self._unchecked)
        finally:
            self._unchecked = None
        if unchecked:
            self._refuse_non_finite()

    def _refuse_non_finite(self):
        raise NonFiniteLogitsError(
            f"the readout produced NaN or inf logits in {self.dtype}: the activations overflowed; run the model "
            "in float32 (dtype: float32 in params.yaml, --dtype float32 on the command line)")

    # ------------------------------------------------------------------ helpers
    def rotary_index(self, idx: int) -> int:
        """The first layer whose rotary tables are layer ``idx``'s (layers of one type share them)."""
        types = getattr(self.config, "layer_types", None)
        return 0 if types is None else list(types).index(types[idx])

    def _rotary(self, h: torch.Tensor, positions: torch.Tensor, idx: int, memo: dict):
        types = getattr(self.config, "layer_types", None)
        key = None if types is None else types[idx]  # layers of one type share their rotary tables
        if key not in memo:
            memo[key] = self.adapter.rotary(self.base, h, positions, idx)
        return memo[key]

    def _mask(self, cache: KVCache, idx: int, rows: torch.Tensor | None, slots: Slots) -> torch.Tensor | None:
        """Boolean attention mask ``[b, 1, q, end]``, or None where sdpa's own causal rule is exact."""
        end = slot_end(slots)
        window = self.windows[idx]
        windowed = window is not None and end >= window
        if not windowed and cache.is_dense(idx, rows, slots) and (end - slots.start == 1 or slots.start == 0):
            return None
        keys = cache.key_mask(idx, rows, slots)  # [b, S]
        q_pos = slot_index(slots, keys.device)[:, None]  # [q, 1]
        k_pos = torch.arange(end, device=keys.device)[None, :]  # [1, S]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed = allowed & (k_pos > q_pos - window)
        return keys[:, None, None, :] & allowed[None, None]  # [b, 1, q, S]
