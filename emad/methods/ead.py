"""EAD — entropy adaptive decoding: a small model M_S and a large model M_L take turns, by the rolling entropy of
the tokens produced.

After each token, the entropy of the model that produced it (its readout before temperature, nats) enters a
rolling mean over the last ``window`` tokens. The :class:`Switcher` moves to M_L when that mean is ≥ τ and back to
M_S when it is ≤ τ, but only once the current model has produced at least ``d_min`` tokens since it took over. The
incoming model's KV cache is then caught up on the tokens it missed in one batched pass (fused with the pending
token), and that work is counted.

Pairs (batch 1; slot = position):

- :class:`ModelPair`: two models with one tokenizer, each with its own cache; both prefill the prompt.
- :class:`SelfPair`: M_L is the target and M_S its own first k layers with the final norm and head. They share one
  cache: K/V of layers 1..k are the same whichever model ran them, so M_S never needs catching up and M_L
  catches up only layers k+1..L of the tokens M_S produced, from their kept ``h_k``. Its output equals that of a
  :class:`ModelPair` whose M_S is the truncated copy of the target.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from emad.decode import default_eos_ids
from emad.decode.results import Generation, Scored
from emad.decode.step import choose, elapsed, prefill
from emad.decode.strategy import Strategy
from emad.engine.cost import CostModel
from emad.engine.entropy import readout_summary
from emad.engine.stack import LayerStack
from emad.methods.common import (
    RowRecord,
    check_context,
    check_inner_layer,
    check_same_vocabulary,
    extend,
    feed,
    full_cost,
    model_name,
    pass_cost,
    to_generation,
)
from emad.methods.ead_score import charge_self_pair, replay_reads, replay_self_pair

SIDES = ("small", "large")


# ---------------------------------------------------------------------------------------------- switching rule
class Switcher:
    """Which model produces the next token.

    Args:
        tau: τ, the entropy threshold in nats (finite).
        window: w, tokens in the rolling mean (>= 1).
        d_min: tokens the current model produces before it may hand over (>= 1).
        start: the model producing the first token, ``"small"`` or ``"large"``.
    """

    def __init__(self, tau: float, window: int = 5, d_min: int = 10, start: str = "small"):
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau):
            raise ValueError(f"tau (the entropy threshold τ, nats) must be a finite number, got {tau!r}")
        for name, value in (("window", window), ("d_min", d_min)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if start not in SIDES:
            raise ValueError(f"start must be one of {', '.join(SIDES)}, got {start!r}")
        self.tau, self.window, self.d_min, self.start = float(tau), window, d_min, start
        self.reset()

    def reset(self) -> None:
        """Start a generation: the start model is current and no entropy has been seen."""
        self.current = self.start
        self.recent: deque[float] = deque(maxlen=self.window)
        self.run = 0  # tokens produced by the current model since it took over
        self.switches = 0

    @property
    def mean(self) -> float:
        """Rolling mean entropy over the last ``window`` tokens (NaN before any)."""
        return sum(self.recent) / len(self.recent) if self.recent else math.nan

    def observe(self, entropy: float) -> bool:
        """Record the entropy of the token the current model just produced; True when the next token changes model."""
        self.recent.append(float(entropy))
        self.run += 1
        if self.run < self.d_min:
            return False
        mean = self.mean
        turn = (self.current == "small" and mean >= self.tau) or (self.current == "large" and mean <= self.tau)
        if turn:
            self.current = "large" if self.current == "small" else "small"
            self.run = 0
            self.switches += 1
        return turn


# ---------------------------------------------------------------------------------------------- model pairs
@dataclass
class Advance:
    """One token's worth of work by one model: its readout logits ``[V]``, depth and cost (catch-up included).

    ``catchup_*`` is the part spent on tokens the model had missed (all FLOPs; a fused pass reads the weights
    once, so catching up costs no extra bytes).
    """

    logits: torch.Tensor
    depth: int
    flops: float
    bytes: float
    catchup_flops: float = 0.0
    catchup_token_layers: float = 0.0


class Pair:
    """The two models of one EAD generation (batch 1): the decode loop calls :meth:`bind`, then per generation
    :meth:`start` and, per token, :meth:`advance` for the current side."""

    def validate(self, n_layers: int) -> None:
        """Check that this pair fits a large model of ``n_layers`` layers; raise ``ValueError`` saying why not."""

    def bind(self, target: LayerStack, tokenizer) -> None:
        """Check that this pair can run with ``target`` as M_L; raise ``ValueError`` saying why not."""
        self.validate(target.n_layers)

    def stacks(self, target: LayerStack) -> list[LayerStack]:
        """Every model this pair runs."""
        return [target]

    def start(self, target: LayerStack, prompt: list[int], capacity: int, side: str) -> Advance:
        """Prefill the prompt; return the readout of ``side`` at the prompt's last position (the first token),
        charged as one readout (the prompt itself is not charged, as for every method)."""
        raise NotImplementedError

    def advance(self, side: str, seq: list[int]) -> Advance:
        """Feed ``side`` the tokens of ``seq`` it has not seen (the pending one last); return its next readout."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {}


class SelfPair(Pair):
    """M_S = the target's first ``small_layers`` layers (+ the readout at k: T_k, final norm and head), sharing
    M_L's cache.

    Args:
        small_layers: k, in 1..L-1.
    """

    def __init__(self, small_layers: int):
        self.k = small_layers

    def validate(self, n_layers: int) -> None:
        check_inner_layer("small_layers k", self.k, n_layers)

    def start(self, target, prompt, capacity, side) -> Advance:
        self.target, self.cost = target, CostModel.from_stack(target)
        self.cache = target.new_cache(1, capacity)
        h_k = feed(target, self.cache, prompt, self.k)  # [1, P, d]
        pos = torch.arange(len(prompt), device=target.device)[None]
        h_L = target.run(h_k, self.k, target.n_layers, self.cache, pos, slice(0, len(prompt)))
        self.upper = len(prompt)  # slots that hold layers k+1..L
        self.pending: list[torch.Tensor] = []  # h_k of slots upper.. (run by M_S only)
        h, depth = (h_k, self.k) if side == "small" else (h_L, target.n_layers)
        return Advance(target.readout(h[0, -1], depth), depth, *self.cost.readout_at(depth))

    def advance(self, side, seq) -> Advance:
        first, q = self.cache.n_slots, len(seq) - self.cache.n_slots
        L = self.target.n_layers
        charged = charge_self_pair(self.cost, self.k, L, side, self.upper, first, q)
        h = feed(self.target, self.cache, seq, self.k)  # [1, q, d]
        if side == "small":
            self.pending.append(h)
            return Advance(self.target.readout(h[0, -1], self.k), self.k, *charged)
        h = torch.cat([*self.pending, h], dim=1)  # [1, missed + q, d]: slots upper..first+q-1
        pos = torch.arange(self.upper, first + q, device=self.target.device)[None]
        h = self.target.run(h, self.k, L, self.cache, pos, slice(self.upper, first + q))
        self.upper, self.pending = first + q, []
        return Advance(self.target.readout(h[0, -1]), L, *charged)

    def describe(self) -> dict:
        return {"pair": "self", "small_layers": self.k}


class ModelPair(Pair):
    """A separate small model with the target's tokenizer; each model keeps its own cache.

    Args:
        small: M_S's layer stack.
        tokenizer: M_S's tokenizer; when given, it must equal the target's.
    """

    def __init__(self, small: LayerStack, tokenizer=None):
        self.small, self.tokenizer = small, tokenizer

    def bind(self, target, tokenizer) -> None:
        check_same_vocabulary("small model", self.small, self.tokenizer, target, tokenizer, "large model")

    def stacks(self, target) -> list[LayerStack]:
        return [self.small, target]

    def start(self, target, prompt, capacity, side) -> Advance:
        self.models = {"small": self.small, "large": target}
        self.costs = {s: CostModel.from_stack(m) for s, m in self.models.items()}
        self.caches = {s: m.new_cache(1, capacity) for s, m in self.models.items()}
        logits = {}
        for s, m in self.models.items():
            ids = torch.tensor([prompt], device=m.device)  # [1, P]
            logits[s] = prefill(m, self.caches[s], ids, torch.ones_like(ids, dtype=torch.bool), m.n_layers)[0]
        cost = self.costs[side]
        return Advance(logits[side].to(target.device), self.models[side].n_layers, cost.readout_flops,
                       cost.readout_bytes)

    def advance(self, side, seq) -> Advance:
        model, cache, cost = self.models[side], self.caches[side], self.costs[side]
        first, q = cache.n_slots, len(seq) - cache.n_slots
        h = feed(model, cache, seq, model.n_layers)  # [1, q, d]: the missed tokens, then the pending one
        flops, bytes_ = pass_cost(cost, 0, model.n_layers, first, q, 1)
        catchup = pass_cost(cost, 0, model.n_layers, first, q - 1, 0)[0]
        logits = model.readout(h[0, -1]).to(self.models["large"].device)
        return Advance(logits, model.n_layers, flops, bytes_, catchup, float((q - 1) * model.n_layers))

    def describe(self) -> dict:
        return {"pair": "model", "small_model": model_name(self.small)}


# ---------------------------------------------------------------------------------------------- the strategy
class EAD(Strategy):
    """Entropy adaptive decoding with a :class:`Pair` and a :class:`Switcher` (see the module docstring).

    Generation is batch 1 per row (rows run one after another). Scoring replays the same loop with the given
    tokens, so the model that predicts each token is the one generation would have used; with a
    :class:`SelfPair` from one full-depth pass (:mod:`emad.methods.ead_score`), otherwise token by token.
    """

    name = "ead"
    knobs = {"tau": "low"}  # τ low: more tokens go to the large model

    def __init__(self, pair: Pair, switcher: Switcher):
        self.pair, self.switcher = pair, switcher

    @classmethod
    def from_options(cls, load: Callable | None = None, tau: float | None = None, small: str | None = None,
                     small_layers: int | None = None, window: int = 5, d_min: int = 10,
                     start: str = "small") -> EAD:
        """``small`` (a second model's spec) or ``small_layers`` (k, the target's own first k layers) names M_S."""
        switcher = cls._switcher(tau, small, small_layers, window, d_min, start)
        if small is not None:
            if load is None:
                raise ValueError(f"method 'ead' with small={small!r} needs a model loader")
            return cls(ModelPair(*load(small)), switcher)
        return cls(SelfPair(small_layers), switcher)

    @classmethod
    def check_options(cls, tau: float | None = None, small: str | None = None, small_layers: int | None = None,
                      window: int = 5, d_min: int = 10, start: str = "small") -> None:
        cls._switcher(tau, small, small_layers, window, d_min, start)
        if small_layers is not None and (isinstance(small_layers, bool) or not isinstance(small_layers, int)
                                         or small_layers < 1):
            raise ValueError(f"small_layers k must be an integer >= 1, got {small_layers!r}")

    @staticmethod
    def _switcher(tau, small, small_layers, window, d_min, start) -> Switcher:
        if tau is None:
            raise ValueError("method 'ead' needs tau (the entropy threshold τ, nats)")
        if (small is None) == (small_layers is None):
            raise ValueError("method 'ead' needs exactly one of small (a second model sharing the tokenizer) or "
                             "small_layers (k: the target's own first k layers as the small model)")
        return Switcher(tau, window, d_min, start)

    def validate(self, n_layers: int) -> None:
        self.pair.validate(n_layers)

    def bind(self, stack, tokenizer) -> None:
        self.pair.bind(stack, tokenizer)

    def describe(self) -> dict:
        s = self.switcher
        return {"method": self.name, **self.pair.describe(), "tau": s.tau, "window": s.window, "d_min": s.d_min,
                "start": s.start, **self.readout_facts()}

    def readout_layers(self, n_layers: int) -> list[int]:
        return [self.pair.k] if isinstance(self.pair, SelfPair) else []

    # ------------------------------------------------------------------ the loop
    def _run(self, stack: LayerStack, prompt: list[int], n: int, pick: Callable[[torch.Tensor], int],
             finished: Callable[[list[int]], str | None]) -> RowRecord:
        """Produce ``n`` tokens at most: ``pick(logits)`` chooses each, ``finished(tokens)`` may stop early."""
        check_context(self.pair.stacks(stack), len(prompt), n)
        switcher, row, cost = self.switcher, RowRecord(), CostModel.from_stack(stack)
        switcher.reset()
        side = switcher.current
        step = self.pair.start(stack, prompt, len(prompt) + n, side)
        tokens = {"small": 0, "large": 0}
        while True:
            token = pick(step.logits)
            entropy = float(readout_summary(step.logits)[0])
            row.ids.append(token)
            row.logprobs.append(float(torch.log_softmax(step.logits.float(), -1)[token]))
            row.greedy.append(int(step.logits.argmax()) == token)
            row.depths.append(step.depth)
            row.flops.append(step.flops)
            row.bytes.append(step.bytes)
            row.entropies.append({step.depth: entropy})
            row.reasons.append(side)
            row.extra_flops += step.catchup_flops
            row.extra_token_layers += step.catchup_token_layers
            tokens[side] += 1
            switcher.observe(entropy)
            finish = finished(row.ids)
            if finish is not None or len(row.ids) == n:
                row.finish = finish or "length"
                break
            side = switcher.current
            step = self.pair.advance(side, prompt + row.ids)
        row.full_flops, row.full_bytes = full_cost(cost, len(prompt), len(row.ids))
        row.extra_events = float(switcher.switches)
        row.stats = {"ead_tokens": float(len(row.ids)), "large_tokens": float(tokens["large"]),
                     "small_tokens": float(tokens["small"]), "switches": float(switcher.switches)}
        return row

    @torch.inference_mode()
    def generate(self, stack, tokenizer, prompts, max_new_tokens, sampling, stop_strings, eos_token_ids,
                 on_token) -> Generation:
        started = time.perf_counter()
        self.bind(stack, tokenizer)
        eos = set(eos_token_ids if eos_token_ids is not None else default_eos_ids(stack, tokenizer))
        rows = []
        for r, prompt in enumerate(prompts):
            row_sampling = replace(sampling, seed=sampling.seed + r)
            generator = (torch.Generator(device=stack.device).manual_seed(row_sampling.seed)
                         if sampling.do_sample else None)
            seen: list[int] = []

            def finished(ids: list[int], r=r, seen=seen) -> str | None:
                return extend(seen, ids[len(seen):], eos, tokenizer, stop_strings,
                              None if on_token is None else (lambda t: on_token(r, t)))

            rows.append(self._run(stack, _prompt(prompt, r), max_new_tokens,
                                  lambda logits, s=row_sampling, g=generator: int(choose(logits[None], s, g)[0]),
                                  finished))
        return to_generation(rows, tokenizer, stop_strings, self.describe(), elapsed(stack.device, started))

    @torch.inference_mode()
    def teacher_forced(self, stack: LayerStack, prompt: Sequence[int], continuation: Sequence[int],
                       stepwise: bool = False) -> RowRecord:
        """The record of this strategy forced through ``continuation`` after ``prompt`` (``stack`` reads out
        through the strategy's readout).

        A :class:`SelfPair` replays the loop from one full-depth pass
        (:func:`~emad.methods.ead_score.replay_self_pair`: the same record up to float rounding); ``stepwise``
        (always, for a :class:`ModelPair`) runs the loop token by token instead, the reference.
        """
        self.bind(stack, None)
        if not prompt or not continuation:
            raise ValueError("score_adaptive needs a non-empty prompt and continuation")
        prompt, continuation = [int(t) for t in prompt], [int(t) for t in continuation]
        if isinstance(self.pair, SelfPair) and not stepwise:
            check_context(self.pair.stacks(stack), len(prompt), len(continuation))
            return replay_self_pair(stack, self.pair.k, self.switcher, prompt, continuation)
        forced = iter(continuation)
        return self._run(stack, prompt, len(continuation), lambda _: next(forced), lambda _: None)

    def score(self, stack, prompt, continuation) -> Scored:
        row = self.teacher_forced(stack, prompt, continuation)
        return Scored(row.logprobs, row.depths, sum(row.flops), sum(row.full_flops), greedy=row.greedy)

    def replays(self) -> bool:
        """A self pair's scoring is a replay of the readouts at k and L (:mod:`emad.methods.ead_score`)."""
        return isinstance(self.pair, SelfPair)

    def replay_layers(self, n_layers: int) -> list[int]:
        return [self.pair.k, n_layers]

    def replay(self, reads, n_prompt, continuation, cost) -> Scored:
        """:meth:`score` from a shared pass's readouts at k and L (:func:`~emad.methods.ead_score.replay_reads`)."""
        row = replay_reads(cost, self.pair.k, cost.n_layers, self.switcher, n_prompt, continuation,
                           {"small": reads[self.pair.k], "large": reads[cost.n_layers]})
        return Scored(row.logprobs, row.depths, sum(row.flops), sum(row.full_flops), greedy=row.greedy)


def _prompt(prompt: Sequence[int], r: int) -> list[int]:
    if len(prompt) == 0:
        raise ValueError(f"prompt {r} is empty: every prompt needs at least one token")
    return [int(t) for t in prompt]

