"""The ``aggregate`` section of params.yaml: the falsification thresholds of the seed paper and who is judged."""

from __future__ import annotations

from pydantic import Field

from emad.config import Section


class AggregateConfig(Section):
    """Params of stage ``aggregate`` (DESIGN.md §4).

    Attributes:
        methods: what the verdict judges: a method (``emad``: every family of it, each readout and estimator) or
            one family (``emad+tuned:topk``); every family is also judged alone, for comparison.
        min_flops_reduction: C1's FLOPs reduction (0.15 = 15%).
        ppl_rel_tol: allowed relative perplexity rise (0.01 = 1%).
        acc_abs_tol: allowed absolute drop of every other quality metric (0.01 = 1 point).
        min_speed_gain: C2's tokens/s gain at matched quality (0.10 = 10%).
    """

    methods: list[str] = Field(default_factory=lambda: ["emad"], min_length=1)
    min_flops_reduction: float = Field(0.15, gt=0, lt=1)
    ppl_rel_tol: float = Field(0.01, ge=0)
    acc_abs_tol: float = Field(0.01, ge=0)
    min_speed_gain: float = Field(0.10, ge=0)

    def thresholds(self) -> dict[str, float]:
        return self.model_dump(exclude={"methods"})
