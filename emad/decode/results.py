"""What decoding returns: :class:`Generation` (with a :class:`TokenTrace` per token) and :class:`Scored`.

Plain records shared by the decode loop, strategies and tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from emad.engine.cost import step_bound


@dataclass
class TokenTrace:
    """One generated token: depth, Ĥ at the probes it passed, why it exited, and its cost.

    ``allowed`` is the first layer where it could exit (its criterion passed, its depth cap or the last probe):
    ``depth`` unless the ``sync`` batch exit carried it deeper (reason ``carried``); None where a strategy made it.
    """

    token: int
    logprob: float
    depth: int
    entropies: dict[int, float]
    reason: str
    flops: float
    full_flops: float
    allowed: int | None = None


@dataclass
class Generation:
    """Generated continuations and their per-token trace.

    Attributes:
        token_ids: generated ids per row (prompt excluded; EOS included when produced).
        texts: decoded continuations, cut before the first stop string.
        depths: layers run per generated token, per row.
        flops, bytes: cost per generated token, per row (layers, probes, exit readout, policy work);
            ``full_flops``/``full_bytes`` the same tokens at full depth.
        policy_flops: FLOPs of policy work (backfill, K/V copy) per row; ``policy_events`` how often it fired.
        finish_reasons: "eos", "stop_string" or "length", per row.
        traces: per row, a :class:`TokenTrace` per token.
        seconds: wall-clock time of the call (device synchronised), prefill included.
        timed: False when the prompts' pass came from (or went to) a store of passes
            (:class:`~emad.decode.generate.Prefills`): ``seconds`` is then no speed measure.
        stats: counts a strategy reports, summed over rows (e.g. drafts proposed and accepted, large-model tokens).
        steps: per row, the decode step that produced each token (tokens of one step were decoded together); empty
            where rows were decoded one after another (every token its own step).
        prefill_seconds: of ``seconds``, the prompts' pass and first token (decode-only time: the rest).
        step_path: how the steps ran: ``host`` (the host step) or ``device/<executor>`` (the step's state on the
            device: ``immediate``, ``graph-if`` or ``graph-lookahead``, :mod:`emad.engine.step_graphs`); empty where
            a strategy decoded.
        host_reads: the step loop's reads of the device (records, flags, row picks), over ``decode_steps`` steps.
        graph_launches: graphs the device steps launched (None where not counted: the host step, strategies).
    """

    token_ids: list[list[int]]
    texts: list[str]
    depths: list[list[int]]
    flops: list[list[float]]
    bytes: list[list[float]]
    full_flops: list[list[float]]
    full_bytes: list[list[float]]
    finish_reasons: list[str]
    policy_flops: list[float] = field(default_factory=list)
    policy_token_layers: list[float] = field(default_factory=list)
    policy_events: list[float] = field(default_factory=list)
    traces: list[list[TokenTrace]] = field(default_factory=list)
    method: dict = field(default_factory=dict)
    seconds: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    steps: list[list[int]] = field(default_factory=list)
    timed: bool = True
    prefill_seconds: float = 0.0
    step_path: str = ""
    host_reads: int = 0
    decode_steps: int = 0
    graph_launches: int | None = None

    @property
    def host_reads_per_step(self) -> float | None:
        """Reads of the device per decode step (None without steps)."""
        return self.host_reads / self.decode_steps if self.decode_steps else None

    def cost_ratio(self, row: int | None = None, kind: str = "flops") -> float:
        """Cost of this generation over full depth for the same tokens (all rows, or one)."""
        rows = range(len(self.token_ids)) if row is None else [row]
        spent = sum(sum(getattr(self, kind)[r]) for r in rows)
        full = sum(sum(getattr(self, "full_" + kind)[r]) for r in rows)
        return spent / full if full else 1.0

    def unit_flops(self) -> list[list[float]]:
        """Per row (a task's unit): ``[FLOPs, full depth's FLOPs]`` of its tokens."""
        return [[sum(f), sum(ff)] for f, ff in zip(self.flops, self.full_flops)]

    def step_cost(self, kind: str = "flops") -> tuple[float, float]:
        """Numerator and denominator of the step ratio (:func:`emad.engine.cost.step_bound`): per step, the
        costliest running row's token, and the costliest at full depth, summed over steps."""
        spent = [c for row in getattr(self, kind) for c in row]
        full = [c for row in getattr(self, "full_" + kind) for c in row]
        steps = [s for row in self.steps for s in row] if self.steps else range(len(spent))
        return step_bound(spent, full, steps)

    def step_ratio(self, kind: str = "flops") -> float:
        """The step bound over full depth (all rows): what a batch step costs where it reads each layer once."""
        spent, full = self.step_cost(kind)
        return spent / full if full else 1.0

    def policy_share(self) -> float:
        """Share of all FLOPs spent on policy work (backfill or K/V copy)."""
        total = sum(sum(f) for f in self.flops)
        return sum(self.policy_flops) / total if total else 0.0



Request = tuple[list[int], list[list[int]]]  # a prompt and the continuations scored after it (teacher forced)


@dataclass
class Scored:
    """Per continuation token: log-probability, depth it was predicted at, and cost (FLOPs)."""

    logprobs: list[float]
    depths: list[int]
    flops: float
    full_flops: float
    seconds: float = 0.0
    greedy: list[bool] = field(default_factory=list)  # per token: is it the argmax of its exit readout

    @property
    def nll(self) -> float:
        return -sum(self.logprobs)

    @property
    def cost_ratio(self) -> float:
        return self.flops / self.full_flops if self.full_flops else 1.0
