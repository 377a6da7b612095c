"""How often each side of the verdict's intervals covers the true change, by metric and number of units: the table
the verdict reads before it gives a label (:mod:`emad.evaluation.coverage`). Writes reports/bench/coverage.json.

A check is met when its interval's upper bound lies within the tolerance and violated when its lower bound lies
beyond it; a two-sided 95% interval promises each side 97.5%. This simulation measures what each side delivers on
paired differences shaped like those of the run files (``--runs``, the decode stages' output of a ``make repro``):

- ``rare-q`` shapes, q = 0.05, 0.1, 0.25, 0.5: a unit is full depth's own (a window, a prompt drawn from the
  full-depth runs) and, with probability q, changed by a change drawn from every change the run files measured
  between a point and full depth on one unit (heavy-tailed: most small, some hundreds of nats); else unchanged;
- ``every``: every unit changed so (q = 1).

The changes are scaled, keeping their shape, so that the population's change is :data:`TARGET` (five times the
tolerance: a change the verdict must not call met), and a changed score stays in its range.

For each shape a population of :data:`POPULATION` units is drawn once (its statistic is the true change), then
``--replicates`` samples of n units (a coverage of 97.5% then has a standard error of 0.35 point), for n in
``--sizes`` (the default and powered plans' judged sizes among them).
Each sample gets the interval the verdict would compute: a paired BCa bootstrap (the percentile interval where BCa
is undefined), ``--resamples`` resamples (the verdict uses 4,999; coverage does not move with more), at 95%.
Samples whose units are all unchanged are left out (the verdict gives them no bootstrap: the share bound, or
nothing for a relative metric); each cell records how many counted. C2's speed-up (Student t on the log ratios of
its per-prompt pairs) is simulated on the timed points' per-prompt log ratios about their own mean, shifted.

The table keeps, per metric, method, n and side, the smallest coverage over the shapes; the verdict gives a label
only where it is at least 96% (:data:`emad.evaluation.coverage.THRESHOLD`).

Usage: python benchmarks/bench_coverage.py [--runs reports/runs] [--replicates 2000] [--speed-replicates 20000]
       [--resamples 999] [--sizes 8,12,16,...] [--out coverage]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from emad.evaluation.coverage import SPEED, THRESHOLD  # noqa: E402
from emad.evaluation.intervals import LEVEL  # noqa: E402
from emad.evaluation.metrics import METRICS  # noqa: E402

SIZES = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 368)
SHAPES = {"rare-0.05": 0.05, "rare-0.1": 0.1, "rare-0.25": 0.25, "rare-0.5": 0.5, "every": 1.0}
POPULATION = 20_000
CHUNK = 4_000_000  # elements of one resampled array at a time (replicates × resamples × n)


# ------------------------------------------------------------------------------------------------- the statistics
# Each takes the paired columns of a sample, [..., n] each, and returns the change over the last axis: what
# emad.evaluation.intervals.change_interval computes for the metric (relative rise of perplexity, absolute drops).

def _perplexity_change(point, full, tokens, axis=-1):
    return np.exp((point.sum(axis) - full.sum(axis)) / tokens.sum(axis)) - 1.0


def _ratio_drop(point, full, compared, axis=-1):
    return (full.sum(axis) - point.sum(axis)) / compared.sum(axis)


def _mean_drop(point, full, axis=-1):
    return full.mean(axis) - point.mean(axis)


# metric -> (the statistic, its columns are pairs)
STATISTICS: dict[str, tuple[Callable, bool]] = {
    "perplexity": (_perplexity_change, True),
    "agreement.token_agreement": (_ratio_drop, True),
    "fidelity.token_agreement": (_ratio_drop, True),
    "fidelity.rouge_l": (_mean_drop, False),
}
TARGET = {"perplexity": 0.05, "agreement.token_agreement": 0.05, "fidelity.token_agreement": 0.05,
          "fidelity.rouge_l": 0.05}  # the populations' true change: five times each tolerance


# ----------------------------------------------------------------------------------------------- the run files

def _runs(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.rglob("*.json")) if p.parent.name != "screens"]


def _samples(run: dict, metric: str) -> list | None:
    m = METRICS.get(metric)
    return run.get("tasks", {}).get(m.task, {}).get("samples", {}).get(m.key)


def pools(runs: list[dict]) -> dict[str, dict]:
    """Per metric: full depth's units (``base``: columns ``[n, k]``) and every per-unit change a point measured
    (``changes``: of the numerator, beyond the metric's float noise)."""
    full = {(r["model"], r["domain"]): r for r in runs if r.get("family") == "full"}
    out = {}
    for metric in STATISTICS:
        noise = METRICS.get(metric).noise
        base, changes = [], []
        for (model, domain), ref in full.items():
            reference = _samples(ref, metric)
            if not reference:
                continue
            base += [list(u) if isinstance(u, list) else [u] for u in reference]
            for run in runs:
                if (run["model"], run["domain"]) != (model, domain) or run is ref:
                    continue
                ours = _samples(run, metric)
                if not ours or len(ours) > len(reference):
                    continue
                for a, b in zip(ours, reference):
                    a0, b0 = (a[0], b[0]) if isinstance(a, list) else (a, b)
                    if math.isfinite(a0 - b0) and abs(a0 - b0) > noise and (not isinstance(a, list) or a[1] == b[1]):
                        changes.append(a0 - b0)
        if base and changes:
            out[metric] = {"base": np.asarray(base, dtype=np.float64), "changes": np.asarray(changes)}
    return out


def speed_deviations(runs: list[dict]) -> np.ndarray:
    """Every timed point's per-prompt log speed ratios about that point's own mean (C2's pairs)."""
    out = []
    for r in runs:
        pairs = r.get("cost", {}).get("speed_pairs") or []
        if r.get("cost", {}).get("speed_unit") == "prompt" and len(pairs) >= 2:
            logs = np.log([a / b for a, b in pairs])
            out += list(logs - logs.mean())
    return np.asarray(out)


# ---------------------------------------------------------------------------------------------- the simulation

def population(pool: dict, metric: str, q: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``POPULATION`` paired units of one shape: full depth's columns ``[N, k]`` and the point's (its numerator
    changed with probability ``q`` by a measured change, scaled so that the population's change is the metric's
    :data:`TARGET`; a score kept in its range)."""
    base = pool["base"][rng.integers(0, len(pool["base"]), POPULATION)]
    moved = rng.random(POPULATION) < q
    delta = np.zeros(POPULATION)
    delta[moved] = pool["changes"][rng.integers(0, len(pool["changes"]), int(moved.sum()))]
    target, total = TARGET[metric], delta.sum()
    if metric == "perplexity":  # exp(s Σδ / Σt) − 1 = target
        scale = math.log1p(target) * base[:, 1].sum() / total
    elif base.shape[1] == 2:  # a drop of Σ(agreeing) / Σ(compared)
        scale = -target * base[:, 1].sum() / total
    else:  # a drop of the mean
        scale = -target * POPULATION / total
    point = base.copy()
    point[:, 0] += scale * delta
    if metric != "perplexity":  # agreeing tokens in [0, compared], a score in [0, 1]
        point[:, 0] = np.clip(point[:, 0], 0.0, base[:, 1] if base.shape[1] == 2 else 1.0)
    return point, base


def _columns(point: np.ndarray, full: np.ndarray, pairs: bool) -> tuple[np.ndarray, ...]:
    """The statistic's arguments from paired units ``[..., n, k]``."""
    return (point[..., 0], full[..., 0], full[..., 1]) if pairs else (point[..., 0], full[..., 0])


def bootstrap_bounds(columns: tuple[np.ndarray, ...], statistic, resamples: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The verdict's paired BCa interval (percentile where BCa is undefined) of every replicate ``[R, n]`` at 95%."""
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = stats.bootstrap(columns, statistic, n_resamples=resamples, vectorized=True, paired=True, axis=-1,
                              confidence_level=LEVEL, method="BCa", rng=rng)
    lo, hi = np.asarray(res.confidence_interval.low), np.asarray(res.confidence_interval.high)
    bad = ~(np.isfinite(lo) & np.isfinite(hi))
    if bad.any():
        dist = np.asarray(res.bootstrap_distribution)[bad]
        tail = (1 - LEVEL) / 2
        lo[bad], hi[bad] = np.quantile(dist, tail, axis=-1), np.quantile(dist, 1 - tail, axis=-1)
    return lo, hi


def cover_cell(point: np.ndarray, full: np.ndarray, metric: str, n: int, replicates: int, resamples: int,
               rng: np.random.Generator) -> dict:
    """Coverage of each side over ``replicates`` samples of ``n`` units of one population."""
    statistic, pairs = STATISTICS[metric]
    truth = float(statistic(*_columns(point, full, pairs)))
    noise = METRICS.get(metric).noise
    lows, highs, kept = [], [], 0
    chunk = max(1, CHUNK // (resamples * n))
    for start in range(0, replicates, chunk):
        idx = rng.integers(0, len(point), (min(chunk, replicates - start), n))
        p, f = point[idx], full[idx]  # [r, n, k]
        changed = (np.abs(p[..., 0] - f[..., 0]) > noise).any(axis=-1)
        if not changed.any():
            continue
        lo, hi = bootstrap_bounds(_columns(p[changed], f[changed], pairs), statistic, resamples, rng)
        lows.append(lo)
        highs.append(hi)
        kept += int(changed.sum())
    if not kept:
        return {"n": n, "replicates": replicates, "bootstrapped": 0, "truth": truth}
    lo, hi = np.concatenate(lows), np.concatenate(highs)
    slack = 1e-12 * max(1.0, abs(truth))
    return {"n": n, "replicates": replicates, "bootstrapped": kept, "truth": truth,
            "lower": float((lo <= truth + slack).mean()), "upper": float((hi >= truth - slack).mean())}


def cover_speed(deviations: np.ndarray, n: int, replicates: int, rng: np.random.Generator) -> dict:
    """Coverage of each side of the Student-t interval on log ratios over ``replicates`` samples of ``n`` prompts."""
    from scipy import stats

    logs = deviations[rng.integers(0, len(deviations), (replicates, n))] + 0.1  # a true log speed-up of 0.1
    truth = float(deviations.mean() + 0.1)
    half = stats.t.ppf(1 - (1 - LEVEL) / 2, n - 1) * logs.std(axis=1, ddof=1) / math.sqrt(n)
    mean = logs.mean(axis=1)
    return {"n": n, "replicates": replicates, "bootstrapped": replicates, "truth": truth,
            "lower": float((mean - half <= truth).mean()), "upper": float((mean + half >= truth).mean())}


def table_of(cells: dict) -> dict:
    """``{metric: {method: {n: {side: smallest coverage over the shapes}}}}`` from the cells (a cell whose samples
    were all unchanged bounds nothing)."""
    out: dict = {}
    for (metric, method, _shape), rows in cells.items():
        for row in rows:
            if "lower" not in row:
                continue
            sides = out.setdefault(metric, {}).setdefault(method, {}).setdefault(str(row["n"]), {})
            for side in ("lower", "upper"):
                sides[side] = min(sides.get(side, 1.0), row[side])
    return out


def markdown(table: dict, threshold: float = THRESHOLD) -> str:
    """The table as docs/params.md shows it: per metric and side, the coverage at each size (a cell below the
    threshold in bold: no label rests on that side there)."""
    sizes = sorted({int(n) for methods in table.values() for cells in methods.values() for n in cells})
    lines = ["| metric (method) | side | " + " | ".join(f"n {n}" for n in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for metric, methods in table.items():
        for method, cells in methods.items():
            for side in ("upper", "lower"):
                row = []
                for n in sizes:
                    found = cells.get(str(n))
                    value = "–" if found is None else f"{100 * found[side]:.1f}"
                    row.append(f"**{value}**" if found is not None and found[side] < threshold else value)
                lines.append(f"| {metric} ({method}) | {side} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="reports/runs")
    parser.add_argument("--replicates", type=int, default=2000)
    parser.add_argument("--speed-replicates", type=int, default=20000, help="C2's t interval is closed-form: cheap")
    parser.add_argument("--resamples", type=int, default=999)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--metrics", default=",".join([*STATISTICS, SPEED]))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="coverage")
    args = parser.parse_args(argv)
    folder = Path(args.runs)
    runs = _runs(folder) if folder.is_dir() else []
    if not runs:
        parser.error(f"--runs {folder}: no run files (run make repro first, or point at a checkout that did)")
    sizes = [int(x) for x in args.sizes.split(",")]
    metrics = args.metrics.split(",")
    unknown = sorted(set(metrics) - {*STATISTICS, SPEED})
    if unknown:
        parser.error(f"--metrics: unknown {unknown}; valid: {', '.join([*STATISTICS, SPEED])}")
    rng = np.random.default_rng(args.seed)
    began = time.perf_counter()
    found = pools(runs)
    cells: dict = {}
    for metric in [m for m in metrics if m in found]:
        for shape, q in SHAPES.items():
            point, full = population(found[metric], metric, q, rng)
            rows = cells[(metric, "bootstrap", shape)] = []
            for n in sizes:
                rows.append(cover_cell(point, full, metric, n, args.replicates, args.resamples, rng))
                row = rows[-1]
                print(f"{metric:26s} {shape:10s} n {n:4d}: lower {row.get('lower', float('nan')):.3f} upper "
                      f"{row.get('upper', float('nan')):.3f} ({row['bootstrapped']} of {row['replicates']} "
                      f"bootstrapped)", flush=True)
    if SPEED in metrics:
        deviations = speed_deviations(runs)
        if len(deviations):
            cells[(SPEED, "t-log", "pooled")] = [cover_speed(deviations, n, args.speed_replicates, rng)
                                                 for n in sizes]
    result = {"benchmark": "coverage of each side of the verdict's intervals by metric and size",
              "runs": str(folder), "run_files": len(runs), "replicates": args.replicates,
              "resamples": args.resamples, "level": LEVEL, "threshold": THRESHOLD, "shapes": SHAPES,
              "population": POPULATION, "pools": {m: {"units": len(p["base"]), "changes": len(p["changes"])}
                                                  for m, p in found.items()},
              "cells": [{"metric": m, "method": method, "shape": shape, "rows": rows}
                        for (m, method, shape), rows in cells.items()],
              "table": table_of(cells), "seconds": round(time.perf_counter() - began, 1)}
    print(markdown(result["table"], THRESHOLD))
    print(f"written to {write(args.out, result)} in {result['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
