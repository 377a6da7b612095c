"""How decode steps run: ``eager`` (the HF layers one by one, growing caches) or ``compiled`` (segments between
probes compiled over static caches, CUDA graphs on CUDA: :mod:`emad.engine.compiled`); ``auto`` picks per device.

On CUDA a compiled step whose state lives on the device is one graph per token with conditional nodes where CUDA has
them, else graphs per block taken with one block of lookahead (:mod:`emad.engine.step_graphs`); ``compiled-if`` and
``compiled-lookahead`` ask for one of the two (refused, naming what is available, where it cannot run).

Every engine gives the same tokens, depths and costs; the choice travels on the layer stack, so generation, the
tasks and the speed measure run unchanged on any.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from emad.engine.compiled import CompiledStack
from emad.engine.stack import LayerStack
from emad.engine.step_graphs import if_nodes_available

# device type -> the engine ``auto`` picks there. CUDA: compiled (eager pays the launch and Python overhead of every
# layer, ~10x HF's static-cache generate). CPU: eager. Compiled is faster per token there at full and fixed depth
# (0.84x at batch 1 on SmolLM2-135M, no gain where probes run) but each process compiles every layout it meets (44 s
# in benchmarks/bench_gpu_decode.py), more than a decode stage's short timed generations gain (docs/benchmarks.md).
AUTO: dict[str, str] = {"cuda": "compiled", "cpu": "eager"}

ENGINES: dict[str, Callable[[LayerStack], LayerStack]] = {
    "eager": lambda stack: stack,
    "compiled": CompiledStack,
    "compiled-if": lambda stack: CompiledStack(stack, branches="if"),
    "compiled-lookahead": lambda stack: CompiledStack(stack, branches="lookahead"),
}
CHOICES = ("auto", *ENGINES)

# engine -> (whether it can run on a device, what it needs): the forced graph paths
NEEDS: dict[str, tuple[Callable[[torch.device], bool], str]] = {
    "compiled-if": (lambda device: device.type == "cuda" and if_nodes_available(),
                    "CUDA graphs with conditional nodes (a CUDA device, CUDA >= 12.4 and torch's "
                    "CUDAGraph.begin_capture_to_if_node)"),
    "compiled-lookahead": (lambda device: device.type == "cuda", "CUDA graphs (a CUDA device)"),
}


def available(device: torch.device | str) -> list[str]:
    """The engine names that can run on ``device``."""
    device = torch.device(device)
    return [name for name in CHOICES if name not in NEEDS or NEEDS[name][0](device)]


def check_engine(name: str, where: str = "decode.engine") -> str:
    """``name`` when it is an engine or ``auto``; else a ``ValueError`` naming ``where`` and the valid values."""
    if name not in CHOICES:
        raise ValueError(f"{where} must be one of {', '.join(CHOICES)}; got {name!r}")
    return name


def resolve_engine(name: str, device: torch.device | str) -> str:
    """The engine ``name`` stands for on ``device`` (``auto``: :data:`AUTO`, eager on a device type it does not
    name).

    Raises:
        ValueError: ``name`` is unknown, or a graph path that cannot run on ``device`` (naming what it needs and the
            engines available there).
    """
    check_engine(name)
    device = torch.device(device)
    if name in NEEDS and not NEEDS[name][0](device):
        raise ValueError(f"decode.engine {name!r} needs {NEEDS[name][1]}, which {device.type} here does not have; "
                         f"available here: {', '.join(available(device))}")
    return AUTO.get(device.type, "eager") if name == "auto" else name


def with_engine(stack: LayerStack, name: str = "auto") -> LayerStack:
    """``stack`` as the engine ``name`` runs it (on the stack's device for ``auto``)."""
    return ENGINES[resolve_engine(name, stack.device)](stack)


def compile_stats(stack: LayerStack) -> dict:
    """What compiling has cost ``stack``'s model in this process so far (compilations, graphs, seconds); empty for
    an eager stack."""
    runner = getattr(stack, "runner", None)
    return {} if runner is None else runner.stats.as_dict()
