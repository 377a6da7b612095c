"""The falsification verdict of DESIGN.md §4, per model, from run records.

- Reference: the ``full`` run of the model on each domain.
- Operating point: runs with the same point name and calibration source; only points evaluated on every domain
  the judged families ran on count (the others are listed as incomplete). A family run on fewer domains than the
  model is judged on those domains, and the report names them.
- FLOPs reduction of a point: ``1 − Σ_d tokens_d · flops_ratio_d / Σ_d tokens_d`` — token-weighted over its
  domains (``cost.tokens``; an unweighted mean when a run lacks a token count).
- Speed-up of a point: time the full-depth runs would take for the point's tokens over the time the point took,
  ``Σ_d (tokens_d / tps_full_d) / Σ_d (tokens_d / tps_d)`` — one wall-clock ratio on the same workload. Where a run
  measured its own speed-up against a full-depth reference in the same process (``cost.speedup``), its
  ``tps_full_d`` is that reference, ``tps_d / speedup_d``; else the full run's file gives it.
- Tolerances, per domain and quality metric present in the full run: a lower-better metric (perplexity) may rise
  by ``ppl_rel_tol`` relative; a higher-better one (scores in [0, 1]) may drop by ``acc_abs_tol`` absolute. Each
  check (:mod:`emad.evaluation.checks`) is taken in the metric's own unit on the confirmation split of the units
  (:mod:`emad.evaluation.units`; the screen chose on the selection split): ``met``, ``violated``, ``unresolved``,
  ``identical by construction`` (proved by the engine: :mod:`emad.evaluation.proof`), ``not counted`` (n < 8) or
  ``ruled out by the screen`` (a task not run). Underpowered checks (too few units to be met even with every
  unit equal) stay out of the gate unless violated. A point is ruled out when a task was not run for it (its
  worst check is then the teacher-forced violation the screen measured, :attr:`PointAssessment.screened`);
  else violated when a counted check is, met when every counted check is and its perplexity check is counted,
  unresolved otherwise.
- C1: passes when some point reducing FLOPs by ≥ ``min_flops_reduction`` is met — with m such candidates (not
  ruled out), each judged at 1 − 0.05/m (Bonferroni, the first step of Holm's procedure: the existence claim holds
  at 95% family-wise). It is falsified only when every such point is measured beyond a tolerance (violated, or
  ruled out by a measured violation) or none reaches the reduction; otherwise it is unresolved at this sample size.
  "Closest" and every headline number are read from measured checks only.
- C2: each point that can decide it (not ruled out; it exits and spends fewer FLOPs than full depth,
  ``decode.speed_flops_below`` — or it is a strategy, which trades FLOPs for fewer sequential passes) was timed on
  ≥ :data:`~emad.evaluation.checks.MIN_SPEED_PROMPTS` distinct prompts per domain, one pair per prompt (point and the
  full-depth reference back to back in the decode process, in blocks whose order turns by one from prompt to
  prompt, so each member of a block of b is first on ⌊n/b⌋ or ⌈n/b⌉ of n prompts: half with one point;
  ``cost.speed_pairs``; the reference is the faster of our full depth and, on CUDA, HF's static-cache
  ``generate``, ``cost.speed_reference``); the per-prompt ratios of all its domains give an interval over prompts
  (Student t on the log ratios, :func:`emad.evaluation.intervals.ratio_interval`; Bonferroni over the timed
  candidates). Its speed state is met when the interval lies at or above ``1 + min_speed_gain``, violated when
  wholly below, unresolved otherwise. C2 passes when a met point has a met speed state (a decode stage that runs
  one domain times a family's candidates cheapest first and stops once one passes there: the family has decided
  C2, its dearer points get the cheap measure); it is falsified when every timed met-or-unresolved point's
  interval lies wholly below the gain; it is unresolved otherwise, and when no eligible point was timed ("not
  timed": nothing was measured).
- Literal reading: "some operating point with ≥ 15% reduction degrades more than the tolerance" — true when some
  such point is violated or ruled out by a measured violation, with those points (it can be true while C1
  passes); unresolved ones are named apart.

Comparisons allow a slack of 1e-9 so that values exactly at a threshold pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

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
from emad.evaluation.units import SELECTION, Units
from emad.report.frontier import FULL, baselines, finite, point_label

EPS = 1e-9


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
        state = combined_state(self.checks)
        return UNRESOLVED if state == MET and self.uncounted_defining else state

    @property
    def uncounted_defining(self) -> list[Check]:
        """The point's relative (perplexity) checks that do not enter the gate (too few windows, not run)."""
        return [c for c in self.checks if c.relative and not c.counted and c.state != IDENTICAL]

    @property
    def underpowered(self) -> list[Check]:
        """The checks kept out of the gate because they cannot be met at their size."""
        return [c for c in self.checks if c.measured and c.underpowered and not c.counted]

    @property
    def within_tolerance(self) -> bool:
        """Every tolerance is met at this sample size."""
        return self.state == MET

    def speed_state(self, floor: float) -> str | None:
        """C2's state of this point's speed-up interval against ``floor`` (None: not timed over prompts)."""
        return None if self.speed is None else floor_state(self.speed, floor)

    def speed_text(self) -> str:
        """``1.62× (95% CI 1.55 to 1.70, 16 prompts, load 1.9)``, or the cheap measure when not timed over
        prompts."""
        if self.speed is None:
            return "n/a" if self.speedup is None else f"{self.speedup:.2f}× (one pair, not timed for C2)"
        ci = (f"95% CI {self.speed.lo:.2f} to {self.speed.hi:.2f}" if self.speed.defined
              else f"95% CI n/a: {self.speed.method.removeprefix('undefined: ')}")
        load = f", load {self.load_avg:.1f}" if self.load_avg is not None else ""
        versus = f" vs {self.speed_reference}" if self.speed_reference else ""
        others = "".join(f"; vs {name} {value:.2f}×" for name, value in self.speedup_by_reference.items()
                         if name != self.speed_reference)
        return f"{self.speed.value:.2f}×{versus} ({ci}, {self.speed.n} prompts{load}{others})"

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
                "flops_ratio": self.flops_ratio, "flops_reduction": self.reduction, "speedup": self.speedup,
                "speed": self.speed.to_dict() if self.speed else None, "load_avg": self.load_avg,
                "speed_reference": self.speed_reference, "speedup_by_reference": self.speedup_by_reference,
                "flops_by_domain": self.flops_by_domain,
                "state": str(self.state), "within_tolerance": self.within_tolerance,
                "worst": worst.describe() if worst else None,
                "underpowered": [f"{c.metric} on {c.domain}: {c.power_text()}" for c in self.underpowered],
                "checks": [c.to_dict() for c in self.checks],
                "screened": [c.to_dict() for c in self.screened]}


PASS, FAIL = "pass", "fail"  # a criterion's outcome: PASS, FAIL (falsified) or UNRESOLVED


@dataclass
class CriterionResult:
    """One criterion's outcome (``pass``, ``fail`` = falsified, or ``unresolved``), the point that decides it
    and the sentence that says so."""

    outcome: str
    deciding: PointAssessment | None

    @property
    def passed(self) -> bool:
        return self.outcome == PASS

    @property
    def falsified(self) -> bool:
        return self.outcome == FAIL

    def sentence(self) -> str:
        return self.text

    def _head(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "passed": self.passed, "falsified": self.falsified,
                "deciding": self.deciding.label if self.deciding else None}


@dataclass
class C1Result(CriterionResult):
    """C1 and its literal reading.

    ``deciding``: the met point with the largest reduction (pass); else the unresolved point with the largest
    reduction (unresolved); else the point with ≥ the required reduction closest to its tolerances, else the
    point with the largest reduction (fail). ``unresolved_points``: points with ≥ the reduction whose state is
    unresolved; ``literal_points``: those that are violated.
    """

    literal: bool
    literal_points: list[str]
    text: str
    unresolved_points: list[str] = field(default_factory=list)

    def literal_sentence(self, min_reduction: float) -> str:
        head = (f"Literal reading: some operating point with ≥ {min_reduction:.0%} reduction degrades more "
                "than the tolerance")
        text = f"{head} — true: {', '.join(self.literal_points)}" if self.literal else f"{head} — false"
        if self.unresolved_points:
            text += f" (unresolved at this sample size: {', '.join(self.unresolved_points)})"
        return text + "."

    def to_dict(self) -> dict[str, Any]:
        return {**self._head(), "literal": self.literal, "literal_points": self.literal_points,
                "unresolved_points": self.unresolved_points, "text": self.text}


@dataclass
class C2Result(CriterionResult):
    """C2. ``deciding``: the met point with the best speed-up when it reaches the gain (pass), else the unresolved
    point with the best speed-up that does (unresolved), else the best timed met-or-unresolved point (fail; None
    when there is none). ``matched``: the met points; ``unresolved``: the unresolved ones."""

    matched: list[str]
    text: str
    unresolved: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        speed = self.deciding.speed if self.deciding else None
        return {**self._head(), "speedup": self.deciding.speedup if self.deciding else None,
                "speed": speed.to_dict() if speed else None,
                "load_avg": self.deciding.load_avg if self.deciding else None,
                "matched": self.matched, "unresolved": self.unresolved, "text": self.text}


@dataclass
class ModelVerdict:
    """C1 and C2 for one model and one set of method families."""

    model: str
    methods: tuple[str, ...]
    domains: list[str]
    thresholds: Thresholds
    points: list[PointAssessment]
    incomplete: list[str]
    c1: C1Result
    c2: C2Result
    model_domains: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """What is judged: the family, or ``<method> (all)`` for every family of one method (each readout and
        estimator), else the families joined by ``, ``."""
        if len(self.methods) == 1:
            return self.methods[0]
        bases = sorted({split_family(m)[0] for m in self.methods})
        return f"{bases[0]} (all)" if len(bases) == 1 else ", ".join(self.methods)

    @property
    def subset(self) -> bool:
        """Judged on fewer domains than the model ran on (the method ran on those only)."""
        return bool(self.model_domains) and self.domains != self.model_domains

    def sentence(self) -> str:
        """Human text: one line per criterion, then the literal reading."""
        who = f"{self.model} ({self.name})"
        return "\n".join([f"{who} — {self.c1.sentence()}", f"{who} — {self.c2.sentence()}",
                          f"{who} — {self.c1.literal_sentence(self.thresholds.min_flops_reduction)}"])

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "methods": list(self.methods), "domains": self.domains,
                "model_domains": self.model_domains, "thresholds": asdict(self.thresholds), "c1": self.c1.to_dict(), "c2": self.c2.to_dict(),
                "incomplete": self.incomplete, "points": [p.to_dict() for p in self.points]}


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


def _prompt_speed(runs: Sequence[dict], level: float = LEVEL) -> Interval | None:
    """The speed-up's 95% interval over the distinct prompts the runs were timed on (one pair per prompt, all
    domains together), or None when a run was not timed over prompts or on fewer than
    :data:`~emad.evaluation.checks.MIN_SPEED_PROMPTS`."""
    costs = [r.get("cost", {}) for r in runs]
    if any(c.get("speed_unit") != "prompt" or len(c.get("speed_pairs") or []) < MIN_SPEED_PROMPTS for c in costs):
        return None
    return ratio_interval([own / ref for c in costs for own, ref in c["speed_pairs"]], level)


def assess_point(runs: Sequence[dict], base: dict[tuple[str, str], dict], thr: Thresholds,
                 level: float = LEVEL) -> PointAssessment:
    """Aggregate one operating point's runs (one per domain) and check every tolerance on the confirmation split,
    intervals at ``level``."""
    runs = sorted(runs, key=lambda r: r["domain"])
    bases = [base[(r["model"], r["domain"])] for r in runs]
    weights = _token_weights(runs)
    flops = sum(w * r["cost"]["flops_ratio"] for w, r in zip(weights, runs)) / sum(weights)
    checks = [build_check(r["domain"], m, r, b, thr.tolerance(m), level=level)
              for r, b in zip(runs, bases) for m in sorted(b.get("quality", {}))]
    first = runs[0]
    screened = [c for r, b in zip(runs, bases) if r.get("not_run") for c in _screened(r, b, thr)]
    return PointAssessment(point_label(first), first["point"], first.get("calibration"),
                           ", ".join(sorted({r["family"] for r in runs})), [r["domain"] for r in runs],
                           [r["run_id"] for r in runs], [r["mlflow_run_id"] for r in runs if r.get("mlflow_run_id")],
                           flops, _aggregate_speedup(runs, bases, weights), checks,
                           {r["domain"]: r["cost"]["flops_ratio"] for r in runs}, first.get("curve"),
                           first.get("knob"), first.get("value"), _prompt_speed(runs, level),
                           max((r["cost"]["load_avg"] for r in runs if finite(r.get("cost", {}).get("load_avg"))),
                               default=None),
                           {r["domain"]: r.get("depth_histogram") or {} for r in runs},
                           *_references(runs), screened, level, list(runs))


def _screened(run: dict, base: dict, thr: Thresholds) -> list[Check]:
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


def _by_reduction(points: list[PointAssessment]) -> list[PointAssessment]:
    return sorted(points, key=lambda p: (-p.reduction, p.label))


Reassess = Callable[[list[PointAssessment], float], list[PointAssessment]]


def _family_wise(points: list[PointAssessment], reassess: Reassess | None) -> tuple[list[PointAssessment], float]:
    """``points`` judged so that one claim over all of them holds at 95% (Bonferroni: each at 1 − 0.05/m, the
    first step of Holm's procedure, which decides an existence claim), and that level."""
    level = 1.0 - (1.0 - LEVEL) / max(len(points), 1)
    if len(points) <= 1 or reassess is None:
        return points, LEVEL
    return reassess(points, level), level


def _kept_out(p: PointAssessment) -> str:
    """``; kept out as underpowered: …`` for the point's underpowered checks, and why its perplexity is not
    counted."""
    parts = []
    if p.underpowered:
        parts.append("kept out of the gate as underpowered: " + "; ".join(
            f"{c.metric} on {c.domain} ({c.power_text()})" for c in p.underpowered))
    if p.uncounted_defining:
        parts.append("C1's perplexity check is not counted: " + "; ".join(c.describe() for c in p.uncounted_defining))
    return "".join(f" ({part})" for part in parts)


def _level_text(level: float, m: int) -> str:
    return "" if m <= 1 else f" (each of the {m} candidates judged at {100 * level:.4g}%, Bonferroni: 95% family-wise)"


def _c1(points: list[PointAssessment], thr: Thresholds, methods: str, domains: list[str],
        reassess: Reassess | None = None) -> C1Result:
    need = thr.min_flops_reduction
    big = [p for p in points if p.reduction >= need - EPS]
    judged, level = _family_wise([p for p in big if p.state != RULED_OUT], reassess)
    met = _by_reduction([p for p in judged if p.state == MET])
    unresolved = _by_reduction([p for p in judged if p.state == UNRESOLVED])
    literal = sorted(p.label for p in big if p.state in (VIOLATED, RULED_OUT))
    open_labels = sorted(p.label for p in unresolved)
    family = _level_text(level, len(judged))
    if met:
        p, w = met[0], met[0].worst
        text = (f"C1 passes (not falsified): {p.named} cuts FLOPs by {p.reduction:.1%} (token-weighted over "
                f"{len(p.domains)} domains) with every counted tolerance met on the confirmation split{family}"
                + (f"; tightest check: {w.describe()}" if w else "") + f"{_kept_out(p)}.")
        return C1Result(PASS, p, bool(literal), literal, text, open_labels)
    if unresolved:
        p = unresolved[0]
        worst = p.worst.describe() if p.worst else "none measured"
        text = (f"C1 unresolved at this sample size (neither shown nor falsified): no operating point with "
                f"≥ {need:.0%} FLOP reduction is shown within every tolerance{family}, but {len(unresolved)} "
                f"{'is' if len(unresolved) == 1 else 'are'} not shown beyond them either; largest reduction: "
                f"{p.named}, {p.reduction:.1%}, its least certain check: {worst}{_kept_out(p)}.")
        return C1Result(UNRESOLVED, p, bool(literal), literal, text, open_labels)
    measured = [p for p in big if p.worst is not None and p.worst.severity is not None]
    if measured:
        p = min(measured, key=lambda p: (p.worst.severity, -p.reduction, p.label))
        text = (f"C1 fails (falsified): every operating point with ≥ {need:.0%} FLOP reduction violates a "
                f"tolerance (or the teacher-forced screen measured it beyond one); closest: {p.named}, "
                f"{p.reduction:.1%} reduction, worst violation: {p.worst.describe()}.")
        return C1Result(FAIL, p, True, literal, text)
    if big:
        text = (f"C1 unresolved: the {len(big)} operating points with ≥ {need:.0%} FLOP reduction have no measured "
                "check.")
        return C1Result(UNRESOLVED, None, False, literal, text)
    if points:
        p = _by_reduction(points)[0]
        text = (f"C1 fails (falsified): no operating point reaches a {need:.0%} FLOP reduction; the largest is "
                f"{p.named} with {p.reduction:.1%}.")
        return C1Result(FAIL, p, False, [], text)
    text = (f"C1 fails (falsified): no operating point of family {methods} was evaluated on every domain "
            f"({', '.join(domains)}).")
    return C1Result(FAIL, None, False, [], text)


def _c2(points: list[PointAssessment], thr: Thresholds, reassess: Reassess | None = None) -> C2Result:
    need = 1.0 + thr.min_speed_gain
    eligible = [p for p in points if p.state in (MET, UNRESOLVED)]
    labels = sorted(p.label for p in eligible if p.state == MET)
    open_labels = sorted(p.label for p in eligible if p.state == UNRESOLVED)
    timed, level = _family_wise([p for p in eligible if p.speed is not None and p.speed.value is not None], reassess)
    timed.sort(key=lambda p: (-(p.speed.lo if p.speed.defined else 0.0), -p.speed.value, p.label))
    gain, family = f"{thr.min_speed_gain:.0%}", _level_text(level, len(timed))
    passing = [p for p in timed if p.state == MET and p.speed_state(need) == MET]
    if passing:
        p = passing[0]
        return C2Result(PASS, p, labels, f"C2 passes (not falsified): at matched accuracy (every counted tolerance "
                        f"met) {p.named} runs {p.speed_text()} the full-depth tokens/s: the whole interval is at or "
                        f"above the gain of {gain}{family}{_kept_out(p)}.", open_labels)
    open_ = [p for p in timed if p.speed_state(need) != VIOLATED]
    if open_:
        p = max(open_, key=lambda p: (p.speed.value, p.label))
        why = (f"whether it keeps accuracy is unresolved ({p.worst.describe() if p.worst else 'none measured'})"
               if p.state == UNRESOLVED else f"its interval straddles the gain of {gain}")
        return C2Result(UNRESOLVED, p, labels, f"C2 unresolved at this sample size: {p.named} runs "
                        f"{p.speed_text()} the full-depth tokens/s{family}, but {why}.", open_labels)
    if not eligible:
        return C2Result(FAIL, None, [], "C2 fails (falsified): no operating point stays within the quality "
                                        "tolerances (every one violates a tolerance or was ruled out by the "
                                        "screen).")
    if not timed:
        return C2Result(UNRESOLVED, None, labels, "C2 unresolved: not timed — no point within (or possibly within) "
                        f"the tolerances ({', '.join(labels + open_labels)}) was timed on {MIN_SPEED_PROMPTS} "
                        "distinct prompts per domain (the decode stage times the points that exit early and spend "
                        "fewer FLOPs than full depth, decode.speed_flops_below, and every strategy; a domain needs a "
                        "task with speed prompts).", open_labels)
    p = max(timed, key=lambda p: (p.speed.value, p.label))
    return C2Result(FAIL, p, labels, f"C2 fails (falsified): every timed point within (or possibly within) the "
                    f"tolerances is slower than the gain of {gain} requires{family}; the best, {p.named} "
                    f"({p.state}), runs {p.speed_text()} the full-depth tokens/s.", open_labels)


def _model_domains(runs: Sequence[dict], base: dict, model: str) -> list[str]:
    domains = sorted({r["domain"] for r in runs if r["model"] == model})
    missing = [d for d in domains if (model, d) not in base]
    if missing:
        raise ValueError(f"no full-depth run for model {model!r} on domain(s) {', '.join(missing)}: the verdict "
                         "compares every operating point against it (add a `full` point to decode.points)")
    return domains


def model_verdict(runs: Sequence[dict], model: str, methods: Sequence[str] = ("emad",),
                  thresholds: Thresholds | None = None) -> ModelVerdict:
    """C1 and C2 for one model; only runs whose family is in ``methods`` count as operating points.

    Raises:
        ValueError: the model has no runs, or lacks a full-depth run on one of its domains.
    """
    thr = thresholds or Thresholds()
    base = baselines(runs)
    if not any(r["model"] == model for r in runs):
        raise ValueError(f"no runs for model {model!r}")
    model_domains = _model_domains(runs, base, model)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        if r["model"] == model and r.get("family") in methods:
            groups.setdefault((r["point"], r.get("calibration") or ""), []).append(r)
    # judged on the domains the method ran on (a family run on fewer domains than the model is judged on those)
    domains = sorted({r["domain"] for g in groups.values() for r in g}) or model_domains
    complete = {k: g for k, g in groups.items() if sorted(r["domain"] for r in g) == domains}
    incomplete = sorted(point_label(g[0]) for k, g in groups.items() if k not in complete)
    points = sorted((assess_point(g, base, thr) for g in complete.values()), key=lambda p: p.label)
    fam = ", ".join(methods)

    def reassess(these: list[PointAssessment], level: float) -> list[PointAssessment]:
        return [assess_point(p.runs, base, thr, level) for p in these]

    return ModelVerdict(model, tuple(methods), domains, thr, points, incomplete,
                        _c1(points, thr, fam, domains, reassess), _c2(points, thr, reassess), model_domains)


def families_of(runs: Sequence[dict], methods: Sequence[str]) -> tuple[str, ...]:
    """The families of ``runs`` that ``methods`` name: a family given whole (``emad+tuned:topk``), or every family of
    a method given bare (``emad``: each readout and estimator), so that the verdict judges a method over all its
    configurations. Sorted; names that match no run are kept (the verdict then says no point was evaluated)."""
    present = {r["family"] for r in runs if r.get("family")}
    found = {f for f in present if f in methods or split_family(f)[0] in methods}
    return tuple(sorted(found | {m for m in methods if not any(split_family(f)[0] == m for f in found)}))


def verdict(runs: Sequence[dict], methods: Sequence[str] = ("emad",), *, min_flops_reduction: float = 0.15,
            ppl_rel_tol: float = 0.01, acc_abs_tol: float = 0.01,
            min_speed_gain: float = 0.10) -> dict[str, ModelVerdict]:
    """The verdict per model (sorted by name) for the method families ``methods``.

    Args:
        runs: run records (:mod:`emad.evaluation.runfile`).
        methods: families that count as "the method" (the verdict is about EMAD by default).
        min_flops_reduction: C1's FLOP reduction (0.15 = 15%).
        ppl_rel_tol: allowed relative rise of perplexity (0.01 = 1%).
        acc_abs_tol: allowed absolute drop of a higher-better metric (0.01 = 1 point).
        min_speed_gain: C2's tokens/s gain (0.10 = 10%).

    Raises:
        ValueError: no runs, no full-depth run at all, or a model × domain without one.
    """
    if not runs:
        raise ValueError("no run records: nothing to judge (run the decode stage first)")
    if not any(r.get("family") == FULL for r in runs):
        raise ValueError("no full-depth run (family 'full') among the runs: the verdict needs one per model and "
                         "domain as the reference")
    thr = Thresholds(min_flops_reduction, ppl_rel_tol, acc_abs_tol, min_speed_gain)
    return {m: model_verdict(runs, m, _ran_on(runs, m, methods), thr) for m in sorted({r["model"] for r in runs})}


def _ran_on(runs: Sequence[dict], model: str, methods: Sequence[str]) -> tuple[str, ...]:
    """The families of ``methods`` that ran on ``model`` (all of ``methods`` when none did: no point evaluated)."""
    ran = {r.get("family") for r in runs if r["model"] == model}
    return tuple(f for f in methods if f in ran) or tuple(methods)


def family_verdicts(runs: Sequence[dict], **thresholds: float) -> dict[str, dict[str, ModelVerdict]]:
    """:func:`verdict` for each non-full family present, alone, on the models it ran on:
    ``{family: {model: ModelVerdict}}``."""
    families = sorted({r["family"] for r in runs if r.get("family") and r["family"] != FULL})
    out = {}
    for f in families:  # each family on the models it ran on
        models = {r["model"] for r in runs if r.get("family") == f}
        out[f] = {m: v for m, v in verdict(runs, (f,), **thresholds).items() if m in models}
    return out
