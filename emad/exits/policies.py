"""KV-consistency policies: what happens to the layers a token skipped, and how deep the next token may go.

- ``monotone``: D_t ≤ D_{t-1} (the prompt runs at full depth, D_0 = L); a token never needs K/V that earlier
  tokens lack, so nothing is ever recomputed.
- ``copy`` (CALM state propagation): depth may rise; a token that exits at ℓ copies its hidden state to layers
  ℓ+1..L and only their K/V projections are computed from it. ``copy-translated`` copies the readout's
  translated state T_ℓ(h) instead (the tuned lens maps h_ℓ toward the final layer's basis; with the logit lens it
  is ``copy``), charging one translation per exit.
- ``backfill``: depth may rise; before a token runs a layer that earlier tokens skipped, those tokens' missing
  layers are computed in one batched pass from their exit states — exactly as if they had run them at the time.

A policy instance holds per-row state for one generation. New policies are one class registered in
:data:`POLICIES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from emad.engine.cache import KVCache
from emad.registry import Registry


@dataclass
class PolicyCost:
    """Extra work a policy did, per row: FLOPs, bytes, token-layers recomputed and how often it fired."""

    flops: torch.Tensor
    bytes: torch.Tensor
    token_layers: torch.Tensor
    events: torch.Tensor


class Policy:
    """Base class: no limit on depth, nothing done for skipped layers.

    Attributes:
        syncs: True when rows that ran the same depths get the same depth cap, so the ``sync`` batch exit
            (:mod:`emad.exits.batching`) can stop every row of a step at one layer without carrying a row past its
            cap. Every policy here does; a policy whose caps depend on more than a row's depths sets it False.
        on_device: True when the policy does nothing for skipped layers and its caps follow from the rows' depths
            alone (:meth:`next_cap`): a decode step then keeps them on the device (:mod:`emad.decode.device_step`).
    """

    name: ClassVar[str]
    syncs: ClassVar[bool] = True
    on_device: ClassVar[bool] = False

    def __init__(self, batch_size: int, n_layers: int, prefill_depth: int, cost_model):
        self.n_layers, self.cost_model = n_layers, cost_model
        self.depth = torch.full((batch_size,), prefill_depth, dtype=torch.long)  # last depth per row
        zeros = torch.zeros(batch_size, dtype=torch.float64)
        self.extra = PolicyCost(zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone())

    def max_depth(self, rows: torch.Tensor) -> torch.Tensor:
        """Deepest layer the next token of each row may run: ``[b]``."""
        return torch.full_like(rows, self.n_layers)

    def before_run(self, stack, cache: KVCache, rows: torch.Tensor, start: int, stop: int) -> None:
        """Called before ``rows`` run layers ``[start, stop)`` (0-based)."""

    def after_exit(self, stack, cache: KVCache, rows: torch.Tensor, slot: int, h: torch.Tensor,
                   positions: torch.Tensor, depth: int) -> None:
        """Called when ``rows`` exit at ``depth`` with hidden states ``h`` ``[e, 1, d]`` in ``slot``."""

    def record(self, rows: torch.Tensor, depths: torch.Tensor) -> None:
        """Remember each row's latest depth."""
        self.depth[rows.cpu()] = depths.cpu()

    def first_cap(self, device) -> torch.Tensor:
        """The depth cap ``[B]`` of every row's first decode step, on ``device``."""
        return self.max_depth(torch.arange(len(self.depth))).to(device)

    @classmethod
    def next_cap(cls, cap: torch.Tensor, depths: torch.Tensor, stepped: torch.Tensor) -> torch.Tensor:
        """The caps ``[B]`` after a step in which the rows where ``stepped`` is True ran ``depths`` ``[B]`` layers
        (tensor operations only: it runs inside a captured step)."""
        return cap


POLICIES: Registry[Policy] = Registry("KV policy")


@POLICIES.register("monotone")
class Monotone(Policy):
    """D_t ≤ D_{t-1}: a probe deeper than the previous token's depth is never considered."""

    on_device = True

    def max_depth(self, rows: torch.Tensor) -> torch.Tensor:
        return self.depth[rows.cpu()].to(rows.device)

    @classmethod
    def next_cap(cls, cap: torch.Tensor, depths: torch.Tensor, stepped: torch.Tensor) -> torch.Tensor:
        return torch.where(stepped, depths, cap)


@POLICIES.register("copy")
class Copy(Policy):
    """Copy the exit state to skipped layers; compute only their K/V (query projection included, then dropped)."""

    def state(self, stack, h: torch.Tensor, depth: int) -> tuple[torch.Tensor, tuple[float, float]]:
        """The state copied to the skipped layers and its extra (FLOPs, bytes) per token: h itself."""
        return h, (0.0, 0.0)

    def after_exit(self, stack, cache, rows, slot, h, positions, depth) -> None:
        if depth >= self.n_layers:
            return
        h, (flops, bytes_) = self.state(stack, h, depth)
        slots = slice(slot, slot + 1)
        for layer in range(depth, self.n_layers):
            stack.write_kv(h, layer, cache, positions[:, None], slots, rows if len(rows) < cache.batch_size else None)
        per_token = (self.n_layers - depth) * self.cost_model.kv_flops
        idx = rows.cpu()
        self.extra.flops[idx] += per_token + flops
        self.extra.bytes[idx] += (self.n_layers - depth) * self.cost_model.kv_bytes + bytes_
        self.extra.token_layers[idx] += self.n_layers - depth
        self.extra.events[idx] += 1


@POLICIES.register("copy-translated")
class CopyTranslated(Copy):
    """As ``copy``, with the readout's translated state T_ℓ(h) copied to the skipped layers."""

    def state(self, stack, h, depth):
        return stack.translate(h, depth), self.cost_model.translation(depth)


@dataclass
class _Pending:
    """Exit states of one row's tokens that have not run every layer: slot → (state [1, d], depth, position)."""

    states: dict[int, tuple[torch.Tensor, int, int]] = field(default_factory=dict)


@POLICIES.register("backfill")
class Backfill(Policy):
    """Before running deeper than earlier tokens did, compute their missing layers (batched, exact)."""

    def __init__(self, batch_size: int, n_layers: int, prefill_depth: int, cost_model):
        super().__init__(batch_size, n_layers, prefill_depth, cost_model)
        self.pending = [_Pending() for _ in range(batch_size)]

    def after_exit(self, stack, cache, rows, slot, h, positions, depth) -> None:
        if depth >= self.n_layers:
            return
        for i, r in enumerate(rows.tolist()):
            self.pending[r].states[slot] = (h[i, -1].clone(), depth, int(positions[i]))

    def before_run(self, stack, cache, rows, start, stop) -> None:
        for r in rows.tolist():
            self._fill(stack, cache, r, stop)

    def _fill(self, stack, cache: KVCache, row: int, stop: int) -> None:
        """Bring every pending token of ``row`` up to depth ``stop`` (0-based layers ``< stop``), layer by layer."""
        pending = self.pending[row].states
        lagging = {s: v for s, v in pending.items() if v[1] < stop}
        if not lagging:
            return
        self.extra.events[row] += 1
        device = stack.device
        row_t = torch.tensor([row], device=device)
        for layer in range(min(v[1] for v in lagging.values()), stop):
            due = sorted(s for s, v in lagging.items() if v[1] <= layer)  # all lagging tokens are at depth == layer
            slots = torch.tensor(due, device=device)
            h = torch.stack([lagging[s][0] for s in due])[None]  # [1, q, d]
            positions = torch.tensor([[lagging[s][2] for s in due]], device=device)
            h = stack.run(h, layer, layer + 1, cache, positions, slots, row_t)
            held = cache.valid[layer, row, : int(slots[-1]) + 1].cumsum(0)[slots].cpu()  # keys seen per token
            self.extra.flops[row] += float(sum(self.cost_model.layer_flops(layer, int(n)) for n in held))
            self.extra.bytes[row] += self.cost_model.layer_bytes[layer] * len(due)
            self.extra.token_layers[row] += len(due)
            for i, s in enumerate(due):
                lagging[s] = (h[0, i], layer + 1, lagging[s][2])
        for s, value in lagging.items():
            if value[1] >= self.n_layers:
                pending.pop(s)
            else:
                pending[s] = value
