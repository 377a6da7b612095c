"""The ``calibrate``, ``readouts``, ``smooth`` and ``estimators`` sections of params.yaml."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from emad.config import Section
from emad.exits.registries import READOUTS
from emad.exits.strata import Strata


def _probe_spec(value):
    layers = [value] if isinstance(value, int) else value
    if not layers or any(x < 1 for x in layers):
        raise ValueError("probe layers must be >= 1 (a non-empty list, or an every-k step)")
    return value


ProbeLayers = Annotated[int | list[int], AfterValidator(_probe_spec)]  # a list of layers, or every k-th layer


class StrataConfig(Section):
    """Bucket edges (interior edges; empty = no stratification on that axis)."""

    position_edges: list[int] = Field(default_factory=list)
    confidence_edges: list[float] = Field(default_factory=list)

    @model_validator(mode="after")
    def _edges(self) -> StrataConfig:
        self.build()  # sorted, unique, in range, or a ValueError naming them
        return self

    def build(self) -> Strata:
        """The stratification these edges define."""
        return Strata(tuple(self.position_edges), tuple(self.confidence_edges))


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
        readouts: the readouts calibrated through (one profile each: ``logit``, ``tuned``).
        device, dtype: where and how the model runs (auto = cuda/bf16 when present, else cpu/fp32).
    """

    sources: list[str] = Field(default_factory=lambda: ["stdlib-prose"], min_length=1)
    readouts: list[str] = Field(default_factory=lambda: ["logit"], min_length=1)
    window: int = Field(256, ge=2)
    batch_size: int = Field(4, ge=1)
    probe_layers: ProbeLayers = 3
    strata: StrataConfig = Field(default_factory=StrataConfig)
    hist_bins: int = Field(100, ge=2)
    max_tokens: int | None = Field(None, gt=0)
    checkpoint_every: int = Field(10, ge=1)
    device: str = "auto"
    dtype: str = "auto"

    @field_validator("readouts")
    @classmethod
    def _readouts(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in READOUTS:
                raise ValueError(f"unknown readout {name!r}; valid: {', '.join(READOUTS.names())}")
        return value


class ReadoutsConfig(Section):
    """Params of stage ``fit_readouts`` (the ``tuned`` readout's translators, model frozen).

    Attributes:
        layers: translated layers, as ``calibrate.probe_layers`` (a list, or every k-th layer); L never is.
        tokens: training tokens, the calibration split's last ones before the selection tokens (the three ranges
            are disjoint: training | selection | held-out, from the end of the split).
        selection: selection tokens, right before the held-out ones: each layer's best epoch, its patience and its
            judgement against the logit lens are scored here.
        holdout: held-out tokens (the last of the split): only reported, never used to choose.
        window: tokens per teacher-forcing window.
        epochs: the epoch cap: at most this many passes over the training tokens, each followed by a selection
            evaluation; every layer keeps the epoch of its own lowest selection KL (0: the identity) and stops after
            ``patience`` evaluations without improvement; fitting ends when all have stopped (each layer's reason,
            patience or the cap, is recorded).
        lr: Adam's learning rate, constant (no schedule tied to the cap favours the last epoch).
        rank: translator rank r (A = U·Vᵀ); null = full rank (d × d).
        seed: seeds initialisation, batch order and vocabulary draws.
        batch_tokens: tokens per optimiser step.
        vocab_sample: uniform vocabulary draws per step for the KL, beside the teacher's ``top_k`` of each token
            (null = the full vocabulary: exact and about V / (sample + k·batch) times slower).
        top_k: teacher tokens per token always in the KL's vocabulary subset.
        patience: epochs without improvement before a layer stops: none of them lowered its selection KL by more
            than ``min_delta`` below the last epoch that did (the identity's at first).
        min_delta: the relative fall of the selection KL that counts as an improvement (0.01: 1%); the kept epoch
            is the lowest scoring one either way.
        source: the calibration source the translators are fitted on (one fit per model): they serve every
            calibration source's tuned profile and every point.
        device, dtype: where and how the model runs.
    """

    layers: ProbeLayers = 3
    tokens: int = Field(8192, ge=16)
    selection: int = Field(1024, ge=16)
    holdout: int = Field(1024, ge=16)
    window: int = Field(256, ge=2)
    epochs: int = Field(40, ge=1)
    lr: float = Field(2e-3, gt=0)
    rank: int | None = Field(None, ge=1)
    seed: int = 0
    batch_tokens: int = Field(256, ge=1)
    vocab_sample: int | None = Field(4096, ge=1)
    top_k: int = Field(32, ge=1)
    patience: int = Field(3, ge=1)
    min_delta: float = Field(0.01, ge=0, lt=1)
    source: str = "stdlib-prose"
    device: str = "auto"
    dtype: str = "auto"

class SmoothConfig(Section):
    """Params of stage ``smooth``: which statistic becomes τ, isotonic smoothing, back-off threshold."""

    statistic: str = Field("mean", pattern=r"^(mean|q0?\.\d+)$")
    isotonic: bool = True
    min_count: int = Field(50, ge=1)
    method: Literal["isotonic"] = "isotonic"


class TopKConfig(Section):
    k: int = Field(1024, ge=1)


class LowRankConfig(Section):
    rank: int = Field(64, ge=1)


class EstimatorsConfig(Section):
    """Params of stage ``fit_estimators``.

    Attributes:
        topk: shortlist size K (null = do not fit).
        lowrank: rank r (null = do not fit).
        tokens: calibration tokens used (first windows of the calibration split).
        window: tokens per window.
        holdout: share of those tokens kept out of the fit to measure the error.
        readouts: the profiles' readouts (of ``calibrate.readouts``) fitted, for the profiles of
            ``decode.ablation_calibration`` (the estimator ablations read those).
    """

    topk: TopKConfig | None = Field(default_factory=TopKConfig)
    lowrank: LowRankConfig | None = Field(default_factory=LowRankConfig)
    tokens: int = Field(4096, ge=16)
    window: int = Field(256, ge=2)
    holdout: float = Field(0.2, gt=0, lt=1)
    readouts: list[str] = Field(default_factory=lambda: ["logit"], min_length=1)

    def fitted(self) -> dict[str, dict]:
        """Estimator name → constructor options, for those not switched off."""
        return {name: cfg.model_dump() for name, cfg in (("topk", self.topk), ("lowrank", self.lowrank))
                if cfg is not None}
