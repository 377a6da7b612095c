"""95% intervals of quality metrics and of their change against full depth (emad.evaluation.intervals)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from emad.evaluation.intervals import (
    MET,
    UNRESOLVED,
    VIOLATED,
    Interval,
    change_interval,
    metric_interval,
    tolerance_state,
)
from emad.evaluation.metrics import intervals_of
from emad.report.tables import fmt_quality


def _samples(kind: str, n: int, seed: int = 0) -> list:
    """Per-unit samples of one kind of metric: rouge-like numbers, 0/1 answers, [agree, compared], [nll, tokens]."""
    rng = np.random.default_rng(seed)
    if kind == "rouge_l":
        return rng.beta(4, 2, n).tolist()
    if kind == "acc":
        return (rng.random(n) < 0.6).astype(int).tolist()
    if kind == "token_agreement":
        total = rng.integers(20, 40, n)
        return [[int(rng.binomial(t, 0.7)), int(t)] for t in total]
    tokens = rng.integers(150, 200, n)
    return [[float(t * rng.normal(2.3, 0.3)), int(t)] for t in tokens]  # perplexity: [nll, tokens]


@pytest.mark.parametrize("key", ["rouge_l", "acc", "token_agreement", "perplexity"])
def test_intervals_contain_the_point_estimate_and_shrink_with_n(key):
    widths = []
    for n in (20, 200, 2000):
        iv = metric_interval(key, _samples(key, n))
        assert iv.n == n and iv.defined
        assert iv.lo <= iv.value <= iv.hi
        widths.append(iv.hi - iv.lo)
    assert widths[0] > widths[1] > widths[2] > 0
    assert metric_interval(key, _samples(key, 200)).method == ("clopper-pearson" if key == "acc" else "bootstrap-bca")


def test_statistics_reproduce_the_task_metrics():
    windows = [[23.0, 10], [11.5, 5], [40.0, 20]]
    assert metric_interval("perplexity", windows).value == pytest.approx(math.exp(74.5 / 35))
    assert metric_interval("token_agreement", [[3, 4], [0, 0], [5, 6]]).value == pytest.approx(8 / 10)
    assert metric_interval("rouge_l", [0.2, 0.4]).value == pytest.approx(0.3)


def test_exact_binomial_matches_the_clopper_pearson_table():
    iv = metric_interval("acc", [1] * 7 + [0] * 3)
    assert iv.method == "clopper-pearson"
    assert (iv.lo, iv.hi) == pytest.approx((0.34755, 0.93326), abs=1e-5)
    none_right = metric_interval("acc", [0] * 10)
    assert none_right.lo == 0.0 and none_right.hi == pytest.approx(1 - 0.025 ** (1 / 10))


def test_fewer_than_two_units_is_undefined_unless_equal():
    for iv in (metric_interval("acc", [1]), metric_interval("perplexity", [[20.0, 10]]),
               change_interval("perplexity", [[21.0, 10]], [[20.0, 10]], relative=True),
               change_interval("acc", [1], [0], relative=False)):
        assert iv.lo is None and iv.hi is None and not iv.defined
        assert iv.method == "undefined: fewer than 2 units"
        assert tolerance_state(iv, 0.01) == UNRESOLVED
    empty = metric_interval("rouge_l", [])
    assert empty.value is None and empty.n == 0 and not empty.defined
    assert fmt_quality(1.0, metric_interval("acc", [1]).to_dict()) == "1.000 [n/a] n=1"
    assert fmt_quality(0.5, None) == "0.500 [n/a]"


def test_units_without_variation_give_no_interval():
    iv = change_interval("perplexity", [[21.0, 10]] * 5, [[20.0, 10]] * 5, relative=True)
    assert iv.value == pytest.approx(math.exp(0.1) - 1) and not iv.defined and "no variation" in iv.method
    assert not metric_interval("rouge_l", [0.5] * 8).defined


def test_bootstrap_is_seeded():
    a, b = (metric_interval("rouge_l", _samples("rouge_l", 30)) for _ in range(2))
    assert a == b
    p, f = _samples("perplexity", 30, seed=1), _samples("perplexity", 30, seed=2)
    assert change_interval("perplexity", p, f, True) == change_interval("perplexity", p, f, True)


def test_pairing_removes_what_units_share():
    """Windows differ a lot in difficulty, the point adds a small rise to each: the paired interval is narrow and
    excludes 0; the same runs without pairing (one unit fewer at full depth) cannot tell the rise from 0."""
    rng = np.random.default_rng(5)
    per_token = rng.normal(2.3, 0.5, 40)
    full = [[float(200 * x), 200] for x in per_token]
    point = [[float(200 * (x + 0.005 + rng.normal(0, 0.001))), 200] for x in per_token]
    paired = change_interval("perplexity", point, full, relative=True)
    unpaired = change_interval("perplexity", point, full[:-1], relative=True)
    assert paired.method == "bootstrap-bca, paired" and "unpaired (n 40 vs 39)" in unpaired.method
    assert paired.lo <= paired.value <= paired.hi and paired.lo > 0
    assert unpaired.lo < 0 < unpaired.hi
    assert (paired.hi - paired.lo) < (unpaired.hi - unpaired.lo) / 10


def test_accuracy_drop_is_exact_from_the_discordant_units():
    # one item lost and one gained on 50 items cannot show a 1-point tolerance; on 2000 items they can
    full = [1, 0] * 25
    small = change_interval("acc", [0, 1] + full[2:], full, relative=False)
    assert small.value == 0.0 and small.method.startswith("exact-paired")
    assert small.hi > 0.05  # one discordant unit of 50 each way: a Clopper-Pearson bound of about 0.1
    assert small.lo == pytest.approx(-small.hi) and tolerance_state(small, 0.01) == UNRESOLVED
    full = [1, 0] * 1000
    large = change_interval("acc", [0, 1] + full[2:], full, relative=False)
    assert large.hi < 0.01 and tolerance_state(large, 0.01) == MET
    # 30 of 400 items lost, none gained: a drop of 7.5 points, wholly beyond 1 point
    point = [1] * 170 + [0] * 30 + [0] * 200
    full = [1] * 200 + [0] * 200
    worse = change_interval("acc", point, full, relative=False)
    assert worse.value == pytest.approx(0.075) and worse.lo <= 0.075 <= worse.hi
    assert tolerance_state(worse, 0.01) == VIOLATED


def test_tolerance_states():
    def iv(lo, hi):
        return Interval(0.0, lo, hi, 10, "test")

    assert tolerance_state(iv(-0.02, 0.01), 0.01) == MET  # a bound exactly at the tolerance is within
    assert tolerance_state(iv(0.011, 0.05), 0.01) == VIOLATED
    assert tolerance_state(iv(0.0, 0.02), 0.01) == UNRESOLVED
    assert tolerance_state(Interval(0.0, None, None, 1, "undefined: fewer than 2 units"), 0.01) == UNRESOLVED


def test_samples_of_the_wrong_shape_are_refused_naming_the_metric():
    with pytest.raises(ValueError, match="'perplexity'.*numbers or all"):
        metric_interval("perplexity", [[1.0, 2, 3], [1.0, 2, 3]])
    with pytest.raises(ValueError, match="'rouge_l'"):
        metric_interval("rouge_l", [0.5, [1, 2]])
    with pytest.raises(ValueError, match="differ in kind"):
        change_interval("perplexity", [[1.0, 2], [1.0, 2]], [1.0, 2.0], relative=True)


def test_run_file_intervals():
    tasks = {"perplexity": {"perplexity": math.exp(2.0), "samples": {"perplexity": [[20.0, 10], [41.0, 20]]}},
             "gsm8k": {"accuracy": 0.5, "samples": {"accuracy": [1, 0, 1, 0]}},
             "humaneval": {"pass_at_1": 1.0}}  # no samples: undefined, not dropped
    ivs = intervals_of(tasks)
    assert set(ivs) == {"perplexity", "gsm8k.accuracy", "humaneval.pass_at_1"}
    assert ivs["gsm8k.accuracy"]["n"] == 4 and ivs["gsm8k.accuracy"]["method"] == "clopper-pearson"
    assert ivs["humaneval.pass_at_1"] == {"lo": None, "hi": None, "n": None,
                                          "method": "undefined: no per-unit samples"}


@pytest.mark.parametrize("key, samples, bound_units", [
    ("token_agreement", [[3, 4], [4, 4], [0, 4]], 12),  # a token-level metric: the caller names its tokens
    ("acc", [1, 0, 1, 1, 0], 5),
    ("rouge_l", [0.5, 0.25, 1.0], 3),
    ("acc", [1], 1),
])
def test_every_paired_unit_equal_bounds_the_share_that_differ(key, samples, bound_units):
    """0 of N units differ: the interval is ± the exact 95% bound 1 − 0.025^(1/N) — never {0}."""
    iv = change_interval(key, samples, [list(s) if isinstance(s, list) else s for s in samples], False, bound_units)
    bound = 1 - 0.025 ** (1 / bound_units)
    assert (iv.value, iv.n) == (0.0, len(samples)) and (iv.lo, iv.hi) == pytest.approx((-bound, bound))
    assert iv.all_equal and iv.method.startswith(f"exact: 0 of {bound_units} differ")
    assert tolerance_state(iv, 0.01) == UNRESOLVED  # too few units to rule out a 1% change


def test_equal_windows_bound_no_relative_change():
    """Perplexity equal on every window: a share of windows that differ bounds no relative change — undefined."""
    windows = [[20.0, 10], [41.0, 20], [7.5, 5]] * 200
    iv = change_interval("perplexity", windows, [list(w) for w in windows], True, None)
    assert iv.value == 0.0 and not iv.defined and "bounds no relative change" in iv.method
    assert tolerance_state(iv, 0.01) == UNRESOLVED


def test_48_equal_prompts_are_unresolved_and_368_are_met():
    """Exact match is per prompt: 0 of 48 prompts differing bounds the drop at 7.4%, not 1 point; 368 do."""
    forty_eight = [1, 0] * 24
    iv = change_interval("exact_match", forty_eight, forty_eight, False, len(forty_eight))
    assert iv.hi == pytest.approx(0.0740, abs=1e-4) and tolerance_state(iv, 0.01) == UNRESOLVED
    many = [1, 0] * 184
    assert tolerance_state(change_interval("exact_match", many, many, False, len(many)), 0.01) == MET
    assert tolerance_state(change_interval("exact_match", many[:-1], many[:-1], False, 367), 0.01) == UNRESOLVED


def test_368_equal_tokens_meet_a_token_level_metric():
    tokens = [[15, 16]] * 23  # 23 prompts x 16 tokens = 368 tokens, all agreeing with full depth
    assert tolerance_state(change_interval("token_agreement", tokens, tokens, False, 368), 0.01) == MET
    assert tolerance_state(change_interval("token_agreement", tokens, tokens, False, 367), 0.01) == UNRESOLVED


def test_one_unit_that_differs_breaks_the_exact_zero():
    full = [1, 1, 1, 1, 1, 1, 1, 1]
    iv = change_interval("acc", full[:-1] + [0], full, relative=False)
    assert iv.hi > 0 and iv.method.startswith("exact-paired")


def test_speed_interval_covers_a_known_ratio_and_floor_states_follow_it():
    """Synthetic timings: a point 1.25x as fast as full depth, each timing with multiplicative noise. Over many
    draws the 95% interval covers 1.25 about 95% of the time; met / violated / unresolved follow the interval."""
    from emad.evaluation.intervals import floor_state, ratio_interval

    rng = np.random.default_rng(1)
    covered = 0
    for _ in range(400):
        ref = 100 * np.exp(rng.normal(0, 0.05, 5))
        own = 125 * np.exp(rng.normal(0, 0.05, 5))
        iv = ratio_interval(list(own / ref))
        covered += iv.lo <= 1.25 <= iv.hi
    assert 0.90 <= covered / 400 <= 0.99
    tight = ratio_interval([1.25, 1.26, 1.24, 1.25, 1.255])
    assert tight.n == 5 and tight.lo < 1.25 < tight.hi
    assert floor_state(tight, 1.1) == "met" and floor_state(tight, 1.4) == "violated"
    assert floor_state(tight, 1.25) == "unresolved"
    assert floor_state(ratio_interval([1.3]), 1.1) == "unresolved"  # one pair: no interval
    assert ratio_interval([1.2, 1.2]).lo == pytest.approx(1.2)  # equal timings: zero width
    assert not ratio_interval([1.2, -1.0]).defined


def test_blocks_of_perfectly_correlated_units_give_the_interval_over_block_means():
    rng = np.random.default_rng(7)
    means = rng.normal(0.5, 0.1, 24)  # one value per block
    point_means = means - rng.exponential(0.02, 24)
    units, point_units = np.repeat(means, 4), np.repeat(point_means, 4)  # 4 equal units a block
    blocks = [i // 4 for i in range(96)]
    by_unit = change_interval("rouge_l", list(point_units), list(units), relative=False, blocks=blocks)
    by_mean = change_interval("rouge_l", list(point_means), list(means), relative=False)
    assert by_unit.blocks == by_mean.blocks == 24 and by_unit.n == 96 and by_mean.n == 24
    assert by_unit.lo == pytest.approx(by_mean.lo, abs=1e-12) and by_unit.hi == pytest.approx(by_mean.hi, abs=1e-12)
    single = change_interval("rouge_l", list(point_units), list(units), relative=False)  # units drawn alone
    assert single.hi - single.lo < by_unit.hi - by_unit.lo  # too narrow: 4 copies of each block pass for 4 draws
    whole = metric_interval("rouge_l", list(units), blocks=blocks)
    assert whole.lo == pytest.approx(metric_interval("rouge_l", list(means)).lo, abs=1e-12)


def test_block_ids_must_match_the_paired_units():
    with pytest.raises(ValueError, match="3 block ids for 8 paired units"):
        change_interval("rouge_l", [0.1] * 7 + [0.2], [0.2] * 8, relative=False, blocks=[0, 0, 1])
