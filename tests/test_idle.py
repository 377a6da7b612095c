"""Idle layers (the positive control): full depth equals the base model exactly, fixed depth at the base's depth
equals the base's full depth, its FLOPs ratio is the hand-worked one, and bad counts are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from emad.config import ConfigError
from emad.decode import generate
from emad.engine.cost import CostModel
from emad.engine.idle import IdleSpecError, append_idle_layers, parse_idle_spec
from emad.engine.models import load_model, prepare_model
from emad.engine.stack import LayerStack
from emad.exits.criteria import Fixed, Full
from emad.params import validate_params
from tests.tiny import ARCHITECTURES, TinyTokenizer, random_prompts, save_tiny_pretrained, tiny_model

NEW = 16


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_full_depth_logits_equal_the_base_model_exactly(arch):
    base = tiny_model(arch)
    grown = append_idle_layers(base, 3)
    assert grown.config.num_hidden_layers == base.config.num_hidden_layers + 3
    ids = torch.tensor(random_prompts(2, [9, 9], seed=1))
    with torch.no_grad():
        assert torch.equal(grown(ids).logits, base(ids).logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_greedy_output_and_fixed_depth_at_the_base_depth_equal_the_base(arch):
    base = tiny_model(arch)
    grown = append_idle_layers(base, 4)
    prompts = random_prompts(2, [7, 11], seed=2)
    reference = generate(LayerStack(base), TinyTokenizer(), prompts, Full(), NEW, eos_token_ids=[])
    full = generate(LayerStack(grown), TinyTokenizer(), prompts, Full(), NEW, eos_token_ids=[])
    fixed = generate(LayerStack(grown), TinyTokenizer(), prompts, Fixed(4), NEW, eos_token_ids=[])
    assert full.token_ids == reference.token_ids == fixed.token_ids
    assert all(d == [8] * NEW for d in full.depths) and all(d == [4] * NEW for d in fixed.depths)


def test_flops_ratio_at_the_base_depth_is_the_hand_worked_value():
    # tiny llama: d = 64, 4 heads of 16, 2 K/V heads, MLP 128, V = 96; 4 layers + 4 idle ones.
    # P = q 64·64 + k 64·32 + v 64·32 + o 64·64 + gate, up, down 3·64·128 = 36,864 per layer; head 64·96 = 6,144.
    # A token attending to 10 keys: layer 2·36,864 + 4·10·64 = 76,288 FLOPs; readout 2·6,144 = 12,288.
    cost = CostModel.from_stack(LayerStack(append_idle_layers(tiny_model("llama"), 4)))
    assert cost.layer_params == (36_864,) * 8 and cost.readout_flops == 12_288
    ran = torch.tensor([[10] * 4 + [0] * 4])
    spent, full = cost.flops(ran, torch.ones(1)), cost.full_depth(torch.tensor([10]))[0]
    assert spent.item() == 4 * 76_288 + 12_288 and full.item() == 8 * 76_288 + 12_288
    assert (spent / full).item() == pytest.approx(317_440 / 622_592)


@pytest.mark.slow
def test_a_folder_spec_with_idle_layers_loads_and_prepares(tmp_path, smollm2):
    folder = save_tiny_pretrained(tmp_path / "base", smollm2.tokenizer, n_layers=2)
    spec = f"{folder}+idle3"
    assert parse_idle_spec(spec) == (str(folder), 3)
    loaded = load_model(spec, device="cpu", dtype="float32")
    assert loaded.fingerprint.n_layers == 5 and loaded.fingerprint.spec == spec
    prepared = load_model(str(prepare_model(spec, tmp_path / "control")), device="cpu", dtype="float32")
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        assert torch.equal(prepared.model(ids).logits, load_model(str(folder), device="cpu").model(ids).logits)


@pytest.mark.parametrize("spec", ["smollm2-135m+idle0", "smollm2-135m+idle-3", "smollm2-135m+idle2.5",
                                  "smollm2-135m+idle", "smollm2-135m+idlex"])
def test_a_bad_idle_count_is_refused_by_name(spec):
    with pytest.raises(IdleSpecError, match="positive integer"):
        parse_idle_spec(spec)
    with pytest.raises(ValueError, match="positive integer"):
        load_model(spec, device="cpu")


@pytest.mark.parametrize("count", [0, -1, 2.5, True])
def test_append_refuses_a_bad_count(count):
    with pytest.raises(IdleSpecError):
        append_idle_layers(tiny_model("llama"), count)


def test_params_name_the_model_key_of_a_bad_idle_spec(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("models:\n  control: smollm2-135m+idle0\n")
    with pytest.raises(ConfigError, match=r"models\.control.*positive integer"):
        validate_params(path)


@pytest.mark.slow
def test_smollm2_with_idle_layers_equals_smollm2(smollm2):
    control = load_model("smollm2-135m+idle30", device="cpu", dtype="float32")
    assert control.fingerprint.n_layers == 60 and control.fingerprint.spec == "smollm2-135m+idle30"
    ids = smollm2.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(control.model(ids).logits, smollm2.model(ids).logits)
    prompts = [ids[0].tolist()]
    reference = generate(LayerStack(smollm2.model), smollm2.tokenizer, prompts, Full(), 8, eos_token_ids=[])
    fixed = generate(LayerStack(control.model), smollm2.tokenizer, prompts, Fixed(30), 8, eos_token_ids=[])
    assert fixed.token_ids == reference.token_ids
    assert 0.55 < fixed.cost_ratio() < 0.57  # 30 of 60 layers, the head paid once: just over half


@pytest.mark.parametrize("probes", [([1, 2, 3, 4], [1, 2, 3, 4, 5, 6]), ([2, 4], [2, 4, 6]), ([2, 4], [2, 5, 6])])
def test_a_grown_models_calibration_is_its_base_models_extended_exactly(probes):
    """The control's statistics: a calibration of the tiny model with 2 idle layers equals the tiny model's own,
    extended (each probe from the base's L on reads as the base's final layer), array for array."""
    from emad.calibration.calibrate import calibrate, windows
    from emad.exits.strata import Strata

    base_probes, grown_probes = probes
    tokens = windows(random_prompts(8, [24], seed=3), 24)
    strata = Strata((8,), (0.5,))
    base = calibrate(LayerStack(tiny_model("llama")), tokens, base_probes, strata, batch_size=4, hist_bins=20)
    own = calibrate(LayerStack(append_idle_layers(tiny_model("llama"), 2)), tokens, grown_probes, strata,
                    batch_size=4, hist_bins=20)
    grown = base.grown(grown_probes, {})
    for name in ("count", "sum", "sumsq", "hist", "agree", "oracle"):
        assert np.array_equal(getattr(grown, name), getattr(own, name)), name
    assert grown.probe_layers == own.probe_layers and grown.tokens == own.tokens
    if 3 not in base_probes:  # a probe below the base's L it never read
        with pytest.raises(ValueError, match=r"no probes \[3\]"):
            base.grown([3, 6], {})


def _assert_close(got, want, where="estimators"):
    """``got == want`` with floats equal up to the last bits (rel 1e-12); keys, lengths and other values exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), where
    else:
        assert got == want, where


def test_a_grown_models_estimators_are_its_base_models_extended_exactly():
    """The control's estimators: Top-K and low-rank fitted on the tiny model with 2 idle layers equal the tiny
    model's own fits, extended (each probe from the base's L on takes its final layer's correction and errors)."""
    import json

    from emad.calibration.estimator_fit import build, collect, fit, grown

    tokens = random_prompts(6, [24], seed=4)
    files = {}
    for name, model, probes in (("base", tiny_model("llama"), [1, 2, 3, 4]),
                                ("grown", append_idle_layers(tiny_model("llama"), 2), [1, 2, 3, 4, 5, 6])):
        stack = LayerStack(model)
        sample = collect(stack, tokens, probes)
        fitted = {}
        for est, options in (("topk", {"k": 16}), ("lowrank", {"rank": 4})):
            estimator = build(est, options, stack, sample)
            fitted[est] = {"options": estimator.options(), **fit(stack, estimator, sample)}
        files[name] = json.loads(json.dumps({"model": {"n_layers": stack.n_layers}, "probe_layers": probes,
                                             "estimators": fitted}))
    # equal up to float rounding: the grown model's fit reduces over more probes at once, and a reduction's
    # blocking (so its last bit) may follow the tensor's shape and the threads at hand
    _assert_close(grown(files["base"], ["topk", "lowrank"], [1, 2, 3, 4, 5, 6]), files["grown"]["estimators"])
    with pytest.raises(ValueError, match=r"lacks probes \[\] or estimators \['prune'\]"):
        grown(files["base"], ["prune"], [1, 2, 3, 4, 5, 6])
