"""Stratifiers: which stratum a token belongs to, from its position and its shallow-layer confidence.

A stratum is a (position bucket, confidence bucket) pair flattened to one index. Position = number of tokens
before it in the model's context; confidence = max softmax probability of the readout at the first probe layer.
With no edges on an axis that axis has a single bucket, so the unstratified profile is the one stratum ``all``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # imported where a tensor is made: a params check builds strata without torch

# variant name -> (keeps the position axis, keeps the confidence axis)
VARIANTS = {"none": (False, False), "position": (True, False), "confidence": (False, True), "both": (True, True)}


@functools.lru_cache(maxsize=64)
def _edges(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, made once: a decode step assigns strata at every probe, and a copy from
    host memory each time would wait for the device's queued work (read-only)."""
    import torch

    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device)


def _check_edges(name: str, edges: list[float], low: float, high: float | None) -> None:
    for i, e in enumerate(edges):
        if not (e > low and (high is None or e < high)):
            bound = f"({low}, {high})" if high is not None else f"> {low}"
            raise ValueError(f"{name}[{i}] = {e} is outside {bound}")
    for i in range(1, len(edges)):
        if edges[i] <= edges[i - 1]:
            raise ValueError(f"{name} must be strictly increasing without duplicates, got {edges}")


@dataclass(frozen=True)
class Strata:
    """Bucket edges on each axis (interior edges only).

    Attributes:
        position_edges: e.g. ``[16, 64]`` → buckets ``[0,16) [16,64) [64,∞)``.
        confidence_edges: e.g. ``[0.3, 0.7]`` → buckets ``[0,0.3) [0.3,0.7) [0.7,1]``.
    """

    position_edges: tuple[int, ...] = field(default=())
    confidence_edges: tuple[float, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "position_edges", tuple(self.position_edges))
        object.__setattr__(self, "confidence_edges", tuple(self.confidence_edges))
        _check_edges("position_edges", list(self.position_edges), 0, None)
        _check_edges("confidence_edges", list(self.confidence_edges), 0.0, 1.0)

    @property
    def n_position(self) -> int:
        return len(self.position_edges) + 1

    @property
    def n_confidence(self) -> int:
        return len(self.confidence_edges) + 1

    def __len__(self) -> int:
        return self.n_position * self.n_confidence

    @property
    def uses_confidence(self) -> bool:
        return bool(self.confidence_edges)

    @property
    def variant(self) -> str:
        """Which axes this stratification uses: ``none``, ``position``, ``confidence`` or ``both``."""
        axes = (bool(self.position_edges), bool(self.confidence_edges))
        return next(name for name, keep in VARIANTS.items() if keep == axes)

    def variants(self) -> list[str]:
        """The variants reachable by dropping axes (``none`` always; ``both`` only when both axes are used)."""
        pos, conf = VARIANTS[self.variant]
        return [name for name, (p, c) in VARIANTS.items() if (pos or not p) and (conf or not c)]

    def keep(self, variant: str) -> Strata:
        """The stratification with only the axes of ``variant`` (which must be one of :meth:`variants`)."""
        if variant not in self.variants():
            raise ValueError(f"strata variant {variant!r} is not available from {self.variant!r} strata "
                             f"(available: {', '.join(self.variants())}; valid names: {', '.join(VARIANTS)})")
        pos, conf = VARIANTS[variant]
        return Strata(self.position_edges if pos else (), self.confidence_edges if conf else ())

    def names(self) -> list[str]:
        """Readable stratum names, index order (``all`` when unstratified)."""
        pos = _bucket_names("pos", [0, *self.position_edges], "inf")
        conf = _bucket_names("conf", [0, *self.confidence_edges], "1")
        names = []
        for p in pos:
            for c in conf:
                parts = [x for x in (p if self.position_edges else "", c if self.confidence_edges else "") if x]
                names.append("|".join(parts) or "all")
        return names

    def edge_tensors(self, device) -> dict[str, torch.Tensor]:
        """The edges as tensors on ``device`` (``position_edges`` long, ``confidence_edges`` float32), for
        :meth:`assign` inside compiled code."""
        import torch

        return {"position_edges": _edges(tuple(self.position_edges), torch.long, torch.device(device)),
                "confidence_edges": _edges(tuple(self.confidence_edges), torch.float32, torch.device(device))}

    def assign(self, positions: torch.Tensor, confidence: torch.Tensor | None,
               edges: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Stratum index per token.

        Args:
            positions: ``[...]`` int, tokens before each token in its context.
            confidence: ``[...]`` max probability at the first probe (needed only with confidence edges).
            edges: :meth:`edge_tensors` on the tokens' device (made here when None).

        Returns:
            ``[...]`` long stratum indices in ``0..len(self)-1``.
        """
        import torch

        if edges is None:
            edges = {"position_edges": _edges(tuple(self.position_edges), positions.dtype, positions.device)}
            if self.uses_confidence and confidence is not None:
                edges["confidence_edges"] = _edges(tuple(self.confidence_edges), confidence.dtype,
                                                   confidence.device)
        p = torch.bucketize(positions, edges["position_edges"], right=True)
        if not self.uses_confidence:
            return p
        if confidence is None:
            raise ValueError("confidence stratification needs the first probe's max probability")
        c = torch.bucketize(confidence, edges["confidence_edges"], right=True)
        return p * self.n_confidence + c

    def parents(self) -> list[int | None]:
        """Back-off chain step for each stratum: (position, confidence) → position-only marginal → global.

        Returned as the index of the position bucket in the position-only marginal for two-axis strata, else None
        (meaning: the global profile). See :meth:`marginal_of`.
        """
        if self.uses_confidence and self.position_edges:
            return [s // self.n_confidence for s in range(len(self))]
        return [None] * len(self)

    def as_dict(self) -> dict:
        return {"position_edges": list(self.position_edges), "confidence_edges": list(self.confidence_edges)}


def _bucket_names(axis: str, starts: list, top: str) -> list[str]:
    ends = [*starts[1:], top]
    return [f"{axis}[{a},{b})" for a, b in zip(starts, ends)]
