"""Run files: one JSON per (model, operating point, calibration source, domain) evaluation, in ``reports/runs/``.

The decode stage writes them; the aggregate stage reads only them (never MLflow), so runs restored from DVC's
run cache still count. Format ``emad-run`` version 1::

    {"format": "emad-run", "version": 1,
     "run_id": "smollm2-135m--emad-m05--cal-stdlib-prose--stdlib-code",
     "model": "smollm2-135m", "model_fingerprint": "<digest>", "n_layers": 30,
     "point": "emad-m05",                       # name in params.yaml decode.points
     "family": "emad",                          # the criterion: full, fixed, confidence, emad, ...
     "options": {"method": "emad", "margin": 0.5, "policy": "monotone", "estimator": "exact", ...},
     "factors": {"margin": 0.5, "policy": "monotone", "estimator": "exact", "probe_every": 3,
                 "strata": "none"},            # what ablation tables vary (emad points only, else {})
     "calibration": "stdlib-prose" | null,      # profile's calibration source (null: no profile)
     "profile_fingerprint": "<sha256[:16]>" | null,
     "domain": "stdlib-code",
     "tasks": {"perplexity": {"perplexity": 12.3, ...,
                              "samples": {"perplexity": [[nll, tokens], ...]}},   # per-unit values
               "fidelity": {...}, ...},
     "quality": {"perplexity": 12.3, "fidelity.token_agreement": 0.97, ...},   # one number per quality metric
     "intervals": {"perplexity": {"lo": 11.8, "hi": 12.9, "n": 11, "method": "bootstrap-bca"}, ...},
     "cost": {"flops_ratio": 0.8, "step_ratio": 0.9, "bytes_ratio": 0.85, "mean_depth": 24.1, "backfill_share": 0.0,
              "policy_events": 0, "tokens": 4096, "seconds": 40.2, "tokens_per_s": 101.9},
     "depth_histogram": {"3": 10, "30": 4086},  # tokens per exit depth (generated and scored)
     "oracle": {"3": 0.05, ...} | null,         # share of calibration tokens per oracle depth (profile)
     "mlflow_run_id": "<id>" | null}

Quality metrics and their direction live in :data:`QUALITY`: perplexity is lower-better (relative tolerance in
the verdict), every other metric higher-better in [0, 1] (absolute tolerance, in points = 0.01). Each carries its
95% interval and sample size in ``intervals`` (:mod:`emad.evaluation.intervals`: lo/hi null when undefined), from
the per-unit ``samples`` its task returned; the samples stay in the run file so that the verdict can pair a point
with the full-depth run unit by unit. Run files without samples (older ones) read as undefined intervals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emad.evaluation.intervals import metric_interval
from emad.io import atomic_write_json, read_json

FORMAT, VERSION = "emad-run", 1

# quality metric → (task it comes from, key in that task's result, higher is better)
QUALITY: dict[str, tuple[str, str, bool]] = {
    "perplexity": ("perplexity", "perplexity", False),
    "fidelity.token_agreement": ("fidelity", "token_agreement", True),
    "fidelity.exact_match": ("fidelity", "exact_match", True),
    "fidelity.rouge_l": ("fidelity", "rouge_l", True),
    "agreement.token_agreement": ("agreement", "token_agreement", True),
    "gsm8k.accuracy": ("gsm8k", "accuracy", True),
    "humaneval.pass_at_1": ("humaneval", "pass_at_1", True),
    "multiple_choice.acc": ("multiple_choice", "acc", True),
    "multiple_choice.acc_norm": ("multiple_choice", "acc_norm", True),
    "cloze.acc": ("cloze", "acc", True),
    "cloze.generation_acc": ("cloze", "generation_acc", True),
    "choice.acc": ("choice", "acc", True),
    "choice.acc_norm": ("choice", "acc_norm", True),
}


class RunFileError(ValueError):
    """A run file is missing, unreadable or not an ``emad-run`` v1 file."""


def quality_of(tasks: dict[str, dict]) -> dict[str, float]:
    """The quality metrics (see :data:`QUALITY`) present in a run's task results."""
    return {name: float(tasks[task][key]) for name, (task, key, _) in QUALITY.items()
            if task in tasks and key in tasks[task]}


def samples_of(tasks: dict[str, dict], metric: str) -> tuple[str, list] | None:
    """``(key, per-unit samples)`` of a quality metric (:data:`QUALITY`) in a run's task results; None when its
    task kept none or the metric is not in :data:`QUALITY`."""
    if metric not in QUALITY:
        return None
    task, key, _ = QUALITY[metric]
    samples = tasks.get(task, {}).get("samples", {}).get(key)
    return None if samples is None else (key, samples)


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


def interval_metrics(intervals: dict[str, dict[str, Any]], prefix: str = "") -> dict[str, float]:
    """MLflow metrics beside each value: ``<prefix><metric>.lo`` / ``.hi`` / ``.n`` (undefined bounds left out)."""
    return {f"{prefix}{name}.{part}": float(iv[part]) for name, iv in intervals.items()
            for part in ("lo", "hi", "n") if iv.get(part) is not None}


def run_id(model: str, point: str, domain: str, calibration: str | None) -> str:
    """``<model>--<point>[--cal-<source>]--<domain>``: unique per run, stable across reruns."""
    parts = [model, point] + ([f"cal-{calibration}"] if calibration else []) + [domain]
    return "--".join(parts)


def save(path: str | Path, record: dict[str, Any]) -> None:
    atomic_write_json(path, {"format": FORMAT, "version": VERSION, **record})


def load(path: str | Path) -> dict[str, Any]:
    data = read_json(path, "run file", RunFileError)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise RunFileError(f"{path} is not an {FORMAT} v{VERSION} file")
    return data


def load_all(folder: str | Path) -> list[dict[str, Any]]:
    """Every run file under ``folder`` (recursively), sorted by run id; an error if there is none."""
    paths = sorted(Path(folder).rglob("*.json"))
    if not paths:
        raise RunFileError(f"no run files in {folder} (run the decode stage first)")
    return sorted((load(p) for p in paths), key=lambda r: r["run_id"])
