"""The decode loop on the layer stack: ``prefill`` → ``step`` → ``generate``, and teacher-forced ``score``.

One loop serves every exit criterion: a token runs from probe to probe, and at each probe the criterion decides,
per row, whether it exits there; the readout of the exit layer gives the token. Rows are independent: a row's
depth never depends on other rows, and a layer is computed only for the rows still active at it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from emad.cache import KVCache
from emad.cost import CostModel
from emad.criteria import Criterion
from emad.stack import LayerStack


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
class StepOutput:
    """What one decode step produced for the rows it ran (in the order of ``rows``)."""

    logits: torch.Tensor  # [b, V] readout at each row's exit layer
    depths: torch.Tensor  # [b] layers run
    readouts: torch.Tensor  # [b] probes read out


@dataclass
class Generation:
    """Generated continuations and their per-token trace.

    Attributes:
        token_ids: generated ids per row (prompt excluded; EOS included when produced).
        texts: decoded continuations, cut before the first stop string.
        depths: layers run per generated token, per row.
        flops, bytes: cost per generated token, per row; ``full_flops``/``full_bytes`` the same tokens at full depth.
        finish_reasons: "eos", "stop_string" or "length", per row.
    """

    token_ids: list[list[int]]
    texts: list[str]
    depths: list[list[int]]
    flops: list[list[float]]
    bytes: list[list[float]]
    full_flops: list[list[float]]
    full_bytes: list[list[float]]
    finish_reasons: list[str]
    method: dict = field(default_factory=dict)

    def cost_ratio(self, row: int | None = None, kind: str = "flops") -> float:
        """Cost of this generation over full depth for the same tokens (all rows, or one)."""
        rows = range(len(self.token_ids)) if row is None else [row]
        spent = sum(sum(getattr(self, kind)[r]) for r in rows)
        full = sum(sum(getattr(self, "full_" + kind)[r]) for r in rows)
        return spent / full if full else 1.0


# --------------------------------------------------------------------------- building blocks
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
def prefill(stack: LayerStack, cache: KVCache, ids: torch.Tensor, real: torch.Tensor, depth: int) -> torch.Tensor:
    """Run the prompt ``[B, T]`` through layers 1..depth, filling the cache; return its last readout ``[B, V]``."""
    slots = cache.allocate(real)
    positions = positions_of(real)
    h = stack.embed(ids, positions)  # [B, T, d]
    h = stack.run(h, 0, depth, cache, positions, slots)
    return stack.readout(h[:, -1])  # [B, V]


@torch.inference_mode()
def step(
    stack: LayerStack,
    cache: KVCache,
    criterion: Criterion,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> StepOutput:
    """Decode one token for ``rows`` (all rows when None), each exiting where the criterion says.

    Args:
        tokens: ``[b]`` the previous token of each row being run.
        positions: ``[b]`` its position id.
        rows: cache rows being run, LongTensor ``[b]``; None = all B rows.

    Returns:
        A :class:`StepOutput` for the b rows, in order.
    """
    b = tokens.shape[0]
    real = torch.zeros(cache.batch_size, 1, dtype=torch.bool, device=tokens.device)
    real[rows if rows is not None else slice(None)] = True
    slots = cache.allocate(real)
    pos = positions[:, None]  # [b, 1]
    h = stack.embed(tokens[:, None], pos)  # [b, 1, d]
    out_logits = torch.empty(b, stack.vocab_size, dtype=stack.dtype, device=tokens.device)
    depths = torch.zeros(b, dtype=torch.long, device=tokens.device)
    readouts = torch.zeros(b, dtype=torch.long, device=tokens.device)
    active = torch.arange(b, device=tokens.device)  # indices into the b rows still running
    probes = criterion.probes(stack.n_layers)
    done = 0
    for probe in probes:
        cache_rows = rows if len(active) == b else (active if rows is None else rows[active])
        h = stack.run(h, done, probe, cache, pos[active], slots, cache_rows)
        done = probe
        logits = stack.readout(h[:, -1])  # [a, V]
        readouts[active] += 1
        leave = torch.ones_like(active, dtype=torch.bool) if probe == probes[-1] else criterion.exits(probe, logits)
        out_logits[active[leave]] = logits[leave]
        depths[active[leave]] = probe
        active, h, = active[~leave], h[~leave]
        if len(active) == 0:
            break
    return StepOutput(out_logits, depths, readouts)


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


# --------------------------------------------------------------------------- generate
@dataclass
class _RowState:
    ids: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    n_ctx: list[torch.Tensor] = field(default_factory=list)  # per token: [L] keys attended per layer
    context: list[int] = field(default_factory=list)
    readouts: list[int] = field(default_factory=list)
    finish: str | None = None


def generate(
    stack: LayerStack,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    criterion: Criterion,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_strings: Sequence[str] = (),
    eos_token_ids: Sequence[int] | None = None,
    on_token: Callable[[int, int], None] | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` per prompt with the criterion's exits.

    Args:
        stack: the model's layer stack.
        tokenizer: its tokenizer (decodes continuations, checks stop strings).
        prompts: token-id lists (batched with left padding).
        criterion: where tokens exit (``full``, ``fixed`` ...).
        max_new_tokens: at most this many tokens per row.
        sampling: greedy by default.
        stop_strings: a row stops once its continuation contains one; its text is cut before it.
        eos_token_ids: a row stops after producing one of these (default: the model's EOS ids).
        on_token: called as ``on_token(row, token_id)`` for each new token (streaming).

    Returns:
        The :class:`Generation`.
    """
    sampling = sampling or Sampling()
    criterion.validate(stack.n_layers)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if stack.max_positions is not None and longest + max_new_tokens > stack.max_positions:
        raise ContextLengthError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the model's context of "
            f"{stack.max_positions} tokens; shorten the prompt or lower max_new_tokens"
        )
    eos = set(eos_token_ids if eos_token_ids is not None else _eos_ids(stack, tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    generator = torch.Generator(device=stack.device).manual_seed(sampling.seed) if sampling.do_sample else None
    cost = CostModel.from_stack(stack)

    ids, real = left_pad(prompts, pad_id, stack.device)
    batch = ids.shape[0]
    cache = stack.new_cache(batch, ids.shape[1] + max_new_tokens)
    logits = prefill(stack, cache, ids, real, criterion.prefill_depth(stack.n_layers))
    tokens = choose(logits, sampling, generator)  # [B]
    positions = real.long().sum(-1)  # next position id per row, [B]
    prefill_depth = criterion.prefill_depth(stack.n_layers)
    states = [_RowState() for _ in range(batch)]
    first_held = _held(cache)  # [B, L]
    for r in range(batch):
        _record(states[r], int(tokens[r]), prefill_depth, first_held[r], 1, int(positions[r]))
    alive = torch.arange(batch, device=stack.device)
    for t in range(1, max_new_tokens + 1):
        alive = _update_finished(states, alive, tokenizer, eos, stop_strings, on_token, t)
        if len(alive) == 0 or t == max_new_tokens:
            break
        rows = None if len(alive) == batch else alive
        out = step(stack, cache, criterion, tokens[alive], positions[alive], rows)
        new = choose(out.logits, sampling, generator)
        tokens[alive] = new
        positions[alive] += 1
        held = _held(cache)
        for i, r in enumerate(alive.tolist()):
            _record(states[r], int(new[i]), int(out.depths[i]), held[r], int(out.readouts[i]), int(positions[r]))
    for s in states:
        s.finish = s.finish or "length"
    return _assemble(states, tokenizer, stop_strings, cost, criterion)


def _eos_ids(stack: LayerStack, tokenizer) -> list[int]:
    ids = getattr(stack.model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    return [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))


def _held(cache: KVCache) -> torch.Tensor:
    """Keys held per row and layer right now, ``[B, L]`` on CPU."""
    return cache.valid[:, :, : cache.n_slots].sum(-1).T.cpu()


def _record(state: _RowState, token: int, depth: int, held: torch.Tensor, readouts: int, context: int) -> None:
    layers = torch.arange(held.shape[0])
    state.ids.append(token)
    state.depths.append(depth)
    state.n_ctx.append(torch.where(layers < depth, held, 0))
    state.readouts.append(readouts)
    state.context.append(context)


def _update_finished(states, alive, tokenizer, eos, stop_strings, on_token, t) -> torch.Tensor:
    """Stream the newest token of each live row and drop rows that hit EOS or a stop string."""
    keep = []
    for r in alive.tolist():
        state = states[r]
        if on_token is not None:
            on_token(r, state.ids[-1])
        if state.ids[-1] in eos:
            state.finish = "eos"
        elif stop_strings and any(s in tokenizer.decode(state.ids) for s in stop_strings):
            state.finish = "stop_string"
        else:
            keep.append(r)
    return alive.new_tensor(keep)


def _cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    cut = min((i for s in stop_strings if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def _assemble(states, tokenizer, stop_strings, cost: CostModel, criterion: Criterion) -> Generation:
    flops, bytes_, full_flops, full_bytes = [], [], [], []
    for s in states:
        n_ctx = torch.stack(s.n_ctx)  # [N, L]
        readouts = torch.tensor(s.readouts)
        context = torch.tensor(s.context)
        # the first token came from the prompt's readout: its layers are the prompt's, not counted
        n_ctx[0] = 0
        ff, fb = cost.full_depth(context)
        ff[0], fb[0] = cost.readout_flops, cost.readout_bytes
        flops.append(cost.flops(n_ctx, readouts).tolist())
        bytes_.append(cost.bytes(n_ctx, readouts).tolist())
        full_flops.append(ff.tolist())
        full_bytes.append(fb.tolist())
    texts = [_cut_at_stop(tokenizer.decode(s.ids, skip_special_tokens=True), stop_strings) for s in states]
    return Generation(
        token_ids=[s.ids for s in states],
        texts=texts,
        depths=[s.depths for s in states],
        flops=flops,
        bytes=bytes_,
        full_flops=full_flops,
        full_bytes=full_bytes,
        finish_reasons=[s.finish for s in states],
        method=criterion.describe(),
    )


# --------------------------------------------------------------------------- score
@torch.inference_mode()
def score(stack: LayerStack, ids: Sequence[int], depth: int | None = None) -> torch.Tensor:
    """Teacher-forced log-probabilities of ``ids[1:]`` given their prefixes, reading out at ``depth`` (default L).

    Returns:
        ``[len(ids) - 1]`` float32 log-probabilities.
    """
    depth = stack.n_layers if depth is None else depth
    if not 1 <= depth <= stack.n_layers:
        raise ValueError(f"depth must be in 1..{stack.n_layers}, got {depth}")
    if len(ids) < 2:
        raise ValueError("scoring needs at least 2 tokens")
    if stack.max_positions is not None and len(ids) > stack.max_positions:
        raise ContextLengthError(
            f"text of {len(ids)} tokens exceeds the model's context of {stack.max_positions} tokens"
        )
    x, real = left_pad([ids], 0, stack.device)
    cache = stack.new_cache(1, x.shape[1])
    slots = cache.allocate(real)
    positions = positions_of(real)
    h = stack.run(stack.embed(x, positions), 0, depth, cache, positions, slots)
    logp = torch.log_softmax(stack.readout(h[0, :-1]).float(), dim=-1)  # [T-1, V]
    return logp.gather(-1, x[0, 1:, None]).squeeze(-1)
