"""``generate``: prefill, then adaptive steps until EOS, a stop string or ``max_new_tokens``; with a trace."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from emad.decode.results import Generation, TokenTrace
from emad.decode.step import (
    EXIT_REASONS,
    ContextLengthError,
    Method,
    Sampling,
    as_method,
    choose,
    elapsed,
    left_pad,
    positions_of,
    prefill,
    reading,
)
from emad.decode.steppers import steps_for
from emad.decode.strategy import Strategy
from emad.engine.cache import KVCache
from emad.engine.cost import CostModel
from emad.engine.stack import LayerStack
from emad.exits.criteria import Criterion


@dataclass
class _Row:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    n_ctx: list[torch.Tensor] = field(default_factory=list)  # per token: [L] keys attended per layer
    context: list[int] = field(default_factory=list)
    extra_flops: list[float] = field(default_factory=list)
    extra_bytes: list[float] = field(default_factory=list)
    entropies: list[dict[int, float]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    allowed: list[int] = field(default_factory=list)  # per token: the first layer where it may exit
    steps: list[int] = field(default_factory=list)  # per token: the decode step that produced it
    finish: str | None = None


class Prefills:
    """Prompt passes made once and reused by every later generation of the same prompts: the K/V cache after the
    prompts ``[B, T]`` and their last states ``[B, d]`` after every layer, keyed by the prompts (and a static cache's
    capacity: its compiled passes attend to the whole buffer), whatever the new tokens' room. A
    generation's layers do not depend on its method before the first token (it reads the last state out through
    its own readout), and a layer's K/V do not depend on the layers after it: so one pass to depth D serves every
    generation that prefills to a depth d <= D (its layers 1..d, its last states after layer d) — exactly the pass
    it would compute; a deeper one replaces it. A generation given the store is not timed (:attr:`Generation.timed`):
    its pass may be reused or made and kept.

    The store holds at most ``max_bytes`` of passes (each its allocated slots only), dropping the least recently used
    first (a pass larger than that is not kept): 736 prompts' cache on a 45-layer model is 2 GB.
    """

    MAX_BYTES = 4 << 30

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        # (prompts, static capacity) -> (cache of layers 1..D, D, {layer: [B, d] last states}, bytes), LRU order
        self._passes: OrderedDict[tuple, tuple[KVCache, int, dict[int, torch.Tensor], int]] = OrderedDict()

    @torch.inference_mode()
    def run(self, stack: LayerStack, prompts: Sequence[Sequence[int]], depth: int, cache: KVCache, ids: torch.Tensor,
            real: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
        """The prompts' pass to ``depth``: its cache and the last states ``[B, d]``; a pass made now fills
        ``cache`` and is kept."""
        # a pass does not depend on the capacity of a cache that attends only to its filled slots; a static cache's
        # compiled passes attend to the whole buffer, so theirs is kept per capacity
        key = (tuple(map(tuple, prompts)), None if type(cache) is KVCache else cache.capacity)
        if key in self._passes and self._passes[key][1] >= depth:
            self._passes.move_to_end(key)
            kept, _, last, _ = self._passes[key]
            cache.load(kept, depth)  # into the cache made for this generation (a static one keeps its addresses)
            return cache, last[depth]
        last = self._pass(stack, cache, ids, real, depth)
        kept = cache.kept(depth)
        size = sum(t.nbytes for t in (*last.values(), *kept.keys, *kept.values) if t is not None)
        self._passes.pop(key, None)
        if size <= self.max_bytes:
            while self._passes and self.held + size > self.max_bytes:
                self._passes.popitem(last=False)
            self._passes[key] = kept, depth, last, size
        return cache, last[depth]

    @staticmethod
    def _pass(stack: LayerStack, cache: KVCache, ids: torch.Tensor, real: torch.Tensor, depth: int
              ) -> dict[int, torch.Tensor]:
        """:func:`~emad.decode.step.prefill_states` to ``depth``, layer by layer: the last states ``[B, d]`` after
        every layer ``1..depth`` (each layer runs as in one call)."""
        slots = cache.allocate(real)
        positions = positions_of(real)
        h, last = stack.embed(ids, positions), {}  # [B, T, d]
        for layer in range(depth):
            h = stack.run(h, layer, layer + 1, cache, positions, slots)
            last[layer + 1] = h[:, -1]
        return last

    @property
    def held(self) -> int:
        """Bytes of the passes kept."""
        return sum(size for *_, size in self._passes.values())


def generate(
    stack: LayerStack,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    method: Method | Criterion | Strategy,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_strings: Sequence[str] = (),
    eos_token_ids: Sequence[int] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    prefills: Prefills | None = None,
    on_logits: Callable[[int, torch.Tensor], None] | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` per prompt with the method's exits.

    Args:
        stack: the model's layer stack.
        tokenizer: its tokenizer (decodes continuations, checks stop strings).
        prompts: token-id lists (batched with left padding; rows never affect each other).
        method: a :class:`Method`, a bare criterion (monotone policy, exact estimator), or a :class:`Strategy`
            (two-model switching, speculative decoding), which is handed the call.
        max_new_tokens: at most this many tokens per row.
        sampling: greedy by default.
        stop_strings: a row stops once its continuation contains one; its text is cut before it.
        eos_token_ids: a row stops after producing one of these (default: the model's EOS ids).
        on_token: called as ``on_token(row, token_id)`` for each new token (streaming).
        prefills: prompt passes to reuse (and keep): the generation is then exact but not timed.
        on_logits: called as ``on_logits(t, logits)`` with the readout ``[B, V]`` each row's ``t``-th new token was
            chosen from (t = 0: the prompts' pass; rows not stepped: NaN), when it is made (before the host reads
            the step); a compiled step's readout is a graph's output, overwritten by the next step: copy what you
            keep (for comparing engines, not for speed).
    """
    sampling = sampling or Sampling()
    stack = reading(stack, method)
    if isinstance(method, Strategy):
        return method.generate(stack, tokenizer, prompts, max_new_tokens, sampling, stop_strings, eos_token_ids,
                               on_token)
    started = time.perf_counter()
    method = as_method(method)
    method.validate(stack.n_layers)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if stack.max_positions is not None and longest + max_new_tokens > stack.max_positions:
        raise ContextLengthError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the model's context of "
            f"{stack.max_positions} tokens; shorten the prompt or lower max_new_tokens")
    eos = set(eos_token_ids if eos_token_ids is not None else default_eos_ids(stack, tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    generator = torch.Generator(device=stack.device).manual_seed(sampling.seed) if sampling.do_sample else None
    cost = CostModel.from_stack(stack)

    ids, real = left_pad(prompts, pad_id, stack.device)
    batch, depth0 = ids.shape[0], method.criterion.prefill_depth(stack.n_layers)
    cache = stack.new_cache(batch, ids.shape[1] + max_new_tokens)
    policy = method.new_policy(batch, stack.n_layers, cost)
    if prefills is None:
        logits = prefill(stack, cache, ids, real, depth0)  # [B, V]
    else:
        cache, last = prefills.run(stack, prompts, depth0, cache, ids, real)
        with torch.inference_mode():
            logits = stack.readout(last, depth0)  # [B, V]
    tokens = choose(logits, sampling, generator)  # [B] on the device
    if on_logits is not None:
        on_logits(0, logits)
    chosen, logps = _to_host(tokens, logits)
    prefilled = time.perf_counter() - started  # the prompt's pass and its token, read on the host
    positions = real.long().sum(-1).tolist()  # next position id per row, on the host
    rows_state = [_Row() for _ in range(batch)]
    helds = [cache.held()]  # per step: [B, L] keys held per row and layer, on the device (read once at the end)
    first_flops, first_bytes = cost.readout_at(depth0)
    for r in range(batch):  # the first token is read out of the prompt's last position
        _record(rows_state[r], int(chosen[r]), float(logps[r]), depth0, positions[r], first_flops, first_bytes,
                {}, "prompt", depth0, 0)
    probes = method.criterion.probes(stack.n_layers)
    steps = steps_for(stack, cache, method, policy, cost, tokens, positions, sampling, generator, eos, stop_strings)
    steps.on_logits = on_logits
    with stack.finite_checks_deferred():  # read once at the end: the loop syncs only where it reads its tokens
        alive = _drop_finished(rows_state, list(range(batch)), tokenizer, eos, stop_strings, on_token)
        steps.retire(sorted(set(range(batch)) - set(alive)))
        t, pending = 1, None
        while True:
            if pending is None:
                if len(alive) == 0 or t >= max_new_tokens:
                    break
                pending, t = (t, steps.launch(alive)), t + 1
                helds.append(cache.held())
            ahead = None
            if steps.lag and len(alive) and t < max_new_tokens:  # launched before the step it follows is read
                ahead, t = (t, steps.launch(alive)), t + 1
                helds.append(cache.held())
            made, handle = pending
            record = steps.read(handle)
            for r in alive:
                token, logp, depth, reason, allowed, flops, bytes_, *seen = record[r]
                positions[r] += 1
                _record(rows_state[r], int(token), logp, int(depth), positions[r], flops, bytes_,
                        {p: e for p, e in zip(probes, seen) if e == e}, EXIT_REASONS[int(reason)], int(allowed), made)
            finished = _drop_finished(rows_state, alive, tokenizer, eos, stop_strings, on_token)
            steps.retire(sorted(set(alive) - set(finished)))
            alive = finished
            pending = ahead
    held = torch.stack(helds).cpu()  # [steps, B, L]
    for r, s in enumerate(rows_state):
        s.finish = s.finish or "length"
        s.n_ctx = [torch.where(torch.arange(held.shape[-1]) < d, held[t, r], 0) if t else held[0, r] * 0
                   for t, d in zip(s.steps, s.depths)]  # per token: [L] keys attended per layer run
    out = _assemble(rows_state, tokenizer, stop_strings, cost, method, policy)
    out.seconds, out.timed = elapsed(stack.device, started), prefills is None
    out.prefill_seconds, out.step_path, out.host_reads, out.decode_steps = prefilled, steps.path, steps.reads, t - 1
    out.graph_launches = steps.launches
    return out


def default_eos_ids(stack: LayerStack, tokenizer) -> list[int]:
    """The ids that end a generation when none are given: the model's generation config's, else the tokenizer's."""
    ids = getattr(stack.model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    return [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))


def _to_host(tokens: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """The chosen tokens ``[b]`` and their log-probabilities under the exit readout ``[b, V]``, on the host in one
    copy."""
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)  # [b]
    host = torch.stack([tokens.double(), logp.double()]).cpu()  # [2, b]
    return [int(x) for x in host[0].tolist()], host[1].tolist()


def _record(row: _Row, token: int, logprob: float, depth: int, context: int, extra_flops: float,
            extra_bytes: float, entropies: dict[int, float], reason: str, allowed: int, step_index: int) -> None:
    row.ids.append(token)
    row.logprobs.append(logprob)
    row.depths.append(depth)
    row.context.append(context)
    row.extra_flops.append(extra_flops)
    row.extra_bytes.append(extra_bytes)
    row.entropies.append(entropies)
    row.reasons.append(reason)
    row.allowed.append(allowed)
    row.steps.append(step_index)


def _drop_finished(rows, alive: list[int], tokenizer, eos, stop_strings, on_token) -> list[int]:
    """Stream the newest token of each live row and drop rows that hit EOS or a stop string."""
    keep = []
    for r in alive:
        row = rows[r]
        if on_token is not None:
            on_token(r, row.ids[-1])
        if row.ids[-1] in eos:
            row.finish = "eos"
        elif stop_strings and any(s in tokenizer.decode(row.ids) for s in stop_strings):
            row.finish = "stop_string"
        else:
            keep.append(r)
    return keep


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any of ``stop_strings`` (all of it when none occurs)."""
    cut = min((i for s in stop_strings if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def _assemble(rows: list[_Row], tokenizer, stop_strings, cost: CostModel, method: Method, policy) -> Generation:
    flops, bytes_, full_flops, full_bytes, traces = [], [], [], [], []
    for r in rows:
        n_ctx, context = torch.stack(r.n_ctx), torch.tensor(r.context)  # [N, L], [N]
        zero = torch.zeros(len(r.ids))
        f = cost.flops(n_ctx, zero) + torch.tensor(r.extra_flops, dtype=torch.float64)
        b = cost.bytes(n_ctx, zero) + torch.tensor(r.extra_bytes, dtype=torch.float64)
        ff, fb = cost.full_depth(context)
        ff[0], fb[0] = cost.readout_flops, cost.readout_bytes  # the prompt's last position: its readout only
        flops.append(f.tolist())
        bytes_.append(b.tolist())
        full_flops.append(ff.tolist())
        full_bytes.append(fb.tolist())
        traces.append([TokenTrace(*x) for x in zip(r.ids, r.logprobs, r.depths, r.entropies, r.reasons, f.tolist(),
                                                   ff.tolist(), r.allowed)])
    return Generation(
        token_ids=[r.ids for r in rows],
        texts=[cut_at_stop(tokenizer.decode(r.ids, skip_special_tokens=True), stop_strings) for r in rows],
        depths=[r.depths for r in rows],
        flops=flops, bytes=bytes_, full_flops=full_flops, full_bytes=full_bytes,
        finish_reasons=[r.finish for r in rows],
        policy_flops=policy.extra.flops.tolist(), policy_token_layers=policy.extra.token_layers.tolist(),
        policy_events=policy.extra.events.tolist(), traces=traces, method=method.describe(),
        steps=[r.steps for r in rows],
    )
