"""The decode loop on the layer stack: ``prefill`` → ``step`` → ``generate``, and teacher-forced ``score``.

One loop serves every method: a token runs from probe to probe, and at each probe the criterion decides, per
row, whether it exits there (Ĥ from the estimator); the policy bounds its depth and keeps the KV cache
consistent; the readout of the exit layer gives the token.
"""

from emad.decode.generate import Prefills, cut_at_stop, default_eos_ids, generate
from emad.decode.results import Generation, Scored, TokenTrace
from emad.decode.score import check_context_length, score, score_adaptive, score_continuations, score_requests
from emad.decode.step import (
    ContextLengthError,
    Method,
    Sampling,
    StepOutput,
    choose,
    left_pad,
    positions_of,
    prefill,
    step,
)
from emad.decode.sweep import Sweep, score_sweep

__all__ = [
    "ContextLengthError", "Generation", "Method", "Prefills", "Sampling", "Scored", "StepOutput", "Sweep", "TokenTrace",
    "check_context_length", "choose", "cut_at_stop", "default_eos_ids", "generate", "left_pad", "positions_of",
    "prefill", "score", "score_adaptive", "score_continuations", "score_requests", "score_sweep", "step",
]
