"""Calibration throughput vs a plain HF script, and peak memory at two corpus sizes.

The plain script is what one writes without EMAD: ``model(ids, output_hidden_states=True)``, then at each probe
layer ``lm_head(norm(h))`` and ``torch.distributions.Categorical(logits=...).entropy()`` over the same tokens.
Both run alternated in one process. Peak memory: ``calibrate_texts`` in a fresh subprocess per corpus size,
reading its own peak RSS. Writes reports/bench/calibrate.json.

Usage: python benchmarks/bench_calibrate.py [--model data/models/smollm2-135m] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, environment, write  # noqa: E402

from emad.calibration.calibrate import accumulate_batch, resolve_probe_layers  # noqa: E402
from emad.calibration.stats import CalibrationStats  # noqa: E402
from emad.corpus import build_source  # noqa: E402
from emad.engine.models import load_model  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.strata import Strata  # noqa: E402

MEMORY_SCRIPT = """
import json, resource, sys
from emad.calibration.calibrate import calibrate_texts
from emad.calibration.config import CalibrateConfig
from emad.corpus import build_source
from emad.engine.models import load_model
spec, tokens = sys.argv[1], int(sys.argv[2])
texts = [d.text for d in build_source("stdlib-prose").documents()]
loaded = load_model(spec)
cfg = CalibrateConfig(window=256, batch_size=4, probe_layers=3, max_tokens=tokens)
stats = calibrate_texts(loaded, texts, cfg)
print(json.dumps({"tokens": stats.tokens, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


@torch.inference_mode()
def plain_hf(model, ids: torch.Tensor, probes: list[int]) -> None:
    out = model(ids, output_hidden_states=True)
    norm, head = model.model.norm, model.lm_head
    for p in probes:
        logits = out.logits if p == len(out.hidden_states) - 1 else head(norm(out.hidden_states[p]))
        torch.distributions.Categorical(logits=logits.float()).entropy()
        logits.argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/smollm2-135m")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--memory-sizes", type=int, nargs=2, default=[2048, 8192])
    args = parser.parse_args()
    loaded = load_model(args.model)
    stack = LayerStack(loaded.model)
    probes = resolve_probe_layers(3, stack.n_layers)
    text = "\n\n".join(d.text for d in build_source("stdlib-prose").documents())
    ids = loaded.tokenizer(text[:200_000])["input_ids"][: args.window * args.batch]
    batch = torch.tensor(ids).view(args.batch, args.window)
    stats = CalibrationStats(probes, Strata(), stack.vocab_size)
    t = alternate({"emad": lambda: accumulate_batch(stack, stats, batch.tolist()),
                   "plain_hf": lambda: plain_hf(loaded.model, batch, probes)}, args.reps, stack.device)
    n = batch.numel()
    memory = []
    for size in args.memory_sizes:
        done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, args.model, str(size)], capture_output=True,
                              text=True, check=True)
        memory.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = {
        "benchmark": "calibration throughput and memory",
        "model": loaded.fingerprint.as_dict(),
        "environment": environment(stack.device, stack.dtype),
        "probe_layers": probes,
        "tokens_per_batch": n,
        "emad_tokens_per_s": n / t["emad"],
        "plain_hf_tokens_per_s": n / t["plain_hf"],
        "throughput_ratio_emad_over_plain": t["plain_hf"] / t["emad"],
        "memory": memory,
    }
    path = write("calibrate", result)
    print(f"calibration: emad {n / t['emad']:.0f} tok/s, plain HF {n / t['plain_hf']:.0f} tok/s "
          f"(ratio {result['throughput_ratio_emad_over_plain']:.2f}); peak RSS "
          + ", ".join(f"{m['tokens']} tok: {m['peak_rss_mb']:.0f} MB" for m in memory) + f"; -> {path}")


if __name__ == "__main__":
    main()
