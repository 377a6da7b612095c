"""The coverage simulation (benchmarks/bench_coverage.py) and the table the verdict reads (emad.evaluation.coverage):
the simulated BCa interval covers as promised where the data are even and fails where rare large changes make it
lopsided; the table withholds a label exactly where the side it rests on falls short."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from emad.evaluation.coverage import EXACT, Coverage, family

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_coverage", ROOT / "benchmarks" / "bench_coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_simulation_reproduces_the_nominal_coverage_where_the_interval_is_trusted(bench):
    """Every prompt loses 1 to 3 of its 16 agreeing tokens: at 64 prompts each side of the BCa interval covers
    97.5% of the time, within a point (3,000 samples: a standard error of 0.3 point)."""
    rng = np.random.default_rng(1)
    pool = {"base": np.full((400, 2), 16.0), "changes": -rng.integers(1, 4, 2000).astype(float)}
    point, full = bench.population(pool, "agreement.token_agreement", 1.0, rng)
    cell = bench.cover_cell(point, full, "agreement.token_agreement", 64, 3000, 999, rng)
    assert cell["truth"] == pytest.approx(0.05)  # the population's change, five times the tolerance
    assert cell["bootstrapped"] == 3000
    assert abs(cell["lower"] - 0.975) < 0.01 and abs(cell["upper"] - 0.975) < 0.01


def test_the_simulation_flags_the_upper_bound_of_bca_on_few_units_with_rare_large_changes(bench):
    """Windows of which half changed by heavy-tailed amounts (a true +5% perplexity): at 8 windows BCa's upper
    bound, the side "met" rests on, covers well under 96% — the verdict gives no label on it there."""
    rng = np.random.default_rng(1)
    pool = {"base": np.stack([rng.normal(150, 30, 400), np.full(400, 64.0)], 1),
            "changes": rng.lognormal(4, 1.2, 2000)}
    point, full = bench.population(pool, "perplexity", 0.5, rng)
    cell = bench.cover_cell(point, full, "perplexity", 8, 1000, 999, rng)
    assert cell["truth"] == pytest.approx(0.05)
    assert cell["upper"] < 0.9 and cell["lower"] > 0.96
    table = Coverage.from_dict({"table": bench.table_of({("perplexity", "bootstrap", "rare"): [cell]})})
    assert not table.trusted("perplexity", "bootstrap", 8, "upper") and table.trusted("perplexity", "bootstrap", 8,
                                                                                      "lower")


def test_the_table_reads_the_largest_simulated_size_not_above_a_check_and_says_what_it_needs():
    table = Coverage({"perplexity": {"bootstrap": {8: {"lower": 0.99, "upper": 0.7}, 16: {"lower": 0.98, "upper": 0.97},
                                                   32: {"lower": 0.98, "upper": 0.95},
                                                   64: {"lower": 0.98, "upper": 0.97}}}})
    assert not table.trusted("perplexity", "bootstrap", 12, "upper")  # read at 8
    assert table.trusted("perplexity", "bootstrap", 20, "upper")  # read at 16
    assert not table.trusted("perplexity", "bootstrap", 40, "upper")  # read at 32
    assert table.needs("perplexity", "bootstrap", "upper") == 64  # covers from there on
    assert table.needs("perplexity", "bootstrap", "lower") == 8
    assert not table.trusted("perplexity", "bootstrap", 4, "lower")  # below every simulated size
    assert not table.trusted("rouge", "bootstrap", 100, "upper")  # never simulated: no label
    assert table.trusted("rouge", EXACT, 3, "upper")  # exact intervals cover by construction
    assert [family(m) for m in ("bootstrap-bca, paired", "bootstrap-percentile, paired", "student-t on log ratios",
                                "exact-paired (discordant units, Clopper-Pearson)", "clopper-pearson")] == [
        "bootstrap", "bootstrap", "t-log", EXACT, EXACT]


def test_a_bad_coverage_file_is_refused_naming_it_and_how_to_make_it(tmp_path):
    bad = tmp_path / "coverage.json"
    bad.write_text(json.dumps({"cells": []}))
    with pytest.raises(ValueError, match=r"coverage.json: not a coverage table .*benchmarks/bench_coverage.py"):
        Coverage.load(bad)
    with pytest.raises(ValueError, match="not a coverage table"):
        Coverage.load(tmp_path / "missing.json")


def test_the_committed_table_is_the_one_the_verdict_reads():
    """reports/bench/coverage.json exists, loads, and covers every metric the default plan judges with a bootstrap
    or a t interval, at the default plan's judged sizes."""
    table = Coverage.load(ROOT / "reports" / "bench" / "coverage.json")
    for metric in ("perplexity", "agreement.token_agreement", "fidelity.token_agreement", "fidelity.rouge_l"):
        assert table.coverage(metric, "bootstrap", 8, "upper") is not None
    assert table.coverage("speed", "t-log", 8, "lower") is not None
    dvc = (ROOT / "dvc.yaml").read_text()
    assert "--coverage reports/bench/coverage.json" in dvc and "- reports/bench/coverage.json" in dvc
