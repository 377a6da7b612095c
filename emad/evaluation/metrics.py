"""Quality metrics by name, each registered with where it comes from, its direction and its kind of tolerance.

A metric is one :class:`QualityMetric` in :data:`METRICS` (as lm-eval registers ``higher_is_better`` with a
metric): the task whose result holds it, its key there, whether higher is better, and whether the verdict's
tolerance is ``relative`` (perplexity: a rise of 1%) or ``absolute`` (accuracies in [0, 1]: a drop of 1 point =
0.01). A run's quality, its 95% intervals and its MLflow names all follow from this one table, so a metric added
here reaches the run file, MLflow and the report with no other edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from emad.evaluation.intervals import metric_interval
from emad.registry import Registry


@dataclass(frozen=True)
class QualityMetric:
    """One quality metric: ``name`` (its key in a run file's ``quality``), ``task`` and ``key`` (where its value
    sits in the task results), ``higher_is_better`` and ``tolerance`` (``relative`` or ``absolute``)."""

    name: str
    task: str
    key: str
    higher_is_better: bool = True
    tolerance: Literal["relative", "absolute"] = "absolute"

    @property
    def mlflow_name(self) -> str:
        """``quality.<task>.<key>``: the metric's name in MLflow."""
        return f"quality.{self.task}.{self.key}"


METRICS: Registry[QualityMetric] = Registry("quality metric")


def register_metric(name: str, task: str, key: str, higher_is_better: bool = True,
                    tolerance: Literal["relative", "absolute"] = "absolute") -> QualityMetric:
    """Registers a quality metric in :data:`METRICS`; a name registered twice is an error."""
    metric = QualityMetric(name, task, key, higher_is_better, tolerance)
    METRICS.add(name, metric)
    return metric


register_metric("perplexity", "perplexity", "perplexity", higher_is_better=False, tolerance="relative")
for _task, _key in [("fidelity", "token_agreement"), ("fidelity", "exact_match"), ("fidelity", "rouge_l"),
                    ("agreement", "token_agreement"), ("gsm8k", "accuracy"), ("humaneval", "pass_at_1"),
                    ("multiple_choice", "acc"), ("multiple_choice", "acc_norm"), ("cloze", "acc"),
                    ("cloze", "generation_acc"), ("choice", "acc"), ("choice", "acc_norm")]:
    register_metric(f"{_task}.{_key}", _task, _key)


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

