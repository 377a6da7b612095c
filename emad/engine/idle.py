"""Idle layers: a model with known redundant depth, the positive control of the verdict.

The spec ``<base spec>+idle<N>`` (``smollm2-135m+idle30``) names the base model with N layers appended, each a copy
of its last layer whose output projections (the adapter row's ``out_proj``: attention output and MLP down
projection, weights and biases) are zero. Such a layer adds exactly zero to the residual stream, so the grown
model's full-depth output equals the base model's bit for bit, and exiting after the base's L layers is lossless
while it skips N of the L + N layers.
"""

from __future__ import annotations

import torch

from emad.engine.adapters import adapter_for
from emad.engine.idle_spec import IdleSpecError, parse_idle_spec

__all__ = ["IdleSpecError", "append_idle_layers", "check_grown", "final_state_from", "parse_idle_spec"]

@torch.no_grad()
def append_idle_layers(model: torch.nn.Module, n: int) -> torch.nn.Module:
    """A new model: ``model`` with ``n`` idle layers appended (copies of its last layer, output projections zero).

    The config's layer count (and ``layer_types``, when it has one) grows by ``n``; every other weight is the
    base model's. The result is in eval mode on the base model's device and dtype.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise IdleSpecError(f"the idle-layer count must be a positive integer; got {n!r}")
    adapter = adapter_for(model.config.model_type)
    config = model.config.__class__.from_dict(model.config.to_dict())
    n_base = config.num_hidden_layers
    config.num_hidden_layers = n_base + n
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * n
    config._attn_implementation = model.config._attn_implementation
    param = next(model.parameters())
    from transformers import AutoModelForCausalLM  # imported on use: params checks need only the spec parser

    grown = AutoModelForCausalLM.from_config(config, dtype=param.dtype)
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    layers = getattr(grown.get_submodule(adapter.base), adapter.layers)
    new = {f"{adapter.base}.{adapter.layers}.{i}." for i in range(n_base, n_base + n)}
    if unexpected or any(not any(k.startswith(p) for p in new) for k in missing):
        raise RuntimeError(f"appending idle layers left weights unmatched: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    for layer in layers[n_base:]:
        layer.load_state_dict(layers[n_base - 1].state_dict())
        for name in adapter.out_proj:
            for weight in layer.get_submodule(name).parameters(recurse=False):
                weight.zero_()
    grown.generation_config = model.generation_config
    return grown.to(param.device).eval()


def check_grown(spec: str, fingerprint: dict, base: dict, flag: str = "--grown-from") -> None:
    """Refuse a model (its spec and ``fingerprint``) that is not a model of ``base`` (a fingerprint) grown by idle
    layers: ``spec`` is ``<base spec>+idle<N>`` and the model has N more layers, the same type, width, vocabulary and
    tokenizer (which model of that shape the base is, the params check of ``control.base`` makes sure)."""
    parsed = parse_idle_spec(spec)
    same = ("model_type", "hidden_size", "vocab_size", "tokenizer_sha256")
    if (parsed is None or any(fingerprint.get(k) != base.get(k) for k in same)
            or fingerprint.get("n_layers") != base.get("n_layers", 0) + parsed[1]):
        raise ValueError(f"{flag}: this model ({spec}) is not the base's model ({base.get('spec')}, "
                         f"{base.get('n_layers')} layers) grown by idle layers: compute it instead (drop {flag})")


def _adds_nothing(layer: torch.nn.Module, out_proj: tuple[str, ...]) -> bool:
    """Every weight and bias of the layer's output projections (``out_proj``) is exactly zero."""
    weights = [w for name in out_proj for w in layer.get_submodule(name).parameters(recurse=False)]
    return bool(weights) and all(not bool(w.any()) for w in weights)


@torch.no_grad()
def final_state_from(stack, probe_tokens: int = 8, seed: int = 0) -> int:
    """The shallowest depth d (1-based) after which the state is the final one for every input: every layer after
    d adds nothing to the residual stream. Proved on the model, not assumed: each such layer's output projections
    (the adapter row's ``out_proj``) are exactly zero, so what it adds is zero whatever its input, and layers
    ``[d, L)`` run on random states return them bit for bit (an architecture that changes the stream elsewhere, e.g.
    a norm after the residual sum, fails here). ``L`` when the last layer adds something.

    Args:
        stack: a :class:`~emad.engine.stack.LayerStack`.
        probe_tokens: length of the random sequence the layers are run on.
        seed: its seed.
    """
    n, out_proj = stack.n_layers, stack.adapter.out_proj
    depth = n
    while depth > 0 and _adds_nothing(stack.layers[depth - 1], out_proj):
        depth -= 1
    if depth == n:
        return n
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, stack.vocab_size, (1, probe_tokens), generator=gen).to(stack.device)
    positions = torch.arange(probe_tokens, device=stack.device)[None]  # [1, T]
    h = stack.embed(ids, positions)
    h = h + torch.randn(h.shape, generator=gen).to(h.device, h.dtype)  # [1, T, d]: a state no layer below made
    cache = stack.new_cache(1, probe_tokens)
    slots = cache.allocate(torch.ones(1, probe_tokens, dtype=torch.bool, device=stack.device))
    out = stack.run(h, depth, n, cache, positions, slots)
    return depth if torch.equal(out, h) else n
