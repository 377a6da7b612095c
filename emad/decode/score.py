"""Teacher-forced scoring: log-probabilities of a text at a fixed depth, or under a method's adaptive exits with
exactly the semantics of generation (same depths, same logits as if the generator had produced the text)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from emad.decode.results import Scored
from emad.decode.step import (
    ContextLengthError,
    Method,
    as_method,
    elapsed,
    left_pad,
    positions_of,
    prefill,
    reading,
    step,
)
from emad.decode.strategy import Strategy
from emad.engine.cache import KVCache
from emad.engine.cost import CostModel
from emad.engine.stack import LayerStack
from emad.exits.criteria import Criterion, ProbeView


@dataclass
class _Prompt:
    """A prompt prefilled once (as :func:`~emad.decode.generate` prefills it): its cache, cropped back to the prompt
    before each continuation, and the readout of its last position, which predicts a continuation's first token."""

    cache: KVCache
    logits: torch.Tensor  # [V]
    depth: int
    length: int

    @classmethod
    def prefill(cls, stack: LayerStack, prompt: Sequence[int], room: int, method: Method) -> _Prompt:
        ids, real = left_pad([prompt], 0, stack.device)
        cache = stack.new_cache(1, len(prompt) + room)
        depth = method.criterion.prefill_depth(stack.n_layers)
        return cls(cache, prefill(stack, cache, ids, real, depth)[0], depth, len(prompt))

    def fresh_cache(self) -> KVCache:
        self.cache.crop(self.length)
        return self.cache


def _check_length(stack: LayerStack, n: int) -> None:
    if stack.max_positions is not None and n > stack.max_positions:
        raise ContextLengthError(f"text of {n} tokens exceeds the model's context of {stack.max_positions} tokens")


@torch.inference_mode()
def score(stack: LayerStack, ids: Sequence[int], depth: int | None = None) -> torch.Tensor:
    """Teacher-forced log-probabilities of ``ids[1:]`` given their prefixes, reading out at ``depth`` (default L).

    Returns:
        ``[len(ids) - 1]`` float32 log-probabilities.
    """
    depth = stack.n_layers if depth is None else depth
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= stack.n_layers:
        raise ValueError(f"depth must be in 1..{stack.n_layers}, got {depth!r}")
    if len(ids) < 2:
        raise ValueError("scoring needs at least 2 tokens")
    _check_length(stack, len(ids))
    x, real = left_pad([ids], 0, stack.device)
    cache = stack.new_cache(1, x.shape[1])
    slots = cache.allocate(real)
    positions = positions_of(real)
    h = stack.run(stack.embed(x, positions), 0, depth, cache, positions, slots)
    logp = torch.log_softmax(stack.readout(h[0, :-1], depth).float(), dim=-1)  # [T-1, V]
    return logp.gather(-1, x[0, 1:, None]).squeeze(-1)


@torch.inference_mode()
def score_adaptive(stack: LayerStack, prompt: Sequence[int], continuation: Sequence[int],
                   method: Method | Criterion | Strategy, parallel: bool | None = None) -> Scored:
    """Score ``continuation`` after ``prompt`` with generation semantics.

    The prompt is prefilled exactly as :func:`~emad.decode.generate` does; continuation token t is predicted by the
    step that consumes token t-1, so depths and log-probabilities equal those of a generation that produced it.
    Under the ``monotone`` policy the positions still running at each layer form a prefix, so the continuation
    is scored with one parallel pass per layer (``parallel``, the default there); otherwise token by token.
    A :class:`Strategy` scores with its own semantics (:meth:`Strategy.score`).
    """
    return score_continuations(stack, prompt, [continuation], method, parallel)[0]


@torch.inference_mode()
def score_continuations(stack: LayerStack, prompt: Sequence[int], continuations: Sequence[Sequence[int]],
                        method: Method | Criterion | Strategy, parallel: bool | None = None) -> list[Scored]:
    """:func:`score_adaptive` of each continuation after the same prompt, with the prompt prefilled once.

    Between continuations the KV cache is cropped back to the prompt. A prompt's prefill is never charged to a
    :class:`Scored`, so each result equals its own :func:`score_adaptive` call; the prefill's time is counted in
    the first result's ``seconds``. A :class:`Strategy` scores each continuation alone.
    """
    started = time.perf_counter()
    stack = reading(stack, method)
    if not prompt or not continuations or not all(continuations):
        raise ValueError("score_adaptive needs a non-empty prompt and continuation")
    out = []
    if isinstance(method, Strategy):
        for continuation in continuations:
            out.append(method.score(stack, prompt, continuation))
            out[-1].seconds, started = elapsed(stack.device, started), time.perf_counter()
        return out
    method = as_method(method)
    method.validate(stack.n_layers)
    for continuation in continuations:
        _check_length(stack, len(prompt) + len(continuation) - 1)  # the last token is predicted, never read
    shared = _Prompt.prefill(stack, prompt, max(len(c) for c in continuations), method)
    for continuation in continuations:
        out.append(_score_adaptive(stack, shared, continuation, method, parallel))
        out[-1].seconds, started = elapsed(stack.device, started), time.perf_counter()
    return out


def _score_adaptive(stack: LayerStack, shared: _Prompt, continuation: Sequence[int], method: Method,
                    parallel: bool | None) -> Scored:
    if parallel is None:
        parallel = method.policy == "monotone" and not method.criterion.reads_every_exit
    if parallel:
        if method.policy != "monotone" or method.criterion.reads_every_exit:
            raise ValueError(f"parallel scoring needs the monotone policy and a criterion that reads exit tokens "
                             f"from the readout, not policy {method.policy!r} with {method.criterion.name!r}")
        return _score_monotone(stack, shared, continuation, method)
    cost = CostModel.from_stack(stack)
    cache, logits, depth0, n_prompt = shared.fresh_cache(), shared.logits, shared.depth, shared.length
    policy = method.new_policy(1, stack.n_layers, cost)
    rows = torch.zeros(1, dtype=torch.long, device=stack.device)
    logprobs, depths, flops, full = [], [depth0], cost.readout_at(depth0)[0], float(cost.readout_flops)
    greedy = []
    for t, token in enumerate(continuation):
        logprobs.append(float(torch.log_softmax(logits.float(), -1)[token]))
        greedy.append(int(logits.argmax()) == token)
        if t == len(continuation) - 1:
            break
        position = torch.tensor([n_prompt + t], device=stack.device)
        before = float(policy.extra.flops[0])
        out = step(stack, cache, method, policy, cost, torch.tensor([token], device=stack.device), position, rows)
        logits = out.logits[0]
        depth = int(out.depths[0])
        depths.append(depth)
        held = cache.valid[:depth, 0, : cache.n_slots].sum(-1).cpu()  # [depth] keys per layer run
        flops += float(sum(cost.layer_flops(i, int(n)) for i, n in enumerate(held)))
        flops += float(out.probe_flops[0]) + float(policy.extra.flops[0]) - before
        full += float(cost.full_depth(torch.tensor([n_prompt + t + 1]))[0][0])
    return Scored(logprobs, depths, flops, full, greedy=greedy)


def _score_monotone(stack: LayerStack, shared: _Prompt, continuation: Sequence[int], method: Method) -> Scored:
    """Monotone scoring, one pass per layer over the prefix of positions still running.

    At probe ℓ, if the first running position whose criterion passes is i*, then i* exits at ℓ and so must every
    later running position (their depth may not exceed i*'s: they are capped, as in generation); the prefix
    shrinks to ``[0, i*)``. The first position's cap is the prompt's depth, which is the deepest probe.
    Costs are charged as generation charges them: a probe for each position evaluated at that probe, and a
    readout for each exit the estimator did not already read out.
    """
    criterion, estimator = method.criterion, method.estimator
    cost = CostModel.from_stack(stack)
    device, n_prompt, m = stack.device, shared.length, len(continuation) - 1
    cache, first_logits, depth0 = shared.fresh_cache(), shared.logits, shared.depth
    probes = criterion.probes(stack.n_layers)
    assert depth0 == probes[-1], "monotone scoring assumes the prompt runs to the deepest probe"
    logprobs = [float(torch.log_softmax(first_logits.float(), -1)[continuation[0]])]
    greedy = [int(first_logits.argmax()) == continuation[0]]
    flops, full = cost.readout_at(depth0)[0], float(cost.readout_flops)
    if m == 0:  # a one-token continuation is read out of the prompt alone
        return Scored(logprobs, [depth0], flops, full, greedy=greedy)
    x = torch.tensor([list(continuation[:-1])], dtype=torch.long, device=device)  # [1, m] inputs
    positions = torch.arange(n_prompt, n_prompt + m, device=device)[None]  # [1, m]
    slots = cache.allocate(torch.ones_like(x, dtype=torch.bool))
    h = stack.embed(x, positions)  # [1, m, d]
    probe_flops, _ = estimator.probe_cost(cost)
    exit_logits = torch.empty(m, stack.vocab_size, dtype=stack.dtype, device=device)
    depth = torch.zeros(m, dtype=torch.long)
    charged = torch.zeros(m, dtype=torch.float64)
    first_conf = torch.ones(m, device=device)
    estimator.begin(m)
    criterion.begin(m)
    running, done = m, 0
    for k, probe in enumerate(probes):
        if running == 0:
            break
        h = stack.run(h[:, :running], done, probe, cache, positions[:, :running],
                      slice(slots.start, slots.start + running))
        done = probe
        first, passer = running, None  # first: the first position that passes here; passer: its exit logits
        if k < len(probes) - 1 and criterion.needs_estimate and criterion.wants_estimate(k, probe):
            est = estimator.estimate(stack, h[0], probe, torch.arange(running, device=device))
            if k == 0:
                first_conf[:running] = est.max_prob.float()
            view = ProbeView(probe, est.entropy, positions[0, :running], first_conf[:running], est.logits,
                             torch.arange(running, device=device))
            criterion.observe(view)
            if probe >= criterion.min_exit_layer:
                hits = criterion.exits(view).nonzero()
                first = int(hits[0]) if len(hits) else running
            upto = min(first + 1, running)  # the positions this probe was paid for (later ones are capped)
            charged[:upto] += (est.cost[0][:upto] if est.cost is not None else probe_flops) + cost.translation(probe)[0]
            if first < running:
                logits = criterion.exit_logits(view)
                passer = logits[first] if logits is not None else None
        elif k == len(probes) - 1:
            first = 0
        if first < running:
            capped = first
            if passer is not None:  # the passer reads its token from the probe; later positions are capped
                exit_logits[first] = passer.to(exit_logits.dtype)
                capped = first + 1
            if capped < running:
                exit_logits[capped:running] = stack.readout(h[0, capped:running], probe).to(exit_logits.dtype)
                charged[capped:running] += cost.readout_at(probe)[0]
            depth[first:running] = probe
        running = first
    targets = torch.tensor(continuation[1:], device=device)[:, None]
    logprobs += torch.log_softmax(exit_logits.float(), -1).gather(-1, targets)[:, 0].tolist()
    greedy += (exit_logits.argmax(-1) == targets[:, 0]).tolist()
    for i in range(m):
        keys = n_prompt + i + 1  # every earlier position ran at least as deep (monotone)
        flops += float(sum(cost.layer_flops(j, keys) for j in range(int(depth[i])))) + float(charged[i])
        full += float(cost.full_depth(torch.tensor([keys]))[0][0])
    return Scored(logprobs, [depth0, *depth.tolist()], flops, full, greedy=greedy)
