"""CALM-family and contrastive early exit: the top-2 gap, vocabulary pruning and its schedules and cost, the JSD
amateur choice, the plausibility set and contrastive distribution, batch invariance and scoring ≡ generation."""

from __future__ import annotations

import math

import pytest
import torch

from emad.decode import Method, generate, score_adaptive
from emad.decode.sweep_rows import BLOCK
from emad.engine.cost import CostModel
from emad.engine.fused import readout_scores, readout_scores_top2
from emad.engine.stack import LayerStack
from emad.evaluation.operating_point import PointConfig, build_method
from emad.exits.contrastive import (
    choose_amateur,
    contrastive_logprobs,
    contrastive_top,
    jsd,
    plausibility_alpha,
)
from emad.exits.criteria import Contrastive, ProbeView, SoftmaxResponse, fused_top2_gap, top2_gap
from emad.exits.estimators import ESTIMATORS, Prune, head_rows_logits
from tests.tiny import VOCAB, TinyTokenizer, random_prompts, tiny_model

TOK = TinyTokenizer()
NEW = 16


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


# ---------------------------------------------------------------------------------------------- softmax response
def test_top2_gap_on_hand_made_distributions():
    logits = torch.stack([_log([0.5, 0.3, 0.2]), _log([1 / 3] * 3), _log([0.98, 0.01, 0.01]),
                          torch.tensor([0.0, float("-inf"), float("-inf")])])
    assert top2_gap(logits).tolist() == pytest.approx([0.2, 0.0, 0.97, 1.0], abs=1e-6)
    assert top2_gap(torch.zeros(2, 1)).tolist() == [1.0, 1.0]


def test_top2_gap_over_a_wide_vocabulary_is_softmaxs_and_each_rows_own():
    """On SmolLM2's vocabulary (the fused kernel runs): the two largest softmax probabilities' difference, ties and
    pruned (-inf) logits included, and a row's gap does not depend on the other rows of a call of a sweep's block
    (BLOCK rows or more: a call of one row may split its reduction over threads, float rounding apart)."""
    torch.manual_seed(0)
    logits = torch.randn(37, 49152) * 4  # [r, V]
    logits[1, :2] = logits[1].max() + 1  # a tie at the top: gap 0
    logits[2, 100:] = float("-inf")  # pruned: 100 tokens left
    logits[3, 1:] = float("-inf")  # one token left: gap 1
    top = torch.softmax(logits, -1).topk(2, -1).values
    targets = torch.randint(0, 49152, (37,))
    *summary, with_summary = readout_scores_top2(logits, targets)  # the sweep's summary kernel
    for got, want in zip(summary, readout_scores(logits, targets)):
        assert torch.allclose(got.float(), want.float(), atol=1e-6)
    for gap in (top2_gap(logits), fused_top2_gap(logits), with_summary):
        assert torch.allclose(gap, top[:, 0] - top[:, 1], atol=1e-6)
    assert fused_top2_gap(logits)[1] == 0 and fused_top2_gap(logits)[3] == 1
    blocks = torch.cat([fused_top2_gap(logits[i:i + BLOCK]) for i in range(0, len(logits), BLOCK)])
    assert torch.equal(blocks, fused_top2_gap(logits))


def test_softmax_response_exits_on_the_gap_with_per_layer_thresholds():
    crit = SoftmaxResponse(threshold=0.5, layer_thresholds={3: 0.1}, probe_every=1)
    logits = torch.stack([_log([0.5, 0.3, 0.2]), _log([0.9, 0.05, 0.05])])  # gaps 0.2, 0.85
    view = lambda layer: ProbeView(layer, torch.zeros(2), torch.zeros(2), logits=logits)  # noqa: E731
    assert crit.exits(view(2)).tolist() == [False, True]
    assert crit.exits(view(3)).tolist() == [True, True]
    crit.validate(4)
    with pytest.raises(ValueError, match=r"layer_thresholds name layers \[5\]"):
        SoftmaxResponse(0.5, {5: 0.1}, probe_every=1).validate(4)


def test_softmax_response_never_and_always_exit():
    stack = LayerStack(tiny_model("llama"))
    prompts = random_prompts(2, [6, 9], seed=40)
    full = generate(stack, TOK, prompts, Method(SoftmaxResponse(2.0, probe_every=1)), NEW, eos_token_ids=[])
    ref = generate(stack, TOK, prompts, Method(SoftmaxResponse(2.0, probe_every=4)), NEW, eos_token_ids=[])
    assert full.token_ids == ref.token_ids and {d for row in full.depths for d in row} == {4}
    eager = generate(stack, TOK, prompts, Method(SoftmaxResponse(0.0, probe_every=1, min_exit_layer=2)), NEW,
                     eos_token_ids=[])
    assert {d for row in eager.depths for d in row[1:]} == {2}


# ---------------------------------------------------------------------------------------------- pruning
def _softmax_method(estimator, threshold=0.3, min_exit_layer=1) -> Method:
    return Method(SoftmaxResponse(threshold, probe_every=1, min_exit_layer=min_exit_layer), "monotone", estimator)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "opt"])
def test_pruning_with_k_equal_to_v_is_no_pruning(arch):
    stack = LayerStack(tiny_model(arch))
    prompts = random_prompts(2, [5, 8], seed=41)
    exact = generate(stack, TOK, prompts, _softmax_method(ESTIMATORS.get("exact")()), NEW, eos_token_ids=[])
    pruned = generate(stack, TOK, prompts, _softmax_method(Prune(VOCAB)), NEW, eos_token_ids=[])
    assert pruned.token_ids == exact.token_ids and pruned.depths == exact.depths
    for a, b in zip(pruned.traces, exact.traces):
        assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-4)


def _probe_sequence(estimator: Prune, stack: LayerStack, h: torch.Tensor, layers: list[int]):
    estimator.begin(len(h))
    return [estimator.estimate(stack, h, layer) for layer in layers]


def test_head_rows_logits_are_each_rows_products_with_its_own_head_rows():
    """A pruned probe's logits over a wide vocabulary (the fused kernel runs): ``weight[ids[i, j]] · x[i]`` as the
    gathered product gives them (float rounding), and a row's logits do not depend on the other rows of a call of
    BLOCK rows or more."""
    torch.manual_seed(1)
    weight, x = torch.randn(49152, 64), torch.randn(21, 64)
    ids = torch.randint(0, 49152, (21, 256))
    z = head_rows_logits(weight, ids, x)  # [a, w]
    assert torch.allclose(z, torch.bmm(weight[ids], x[:, :, None])[:, :, 0], atol=1e-4)
    blocks = torch.cat([head_rows_logits(weight, ids[i:i + BLOCK], x[i:i + BLOCK]) for i in range(0, len(x), BLOCK)])
    assert torch.equal(blocks, z)


def test_pruned_probe_reads_only_the_kept_rows_and_maps_back():
    stack = LayerStack(tiny_model("llama"))
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    first, later = _probe_sequence(Prune(8), stack, h, [1, 2])
    full = stack.readout(h)
    kept = full.topk(8, dim=-1).indices
    torch.testing.assert_close(first.logits, full)
    finite = torch.isfinite(later.logits)
    assert finite.sum(-1).tolist() == [8, 8, 8]
    assert torch.equal(finite, torch.zeros_like(finite).scatter(1, kept, True))
    torch.testing.assert_close(later.logits.gather(1, kept), full.gather(1, kept), rtol=1e-5, atol=1e-5)
    assert torch.equal(later.logits.argmax(-1), full.argmax(-1))  # the full argmax is kept: the token maps back
    cost = CostModel.from_stack(stack)
    assert first.cost[0].tolist() == [cost.readout_flops] * 3
    assert later.cost[0].tolist() == [2.0 * 64 * 8] * 3


def test_decaying_k_shrinks_linearly_from_k0_to_k_star():
    stack = LayerStack(tiny_model("llama"))  # L = 4
    h = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    ests = _probe_sequence(Prune(40, "decay", 10), stack, h, [1, 2, 3, 4])
    # j = 1: k_l = round(40 + (10 - 40) * (l - 1) / 3) = 30, 20, 10 at l = 2, 3, 4
    assert [int(torch.isfinite(e.logits[0]).sum()) for e in ests[1:]] == [30, 20, 10]
    assert [e.cost[0][0].item() for e in ests[1:]] == [2.0 * 64 * k for k in (30, 20, 10)]
    # each later set holds the best tokens of the previous probe's set
    for before, after in zip(ests[1:], ests[2:]):
        kept = torch.isfinite(after.logits[0])
        best = before.logits[0].topk(int(kept.sum())).indices
        assert kept[best].all()


def test_adaptive_k_follows_the_previous_confidence():
    stack = LayerStack(tiny_model("llama"))
    h = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    ests = _probe_sequence(Prune(prune_schedule="adaptive"), stack, h, [1, 2, 3])
    for before, after in zip(ests, ests[1:]):
        previous = torch.isfinite(before.logits).sum(-1)
        want = torch.ceil(VOCAB * (1 - 0.9 * before.max_prob.double())).long()
        assert torch.isfinite(after.logits).sum(-1).tolist() == torch.minimum(want, previous).tolist()


def test_pruning_saves_probe_flops_in_generation():
    stack = LayerStack(tiny_model("llama"))
    prompts = random_prompts(1, [6], seed=42)
    method = lambda est: _softmax_method(est, threshold=2.0)  # noqa: E731  never exits: every probe is paid
    exact = generate(stack, TOK, prompts, method(ESTIMATORS.get("exact")()), NEW, eos_token_ids=[])
    pruned = generate(stack, TOK, prompts, method(Prune(8)), NEW, eos_token_ids=[])
    cost = CostModel.from_stack(stack)
    saved = (cost.readout_flops - 2 * 64 * 8) * 2  # probes 2 and 3 are pruned (4 is the last: no estimate)
    per_token = [a - b for a, b in zip(exact.flops[0][1:], pruned.flops[0][1:])]
    assert per_token == pytest.approx([saved] * (NEW - 1))


# ---------------------------------------------------------------------------------------------- contrastive
def test_jsd_and_the_amateur_choice_on_constructed_readouts():
    p = _log([0.7, 0.2, 0.1])
    far, same, near = _log([0.05, 0.05, 0.9]), _log([0.7, 0.2, 0.1]), _log([0.2, 0.2, 0.6])  # layers 3, 6, 8
    assert jsd(p, same).item() == pytest.approx(0.0, abs=1e-7)
    assert jsd(p, far).item() == pytest.approx(jsd(far, p).item()) and jsd(p, far) <= math.log(2)
    assert jsd(p, near) < jsd(p, far)
    candidates = torch.stack([far, same, near])[:, None]  # [C=3, a=1, V]
    assert choose_amateur(p[None], candidates, 9, [3, 6, 8], 0.0).tolist() == [0]  # the largest JSD
    # a strong distance discount prefers the nearer layer: JSD(far)/(1 + 5·6) < JSD(near)/(1 + 5·1)
    assert jsd(p, far) / 31 < jsd(p, near) / 6
    assert choose_amateur(p[None], candidates, 9, [3, 6, 8], 5.0).tolist() == [2]
    # per row: a second row whose nearest candidate is farthest in JSD picks it
    two = torch.stack([torch.stack([far, p]), torch.stack([same, p]), torch.stack([near, far])])  # [3, 2, V]
    assert choose_amateur(torch.stack([p, p]), two, 9, [3, 6, 8], 0.0).tolist() == [0, 2]


def test_alpha_schedule_and_plausibility_set():
    conf = torch.tensor([0.6, 0.2])
    alpha = plausibility_alpha(0.5, 0.25, 4, conf)  # 0.5 / (1 + 1) · (1 - c)
    assert alpha.tolist() == pytest.approx([0.1, 0.2])
    logp = torch.stack([_log([0.6, 0.3, 0.05, 0.05]), _log([0.2, 0.2, 0.35, 0.25])])
    logq = torch.stack([_log([0.25] * 4), _log([0.4, 0.1, 0.4, 0.1])])
    out = contrastive_logprobs(logp, logq, alpha).exp()
    # row 0: plausible p >= 0.1 · 0.6 -> tokens 0, 1; row 1: p >= 0.2 · 0.35 -> all four
    assert (out[0] > 0).tolist() == [True, True, False, False] and (out[1] > 0).all()
    assert out.sum(-1).tolist() == pytest.approx([1.0, 1.0])
    ratio = torch.tensor([0.6 / 0.25, 0.3 / 0.25])
    assert out[0, :2].tolist() == pytest.approx((ratio / ratio.sum()).tolist())
    expert = contrastive_logprobs(logp, logq, alpha, weight=0.0).exp()  # w = 0: the expert on its set
    assert expert[1].tolist() == pytest.approx([0.2, 0.2, 0.35, 0.25])
    half = contrastive_logprobs(logp, logq, alpha, weight=0.5).exp()[1]
    raw = torch.tensor([0.2, 0.2, 0.35, 0.25]) / torch.tensor([0.4, 0.1, 0.4, 0.1]).sqrt()
    assert half.tolist() == pytest.approx((raw / raw.sum()).tolist())


@pytest.mark.parametrize("vocab", [7, 49152])  # eager and fused
def test_contrastive_top_is_the_contrastive_distributions_top_probability(vocab):
    torch.manual_seed(2)
    logp = torch.log_softmax(torch.randn(19, vocab) * 3, -1)
    logq = torch.log_softmax(torch.randn(19, vocab) * 3, -1)
    logq[0, :3] = float("-inf")  # the amateur gives some tokens no probability
    for alpha, rate, layer, weight in ((0.1, 0.0, 6, 1.0), (0.5, 0.25, 4, 0.5), (0.0, 0.0, 3, 1.0)):
        prime = plausibility_alpha(alpha, rate, layer, logp.max(-1).values.exp())
        want = contrastive_logprobs(logp, logq, prime, weight).max(-1).values.exp()  # [a]
        got = contrastive_top(logp, logq, alpha / (1 + rate * layer), weight)
        assert torch.allclose(got, want, atol=1e-6), (alpha, rate, layer, weight)


def test_contrastive_output_changes_tokens_and_never_exit_without_it_is_full_depth():
    stack = LayerStack(tiny_model("llama"))
    prompts = random_prompts(2, [6, 7], seed=43)
    full = generate(stack, TOK, prompts, Method(SoftmaxResponse(2.0, probe_every=4)), NEW, eos_token_ids=[])
    plain = generate(stack, TOK, prompts, Method(Contrastive(2.0, probe_every=1)), NEW, eos_token_ids=[])
    assert plain.token_ids == full.token_ids
    dola = generate(stack, TOK, prompts, Method(Contrastive(2.0, alpha=0.1, probe_every=1, contrastive_output=True)),
                    NEW, eos_token_ids=[])
    assert dola.token_ids != full.token_ids and {d for row in dola.depths for d in row[1:]} == {4}


# ---------------------------------------------------------------------------------------------- semantics
CRITERIA_UNDER_TEST = {
    "softmax-exact": lambda: _softmax_method(ESTIMATORS.get("exact")(), 0.2, 2),
    "softmax-prune": lambda: _softmax_method(Prune(12), 0.2, 2),
    "softmax-decay": lambda: _softmax_method(Prune(40, "decay", 6), 0.1),
    "softmax-adaptive": lambda: _softmax_method(Prune(prune_schedule="adaptive"), 0.1),
    "contrastive": lambda: Method(Contrastive(0.5, alpha=0.2, alpha_rate=0.1, distance_discount=0.5, probe_every=1)),
    "contrastive-output": lambda: Method(Contrastive(0.3, alpha=0.1, probe_every=1, contrastive_output=True,
                                                     contrast_weight=0.5)),
}


@pytest.mark.parametrize("name", sorted(CRITERIA_UNDER_TEST))
def test_every_new_criterion_is_batch_invariant(name):
    stack = LayerStack(tiny_model("llama"))
    prompts = random_prompts(3, [5, 9, 7], seed=44)
    batch = generate(stack, TOK, prompts, CRITERIA_UNDER_TEST[name](), NEW, eos_token_ids=[])
    assert len({d for row in batch.depths for d in row}) > 1  # exits happen at several depths
    for i, prompt in enumerate(prompts):
        alone = generate(stack, TOK, [prompt], CRITERIA_UNDER_TEST[name](), NEW, eos_token_ids=[])
        assert alone.token_ids[0] == batch.token_ids[i] and alone.depths[0] == batch.depths[i]
        assert alone.flops[0] == pytest.approx(batch.flops[i])


@pytest.mark.parametrize("name", sorted(CRITERIA_UNDER_TEST))
def test_scoring_follows_generation(name):
    stack = LayerStack(tiny_model("llama"))
    prompt = random_prompts(1, [6], seed=45)[0]
    out = generate(stack, TOK, [prompt], CRITERIA_UNDER_TEST[name](), NEW, eos_token_ids=[])
    for parallel in (None, False):
        scored = score_adaptive(stack, prompt, out.token_ids[0], CRITERIA_UNDER_TEST[name](), parallel=parallel)
        assert scored.depths == out.depths[0]
        assert scored.logprobs == pytest.approx([t.logprob for t in out.traces[0]], abs=1e-4)
        assert scored.flops == pytest.approx(sum(out.flops[0]))
        assert all(scored.greedy)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make, culprit", [
    (lambda: Prune(0), "prune_k"), (lambda: Prune(-3), "prune_k"), (lambda: Prune(8, "cubic"), "prune_schedule"),
    (lambda: Prune(8, "decay"), "prune_k_min"), (lambda: Prune(8, "decay", 9), "prune_k_min"),
    (lambda: Contrastive(0.5, alpha=1.5), "alpha"), (lambda: Contrastive(0.5, alpha=-0.1), "alpha"),
    (lambda: Contrastive(-1.0), "threshold"), (lambda: SoftmaxResponse(float("nan")), "threshold"),
    (lambda: SoftmaxResponse(0.5, {2: -1.0}), r"layer_thresholds\[2\]"),
])
def test_bad_options_name_the_parameter(make, culprit):
    with pytest.raises(ValueError, match=culprit):
        make()


def test_k_above_the_vocabulary_and_estimators_without_readouts_are_refused():
    stack = LayerStack(tiny_model("llama"))
    with pytest.raises(ValueError, match=rf"prune_k = {VOCAB + 1} is outside 1\.\.{VOCAB}"):
        generate(stack, TOK, [[3, 4]], _softmax_method(Prune(VOCAB + 1)), 4)
    with pytest.raises(ValueError, match=r"'softmax' reads each probe's readout.*exact, prune.*'topk'"):
        build_method(PointConfig(method="softmax", threshold=0.5, estimator="topk"), 4, {}, estimators_path="x")
    point = PointConfig(method="softmax", threshold=0.4, estimator="prune", prune_k=16, prune_schedule="decay",
                        prune_k_min=4, layer_thresholds={3: 0.2})
    method = build_method(point, 4, {})
    assert method.describe()["prune_k_min"] == 4 and method.criterion.layer_thresholds == {3: 0.2}
