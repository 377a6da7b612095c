"""Which values of a screened sweep a decode stage keeps: read off the teacher-forced screen of its dense grid.

A screened sweep (a range or ``all``, :mod:`emad.evaluation.sweeps`) is scored at every value of its grid in the
domain's one-pass sweep, on the teacher-forced tasks only (:meth:`emad.evaluation.decoder.Decoder.screen`): one
:class:`ScreenRow` per value × calibration source × domain. :func:`keep` chooses, per sweep and jointly over its
domains and calibration sources (so that every kept point has every cell the verdict and the domain-shift matrix
read):

1. values with identical exit decisions on every cell count once (the first of them in grid order);
2. ``points`` values spread evenly along the sweep's FLOPs range (mean FLOPs ratio over the cells);
3. the two values beside the verdict's target FLOPs ratio (``1 − min_flops_reduction``): by the mean over the
   cells, and by each cell's own FLOPs ratio (a family × calibration × domain curve is read at the target there);
4. the two values beside the tolerance crossing nearest that target: one no teacher-forced check rules out on
   any cell, one some check rules out.

Before choosing, a sweep of a continuous knob whose neighbouring grid values beside the target (by the mean or on
any one cell), or beside the tolerance crossing nearest it, lie more than :data:`MAX_GAP` apart in FLOPs ratio is
screened again between them (:func:`refinements`: :data:`REFINE_VALUES` values, at most :data:`ROUNDS` rounds), so
that the kept points read each curve there at most :data:`MAX_GAP` apart wherever the knob can place them (a jump
of the exit decisions between two neighbouring values, a cliff, stays wider).

Only kept values become runs (run files, MLflow runs, free-running tasks, timing). The rows, kept or not, are the
sweep's screen artifact (:func:`screen_record`), drawn faintly behind the kept points in the figures.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

MAX_GAP = 0.05  # FLOPs ratio between the kept points beside the target (and beside the tolerance crossing)
REFINE_VALUES = 4  # values screened between two neighbours that lie farther apart
ROUNDS = 3  # refinement rounds at most


@dataclass
class ScreenRow:
    """One value of a screened sweep on one cell (calibration source × domain), teacher forced.

    Attributes:
        point: the expanded point's name (``emad_0.5``); curve, knob, value: its sweep, the knob and its value.
        family: the method family the report groups it in.
        flops_ratio: FLOPs vs full depth over the teacher-forced tasks' tokens.
        quality: each teacher-forced quality metric (perplexity, agreement, ...).
        ruled_out: the metrics whose teacher-forced check rules the value out (empty: none).
        exits: a digest of every scored token's exit depth (equal digests: equal exit decisions).
    """

    point: str
    curve: str
    family: str
    knob: str
    value: float
    calibration: str | None
    domain: str
    flops_ratio: float
    quality: dict[str, float]
    ruled_out: list[str]
    exits: str
    kept: bool = False
    why: list[str] = field(default_factory=list)  # why it was kept: spread, target, tolerance


def keep(rows: Sequence[ScreenRow], points: dict[str, int], target: float) -> set[str]:
    """The points each screened sweep keeps (module docstring), with ``kept`` and ``why`` set on ``rows``.

    Args:
        rows: every screened value's rows (all sweeps, cells and domains).
        points: sweep name → how many values it spreads along its FLOPs range.
        target: the verdict's target FLOPs ratio (``1 − min_flops_reduction``).
    """
    by_curve: dict[str, dict[str, list[ScreenRow]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_curve[row.curve][row.point].append(row)
    kept: set[str] = set()
    for curve, values in by_curve.items():
        reasons = _choose(values, points[curve], target)
        for point, why in reasons.items():
            kept.add(point)
            for row in values[point]:
                row.kept, row.why = True, why
    return kept


def _choose(values: dict[str, list[ScreenRow]], n: int, target: float) -> dict[str, list[str]]:
    """One sweep's kept points → why each is kept."""
    distinct: dict[tuple, str] = {}
    for point, cells in values.items():  # grid order: the first of equal exit decisions stands for them
        distinct.setdefault(tuple(sorted((r.calibration or "", r.domain, r.exits) for r in cells)), point)
    flops, ok = _pooled({p: values[p] for p in distinct.values()})
    order = sorted(flops, key=lambda p: (flops[p], p))
    reasons: dict[str, list[str]] = defaultdict(list)
    lo, hi = flops[order[0]], flops[order[-1]]
    for i in range(min(n, len(order))):
        aim = lo + (hi - lo) * i / max(n - 1, 1)
        free = [p for p in order if "spread" not in reasons[p]]
        reasons[min(free, key=lambda p: (abs(flops[p] - aim), flops[p]))].append("spread")
    for cell_flops in [flops, *_per_cell({p: values[p] for p in order}).values()]:
        for point in _beside(cell_flops, target):
            if "target" not in reasons[point]:
                reasons[point].append("target")
    crossings = [(a, b) for a, b in zip(order, order[1:]) if ok[a] != ok[b]]
    if crossings:
        a, b = min(crossings, key=lambda ab: abs((flops[ab[0]] + flops[ab[1]]) / 2 - target))
        reasons[a].append("tolerance")
        reasons[b].append("tolerance")
    return {p: why for p, why in reasons.items() if why}


def costly(rows: Sequence[ScreenRow], bound: float) -> set[tuple[str, str | None]]:
    """``(point, calibration)`` of the screened values whose teacher-forced FLOPs ratio is at least ``bound`` on
    every domain they ran: with ``bound`` at or above both the verdict's target and ``decode.speed_flops_below``,
    such a point can decide neither C1 (it cannot reach the reduction) nor C2 (it is not timed)."""
    lowest: dict[tuple[str, str | None], float] = {}
    for row in rows:
        key = (row.point, row.calibration)
        lowest[key] = min(lowest.get(key, row.flops_ratio), row.flops_ratio)
    return {key for key, flops in lowest.items() if flops >= bound}


def refinements(rows: Sequence[ScreenRow], target: float, layer_knobs: Sequence[str] = ()) -> dict[str, list[float]]:
    """Sweep → the values to screen next: between neighbouring values (in knob order) whose mean FLOPs ratios lie on
    both sides of ``target``, or that are the tolerance crossing nearest it, when they are more than
    :data:`MAX_GAP` apart; none for a layer knob (its grid is every layer) or where 4 significant digits cannot
    split the interval."""
    by_curve: dict[str, dict[float, list[ScreenRow]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_curve[row.curve][row.value].append(row)
    out = {}
    for curve, cells in by_curve.items():
        if next(iter(cells.values()))[0].knob in layer_knobs:
            continue
        values = sorted(cells)
        flops, ok = _pooled(cells)
        pairs = list(zip(values, values[1:]))
        wide = [(a, b) for cell_flops in [flops, *_per_cell(cells).values()] for a, b in pairs
                if a in cell_flops and b in cell_flops and (cell_flops[a] <= target) != (cell_flops[b] <= target)
                and abs(cell_flops[a] - cell_flops[b]) > MAX_GAP]
        crossings = [(a, b) for a, b in pairs if ok[a] != ok[b]]
        if crossings:
            a, b = min(crossings, key=lambda ab: abs((flops[ab[0]] + flops[ab[1]]) / 2 - target))
            if abs(flops[a] - flops[b]) > MAX_GAP:
                wide.append((a, b))
        new = {float(f"{a + (b - a) * k / (REFINE_VALUES + 1):.4g}") for a, b in wide
               for k in range(1, REFINE_VALUES + 1)} - set(values)
        if new:
            out[curve] = sorted(new)
    return out


def _beside(flops: dict, target: float) -> list:
    """The two keys of ``flops`` (key → FLOPs ratio) beside ``target``: the costliest at or below it and the
    cheapest above it (none when every value lies on one side)."""
    below = [k for k in flops if flops[k] <= target]
    above = [k for k in flops if flops[k] > target]
    if not below or not above:
        return []
    return [max(below, key=lambda k: (flops[k], str(k))), min(above, key=lambda k: (flops[k], str(k)))]


def _per_cell(cells: dict) -> dict[tuple, dict]:
    """Cell (calibration source, domain) → key of ``cells`` (its rows on every cell) → its FLOPs ratio there."""
    out: dict[tuple, dict] = defaultdict(dict)
    for key, rows in cells.items():
        for row in rows:
            out[row.calibration or "", row.domain][key] = row.flops_ratio
    return out


def _pooled(cells: dict) -> tuple[dict, dict]:
    """Per key (a point or a value) of ``cells`` (its rows on every cell): the mean FLOPs ratio over the cells, and
    whether no teacher-forced check rules it out on any."""
    return ({k: sum(r.flops_ratio for r in rows) / len(rows) for k, rows in cells.items()},
            {k: not any(r.ruled_out for r in rows) for k, rows in cells.items()})


def screen_record(model: str, curve: str, rows: Sequence[ScreenRow]) -> dict:
    """A sweep's screen artifact: the model, sweep, knob and family, and every row (kept or not)."""
    first = rows[0]
    return {"format": "emad-screen", "version": 1, "model": model, "curve": curve, "knob": first.knob,
            "family": first.family, "rows": [asdict(r) for r in sorted(rows, key=lambda r: (
                r.calibration or "", r.domain, r.value))]}
