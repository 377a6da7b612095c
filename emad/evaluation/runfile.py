"""Run files: one JSON per (model, operating point, calibration source, domain) evaluation, in ``reports/runs/``.

The decode stage writes them; the aggregate stage reads only them (never MLflow), so runs restored from DVC's
run cache still count. Format ``emad-run`` version 1: ``{"format": "emad-run", "version": 1, ...}`` followed by
the fields of :class:`emad.evaluation.record.RunRecord`, in its order; this module reads and writes the files.

Quality metrics, their direction and tolerance live in :data:`emad.evaluation.metrics.METRICS` (perplexity:
lower-better, relative tolerance; every other metric: higher-better in [0, 1], absolute tolerance in points =
0.01). Each carries its 95% interval and sample size in ``intervals`` (:mod:`emad.evaluation.intervals`: lo/hi null
when undefined), from the per-unit ``samples`` its task returned; the samples stay in the run file so that the
verdict can pair a point with the full-depth run unit by unit. Run files without samples (older ones) read as
undefined intervals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emad.io import atomic_write_json, read_json

__all__ = ["FORMAT", "VERSION", "RunFileError", "load", "load_all", "run_files", "save"]

FORMAT, VERSION = "emad-run", 1


class RunFileError(ValueError):
    """A run file is missing, unreadable or not an ``emad-run`` v1 file."""


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
    """The ``*.json`` files under ``folder`` (recursively, screens aside: ``screens/`` folders), sorted; an error if
    there is none."""
    paths = sorted(p for p in Path(folder).rglob("*.json") if p.parent.name != "screens")
    if not paths:
        raise RunFileError(f"no run files in {folder} (run the decode stage first)")
    return paths


def load_all(folder: str | Path) -> list[dict[str, Any]]:
    """Every run file under ``folder`` (recursively) as its dict, sorted by run id; an error if there is none."""
    return sorted((load(p) for p in run_files(folder)), key=lambda r: r["run_id"])
