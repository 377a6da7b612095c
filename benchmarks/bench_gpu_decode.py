"""Per-token decode time of HF ``generate`` (dynamic and static cache) and of our engines (eager, compiled) at full
depth, fixed depth 0.5L and 0.8L, EMAD probing without exiting and EMAD exiting; compile time; greedy agreement
with HF. For a GPU (bf16) and, shorter, for a CPU.

Per-token time is differenced: (time of ``--long`` new tokens − time of ``--short``) / (long − short), so the prompt
pass drops out; EOS is off; each decoder's generations alternate with every other's in rounds, medians over
``--reps`` rounds. Models: the embedded SmolLM2-135M and a random-weight model of SmolLM2-1.7B's shape
(``random:smollm2-1.7b``, built from a config, nothing downloaded). Writes reports/bench/gpu_decode-<device>-<dtype>.json.

Defaults by device: on CUDA both models, batches 1 and 8, 144 − 16 new tokens (``make bench-gpu``); on a CPU,
shorter: SmolLM2-135M only, batches 1 and 4, 40 − 8 new tokens.

Usage: python benchmarks/bench_gpu_decode.py [--models smollm2-135m,random:smollm2-1.7b] [--batches 1,8] [--short 16]
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
from emad.engine.models import LoadedModel, load_model, resolve_device  # noqa: E402
from emad.engine.random_models import PREFIX as RANDOM_PREFIX  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.criteria import Emad, Fixed, Full  # noqa: E402
from emad.exits.estimators import TopK  # noqa: E402
from emad.exits.strata import Strata  # noqa: E402


def load(spec: str, device: str, dtype: str) -> tuple:
    """(model, tokenizer, description) of a model spec: an embedded alias, a folder, or ``random:<shape>`` (random
    weights of a real shape, :mod:`emad.engine.random_models`: no model file, no tokenizer file)."""
    loaded: LoadedModel = load_model(spec, device=device, dtype=dtype)
    description = loaded.fingerprint.as_dict()
    if spec.startswith(RANDOM_PREFIX):
        description["random_weights"] = True
    return loaded.model, loaded.tokenizer, description


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


def _seconds(fn, new: int, device, clock=time.perf_counter) -> float:
    sync(device)
    began = clock()
    fn(new)
    sync(device)
    return clock() - began


def per_token_seconds(runs: dict, short: int, long: int, reps: int, device, deadline: float | None = None,
                      after_round=None, clock=time.perf_counter) -> dict[str, list[float]]:
    """Per decoder, its seconds per token in each of ``reps`` rounds: (time of ``long`` new tokens − time of
    ``short``) / (long − short); each round runs every decoder in turn, every other round in reverse order. Past
    ``deadline`` (a ``time.perf_counter()`` value) no further round starts (one always runs); ``after_round(times)``
    is called after each. ``clock``: wall-clock time (default) or, for the host's own work, ``time.process_time``."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    for r in range(reps):
        if r and deadline is not None and time.perf_counter() > deadline:
            break
        for label in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            long_s = _seconds(runs[label], long, device, clock)
            short_s = _seconds(runs[label], short, device, clock)
            times[label].append((long_s - short_s) / (long - short))
        if after_round is not None:
            after_round(times)
    return times


def bench_batch(model, tokenizer, stacks: dict, profile, batch: int, args, deadline: float | None = None,
                progress=None) -> dict:
    """Every decoder at one batch size: per-token ms, mean depth and cost ratios, greedy agreement with HF.

    Each decoder is warmed up (compiled, captured) in turn, then all are timed in alternating rounds. Past
    ``deadline`` (a ``time.perf_counter()`` value) no further decoder is warmed up (the rest are recorded as skipped)
    and no further round starts; ``progress(partial)`` gets what is known after each decoder and each round."""
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
    out = {"batch": batch, "decoders": {}, "skipped": []}
    ready, hf_tokens = {}, None
    for label, fn in runs.items():  # warm-up: every path once (compiles, captures); HF static first
        if deadline is not None and time.perf_counter() > deadline:
            out["skipped"].append(label)
            continue
        t0 = time.perf_counter()
        made = fn(args.long)
        if label == "hf-static":
            hf_tokens = made[:, ids.shape[1]:].tolist()
        elif not label.startswith("hf-"):
            facts[label] = _facts(made, hf_tokens, tokenizer.eos_token_id)
        ready[label] = fn
        out["decoders"][label] = {"warm_up_s": round(time.perf_counter() - t0, 3), **facts.get(label, {})}
        if progress is not None:
            progress(out)
    out["warm_up_s"] = round(time.perf_counter() - began, 3)

    def timed(times: dict) -> None:
        for label, ts in times.items():
            out["decoders"][label].update(ms_per_token=1e3 * statistics.median(ts), rounds=len(ts))
        _ratios(out["decoders"])
        if progress is not None:
            progress(out)

    per_token_seconds(ready, args.short, args.long, args.reps, device, deadline, timed)
    out["compile_seconds"] = {e: round(compile_stats(s).get("compile_seconds", 0.0) - compile_before[e], 3)
                              for e, s in stacks.items() if e != "eager"}
    return out


def _ratios(rows: dict) -> None:
    """Each timed decoder's time against the best HF decoder and against its engine's full depth, in place."""
    hf = [rows[k]["ms_per_token"] for k in ("hf-static", "hf-dynamic") if "ms_per_token" in rows.get(k, {})]
    for label, row in rows.items():
        if "ms_per_token" not in row:
            continue
        if hf:
            row["time_ratio_to_best_hf"] = row["ms_per_token"] / min(hf)
        full = rows.get(f"full/{label.split('/')[-1]}") if "/" in label else None
        if full is not None and "ms_per_token" in full:
            row["time_ratio_to_own_full"] = row["ms_per_token"] / full["ms_per_token"]


def _before_eos(ids: list[int], eos: int | None) -> int:
    """Tokens before the first EOS: HF's ``min_new_tokens`` bans EOS where ours emits it, so only they compare."""
    return ids.index(eos) if eos in ids else len(ids)


def _facts(out, hf_tokens: list[list[int]] | None, eos: int | None) -> dict:
    """Mean depth, FLOPs and bytes ratios of a generation, and whether its greedy tokens equal HF static's (up to
    the first EOS)."""
    depths = [d for row in out.depths for d in row[1:]]
    ratio = (lambda spent, full: sum(map(sum, spent)) / sum(map(sum, full)))
    return {"mean_depth": statistics.fmean(depths) if depths else None,
            "flops_ratio": ratio(out.flops, out.full_flops), "bytes_ratio": ratio(out.bytes, out.full_bytes),
            "tokens_equal_hf_static": None if hf_tokens is None else all(
                a[:n] == b[:n] for a, b in zip(out.token_ids, hf_tokens) for n in [_before_eos(a, eos)])}


def checks(batch: dict) -> dict:
    """The targets of a compiled engine (measured values beside them; nothing asserted; a ratio whose decoders were
    not timed is left out)."""
    rows = {k: v["ms_per_token"] for k, v in batch["decoders"].items() if "ms_per_token" in v}
    full = rows.get("full/compiled")
    if full is None:
        return {}
    out = {"target_full_over_hf_static": 1.1, "target_emad_probes_over_full": 1.15}
    if "hf-static" in rows:
        out["full_over_hf_static"] = full / rows["hf-static"]
    for name in ("fixed-0.5L", "fixed-0.8L"):
        if f"{name}/compiled" in rows:
            out[f"{name}_time_over_full"] = rows[f"{name}/compiled"] / full
            out[f"{name}_target"] = batch["decoders"][f"{name}/compiled"]["bytes_ratio"] + 0.05
    for name, key in (("emad-probes-exact", "emad_probes_over_full"), ("emad-probes-topk",
                                                                        "emad_probes_topk_over_full")):
        if f"{name}/compiled" in rows:
            out[key] = rows[f"{name}/compiled"] / full
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None,
                        help="default: smollm2-135m,random:smollm2-1.7b (CUDA), smollm2-135m (CPU)")
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
    for key, gpu, cpu in (("models", "smollm2-135m,random:smollm2-1.7b", "smollm2-135m"), ("batches", "1,8", "1,4"),
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
