"""The first run on a GPU, in one script (``make gpu-check``): what the machine is, what its graph machinery costs,
how fast each decoder is against HF's static-cache ``generate``, whether C2's timing builds nothing while it times,
and whether the compiled engine is exact there (and where it parts if not). One JSON into
reports/bench/gpu_check-<device>.json, rewritten after every section and after each decoder of a decode section, so
a run stopped at its limit still returns what it finished.

Sections, in order (each records its status, seconds, and what it compiled and captured; once ``--budget`` seconds
have passed, work inside a section stops at its next decoder, round or comparison, and later sections are recorded
as skipped):

1. ``environment``: torch, transformers, CUDA, driver, device, whether CUDA graphs hold conditional IF nodes (tried
   with a real capture; the reason where not), the inductor cache folder.
2. ``latency``: one replay of a captured graph, one host read of a device value, one pinned non-blocking copy with
   an event waited for (median µs).
3. ``if_node``: a 3-layer masked segment captured inside an IF node; replays with the predicate true and false
   (median µs each) and whether the false one left the K/V buffers as they were.
4. ``decode_batch_<b>`` for the first batch size (1): :func:`bench_gpu_decode.bench_batch` on the compiled engine
   (HF static and dynamic, full, fixed 0.5L and 0.8L, EMAD probing without exit — exact and Top-K — and EMAD
   exiting at margin 0 on the script's own quick profile), the targets beside the measured ratios; host reads and
   graph launches per token of each decoder.
5. ``c2_dry_run``: C2's timing (:func:`emad.evaluation.speed.time_prompts`) of EMAD on two prompts; it fails if a
   timed block compiles or captures.
6. ``decode_batch_<b>`` for each further batch size (8).
7. ``exactness``: the compiled engine against the eager one (full depth, EMAD exiting) and HF greedy, in each
   ``--exactness`` dtype (bfloat16 by default), at the largest batch; where they part: the first differing token
   and step, the shares of equal tokens and depths, the largest logit difference there and each side's margin.
8. ``memory``: peak memory.

The model is a random-weight one of SmolLM2-135M's shape by default (``random:smollm2-135m``: no model file, no
tokenizer, no ``gguf``); ``--model smollm2-135m`` loads the embedded one where its package is installed. It imports
torch, transformers and the engine (no dvc, mlflow, ray). On a CPU (``--device cpu``) it runs the same sections, the
compiled engine without graphs (the test suite runs them with the graph paths emulated).

Usage: python benchmarks/gpu_check.py [--device auto] [--model random:smollm2-135m] [--budget 540] [--batches 1,8]
       [--exactness bfloat16] [--short 16] [--long 144] [--reps 3] [--cache-dir .cache/inductor]
       [--sections latency,if_node,decode,c2_dry_run,exactness,memory] [--out NAME] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, sync, write  # noqa: E402
from gpu_check_sections import (  # noqa: E402
    bundle_cache,
    dynamo_graphs,
    section_c2,
    section_decode,
    section_exactness,
)

from emad.engine.compiled import CompiledStack  # noqa: E402
from emad.engine.models import resolve_device  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.engine.step_graphs import Always, if_node_support  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("inductor", "aot_eager")
SECTIONS = ("latency", "if_node", "decode", "c2_dry_run", "exactness", "memory")  # decode: each --batches size
DTYPES = ("float32", "bfloat16")


def compiled_stack(base: LayerStack, backend: str = "inductor") -> CompiledStack:
    """The engine the check runs: the compiled one, probes fused as on CUDA (graphs and conditional nodes where the
    device has them)."""
    return CompiledStack(base, backend, fuse_probes=True)


def shown(path: str | None) -> str | None:
    """``path`` as a record may name it: relative to the repository where it lies inside, else its last part (a
    record names no path of the machine that wrote it)."""
    if path is None or not os.path.isabs(path):
        return path
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else resolved.name


def section_environment(device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    reason = if_node_support()
    out = {**environment(device, dtype), "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "if_nodes": reason is None, "if_nodes_not_available_because": reason,
           "inductor_cache_dir": shown(os.environ.get("TORCHINDUCTOR_CACHE_DIR")), "python": sys.version.split()[0]}
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
        return {"skipped": f"no CUDA graphs with conditional nodes here: {if_node_support() or 'graphs are off'}"}
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


def section_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}
    import resource

    return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


class Run:
    """The check's JSON and its clock: sections run in turn, each recorded (status, seconds, what it compiled and
    captured) and the file rewritten after it and whenever a section reports progress.

    Args:
        name: the file name under reports/bench; budget: seconds; header: the JSON's first fields.
    """

    def __init__(self, name: str, budget: float, header: dict, out_dir: str | None = None):
        self.name, self.budget, self.out_dir = name, budget, out_dir
        self.began = time.perf_counter()
        self.deadline = self.began + budget
        self.result = {**header, "budget_s": budget, "sections": {}, "errors": [], "complete": False}
        self.stacks: list = []  # compiled stacks whose compile stats the sections report

    def spent(self) -> float:
        return time.perf_counter() - self.began

    def save(self) -> Path:
        self.result["seconds"] = round(self.spent(), 3)
        return write(self.name, self.result, self.out_dir)

    def _built(self) -> dict:
        totals = {"compilations": 0, "graphs": 0, "compile_seconds": 0.0, "graph_fallbacks": []}
        for stack in self.stacks:
            stats = stack.runner.stats.as_dict()
            for key in ("compilations", "graphs", "compile_seconds"):
                totals[key] += stats[key]
            totals["graph_fallbacks"] += [r for r in stats["graph_fallbacks"] if r not in totals["graph_fallbacks"]]
        return {**totals, "dynamo_graphs": dynamo_graphs()}

    def section(self, name: str, fn, wanted: bool = True) -> None:
        """Run ``fn(progress)`` as section ``name`` (skipped where not ``wanted`` and once the budget is spent; an
        error is recorded and the next section runs); ``progress(partial)`` records what the section knows so far and
        rewrites the file."""
        if not wanted:
            self.result["sections"][name] = {"status": "skipped", "skipped": "not in --sections"}
            return
        if self.spent() > self.budget:
            self.result["sections"][name] = {"status": "skipped",
                                             "skipped": f"budget: {self.spent():.0f} s of {self.budget:.0f} s spent"}
            self.save()
            return
        t0, before = time.perf_counter(), self._built()

        def built() -> dict:
            now = self._built()
            return {"compilations": now["compilations"] - before["compilations"],
                    "graphs": now["graphs"] - before["graphs"],
                    "compile_seconds": round(now["compile_seconds"] - before["compile_seconds"], 3),
                    "dynamo_graphs": now["dynamo_graphs"] - before["dynamo_graphs"],
                    "graph_fallbacks": [r for r in now["graph_fallbacks"] if r not in before["graph_fallbacks"]]}

        def progress(partial: dict) -> None:
            self.result["sections"][name] = {**partial, "status": "running",
                                             "seconds": round(time.perf_counter() - t0, 3), "built": built()}
            self.save()

        progress({})
        try:
            found, status = fn(progress), "done"
        except Exception as error:  # noqa: BLE001 - a failed section is recorded, the next ones still run
            found, status = {"error": f"{type(error).__name__}: {error}"}, "error"
            self.result["errors"].append(name)
        self.result["sections"][name] = {**found, "status": status, "seconds": round(time.perf_counter() - t0, 3),
                                         "built": built()}
        self.save()
        print(f"{name}: {status} in {time.perf_counter() - t0:.1f} s", flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options, checked before any work (a bad value names its option and the valid values)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="random:smollm2-135m",
                        help="random:<shape> (random weights: no model file) or a model spec such as smollm2-135m")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds; work stops at the next step after it")
    parser.add_argument("--batches", default="1,8", help="decode batch sizes: the first before the C2 dry run")
    parser.add_argument("--exactness", default="bfloat16", help="dtypes of the exactness section (comma-separated)")
    parser.add_argument("--short", type=int, default=None, help="default 16 (CUDA), 4 (CPU)")
    parser.add_argument("--long", type=int, default=None, help="default 144 (CUDA), 8 (CPU)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backend", default="inductor", help=f"torch.compile backend: {', '.join(BACKENDS)}")
    parser.add_argument("--cache-dir", default=str(ROOT / ".cache" / "inductor"),
                        help="inductor's (and triton's) cache: a second run reuses what the first compiled")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"which to run, in their order (environment always): {', '.join(SECTIONS)}")
    parser.add_argument("--out", default=None, help="file name (default gpu_check-<device>)")
    parser.add_argument("--out-dir", default=None, help="folder of the JSON (default reports/bench)")
    args = parser.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    if not args.sections or set(args.sections) - set(SECTIONS):
        parser.error(f"--sections must name sections among {', '.join(SECTIONS)}, got {','.join(args.sections)!r}")
    try:
        args.device = resolve_device(args.device)
    except ValueError as error:
        parser.error(f"--device: {error}")
    on_gpu = args.device.type == "cuda"
    args.short = args.short or (16 if on_gpu else 4)
    args.long = args.long or (144 if on_gpu else 8)
    if not 1 <= args.short < args.long:
        parser.error(f"--short must be in 1..--long - 1 (--long {args.long}), got {args.short}")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        args.batches = []
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batches must be positive integers separated by commas (e.g. 1,8), got {args.batches!r}")
    args.exactness = [d for d in args.exactness.split(",") if d]
    if not args.exactness or set(args.exactness) - set(DTYPES):
        parser.error(f"--exactness must name dtypes among {', '.join(DTYPES)}, got {','.join(args.exactness)!r}")
    if args.backend not in BACKENDS:
        parser.error(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    if args.budget <= 0 or args.reps < 1:
        parser.error(f"--budget must be > 0 and --reps >= 1, got {args.budget} and {args.reps}")
    if args.model.startswith("random:"):
        from emad.engine.random_models import RandomSpecError, shape_of

        try:
            shape_of(args.model.split("+idle")[0])
        except RandomSpecError as error:
            parser.error(f"--model: {error}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.cache_dir).resolve())  # read when inductor first compiles
    device, on_gpu = args.device, args.device.type == "cuda"
    dtype = "bfloat16" if on_gpu else "float32"
    run = Run(args.out or f"gpu_check-{device.type}", args.budget,
              {"benchmark": "first GPU run: environment, graph latencies, IF nodes, decode speed, C2 dry run, "
                            "exactness", "model": args.model, "argv": [shown(a) for a in (sys.argv[1:] if argv is None else argv)],
               "batches": args.batches, "short": args.short, "long": args.long, "reps": args.reps,
               "backend": args.backend, "sections_asked": args.sections}, args.out_dir)
    wanted = set(args.sections)

    def compiled(base: LayerStack) -> CompiledStack:
        stack = compiled_stack(base, args.backend)
        if stack.runner not in [s.runner for s in run.stacks]:
            run.stacks.append(stack)
        return stack

    bundle_of = bundle_cache(args.model, str(device), compiled)
    run.section("environment", lambda _: section_environment(device, getattr(torch, dtype)))
    run.section("latency", lambda _: section_latency(device), "latency" in wanted)
    run.section("if_node", lambda _: section_if_node(bundle_of(dtype).stack, device), "if_node" in wanted)
    first, *rest = args.batches
    run.section(f"decode_batch_{first}",
                lambda progress: section_decode(bundle_of(dtype), first, args, run.deadline, progress),
                "decode" in wanted)
    run.section("c2_dry_run", lambda _: section_c2(bundle_of(dtype), args.short), "c2_dry_run" in wanted)
    for batch in rest:
        run.section(f"decode_batch_{batch}",
                    lambda progress, b=batch: section_decode(bundle_of(dtype), b, args, run.deadline, progress),
                    "decode" in wanted)
    run.section("exactness", lambda progress: section_exactness(bundle_of, args.exactness, max(args.batches),
                                                                min(32, args.long), run.deadline, progress),
                "exactness" in wanted)
    run.section("memory", lambda _: section_memory(device), "memory" in wanted)
    run.result["device"] = run.result["sections"]["environment"].get("gpu") or str(device)
    run.result["complete"] = True
    path = run.save()
    errors = run.result["errors"]
    print(f"written to {path} in {run.spent():.0f} s" + (f"; sections with errors: {errors}" if errors else ""))
    return run.result


if __name__ == "__main__":
    main()
