"""The embedded SmolLM2-135M: the stack equals HF exactly, and it generates sensible text offline."""

from __future__ import annotations

import pytest
import torch

from emad.decode import generate
from emad.engine.stack import LayerStack
from emad.exits.criteria import Full
from tests.test_stack import _forward

pytestmark = pytest.mark.slow


def test_smollm2_stack_logits_and_layer_readouts_equal_hf(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    stack = LayerStack(model)
    ids = torch.tensor([tok("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")["input_ids"]])
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
        torch.testing.assert_close(_forward(stack, ids), out.logits, atol=1e-4, rtol=0)
        for layer in (1, 10, 29):
            expected = model.lm_head(model.model.norm(out.hidden_states[layer]))
            real = torch.ones_like(ids, dtype=torch.bool)
            cache = stack.new_cache(1, ids.shape[1])
            slots = cache.allocate(real)
            pos = torch.arange(ids.shape[1])[None]
            h = stack.run(stack.embed(ids, pos), 0, layer, cache, pos, slots)
            torch.testing.assert_close(stack.readout(h), expected, atol=1e-4, rtol=0)


def test_smollm2_greedy_equals_hf_generate_and_is_sensible(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    prompt = tok("The capital of France is")["input_ids"]
    ours = generate(LayerStack(model), tok, [prompt], Full(), 32)  # stops at EOS, as HF does
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                            pad_token_id=tok.eos_token_id)
    assert ours.token_ids[0] == theirs[0, len(prompt):].tolist()
    assert "Paris" in ours.texts[0]
