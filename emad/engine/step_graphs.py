"""How a device step's program (:class:`~emad.decode.device_step.DeviceStep`) is taken: what answers its ``when any
row still runs`` before each later block.

- :class:`Immediate`: the host runs the blocks one by one and reads that flag before each (an eager stack, or a
  compiled one without graphs: on a CPU the read costs nothing).
- :class:`OneGraph` (``graph-if``): the whole step is one CUDA graph, launched once per token; each later block sits
  in a conditional IF node on the flag, which the device evaluates (CUDA ≥ 12.4: ``CUDAGraph.begin_capture_to_if_node``
  / ``end_capture_to_conditional_node``, bound from torch 2.12 on). The host reads nothing inside a step.
- :class:`Lookahead` (``graph-lookahead``): where conditional nodes are not available, each block is a graph of its
  own; block k+1 is launched before the flag block k left is read (a pinned, non-blocking copy and an event), so the
  device works while the host waits, and launching stops once the device says every row left (one block run in
  vain at most, its writes masked).

Graphs are captured (and the compiled pieces compiled) while no row is live, so warm-up and capture change no
state; a captured program reads its state, tables and the slab's buffers where they lie.
"""

from __future__ import annotations

import torch

_IF_SUPPORT: dict[int, str | None] = {}  # CUDA device index -> None (IF nodes work) or why not, tried once


def if_node_support() -> str | None:
    """None where CUDA graphs here hold conditional IF nodes, else the reason they do not: no CUDA device, a torch
    without the binding, CUDA before 12.4, or a test capture of one IF node that failed or misbehaved (the driver
    decides too, which no version number tells). The capture is tried once per process and device."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return f"torch {torch.__version__} has no CUDAGraph.begin_capture_to_if_node (torch >= 2.12 has)"
    version = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    if version < (12, 4):
        return f"CUDA {torch.version.cuda} < 12.4"
    device = torch.cuda.current_device()
    if device not in _IF_SUPPORT:
        _IF_SUPPORT[device] = _try_if_node()
    return _IF_SUPPORT[device]


def _try_if_node() -> str | None:
    """Capture ``x += 1`` inside an IF node and replay it with the predicate true, then false: None when ``x`` is 1,
    else what went wrong."""
    try:
        flag = torch.ones((), dtype=torch.bool, device="cuda")
        x = torch.zeros(1, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph.begin_capture_to_if_node(flag)
            x.add_(1)
            graph.end_capture_to_conditional_node()
        x.zero_()
        graph.replay()
        flag.fill_(False)
        graph.replay()
        torch.cuda.synchronize()
        got = float(x.item())
    except Exception as error:  # noqa: BLE001 - any failure means: no IF nodes here, and why
        return f"a test capture of an IF node failed: {type(error).__name__}: {error}"
    return None if got == 1.0 else f"a test IF node ran its body {got:g} times in two replays (one expected)"


def if_nodes_available() -> bool:
    """Whether CUDA graphs here hold conditional IF nodes (:func:`if_node_support`)."""
    return if_node_support() is None


class Always:
    """Takes every block without reading anything (warm-up before a capture: no row is live then)."""

    def when(self, pred: torch.Tensor, body) -> bool:
        body()
        return True


class Immediate:
    """Runs the program on the host's thread, reading before each later block whether a row still runs.

    Attributes:
        reads: host reads of the device so far; launches: graphs launched (none).
    """

    name = "immediate"
    launches = 0

    def __init__(self):
        self.reads = 0

    def when(self, pred: torch.Tensor, body) -> bool:
        self.reads += 1
        if not bool(pred):
            return False
        body()
        return True

    def run(self, program) -> None:
        program.run(self)


class CaptureIf:
    """Inside a capture: each later block in a conditional IF node on its flag (evaluated on the device)."""

    def __init__(self, graph):
        self.graph = graph

    def when(self, pred: torch.Tensor, body) -> bool:
        self.graph.begin_capture_to_if_node(pred)
        try:
            body()
        finally:
            self.graph.end_capture_to_conditional_node()
        return True


class StepGraph:
    """A whole step captured as one CUDA graph with conditional nodes (warmed up twice on a side stream first)."""

    def __init__(self, program):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                program.run(Always())
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.compiler.set_stance("fail_on_recompile"):
            program.run(CaptureIf(self.graph))

    def replay(self) -> None:
        self.graph.replay()


class OneGraph:
    """One graph launch per token (``graph-if``).

    Attributes:
        reads: host reads of the device (none); launches: graphs launched so far.
    """

    name = "graph-if"
    reads = 0

    def __init__(self, program, capture=StepGraph):
        self.graph = capture(program)
        self.launches = 0

    def run(self, program) -> None:
        self.graph.replay()
        self.launches += 1


class Flags:
    """Host copies of a program's ``more`` flags: posted after the block that computes one (a non-blocking copy into
    pinned memory and an event on CUDA), read when needed (waiting for that event only)."""

    def __init__(self, more: torch.Tensor):
        self.more = more
        cuda = more.device.type == "cuda"
        self.host = torch.zeros(len(more), dtype=torch.bool, pin_memory=cuda)
        self.events = [torch.cuda.Event() for _ in range(len(more))] if cuda else None

    def post(self, k: int) -> None:
        self.host[k].copy_(self.more[k], non_blocking=True)
        if self.events is not None:
            self.events[k].record()

    def read(self, k: int) -> bool:
        if self.events is not None:
            self.events[k].synchronize()
        return bool(self.host[k])


class Lookahead:
    """Graphs per block, block k+1 launched before block k's flag is read (``graph-lookahead``).

    Attributes:
        reads: host reads of the device so far (one per later block launched); launches: graphs launched so far.
    """

    name = "graph-lookahead"

    def __init__(self, program, capture):
        self.graphs = program.capture_blocks(capture)
        self.flags = Flags(program.state.more)
        self.reads = self.launches = 0

    def run(self, program) -> None:
        first, *blocks, finish = self.graphs
        first.replay()
        if blocks:
            self.flags.post(1)
        launched = 2  # the first block and the finish
        for k, graph in enumerate(blocks, start=1):
            graph.replay()  # before the flag that says whether it was needed is read
            launched += 1
            if k < len(blocks):
                self.flags.post(k + 1)
            self.reads += 1
            if not self.flags.read(k):
                break
        finish.replay()
        self.launches += launched


BRANCHES = {"if": OneGraph, "lookahead": Lookahead}  # how graphs take a step's blocks, by name
