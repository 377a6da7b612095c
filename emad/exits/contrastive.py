"""Within-model contrast between layers: the pieces of the ``contrastive`` criterion, as pure functions.

For a token at layer ℓ with the expert distribution ``p = softmax(readout_ℓ)`` and earlier candidate layers m:

- amateur layer: per row, the m with the largest ``JSD(p ‖ p_m) / (1 + d·(ℓ − m))`` (Jensen–Shannon divergence
  discounted by layer distance, ``d`` = ``distance_discount``);
- plausibility set: ``{x : p(x) ≥ α′·max p}`` with the hyperbolic schedule ``α′ = α / (1 + r·ℓ) · (1 − c)``,
  c = max p (the expert's confidence);
- contrastive distribution: ``softmax(log p − w·log p_amateur)`` on the plausible set, 0 elsewhere (w = 1 is
  DoLa's contrast; other w the weighted variant).

Every reduction is per row: rows of a batch never influence each other.
"""

from __future__ import annotations

import torch

from emad.engine.fused import fused


@fused
def entropy_of(p: torch.Tensor) -> torch.Tensor:
    """Entropy ``-Σ p log p`` (nats, ``0 log 0 = 0``) of probabilities ``[..., V]`` → ``[...]``."""
    return -torch.where(p > 0, p * p.log(), 0.0).sum(-1)


def jsd(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence (nats) between distributions given as log-probabilities ``[..., V]`` → ``[...]``.

    ``-inf`` entries (zero probability) are allowed on either side.
    """
    p, q = logp.exp(), logq.exp()
    return jsd_probs(p, q, entropy_of(p), entropy_of(q))


@fused
def log_distribution(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log_softmax(logits)``, its probabilities and their entropy, in fp32: ``[..., V]`` → ``[..., V]``,
    ``[..., V]``, ``[...]`` (one pass where fused)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return logp, p, -torch.where(p > 0, p * logp, 0.0).sum(-1)


@fused
def jsd_probs(p: torch.Tensor, q: torch.Tensor, h_p: torch.Tensor, h_q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence from probabilities ``[..., V]`` and their entropies ``[...]`` (broadcast):
    ``H((p + q)/2) − (H(p) + H(q))/2`` → ``[...]``, clamped at 0."""
    m = (p + q) * 0.5
    return (-torch.where(m > 0, m * m.log(), 0.0).sum(-1) - 0.5 * (h_p + h_q)).clamp_min(0.0)


def choose_amateur(logp: torch.Tensor, candidates: torch.Tensor, layer: int, layers: list[int],
                   distance_discount: float) -> torch.Tensor:
    """Index (into ``layers``) of each row's amateur layer.

    Args:
        logp: expert log-probabilities ``[a, V]`` at ``layer``.
        candidates: candidate log-probabilities ``[C, a, V]`` at the earlier ``layers`` (length C).
        distance_discount: d >= 0 in ``JSD / (1 + d·(layer − m))``.

    Returns:
        ``[a]`` long.
    """
    p, q = logp.exp(), candidates.exp()
    return amateur_of(jsd_probs(p[None], q, entropy_of(p)[None], entropy_of(q)), layer, layers, distance_discount)


def amateur_of(scores: torch.Tensor, layer: int, layers: list[int], distance_discount: float) -> torch.Tensor:
    """Each row's amateur from the JSDs ``[C, a]`` of the candidate ``layers``: the largest discounted one → ``[a]``."""
    distance = torch.tensor([layer - m for m in layers], dtype=scores.dtype, device=scores.device)[:, None]
    return (scores / (1 + distance_discount * distance)).argmax(0)


def plausibility_alpha(alpha: float, rate: float, layer: int, confidence: torch.Tensor) -> torch.Tensor:
    """``α′ = α / (1 + r·ℓ) · (1 − c)`` per row: ``[a]``."""
    return alpha / (1 + rate * layer) * (1 - confidence)


@fused
def contrastive_logprobs(logp: torch.Tensor, logq: torch.Tensor, alpha_prime: torch.Tensor,
                         weight: float = 1.0) -> torch.Tensor:
    """Log of the contrastive distribution ``[a, V]``: ``log_softmax(log p − w·log q)`` over the plausible set
    ``{x : p(x) ≥ α′·max p}`` (``-inf`` outside it). The expert's argmax is always plausible, so every row
    has at least one token."""
    max_logp = logp.max(-1, keepdim=True).values  # [a, 1]
    plausible = logp >= max_logp + alpha_prime.clamp_min(torch.finfo(logp.dtype).tiny).log()[:, None]
    plausible |= logp == max_logp
    score = torch.where(plausible, logp - weight * torch.nan_to_num(logq, neginf=-1e4), float("-inf"))
    return torch.log_softmax(score, dim=-1)


@fused
def contrastive_top(logp: torch.Tensor, logq: torch.Tensor, scale: float, weight: float = 1.0) -> torch.Tensor:
    """The contrastive distribution's top probability per row ``[a]``: :func:`contrastive_logprobs`' row maximum,
    exponentiated, with ``α′ = scale·(1 − max p)`` (:func:`plausibility_alpha`'s, ``scale = α/(1 + r·ℓ)``), in one
    kernel that writes no ``[a, V]``."""
    max_logp = logp.max(-1, keepdim=True).values  # [a, 1]
    alpha_prime = scale * (1 - max_logp.exp())
    plausible = logp >= max_logp + alpha_prime.clamp_min(torch.finfo(logp.dtype).tiny).log()
    plausible |= logp == max_logp
    score = torch.where(plausible, logp - weight * torch.nan_to_num(logq, neginf=-1e4), float("-inf"))
    return torch.exp(score - score.amax(-1, keepdim=True)).sum(-1).reciprocal()  # 1 / Σ exp(score − max score)
