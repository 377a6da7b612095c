"""Self-draft speculative decoding on SmolLM2 vs the target alone: tokens/s side by side.

For each temperature (0 = greedy), the target alone (full-depth ``generate``) and self-draft speculative decoding at
a few exit layers E, each with three draft-length policies (static N, AdaEDL, confidence stop), run in turn in one
process (alternated A/B, medians of the repetitions). Reports tokens/s, the speed-up over the target alone,
acceptance statistics and the FLOPs / bytes cost ratios. Writes reports/bench/speculative.json.

With ``--readouts PATH`` (a fitted readouts file) every self-draft configuration also runs with a tuned drafter —
drafts read out through T_E (Kangaroo style) — and transformers' own self-speculation
(``generate(..., assistant_early_exit=E)``) runs on the same prompt beside them; the result goes to
reports/bench/speculative_readouts-prompt<N>.json (``--prompt N`` picks the prompt: 0 prose, 1 code, ...).

Usage: python benchmarks/bench_speculative.py [--quick] [--model smollm2-135m] [--exit-layers 8 12 18]
       [--readouts PATH --policies adaedl --prompt 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PROMPTS  # noqa: E402
from common import alternate, environment, write  # noqa: E402

from emad.decode import Sampling, generate  # noqa: E402
from emad.engine.models import load_model  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.criteria import Full  # noqa: E402
from emad.exits.readouts import TunedLens  # noqa: E402
from emad.methods import AdaEDL, ConfidenceStop, SelfDrafter, Static, speculative_generate  # noqa: E402


def policies(n: int) -> dict:
    """The draft-length policies compared (fresh objects per run: they carry state within a generation)."""
    return {"static": lambda: Static(n), "adaedl": lambda: AdaEDL(n=2 * n),
            "confidence": lambda: ConfidenceStop(n=2 * n)}


def sampling_for(temperature: float) -> Sampling:
    return Sampling() if temperature == 0 else Sampling(do_sample=True, temperature=temperature, seed=0)


def hf_self_speculation(model, prompt: list[int], exit_layer: int, new: int, temperature: float):
    """transformers' own early-exit self-speculation on the same prompt; returns its new token ids."""
    ids = torch.tensor([prompt])
    sample = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_early_exit=exit_layer,
                         max_new_tokens=new, min_new_tokens=new, pad_token_id=0, **sample)
    return out[0, len(prompt):].tolist()


def candidates(stack, tok, prompt, exit_layers: list[int], n: int, new: int, temperature: float,
               last: dict, tuned=None, names: list[str] | None = None) -> dict:
    """Name → zero-argument callable; each stores its latest result in ``last``. ``tuned``: the stack read
    through the tuned readout (adds ``E<e>-<policy>-tuned`` and transformers' ``hf-E<e>``)."""
    sampling = sampling_for(temperature)

    def keep(name, fn):
        def call():
            last[name] = fn()
        return call

    fns = {"target": keep("target", lambda: generate(stack, tok, [prompt], Full(), new, sampling,
                                                     eos_token_ids=[]))}
    readers = {"": stack} if tuned is None else {"": stack, "-tuned": tuned}
    for exit_layer in exit_layers:
        for pname, make in policies(n).items():
            if names is not None and pname not in names:
                continue
            for suffix, reader in readers.items():
                name = f"E{exit_layer}-{pname}{suffix}"
                fns[name] = keep(name, lambda e=exit_layer, m=make, r=reader: speculative_generate(
                    r, tok, prompt, SelfDrafter(e), new, m(), sampling, eos_token_ids=[]))
        if tuned is not None:
            fns[f"hf-E{exit_layer}"] = keep(f"hf-E{exit_layer}", lambda e=exit_layer: hf_self_speculation(
                stack.model, prompt, e, new, temperature))
    return fns


def rows(times: dict, last: dict, new: int, temperature: float) -> list[dict]:
    target_s = times["target"]
    out = [{"config": "target", "tokens_per_s": new / target_s, "seconds": target_s, "speedup": 1.0}]
    for name, seconds in times.items():
        if name == "target":
            continue
        res = last[name]
        if name.startswith("hf-"):  # transformers' self-speculation: tokens and time only
            out.append({"config": name, "tokens_per_s": new / seconds, "seconds": seconds,
                        "speedup": target_s / seconds})
            if temperature == 0:
                out[-1]["identical_to_target"] = res == last["target"].token_ids[0]
            continue
        stats = {k: v for k, v in res.summary().items() if k not in ("seconds", "tokens_per_s", "method")}
        out.append({"config": name, "tokens_per_s": new / seconds, "seconds": seconds,
                    "speedup": target_s / seconds,
                    "mean_draft_length": res.drafted / max(res.verifications, 1),
                    **stats})
        if temperature == 0:  # greedy must reproduce the target token for token
            out[-1]["identical_to_target"] = res.token_ids == last["target"].token_ids[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model spec (embedded alias, folder or hub id)")
    parser.add_argument("--exit-layers", type=int, nargs="+", default=[8, 12, 18])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0, 1.3])
    parser.add_argument("--n", type=int, default=4, help="static draft length N (adaptive policies cap at 2N)")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--readouts", type=Path, help="readouts.safetensors: add tuned drafters and transformers' "
                        "assistant_early_exit")
    parser.add_argument("--prompt", type=int, default=0, help="index into the benchmark prompts (0 prose, 1 code)")
    parser.add_argument("--policies", nargs="+", choices=sorted(policies(1)), help="draft-length policies (all)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: E=12, temperatures 0 and 1, 8 tokens, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.exit_layers, args.temperatures, args.new_tokens, args.reps = [12], [0.0, 1.0], 8, 1
    loaded = load_model(args.model, device="cpu", dtype="float32")
    stack, tok = LayerStack(loaded.model), loaded.tokenizer
    tuned = None if args.readouts is None else stack.with_readout(TunedLens.load(args.readouts))
    prompt = tok(PROMPTS[args.prompt])["input_ids"]
    for fn in candidates(stack, tok, prompt, args.exit_layers, args.n, 4, 0.0, {}, tuned,
                         args.policies).values():  # warm-up
        fn()

    result = {"benchmark": "self-draft speculative decoding vs the target alone",
              "model": loaded.fingerprint.as_dict(),
              "environment": environment(stack.device, stack.dtype), "prompt": PROMPTS[args.prompt],
              "new_tokens": args.new_tokens, "reps": args.reps, "n": args.n, "temperatures": {}}
    for temperature in args.temperatures:
        last: dict = {}
        fns = candidates(stack, tok, prompt, args.exit_layers, args.n, args.new_tokens, temperature, last, tuned,
                         args.policies)
        times = alternate(fns, args.reps, stack.device, warmup=0)
        result["temperatures"][str(temperature)] = rows(times, last, args.new_tokens, temperature)
    path = write("speculative" if tuned is None else f"speculative_readouts-prompt{args.prompt}", result)
    for temperature, table in result["temperatures"].items():
        print(f"temperature {temperature}:")
        for r in table:
            extra = "" if r["config"] == "target" or r["config"].startswith("hf-") else (
                f"  accept {r['acceptance_rate']:.2f}  draft {r['mean_draft_length']:.1f}  "
                f"passes/token {r['target_passes_per_token']:.2f}  FLOPs {r['flops_ratio']:.2f}")
            print(f"  {r['config']:>16}: {r['tokens_per_s']:6.1f} tok/s  x{r['speedup']:.2f}{extra}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
