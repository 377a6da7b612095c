"""Speculative decoding: greedy output ≡ the target's own greedy output, sampled output follows the target's
distribution, AdaEDL's λ rule, costs, and errors a user can act on."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from scipy import stats

from emad.decode import Sampling, generate
from emad.engine.cache import KVCache
from emad.engine.cost import CostModel
from emad.engine.stack import LayerStack
from emad.exits.criteria import Full
from emad.exits.readouts import TunedLens
from emad.methods import (
    DRAFT_POLICIES,
    AdaEDL,
    ConfidenceStop,
    ModelDrafter,
    SelfDrafter,
    Static,
    speculative_generate,
)
from emad.methods.common import pass_cost
from tests.tiny import ARCHITECTURES, TinyTokenizer, VocabTokenizer, random_prompts, tiny_model

NEW = 24
TOK = TinyTokenizer()


def _target_greedy(stack: LayerStack, prompt: list[int], new: int = NEW, eos=()) -> list[int]:
    return generate(stack, TOK, [prompt], Full(), new, eos_token_ids=list(eos)).token_ids[0]


def _spec(stack, prompt, drafter, policy=None, new: int = NEW, **kwargs):
    return speculative_generate(stack, TOK, prompt, drafter, new, policy, eos_token_ids=kwargs.pop("eos", []),
                                **kwargs)


def _check_counts(out, new: int = NEW) -> None:
    assert len(out.token_ids) == new
    assert len(out.token_ids) - 1 == out.accepted + out.verifications  # each pass: accepted drafts + 1 token
    assert all(0 <= a <= d for a, d in zip(out.accepted_lengths, out.draft_lengths))


# ---------------------------------------------------------------------------------------------- greedy ≡ target
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("exit_layer", [1, 3])
def test_self_draft_greedy_equals_target_greedy(arch, exit_layer):
    stack = LayerStack(tiny_model(arch))
    prompt = random_prompts(1, [7], seed=11)[0]
    out = _spec(stack, prompt, SelfDrafter(exit_layer), Static(3))
    assert out.token_ids == _target_greedy(stack, prompt)
    _check_counts(out)


POLICIES = {"static": lambda: Static(4), "adaedl": lambda: AdaEDL(n=6, lam=0.2, target_acceptance=0.3),
            "confidence": lambda: ConfidenceStop(n=6, c=0.3)}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("drafter", ["self-2", "truncated-copy", "other-seed", "other-arch"])
def test_greedy_equals_target_for_every_drafter_and_policy(drafter, policy):
    stack = LayerStack(tiny_model("llama"))
    drafters = {
        "self-2": lambda: SelfDrafter(2),
        "truncated-copy": lambda: ModelDrafter(LayerStack(tiny_model("llama", n_layers=2))),
        "other-seed": lambda: ModelDrafter(LayerStack(tiny_model("llama", seed=1, n_layers=2))),
        "other-arch": lambda: ModelDrafter(LayerStack(tiny_model("qwen2", seed=2))),
    }
    for seed, length in ((12, 5), (13, 10)):
        prompt = random_prompts(1, [length], seed=seed)[0]
        out = _spec(stack, prompt, drafters[drafter](), POLICIES[policy]())
        assert out.token_ids == _target_greedy(stack, prompt)
        _check_counts(out)
        if policy == "static":  # N drafts, fewer only where the token budget ends
            made = 1
            for drafted, accepted in zip(out.draft_lengths, out.accepted_lengths):
                assert drafted == min(4, NEW - made - 1)
                made += accepted + 1


def test_self_draft_accepts_some_drafts():
    stack = LayerStack(tiny_model("llama"))
    out = _spec(stack, random_prompts(1, [6], seed=14)[0], SelfDrafter(3), Static(4))
    assert 0 < out.accepted < out.drafted
    assert out.target_passes_per_token < 1


def test_drafting_with_the_target_itself_accepts_everything():
    model = tiny_model("gpt2")
    stack = LayerStack(model)
    prompt = random_prompts(1, [6], seed=15)[0]
    out = _spec(stack, prompt, ModelDrafter(LayerStack(model)), Static(4), new=21)
    assert out.token_ids == _target_greedy(stack, prompt, 21)
    assert out.draft_lengths == [4] * 4 and out.acceptance_rate == 1.0
    assert out.target_passes_per_token == pytest.approx(4 / 20)
    assert out.mean_accepted == 4.0


def test_eos_stops_like_the_target():
    stack = LayerStack(tiny_model("llama"))
    prompt = random_prompts(1, [8], seed=16)[0]
    free = _target_greedy(stack, prompt)
    eos = free[6]
    out = _spec(stack, prompt, SelfDrafter(2), Static(4), eos=[eos])
    assert out.token_ids == _target_greedy(stack, prompt, eos=[eos])
    assert out.finish_reason == "eos"


def test_stats_and_costs_are_consistent():
    stack = LayerStack(tiny_model("llama"))
    out = _spec(stack, random_prompts(1, [6], seed=17)[0], SelfDrafter(1), Static(2))
    assert out.full_flops > 0 and out.drafter_flops > 0 and out.target_flops > 0
    assert out.cost_ratio() == pytest.approx((out.drafter_flops + out.target_flops) / out.full_flops)
    assert out.seconds > 0 and out.tokens_per_s == pytest.approx(NEW / out.seconds)
    summary = out.summary()
    assert summary["drafter"] == "self" and summary["exit_layer"] == 1 and summary["draft_policy"] == "static"


def test_pass_cost_sums_layer_flops():
    cost = CostModel.from_stack(LayerStack(tiny_model("qwen3")))
    flops, bytes_ = pass_cost(cost, 1, 3, first_slot=5, q=3, readouts=2)
    expected = sum(cost.layer_flops(layer, slot + 1) for layer in (1, 2) for slot in (5, 6, 7))
    assert flops == expected + 2 * cost.readout_flops
    assert bytes_ == cost.layer_bytes[1] + cost.layer_bytes[2] + cost.readout_bytes


def test_cache_crop_forgets_later_slots():
    cache = KVCache(n_layers=2, batch_size=1, capacity=4, device="cpu")
    cache.allocate(torch.ones(1, 6, dtype=torch.bool))
    cache.valid[:, :, :6] = True
    cache.filled = [6, 6]
    cache.crop(4)
    assert cache.n_slots == 4 and cache.filled == [4, 4]
    assert cache.held().tolist() == [[4, 4]]
    assert cache.allocate(torch.ones(1, 1, dtype=torch.bool)) == slice(4, 5)
    with pytest.raises(ValueError, match="holds 5"):
        cache.crop(6)


# ---------------------------------------------------------------------------------------------- AdaEDL
def test_adaedl_lambda_follows_scripted_acceptance():
    policy = AdaEDL(n=8, lam=0.5, target_acceptance=0.6, beta=0.5, eta=0.2)
    # (drafted, accepted) -> a; ā = 0.5·ā + 0.5·a (ā₀ = 0.6); λ += 0.2·(0.6 − ā)
    script = [((4, 2), 0.55, 0.51), ((2, 2), 0.775, 0.475), ((3, 0), 0.3875, 0.5175), ((0, 0), 0.3875, 0.5175)]
    for (drafted, accepted), rate, lam in script:
        policy.update(drafted, accepted)
        assert policy.rate == pytest.approx(rate) and policy.lam == pytest.approx(lam)
    for _ in range(100):
        policy.update(4, 0)
    assert policy.lam == 1.0  # clipped
    policy.reset()
    assert (policy.lam, policy.rate) == (0.5, 0.6)


def test_adaedl_stops_on_the_entropy_bound():
    uniform = torch.zeros(96)  # H = ln 96 = 4.564 nats -> bound = 1 - sqrt(0.2 · 4.564) = 0.0446
    peaked = torch.full((96,), -30.0)
    peaked[3] = 0.0
    policy = AdaEDL(gamma=0.2, lam=0.04)
    assert policy.bound(uniform) == pytest.approx(1 - math.sqrt(0.2 * math.log(96)), abs=1e-5)
    assert policy.keep_drafting(uniform)
    policy.lam = 0.05
    assert not policy.keep_drafting(uniform) and policy.keep_drafting(peaked)
    assert ConfidenceStop(c=0.5).keep_drafting(peaked) and not ConfidenceStop(c=0.5).keep_drafting(uniform)


# ---------------------------------------------------------------------------------------------- sampling
V_SMALL = 16


def _small_vocab_model(seed: int, n_layers: int = 3):
    config = tf.LlamaConfig(vocab_size=V_SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights: peaked readouts that differ between layers and models
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape) * 1.2 / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def _exact_marginals(model, prompt: list[int], temperature: float, steps: int) -> list[torch.Tensor]:
    """P(token j = v) under the target's own sampling, for j < steps, by expanding every prefix."""
    prefixes, weights, marginals = [[]], torch.ones(1, dtype=torch.float64), []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]  # [n, V]
        joint = weights[:, None] * torch.softmax(logits.double() / temperature, -1)  # [n, V]
        marginals.append(joint.sum(0))
        prefixes = [p + [v] for p in prefixes for v in range(V_SMALL)]
        weights = joint.flatten()
    return marginals


def _translators(layers: list[int], d: int) -> TunedLens:
    """A tuned readout away from the identity (random translators)."""
    lens = TunedLens.identity(layers, d, {})
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in lens.translators.values():
            for p in t.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 / p.shape[-1] ** 0.5)
    return lens


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson χ² p-value, cells with expected count < 5 pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


SAMPLES = 1200
STEPS = 4


@pytest.mark.heavy
@pytest.mark.parametrize("drafter,temperature", [("self-1-tuned", 1.0), ("model", 1.3)])
def test_sampled_tokens_follow_the_target_distribution(drafter, temperature):
    """χ² on the marginals of the first 4 tokens (16 symbols, 1200 samples each; fixed seeds).

    Power: moving 0.05 of probability between two tokens of mass ≈ 0.1 gives a noncentrality of
    1200 · (0.05²/0.1 + 0.05²/0.1) = 60, detected at the 0.001 level with power > 0.99 on 15 degrees of freedom.
    """
    model = _small_vocab_model(seed=0)
    stack, prompt = LayerStack(model), [3, 7, 1, 12, 5]
    if drafter == "self-1-tuned":  # drafts read through a translator at layer 1 (verification: the model's own)
        stack = stack.with_readout(_translators(layers=[1, 2], d=32))
    make = {"self-1-tuned": lambda: SelfDrafter(1),
            "model": lambda: ModelDrafter(LayerStack(_small_vocab_model(1, 1)))}
    drafter = make[drafter]()
    counts = torch.zeros(STEPS, V_SMALL, dtype=torch.float64)
    accepted = 0
    for seed in range(SAMPLES):
        sampling = Sampling(do_sample=True, temperature=temperature, seed=seed)
        out = speculative_generate(stack, TOK, prompt, drafter, STEPS, Static(3), sampling, eos_token_ids=[])
        counts[torch.arange(STEPS), torch.tensor(out.token_ids)] += 1
        accepted += out.accepted
    assert 0 < accepted  # the acceptance path is exercised, not only replacements
    for j, probs in enumerate(_exact_marginals(model, prompt, temperature, STEPS)):
        assert _chi_square_p(counts[j], probs) > 1e-3, f"token {j} does not follow the target's distribution"


# ---------------------------------------------------------------------------------------------- bad input
def test_different_vocabulary_is_refused_naming_both_models():
    target = LayerStack(tiny_model("llama"))
    drafter = ModelDrafter(LayerStack(_small_vocab_model(0)))
    with pytest.raises(ValueError, match=r"(?s)vocabulary 16.*vocabulary 96.*tokenizer"):
        _spec(target, [3, 4], drafter)


def test_different_tokenizer_is_refused():
    target = LayerStack(tiny_model("llama"))
    drafter_stack = LayerStack(tiny_model("llama", seed=3, n_layers=1))
    drafter = ModelDrafter(drafter_stack, tokenizer=VocabTokenizer({"a": 0}))
    with pytest.raises(ValueError, match="different tokenizers"):
        speculative_generate(target, VocabTokenizer({"b": 0}), [3, 4], drafter, 4)


@pytest.mark.parametrize("exit_layer", [0, 4, -1, 7])
def test_exit_layer_outside_range_is_refused(exit_layer):
    stack = LayerStack(tiny_model("llama"))
    with pytest.raises(ValueError, match=rf"E={exit_layer}.*1\.\.3"):
        _spec(stack, [3, 4], SelfDrafter(exit_layer))


@pytest.mark.parametrize("make,param", [
    (lambda: Static(0), "n"), (lambda: AdaEDL(n=0), "n"), (lambda: AdaEDL(gamma=0.0), "gamma"),
    (lambda: AdaEDL(gamma=-1.0), "gamma"), (lambda: ConfidenceStop(c=0.0), "c"),
    (lambda: ConfidenceStop(c=1.0), "c"), (lambda: ConfidenceStop(c=1.5), "c"),
])
def test_bad_policy_parameters_name_the_parameter(make, param):
    with pytest.raises(ValueError, match=rf"^{param} "):
        make()


def test_batch_of_several_prompts_is_refused_and_unknown_policy_lists_names():
    stack = LayerStack(tiny_model("llama"))
    with pytest.raises(ValueError, match="batch size 1"):
        _spec(stack, [[3, 4], [5, 6]], SelfDrafter(2))
    assert _spec(stack, [[3, 4]], SelfDrafter(2), new=4).token_ids == _target_greedy(stack, [3, 4], 4)
    with pytest.raises(KeyError, match="adaedl, confidence, static"):
        DRAFT_POLICIES.get("adaptive")
