"""What a probe of the compiled decode step computes, op by op, against the least its estimator needs.

A device step settles each probe in one compiled function (:func:`emad.decode.step_state.settle`): the estimate, the
criterion's test, the exit bookkeeping. On a GPU each op of it is a kernel before inductor fuses them, and the ones
that pass over the readout (``[B, V]``: 49,152 columns for SmolLM2) cost what the head's product costs to read. This
benchmark traces the settling of a middle probe (estimated, tested, neither the first nor the last) into aten ops
(dynamo + AOT autograd, as inductor receives them) and traces the minimum beside it — the final norm, the
estimator's own work from the head's input and the criterion's comparison — and counts, for each: every compute op,
matrix products, final norms (``rsqrt``), and passes over the vocabulary (ops with a ``V``-wide input or output).
What the probe adds beyond the minimum is its bookkeeping on ``[B]``-sized tensors; it should add no matrix product,
no norm and no pass over the vocabulary. Also: the last probe (not estimated: every row still running leaves there)
against a probe of full depth, which equal it.

Model: SmolLM2-135M's depth (30 layers) and vocabulary at a width of 64 (random weights), probes every 3rd layer.
Writes reports/bench/probe_kernels.json. Counting is exact (no timing): the numbers are the same on any host.

Usage: python benchmarks/bench_probe_kernels.py [--batches 1,8] [--layers 30] [--no-kernels] [--out probe_kernels]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_decode import profile_of  # noqa: E402
from bench_step_host import EVERY, SHAPE  # noqa: E402
from common import environment, write  # noqa: E402

from emad.decode import Method, generate  # noqa: E402
from emad.engine.compiled import CompiledStack  # noqa: E402
from emad.engine.random_models import ByteTokenizer  # noqa: E402
from emad.engine.stack import LayerStack  # noqa: E402
from emad.exits.criteria import Emad, Full, ProbeView  # noqa: E402
from emad.exits.estimators import Exact, LowRank, TopK  # noqa: E402

VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default,
         torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.default,
         torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.t.default,
         torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.alias.default,
         torch.ops.aten.detach.default}
MATMULS = {"mm", "addmm", "bmm", "matmul"}


class Traced:
    """A torch.compile backend that keeps each compiled function's aten graph (AOT autograd's forward graph) and
    runs it as it is; with ``kernels``, it also has inductor compile the captured graph (its cache off) and counts
    the kernels inductor generates for it (fused loops; matrix products are library calls besides)."""

    def __init__(self, kernels: bool = False):
        from torch._dynamo.backends.common import aot_autograd

        self.graphs: list[torch.fx.GraphModule] = []
        self.kernels: list[int | None] = []
        self.inductor = kernels
        self.backend = aot_autograd(fw_compiler=self._keep)

    def _keep(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def __call__(self, gm, example_inputs):
        self.kernels.append(generated_kernels(gm, example_inputs) if self.inductor else None)
        return self.backend(gm, example_inputs)


def generated_kernels(gm: torch.fx.GraphModule, example_inputs) -> int:
    """Kernels inductor generates for a graph dynamo captured (compiled afresh, on a copy: a cached graph would
    generate none)."""
    import copy

    from torch._inductor import config, metrics
    from torch._inductor.compile_fx import compile_fx

    before = metrics.generated_kernel_count
    with config.patch(fx_graph_cache=False, autotune_local_cache=False):
        compile_fx(copy.deepcopy(gm), example_inputs)
    return metrics.generated_kernel_count - before


def count(gm: torch.fx.GraphModule, vocab: int, kernels: int | None = None) -> dict:
    """Compute ops of an aten graph (views and metadata aside), matrix products, final norms (``rsqrt``) and passes
    over the vocabulary (ops with a ``vocab``-wide input or output), and the ops by name."""
    ops: Counter[str] = Counter()
    vocab_ops = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in VIEWS or not hasattr(node.target, "_schema"):
            continue
        name = node.target._schema.name.split("::")[-1]
        ops[name] += 1
        shapes = [a.meta["val"].shape for a in (*node.all_input_nodes, node)
                  if isinstance(a.meta.get("val"), torch.Tensor)]
        vocab_ops += any(len(s) and s[-1] == vocab for s in shapes)
    out = {"ops": sum(ops.values()), "matmuls": sum(n for k, n in ops.items() if k in MATMULS),
           "final_norms": ops["rsqrt"], "vocab_passes": vocab_ops}
    if kernels is not None:
        out["inductor_kernels"] = kernels
    return {**out, "by_op": dict(sorted(ops.items()))}


def traced_settles(base: LayerStack, tokenizer, method, batch: int, kernels: bool) -> dict:
    """Each compiled settling of ``method``'s step at ``batch`` rows, by probe shape (first, middle, last): its
    counted aten graph."""
    traced = Traced(kernels)
    stack = CompiledStack(base, traced, fuse_probes=True)
    prompts = [tokenizer("The history of the printing press begins")["input_ids"]] * batch
    generate(stack, tokenizer, prompts, method, 2, eos_token_ids=[])
    out = {}
    for layout, gm, kernels in zip(stack.runner.stats.layouts, traced.graphs, traced.kernels):
        if layout[0] == "settle":
            shape = layout[1]
            where = "first" if shape.first and not shape.last else "last" if shape.last else "middle"
            out[where] = count(gm, base.vocab_size, kernels)
    return out


@torch.inference_mode()
def traced_minimum(base: LayerStack, estimator, profile, batch: int, kernels: bool) -> dict:
    """The least a probe by ``estimator`` computes: the final norm, the estimator's estimate from the head's input,
    and the criterion's comparison (EMAD's strata and τ − margin), traced as the settling is."""
    traced = Traced(kernels)
    criterion = Emad(profile, 0.0)
    tables = criterion.tables(base.n_layers, base.device)
    h = torch.randn(batch, base.config.hidden_size)
    position = torch.full((batch,), 5)
    estimator.from_input(base, base.final_norm(h))  # its lazy tensors, made outside the trace

    def minimum(h, position, k, *values):
        est = estimator.from_input(base, base.final_norm(h))
        view = ProbeView(0, est.entropy, position, est.max_prob, est.logits)
        return criterion.test(view, dict(zip(tables, values)), k), est.entropy

    torch.compile(minimum, fullgraph=True, dynamic=False, backend=traced)(h, position, torch.tensor([1]),
                                                                        *tables.values())
    return count(traced.graphs[-1], base.vocab_size, traced.kernels[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="at least 3 probes: >= 7")
    parser.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="also count the kernels inductor generates (compiles each graph: minutes on a CPU)")
    parser.add_argument("--out", default="probe_kernels")
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        parser.error(f"--batches must be positive integers separated by commas, got {args.batches!r}")
    if args.layers < 2 * EVERY + 1:
        parser.error(f"--layers must be at least {2 * EVERY + 1} (a first, a middle and a last probe), got "
                     f"{args.layers}")
    shape = {**SHAPE, "num_hidden_layers": args.layers}
    config = tf.LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = LayerStack(tf.LlamaForCausalLM(config).eval())
    tokenizer = ByteTokenizer(config.vocab_size)
    profile = profile_of(base, tokenizer, EVERY)
    estimators = {"exact": Exact, "topk": lambda: TopK(1024), "lowrank": lambda: LowRank(32)}
    result = {"benchmark": "aten ops of a compiled probe against the least its estimator needs",
              "model": {"random_weights": True, **shape}, "environment": environment(base.device, base.dtype),
              "probes_per_token": len(profile.probe_layers), "batches": []}
    for batch in batches:
        rows: dict = {"batch": batch, "estimators": {}}
        full = traced_settles(base, tokenizer, Method(Full()), batch, args.kernels)["last"]
        for name, make in estimators.items():
            settles = traced_settles(base, tokenizer, Method(Emad(profile, math.inf), "monotone", make()), batch,
                                     args.kernels)
            least = traced_minimum(base, make(), profile, batch, args.kernels)
            probe = settles["middle"]
            rows["estimators"][name] = {
                "probe": probe, "minimum": least,
                "added": {k: probe[k] - least[k] for k in ("ops", "matmuls", "final_norms", "vocab_passes",
                                                          "inductor_kernels") if k in probe},
                "last_probe": settles["last"], "last_probe_equals_full_depth": settles["last"] == full}
            added = rows["estimators"][name]["added"]
            kernels = (f"; inductor kernels {probe['inductor_kernels']} against {least['inductor_kernels']}"
                       if "inductor_kernels" in probe else "")
            print(f"batch {batch} {name:8s} probe {probe['ops']:3d} ops ({probe['matmuls']} matmul, "
                  f"{probe['final_norms']} norm, {probe['vocab_passes']} vocab passes); minimum {least['ops']:3d}; "
                  f"added {added['ops']} ops, {added['matmuls']} matmul, {added['final_norms']} norm, "
                  f"{added['vocab_passes']} vocab passes{kernels}")
        rows["full_depth_probe"] = full
        result["batches"].append(rows)
    print(f"written to {write(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
