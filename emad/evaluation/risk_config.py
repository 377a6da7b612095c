"""The ``risk`` section of params.yaml: risk-controlled thresholds searched on held-out prompts."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from emad.config import Section, validate_section
from emad.evaluation.operating_point import PointConfig
from emad.evaluation.risk import LOSSES, min_prompts
from emad.exits.criteria import CRITERIA


class SearchConfig(Section):
    """One search: an operating point whose ``knob`` takes each of ``values``.

    Attributes:
        point: the operating point's other options (as in ``decode.points``).
        knob: the scalar option searched (one of the method's knobs, e.g. ``margin`` or ``threshold``).
        values: candidate values (searched from the end that exits less).
    """

    point: dict[str, Any]
    knob: str
    values: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _knob(self) -> SearchConfig:
        method = self.point.get("method", "full")
        knobs = CRITERIA.get(method).knobs if method in CRITERIA else {}
        if self.knob not in knobs:
            raise ValueError(f"knob {self.knob!r} is not a scalar knob of method {method!r}; valid: "
                             f"{', '.join(knobs) or 'none'}")
        for value in self.values:
            self.point_at(value)  # every value makes a valid point
        return self

    def point_at(self, value: float) -> PointConfig:
        return validate_section("point", {**self.point, self.knob: value}, PointConfig)

    @property
    def conservative(self) -> str:
        return CRITERIA.get(self.point.get("method", "full")).knobs[self.knob]


class RiskConfig(Section):
    """Params of stage ``risk`` (see :mod:`emad.evaluation.risk`).

    Attributes:
        domain: the domain whose eval split gives the prompts (it must be sampled).
        calibration: the calibration source whose profiles the searches read (one of ``calibrate.sources``).
        prompts: held-out prompts for the search (at least the minimum δ and ε need).
        fresh_prompts: further prompts, disjoint from those, on which the chosen value is checked.
        prompt_tokens, new_tokens: prompt length and continuation length in tokens.
        delta: δ in (0, 1), the tolerated loss (1 − token agreement, or 1 − exact match).
        epsilon: ε in (0, 1), the probability that the guarantee fails.
        loss: ``agreement`` or ``exact``.
        searches: name → :class:`SearchConfig`.
        executor: who runs the searches, one work unit each: ``serial`` (this process: the model and the full-depth
            references made once for all) or ``ray`` (actors, :mod:`emad.evaluation.executors`);
            ``$EMAD_DECODE_EXECUTOR`` overrides it. The outputs are the same either way.
        workers: Ray actors (null: one per GPU of the cluster, else 2).
        device, dtype: where and how the model runs.
    """

    domain: str = "stdlib-prose"
    calibration: str = "stdlib-prose"
    prompts: int = Field(24, ge=1)
    fresh_prompts: int = Field(24, ge=1)
    prompt_tokens: int = Field(32, ge=1)
    new_tokens: int = Field(16, ge=1)
    delta: float = Field(0.1, gt=0, lt=1)
    epsilon: float = Field(0.1, gt=0, lt=1)
    loss: str = "agreement"
    searches: dict[str, SearchConfig] = Field(default_factory=dict)
    executor: str = "serial"
    workers: int | None = Field(None, ge=1)
    device: str = "auto"
    dtype: str = "auto"

    @model_validator(mode="after")
    def _enough(self) -> RiskConfig:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        need = min_prompts(self.delta, self.epsilon)
        if self.prompts < need:
            raise ValueError(f"prompts: delta={self.delta} and epsilon={self.epsilon} need at least {need} "
                             f"held-out prompts, got {self.prompts}")
        return self
