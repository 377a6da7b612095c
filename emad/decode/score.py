"""Teacher-forced scoring: log-probabilities of a text at a fixed depth, or under a method's adaptive exits with
exactly the semantics of generation (same depths, same logits as if the generator had produced the text)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from emad.decode.monotone import first_scores, monotone_exits, scored_from_exits, target_scores
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
from emad.exits.criteria import Criterion


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


def check_context_length(stack: LayerStack, n: int) -> None:
    """Raises :class:`ContextLengthError` when a text of ``n`` tokens does not fit the model's context."""
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
    check_context_length(stack, len(ids))
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
        check_context_length(stack, len(prompt) + len(continuation) - 1)  # the last token is predicted, never read
    shared = _Prompt.prefill(stack, prompt, max(len(c) for c in continuations), method)
    for continuation in continuations:
        out.append(_score_adaptive(stack, shared, continuation, method, parallel))
        out[-1].seconds, started = elapsed(stack.device, started), time.perf_counter()
    return out


@torch.inference_mode()
def score_requests(stack: LayerStack, requests: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                   method: Method | Criterion | Strategy) -> list[list[Scored]]:
    """:func:`score_continuations` of every ``(prompt, continuations)`` request: ``[[Scored per continuation] per
    request]``. A method scored token by token (a policy other than ``monotone``, or a criterion that reads every
    exit) decodes every (prompt, continuation) pair as one row of a batch, as :func:`~emad.decode.generate` decodes
    prompts together (rows never affect each other), the continuation's tokens fed in place of the generated ones;
    the batch's time is counted in the first result's ``seconds``. Other methods score request by request."""
    if isinstance(method, Strategy) or not requests:
        return [score_continuations(stack, prompt, continuations, method) for prompt, continuations in requests]
    method = as_method(method)
    if method.policy == "monotone" and not method.criterion.reads_every_exit:
        return [score_continuations(stack, prompt, continuations, method) for prompt, continuations in requests]
    started = time.perf_counter()
    stack = reading(stack, method)
    method.validate(stack.n_layers)
    pairs = [(list(p), list(c)) for p, cs in requests for c in cs]
    for prompt, continuation in pairs:
        if not prompt or not continuation:
            raise ValueError("score_adaptive needs a non-empty prompt and continuation")
        check_context_length(stack, len(prompt) + len(continuation) - 1)
    flat = _score_batch(stack, pairs, method)
    flat[0].seconds = elapsed(stack.device, started)
    out, at = [], 0
    for _, continuations in requests:
        out.append(flat[at:at + len(continuations)])
        at += len(continuations)
    return out


def _score_batch(stack: LayerStack, pairs: list[tuple[list[int], list[int]]], method: Method) -> list[Scored]:
    """Token-by-token scoring of ``pairs`` (prompt, continuation) as the rows of one batch: each row's accounting
    is :func:`_score_adaptive`'s for that pair alone."""
    cost = CostModel.from_stack(stack)
    ids, real = left_pad([p for p, _ in pairs], 0, stack.device)
    batch, depth0 = len(pairs), method.criterion.prefill_depth(stack.n_layers)
    cache = stack.new_cache(batch, ids.shape[1] + max(len(c) for _, c in pairs))
    policy = method.new_policy(batch, stack.n_layers, cost)
    logits = prefill(stack, cache, ids, real, depth0).float()  # [B, V]
    n_prompt = [len(p) for p, _ in pairs]
    first = float(cost.readout_at(depth0)[0])
    logprobs, greedy = [[] for _ in pairs], [[] for _ in pairs]
    depths = [[depth0] for _ in pairs]
    flops, full = [first] * batch, [float(cost.readout_flops)] * batch
    alive = torch.arange(batch, device=stack.device)
    for t in range(max(len(c) for _, c in pairs)):
        rows = alive.tolist()
        tokens = torch.tensor([pairs[r][1][t] for r in rows], device=stack.device)  # [b]
        logp = torch.log_softmax(logits, -1)  # [b, V]
        best = logits.argmax(-1).tolist()
        for i, r in enumerate(rows):
            logprobs[r].append(float(logp[i, tokens[i]]))
            greedy[r].append(best[i] == int(tokens[i]))
        going = [i for i, r in enumerate(rows) if t < len(pairs[r][1]) - 1]  # rows with a token still to predict
        if not going:
            break
        keep = torch.tensor(going, device=stack.device)
        alive, tokens = alive[keep], tokens[keep]
        rows = alive.tolist()
        positions = torch.tensor([n_prompt[r] + t for r in rows], device=stack.device)  # [b]
        before = policy.extra.flops.clone()
        out = step(stack, cache, method, policy, cost, tokens, positions, alive)
        logits = out.logits.float()
        for i, r in enumerate(rows):
            depth = int(out.depths[i])
            depths[r].append(depth)
            held = cache.valid[:depth, r, : cache.n_slots].sum(-1).cpu()  # [depth] keys per layer run
            flops[r] += float(sum(cost.layer_flops(j, int(n)) for j, n in enumerate(held)))
            flops[r] += float(out.probe_flops[i]) + float(policy.extra.flops[r] - before[r])
            full[r] += float(cost.full_depth(torch.tensor([n_prompt[r] + t + 1]))[0][0])
    return [Scored(logprobs[r], depths[r], flops[r], full[r], greedy=greedy[r]) for r in range(batch)]


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


class _Incremental:
    """States of a continuation's running prefix, computed by running the stack on it probe after probe (each
    layer once for the positions still running); estimates from the method's own estimator."""

    def __init__(self, stack: LayerStack, cache: KVCache, continuation: Sequence[int], n_prompt: int,
                 estimator) -> None:
        m = len(continuation) - 1
        x = torch.tensor([list(continuation[:-1])], dtype=torch.long, device=stack.device)  # [1, m] inputs
        self.positions = torch.arange(n_prompt, n_prompt + m, device=stack.device)  # [m]
        self.targets = torch.tensor(list(continuation[1:]), dtype=torch.long, device=stack.device)  # [m]
        self.stack, self.cache, self.estimator, self.memo = stack, cache, estimator, None
        self.slots = cache.allocate(torch.ones_like(x, dtype=torch.bool))
        self.h = stack.embed(x, self.positions[None])  # [1, m, d]
        self.done = 0
        estimator.begin(m)

    def run_to(self, probe: int, live: torch.Tensor) -> None:
        running = int(live.sum())  # one continuation: its running prefix
        slots = slice(self.slots.start, self.slots.start + running)
        self.h = self.stack.run(self.h[:, :running], self.done, probe, self.cache, self.positions[None, :running],
                                slots)
        self.done = probe

    def estimate(self, k: int, probe: int, live: torch.Tensor):
        return self.estimator.estimate(self.stack, self.h[0], probe, torch.arange(self.h.shape[1],
                                                                                  device=self.stack.device))

    def exit_scores(self, probe: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = int(rows[0]), int(rows[-1]) + 1  # a contiguous range of the running prefix
        return target_scores(self.stack.readout(self.h[0, lo:hi], probe), self.targets[lo:hi])


def _score_monotone(stack: LayerStack, shared: _Prompt, continuation: Sequence[int], method: Method) -> Scored:
    """Monotone scoring, one pass per layer over the prefix of positions still running
    (:func:`emad.decode.monotone.monotone_exits`). The first position's cap is the prompt's depth, which is the
    deepest probe."""
    cost = CostModel.from_stack(stack)
    cache = shared.fresh_cache()
    assert shared.depth == method.criterion.probes(stack.n_layers)[-1], \
        "monotone scoring assumes the prompt runs to the deepest probe"
    exits = None
    if len(continuation) > 1:
        source = _Incremental(stack, cache, continuation, shared.length, method.estimator)
        exits = monotone_exits(method, source, source.targets, stack.n_layers, cost, stack.dtype)
    return scored_from_exits(continuation, first_scores(shared.logits), shared.depth, exits, cost, shared.length)
