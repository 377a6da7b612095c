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
