"""A verdict that holds at its sample size: units equal up to float noise are equal, a label stands only where the
side of the interval it rests on covers at its size, token-level checks count prompts, power is taken at the level
a check is judged at, and C1 and C2 read "not falsified; untested at this size" where a check they name cannot
count; C2 is falsified only when every eligible point was timed."""

from __future__ import annotations

import json

import pytest

from emad.evaluation import coverage
from emad.evaluation.checks import build_check
from emad.evaluation.coverage import Coverage
from emad.evaluation.intervals import metric_value
from emad.evaluation.metrics import METRICS, quality_of
from emad.evaluation.units import CONFIRMATION, SELECTION, Units, indices
from emad.report import metrics_summary, report_markdown
from emad.report.verdict import verdict
from tests.test_report import full_runs, point_runs, powered  # noqa: F401 (powered: a fixture)


def table_of(spec: dict, replicates: int = 100_000) -> Coverage:
    """A coverage table from ``{metric: {method: {n: {side: coverage}}}}`` at 95% (or ``{level: {side: coverage}}``
    per n), one bin a size, ``replicates`` simulated samples a cell (its Monte Carlo bound then sits 0.1 point
    below its coverage)."""
    rows = []
    for metric, methods in spec.items():
        for method, sizes in methods.items():
            for n, cells in sizes.items():
                by_level = cells if all(isinstance(k, float) for k in cells) else {0.95: cells}
                for level, sides in by_level.items():
                    rows += [[metric, method, n, coverage.ALL_BINS, level, side, round(c * replicates), replicates]
                             for side, c in sides.items()]
    return Coverage.from_dict({"table": {"columns": ["metric", "method", "n", "changed", "level", "side", "covered",
                                                     "replicates"], "rows": rows}})


def _windows(nll: list[float], tokens: int = 64) -> dict:
    """A perplexity task's result from its windows' summed NLL."""
    samples = [[v, tokens] for v in nll]
    return {"perplexity": {"perplexity": metric_value("perplexity", samples), "samples": {"perplexity": samples}}}


def test_windows_equal_up_to_float_noise_never_meet_a_perplexity_check():
    """The case that signed "met" on data that never saw the method: on the 8 confirmation windows the point never
    exited (each window's NLL equals full depth's up to 1e-6 nats), on the 8 selection windows one window exited and
    lost 164 nats. The confirmation check is not met: equal windows bound no relative change."""
    full_nll = [150.0 + 3.0 * i for i in range(16)]
    point_nll = list(full_nll)
    confirmation, selection = indices(16, CONFIRMATION, 0, "perplexity"), indices(16, SELECTION, 0, "perplexity")
    for i in confirmation:
        point_nll[i] += 1e-6 * (1 if i % 2 else -1)
    point_nll[selection[3]] += 164.0
    full = {"run_id": "full", "tasks": _windows(full_nll)}
    point = {"run_id": "p", "tasks": _windows(point_nll)}
    for run in (full, point):
        run["quality"] = quality_of(run["tasks"])
    check = build_check("prose", "perplexity", point, full, 0.01, Units(CONFIRMATION, 0))
    assert check.state == "unresolved" and check.lo is None
    assert "every paired unit equal" in check.method and "within float noise" in check.method
    everything = build_check("prose", "perplexity", point, full, 0.01, Units(SELECTION, 0))
    assert everything.state != "met" and everything.change > 0.01  # +164 nats on one of 8 windows


def test_a_label_its_interval_cannot_carry_at_its_size_is_withheld():
    """A bootstrap whose upper bound covered 69% at n 8 in the simulation carries no "met": the check is
    underpowered, kept out of the gate, and says from which size it would count."""
    table = table_of({"perplexity": {"bootstrap": {8: {"lower": 0.97, "upper": 0.69},
                                                   64: {"lower": 0.975, "upper": 0.97}}}})
    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.01, acc=0.5)
    plain = verdict(runs)["m"]
    judged = next(p for p in plain.points if p.point == "emad-a")
    assert {c.state for c in judged.checks if c.metric == "perplexity"} == {"met"}  # 25 judged windows: BCa
    with coverage.using(table):
        v = verdict(runs)["m"]
    checks = [c for p in v.points if p.point == "emad-a" for c in p.checks if c.metric == "perplexity"]
    assert checks and all(c.state == "unresolved" and c.underpowered and not c.counted for c in checks)
    assert all("met withheld: the upper bound of its bootstrap interval covers 69.0%" in c.power_text()
               and "at n 24" in c.power_text() and "at no simulated level reaches 96.0%" in c.power_text()
               and "covers from n 64" in c.power_text() for c in checks)
    assert coverage.active() is None  # the table was in force inside the block only


def test_c1_with_its_accuracy_checks_underpowered_is_untested_not_passed():
    """Perplexity met, token agreement on 24 judged prompts (368 needed): C1 is not falsified but untested at this
    size, naming the check and what it would need — not a pass."""
    v = verdict(full_runs() + point_runs("emad-a", flops=0.8, ppl=10.01, acc=0.5, tps=130))["m"]
    point = next(p for p in v.points if p.point == "emad-a")
    assert {c.metric: c.state for c in point.checks if c.domain == "prose"} == {
        "perplexity": "met", "fidelity.token_agreement": "met"}
    assert point.state == "untested at this size" and not v.c1.passed and not v.c1.falsified
    assert v.c1.outcome == "untested" and v.c2.outcome == "untested"
    sentence = v.c1.sentence()
    assert sentence.startswith("C1 not falsified; untested at this size")
    assert "fidelity.token_agreement on prose (needs ≥ 368 prompts with every one equal; has 24)" in sentence
    assert v.c2.sentence().startswith("C2 not falsified; untested at this size")


def test_power_is_taken_at_the_level_a_check_is_judged_at():
    """Two candidates: each judged at 97.5%, where a 1-point check with every unit equal needs 437 units (368 at
    95%); four: 505 at 98.75%."""
    metric = METRICS.get("fidelity.exact_match")
    assert [metric.needs(0.01, level) for level in (0.95, 0.975, 0.9875)] == [368, 437, 505]
    runs = full_runs() + point_runs("emad-a", flops=0.8) + point_runs("emad-b", flops=0.7)
    v = verdict(runs)["m"]
    judged = [c for c in v.c1.deciding.checks if c.metric == "fidelity.token_agreement"]
    assert v.c1.outcome == "untested" and judged and {(c.needs, c.level) for c in judged} == {(437, 0.975)}
    assert "needs ≥ 437 prompts" in v.c1.sentence()


@pytest.mark.usefixtures("powered")
def test_c2_is_not_falsified_while_an_eligible_point_was_not_timed():
    """Every timed point is slower than the gain, but one eligible point that saves FLOPs was never timed over
    prompts: C2 is unresolved, naming it — not falsified."""
    slow = point_runs("emad-a", flops=0.7, tps=95)
    untimed = point_runs("emad-b", flops=0.6, tps=99)
    for r in untimed:
        r["cost"]["speed_unit"], r["cost"]["speed_pairs"] = "repeat", [[99.0, 100.0]]
    v = verdict(full_runs() + slow + untimed)["m"]
    assert v.c2.outcome == "unresolved" and v.c2.deciding.point == "emad-a"
    assert "emad-b" in v.c2.sentence() and "falsified only when every one of them is" in v.c2.sentence()
    assert verdict(full_runs() + slow)["m"].c2.outcome == "fail"  # every eligible point timed and slow


def test_the_new_states_reach_the_report_metrics_and_readme_blocks(tmp_path):
    """An untested C1 is said as such in report.md, metrics.json and the README's numbers block."""
    import importlib.util
    from pathlib import Path

    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.01)
    v = verdict(runs)
    md = report_markdown(runs, v, {}, [])
    assert "C1 not falsified; untested at this size" in md
    metrics = metrics_summary(runs, v)
    assert metrics["m"]["emad"]["c1"] == "untested"
    spec = importlib.util.spec_from_file_location("results_numbers",
                                                  Path(__file__).resolve().parents[1] / "tools" / "results_numbers.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.OUTCOME["untested"] == "is not falsified; untested at this size"
    json.dumps(metrics)


def test_the_flops_reduction_is_read_on_the_half_the_checks_judge():
    """A point that saves FLOPs only on the selection half's windows: its reduction on the confirmation half (the
    units its checks judge) is 0, not the every-unit figure; a run file without per-unit costs reads every unit."""
    runs = full_runs() + point_runs("emad-a", flops=0.8)
    for r in runs:
        n = len(r["tasks"]["perplexity"]["samples"]["perplexity"])
        selection = set(indices(n, SELECTION, 0, "perplexity"))
        cost = [[0.5, 1.0] if i in selection and r["point"] != "full" else [1.0, 1.0] for i in range(n)]
        r["tasks"]["perplexity"]["unit_flops"] = cost
        r["tasks"]["fidelity"]["unit_flops"] = [[1.0, 1.0]] * len(r["tasks"]["fidelity"]["samples"]["token_agreement"])
    point = next(p for p in verdict(runs)["m"].points if p.point == "emad-a")
    assert point.flops_half == "confirmation half" and point.reduction == pytest.approx(0.0)
    plain = next(p for p in verdict(full_runs() + point_runs("emad-a", flops=0.8))["m"].points
                 if p.point == "emad-a")
    assert plain.flops_half == "every unit" and plain.reduction == pytest.approx(0.2)


@pytest.mark.usefixtures("powered")
def test_a_speed_up_whose_lower_bound_does_not_cover_at_its_prompts_does_not_pass_c2():
    """An interval wholly above the gain, over 8 prompts where the t interval's lower bound covered 95% in the
    simulation: C2 is unresolved, saying why and from how many prompts it would count."""
    runs = full_runs() + point_runs("emad-a", flops=0.8, ppl=10.01, tps=130)
    assert verdict(runs)["m"].c2.outcome == "pass"
    covers = {"bootstrap": {8: {"lower": 0.97, "upper": 0.97}}}
    table = table_of({"perplexity": covers, "fidelity.token_agreement": covers,
                      "speed": {"t-log": {8: {"lower": 0.95, "upper": 0.98}, 32: {"lower": 0.97, "upper": 0.98}}}})
    with coverage.using(table):
        v = verdict(runs)["m"]
    assert v.c2.outcome == "unresolved" and "its lower bound covers 95.0% at 95% and reaches 96.0% at no simulated level " \
        "(from 32 prompts it does)" in v.c2.sentence()


@pytest.mark.usefixtures("powered")
def test_a_side_that_covers_only_at_a_wider_level_is_judged_there_not_withheld():
    """8 log ratios like the control's fixed_30 (1.41×, 95% CI 1.38 to 1.43): at 95% the t interval's lower side
    covers 95.4% in the simulation (96% needed), at 99% it covers 99.5%. C2 is judged on the 99% bound, which
    still lies above 1.10: a pass, naming the level."""
    ratios = [1.38, 1.44, 1.40, 1.43, 1.39, 1.42, 1.41, 1.41]
    runs = full_runs()
    for r in point_runs("fixed-30", flops=0.56, ppl=10.0, tps=141):
        r["cost"]["speed_pairs"] = [[100 * x, 100.0] for x in ratios]
        runs.append(r)
    covers = {"bootstrap": {8: {0.95: {"lower": 0.99, "upper": 0.99}}}}
    speed = {"t-log": {8: {0.95: {"lower": 0.954, "upper": 0.98}, 0.99: {"lower": 0.995, "upper": 0.995}}}}
    table = table_of({"perplexity": covers, "fidelity.token_agreement": covers, "speed": speed})
    assert table.calibrated("speed", "t-log", 8, "lower", 0.95) == 0.99
    assert not table.trusted("speed", "t-log", 8, "lower", 0.95) and table.trusted("speed", "t-log", 8, "lower", 0.99)
    with coverage.using(table):
        v = verdict(runs, ("fixed",))["m"]
        judged = v.c2.deciding.speed_judged(1.10)
    assert v.c2.outcome == "pass" and v.c2.reason == "fast"
    assert judged.interval.level == 0.99 and judged.interval.lo > 1.10
    assert judged.interval.lo < v.c2.deciding.speed.lo  # wider than the 95% interval
    assert "99% CI (calibrated from 95%)" in v.c2.sentence()
