"""The layer stack is the model: logits, per-layer readouts and cached decoding equal HF, for every adapter."""

from __future__ import annotations

import pytest
import torch

from emad.decode import left_pad, positions_of
from emad.engine.adapters import ADAPTERS, UnsupportedArchitectureError, adapter_for
from emad.engine.stack import LayerStack
from tests.tiny import ARCHITECTURES, random_prompts, tiny_model


def _forward(stack: LayerStack, ids: torch.Tensor) -> torch.Tensor:
    real = torch.ones_like(ids, dtype=torch.bool)
    cache = stack.new_cache(ids.shape[0], ids.shape[1])
    slots = cache.allocate(real)
    pos = positions_of(real)
    return stack.readout(stack.run(stack.embed(ids, pos), 0, stack.n_layers, cache, pos, slots))


def test_every_adapter_has_a_tiny_model():
    assert set(ARCHITECTURES) == set(ADAPTERS)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_full_depth_logits_equal_hf(arch):
    model = tiny_model(arch)
    stack = LayerStack(model)
    ids = torch.tensor(random_prompts(2, [20]))
    with torch.inference_mode():
        ours = _forward(stack, ids)
        theirs = model(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_readout_at_every_layer_equals_head_of_final_norm_of_hf_hidden_state(arch):
    model = tiny_model(arch)
    stack = LayerStack(model)
    ids = torch.tensor(random_prompts(1, [12]))
    real = torch.ones_like(ids, dtype=torch.bool)
    pos = positions_of(real)
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True).hidden_states  # embeddings, layer 1, ..., layer L
        cache = stack.new_cache(1, ids.shape[1])
        slots = cache.allocate(real)
        h = stack.embed(ids, pos)
        for layer in range(1, stack.n_layers):  # the last entry of HF's tuple is taken after the final norm
            h = stack.run(h, layer - 1, layer, cache, pos, slots)
            expected = stack.head(stack.final_norm(hidden[layer]))
            if stack.softcap:
                expected = torch.tanh(expected / stack.softcap) * stack.softcap
            torch.testing.assert_close(stack.readout(h), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_incremental_decoding_equals_full_forward_at_every_step(arch):
    model = tiny_model(arch)
    stack = LayerStack(model)
    prompts = random_prompts(3, [9, 5, 7], seed=1)
    ids, real = left_pad(prompts, 0, "cpu")
    extra = torch.tensor(random_prompts(3, [10], seed=2))  # [3, 10] tokens fed one at a time
    with torch.inference_mode():
        cache = stack.new_cache(3, 4)  # small on purpose: the cache must grow
        slots = cache.allocate(real)
        pos = positions_of(real)
        stack.run(stack.embed(ids, pos), 0, stack.n_layers, cache, pos, slots)
        next_pos = real.sum(-1)
        all_ids, all_real = ids, real
        for t in range(extra.shape[1]):
            tok = extra[:, t : t + 1]
            slots = cache.allocate(torch.ones_like(tok, dtype=torch.bool))
            h = stack.run(stack.embed(tok, next_pos[:, None]), 0, stack.n_layers, cache, next_pos[:, None], slots)
            step_logits = stack.readout(h[:, -1])
            next_pos = next_pos + 1
            all_ids = torch.cat([all_ids, tok], 1)
            all_real = torch.cat([all_real, torch.ones_like(tok, dtype=torch.bool)], 1)
            full = model(all_ids, attention_mask=all_real.long(), position_ids=positions_of(all_real)).logits
            torch.testing.assert_close(step_logits, full[:, -1], atol=1e-4, rtol=0)


def test_unknown_architecture_lists_supported_ones():
    with pytest.raises(UnsupportedArchitectureError, match="llama") as err:
        adapter_for("mamba")
    assert "mamba" in str(err.value) and "gpt2" in str(err.value)


@pytest.mark.parametrize("rows", [3, 8, 16])
def test_readouts_of_several_layers_in_one_product_equal_each_readout(rows):
    """``LayerStack.readouts``: every layer's states read out through one head product give each layer's own
    readout (to float rounding; the rows are split back to their layers in order)."""
    stack = LayerStack(tiny_model("llama"))
    g = torch.Generator().manual_seed(rows)
    states = {layer: torch.randn(rows, stack.config.hidden_size, generator=g) for layer in (1, 2, 4)}
    together = stack.readouts(states)
    assert list(together) == [1, 2, 4]
    for layer, h in states.items():
        assert together[layer].shape == (rows, stack.vocab_size)
        torch.testing.assert_close(together[layer], stack.readout(h, layer), rtol=0, atol=1e-5)
