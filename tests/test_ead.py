"""EAD: the switching rule on scripted entropies, exact catch-up (self pair ≡ separate truncated model ≡ teacher
forcing at each token's model), scoring ≡ generation, the self pair's one-pass scoring ≡ its token-by-token
scoring, counted catch-up work, strategies through ``generate``, and errors a user can act on."""

from __future__ import annotations

import math

import pytest

from emad.decode import Sampling, generate, score, score_adaptive
from emad.decode.step import reading
from emad.engine.stack import LayerStack
from emad.exits.criteria import Full
from emad.methods import EAD, STRATEGIES, ModelPair, SelfPair, Switcher
from tests.test_readouts import random_lens
from tests.tiny import TinyTokenizer, VocabTokenizer, random_prompts, tiny_model

TOK = TinyTokenizer()
NEW = 24


# ---------------------------------------------------------------------------------------------- the rule
def _sides(switcher: Switcher, entropies: list[float]) -> list[str]:
    """The model that produces each token, given the entropy each token turned out to have."""
    switcher.reset()
    sides = []
    for h in entropies:
        sides.append(switcher.current)
        switcher.observe(h)
    return sides


def test_switches_up_when_the_rolling_mean_reaches_tau_and_down_when_it_falls_to_it():
    s = Switcher(tau=1.0, window=2, d_min=1)
    # means over the last 2: [0.5] .5, [.5,1.5] 1.0 -> up; [1.5,.8] 1.15; [.8,.8] .8 -> down; [.8,2] 1.4 -> up
    assert _sides(s, [0.5, 1.5, 0.8, 0.8, 2.0, 2.0]) == ["small", "small", "large", "large", "small", "large"]
    assert s.switches == 3


def test_window_averages_the_last_w_tokens():
    entropies = [3.0, 0.0, 0.0, 0.0, 0.0]  # one spike: a window of 1 moves on it, a window of 4 barely sees it
    assert _sides(Switcher(tau=0.5, window=1, d_min=1), entropies)[:3] == ["small", "large", "small"]
    assert _sides(Switcher(tau=0.5, window=4, d_min=1), entropies) == ["small", "large", "large", "large", "large"]
    assert _sides(Switcher(tau=0.8, window=4, d_min=1), entropies) == ["small", "large", "large", "large", "small"]


def test_d_min_holds_the_current_model_for_at_least_d_min_tokens():
    entropies = [5.0] * 3 + [0.0] * 6  # rolling means over 4: 5 5 5 3.75 2.5 1.25 0 0 0
    assert _sides(Switcher(tau=1.0, window=4, d_min=1), entropies) == ["small"] + ["large"] * 6 + ["small"] * 2
    # with d_min = 4 the small model makes 4 tokens first; the large one then also makes 4 before it may leave
    assert _sides(Switcher(tau=1.0, window=4, d_min=4), entropies) == ["small"] * 4 + ["large"] * 4 + ["small"]


def test_start_large_and_equal_mean_moves_either_way():
    assert _sides(Switcher(tau=1.0, window=1, d_min=1, start="large"), [1.0, 1.0, 1.0]) == ["large", "small", "large"]


# ---------------------------------------------------------------------------------------------- exactness
def _ead(pair, tau=2.5, window=2, d_min=3, start="small") -> EAD:
    return EAD(pair, Switcher(tau, window, d_min, start))


def _switching_tau(stack: LayerStack, prompt: list[int], k: int = 2) -> float:
    """The median entropy over an always-small and an always-large run: a τ at which the models take turns."""
    seen = []
    for tau, start in ((1e9, "small"), (-1e9, "large")):
        out = generate(stack, TOK, [prompt], _ead(SelfPair(k), tau, d_min=1, start=start), NEW, eos_token_ids=[])
        seen += [h for t in out.traces[0] for h in t.entropies.values()]
    return sorted(seen)[len(seen) // 2]


def _teacher_logprobs(stack: LayerStack, prompt: list[int], tokens: list[int], depth: int) -> list[float]:
    return score(stack, prompt + tokens, depth)[len(prompt) - 1:].tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "opt"])
def test_self_pair_equals_teacher_forcing_by_each_tokens_model(arch):
    """Every token's log-probability equals the teacher-forced one at its model's depth: the shared cache and the
    catch-up of layers k+1..L leave nothing stale."""
    stack = LayerStack(tiny_model(arch))
    prompt = random_prompts(1, [7], seed=21)[0]
    out = generate(stack, TOK, [prompt], _ead(SelfPair(2), _switching_tau(stack, prompt)), NEW, eos_token_ids=[])
    tokens, depths = out.token_ids[0], out.depths[0]
    assert set(depths) == {2, 4} and out.stats["switches"] >= 2  # both models produced tokens
    for depth in (2, 4):
        teacher = _teacher_logprobs(stack, prompt, tokens, depth)
        for j, d in enumerate(depths):
            if d == depth:
                assert out.traces[0][j].logprob == pytest.approx(teacher[j], abs=1e-4)


def test_self_pair_equals_a_separate_truncated_model():
    stack = LayerStack(tiny_model("llama"))
    small = LayerStack(tiny_model("llama", n_layers=2))
    prompts = random_prompts(3, [7, 4, 9], seed=22)
    tau = _switching_tau(stack, prompts[0])
    ours = generate(stack, TOK, prompts, _ead(SelfPair(2), tau), NEW, eos_token_ids=[])
    theirs = generate(stack, TOK, prompts, _ead(ModelPair(small), tau), NEW, eos_token_ids=[])
    assert ours.token_ids == theirs.token_ids and ours.depths == theirs.depths and ours.stats["switches"] >= 3
    assert ours.stats == theirs.stats


def test_catch_up_work_is_the_missed_tokens():
    """Each switch to a model feeds it the tokens the other produced since it last ran; that work is counted."""
    stack = LayerStack(tiny_model("llama"))
    small = LayerStack(tiny_model("llama", seed=5, n_layers=2))
    prompt = random_prompts(1, [6], seed=23)[0]
    out = generate(stack, TOK, [prompt], _ead(ModelPair(small), _switching_tau(stack, prompt), d_min=2), NEW,
                   eos_token_ids=[])
    last_fed = {"small": -1, "large": -1}  # index of the last generated token each model was fed (-1: the prompt)
    expected = {"small": 0, "large": 0}  # tokens fed as catch-up, per model
    for j, t in enumerate(out.traces[0]):
        if j > 0:  # token j is read out after feeding its model tokens last_fed+1 .. j-1; all but j-1 are catch-up
            expected[t.reason] += (j - 1) - last_fed[t.reason] - 1
            last_fed[t.reason] = j - 1
    assert out.stats["switches"] >= 2 and expected["small"] > 0 and expected["large"] > 0
    assert out.policy_token_layers[0] == expected["small"] * 2 + expected["large"] * 4
    assert out.policy_flops[0] > 0 and out.policy_events[0] == out.stats["switches"]
    assert out.stats["large_tokens"] + out.stats["small_tokens"] == NEW


def test_always_large_is_the_target_and_always_small_is_the_truncated_model():
    stack = LayerStack(tiny_model("qwen3"))
    prompt = random_prompts(1, [8], seed=24)[0]
    full = generate(stack, TOK, [prompt], Full(), NEW, eos_token_ids=[])
    big = generate(stack, TOK, [prompt], _ead(SelfPair(1), tau=-1e9, d_min=1, start="large"), NEW, eos_token_ids=[])
    assert big.token_ids == full.token_ids and big.stats["switches"] == 0
    assert big.cost_ratio() == pytest.approx(1.0)
    tiny = generate(stack, TOK, [prompt], _ead(SelfPair(1), tau=1e9, d_min=1), NEW, eos_token_ids=[])
    truncated = generate(LayerStack(tiny_model("qwen3", n_layers=1)), TOK, [prompt], Full(), NEW, eos_token_ids=[])
    assert tiny.token_ids == truncated.token_ids and tiny.stats["large_tokens"] == 0
    assert tiny.cost_ratio() < 0.6


def test_scoring_replays_generation():
    stack = LayerStack(tiny_model("llama"))
    prompt = random_prompts(1, [5], seed=25)[0]
    method = _ead(SelfPair(2), _switching_tau(stack, prompt))
    out = generate(stack, TOK, [prompt], method, NEW, eos_token_ids=[])
    assert out.stats["switches"] >= 2
    scored = score_adaptive(stack, prompt, out.token_ids[0], method)
    assert scored.depths == out.depths[0]
    assert scored.logprobs == pytest.approx([t.logprob for t in out.traces[0]], abs=1e-5)
    assert scored.flops == pytest.approx(sum(out.flops[0]))
    assert scored.full_flops == pytest.approx(sum(out.full_flops[0]))
    assert all(scored.greedy)  # greedy generation: every token is its readout's argmax


# ---------------------------------------------------------------------------------------------- one-pass scoring
FP32_TOL = 5e-5  # float32 log-probs of the same states computed in other batch shapes


def _one_pass_equals_stepwise(stack: LayerStack, method: EAD, prompt: list[int], continuation: list[int]):
    """Score through ``score_adaptive`` (the self pair's one-pass path) and token by token; assert they agree and
    return the one-pass record."""
    view = reading(stack, method)
    fast = method.teacher_forced(view, prompt, continuation)
    slow = method.teacher_forced(view, prompt, continuation, stepwise=True)
    assert fast.ids == slow.ids == continuation
    rule = method.switcher  # a mean within rounding of τ could turn either way: keep the tests off that edge
    replay = Switcher(rule.tau, rule.window, rule.d_min, rule.start)
    means = [replay.observe(e[d]) or replay.mean for e, d in zip(slow.entropies, slow.depths)]
    assert min(abs(m - rule.tau) for m in means) > 1e-4, "τ is within rounding of a rolling mean: pick another"
    assert fast.depths == slow.depths and fast.reasons == slow.reasons and fast.greedy == slow.greedy
    # float32 rounding of a batched pass vs one token at a time differs between CPUs (1.0e-5 seen on AVX-512)
    assert fast.logprobs == pytest.approx(slow.logprobs, abs=FP32_TOL, rel=0)
    assert [e[d] for e, d in zip(fast.entropies, fast.depths)] == pytest.approx(
        [e[d] for e, d in zip(slow.entropies, slow.depths)], abs=FP32_TOL, rel=0)
    # costs: the same charges in the same order, so exactly equal floats
    assert fast.flops == slow.flops and fast.bytes == slow.bytes
    assert fast.full_flops == slow.full_flops and fast.full_bytes == slow.full_bytes
    assert (fast.extra_flops, fast.extra_token_layers, fast.extra_events) == (
        slow.extra_flops, slow.extra_token_layers, slow.extra_events)
    assert fast.stats == slow.stats and fast.finish == slow.finish
    scored = score_adaptive(stack, prompt, continuation, method)
    assert scored.depths == slow.depths and scored.greedy == slow.greedy
    assert scored.logprobs == pytest.approx(slow.logprobs, abs=FP32_TOL, rel=0)
    assert scored.flops == sum(slow.flops) and scored.full_flops == sum(slow.full_flops)
    return fast


def _taus(stack: LayerStack, prompt: list[int], continuation: list[int], k: int) -> list[float]:
    """τ from "always small" to "always large": ±1e9 and (nudged off the entropies and their means) the quartiles
    of the entropies both models see along the continuation."""
    seen = []
    for tau, start in ((1e9, "small"), (-1e9, "large")):
        row = _ead(SelfPair(k), tau, d_min=1, start=start).teacher_forced(stack, prompt, continuation)
        seen += [h for e in row.entropies for h in e.values()]
    seen = sorted(seen)
    return [1e9, *(seen[i] + 3e-3 for i in (len(seen) // 4, len(seen) // 2, 3 * len(seen) // 4)), -1e9]


@pytest.mark.parametrize("start", ["small", "large"])
@pytest.mark.parametrize("window, d_min", [(1, 1), (2, 3), (4, 2), (3, 10)])
def test_self_pair_one_pass_scoring_equals_token_by_token(window, d_min, start):
    stack = LayerStack(tiny_model("llama"))
    prompt, continuation = random_prompts(2, [7, NEW], seed=31)
    rows = [_one_pass_equals_stepwise(stack, _ead(SelfPair(2), tau, window, d_min, start), prompt, continuation)
            for tau in _taus(stack, prompt, continuation, 2)]
    held = min(d_min, NEW)  # the start model's tokens before it may hand over
    assert rows[0].reasons == [start] * held + ["small"] * (NEW - held)  # τ = 1e9: the small model, once allowed
    assert rows[-1].reasons == [start] * held + ["large"] * (NEW - held)  # τ = -1e9: the large model
    assert any(0 < r.reasons.count("small") < NEW and r.stats["switches"] > 0 for r in rows[1:-1])


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "gemma3_text"])
def test_self_pair_one_pass_scoring_switches_both_ways(arch):
    """Several continuations (random and generated), at a τ where the models take turns: the one-pass scores
    equal the token-by-token ones, and the switcher really moved both ways."""
    stack = LayerStack(tiny_model(arch))
    prompt, *randoms = random_prompts(4, [6, 30, 18, 25], seed=32)
    tau = _switching_tau(stack, prompt) + 3e-3  # off the entropy it is
    generated = generate(stack, TOK, [prompt], _ead(SelfPair(2), tau), NEW, eos_token_ids=[]).token_ids[0]
    ups = downs = 0
    for continuation in [generated, *randoms]:
        for window, d_min in ((2, 3), (1, 1)):
            row = _one_pass_equals_stepwise(stack, _ead(SelfPair(2), tau, window, d_min), prompt, continuation)
            turns = list(zip(row.reasons, row.reasons[1:]))
            ups += turns.count(("small", "large"))
            downs += turns.count(("large", "small"))
            assert row.stats["switches"] - sum(a != b for a, b in turns) in (0, 1)  # the last token may turn too
    assert ups > 0 and downs > 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_self_pair_one_pass_scoring_reads_out_through_the_tuned_readout(k):
    """The ``readout: tuned`` point: readouts at k go through the translator in both paths (and it matters)."""
    stack = LayerStack(tiny_model("llama"))
    prompt, continuation = random_prompts(2, [5, 20], seed=33)
    lens, switches = random_lens(), 0.0
    for window, d_min, start in ((2, 2, "small"), (1, 1, "large")):
        for tau in _taus(stack.with_readout(lens), prompt, continuation, k):
            method = _ead(SelfPair(k), tau, window, d_min, start)
            method.readout = lens
            switches += _one_pass_equals_stepwise(stack, method, prompt, continuation).stats["switches"]
    assert switches > 0
    logit = _ead(SelfPair(k), 1e9, d_min=1).teacher_forced(stack, prompt, continuation)
    tuned = _ead(SelfPair(k), 1e9, d_min=1).teacher_forced(stack.with_readout(lens), prompt, continuation)
    assert tuned.logprobs != pytest.approx(logit.logprobs, abs=1e-3)
    assert sum(tuned.flops) > sum(logit.flops)  # the translator is charged


def test_model_pair_scores_token_by_token():
    stack = LayerStack(tiny_model("llama"))
    small = LayerStack(tiny_model("llama", n_layers=2))
    prompt, continuation = random_prompts(2, [6, 16], seed=34)
    tau = _switching_tau(stack, prompt) + 3e-3
    ours = _ead(SelfPair(2), tau).teacher_forced(stack, prompt, continuation)
    theirs = _ead(ModelPair(small), tau).teacher_forced(stack, prompt, continuation)
    assert theirs.depths == ours.depths and theirs.logprobs == pytest.approx(ours.logprobs, abs=1e-5)
    assert theirs.stats == ours.stats


def test_sampling_is_seeded_and_rows_are_independent():
    stack = LayerStack(tiny_model("llama"))
    prompts = random_prompts(2, [5, 6], seed=26)
    sampling = Sampling(do_sample=True, temperature=1.0, seed=3)
    a = generate(stack, TOK, prompts, _ead(SelfPair(2)), 12, sampling, eos_token_ids=[])
    b = generate(stack, TOK, prompts, _ead(SelfPair(2)), 12, sampling, eos_token_ids=[])
    alone = generate(stack, TOK, prompts[1:], _ead(SelfPair(2)), 12, Sampling(True, 1.0, seed=4), eos_token_ids=[])
    assert a.token_ids == b.token_ids and a.token_ids[1] == alone.token_ids[0]


def test_eos_and_stop_strings_end_a_row():
    stack = LayerStack(tiny_model("llama"))
    prompt = random_prompts(1, [6], seed=27)[0]
    free = generate(stack, TOK, [prompt], _ead(SelfPair(2)), NEW, eos_token_ids=[]).token_ids[0]
    out = generate(stack, TOK, [prompt], _ead(SelfPair(2)), NEW, eos_token_ids=[free[5]])
    assert out.token_ids[0] == free[: free.index(free[5]) + 1] and out.finish_reasons == ["eos"]
    streamed = []
    out = generate(stack, TOK, [prompt], _ead(SelfPair(2)), NEW, stop_strings=[f"t{free[3]}"], eos_token_ids=[],
                   on_token=lambda r, t: streamed.append((r, t)))
    assert out.finish_reasons == ["stop_string"] and [t for _, t in streamed] == out.token_ids[0]


# ---------------------------------------------------------------------------------------------- strategies
def test_strategies_build_from_options():
    ead = STRATEGIES.get("ead").from_options(tau=1.5, small_layers=2, window=3, d_min=4)
    assert ead.describe() == {"method": "ead", "pair": "self", "small_layers": 2, "tau": 1.5, "window": 3,
                              "d_min": 4, "start": "small"}
    spec = STRATEGIES.get("speculative").from_options(exit_layer=2, draft_policy="adaedl", max_draft=6, gamma=0.3)
    assert spec.describe()["draft_policy"] == "adaedl" and spec.policy.gamma == 0.3 and spec.policy.n == 6
    conf = STRATEGIES.get("speculative").from_options(exit_layer=1, draft_policy="confidence", draft_confidence=0.2)
    assert conf.policy.c == 0.2
    loaded = []
    pair = STRATEGIES.get("ead").from_options(tau=1.0, small="tiny", load=lambda spec: (
        loaded.append(spec) or LayerStack(tiny_model("llama", n_layers=1)), None))
    assert loaded == ["tiny"] and isinstance(pair.pair, ModelPair)


def test_speculative_strategy_through_generate_equals_target_greedy():
    stack = LayerStack(tiny_model("llama"))
    prompts = random_prompts(2, [6, 9], seed=28)
    method = STRATEGIES.get("speculative").from_options(exit_layer=2, draft_policy="adaedl")
    out = generate(stack, TOK, prompts, method, NEW, eos_token_ids=[])
    full = generate(stack, TOK, prompts, Full(), NEW, eos_token_ids=[])
    assert out.token_ids == full.token_ids
    for ours, theirs in zip(out.traces, full.traces):
        assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-4)
    assert out.stats["verified_tokens"] == 2 * (NEW - 1)
    assert out.stats["verifications"] + out.stats["accepted"] == out.stats["verified_tokens"]
    assert out.cost_ratio() == pytest.approx(sum(map(sum, out.flops)) / sum(map(sum, out.full_flops)))
    scored = score_adaptive(stack, prompts[0], out.token_ids[0], method)
    assert scored.logprobs == pytest.approx([t.logprob for t in full.traces[0]], abs=1e-4)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("tau", [math.inf, -math.inf, math.nan, "1"])
def test_tau_must_be_finite(tau):
    with pytest.raises(ValueError, match="tau"):
        Switcher(tau)


@pytest.mark.parametrize("option,value", [("window", 0), ("d_min", 0), ("window", 1.5), ("start", "medium")])
def test_window_d_min_and_start_are_checked(option, value):
    with pytest.raises(ValueError, match=f"^{option}"):
        Switcher(1.0, **{option: value})


@pytest.mark.parametrize("k", [0, 4, -1])
def test_small_layers_outside_range_is_refused(k):
    stack = LayerStack(tiny_model("llama"))
    with pytest.raises(ValueError, match=rf"small_layers k={k}.*1\.\.3"):
        generate(stack, TOK, [[3, 4]], _ead(SelfPair(k)), 4)


def test_different_tokenizers_or_vocabularies_are_refused_naming_both():
    target = LayerStack(tiny_model("llama"))
    other = LayerStack(tiny_model("llama", seed=3, n_layers=1))
    with pytest.raises(ValueError, match=r"(?s)small model .*llama, 1 layers.* large model .*llama, 4 layers.*"
                                         r"different tokenizers"):
        generate(target, VocabTokenizer({"b": 0}), [[3, 4]], _ead(ModelPair(other, VocabTokenizer({"a": 0}))), 4)
    cfg = tiny_model("gpt2").config
    cfg.vocab_size = 50
    import transformers as tf

    small = LayerStack(tf.AutoModelForCausalLM.from_config(cfg).eval())
    with pytest.raises(ValueError, match=r"(?s)vocabulary 50.*vocabulary 96"):
        generate(target, TOK, [[3, 4]], _ead(ModelPair(small)), 4)


def test_from_options_needs_tau_and_exactly_one_small_model():
    make = STRATEGIES.get("ead").from_options
    with pytest.raises(ValueError, match="needs tau"):
        make(small_layers=2)
    with pytest.raises(ValueError, match="exactly one of small"):
        make(tau=1.0)
    with pytest.raises(ValueError, match="exactly one of small"):
        make(tau=1.0, small="x", small_layers=2)
    with pytest.raises(ValueError, match="needs exit_layer"):
        STRATEGIES.get("speculative").from_options()
    with pytest.raises(ValueError, match="adaedl, confidence, static"):
        STRATEGIES.get("speculative").from_options(exit_layer=1, draft_policy="greedy")
    with pytest.raises(ValueError, match=r"^n "):
        STRATEGIES.get("speculative").from_options(exit_layer=1, max_draft=0)
    with pytest.raises(ValueError, match=r"E=9.*1\.\.3"):
        generate(LayerStack(tiny_model("llama")), TOK, [[3, 4]],
                 STRATEGIES.get("speculative").from_options(exit_layer=9), 4)
