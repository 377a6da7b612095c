"""Batch exits at mixed depths: per-row vs sync, time against the FLOPs bound and the step bound.

A batch of prompts decodes under one exit criterion whose rows want different depths (a fixed entropy threshold),
once with per-row exits and once with ``batch_exit: sync``, alternated with full depth in one process. For each:
tokens/s, the time ratio to full depth, the FLOPs bound (cost ratio) and the step bound (per step, the costliest
row; :func:`emad.engine.cost.step_bound`), and the time ratio over each bound (1 = the bound is met). Writes
reports/bench/batch_sync[-<device>-<dtype>].json.

Usage: python benchmarks/bench_batch_sync.py [--model smollm2-135m] [--batch 8] [--new-tokens 32] [--reps 3]
    [--threshold 1.0] [--probe-every 3] [--policy monotone] [--device auto] [--dtype auto] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PROMPTS  # noqa: E402
from common import alternate, environment, write  # noqa: E402

from emad.decode import Generation, Method, generate  # noqa: E402
from emad.engine.models import load_model  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.criteria import Confidence, Full  # noqa: E402


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two generations chose the same token."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def summary(gen: Generation, seconds: float, full_seconds: float, full_ids: list[list[int]]) -> dict:
    """Speed, both bounds and depths of one configuration (``seconds``: its median time)."""
    tokens = [t for row in gen.traces for t in row[1:]]  # decode steps only (token 0 is the prompt's readout)
    time_ratio = seconds / full_seconds
    flops, step = gen.cost_ratio(), gen.step_ratio()
    return {
        "method": gen.method,
        "seconds": seconds,
        "tokens_per_s": sum(map(len, gen.token_ids)) / seconds,
        "time_ratio": time_ratio,
        "flops_ratio": flops,
        "step_ratio": step,
        "bytes_ratio": gen.cost_ratio(kind="bytes"),
        "step_bytes_ratio": gen.step_ratio("bytes"),
        "time_over_flops_bound": time_ratio / flops,
        "time_over_step_bound": time_ratio / step,
        "mean_depth": sum(t.depth for t in tokens) / len(tokens),
        "mean_allowed_depth": sum(t.allowed for t in tokens) / len(tokens),
        "carried_share": sum(t.reason == "carried" for t in tokens) / len(tokens),
        "depths_seen": sorted({t.depth for t in tokens}),
        "token_agreement_with_full": agreement(gen.token_ids, full_ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=1.0, help="entropy threshold h0 (nats) of the criterion")
    parser.add_argument("--probe-every", type=int, default=3)
    parser.add_argument("--policy", default="monotone")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's; 1 on a shared machine)")
    args = parser.parse_args()
    if args.batch < 2:
        parser.error(f"--batch must be >= 2 (the step bound is about batches), got {args.batch}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    stack, tok = LayerStack(loaded.model), loaded.tokenizer
    prompts = [tok(p)["input_ids"] for p in (PROMPTS * args.batch)[: args.batch]]
    criterion = Confidence(args.threshold, probe_every=args.probe_every)
    methods = {"full": Method(Full()), "per-row": Method(criterion, args.policy),
               "sync": Method(criterion, args.policy, batch_exit="sync")}
    gens: dict[str, Generation] = {}  # the latest output of each configuration

    def run(name: str) -> None:
        gens[name] = generate(stack, tok, prompts, methods[name], args.new_tokens, eos_token_ids=[])

    times = alternate({name: (lambda n=name: run(n)) for name in methods}, args.reps, stack.device)
    full_ids = gens["full"].token_ids
    result = {
        "benchmark": "batch exits at mixed depths: per-row vs sync against the FLOPs and step bounds",
        "model": loaded.fingerprint.as_dict(),
        "environment": environment(stack.device, stack.dtype),
        "batch": args.batch, "new_tokens": args.new_tokens, "reps": args.reps,
        "full": {"seconds": times["full"], "tokens_per_s": args.batch * args.new_tokens / times["full"]},
        **{name: summary(gens[name], times[name], times["full"], full_ids) for name in ("per-row", "sync")},
    }
    suffix = "" if stack.device.type == "cpu" else f"-{stack.device.type}-{result['environment']['dtype']}"
    path = write("batch_sync" + suffix, result)
    print(f"full depth: {result['full']['tokens_per_s']:.1f} tok/s")
    for name in ("per-row", "sync"):
        r = result[name]
        print(f"{name:>7}: {r['tokens_per_s']:.1f} tok/s, time ratio {r['time_ratio']:.3f}, FLOPs bound "
              f"{r['flops_ratio']:.3f} ({r['time_over_flops_bound']:.2f}x), step bound {r['step_ratio']:.3f} "
              f"({r['time_over_step_bound']:.2f}x), mean depth {r['mean_depth']:.1f} (allowed "
              f"{r['mean_allowed_depth']:.1f}), agreement with full {r['token_agreement_with_full']:.3f}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
