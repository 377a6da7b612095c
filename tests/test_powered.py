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


def test_every_check_of_the_default_plan_is_underpowered(power, table):
    """The default plan decides none of C1's checks at its sizes: C1 reads "untested at this size" at best."""
    rows = power.rows(validate_params(ROOT / "params.yaml"), table)
    checks = [r for r in rows if r["check"] != "C2 speed-up"]
    assert checks and all(r["verdict"] != "decidable" for r in checks)


def test_the_powered_plan_decides_every_accuracy_check_it_sizes(power, table):
    """The powered plan's per-prompt and per-item checks have the judged units a met label needs (368 at 95%);
    the table says which checks stay underpowered and what they would need."""
    rows = power.rows(validate_params(ROOT / "params-powered.yaml"), table)
    by = {r["check"]: r for r in rows}
    for check in ("fidelity.exact_match", "fidelity.rouge_l", "agreement.token_agreement", "cloze.acc"):
        assert by[check]["judged"] >= 368 and not by[check]["verdict"].startswith("underpowered: needs"), by[check]
    text = power.markdown(rows)
    assert text.startswith("| domain | check |") and len(text.splitlines()) == len(rows) + 2
