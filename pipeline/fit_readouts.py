"""Stage ``fit_readouts``: the ``tuned`` readout of one model, fitted on one corpus's calibration split.

Writes ``readouts.safetensors`` (translators, model fingerprint, layers) and ``metrics.json`` (per layer KL, top-1
agreement with the final layer and perplexity on held-out tokens, for ``logit`` and ``tuned``, and the same on the
selection tokens and the first training tokens; the training curve; each layer's best epoch, 0 for the identity,
and why and when it stopped, on patience or at the epoch cap; the token ranges of the three splits) into
``--out-dir``, and a figure. Runs as a plain process or data-parallel under
``torchrun --nproc_per_node N pipeline/fit_readouts.py ...``. For a model grown by idle layers (``<base>+idle<N>``,
the positive control), ``--grown-from`` the base model's fit on the same corpus: extended to the idle layers, which
is what a fit would give bit for bit (:func:`emad.calibration.readout_fit.grown_fit`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from emad import tracking
from emad.calibration.calibrate import resolve_probe_layers
from emad.calibration.config import ReadoutsConfig
from emad.calibration.readout_fit import FitResult, fit_texts, grown_fit, result_metrics
from emad.corpus import read_split
from emad.engine import distributed
from emad.engine.idle import check_grown
from emad.engine.models import load_model, prepared_spec
from emad.exits.readouts import TunedLens
from emad.io import atomic_write_json, read_json
from emad.params import load_section
from emad.stage import run_stage


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="model spec (prepared folder, alias or hub id)")
    parser.add_argument("--corpus", type=Path, required=True, help="sampled corpus folder (calib.jsonl)")
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for readouts.safetensors, metrics.json")
    parser.add_argument("--plot", type=Path, required=True, help="PNG of logit vs tuned per layer")
    parser.add_argument("--grown-from", type=Path, help="for a model grown by idle layers (<base>+idle<N>): the "
                        "folder of its base model's fit on the same corpus, extended instead of fitting anew")
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_args(argv)


def load_params(args: argparse.Namespace) -> ReadoutsConfig:
    """The params this stage reads, checked (the whole file first): section ``readouts``."""
    return load_section("readouts", ReadoutsConfig, args.params)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_params(args)
    texts, corpus_hash = read_split(args.corpus, "calib")
    base = _base_fit(args.grown_from, corpus_hash) if args.grown_from else None

    device, rank, world = distributed.join(cfg.device)
    params = {"readouts": cfg.model_dump(), "model": args.model_dir, "corpus": str(args.corpus), "world_size": world,
              "grown_from": args.grown_from and str(args.grown_from)}  # None (a fit) is not logged
    name = tracking.run_name("fit_readouts", tracking.label(args.model_dir), tracking.label(args.corpus))
    with tracking.stage_run("fit_readouts", params, {"corpus_manifest": corpus_hash}, run_name=name,
                            enabled=rank == 0) as run:
        loaded = load_model(args.model_dir, device=device, dtype=cfg.dtype)
        run.set_tags({"model_fingerprint": loaded.fingerprint.digest})
        bar = tqdm(unit="tok", desc=f"fit_readouts {args.corpus.name}", disable=rank != 0)

        def on_epoch(entry: dict) -> None:
            for layer, value in entry["train_kl"].items():
                run.log_metrics({f"train_kl.layer_{layer}": value, f"selection_kl.layer_{layer}":
                                 entry["selection_kl"][layer]}, step=entry["epoch"])
            bar.set_postfix(epoch=entry["epoch"], selection_kl=f"{sum(entry['selection_kl'].values()):.3f}")

        start = time.perf_counter()
        if base is None:
            result, facts = fit_texts(loaded, texts, cfg, checkpoint=args.out_dir / "readouts.ckpt",
                                      on_epoch=on_epoch, on_batch=bar.update,
                                      on_start=lambda n: bar.reset(total=n * cfg.epochs))
        else:
            result, facts = _grown(prepared_spec(args.model_dir), loaded, cfg, *base)
            for entry in result.history:
                on_epoch(entry)
        bar.close()
        elapsed = time.perf_counter() - start
        if rank == 0:
            result.lens.save(args.out_dir / "readouts.safetensors")
            metrics = {"model": loaded.fingerprint.as_dict(), "corpus": corpus_hash, **facts, "settings": cfg.model_dump(),
                       "seconds": elapsed, "tokens_per_s": facts["tokens"] * len(result.history) / elapsed,
                       **result_metrics(result)}
            if base is not None:  # the fit's own cost is the base fit's
                metrics |= {"grown_from": str(args.grown_from), "seconds": base[1]["seconds"],
                            "tokens_per_s": base[1]["tokens_per_s"]}
            atomic_write_json(args.out_dir / "metrics.json", metrics)
            from emad.report.plots import readouts_figure, save_figure  # matplotlib, where it draws

            save_figure(readouts_figure(result.held_out, title=str(args.out_dir)), args.plot)
            for readout, per_layer in result.held_out.items():
                for key in ("kl", "agreement", "perplexity"):
                    run.log_series(f"held_out.{readout}.{key}", {k: v[key] for k, v in per_layer.items()})
            run.log_metrics({"seconds": elapsed, "epochs_run": len(result.history), "tokens": facts["tokens"],
                             "layers_at_cap": sum(s["reason"] == "cap" for s in result.stopped.values()),
                             **{f"best_epoch.layer_{k}": v for k, v in result.best_epoch.items()},
                             **{f"stop_epoch.layer_{k}": s["epoch"] for k, s in result.stopped.items()}})
            run.log_dict(metrics["held_out"], "held_out.json")
            run.log_artifact(args.plot)
            deepest = max(facts["layers"])
            print(f"fit_readouts: {facts['tokens']} tokens, {len(result.history)} epochs in {elapsed:.0f} s "
                  f"({_stop_summary(result.stopped)}); layer "
                  f"{deepest}: agreement {result.held_out['logit'][deepest]['agreement']:.3f} (logit) -> "
                  f"{result.held_out['tuned'][deepest]['agreement']:.3f} (tuned) -> {args.out_dir}")
    distributed.leave()
    return 0


def _stop_summary(stopped: dict) -> str:
    """``"layers stopped: 7 on patience, 2 at the cap"``: how many layers stopped for each reason."""
    reasons = [s["reason"] for s in stopped.values()]
    words = {"patience": "on patience", "cap": "at the cap", "final state": "in the final state"}
    return "layers stopped: " + ", ".join(f"{reasons.count(r)} {words.get(r, r)}" for r in dict.fromkeys(reasons))


def _base_fit(folder: Path, corpus_hash: str) -> tuple[TunedLens, dict]:
    """The base model's fit in ``folder`` (readouts and metrics), checked to be on this corpus, before any work."""
    metrics_path = folder / "metrics.json"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"--grown-from {folder}: no metrics.json there; run fit_readouts for the base model "
                                f"first (its folder data/readouts/<base>/<source>)")
    metrics = read_json(metrics_path, "readouts metrics", ValueError)
    if metrics.get("corpus") != corpus_hash:
        raise ValueError(f"--grown-from {folder}: the base fit read another corpus (manifest {metrics.get('corpus')}, "
                         f"this one {corpus_hash}): give the base model's fit on the same --corpus")
    return TunedLens.load(folder / "readouts.safetensors"), metrics


def _grown(spec: str, loaded, cfg: ReadoutsConfig, base: TunedLens, metrics: dict) -> tuple[FitResult, dict]:
    """The grown model's fit from its base's (:func:`~emad.calibration.readout_fit.grown_fit`), after checking
    that this model is the base grown by idle layers and the base fit used these settings."""
    fingerprint = loaded.fingerprint.as_dict()
    check_grown(spec, fingerprint, metrics["model"])
    if metrics.get("settings", {}) | {"device": cfg.device} != cfg.model_dump():
        raise ValueError("--grown-from: the base fit used other readouts settings than params readouts: rerun it")
    n = fingerprint["n_layers"]
    layers = [p for p in resolve_probe_layers(cfg.layers, n) if p < n]
    result = grown_fit(base, metrics, fingerprint, layers, n, cfg.rank, cfg.seed)
    facts = ("tokens", "selection", "holdout", "train_reported", "ranges")
    return result, {key: metrics[key] for key in facts} | {"layers": layers}


if __name__ == "__main__":
    run_stage("fit_readouts", main)
