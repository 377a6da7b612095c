"""The first run on a GPU, in one script (``make gpu-check``): what the machine is, what its graph machinery costs,
whether the compiled engine is exact there, how fast each decoder is against HF's static-cache ``generate``, and
whether C2's timing builds nothing while it times. One JSON into reports/bench/gpu_check-<device>.json.

Sections, in order (each records its own seconds; once ``--budget`` seconds have passed the rest are recorded as
skipped, so the script ends in time on a slow host):

1. ``environment``: torch, CUDA, driver, device, whether CUDA graphs can hold conditional IF nodes.
2. ``latency``: one replay of a captured graph, one host read of a device value, one pinned non-blocking copy with
   an event waited for (median µs).
3. ``if_node``: a 3-layer masked segment captured inside an IF node; replays with the predicate true and false
   (median µs each) and whether the false one left the K/V buffers as they were.
4. ``exactness``: the compiled engine against the eager one and HF greedy, float32 and bfloat16 (tokens and depths,
   full depth and EMAD exiting, batch 4).
5. ``decode``: :func:`bench_gpu_decode.bench_batch` at batch 1 and 8 on the compiled engine (HF static and
   dynamic, full, fixed 0.5L and 0.8L, EMAD probing without exit — exact and Top-K — and EMAD exiting at margin 0 on
   the script's own quick profile), with the targets beside the measured ratios; host reads and graph launches per
   token of each decoder.
6. ``c2_dry_run``: C2's timing (:func:`emad.evaluation.speed.time_prompts`) of EMAD on two prompts; it fails if a
   timed block compiles or captures.
7. ``memory``: peak memory.

It imports torch, transformers and the engine (no dvc, mlflow, ray). On a CPU (``--device cpu``) it runs the same
sections on ``random-tiny`` (the test suite does, with the graph paths emulated).

Usage: python benchmarks/gpu_check.py [--device auto] [--model smollm2-135m] [--budget 540] [--short 16]
       [--long 144] [--reps 3] [--out NAME]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_decode import PROMPTS, bench_batch, checks, load, profile_of  # noqa: E402
from common import environment, sync, write  # noqa: E402

from emad.decode import Method, generate, left_pad  # noqa: E402
from emad.engine.compiled import CompiledStack  # noqa: E402
from emad.engine.models import resolve_device  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.engine.step_graphs import Always, if_nodes_available  # noqa: E402
from emad.exits.criteria import Emad, Full  # noqa: E402
from emad.exits.estimators import TopK  # noqa: E402


def compiled_stack(base: LayerStack) -> CompiledStack:
    """The engine the check runs: the compiled one (graphs and conditional nodes where the device has them)."""
    return CompiledStack(base)


def section_environment(device: torch.device, dtype: torch.dtype) -> dict:
    out = {**environment(device, dtype), "cuda": torch.version.cuda, "if_nodes": if_nodes_available()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1))
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            out["driver"] = None
    return out


def _median_us(fn, device, reps: int = 200) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1e6 * statistics.median(times)


def section_latency(device: torch.device) -> dict:
    x = torch.ones(8, device=device)
    flag = torch.ones((), dtype=torch.bool, device=device)
    out = {"host_read_us": _median_us(lambda: bool(flag), device)}
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            x.add_(1)
        out["graph_replay_us"] = _median_us(lambda: (graph.replay(), sync(device)), device)
        pinned = torch.zeros(8, pin_memory=True)
        event = torch.cuda.Event()

        def copy():
            pinned.copy_(x, non_blocking=True)
            event.record()
            event.synchronize()

        out["pinned_copy_event_us"] = _median_us(copy, device)
    return out


class _Segment3:
    """A program of one block: layers [0, 3) of every row, inside a conditional node on ``pred`` (the IF check)."""

    def __init__(self, stack, cache, h, positions, running, pred):
        self.stack, self.cache, self.h, self.positions, self.running, self.pred = stack, cache, h, positions, running, pred
        self.logits = torch.zeros(1, device=h.device)

    def run(self, ex) -> None:
        ex.when(self.pred, lambda: self.stack.runner.segment(0, 3, self.h, self.positions, self.running, self.cache))
        self.logits = self.logits + 0  # the program's output (a graph keeps one)


@torch.inference_mode()
def section_if_node(stack, device: torch.device) -> dict:
    runner = stack.runner
    if not runner.graphs or stack.branches != "if":
        return {"skipped": "no CUDA graphs with conditional nodes here"}
    batch, d = 1, stack.config.hidden_size
    cache = stack.new_cache(batch, 16)
    ids = torch.ones(batch, 2, dtype=torch.long, device=device)
    from emad.decode.step import prefill_states

    prefill_states(stack, cache, ids, torch.ones_like(ids, dtype=torch.bool), stack.n_layers)  # eager: K/V made
    cache.allocate(torch.ones(batch, 1, dtype=torch.bool, device=device), dense=True)
    cache.slot_tensor(2)
    with torch.inference_mode(False):
        h = torch.randn(batch, 1, d, device=device, dtype=stack.dtype)
        positions = torch.ones(batch, 1, dtype=torch.long, device=device)
        running = torch.ones(batch, dtype=torch.bool, device=device)
        pred = torch.ones((), dtype=torch.bool, device=device)
    program = _Segment3(stack, cache, h, positions, running, pred)
    program.run(Always())  # compiled before the capture
    graph = runner.capture_step(program)
    out = {}
    for value in (True, False):
        pred.fill_(value)
        cache.valid[:, :, 2].zero_()
        graph.replay()
        sync(device)
        out[f"wrote_kv_when_{'true' if value else 'false'}"] = bool(cache.valid[:3, :, 2].all())
        out[f"replay_{'true' if value else 'false'}_us"] = _median_us(lambda: (graph.replay(), sync(device)), device, 50)
    out["ok"] = out["wrote_kv_when_true"] and not out["wrote_kv_when_false"]
    return out


def _tokens_and_depths(stack, tokenizer, prompts, method, new: int) -> tuple[list, list]:
    out = generate(stack, tokenizer, prompts, method, new, eos_token_ids=[])
    return out.token_ids, out.depths


def section_exactness(spec: str, device: str, tokenizer_prompts: int, new: int) -> dict:
    out = {}
    for dtype in ("float32", "bfloat16"):
        model, tokenizer, _ = load(spec, device, dtype)
        eager = LayerStack(model)
        compiled = compiled_stack(eager)
        profile = profile_of(eager, tokenizer)
        prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:tokenizer_prompts]]
        ids, real = left_pad(prompts, 0, eager.device)
        hf = model.generate(ids, attention_mask=real.long(), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            pad_token_id=0)[:, ids.shape[1]:].tolist()
        rows = {}
        for name, method in (("full", lambda: Method(Full())), ("emad-exits", lambda p=profile: Method(Emad(p, 0.0)))):
            a_tokens, a_depths = _tokens_and_depths(eager, tokenizer, prompts, method(), new)
            b_tokens, b_depths = _tokens_and_depths(compiled, tokenizer, prompts, method(), new)
            rows[name] = {"compiled_equals_eager_tokens": a_tokens == b_tokens,
                          "compiled_equals_eager_depths": a_depths == b_depths,
                          "rows_equal_hf_greedy": sum(t == h for t, h in zip(b_tokens, hf)) if name == "full" else None,
                          "rows": len(prompts)}
        out[dtype] = rows
        del model, eager, compiled
    return out


def _steps(stack, tokenizer, prompts, methods: dict, new: int) -> dict:
    """Host reads and graph launches per decode step of each decoder (one generation each, after its warm-up)."""
    out = {}
    for name, method in methods.items():
        generate(stack, tokenizer, prompts, method(), new, eos_token_ids=[])
        made = generate(stack, tokenizer, prompts, method(), new, eos_token_ids=[])
        launches = made.graph_launches
        out[name] = {"step_path": made.step_path, "host_reads_per_token": made.host_reads_per_step,
                     "graph_launches_per_token": launches / made.decode_steps if launches is not None else None}
    return out


def section_decode(spec: str, device: str, dtype: str, batches: list[int], args) -> tuple[dict, tuple]:
    from bench_gpu_decode import decoders

    model, tokenizer, description = load(spec, device, dtype)
    base = LayerStack(model)
    stack = compiled_stack(base)
    profile = profile_of(base, tokenizer)
    out = {"model": description, "batches": []}
    for batch in batches:
        measured = bench_batch(model, tokenizer, {"compiled": stack}, profile, batch, args)
        measured["checks"] = checks(measured)
        prompts = [tokenizer(p)["input_ids"] for p in (PROMPTS * batch)[:batch]]
        measured["steps"] = _steps(stack, tokenizer, prompts, decoders(stack.n_layers, profile), args.short)
        out["batches"].append(measured)
    return out, (stack, tokenizer, profile)


def section_c2(stack, tokenizer, profile, new: int) -> dict:
    from emad.evaluation.speed import time_prompts

    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    methods = [Method(Emad(profile, 0.0)), Method(Emad(profile, 0.0), "monotone", TopK(1024))]
    timed = time_prompts(stack, tokenizer, methods, prompts, new)
    return {"prompts": 2, "new_tokens": new, "built_nothing_while_timed": True,
            "points": [{key: t[key] for key in ("speedup", "speed_reference", "decode_speedup", "speed_pairs",
                                                "decode_speed_pairs")} for t in timed]}


def section_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}
    import resource

    return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default=None, help="default: smollm2-135m on CUDA, random-tiny elsewhere")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds; later sections are skipped after it")
    parser.add_argument("--short", type=int, default=None, help="default 16 (CUDA), 4 (CPU)")
    parser.add_argument("--long", type=int, default=None, help="default 144 (CUDA), 8 (CPU)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="file name under reports/bench (default gpu_check-<device>)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    on_gpu = device.type == "cuda"
    args.model = args.model or ("smollm2-135m" if on_gpu else "random-tiny")
    args.short = args.short or (16 if on_gpu else 4)
    args.long = args.long or (144 if on_gpu else 8)
    if not 1 <= args.short < args.long:
        parser.error(f"--short must be in 1..--long - 1 (--long {args.long}), got {args.short}")
    dtype = "bfloat16" if on_gpu else "float32"
    began = time.perf_counter()
    result = {"benchmark": "first GPU run: environment, graph latencies, IF nodes, exactness, decode speed, C2 dry run",
              "model": args.model, "budget_s": args.budget, "sections": {}}
    shared = {}

    def run(name: str, fn) -> None:
        spent = time.perf_counter() - began
        if spent > args.budget:
            result["sections"][name] = {"skipped": f"budget: {spent:.0f} s of {args.budget:.0f} s spent"}
            return
        t0 = time.perf_counter()
        try:
            found = fn()
        except Exception as error:  # noqa: BLE001 - a failed section is recorded, the next ones still run
            found = {"error": f"{type(error).__name__}: {error}"}
        result["sections"][name] = {**found, "seconds": round(time.perf_counter() - t0, 3)}
        print(f"{name}: {result['sections'][name]}", flush=True)

    torch_dtype = torch.bfloat16 if on_gpu else torch.float32
    run("environment", lambda: section_environment(device, torch_dtype))
    run("latency", lambda: section_latency(device))

    def if_node():
        model, _, _ = load(args.model, str(device), dtype)
        return section_if_node(compiled_stack(LayerStack(model)), device)

    run("if_node", if_node)
    run("exactness", lambda: section_exactness(args.model, str(device), 4, min(32, args.long)))

    def decode():
        found, shared["stack"] = section_decode(args.model, str(device), dtype, [1, 8] if on_gpu else [1, 2], args)
        return found

    run("decode", decode)
    run("c2_dry_run", lambda: section_c2(*shared["stack"], args.short) if "stack" in shared
        else {"skipped": "the decode section did not run"})
    run("memory", lambda: section_memory(device))
    result["seconds"] = round(time.perf_counter() - began, 3)
    result["device"] = result["sections"]["environment"].get("gpu") or str(device)
    errors = [n for n, s in result["sections"].items() if "error" in s]
    result["errors"] = errors
    path = write(args.out or f"gpu_check-{device.type}", result)
    print(f"written to {path} in {result['seconds']:.0f} s" + (f"; sections with errors: {errors}" if errors else ""))
    return result


if __name__ == "__main__":
    main()
