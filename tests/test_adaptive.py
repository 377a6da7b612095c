"""Adaptive-depth decoding: criteria, KV policies and scoring (the spec of the EMAD engine)."""

from __future__ import annotations

import math

import pytest
import torch

from emad.calibration.calibrate import calibrate, windows
from emad.calibration.profile import ProfileError, smooth
from emad.decode import Method, generate, score_adaptive, score_continuations, score_requests
from emad.engine.stack import LayerStack
from emad.exits.criteria import Confidence, Emad, Fixed, Full, ProbeView
from emad.exits.estimators import Estimate
from emad.exits.strata import Strata
from tests.tiny import ScriptedEstimator, TinyTokenizer, random_prompts, tiny_model

NEW = 24


@pytest.fixture(scope="module")
def llama():
    return LayerStack(tiny_model("llama", n_layers=None))


@pytest.fixture(scope="module")
def profile(llama):
    docs = random_prompts(12, [24], seed=11)
    stats = calibrate(llama, windows(docs, 24), [1, 2, 3, 4], Strata(position_edges=(8,)), batch_size=4)
    return smooth(stats, min_count=5)


def _median_threshold(stack) -> float:
    """An entropy threshold that some probes pass and some do not."""
    out = generate(stack, TinyTokenizer(), random_prompts(2, [6, 9], seed=12),
                   Method(Confidence(threshold=0.0, probe_every=1)), 12, eos_token_ids=[])
    seen = [e for row in out.traces for t in row for e in t.entropies.values()]
    return float(torch.tensor(seen).median())


def _gen(stack, method, prompts=None, new=NEW):
    prompts = prompts or random_prompts(3, [7, 11, 5], seed=13)
    return generate(stack, TinyTokenizer(), prompts, method, new, eos_token_ids=[])


def test_emad_with_infinite_margin_and_fixed_full_are_full_depth(llama, profile):
    full = _gen(llama, Full())
    assert _gen(llama, Emad(profile, math.inf)).token_ids == full.token_ids
    assert _gen(llama, Fixed(4)).token_ids == full.token_ids


def test_monotone_trace_never_increases_and_exits_early(llama):
    out = _gen(llama, Method(Confidence(_median_threshold(llama), probe_every=1)))
    assert any(d < 4 for row in out.depths for d in row)
    for row in out.depths:
        assert all(b <= a for a, b in zip(row, row[1:]))
    assert out.cost_ratio() < 1


@pytest.mark.parametrize("policy", ["copy", "backfill"])
def test_depth_may_rise_under_copy_and_backfill(llama, policy):
    out = _gen(llama, Method(Confidence(_median_threshold(llama), probe_every=1), policy))
    assert any(b > a for row in out.depths for a, b in zip(row, row[1:]))
    assert sum(out.policy_token_layers) > 0 and out.policy_share() > 0


def test_backfill_equals_full_recompute_of_the_same_depths(llama):
    model = llama.model
    prompt = random_prompts(1, [8], seed=14)[0]
    method = Method(Confidence(_median_threshold(llama), probe_every=1), "backfill")
    gen = generate(llama, TinyTokenizer(), [prompt], method, NEW, eos_token_ids=[])
    cont, depths = gen.token_ids[0], gen.depths[0]
    assert len(set(depths)) > 1
    seq = torch.tensor([prompt + cont])
    with torch.inference_mode():
        hidden = model(seq, output_hidden_states=True).hidden_states
    for t, (token, depth) in enumerate(zip(cont, depths)):
        pos = len(prompt) - 1 + t  # the position whose readout predicted this token
        h = hidden[depth][0, pos] if depth < 4 else None
        logits = llama.readout(h) if h is not None else model(seq[:, : pos + 1]).logits[0, -1]
        expected = torch.log_softmax(logits.detach().float(), -1)[token]
        assert gen.traces[0][t].logprob == pytest.approx(float(expected), abs=1e-4)


def test_copy_writes_deeper_kv_from_the_copied_state(llama):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from emad.decode import prefill
    from emad.decode.step import step
    from emad.engine.cost import CostModel
    from emad.exits.policies import Copy

    model, cost = llama.model, CostModel.from_stack(llama)
    prompt = torch.tensor([random_prompts(1, [6], seed=15)[0]])
    cache = llama.new_cache(1, 8)
    prefill(llama, cache, prompt, torch.ones_like(prompt, dtype=torch.bool), 4)
    before = [k.clone() for k in cache.keys]
    method = Method(Confidence(threshold=1e9, probe_every=1), "copy")  # every token exits at layer 1
    token, pos = torch.tensor([7]), torch.tensor([6])
    out = step(llama, cache, method, Copy(1, 4, 4, cost), cost, token, pos, torch.tensor([0]))
    assert out.depths.tolist() == [1]
    with torch.inference_mode():
        h1 = model(torch.cat([prompt, token[None]], 1), output_hidden_states=True).hidden_states[1][:, 6:]
        for j in range(1, 4):  # deeper layers: K from the copied layer-1 state, through that layer's projection
            layer = model.model.layers[j]
            x = layer.input_layernorm(h1)
            k = layer.self_attn.k_proj(x).view(1, 1, -1, 16).transpose(1, 2)
            cos, sin = model.model.rotary_emb(x, pos[None])
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            torch.testing.assert_close(cache.keys[j][0, :, 6], k[0, :, 0], atol=1e-5, rtol=0)
    for j in range(4):
        torch.testing.assert_close(cache.keys[j][:, :, :6], before[j][:, :, :6])  # the prompt is untouched
    assert cache.valid[:, 0, 6].all()


@pytest.mark.parametrize("policy", ["monotone", "copy", "backfill"])
def test_batch_with_mixed_lengths_equals_rows_alone(llama, policy):
    method = Method(Confidence(_median_threshold(llama), probe_every=1), policy)
    prompts = random_prompts(4, [10, 3, 7, 12], seed=16)
    batch = _gen(llama, method, prompts)
    for i, p in enumerate(prompts):
        alone = _gen(llama, method, [p])
        assert alone.token_ids[0] == batch.token_ids[i]
        assert alone.depths[0] == batch.depths[i]


@pytest.mark.parametrize("policy", ["monotone", "copy", "backfill"])
def test_scoring_equals_generation_logprobs_and_depths(llama, profile, policy):
    margin = -0.5 if policy == "monotone" else 0.0
    criterion = Emad(profile, margin) if margin >= 0 else Confidence(_median_threshold(llama), probe_every=1)
    method = Method(criterion, policy)
    prompt = random_prompts(1, [9], seed=17)[0]
    gen = generate(llama, TinyTokenizer(), [prompt], method, NEW, eos_token_ids=[])
    scored = score_adaptive(llama, prompt, gen.token_ids[0], method)
    assert scored.depths == gen.depths[0]
    assert scored.logprobs == pytest.approx([t.logprob for t in gen.traces[0]], abs=1e-5)
    assert scored.cost_ratio == pytest.approx(gen.cost_ratio(), rel=1e-6)




@pytest.mark.parametrize("policy", ["copy", "backfill", "copy-translated"])
def test_requests_scored_as_one_batch_equal_each_request_alone(llama, policy):
    """Token-by-token scoring of many requests (prompts of several lengths, continuations of several lengths,
    one of a single token) as one batch gives each continuation what scoring its request alone gives."""
    method = Method(Confidence(_median_threshold(llama), probe_every=1), policy)
    prompts = random_prompts(3, [9, 4, 13], seed=26)
    requests = [(prompts[0], random_prompts(2, [12, 5], seed=27)), (prompts[1], random_prompts(1, [1], seed=28)),
                (prompts[2], random_prompts(3, [16, 8, 2], seed=29))]
    together = score_requests(llama, requests, method)
    assert [len(r) for r in together] == [2, 1, 3]
    rose = False
    for (prompt, continuations), got in zip(requests, together):
        for g, want in zip(got, score_continuations(llama, prompt, continuations, method)):
            assert g.depths == want.depths and g.greedy == want.greedy
            assert g.logprobs == pytest.approx(want.logprobs, abs=1e-5)
            assert g.flops == pytest.approx(want.flops, rel=1e-9)
            assert g.full_flops == pytest.approx(want.full_flops, rel=1e-9)
            rose |= any(b > a for a, b in zip(g.depths, g.depths[1:]))
    assert rose  # the policy's own work (depth rising) was exercised


@pytest.mark.parametrize("table, threshold, min_exit, expected", [
    ({1: 3.0, 2: 2.0, 3: 0.5, 4: 0.1}, 1.0, 1, 3),
    ({1: 0.2, 2: 2.0, 3: 0.5, 4: 0.1}, 1.0, 1, 1),
    ({1: 0.2, 2: 2.0, 3: 0.5, 4: 0.1}, 1.0, 2, 3),
    ({1: 3.0, 2: 3.0, 3: 3.0, 4: 3.0}, 1.0, 1, 4),
])
def test_confidence_picks_the_first_probe_under_threshold(llama, table, threshold, min_exit, expected):
    method = Method(Confidence(threshold, probe_every=1, min_exit_layer=min_exit), "backfill", ScriptedEstimator(table))
    out = _gen(llama, method, random_prompts(1, [5], seed=18), new=4)
    assert out.depths[0][1:] == [expected] * 3


def test_monotone_caps_depth_at_the_previous_token(llama):
    # first step exits at 2; later Ĥ would only pass at 4, but monotone keeps depth 2
    class Falling(ScriptedEstimator):
        def __init__(self):
            self.calls = 0

        def estimate(self, stack, h, layer, rows=None):
            self.calls += 1
            value = 0.1 if (self.calls <= 2 and layer == 2) else 5.0
            return Estimate(torch.full((h.shape[0],), value), torch.full((h.shape[0],), 0.5), None)

    out = _gen(llama, Method(Confidence(1.0, probe_every=1), "monotone", Falling()),
               random_prompts(1, [5], seed=19), new=5)
    assert out.depths[0][1:] == [2, 2, 2, 2]
    assert {t.reason for t in out.traces[0][2:]} == {"depth_cap"}


def test_emad_uses_the_stratum_of_each_token(profile):
    crit = Emad(profile, margin=0.0)
    table = profile.table()
    view = ProbeView(2, torch.tensor([0.0, 100.0, 0.0]), torch.tensor([3, 3, 20]))
    got = crit.exits(view)
    assert got.tolist() == [bool(0.0 <= table[0, 1]), False, bool(0.0 <= table[1, 1])]
    view = ProbeView(2, table[:, 1] + 1e-3, torch.tensor([3, 20]))
    assert crit.exits(view).tolist() == [False, False]


@pytest.mark.parametrize("build, culprit", [
    (lambda p: Emad(p, -1.0), "margin"),
    (lambda p: Emad(p, float("nan")), "margin"),
    (lambda p: Confidence(float("nan")), "threshold"),
    (lambda p: Confidence(-0.1), "threshold"),
])
def test_bad_margin_or_threshold_is_refused(profile, build, culprit):
    with pytest.raises(ValueError, match=culprit):
        build(profile)


@pytest.mark.parametrize("criterion, culprit", [
    (lambda p: Emad(p, 0.5, min_exit_layer=0), "min_exit_layer"),
    (lambda p: Confidence(1.0, min_exit_layer=9), "min_exit_layer"),
    (lambda p: Confidence(1.0, probe_every=0), "probe_every"),
])
def test_bad_layers_fail_before_decoding(llama, profile, criterion, culprit):
    with pytest.raises(ValueError, match=culprit):
        _gen(llama, criterion(profile))


def test_profile_of_another_depth_or_model_is_refused(profile):
    shallow = LayerStack(tiny_model("llama", n_layers=3))
    with pytest.raises(ValueError, match="probe layers"):
        _gen(shallow, Emad(profile, 0.5))
    mine = {"model_type": "llama", "n_layers": 4, "tokenizer_sha256": "x"}
    with pytest.raises(ProfileError, match="tokenizer_sha256"):
        type(profile)(profile.probe_layers, profile.strata, profile.tau, model=mine).check_model(
            {**mine, "tokenizer_sha256": "y"})


def test_unknown_policy_lists_valid_names():
    with pytest.raises(KeyError, match="backfill, copy, copy-translated, monotone"):
        Method(Full(), "sometimes")


@pytest.mark.parametrize("criterion", ["emad", "confidence", "fixed", "min_exit"])
def test_parallel_monotone_scoring_equals_token_by_token(llama, profile, criterion):
    crit = {"emad": lambda: Emad(profile, 0.0), "fixed": lambda: Fixed(2),
            "confidence": lambda: Confidence(_median_threshold(llama), probe_every=1),
            "min_exit": lambda: Confidence(_median_threshold(llama), probe_every=1, min_exit_layer=3)}[criterion]()
    prompt = random_prompts(1, [7], seed=24)[0]
    cont = random_prompts(1, [20], seed=25)[0]
    fast = score_adaptive(llama, prompt, cont, Method(crit), parallel=True)
    slow = score_adaptive(llama, prompt, cont, Method(crit), parallel=False)
    assert fast.depths == slow.depths
    assert fast.logprobs == pytest.approx(slow.logprobs, abs=1e-5)
    assert fast.flops == pytest.approx(slow.flops, rel=1e-9)
    assert fast.full_flops == pytest.approx(slow.full_flops, rel=1e-9)
    one = score_adaptive(llama, prompt, cont[:1], Method(crit))  # a one-token continuation
    assert one.logprobs == pytest.approx(slow.logprobs[:1], abs=1e-5) and one.depths == slow.depths[:1]
