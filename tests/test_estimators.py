"""Cheap entropy estimators: exact in their limits, fitted corrections, stored beside the profile."""

from __future__ import annotations

import pytest
import torch

from emad.calibration import estimator_fit
from emad.calibration.calibrate import windows
from emad.calibration.estimator_fit import EstimatorFitError
from emad.decode import Method, generate
from emad.engine.cost import CostModel
from emad.engine.stack import LayerStack
from emad.exits.criteria import Confidence
from emad.exits.estimators import ESTIMATORS, LowRank, TopK, head_svd
from tests.tiny import VOCAB, TinyTokenizer, random_prompts, tiny_model


@pytest.fixture(scope="module")
def stack():
    return LayerStack(tiny_model("llama"))


@pytest.fixture(scope="module")
def sample(stack):
    return estimator_fit.collect(stack, windows(random_prompts(10, [20], seed=21), 20), [1, 2, 3, 4])


def _hidden(seed=0):
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(seed)) * 3


def test_topk_with_k_equal_v_and_lowrank_with_r_equal_d_equal_exact(stack):
    h = _hidden()
    exact = ESTIMATORS.get("exact")().estimate(stack, h, 2)
    with torch.inference_mode():
        topk = TopK(VOCAB, correction={2: (0.5, 1.0)}).estimate(stack, h, 2)
        low = LowRank(64, correction={2: (0.5, 1.0)}).estimate(stack, h, 2)
    torch.testing.assert_close(topk.entropy, exact.entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(low.entropy, exact.entropy, atol=1e-3, rtol=0)


def test_low_rank_estimators_of_one_head_share_its_svd_until_the_weight_changes(monkeypatch):
    weight = torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(3))
    u, s, vh = head_svd(weight)
    assert head_svd(weight)[0] is u  # computed once
    torch.testing.assert_close((u * s) @ vh, weight, atol=1e-4, rtol=0)
    with torch.no_grad():
        weight[0] += 1.0  # an in-place change: the SVD is taken again
    u2, s2, vh2 = head_svd(weight)
    assert u2 is not u
    torch.testing.assert_close((u2 * s2) @ vh2, weight, atol=1e-4, rtol=0)
    stack = LayerStack(tiny_model("llama"))
    h = _hidden(1)
    calls = []
    svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: calls.append(1) or svd(*a, **k))
    with torch.inference_mode():
        est = [LowRank(r).estimate(stack, h, 2).entropy for r in (8, 16, 8)]
    assert len(calls) == 1  # one SVD for three estimators of one head
    assert torch.equal(est[0], est[2]) and not torch.equal(est[0], est[1])


def test_smaller_estimators_are_cheaper_and_approximate(stack, sample):
    cost = CostModel.from_stack(stack)
    exact_flops = ESTIMATORS.get("exact")().probe_cost(cost)[0]
    assert TopK(16).probe_cost(cost)[0] == 2 * 64 * 16 < exact_flops
    assert LowRank(8).probe_cost(cost)[0] == 2 * 8 * (64 + VOCAB)
    est = estimator_fit.build("topk", {"k": 16}, stack, sample)
    assert len(est.shortlist) == 16 and len(set(est.shortlist)) == 16
    report = estimator_fit.fit(stack, est, sample)
    assert set(report["correction"]) == {"1", "2", "3", "4"}
    assert report["mae"]["all"] >= 0 and report["mae_raw"]["all"] > 0


def test_fit_recovers_a_linear_relation():
    class Scaled(TopK):
        """Raw estimate = (exact - 1) / 2: the fitted correction must undo it."""

        def estimate(self, stack, h, layer, rows=None):
            exact = ESTIMATORS.get("exact")().estimate(stack, h, layer)
            exact.entropy = self.corrected((exact.entropy - 1.0) / 2.0, layer)
            return exact

    stack = LayerStack(tiny_model("qwen2"))
    sample = estimator_fit.collect(stack, windows(random_prompts(6, [16], seed=22), 16), [2, 4])
    est = Scaled(8)
    report = estimator_fit.fit(stack, est, sample)
    for slope, intercept in report["correction"].values():
        assert slope == pytest.approx(2.0, abs=1e-4) and intercept == pytest.approx(1.0, abs=1e-4)
    assert report["mae"]["all"] < 1e-4 < report["mae_raw"]["all"]


def test_save_load_round_trip_and_refusals(stack, sample, tmp_path):
    model = {"model_type": "llama", "n_layers": 4, "hidden_size": 64, "vocab_size": VOCAB, "tokenizer_sha256": "t"}
    est = estimator_fit.build("lowrank", {"rank": 8}, stack, sample)
    report = estimator_fit.fit(stack, est, sample)
    path = tmp_path / "estimators.json"
    estimator_fit.save(path, {"lowrank": {"options": est.options(), **report}}, model, [1, 2, 3, 4])
    back = estimator_fit.load(path, "lowrank", model, [2, 4])
    h = _hidden(1)
    with torch.inference_mode():
        torch.testing.assert_close(back.estimate(stack, h, 3).entropy, est.estimate(stack, h, 3).entropy)
    with pytest.raises(EstimatorFitError, match="'topk' was not fitted"):
        estimator_fit.load(path, "topk", model)
    with pytest.raises(EstimatorFitError, match="fitted for model"):
        estimator_fit.load(path, "lowrank", {**model, "tokenizer_sha256": "other"})
    with pytest.raises(EstimatorFitError, match="probes"):
        estimator_fit.load(path, "lowrank", model, [5])
    path.write_text(path.read_text()[:40])
    with pytest.raises(EstimatorFitError, match="truncated"):
        estimator_fit.load(path, "lowrank", model)


@pytest.mark.parametrize("build, culprit", [
    (lambda: TopK(0), "k must be"),
    (lambda: LowRank(0), "rank must be"),
])
def test_bad_estimator_options(build, culprit):
    with pytest.raises(ValueError, match=culprit):
        build()


@pytest.mark.parametrize("est, culprit", [(TopK(VOCAB + 1), "exceeds the vocabulary"),
                                         (LowRank(65), "exceeds the hidden size")])
def test_estimator_larger_than_the_model_is_refused(stack, est, culprit):
    with pytest.raises(ValueError, match=culprit):
        est.estimate(stack, _hidden(), 1)


def test_decoding_with_a_cheap_estimator_charges_its_probe_cost(stack, sample):
    est = estimator_fit.build("topk", {"k": 16}, stack, sample)
    estimator_fit.fit(stack, est, sample)
    out = generate(stack, TinyTokenizer(), random_prompts(2, [6, 8], seed=23),
                   Method(Confidence(2.0, probe_every=1), "backfill", est), 10, eos_token_ids=[])
    assert out.method["estimator"] == "topk" and out.method["k"] == 16
    assert all(len(t.entropies) >= 1 for row in out.traces for t in row[1:])
