"""The ``estimators`` section of params.yaml: which cheap estimators to fit, and on how many tokens."""

from __future__ import annotations

from pydantic import Field

from emad.config import Section


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
    """

    topk: TopKConfig | None = Field(default_factory=TopKConfig)
    lowrank: LowRankConfig | None = Field(default_factory=LowRankConfig)
    tokens: int = Field(4096, ge=16)
    window: int = Field(256, ge=2)
    holdout: float = Field(0.2, gt=0, lt=1)

    def fitted(self) -> dict[str, dict]:
        """Estimator name → constructor options, for those not switched off."""
        return {name: cfg.model_dump() for name, cfg in (("topk", self.topk), ("lowrank", self.lowrank))
                if cfg is not None}
