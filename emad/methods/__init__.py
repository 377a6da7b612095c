"""Strategies that are more than a per-token exit: two-model entropy switching (EAD) and speculative decoding
(separate or self drafter; static, AdaEDL or confidence draft length). Each is registered in :data:`STRATEGIES`."""

from emad.methods.drafting import (
    DRAFT_POLICIES,
    AdaEDL,
    ConfidenceStop,
    Drafter,
    DraftPolicy,
    ModelDrafter,
    SelfDrafter,
    Static,
)
from emad.methods.ead import EAD, ModelPair, SelfPair, Switcher
from emad.methods.speculative import (
    SpeculativeResult,
    accept_greedy,
    accept_sampled,
    speculative_generate,
    warp,
)
from emad.methods.strategies import STRATEGIES, Speculative

__all__ = [
    "DRAFT_POLICIES", "EAD", "STRATEGIES", "AdaEDL", "ConfidenceStop", "DraftPolicy", "Drafter", "ModelDrafter",
    "ModelPair", "SelfDrafter", "SelfPair", "Speculative", "SpeculativeResult", "Static", "Switcher",
    "accept_greedy", "accept_sampled", "speculative_generate", "warp",
]
