"""What the strategies share: feeding new tokens to a cache, the cost of one pass, model checks, and the
per-token record of one generated row that becomes a :class:`~emad.decode.Generation`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from emad.decode import cut_at_stop
from emad.decode.results import Generation, TokenTrace
from emad.decode.step import ContextLengthError
from emad.engine.cache import KVCache
from emad.engine.cost import CostModel
from emad.engine.stack import LayerStack


def feed(stack: LayerStack, cache: KVCache, seq: Sequence[int], stop: int) -> torch.Tensor:
    """Run the tokens of ``seq`` not yet in ``cache`` (batch 1, one slot per position) through layers ``[0, stop)``.

    Returns:
        Their hidden states after layer ``stop``, ``[1, q, d]``.
    """
    first = cache.n_slots
    ids = torch.tensor([list(seq[first:])], device=stack.device)  # [1, q]
    if ids.shape[1] == 0:
        raise ValueError("feed: every token of the sequence is already in the cache")
    slots = cache.allocate(torch.ones_like(ids, dtype=torch.bool))
    pos = torch.arange(first, first + ids.shape[1], device=stack.device)[None]  # [1, q]
    return stack.run(stack.embed(ids, pos), 0, stop, cache, pos, slots)


def pass_cost(cost: CostModel, start: int, stop: int, first_slot: int, q: int,
              readouts: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one pass of ``q`` consecutive tokens over layers ``[start, stop)`` and ``readouts`` readouts.

    The token in slot ``s`` attends to ``s + 1`` keys, so the pass costs ``Σ_layers (2·P_ℓ·q + 4·d·Σ_s (s+1))``
    FLOPs (:meth:`CostModel.layer_flops` summed over its tokens) plus ``readouts`` readouts at layer ``stop``
    (:meth:`CostModel.readout_at`: the translation there, final norm and head). One pass reads each weight once:
    bytes are the layers' bytes plus one readout's bytes when it reads out at all.
    """
    keys = q * first_slot + q * (q + 1) // 2  # Σ (s + 1) over s = first_slot .. first_slot + q - 1
    flops = 2 * q * sum(cost.layer_params[start:stop]) + 4 * cost.d_model * (stop - start) * keys
    readout_flops, readout_bytes = cost.readout_at(stop)
    bytes_ = sum(cost.layer_bytes[start:stop]) + (readout_bytes if readouts else 0)
    return float(flops + readouts * readout_flops), float(bytes_)


def check_inner_layer(label: str, value: int, n_layers: int) -> None:
    """Refuse a layer count outside 1..L-1 (a drafter's exit layer E, a small model's k), naming ``label``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < n_layers:
        raise ValueError(f"{label}={value!r} is outside the valid range 1..{n_layers - 1} for a target of "
                         f"{n_layers} layers")


def model_name(stack: LayerStack) -> str:
    """A name for error messages: the model's path or hub id, else its architecture and shape."""
    name = getattr(stack.config, "name_or_path", "") or ""
    shape = f"{stack.config.model_type}, {stack.n_layers} layers, vocabulary {stack.vocab_size}"
    return f"{name!r} ({shape})" if name else f"<{shape}>"


def check_same_vocabulary(role: str, stack: LayerStack, tokenizer, target: LayerStack, target_tokenizer,
                          target_role: str = "target") -> None:
    """Refuse a second model whose vocabulary or tokenizer differs from the target's, naming both models.

    Raises:
        ValueError: different vocabulary sizes, or different token → id maps (when both tokenizers are known).
    """
    ours, theirs = model_name(stack), model_name(target)
    if stack.vocab_size != target.vocab_size:
        raise ValueError(f"{role} {ours} has {stack.vocab_size} vocabulary rows but {target_role} {theirs} has "
                         f"{target.vocab_size}: the two models must share one tokenizer and vocabulary")
    if tokenizer is not None and target_tokenizer is not None and _vocab(tokenizer) != _vocab(target_tokenizer):
        raise ValueError(f"{role} {ours} and {target_role} {theirs} use different tokenizers: the two models must "
                         "share one tokenizer and vocabulary")


def _vocab(tokenizer) -> dict | int:
    return tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else len(tokenizer)


def check_context(stacks: Sequence[LayerStack], prompt_len: int, max_new_tokens: int) -> None:
    """Refuse ``max_new_tokens < 1`` and a prompt + continuation longer than any model's context."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for stack in stacks:
        if stack.max_positions is not None and prompt_len + max_new_tokens > stack.max_positions:
            raise ContextLengthError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the context of "
                f"{stack.max_positions} tokens of {model_name(stack)}; shorten the prompt or lower max_new_tokens")


def extend(out: list[int], new: Sequence[int], eos: set[int], tokenizer, stop_strings: Sequence[str],
           on_token: Callable[[int], None] | None) -> str | None:
    """Append tokens one by one until EOS or a stop string; returns the finish reason, or None to go on."""
    for token in new:
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos:
            return "eos"
        if stop_strings and any(s in tokenizer.decode(out) for s in stop_strings):
            return "stop_string"
    return None


@dataclass
class RowRecord:
    """One generated row, token by token: what a strategy fills in and :func:`to_generation` assembles.

    ``flops``/``bytes`` are the strategy's spend per token (its share of a pass that produced several tokens);
    ``full_flops``/``full_bytes`` the target alone at full depth for the same token.
    """

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)  # per token: the argmax of the readout it came from
    depths: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    bytes: list[float] = field(default_factory=list)
    full_flops: list[float] = field(default_factory=list)
    full_bytes: list[float] = field(default_factory=list)
    entropies: list[dict[int, float]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    finish: str = "length"
    extra_flops: float = 0.0  # work beyond producing tokens (catch-up prefills), included in ``flops``
    extra_token_layers: float = 0.0
    extra_events: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)


def full_cost(cost: CostModel, prompt_len: int, n: int) -> tuple[list[float], list[float]]:
    """Per token, FLOPs and bytes of the target alone at full depth: the first token is read out of the prompt's
    last position (one readout), token ``j ≥ 1`` runs all layers over ``prompt_len + j`` keys."""
    flops, bytes_ = cost.full_depth(torch.arange(prompt_len + 1, prompt_len + n))  # [n - 1] each
    return [float(cost.readout_flops), *flops.tolist()], [float(cost.readout_bytes), *bytes_.tolist()]


def to_generation(rows: Sequence[RowRecord], tokenizer, stop_strings: Sequence[str], method: dict,
                  seconds: float) -> Generation:
    """Assemble per-row records into a :class:`~emad.decode.Generation` (stats summed over rows)."""
    stats: dict[str, float] = {}
    for r in rows:
        for key, value in r.stats.items():
            stats[key] = stats.get(key, 0.0) + value
    return Generation(
        token_ids=[r.ids for r in rows],
        texts=[cut_at_stop(tokenizer.decode(r.ids, skip_special_tokens=True), stop_strings) for r in rows],
        depths=[r.depths for r in rows], flops=[r.flops for r in rows], bytes=[r.bytes for r in rows],
        full_flops=[r.full_flops for r in rows], full_bytes=[r.full_bytes for r in rows],
        finish_reasons=[r.finish for r in rows],
        policy_flops=[r.extra_flops for r in rows], policy_token_layers=[r.extra_token_layers for r in rows],
        policy_events=[r.extra_events for r in rows],
        traces=[[TokenTrace(*x) for x in zip(r.ids, r.logprobs, r.depths, r.entropies, r.reasons, r.flops,
                                             r.full_flops)] for r in rows],
        method=method, seconds=seconds, stats=stats,
    )
