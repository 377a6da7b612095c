"""Stage ``smooth``: calibration statistics → the target profile τ (JSON) and its figure (PNG).

Beside ``profile.json`` (the strata as calibrated) it writes ``strata/<variant>.json`` for every stratification
reachable by dropping axes (``none``, ``position``, ``confidence``, ``both``), each smoothed from the folded
statistics: the stratification ablation needs one calibration run, not four.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from emad import tracking
from emad.calibration.config import SmoothConfig
from emad.calibration.profile import smooth, smooth_variants, variant_path
from emad.calibration.stats import CalibrationStats
from emad.engine.models import ModelFingerprint
from emad.params import load_section
from emad.report.plots import profile_figure, save_figure
from emad.stage import run_stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    parser.add_argument("--plot", type=Path, required=True, help="PNG of raw vs smoothed profiles")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    cfg = load_section("smooth", SmoothConfig, args.params)
    stats = CalibrationStats.load(args.stats)
    profile = smooth(stats, cfg.statistic, cfg.min_count, cfg.isotonic)
    params = {"smooth": cfg.model_dump(), "stats": str(args.stats)}
    tags = {"model_fingerprint": ModelFingerprint(**profile.model).digest if profile.model else "",
            "corpus_manifest": profile.corpus}
    variants = smooth_variants(stats, cfg.statistic, cfg.min_count, cfg.isotonic)
    name = tracking.run_name("smooth", *tracking.profile_qualifiers(args.out, profile.readout))
    with tracking.stage_run("smooth", params, tags, run_name=name) as run:
        profile.save(args.out)
        for variant, smoothed in variants.items():
            smoothed.save(variant_path(args.out, variant))
        save_figure(profile_figure(profile, title=str(args.out.parent)), args.plot)
        for name in profile.strata.names():
            run.log_series(f"tau.{name}", dict(zip(profile.probe_layers, profile.tau[name])))
            run.log_series(f"raw.{name}", dict(zip(profile.probe_layers, profile.raw[name])))
            run.log_metrics({f"violation_max.{name}": profile.monotonicity[name]["max"],
                             f"violation_total.{name}": profile.monotonicity[name]["total"]})
        run.log_artifact(args.plot)
        run.log_artifact(args.out)
    worst = max(profile.monotonicity.values(), key=lambda m: m["max"])
    print(f"smooth: {len(profile.tau)} strata x {len(profile.probe_layers)} probes -> {args.out}; "
          f"largest raw rise {worst['max']:.3f} nats, backed off: {len(profile.backed_off)}; "
          f"variants: {', '.join(variants)}")
    return 0


if __name__ == "__main__":
    run_stage("smooth", main)
