"""How decode steps run: ``eager`` (the HF layers one by one, growing caches) or ``compiled`` (segments between
probes compiled over static caches, CUDA graphs on CUDA: :mod:`emad.engine.compiled`); ``auto`` picks per device.

Both engines give the same tokens, depths and costs; the choice travels on the layer stack, so generation, the
tasks and the speed measure run unchanged on either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from emad.engine.compiled import CompiledStack
from emad.engine.stack import LayerStack

# device type -> the engine ``auto`` picks there. CUDA: compiled (eager pays the launch and Python overhead of every
# layer, ~10x HF's static-cache generate). CPU: eager. Compiled is faster per token there at full and fixed depth
# (0.84x at batch 1 on SmolLM2-135M, no gain where probes run) but each process compiles every layout it meets (44 s
# in benchmarks/bench_gpu_decode.py), more than a decode stage's short timed generations gain (docs/benchmarks.md).
AUTO: dict[str, str] = {"cuda": "compiled", "cpu": "eager"}

ENGINES: dict[str, Callable[[LayerStack], LayerStack]] = {
    "eager": lambda stack: stack,
    "compiled": CompiledStack,
}
CHOICES = ("auto", *ENGINES)


def check_engine(name: str, where: str = "decode.engine") -> str:
    """``name`` when it is an engine or ``auto``; else a ``ValueError`` naming ``where`` and the valid values."""
    if name not in CHOICES:
        raise ValueError(f"{where} must be one of {', '.join(CHOICES)}; got {name!r}")
    return name


def resolve_engine(name: str, device: torch.device | str) -> str:
    """The engine ``name`` stands for on ``device`` (``auto``: :data:`AUTO`, eager on a device type it does not
    name)."""
    check_engine(name)
    return AUTO.get(torch.device(device).type, "eager") if name == "auto" else name


def with_engine(stack: LayerStack, name: str = "auto") -> LayerStack:
    """``stack`` as the engine ``name`` runs it (on the stack's device for ``auto``)."""
    return ENGINES[resolve_engine(name, stack.device)](stack)


def compile_stats(stack: LayerStack) -> dict:
    """What compiling has cost ``stack``'s model in this process so far (compilations, graphs, seconds); empty for
    an eager stack."""
    runner = getattr(stack, "runner", None)
    return {} if runner is None else runner.stats.as_dict()
