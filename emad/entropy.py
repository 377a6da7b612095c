"""Entropy of readout distributions (natural log, nats, always computed in fp32).

Only the exact entropy lives here for now; cheap estimators register beside it.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Exact entropy H = -Σ p log p of softmax(logits) over the last axis, in nats.

    Computed in float32 whatever the input dtype, as ``logsumexp(z) - Σ softmax(z)·z`` on max-shifted logits,
    which is stable for very peaked (H → 0) and very flat (H → log V) distributions; ``-inf`` logits (masked
    tokens) contribute nothing.

    Args:
        logits: ``[..., V]`` unnormalised log-probabilities.

    Returns:
        ``[...]`` float32 entropies, each in ``[0, log V]``.
    """
    z = logits.float()
    z = z - z.amax(dim=-1, keepdim=True)  # max 0: exp never overflows
    log_norm = torch.logsumexp(z, dim=-1)  # [...]
    p = torch.softmax(z, dim=-1)
    weighted = torch.where(p > 0, p * z, torch.zeros_like(z)).sum(dim=-1)  # Σ p z, skipping -inf entries
    return (log_norm - weighted).clamp_min(0.0)


def readout_summary(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy, argmax and max probability of softmax(logits) over the last axis, from one fp32 pass.

    Returns:
        ``(entropy [...] float32 nats, argmax [...] long, max_prob [...] float32)``.
    """
    z = logits.float()
    top, argmax = z.max(dim=-1)
    z = z - top[..., None]
    log_norm = torch.logsumexp(z, dim=-1)  # [...]
    p = torch.exp(z - log_norm[..., None])
    weighted = torch.where(p > 0, p * z, torch.zeros_like(z)).sum(dim=-1)
    return (log_norm - weighted).clamp_min(0.0), argmax, torch.exp(-log_norm)
