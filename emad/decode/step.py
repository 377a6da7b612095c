"""Building blocks of the decode loop: methods, padding, ``prefill``, one adaptive ``step``, token choice."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from emad.decode.lanes import Lanes, on_device
from emad.engine.cache import KVCache
from emad.engine.cost import CostModel
from emad.engine.stack import LayerStack
from emad.exits.batching import BATCH_EXITS, check_batch_exit
from emad.exits.criteria import Criterion, ProbeView
from emad.exits.estimators import ESTIMATORS, Estimator
from emad.exits.policies import POLICIES, Policy
from emad.exits.readouts import Readout


def elapsed(device: torch.device, started: float) -> float:
    """Seconds since ``started`` (a ``time.perf_counter()`` value), after the device finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


class ContextLengthError(ValueError):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


@dataclass
class Sampling:
    """How the next token is chosen from the exit readout.

    Attributes:
        do_sample: False = greedy (argmax).
        temperature: softmax temperature (> 0) when sampling.
        top_p: nucleus mass in (0, 1] when sampling.
        seed: seed of the sampling generator (same seed, same output).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Method:
    """An operating point: exit criterion × KV policy × entropy estimator × readout, and the batch exit rule.

    Attributes:
        criterion: where tokens exit.
        policy: name of the KV-consistency policy (``monotone``, ``copy``, ``copy-translated``, ``backfill``).
        estimator: how Ĥ is computed at probes.
        readout: how a probe layer is read out (:mod:`emad.exits.readouts`); None reads through the stack's own.
        batch_exit: when the rows of a batch step leave (:mod:`emad.exits.batching`): ``per-row`` or ``sync``.
    """

    criterion: Criterion
    policy: str = "monotone"
    estimator: Estimator = field(default_factory=lambda: ESTIMATORS.get("exact")())
    readout: Readout | None = None
    batch_exit: str = "per-row"

    def __post_init__(self):
        POLICIES.get(self.policy)  # unknown names fail here, listing the valid ones
        check_batch_exit(self.batch_exit, self.policy)

    def validate(self, n_layers: int) -> None:
        self.criterion.validate(n_layers)
        check_pairing(self.criterion, type(self.estimator))

    def bind(self, stack: LayerStack, tokenizer) -> None:
        """Check that this method can run on ``stack`` (as :meth:`Strategy.bind` does), before any work."""
        self.validate(stack.n_layers)

    def new_policy(self, batch_size: int, n_layers: int, cost: CostModel) -> Policy:
        return POLICIES.get(self.policy)(batch_size, n_layers, self.criterion.prefill_depth(n_layers), cost)

    def describe(self) -> dict:
        readout = {} if self.readout is None else self.readout.describe()
        batch = {} if self.batch_exit == "per-row" else {"batch_exit": self.batch_exit}
        return {**self.criterion.describe(), "policy": self.policy, **self.estimator.describe(), **readout, **batch}


def reading(stack: LayerStack, method) -> LayerStack:
    """The stack that reads out through ``method``'s readout (a method or strategy without one: ``stack``)."""
    readout = getattr(method, "readout", None)
    return stack if readout is None else stack.with_readout(readout)


def check_pairing(criterion: Criterion, estimator: type[Estimator]) -> None:
    """Refuse a criterion that reads each probe's readout with an estimator that does not compute it."""
    if criterion.needs_logits and not estimator.gives_logits:
        able = ", ".join(n for n in ESTIMATORS.names() if ESTIMATORS.get(n).gives_logits)
        raise ValueError(f"method {criterion.name!r} reads each probe's readout: use an estimator that computes it "
                         f"({able}), not {estimator.name!r}")


def as_method(method: Method | Criterion) -> Method:
    """A bare criterion means: monotone policy, exact estimator."""
    return method if isinstance(method, Method) else Method(method)


@dataclass
class StepOutput:
    """What one decode step produced for the rows it ran (in the order of ``rows``).

    Attributes:
        logits: ``[b, V]`` readout at each row's exit layer.
        depths: ``[b]`` layers run.
        probe_flops, probe_bytes: ``[b]`` cost of the probes and the exit readout.
        entropies: ``[b, P]`` Ĥ seen at each probe (NaN where not probed).
        reasons: ``[b]`` exit reason code (see :data:`EXIT_REASONS`).
        allowed: ``[b]`` the first probe where each row may exit (its criterion passed, its cap or the last
            probe); below ``depths`` where the ``sync`` batch exit carried the row on.
        reads: copies from the device the step made (one per estimated probe).
    """

    logits: torch.Tensor
    depths: torch.Tensor
    probe_flops: torch.Tensor
    probe_bytes: torch.Tensor
    entropies: torch.Tensor
    reasons: torch.Tensor
    allowed: torch.Tensor
    reads: int = 0


EXIT_REASONS = ("criterion", "depth_cap", "last_probe", "carried")


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists: ids ``[B, T]`` and real-token mask ``[B, T]``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    real = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        real[i, width - len(p):] = True
    return ids.to(device), real.to(device)


def positions_of(real: torch.Tensor) -> torch.Tensor:
    """Position ids from a real-token mask ``[B, T]`` as HF computes them (padding gets position 1)."""
    pos = real.long().cumsum(-1) - 1
    return pos.masked_fill(~real, 1)


@torch.inference_mode()
def prefill_states(stack: LayerStack, cache: KVCache, ids: torch.Tensor, real: torch.Tensor,
                   depth: int) -> torch.Tensor:
    """Run the prompt ``[B, T]`` through layers 1..depth, filling the cache; return its last states ``[B, d]``."""
    slots = cache.allocate(real)
    positions = positions_of(real)
    h = stack.embed(ids, positions)  # [B, T, d]
    return stack.run(h, 0, depth, cache, positions, slots)[:, -1]


@torch.inference_mode()
def prefill(stack: LayerStack, cache: KVCache, ids: torch.Tensor, real: torch.Tensor, depth: int) -> torch.Tensor:
    """:func:`prefill_states`, read out: the prompt's last readout ``[B, V]``."""
    return stack.readout(prefill_states(stack, cache, ids, real, depth), depth)  # [B, V]


@torch.inference_mode()
def step(
    stack: LayerStack,
    cache: KVCache,
    method: Method,
    policy: Policy,
    cost: CostModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
) -> StepOutput:
    """Decode one token for ``rows``, each exiting where the criterion says, within the policy's depth cap; the
    method's batch exit rule decides whether rows that may exit leave at once (``per-row``) or together (``sync``).

    The device runs the layers, the estimates and the criterion; the host keeps the step's bookkeeping (which rows
    still run, their caps, depths, reasons, costs and entropies) and learns from the device once per estimated
    probe — the criterion's decisions and the entropies, in one copy — and never otherwise.

    Args:
        tokens: ``[b]`` the previous token of each row being run (on the model's device).
        positions: ``[b]`` its position id.
        rows: cache rows being run, LongTensor ``[b]`` (all B rows or a subset; best on the host).

    Returns:
        A :class:`StepOutput` for the b rows, in order (logits on the device, the rest on the host).
    """
    b, device = tokens.shape[0], tokens.device
    rows = rows.cpu()  # host bookkeeping; device tensors are indexed with it directly
    real = torch.zeros(cache.batch_size, 1, dtype=torch.bool, device=device)
    real[on_device(rows, device)] = True
    slots = cache.allocate(real, dense=b == cache.batch_size)
    pos = positions.to(device)[:, None]  # [b, 1]
    h = stack.embed(tokens[:, None], pos)  # [b, 1, d]
    criterion, estimator = method.criterion, method.estimator
    probes = criterion.probes(stack.n_layers)
    cap = policy.max_depth(rows)  # [b] on the host
    rule = BATCH_EXITS.get(method.batch_exit)()
    if rule.shares_depth and b > 1 and bool((cap != cap[0]).any()):
        raise RuntimeError(f"batch_exit {method.batch_exit!r}: policy {method.policy!r} capped the rows of one step "
                           f"at different layers {sorted(set(cap.tolist()))}; it cannot combine with this rule")
    out = StepOutput(
        logits=torch.empty(b, stack.vocab_size, dtype=stack.dtype, device=device),
        depths=torch.zeros(b, dtype=torch.long),
        probe_flops=torch.zeros(b, dtype=torch.float64), probe_bytes=torch.zeros(b, dtype=torch.float64),
        entropies=torch.full((b, len(probes)), float("nan")), reasons=torch.zeros(b, dtype=torch.long),
        allowed=torch.zeros(b, dtype=torch.long),
    )
    first_conf = torch.ones(b, device=device)
    active = torch.arange(b)  # host: indices into the b rows still running
    ready = torch.zeros(b, dtype=torch.bool)  # host, per running row: it may exit at an earlier probe
    estimator.begin(b)
    criterion.begin(b)
    done = 0
    lanes = Lanes.of(stack, cache, h, pos, rows, slots)
    for k, probe in enumerate(probes):
        policy.before_run(stack, cache, rows[active], done, probe)
        h = lanes.run(done, probe, active)  # [a, 1, d] the active rows' states after layer `probe`
        done = probe
        last = torch.full_like(active, k == len(probes) - 1, dtype=torch.bool)
        capped = cap[active] <= probe
        passed = torch.zeros_like(last)
        probe_logits = None  # [p, V] exit logits of the probed rows
        # rows whose depth is decided here are probed; capped rows exit without a probe (as they would alone), and
        # rows carried on by the batch exit rule are not probed again
        probing = torch.ones_like(last) if criterion.reads_every_exit else ~(last | capped | ready)
        if criterion.needs_estimate and criterion.wants_estimate(k, probe) and bool(probing.any()):
            passed[probing], probe_logits = _probe(lanes, method, cost, out, probing, active[probing], k, probe,
                                                   pos, first_conf)
            out.reads += 1
        allowed = passed | capped | last | ready
        newly = allowed & ~ready
        if bool(newly.any()):
            out.allowed[active[newly]] = probe  # first allowed here
        leave = rule.leaving(allowed)
        if not bool(leave.any()):  # every row runs on (the common case: no indexing)
            ready = allowed
            continue
        gone = active[leave]
        read = leave & ~probing if probe_logits is not None else leave  # rows read out afresh
        if probe_logits is not None:
            took = leave & probing
            out.logits[on_device(active[took], device)] = probe_logits[on_device(took[probing], device)].to(
                out.logits.dtype)
        if bool(read.any()):
            out.logits[on_device(active[read], device)] = _readout(lanes, read, probe, cost, out,
                                                           active[read]).to(out.logits.dtype)
        out.depths[gone] = probe
        code = torch.where(passed[leave], 0, torch.where(capped[leave], 1, 2))
        out.reasons[gone] = torch.where(ready[leave], 3, code)
        policy.after_exit(stack, cache, rows[gone], slots.start, h[on_device(leave, device)],
                          pos[on_device(gone, device), 0], probe)
        active, ready = active[~leave], allowed[~leave]
        lanes.keep(on_device(~leave, device))
        if len(active) == 0:
            break
    policy.record(rows, out.depths)
    return out


def _probe(lanes: Lanes, method: Method, cost: CostModel, out: StepOutput, probing: torch.Tensor,
           probed: torch.Tensor, k: int, probe: int, pos: torch.Tensor,
           first_conf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``k``-th probe (at layer ``probe``) of the active rows where ``probing`` is True, which are the step's
    rows ``probed`` (host indices): their estimate, charged to ``out``, seen by the criterion. The one host copy of
    the probe brings back the criterion's decisions and the entropies.

    Returns:
        ``(passed [p] on the host, exit logits [p, V] on the device or None)``.
    """
    criterion, estimator, device = method.criterion, method.estimator, pos.device
    there = on_device(probed, device)
    est = lanes.estimate(estimator, probe, probing, there)
    spent = est.cost or estimator.probe_cost(cost)
    moved = cost.translation(probe)  # the readout's T_ℓ, read before the estimator's head rows
    out.probe_flops[probed] += spent[0] + moved[0]
    out.probe_bytes[probed] += spent[1] + moved[1]
    if k == 0:
        first_conf[there] = est.max_prob.float()
    view = ProbeView(probe, est.entropy, pos[there, 0], first_conf[there], est.logits, there)
    criterion.observe(view)
    exits = criterion.exits(view) if probe >= criterion.min_exit_layer else torch.zeros_like(est.entropy, dtype=bool)
    host = torch.stack([exits.float(), est.entropy.float()]).cpu()  # [2, p]: the probe's one copy to the host
    out.entropies[probed, k] = host[1]
    return host[0].bool(), criterion.exit_logits(view)


def _readout(lanes: Lanes, reading: torch.Tensor, layer: int, cost: CostModel, out: StepOutput,
             gone: torch.Tensor) -> torch.Tensor:
    """The exit readout ``[r, V]`` at ``layer`` of the active rows where ``reading`` is True (the step rows ``gone``)
    when no estimator produced it (charged as one readout there)."""
    flops, bytes_ = cost.readout_at(layer)
    out.probe_flops[gone] += flops
    out.probe_bytes[gone] += bytes_
    return lanes.readout(layer, reading, gone)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from readout logits ``[b, V]``: argmax, or a temperature/top-p sample."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sampling.top_p  # the smallest prefix with mass >= top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
