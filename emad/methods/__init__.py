"""Strategies that are more than a per-token exit: speculative decoding (separate or self drafter, AdaEDL)."""

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
from emad.methods.speculative import (
    SpeculativeResult,
    accept_greedy,
    accept_sampled,
    speculative_generate,
    warp,
)

__all__ = [
    "DRAFT_POLICIES", "AdaEDL", "ConfidenceStop", "DraftPolicy", "Drafter", "ModelDrafter", "SelfDrafter",
    "SpeculativeResult", "Static", "accept_greedy", "accept_sampled", "speculative_generate", "warp",
]
