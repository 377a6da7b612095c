"""FLOPs and bytes of weights read, per token, for each kind of work the decoder does.

Definitions (DESIGN.md §4; they must not drift):

- a layer: ``FLOPs = 2 × P_ℓ + 4 × n_ctx × d`` where ``P_ℓ`` counts the layer's matmul parameters (weights of
  its linear / Conv1D projections; norms, biases and element-wise work are not counted) and ``n_ctx`` is the number
  of keys the token attends to at that layer (itself included): ``2·n_ctx·d`` for the scores ``q·K`` and as much
  for the weighted sum of ``V``;
- the head: ``2 × d × V``; a readout (probe with the exact estimator) = final norm + head, whose FLOPs are the head's
  (plus any output projection the architecture applies before it, e.g. OPT's ``project_out``);
- a translation (the ``tuned`` readout's T_ℓ(h) = h + A·h + b before the final norm, at layers below L):
  ``2 × (A's parameters)`` — ``2·d²`` at full rank, ``4·d·r`` at rank r — and the bytes of T_ℓ's weights; it is
  charged with every readout or probe at a translated layer, on top of the estimator's own cost;
- a K/V copy (state propagation into a skipped layer): ``2 × (Q, K and V projection parameters)`` — the query
  is computed and dropped — and the bytes of those weights;
- embedding lookups are free;
- bytes = bytes of the weights read: every parameter of each layer run (norms and biases included), and of the
  final norm + head for each readout. Per token, as at batch 1 (a batch shares weight reads; ratios are unchanged).

The cost ratio of a method is its cost divided by the cost of full depth for the same tokens — the FLOPs bound on
its speed-up, exact where time follows FLOPs.

The step bound (:func:`step_bound`), for batches: the rows of a batch decode each token in one step, and a step runs
each layer, reading its weights once for all rows, while any row still runs it — so where a step's time is the
weights it reads (decoding is memory-bound), a step costs its costliest row, not the sum of its rows. With
``c_{r,s}`` the cost of row r's token at step s (its layers, probes, exit readout and policy work, as above) and
``f_{r,s}`` that token at full depth, over the rows running at step s::

    step ratio = Σ_s max_r c_{r,s} / Σ_s max_r f_{r,s}

The costliest row is the deepest one unless probes or a longer context outweigh a layer. At batch 1 (one row per
step) the step ratio is the cost ratio. Rows of one step that exit at different depths lower the cost ratio but not
the step ratio; under the ``sync`` batch exit every row of a step runs the same layers (only their probes differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


def _matmul_params(module: nn.Module) -> int:
    """Parameters of the weight matrices of ``module``'s linear maps (nn.Linear and HF's Conv1D)."""
    total = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear) or type(sub).__name__ == "Conv1D":
            total += sub.weight.numel()
    return total


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass(frozen=True)
class CostModel:
    """Per-token cost of layers and readouts of one model.

    Attributes:
        d_model: hidden size d.
        layer_params: matmul parameters P_ℓ of each layer, ``[L]``.
        layer_bytes: bytes of all parameters of each layer, ``[L]``.
        readout_params: matmul parameters of one readout (head, plus any output projection).
        readout_bytes: bytes of the final norm + head weights.
        kv_params: Q/K/V projection parameters of one layer (a K/V copy's matmuls).
        kv_bytes: bytes of those weights.
        vocab_size: V (rows of the head).
        head_in: width of the head's input (d, or the projected width where an output projection exists).
        head_element_bytes: bytes per head weight.
        translator_params: matmul parameters of T_ℓ for layers 1..L (0 where the readout does not translate).
        translator_bytes: bytes of T_ℓ's weights, ``[L]``.
    """

    d_model: int
    layer_params: tuple[int, ...]
    layer_bytes: tuple[int, ...]
    readout_params: int
    readout_bytes: int
    kv_params: int = 0
    kv_bytes: int = 0
    vocab_size: int = 0
    head_in: int = 0
    head_element_bytes: int = 4
    translator_params: tuple[int, ...] = ()
    translator_bytes: tuple[int, ...] = ()

    @classmethod
    def from_stack(cls, stack) -> CostModel:
        """Count parameters of a :class:`~emad.engine.stack.LayerStack`'s model."""
        norms = nn.ModuleList(stack.norms)
        qkv = [m for name, m in stack.layers[0].named_modules() if name.split(".")[-1] in stack.adapter.qkv]
        layers = range(1, stack.n_layers + 1)
        lens = stack.lens
        return cls(
            d_model=stack.config.hidden_size,
            layer_params=tuple(_matmul_params(layer) for layer in stack.layers),
            layer_bytes=tuple(_param_bytes(layer) for layer in stack.layers),
            readout_params=stack.head.weight.numel() + _matmul_params(norms),
            readout_bytes=_param_bytes(stack.head) + _param_bytes(norms),
            kv_params=sum(m.weight.numel() for m in qkv),
            kv_bytes=sum(_param_bytes(m) for m in qkv),
            vocab_size=stack.head.weight.shape[0],
            head_in=stack.head.weight.shape[1],
            head_element_bytes=stack.head.weight.element_size(),
            translator_params=tuple(0 if lens is None else lens.matmul_params(layer) for layer in layers),
            translator_bytes=tuple(0 if lens is None else lens.param_bytes(layer) for layer in layers),
        )

    @property
    def n_layers(self) -> int:
        return len(self.layer_params)

    def layer_flops(self, layer: int, n_ctx: int) -> int:
        """FLOPs of layer ``layer`` (0-based) for one token attending to ``n_ctx`` keys."""
        return 2 * self.layer_params[layer] + 4 * n_ctx * self.d_model

    @property
    def kv_flops(self) -> int:
        """FLOPs of one K/V copy into one skipped layer."""
        return 2 * self.kv_params

    @property
    def readout_flops(self) -> int:
        """FLOPs of one exact readout: ``2 × d × V`` (+ output projection if any)."""
        return 2 * self.readout_params

    def translation(self, layer: int) -> tuple[float, float]:
        """(FLOPs, bytes) of translating one token's state at ``layer`` (1-based) before a readout or probe."""
        if not self.translator_params or not 1 <= layer <= len(self.translator_params):
            return 0.0, 0.0
        return 2.0 * self.translator_params[layer - 1], float(self.translator_bytes[layer - 1])

    def readout_at(self, layer: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one exact readout at ``layer``: the translation there plus final norm + head."""
        tf, tb = self.translation(layer)
        return self.readout_flops + tf, self.readout_bytes + tb

    def flops(self, n_ctx: torch.Tensor, readouts: torch.Tensor) -> torch.Tensor:
        """FLOPs of the layers tokens ran plus their exact readouts.

        Args:
            n_ctx: ``[N, L]`` keys attended by each token at each layer, 0 where the layer did not run.
            readouts: ``[N]`` number of exact readouts each token paid for (may be fractional for estimators
                costed in readout units).

        Returns:
            ``[N]`` float64 FLOPs.
        """
        ran = (n_ctx > 0).double()
        params = torch.tensor(self.layer_params, dtype=torch.float64)
        return ran @ (2 * params) + 4.0 * self.d_model * n_ctx.double().sum(-1) + readouts.double() * self.readout_flops

    def bytes(self, n_ctx: torch.Tensor, readouts: torch.Tensor) -> torch.Tensor:
        """Bytes of weights read by tokens given where they ran (same arguments as :meth:`flops`)."""
        ran = (n_ctx > 0).double()
        return ran @ torch.tensor(self.layer_bytes, dtype=torch.float64) + readouts.double() * self.readout_bytes

    def full_depth(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(FLOPs, bytes) ``[N]`` of the same tokens at full depth, each attending to ``context[N]`` keys."""
        n_ctx = context[:, None].expand(-1, self.n_layers)
        ones = torch.ones_like(context)
        return self.flops(n_ctx, ones), self.bytes(n_ctx, ones)


def step_bound(spent: Sequence[float], full: Sequence[float], steps: Sequence[int]) -> tuple[float, float]:
    """Numerator and denominator of the step ratio (see the module docstring): ``Σ_s max spent`` and ``Σ_s max full``
    over the steps ``s``, each token counted at the step that produced it.

    Args:
        spent: ``[N]`` cost of each token (FLOPs or bytes).
        full: ``[N]`` the same tokens at full depth.
        steps: ``[N]`` the step of each token (tokens of one step were decoded together).

    Returns:
        ``(Σ_s max_{i∈s} spent_i, Σ_s max_{i∈s} full_i)`` as floats (0, 0 without tokens).
    """
    if not len(spent) == len(full) == len(steps):
        raise ValueError(f"spent, full and steps need one entry per token, got {len(spent)}, {len(full)} and "
                         f"{len(steps)}")
    if not len(steps):
        return 0.0, 0.0
    _, index = torch.unique(torch.as_tensor(steps, dtype=torch.long), return_inverse=True)  # [N] in 0..S-1
    n_steps = int(index.max()) + 1

    def per_step_max(values: Sequence[float]) -> float:
        values = torch.as_tensor(values, dtype=torch.float64)  # [N]
        return float(values.new_zeros(n_steps).scatter_reduce(0, index, values, "amax", include_self=False).sum())

    return per_step_max(spent), per_step_max(full)
