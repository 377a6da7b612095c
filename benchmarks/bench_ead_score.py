"""EAD (self pair) teacher-forced scoring: one full-depth pass replayed vs the token-by-token loop, on perplexity
windows of SmolLM2.

Both sides score the same windows (prompt + continuation, as the perplexity task does) for each τ and give the
same records (depths, costs and switches identical, log-probabilities within 1e-4: checked); they run alternately
in one process and the medians are compared. Writes reports/bench/ead_score.json: per τ, the seconds of each side,
their ratio, and the share of tokens the large model produced.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, environment, load_prose, prose_parser, write  # noqa: E402

from emad.methods.ead import EAD  # noqa: E402


def records(stack, strategy, requests, stepwise: bool):
    return [strategy.teacher_forced(stack, p, c, stepwise=stepwise) for p, cs in requests for c in cs]


def main(argv: list[str] | None = None) -> int:
    parser = prose_parser(__doc__.splitlines()[0], tokens=192)
    parser.add_argument("--small-layers", type=int, default=21)
    parser.add_argument("--taus", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    args = parser.parse_args(argv)
    loaded, stack, requests, scored_tokens = load_prose(args)
    results = []
    for tau in args.taus:
        strategy = EAD.from_options(tau=tau, small_layers=args.small_layers)
        strategy.bind(stack, loaded.tokenizer)
        fast, slow = records(stack, strategy, requests, False), records(stack, strategy, requests, True)
        for a, b in zip(fast, slow):
            assert a.depths == b.depths and a.flops == b.flops and a.stats == b.stats, "one pass differs"
            assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) < 1e-4
        t = alternate({"token_by_token": lambda s=strategy: records(stack, s, requests, True),
                       "one_pass": lambda s=strategy: records(stack, s, requests, False)}, args.reps, stack.device)
        large = sum(r.stats["large_tokens"] for r in fast) / scored_tokens
        results.append({"tau": tau, "token_by_token_s": t["token_by_token"], "one_pass_s": t["one_pass"],
                        "one_pass_over_token_by_token": t["one_pass"] / t["token_by_token"],
                        "large_token_share": large,
                        "switches": sum(r.stats["switches"] for r in fast)})
        print(f"tau={tau}: token by token {t['token_by_token']:.2f} s, one pass {t['one_pass']:.2f} s "
              f"(ratio {t['one_pass'] / t['token_by_token']:.3f}; large-model share {large:.2f})")
    write("ead_score", {"model": args.model, "scored_tokens": scored_tokens, "windows": len(requests),
                        "window": args.window, "prefix": args.prefix, "small_layers": args.small_layers,
                        "reps": args.reps, "environment": environment(stack.device, stack.dtype),
                        "results": results})
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
