"""The host's share of a compiled decode step: per-token time of the compiled engine as CUDA runs it (probes
fused, graphs captured and replayed) with the graphs' device work taken out, on a CPU.

On a GPU a replayed graph costs the host a launch, and the rest of a step is the host's own work — the step's
bookkeeping, the small eager ops around the graphs, and any wait for the device. Where that work takes longer than
the device's, it sets the time per token. This benchmark measures it without a GPU: each captured graph's replay
does nothing (its outputs keep the values of its capture), so what is timed is everything but the layers, probes
and readouts. Decisions then never change, so only decoders whose path does not depend on them are timed: full
depth, fixed depth, and EMAD with probes that never exit (margin +inf: every probe runs every step).

Three step paths, side by side: ``graph-if`` (the device step as one graph per token, its later blocks in
conditional nodes: what CUDA ≥ 12.4 runs), ``graph-lookahead`` (the device step as graphs per block, each launched
before the previous block's flag is read: the fallback; every flag reads "a row still runs") and ``host`` (the host
step, whose bookkeeping reads the device at every probe: what ran before the device step).

Model: SmolLM2-135M's depth (30 layers) and vocabulary at a width of 64 (random weights), so that the eager ops
cost what their launches would; probes at every 3rd layer (10 a token). Per-token time is differenced: (time of
``--long`` new tokens − time of ``--short``) / (long − short); rounds alternate the decoders, medians over
``--reps``. Reports ms/token per decoder, µs of host time per probe ((probing − full) / probes a token) and the
step's reads of the device per token. Writes reports/bench/step_host.json.

The clock is the process's CPU time by default (``--clock cpu``, torch on one thread): the host's own work, which a
host shared with other jobs does not inflate as it does wall-clock time (``--clock wall``).

Usage: python benchmarks/bench_step_host.py [--batches 1,8] [--short 8] [--long 72] [--reps 5] [--clock cpu]
       [--paths ...]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_decode import PROMPTS, per_token_seconds, profile_of  # noqa: E402
from common import environment, write  # noqa: E402

from emad.decode import Method, generate  # noqa: E402
from emad.engine import compiled  # noqa: E402
from emad.engine.compiled import CompiledStack  # noqa: E402
from emad.engine.models import load_model  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.engine.step_graphs import Always  # noqa: E402
from emad.exits.criteria import Emad, Fixed, Full  # noqa: E402
from emad.exits.estimators import TopK  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
EVERY = 3  # probe every 3rd layer
PATHS = ("graph-if", "graph-lookahead", "host")
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}  # cpu: the process's own work, whatever else runs


class HostOnly(compiled._Graph):
    """A captured graph whose replay does no device work: its outputs keep the values of its capture."""

    def _record(self, fn):
        return fn(*self.inputs, *self.fixed)

    def replay(self) -> None:
        pass


class StepHostOnly:
    """A device step captured as one graph whose replay does no device work (its readout keeps its capture's)."""

    def __init__(self, program):
        program.run(Always())

    def replay(self) -> None:
        pass


def stack_as_on_cuda(base: LayerStack, path: str) -> CompiledStack:
    """``base`` on the compiled engine as CUDA runs it (probes fused, graphs replayed without device work), its steps
    on ``path``."""
    stack = CompiledStack(base, "aot_eager", fuse_probes=True, branches="lookahead" if path == "graph-lookahead"
                          else "if")
    stack.runner.graphs, stack.runner.capture, stack.runner.capture_step = True, HostOnly, StepHostOnly
    if path == "host":
        stack = copy.copy(stack)
        stack.device_steps = False
    return stack


def decoders(n_layers: int, profile) -> dict:
    return {"full": lambda: Method(Full()),
            "fixed-0.5L": lambda: Method(Fixed(n_layers // 2)),
            "emad-probes-exact": lambda: Method(Emad(profile, math.inf)),
            "emad-probes-topk": lambda: Method(Emad(profile, math.inf), "monotone", TopK(1024))}


def bench_path(stack, tokenizer, profile, batch: int, args) -> dict:
    prompts = [tokenizer(p)["input_ids"] for p in (PROMPTS * batch)[:batch]]
    runs = {name: (lambda new, m=m: generate(stack, tokenizer, prompts, m(), new, eos_token_ids=[]))
            for name, m in decoders(stack.n_layers, profile).items()}
    for run in runs.values():  # warm-up: compile, capture
        run(args.long)
    for program in stack.runner.programs.values():  # no replay runs a block: every flag stays "a row still runs"
        program.state.more.fill_(True)
    made = {name: run(args.short) for name, run in runs.items()}  # how each steps (path, reads)
    times = per_token_seconds(runs, args.short, args.long, args.reps, stack.device, clock=CLOCKS[args.clock])
    rows = {name: {"ms_per_token": 1e3 * statistics.median(ts), "step_path": made[name].step_path,
                   "host_reads_per_token": made[name].host_reads_per_step}
            for name, ts in times.items()}
    probes = len(profile.probe_layers)
    full = rows["full"]["ms_per_token"]
    for name, row in rows.items():
        row["time_ratio_to_full"] = row["ms_per_token"] / full
        if name.startswith("emad-probes"):
            row["host_us_per_probe"] = 1e3 * (row["ms_per_token"] - full) / probes
            row["host_reads_per_probe"] = (row["host_reads_per_token"] - rows["full"]["host_reads_per_token"]) / probes
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=72)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--clock", default="cpu", choices=tuple(CLOCKS),
                        help="cpu: the process's CPU time (one thread; robust where other work shares the host), "
                             "wall: wall-clock time")
    parser.add_argument("--out", default="step_host")
    args = parser.parse_args(argv)
    if not 1 <= args.short < args.long:
        parser.error(f"--short must be in 1..--long - 1 (--long {args.long}), got {args.short}")
    if args.clock == "cpu":
        torch.set_num_threads(1)  # the host's work is one thread's: its CPU time is its time
    paths = args.paths.split(",")
    if unknown := sorted(set(paths) - set(PATHS)):
        parser.error(f"--paths: unknown {unknown}; valid: {', '.join(PATHS)}")
    config = tf.LlamaConfig(**SHAPE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32").tokenizer
    base = LayerStack(model)
    profile = profile_of(base, tokenizer, EVERY)
    result = {"benchmark": "host time of a compiled decode step (graph replays without device work)",
              "model": {"random_weights": True, **SHAPE}, "environment": environment(base.device, base.dtype),
              "short": args.short, "long": args.long, "reps": args.reps, "clock": args.clock,
              "probes_per_token": len(profile.probe_layers), "batches": []}
    stacks = {path: stack_as_on_cuda(base, path) for path in paths}
    for batch in map(int, args.batches.split(",")):
        measured = {"batch": batch, "paths": {}}
        for path, stack in stacks.items():
            rows = measured["paths"][path] = bench_path(stack, tokenizer, profile, batch, args)
            for name, row in rows.items():
                extra = (f"  {row['host_us_per_probe']:6.1f} us/probe, {row['host_reads_per_probe']:.2f} reads/probe"
                         if "host_us_per_probe" in row else "")
                print(f"batch {batch} {path:15s} {name:18s} {row['ms_per_token']:7.3f} ms/token "
                      f"({row['time_ratio_to_full']:.2f}x full, {row['host_reads_per_token']:.1f} reads/token){extra}")
        result["batches"].append(measured)
    result["compile"] = next(iter(stacks.values())).runner.stats.as_dict()  # graphs captured (replayed without work)
    print(f"written to {write(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
