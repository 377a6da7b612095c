"""The compiled engine as it runs on CUDA — probes fused, segments and probes replayed as graphs — on a CPU: the
graph replays keep a CUDA graph's contract (:class:`ReplayedOnCPU`), so the CUDA path's bookkeeping is tested where
no GPU is."""

from __future__ import annotations

import pytest

from emad.engine import compiled
from emad.engine.compiled import CompiledStack
from emad.engine.stack import LayerStack


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
        fresh = self._fn(*self.inputs, *self.fixed)
        kept = self.output if isinstance(self.output, tuple) else (self.output,)
        for mine, new in zip(kept, fresh if isinstance(fresh, tuple) else (fresh,)):
            if mine is not None:
                mine.copy_(new)


def as_on_cuda(stack: LayerStack, backend: str) -> CompiledStack:
    """``stack`` on the compiled engine as CUDA runs it: probes fused, graphs captured and replayed on the CPU
    (:class:`ReplayedOnCPU`)."""
    out = CompiledStack(stack, backend, fuse_probes=True)
    out.runner.graphs, out.runner.capture = True, ReplayedOnCPU
    return out


def patch_engine_as_on_cuda(monkeypatch: pytest.MonkeyPatch, backend: str = "aot_eager") -> None:
    """Make ``decode.engine: compiled`` run as on CUDA, graphs replayed on the CPU."""
    from emad.engine import engines

    monkeypatch.setitem(engines.ENGINES, "compiled", lambda stack: as_on_cuda(stack, backend))
