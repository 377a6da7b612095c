"""Stage ``fit_readouts``: the ``tuned`` readout of one model, fitted on one corpus's calibration split.

Writes ``readouts.safetensors`` (translators, model fingerprint, layers) and ``metrics.json`` (per layer KL, top-1
agreement with the final layer and perplexity on held-out tokens, for ``logit`` and ``tuned``; the training
curve; each layer's best epoch, 0 for the identity) into ``--out-dir``, and a figure. Runs as a plain process or
data-parallel under ``torchrun --nproc_per_node N pipeline/fit_readouts.py ...``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from emad import tracking
from emad.calibration.config import ReadoutsConfig
from emad.calibration.readout_fit import fit_texts
from emad.corpus import read_split
from emad.engine import distributed
from emad.engine.models import load_model
from emad.io import atomic_write_json
from emad.params import load_section
from emad.report.plots import readouts_figure, save_figure
from emad.stage import run_stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="model spec (prepared folder, alias or hub id)")
    parser.add_argument("--corpus", type=Path, required=True, help="sampled corpus folder (calib.jsonl)")
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for readouts.safetensors, metrics.json")
    parser.add_argument("--plot", type=Path, required=True, help="PNG of logit vs tuned per layer")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    cfg = load_section("readouts", ReadoutsConfig, args.params)
    texts, corpus_hash = read_split(args.corpus, "calib")

    device, rank, world = distributed.join(cfg.device)
    params = {"readouts": cfg.model_dump(), "model": args.model_dir, "corpus": str(args.corpus), "world_size": world}
    name = tracking.run_name("fit_readouts", tracking.label(args.model_dir), tracking.label(args.corpus))
    with tracking.stage_run("fit_readouts", params, {"corpus_manifest": corpus_hash}, run_name=name,
                            enabled=rank == 0) as run:
        loaded = load_model(args.model_dir, device=device, dtype=cfg.dtype)
        run.set_tags({"model_fingerprint": loaded.fingerprint.digest})
        bar = tqdm(unit="tok", desc=f"fit_readouts {args.corpus.name}", disable=rank != 0)

        def on_epoch(entry: dict) -> None:
            for layer, value in entry["train_kl"].items():
                run.log_metrics({f"train_kl.layer_{layer}": value, f"held_out_kl.layer_{layer}":
                                 entry["held_out_kl"][layer]}, step=entry["epoch"])
            bar.set_postfix(epoch=entry["epoch"], held_out_kl=f"{sum(entry['held_out_kl'].values()):.3f}")

        start = time.perf_counter()
        result, facts = fit_texts(loaded, texts, cfg, checkpoint=args.out_dir / "readouts.ckpt", on_epoch=on_epoch,
                                  on_batch=bar.update, on_start=lambda n: bar.reset(total=n * cfg.epochs))
        bar.close()
        elapsed = time.perf_counter() - start
        if rank == 0:
            result.lens.save(args.out_dir / "readouts.safetensors")
            metrics = {"model": loaded.fingerprint.as_dict(), "corpus": corpus_hash, **facts,
                       "seconds": elapsed, "tokens_per_s": facts["tokens"] * len(result.history) / elapsed,
                       "best_epoch": {str(k): v for k, v in result.best_epoch.items()}, "history": result.history,
                       "held_out": {r: {str(k): v for k, v in m.items()} for r, m in result.held_out.items()}}
            atomic_write_json(args.out_dir / "metrics.json", metrics)
            save_figure(readouts_figure(result.held_out, title=str(args.out_dir)), args.plot)
            for readout, per_layer in result.held_out.items():
                for key in ("kl", "agreement", "perplexity"):
                    run.log_series(f"held_out.{readout}.{key}", {k: v[key] for k, v in per_layer.items()})
            run.log_metrics({"seconds": elapsed, "epochs_run": len(result.history), "tokens": facts["tokens"],
                             **{f"best_epoch.layer_{k}": v for k, v in result.best_epoch.items()}})
            run.log_dict(metrics["held_out"], "held_out.json")
            run.log_artifact(args.plot)
            deepest = max(facts["layers"])
            print(f"fit_readouts: {facts['tokens']} tokens, {len(result.history)} epochs in {elapsed:.0f} s; layer "
                  f"{deepest}: agreement {result.held_out['logit'][deepest]['agreement']:.3f} (logit) -> "
                  f"{result.held_out['tuned'][deepest]['agreement']:.3f} (tuned) -> {args.out_dir}")
    distributed.leave()
    return 0


if __name__ == "__main__":
    run_stage("fit_readouts", main)
