"""The per-unit samples the coverage simulation draws from (``reports/bench/coverage_samples.json``), taken from a
run's files by the aggregate stage, so that ``python benchmarks/bench_coverage.py`` rebuilds the coverage table
from a clone.

Per metric that a bootstrap judges (every registered metric whose full-depth samples are not all 0/1): full depth's
units in the split's blocks (:data:`emad.evaluation.units.BLOCK` consecutive units of one run), and every point's
per-unit change of the numerator in the same blocks (0 where a unit moved by no more than the metric's float noise,
or its denominator differs; only blocks with a changed unit). For C2: every timed point's per-prompt log speed
ratios about that point's own mean. Floats keep 8 significant digits, so the file is the same wherever the run
files are.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from emad.evaluation.metrics import METRICS, samples_of
from emad.evaluation.units import BLOCK

FORMAT = "emad-coverage-samples"


def _g(x: float) -> float:
    return float(f"{x:.8g}")


def _unit(value: Any) -> list[float]:
    return [_g(v) for v in value] if isinstance(value, list | tuple) else [_g(value)]


def _binary(samples: Sequence) -> bool:
    return all(not isinstance(v, list | tuple) and v in (0, 1) for v in samples)


def _blocks(values: Sequence) -> list[list]:
    return [list(values[i:i + BLOCK]) for i in range(0, len(values), BLOCK)]


def _changes(point: Sequence, full: Sequence, noise: float) -> list[float]:
    """Per unit: the point's numerator minus full depth's, 0 within ``noise`` or where a denominator differs."""
    out = []
    for a, b in zip(point, full):
        a0, b0 = (a[0], b[0]) if isinstance(a, list | tuple) else (a, b)
        same_den = not isinstance(a, list | tuple) or a[1] == b[1]
        delta = a0 - b0
        out.append(_g(delta) if same_den and math.isfinite(delta) and abs(delta) > noise else 0.0)
    return out


def metric_pools(runs: Sequence[dict]) -> dict[str, dict]:
    """``{metric: {"pairs", "noise", "base": [blocks of full depth's units], "changes": [blocks of a point's
    changes]}}`` over every model and domain's full-depth run and the points beside it; a metric whose samples are
    all 0/1 (an exact interval judges it) is left out."""
    full = {(r["model"], r["domain"]): r for r in runs if r.get("family") == "full"}
    out: dict[str, dict] = {}
    for metric in METRICS.values():
        base, changes, pairs, scores = [], [], None, False
        for key, ref in sorted(full.items()):
            found = samples_of(ref.get("tasks", {}), metric.name)
            if not found:
                continue
            reference = found[1]
            pairs = isinstance(reference[0], list | tuple)
            base += [[_unit(u) for u in block] for block in _blocks(reference)]
            scores |= not _binary(reference)
            for run in sorted(runs, key=lambda r: r["run_id"]):
                ours = samples_of(run.get("tasks", {}), metric.name) if run is not ref and (
                    run["model"], run["domain"]) == key else None
                if ours and len(ours[1]) <= len(reference):
                    scores |= not _binary(ours[1])
                    changes += [b for b in _blocks(_changes(ours[1], reference, metric.noise)) if any(b)]
        if base and changes and scores:
            out[metric.name] = {"pairs": bool(pairs), "noise": metric.noise, "base": base, "changes": changes}
    return out


def speed_deviations(runs: Sequence[dict]) -> list[float]:
    """Every timed point's per-prompt log speed ratios about that point's own mean (C2's pairs)."""
    out = []
    for r in sorted(runs, key=lambda r: r["run_id"]):
        cost = r.get("cost", {})
        pairs = cost.get("speed_pairs") or []
        if cost.get("speed_unit") == "prompt" and len(pairs) >= 2:
            logs = [math.log(a / b) for a, b in pairs]
            mean = sum(logs) / len(logs)
            out += [_g(x - mean) for x in logs]
    return out


def coverage_samples(runs: Sequence[dict]) -> dict:
    """The samples file's content (see the module docstring)."""
    return {"format": FORMAT, "version": 1, "block": BLOCK, "run_files": len(runs),
            "metrics": metric_pools(runs), "speed": {"deviations": speed_deviations(runs)}}


def samples_text(samples: dict) -> str:
    """The samples file's text: one block a line (small to diff), the same bytes for the same samples."""
    def lines(blocks: list) -> str:
        return "[\n" + ",\n".join("        " + json.dumps(b) for b in blocks) + "\n      ]"

    metrics = []
    for name, pool in samples["metrics"].items():
        head = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pool.items() if k not in ("base", "changes"))
        metrics.append(f'    {json.dumps(name)}: {{{head},\n      "base": {lines(pool["base"])},\n'
                       f'      "changes": {lines(pool["changes"])}}}')
    top = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in samples.items() if k not in ("metrics", "speed")]
    body = ",\n".join(metrics)
    return ("{\n" + ",\n".join([*top, f'  "metrics": {{\n{body}\n  }}',
                                   f'  "speed": {json.dumps(samples["speed"])}']) + "\n}\n")


def sha256_of(path: Path | str) -> str:
    """The sha256 of a file's bytes (the coverage table records its samples file's)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
