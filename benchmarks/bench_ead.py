"""EAD on SmolLM2 (small model = its own first k layers): cost, quality and tokens/s at a few τ, and ablations of
the rolling window w and of d_min — side by side with the model alone in one process. A run that never leaves
the large model (``ead-always-large``) measures EAD's own loop against the general decode loop.

Quality is fidelity to the model alone (greedy): token agreement and exact match of the continuations of the same
prompts. Every configuration generates the same prompts (batch rows run one at a time, as EAD does), alternated
with the full-depth run (medians of the repetitions). Writes reports/bench/ead.json.

Usage: python benchmarks/bench_ead.py [--quick] [--model smollm2-135m] [--small-layers 10 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PROMPTS  # noqa: E402
from common import alternate, environment, write  # noqa: E402

from emad.decode import generate  # noqa: E402
from emad.engine.models import load_model  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.evaluation.evaluate import strategy_stats  # noqa: E402
from emad.exits.criteria import Full  # noqa: E402
from emad.methods import EAD, SelfPair, Switcher  # noqa: E402


def configs(small_layers: list[int], taus: list[float], windows: list[int], d_mins: list[int]) -> dict:
    """Name → (k, τ, w, d_min): a τ sweep at the defaults (w = 5, d_min = 10) for each k, then the w and d_min
    ablations at the first k and the middle τ."""
    out = {f"k{k}-tau{t}": (k, t, 5, 10) for k in small_layers for t in taus}
    k, tau = small_layers[0], taus[len(taus) // 2]
    out.update({f"k{k}-tau{tau}-w{w}": (k, tau, w, 10) for w in windows if w != 5})
    out.update({f"k{k}-tau{tau}-dmin{d}": (k, tau, 5, d) for d in d_mins if d != 10})
    return out


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(token agreement, exact-match rate) of continuations against the reference ones."""
    same = sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y))
    total = sum(max(len(x), len(y)) for x, y in zip(ours, reference))
    return same / total, sum(x == y for x, y in zip(ours, reference)) / len(reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model spec (embedded alias, folder or hub id)")
    parser.add_argument("--small-layers", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--taus", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--d-mins", type=int, nargs="+", default=[1, 10, 30])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: k=10, two τ, 2 prompts, 8 tokens, 1 rep")
    args = parser.parse_args()
    if args.quick:
        args.small_layers, args.taus, args.windows, args.d_mins = [10], [0.5, 1.0], [1], [1]
        args.prompts, args.new_tokens, args.reps = 2, 8, 1
    loaded = load_model(args.model, device="cpu", dtype="float32")
    stack, tok = LayerStack(loaded.model), loaded.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS[: args.prompts]]
    table = configs(args.small_layers, args.taus, args.windows, args.d_mins)
    last: dict = {}

    def run(name: str, method) -> None:
        # one prompt per call, as EAD runs rows; the full-depth reference does the same for a fair clock
        last[name] = [generate(stack, tok, [p], method, args.new_tokens, eos_token_ids=[]) for p in prompts]

    fns = {"full": lambda: run("full", Full()),
           # the large model alone through EAD's loop: separates the loop's own overhead from switching
           "ead-always-large": lambda: run("ead-always-large", EAD(SelfPair(1), Switcher(-1e9, start="large")))}
    for name, (k, tau, w, d) in table.items():
        fns[name] = lambda n=name, k=k, t=tau, w=w, d=d: run(n, EAD(SelfPair(k), Switcher(t, w, d)))
    times = alternate(fns, args.reps, stack.device)
    reference = [g.token_ids[0] for g in last["full"]]
    tokens = len(prompts) * args.new_tokens
    rows = []
    for name, seconds in times.items():
        gens = last[name]
        ids = [g.token_ids[0] for g in gens]
        flops = sum(sum(map(sum, g.flops)) for g in gens) / sum(sum(map(sum, g.full_flops)) for g in gens)
        agree, exact = agreement(ids, reference)
        row = {"config": name, "tokens_per_s": tokens / seconds, "speedup": times["full"] / seconds,
               "flops_ratio": flops, "token_agreement": agree, "exact_match": exact,
               "catchup_share": sum(sum(g.policy_flops) for g in gens) / sum(sum(map(sum, g.flops)) for g in gens)}
        if name in table:
            k, tau, w, d = table[name]
            row.update(small_layers=k, tau=tau, window=w, d_min=d, **strategy_stats(gens))
        rows.append(row)
    result = {"benchmark": "EAD (truncated self pair) vs the model alone", "model": loaded.fingerprint.as_dict(),
              "environment": environment(stack.device, stack.dtype), "prompts": PROMPTS[: args.prompts],
              "new_tokens": args.new_tokens, "reps": args.reps, "rows": rows}
    path = write("ead", result)
    for r in rows:
        share = f"  large {r['large_token_share']:.2f}  switches {r['switches']:.0f}" if "switches" in r else ""
        print(f"{r['config']:>18}: {r['tokens_per_s']:6.1f} tok/s  x{r['speedup']:.2f}  FLOPs {r['flops_ratio']:.3f}"
              f"  agree {r['token_agreement']:.3f}  exact {r['exact_match']:.2f}{share}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
