"""Exit criteria: at which probe layer a token stops and reads out its prediction.

A criterion names its probe layers (1-based, ascending; the last is the deepest a token may run) and, at each
probe, decides per row whether the token exits there, from a :class:`ProbeView` (the estimated entropy Ĥ and what
stratifies the token). The decode loop knows nothing else about it. New criteria are one small class registered
in :data:`CRITERIA`; every criterion takes ``min_exit_layer`` (no exit below it).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from emad.registry import Registry


@dataclass
class ProbeView:
    """What a criterion sees at one probe, for the ``a`` rows still running.

    Attributes:
        layer: the probe layer (1-based).
        entropy: ``[a]`` estimated entropy Ĥ (nats).
        positions: ``[a]`` position id of each token (tokens before it in its context).
        first_confidence: ``[a]`` max probability at the token's first probe (for strata), or None.
    """

    layer: int
    entropy: torch.Tensor
    positions: torch.Tensor
    first_confidence: torch.Tensor | None = None


class Criterion:
    """Base class. Subclasses set :attr:`name` through the registry and override what they need.

    Attributes:
        needs_estimate: False when the criterion never looks at Ĥ (then probes cost nothing before the exit).
        min_exit_layer: no exit below this layer.
    """

    name: ClassVar[str]
    needs_estimate: ClassVar[bool] = True
    min_exit_layer: int = 1

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
        if not isinstance(self.min_exit_layer, int) or not 1 <= self.min_exit_layer <= n_layers:
            raise ValueError(f"min_exit_layer must be in 1..{n_layers}, got {self.min_exit_layer!r}")

    def probes(self, n_layers: int) -> list[int]:
        """Probe layers, 1-based and ascending; the last is the deepest any token runs."""
        return [n_layers]

    def prefill_depth(self, n_layers: int) -> int:
        """How many layers the prompt runs."""
        return n_layers

    def needs_first_confidence(self) -> bool:
        """True when decisions use the max probability at the first probe (confidence strata)."""
        return False

    def exits(self, view: ProbeView) -> torch.Tensor:
        """Per-row exit decision at a probe: bool ``[a]``."""
        return torch.zeros_like(view.entropy, dtype=torch.bool)

    def describe(self) -> dict:
        """Parameters identifying this operating point (for traces, JSON and MLflow)."""
        return {"method": self.name}


CRITERIA: Registry[Criterion] = Registry("exit criterion")


def _check_threshold(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (inf allowed), got {value!r}")


def _every(probe_every: int, n_layers: int) -> list[int]:
    if not isinstance(probe_every, int) or not 1 <= probe_every <= n_layers:
        raise ValueError(f"probe_every must be in 1..{n_layers}, got {probe_every!r}")
    return sorted(set(range(probe_every, n_layers + 1, probe_every)) | {n_layers})


@CRITERIA.register("full")
class Full(Criterion):
    """Every token runs all L layers (the reference)."""

    needs_estimate = False


@CRITERIA.register("fixed")
class Fixed(Criterion):
    """Every token, prompt included, runs layers 1..m and reads out at m (the model truncated to m layers).

    Args:
        depth: m, in 1..L.
    """

    needs_estimate = False

    def __init__(self, depth: int):
        self.depth = depth

    def validate(self, n_layers: int) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or not 1 <= self.depth <= n_layers:
            raise ValueError(f"depth must be an integer in 1..{n_layers} for this model, got {self.depth!r}")

    def probes(self, n_layers: int) -> list[int]:
        return [self.depth]

    def prefill_depth(self, n_layers: int) -> int:
        return self.depth

    def describe(self) -> dict:
        return {"method": self.name, "depth": self.depth}


@CRITERIA.register("confidence")
class Confidence(Criterion):
    """Exit at the first probe with Ĥ ≤ h0 (one global entropy threshold).

    Args:
        threshold: h0 in nats (>= 0).
        probe_every: probe every k-th layer (L always probed).
        min_exit_layer: no exit below this layer.
    """

    def __init__(self, threshold: float, probe_every: int = 3, min_exit_layer: int = 1):
        _check_threshold("threshold", threshold)
        self.threshold, self.probe_every, self.min_exit_layer = float(threshold), probe_every, min_exit_layer

    def validate(self, n_layers: int) -> None:
        super().validate(n_layers)
        _every(self.probe_every, n_layers)

    def probes(self, n_layers: int) -> list[int]:
        return _every(self.probe_every, n_layers)

    def exits(self, view: ProbeView) -> torch.Tensor:
        return view.entropy <= self.threshold

    def describe(self) -> dict:
        return {"method": self.name, "threshold": self.threshold, "probe_every": self.probe_every,
                "min_exit_layer": self.min_exit_layer}


@CRITERIA.register("emad")
class Emad(Criterion):
    """Exit at the shallowest probe ℓ with Ĥ_ℓ ≤ τ_ℓ(stratum of the token) − margin.

    Args:
        profile: the target profile (its probe layers are the probes).
        margin: m in nats (>= 0; +inf never exits early).
        min_exit_layer: no exit below this layer.
        probe_stride: probe every k-th of the profile's probe layers, counted down from L (1 = all of them).
    """

    def __init__(self, profile, margin: float, min_exit_layer: int = 1, probe_stride: int = 1):
        _check_threshold("margin", margin)
        if isinstance(probe_stride, bool) or not isinstance(probe_stride, int) or probe_stride < 1:
            raise ValueError(f"probe_stride must be an integer >= 1, got {probe_stride!r}")
        self.profile, self.margin, self.min_exit_layer = profile, float(margin), min_exit_layer
        self.probe_stride = probe_stride
        self._tau: torch.Tensor | None = None  # [S, P] on the decoding device
        self._column = {layer: i for i, layer in enumerate(profile.probe_layers)}

    def validate(self, n_layers: int) -> None:
        super().validate(n_layers)
        layers = self.profile.probe_layers
        if any(not 1 <= x <= n_layers for x in layers) or layers[-1] != n_layers:
            raise ValueError(f"profile probe layers {layers} do not fit a {n_layers}-layer model "
                             f"(they must lie in 1..{n_layers} and end at {n_layers})")
        if self.probe_stride > 1 and self.profile.strata.uses_confidence:
            raise ValueError("probe_stride > 1 would move the first probe that confidence strata were calibrated "
                             "at; use a profile without confidence strata")

    def probes(self, n_layers: int) -> list[int]:
        return list(self.profile.probe_layers)[::-1][:: self.probe_stride][::-1]

    def needs_first_confidence(self) -> bool:
        return self.profile.strata.uses_confidence

    def exits(self, view: ProbeView) -> torch.Tensor:
        if self._tau is None or self._tau.device != view.entropy.device:
            self._tau = self.profile.table(view.entropy.device)
        strata = self.profile.strata.assign(view.positions, view.first_confidence)  # [a]
        tau = self._tau[strata, self._column[view.layer]]  # [a]
        return view.entropy <= tau - self.margin

    def describe(self) -> dict:
        return {"method": self.name, "margin": self.margin, "min_exit_layer": self.min_exit_layer,
                "probe_stride": self.probe_stride, "strata": self.profile.strata.variant,
                "profile_model": self.profile.model.get("spec", ""), "profile_corpus": self.profile.corpus}
