"""The one adapter table: where each supported architecture keeps its embedding, layers, final norm and head.

A new architecture is one new row in :data:`ADAPTERS`; no other module looks at ``model_type``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# (base module, ids [B, T], positions [B, T]) -> h [B, T, d]
EmbedFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
# (base module, h [B, T, d], positions [B, T], layer index) -> position embeddings passed to that layer (or None)
RotaryFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], Any]


class UnsupportedArchitectureError(ValueError):
    """Raised for a model whose ``model_type`` has no row in the adapter table."""


@dataclass(frozen=True)
class Adapter:
    """How to take one architecture apart into embed → layers → final norm → head.

    Attributes:
        base: dotted attribute path from the CausalLM to the decoder body.
        layers: attribute of the body holding the ``nn.ModuleList`` of decoder layers.
        final_norm: attributes of the body applied in order after the last layer (missing/None ones skipped).
        embed: token (+ learned position) embedding.
        rotary: rotary position embeddings for a layer, or None when the architecture has none.
        cache_kwarg: name of the keyword through which a layer receives its cache.
        sliding_window: the layer's attention window (None = full attention).
        qkv: names of the attention input projections inside a layer (their cost is a K/V copy's cost).
        out_proj: dotted names of the projections whose outputs a layer adds to the residual stream (attention
            output, MLP down projection): zeroed, they make the layer an identity (:mod:`emad.engine.idle`).
    """

    base: str
    layers: str
    final_norm: tuple[str, ...]
    embed: EmbedFn
    rotary: RotaryFn | None = None
    cache_kwarg: str = "past_key_values"
    sliding_window: Callable[[Any, int], int | None] = lambda config, idx: None
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    out_proj: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")


def _embed_tokens(attr: str) -> EmbedFn:
    return lambda base, ids, positions: getattr(base, attr)(ids)


def _rope(base: nn.Module, h: torch.Tensor, positions: torch.Tensor, idx: int):
    return base.rotary_emb(h, positions)


def _layer_type_rope(base: nn.Module, h: torch.Tensor, positions: torch.Tensor, idx: int):
    return base.rotary_emb(h, positions, base.config.layer_types[idx])


def _window_by_layer_type(config, idx: int) -> int | None:
    types = getattr(config, "layer_types", None)
    if types is not None and types[idx] == "sliding_attention":
        return config.sliding_window
    return None


def _mistral_window(config, idx: int) -> int | None:
    return getattr(config, "sliding_window", None)


def _embed_gpt2(base: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return base.wte(ids) + base.wpe(positions)


def _embed_opt(base: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    h = base.embed_tokens(ids)
    if base.project_in is not None:
        h = base.project_in(h)
    return h + base.embed_positions(None, 0, position_ids=positions)


_LLAMA = Adapter(
    base="model", layers="layers", final_norm=("norm",),
    embed=_embed_tokens("embed_tokens"), rotary=_rope, sliding_window=_window_by_layer_type,
)

ADAPTERS: dict[str, Adapter] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mistral": Adapter(
        base="model", layers="layers", final_norm=("norm",),
        embed=_embed_tokens("embed_tokens"), rotary=_rope, sliding_window=_mistral_window,
    ),
    "gemma3_text": Adapter(
        base="model", layers="layers", final_norm=("norm",),
        embed=_embed_tokens("embed_tokens"), rotary=_layer_type_rope, sliding_window=_window_by_layer_type,
    ),
    "gpt_neox": Adapter(
        base="gpt_neox", layers="layers", final_norm=("final_layer_norm",),
        embed=_embed_tokens("embed_in"), rotary=_rope, cache_kwarg="layer_past", qkv=("query_key_value",),
        out_proj=("attention.dense", "mlp.dense_4h_to_h"),
    ),
    "gpt2": Adapter(base="transformer", layers="h", final_norm=("ln_f",), embed=_embed_gpt2, qkv=("c_attn",),
                    out_proj=("attn.c_proj", "mlp.c_proj")),
    "opt": Adapter(
        base="model.decoder", layers="layers", final_norm=("final_layer_norm", "project_out"),
        embed=_embed_opt, out_proj=("self_attn.out_proj", "fc2"),
    ),
}


def adapter_for(model_type: str) -> Adapter:
    """The adapter row for ``model_type``; raises listing the supported ones."""
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported; supported architectures: {', '.join(sorted(ADAPTERS))}"
        ) from None
