"""The compiled engine as it runs on CUDA — probes fused, segments and probes replayed as graphs, a device step as one
graph with conditional nodes or as graphs per block — on a CPU: the graph replays keep a CUDA graph's contract
(:class:`ReplayedOnCPU`, :class:`StepReplayedOnCPU`), so the CUDA path's bookkeeping is tested where no GPU is."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from torch.utils._python_dispatch import _disable_current_modes

from emad.engine import compiled
from emad.engine.compiled import CompiledStack
from emad.engine.stack import LayerStack
from emad.engine.step_graphs import Always

DEVICE_SIDE = [0]  # > 0 while an emulated replay does what the device would do (host-read counters skip it)


@contextmanager
def device_side():
    """The work inside is the device's (an emulated graph replay), not the host's: dispatch modes that watch the
    host (counters) are set aside for it."""
    DEVICE_SIDE[0] += 1
    try:
        with _disable_current_modes():
            yield
    finally:
        DEVICE_SIDE[0] -= 1


class ReplayedOnCPU(compiled._Graph):
    """A CUDA graph's contract, kept on a CPU: capture runs the function once on the graph's own copies of the inputs
    and keeps its output tensors; a replay reruns it on those same input tensors and on the fixed tensors as they
    were at capture, and overwrites the kept outputs in place. A caller that hands in tensors without copying them,
    reads an output after the next replay of the same graph, or moves a buffer a graph captured gets other numbers
    than the eager engine, as it would from a real graph. The copies' dispatch keys are checked as on CUDA: a copy
    the compiled function's guards refuse is a recompile, refused inside a capture."""

    replays = 0

    def _record(self, fn):
        self._fn = fn
        return fn(*self.inputs, *self.fixed)  # `fixed` holds a slab's buffers as they are now (its list sliced)

    def replay(self) -> None:
        ReplayedOnCPU.replays += 1
        with device_side():
            fresh = self._fn(*self.inputs, *self.fixed)
            kept = self.output if isinstance(self.output, tuple) else (self.output,)
            for mine, new in zip(kept, fresh if isinstance(fresh, tuple) else (fresh,)):
                if mine is not None:
                    mine.copy_(new)


class Conditional:
    """A conditional IF node as the device takes it at replay: its predicate is read then, and a false one skips the
    body, whose buffers keep what they held."""

    def when(self, pred, body) -> bool:
        if not bool(pred):
            return False
        body()
        return True


class StepReplayedOnCPU:
    """A device step captured as one graph with conditional nodes, kept on a CPU: the capture runs the program once
    with every body taken (the warm-up a capture needs; no row is live then) and keeps its exit readout; a replay
    reruns the program, each later block only where its predicate holds at replay, and overwrites the kept readout."""

    replays = 0

    def __init__(self, program):
        program.run(Always())
        self.program, self.output = program, program.logits

    def replay(self) -> None:
        StepReplayedOnCPU.replays += 1
        with device_side():
            self.program.run(Conditional())
            self.output.copy_(self.program.logits)
        self.program.logits = self.output


def as_on_cuda(stack: LayerStack, backend: str, branches: str = "if") -> CompiledStack:
    """``stack`` on the compiled engine as CUDA runs it: probes fused, graphs captured and replayed on the CPU
    (:class:`ReplayedOnCPU`), device steps as one graph with conditional nodes (``branches`` ``if``:
    :class:`StepReplayedOnCPU`) or graphs per block with lookahead (``lookahead``)."""
    out = CompiledStack(stack, backend, fuse_probes=True, branches=branches)
    out.runner.graphs, out.runner.capture, out.runner.capture_step = True, ReplayedOnCPU, StepReplayedOnCPU
    return out


def patch_engine_as_on_cuda(monkeypatch: pytest.MonkeyPatch, backend: str = "aot_eager") -> None:
    """Make ``decode.engine: compiled`` run as on CUDA, graphs replayed on the CPU."""
    from emad.engine import engines

    monkeypatch.setitem(engines.ENGINES, "compiled", lambda stack: as_on_cuda(stack, backend))
