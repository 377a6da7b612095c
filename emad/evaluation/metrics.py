"""Quality metrics by name, each registered with where it comes from, its direction, its unit and its tolerance.

A metric is one :class:`QualityMetric` in :data:`METRICS` (as lm-eval registers ``higher_is_better`` with a
metric): the task whose result holds it, its key there, whether higher is better, whether the verdict's
tolerance is ``relative`` (perplexity: a rise of 1%) or ``absolute`` (scores in [0, 1]: a drop of 1 point = 0.01),
and its independent ``unit`` (a window, prompt, item or problem; ``token`` for a token-level metric, whose per-unit
samples are still one per prompt, so that intervals resample whole prompts). A run's quality, its 95% intervals,
its MLflow names and the verdict's bound when every unit is equal all follow from this one table, so a metric
added here reaches the run file, MLflow and the report with no other edit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from emad.evaluation.intervals import LEVEL, finest_units, metric_interval
from emad.registry import Registry


@dataclass(frozen=True)
class QualityMetric:
    """One quality metric: ``name`` (its key in a run file's ``quality``), ``task`` and ``key`` (where its value
    sits in the task results), ``higher_is_better``, ``tolerance`` (``relative`` or ``absolute``) and ``unit``
    (what is drawn independently: ``window``, ``prompt``, ``item``, ``problem``; ``token`` for a token-level
    metric)."""

    name: str
    task: str
    key: str
    higher_is_better: bool = True
    tolerance: Literal["relative", "absolute"] = "absolute"
    unit: str = "item"

    def bound_units(self, samples: Sequence) -> int | None:
        """When every paired unit is equal: how many units the exact share bound runs over — the tokens of a
        token-level metric (Σ denominators of its pairs), else the metric's own units. None for a relative
        metric: a bound on the share of units that differ bounds no relative change."""
        if self.tolerance == "relative":
            return None
        return finest_units(self.key, samples) if self.unit == "token" else len(samples)

    def needs(self, tolerance: float) -> int | None:
        """The units a check needs to be met with every unit equal: the smallest n with
        ``1 − 0.025^(1/n) ≤ tolerance`` (368 for one point); None for a relative metric (only a paired interval,
        or identity by construction, meets it)."""
        if self.tolerance == "relative" or not 0 < tolerance < 1:
            return None
        return math.ceil(math.log((1 - LEVEL) / 2) / math.log(1 - tolerance) - 1e-9)

    @property
    def mlflow_name(self) -> str:
        """``quality.<task>.<key>``: the metric's name in MLflow."""
        return f"quality.{self.task}.{self.key}"


METRICS: Registry[QualityMetric] = Registry("quality metric")


def register_metric(name: str, task: str, key: str, higher_is_better: bool = True,
                    tolerance: Literal["relative", "absolute"] = "absolute", unit: str = "item") -> QualityMetric:
    """Registers a quality metric in :data:`METRICS`; a name registered twice is an error."""
    metric = QualityMetric(name, task, key, higher_is_better, tolerance, unit)
    METRICS.add(name, metric)
    return metric


register_metric("perplexity", "perplexity", "perplexity", higher_is_better=False, tolerance="relative",
                unit="window")
for _task, _key, _unit in [("fidelity", "token_agreement", "token"), ("fidelity", "exact_match", "prompt"),
                           ("fidelity", "rouge_l", "prompt"), ("agreement", "token_agreement", "token"),
                           ("gsm8k", "accuracy", "problem"), ("humaneval", "pass_at_1", "problem"),
                           ("multiple_choice", "acc", "item"), ("multiple_choice", "acc_norm", "item"),
                           ("cloze", "acc", "item"), ("cloze", "generation_acc", "item"), ("choice", "acc", "item"),
                           ("choice", "acc_norm", "item")]:
    register_metric(f"{_task}.{_key}", _task, _key, unit=_unit)


def higher_is_better(metric: str) -> bool:
    """Direction of a quality metric; a metric not in :data:`METRICS` counts as higher-better."""
    return METRICS.get(metric).higher_is_better if metric in METRICS else True


def relative_tolerance(metric: str) -> bool:
    """True when the verdict's tolerance of ``metric`` is relative (perplexity), False when absolute (points)."""
    return metric in METRICS and METRICS.get(metric).tolerance == "relative"


def mlflow_name(metric: str) -> str:
    """``quality.<task>.<key>`` of a run file's quality key; for one not in :data:`METRICS`, ``<task>.<key>`` is
    read from the name itself (``a.b`` → ``quality.a.b``, ``a`` → ``quality.a.a``)."""
    if metric in METRICS:
        return METRICS.get(metric).mlflow_name
    task, _, key = metric.partition(".")
    return f"quality.{task}.{key or task}"


def quality_of(tasks: dict[str, dict]) -> dict[str, float]:
    """The quality metrics of :data:`METRICS` present in a run's task results, in registration order."""
    return {m.name: float(tasks[m.task][m.key]) for m in METRICS.values()
            if m.task in tasks and m.key in tasks[m.task]}


def samples_of(tasks: dict[str, dict], metric: str) -> tuple[str, list] | None:
    """``(key, per-unit samples)`` of a quality metric in a run's task results; None when its task kept none or
    the metric is not in :data:`METRICS`."""
    if metric not in METRICS:
        return None
    m = METRICS.get(metric)
    samples = tasks.get(m.task, {}).get("samples", {}).get(m.key)
    return None if samples is None else (m.key, samples)


def intervals_of(tasks: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """``{metric: {"lo", "hi", "n", "method"}}`` for every quality metric present (see :func:`quality_of`): the
    95% interval of its per-unit samples; undefined (lo/hi None, n None) when the task returned none."""
    out = {}
    for name in quality_of(tasks):
        found = samples_of(tasks, name)
        if found is None:
            out[name] = {"lo": None, "hi": None, "n": None, "method": "undefined: no per-unit samples"}
        else:
            iv = metric_interval(*found).to_dict()
            out[name] = {k: iv[k] for k in ("lo", "hi", "n", "method")}
    return out

