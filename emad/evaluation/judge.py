"""A point judged over its domains (DESIGN.md §4): its runs aggregated, its checks taken, its state. No prose here —
:mod:`emad.report.verdict` words the decisions — and C1 and C2 are decided from named reasons in
:mod:`emad.evaluation.decisions`, so the report, the decode stage's early stop of C2 and any other reader share one
rule.

- A point (:class:`PointAssessment`, :func:`assess_point`): its runs on every domain, token-weighted FLOPs on the
  judged half, its checks on the confirmation split (:mod:`emad.evaluation.checks`), its C2 interval over prompts;
  its state by :func:`gate_state`: *met* only when every check the criteria name (perplexity and every
  accuracy-like task the run has) counts and is met, or the point is identical by construction; *untested at this
  size* when every check that counts is met but a named one cannot count (underpowered, fewer than 8 units, no
  samples). A task the screen did not run rules the point out only where the teacher-forced violation the screen
  measured stands under the rules in force (:func:`screened_checks`, the coverage table included); else that task
  is unresolved.
- C2 on one domain, as the decode stage's early stop reads it: :func:`passes_c2`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from emad.evaluation import coverage, identity
from emad.evaluation.checks import (
    IDENTICAL,
    MET,
    MIN_SPEED_PROMPTS,
    RULED_OUT,
    UNRESOLVED,
    VIOLATED,
    Check,
    State,
    Thresholds,
    build_check,
    combined_state,
)
from emad.evaluation.identity import split_family
from emad.evaluation.intervals import LEVEL, Interval, floor_state, ratio_interval
from emad.evaluation.speed_devices import DeviceSplit, split_by_device
from emad.evaluation.states import UNTESTED
from emad.evaluation.units import CONFIRMATION, SELECTION, Units
from emad.exits.registries import STRATEGIES

EPS = 1e-9


def finite(x: Any) -> bool:
    """A real number that is neither inf nor nan (bools are not numbers here)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def uncounted_defining(checks: Sequence[Check]) -> list[Check]:
    """The relative (perplexity) checks among ``checks`` that do not enter the gate (too few windows, not run)."""
    return [c for c in checks if c.relative and not c.counted and c.state != IDENTICAL]


def untested(checks: Sequence[Check]) -> list[Check]:
    """The named checks among ``checks`` that do not enter the gate: underpowered, on fewer than 8 units, or without
    a measurement (a task the screen stopped is a measurement: its violation stands)."""
    return [c for c in checks if not c.counted and c.state not in (IDENTICAL, RULED_OUT)]


def gate_state(checks: Sequence[Check]) -> State:
    """:func:`~emad.evaluation.checks.combined_state`, except that ``met`` needs every named check counted: where
    every check that counts is met but one cannot count (:func:`untested`), the point is untested at this size —
    not met (C1 names perplexity and every accuracy; without them no point is shown within the tolerances)."""
    state = combined_state(list(checks))
    return UNTESTED if state == MET and untested(checks) else state


@dataclass
class PointAssessment:
    """One operating point of the model, aggregated over all its domains."""

    label: str
    point: str
    calibration: str | None
    family: str
    domains: list[str]
    run_ids: list[str]
    mlflow_run_ids: list[str]
    flops_ratio: float
    speedup: float | None
    checks: list[Check] = field(default_factory=list)
    flops_by_domain: dict[str, float] = field(default_factory=dict)
    curve: str | None = None
    knob: str | None = None
    value: float | None = None
    speed: Interval | None = None
    load_avg: float | None = None
    depths: dict[str, dict[str, int]] = field(default_factory=dict)  # domain -> tokens per exit depth
    speed_reference: str | None = None  # the full-depth decoder C2's pairs are against (the faster one timed)
    speedup_by_reference: dict[str, float] = field(default_factory=dict)  # every full-depth decoder timed
    screened: list[Check] = field(default_factory=list)  # a ruled-out point's violations on the selection split
    level: float = LEVEL  # of its intervals (above 95% where one claim rests on several points)
    runs: list[dict] = field(default_factory=list, repr=False)  # its run records (one per domain)
    flops_half: str = "confirmation half"  # the units its FLOPs ratio is read on (those its checks judge)
    speed_device: str | None = None  # the device ``speed`` is read on, set where its runs were timed on several
    speed_left_out: list[dict] = field(default_factory=list)  # then the runs left out: domain, run_id, device, pairs
    strategy: bool = False  # a strategy (EAD, speculative decoding): saves sequential passes, not FLOPs

    @property
    def reduction(self) -> float:
        return 1.0 - self.flops_ratio

    @property
    def named(self) -> str:
        """The label with the family (method, readout, estimator): ``emad-topk_1@stdlib-prose (emad:topk)``."""
        return f"{self.label} ({self.family})"

    @property
    def state(self) -> State:
        """``ruled out by the screen`` when a task was not run for it; else ``violated`` if a counted check is,
        ``met`` if every counted check is and its perplexity check is counted on every domain that has one (C1's
        defining check: without it no point is shown within the tolerances), else ``unresolved``."""
        return gate_state(self.checks)

    @property
    def uncounted_defining(self) -> list[Check]:
        """The point's relative (perplexity) checks that do not enter the gate (too few windows, not run)."""
        return uncounted_defining(self.checks)

    @property
    def untested(self) -> list[Check]:
        """The point's named checks that do not enter the gate (:func:`untested`)."""
        return untested(self.checks)

    @property
    def underpowered(self) -> list[Check]:
        """The checks kept out of the gate because they cannot be met at their size."""
        return [c for c in self.checks if c.measured and c.underpowered and not c.counted]

    @property
    def within_tolerance(self) -> bool:
        """Every tolerance is met at this sample size."""
        return self.state == MET

    def speed_judged(self, floor: float) -> SpeedJudgement | None:
        """C2's judgement of this point's speed-up against ``floor`` (:func:`judge_speed`; None: not timed over
        prompts)."""
        if self.speed is None:
            return None
        return judge_speed(self.speed, floor, lambda level: _prompt_speed(self.runs, level)[0])

    def speed_withheld(self, floor: float) -> str | None:
        """Why this point's speed-up interval carries no label against ``floor`` though it lies on one side of it
        (no simulated level makes that side cover at its number of prompts); None otherwise."""
        judged = self.speed_judged(floor)
        return None if judged is None else judged.withheld

    def speed_state(self, floor: float) -> str | None:
        """C2's state of this point's speed-up interval against ``floor`` (None: not timed over prompts)."""
        judged = self.speed_judged(floor)
        return None if judged is None else judged.state

    @property
    def worst(self) -> Check | None:
        """The measured check furthest from being met: for a point the screen ruled out, its worst teacher-forced
        violation on the selection split; else a violated one before an unresolved one, then by severity, counted
        checks first. None when nothing was measured."""
        pool = self.screened if self.state == RULED_OUT and self.screened else \
            [c for c in self.checks if c.measured]
        return max(pool, key=lambda c: (c.counted, c.rank), default=None)

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {"label": self.label, "point": self.point, "calibration": self.calibration, "family": self.family,
                "domains": self.domains, "run_ids": self.run_ids, "mlflow_run_ids": self.mlflow_run_ids,
                "curve": self.curve, "knob": self.knob, "value": self.value,
                "flops_ratio": self.flops_ratio, "flops_reduction": self.reduction, "flops_half": self.flops_half,
                "speedup": self.speedup,
                "speed": self.speed.to_dict() if self.speed else None, "load_avg": self.load_avg,
                "speed_reference": self.speed_reference, "speedup_by_reference": self.speedup_by_reference,
                **({"speed_device": self.speed_device, "speed_left_out": self.speed_left_out}
                   if self.speed_device is not None or self.speed_left_out else {}),
                "flops_by_domain": self.flops_by_domain,
                "state": str(self.state), "within_tolerance": self.within_tolerance,
                "worst": worst.describe() if worst else None,
                "underpowered": [f"{c.metric} on {c.domain}: {c.power_text()}" for c in self.underpowered],
                "checks": [c.to_dict() for c in self.checks],
                "screened": [c.to_dict() for c in self.screened]}




def _token_weights(runs: Sequence[dict]) -> list[float]:
    tokens = [r.get("cost", {}).get("tokens") for r in runs]
    if all(isinstance(t, int | float) and t > 0 for t in tokens):
        return [float(t) for t in tokens]
    return [1.0] * len(runs)


def _reference_tps(run: dict, base: dict) -> float:
    """Full-depth tokens/s to compare ``run`` with: its in-process reference when it measured its own speed-up."""
    own = run.get("cost", {}).get("speedup")
    if finite(own) and own > 0:
        return run["cost"]["tokens_per_s"] / own
    return base["cost"]["tokens_per_s"]


def _aggregate_speedup(runs: Sequence[dict], bases: Sequence[dict], weights: Sequence[float]) -> float | None:
    try:
        full_time = sum(w / _reference_tps(r, b) for w, r, b in zip(weights, runs, bases))
        time = sum(w / r["cost"]["tokens_per_s"] for w, r in zip(weights, runs))
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return full_time / time if time > 0 else None


def _prompt_speed(runs: Sequence[dict], level: float = LEVEL) -> tuple[Interval | None, DeviceSplit]:
    """The speed-up's 95% interval over the distinct prompts the runs were timed on (one pair per prompt, all
    domains together) on one device (:func:`~emad.evaluation.speed_devices.split_by_device`: the one with the most
    pairs), and that split; None, with every run kept, when a run was not timed over prompts or on fewer than
    :data:`~emad.evaluation.checks.MIN_SPEED_PROMPTS`."""
    costs = [r.get("cost", {}) for r in runs]
    if any(c.get("speed_unit") != "prompt" or len(c.get("speed_pairs") or []) < MIN_SPEED_PROMPTS for c in costs):
        return None, DeviceSplit(None, list(runs))
    split = split_by_device(runs)
    return ratio_interval([own / ref for r in split.kept for own, ref in r["cost"]["speed_pairs"]], level), split


def half_flops(run: dict, units: Units) -> float | None:
    """The run's FLOPs ratio over ``units``' half of every task's units: Σ FLOPs / Σ full depth's FLOPs of the units
    there (``unit_flops`` of each task result); None when a task with per-unit samples records no per-unit cost (a
    run file of an older version)."""
    spent = full = 0.0
    for task, result in run.get("tasks", {}).items():
        costs = result.get("unit_flops")
        if costs is None:
            if result.get("samples"):
                return None
            continue
        for f, ff in units.take(task, costs):
            spent, full = spent + f, full + ff
    return spent / full if full else None


def _judged_flops(run: dict) -> tuple[float, str]:
    """The run's FLOPs ratio on the half its checks judge (the confirmation half under its seed), and which half
    that is; every unit where the run records no per-unit cost."""
    seed = int((run.get("split") or {}).get("seed", 0))
    found = half_flops(run, Units(CONFIRMATION, seed))
    return (found, "confirmation half") if found is not None else (run["cost"]["flops_ratio"], "every unit")


def assess_point(runs: Sequence[dict], base: dict[tuple[str, str], dict], thr: Thresholds,
                 level: float = LEVEL) -> PointAssessment:
    """Aggregate one operating point's runs (one per domain) and check every tolerance on the confirmation split,
    intervals at ``level``; its FLOPs ratio read on the same half (:func:`half_flops`). A run the screen stopped
    keeps its tasks ruled out only where the violation the screen measured stands (:func:`screened_checks`)."""
    runs = sorted(runs, key=lambda r: r["domain"])
    bases = [base[(r["model"], r["domain"])] for r in runs]
    weights = _token_weights(runs)
    judged = [_judged_flops(r) for r in runs]
    checks, screened = [], []
    for r, b in zip(runs, bases):
        mine = [build_check(r["domain"], m, r, b, thr.tolerance(m), level=level) for m in sorted(b.get("quality", {}))]
        stands = screened_checks(r, b, thr) if r.get("not_run") else []
        checks += mine if stands or not r.get("not_run") else [_unruled(c) for c in mine]
        screened += stands
    first = runs[0]
    speed, split = _prompt_speed(runs, level)
    reference, by_reference = _references(split.kept)
    return PointAssessment(
        label=identity.point_label(str(first["point"]), first.get("calibration")), point=first["point"],
        calibration=first.get("calibration"), family=", ".join(sorted({r["family"] for r in runs})),
        domains=[r["domain"] for r in runs], run_ids=[r["run_id"] for r in runs],
        mlflow_run_ids=[r["mlflow_run_id"] for r in runs if r.get("mlflow_run_id")],
        flops_ratio=sum(w * f for w, (f, _) in zip(weights, judged)) / sum(weights),
        speedup=_aggregate_speedup(runs, bases, weights), checks=checks,
        flops_by_domain={r["domain"]: f for r, (f, _) in zip(runs, judged)}, curve=first.get("curve"),
        knob=first.get("knob"), value=first.get("value"), speed=speed,
        load_avg=max((r["cost"]["load_avg"] for r in split.kept if finite(r.get("cost", {}).get("load_avg"))),
                     default=None),
        depths={r["domain"]: r.get("depth_histogram") or {} for r in runs}, speed_reference=reference,
        speedup_by_reference=by_reference, screened=screened, level=level, runs=list(runs),
        flops_half=" and ".join(sorted({half for _, half in judged})),
        speed_device=split.judged if split.mixed else None, speed_left_out=split.left_out_summary(),
        strategy=any(split_family(r["family"])[0] in STRATEGIES for r in runs))


def _unruled(check: Check) -> Check:
    """A check ruled out by a screen whose violation does not stand under the rules in force: unresolved (its task
    was not run, and nothing measured rules it out)."""
    if check.state != RULED_OUT:
        return check
    return replace(check, state=UNRESOLVED, method=f"{check.method} — but that violation does not stand under the "
                   "verdict's rules (its interval's side does not cover at its size)")


def screened_checks(run: dict, base: dict, thr: Thresholds) -> list[Check]:
    """The teacher-forced checks of a run the screen ruled out, on the selection split it was ruled out on, that
    are violated there (what the decode stage measured when it stopped the point)."""
    units = Units(SELECTION, int((run.get("split") or {}).get("seed", 0)))
    forced = [m for m in sorted(base.get("quality", {})) if m in run.get("quality", {})]
    checks = [build_check(run["domain"], m, run, base, thr.tolerance(m), units) for m in forced]
    return [c for c in checks if c.counted and c.state == VIOLATED]


def _references(runs: Sequence[dict]) -> tuple[str | None, dict[str, float]]:
    """The full-depth decoder the runs' C2 pairs are against (when they agree on one) and the speed-up against every
    decoder they were timed beside: the geometric mean over the runs' per-domain speed-ups."""
    costs = [r.get("cost", {}) for r in runs]
    names = {c.get("speed_reference") for c in costs}
    reference = names.pop() if len(names) == 1 else None
    by_ref: dict[str, list[float]] = {}
    for c in costs:
        for name, value in (c.get("speedup_by_reference") or {}).items():
            by_ref.setdefault(name, []).append(value)
    return reference, {n: math.exp(sum(map(math.log, v)) / len(v)) for n, v in by_ref.items() if len(v) == len(runs)}


@dataclass(frozen=True)
class SpeedJudgement:
    """A speed-up interval against C2's floor: its ``state``, the ``interval`` it rests on (at the level where its
    side covers) and, where no simulated level makes that side cover, why the label was ``withheld``."""

    state: State
    interval: Interval
    withheld: str | None = None


def judge_speed(speed: Interval, floor: float, at_level: Callable[[float], Interval | None]) -> SpeedJudgement:
    """The speed-up interval ``speed`` against ``floor`` under the coverage table in force: a pass rests on its
    lower side, a fail on its upper; where that side does not cover at its number of prompts, the interval is taken
    at the smallest simulated level where it does (``at_level`` recomputes it there) — or, where none does, the label
    is withheld (unresolved)."""
    state, table = floor_state(speed, floor), coverage.active()
    if table is None or state not in (MET, VIOLATED):
        return SpeedJudgement(state, speed)
    side, method = ("lower" if state == MET else "upper"), coverage.family(speed.method)
    found = table.calibrated(coverage.SPEED, method, speed.n, side, speed.level)
    if found is None:
        near = table.nearest(coverage.SPEED, method, speed.n, side, speed.level)
        measured = f"covers {near[1].coverage:.1%} at {100 * near[0]:.4g}%" if near else "was not simulated"
        need = table.needs(coverage.SPEED, method, side, speed.level)
        return SpeedJudgement(UNRESOLVED, speed, (
            f"its interval lies {'at or above' if state == MET else 'below'} the gain, but at {speed.n} prompts its "
            f"{side} bound {measured} and reaches {coverage.target(speed.level):.1%} at no simulated level"
            + (f" (from {need} prompts it does)" if need else "")))
    wider = at_level(found) if found > speed.level + 1e-9 else None
    if wider is None or not wider.defined:
        return SpeedJudgement(state, speed)
    return SpeedJudgement(floor_state(wider, floor), wider)


def passes_c2(checks: Sequence[Check], pairs: Sequence[Sequence[float]], floor: float) -> bool:
    """C2 on one domain, as the decode stage's early stop reads it: every counted check met (``checks``, on the
    selection split) and the speed-up's interval over ≥ :data:`MIN_SPEED_PROMPTS` prompts (``pairs`` of the point's
    and the reference's tokens/s) at or above ``floor`` (judged as :func:`judge_speed` judges it)."""
    if len(pairs) < MIN_SPEED_PROMPTS or gate_state(checks) != MET:
        return False
    ratios = [a / b for a, b in pairs]
    return judge_speed(ratio_interval(ratios), floor, lambda level: ratio_interval(ratios, level)).state == MET
