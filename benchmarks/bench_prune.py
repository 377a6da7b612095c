"""One probe with vocabulary pruning vs the exact readout, the top-K shortlist and the low-rank estimators, in time
and FLOPs, each relative to one decoder layer (a decode step of one token over 128 keys, SmolLM2 by default).

A pruned probe is the probe after the token's first one: its k head rows only. Writes reports/bench/prune.json.
With ``--readouts PATH`` (a fitted readouts file) every estimator is also measured through the tuned readout — the
translation T_ℓ before the head rows — and the result goes to reports/bench/probe_readouts.json.

Usage: python benchmarks/bench_prune.py [--model smollm2-135m] [--ks 64 256 1024 4096] [--reps 50] [--readouts PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_step_layer, environment, probe_seconds, write  # noqa: E402

from emad.engine.cost import CostModel  # noqa: E402
from emad.engine.models import load_model  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.estimators import Exact, LowRank, Prune, TopK  # noqa: E402
from emad.exits.readouts import TunedLens  # noqa: E402

LAYER = 15  # the layer timed, and the probe layer (1-based)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model spec (embedded alias, folder or hub id)")
    parser.add_argument("--ks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--readouts", type=Path, help="readouts.safetensors: also measure through the tuned readout")
    args = parser.parse_args()
    loaded = load_model(args.model, device="cpu", dtype="float32")
    stack = LayerStack(loaded.model)
    cost = CostModel.from_stack(stack)

    layer_s, probe_h = decode_step_layer(stack, LAYER, args.reps)  # probe_h [1, d]: a real hidden state
    layer_flops = cost.layer_flops(LAYER - 1, 129)

    def measure(name: str, est, reader: LayerStack, first_layer: int | None = None) -> dict:
        if first_layer is not None:  # the pruned probe: after the token's first (full) probe
            est.begin(1)
            est.estimate(reader, probe_h, first_layer)
        seconds, result = probe_seconds(est, reader, probe_h, LAYER, args.reps)
        flops = float(result.cost[0][0]) if result.cost is not None else est.probe_cost(cost)[0]
        flops += CostModel.from_stack(reader).translation(LAYER)[0]  # step charges the translation beside it
        return {"estimator": name, "readout": reader.readout_name, "probe_s": seconds,
                "probe_over_layer_time": seconds / layer_s, "probe_flops": flops,
                "probe_over_layer_flops": flops / layer_flops}

    readers = [stack] if args.readouts is None else [stack, stack.with_readout(TunedLens.load(args.readouts))]
    rows = []
    for reader in readers:
        rows += [measure("exact", Exact(), reader), measure("topk(1024)", TopK(1024), reader),
                 measure("lowrank(64)", LowRank(64), reader)]
        rows += [measure(f"prune(k={k})", Prune(k), reader, first_layer=LAYER - 3)
                 for k in args.ks if k <= stack.vocab_size]
    result = {"benchmark": "probe cost: vocabulary pruning vs exact, top-K and low-rank"
                           + ("" if args.readouts is None else ", through the logit and the tuned readout"),
              "model": loaded.fingerprint.as_dict(), "environment": environment(stack.device, stack.dtype),
              "layer_s": layer_s, "layer_flops": layer_flops, "rows": rows}
    path = write("prune" if args.readouts is None else "probe_readouts", result)
    print(f"one layer: {layer_s * 1e3:.3f} ms, {layer_flops / 1e6:.1f} MFLOPs")
    for r in rows:
        print(f"{r['estimator']:>14} ({r['readout']}): {r['probe_s'] * 1e3:7.3f} ms = {r['probe_over_layer_time']:5.2f} layers "
              f"(FLOPs {r['probe_over_layer_flops']:5.2f} layers)")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
