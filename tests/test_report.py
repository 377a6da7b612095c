"""The aggregate stage's library (emad.report) on synthetic run records."""

from __future__ import annotations

import json
import math
import sys
import zlib

import numpy as np
import pytest

from emad.evaluation.identity import run_id
from emad.evaluation.metrics import intervals_of, quality_of
from emad.evaluation.units import CONFIRMATION, SELECTION, indices
from emad.report import (
    ablation_markdown,
    ablation_tables,
    domain_shift_markdown,
    domain_shift_table,
    family_verdicts,
    metrics_summary,
    oracle_flops_ratio,
    pareto_data,
    report_markdown,
    run_details,
    write_pareto_figures,
)
from emad.report.figures.lines import plot_fields
from emad.report.frontier import frontier
from emad.report.verdict import verdict

DOMAINS = ("code", "prose")


UNITS, WINDOW, COMPARED = 48, 200, 100  # per-unit samples of the synthetic runs: windows / prompts, their tokens
PROMPTS = 48  # the synthetic token agreement's prompts (24 judged: a token-level check counts prompts)
POWERED = 880  # enough prompts for a met 1-point agreement check: 440 judged (368 needed at 95%, 437 at 97.5%)


@pytest.fixture
def powered(monkeypatch):
    """Synthetic runs whose token agreement is powered (its judged prompts can meet 1 point): C1 can pass."""
    monkeypatch.setattr(sys.modules[__name__], "PROMPTS", POWERED)


def _jitter(rid: str, scale: float, task: str, n: int = UNITS) -> np.ndarray:
    """Small per-unit noise, different for every run, centred on each split of ``task``'s ``n`` units (the
    verdict's confirmation split, the screen's selection split): tight paired intervals around the given values."""
    x = np.random.default_rng(zlib.crc32(rid.encode())).normal(0.0, scale, n)
    for which in (SELECTION, CONFIRMATION):
        idx = indices(n, which, 0, task)
        x[idx] -= x[idx].mean()
    return x


def synthetic_tasks(rid: str, ppl: float | None, acc: float | None, noise: float = 1e-4) -> dict:
    """Task results whose per-unit samples reproduce ``ppl`` (windows' [nll, tokens]) and ``acc`` (prompts'
    [agreeing, compared] tokens) exactly, with a little variation between units (``noise``: per-token NLL)."""
    tasks = {}
    if ppl is not None:
        nll = WINDOW * (math.log(ppl) + _jitter(rid + "ppl", noise, "perplexity"))
        tasks["perplexity"] = {"perplexity": ppl, "samples": {"perplexity": [[float(v), WINDOW] for v in nll]}}
    if acc is not None:
        agree = COMPARED * (acc + _jitter(rid + "acc", 1e-4, "fidelity", PROMPTS))
        tasks["fidelity"] = {"token_agreement": acc,
                             "samples": {"token_agreement": [[float(v), COMPARED] for v in agree]}}
    return tasks


def make_run(point: str, domain: str, family: str | None = None, *, model: str = "m", calibration: str | None = None,
             flops: float = 1.0, ppl: float | None = 10.0, acc: float | None = 0.5, tps: float = 100.0,
             tokens: int = 1000, factors: dict | None = None, oracle: dict | None = None,
             backfill: float = 0.0, tasks: dict | None = None, pairs: int = 8) -> dict:
    """A run record in the emad-run format with the fields the report reads; ``tasks`` replaces the synthetic
    task results (with their samples) made from ``ppl`` and ``acc``."""
    family = family or point.split("-")[0]
    rid = run_id(model, point, domain, calibration)
    tasks = synthetic_tasks(rid, ppl, acc) if tasks is None else tasks
    return {"run_id": rid, "model": model, "n_layers": 30, "point": point, "family": family, "options": {},
            "factors": factors or {}, "calibration": calibration, "domain": domain, "tasks": tasks,
            "quality": quality_of(tasks), "intervals": intervals_of(tasks),
            "cost": {"flops_ratio": flops, "bytes_ratio": flops, "mean_depth": 30 * flops, "backfill_share": backfill,
                     "policy_events": 0, "tokens": tokens, "seconds": tokens / tps, "tokens_per_s": tps,
                     # one timed pair per prompt [point, full depth] tokens/s: the ratio tps / 100, a little above
                     "speed_pairs": [[tps * (1 + 0.001 * i), 100.0] for i in range(pairs)], "speed_unit": "prompt",
                     "load_avg": 1.0},
            "depth_histogram": {}, "oracle": oracle, "mlflow_run_id": f"ml-{rid}"}


def full_runs(model: str = "m", ppl: float = 10.0, acc: float = 0.5) -> list[dict]:
    return [make_run("full", d, model=model, ppl=ppl, acc=acc) for d in DOMAINS]


def point_runs(point: str, **kw) -> list[dict]:
    return [make_run(point, d, **kw) for d in DOMAINS]


# --- Pareto ---------------------------------------------------------------------------------------------------

def test_frontier_removes_dominated_points_and_keeps_ties_sorted_by_cost():
    pts = [{"id": "a", "c": 1.0, "q": 0.9}, {"id": "b", "c": 0.8, "q": 0.9}, {"id": "c", "c": 0.8, "q": 0.9},
           {"id": "d", "c": 0.5, "q": 0.7}, {"id": "e", "c": 0.6, "q": 0.6}, {"id": "f", "c": None, "q": 1.0}]
    assert [p["id"] for p in frontier(pts, "c", "q", higher_better=True)] == ["d", "b", "c"]


def test_frontier_lower_better_quality_and_maximised_speed():
    pts = [{"id": "a", "s": 1.0, "ppl": 10.0}, {"id": "b", "s": 1.3, "ppl": 10.5}, {"id": "c", "s": 1.2, "ppl": 11.0}]
    assert [p["id"] for p in frontier(pts, "s", "ppl", higher_better=False, cost_lower_better=False)] == ["a", "b"]
    assert [p["id"] for p in frontier(pts, "s", "ppl", higher_better=False)] == ["a"]


def test_oracle_bound_is_share_weighted_depth_over_layers():
    assert oracle_flops_ratio({"3": 0.5, "30": 0.5}, 30) == pytest.approx(0.55)
    assert oracle_flops_ratio({"15": 2.0}, 30) == pytest.approx(0.5)  # shares are normalised
    assert oracle_flops_ratio(None, 30) is None


def test_pareto_data_rows_speedup_frontier_and_oracle():
    oracle = {"3": 0.2, "30": 0.8}
    runs = full_runs() + point_runs("emad-a", calibration="prose", flops=0.8, ppl=10.05, tps=120, oracle=oracle) \
        + point_runs("fixed-b", flops=0.7, ppl=12.0, tps=110) + point_runs("fixed-c", flops=0.9, ppl=12.5, tps=105)
    series = pareto_data(runs)
    assert [s.name for s in series] == [f"m--{d}--{m}" for d in DOMAINS
                                        for m in ("fidelity.token_agreement", "perplexity")]
    ppl = next(s for s in series if s.name == "m--code--perplexity")
    rows = {r["point"]: r for r in ppl.rows}
    assert rows["emad-a@prose"]["speedup"] == pytest.approx(1.2)
    assert rows["full"]["speedup"] == pytest.approx(1.0)
    assert [p for p, r in rows.items() if r["on_frontier_flops"]] == ["full", "emad-a@prose", "fixed-b"]
    assert not rows["fixed-c"]["on_frontier_flops"]
    assert ppl.oracle == {"prose": pytest.approx((0.2 * 3 + 0.8 * 30) / 30)}
    assert ppl.full_quality == 10.0
    assert ppl.plot_rows()[-1]["family"] == "oracle"
    json.dumps([s.to_dict() for s in series])


def test_pareto_data_without_full_run_has_no_speedups_and_rejects_empty():
    series = pareto_data(point_runs("fixed-b", flops=0.7))
    assert all(r["speedup"] is None and not r["on_frontier_speed"] for s in series for r in s.rows)
    with pytest.raises(ValueError, match="no run records"):
        pareto_data([])


# --- verdict --------------------------------------------------------------------------------------------------

def test_c1_and_c2_pass(powered):
    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.09, acc=0.492, tps=120)
    v = verdict(runs)["m"]
    assert v.c1.passed and not v.c1.falsified and v.c1.deciding.label == "emad-a"
    assert v.c1.deciding.reduction == pytest.approx(0.2)
    assert v.c2.passed and v.c2.deciding.speedup == pytest.approx(1.2)
    assert not v.c1.literal
    assert "not falsified" in v.c1.sentence() and "not falsified" in v.c2.sentence()
    assert "— false" in v.sentence()
    json.dumps(v.to_dict())


def test_c1_fails_on_perplexity_and_names_worst_violation():
    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.2, tps=130) + point_runs("emad-b", flops=0.95)
    v = verdict(runs)["m"]
    assert not v.c1.passed and v.c1.falsified
    assert v.c1.deciding.label == "emad-a"
    assert v.c1.deciding.worst.metric == "perplexity"
    assert "C1 fails (falsified)" in v.c1.sentence() and "perplexity" in v.c1.sentence()
    assert v.c1.literal and v.c1.literal_points == ["emad-a"]
    # emad-b is within tolerance (matched accuracy) but gives no speed-up
    assert not v.c2.passed and v.c2.deciding.label == "emad-b" and "C2 fails (falsified)" in v.c2.sentence()


def test_c1_is_untested_when_no_point_reaches_the_reduction():
    v = verdict(full_runs() + point_runs("emad-a", flops=0.9))["m"]  # nothing of the family tested C1
    assert v.c1.outcome == "untested" and v.c1.reason == "short" and not v.c1.falsified and not v.c1.literal
    assert "no point reaches 15% fewer FLOPs; best 10.0%" in v.c1.sentence()


def test_literal_reading_can_be_true_while_c1_passes(powered):
    runs = full_runs() + point_runs("emad-a", flops=0.8) + point_runs("emad-b", flops=0.6, acc=0.45)
    v = verdict(runs)["m"]
    assert v.c1.passed and v.c1.deciding.label == "emad-a"
    assert v.c1.literal and v.c1.literal_points == ["emad-b"]
    assert "— true: emad-b" in v.c1.literal_sentence(0.15)


def test_perplexity_tolerance_is_relative_and_accuracy_tolerance_absolute(powered):
    base = full_runs(ppl=100.0, acc=0.5)
    ok = verdict(base + point_runs("emad-a", flops=0.8, ppl=100.9, acc=0.4905))["m"]
    assert ok.c1.passed  # +0.9 perplexity is 0.9% relative; -0.95 point is within 1 point
    bad_acc = verdict(base + point_runs("emad-a", flops=0.8, ppl=100.0, acc=0.489))["m"]
    assert not bad_acc.c1.passed and bad_acc.c1.deciding.worst.metric == "fidelity.token_agreement"
    bad_ppl = verdict(base + point_runs("emad-a", flops=0.8, ppl=101.1, acc=0.5))["m"]
    assert not bad_ppl.c1.passed and bad_ppl.c1.deciding.worst.metric == "perplexity"


def test_thresholds_are_keyword_arguments(powered):
    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.2, tps=105)
    assert not verdict(runs)["m"].c1.passed
    loose = verdict(runs, ppl_rel_tol=0.05, min_speed_gain=0.05)["m"]
    assert loose.c1.passed and loose.c2.passed


def test_c2_fails_when_nothing_is_within_tolerance():
    v = verdict(full_runs() + point_runs("emad-a", flops=0.5, acc=0.3, tps=300))["m"]
    assert not v.c2.passed and v.c2.deciding is None and "no operating point" in v.c2.sentence()


def test_flops_are_token_weighted_and_speedup_is_a_time_ratio():
    runs = full_runs() + [make_run("emad-a", "code", flops=0.8, tokens=3000, tps=200),
                          make_run("emad-a", "prose", flops=0.9, tokens=1000, tps=100)]
    p = verdict(runs)["m"].points[0]
    assert p.flops_ratio == pytest.approx(0.825)
    assert p.speedup == pytest.approx((3000 / 100 + 1000 / 100) / (3000 / 200 + 1000 / 100))


def test_points_must_cover_every_domain_and_share_the_calibration():
    runs = full_runs() + [make_run("emad-a", "code", calibration="code", flops=0.7),
                          make_run("emad-a", "prose", calibration="prose", flops=0.7)]
    v = verdict(runs)["m"]
    assert v.points == [] and v.incomplete == ["emad-a@code", "emad-a@prose"]
    assert not v.c1.passed and "evaluated on every domain" in v.c1.sentence()


def test_verdict_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="no run records"):
        verdict([])
    with pytest.raises(ValueError, match="no full-depth run"):
        verdict(point_runs("emad-a"))
    with pytest.raises(ValueError, match="domain\\(s\\) prose"):
        verdict([make_run("full", "code")] + point_runs("emad-a"))
    with pytest.raises(ValueError, match="two full-depth runs"):
        verdict(full_runs() + [make_run("full", "code")])


def test_family_verdicts_show_whether_baselines_pass(powered):
    runs = full_runs() + point_runs("emad-a", flops=0.8, tps=120) + point_runs("fixed-b", flops=0.5, acc=0.3)
    fams = family_verdicts(runs)
    assert sorted(fams) == ["emad", "fixed"]
    assert fams["emad"]["m"].c1.passed and not fams["fixed"]["m"].c1.passed


# --- tables ---------------------------------------------------------------------------------------------------

def shift_runs() -> list[dict]:
    runs = full_runs()
    for cal, flops in (("code", 0.7), ("prose", 0.8)):
        runs += [make_run("emad-a", d, calibration=cal, flops=flops + (0.05 if d != cal else 0.0),
                          ppl=10.0 if d == cal else 10.5) for d in DOMAINS]
    return runs


def test_domain_shift_table_against_full_and_in_domain():
    cells = domain_shift_table(shift_runs())
    assert [(c["calibration"], c["domain"]) for c in cells] == [(c, d) for c in ("code", "prose") for d in DOMAINS]
    cell = next(c for c in cells if (c["calibration"], c["domain"]) == ("code", "prose"))
    assert not cell["in_domain"]
    assert cell["savings"] == pytest.approx(0.25)
    assert cell["vs_full"]["perplexity"] == pytest.approx(0.05)
    assert cell["vs_in_domain"]["savings"] == pytest.approx(0.25 - 0.2)  # in-domain prose cell saves 20%
    assert cell["vs_in_domain"]["perplexity"] == pytest.approx(0.05)  # relative, as against full depth
    own = next(c for c in cells if (c["calibration"], c["domain"]) == ("code", "code"))
    assert own["in_domain"] and own["vs_in_domain"] is None
    md = domain_shift_markdown(cells)
    assert "calibration \\ domain" in md and "savings 25.0%" in md and "perplexity +5.00%" in md


def ablation_runs() -> list[dict]:
    default = {"margin": 0.5, "policy": "monotone", "estimator": "exact", "probe_every": 3, "strata": "none"}
    runs = full_runs(model="m")
    runs += [make_run("emad-m05", "code", factors=default, flops=0.8)]
    runs += [make_run("emad-m10", "code", factors={**default, "margin": 1.0}, flops=0.7)]
    runs += [make_run("emad-m00", "code", factors={**default, "margin": 0.0}, flops=0.9)]
    runs += [make_run("emad-bf", "code", factors={**default, "policy": "backfill"}, flops=0.75, backfill=0.1)]
    runs += [make_run("emad-two", "code", factors={**default, "policy": "copy", "margin": 1.0}, flops=0.6)]
    return runs


def test_ablation_tables_group_single_factor_variants_with_the_default():
    tables = ablation_tables(ablation_runs(), "emad-m05")
    assert sorted(tables) == ["margin", "policy"]
    assert [(r["value"], r["is_default"]) for r in tables["margin"]] == [(0.0, False), (0.5, True), (1.0, False)]
    assert [r["point"] for r in tables["policy"]] == ["emad-bf", "emad-m05"]
    assert tables["policy"][0]["backfill_share"] == 0.1
    assert tables["margin"][2]["speedup"] == pytest.approx(1.0)
    md = ablation_markdown(tables)
    assert "**margin**" in md and "**0.5** (default)" in md and "backfill share" in md


def test_ablation_rows_of_two_calibration_sources_say_which():
    default = {"margin": 0.5, "policy": "monotone", "estimator": "exact", "probe_every": 3, "strata": "none"}
    runs = full_runs()
    for cal, flops in (("prose", 0.8), ("code", 0.85)):
        runs += [make_run("emad-m05", "code", calibration=cal, factors=default, flops=flops),
                 make_run("emad-m00", "code", calibration=cal, factors={**default, "margin": 0.0}, flops=flops + 0.1)]
    md = ablation_markdown(ablation_tables(runs, "emad-m05"))
    assert "| calibration |" in md
    rows = [line for line in md.splitlines() if "emad-m00" in line]
    assert len(rows) == 2 and {"prose", "code"} == {line.split("|")[3].strip() for line in rows}


def test_ablation_tables_reject_an_unknown_default_point():
    with pytest.raises(ValueError, match="emad-zz.*emad-m05"):
        ablation_tables(ablation_runs(), "emad-zz")
    with pytest.raises(ValueError, match="no factors"):
        ablation_tables(ablation_runs(), "full")


# --- figures and report ---------------------------------------------------------------------------------------

def report_runs() -> list[dict]:
    oracle = {"3": 0.3, "30": 0.7}
    return full_runs() + point_runs("emad-a", calibration="prose", flops=0.8, tps=120, oracle=oracle) \
        + point_runs("fixed-b", flops=0.6, acc=0.45, tps=150)


def test_figures_are_written_as_png_with_their_run_ids(tmp_path):
    series = [s for s in pareto_data(report_runs()) if s.domain == "code"]
    index = write_pareto_figures(series, tmp_path / "figures")
    assert len(index) == 2
    for entry in index:
        data = (tmp_path / "figures" / f"{entry['name']}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        assert "m--emad-a--cal-prose--code" in entry["run_ids"]
        assert "ml-m--full--code" in entry["mlflow_run_ids"]


def test_report_markdown_and_metrics(powered, tmp_path):
    runs = report_runs()
    verdicts = verdict(runs)
    index = [{"path": str(tmp_path / "figures" / "m--code--perplexity.png"), "name": "m--code--perplexity",
              "run_ids": ["r1"], "mlflow_run_ids": ["abc", "def"]}]
    tables = {"domain_shift": domain_shift_table(runs), "ablations": {}}
    md = report_markdown(runs, verdicts, tables, index, family_verdicts=family_verdicts(runs),
                         relative_to=tmp_path)
    assert md == report_markdown(runs, verdicts, tables, index, family_verdicts=family_verdicts(runs),
                                 relative_to=tmp_path)
    assert "**C1 pass.** C1 passes (not falsified)" in md
    assert "C2 passes (not falsified)" in md and "Literal reading" in md
    assert "![m--code--perplexity](figures/m--code--perplexity.png)" in md
    assert "MLflow runs: `abc`, `def`" in md
    assert "### m · code" in md and "`dvc repro`" in md and "`make mlflow`" in md
    assert "| fixed | m | code, prose | fail (beyond) |" in md
    details = run_details(runs, verdicts)["models"]
    assert details["m"]["verdict"] == {"c1": True, "c2": True, "c1_outcome": "pass", "c2_outcome": "pass",
                                       "c1_literal": False}
    assert details["m"]["best"]["c1_point"] == "emad-a@prose"
    assert details["m"]["runs"]["emad-a@prose"]["code"]["flops_ratio"] == 0.8
    metrics = metrics_summary(runs, verdicts)
    assert metrics["m"]["emad"]["c1"] == "pass" and metrics["m"]["fixed"]["c1"] == "fail"
    json.dumps(metrics)


# --- uncertainty: three states on run files -------------------------------------------------------------------

def _saved(tmp_path, runs: list[dict]) -> list[dict]:
    """The runs written as run files and read back, as the aggregate stage reads them."""
    from emad.evaluation import runfile

    for r in runs:
        runfile.save(tmp_path / f"{r['run_id']}.json", r)
    return runfile.load_all(tmp_path)


def noisy_runs(point: str, ppl: float, noise: float, **kw) -> list[dict]:
    """A point whose windows vary by ``noise`` nats per token around ``ppl``: its paired interval is wide."""
    return [make_run(point, d, tasks=synthetic_tasks(run_id("m", point, d, None), ppl, 0.5, noise), **kw)
            for d in DOMAINS]


def test_checks_are_met_violated_or_unresolved_on_run_files(powered, tmp_path):
    runs = _saved(tmp_path, full_runs() + point_runs("emad-met", flops=0.8, ppl=10.05)
                  + point_runs("emad-bad", flops=0.8, ppl=10.3)
                  + noisy_runs("emad-open", ppl=10.08, noise=0.05, flops=0.8))
    points = {p.label: p for p in verdict(runs)["m"].points}
    ppl = {label: next(c for c in p.checks if c.metric == "perplexity" and c.domain == "code")
           for label, p in points.items()}
    assert ppl["emad-met"].state == "met" and ppl["emad-met"].hi <= 0.01
    assert ppl["emad-bad"].state == "violated" and ppl["emad-bad"].lo > 0.01
    open_ = ppl["emad-open"]
    assert open_.state == "unresolved" and open_.lo < 0.01 < open_.hi and open_.n == 24  # the confirmation half
    assert all(c.lo <= c.change <= c.hi for c in ppl.values())
    assert {label: p.state for label, p in points.items()} == {"emad-met": "met", "emad-bad": "violated",
                                                               "emad-open": "unresolved"}
    assert "95% CI" in open_.describe() and open_.describe().endswith(": unresolved")


def test_c1_and_c2_are_unresolved_when_no_candidate_is_shown_either_way(powered, tmp_path):
    runs = _saved(tmp_path, full_runs() + noisy_runs("emad-open", ppl=10.08, noise=0.05, flops=0.7, tps=130)
                  + point_runs("emad-bad", flops=0.6, ppl=10.5, tps=150) + point_runs("emad-slow", flops=0.95))
    v = verdict(runs)["m"]
    assert v.c1.outcome == "unresolved" and not v.c1.passed and not v.c1.falsified
    assert v.c1.deciding.label == "emad-open" and v.c1.unresolved_points == ["emad-open"]
    assert "C1 unresolved at this sample size" in v.c1.sentence()
    assert v.c1.literal and v.c1.literal_points == ["emad-bad"]  # the literal reading counts violations only
    assert "(unresolved at this sample size: emad-open)" in v.c1.literal_sentence(0.15)
    # the met point is too slow; the unresolved one would reach the gain: C2 cannot be decided either
    assert v.c2.outcome == "unresolved" and v.c2.deciding.label == "emad-open" and v.c2.matched == ["emad-slow"]
    md = report_markdown(runs, verdict(runs), {}, [])
    assert "**C1 unresolved.**" in md and "**C2 unresolved.**" in md and "Checks of emad-open" in md
    assert "| `beyond` | every candidate is measured beyond a tolerance | fail (falsified) |" in md
    assert run_details(runs, verdict(runs))["models"]["m"]["verdict"]["c1_outcome"] == "unresolved"
    assert metrics_summary(runs, verdict(runs))["m"]["emad"]["c1"] == "unresolved"
    json.dumps(v.to_dict())


def test_c1_is_falsified_only_when_every_candidate_is_violated(tmp_path):
    runs = _saved(tmp_path, full_runs() + point_runs("emad-bad", flops=0.6, ppl=10.5)
                  + noisy_runs("emad-small", ppl=10.08, noise=0.05, flops=0.9))
    v = verdict(runs)["m"]
    assert v.c1.outcome == "fail" and v.c1.falsified  # the unresolved point does not reach 15%
    assert "every operating point with ≥ 15% FLOP reduction violates a tolerance" in v.c1.sentence()
    assert v.c2.outcome == "fail" and v.c2.deciding.label == "emad-small"  # unresolved and too slow


def test_run_files_without_samples_leave_checks_unresolved():
    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.0)
    for r in runs:
        r["tasks"] = {k: {m: v for m, v in t.items() if m != "samples"} for k, t in r["tasks"].items()}
    v = verdict(runs)["m"]
    check = v.points[0].checks[0]
    assert check.state == "unresolved" and check.lo is None and "no per-unit samples in m--emad-a--code" in \
        check.method
    assert "95% CI n/a" in check.describe()
    assert v.c1.outcome == "unresolved"


def test_results_table_shows_intervals_and_sample_sizes():
    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.05)
    md = report_markdown(runs, verdict(runs), {}, [])
    iv = runs[0]["intervals"]["perplexity"]
    assert iv["n"] == UNITS and iv["lo"] < 10.0 < iv["hi"]
    assert f"10.000 [{iv['lo']:.3f}, {iv['hi']:.3f}] n={UNITS}" in md
    metrics = run_details(runs, verdict(runs))["models"]["m"]["runs"]["full"]["code"]
    assert metrics["perplexity.n"] == UNITS and metrics["perplexity.lo"] < 10.0 < metrics["perplexity.hi"]


def _exact_copy_of_full(point: str, flops: float, units: int) -> list[dict]:
    """Runs of ``point`` whose every unit equals full depth's (e.g. a lossless exit), ``units`` units each."""
    out = []
    for d in DOMAINS:
        full = make_run("full", d)
        tasks = json.loads(json.dumps(full["tasks"]))
        for task in tasks.values():
            for key in task["samples"]:
                task["samples"][key] = task["samples"][key][:units]
        out.append(make_run(point, d, flops=flops, tasks=tasks))
    return out


def test_equal_windows_without_an_identity_proof_do_not_meet_perplexity(powered):
    """Every unit equal on 50 windows and 880 prompts of 100 tokens: the token-level agreement is met (its 440
    confirmation prompts bound the share that differ within 1 point), but equal windows bound no relative
    perplexity change, at any size: without the engine's proof the point is unresolved, and C1 with it; with it,
    identical."""
    v = verdict(full_runs() + _exact_copy_of_full("emad-lossless", 0.6, POWERED))["m"]
    point = next(p for p in v.points if p.point == "emad-lossless")
    agreement = [c for c in point.checks if c.metric == "fidelity.token_agreement"]
    perplexity = [c for c in point.checks if c.metric == "perplexity"]
    assert all(c.state == "met" and 0 < c.hi < 0.01 and c.lo == -c.hi and c.has == 440 for c in agreement)
    assert all(c.state == "unresolved" and c.lo is None and "bounds no relative change" in c.method
               for c in perplexity)
    assert point.state == "unresolved" and v.c1.outcome == "unresolved"
    proved = full_runs() + _exact_copy_of_full("emad-lossless", 0.6, POWERED)
    for r in proved:
        if r["point"] == "emad-lossless":
            r["identity"] = {"proved": True, "why": "every exit at depth ≥ 20", "final_from": 20}
    v = verdict(proved)["m"]
    point = next(p for p in v.points if p.point == "emad-lossless")
    assert {c.state for c in point.checks} == {"identical by construction"} and point.state == "met"
    assert v.c1.outcome == "pass" and v.c1.deciding.point == "emad-lossless"


def test_token_agreement_is_bounded_by_prompts_not_tokens():
    """0 of 384 tokens over 24 judged prompts differ: the share bound counts prompts (14.25%), not tokens (0.96%),
    so the check is underpowered (368 prompts needed) and the point untested, not met."""
    full = make_run("full", "prose", tasks={"agreement": {"token_agreement": 1.0,
                                                          "samples": {"token_agreement": [[16, 16]] * 48}}})
    point = make_run("emad-a", "prose", flops=0.6, tasks=json.loads(json.dumps(full["tasks"])))
    v = verdict([full, point])["m"]
    (check,) = next(p for p in v.points if p.point == "emad-a").checks
    assert check.all_equal and check.has == 24 and check.unit == "prompt"
    assert check.hi == pytest.approx(1 - 0.025 ** (1 / 24)) and check.hi == pytest.approx(0.1425, abs=1e-4)
    assert check.underpowered and not check.counted and check.needs == 368
    assert "0 of 24 differ" in check.method and "needs ≥ 368 prompts" in check.power_text()


def _equal_prompts(point: str, prompts: int, n_layers_hist: dict | None = None) -> list[dict]:
    """Full depth and a point whose ``prompts`` 0/1 accuracy units are all equal (cloze-like items)."""
    tasks = {"cloze": {"acc": 0.5, "samples": {"acc": [i % 2 for i in range(prompts)]}}}
    runs = [make_run(name, d, tasks=json.loads(json.dumps(tasks)), flops=1.0 if name == "full" else 0.6)
            for name in ("full", point) for d in DOMAINS]
    for r in runs:
        if r["point"] == point and n_layers_hist is not None:
            r["depth_histogram"] = n_layers_hist
    return runs


def test_eight_equal_items_are_underpowered_and_kept_out_with_their_reason():
    """16 items, 8 on the confirmation split, all equal: the bound is 36.9%; the check cannot be met at its size
    (it needs 368 items), so it is labelled underpowered and kept out of the gate, and the verdict says why."""
    v = verdict(_equal_prompts("emad-eight", 16))["m"]
    point = next(p for p in v.points if p.point == "emad-eight")
    assert {c.state for c in point.checks} == {"unresolved"} and point.state == "unresolved"
    assert all(c.hi == pytest.approx(1 - 0.025 ** (1 / 8)) and c.underpowered and not c.counted
               for c in point.checks)
    assert (point.checks[0].needs, point.checks[0].has) == (368, 8)
    assert "0 of 8 differ" in point.checks[0].describe() and v.c1.outcome == "unresolved"
    assert "underpowered" in v.c1.sentence() and "needs ≥ 368 items" in v.c1.sentence()


def _equal_exact_match(prompts: int) -> list[dict]:
    tasks = {"fidelity": {"exact_match": 0.5, "samples": {"exact_match": [i % 2 for i in range(prompts)]}}}
    return [make_run(name, d, tasks=json.loads(json.dumps(tasks)), flops=1.0 if name == "full" else 0.6)
            for name in ("full", "emad-x") for d in DOMAINS]


@pytest.mark.parametrize("prompts, state", [(96, "unresolved"), (736, "met")])
def test_exact_match_is_bounded_in_prompts_not_tokens(prompts, state):
    """48 equal prompts judged (96, half confirmation) bound the drop at 7.4%: unresolved for a 1-point tolerance;
    368 judged (736) bound it within 1 point: met."""
    point = next(p for p in verdict(_equal_exact_match(prompts))["m"].points if p.point == "emad-x")
    check = point.checks[0]
    assert check.state == state and check.has == prompts // 2 and check.unit == "prompt"
    assert check.hi == pytest.approx(1 - 0.025 ** (1 / (prompts // 2)))
    assert check.underpowered == (prompts // 2 < 368)


def test_a_point_proved_identical_is_identical_by_construction_and_one_that_never_exits_is_not_enough():
    runs = _equal_prompts("emad-never", 1, {"30": 640})
    point = next(p for p in verdict(runs)["m"].points if p.point == "emad-never")
    assert "identical by construction" not in {c.state for c in point.checks}  # the histogram alone proves nothing
    for r in runs:
        if r["point"] == "emad-never":
            r["identity"] = {"proved": True, "why": "never exits", "final_from": 30}
    point = next(p for p in verdict(runs)["m"].points if p.point == "emad-never")
    assert {c.state for c in point.checks} == {"identical by construction"} and point.state == "met"


def test_a_check_on_fewer_than_eight_units_is_not_counted_anywhere(tmp_path):
    base = full_runs()
    for run in base:  # full depth itself keeps only 7 units
        for task in run["tasks"].values():
            task["samples"] = {k: v[:7] for k, v in task["samples"].items()}
    runs = base + _exact_copy_of_full("emad-few", 0.6, 7)
    v = verdict(runs)["m"]
    point = next(p for p in v.points if p.point == "emad-few")
    assert point.checks and not any(c.counted for c in point.checks)
    assert {c.state for c in point.checks} == {"not counted (n < 8)"}
    assert point.state == "unresolved" and v.c1.outcome != "pass"
    md = report_markdown(runs, verdict(runs), {}, [])
    row = next(line for line in md.splitlines() if line.startswith("| emad-few |"))
    assert "0 met, 0 unresolved, 0 violated, 4 not counted" in row and "underpowered" not in row.split("|")[6]
    metrics = metrics_summary(runs, verdict(runs))
    assert "emad-few" not in json.dumps(metrics)  # no headline number reads it


def test_a_point_on_a_subset_of_full_depths_windows_is_compared_on_that_subset():
    """A strategy scored on the leading 10 of full depth's 50 windows, equal to full depth there: its change is 0
    and its Pareto row reads exactly 1 against full depth, though those windows' perplexity is not full depth's
    perplexity on all 50."""
    full = full_runs()
    for r in full:  # the first 10 windows are easier than the rest
        r["tasks"]["perplexity"]["samples"]["perplexity"] = [[float(WINDOW * (1.5 if i < 10 else 2.5)), WINDOW]
                                                             for i in range(UNITS)]
        r["quality"] = quality_of(r["tasks"])
    spec = []
    for r in full:
        tasks = json.loads(json.dumps(r["tasks"]))
        tasks["perplexity"]["samples"]["perplexity"] = tasks["perplexity"]["samples"]["perplexity"][:10]
        tasks["perplexity"]["perplexity"] = math.exp(1.5)
        spec.append(make_run("spec-lossless", r["domain"], family="speculative", flops=1.1, tasks=tasks))
    runs = full + spec
    check = next(c for c in family_verdicts(runs)["speculative"]["m"].points[0].checks if c.metric == "perplexity")
    # equal on the 4 leading windows of its confirmation split (of the first 10): no bound on a relative change, and too
    # few windows
    assert check.change == 0.0 and check.full == pytest.approx(math.exp(1.5)) and check.n == 4
    assert check.state == "not counted (n < 8)"
    series = next(s for s in pareto_data(runs) if s.metric == "perplexity")
    row = next(r for r in series.rows if r["point"] == "spec-lossless")
    assert plot_fields(series, row)["quality_vs_full"] == pytest.approx(1.0)


def test_a_family_run_on_fewer_domains_is_judged_on_those():
    runs = full_runs() + [make_run("ead-a", "prose", family="ead", flops=0.7, ppl=10.0, acc=0.5)]
    v = family_verdicts(runs)["ead"]["m"]
    assert v.domains == ["prose"] and v.model_domains == list(DOMAINS) and v.subset
    assert [p.label for p in v.points] == ["ead-a"] and not v.incomplete
    md = report_markdown(runs, verdict(runs, ("ead",)), {}, [], family_verdicts=family_verdicts(runs))
    assert "the method ran on these only" in md and "| ead | m | prose (only these) |" in md


def test_c2_follows_the_speed_interval_over_prompts(powered):
    def runs_with(pairs_of: dict[str, list[float]]) -> list[dict]:
        out = full_runs()
        for point, ratios in pairs_of.items():
            for r in point_runs(point, flops=0.8, tps=100 * ratios[0]):
                r["cost"]["speed_pairs"] = [[100 * x, 100.0] for x in ratios]
                out.append(r)
        return out

    fast = verdict(runs_with({"emad-a": [1.3, 1.32, 1.29, 1.31, 1.3, 1.3, 1.31, 1.29]}))["m"]
    # the interval is over the 16 prompts of both domains
    assert fast.c2.passed and "95% CI 1.30" in fast.c2.sentence() and "16 prompts" in fast.c2.sentence()
    slow = verdict(runs_with({"emad-a": [1.0, 1.02, 0.99, 1.01, 1.0, 1.0, 1.01, 0.99]}))["m"]
    assert slow.c2.falsified and "1.00×" in slow.c2.sentence()
    straddling = verdict(runs_with({"emad-a": [1.0, 1.25, 1.05, 1.2, 1.1, 1.0, 1.25, 1.1]}))["m"]
    assert straddling.c2.outcome == "unresolved" and "straddles" in straddling.c2.sentence()
    few = verdict(runs_with({"emad-a": [1.3, 1.3, 1.3, 1.3, 1.3]}))["m"]  # 5 prompts: fewer than C2 reads
    # no timed eligible point: nothing was measured, so C2 is unresolved ("not timed"), never falsified
    assert few.c2.outcome == "unresolved" and few.c2.deciding is None and "not timed" in few.c2.sentence()
    assert "timed on 8 distinct prompts per domain" in few.c2.sentence()
    costly = full_runs() + point_runs("emad-a", flops=1.02, tps=90.0, pairs=0)  # met, no FLOPs saved: never timed
    never = verdict(costly)["m"].c2
    # no point at matched accuracy does less work than full depth: falsified for that reason alone
    assert never.outcome == "fail" and never.reason == "no_saving" and never.deciding is None
    assert "no point does less work than full depth" in never.sentence() and "emad-a" in never.sentence()
    repeats = runs_with({"emad-a": [1.3, 1.32, 1.29, 1.31, 1.3, 1.3, 1.31, 1.29]})
    for r in repeats:  # repeats of one prompt measure timer jitter, not inputs: not read by C2
        r["cost"]["speed_unit"] = "repeat"
    assert verdict(repeats)["m"].c2.deciding is None


def test_the_deciding_points_checks_come_with_their_exit_depth_histograms():
    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.09, acc=0.492, tps=120)
    for r in runs:
        if r["point"] == "emad-a":
            r["depth_histogram"] = {"21": 413, "27": 144, "30": 283}
    md = report_markdown(runs, verdict(runs), {}, [])
    assert "Checks of emad-a (deciding C1 and C2" in md
    assert "exit depths on code (layer: tokens): 21: 413 (49%), 27: 144 (17%), 30: 283 (34%)" in md


def test_a_check_on_one_unit_enters_no_curve_reading():
    from emad.report.curves import model_curves

    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.0, acc=0.3)
    for r in runs:  # the point's fidelity rests on one prompt (it is far off full depth there)
        if r["point"] == "emad-a":
            r["tasks"]["fidelity"]["samples"]["token_agreement"] = [[30.0, 100]]
    (curve,) = [c for c in model_curves(family_verdicts(runs)) if c.family == "emad"]
    assert set(curve.metrics) == {"perplexity"}  # the fidelity check (n 1) is read nowhere
    (point,) = curve.points
    assert point.state == "untested at this size"  # met where it counts; its one-prompt check cannot count


def test_a_task_not_run_is_ruled_out_with_the_measured_violation_as_worst():
    """The screen stopped the point (perplexity beyond the tolerance on the selection split): its fidelity check is
    *ruled out by the screen*, not a violation with change ∞; its worst check is the measured teacher-forced one,
    with its size and interval; C1's closest point is read from measured checks only."""
    runs = full_runs()
    for r in point_runs("emad-out", flops=0.6, ppl=10.5):
        del r["tasks"]["fidelity"]
        r["quality"], r["not_run"] = quality_of(r["tasks"]), {"fidelity": "violates perplexity (teacher forced)"}
        runs.append(r)
    runs += point_runs("emad-near", flops=0.7, ppl=10.3)
    v = verdict(runs)["m"]
    out = next(p for p in v.points if p.point == "emad-out")
    assert out.state == "ruled out by the screen"
    ruled = [c for c in out.checks if c.metric == "fidelity.token_agreement"]
    assert all(c.state == "ruled out by the screen" and c.change is None and not c.counted for c in ruled)
    worst = out.worst
    assert worst.metric == "perplexity" and worst.state == "violated" and worst.change == pytest.approx(0.05, rel=1e-3)
    assert worst.lo > 0.01 and "selection split" in worst.units and worst.n == 24
    assert v.c1.falsified and v.c1.deciding.point == "emad-near"  # the measured violation closest to the tolerance
    assert "emad-out" in v.c1.literal_points
    assert "inf" not in v.c1.sentence() and "not run" not in v.c1.sentence()


def test_c1_cannot_pass_without_a_counted_perplexity_check():
    """Agreement met but perplexity scored on too few windows (not counted): the point is unresolved, not met."""
    runs = full_runs()
    for r in point_runs("emad-short", flops=0.6, ppl=10.0):
        r["tasks"]["perplexity"]["samples"]["perplexity"] = r["tasks"]["perplexity"]["samples"]["perplexity"][:6]
        runs.append(r)
    v = verdict(runs)["m"]
    point = next(p for p in v.points if p.point == "emad-short")
    assert point.uncounted_defining and point.state == "unresolved" and v.c1.outcome == "unresolved"
    assert "perplexity check is not counted" in v.c1.sentence()
