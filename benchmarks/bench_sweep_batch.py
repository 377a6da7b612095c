"""The screen's sweep at several batch sizes, against its FLOPs floor: one domain's teacher-forced screen of the
default run (every point of ``decode@<model>`` and full depth's reference; perplexity windows, agreement prompts,
cloze and choice items) scored at ``--sizes`` requests a pass.

Per batch size: requests per second (all tasks, and per task), its ratio to batch 1, and the screen's FLOPs per
request by kind (the model's layers for the real tokens, the readouts, the estimators' products: what the sweep
computed, :attr:`emad.decode.Sweep.work`); beside it the throughput this host reaches on a plain matrix product of
the screen's shapes (a readout's ``[rows, d] @ [d, V]``, a layer's ``[tokens, d] @ [d, ffn]``), so that each row says
how far it runs from its floor (the screen's FLOPs at that throughput, measured before each task's run and after the
last, so that a busy host's drift is in both: ``seconds / floor``). Peak memory: a fresh
process per size scores the first batch of each task (the largest: requests come longest first) and reports its
resident peak above what it held before. The batch sizes run in turn, ``--reps`` rounds, in one process; a batch's
scores are checked against batch 1's (exits and FLOPs equal, NLLs within the verdict's noise) before timing.
Writes reports/bench/sweep_batch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
from common import environment, sync, timed, write  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="a checkout that ran `make repro` (its data/)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--params", type=Path, help="the params file whose decode section plans the screen (default: "
                        "the root's params.yaml), e.g. params-powered.yaml")
    parser.add_argument("--control", action="store_true", help="the positive control's screen (control.decode)")
    parser.add_argument("--domain", default="stdlib-prose")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=None, help="decode.sweep_batch_tokens (default: no bound)")
    parser.add_argument("--per-task", type=int, default=None, help="the first requests of each task (default: all)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--memory-of", type=int, help=argparse.SUPPRESS)  # a child: peak memory at this size
    parser.add_argument("--out", default="sweep_batch")
    args = parser.parse_args(argv)
    args.params = args.params.resolve() if args.params else None
    if any(s < 1 for s in args.sizes) or 1 not in args.sizes:
        parser.error(f"--sizes: whole numbers >= 1, 1 among them (the reference), got {args.sizes}")
    if not (args.root / "data" / "models" / args.model).is_dir():
        parser.error(f"--root {args.root}: no data/models/{args.model} there; run `make repro` in it first")
    return args


def screen(args):
    """The decode stage's plan for ``args.model`` in ``args.root`` (the stage's own flags), its decoder, a sweep
    of every point and full depth's reference, and each teacher-forced task's requests."""
    from emad.decode import Sweep
    from emad.evaluation.decoder import Decoder
    from emad.tasks.registry import Shared
    from pipeline.decode import parse_args as stage_args
    from pipeline.decode import plan

    os.chdir(args.root)
    m = args.model
    call = plan(stage_args([
        "--kind", "baseline", "--kind", "point", "--model", m, "--model-dir", f"data/models/{m}",
        "--corpora", "data/corpus", "--profile", f"data/profiles/{m}/{{calibration}}/{{readout}}/profile.json",
        "--readouts", f"data/readouts/{m}/stdlib-prose/readouts.safetensors",
        "--estimators", f"data/estimators/{m}/{{readout}}.json", "--domain", args.domain,
        "--out", "/dev/null", "--artifacts", "/dev/null", "--params", str(args.params or args.root / "params.yaml"),
        *(["--control", "--calibration", args.domain] if args.control else [])]))
    decoder = Decoder(call)
    methods = decoder._methods(decoder.jobs, reference=True)
    sweep = Sweep(decoder.stack, list(methods.values()), list(methods))
    shared = Shared()
    tasks = {p.name: p.task.requests(decoder.stack, decoder.loaded.tokenizer, p.data, p.settings, shared)
             [:args.per_task] for p in decoder.prepared[args.domain] if p.task.teacher_forced}
    return decoder, sweep, tasks


def score(sweep, tasks: dict, size: int, tokens: int | None) -> dict:
    """Every task's requests at ``size`` requests a pass: per task its ``[request][method][continuation]``."""
    from emad.decode.batches import request_batches

    out = {}
    for name, requests in tasks.items():
        got: dict[int, list] = {}
        for batch in request_batches(requests, size, tokens):
            for i, scored in zip(batch, sweep.score_batch([requests[i] for i in batch])):
                got[i] = scored
        out[name] = [got[i] for i in range(len(requests))]
    return out


def differences(a: dict, b: dict) -> dict:
    """How ``b`` differs from ``a`` (same tasks): of every result (a method on a continuation), those whose exits,
    greedy hits or FLOPs differ (an estimate within float rounding of its threshold decides otherwise in another
    batch), and the largest difference of a continuation's NLL where they do not (float rounding)."""
    results, unequal, nll = 0, 0, 0.0
    for task in a:
        for ra, rb in zip(a[task], b[task]):
            for ma, mb in zip(ra, rb):
                for x, y in zip(ma, mb):
                    results += 1
                    if (x.depths, x.greedy, x.flops) != (y.depths, y.greedy, y.flops):
                        unequal += 1
                    elif x.nll != y.nll:
                        nll = max(nll, abs(x.nll - y.nll))
    return {"results": results, "results_with_other_exits_or_flops": unequal,
            "max_nll_difference_where_exits_equal": nll}


def matmul_throughput(d: int, vocab: int, ffn: int, device, reps: int = 5) -> dict:
    """GFLOP/s of plain products of the screen's shapes: a readout ``[256, d] @ [d, V]`` and a layer's
    ``[1024, d] @ [d, ffn]``."""
    out = {}
    for name, (m, k, n) in {"readout": (256, d, vocab), "layer": (1024, d, ffn)}.items():
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        a @ b
        seconds = statistics.median(timed(lambda a=a, b=b: a @ b, device) for _ in range(reps))
        out[name] = {"shape": [m, k, n], "gflops_per_s": 2 * m * k * n / seconds / 1e9}
    return out


def resident(field: str) -> float:
    """This process's ``VmRSS`` or ``VmHWM`` (its peak since the last reset), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20  # kB -> GiB
    raise OSError(f"no {field} in /proc/self/status")


def peak_memory(size: int, args) -> float:
    """The resident peak (GiB) of a fresh process while it scores the first batch of each task at ``size`` (the
    largest: requests come longest first), above what it held before (the model, the methods)."""
    from emad.decode.batches import request_batches

    decoder, sweep, tasks = screen(args)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the present resident size
    before = resident("VmRSS")
    with torch.inference_mode():
        for requests in tasks.values():
            first = request_batches(requests, size, args.tokens)[0]
            sweep.score_batch([requests[i] for i in first])
    return resident("VmHWM") - before


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_of is not None:
        print(json.dumps({"peak_gb": peak_memory(args.memory_of, args)}))
        return 0
    decoder, sweep, tasks = screen(args)
    stack, sizes = decoder.stack, sorted(set(args.sizes))
    n_requests = sum(len(r) for r in tasks.values())
    print(f"{len(sweep.methods)} methods; requests: {({k: len(v) for k, v in tasks.items()})}", file=sys.stderr)
    with torch.inference_mode():
        reference = score(sweep, tasks, 1, args.tokens)  # also compiles the fused kernels
        checks = {size: differences(reference, score(sweep, tasks, size, args.tokens)) for size in sizes if size > 1}
        seconds: dict[int, list[float]] = {s: [] for s in sizes}
        per_task: dict[int, dict[str, list[float]]] = {s: {t: [] for t in tasks} for s in sizes}
        work: dict[int, dict[str, dict]] = {}  # size -> task -> FLOPs by kind
        config = stack.config
        shapes = (config.hidden_size, stack.vocab_size, config.intermediate_size, stack.device)
        throughputs: dict[int, list[dict]] = {s: [] for s in sizes}  # measured beside each size's runs
        for _ in range(args.reps):
            for size in sizes:
                for name in tasks:
                    throughputs[size].append(matmul_throughput(*shapes))
                    before = dict(sweep.work)
                    per_task[size][name].append(timed(lambda n=name, s=size: score(sweep, {n: tasks[n]}, s,
                                                                                   args.tokens), stack.device))
                    work.setdefault(size, {})[name] = {k: sweep.work[k] - before.get(k, 0) for k in sweep.work}
                seconds[size].append(sum(per_task[size][name][-1] for name in tasks))
                throughputs[size].append(matmul_throughput(*shapes))
                print(f"batch {size}: {n_requests / seconds[size][-1]:.3f} requests/s", file=sys.stderr)
        sync(stack.device)
    def median_throughput(measured: list[dict]) -> dict:
        return {kind: {"shape": measured[0][kind]["shape"],
                       "gflops_per_s": statistics.median(m[kind]["gflops_per_s"] for m in measured)}
                for kind in measured[0]}

    throughput = median_throughput([m for ms in throughputs.values() for m in ms])
    rows = []
    for size in sizes:
        beside = median_throughput(throughputs[size])  # the host's products between its tasks' runs

        def floor_of(flops: dict, t: dict = beside) -> float:  # seconds of these FLOPs at that throughput
            return (flops.get("layers", 0) / t["layer"]["gflops_per_s"]
                    + (flops.get("readouts", 0) + flops.get("estimators", 0)) / t["readout"]["gflops_per_s"]) / 1e9

        s = statistics.median(seconds[size])
        total = {k: sum(w.get(k, 0) for w in work[size].values()) for k in ("layers", "readouts", "estimators")}
        floor = floor_of(total)
        memory = None
        if not args.no_memory:
            child = subprocess.run([sys.executable, __file__, "--root", str(args.root), "--model", args.model,
                                    "--domain", args.domain, "--memory-of", str(size),
                                    *([] if args.params is None else ["--params", str(args.params.resolve())]),
                                    *(["--control"] if args.control else []),
                                    *([] if args.tokens is None else ["--tokens", str(args.tokens)]),
                                    *([] if args.per_task is None else ["--per-task", str(args.per_task)])],
                                   capture_output=True, text=True, check=True)
            memory = json.loads(child.stdout.strip().splitlines()[-1])["peak_gb"]
        rows.append({"batch": size, "seconds": s, "requests_per_s": n_requests / s,
                     "over_batch_1": statistics.median(seconds[1]) / s,
                     "per_task_s": {t: statistics.median(v) for t, v in per_task[size].items()},
                     "per_task_over_floor": {t: statistics.median(v) / floor_of(work[size][t])
                                             for t, v in per_task[size].items()},
                     "flops_per_request": {k: v / n_requests for k, v in total.items()},
                     "matmul_gflops_per_s": {k: v["gflops_per_s"] for k, v in beside.items()},
                     "floor_s": floor, "over_floor": s / floor, "peak_memory_gb": memory,
                     **({"check_against_batch_1": checks[size]} if size in checks else {})})
        print(f"batch {size}: {n_requests / s:.3f} requests/s ({rows[-1]['over_batch_1']:.2f}x batch 1), "
              f"{s / floor:.2f}x its FLOPs floor, peak {memory} GB", file=sys.stderr)
    write(args.out, {"model": args.model, "domain": args.domain, "params": str(args.params or "params.yaml"),
                     "control": args.control, "methods": len(sweep.methods) + len(sweep.replays),
                     "requests": {k: len(v) for k, v in tasks.items()}, "tokens_bound": args.tokens,
                     "reps": args.reps, "matmul_throughput": throughput,
                     "environment": environment(stack.device, stack.dtype), "results": rows,
                     "measured_at": time.strftime("%Y-%m-%d")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
