"""Teacher-forced scoring: log-probabilities of a text at a fixed depth, or under a method's adaptive exits with
exactly the semantics of generation (same depths, same logits as if the generator had produced the text)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from emad.cost import CostModel
from emad.criteria import Criterion
from emad.decode.step import ContextLengthError, Method, as_method, left_pad, positions_of, prefill, step
from emad.stack import LayerStack


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
    logp = torch.log_softmax(stack.readout(h[0, :-1]).float(), dim=-1)  # [T-1, V]
    return logp.gather(-1, x[0, 1:, None]).squeeze(-1)


@dataclass
class Scored:
    """Per continuation token: log-probability, depth it was predicted at, and cost (FLOPs)."""

    logprobs: list[float]
    depths: list[int]
    flops: float
    full_flops: float

    @property
    def nll(self) -> float:
        return -sum(self.logprobs)

    @property
    def cost_ratio(self) -> float:
        return self.flops / self.full_flops if self.full_flops else 1.0


@torch.inference_mode()
def score_adaptive(stack: LayerStack, prompt: Sequence[int], continuation: Sequence[int],
                   method: Method | Criterion) -> Scored:
    """Score ``continuation`` after ``prompt`` with generation semantics.

    The prompt is prefilled exactly as :func:`~emad.decode.generate` does; continuation token t is predicted by the
    step that consumes token t-1, so depths and log-probabilities equal those of a generation that produced it.
    """
    method = as_method(method)
    method.validate(stack.n_layers)
    if not prompt or not continuation:
        raise ValueError("score_adaptive needs a non-empty prompt and continuation")
    _check_length(stack, len(prompt) + len(continuation))
    cost = CostModel.from_stack(stack)
    ids, real = left_pad([prompt], 0, stack.device)
    cache = stack.new_cache(1, len(prompt) + len(continuation))
    policy = method.new_policy(1, stack.n_layers, cost)
    depth0 = method.criterion.prefill_depth(stack.n_layers)
    logits = prefill(stack, cache, ids, real, depth0)[0]
    rows = torch.zeros(1, dtype=torch.long, device=stack.device)
    logprobs, depths, flops, full = [], [depth0], float(cost.readout_flops), float(cost.readout_flops)
    for t, token in enumerate(continuation):
        logprobs.append(float(torch.log_softmax(logits.float(), -1)[token]))
        if t == len(continuation) - 1:
            break
        position = torch.tensor([len(prompt) + t], device=stack.device)
        before = float(policy.extra.flops[0])
        out = step(stack, cache, method, policy, cost, torch.tensor([token], device=stack.device), position, rows)
        logits = out.logits[0]
        depth = int(out.depths[0])
        depths.append(depth)
        held = cache.valid[:depth, 0, : cache.n_slots].sum(-1).cpu()  # [depth] keys per layer run
        flops += float(sum(cost.layer_flops(i, int(n)) for i, n in enumerate(held)))
        flops += float(out.probe_flops[0]) + float(policy.extra.flops[0]) - before
        full += float(cost.full_depth(torch.tensor([len(prompt) + t + 1]))[0][0])
    return Scored(logprobs, depths, flops, full)
