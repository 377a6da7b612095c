"""The coverage simulation (benchmarks/bench_coverage.py) and the table the verdict reads (emad.evaluation.coverage):
the simulated BCa interval covers as promised where the data are even and fails where rare large changes make it
lopsided; levels above 95% are simulated and read; the table calibrates a check to the level where its side covers,
or withholds its label; the committed table is rebuilt from the committed samples."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from emad.evaluation.coverage import ALL_BINS, EXACT, Coverage, family, target
from emad.evaluation.coverage_samples import sha256_of

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "reports" / "bench" / "coverage.json"
SAMPLES = ROOT / "reports" / "bench" / "coverage_samples.json"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_coverage", ROOT / "benchmarks" / "bench_coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _side(row: dict, changed: str, side: str, level: float = 0.95) -> float:
    cell = row["bins"][changed]
    return cell[side][[0.95, 0.975, 0.98333, 0.9875, 0.99, 0.995, 0.998, 0.999].index(level)] / cell["replicates"]


def test_the_simulation_reproduces_the_nominal_coverage_where_the_interval_is_trusted(bench):
    """Every prompt loses 1 to 3 of its 16 agreeing tokens, the true drop at the 1-point tolerance: at 128 prompts
    (32 blocks) each side of the BCa interval covers its nominal 97.5% within three Monte Carlo standard errors."""
    rng = np.random.default_rng(1)
    pool = {"pairs": True, "noise": 0.0, "base": [[[16.0, 16.0]] * 4] * 100,
            "changes": [list(-rng.integers(1, 4, 4).astype(float)) for _ in range(500)]}
    row, = bench.cover_shape(pool, "agreement.token_agreement", 1.0, 1.0, [128], 2000, 999, seed=0)
    assert row["truth"] == pytest.approx(0.01, rel=1e-6)  # at the tolerance: where a label flips
    assert set(row["bins"]) == {"64+"} and row["bins"]["64+"]["replicates"] == 2000
    error = 3 * math.sqrt(0.975 * 0.025 / 2000)
    for side in ("lower", "upper"):
        assert abs(_side(row, "64+", side) - 0.975) < error, side


@pytest.fixture(scope="module")
def rare(bench):
    """Perplexity windows of which 0.5% change by heavy-tailed amounts, the true rise at the 1% tolerance, at 192
    windows: most samples have no changed window, the rest one or two."""
    rng = np.random.default_rng(2)
    base = [[[float(rng.normal(150, 30)), 64.0] for _ in range(4)] for _ in range(200)]
    changes = [[float(rng.lognormal(3, 1.2))] + [0.0] * 3 for _ in range(400)]
    pool = {"pairs": True, "noise": 1e-3, "base": base, "changes": changes}
    return bench.cover_shape(pool, "perplexity", 0.005, 1.0, [192], 2000, 499, seed=0)


def test_a_rare_change_at_192_windows_is_flagged_where_it_under_covers(bench, rare):
    row, = rare
    assert row["truth"] == pytest.approx(0.01, rel=1e-9) and row["share"] < 0.01
    table = Coverage.from_dict({"table": bench.table_of(rare)})
    one = table.cell("perplexity", "bootstrap", 192, "upper", 0.95, changed=1)
    assert one is not None and one.coverage < target(0.95)  # "met" would rest on a side that misses
    assert not table.trusted("perplexity", "bootstrap", 192, "upper", 0.95, changed=1)
    assert not table.trusted("perplexity", "bootstrap", 400, "upper", 0.95, changed=1)  # read at 192


def test_levels_above_95_are_simulated_and_read(bench, rare):
    row, = rare
    table = Coverage.from_dict({"table": bench.table_of(rare)})
    assert table.levels() == [0.95, 0.975, 0.98333, 0.9875, 0.99, 0.995, 0.998, 0.999]
    for side in ("lower", "upper"):  # a wider interval covers at least as often, from the same resamples
        series = [_side(row, "1", side, level) for level in table.levels()]
        assert series == sorted(series)
    at_99 = table.coverage("perplexity", "bootstrap", 192, "lower", 0.99, changed=1)
    assert at_99 is not None and at_99 >= table.coverage("perplexity", "bootstrap", 192, "lower", 0.95, changed=1)
    found = table.calibrated("perplexity", "bootstrap", 192, "lower", 0.95, changed=1)
    assert found is None or found in table.levels()


def _table(rows: list[list]) -> Coverage:
    columns = ["metric", "method", "n", "changed", "level", "side", "covered", "replicates"]
    return Coverage.from_dict({"table": {"columns": columns, "rows": rows}})


def test_the_table_reads_the_largest_simulated_size_not_above_a_check_and_calibrates_or_withholds():
    rows = []
    for n, upper in ((8, 0.70), (16, 0.975), (32, 0.95), (64, 0.975)):
        rows += [["perplexity", "bootstrap", n, "2-3", 0.95, "upper", round(upper * 10000), 10000],
                 ["perplexity", "bootstrap", n, "2-3", 0.99, "upper", round((upper + 0.0235) * 10000), 10000]]
    table = _table(rows)
    assert not table.trusted("perplexity", "bootstrap", 12, "upper", changed=2)  # read at 8: 70%, 72% at 99%
    assert table.calibrated("perplexity", "bootstrap", 12, "upper", 0.95, changed=2) is None
    assert table.trusted("perplexity", "bootstrap", 20, "upper", changed=3)  # read at 16
    assert table.calibrated("perplexity", "bootstrap", 40, "upper", 0.95, changed=2) == 0.99  # 95% misses at 32
    assert table.needs("perplexity", "bootstrap", "upper", changed=2) == 16  # covers (at some level) from there on
    assert table.cell("perplexity", "bootstrap", 64, "upper", 0.95, changed=9) is None  # no such bin simulated
    assert not table.trusted("perplexity", "bootstrap", 4, "upper", changed=2)  # below every simulated size
    assert not table.trusted("rouge", "bootstrap", 100, "upper")  # never simulated: no label
    assert table.trusted("rouge", EXACT, 3, "upper")  # exact intervals cover by construction
    assert [family(m) for m in ("bootstrap-bca, paired", "bootstrap-percentile, paired", "student-t on log ratios",
                                "exact-paired (discordant units, Clopper-Pearson)", "clopper-pearson")] == [
        "bootstrap", "bootstrap", "t-log", EXACT, EXACT]
    speed = _table([["speed", "t-log", 8, ALL_BINS, 0.95, "lower", 9540, 10000]])
    assert speed.cell("speed", "t-log", 8, "lower", 0.95, changed=5).covered == 9540  # one bin serves every check


def test_a_bad_coverage_file_is_refused_naming_it_and_how_to_make_it(tmp_path):
    bad = tmp_path / "coverage.json"
    bad.write_text(json.dumps({"cells": []}))
    with pytest.raises(ValueError, match=r"coverage.json: not a coverage table .*benchmarks/bench_coverage.py"):
        Coverage.load(bad)
    with pytest.raises(ValueError, match="not a coverage table"):
        Coverage.load(tmp_path / "missing.json")


def test_the_committed_table_is_simulated_where_labels_flip_from_the_committed_samples():
    """reports/bench/coverage.json: levels above 95%, q down to 0.005, the tolerance's multiples, and the sha256 of
    reports/bench/coverage_samples.json; every metric the default plan judges with a bootstrap or a t interval."""
    data = json.loads(COMMITTED.read_text())
    assert data["samples_sha256"] == sha256_of(SAMPLES)
    assert min(data["q"]) == 0.005 and data["multiples"] == [0.5, 1.0, 2.0] and max(data["levels"]) > 0.99
    table = Coverage.load(COMMITTED)
    for metric in ("perplexity", "agreement.token_agreement", "fidelity.token_agreement", "fidelity.rouge_l"):
        assert table.cell(metric, "bootstrap", 8, "upper", 0.95) is not None, metric
        assert table.cell(metric, "bootstrap", 192, "upper", 0.9875) is not None, metric
    assert table.cell("speed", "t-log", 8, "lower", 0.95) is not None
    dvc = (ROOT / "dvc.yaml").read_text()
    assert "--coverage reports/bench/coverage.json" in dvc and "- reports/bench/coverage.json" in dvc
    assert "--coverage-samples reports/bench/coverage_samples.json" in dvc


def test_the_bench_rebuilds_the_committed_cells_from_the_committed_samples(bench, tmp_path, monkeypatch):
    """A subset of the committed cells, simulated again from the committed samples with the same seed: the same
    counts (each cell is seeded by its own key)."""
    data = json.loads(COMMITTED.read_text())
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # writes under tmp_path/reports/bench
    found = bench.main(["--samples", str(SAMPLES), "--metrics", "fidelity.rouge_l,speed", "--q", "0.25",
                        "--multiples", "1", "--sizes", "8,12", "--workers", "1",
                        "--replicates", str(data["replicates"]), "--resamples", str(data["resamples"]),
                        "--speed-replicates", str(data["speed_replicates"]), "--seed", str(data["seed"])])
    committed = {(c["metric"], c["shape"], c["n"]): c for c in data["cells"]}
    assert len(found["cells"]) == 4
    for cell in found["cells"]:
        assert cell == committed[(cell["metric"], cell["shape"], cell["n"])]


def test_the_docs_show_the_committed_table(bench):
    """docs/params.md quotes what the committed table licenses, as the bench prints it."""
    assert bench.markdown(Coverage.load(COMMITTED)) in (ROOT / "docs" / "params.md").read_text()
