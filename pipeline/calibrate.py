"""Stage ``calibrate``: teacher-forcing entropy statistics of one model on one corpus's calibration split, read
through each readout (one file and one MLflow run each; the model loaded once).

Runs as a plain process or data-parallel under ``torchrun --nproc_per_node N pipeline/calibrate.py ...``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from emad import tracking
from emad.calibration.calibrate import calibrate_texts, resolve_probe_layers
from emad.calibration.config import CalibrateConfig
from emad.calibration.stats import CalibrationStats
from emad.corpus import read_split
from emad.engine import distributed
from emad.engine.idle import check_grown
from emad.engine.models import load_model, prepared_spec
from emad.exits.readouts import load_readout
from emad.params import load_section
from emad.stage import READOUT, checkpoint_beside, per_readout, run_stage


def _log(run, stats, elapsed: float) -> None:
    """Token count, speed, and mean entropy / argmax agreement per probe (step = layer) for the MLflow run."""
    probes = stats.probe_layers
    run.set_tags({"probe_layers": ",".join(map(str, probes))})
    run.log_metrics({"tokens": stats.tokens, "tokens_per_s": stats.tokens / elapsed, "seconds": elapsed})
    run.log_series("entropy_mean_all", dict(zip(probes, (stats.sum.sum(0) / stats.count.sum(0)).tolist())))
    run.log_series("argmax_agreement", dict(zip(probes, stats.agreement().tolist())))
    for name, row in zip(stats.strata.names(), stats.mean().tolist()):
        run.log_series(f"entropy_mean.{name}", dict(zip(probes, row)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="model spec (prepared folder, alias or hub id)")
    parser.add_argument("--corpus", type=Path, required=True, help="sampled corpus folder (calib.jsonl)")
    parser.add_argument("--out", required=True, help=f"stats JSON to write; with several readouts a path with "
                        f"{READOUT} (data/stats/<model>/<source>/{READOUT}.json)")
    parser.add_argument("--readout", action="append", help="a readout entropies are read through (logit, tuned); "
                        "repeat for several (default: every one of calibrate.readouts)")
    parser.add_argument("--readouts", type=Path, help="readouts.safetensors (stage fit_readouts) for readout tuned")
    parser.add_argument("--grown-from", help=f"for a model grown by idle layers (<base>+idle<N>): its base model's "
                        f"statistics on the same corpus (a path with {READOUT}, as --out), extended instead of "
                        f"calibrating anew")
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_args(argv)


def load_params(args: argparse.Namespace) -> CalibrateConfig:
    """The params this stage reads, checked (the whole file first): section ``calibrate``."""
    return load_section("calibrate", CalibrateConfig, args.params)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_params(args)
    outs = per_readout(args.out, args.readout or cfg.readouts, "--out")
    bases = per_readout(args.grown_from, list(outs), "--grown-from") if args.grown_from else {}
    texts, corpus_hash = read_split(args.corpus, "calib")

    device, rank, world = distributed.join(cfg.device)
    loaded = load_model(args.model_dir, device=device, dtype=cfg.dtype)
    layers = resolve_probe_layers(cfg.probe_layers, loaded.fingerprint.n_layers)
    readouts = {name: load_readout(name, args.readouts, loaded.fingerprint.as_dict(), layers,
                                   loaded.fingerprint.n_layers) for name in outs}  # all checked before any work
    grown = {name: _grown(path, prepared_spec(args.model_dir), loaded.fingerprint.as_dict(), corpus_hash, name,
                          cfg, layers)
             for name, path in bases.items()}  # before any work
    for name, out in outs.items():
        _calibrate(args, cfg, loaded, texts, corpus_hash, name, readouts[name], out, rank, world, grown.get(name))
    distributed.leave()
    return 0


def _grown(path: Path, spec: str, fingerprint: dict, corpus_hash: str, readout: str, cfg: CalibrateConfig,
           layers: list[int]) -> CalibrationStats:
    """This model's statistics at probe ``layers`` from its base model's at ``path``, checked to be this model's
    base on this corpus and settings (:meth:`~emad.calibration.stats.CalibrationStats.grown`)."""
    base = CalibrationStats.load(path)
    check_grown(spec, fingerprint, base.model)
    if (base.corpus, base.readout) != (corpus_hash, readout):
        raise ValueError(f"--grown-from {path}: statistics of corpus {base.corpus} through {base.readout!r}, not of "
                         f"this corpus ({corpus_hash}) through {readout!r}")
    if (base.strata, base.hist_bins) != (cfg.strata.build(), cfg.hist_bins):
        raise ValueError(f"--grown-from {path}: calibrated with other strata or histogram bins than params "
                         f"calibrate: rerun it")
    return base.grown(layers, fingerprint)


def _calibrate(args, cfg: CalibrateConfig, loaded, texts, corpus_hash: str, name: str, readout, out: Path,
               rank: int, world: int, grown: CalibrationStats | None = None) -> None:
    """One readout's statistics (``grown``: given, from the base model's), written to ``out``, and its MLflow
    run."""
    params = {"calibrate": cfg.model_dump(), "model": args.model_dir, "corpus": str(args.corpus), "world_size": world,
              "readout": name, "grown_from": args.grown_from if grown is not None else None}
    run_name = tracking.run_name("calibrate", tracking.label(args.model_dir), tracking.label(args.corpus), name)
    with tracking.stage_run("calibrate", params, {"corpus_manifest": corpus_hash}, run_name=run_name,
                            enabled=rank == 0) as run:
        run.set_tags({"model_fingerprint": loaded.fingerprint.digest, "readout": name})
        bar = tqdm(unit="tok", desc=f"calibrate {args.corpus.name} {name}", disable=rank != 0)
        start = time.perf_counter()
        if grown is None:
            stats = calibrate_texts(loaded, texts, cfg, corpus_hash, checkpoint=checkpoint_beside(out),
                                    on_batch=lambda n: bar.update(n * world), on_start=lambda n: bar.reset(total=n),
                                    readout=readout)
        else:
            stats = grown
        bar.close()
        probes = stats.probe_layers
        elapsed = time.perf_counter() - start
        if rank == 0:
            stats.save(out)
            _log(run, stats, elapsed)
            print(f"calibrate: {stats.tokens} tokens at {len(probes)} probes in {elapsed:.1f} s "
                  f"({stats.tokens / elapsed:.0f} tok/s) -> {out}")


if __name__ == "__main__":
    run_stage("calibrate", main)
