"""Per-token decode time of HF ``generate`` (dynamic and static cache) and of our engines (eager, compiled) at full
depth, fixed depth 0.5L and 0.8L, EMAD probing without exiting and EMAD exiting; compile time; greedy agreement
with HF. For a GPU (bf16) and, shorter, for a CPU.

Per-token time is differenced: (time of ``--long`` new tokens − time of ``--short``) / (long − short), so the prompt
pass drops out; EOS is off; each decoder's generations alternate with every other's in rounds, medians over
``--reps`` rounds. Models: the embedded SmolLM2-135M and a random-weight model of SmolLM2-1.7B's shape (built from a
config, nothing downloaded). Writes reports/bench/gpu_decode-<device>-<dtype>.json.

Defaults by device: on CUDA both models, batches 1 and 8, 144 − 16 new tokens (``make bench-gpu``); on a CPU,
shorter: SmolLM2-135M only, batches 1 and 4, 40 − 8 new tokens.

Usage: python benchmarks/bench_gpu_decode.py [--models smollm2-135m,random-1.7b] [--batches 1,8] [--short 16]
       [--long 144] [--reps 3] [--engines eager,compiled] [--device auto] [--dtype auto] [--out NAME]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PROMPTS  # noqa: E402
from common import environment, sync, write  # noqa: E402

from emad.calibration.calibrate import calibrate, windows  # noqa: E402
from emad.calibration.profile import smooth  # noqa: E402
from emad.decode import Method, generate, left_pad  # noqa: E402
from emad.engine.engines import compile_stats, with_engine  # noqa: E402
from emad.engine.models import LoadedModel, load_model, resolve_device, resolve_dtype  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.criteria import Emad, Fixed, Full  # noqa: E402
from emad.exits.estimators import TopK  # noqa: E402
from emad.exits.strata import Strata  # noqa: E402

RANDOM_SHAPES = {  # name -> LlamaConfig fields: SmolLM2-1.7B's shape
    "random-1.7b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192,
                        tie_word_embeddings=True, rope_theta=130000.0),
    "random-tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,  # tests
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        tie_word_embeddings=True),
}


def load(spec: str, device: str, dtype: str) -> tuple:
    """(model, tokenizer, description) for an embedded alias, folder, or a name of :data:`RANDOM_SHAPES`."""
    if spec not in RANDOM_SHAPES:
        loaded: LoadedModel = load_model(spec, device=device, dtype=dtype)
        return loaded.model, loaded.tokenizer, loaded.fingerprint.as_dict()
    import transformers as tf

    dev = resolve_device(device)
    config = tf.LlamaConfig(**RANDOM_SHAPES[spec])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = tf.LlamaForCausalLM(config).to(resolve_dtype(dtype, dev)).eval()
    tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32").tokenizer  # same vocabulary size
    return model, tokenizer, {"spec": spec, "random_weights": True, **RANDOM_SHAPES[spec]}


def profile_of(stack: LayerStack, tokenizer, every: int = 3):
    """A target profile at every ``every``-th layer from a quick calibration on the benchmark's own prompts."""
    ids = [tokenizer(p * 4)["input_ids"] for p in PROMPTS]
    probes = sorted({*range(every, stack.n_layers + 1, every), stack.n_layers})
    return smooth(calibrate(stack, windows(ids, 64), probes, Strata(), batch_size=4), min_count=1)


def decoders(n_layers: int, profile) -> dict:
    """Our decoders by name (methods made afresh per generation)."""
    return {
        "full": lambda: Method(Full()),
        "fixed-0.5L": lambda: Method(Fixed(max(1, round(0.5 * n_layers)))),
        "fixed-0.8L": lambda: Method(Fixed(max(1, round(0.8 * n_layers)))),
        "emad-probes-exact": lambda: Method(Emad(profile, math.inf)),  # probes every 3rd layer, never exits
        "emad-probes-topk": lambda: Method(Emad(profile, math.inf), "monotone", TopK(1024)),
        "emad-exits": lambda: Method(Emad(profile, 0.0)),
    }


def hf_runner(model, ids: torch.Tensor, real: torch.Tensor, static: bool):
    """HF greedy ``generate`` of exactly n new tokens (EOS off), dynamic or static cache."""
    extra = {"cache_implementation": "static"} if static else {}

    def run(new: int):
        return model.generate(ids, attention_mask=real.long(), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, **extra)
    return run


def _seconds(fn, new: int, device) -> float:
    sync(device)
    began = time.perf_counter()
    fn(new)
    sync(device)
    return time.perf_counter() - began


def per_token_seconds(runs: dict, short: int, long: int, reps: int, device) -> dict[str, list[float]]:
    """Per decoder, its seconds per token in each of ``reps`` rounds: (time of ``long`` new tokens − time of
    ``short``) / (long − short); each round runs every decoder in turn, every other round in reverse order."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    for r in range(reps):
        for label in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            long_s = _seconds(runs[label], long, device)
            short_s = _seconds(runs[label], short, device)
            times[label].append((long_s - short_s) / (long - short))
    return times


def bench_batch(model, tokenizer, stacks: dict, profile, batch: int, args) -> dict:
    """Every decoder at one batch size: per-token ms, mean depth and cost ratios, greedy agreement with HF."""
    prompts = [tokenizer(p)["input_ids"] for p in (PROMPTS * batch)[:batch]]
    device = next(iter(stacks.values())).device
    ids, real = left_pad(prompts, 0, device)
    runs, facts = {}, {}
    for label, static in (("hf-dynamic", False), ("hf-static", True)):
        runs[label] = hf_runner(model, ids, real, static)
    n_layers = next(iter(stacks.values())).n_layers
    for engine, stack in stacks.items():
        for name, method in decoders(n_layers, profile).items():
            def run(new, s=stack, m=method):
                return generate(s, tokenizer, prompts, m(), new, eos_token_ids=[])
            runs[f"{name}/{engine}"] = run
    compile_before = {e: compile_stats(s).get("compile_seconds", 0.0) for e, s in stacks.items()}
    began = time.perf_counter()
    hf_tokens = runs["hf-static"](args.long)[:, ids.shape[1]:].tolist()  # warm-up: every path once, compiles
    for label, fn in runs.items():
        out = fn(args.long)
        if not label.startswith("hf-"):
            facts[label] = _facts(out, hf_tokens, tokenizer.eos_token_id)
    warm_up_s = time.perf_counter() - began
    times = per_token_seconds(runs, args.short, args.long, args.reps, device)
    rows = {label: {"ms_per_token": 1e3 * statistics.median(ts), **facts.get(label, {})}
            for label, ts in times.items()}
    best_hf = min(rows["hf-static"]["ms_per_token"], rows["hf-dynamic"]["ms_per_token"])
    for label, row in rows.items():
        row["time_ratio_to_best_hf"] = row["ms_per_token"] / best_hf
        full = rows.get(f"full/{label.split('/')[-1]}") if "/" in label else None
        if full is not None:
            row["time_ratio_to_own_full"] = row["ms_per_token"] / full["ms_per_token"]
    compiled = {e: round(compile_stats(s).get("compile_seconds", 0.0) - compile_before[e], 3)
                for e, s in stacks.items() if e != "eager"}
    return {"batch": batch, "decoders": rows, "warm_up_s": round(warm_up_s, 3), "compile_seconds": compiled}


def _before_eos(ids: list[int], eos: int | None) -> int:
    """Tokens before the first EOS: HF's ``min_new_tokens`` bans EOS where ours emits it, so only they compare."""
    return ids.index(eos) if eos in ids else len(ids)


def _facts(out, hf_tokens: list[list[int]], eos: int | None) -> dict:
    """Mean depth, FLOPs and bytes ratios of a generation, and whether its greedy tokens equal HF static's (up to
    the first EOS)."""
    depths = [d for row in out.depths for d in row[1:]]
    ratio = (lambda spent, full: sum(map(sum, spent)) / sum(map(sum, full)))
    return {"mean_depth": statistics.fmean(depths) if depths else None,
            "flops_ratio": ratio(out.flops, out.full_flops), "bytes_ratio": ratio(out.bytes, out.full_bytes),
            "tokens_equal_hf_static": all(a[:n] == b[:n] for a, b in zip(out.token_ids, hf_tokens)
                                          for n in [_before_eos(a, eos)])}


def checks(batch: dict) -> dict:
    """The targets of a compiled engine (measured values beside them; nothing asserted)."""
    rows = batch["decoders"]
    if "full/compiled" not in rows:
        return {}
    full = rows["full/compiled"]["ms_per_token"]
    out = {"full_over_hf_static": full / rows["hf-static"]["ms_per_token"], "target_full_over_hf_static": 1.1}
    for name in ("fixed-0.5L", "fixed-0.8L"):
        row = rows[f"{name}/compiled"]
        out[f"{name}_time_over_full"] = row["ms_per_token"] / full
        out[f"{name}_target"] = row["bytes_ratio"] + 0.05
    out["emad_probes_over_full"] = rows["emad-probes-exact/compiled"]["ms_per_token"] / full
    out["emad_probes_topk_over_full"] = rows["emad-probes-topk/compiled"]["ms_per_token"] / full
    out["target_emad_probes_over_full"] = 1.15
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="default: smollm2-135m,random-1.7b (CUDA), smollm2-135m (CPU)")
    parser.add_argument("--batches", default=None, help="default: 1,8 (CUDA), 1,4 (CPU)")
    parser.add_argument("--short", type=int, default=None, help="default: 16 (CUDA), 8 (CPU)")
    parser.add_argument("--long", type=int, default=None, help="default: 144 (CUDA), 40 (CPU)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engines", default="eager,compiled")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=None, help="file name under reports/bench (default gpu_decode-<device>-<dtype>)")
    args = parser.parse_args(argv)
    on_gpu = resolve_device(args.device).type == "cuda"
    for key, gpu, cpu in (("models", "smollm2-135m,random-1.7b", "smollm2-135m"), ("batches", "1,8", "1,4"),
                          ("short", 16, 8), ("long", 144, 40)):
        if getattr(args, key) is None:
            setattr(args, key, gpu if on_gpu else cpu)
    if not 1 <= args.short < args.long:
        parser.error(f"--short must be in 1..--long - 1 (--long {args.long}), got {args.short}")
    engines = args.engines.split(",")
    result = {"benchmark": "per-token decode time: HF generate vs our eager and compiled engines", "models": [],
              "short": args.short, "long": args.long, "reps": args.reps}
    for spec in args.models.split(","):
        model, tokenizer, description = load(spec, args.device, args.dtype)
        base = LayerStack(model)
        began = time.perf_counter()
        stacks = {e: with_engine(base, e) for e in engines}
        profile = profile_of(base, tokenizer)
        entry = {"model": description, "environment": environment(base.device, base.dtype),
                 "setup_s": round(time.perf_counter() - began, 3), "batches": []}
        for batch in map(int, args.batches.split(",")):
            measured = bench_batch(model, tokenizer, stacks, profile, batch, args)
            measured["checks"] = checks(measured)
            entry["batches"].append(measured)
            for label, row in measured["decoders"].items():
                print(f"{description['spec']} batch {batch} {label:28s} {row['ms_per_token']:8.2f} ms/token "
                      f"({row['time_ratio_to_best_hf']:.2f}x best HF)")
        entry["compile_seconds"] = {e: compile_stats(s).get("compile_seconds") for e, s in stacks.items()
                                    if e != "eager"}
        result["models"].append(entry)
        del model, base, stacks
    env = result["models"][0]["environment"] if result["models"] else {}
    name = args.out or f"gpu_decode-{env.get('device', 'cpu').split(':')[0]}-{env.get('dtype', '')}"
    path = write(name, result)
    print(f"written to {path}")
    return result


if __name__ == "__main__":
    main()
