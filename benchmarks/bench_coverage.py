"""How often each side of the verdict's intervals covers the true change where labels flip, by metric, size, changed
units and level: the table the verdict reads before it gives a label (:mod:`emad.evaluation.coverage`). Reads the
committed samples (reports/bench/coverage_samples.json, written by the aggregate stage from a run) and writes
reports/bench/coverage.json with that file's sha256, so a clone rebuilds the same table.

For each metric a bootstrap judges, each share q of changed units (:data:`QS`) and each multiple of the tolerance
(:data:`MULTIPLES`: the true change at the tolerance, where a met / violated label flips, and at half and twice
it), a population of :data:`POPULATION_BLOCKS` blocks of 4 units is drawn once: each block is one of full depth's
(consecutive units of one run, as the split keeps them), and, with the probability that changes a share q of the
units, it takes a measured block of a point's per-unit changes (so changes keep their clustering within blocks; when
q is above the share the measured blocks change, every unit changes alone with probability q). The changes are
scaled, keeping their shape, so that the population's change is the multiple of the tolerance (a bounded score kept
in its range; a population that cannot reach it is left out, "infeasible"). The population's statistic is the truth.

Then ``--replicates`` samples of n units (n/4 whole blocks, for n in :data:`SIZES`) get the interval the verdict
computes (:func:`emad.evaluation.bootstrap.bootstrap_bounds`: the paired BCa bootstrap over blocks, the percentile
interval where BCa is undefined, ``--resamples`` resamples; the verdict uses 4,999 — coverage does not move with
more) at every level of :data:`emad.evaluation.coverage.LEVELS` from the same resamples (every :data:`PER_DRAW`
replicates share one draw of which blocks each resample takes). A sample whose units are all
unchanged is left out (the verdict gives it no bootstrap), as is one whose resamples do not vary. Each replicate is
counted in the bin of its changed units (:data:`emad.evaluation.coverage.CHANGED_BINS`). C2's speed-up (Student t on
the log ratios of its per-prompt pairs) is simulated on the timed points' per-prompt log ratios about their own mean.

The table keeps, per metric, method, n, changed bin, level and side, the worst shape by the Monte Carlo lower bound
of its coverage, among the shapes with at least :data:`MIN_BIN_REPLICATES` replicates in that bin. Every cell is
seeded by its own key, so any subset of cells (``--metrics``, ``--q``, ``--multiples``, ``--sizes``) rebuilds
exactly the cells of the whole run.

Usage: python benchmarks/bench_coverage.py [--samples reports/bench/coverage_samples.json] [--replicates 2000]
       [--speed-replicates 20000] [--resamples 999] [--sizes 8,12,...] [--q 0.005,...] [--multiples 0.5,1,2]
       [--metrics ...] [--workers 2] [--seed 0] [--out coverage]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from emad.evaluation.bootstrap import bootstrap_bounds, paired_change_of_totals  # noqa: E402
from emad.evaluation.checks import Thresholds  # noqa: E402
from emad.evaluation.coverage import (  # noqa: E402
    ALL_BINS,
    CHANGED_BINS,
    LEVELS,
    MC_CONFIDENCE,
    SLACK,
    SPEED,
    Cell,
    Coverage,
    bin_label,
    changed_bin,
    target,
)
from emad.evaluation.coverage_samples import FORMAT, sha256_of  # noqa: E402
from emad.evaluation.metrics import METRICS  # noqa: E402

SAMPLES = ROOT / "reports" / "bench" / "coverage_samples.json"
SIZES = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 368)
QS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
MULTIPLES = (0.5, 1.0, 2.0)
POPULATION_BLOCKS = 5000
BLOCK = 4
MIN_BIN_REPLICATES = 200  # a shape speaks for a changed bin only with this many replicates there
PER_DRAW = 100  # replicates that share one draw of resample counts (a matrix product gives all their resamples)
COLUMNS = ("metric", "method", "n", "changed", "level", "side", "covered", "replicates", "coverage", "lower", "shape")
SPEED_TRUTH = 0.1  # a true log speed-up (the t interval is location-invariant: any value serves)


# ---------------------------------------------------------------------------------------------- the populations

def _seeded(*key) -> np.random.Generator:
    """A generator seeded by a cell's key, so any subset of cells reproduces the whole run's."""
    return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def _statistic(metric: str, pairs: bool):
    """The change the verdict computes for ``metric`` from totals (point num, den, full num, den)."""
    m = METRICS.get(metric)
    return paired_change_of_totals(metric == "perplexity" and pairs, m.tolerance == "relative")


def _change(pool: dict, metric: str, point: np.ndarray, full: np.ndarray) -> float:
    """The population's change: the statistic on every unit (``[N, 4, k]`` each)."""
    sums = _block_sums(point, full, pool["pairs"])
    return float(_statistic(metric, pool["pairs"])(*(s.sum() for s in sums)))


def _block_sums(point: np.ndarray, full: np.ndarray, pairs: bool) -> tuple[np.ndarray, ...]:
    """Units ``[..., 4, k]`` → block sums (point num, point den, full num, full den), each ``[...]``."""
    if pairs:
        return point[..., 0].sum(-1), point[..., 1].sum(-1), full[..., 0].sum(-1), full[..., 1].sum(-1)
    ones = np.full(point.shape[:-2], float(point.shape[-2]))
    return point[..., 0].sum(-1), ones, full[..., 0].sum(-1), ones


def _clip(metric: str, pool: dict, values: np.ndarray, full: np.ndarray) -> np.ndarray:
    """A bounded score kept in its range: agreeing tokens in [0, compared], a score in [0, 1]."""
    if metric == "perplexity":
        return values
    return np.clip(values, 0.0, full[..., 1] if pool["pairs"] else 1.0)


def population(pool: dict, metric: str, q: float, multiple: float, rng: np.random.Generator
               ) -> tuple[np.ndarray, np.ndarray, float] | None:
    """:data:`POPULATION_BLOCKS` blocks of paired units ``[N, 4, k]`` (point, full) whose change is ``multiple``
    × the tolerance with a share ``q`` of changed units, and that share as drawn; None when a bounded score cannot
    reach the change with so few units changed."""
    base = np.asarray([b for b in pool["base"] if len(b) == BLOCK], dtype=np.float64)  # [B, 4, k]
    changes = np.asarray([b + [0.0] * (BLOCK - len(b)) for b in pool["changes"]], dtype=np.float64)  # [C, 4]
    full = base[rng.integers(0, len(base), POPULATION_BLOCKS)]  # [N, 4, k]
    share = float((changes != 0).mean())  # of a measured change block's units
    if q <= share:  # whole measured change blocks: their clustering kept
        hit = rng.random(POPULATION_BLOCKS) < q / share
        delta = np.zeros((POPULATION_BLOCKS, BLOCK))
        delta[hit] = changes[rng.integers(0, len(changes), int(hit.sum()))]
    else:  # more units change than the measured blocks change: each unit alone
        moved = changes[changes != 0]
        delta = np.where(rng.random((POPULATION_BLOCKS, BLOCK)) < q,
                         moved[rng.integers(0, len(moved), (POPULATION_BLOCKS, BLOCK))], 0.0)
    if not delta.any():
        return None
    want = multiple * Thresholds().tolerance(metric)

    def shifted(scale: float) -> np.ndarray:
        point = full.copy()
        point[..., 0] = _clip(metric, pool, full[..., 0] + scale * delta, full)
        return point

    if metric == "perplexity":  # exp(s Σδ / Σt) − 1 = want, exactly
        scale = math.log1p(want) * full[..., 1].sum() / delta.sum()
    else:  # a drop Σ(full − point) / Σ den = want, before clipping; then bisect what clipping took away
        den = full[..., 1].sum() if pool["pairs"] else float(full[..., 0].size)
        scale = -want * den / delta.sum()
        if _change(pool, metric, shifted(scale * 1e6), full) < want:
            return None
        lo, hi = 0.0, 1.0
        while _change(pool, metric, shifted(scale * hi), full) < want:
            hi *= 2.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _change(pool, metric, shifted(scale * mid), full) < want else (lo, mid)
        scale *= hi
    point = shifted(scale)
    moved = np.abs(point[..., 0] - full[..., 0]) > pool["noise"]
    return point, full, float(moved.mean())


# ----------------------------------------------------------------------------------------------- the simulation

def cover_shape(pool: dict, metric: str, q: float, multiple: float, sizes: list[int], replicates: int,
                resamples: int, seed: int) -> list[dict]:
    """One shape's cells: per size, per changed bin, per level, how many replicates each side covered."""
    rng = _seeded(seed, metric, q, multiple)
    found = population(pool, metric, q, multiple, rng)
    shape = f"q={q:g} x{multiple:g}"
    if found is None:
        return [{"metric": metric, "shape": shape, "q": q, "multiple": multiple, "n": n, "infeasible": True}
                for n in sizes]
    point, full, share = found
    truth = _change(pool, metric, point, full)
    slack = 1e-12 * max(1.0, abs(truth))
    statistic, rows = _statistic(metric, pool["pairs"]), []
    for n in sizes:
        rng_n = _seeded(seed, metric, q, multiple, n)
        m = n // BLOCK
        idx = rng_n.integers(0, len(point), (replicates, m))
        p, f = point[idx], full[idx]  # [R, m, 4, k]
        changed = (np.abs(p[..., 0] - f[..., 0]) > pool["noise"]).sum(axis=(1, 2))  # [R]
        bins: dict[str, dict] = {}
        keep = np.flatnonzero(changed > 0)
        for start in range(0, len(keep), PER_DRAW):
            these = keep[start:start + PER_DRAW]
            sums = _block_sums(p[these], f[these], pool["pairs"])  # 4 × [r, m]
            bounds, dist = bootstrap_bounds(sums, statistic, LEVELS, resamples, rng_n)
            dist = dist.reshape(len(these), -1)
            defined = np.isfinite(dist).all(-1) & (np.ptp(dist, axis=-1) > 0)
            for j, r in enumerate(these):
                if not defined[j]:
                    continue
                cell = bins.setdefault(changed_bin(int(changed[r])), {
                    "replicates": 0, "lower": [0] * len(LEVELS), "upper": [0] * len(LEVELS)})
                cell["replicates"] += 1
                for i, (lo, hi, _) in enumerate(bounds[level] for level in LEVELS):
                    cell["lower"][i] += int(lo[j] <= truth + slack)
                    cell["upper"][i] += int(hi[j] >= truth - slack)
        rows.append({"metric": metric, "shape": shape, "q": q, "multiple": multiple, "n": n, "truth": truth,
                     "share": share, "replicates": replicates, "bootstrapped": int(sum(b["replicates"]
                                                                                       for b in bins.values())),
                     "bins": dict(sorted(bins.items()))})
    return rows


def cover_speed(deviations: np.ndarray, sizes: list[int], replicates: int, seed: int) -> list[dict]:
    """Coverage of each side of the Student-t interval on log ratios, per size and level."""
    from scipy import stats

    rows = []
    for n in sizes:
        rng = _seeded(seed, SPEED, n)
        logs = deviations[rng.integers(0, len(deviations), (replicates, n))] + SPEED_TRUTH
        truth = float(deviations.mean() + SPEED_TRUTH)
        mean, sd = logs.mean(axis=1), logs.std(axis=1, ddof=1)
        halves = [stats.t.ppf(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n) for level in LEVELS]
        rows.append({"metric": SPEED, "shape": "pooled", "n": n, "truth": truth, "replicates": replicates,
                     "bins": {ALL_BINS: {"replicates": replicates,
                                         "lower": [int((mean - half <= truth).sum()) for half in halves],
                                         "upper": [int((mean + half >= truth).sum()) for half in halves]}}})
    return rows


def table_of(cells: list[dict]) -> dict:
    """One row per metric, method, n, changed bin, level and side: the worst shape by its Monte Carlo lower bound
    (among shapes with ≥ :data:`MIN_BIN_REPLICATES` replicates in the bin), as ``{"columns", "rows"}``."""
    worst: dict[tuple, Cell] = {}
    for row in cells:
        method = "t-log" if row["metric"] == SPEED else "bootstrap"
        for changed, cell in row.get("bins", {}).items():
            if cell["replicates"] < MIN_BIN_REPLICATES:
                continue
            for side in ("lower", "upper"):
                for level, covered in zip(LEVELS, cell[side]):
                    key = (row["metric"], method, row["n"], changed, level, side)
                    found = Cell(covered, cell["replicates"], row["shape"])
                    if key not in worst or found.lower < worst[key].lower:
                        worst[key] = found
    return {"columns": list(COLUMNS),
            "rows": [[*k, c.covered, c.replicates, round(c.coverage, 6), round(c.lower, 6), c.shape]
                     for k, c in sorted(worst.items())]}


def markdown(table: Coverage, level: float = 0.95) -> str:
    """Per metric and side, at each simulated size: from how many changed units a label judged at ``level`` stands
    and the widest level it is judged at there (``≥ 4 · 97.5``; ``all`` where it does not depend on them; – where
    it stands for no number of changed units)."""
    metrics = sorted({(k[0], k[1]) for k in table.cells})
    sizes = sorted({k[2] for k in table.cells})
    lines = ["| metric (method) | side | " + " | ".join(f"n {n}" for n in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for metric, method in metrics:
        for side in ("upper", "lower"):
            row = []
            for n in sizes:
                found = table.reach(metric, method, n, side, level) if n in table.sizes(metric, method) else None
                row.append("–" if found is None else
                           f"{'all' if found[0] <= 1 else f'≥ {found[0]}'} · {100 * found[1]:.4g}")
            lines.append(f"| {metric} ({method}) | {side} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _load(path: Path) -> dict:
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a coverage samples file (format {data.get('format')!r}, want {FORMAT!r})")
    return data


def _floats(text: str, name: str, parser: argparse.ArgumentParser) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        parser.error(f"--{name}: a comma-separated list of numbers, got {text!r}")
        raise


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=Path, default=SAMPLES)
    parser.add_argument("--replicates", type=int, default=2000)
    parser.add_argument("--speed-replicates", type=int, default=20000, help="C2's t interval is closed-form: cheap")
    parser.add_argument("--resamples", type=int, default=999)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--q", default=",".join(map(str, QS)))
    parser.add_argument("--multiples", default=",".join(map(str, MULTIPLES)))
    parser.add_argument("--metrics", default=None, help="default: every metric of the samples, and speed")
    parser.add_argument("--workers", type=int, default=2, help="processes (1: in this one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="coverage")
    args = parser.parse_args(argv)
    try:
        data = _load(args.samples)
    except (OSError, ValueError) as err:
        parser.error(f"--samples {args.samples}: {err} (the aggregate stage writes it: run make repro first)")
    sizes = [int(x) for x in _floats(args.sizes, "sizes", parser)]
    if any(n < 2 * BLOCK or n % BLOCK for n in sizes):
        parser.error(f"--sizes: each a multiple of {BLOCK} of at least {2 * BLOCK} (whole blocks), got {sizes}")
    qs, multiples = _floats(args.q, "q", parser), _floats(args.multiples, "multiples", parser)
    pools = data["metrics"]
    valid = [*pools, SPEED]
    metrics = args.metrics.split(",") if args.metrics else valid
    if sorted(set(metrics) - set(valid)):
        parser.error(f"--metrics: unknown {sorted(set(metrics) - set(valid))}; valid: {', '.join(valid)}")
    began = time.perf_counter()
    jobs = [(pools[m], m, q, k, sizes, args.replicates, args.resamples, args.seed)
            for m in metrics if m != SPEED for q in qs for k in multiples]
    cells: list[dict] = []
    with ProcessPoolExecutor(max_workers=args.workers) if args.workers > 1 else nullcontext() as pool:
        for rows in (pool.map if pool else map)(cover_shape, *zip(*jobs)) if jobs else []:
            for row in rows:
                print(f"{row['metric']:26s} {row['shape']:12s} n {row['n']:4d}: "
                      + ("infeasible" if row.get("infeasible") else
                         f"{row['bootstrapped']} of {row['replicates']} bootstrapped"), flush=True)
            cells += rows
    deviations = np.asarray(data["speed"]["deviations"], dtype=np.float64)
    if SPEED in metrics and len(deviations):
        cells += cover_speed(deviations, sizes, args.speed_replicates, args.seed)
    table = table_of(cells)
    result = {"benchmark": "coverage of each side of the verdict's intervals where labels flip, by metric, size, "
                           "changed units and level",
              "samples": str(args.samples.relative_to(ROOT) if args.samples.is_relative_to(ROOT) else args.samples),
              "samples_sha256": sha256_of(args.samples), "run_files": data.get("run_files"),
              "replicates": args.replicates, "speed_replicates": args.speed_replicates, "resamples": args.resamples,
              "seed": args.seed, "levels": list(LEVELS), "targets": {str(lv): target(lv) for lv in LEVELS},
              "slack": SLACK, "mc_confidence": MC_CONFIDENCE, "q": qs, "multiples": multiples, "sizes": sizes,
              "changed_bins": [bin_label(lo, hi) for lo, hi in CHANGED_BINS],
              "population_blocks": POPULATION_BLOCKS, "min_bin_replicates": MIN_BIN_REPLICATES,
              "pools": {m: {"blocks": len(p["base"]), "change_blocks": len(p["changes"])} for m, p in pools.items()},
              "cells": cells, "table": table, "seconds": round(time.perf_counter() - began, 1)}
    print(markdown(Coverage.from_dict(result)))
    print(f"written to {write_compact(args.out, result)} in {result['seconds']:.0f} s")
    return result


def write_compact(name: str, result: dict) -> Path:
    """``reports/bench/<name>.json`` with one line per cell and per table row (the file stays small enough to
    read and to diff), written atomically."""
    lines = []
    for key, value in result.items():
        if key == "cells":
            body = ",\n".join("    " + json.dumps(row) for row in value)
            lines.append(f'  "cells": [\n{body}\n  ]')
        elif key == "table":
            body = ",\n".join("      " + json.dumps(row) for row in value["rows"])
            lines.append(f'  "table": {{\n    "columns": {json.dumps(value["columns"])},\n    "rows": [\n{body}\n    ]\n  }}')
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    path = ROOT / "reports" / "bench" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    tmp.replace(path)
    return path


if __name__ == "__main__":
    main()

