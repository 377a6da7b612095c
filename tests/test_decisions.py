"""C1 and C2 from named reasons (emad.evaluation.decisions): one fixture per row of each table, its outcome and
reason; the tables as docs/paper-plan.md and the report show them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from emad.evaluation.checks import Thresholds
from emad.evaluation.decisions import (
    C1_TABLE,
    C2_TABLE,
    C1Reason,
    C2Reason,
    Outcome,
    decide_c1,
    decide_c2,
    table_markdown,
)
from emad.evaluation.intervals import Interval, floor_state
from emad.evaluation.states import MET, RULED_OUT, UNRESOLVED, UNTESTED, VIOLATED

ROOT = Path(__file__).resolve().parents[1]
THR = Thresholds()


@dataclass
class Point:
    """The attributes of a PointAssessment the decisions read."""

    label: str
    reduction: float
    state: str = MET
    severity: float | None = None  # of its worst measured check
    speed: Interval | None = None
    strategy: bool = False

    @property
    def worst(self):
        return None if self.severity is None else SimpleNamespace(severity=self.severity)

    def speed_state(self, floor: float):
        return None if self.speed is None else floor_state(self.speed, floor)


def timed(lo: float, hi: float) -> Interval:
    return Interval((lo * hi) ** 0.5, lo, hi, 8, "student-t on log ratios")


C1_CASES = {
    C1Reason.NO_POINTS: [],
    C1Reason.SHORT: [Point("a", 0.045), Point("b", 0.01, VIOLATED, 3.0)],
    C1Reason.MET: [Point("a", 0.2, MET), Point("b", 0.3, VIOLATED, 2.0)],
    C1Reason.UNTESTED: [Point("a", 0.2, UNTESTED), Point("b", 0.3, UNRESOLVED)],
    C1Reason.OPEN: [Point("a", 0.2, UNRESOLVED, 0.9), Point("b", 0.3, VIOLATED, 2.0)],
    C1Reason.BEYOND: [Point("a", 0.2, VIOLATED, 2.0), Point("b", 0.3, RULED_OUT, 5.0), Point("c", 0.05, MET)],
    C1Reason.UNMEASURED: [Point("a", 0.2, RULED_OUT)],
}


@pytest.mark.parametrize("reason", list(C1Reason))
def test_each_c1_reason_gives_its_outcome(reason):
    d = decide_c1(C1_CASES[reason], THR)
    assert d.reason == reason
    assert d.outcome == next(r.outcome for r in C1_TABLE if r.reason == reason)


def test_c1_short_of_the_reduction_is_untested_never_falsified():
    d = decide_c1(C1_CASES[C1Reason.SHORT], THR)
    assert d.outcome == Outcome.UNTESTED and d.deciding.label == "a" and not d.literal


C2_CASES = {
    C2Reason.NO_POINTS: [],
    C2Reason.NONE_ELIGIBLE: [Point("a", 0.2, VIOLATED, 2.0), Point("b", 0.3, RULED_OUT)],
    C2Reason.NO_SAVING: [Point("a", -0.006, MET), Point("b", -1.8, UNRESOLVED)],
    C2Reason.FAST: [Point("a", 0.2, MET, speed=timed(1.38, 1.43)), Point("b", 0.3, MET)],
    C2Reason.UNTESTED: [Point("a", 0.2, UNTESTED, speed=timed(1.38, 1.43))],
    C2Reason.OPEN: [Point("a", 0.2, MET, speed=timed(1.05, 1.2))],
    C2Reason.NOT_TIMED: [Point("a", 0.2, MET, speed=timed(0.8, 0.9)), Point("b", 0.1, UNRESOLVED)],
    C2Reason.SLOW: [Point("a", 0.2, MET, speed=timed(0.8, 0.9)), Point("b", -0.1, MET)],
}


@pytest.mark.parametrize("reason", list(C2Reason))
def test_each_c2_reason_gives_its_outcome(reason):
    d = decide_c2(C2_CASES[reason], THR)
    assert d.reason == reason
    assert d.outcome == next(r.outcome for r in C2_TABLE if r.reason == reason)


def test_c2_without_a_point_saving_work_is_the_same_timed_or_not():
    untimed = [Point("a", -0.006, MET), Point("b", -0.02, UNRESOLVED)]
    slow = [Point("a", -0.006, MET, speed=timed(0.88, 0.92)), Point("b", -0.02, UNRESOLVED)]
    fast = [Point("a", -0.006, MET, speed=timed(1.3, 1.4)), Point("b", -0.02, UNRESOLVED)]
    decisions = [decide_c2(points, THR) for points in (untimed, slow, fast)]
    assert {(d.outcome, d.reason, d.deciding) for d in decisions} == {(Outcome.FAIL, C2Reason.NO_SAVING, None)}
    assert [p.label for p in decisions[1].information] == ["a"]  # the timed figure is information, not the reason


def test_a_strategy_saves_sequential_passes_and_stays_a_c2_candidate():
    spec = [Point("spec", -0.4, MET, speed=timed(1.3, 1.4), strategy=True)]
    assert decide_c2(spec, THR).reason == C2Reason.FAST
    slow = [Point("spec", -0.4, MET, speed=timed(0.56, 0.67), strategy=True)]
    assert decide_c2(slow, THR).reason == C2Reason.SLOW


def test_the_tables_are_in_the_paper_plan_as_the_report_shows_them():
    assert table_markdown() in (ROOT / "docs" / "paper-plan.md").read_text()
    rows = [line for line in table_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) == len(C1_TABLE) + len(C2_TABLE) == len(C1Reason) + len(C2Reason)


def test_a_falsification_reads_every_candidate_at_95_and_a_pass_the_bonferroni_level():
    """Every candidate beyond a tolerance at 95% falsifies C1 though one is unresolved at 1 − 0.05/m: the claim
    "all beyond" is wrong only where that candidate is within, which its own 95% check rules out. A pass needs the
    stricter level: met at 95% but unresolved at 97.5% is no pass."""
    stricter = {"a": Point("a", 0.2, UNRESOLVED, 1.5), "b": Point("b", 0.3, VIOLATED, 3.0)}
    reassess = lambda points, level: [stricter[p.label] for p in points]  # noqa: E731
    beyond = decide_c1([Point("a", 0.2, VIOLATED, 1.5), Point("b", 0.3, VIOLATED, 3.0)], THR, reassess)
    assert beyond.reason == C1Reason.BEYOND and beyond.level == 0.95 and beyond.outcome == Outcome.FAIL
    stricter["a"] = Point("a", 0.2, UNRESOLVED, 0.9)
    open_ = decide_c1([Point("a", 0.2, MET, 0.9), Point("b", 0.3, VIOLATED, 3.0)], THR, reassess)
    assert open_.reason == C1Reason.OPEN and open_.deciding.label == "a" and open_.level == pytest.approx(0.975)
