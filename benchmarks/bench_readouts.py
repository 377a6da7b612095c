"""Fitting the tuned readout: tokens/s and peak RSS, and held-out quality per layer, logit vs tuned, per source.

Each source runs ``fit_texts`` (the stage's function) in a fresh subprocess that reports its own peak RSS, on the
calibration split of the sampled corpus (``data/corpus/<source>``, from ``dvc repro sample_corpus``) with the
``readouts`` section of params.yaml (``--set key=value`` overrides it). Throughput is training tokens × epochs
over the seconds of the whole fit, the collection pass included. Writes reports/bench/readouts.json.

Usage: python benchmarks/bench_readouts.py [--model data/models/smollm2-135m] [--sources stdlib-prose stdlib-code]
       [--set epochs=4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIT_SCRIPT = """
import json, resource, sys, time
from emad.calibration.config import ReadoutsConfig
from emad.calibration.readout_fit import fit_texts
from emad.corpus import read_split
from emad.engine.models import load_model
spec, corpus, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
texts, _ = read_split(corpus, "calib")
loaded = load_model(spec, device="cpu", dtype="float32")
cfg = ReadoutsConfig(**options)
started = time.perf_counter()
result, facts = fit_texts(loaded, texts, cfg)
seconds = time.perf_counter() - started
print(json.dumps({**facts, "seconds": seconds, "epochs_run": len(result.history), "best_epoch": result.best_epoch,
                  "train_tokens_per_s": facts["tokens"] * len(result.history) / seconds,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "held_out": {r: {str(k): v for k, v in m.items()} for r, m in result.held_out.items()}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/smollm2-135m")
    parser.add_argument("--sources", nargs="+", default=["stdlib-prose", "stdlib-code"])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a readouts param")
    args = parser.parse_args()
    options = dict(yaml.safe_load(args.params.read_text()).get("readouts") or {})
    options.update({k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.set)})
    options.update(device="cpu", dtype="float32")
    result = {"benchmark": "fitting the tuned readout", "model": args.model, "readouts": options, "sources": {}}
    for source in args.sources:
        corpus = ROOT / "data" / "corpus" / source
        if not (corpus / "calib.jsonl").is_file():
            raise SystemExit(f"bench_readouts: {corpus}/calib.jsonl is missing: run `dvc repro sample_corpus` first")
        done = subprocess.run([sys.executable, "-c", FIT_SCRIPT, args.model, str(corpus), json.dumps(options)],
                              capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        result["sources"][source] = row
        held = row["held_out"]
        print(f"{source}: {row['tokens']} tokens x {row['epochs_run']} epochs in {row['seconds']:.0f} s "
              f"({row['train_tokens_per_s']:.0f} tok/s), peak RSS {row['peak_rss_mb']:.0f} MB")
        for layer in held["logit"]:
            lo, tu = held["logit"][layer], held["tuned"][layer]
            print(f"  layer {layer:>2}: agreement {lo['agreement']:.3f} -> {tu['agreement']:.3f}, "
                  f"perplexity {lo['perplexity']:.4g} -> {tu['perplexity']:.4g}")
    print(f"-> {write('readouts', result)}")


if __name__ == "__main__":
    main()
