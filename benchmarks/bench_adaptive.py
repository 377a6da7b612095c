"""Adaptive-depth decoding on SmolLM2: realised speed-ups vs the cost model, probe costs, EMAD operating points.

1. fixed(d), d ∈ {L/4, L/2, 3L/4}: time speed-up over full depth vs the FLOPs bound (target ≥ 0.9× the bound);
2. one probe per estimator vs one layer at a decode step (target ≤ 0.25× for topk / lowrank);
3. batch 8 at mixed depths (confidence criterion, per-row exits) vs the bound full-time × cost ratio (≤ 1.1×);
4. EMAD at a few margins: tokens/s, FLOPs ratio, token agreement with full depth.
All runs alternate in one process; medians. Writes reports/bench/adaptive.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PROMPTS  # noqa: E402
from common import alternate, decode_step_layer, environment, probe_seconds, write  # noqa: E402

from emad.calibration import estimator_fit  # noqa: E402
from emad.calibration.profile import Profile  # noqa: E402
from emad.decode import Method, generate  # noqa: E402
from emad.engine.models import load_model  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.criteria import Confidence, Emad, Fixed, Full  # noqa: E402


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def run(stack, tok, prompts, method, new):
    return generate(stack, tok, prompts, method, new, eos_token_ids=[])


def fixed_speedups(stack, tok, prompts, new, reps) -> list[dict]:
    out = []
    L = stack.n_layers
    for d in (L // 4, L // 2, 3 * L // 4):
        t = alternate({"full": lambda: run(stack, tok, prompts, Full(), new),
                       "fixed": lambda d=d: run(stack, tok, prompts, Fixed(d), new)}, reps, stack.device)
        bound = 1 / run(stack, tok, prompts, Fixed(d), new).cost_ratio()
        realised = t["full"] / t["fixed"]
        out.append({"depth": d, "realised_speedup": realised, "flops_bound": bound,
                    "realised_over_bound": realised / bound})
    return out


@torch.inference_mode()
def probe_times(stack, estimators: dict, reps: int = 50) -> dict:
    layer, h = decode_step_layer(stack, 15, reps)
    result = {"layer_s": layer}
    for name, est in estimators.items():
        t, _ = probe_seconds(est, stack, h, 15, reps)
        result[name] = {"probe_s": t, "probe_over_layer": t / layer}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/smollm2-135m")
    parser.add_argument("--profile", default="data/profiles/smollm2-135m/stdlib-prose/logit/profile.json")
    parser.add_argument("--estimators", default="data/estimators/smollm2-135m/logit.json",
                        help="fitted estimators of the profile's readout (stage fit_estimators)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--margins", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    args = parser.parse_args()
    loaded = load_model(args.model)
    stack, tok = LayerStack(loaded.model), loaded.tokenizer
    profile = Profile.load(args.profile)
    profile.check_model(loaded.fingerprint.as_dict())
    fitted = Path(args.estimators)
    estimators = {"exact": estimator_fit.load(fitted, "exact")}
    for name in ("topk", "lowrank"):
        estimators[name] = estimator_fit.load(fitted, name, loaded.fingerprint.as_dict(), profile.probe_layers)
    one = [tok(PROMPTS[0])["input_ids"]]
    eight = [tok(p)["input_ids"] for p in PROMPTS]
    new = args.new_tokens

    result = {"benchmark": "adaptive-depth decoding", "model": loaded.fingerprint.as_dict(),
              "environment": environment(stack.device, stack.dtype), "new_tokens": new}
    result["fixed_speedup_batch1"] = fixed_speedups(stack, tok, one, new, args.reps)
    result["probe_vs_layer"] = probe_times(stack, estimators)

    mixed = Method(Confidence(1.0, probe_every=3), "monotone")
    t = alternate({"full": lambda: run(stack, tok, eight, Full(), new),
                   "mixed": lambda: run(stack, tok, eight, mixed, new)}, args.reps, stack.device)
    gen = run(stack, tok, eight, mixed, new)
    bound = t["full"] * gen.cost_ratio()
    result["batch8_mixed_depths"] = {"method": gen.method, "depths_seen": sorted({d for r in gen.depths for d in r}),
                                     "flops_ratio": gen.cost_ratio(), "time_s": t["mixed"], "full_time_s": t["full"],
                                     "time_over_bound": t["mixed"] / bound}

    full_ids = run(stack, tok, eight, Full(), new).token_ids
    points = []
    for estimator in ("exact", "topk", "lowrank"):
        for margin in args.margins:
            method = Method(Emad(profile, margin), "monotone", estimators[estimator])
            times = alternate({"emad": lambda m=method: run(stack, tok, eight, m, new)}, args.reps, stack.device)
            gen = run(stack, tok, eight, method, new)
            points.append({"estimator": estimator, "margin": margin, "tokens_per_s": 8 * new / times["emad"],
                           "flops_ratio": gen.cost_ratio(), "bytes_ratio": gen.cost_ratio(kind="bytes"),
                           "mean_depth": sum(map(sum, gen.depths)) / sum(map(len, gen.depths)),
                           "token_agreement_with_full": agreement(gen.token_ids, full_ids)})
    result["emad_batch8"] = points
    result["full_batch8_tokens_per_s"] = 8 * new / t["full"]
    path = write("adaptive", result)
    for f in result["fixed_speedup_batch1"]:
        print(f"fixed({f['depth']}): speed-up {f['realised_speedup']:.2f}x vs bound {f['flops_bound']:.2f}x "
              f"({f['realised_over_bound']:.2f} of the bound)")
    pv = result["probe_vs_layer"]
    print("probe / layer: " + ", ".join(f"{k} {v['probe_over_layer']:.2f}" for k, v in pv.items() if k != "layer_s"))
    b8 = result["batch8_mixed_depths"]
    print(f"batch 8 mixed depths {b8['depths_seen']}: time / bound {b8['time_over_bound']:.2f}")
    for p in points:
        print(f"emad {p['estimator']:>7} margin {p['margin']:.2f}: {p['tokens_per_s']:.1f} tok/s, FLOPs ratio "
              f"{p['flops_ratio']:.3f}, mean depth {p['mean_depth']:.1f}, agreement {p['token_agreement_with_full']:.3f}")
    print(f"full depth batch 8: {result['full_batch8_tokens_per_s']:.1f} tok/s -> {path}")


if __name__ == "__main__":
    main()
