"""The report's tables as plain data (lists of dicts), with markdown renderers.

Domain-shift table — for the runs that use a profile (``calibration`` set): one row per calibration source, one
column per evaluation domain, per model and point. A cell holds the savings ``1 − flops_ratio``, the quality
metrics, their change against the full-depth run of that domain (``vs_full``: relative for lower-better metrics
such as perplexity, absolute for the others, as in the verdict; ``vs_full_ci``: its paired 95% interval
``[lo, hi]``, None when undefined) and, when the model × point has an in-domain run
on that domain (calibration source == domain), the change against it (``vs_in_domain``: savings as a plain
difference, this cell minus the in-domain cell; metrics relative / absolute as in ``vs_full``).

Curve tables (:mod:`emad.report.curves`) — per model × family (and per calibration source × domain): the
tolerance used and the perplexity change read at the target FLOPs ratio on the family's envelope, the measured
points on either side, and the largest FLOPs reduction within tolerance; the domain-shift comparison of curves
calibrated in-domain and shifted at equal FLOPs.

Ablation tables — the runs of the default operating point and every run whose ``factors`` differ from the
default's in exactly one key (same model, domain and calibration source). One table per varied factor; its rows
are the default plus each variant, each with the factor value, quality metrics (and their ``intervals``),
``flops_ratio``, ``speedup`` and ``backfill_share``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from emad.evaluation.checks import change_of, full_on_units
from emad.evaluation.identity import CurveId
from emad.evaluation.metrics import higher_is_better
from emad.report.curves import TOLERANCE_USED, AtFlops, Curve, CurvePoint
from emad.report.frontier import baselines, speedup

_MISSING = object()


def quality_change(metric: str, value: float | None, ref: float | None) -> float | None:
    """Change of ``value`` against ``ref``: relative for lower-better metrics, absolute difference otherwise."""
    if value is None or ref is None:
        return None
    if higher_is_better(metric):
        return value - ref
    return value / ref - 1.0 if ref else None


def _vs_full_ci(metric: str, run: dict, base: dict | None) -> list[float] | None:
    """The paired 95% interval of the change vs full depth, signed as :func:`quality_change` (None: undefined)."""
    iv = change_of(metric, run, base) if base is not None and metric in base.get("quality", {}) else None
    if iv is None or not iv.defined:
        return None
    return [iv.lo, iv.hi] if not higher_is_better(metric) else [-iv.hi, -iv.lo]  # a drop as value − full


def _savings(run: dict[str, Any]) -> float | None:
    ratio = run.get("cost", {}).get("flops_ratio")
    return None if ratio is None else 1.0 - ratio


def _shift_cell(run: dict, base: dict | None, in_domain: dict | None) -> dict[str, Any]:
    q = run.get("quality", {})
    cell = {"model": run["model"], "point": run["point"], "calibration": run["calibration"],
            "domain": run["domain"], "run_id": run["run_id"], "in_domain": CurveId.of_run(run).in_domain,
            "savings": _savings(run), "quality": dict(sorted(q.items())),
            "vs_full": {m: quality_change(m, v, full_on_units(m, run, base) if base else None)
                        for m, v in sorted(q.items())},
            "vs_full_ci": {m: _vs_full_ci(m, run, base) for m in sorted(q)}, "vs_in_domain": None}
    if in_domain is not None and in_domain is not run:
        iq = in_domain.get("quality", {})
        s, s0 = cell["savings"], _savings(in_domain)
        cell["vs_in_domain"] = {"savings": None if s is None or s0 is None else s - s0,
                                **{m: quality_change(m, v, iq[m]) for m, v in sorted(q.items()) if m in iq}}
    return cell


def domain_shift_table(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per run with a calibration source, sorted by (model, point, calibration, domain).

    Each cell: ``model, point, calibration, domain, run_id, in_domain, savings, quality, vs_full, vs_in_domain``
    (see the module docstring).
    """
    base = baselines(runs)
    cal_runs = [r for r in runs if r.get("calibration")]
    in_dom = {(r["model"], r["point"], r["domain"]): r for r in cal_runs if CurveId.of_run(r).in_domain}
    cells = [_shift_cell(r, base.get((r["model"], r["domain"])), in_dom.get((r["model"], r["point"], r["domain"])))
             for r in cal_runs]
    return sorted(cells, key=lambda c: (c["model"], c["point"], c["calibration"], c["domain"]))


def _diff_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k, _MISSING) != b.get(k, _MISSING))


def _ablation_row(run: dict, factor: str, base: dict | None, is_default: bool) -> dict[str, Any]:
    cost = run.get("cost", {})
    return {"model": run["model"], "domain": run["domain"], "calibration": run.get("calibration"),
            "factor": factor, "value": run.get("factors", {}).get(factor), "point": run["point"],
            "run_id": run["run_id"], "is_default": is_default, "quality": dict(sorted(run.get("quality", {}).items())),
            "intervals": run.get("intervals", {}),
            "flops_ratio": cost.get("flops_ratio"), "speedup": speedup(run, base),
            "backfill_share": cost.get("backfill_share")}


def _value_key(v: Any) -> tuple:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v))


def ablation_tables(runs: Sequence[dict[str, Any]], default_point: str) -> dict[str, list[dict[str, Any]]]:
    """``{factor: rows}`` for every factor that some run varies alone against ``default_point``.

    Rows: ``model, domain, calibration, factor, value, point, run_id, is_default, quality, flops_ratio, speedup,
    backfill_share``, sorted by (model, domain, calibration, value); the default row is in every table.

    Raises:
        ValueError: no run of ``default_point``, or its runs carry no factors.
    """
    defaults = [r for r in runs if r["point"] == default_point]
    if not defaults:
        points = ", ".join(sorted({r["point"] for r in runs})) or "none"
        raise ValueError(f"default operating point {default_point!r} has no runs (points with runs: {points})")
    if not any(r.get("factors") for r in defaults):
        raise ValueError(f"runs of {default_point!r} carry no factors (only emad points do); pick an emad point "
                         "as the default for the ablation tables")
    base = baselines(runs)
    tables: dict[str, list[dict[str, Any]]] = {}
    for d in defaults:
        key = (d["model"], d["domain"], d.get("calibration"))
        variants = {}
        for r in runs:
            if r is d or (r["model"], r["domain"], r.get("calibration")) != key or not r.get("factors"):
                continue
            diff = _diff_keys(r["factors"], d.get("factors", {}))
            if len(diff) == 1:
                variants.setdefault(diff[0], []).append(r)
        b = base.get((d["model"], d["domain"]))
        for factor, rs in variants.items():
            rows = tables.setdefault(factor, [])
            rows.append(_ablation_row(d, factor, b, True))
            rows += [_ablation_row(r, factor, b, False) for r in rs]
    order = lambda row: (row["model"], row["domain"], row["calibration"] or "", _value_key(row["value"]),
                         row["run_id"])
    return {f: sorted(rows, key=order) for f, rows in sorted(tables.items())}


# --- markdown -------------------------------------------------------------------------------------------------

def fmt(x: Any, spec: str = ".3f") -> str:
    """A number for a table (``–`` when missing)."""
    if x is None:
        return "–"
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    return format(x, spec)


def fmt_quality(value: float | None, interval: dict[str, Any] | None, spec: str = ".3f") -> str:
    """A quality metric with its 95% interval and sample size: ``0.512 [0.410, 0.613] n=50`` (``[n/a]`` when the
    interval is undefined or was not recorded)."""
    if value is None:
        return "–"
    lo, hi, n = ((interval or {}).get(k) for k in ("lo", "hi", "n"))
    ci = "n/a" if lo is None or hi is None else f"{format(lo, spec)}, {format(hi, spec)}"
    return f"{fmt(value, spec)} [{ci}]" + (f" n={n}" if n is not None else "")


def fmt_change(metric: str, change: float | None) -> str:
    """A quality change: ``+1.23%`` for relative (lower-better) metrics, ``-0.8 pt`` for absolute ones."""
    if change is None:
        return "–"
    return f"{100 * change:+.1f} pt" if higher_is_better(metric) else f"{change:+.2%}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell_text(cell: dict[str, Any]) -> str:
    parts = [f"savings {fmt(cell['savings'], '.1%')}"]
    cis = cell.get("vs_full_ci", {})
    parts += [f"{m} {fmt_change(m, c)}" + (" [" + ", ".join(fmt_change(m, b) for b in cis[m]) + "]"
                                           if cis.get(m) else " [n/a]") for m, c in cell["vs_full"].items()]
    vs = cell["vs_in_domain"]
    if vs:
        parts.append("vs in-domain: savings " + fmt(vs.get("savings"), "+.1%")
                     + "".join(f", {m} {fmt_change(m, v)}" for m, v in vs.items() if m != "savings"))
    return "<br>".join(parts)


def domain_shift_markdown(cells: Sequence[dict[str, Any]]) -> str:
    """One matrix per model × point: rows = calibration source, columns = evaluation domain."""
    if not cells:
        return "_No runs with a calibration profile._"
    out = []
    groups = sorted({(c["model"], c["point"]) for c in cells})
    for model, point in groups:
        mine = [c for c in cells if (c["model"], c["point"]) == (model, point)]
        domains = sorted({c["domain"] for c in mine})
        cals = sorted({c["calibration"] for c in mine})
        by = {(c["calibration"], c["domain"]): c for c in mine}
        rows = [[cal] + [_cell_text(by[(cal, d)]) if (cal, d) in by else "–" for d in domains] for cal in cals]
        out.append(f"**{model} · {point}** (quality vs full depth; in-domain differences where available)\n\n"
                   + markdown_table(["calibration \\ domain"] + domains, rows))
    return "\n\n".join(out)


def ablation_markdown(tables: dict[str, list[dict[str, Any]]]) -> str:
    """One markdown table per factor, with the calibration source of each row (``backfill_share`` only for the
    policy factor)."""
    if not tables:
        return "_No single-factor ablations among the runs._"
    out = []
    for factor, rows in tables.items():
        metrics = sorted({m for r in rows for m in r["quality"]})
        extra = ["backfill share"] if factor == "policy" else []
        header = ["model", "domain", "calibration", factor, "point"] + metrics + ["FLOPs ratio", "speed-up"] + extra
        body = []
        for r in rows:
            value = f"**{r['value']}** (default)" if r["is_default"] else str(r["value"])
            line = [r["model"], r["domain"], r["calibration"] or "–", value, r["point"]] + [
                fmt_quality(r["quality"].get(m), r.get("intervals", {}).get(m)) for m in metrics]
            line += [fmt(r["flops_ratio"]), fmt(r["speedup"], ".2f")]
            line += [fmt(r["backfill_share"])] if extra else []
            body.append(line)
        out.append(f"**{factor}**\n\n" + markdown_table(header, body))
    return "\n\n".join(out)



def risk_markdown(results: Sequence[dict[str, Any]]) -> str:
    """One row per risk-controlled search: the chosen knob value, its guarantee, and the check on fresh prompts."""
    if not results:
        return "_No risk-controlled searches._"
    lines = ["| model | search | calibration | knob | chosen | held-out loss | fresh loss (δ) | holds on fresh | "
             "FLOPs ratio (fresh) | MLflow run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["model"], r["search"], r["calibration"])):
        tested = dict(zip(r["values"], r["risks"]))
        chosen = "none" if r["chosen"] is None else f"{r['chosen']:g}"
        held = "—" if r["chosen"] is None else f"{tested[r['chosen']]:.3f}"
        fresh = "—" if r.get("fresh_risk") is None else f"{r['fresh_risk']:.3f} ({r['delta']:g})"
        holds = "—" if r.get("fresh_holds") is None else ("yes" if r["fresh_holds"] else "**no**")
        flops = "—" if r.get("fresh_flops_ratio") is None else f"{r['fresh_flops_ratio']:.3f}"
        lines.append(f"| {r['model']} | {r['search']} | {r['calibration']} | {r['knob']} | {chosen} | {held} | "
                     f"{fresh} | {holds} | {flops} | `{r.get('mlflow_run_id') or '-'}` |")
    notes = [f"- {r['model']} · {r['search']}: {r['guarantee']}." for r in results]
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


# --- curves ---------------------------------------------------------------------------------------------------

def fmt_degradation(metric: str, value: float | None) -> str:
    """A curve's degradation (positive = worse) in the units of :func:`fmt_change`; the tolerance used as ``0.42``."""
    if value is None:
        return "–"
    if metric == TOLERANCE_USED:
        return fmt(value, ".2f")
    return fmt_change(metric, -value if higher_is_better(metric) else value)


def _pt(p: CurvePoint, metric: str = TOLERANCE_USED) -> str:
    return f"{p.label} ({p.reduction:.1%}: {fmt_degradation(metric, p.value)})"


def fmt_between(at: AtFlops, metric: str = TOLERANCE_USED) -> str:
    """The measured envelope points beside a reading: ``a (12.0%: 0.30) · b (18.0%: 0.80)`` (cheaper first)."""
    if at.cheaper is None:
        return "not reached" + (f"; cheapest {_pt(at.costlier, metric)}" if at.costlier else "")
    if at.costlier is None:
        return f"{_pt(at.cheaper, metric)}, flat above"
    if at.costlier is at.cheaper:
        return f"at {_pt(at.cheaper, metric)}"
    return f"{_pt(at.cheaper, metric)} · {_pt(at.costlier, metric)}"


def fmt_largest(p: CurvePoint | None) -> str:
    return "none" if p is None else f"{p.reduction:.1%} ({p.label}, {p.state})"


def _curve_cells(c: Curve) -> list[str]:
    at = c.at_target
    ppl = c.at(c.target, "perplexity") if "perplexity" in c.metrics else None
    return [fmt_degradation(TOLERANCE_USED, at.value), fmt_between(at),
            fmt_degradation("perplexity", ppl.value) if ppl else "–", fmt_largest(c.largest_ok)]


CURVE_NOTE = ("Read on each family's lower frontier (its monotone envelope: points no other point of the family "
              "beats on FLOPs and quality, joined by straight lines, flat above the costliest; undefined below the "
              "cheapest). Tolerance used = the largest change/tolerance over the checks (1 = at the tolerance); "
              "beside it the measured points on either side (FLOPs reduction: tolerance used). Largest reduction "
              "within tolerance: the measured point with most FLOPs saved and no check violated (met or unresolved).")


def curves_markdown(curves: Sequence[Curve], outcomes: Mapping[tuple[str, str], tuple[str, str]] | None = None) -> str:
    """One row per model × family (curves on the model): C1 and C2 (``outcomes[(model, family)]``), the tolerance
    used and perplexity change at the target FLOPs, the points beside it, the largest reduction within tolerance."""
    if not curves:
        return "_No curves._"
    target = curves[0].target
    rows = [[c.model, c.family, str(len(c.points)), *(outcomes or {}).get((c.model, c.family), ("–", "–")),
             *_curve_cells(c)] for c in curves]
    return markdown_table(["model", "family", "points", "C1", "C2",
                           f"tolerance used at {1 - target:.0%} fewer FLOPs (confirmation half)",
                           "measured beside it", "perplexity (confirmation half)",
                           "largest reduction within tolerance"], rows)


def domain_curves_markdown(curves: Sequence[Curve]) -> str:
    """One row per model × family × calibration source × domain (the curves on one domain)."""
    if not curves:
        return "_No curves._"
    target = curves[0].target
    rows = [[c.model, c.family, c.calibration or "–", c.domain or "–", *_curve_cells(c)] for c in curves]
    return markdown_table(["model", "family", "calibration", "domain",
                           f"tolerance used at {1 - target:.0%} fewer FLOPs (confirmation half)", "measured beside it",
                           "perplexity (confirmation half)", "largest reduction within tolerance"], rows)


def _shift_reading(cell: dict[str, Any]) -> str:
    a, b, d = cell["in_domain"], cell["shifted"], cell["difference"]
    if a is None and b is None:
        return "–"
    return f"{fmt(a, '.2f')} → {fmt(b, '.2f')}" + (f" ({d:+.2f})" if d is not None else "")


def shift_curves_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One row per shifted curve: the tolerance used in-domain → shifted (difference) at each common FLOPs ratio,
    and the largest reductions within tolerance."""
    if not rows:
        return "_No curve calibrated on one domain and evaluated on another._"
    ratios = [c["flops_ratio"] for c in rows[0]["at"]]
    body = []
    for r in rows:
        ok = r["largest_ok"]
        body.append([r["model"], r["family"], r["domain"], r["calibration"]]
                    + [_shift_reading(c) for c in r["at"]]
                    + [f"{fmt(ok['in_domain'], '.1%')} → {fmt(ok['shifted'], '.1%')}"])
    return markdown_table(["model", "family", "domain", "calibrated on"] + [f"FLOPs {x:g}" for x in ratios]
                          + ["largest reduction within tolerance"], body)
