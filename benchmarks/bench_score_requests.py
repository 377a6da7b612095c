"""Token-by-token scoring of many requests: one request at a time vs all of them as the rows of one batch.

A policy that lets depth rise (K/V copy, backfill) cannot be scored from a shared full-depth pass; its points score
each continuation token by token. The agreement task gives each of its prompts one continuation, so scoring its
requests one at a time runs single-row steps whose readouts are memory-bound; ``score_requests`` decodes them as one
batch. Both sides score the same requests of SmolLM2 (prompts cut from stdlib-prose, full-depth continuations, as the
agreement task does) under the default point's EMAD criterion with each policy, give the same depths and FLOPs
(checked) and run alternately in one process; medians compared. Writes reports/bench/score_requests.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, environment, prose_windows, write  # noqa: E402

from emad.decode import Method, generate, score_continuations, score_requests  # noqa: E402
from emad.exits.criteria import Confidence, Full  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from emad.engine.models import load_model
    from emad.engine.stack import LayerStack

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=2.0, help="entropy threshold (nats) of the criterion")
    parser.add_argument("--policies", nargs="+", default=["copy", "backfill"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    loaded = load_model(args.model, device=args.device, dtype="float32")
    stack = LayerStack(loaded.model)
    windows = prose_windows(loaded.tokenizer, 64 * args.prompts, args.prompt_tokens + 64, args.prompt_tokens)
    prompts = [p for p, _ in windows][: args.prompts]
    full = generate(stack, loaded.tokenizer, prompts, Full(), args.new_tokens, eos_token_ids=[])
    requests = [(p, [ids]) for p, ids in zip(prompts, full.token_ids)]
    results = []
    for policy in args.policies:
        method = Method(Confidence(args.threshold), policy)
        alone = [score_continuations(stack, p, c, method) for p, c in requests]
        together = score_requests(stack, requests, method)
        for a, b in zip(alone, together):
            assert a[0].depths == b[0].depths and a[0].flops == b[0].flops, "batched scoring differs"
        t = alternate({"one_at_a_time": lambda m=method: [score_continuations(stack, p, c, m) for p, c in requests],
                       "batched": lambda m=method: score_requests(stack, requests, m)}, args.reps, stack.device)
        results.append({"policy": policy, "one_at_a_time_s": t["one_at_a_time"], "batched_s": t["batched"],
                        "speedup": t["one_at_a_time"] / t["batched"]})
        print(f"{policy}: one request at a time {t['one_at_a_time']:.2f} s, one batch {t['batched']:.2f} s "
              f"({t['one_at_a_time'] / t['batched']:.2f}x)")
    write("score_requests", {"model": args.model, "requests": len(requests), "prompt_tokens": args.prompt_tokens,
                             "new_tokens": args.new_tokens, "threshold": args.threshold, "reps": args.reps,
                             "environment": environment(stack.device, stack.dtype), "results": results})
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
