"""Quality metrics by name, each registered with where it comes from, its direction, its unit and its tolerance.

A metric is one :class:`QualityMetric` in :data:`METRICS` (as lm-eval registers ``higher_is_better`` with a
metric): the task whose result holds it, its key there, whether higher is better, whether the verdict's
tolerance is ``relative`` (perplexity: a rise of 1%) or ``absolute`` (scores in [0, 1]: a drop of 1 point = 0.01),
its independent ``unit`` (a window, prompt, item or problem; ``token`` for a token-level metric, whose per-unit
samples are one per prompt: its intervals resample whole prompts and its bounds count prompts, since a prompt's
tokens are not drawn independently), and its float ``noise`` (how far one unit's value may move between two runs
that compute the same thing in another order: a unit within it is unchanged). A run's quality, its 95% intervals,
its MLflow names and the verdict's bound when every unit is equal all follow from this one table, so a metric
added here reaches the run file, MLflow and the report with no other edit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from emad.evaluation.intervals import LEVEL, metric_interval
from emad.evaluation.units import BLOCK
from emad.registry import Registry


@dataclass(frozen=True)
class QualityMetric:
    """One quality metric: ``name`` (its key in a run file's ``quality``), ``task`` and ``key`` (where its value
    sits in the task results), ``higher_is_better``, ``tolerance`` (``relative`` or ``absolute``), ``unit``
    (what is drawn independently: ``window``, ``prompt``, ``item``, ``problem``; ``token`` for a token-level
    metric, whose samples and bounds are per prompt) and ``noise`` (the largest change of one unit's value —
    the numerator of a pair — that two runs computing the same thing in another order can show: a unit within it
    counts as unchanged)."""

    name: str
    task: str
    key: str
    higher_is_better: bool = True
    tolerance: Literal["relative", "absolute"] = "absolute"
    unit: str = "item"
    noise: float = 0.0

    @property
    def sampled(self) -> str:
        """What one sample is (and what bounds count): the unit, or ``prompt`` for a token-level metric."""
        return "prompt" if self.unit == "token" else self.unit

    def bound_units(self, samples: Sequence) -> int | None:
        """When every paired unit is equal: how many units the exact share bound runs over — the samples (a
        token-level metric's prompts: its tokens are not independent). None for a relative metric: a bound on
        the share of units that differ bounds no relative change."""
        if self.tolerance == "relative":
            return None
        return len(samples)

    def needs(self, tolerance: float, level: float = LEVEL) -> int | None:
        """The units a check judged at ``level`` needs to be met with every unit equal: the smallest n with
        ``1 − ((1 − level)/2)^(1/n) ≤ tolerance`` (368 for one point at 95%, 505 at 98.75%); None for a relative
        metric (only a paired interval, or identity by construction, meets it)."""
        if self.tolerance == "relative" or not 0 < tolerance < 1:
            return None
        return math.ceil(math.log((1 - level) / 2) / math.log(1 - tolerance) - 1e-9)

    @property
    def mlflow_name(self) -> str:
        """``quality.<task>.<key>``: the metric's name in MLflow."""
        return f"quality.{self.task}.{self.key}"


METRICS: Registry[QualityMetric] = Registry("quality metric")


def register_metric(name: str, task: str, key: str, higher_is_better: bool = True,
                    tolerance: Literal["relative", "absolute"] = "absolute", unit: str = "item",
                    noise: float = 0.0) -> QualityMetric:
    """Registers a quality metric in :data:`METRICS`; a name registered twice is an error."""
    metric = QualityMetric(name, task, key, higher_is_better, tolerance, unit, noise)
    METRICS.add(name, metric)
    return metric


# A window's summed NLL over its tokens, computed at full depth by the engine and by a point that never exits there,
# differs by its float rounding (≈ 1e-5 nats on 64 fp32 tokens); a 1% perplexity rise moves it by ≈ 0.6 nats.
WINDOW_NOISE = 1e-3  # nats
register_metric("perplexity", "perplexity", "perplexity", higher_is_better=False, tolerance="relative",
                unit="window", noise=WINDOW_NOISE)
for _task, _key, _unit, _noise in [
        ("fidelity", "token_agreement", "token", 0.0), ("fidelity", "exact_match", "prompt", 0.0),
        ("fidelity", "rouge_l", "prompt", 1e-9), ("agreement", "token_agreement", "token", 0.0),
        ("gsm8k", "accuracy", "problem", 0.0), ("humaneval", "pass_at_1", "problem", 0.0),
        ("multiple_choice", "acc", "item", 0.0), ("multiple_choice", "acc_norm", "item", 0.0),
        ("cloze", "acc", "item", 0.0), ("cloze", "generation_acc", "item", 0.0), ("choice", "acc", "item", 0.0),
        ("choice", "acc_norm", "item", 0.0)]:
    register_metric(f"{_task}.{_key}", _task, _key, unit=_unit, noise=_noise)


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
            iv = metric_interval(*found, blocks=[i // BLOCK for i in range(len(found[1]))]).to_dict()
            out[name] = {k: iv[k] for k in ("lo", "hi", "n", "method")}
    return out

