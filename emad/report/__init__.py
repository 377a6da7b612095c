"""The aggregate stage's library, by what each module makes.

- frontier data: :mod:`.frontier` (rows of quality against cost, Pareto frontiers, speed-ups, oracle bounds) and
  :mod:`.curves` (each family's curve read at equal FLOPs);
- the verdict: :mod:`.verdict` (C1, C2) on :mod:`.checks` (tolerance checks with intervals);
- tables: :mod:`.tables`, :mod:`.readouts`; report.md, metrics.json and details.json: :mod:`.render`;
- figures: :mod:`.figures` (the curve figures), :mod:`.plots` (the other stages' figures), :mod:`.heatmap`.

Every function takes run records (dicts in the ``emad-run`` format of :mod:`emad.evaluation.runfile`) and returns plain
data, a matplotlib figure or text; nothing here reads run files or knows about reports/. A typical sequence::

    runs = emad.evaluation.runfile.load_all("reports/runs")
    series = pareto_data(runs)                         # dvc plots data: series.plot_rows() per series.name
    verdicts = verdict(runs)                           # {model: ModelVerdict} for EMAD
    others = family_verdicts(runs)                     # {family: {model: ModelVerdict}}
    tables = {"ablations": ablation_tables(runs, default_point="emad-m05")}
    index = write_pareto_figures(series, "reports/figures")
    write_overview_figure(series, "reports/figures/overview.png")          # perplexity vs FLOPs, per domain
    write_domain_shift_figure(series, "reports/figures/domain-shift.png")  # in-domain vs shifted calibration
    text = report_markdown(runs, verdicts, tables, index, family_verdicts=others, relative_to="reports")
    metrics = metrics_summary(runs, verdicts, others)   # headline numbers: reports/metrics.json
    details = run_details(runs, verdicts, others)      # every run and curve: reports/details.json
    curves = model_curves(others)                      # each family's swept points read at equal FLOPs
"""

from __future__ import annotations

from emad import lazy_exports

_EXPORTS = {
    "emad.report.curves": [
        "AtFlops", "Curve", "CurvePoint", "at_flops", "domain_curves", "domain_shift_curves", "envelope",
        "largest_reduction", "model_curves"
    ],
    "emad.report.figures.frontier": [
        "domain_shift_figure", "overview_figure", "pareto_figure", "write_domain_shift_figure",
        "write_overview_figure", "write_pareto_figures"
    ],
    "emad.report.frontier": [
        "ParetoSeries", "baselines", "oracle_bounds", "oracle_flops_ratio", "pareto_data", "point_label", "speedup"
    ],
    "emad.report.render": [
        "metrics_summary", "report_markdown", "run_details"
    ],
    "emad.report.tables": [
        "ablation_markdown", "ablation_tables", "domain_shift_markdown", "domain_shift_table"
    ],
    "emad.report.verdict": [
        "C1Result", "C2Result", "Check", "CriterionResult", "ModelVerdict", "PointAssessment", "Thresholds",
        "families_of", "family_verdicts", "model_verdict"
    ],
}
# ``verdict`` and ``frontier`` are submodules' names as well as functions: import those functions from their
# modules (``from emad.report.verdict import verdict``), a lazily bound name would be the module.
__all__, __getattr__, __dir__ = lazy_exports("emad.report", globals(), _EXPORTS)
