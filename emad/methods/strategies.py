"""Strategies by name (:data:`STRATEGIES`): ``ead`` (two-model entropy switching) and ``speculative`` (drafts
verified by the target, with a draft-length policy). Operating points, the CLI and lm-eval build them from options
with :meth:`~emad.decode.strategy.Strategy.from_options`."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import replace

from emad.decode.results import Generation, Scored
from emad.decode.score import score_adaptive
from emad.decode.step import Method, elapsed
from emad.decode.strategy import Strategy
from emad.engine.cost import CostModel
from emad.exits import registries
from emad.exits.criteria import Full
from emad.methods.common import RowRecord, full_cost, to_generation
from emad.methods.drafting import DRAFT_POLICIES, Drafter, DraftPolicy, ModelDrafter, SelfDrafter
from emad.methods.ead import EAD
from emad.methods.speculative import SpeculativeResult, speculative_generate
from emad.registry import Registry

STRATEGIES: Registry[Strategy] = registries.STRATEGIES  # declared there, with its names
STRATEGIES.register("ead")(EAD)


@STRATEGIES.register("speculative")
class Speculative(Strategy):
    """Speculative decoding (see :func:`~emad.methods.speculative.speculative_generate`), one row at a time.

    Per token, the generation reports the row's whole spend (drafter and target) divided evenly over its tokens,
    and depth L (every token is the target's). Scoring is the target's own full-depth scoring: the method is
    lossless, so a text's probability under it is the target's, and teacher forcing needs no drafts.
    """

    knobs = {"exit_layer": "high"}  # the self drafter's exit layer: higher drafts better and costs more

    def __init__(self, drafter: Drafter, policy: DraftPolicy):
        self.drafter, self.policy = drafter, policy

    @classmethod
    def from_options(cls, load: Callable | None = None, drafter: str = "self", exit_layer: int | None = None,
                     draft_policy: str = "static", max_draft: int = 4, gamma: float | None = None,
                     lam: float | None = None, target_acceptance: float | None = None, beta: float | None = None,
                     eta: float | None = None, draft_confidence: float | None = None) -> Speculative:
        """``drafter``: ``self`` (early exit at ``exit_layer`` of the target) or a second model's spec.
        ``draft_policy``: ``static``, ``adaedl`` (``gamma``, ``lam``, ``target_acceptance``, ``beta``, ``eta``) or
        ``confidence`` (``draft_confidence``); ``max_draft`` is N."""
        policy = cls._policy(drafter, exit_layer, draft_policy, max_draft, gamma, lam, target_acceptance, beta, eta,
                             draft_confidence)
        if drafter == "self":
            return cls(SelfDrafter(exit_layer), policy)
        if load is None:
            raise ValueError(f"method 'speculative' with drafter={drafter!r} needs a model loader")
        return cls(ModelDrafter(*load(drafter)), policy)

    @classmethod
    def check_options(cls, drafter: str = "self", exit_layer: int | None = None, draft_policy: str = "static",
                      max_draft: int = 4, gamma: float | None = None, lam: float | None = None,
                      target_acceptance: float | None = None, beta: float | None = None, eta: float | None = None,
                      draft_confidence: float | None = None) -> None:
        cls._policy(drafter, exit_layer, draft_policy, max_draft, gamma, lam, target_acceptance, beta, eta,
                    draft_confidence)

    @staticmethod
    def _policy(drafter, exit_layer, draft_policy, max_draft, gamma, lam, target_acceptance, beta, eta,
                draft_confidence) -> DraftPolicy:
        """The draft-length policy, after checking that a self drafter has its exit layer."""
        if drafter == "self" and exit_layer is None:
            raise ValueError("method 'speculative' with drafter=self needs exit_layer (E, in 1..L-1)")
        try:
            policy_cls = DRAFT_POLICIES.get(draft_policy)
        except KeyError as err:
            raise ValueError(err.args[0]) from None
        given = {"n": max_draft, "gamma": gamma, "lam": lam, "target_acceptance": target_acceptance, "beta": beta,
                 "eta": eta, "c": draft_confidence}
        accepted = set(inspect.signature(policy_cls.__init__).parameters)
        return policy_cls(**{k: v for k, v in given.items() if v is not None and k in accepted})

    def validate(self, n_layers: int) -> None:
        self.drafter.validate(n_layers)

    def bind(self, stack, tokenizer) -> None:
        self.drafter.bind(stack, tokenizer)

    def describe(self) -> dict:
        return {"method": self.name, **self.drafter.describe(), **self.policy.describe(), **self.readout_facts()}

    def readout_layers(self, n_layers: int) -> list[int]:
        return [self.drafter.exit_layer] if isinstance(self.drafter, SelfDrafter) else []

    def generate(self, stack, tokenizer, prompts, max_new_tokens, sampling, stop_strings, eos_token_ids,
                 on_token) -> Generation:
        started = time.perf_counter()
        self.bind(stack, tokenizer)
        cost, rows = CostModel.from_stack(stack), []
        for r, prompt in enumerate(prompts):
            stream = None if on_token is None else (lambda t, r=r: on_token(r, t))
            out = speculative_generate(stack, tokenizer, [list(prompt)], self.drafter, max_new_tokens, self.policy,
                                       replace(sampling, seed=sampling.seed + r), stop_strings, eos_token_ids,
                                       stream)
            rows.append(_row(out, cost, len(prompt), stack.n_layers))
        return to_generation(rows, tokenizer, stop_strings, self.describe(), elapsed(stack.device, started))

    def score(self, stack, prompt, continuation) -> Scored:
        self.bind(stack, None)
        return score_adaptive(stack, prompt, continuation, Full())

    def scored_as(self) -> Method:
        """Full depth through this strategy's readout: verification makes every token the target's (lossless), so
        its teacher-forced scores are full depth's (:meth:`score`)."""
        return Method(Full(), readout=self.readout)


def _row(out: SpeculativeResult, cost: CostModel, prompt_len: int, n_layers: int) -> RowRecord:
    n = len(out.token_ids)
    flops = (out.drafter_flops + out.target_flops) / n
    bytes_ = (out.drafter_bytes + out.target_bytes) / n
    full_flops, full_bytes = full_cost(cost, prompt_len, n)
    return RowRecord(
        ids=out.token_ids, logprobs=out.logprobs, greedy=[], depths=[n_layers] * n, flops=[flops] * n,
        bytes=[bytes_] * n, full_flops=full_flops, full_bytes=full_bytes, entropies=[{}] * n,
        reasons=["verified"] * n, finish=out.finish_reason,
        stats={"drafted": float(out.drafted), "accepted": float(out.accepted),
               "verifications": float(out.verifications), "verified_tokens": float(n - 1)},
    )
