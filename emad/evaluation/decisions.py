"""C1 and C2 decided from named reasons: one table each, written once here, applied to every family alike.

Each criterion's outcome is a function of its reason: :data:`C1_TABLE` and :data:`C2_TABLE` list the reasons in the
order they are tried, each with the condition that selects it and the outcome it gives, and :func:`decide_c1` /
:func:`decide_c2` walk them in that order. docs/paper-plan.md holds the same tables (:func:`table_markdown`) and the
report's rules paragraph reproduces them, so the words and the code cannot part. A label never rests on what
happened to be measured: a family with no evaluated point at the required reduction tested nothing about C1
(untested), and a family none of whose points within the tolerances does less work than full depth fails C2 for
that reason alone, whether or not such a point was timed.

Terms (the points are :class:`~emad.evaluation.judge.PointAssessment`, judged on the confirmation half):

- C1's *candidates*: points with ≥ ``min_flops_reduction`` fewer FLOPs on the judged half, not ruled out by a
  teacher-forced violation that stands. A pass (some candidate met) is an existence claim: each candidate judged
  at 1 − 0.05/m over the m candidates (Bonferroni). A falsification (every candidate beyond a tolerance; for C2,
  every candidate slow) is wrong only where some candidate is not, whose own 95% check guards it (an
  intersection–union test): the candidates are read at 95%.
- C2's *eligible* points: met, untested at this size or unresolved. Its *candidates*: eligible points that do less
  work than full depth — fewer FLOPs on the judged half, or a strategy (EAD, speculative decoding: it saves
  sequential passes, not FLOPs, and the decode stage times every one). Only candidates are read for C2; a timed
  point that is no candidate is shown as information, never as the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from emad.evaluation.intervals import LEVEL
from emad.evaluation.states import MET, RULED_OUT, UNRESOLVED, UNTESTED, VIOLATED

if TYPE_CHECKING:  # the points and thresholds: emad.evaluation.judge imports this module
    from emad.evaluation.checks import Thresholds
    from emad.evaluation.judge import PointAssessment

EPS = 1e-9


class Outcome(StrEnum):
    """A criterion's outcome."""

    PASS = "pass"
    FAIL = "fail"  # falsified
    UNTESTED = "untested"  # not falsified; nothing (or nothing that counts) tested it at this size
    UNRESOLVED = "unresolved"


class C1Reason(StrEnum):
    """Why C1 came out as it did (the value is the name metrics.json carries as ``c1_reason``)."""

    NO_POINTS = "no_points"
    SHORT = "short"
    MET = "met"
    UNTESTED = "untested"
    OPEN = "open"
    BEYOND = "beyond"
    UNMEASURED = "unmeasured"


class C2Reason(StrEnum):
    """Why C2 came out as it did (the value is the name metrics.json carries as ``c2_reason``)."""

    NO_POINTS = "no_points"
    NONE_ELIGIBLE = "none_eligible"
    NO_SAVING = "no_saving"
    FAST = "fast"
    UNTESTED = "untested"
    OPEN = "open"
    NOT_TIMED = "not_timed"
    SLOW = "slow"


@dataclass(frozen=True)
class Rule:
    """One row of a decision table: the ``reason``, the ``condition`` that selects it, its ``outcome``."""

    reason: StrEnum
    condition: str
    outcome: Outcome


C1_TABLE: tuple[Rule, ...] = (
    Rule(C1Reason.NO_POINTS, "no point was evaluated on every domain", Outcome.UNTESTED),
    Rule(C1Reason.SHORT, "no evaluated point reaches the required FLOPs reduction (nothing tested C1)",
         Outcome.UNTESTED),
    Rule(C1Reason.MET, "a candidate is met", Outcome.PASS),
    Rule(C1Reason.UNTESTED, "a candidate is met where its checks count, but a named check cannot count at this size",
         Outcome.UNTESTED),
    Rule(C1Reason.OPEN, "a candidate is unresolved", Outcome.UNRESOLVED),
    Rule(C1Reason.BEYOND, "every candidate is measured beyond a tolerance", Outcome.FAIL),
    Rule(C1Reason.UNMEASURED, "no candidate has a measured check", Outcome.UNRESOLVED),
)

C2_TABLE: tuple[Rule, ...] = (
    Rule(C2Reason.NO_POINTS, "no point was evaluated on every domain", Outcome.UNTESTED),
    Rule(C2Reason.NONE_ELIGIBLE, "no point is within (or possibly within) the tolerances", Outcome.FAIL),
    Rule(C2Reason.NO_SAVING, "at matched accuracy no point does less work than full depth (no eligible point "
         "saves FLOPs on the judged half, none is a strategy) — whether or not any was timed", Outcome.FAIL),
    Rule(C2Reason.FAST, "a met candidate's speed-up interval lies at or above the gain", Outcome.PASS),
    Rule(C2Reason.UNTESTED, "a candidate untested at this size reaches the gain", Outcome.UNTESTED),
    Rule(C2Reason.OPEN, "a timed candidate is not shown below the gain", Outcome.UNRESOLVED),
    Rule(C2Reason.NOT_TIMED, "a candidate was not timed over prompts", Outcome.UNRESOLVED),
    Rule(C2Reason.SLOW, "every candidate was timed and lies wholly below the gain", Outcome.FAIL),
)

OUTCOME_WORDS = {Outcome.PASS: "pass", Outcome.FAIL: "fail (falsified)", Outcome.UNTESTED: "untested (not falsified)",
                 Outcome.UNRESOLVED: "unresolved"}


def outcome_of(reason: StrEnum) -> Outcome:
    """The outcome the tables give ``reason``."""
    for rule in C1_TABLE + C2_TABLE:
        if rule.reason is reason:
            return rule.outcome
    raise KeyError(f"no rule for reason {reason!r}")


def table_markdown() -> str:
    """Both decision tables in markdown, as docs/paper-plan.md and the report show them (first matching row wins)."""
    lines = []
    for name, table in (("C1", C1_TABLE), ("C2", C2_TABLE)):
        lines += [f"| {name} reason | when (first matching row) | outcome |", "|---|---|---|"]
        lines += [f"| `{r.reason}` | {r.condition} | {OUTCOME_WORDS[r.outcome]} |" for r in table]
        lines.append("")
    return "\n".join(lines).rstrip()


Reassess = Callable[[list["PointAssessment"], float], list["PointAssessment"]]


def family_wise(points: list[PointAssessment], reassess: Reassess | None) -> tuple[list[PointAssessment], float]:
    """``points`` judged so that one claim over all of them holds at 95% (Bonferroni: each at 1 − 0.05/m, the
    first step of Holm's procedure, which decides an existence claim), and that level."""
    if len(points) <= 1 or reassess is None:
        return points, LEVEL
    level = 1.0 - (1.0 - LEVEL) / len(points)
    return reassess(points, level), level


def _by_reduction(points: Sequence[PointAssessment]) -> list[PointAssessment]:
    return sorted(points, key=lambda p: (-p.reduction, p.label))


@dataclass(frozen=True)
class _Decision:
    """What both criteria's decisions hold: the ``reason`` (its outcome from the criterion's table) and the
    ``deciding`` point."""

    reason: C1Reason | C2Reason
    deciding: PointAssessment | None

    @property
    def outcome(self) -> Outcome:
        return outcome_of(self.reason)


@dataclass(frozen=True)
class C1Decision(_Decision):
    """C1: ``reason`` (its ``outcome`` from :data:`C1_TABLE`), the ``deciding`` point (judged at ``level``), the
    ``literal`` points (with the reduction, measured beyond a tolerance), the ``unresolved`` candidates and how many
    were judged (``candidates``)."""

    literal: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    candidates: int = 0
    level: float = LEVEL


@dataclass(frozen=True)
class C2Decision(_Decision):
    """C2: ``reason`` (its ``outcome`` from :data:`C2_TABLE`), the ``deciding`` point, the ``matched`` (met) and
    ``unresolved`` (unresolved or untested) eligible points, how many timed candidates were judged (``timed``) and
    at which ``level``, the candidates not timed over prompts (``untimed``) and the eligible points timed that are
    no candidate (``information``: they do no less work than full depth)."""

    matched: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    timed: int = 0
    level: float = LEVEL
    untimed: list[str] = field(default_factory=list)
    information: list[PointAssessment] = field(default_factory=list)


def decide_c1(points: list[PointAssessment], thr: Thresholds, reassess: Reassess | None = None) -> C1Decision:
    """C1 over ``points`` (judged at 95%) by :data:`C1_TABLE`; ``reassess`` judges the candidates at a stricter
    level for a pass. A pass is an existence claim — some candidate is within every tolerance — and holds at 95%
    family-wise only with each candidate at 1 − 0.05/m; a falsification claims that *every* candidate is beyond a
    tolerance, which is wrong only if some candidate is within them, and that candidate's own 95% check guards it
    (an intersection–union test): it reads the candidates at 95%."""
    if not points:
        return C1Decision(C1Reason.NO_POINTS, None)
    big = [p for p in points if p.reduction >= thr.min_flops_reduction - EPS]
    if not big:
        return C1Decision(C1Reason.SHORT, _by_reduction(points)[0])
    judged, level = family_wise([p for p in big if p.state != RULED_OUT], reassess)
    by_state = {s: _by_reduction([p for p in judged if p.state == s]) for s in (MET, UNTESTED, UNRESOLVED)}
    literal = sorted(p.label for p in big if p.state in (VIOLATED, RULED_OUT))
    open_labels = sorted(p.label for p in by_state[UNTESTED] + by_state[UNRESOLVED])
    m = len(judged)
    if by_state[MET]:
        return C1Decision(C1Reason.MET, by_state[MET][0], literal, open_labels, m, level)
    measured = [p for p in big if p.worst is not None and p.worst.severity is not None]
    if measured and all(p.state in (VIOLATED, RULED_OUT) for p in big):
        p = min(measured, key=lambda p: (p.worst.severity, -p.reduction, p.label))
        return C1Decision(C1Reason.BEYOND, p, literal, [], m, LEVEL)
    for state, reason in ((UNTESTED, C1Reason.UNTESTED), (UNRESOLVED, C1Reason.OPEN)):
        if by_state[state]:
            return C1Decision(reason, by_state[state][0], literal, open_labels, m, level)
    unresolved = _by_reduction([p for p in big if p.state not in (VIOLATED, RULED_OUT)])
    if unresolved:  # unresolved at 95% where the stricter level left none open: open all the same
        return C1Decision(C1Reason.OPEN, unresolved[0], literal, sorted(p.label for p in unresolved), m, level)
    return C1Decision(C1Reason.UNMEASURED, None, literal, [], m, level)


def saves_work(p: PointAssessment) -> bool:
    """``p`` does less work than full depth: fewer FLOPs on the judged half, or it is a strategy (it saves
    sequential passes; its FLOPs may exceed full depth's)."""
    return p.strategy or p.reduction > EPS


def decide_c2(points: list[PointAssessment], thr: Thresholds, reassess: Reassess | None = None) -> C2Decision:
    """C2 over ``points`` by :data:`C2_TABLE`; ``reassess`` judges the timed candidates at a stricter level."""
    if not points:
        return C2Decision(C2Reason.NO_POINTS, None)
    need = 1.0 + thr.min_speed_gain
    eligible = [p for p in points if p.state in (MET, UNTESTED, UNRESOLVED)]
    if not eligible:
        return C2Decision(C2Reason.NONE_ELIGIBLE, None)
    labels = sorted(p.label for p in eligible if p.state == MET)
    open_labels = sorted(p.label for p in eligible if p.state in (UNTESTED, UNRESOLVED))
    candidates = [p for p in eligible if saves_work(p)]
    information = sorted((p for p in eligible if not saves_work(p) and p.speed is not None),
                         key=lambda p: (-(p.speed.value or 0.0), p.label))
    if not candidates:
        return C2Decision(C2Reason.NO_SAVING, None, labels, open_labels, information=information)
    timed, level = family_wise([p for p in candidates if p.speed is not None and p.speed.value is not None],
                               reassess)
    timed = sorted(timed, key=lambda p: (-(p.speed.lo if p.speed.defined else 0.0), -p.speed.value, p.label))
    untimed = sorted(p.label for p in candidates if p.label not in {t.label for t in timed})
    rest = dict(matched=labels, unresolved=open_labels, timed=len(timed), level=level, untimed=untimed,
                information=information)
    passing = [p for p in timed if p.state == MET and p.speed_state(need) == MET]
    if passing:
        return C2Decision(C2Reason.FAST, passing[0], **rest)
    fast_untested = [p for p in timed if p.state == UNTESTED and p.speed_state(need) == MET]
    if fast_untested:
        return C2Decision(C2Reason.UNTESTED, fast_untested[0], **rest)
    # a falsification claims every candidate slow: each read at 95% (an intersection–union test, as for C1)
    alone = [p for p in candidates if p.speed is not None and p.speed.value is not None]
    slow = not untimed and alone and all(p.speed_state(need) == VIOLATED for p in alone)
    if slow:
        best = max(alone, key=lambda p: (p.speed.value, p.label))
        return C2Decision(C2Reason.SLOW, best, **{**rest, "level": LEVEL})
    open_ = [p for p in timed if p.speed_state(need) != VIOLATED]
    if open_:
        return C2Decision(C2Reason.OPEN, max(open_, key=lambda p: (p.speed.value, p.label)), **rest)
    best = max(timed, key=lambda p: (p.speed.value, p.label)) if timed else None
    return C2Decision(C2Reason.NOT_TIMED if untimed else C2Reason.OPEN, best, **rest)
