"""Speculative decoding on the layer stack: a drafter proposes up to N tokens, the target verifies them in one pass.

One round, with ``n`` committed tokens in the target cache and the pending token ``x`` (chosen, not yet run):

1. draft: the drafter proposes ``d_1..d_k`` (``k ≤ N``, fewer when the draft-length policy stops early or the
   token budget ends), each from its distribution ``q_j`` for position ``n+j``;
2. verify: the target runs ``x, d_1..d_k`` (slots ``n..n+k``) in one multi-token pass, giving ``p_1..p_{k+1}``;
3. accept: greedy keeps drafts while they equal the target's argmax and replaces the first mismatch by it;
   sampling accepts ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``, else samples the replacement from
   ``norm(max(0, p_j − q_j))``; when all ``k`` are accepted the bonus token comes from ``p_{k+1}``;
4. crop: with ``i`` accepted, slots ``0..n+i`` stay in both caches and the rest is cropped; the replacement (or
   bonus) token becomes pending.

Greedy output is identical to the target's own greedy output; sampled output follows the target's distribution
(temperature and top-p are applied to ``p`` and ``q`` alike). Batch size 1: one prompt per call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from emad.decode import cut_at_stop, default_eos_ids
from emad.decode.step import Sampling, choose, elapsed, prefill
from emad.engine.cache import KVCache
from emad.engine.cost import CostModel
from emad.engine.stack import LayerStack
from emad.methods.common import check_context, extend, pass_cost
from emad.methods.drafting import Drafter, DraftPolicy, Static, Tally


@dataclass
class SpeculativeResult:
    """Generated tokens and the statistics of one speculative generation.

    Attributes:
        token_ids: generated ids (prompt excluded; EOS included when produced).
        text: decoded continuation, cut before the first stop string.
        finish_reason: "eos", "stop_string" or "length".
        logprobs: per token, its log-probability under the target's readout (before temperature).
        draft_lengths: drafts proposed in each verification round.
        accepted_lengths: drafts accepted in each verification round.
        drafter_flops, drafter_bytes: drafter work after the prompt (layers and readouts).
        target_flops, target_bytes: target work after the prompt (the prompt's last readout, verify passes).
        full_flops, full_bytes: the target alone generating the same tokens at full depth.
        seconds: wall-clock time of the call (device synchronised), prefill included.
        method: drafter, draft-length policy and sampling parameters.
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    drafter_flops: float = 0.0
    drafter_bytes: float = 0.0
    target_flops: float = 0.0
    target_bytes: float = 0.0
    full_flops: float = 0.0
    full_bytes: float = 0.0
    seconds: float = 0.0
    method: dict = field(default_factory=dict)

    @property
    def drafted(self) -> int:
        """Draft tokens proposed."""
        return sum(self.draft_lengths)

    @property
    def accepted(self) -> int:
        """Draft tokens accepted."""
        return sum(self.accepted_lengths)

    @property
    def verifications(self) -> int:
        """Target verify passes."""
        return len(self.draft_lengths)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts (0 when none were proposed)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per verification (each verification also yields one target token)."""
        return self.accepted / self.verifications if self.verifications else 0.0

    @property
    def target_passes_per_token(self) -> float:
        """Verify passes per token they produced (every token but the first, which the prompt's readout gives);
        1.0 for the target alone."""
        return self.verifications / (len(self.token_ids) - 1) if len(self.token_ids) > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else 0.0

    def cost_ratio(self, kind: str = "flops") -> float:
        """(drafter + target) cost over the target alone at full depth for the same tokens (FLOPs or bytes)."""
        spent = getattr(self, f"drafter_{kind}") + getattr(self, f"target_{kind}")
        full = getattr(self, f"full_{kind}")
        return spent / full if full else 1.0

    def summary(self) -> dict:
        """The statistics as a flat dict (for JSON and MLflow)."""
        return {
            **self.method, "tokens": len(self.token_ids), "drafted": self.drafted, "accepted": self.accepted,
            "verifications": self.verifications, "acceptance_rate": self.acceptance_rate,
            "mean_accepted_per_verification": self.mean_accepted,
            "target_passes_per_token": self.target_passes_per_token, "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s, "flops_ratio": self.cost_ratio(),
            "bytes_ratio": self.cost_ratio("bytes"),
        }


# ---------------------------------------------------------------------------------------------- acceptance
def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution :func:`~emad.decode.step.choose` samples from: softmax(logits / T), restricted to the
    top-p nucleus and renormalised; ``[..., V]`` → ``[..., V]`` float32."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sampling.top_p  # the smallest prefix with mass >= top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return probs / probs.sum(-1, keepdim=True)


def accept_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> tuple[int, int]:
    """Greedy verification.

    Args:
        logits: target logits ``[k+1, V]``; row j predicts the token after draft j (row 0: after the pending token).
        drafts: the ``k`` draft tokens.

    Returns:
        ``(i, token)``: the number of drafts accepted (the longest prefix equal to the target's argmax) and the
        target's token after them (the correction of draft ``i+1``, or the bonus token when ``i = k``).
    """
    best = logits.argmax(-1).tolist()  # [k+1]
    i = next((j for j, d in enumerate(drafts) if d != best[j]), len(drafts))
    return i, best[i]


def accept_sampled(p: torch.Tensor, q: torch.Tensor | None, drafts: Sequence[int],
                   generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling: the returned tokens are distributed as the target's ``p``.

    Draft ``d_j ~ q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; the first rejected one is
    replaced by a sample from ``norm(max(0, p_j − q_j))`` (from ``p_j`` if that is numerically all zero); when
    all are accepted the bonus token is sampled from ``p_{k+1}``.

    Args:
        p: target distributions ``[k+1, V]`` (already warped by temperature / top-p).
        q: drafter distributions ``[k, V]`` the drafts were sampled from (None when ``k = 0``).
        drafts: the ``k`` draft tokens.
        generator: random source (uniforms for acceptance, then the replacement or bonus sample).

    Returns:
        ``(i, token)`` as in :func:`accept_greedy`.
    """
    k = len(drafts)
    i = 0
    if k:
        rows, idx = torch.arange(k, device=p.device), torch.tensor(list(drafts), device=p.device)
        u = torch.rand(k, generator=generator, device=p.device)  # [k]
        ok = u * q[rows, idx] < p[rows, idx]  # u < p/q without dividing; q(d) > 0 as d was drawn from q
        i = int(ok.long().cumprod(0).sum())
    if i < k:
        residual = (p[i] - q[i]).clamp_min(0)  # [V]
        dist = residual if float(residual.sum()) > 0 else p[i]
    else:
        dist = p[k]
    return i, int(torch.multinomial(dist, 1, generator=generator))


# ---------------------------------------------------------------------------------------------- one round
def _draft(drafter: Drafter, policy: DraftPolicy, seq: list[int], budget: int, sampling: Sampling,
           generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
    """Up to ``budget`` drafts after ``seq``, and (when sampling) the distributions ``[k, V]`` they came from."""
    drafts: list[int] = []
    probs: list[torch.Tensor] = []
    while len(drafts) < budget:
        logits = drafter.propose(seq + drafts)  # [V]
        if drafts and not policy.keep_drafting(logits):
            break
        if sampling.do_sample:
            probs.append(warp(logits, sampling))
            drafts.append(int(torch.multinomial(probs[-1], 1, generator=generator)))
        else:
            drafts.append(int(logits.argmax()))
    return drafts, torch.stack(probs) if probs else None


def _verify(target: LayerStack, cache: KVCache, drafter: Drafter, seq: list[int], start: int, cost: CostModel,
            tally: Tally) -> torch.Tensor:
    """Target logits ``[q, V]`` for the tokens ``seq[start:]`` (pending + drafts), in one multi-token pass."""
    h, first = drafter.verify_input(seq, start)  # [1, q, d] entering layer `first` (0-based)
    q = h.shape[1]
    pos = torch.arange(start, start + q, device=target.device)[None]  # [1, q]
    h = target.run(h, first, target.n_layers, cache, pos, slice(start, start + q))
    tally.add("target", *pass_cost(cost, first, target.n_layers, start, q, q))
    return target.readout(h[0])  # [q, V]


def _round(target: LayerStack, cache: KVCache, drafter: Drafter, policy: DraftPolicy, seq: list[int], budget: int,
           sampling: Sampling, generator, cost: CostModel, tally: Tally) -> tuple[list[int], list[float], int, int]:
    """Draft, verify, accept, crop; returns (new committed tokens, their log-probabilities under the target's
    readout before temperature, drafts proposed, drafts accepted)."""
    start = len(seq) - 1  # slot of the pending token
    drafts, q = _draft(drafter, policy, seq, min(policy.n, budget), sampling, generator)
    logits = _verify(target, cache, drafter, seq + drafts, start, cost, tally)  # [k+1, V]
    if sampling.do_sample:
        i, token = accept_sampled(warp(logits, sampling), q, drafts, generator)
    else:
        i, token = accept_greedy(logits, drafts)
    keep = len(seq) + i  # slots 0..start+i: the pending token and the accepted drafts
    cache.crop(keep)
    drafter.crop(keep)
    new = drafts[:i] + [token]
    logprobs = _logprobs(logits[: i + 1], new)
    return new, logprobs, len(drafts), i


def _logprobs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """log softmax(logits[j])[tokens[j]] for each row j of ``[n, V]``."""
    index = torch.tensor(tokens, device=logits.device)[:, None]  # [n, 1]
    return torch.log_softmax(logits.float(), -1).gather(-1, index)[:, 0].tolist()


# ---------------------------------------------------------------------------------------------- generation
@torch.inference_mode()
def speculative_generate(
    target: LayerStack,
    tokenizer,
    prompt: Sequence[int] | Sequence[Sequence[int]],
    drafter: Drafter,
    max_new_tokens: int,
    policy: DraftPolicy | None = None,
    sampling: Sampling | None = None,
    stop_strings: Sequence[str] = (),
    eos_token_ids: Sequence[int] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> SpeculativeResult:
    """Generate up to ``max_new_tokens`` after one prompt with drafts verified by the target.

    Args:
        target: the target model's layer stack (its output is what this reproduces).
        tokenizer: the target's tokenizer (decodes the continuation, checks stop strings).
        prompt: one prompt's token ids (a batch of exactly one prompt is accepted too).
        drafter: a :class:`~emad.methods.drafting.SelfDrafter` or :class:`~emad.methods.drafting.ModelDrafter`.
        max_new_tokens: at most this many tokens.
        policy: draft-length policy (default: static, N = 4); restarted for this generation.
        sampling: greedy by default.
        stop_strings: stop once the continuation contains one; the text is cut before it.
        eos_token_ids: stop after producing one of these (default: the model's EOS ids).
        on_token: called with each new token id (streaming).

    Raises:
        ValueError: for a batch of several prompts, an empty prompt, ``max_new_tokens < 1`` or a drafter that
            cannot serve the target (different vocabulary, exit layer outside 1..L-1).
        ContextLengthError: when prompt + ``max_new_tokens`` exceed a model's context.
    """
    started = time.perf_counter()
    prompt = _one_prompt(prompt)
    policy = policy or Static()
    sampling = sampling or Sampling()
    drafter.bind(target, tokenizer)
    check_context([s for s in (target, drafter.stack) if s is not None], len(prompt), max_new_tokens)
    eos = set(eos_token_ids if eos_token_ids is not None else default_eos_ids(target, tokenizer))
    generator = torch.Generator(device=target.device).manual_seed(sampling.seed) if sampling.do_sample else None
    cost, tally, capacity = CostModel.from_stack(target), Tally(), len(prompt) + max_new_tokens

    cache = target.new_cache(1, capacity)
    ids = torch.tensor([prompt], device=target.device)  # [1, P]
    logits = prefill(target, cache, ids, torch.ones_like(ids, dtype=torch.bool), target.n_layers)  # [1, V]
    tally.add("target", cost.readout_flops, cost.readout_bytes)  # the first token is read out of the prompt
    drafter.start(target, cache, prompt, capacity, tally)
    policy.reset()
    out: list[int] = []
    result = SpeculativeResult([], "", "length")
    first = int(choose(logits, sampling, generator))
    result.logprobs = _logprobs(logits, [first])
    finish = extend(out, [first], eos, tokenizer, stop_strings, on_token)
    while finish is None and len(out) < max_new_tokens:
        budget = max_new_tokens - len(out) - 1  # drafts beyond this could not all be kept
        new, logprobs, drafted, accepted = _round(target, cache, drafter, policy, prompt + out, budget, sampling,
                                                  generator, cost, tally)
        result.logprobs += logprobs
        result.draft_lengths.append(drafted)
        result.accepted_lengths.append(accepted)
        policy.update(drafted, accepted)
        finish = extend(out, new, eos, tokenizer, stop_strings, on_token)
    return _finish(result, out, finish or "length", tokenizer, stop_strings, tally, cost, len(prompt),
                   {**drafter.describe(), **policy.describe(), **_describe(sampling)}, target.device, started)


def _one_prompt(prompt) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if len(prompt) and isinstance(prompt[0], (list, tuple)):
        if len(prompt) != 1:
            raise ValueError(f"speculative decoding runs one prompt at a time (batch size 1), got {len(prompt)} "
                             "prompts: call it once per prompt")
        prompt = prompt[0]
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: it needs at least one token")
    return [int(t) for t in prompt]


def _describe(sampling: Sampling) -> dict:
    if not sampling.do_sample:
        return {"temperature": 0.0}
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed}


def _finish(result: SpeculativeResult, out: list[int], finish: str, tokenizer, stop_strings, tally: Tally,
            cost: CostModel, prompt_len: int, method: dict, device, started: float) -> SpeculativeResult:
    """Fill in tokens, text, costs (the target alone: the prompt's readout, then full depth per token) and time."""
    full_flops, full_bytes = cost.full_depth(torch.arange(prompt_len + 1, prompt_len + len(out)))  # [n - 1] each
    result.token_ids, result.finish_reason, result.method = out, finish, {"method": "speculative", **method}
    result.logprobs = result.logprobs[: len(out)]  # tokens after EOS or a stop string were dropped
    result.text = cut_at_stop(tokenizer.decode(out, skip_special_tokens=True), stop_strings)
    result.drafter_flops, result.drafter_bytes = tally.flops["drafter"], tally.bytes["drafter"]
    result.target_flops, result.target_bytes = tally.flops["target"], tally.bytes["target"]
    result.full_flops = cost.readout_flops + float(full_flops.sum())
    result.full_bytes = cost.readout_bytes + float(full_bytes.sum())
    result.seconds = elapsed(device, started)
    return result
