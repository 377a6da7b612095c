"""The falsification verdict of DESIGN.md §4, per model, from run records.

- Reference: the ``full`` run of the model on each domain.
- Operating point: runs with the same point name and calibration source; only points evaluated on every domain
  the judged families ran on count (the others are listed as incomplete). A family run on fewer domains than the
  model is judged on those domains, and the report names them.
- FLOPs reduction of a point: ``1 − Σ_d tokens_d · flops_ratio_d / Σ_d tokens_d`` — token-weighted over its
  domains (``cost.tokens``; an unweighted mean when a run lacks a token count), each ``flops_ratio_d`` read on the
  confirmation half, the units its checks judge (every unit for a run file without per-unit costs).
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
  unit equal, at the level they are judged; or an interval whose side a label rests on does not cover at its size,
  :mod:`emad.evaluation.coverage`) stay out of the gate unless violated. A point is ruled out when a task was not
  run for it (its worst check is then the teacher-forced violation the screen measured,
  :attr:`PointAssessment.screened`); else violated when a counted check is, met when every named check counts and
  is met, untested at this size when every check that counts is met but a named one cannot count, unresolved
  otherwise.
- C1 (the seed's: within 1% perplexity *and* 1 point accuracy) and C2 (the tokens/s gain at matched accuracy):
  decided from named reasons, one table each (:mod:`emad.evaluation.decisions`: :data:`C1_TABLE`,
  :data:`C2_TABLE`, the first matching row wins), applied alike to every family. C1's candidates (≥
  ``min_flops_reduction`` on the judged half) are each judged at 1 − 0.05/m (Bonferroni, the first step of Holm's
  procedure: the existence claim holds at 95% family-wise); a family with no point at the reduction is *untested*.
  C2's candidates are the points within (or possibly within) the tolerances that do less work than full depth (fewer
  FLOPs on the judged half, or a strategy); each was timed on ≥ :data:`~emad.evaluation.checks.MIN_SPEED_PROMPTS`
  distinct prompts of the confirmation half per domain, one pair per prompt (point and the full-depth reference back
  to back in the decode process, in blocks whose order turns from prompt to prompt and is reversed on every other
  prompt, so that each point runs before each reference on ⌊n/2⌋ or ⌈n/2⌉ of its n prompts; ``cost.speed_pairs``;
  the reference is the faster of our full depth and, on CUDA, HF's static-cache ``generate``,
  ``cost.speed_reference``); the per-prompt ratios of all its domains give an interval over prompts (Student t on
  the log ratios, :func:`emad.evaluation.intervals.ratio_interval`; Bonferroni over the timed candidates; widened
  to the level where the coverage simulation says its side covers) — on one device: where a point's runs were
  timed on several (``cost.speed_device``), the pairs of the device with the most are read, and the text names it
  and the pairs left out (:mod:`emad.evaluation.speed_devices`). With no candidate, C2 is falsified for that reason
  alone, timed or not (timed figures are shown as information).
- Literal reading: "some operating point with ≥ 15% reduction degrades more than the tolerance" — true when some
  such point is violated or ruled out by a measured violation, with those points (it can be true while C1
  passes); unresolved ones are named apart.

Comparisons allow a slack of 1e-9 so that values exactly at a threshold pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from emad.evaluation.checks import MIN_SPEED_PROMPTS, Thresholds
from emad.evaluation.decisions import (  # noqa: F401  (the verdict's decisions, re-exported for its readers)
    C1Decision,
    C1Reason,
    C2Decision,
    C2Reason,
    Outcome,
    decide_c1,
    decide_c2,
)
from emad.evaluation.identity import split_family
from emad.evaluation.judge import PointAssessment, _references, assess_point  # noqa: F401
from emad.evaluation.states import MIN_UNITS, NOT_COUNTED, State
from emad.report.frontier import FULL, baselines, point_label

PASS, FAIL, UNRESOLVED, UNTESTED = Outcome.PASS, Outcome.FAIL, Outcome.UNRESOLVED, Outcome.UNTESTED


def speed_text(p: PointAssessment, floor: float | None = None) -> str:
    """``1.62× (95% CI 1.55 to 1.70, 16 prompts, load 1.9)``, or the cheap measure when not timed over prompts;
    where the point's runs were timed on several devices, the one read and the pairs left out. Given C2's ``floor``,
    the interval C2 judged against it: at a wider level where the side its label rests on covers only there."""
    if p.speed is None:
        return "n/a" if p.speedup is None else f"{p.speedup:.2f}× (one pair, not timed for C2)"
    judged = p.speed_judged(floor) if floor is not None else None
    speed = judged.interval if judged is not None else p.speed
    level = f"{100 * speed.level:.4g}% CI"
    if speed.level > p.speed.level + 1e-9:
        level += f" (calibrated from {100 * p.speed.level:.4g}%)"
    ci = (f"{level} {speed.lo:.2f} to {speed.hi:.2f}" if speed.defined
          else f"{level} n/a: {speed.method.removeprefix('undefined: ')}")
    load = f", load {p.load_avg:.1f}" if p.load_avg is not None else ""
    versus = f" vs {p.speed_reference}" if p.speed_reference else ""
    others = "".join(f"; vs {name} {value:.2f}×" for name, value in p.speedup_by_reference.items()
                     if name != p.speed_reference)
    return f"{speed.value:.2f}×{versus} ({ci}, {speed.n} prompts{load}{others}{_device_text(p)})"


def _device_text(p: PointAssessment) -> str:
    """``; pairs timed on <device> only (left out: <domain>'s 8 pairs on <device>)`` where the point's runs were timed on
    several devices (C2 reads the pairs of one: :mod:`emad.evaluation.speed_devices`); empty otherwise."""
    if not p.speed_left_out:
        return ""
    left = ", ".join(f"{r['domain']}'s {r['pairs']} pairs on {r['device'] or 'an unnamed device'}"
                     for r in p.speed_left_out)
    return f"; pairs timed on {p.speed_device or 'an unnamed device'} only (left out: {left})"


@dataclass
class CriterionResult:
    """One criterion's outcome (``pass``, ``fail`` = falsified, or ``unresolved``), the point that decides it
    and the sentence that says so."""

    outcome: Outcome
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
        return {"outcome": str(self.outcome), "reason": getattr(self, "reason", ""), "passed": self.passed,
                "falsified": self.falsified,
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
    reason: str = ""  # the reason's name in emad.evaluation.decisions.C1_TABLE

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
    untimed: list[str] = field(default_factory=list)
    reason: str = ""  # the reason's name in emad.evaluation.decisions.C2_TABLE

    def to_dict(self) -> dict[str, Any]:
        speed = self.deciding.speed if self.deciding else None
        return {**self._head(), "speedup": self.deciding.speedup if self.deciding else None,
                "speed": speed.to_dict() if speed else None,
                "load_avg": self.deciding.load_avg if self.deciding else None,
                "matched": self.matched, "unresolved": self.unresolved, "untimed": self.untimed, "text": self.text}


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


def _kept_out(p: PointAssessment) -> str:
    """`` (kept out of the gate as underpowered: …)`` for the point's underpowered checks, and why its perplexity
    is not counted."""
    parts = []
    if p.underpowered:
        parts.append("kept out of the gate as underpowered: " + "; ".join(
            f"{c.metric} on {c.domain} ({c.power_text()})" for c in p.underpowered))
    if p.uncounted_defining:
        parts.append("C1's perplexity check is not counted: " + "; ".join(c.describe() for c in p.uncounted_defining))
    return "".join(f" ({part})" for part in parts)


def _needing(p: PointAssessment) -> str:
    """Which of ``p``'s named checks cannot count at this size, and what each would need."""
    parts = []
    for c in p.untested:
        if c.state == NOT_COUNTED:
            why = f"{c.n} {c.unit}s judged (≥ {MIN_UNITS} needed)"
        elif c.underpowered:
            why = c.power_text()
        else:
            why = c.method.removeprefix("undefined: ")
        parts.append(f"{c.metric} on {c.domain} ({why})")
    return ("these cannot count at this size: " + "; ".join(parts)) if parts else "none cannot count"


def _level_text(level: float, m: int) -> str:
    return "" if m <= 1 else f" (each of the {m} candidates judged at {100 * level:.4g}%, Bonferroni: 95% family-wise)"


def c1_result(d: C1Decision, thr: Thresholds, methods: str, domains: list[str]) -> C1Result:
    """C1's decision in words."""
    need, p = thr.min_flops_reduction, d.deciding
    family = _level_text(d.level, d.candidates)
    if d.reason == C1Reason.MET:
        w = p.worst
        text = (f"C1 passes (not falsified): {p.named} cuts FLOPs by {p.reduction:.1%} ({p.flops_half}, "
                f"token-weighted over {len(p.domains)} domains) with every counted tolerance met on the confirmation "
                f"split{family}"
                + (f"; tightest check: {w.describe()}" if w else "") + f"{_kept_out(p)}.")
    elif d.reason == C1Reason.UNTESTED:
        text = (f"C1 not falsified; untested at this size: {p.named} cuts FLOPs by {p.reduction:.1%} "
                f"({p.flops_half}) with every check that counts met on the confirmation split{family}, but C1 names "
                f"every accuracy and {_needing(p)}.")
    elif d.reason == C1Reason.OPEN:
        n = len(d.unresolved)
        text = (f"C1 unresolved at this sample size (neither shown nor falsified): no operating point with "
                f"≥ {need:.0%} FLOP reduction is shown within every tolerance{family}, but {n} "
                f"{'is' if n == 1 else 'are'} not shown beyond them either; largest reduction: {p.named}, "
                f"{p.reduction:.1%}, its least certain check: {p.worst.describe() if p.worst else 'none measured'}"
                f"{_kept_out(p)}.")
    elif d.reason == C1Reason.BEYOND:
        text = (f"C1 fails (falsified): every operating point with ≥ {need:.0%} FLOP reduction violates a "
                f"tolerance (or the teacher-forced screen measured it beyond one); closest: {p.named}, "
                f"{p.reduction:.1%} reduction, worst violation: {p.worst.describe()}.")
    elif d.reason == C1Reason.UNMEASURED:
        text = f"C1 unresolved: the operating points with ≥ {need:.0%} FLOP reduction have no measured check."
    elif d.reason == C1Reason.SHORT:
        text = (f"C1 untested (not falsified): no point reaches {need:.0%} fewer FLOPs; best {p.reduction:.1%} "
                f"({p.named}), so nothing of this family tested C1.")
    else:
        text = (f"C1 untested (not falsified): no operating point of family {methods} was evaluated on every domain "
                f"({', '.join(domains)}).")
    return C1Result(d.outcome, p, bool(d.literal), list(d.literal), text, list(d.unresolved), str(d.reason))


NAMED = 8  # points a sentence names before "… and N more"


def _some(names: list[str]) -> str:
    """At most :data:`NAMED` of ``names``, then how many more."""
    if len(names) <= NAMED:
        return ", ".join(names)
    return f"{len(names)} points: {', '.join(names[:NAMED])} … and {len(names) - NAMED} more"


def _information(d: C2Decision, floor: float) -> str:
    """``; timed all the same, for information: …`` for the timed points that do no less work (not C2's reason)."""
    if not d.information:
        return ""
    return "; timed all the same, for information only: " + "; ".join(
        f"{p.named} {speed_text(p, floor)}" for p in d.information[:NAMED])


def c2_result(d: C2Decision, thr: Thresholds) -> C2Result:
    """C2's decision in words."""
    p, gain, floor = d.deciding, f"{thr.min_speed_gain:.0%}", 1.0 + thr.min_speed_gain
    family = _level_text(d.level, d.timed)
    if d.reason == C2Reason.FAST:
        text = (f"C2 passes (not falsified): at matched accuracy (every counted tolerance met) {p.named} runs "
                f"{speed_text(p, floor)} the full-depth tokens/s: the whole interval is at or above the gain of "
                f"{gain}{family}{_kept_out(p)}.")
    elif d.reason == C2Reason.UNTESTED:
        text = (f"C2 not falsified; untested at this size: {p.named} runs {speed_text(p, floor)} the full-depth tokens/s, "
                f"its whole interval at or above the gain of {gain}{family}, but at matched accuracy only where it "
                f"counts: {_needing(p)}.")
    elif d.reason == C2Reason.OPEN:
        withheld = p.speed_withheld(1.0 + thr.min_speed_gain)
        speed_why = withheld or f"its interval straddles the gain of {gain}"
        if p.state == State.UNRESOLVED:
            why = f"whether it keeps accuracy is unresolved ({p.worst.describe() if p.worst else 'none measured'})"
        elif p.state == State.UNTESTED:
            why = f"{speed_why}, and {_needing(p)}"
        else:
            why = speed_why
        text = f"C2 unresolved at this sample size: {p.named} runs {speed_text(p, floor)} the full-depth tokens/s{family}, " \
               f"but {why}."
    elif d.reason == C2Reason.NONE_ELIGIBLE:
        text = ("C2 fails (falsified): no operating point stays within the quality tolerances (every one violates "
                "a tolerance or was ruled out by the screen).")
    elif d.reason == C2Reason.NO_SAVING:
        text = (f"C2 fails (falsified): at matched accuracy no point does less work than full depth — every point "
                f"within (or possibly within) the tolerances ({_some(d.matched + d.unresolved)}) spends at least "
                f"full depth's FLOPs on the judged half (it never exits early, or its probes cost more than the "
                f"layers it skips), and none is a strategy{_information(d, floor)}.")
    elif d.reason == C2Reason.NO_POINTS:
        text = "C2 untested (not falsified): no operating point was evaluated on every domain."
    elif d.reason == C2Reason.NOT_TIMED and p is not None:
        text = (f"C2 unresolved: every timed candidate within (or possibly within) the tolerances is slower than the "
                f"gain of {gain} requires{family} (the best, {p.named}, runs {speed_text(p, floor)} the full-depth "
                f"tokens/s), but {len(d.untimed)} candidate(s) that do less work than full depth were not timed over "
                f"prompts ({_some(d.untimed)}): C2 is falsified only when every one of them is.")
    elif d.reason == C2Reason.NOT_TIMED:
        text = ("C2 unresolved: not timed — no candidate (a point within, or possibly within, the tolerances that "
                f"does less work than full depth: {_some(d.untimed)}) was timed on {MIN_SPEED_PROMPTS} distinct "
                "prompts per domain (the decode stage times the points that exit early and spend fewer FLOPs than "
                "full depth, decode.speed_flops_below, and every strategy; a domain needs a task with speed "
                "prompts).")
    else:
        text = (f"C2 fails (falsified): every point within (or possibly within) the tolerances that does less work "
                f"than full depth was timed over prompts and is slower than the gain of {gain} requires{family}; the "
                f"best, {p.named} ({p.state}), runs {speed_text(p, floor)} the full-depth tokens/s{_information(d, floor)}.")
    return C2Result(d.outcome, p, list(d.matched), text, list(d.unresolved), list(d.untimed), str(d.reason))


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
                        c1_result(decide_c1(points, thr, reassess), thr, fam, domains),
                        c2_result(decide_c2(points, thr, reassess), thr), model_domains)


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
