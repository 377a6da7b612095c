"""Entropy estimators: how Ĥ is computed at a probe, and what one probe costs.

``exact`` reads out the full head; cheaper estimators register beside it. An estimator that already produced the
full readout hands its logits back, so the exit readout is not paid twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from emad.cost import CostModel
from emad.entropy import readout_summary
from emad.registry import Registry


@dataclass
class Estimate:
    """Ĥ at one probe for ``a`` rows.

    Attributes:
        entropy: ``[a]`` estimated entropy (nats).
        max_prob: ``[a]`` estimated max probability (confidence strata).
        logits: ``[a, V]`` the full readout when the estimator computed it, else None.
    """

    entropy: torch.Tensor
    max_prob: torch.Tensor
    logits: torch.Tensor | None = None


class Estimator:
    """Base class of entropy estimators."""

    name: ClassVar[str]

    @classmethod
    def from_sample(cls, stack, sample: dict, **options) -> Estimator:
        """Build for fitting, given a calibration sample (see :func:`emad.estimator_fit.collect`)."""
        return cls(**options)

    def estimate(self, stack, h: torch.Tensor, layer: int) -> Estimate:
        """Ĥ for hidden states ``h`` ``[a, d]`` at probe ``layer``."""
        raise NotImplementedError

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        """(FLOPs, bytes) of one probe for one token."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"estimator": self.name}


ESTIMATORS: Registry[Estimator] = Registry("entropy estimator")


@ESTIMATORS.register("exact")
class Exact(Estimator):
    """Full readout (final norm + head) and its exact entropy: a probe costs one readout."""

    def estimate(self, stack, h: torch.Tensor, layer: int) -> Estimate:
        logits = stack.readout(h)  # [a, V]
        entropy, _, max_prob = readout_summary(logits)
        return Estimate(entropy, max_prob, logits)

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        return float(cost.readout_flops), float(cost.readout_bytes)


class _Corrected(Estimator):
    """An approximate estimator with a per-layer linear correction ``Ĥ = slope_ℓ · raw + intercept_ℓ``.

    The correction is fitted on calibration tokens (:func:`emad.estimator_fit.fit`); without one, the raw
    estimate is used. ``exact_by_construction`` estimators (K = V, r = d) keep the raw value.
    """

    exact_by_construction = False

    def __init__(self, correction: dict | None = None):
        self.correction = {int(k): tuple(v) for k, v in (correction or {}).items()}

    def corrected(self, raw: torch.Tensor, layer: int) -> torch.Tensor:
        if self.exact_by_construction or layer not in self.correction:
            return raw
        slope, intercept = self.correction[layer]
        return (raw * slope + intercept).clamp_min(0.0)


@ESTIMATORS.register("topk")
class TopK(_Corrected):
    """Entropy over a shortlist of K candidate tokens (the head rows of the shortlist only), with a per-layer
    tail-mass correction fitted on calibration tokens. The shortlist is the K tokens most often predicted
    (final-layer argmax) on the calibration split, topped up with the most frequent input tokens.

    Args:
        k: shortlist size (1..V; K = V is the exact entropy).
        shortlist: token ids (length k), from fitting; None = the first k ids (only meaningful for K = V).
        correction: ``{layer: (slope, intercept)}``.
    """

    def __init__(self, k: int, shortlist: list[int] | None = None, correction: dict | None = None):
        super().__init__(correction)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"topk: k must be an integer >= 1, got {k!r}")
        self.k, self.shortlist = k, shortlist
        self._rows: torch.Tensor | None = None  # [k, d] head rows of the shortlist

    @classmethod
    def from_sample(cls, stack, sample: dict, **options) -> TopK:
        """Shortlist: the K tokens most often predicted at the final layer, topped up with frequent inputs."""
        vocab, k = stack.vocab_size, options["k"]
        counts = torch.bincount(sample["final_argmax"].cpu(), minlength=vocab).double() * vocab
        counts += torch.bincount(sample["inputs"].cpu(), minlength=vocab).double()
        return cls(shortlist=counts.argsort(descending=True, stable=True)[:k].tolist(), **options)

    def _head_rows(self, stack) -> torch.Tensor:
        if self._rows is None:
            vocab = stack.vocab_size
            if self.k > vocab:
                raise ValueError(f"topk: k = {self.k} exceeds the vocabulary size {vocab}")
            ids = torch.tensor(self.shortlist if self.shortlist is not None else range(self.k), dtype=torch.long)
            self.exact_by_construction = self.k == vocab
            self._rows = stack.head.weight[ids.to(stack.device)].detach()
        return self._rows

    def estimate(self, stack, h: torch.Tensor, layer: int) -> Estimate:
        logits = stack.final_norm(h) @ self._head_rows(stack).T  # [a, k]
        if stack.softcap is not None:
            logits = torch.tanh(logits / stack.softcap) * stack.softcap
        raw, _, max_prob = readout_summary(logits)
        return Estimate(self.corrected(raw, layer), max_prob, None)

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        """``2 × d × K`` FLOPs and the K head rows' bytes (the final norm is element-wise, not counted)."""
        return 2.0 * cost.head_in * self.k, float(cost.head_element_bytes * cost.head_in * self.k)

    def options(self) -> dict:
        return {"k": self.k, "shortlist": self.shortlist}

    def describe(self) -> dict:
        return {"estimator": self.name, "k": self.k}


@ESTIMATORS.register("lowrank")
class LowRank(_Corrected):
    """Readout through a rank-r factorisation ``W ≈ A·B`` of the unembedding (truncated SVD), then its entropy,
    with a per-layer linear correction fitted on calibration tokens.

    Args:
        rank: r (1..d; r = d is the exact readout up to rounding).
        correction: ``{layer: (slope, intercept)}``.
    """

    def __init__(self, rank: int, correction: dict | None = None):
        super().__init__(correction)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lowrank: rank must be an integer >= 1, got {rank!r}")
        self.rank = rank
        self._factors: tuple[torch.Tensor, torch.Tensor] | None = None  # A [V, r], B [r, d]

    def _ab(self, stack) -> tuple[torch.Tensor, torch.Tensor]:
        if self._factors is None:
            weight = stack.head.weight.detach().float()  # [V, d]
            if self.rank > weight.shape[1]:
                raise ValueError(f"lowrank: rank = {self.rank} exceeds the hidden size {weight.shape[1]}")
            u, s, vh = torch.linalg.svd(weight, full_matrices=False)
            r = self.rank
            self.exact_by_construction = r == weight.shape[1]
            self._factors = ((u[:, :r] * s[:r]).to(stack.dtype), vh[:r].to(stack.dtype))
        return self._factors

    def estimate(self, stack, h: torch.Tensor, layer: int) -> Estimate:
        a, b = self._ab(stack)
        logits = (stack.final_norm(h) @ b.T) @ a.T  # [a, V]
        if stack.softcap is not None:
            logits = torch.tanh(logits / stack.softcap) * stack.softcap
        raw, _, max_prob = readout_summary(logits)
        return Estimate(self.corrected(raw, layer), max_prob, None)

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        """``2 × r × (d + V)`` FLOPs and the bytes of the two factors."""
        params = self.rank * (cost.head_in + cost.vocab_size)
        return 2.0 * params, float(cost.head_element_bytes * params)

    def options(self) -> dict:
        return {"rank": self.rank}

    def describe(self) -> dict:
        return {"estimator": self.name, "rank": self.rank}
