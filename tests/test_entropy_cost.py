"""Exact entropy and the cost model on hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from emad.engine.cost import CostModel
from emad.engine.entropy import entropy_from_logits
from emad.engine.stack import LayerStack
from tests.tiny import tiny_model


def test_entropy_of_known_distributions():
    uniform = torch.zeros(3, 1000)
    assert entropy_from_logits(uniform) == pytest.approx(torch.full((3,), math.log(1000)), abs=1e-5)
    two = torch.log(torch.tensor([0.25, 0.75]))
    assert entropy_from_logits(two).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_entropy_is_stable_when_peaked_and_flat_and_in_bf16():
    peaked = torch.tensor([[1e4, 0.0, 0.0, -1e4]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    masked = torch.tensor([[0.0, 0.0, float("-inf")]])
    assert entropy_from_logits(masked).item() == pytest.approx(math.log(2), abs=1e-6)
    flat = torch.full((1, 49152), 3.0)
    assert entropy_from_logits(flat).item() == pytest.approx(math.log(49152), abs=1e-4)
    logits = torch.randn(4, 5000) * 3
    exact = entropy_from_logits(logits)
    bf16 = entropy_from_logits(logits.bfloat16())
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, entropy_from_logits(logits.bfloat16().float()))
    assert (exact - bf16).abs().max() < 0.05


def test_cost_model_on_hand_worked_llama_config():
    # hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, vocab 96, untied head
    cost = CostModel.from_stack(LayerStack(tiny_model("llama")))
    p = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate/up/down = 36,864
    assert cost.layer_params == (p,) * 4
    assert cost.layer_flops(0, n_ctx=10) == 2 * 36_864 + 4 * 10 * 64 == 76_288
    assert cost.readout_flops == 2 * 64 * 96 == 12_288
    assert cost.layer_bytes == ((p + 2 * 64) * 4,) * 4  # two RMSNorm weights
    assert cost.readout_bytes == (96 * 64 + 64) * 4
    # one token at depth 2 with 10 and 9 keys, 1 readout; another at full depth with 10 keys everywhere
    n_ctx = torch.tensor([[10, 9, 0, 0], [10, 10, 10, 10]])
    flops = cost.flops(n_ctx, torch.tensor([1, 1]))
    assert flops.tolist() == [2 * 2 * p + 4 * 19 * 64 + 12_288, 4 * 76_288 + 12_288]
    full, _ = cost.full_depth(torch.tensor([10]))
    assert full.item() == flops[1].item()


def test_gpt2_conv1d_counts_as_matmul():
    cost = CostModel.from_stack(LayerStack(tiny_model("gpt2")))
    # c_attn 64x192, c_proj 64x64, mlp c_fc 64x256, c_proj 256x64
    assert cost.layer_params[0] == 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64
