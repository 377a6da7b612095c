"""The states a tolerance check, a speed-up floor or a point can be in: one enum, shared by the numerics
(:mod:`emad.evaluation.intervals`), the checks (:mod:`emad.evaluation.checks`), the decisions
(:mod:`emad.evaluation.judge`) and the report. Being a :class:`~enum.StrEnum`, a state reads as its words in
JSON and in the report; code compares members, never English strings."""

from __future__ import annotations

from enum import StrEnum

MIN_UNITS = 8  # no check in the verdict rests on fewer units


class State(StrEnum):
    """A check's (or a point's) state."""

    MET = "met"
    VIOLATED = "violated"
    UNRESOLVED = "unresolved"
    IDENTICAL = "identical by construction"
    NOT_COUNTED = f"not counted (n < {MIN_UNITS})"
    RULED_OUT = "ruled out by the screen"
    UNTESTED = "untested at this size"  # a point: every check that counts is met, some named check cannot count


MET, VIOLATED, UNRESOLVED = State.MET, State.VIOLATED, State.UNRESOLVED
IDENTICAL, NOT_COUNTED, RULED_OUT, UNTESTED = State.IDENTICAL, State.NOT_COUNTED, State.RULED_OUT, State.UNTESTED
