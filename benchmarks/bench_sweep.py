"""A sweep of N methods scored in one pass vs N single-method scorings, on perplexity windows of SmolLM2.

The methods are EMAD-style entropy criteria: confidence thresholds (logit readout) at N values spread over the
range where exits go from almost never to almost always. Both sides score the same windows (prompt + continuation,
as the perplexity task does) and give identical results (checked); they run alternately in one process, and the
medians are compared. Writes reports/bench/sweep.json: per N, the seconds of each side and their ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, environment, load_prose, prose_parser, write  # noqa: E402

from emad.decode import Method, Sweep, score_continuations  # noqa: E402
from emad.exits.criteria import Confidence  # noqa: E402


def methods(n: int) -> list[Method]:
    """``n`` confidence thresholds, log-spaced over 0.01..4 nats."""
    return [Method(Confidence(float(t))) for t in np.geomspace(0.01, 4.0, n)]


def singles(stack, requests, ms):
    return [[score_continuations(stack, p, c, m) for p, c in requests] for m in ms]


def swept(stack, requests, ms):
    sweep = Sweep(stack, ms)
    rows = [sweep.score(p, c) for p, c in requests]  # [request][method][continuation]
    return [[row[j] for row in rows] for j in range(len(ms))]


def main(argv: list[str] | None = None) -> int:
    parser = prose_parser(__doc__.splitlines()[0], tokens=512)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args(argv)
    _, stack, requests, scored_tokens = load_prose(args)
    results = []
    for n in args.sizes:
        ms = methods(n)
        a, b = singles(stack, requests, ms), swept(stack, requests, ms)
        for ra, rb in zip(a, b):
            for x, y in zip(ra, rb):
                assert x[0].depths == y[0].depths and x[0].flops == y[0].flops, "sweep differs from single scoring"
                assert max(abs(p - q) for p, q in zip(x[0].logprobs, y[0].logprobs)) < 1e-4
        t = alternate({"singles": lambda ms=ms: singles(stack, requests, ms),
                       "sweep": lambda ms=ms: swept(stack, requests, ms)}, args.reps, stack.device, warmup=0)
        results.append({"methods": n, "singles_s": t["singles"], "sweep_s": t["sweep"],
                        "sweep_over_singles": t["sweep"] / t["singles"],
                        "singles_per_method_s": t["singles"] / n, "sweep_per_method_s": t["sweep"] / n})
        print(f"N={n}: {n} single scorings {t['singles']:.2f} s, one sweep {t['sweep']:.2f} s "
              f"(ratio {t['sweep'] / t['singles']:.3f})")
    write("sweep", {"model": args.model, "scored_tokens": scored_tokens, "windows": len(requests),
                    "window": args.window, "prefix": args.prefix, "reps": args.reps,
                    "environment": environment(stack.device, stack.dtype), "results": results})
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
