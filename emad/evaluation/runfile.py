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

The typed record behind this format is :class:`emad.evaluation.record.RunRecord` (its fields are the keys above);
this module reads and writes the files. Quality metrics, their direction and tolerance live in
:data:`emad.evaluation.metrics.METRICS`: perplexity is lower-better (relative tolerance in the verdict), every
other metric higher-better in [0, 1] (absolute tolerance, in points = 0.01). Each carries its 95% interval and
sample size in ``intervals`` (:mod:`emad.evaluation.intervals`: lo/hi null when undefined), from the per-unit
``samples`` its task returned; the samples stay in the run file so that the verdict can pair a point with the
full-depth run unit by unit. Run files without samples (older ones) read as undefined intervals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emad.evaluation.identity import run_id
from emad.evaluation.metrics import QUALITY, intervals_of, quality_of, samples_of
from emad.io import atomic_write_json, read_json

__all__ = ["FORMAT", "VERSION", "QUALITY", "RunFileError", "interval_metrics", "intervals_of", "load", "load_all",
           "quality_of", "run_files", "run_id", "samples_of", "save"]

FORMAT, VERSION = "emad-run", 1


class RunFileError(ValueError):
    """A run file is missing, unreadable or not an ``emad-run`` v1 file."""


def interval_metrics(intervals: dict[str, dict[str, Any]], prefix: str = "") -> dict[str, float]:
    """MLflow metrics beside each value: ``<prefix><metric>.lo`` / ``.hi`` / ``.n`` (undefined bounds left out)."""
    return {f"{prefix}{name}.{part}": float(iv[part]) for name, iv in intervals.items()
            for part in ("lo", "hi", "n") if iv.get(part) is not None}


def save(path: str | Path, record: dict[str, Any]) -> None:
    """Write a run record (a dict of :class:`~emad.evaluation.record.RunRecord`'s fields) as an emad-run file."""
    atomic_write_json(path, {"format": FORMAT, "version": VERSION, **record})


def load(path: str | Path) -> dict[str, Any]:
    """The record in an emad-run file, as the dict it holds (format and version included)."""
    data = read_json(path, "run file", RunFileError)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise RunFileError(f"{path} is not an {FORMAT} v{VERSION} file")
    return data


def run_files(folder: str | Path) -> list[Path]:
    """The ``*.json`` files under ``folder`` (recursively), sorted; an error if there is none."""
    paths = sorted(Path(folder).rglob("*.json"))
    if not paths:
        raise RunFileError(f"no run files in {folder} (run the decode stage first)")
    return paths


def load_all(folder: str | Path) -> list[dict[str, Any]]:
    """Every run file under ``folder`` (recursively) as its dict, sorted by run id; an error if there is none."""
    return sorted((load(p) for p in run_files(folder)), key=lambda r: r["run_id"])
