"""Calibration statistics, stratification, smoothing and profile io (the spec of the calibrate/smooth stages)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.optimize import isotonic_regression

from emad.calibration.calibrate import accumulate_batch, calibrate, resolve_probe_layers, windows
from emad.calibration.profile import Profile, ProfileError, smooth
from emad.calibration.stats import CalibrationStats, StatsFormatError
from emad.decode import positions_of
from emad.engine.entropy import entropy_from_logits
from emad.engine.stack import LayerStack
from emad.exits.strata import Strata
from tests.tiny import random_prompts, tiny_model


def _stats(probes=(1, 2, 3), strata=Strata(), vocab=100, bins=10) -> CalibrationStats:
    return CalibrationStats(list(probes), strata, vocab, bins)


def test_statistics_on_a_hand_computed_example():
    st = _stats()
    entropy = torch.tensor([[3.0, 2.0, 1.0], [1.0, 1.0, 0.5]])
    argmax = torch.tensor([[5, 7, 7], [4, 9, 4]])
    st.add(entropy, argmax, torch.tensor([0, 0]))
    assert st.count.tolist() == [[2, 2, 2]]
    assert st.sum.tolist() == [[4.0, 3.0, 1.5]]
    assert st.sumsq.tolist() == [[10.0, 5.0, 1.25]]
    assert st.agree.tolist() == [1, 1, 2]  # token 0 agrees at probes 2, 3; token 1 at probes 1, 3
    assert st.oracle.tolist() == [1, 1, 0]  # shallowest agreeing probe: token 0 → probe 2, token 1 → probe 1
    width = math.log(100) / 10
    assert st.hist[0, 0].nonzero()[0].tolist() == sorted({int(3.0 / width), int(1.0 / width)})
    assert st.mean()[0].tolist() == pytest.approx([2.0, 1.5, 0.75])
    assert st.tokens == 2


def test_merge_of_shards_equals_one_pass():
    g = torch.Generator().manual_seed(0)
    entropy, argmax = torch.rand(50, 3, generator=g) * 4, torch.randint(0, 5, (50, 3), generator=g)
    strata = Strata(position_edges=(3, 7))
    pos = torch.randint(0, 10, (50,), generator=g)
    one = _stats(strata=strata)
    one.add(entropy, argmax, strata.assign(pos, None))
    a, b = _stats(strata=strata), _stats(strata=strata)
    a.add(entropy[:20], argmax[:20], strata.assign(pos[:20], None))
    b.add(entropy[20:], argmax[20:], strata.assign(pos[20:], None))
    merged = a.merge(b)
    for x, y in zip(merged.arrays(), one.arrays()):
        torch.testing.assert_close(x, y)


def test_stratification_puts_tokens_in_the_right_buckets():
    strata = Strata(position_edges=(4, 16), confidence_edges=(0.3, 0.7))
    pos = torch.tensor([0, 3, 4, 15, 16, 100])
    conf = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.99, 0.0])
    # position bucket * 3 + confidence bucket; edges belong to the upper bucket
    assert strata.assign(pos, conf).tolist() == [0, 1, 4, 5, 8, 6]
    assert strata.names()[5] == "pos[4,16)|conf[0.7,1)"
    assert Strata().names() == ["all"]


@pytest.mark.parametrize("variant, expected", [("none", Strata()), ("position", Strata(position_edges=(3, 7))),
                                               ("confidence", Strata(confidence_edges=(0.4,))),
                                               ("both", Strata(position_edges=(3, 7), confidence_edges=(0.4,)))])
def test_restricted_stats_equal_a_calibration_with_fewer_axes(variant, expected):
    g = torch.Generator().manual_seed(1)
    entropy, argmax = torch.rand(80, 3, generator=g) * 4, torch.randint(0, 5, (80, 3), generator=g)
    pos, conf = torch.randint(0, 10, (80,), generator=g), torch.rand(80, generator=g)
    both = Strata(position_edges=(3, 7), confidence_edges=(0.4,))
    full = _stats(strata=both)
    full.add(entropy, argmax, both.assign(pos, conf))
    direct = _stats(strata=expected)
    direct.add(entropy, argmax, expected.assign(pos, conf if expected.uses_confidence else None))
    folded = full.restrict(variant)
    assert folded.strata == expected and folded.strata.variant == variant
    for x, y in zip(folded.arrays(), direct.arrays()):
        torch.testing.assert_close(x, y)
    assert smooth(folded, min_count=1).tau == smooth(direct, min_count=1).tau


def test_variants_reachable_and_refused():
    assert Strata().variants() == ["none"]
    assert Strata(position_edges=(4,)).variants() == ["none", "position"]
    assert Strata(confidence_edges=(0.5,)).variants() == ["none", "confidence"]
    assert Strata((4,), (0.5,)).variants() == ["none", "position", "confidence", "both"]
    with pytest.raises(ValueError, match="'confidence' is not available from 'position' strata"):
        Strata(position_edges=(4,)).keep("confidence")
    with pytest.raises(ValueError, match="valid names: none, position, confidence, both"):
        Strata().keep("all")


@pytest.mark.parametrize("edges", [(16, 4), (4, 4), (0, 8)])
def test_unsorted_duplicate_or_out_of_range_edges_are_refused(edges):
    with pytest.raises(ValueError, match="position_edges"):
        Strata(position_edges=edges)
    with pytest.raises(ValueError, match="confidence_edges"):
        Strata(confidence_edges=(0.5, 1.5))


def test_probe_layers_every_k_and_list():
    assert resolve_probe_layers(4, 10) == [4, 8, 10]
    assert resolve_probe_layers([2, 5], 10) == [2, 5, 10]
    for bad in ([0, 3], [3, 11], [3, 3]):
        with pytest.raises(ValueError, match="probe_layers"):
            resolve_probe_layers(bad, 10)


def test_isotonic_output_is_non_increasing_and_equals_scipy():
    st = _stats(probes=(1, 2, 3, 4))
    entropy = torch.tensor([[2.0, 3.0, 1.0, 1.5]] * 3 + [[1.0, 2.5, 0.5, 0.2]])
    st.add(entropy, torch.zeros(4, 4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    prof = smooth(st, min_count=1)
    tau = np.array(prof.tau["all"])
    assert (np.diff(tau) <= 1e-12).all()
    expected = isotonic_regression(st.mean()[0], weights=st.count[0], increasing=False).x
    np.testing.assert_allclose(tau, expected)
    # raw means 1.75, 2.875, 0.875, 1.175: rises of 1.125 and 0.3
    assert prof.monotonicity["all"]["max"] == pytest.approx(1.125)
    assert prof.monotonicity["all"]["total"] == pytest.approx(1.425)
    assert prof.raw["all"] == pytest.approx(st.mean()[0].tolist())


def test_the_fit_without_scipy_equals_scipys():
    """Where scipy is not installed (a bare GPU image) the profile's isotonic fit is the same, up to rounding."""
    from emad.calibration.profile import pool_adjacent_violators

    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 10, 30):
        for _ in range(20):
            values, weights = rng.normal(size=n) * 3, rng.uniform(0.01, 50, size=n)
            expected = isotonic_regression(values, weights=weights, increasing=False).x
            np.testing.assert_allclose(pool_adjacent_violators(values, weights), expected, rtol=1e-12, atol=1e-12)


def test_thin_strata_back_off_to_parent_then_global():
    strata = Strata(position_edges=(10,), confidence_edges=(0.5,))
    st = _stats(probes=(1, 2), strata=strata)
    g = torch.Generator().manual_seed(1)
    # stratum 0 (pos<10, conf<0.5): 30 tokens; stratum 1: 2 tokens; strata 2, 3 (pos>=10): 1 token each
    counts = [30, 2, 1, 1]
    entropy = torch.cat([torch.full((n, 2), float(s + 1)) for s, n in enumerate(counts)])
    entropy += torch.rand(entropy.shape, generator=g) * 0.01
    index = torch.cat([torch.full((n,), s) for s, n in enumerate(counts)])
    st.add(entropy, torch.zeros_like(entropy, dtype=torch.long), index)
    prof = smooth(st, min_count=20)
    names = strata.names()
    assert names[0] not in prof.backed_off
    assert prof.backed_off[names[1]].startswith("position marginal")
    assert prof.backed_off[names[2]] == "global" and prof.backed_off[names[3]] == "global"
    marginal = (entropy[:32].sum(0) / 32).double().numpy()
    expected = isotonic_regression(marginal, weights=np.full(2, 32.0), increasing=False).x
    assert prof.tau[names[1]] == pytest.approx(expected.tolist())
    overall = (entropy.sum(0) / 34).double().numpy()
    assert prof.tau[names[3]] == pytest.approx(isotonic_regression(overall, increasing=False).x.tolist())
    assert prof.tau[names[0]] != prof.tau[names[1]]


def test_quantile_statistic_reads_histogram():
    st = _stats(probes=(1,), vocab=math.ceil(math.exp(10)), bins=100)
    st.add(torch.linspace(0, 9.99, 1000)[:, None], torch.zeros(1000, 1, dtype=torch.long),
           torch.zeros(1000, dtype=torch.long))
    assert st.quantile(0.5)[0, 0].item() == pytest.approx(5.0, abs=0.1)
    assert smooth(st, statistic="q0.25", min_count=1).tau["all"][0] == pytest.approx(2.5, abs=0.1)
    with pytest.raises(ValueError, match="statistic"):
        smooth(st, statistic="median")


def test_stats_and_profile_json_round_trip(tmp_path):
    strata = Strata(position_edges=(5,))
    st = _stats(strata=strata)
    st.model, st.corpus = {"model_type": "llama", "n_layers": 3}, "abc"
    st.add(torch.rand(20, 3), torch.randint(0, 3, (20, 3)), strata.assign(torch.arange(20), None))
    st.save(tmp_path / "stats.json")
    back = CalibrationStats.load(tmp_path / "stats.json")
    for x, y in zip(back.arrays(), st.arrays()):
        torch.testing.assert_close(x, y)
    prof = smooth(back, min_count=1)
    prof.save(tmp_path / "profile.json")
    again = Profile.load(tmp_path / "profile.json")
    assert again.to_dict() == prof.to_dict()
    assert again.table().shape == (2, 3)


def test_truncated_or_foreign_files_are_refused(tmp_path):
    st = _stats()
    st.save(tmp_path / "stats.json")
    text = (tmp_path / "stats.json").read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with pytest.raises(StatsFormatError, match="cut.json"):
        CalibrationStats.load(tmp_path / "cut.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something"}))
    with pytest.raises(ProfileError, match="other.json"):
        Profile.load(tmp_path / "other.json")
    with pytest.raises(StatsFormatError, match="other.json"):
        CalibrationStats.load(tmp_path / "other.json")


def test_profile_of_another_model_is_refused_showing_both():
    prof = Profile([1, 2], Strata(), {"all": [1.0, 0.5]}, model={"model_type": "llama", "n_layers": 2,
                                                                     "tokenizer_sha256": "aaa"})
    with pytest.raises(ProfileError, match="aaa.*bbb"):
        prof.check_model({"model_type": "llama", "n_layers": 2, "tokenizer_sha256": "bbb"})


def test_recorded_entropy_equals_stack_readout_entropy():
    stack = LayerStack(tiny_model("llama"))
    window = random_prompts(1, [12], seed=3)[0]
    st = CalibrationStats([2, 4], Strata(), stack.vocab_size)
    accumulate_batch(stack, st, [window])
    ids = torch.tensor([window])
    real = torch.ones_like(ids, dtype=torch.bool)
    cache = stack.new_cache(1, 12)
    slots = cache.allocate(real)
    pos = positions_of(real)
    with torch.inference_mode():
        h2 = stack.run(stack.embed(ids, pos), 0, 2, cache, pos, slots)
        h4 = stack.run(h2, 2, 4, cache, pos, slots)
        e2, e4 = entropy_from_logits(stack.readout(h2))[0], entropy_from_logits(stack.readout(h4))[0]
    assert st.sum[0].tolist() == pytest.approx([e2.sum().item(), e4.sum().item()], rel=1e-5)


def test_padding_and_batching_do_not_change_statistics():
    stack = LayerStack(tiny_model("qwen2"))
    docs = random_prompts(5, [30, 7, 19, 3, 11], seed=4)
    wins = windows(docs, 8)
    one = calibrate(stack, wins, [1, 3, 4], Strata(position_edges=(4,)), batch_size=1)
    many = calibrate(stack, wins, [1, 3, 4], Strata(position_edges=(4,)), batch_size=3)
    for x, y in zip(one.arrays(), many.arrays()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    assert one.tokens == sum(len(w) for w in wins)


def test_interrupted_calibration_resumes_from_checkpoint(tmp_path, monkeypatch):
    stack = LayerStack(tiny_model("llama"))
    wins = windows(random_prompts(12, [10], seed=5), 10)
    full = calibrate(stack, wins, [2, 4], Strata(), batch_size=2)
    ckpt = tmp_path / "stats.ckpt"
    calls = {"n": 0}

    def crash_after_four(tokens):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate(stack, wins, [2, 4], Strata(), batch_size=2, checkpoint=ckpt, checkpoint_every=2,
                  on_batch=crash_after_four)
    assert json.loads(ckpt.read_text())["done_batches"] == 2
    seen = []
    resumed = calibrate(stack, wins, [2, 4], Strata(), batch_size=2, checkpoint=ckpt, checkpoint_every=2,
                        on_batch=seen.append)
    assert len(seen) == 4  # 6 batches, 2 restored from the checkpoint
    assert not ckpt.exists()
    for x, y in zip(resumed.arrays(), full.arrays()):
        torch.testing.assert_close(x, y)
