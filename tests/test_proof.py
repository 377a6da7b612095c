"""Identity by construction is proved on the model, not assumed: idle layers make the state final after the base's
depth (and a model whose top layer adds something does not); the proof names why it fails; the splits of units are
disjoint, balanced and fixed by the seed."""

from __future__ import annotations

import pytest
import torch

from emad.decode import generate
from emad.decode.step import Method
from emad.engine.idle import append_idle_layers, final_state_from
from emad.engine.stack import LayerStack
from emad.evaluation.proof import prove_identical
from emad.evaluation.units import ALL, BLOCK, CONFIRMATION, SELECTION, Units, indices, split_record
from emad.exits.criteria import Contrastive, Fixed, Full
from emad.exits.estimators import ESTIMATORS
from emad.exits.readouts import TunedLens
from emad.methods.strategies import Speculative
from tests.tiny import ARCHITECTURES, TinyTokenizer, random_prompts, tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_idle_layers_make_the_state_final_after_the_base_depth(arch):
    base = tiny_model(arch)
    n = base.config.num_hidden_layers
    assert final_state_from(LayerStack(base)) == n  # every layer of a trained-like model adds something
    grown = LayerStack(append_idle_layers(base, 3))
    assert final_state_from(grown) == n


def test_a_zeroed_layer_below_an_active_one_proves_nothing():
    """Only a run of idle layers at the top counts: a top layer that adds something keeps the state unfinished."""
    model = tiny_model("llama", n_layers=4)
    stack = LayerStack(model)
    for name in stack.adapter.out_proj:  # layer 3 of 4 idle, layer 4 not
        for w in stack.layers[2].get_submodule(name).parameters(recurse=False):
            w.data.zero_()
    assert final_state_from(stack) == 4


def test_the_control_fixed_depth_is_proved_identical_and_its_tokens_are_full_depths():
    base = tiny_model("llama")
    n = base.config.num_hidden_layers
    grown = LayerStack(append_idle_layers(base, 4))
    final_from = final_state_from(grown)
    prompts = random_prompts(2, [7, 9], seed=3)
    fixed = Method(Fixed(n))
    out = generate(grown, TinyTokenizer(), prompts, fixed, 8, eos_token_ids=[])
    full = generate(grown, TinyTokenizer(), prompts, Method(Full()), 8, eos_token_ids=[])
    assert out.token_ids == full.token_ids
    proof = prove_identical(fixed, grown.n_layers, final_from, {n: 16})
    assert proof["proved"] and proof["final_from"] == n


def test_a_fixed_depth_on_a_model_whose_top_layer_is_active_is_not_proved():
    model = LayerStack(tiny_model("llama"))
    n = model.n_layers
    proof = prove_identical(Method(Fixed(n - 1)), n, final_state_from(model), {n - 1: 16})
    assert not proof["proved"] and f"exits at depth {n - 1}" in proof["why"]
    assert prove_identical(Method(Full()), n, n, {n: 16})["proved"]


def test_what_reads_tokens_otherwise_is_never_proved():
    n = 4
    contrast = Method(Contrastive(threshold=0.5, contrastive_output=True))
    assert not prove_identical(contrast, n, n, {n: 16})["proved"]  # never exits, but its tokens are a contrast
    prune = Method(Full(), estimator=ESTIMATORS.get("prune")(prune_k=8))
    assert "reads part of the head" in prove_identical(prune, n, n, {n: 16})["why"]
    spec = Speculative.from_options(exit_layer=2)
    assert "strategy" in prove_identical(spec, n, n, {n: 16})["why"]
    lens = TunedLens.identity([2], 8, {})
    assert lens.identity_at(2) and lens.identity_at(3)
    with torch.no_grad():
        lens.translators[2].bias[0] = 1.0
    assert not lens.identity_at(2)
    assert "translates" in prove_identical(Method(Fixed(2), readout=lens), n, 2, {2: 16})["why"]
    assert prove_identical(Method(Fixed(3), readout=lens), n, 2, {3: 16})["proved"]


@pytest.mark.parametrize("n", [1, 2, 7, 16, 48, 49])
def test_selection_and_confirmation_are_disjoint_balanced_and_cover_every_unit(n):
    sel, conf = indices(n, SELECTION, 0, "fidelity"), indices(n, CONFIRMATION, 0, "fidelity")
    assert not set(sel) & set(conf) and sorted(sel + conf) == indices(n, ALL, 0, "fidelity") == list(range(n))
    assert abs(len(sel) - len(conf)) <= BLOCK  # balanced up to one block
    # a run scored on fewer (leading) units keeps each unit on the same side
    assert indices(n - 1, CONFIRMATION, 0, "fidelity") == [i for i in conf if i < n - 1]


def test_consecutive_units_stay_on_one_side():
    """Neighbouring windows of one text (a block) are judged together: never one in the selection half and its
    neighbour in the confirmation half, but at a block's edge."""
    conf = set(indices(48, CONFIRMATION, 0, "perplexity"))
    for start in range(0, 48, BLOCK):
        block = set(range(start, start + BLOCK))
        assert block <= conf or not block & conf
    assert len(conf) == 24


def test_the_split_is_fixed_by_its_seed_and_recorded():
    assert indices(48, CONFIRMATION, 0, "fidelity") == indices(48, CONFIRMATION, 0, "fidelity")
    assert indices(48, CONFIRMATION, 0, "fidelity") != indices(48, CONFIRMATION, 1, "fidelity")
    assert Units(CONFIRMATION, 0).take("x", list("abcdefgh")) == [list("abcdefgh")[i]
                                                                  for i in indices(8, CONFIRMATION, 0, "x")]
    record = split_record({"fidelity": {"samples": {"exact_match": [1] * 10, "rouge_l": [1.0] * 10}},
                           "gsm8k": {"accuracy": 0.0}}, 3)
    assert record["seed"] == 3 and set(record) == {"seed", "rule", "fidelity"}
    assert sorted(record["fidelity"][SELECTION] + record["fidelity"][CONFIRMATION]) == list(range(10))
