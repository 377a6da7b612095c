"""What the compiled engine keeps of its compilations: a function captured as a CUDA graph (:class:`_Graph`) and the
counts of what compiling and capturing cost in a process (:class:`CompileStats`), with the fallbacks taken."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch


def _like(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its dispatch keys (an inference tensor's copy is one, a normal tensor's is not), so that a
    compiled function's guards accept the copy wherever they accepted ``x``."""
    with torch.inference_mode(x.is_inference()):
        return x.clone()


class _Graph:
    """One function captured as a CUDA graph: replays copy the inputs into the graph's own tensors and overwrite
    :attr:`output`.

    Args:
        fn: the compiled function, called as ``fn(*inputs, *fixed)``.
        inputs: tensors whose values change between replays (copied in at every replay).
        fixed: what is read where it lies (a slab's buffers, an estimator): its addresses never change.
    """

    def __init__(self, fn, inputs: tuple[torch.Tensor, ...], fixed: tuple, pool=None):
        self.inputs = tuple(_like(x) for x in inputs)
        self.fixed = fixed
        self.pool = pool
        self.output = self._record(fn)

    def _record(self, fn):
        """Capture ``fn`` on the graph's own inputs; its output (tensors the replays overwrite)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (lazy initialisation); its writes are the replay's own
            for _ in range(2):
                fn(*self.inputs, *self.fixed)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn(*self.inputs, *self.fixed)

    def replay(self) -> None:
        self.graph.replay()

    def __call__(self, *inputs: torch.Tensor):
        for mine, given in zip(self.inputs, inputs):
            mine.copy_(given)
        self.replay()
        return self.output


@dataclass
class CompileStats:
    """What compiling cost in this process: functions compiled, graphs captured and the seconds of both."""

    compilations: int = 0
    graphs: int = 0
    seconds: float = 0.0
    layouts: list[tuple] = field(default_factory=list)  # what was compiled: the keys of segments, pieces, probes
    fallbacks: list[str] = field(default_factory=list)  # where a step took a slower path than asked, and why

    def as_dict(self) -> dict:
        return {"compilations": self.compilations, "graphs": self.graphs, "compile_seconds": round(self.seconds, 3),
                "graph_fallbacks": list(self.fallbacks)}

    def fell_back(self, reason: str) -> None:
        """Record ``reason`` (once) and warn with it (once per process)."""
        if reason not in self.fallbacks:
            self.fallbacks.append(reason)
        if reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(reason, RuntimeWarning, stacklevel=3)


_WARNED: set[str] = set()  # fallback reasons warned about in this process
