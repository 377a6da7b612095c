"""A continuation's readouts at every kept layer: one head product per layer vs one for all layers.

A sweep reads a continuation's states out at each kept layer (``[m, d]`` → ``[m, V]``). For a short continuation
the product is bound by reading the head's weights (V × d floats), so one product per layer reads them once per
layer; ``LayerStack.readouts`` stacks the layers' rows and reads them once. Both sides read out the same full-depth
states of SmolLM2 (a stdlib-prose window, its first ``m`` positions, at 15 kept layers like the default
run: every 3rd layer and the fixed depths 15..29) and run alternately in one process; medians compared, and the
logits compared (bit for bit where every layer has at least 8 rows). Writes reports/bench/sweep_readouts.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, environment, prose_windows, write  # noqa: E402


def states(stack, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """The full-depth states ``[m, d]`` of ``ids`` after each of ``layers``."""
    x = torch.tensor([ids], device=stack.device)
    positions = torch.arange(len(ids), device=stack.device)[None]
    cache = stack.new_cache(1, len(ids))
    slots = cache.allocate(torch.ones_like(x, dtype=torch.bool))
    h, done, out = stack.embed(x, positions), 0, {}
    for layer in layers:
        h = stack.run(h, done, layer, cache, positions, slots)
        out[layer], done = h[0], layer
    return out


def main(argv: list[str] | None = None) -> int:
    from emad.engine.models import load_model
    from emad.engine.stack import LayerStack

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[3, 8, 15, 63],
                        help="continuation lengths m (choice options, cloze, agreement, perplexity windows)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    loaded = load_model(args.model, device=args.device, dtype="float32")
    stack = LayerStack(loaded.model)
    n = stack.n_layers
    layers = sorted({*range(3, n + 1, 3), *range(n // 2, n, 2)})
    prompt, (continuation, *_) = prose_windows(loaded.tokenizer, 64, max(args.lengths) + 1, 1)[0]
    window = [*prompt, *continuation]
    results = []
    for m in args.lengths:
        kept = states(stack, window[:m], layers)
        per_layer = {layer: stack.readout(h, layer) for layer, h in kept.items()}
        together = stack.readouts(kept)
        equal = all(torch.equal(per_layer[layer], together[layer]) for layer in layers)
        diff = max(float((per_layer[layer] - together[layer]).abs().max()) for layer in layers)
        t = alternate({"per_layer": lambda k=kept: [stack.readout(h, layer) for layer, h in k.items()],
                       "one_product": lambda k=kept: stack.readouts(k)}, args.reps, stack.device)
        results.append({"rows": m, "layers": len(layers), "per_layer_s": t["per_layer"],
                        "one_product_s": t["one_product"], "speedup": t["per_layer"] / t["one_product"],
                        "bitwise_equal": equal, "max_abs_diff": diff})
        print(f"m = {m}: {len(layers)} layers one by one {t['per_layer'] * 1000:.1f} ms, in one product "
              f"{t['one_product'] * 1000:.1f} ms ({t['per_layer'] / t['one_product']:.2f}x); bit for bit: {equal} "
              f"(max |diff| {diff:.2g})")
    write("sweep_readouts", {"model": args.model, "layers": layers, "reps": args.reps,
                             "environment": environment(stack.device, stack.dtype), "results": results})
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
