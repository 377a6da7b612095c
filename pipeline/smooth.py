"""Stage ``smooth``: calibration statistics → the target profile τ (JSON) and its figure (PNG), for each readout.

Beside ``profile.json`` (the strata as calibrated) it writes ``strata/<variant>.json`` for every stratification
reachable by dropping axes (``none``, ``position``, ``confidence``, ``both``), each smoothed from the folded
statistics: the stratification ablation needs one calibration run, not four.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from emad import tracking
from emad.calibration.config import CalibrateConfig, SmoothConfig
from emad.calibration.profile import smooth, smooth_variants, variant_path
from emad.calibration.stats import CalibrationStats
from emad.engine.fingerprint import ModelFingerprint
from emad.params import load_section
from emad.report.plots import profile_figure, save_figure  # matplotlib is imported by the first figure
from emad.stage import READOUT, per_readout, run_stage


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stats", required=True, help=f"stats JSON (stage calibrate); with several readouts a path "
                        f"with {READOUT}, as --out and --plot")
    parser.add_argument("--out", required=True, help="profile JSON to write")
    parser.add_argument("--plot", required=True, help="PNG of raw vs smoothed profiles")
    parser.add_argument("--readout", action="append", help="a readout whose statistics to smooth; repeat for "
                        "several (default: every one of calibrate.readouts)")
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_args(argv)


def load_params(args: argparse.Namespace) -> tuple[SmoothConfig, list[str]]:
    """The params this stage reads, checked (the whole file first): section ``smooth``, and the readouts to smooth
    (``--readout``, else ``calibrate.readouts``)."""
    return (load_section("smooth", SmoothConfig, args.params, points=False),
            args.readout or load_section("calibrate", CalibrateConfig, args.params, points=False).readouts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg, readouts = load_params(args)
    files = {flag: per_readout(getattr(args, flag), readouts, f"--{flag}") for flag in ("stats", "out", "plot")}
    stats = {name: CalibrationStats.load(path) for name, path in files["stats"].items()}  # all read before any work
    for name in readouts:
        _smooth(cfg, stats[name], files["stats"][name], files["out"][name], files["plot"][name])
    return 0


def _smooth(cfg: SmoothConfig, stats: CalibrationStats, source: Path, out: Path, plot: Path) -> None:
    """One readout's profile (and its stratification variants), figure and MLflow run."""
    profile = smooth(stats, cfg.statistic, cfg.min_count, cfg.isotonic)
    params = {"smooth": cfg.model_dump(), "stats": str(source)}
    tags = {"model_fingerprint": ModelFingerprint(**profile.model).digest if profile.model else "",
            "corpus_manifest": profile.corpus}
    variants = smooth_variants(stats, cfg.statistic, cfg.min_count, cfg.isotonic)
    name = tracking.run_name("smooth", *tracking.profile_qualifiers(out, profile.readout))
    with tracking.stage_run("smooth", params, tags, run_name=name) as run:
        profile.save(out)
        for variant, smoothed in variants.items():
            smoothed.save(variant_path(out, variant))
        save_figure(profile_figure(profile, title=str(out.parent)), plot)
        for stratum in profile.strata.names():
            run.log_series(f"tau.{stratum}", dict(zip(profile.probe_layers, profile.tau[stratum])))
            run.log_series(f"raw.{stratum}", dict(zip(profile.probe_layers, profile.raw[stratum])))
            run.log_metrics({f"violation_max.{stratum}": profile.monotonicity[stratum]["max"],
                             f"violation_total.{stratum}": profile.monotonicity[stratum]["total"]})
        run.log_artifact(plot)
        run.log_artifact(out)
    worst = max(profile.monotonicity.values(), key=lambda m: m["max"])
    print(f"smooth: {len(profile.tau)} strata x {len(profile.probe_layers)} probes -> {out}; "
          f"largest raw rise {worst['max']:.3f} nats, backed off: {len(profile.backed_off)}; "
          f"variants: {', '.join(variants)}")


if __name__ == "__main__":
    run_stage("smooth", main)
