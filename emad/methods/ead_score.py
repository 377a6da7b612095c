"""Teacher-forced scoring of EAD with a :class:`~emad.methods.ead.SelfPair` from one full-depth pass, exactly.

Under teacher forcing with a self pair, every hidden state EAD computes equals the full-depth pass's over
prompt + continuation: layers 1..k are causal and run on the same tokens whichever model ran them (they share one
cache), and layers k+1..L of a slot are only ever computed (in the prefill, or in a catch-up fused with the pending
token) once every earlier slot has them, from the same ``h_k``, so they equal the full pass's too. Hence the small
model's readout at a position is the readout at layer k of the full pass's state there, the large model's the
readout at L. The switching decisions depend only on the entropies of those readouts (a scalar loop over the
:class:`~emad.methods.ead.Switcher`), and every cost depends only on the sequence of decisions, charged by the same
function :meth:`SelfPair.advance` charges with (:func:`charge_self_pair`).

So :func:`replay_self_pair` runs one pass over prompt + continuation[:-1] keeping ``h_k`` and ``h_L``, reads out at
k and at L once over all positions that predict a continuation token (in chunks, through the stack's readout: a
tuned readout translates at k exactly as the token-by-token path does), and replays the loop on scalars. Its
:class:`~emad.methods.common.RowRecord` equals the token-by-token one (:meth:`EAD.teacher_forced` with
``stepwise=True``) up to float rounding of the hidden states: depths, greedy hits and costs are identical as long
as no rolling mean lies within rounding of τ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from emad.engine.cost import CostModel
from emad.engine.entropy import readout_summary
from emad.engine.stack import LayerStack
from emad.methods.common import RowRecord, feed, full_cost, pass_cost

CHUNK = 128  # positions read out together: bounds the [chunk, V] fp32 logits held at once


def charge_self_pair(cost: CostModel, k: int, n_layers: int, side: str, upper: int, first: int,
                     q: int) -> tuple[float, float, float, float]:
    """What one :meth:`SelfPair.advance` costs: ``side`` feeds the ``q`` tokens of slots ``first..`` (the pending
    one last) and reads out once; the large side first catches up layers k+1..L of slots ``upper..first-1``, which
    only the small side ran, fused with them.

    Returns:
        (FLOPs, bytes, catch-up FLOPs, catch-up token-layers), the catch-up included in the FLOPs.
    """
    if side == "small":
        flops, bytes_ = pass_cost(cost, 0, k, first, q, 1)
        return flops, bytes_, 0.0, 0.0
    lower = pass_cost(cost, 0, k, first, q, 0)
    missed = first - upper
    top = pass_cost(cost, k, n_layers, upper, missed + q, 1)
    catchup = pass_cost(cost, k, n_layers, upper, missed, 0)[0]
    return lower[0] + top[0], lower[1] + top[1], catchup, float(missed * (n_layers - k))


def _summaries(stack: LayerStack, h: torch.Tensor, depth: int,
               targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position, the readout at ``depth`` of ``h`` ``[n, d]``: its entropy (fp32, as ``readout_summary``), the
    target's fp32 log-probability and whether the target is the argmax (``[n]`` each)."""
    entropy, logprob, greedy = [], [], []
    for lo in range(0, h.shape[0], CHUNK):
        logits = stack.readout(h[lo:lo + CHUNK], depth)  # [c, V]
        t = targets[lo:lo + CHUNK, None]  # [c, 1]
        entropy.append(readout_summary(logits)[0])
        logprob.append(torch.log_softmax(logits.float(), -1).gather(-1, t)[:, 0])
        greedy.append(logits.argmax(-1) == t[:, 0])
    return torch.cat(entropy), torch.cat(logprob), torch.cat(greedy)


def replay_self_pair(stack: LayerStack, k: int, switcher, prompt: Sequence[int],
                     continuation: Sequence[int]) -> RowRecord:
    """The record of EAD (a self pair of ``k`` layers, ``switcher`` reset here) forced through ``continuation``
    after ``prompt``, from one full-depth pass (see the module docstring).

    Args:
        stack: the target, reading out through the strategy's readout.
        k: the small model's layers.
        switcher: the strategy's :class:`~emad.methods.ead.Switcher` (its rule decides; it is left as after the
            last token).
        prompt, continuation: non-empty token lists.
    """
    n_prompt, n_layers = len(prompt), stack.n_layers
    seq = [*prompt, *continuation[:-1]]
    cache = stack.new_cache(1, len(seq))
    h_k = feed(stack, cache, seq, k)  # [1, T, d]
    pos = torch.arange(len(seq), device=stack.device)[None]  # [1, T]
    h_L = stack.run(h_k, k, n_layers, cache, pos, slice(0, len(seq)))  # [1, T, d]
    targets = torch.tensor(list(continuation), dtype=torch.long, device=stack.device)  # [n]
    read = {"small": _summaries(stack, h_k[0, n_prompt - 1:], k, targets),  # position P-1+j predicts token j
            "large": _summaries(stack, h_L[0, n_prompt - 1:], n_layers, targets)}
    read = {side: tuple(x.tolist() for x in values) for side, values in read.items()}
    return replay_reads(CostModel.from_stack(stack), k, n_layers, switcher, n_prompt, continuation, read)


def replay_reads(cost: CostModel, k: int, n_layers: int, switcher, n_prompt: int, continuation: Sequence[int],
                 read: dict[str, tuple[list[float], list[float], list[bool]]]) -> RowRecord:
    """The record of EAD (a self pair of ``k`` layers, ``switcher`` reset here) forced through ``continuation``
    after a prompt of ``n_prompt`` tokens, from ``read``: per side (``small``: the readout at k, ``large``: at L),
    the entropy, the target's log-probability and greedy hit of each position that predicts a continuation token
    (:func:`replay_self_pair` reads them from its own pass; a sweep from its shared one)."""
    n = len(continuation)
    depth_of = {"small": k, "large": n_layers}
    row, tokens = RowRecord(), {"small": 0, "large": 0}
    switcher.reset()
    upper = n_prompt  # slots that hold layers k+1..L (the prompt's, after the prefill)
    for j, token in enumerate(continuation):
        side = switcher.current
        depth = depth_of[side]
        if j == 0:  # read out of the prefill
            flops, bytes_, catchup, catchup_layers = *cost.readout_at(depth), 0.0, 0.0
        else:  # advance feeds token j-1 into slot P+j-1
            first = n_prompt + j - 1
            flops, bytes_, catchup, catchup_layers = charge_self_pair(cost, k, n_layers, side, upper, first, 1)
            if side == "large":
                upper = first + 1
        entropy, logprob, greedy = (x[j] for x in read[side])
        row.ids.append(int(token))
        row.logprobs.append(logprob)
        row.greedy.append(greedy)
        row.depths.append(depth)
        row.flops.append(flops)
        row.bytes.append(bytes_)
        row.entropies.append({depth: entropy})
        row.reasons.append(side)
        row.extra_flops += catchup
        row.extra_token_layers += catchup_layers
        tokens[side] += 1
        switcher.observe(entropy)
    row.full_flops, row.full_bytes = full_cost(cost, n_prompt, n)
    row.extra_events = float(switcher.switches)
    row.stats = {"ead_tokens": float(n), "large_tokens": float(tokens["large"]),
                 "small_tokens": float(tokens["small"]), "switches": float(switcher.switches)}
    return row
