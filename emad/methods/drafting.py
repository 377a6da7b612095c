"""The drafting side of speculative decoding: who drafts (drafters) and how many tokens (draft-length policies).

Drafters (batch 1; slot = position, no padding):

- :class:`ModelDrafter`: a separate, smaller :class:`~emad.engine.stack.LayerStack` with the target's vocabulary and its
  own :class:`~emad.engine.cache.KVCache`.
- :class:`SelfDrafter`: early exit at layer E of the target itself; the draft distribution is
  ``readout(h_E) = head(final_norm(T_E(h_E)))`` (T_E: the stack's readout, the identity for the logit lens; a
  trained translator makes it a Kangaroo-style adapter on the shallow sub-network). Drafting writes the K/V of layers 1..E straight into the target's
  cache, so verification only runs layers E+1..L (see :class:`SelfDrafter` for which K/V are valid when).

Draft-length policies (:data:`DRAFT_POLICIES`): ``static`` (always N), ``adaedl`` (entropy lower bound on the
acceptance probability, with a self-adjusting threshold λ) and ``confidence`` (drafter top-1 probability).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from emad.decode.step import prefill
from emad.engine.cache import KVCache
from emad.engine.cost import CostModel
from emad.engine.entropy import readout_summary
from emad.engine.stack import LayerStack
from emad.methods.common import check_inner_layer, check_same_vocabulary, feed, model_name, pass_cost
from emad.registry import Registry


# ---------------------------------------------------------------------------------------------- cost tally
@dataclass
class Tally:
    """FLOPs and bytes of weights read since the prompt, per side (``"drafter"``, ``"target"``)."""

    flops: dict[str, float] = field(default_factory=lambda: {"drafter": 0.0, "target": 0.0})
    bytes: dict[str, float] = field(default_factory=lambda: {"drafter": 0.0, "target": 0.0})

    def add(self, side: str, flops: float, bytes_: float) -> None:
        """Charge one pass to ``side``."""
        self.flops[side] += flops
        self.bytes[side] += bytes_


# ---------------------------------------------------------------------------------------------- drafters
class Drafter:
    """Proposes draft tokens for a target (batch 1). One drafter object serves one generation at a time.

    The decode loop calls :meth:`bind` once, :meth:`start` after the target's prefill, then per round
    :meth:`propose` (once per draft token, plus once more when a policy checks whether to stop),
    :meth:`verify_input` and :meth:`crop`.

    Attributes:
        stack: the drafter's own model, or None when it drafts with the target's layers.
    """

    stack: LayerStack | None = None

    def validate(self, n_layers: int) -> None:
        """Check that this drafter fits a target of ``n_layers`` layers; raise ``ValueError`` saying why not."""

    def bind(self, target: LayerStack, tokenizer) -> None:
        """Check that this drafter can serve ``target``; raise ``ValueError`` saying why not."""
        self.validate(target.n_layers)

    def start(self, target: LayerStack, cache: KVCache, prompt: list[int], capacity: int, tally: Tally) -> None:
        """Begin a generation: the target's cache already holds the prompt."""
        raise NotImplementedError

    def propose(self, seq: list[int]) -> torch.Tensor:
        """Drafter logits ``[V]`` for the token after ``seq`` (every token of ``seq`` fed so far stays fed)."""
        raise NotImplementedError

    def verify_input(self, seq: list[int], start: int) -> tuple[torch.Tensor, int]:
        """Hidden states ``[1, q, d]`` of ``seq[start:]`` for the target's verify pass, and the 0-based layer
        they enter; the target cache then has slots for all of ``seq``."""
        raise NotImplementedError

    def crop(self, n_slots: int) -> None:
        """Keep the drafter's state for the first ``n_slots`` tokens only (the rest were rejected)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Parameters identifying this drafter (for JSON and MLflow)."""
        return {}


def _arange(start: int, q: int, device) -> torch.Tensor:
    return torch.arange(start, start + q, device=device)[None]  # [1, q]


class SelfDrafter(Drafter):
    """Early exit at layer E of the target (layers 1..E draft; LayerSkip-style shared cache).

    Which K/V the target cache holds, with ``n`` committed tokens before the pending one ``x`` (slot ``n``) and
    drafts ``d_1..d_k`` (slots ``n+1..n+k``):

    - round start: slots ``0..n-1`` at every layer, nothing else;
    - after drafting: layers 1..E also hold ``x, d_1..d_{k-1}`` (each draft step runs one token through layers
      1..E and reads out ``h_E``), and ``d_k`` too when a policy's stop check ran it; layers E+1..L still stop at
      ``n-1``. These lower-layer K/V are exactly what the full model computes there (layers 1..E of a token
      depend only on layers 1..E of earlier tokens), so they are kept, as are the ``h_E``;
    - verification runs ``d_k`` through layers 1..E if no draft step did, then layers E+1..L for all ``k+1``
      tokens at once from their ``h_E``: slots ``0..n+k`` at every layer;
    - with ``i`` drafts accepted, slots ``0..n+i`` (``x`` and the accepted drafts) are valid at every layer;
      slots ``n+i+1..n+k`` (rejected drafts, at every layer) are cropped, and the target's replacement (or
      bonus) token becomes the pending token of the next round.

    Args:
        exit_layer: E, in 1..L-1.
    """

    def __init__(self, exit_layer: int):
        self.exit_layer = exit_layer

    def validate(self, n_layers: int) -> None:
        check_inner_layer("exit layer E", self.exit_layer, n_layers)

    def start(self, target, cache, prompt, capacity, tally) -> None:
        self.target, self.cache, self.tally = target, cache, tally
        self.cost = CostModel.from_stack(target)
        self.crop(len(prompt))

    def _lower(self, seq: list[int], side: str) -> torch.Tensor:
        """Run the tokens of ``seq`` not yet in the cache through layers 1..E; keep and return ``h_E [1, q, d]``."""
        first, q = self.cache.n_slots, len(seq) - self.cache.n_slots
        h = feed(self.target, self.cache, seq, self.exit_layer)  # [1, q, d]
        self.tally.add(side, *pass_cost(self.cost, 0, self.exit_layer, first, q, 1 if side == "drafter" else 0))
        self._h.append(h)
        return h

    def propose(self, seq: list[int]) -> torch.Tensor:
        return self.target.readout(self._lower(seq, "drafter")[0, -1], self.exit_layer)  # [V]

    def verify_input(self, seq: list[int], start: int) -> tuple[torch.Tensor, int]:
        if self.cache.n_slots < len(seq):
            self._lower(seq, "target")
        h = torch.cat(self._h, dim=1)  # [1, q, d]
        assert self._from == start and h.shape[1] == len(seq) - start, "drafter state out of step with the target"
        return h, self.exit_layer

    def crop(self, n_slots: int) -> None:
        self._h: list[torch.Tensor] = []  # h_E of slots _from.. (this round's tokens)
        self._from = n_slots

    def describe(self) -> dict:
        return {"drafter": "self", "exit_layer": self.exit_layer}


class ModelDrafter(Drafter):
    """A separate, smaller model with the target's vocabulary and its own KV cache.

    Its cache holds the committed tokens it has been fed; after a round where every draft was accepted it lags one
    token behind (the last draft was never fed), and the next :meth:`propose` feeds the missing tokens together.

    Args:
        stack: the drafter's layer stack.
        tokenizer: its tokenizer; when given, its vocabulary must equal the target tokenizer's.
    """

    def __init__(self, stack: LayerStack, tokenizer=None):
        self.stack, self.tokenizer = stack, tokenizer

    def bind(self, target: LayerStack, tokenizer) -> None:
        check_same_vocabulary("drafter", self.stack, self.tokenizer, target, tokenizer)

    def start(self, target, cache, prompt, capacity, tally) -> None:
        self.target, self.target_cache, self.tally = target, cache, tally
        self.cost = CostModel.from_stack(self.stack)
        self.cache = self.stack.new_cache(1, capacity)
        ids = torch.tensor([prompt], device=self.stack.device)  # [1, P]
        prefill(self.stack, self.cache, ids, torch.ones_like(ids, dtype=torch.bool), self.stack.n_layers)

    def propose(self, seq: list[int]) -> torch.Tensor:
        first, q = self.cache.n_slots, len(seq) - self.cache.n_slots
        h = feed(self.stack, self.cache, seq, self.stack.n_layers)  # [1, q, d]
        self.tally.add("drafter", *pass_cost(self.cost, 0, self.stack.n_layers, first, q, 1))
        return self.stack.readout(h[0, -1]).to(self.target.device)  # [V]

    def verify_input(self, seq: list[int], start: int) -> tuple[torch.Tensor, int]:
        ids = torch.tensor([seq[start:]], device=self.target.device)  # [1, q]
        slots = self.target_cache.allocate(torch.ones_like(ids, dtype=torch.bool))
        assert slots.start == start, "target cache out of step with the committed tokens"
        return self.target.embed(ids, _arange(start, ids.shape[1], ids.device)), 0

    def crop(self, n_slots: int) -> None:
        self.cache.crop(min(n_slots, self.cache.n_slots))

    def describe(self) -> dict:
        return {"drafter": "model", "drafter_model": model_name(self.stack)}


# ---------------------------------------------------------------------------------------------- draft length
class DraftPolicy:
    """How many tokens to draft per round: at most ``n``; the first draft of a round is always proposed.

    Before proposing draft ``j ≥ 2`` the loop asks :meth:`keep_drafting` with the drafter's logits for it; after
    each verification it calls :meth:`update`. :meth:`reset` starts a generation afresh.

    Args:
        n: N, the most drafts per round (>= 1).
    """

    name: ClassVar[str]

    def __init__(self, n: int = 4):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n (the maximum draft length N) must be an integer >= 1, got {n!r}")
        self.n = n

    def reset(self) -> None:
        """Forget what earlier generations taught (called at the start of each generation)."""

    def keep_drafting(self, logits: torch.Tensor) -> bool:
        """True to propose the token whose drafter logits ``[V]`` (before temperature) are given."""
        return True

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from one verification: ``accepted`` of ``drafted`` drafts were kept."""

    def describe(self) -> dict:
        """Parameters identifying this policy."""
        return {"draft_policy": self.name, "max_draft": self.n}


DRAFT_POLICIES: Registry[DraftPolicy] = Registry("draft-length policy")


@DRAFT_POLICIES.register("static")
class Static(DraftPolicy):
    """Always draft N tokens."""


@DRAFT_POLICIES.register("confidence")
class ConfidenceStop(DraftPolicy):
    """Stop drafting when the drafter's top-1 probability (before temperature) is below ``c``.

    Args:
        n: the most drafts per round.
        c: confidence threshold in (0, 1).
    """

    def __init__(self, n: int = 8, c: float = 0.5):
        super().__init__(n)
        if not 0 < c < 1:
            raise ValueError(f"c (the confidence threshold) must be in (0, 1), got {c!r}")
        self.c = c

    def keep_drafting(self, logits: torch.Tensor) -> bool:
        return float(readout_summary(logits)[2]) >= self.c

    def describe(self) -> dict:
        return {**super().describe(), "c": self.c}


@DRAFT_POLICIES.register("adaedl")
class AdaEDL(DraftPolicy):
    """Stop drafting when the entropy lower bound on the acceptance probability falls below λ.

    With ``H`` the entropy (nats, before temperature) of the drafter's distribution for the next draft, the draft
    is proposed while ``1 − sqrt(γ·H) ≥ λ`` and drafting stops when ``1 − sqrt(γ·H) < λ``.

    λ follows the acceptance rate. After a verification in which ``k ≥ 1`` drafts were proposed and ``i`` accepted:

        a   = i / k
        ā  ← β·ā + (1 − β)·a                      (ā starts at α*, the target acceptance rate)
        λ  ← clip(λ + η·(α* − ā), 0, 1)

    so acceptance below target raises λ (shorter drafts, which are accepted more often) and acceptance above
    target lowers it (longer drafts). ā and λ restart from α* and λ₀ at each generation.

    Args:
        n: the most drafts per round.
        gamma: γ > 0, the entropy scale.
        lam: λ₀ in [0, 1], the starting threshold.
        target_acceptance: α* in (0, 1].
        beta: β in [0, 1), the moving average's memory.
        eta: η >= 0, the step size of λ (0 keeps λ fixed).
    """

    def __init__(self, n: int = 8, gamma: float = 0.2, lam: float = 0.4, target_acceptance: float = 0.7,
                 beta: float = 0.9, eta: float = 0.1):
        super().__init__(n)
        checks = {"gamma": gamma > 0, "lam": 0 <= lam <= 1, "target_acceptance": 0 < target_acceptance <= 1,
                  "beta": 0 <= beta < 1, "eta": eta >= 0}
        ranges = {"gamma": "> 0", "lam": "in [0, 1]", "target_acceptance": "in (0, 1]", "beta": "in [0, 1)",
                  "eta": ">= 0"}
        values = {"gamma": gamma, "lam": lam, "target_acceptance": target_acceptance, "beta": beta, "eta": eta}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {ranges[name]}, got {values[name]!r}")
        self.gamma, self.lam0, self.target, self.beta, self.eta = gamma, lam, target_acceptance, beta, eta
        self.reset()

    def reset(self) -> None:
        self.lam, self.rate = self.lam0, self.target

    def bound(self, logits: torch.Tensor) -> float:
        """``1 − sqrt(γ·H)``: the lower bound on the acceptance probability of the next draft."""
        return 1.0 - math.sqrt(self.gamma * float(readout_summary(logits)[0]))

    def keep_drafting(self, logits: torch.Tensor) -> bool:
        return self.bound(logits) >= self.lam

    def update(self, drafted: int, accepted: int) -> None:
        if drafted < 1:
            return
        self.rate = self.beta * self.rate + (1 - self.beta) * accepted / drafted
        self.lam = min(1.0, max(0.0, self.lam + self.eta * (self.target - self.rate)))

    def describe(self) -> dict:
        return {**super().describe(), "gamma": self.gamma, "lam": self.lam0,
                "target_acceptance": self.target, "beta": self.beta, "eta": self.eta}
