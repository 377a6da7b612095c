"""The ``calibrate`` and ``smooth`` sections of params.yaml."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from emad.config import Section
from emad.strata import Strata


class StrataConfig(Section):
    """Bucket edges (interior edges; empty = no stratification on that axis)."""

    position_edges: list[int] = Field(default_factory=list)
    confidence_edges: list[float] = Field(default_factory=list)

    @model_validator(mode="after")
    def _edges(self) -> StrataConfig:
        Strata(self.position_edges, self.confidence_edges)  # sorted, unique, in range, or a ValueError naming them
        return self


class CalibrateConfig(Section):
    """Params of stage ``calibrate``.

    Attributes:
        sources: corpus sources calibrated on (one profile per model × source).
        window: tokens per teacher-forcing window (≤ the model's context).
        batch_size: windows per forward pass.
        probe_layers: a list of layers, or an int k meaning every k-th layer; L is always added.
        strata: stratification of the profile.
        hist_bins: entropy histogram bins over [0, log V].
        max_tokens: stop after this many calibration tokens (None = the whole split).
        checkpoint_every: batches between resumable checkpoints.
        device, dtype: where and how the model runs (auto = cuda/bf16 when present, else cpu/fp32).
    """

    sources: list[str] = Field(default_factory=lambda: ["stdlib-prose"], min_length=1)
    window: int = Field(256, ge=2)
    batch_size: int = Field(4, ge=1)
    probe_layers: int | list[int] = 3
    strata: StrataConfig = Field(default_factory=StrataConfig)
    hist_bins: int = Field(100, ge=2)
    max_tokens: int | None = Field(None, gt=0)
    checkpoint_every: int = Field(10, ge=1)
    device: str = "auto"
    dtype: str = "auto"

    @field_validator("probe_layers")
    @classmethod
    def _positive(cls, value):
        layers = [value] if isinstance(value, int) else value
        if not layers or any(x < 1 for x in layers):
            raise ValueError("probe layers must be >= 1 (a non-empty list, or an every-k step)")
        return value


class SmoothConfig(Section):
    """Params of stage ``smooth``: which statistic becomes τ, isotonic smoothing, back-off threshold."""

    statistic: str = Field("mean", pattern=r"^(mean|q0?\.\d+)$")
    isotonic: bool = True
    min_count: int = Field(50, ge=1)
    method: Literal["isotonic"] = "isotonic"
