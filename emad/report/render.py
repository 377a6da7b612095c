"""reports/report.md, reports/metrics.json (headline numbers) and the per-run detail file from runs, verdicts, tables
and the figures index.

The output depends only on the inputs (no timestamps, sorted keys), so an unchanged run set gives an unchanged
report.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from emad.engine.idle_spec import parse_idle_spec
from emad.evaluation.checks import IDENTICAL, NOT_COUNTED, RULED_OUT
from emad.evaluation.decisions import table_markdown
from emad.evaluation.states import MET, UNRESOLVED, UNTESTED, VIOLATED
from emad.report.curves import Curve, domain_curves, domain_shift_curves, model_curves
from emad.report.frontier import FULL, baselines, point_label, speedup
from emad.report.readouts import readouts_markdown
from emad.report.rules import DECISION_RULE, UNCERTAINTY_RULE, coverage_rule
from emad.report.tables import (
    CURVE_NOTE,
    ablation_markdown,
    curves_markdown,
    domain_curves_markdown,
    domain_shift_markdown,
    fmt,
    fmt_quality,
    markdown_table,
    risk_markdown,
    shift_curves_markdown,
)
from emad.report.verdict import NAMED, ModelVerdict, PointAssessment, speed_text
from emad.report.verdict import family_verdicts as judge_families

REPRODUCE = ("`dvc repro` rebuilds every stage from params.yaml (only what changed reruns); `make mlflow` opens "
             "the MLflow UI on the logged runs; `dvc metrics show` reads the headline numbers in "
             "reports/metrics.json (per model and family: C1, C2, quality at the target FLOPs, largest reduction "
             "within tolerance), reports/details.json holds every run's numbers and the curves, and "
             "`dvc plots show` reads reports/pareto/.")


def _aside(checks) -> list[tuple[str, int]]:
    """The checks outside (or beside) the met / unresolved / violated counts: identical by construction, ruled out
    by the screen, underpowered (kept out of the gate), not counted (n < 8)."""
    return [("identical by construction", sum(c.state == IDENTICAL for c in checks)),
            ("ruled out by the screen", sum(c.state == RULED_OUT for c in checks)),
            ("underpowered", sum(c.measured and c.underpowered and not c.counted and c.state != NOT_COUNTED
                                 for c in checks)),
            ("not counted", sum(c.state == NOT_COUNTED for c in checks))]


def _family_best(points: list[PointAssessment], need: float) -> PointAssessment:
    """The point that speaks for a family: with the required reduction, the met one cutting most, else the
    unresolved one cutting most, else the one closest to its tolerances; without the reduction, the cheapest."""
    big = [p for p in points if p.reduction >= need - 1e-9]
    for state in (MET, UNTESTED, UNRESOLVED):
        these = [p for p in big if p.state == state]
        if these:
            return max(these, key=lambda p: (p.reduction, p.label))
    measured = [p for p in big if p.worst is not None and p.worst.severity is not None]
    if measured:
        return min(measured, key=lambda p: (p.worst.severity, -p.reduction, p.label))
    return max(points, key=lambda p: (p.reduction, p.label))


def _family_rows(v: ModelVerdict) -> list[list[str]]:
    """One row per family: the point that speaks for it, its state and why."""
    families: dict[str, list[PointAssessment]] = {}
    for p in v.points:
        families.setdefault(p.family, []).append(p)
    rows = []
    for family, points in sorted(families.items()):
        p = _family_best(points, v.thresholds.min_flops_reduction)
        worst = p.worst
        power = f"; underpowered, kept out: {', '.join(sorted({c.metric for c in p.underpowered}))}" \
            if p.underpowered else ""
        rows.append([family, p.label, fmt(p.reduction, ".1%"), str(p.state),
                     speed_text(p, 1.0 + v.thresholds.min_speed_gain),
                     (worst.describe() if worst else "–") + power])
    return rows


def _literal_short(v: ModelVerdict) -> str:
    """The literal reading, naming at most :data:`NAMED` points."""
    names = v.c1.literal_points
    if len(names) <= NAMED:
        return v.c1.literal_sentence(v.thresholds.min_flops_reduction)
    head = (f"Literal reading: some operating point with ≥ {v.thresholds.min_flops_reduction:.0%} reduction "
            "degrades more than the tolerance")
    return (f"{head} — true for {len(names)} points: {', '.join(names[:NAMED])} … and "
            f"{len(names) - NAMED} more (all in the table of every point below).")


def _point_rows(v: ModelVerdict) -> list[list[str]]:
    rows = []
    for p in sorted(v.points, key=lambda p: (-p.reduction, p.label)):
        worst = p.worst
        counts = ", ".join([f"{sum(c.state == s for c in p.checks)} {s}" for s in (MET, UNRESOLVED, VIOLATED)]
                           + [f"{n} {label}" for label, n in _aside(p.checks) if n])
        rows.append([p.label, p.family, fmt(p.reduction, ".1%"), speed_text(p, 1.0 + v.thresholds.min_speed_gain),
                     str(p.state), counts,
                     worst.describe() if worst else "–"])
    return rows


def _change_text(c) -> str:
    if c.value is None or c.change is None:  # no run value, or no units of it on the judged half
        return "missing"
    return f"{c.change:+.2%}" if c.relative else f"{100 * (c.value - c.full):+.2f} pt"


def _check_rows(p: PointAssessment) -> list[list[str]]:
    return [[c.domain, c.metric, fmt(c.full, ".4g"), fmt(c.value, ".4g"), _change_text(c),
             c.interval_text().removeprefix("95% CI "),
             f"+{c.tolerance:.0%}" if c.relative else f"−{100 * c.tolerance:g} pt",
             f"{c.state}, underpowered: {c.power_text()}" if c.underpowered else str(c.state)] for c in p.checks]


def depths_text(p: PointAssessment) -> str:
    """The point's exit depths per domain, ``depth: tokens`` (a mean depth hides a mixture: 413 tokens at 21 and
    283 at 45 are not 30)."""
    lines = []
    for domain, hist in sorted(p.depths.items()):
        total = sum(hist.values())
        cells = ", ".join(f"{d}: {n} ({n / total:.0%})" for d, n in sorted(hist.items(), key=lambda kv: int(kv[0])))
        lines.append(f"- exit depths on {domain} (layer: tokens): {cells or 'none recorded'}")
    return "\n".join(lines)


def deciding_checks_markdown(v: ModelVerdict) -> str:
    """Every check of the points that decide C1 and C2 (change, its 95% interval and n, tolerance, state) and
    their exit-depth histograms."""
    deciding: dict[str, tuple[list[str], PointAssessment]] = {}
    for name, p in (("C1", v.c1.deciding), ("C2", v.c2.deciding)):
        if p is not None and p.checks:
            deciding.setdefault(p.label, ([], p))[0].append(name)
    header = ["domain", "metric", "full", "point", "change", "95% CI, n", "tolerance", "state"]
    return "\n\n".join(f"Checks of {p.label} (deciding {' and '.join(names)}; {p.state}):\n\n"
                       + markdown_table(header, _check_rows(p)) + "\n\n" + depths_text(p)
                       for names, p in deciding.values())


def verdict_markdown(verdicts: Mapping[str, ModelVerdict]) -> str:
    """Per model: C1, the literal reading, C2 (deciding points named), the table of complete points with their
    states, and every check of the deciding points (how states are read: :data:`UNCERTAINTY_RULE`)."""
    out = []
    for model, v in verdicts.items():
        t = v.thresholds
        judged = f" (the method ran on these only, of {', '.join(v.model_domains)})" if v.subset else ""
        judged_families = f" (families: {', '.join(v.methods)})" if len(v.methods) > 1 else ""
        lines = [f"### {model} — method: {v.name}{judged_families}", "",
                 f"- **C1 {v.c1.outcome}.** {v.c1.sentence()}",
                 f"- {_literal_short(v)}",
                 f"- **C2 {v.c2.outcome}.** {v.c2.sentence()}",
                 f"- Domains: {', '.join(v.domains)}{judged}. Tolerances: perplexity +{t.ppl_rel_tol:.0%} relative, other "
                 f"metrics −{100 * t.acc_abs_tol:g} point absolute; FLOPs token-weighted over domains; checks on "
                 f"{_split_text(v)}."]
        if v.incomplete:
            lines.append(f"- Not on every domain (left out): {', '.join(v.incomplete)}.")
        control = control_note(model)
        if control:
            lines.append(f"- {control}")
        if v.points:
            lines += ["", "The point that speaks for each family (with the required reduction: the met one cutting "
                      "most, else the unresolved one, else the one closest to its tolerances):", "",
                      markdown_table(["family", "point", "FLOPs reduction (confirmation half)", "state", "speed-up", "why"],
                                     _family_rows(v))]
        checks = deciding_checks_markdown(v)
        if checks:
            lines += ["", checks]
        out.append("\n".join(lines))
    return "\n\n".join(out) if out else "_No verdict._"


def control_note(model: str) -> str | None:
    """What a verdict on the positive control (``<base>+idle<N>``, :mod:`emad.engine.idle`) shows and does not; None
    for any other model."""
    try:
        found = parse_idle_spec(model)
    except ValueError:
        return None
    if found is None:
        return None
    base, n = found
    return (f"The positive control: {base} with {n} idle layers appended (copies of its last layer whose output "
            f"projections are zero: they leave the residual stream as it is). A point that exits only into the idle "
            f"layers is identical to full depth by construction — the engine proves it — and its EMAD points set "
            f"their minimum exit layer at {base}'s depth, so identity there holds by design. A pass here shows that "
            f"the FLOPs accounting, the timing and the verdict's machinery find a saving that is there; it does not "
            f"test EMAD's criterion, which never chooses between layers that differ.")


def _split_text(v: ModelVerdict) -> str:
    """Which split the checks judge, and its seed."""
    seeds = sorted({int((r.get("split") or {}).get("seed", 0)) for p in v.points for r in p.runs})
    return f"the confirmation split (seed {', '.join(map(str, seeds)) or 0}; the screen chose on the selection split)"


def points_markdown(verdicts: Mapping[str, ModelVerdict]) -> str:
    """Per model: every complete point of the judged method with its state, check counts and worst check."""
    out = []
    for model, v in verdicts.items():
        if v.points:
            out.append(f"### {model} — {v.name}\n\n" + markdown_table(
                ["point", "family", "FLOPs reduction (confirmation half)", "speed-up", "state", "checks", "worst check"], _point_rows(v)))
    return "\n\n".join(out) if out else "_No points._"


def baselines_markdown(family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> str:
    """One row per family × model: does a baseline pass the same criteria, on which domains (those it ran on)?"""
    rows = []
    for family, per_model in family_verdicts.items():
        for model, v in per_model.items():
            domains = ", ".join(v.domains) + (" (only these)" if v.subset else "")
            rows.append([family, model, domains, f"{v.c1.outcome} ({v.c1.reason})",
                         v.c1.deciding.label if v.c1.deciding else "–", f"{v.c2.outcome} ({v.c2.reason})",
                         v.c2.deciding.label if v.c2.deciding else "–",
                         speed_text(v.c2.deciding, 1.0 + v.thresholds.min_speed_gain) if v.c2.deciding else "–"])
    if not rows:
        return "_No families to compare._"
    return markdown_table(["family", "model", "domains judged", "C1", "C1 deciding point", "C2", "C2 deciding point", "speed-up"],
                          rows)


def _result_order(run: dict) -> tuple:
    return (run.get("family") != FULL, run.get("family") or "", point_label(run))


def results_markdown(runs: Sequence[dict[str, Any]]) -> str:
    """One table per model × domain: every run's quality metrics (value, 95% interval, n) and costs."""
    base = baselines(runs)
    out = []
    for model, domain in sorted({(r["model"], r["domain"]) for r in runs}):
        mine = sorted((r for r in runs if (r["model"], r["domain"]) == (model, domain)), key=_result_order)
        metrics = sorted({m for r in mine for m in r.get("quality", {})})
        rows = []
        for r in mine:
            c = r.get("cost", {})
            rows.append([point_label(r), r.get("family", "")]
                        + [fmt_quality(r.get("quality", {}).get(m), r.get("intervals", {}).get(m)) for m in metrics]
                        + [fmt(c.get("flops_ratio")), fmt(c.get("bytes_ratio")),
                           fmt(speedup(r, base.get((model, domain))), ".2f"), fmt(c.get("mean_depth"), ".1f")])
        header = ["point", "family"] + [f"{m} (every unit)" for m in metrics] + ["FLOPs ratio (every unit)",
                                                                              "bytes ratio", "speed-up", "mean depth"]
        out.append(f"### {model} · {domain}\n\n" + markdown_table(header, rows))
    return "\n\n".join(out)


def _link(path: str, relative_to: str | Path | None) -> str:
    rel = os.path.relpath(path, relative_to) if relative_to is not None else path
    return Path(rel).as_posix()


def _codes(items: Sequence[str]) -> str:
    return ", ".join(f"`{i}`" for i in items)


def figures_markdown(figures_index: Sequence[dict[str, Any]], relative_to: str | Path | None = None) -> str:
    """Each figure as an image link followed by the MLflow runs it shows."""
    out = []
    for f in figures_index:
        ids = f.get("mlflow_run_ids") or []
        runs = _codes(ids) if ids else f"none logged (run files: {_codes(f.get('run_ids', []))})"
        out.append(f"![{f['name']}]({_link(f['path'], relative_to)})\n\nMLflow runs: {runs}")
    return "\n\n".join(out) if out else "_No figures._"


RISK_NOTE = ("Each search tests a method's knob from the value that exits least (Learn then Test, fixed sequence, "
             "Hoeffding–Bentkus p-values) on held-out prompts and keeps the most aggressive certified value; "
             "the chosen value is then run on fresh prompts.")


def _outcomes(family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> dict[tuple[str, str], tuple[str, str]]:
    return {(m, f): (v.c1.outcome, v.c2.outcome) for f, per in family_verdicts.items() for m, v in per.items()}


SHIFT_NOTE = ("Each profile-based family's curve on one domain, calibrated on that domain (in-domain) and on another "
              "(shifted), both read on their envelopes at the same FLOPs ratios: tolerance used in-domain → shifted "
              "(shifted − in-domain); – where a curve does not reach the ratio.")


def curves_sections(family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> list[str]:
    """The report's curve sections: every family at the target FLOPs (on the model, then per domain and
    calibration source), and the domain shift of the curves at equal FLOPs."""
    per_domain = domain_curves(family_verdicts)
    return ["## Curves at equal FLOPs", CURVE_NOTE,
            curves_markdown(model_curves(family_verdicts), _outcomes(family_verdicts)),
            "### Per domain and calibration source", domain_curves_markdown(per_domain),
            "## Domain shift", SHIFT_NOTE, shift_curves_markdown(domain_shift_curves(per_domain))]


def mixed_units_markdown(runs: Sequence[dict[str, Any]]) -> list[str]:
    """A warning per distinct mix of settings the runs were merged under (``EMAD_ALLOW_MIXED_UNITS=1``): the
    runs' numbers were computed differently, which the verdict cannot tell apart; empty when none was."""
    mixes = sorted({m for r in runs if (m := (r.get("provenance") or {}).get("mixed"))})
    return [f"**Mixed settings.** Units computed under different settings were merged on request "
            f"(EMAD_ALLOW_MIXED_UNITS=1): {mix}." for mix in mixes]


def report_markdown(runs: Sequence[dict[str, Any]], verdicts: Mapping[str, ModelVerdict],
                    tables: Mapping[str, Any], figures_index: Sequence[dict[str, Any]], *,
                    family_verdicts: Mapping[str, Mapping[str, ModelVerdict]] | None = None,
                    relative_to: str | Path | None = None, readout_fits: Mapping[str, Any] | None = None) -> str:
    """The whole report as markdown.

    Args:
        runs: run records.
        verdicts: ``{model: ModelVerdict}`` for the method (:func:`emad.report.verdict.verdict`).
        tables: ``{"domain_shift": cells, "ablations": {factor: rows}, "risk": results}`` (any may be absent).
        figures_index: from :func:`emad.report.figures.write_pareto_figures`.
        family_verdicts: optional ``{family: {model: ModelVerdict}}`` to show whether baselines pass too.
        relative_to: folder of the report; figure links are made relative to it.
        readout_fits: ``{"model/source": metrics.json of fit_readouts}`` for the "Readouts" section.
    """
    parts = ["# EMAD report", *mixed_units_markdown(runs), "## Verdict (DESIGN.md §4)",
             f"Uncertainty. {UNCERTAINTY_RULE} {coverage_rule()}", DECISION_RULE, table_markdown(),
             verdict_markdown(verdicts)]
    if family_verdicts:
        parts += ["## Every family against the same criteria", baselines_markdown(family_verdicts)]
        parts += curves_sections(family_verdicts)
    parts += ["## Every point judged", points_markdown(verdicts)]
    parts += ["## Results per model and domain",
              "Every run's numbers over all its units (both halves: the verdict's checks above read the "
              "confirmation half, the screen chose on the selection half). Speed-up = the run's own speed-up against "
              "a full-depth reference generated in the same process where measured, else tokens/s over the "
              "full-depth run of the same model and domain.",
              results_markdown(runs)]
    if "domain_shift" in tables:
        parts += ["## Domain shift per operating point", domain_shift_markdown(tables["domain_shift"])]
    if "ablations" in tables:
        parts += ["## Ablations", ablation_markdown(tables["ablations"])]
    if readout_fits:
        parts += ["## Readouts", readouts_markdown(readout_fits, runs, family_verdicts or {})]
    if tables.get("risk"):
        parts += ["## Risk-controlled thresholds", RISK_NOTE, risk_markdown(tables["risk"])]
    parts += ["## Figures", figures_markdown(figures_index, relative_to), "## How to reproduce", REPRODUCE]
    return "\n\n".join(parts) + "\n"


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    """Without nulls; floats rounded to 6 decimals for reading."""
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items() if v is not None}


def _run_metrics(run: dict[str, Any], base: dict | None) -> dict[str, Any]:
    c = run.get("cost", {})
    bounds = {f"{m}.{part}": iv.get(part) for m, iv in sorted(run.get("intervals", {}).items())
              for part in ("lo", "hi", "n")}
    return _clean({"flops_ratio": c.get("flops_ratio"), "bytes_ratio": c.get("bytes_ratio"),
                   "speedup": speedup(run, base), "mean_depth": c.get("mean_depth"),
                   **dict(sorted(run.get("quality", {}).items())), **bounds})


def _best(v: ModelVerdict) -> dict[str, Any]:
    c1, c2 = v.c1.deciding, v.c2.deciding
    return _clean({"c1_point": c1.label if c1 else None, "flops_reduction": c1.reduction if c1 else None,
                   "c2_point": c2.label if c2 else None, "speedup": c2.speedup if c2 else None})


def _families(runs: Sequence[dict[str, Any]], verdicts: Mapping[str, ModelVerdict],
              family_verdicts: Mapping[str, Mapping[str, ModelVerdict]] | None) -> dict[str, dict[str, ModelVerdict]]:
    """Every family judged alone, plus the judged method under its joined name when it spans several families."""
    if family_verdicts is None:
        thr = next(iter(verdicts.values())).thresholds if verdicts else None
        family_verdicts = judge_families(runs, **(asdict(thr) if thr else {}))
    out = {f: dict(per) for f, per in family_verdicts.items()}
    for model, v in verdicts.items():
        out.setdefault(v.name, {}).setdefault(model, v)
    return out


def _headline(curve: Curve, v: ModelVerdict) -> dict[str, Any]:
    ppl = curve.at(curve.target, "perplexity").value if "perplexity" in curve.metrics else None
    ok, met = curve.largest_ok, curve.largest_met
    timed = v.c2.deciding  # quoted only at matched accuracy: timed over prompts, every counted check met
    timed = timed if timed is not None and timed.speed is not None and timed.state == MET else None
    speed = timed.speed if timed else None
    return _clean({"c1": v.c1.outcome, "c1_reason": v.c1.reason, "c2": v.c2.outcome, "c2_reason": v.c2.reason,
                   "tolerance_multiple_at_target": curve.at_target.value,
                   "perplexity_change_at_target": ppl, "max_reduction_within_tolerance": met.reduction if met else None,
                   "max_reduction_unresolved": ok.reduction if ok and ok.state == UNRESOLVED else None,
                   "max_reduction_untested": ok.reduction if ok and ok.state == UNTESTED else None,
                   "c2_point": timed.label if timed else None, "speedup": speed.value if speed else None,
                   "speedup_lo": speed.lo if speed else None, "speedup_hi": speed.hi if speed else None,
                   "speedup_prompts": speed.n if speed else None,
                   "speedup_level": timed.level if timed and speed.defined else None,
                   "speedup_device": timed.speed_device if timed else None})


def metrics_summary(runs: Sequence[dict[str, Any]], verdicts: Mapping[str, ModelVerdict],
                    family_verdicts: Mapping[str, Mapping[str, ModelVerdict]] | None = None) -> dict[str, Any]:
    """reports/metrics.json, headline numbers only: ``{model: {family: headline}}``, no nulls.

    A headline (:mod:`emad.report.curves`, read on the family's curve over the model's domains): ``c1``, ``c2``
    (``pass``, ``fail`` = falsified, ``untested`` at this size, ``unresolved`` at this sample size);
    ``tolerance_multiple_at_target`` (the
    largest change / tolerance over the checks, 1 = at the tolerance) and ``perplexity_change_at_target``
    (relative rise, ratio − 1, worst domain) at the FLOPs ratio 1 − ``min_flops_reduction``, interpolated on the
    envelope (left out when the curve does not reach it); ``max_reduction_within_tolerance``: the largest positive
    FLOPs reduction of a point with every named check counted and met (left out when there is none);
    ``max_reduction_unresolved`` / ``max_reduction_untested``: the largest one met, untested at this size or
    unresolved, when that point is unresolved / untested; ``c2_point``,
    ``speedup`` (``_lo``, ``_hi``, ``_prompts``, ``_level``): the point C2 names when it was timed over prompts
    with every counted check met, its tokens/s over full depth's with the interval over prompts at the level C2
    judged it (family-wise); ``speedup_device``: the device whose pairs it reads, only where the point's runs were
    timed on several. Families are those of ``family_verdicts`` (judged alone; computed from ``runs`` with
    the thresholds of ``verdicts`` when None) plus the judged method of ``verdicts`` under its joined name
    (``emad (all)``, or ``emad, confidence``) when it spans several. The per-run detail is :func:`run_details`.
    """
    families = _families(runs, verdicts, family_verdicts)
    curves = {(c.model, c.family): c for c in model_curves(families)}
    out: dict[str, Any] = {}
    for family, per in sorted(families.items()):
        for model, v in sorted(per.items()):
            out.setdefault(model, {})[family] = _headline(curves[(model, family)], v)
    return {m: dict(sorted(per.items())) for m, per in sorted(out.items())}


def run_details(runs: Sequence[dict[str, Any]], verdicts: Mapping[str, ModelVerdict],
                family_verdicts: Mapping[str, Mapping[str, ModelVerdict]] | None = None) -> dict[str, Any]:
    """The detail file beside metrics.json (reports/details.json; not DVC metrics): ``{"models": {model:
    {verdict, best, runs}}, "curves": [...], "domain_curves": [...], "domain_shift": [...]}``.

    Per model: ``verdict``: ``c1``, ``c2`` (True = passes), ``c1_outcome``, ``c2_outcome`` and ``c1_literal``
    of the judged method; ``best``: its deciding points with the FLOPs reduction (C1) and speed-up (C2);
    ``runs``: FLOPs and bytes ratios, speed-up, mean depth and quality metrics per operating point and domain,
    each metric with its 95% interval and sample size (``<metric>.lo``, ``.hi``, ``.n``; left out when
    undefined), no nulls. ``curves`` / ``domain_curves``: :meth:`emad.report.curves.Curve.to_dict` on the model
    and per domain × calibration source; ``domain_shift``: :func:`emad.report.curves.domain_shift_curves`.
    """
    base = baselines(runs)
    models: dict[str, Any] = {}
    for model in sorted({r["model"] for r in runs}):
        per_point: dict[str, dict[str, Any]] = {}
        for r in sorted((r for r in runs if r["model"] == model), key=lambda r: r["run_id"]):
            per_point.setdefault(point_label(r), {})[r["domain"]] = _run_metrics(r, base.get((model, r["domain"])))
        entry: dict[str, Any] = {}
        if model in verdicts:
            v = verdicts[model]
            entry["verdict"] = {"c1": v.c1.passed, "c2": v.c2.passed, "c1_outcome": v.c1.outcome,
                                "c2_outcome": v.c2.outcome, "c1_literal": v.c1.literal}
            entry["best"] = _best(v)
        entry["runs"] = dict(sorted(per_point.items()))
        models[model] = entry
    families = _families(runs, verdicts, family_verdicts)
    per_domain = domain_curves(families)
    return {"models": models, "curves": [c.to_dict() for c in model_curves(families)],
            "domain_curves": [c.to_dict() for c in per_domain], "domain_shift": domain_shift_curves(per_domain)}
