"""Exit criteria: at which probe layer a token stops and reads out its prediction.

A criterion names its probe layers (1-based, ascending; the last one is the deepest a token may run) and, at each
probe, decides per row whether the token exits there. The decode loop knows nothing else about it. New criteria
are one small class registered in :data:`CRITERIA`.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch

from emad.registry import Registry


class Criterion:
    """Base class. Subclasses set :attr:`name` through the registry and override what they need."""

    name: ClassVar[str]

    @classmethod
    def from_options(cls, **options) -> Criterion:
        """Build from a bag of options (CLI flags, params), taking the ones ``__init__`` names.

        Raises:
            ValueError: naming the option this criterion needs and did not get.
        """
        params = [p for p in inspect.signature(cls.__init__).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        missing = [p.name for p in params if p.default is p.empty and options.get(p.name) is None]
        if missing:
            raise ValueError(f"method {cls.name!r} needs {', '.join(missing)}")
        return cls(**{p.name: options[p.name] for p in params if options.get(p.name) is not None})

    def validate(self, n_layers: int) -> None:
        """Raise ``ValueError`` naming the parameter when this criterion cannot run on an L-layer model."""

    def probes(self, n_layers: int) -> list[int]:
        """Probe layers, 1-based and ascending; the last is the deepest any token runs."""
        return [n_layers]

    def prefill_depth(self, n_layers: int) -> int:
        """How many layers the prompt runs."""
        return n_layers

    def exits(self, layer: int, logits: torch.Tensor) -> torch.Tensor:
        """Per-row exit decision at probe ``layer`` from its readout ``[b, V]``: bool ``[b]``."""
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)

    def describe(self) -> dict:
        """Parameters identifying this operating point (for traces, JSON and MLflow)."""
        return {"method": self.name}


CRITERIA: Registry[Criterion] = Registry("exit criterion")


@CRITERIA.register("full")
class Full(Criterion):
    """Every token runs all L layers (the reference)."""


@CRITERIA.register("fixed")
class Fixed(Criterion):
    """Every token, prompt included, runs layers 1..m and reads out at m (the model truncated to m layers).

    Args:
        depth: m, in 1..L.
    """

    def __init__(self, depth: int):
        self.depth = depth

    def validate(self, n_layers: int) -> None:
        if not isinstance(self.depth, int) or not 1 <= self.depth <= n_layers:
            raise ValueError(f"depth must be an integer in 1..{n_layers} for this model, got {self.depth!r}")

    def probes(self, n_layers: int) -> list[int]:
        return [self.depth]

    def prefill_depth(self, n_layers: int) -> int:
        return self.depth

    def describe(self) -> dict:
        return {"method": self.name, "depth": self.depth}
