"""Stage ``aggregate``: run files → metrics.json (headline numbers), details.json (every run and curve), Pareto
data and figures, verdict, tables and report.md.

Reads only the run files (never MLflow), so runs restored from DVC's run cache count. Logs one MLflow run that
carries every figure and the report, with the decode runs nested under it.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from emad import tracking
from emad.evaluation import coverage
from emad.evaluation.coverage import Coverage
from emad.evaluation.coverage_samples import coverage_samples, samples_text
from emad.evaluation.record import load_records
from emad.io import atomic_write_json, atomic_write_text, read_json
from emad.params import load_section
from emad.report import (
    Thresholds,
    ablation_tables,
    families_of,
    family_verdicts,
    metrics_summary,
    pareto_data,
    report_markdown,
    run_details,
)
from emad.report.config import AggregateConfig
from emad.report.figures.lines import plot_fields
from emad.report.verdict import verdict
from emad.stage import run_stage

PLOT_KEYS = ("run_id", "point", "family", "calibration", "flops_ratio", "bytes_ratio", "speedup", "quality",
             "on_frontier_flops", "on_frontier_speed", "curve", "knob", "value", "readout", "domain", "screened")
OVERVIEW, DOMAIN_SHIFT = "overview.png", "domain-shift.png"  # beside the per-series figures


def _write_plot_data(series, folder: Path, thresholds: Thresholds) -> None:
    """One JSON per series for ``dvc plots`` (every record with the same keys, as DVC requires), under
    ``flops/`` and ``speed/`` — one plot definition per x axis in dvc.yaml. Each row also carries the quality as
    the figures show it (``quality_vs_full``) and the line it belongs to (``line``, ``calibration_kind``); the FLOPs
    data also holds the screened values of the series' sweeps (``screened: true``, drawn faintly)."""
    for s in series:
        rows = [{**{k: row.get(k) for k in PLOT_KEYS}, "screened": False,
                 **plot_fields(s, row, thresholds.ppl_rel_tol, thresholds.acc_abs_tol)} for row in s.plot_rows()]
        screened = [{**{k: row.get(k) for k in PLOT_KEYS}, "domain": s.domain, "screened": True,
                     **plot_fields(s, row, thresholds.ppl_rel_tol, thresholds.acc_abs_tol)} for row in s.screen]
        atomic_write_json(folder / "flops" / f"{s.name}.json", rows + screened)
        atomic_write_json(folder / "speed" / f"{s.name}.json", rows)


def _risk_results(folder: Path | None) -> list[dict]:
    """The ``emad-risk`` result files of the risk stage (none when the folder is absent)."""
    if folder is None or not folder.is_dir():
        return []
    return [read_json(path, "risk result", ValueError) for path in sorted(folder.rglob("*.json"))]


def _readout_fits(folder: Path | None) -> dict[str, dict]:
    """``{"model/source": metrics.json}`` of stage fit_readouts (none when the folder is absent)."""
    if folder is None or not folder.is_dir():
        return {}
    return {f"{p.parent.parent.name}/{p.parent.name}": read_json(p, "readout metrics", ValueError)
            for p in sorted(folder.glob("*/*/metrics.json"))}


def verdict_notes(verdicts: dict, others: dict) -> dict[str, str]:
    """Per model, the verdict in a line: the judged method's C1 / C2 and every family that passes C1."""
    notes = {}
    for model, v in verdicts.items():
        passing = sorted(f for f, per in others.items() if model in per and per[model].c1.passed)
        notes[model] = (f"{v.name}: C1 {v.c1.outcome}, C2 {v.c2.outcome}"
                        + (f"; C1 passes: {', '.join(passing)}" if passing else "; no family passes C1"))
    return notes


def verdict_log(v, prefix: str) -> tuple[dict[str, float], dict[str, str]]:
    """MLflow metrics and tags of one verdict (a :class:`emad.report.verdict.ModelVerdict`), names under
    ``prefix`` (``smollm2-135m`` or ``family.emad.smollm2-135m``): ``c1_passed``, ``c2_passed``, ``c1_literal``
    (1 = some point with the reduction degrades more than the tolerance), ``c1_flops_reduction`` and
    ``c2_speedup`` of the deciding points; tags ``c1`` / ``c2`` (pass, fail, untested or unresolved), their reasons
    ``c1_reason`` / ``c2_reason`` (emad.evaluation.decisions) and the deciding points
    ``c1_point`` / ``c2_point``. Nothing undefined is logged."""
    metrics = {"c1_passed": float(v.c1.passed), "c2_passed": float(v.c2.passed), "c1_literal": float(v.c1.literal),
               "c1_flops_reduction": v.c1.deciding.reduction if v.c1.deciding else None,
               "c2_speedup": v.c2.deciding.speedup if v.c2.deciding else None}
    tags = {"c1": v.c1.outcome, "c2": v.c2.outcome, "c1_reason": v.c1.reason or None, "c2_reason": v.c2.reason or None,
            "c1_point": v.c1.deciding.label if v.c1.deciding else None,
            "c2_point": v.c2.deciding.label if v.c2.deciding else None}
    return ({f"{prefix}.{k}": float(x) for k, x in metrics.items() if x is not None},
            {f"{prefix}.{k}": str(x) for k, x in tags.items() if x is not None})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, required=True, help="folder of run files (reports/runs)")
    parser.add_argument("--risk", type=Path, help="folder of risk-control results (reports/risk)")
    parser.add_argument("--readouts", type=Path, help="folder of fitted readouts (data/readouts: <model>/<source>/"
                        "metrics.json)")
    parser.add_argument("--default-point", required=True, help="the EMAD point the ablations vary")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics.json to write (headline numbers)")
    parser.add_argument("--details", type=Path, required=True, help="details.json to write (every run and curve)")
    parser.add_argument("--pareto", type=Path, required=True, help="folder for dvc plots data")
    parser.add_argument("--figures", type=Path, required=True, help="folder for Pareto PNGs")
    parser.add_argument("--report", type=Path, required=True, help="report.md to write")
    parser.add_argument("--coverage", type=Path, help="coverage table of the intervals (reports/bench/coverage.json: "
                        "benchmarks/bench_coverage.py); without it every interval is taken at face value")
    parser.add_argument("--coverage-samples", type=Path, help="where to write the per-unit samples the coverage "
                        "simulation draws from (reports/bench/coverage_samples.json: python benchmarks/bench_coverage.py "
                        "rebuilds coverage.json from it)")
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_args(argv)


def load_params(args: argparse.Namespace) -> AggregateConfig:
    """The params this stage reads, checked (the whole file first): section ``aggregate``."""
    return load_section("aggregate", AggregateConfig, args.params, points=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_params(args)
    table = Coverage.load(args.coverage) if args.coverage else None  # a bad table fails before any work
    runs = [r.to_dict() for r in load_records(args.runs)]  # the report reads each record as its dict
    with coverage.using(table):  # every label the verdict gives rests on an interval that covers at its size
        return _aggregate(args, cfg, runs)


def _aggregate(args: argparse.Namespace, cfg: AggregateConfig, runs: list[dict]) -> int:
    verdicts = verdict(runs, families_of(runs, cfg.methods), **cfg.thresholds())
    others = family_verdicts(runs, **cfg.thresholds())
    tables = {"ablations": ablation_tables(runs, default_point=args.default_point)
              if any(r["point"] == args.default_point for r in runs) else {},
              "risk": _risk_results(args.risk)}
    series = pareto_data(runs, [read_json(p, "screen file", ValueError)
                                for p in sorted(args.runs.rglob("screens/*.json"))])
    thresholds = Thresholds(**cfg.thresholds())
    from emad.report.figures.frontier import (  # matplotlib: imported where the figures are drawn
        write_domain_shift_figure,
        write_overview_figure,
        write_pareto_figures,
    )

    with tempfile.TemporaryDirectory(dir=args.figures.parent if args.figures.parent.exists() else None) as tmp:
        staged = Path(tmp)  # figures and plot data appear whole, or not at all
        index = write_pareto_figures(series, staged / "figures", thresholds)
        summaries = [p for p in (write_overview_figure(series, staged / "figures" / OVERVIEW, thresholds=thresholds,
                                                       notes=verdict_notes(verdicts, others)),
                                 write_domain_shift_figure(series, staged / "figures" / DOMAIN_SHIFT,
                                                           thresholds=thresholds)) if p]
        _write_plot_data(series, staged / "pareto", thresholds)
        for src, dst in ((staged / "figures", args.figures), (staged / "pareto", args.pareto)):
            shutil.rmtree(dst, ignore_errors=True)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), dst)
    for entry in index:
        entry["path"] = str(args.figures / Path(entry["path"]).name)
    text = report_markdown(runs, verdicts, tables, index, family_verdicts=others, relative_to=args.report.parent,
                           readout_fits=_readout_fits(args.readouts))
    summary = metrics_summary(runs, verdicts, others)
    details = run_details(runs, verdicts, others)

    params = {"aggregate": cfg.model_dump(), "default_point": args.default_point, "runs": len(runs)}
    with tracking.stage_run("aggregate", params, run_name=tracking.run_name("aggregate")) as run:
        atomic_write_text(args.report, text)
        atomic_write_json(args.metrics, summary)
        atomic_write_json(args.details, details)
        if args.coverage_samples:
            atomic_write_text(args.coverage_samples, samples_text(coverage_samples(runs)))
        for model, v in verdicts.items():
            run.log_dict(v.to_dict(), f"verdict/{model}.json")
            metrics, tags = verdict_log(v, model)  # c1 / c2: pass, fail or unresolved
            run.log_metrics(metrics)
            run.set_tags(tags)
        for family, per_model in others.items():
            for model, v in per_model.items():
                run.log_dict(v.to_dict(), f"verdict/family/{family}/{model}.json")
                metrics, tags = verdict_log(v, f"family.{family}.{model}")
                run.log_metrics(metrics)
                run.set_tags(tags)
        run.set_tags({tracking.NOTE: "\n\n".join(v.sentence().replace("\n", "\n\n") for v in verdicts.values())
                      or "No verdict: no run of the methods in aggregate.methods."})
        figures = [entry["path"] for entry in index] + [str(args.figures / p.name) for p in summaries]
        run.log_metrics({"runs": len(runs), "figures": len(figures)})
        for path in figures:
            run.log_artifact(path, "figures")
        run.log_artifact(args.report)
        run.log_artifact(args.metrics)
        run.log_artifact(args.details)
        nested = run.adopt(sorted({r["mlflow_run_id"] for r in runs if r.get("mlflow_run_id")}))
        run.set_tags({"decode_runs": len(runs), "decode_runs_in_store": nested})
    for model, v in verdicts.items():
        print(f"aggregate: {model}: {v.sentence()}")
    print(f"aggregate: {len(runs)} runs -> {args.report}, {args.metrics}, {args.details}, {len(index)} figures")
    return 0


if __name__ == "__main__":
    run_stage("aggregate", main)
