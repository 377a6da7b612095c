"""What a plan can decide at its sizes, computed from its params (tools/plan_power.py): the judged units of each
check, what a met label needs there (every unit equal: the share bound's units at the judged level; a bootstrap: a
size at which its upper bound covers), and the default and powered plans as docs/params.md and docs/results.md
describe them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from emad.evaluation.coverage import Coverage
from emad.params import validate_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def power():
    spec = importlib.util.spec_from_file_location("plan_power", ROOT / "tools" / "plan_power.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def table():
    return Coverage.load(ROOT / "reports" / "bench" / "coverage.json")


@pytest.mark.parametrize("metric, judged", [("perplexity", 8), ("agreement.token_agreement", 24),
                                            ("fidelity.exact_match", 12), ("fidelity.token_agreement", 12),
                                            ("cloze.acc", 8), ("choice.acc", 4)])
def test_the_default_plan_judges_these_units(power, metric, judged):
    """Judged units per check of the default plan (a token-level check counts prompts)."""
    cfg = validate_params(ROOT / "params.yaml")
    assert power.judged_units(cfg, "stdlib-prose")[metric] == judged


def test_the_default_plan_decides_violations_and_no_pass_of_c1(power, table):
    """At the default plan's sizes C1 cannot pass: its perplexity check cannot be met (8 judged windows: no
    simulated level makes the upper side cover), nor the scores with every unit equal (368 needed); a violation is
    decidable for the checks that count — C1's falsifications rest on them."""
    rows = power.rows(validate_params(ROOT / "params.yaml"), table)
    by = {r["check"]: r for r in rows}
    assert not power.decidable(by["perplexity"], "met")
    assert not any(power.decidable(by[c], "met") for c in ("cloze.acc", "fidelity.exact_match"))
    assert all(power.decidable(by[c], "violated") for c in ("cloze.acc", "fidelity.exact_match"))
    assert power.decidable(by["C2 speed-up"], "met") and power.decidable(by["C2 speed-up"], "violated")


def test_the_powered_plan_decides_a_pass_and_a_failure_of_every_check(power, table):
    """The powered plan's checks can be met and violated at its sizes, its share-bounded checks with 368 judged
    units (95%); the table gives both per check."""
    rows = power.rows(validate_params(ROOT / "params-powered.yaml"), table)
    by = {r["check"]: r for r in rows}
    for check in ("fidelity.exact_match", "fidelity.rouge_l", "agreement.token_agreement", "cloze.acc"):
        assert by[check]["judged"] >= 368 and power.decidable(by[check], "met"), by[check]
    assert all(power.decidable(r, "violated") for r in rows), [r for r in rows if not power.decidable(r, "violated")]
    text = power.markdown(rows)
    assert text.startswith("| domain | check |") and len(text.splitlines()) == len(rows) + 2


def test_candidates_raise_the_level_a_check_is_judged_at(power, table):
    """With 4 candidates each check is judged at 98.75%: 505 equal units for a 1-point bound, so 368 no longer do."""
    one = {r["check"]: r for r in power.rows(validate_params(ROOT / "params-powered.yaml"), table)}
    four = {r["check"]: r for r in power.rows(validate_params(ROOT / "params-powered.yaml"), table, 4)}
    assert one["cloze.acc"]["needs_equal"] == 368 and four["cloze.acc"]["needs_equal"] == 505
    assert four["cloze.acc"]["level"] == pytest.approx(0.9875) and not power.decidable(four["cloze.acc"], "met")
