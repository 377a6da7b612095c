"""Risk-controlled thresholds: valid Hoeffding–Bentkus p-values, the fixed-sequence search, the guarantee in
simulation, the minimum number of prompts, and the knob directions of the criteria."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from emad.evaluation.risk import control, fixed_sequence, hb_p_value, min_prompts, order_values, prompt_losses


def test_p_value_is_one_at_or_above_delta_and_grows_with_the_risk():
    assert hb_p_value(0.2, 50, 0.1) == 1.0 and hb_p_value(0.1, 50, 0.1) <= 1.0
    ps = [hb_p_value(r, 80, 0.2) for r in (0.0, 0.05, 0.1, 0.15)]
    assert ps == sorted(ps) and ps[0] == pytest.approx(0.8 ** 80)


@pytest.mark.parametrize("n, delta", [(30, 0.1), (100, 0.3)])
def test_p_values_are_valid_under_the_null(n, delta):
    """With true risk exactly δ (the boundary of H0), P(p ≤ t) ≤ t for every level t."""
    rng = np.random.default_rng(0)
    risks = rng.binomial(n, delta, size=4000) / n
    ps = np.array([hb_p_value(r, n, delta) for r in risks])
    for t in (0.01, 0.05, 0.1, 0.2, 0.5):
        assert (ps <= t).mean() <= t + 3 * math.sqrt(t * (1 - t) / len(ps))


def test_fixed_sequence_stops_at_the_first_value_it_cannot_certify():
    table = [[0.0] * 40, [0.0] * 38 + [1.0] * 2, [1.0] * 40, [0.0] * 40]  # the last is never looked at
    seen = []

    def losses(i):
        seen.append(i)
        return table[i]

    chosen, ps = fixed_sequence(losses, len(table), delta=0.2, epsilon=0.05)
    assert chosen == 1 and seen == [0, 1, 2] and len(ps) == 3 and ps[2] == 1.0
    assert fixed_sequence(lambda i: [1.0] * 40, 3, 0.2, 0.05) == (None, [1.0])


def test_the_guarantee_holds_in_simulation():
    """True risks rise with aggressiveness; over many draws of n prompts the chosen value's true risk exceeds δ
    in at most ε of them."""
    rng = np.random.default_rng(1)
    true = np.array([0.0, 0.05, 0.1, 0.14, 0.18, 0.22, 0.3, 0.5])
    delta, epsilon, n, trials = 0.2, 0.1, 60, 2000
    bad = chosen_any = 0
    for _ in range(trials):
        draws = rng.random((len(true), n)) < true[:, None]
        chosen, _ = fixed_sequence(lambda i, d=draws: d[i].astype(float), len(true), delta, epsilon)
        chosen_any += chosen is not None
        bad += chosen is not None and true[chosen] > delta
    assert bad / trials <= epsilon
    assert chosen_any / trials > 0.9  # and the procedure is not vacuous


def test_a_zero_loss_p_value_is_closed_form_and_checking_params_needs_no_scipy():
    """With no loss the binomial term is (1 − δ)^n: equal to scipy's, and params validation (which asks
    :func:`min_prompts`) does not import scipy.stats (about a second of every stage)."""
    from scipy import stats

    for n, delta in ((22, 0.1), (5, 0.5), (300, 0.01)):
        assert hb_p_value(0.0, n, delta) == pytest.approx(
            min(1.0, math.exp(n * math.log(1 - delta)), math.e * stats.binom.cdf(0, n, delta)), rel=1e-12)
    code = ("import sys; from emad.params import validate_params; validate_params('params.yaml'); "
            "assert 'scipy.stats' not in sys.modules, 'scipy.stats imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_minimum_prompts_and_bad_levels():
    assert min_prompts(0.1, 0.1) == 22  # 0.9^22 = 0.098 <= 0.1 < 0.9^21
    assert hb_p_value(0.0, 22, 0.1) <= 0.1 < hb_p_value(0.0, 21, 0.1)
    with pytest.raises(ValueError, match="needs at least 22 held-out prompts, got 10"):
        control(lambda v: [0.0] * 10, "margin", [1.0, 0.5], "high", 0.1, 0.1, n=10)
    for bad in (0.0, 1.0, -0.5, 2.0):
        with pytest.raises(ValueError, match="delta must be in"):
            min_prompts(bad, 0.1)
        with pytest.raises(ValueError, match="epsilon must be in"):
            min_prompts(0.1, bad)
    with pytest.raises(ValueError, match="loss must be one of"):
        control(lambda v: [0.0] * 30, "margin", [1.0], "high", 0.1, 0.1, n=30, loss="bleu")


def test_control_orders_the_values_and_states_the_guarantee():
    table = {2.0: 0.0, 1.0: 0.02, 0.5: 0.05, 0.0: 0.6}  # margin: high is conservative
    result = control(lambda v: [table[v]] * 200, "margin", [0.0, 1.0, 2.0, 0.5], "high", 0.1, 0.05, n=200)
    assert result.values == [2.0, 1.0, 0.5, 0.0] and result.chosen == 0.5
    assert result.risks == pytest.approx([0.0, 0.02, 0.05, 0.6]) and len(result.p_values) == 4
    assert "margin = 0.5" in result.guarantee and "≥ 0.9" in result.guarantee and "≥ 0.95" in result.guarantee
    none = control(lambda v: [0.5] * 50, "threshold", [0.1, 0.9], "low", 0.1, 0.05, n=50)
    assert none.chosen is None and none.values == [0.1, 0.9] and "no value certified" in none.guarantee
    assert order_values([0.3, 0.1, 0.3], "low") == [0.1, 0.3]


def test_prompt_losses():
    ours, ref = [[1, 2, 3, 4], [5, 6], [7]], [[1, 2, 9, 4], [5, 6], [8, 8]]
    assert prompt_losses(ours, ref, "agreement") == pytest.approx([0.25, 0.0, 1.0])
    assert prompt_losses(ours, ref, "exact") == [1.0, 0.0, 1.0]
