"""Sweeps in params: a point whose method's knob is a list, a range or ``all`` stands for many operating points.

- A **list** (``margin: [0.5, 1, 2]``) gives one point per value, named ``<point>_<value>`` (``emad_0.5``), each a
  first-class point (its own run file, MLflow run and report row) that remembers its :class:`SweepPosition`.
- A **range** (``margin: {from: 0, to: auto, points: 8}``, ``threshold: {from: 0.02, to: 2, spacing: log}``) or
  ``all`` (a layer knob: every depth 1..L−1) is **screened**: the decode stage scores a dense grid of it
  (``grid`` values, default :data:`GRID`, evenly or, ``spacing: log``, geometrically spaced; a layer knob: every
  layer of its range, or every k-th when there are more than ``grid``) on the teacher-forced tasks in its
  one-pass sweep, and keeps ``points`` of them spread along the curve's FLOPs range plus the pairs that bracket the
  verdict's target and the tolerance crossing (:mod:`emad.evaluation.screen`). ``to: auto`` is the profile's
  largest τ (a method with a profile, knob ``margin``).
- A range's ``values`` (null: the range) **lists** the sweep's values instead: ``margin: {from: 0, to: auto,
  points: 8, values: [0.5, 1]}`` is the list ``[0.5, 1]`` (its range keys are then not read). DVC's ``-S`` (Hydra's
  override grammar) cannot replace a mapping by a list, so ``dvc exp run -S 'decode.points.emad.margin.values=[0.5,1]'``
  is how a ranged knob of the default params is swept at given values in one override.

Fields that name a layer (:data:`LAYER_FIELDS`) may be given relative to the model's depth L: ``L``, ``0.7L``
(``round(0.7 · L)``, at least 1), ``L-2``; ranges of them too. They resolve per model when the decode stage knows L
(:func:`resolve_layer`); without a model (the params check) they resolve against :data:`NOMINAL_LAYERS` so that the
options are still checked. Everything else here runs while the params are validated: a bad sweep fails before any
stage works.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

from emad.config import Section
from emad.decode.strategy import Strategy
from emad.exits.criteria import CRITERIA
from emad.methods import STRATEGIES

LAYER_FIELDS = ("depth", "exit_layer", "small_layers", "min_exit_layer")  # options that name a layer (1..L)
DEFAULT_POINTS = 8  # points a range keeps when it does not say
GRID = 16  # values a range knob is screened at (a layer knob: every layer in its range)
NOMINAL_LAYERS = 1000  # L that relative layers resolve against while params are checked without a model
RANGE_KEYS = {"from", "to", "points", "grid", "spacing"}
VALUES = "values"  # a range's key that lists the sweep's values instead (null: the range)
_RELATIVE = re.compile(r"^\s*(?:(\d*\.?\d+)\s*\*?\s*)?L\s*(?:([+-])\s*(\d+))?\s*$")


class SweepPosition(Section):
    """Where a point sits on its family's curve: ``curve`` (the sweep's name in params, or the point's own when it
    is not swept), ``knob`` (the method's knob, None for a method without one), its ``value``, and whether the
    value came from a screened range (``screened``)."""

    curve: str
    knob: str | None = None
    value: float | None = None
    screened: bool = False


class Screen(Section):
    """A screened sweep of ``decode.<table>.<name>``: its knob, the grid of values scored teacher forced (resolved
    for one model; empty while params are checked without one) and how many points it keeps (``points``)."""

    table: str
    name: str
    knob: str
    points: int
    values: list[float]


def knob_of(method: str) -> str | None:
    """The option a sweep of ``method`` varies (its criterion's or strategy's first knob); None without one."""
    cls: type[Strategy] | Any = STRATEGIES.get(method) if method in STRATEGIES else CRITERIA.get(method)
    return next(iter(cls.knobs), None)


def swept_name(base: str, value: float) -> str:
    """The name of a sweep's point: ``<base>_<value>`` (``emad-tuned_1.5``)."""
    return f"{base}_{value:g}"


def resolve_layer(where: str, value: Any, n_layers: int | None) -> Any:
    """A layer field's value for a model of ``n_layers`` layers: an int stays; ``L``, ``0.7L``, ``L-2`` resolve
    (``round(f · L) ± k``, at least 1); anything else is returned for the field's own check. ``n_layers`` None:
    :data:`NOMINAL_LAYERS`.

    Raises:
        ValueError: naming ``where``: a relative value that is not of the form ``L``, ``<f>L``, ``L-<k>``, or a
            fraction above 1.
    """
    if not isinstance(value, str):
        return value
    found = _RELATIVE.match(value)
    if not found:
        raise ValueError(f"{where}: {value!r} is neither a layer number nor relative to the model's depth L; "
                         f"give an int, 'L', a fraction such as '0.7L', or 'L-2'")
    fraction = float(found.group(1)) if found.group(1) else 1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"{where}: {value!r}: the fraction of L must be in (0, 1]")
    shift = int(found.group(3) or 0) * (-1 if found.group(2) == "-" else 1)
    return max(1, round(fraction * (n_layers or NOMINAL_LAYERS)) + shift)


def _values(where: str, values: list) -> list[float]:
    if not values:
        raise ValueError(f"{where}: an empty list; give at least one value")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int | float)]
    if bad:
        raise ValueError(f"{where}: {bad[0]!r} is not a number; a sweep lists numbers, e.g. [0.5, 1, 2]")
    seen = set()
    for v in values:
        if float(v) in seen:
            raise ValueError(f"{where}: the value {v!r} is listed twice")
        seen.add(float(v))
    return values


def forms(where: str) -> str:
    """The two forms a swept knob's mapping at ``where`` may take, for error messages."""
    return (f"{where} is either a range {{from: ..., to: ..., points: ...}} (its values: null), screened, or lists "
            f"its values, values: [0.5, 1], one point each (dvc exp run -S '{where}.{VALUES}=[0.5,1]')")


def listed(where: str, spec: Any) -> list | None:
    """The values a knob's mapping lists (``values: [...]``; its range keys are then not read), or None for a range
    (``values`` absent or null) or a knob that is not a mapping.

    Raises:
        ValueError: naming ``<where>.values``: a value that is not a list; ``<where>.<key>``: a list on a range
            key (``from``, ``to``, ``points``, ``grid``, ``spacing``) while ``values`` is null; ``<where>``: an
            unknown key beside ``values``; each with the two forms (:func:`forms`).
    """
    if not isinstance(spec, dict):
        return None
    values = spec.get(VALUES)
    if values is not None and not isinstance(values, list):
        raise ValueError(f"{where}.{VALUES}: {values!r} is not a list; {forms(where)}")
    if values is None:
        key = next((k for k in sorted(RANGE_KEYS) if isinstance(spec.get(k), list | dict)), None)
        if key is not None:
            raise ValueError(f"{where}.{key}: {spec[key]!r}: a list where the range needs one value; {forms(where)}")
    unknown = sorted(set(spec) - RANGE_KEYS - {VALUES})
    if values is not None and unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; {forms(where)}")
    return values


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: {value!r} is not a finite number")
    return float(value)


def grid_of(where: str, knob: str, spec: Any, n_layers: int | None, auto: float | None,
            has_profile: bool) -> tuple[list[float], int] | None:
    """The screened grid of a range (``{from, to, points, grid}``) or ``all``, and how many points it keeps; None
    when ``to: auto`` waits for the profile (``auto`` None).

    Raises:
        ValueError: naming ``where`` (``decode.<table>.<point>.<knob>``): unknown keys, ``from`` > ``to``,
            ``points`` < 2, ``grid`` < ``points``, ``all`` on a knob that is not a layer, ``to: auto`` on a method
            without a profile or a knob other than ``margin``, ``spacing: log`` on a layer knob or from <= 0.
    """
    layer = knob in LAYER_FIELDS
    if spec == "all":
        if not layer:
            raise ValueError(f"{where}: 'all' sweeps a layer knob ({', '.join(LAYER_FIELDS)}); give {knob} a "
                             f"range {{from: ..., to: ..., points: ...}} or a list")
        spec = {"from": 1, "to": "L-1"}
    unknown = sorted(set(spec) - RANGE_KEYS - {VALUES})
    if unknown:
        raise ValueError(f"{where}: unknown range key(s) {', '.join(unknown)}; a range is {{from, to, points, "
                         f"grid, spacing}}, or its values: [...] lists the sweep's values")
    if "from" not in spec or "to" not in spec:
        raise ValueError(f"{where}: a range needs from and to, e.g. {{from: 0, to: auto, points: 8}}; "
                         f"{forms(where)}")
    points = spec.get("points", DEFAULT_POINTS)
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise ValueError(f"{where}.points: {points!r}: a range keeps at least 2 points (an int >= 2)")
    if spec["to"] == "auto" and (knob != "margin" or not has_profile):
        raise ValueError(f"{where}.to: auto is the profile's largest tau: it needs a method with a profile and "
                         f"knob margin (this knob: {knob}); give a number")
    if spec["to"] == "auto" and auto is None:
        return None
    ends = []
    for key in ("from", "to"):
        raw = auto if spec[key] == "auto" else spec[key]
        value = resolve_layer(f"{where}.{key}", raw, n_layers) if layer else raw
        ends.append(_number(f"{where}.{key}", value))
    lo, hi = ends
    if lo > hi:
        raise ValueError(f"{where}: from = {lo:g} is above to = {hi:g}; give from <= to")
    grid = spec.get("grid", GRID)
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < points:
        raise ValueError(f"{where}.grid: {grid!r}: screen at least as many values as the points kept ({points})")
    spacing = spec.get("spacing", "linear")
    if spacing not in ("linear", "log") or (spacing == "log" and (layer or lo <= 0)):
        raise ValueError(f"{where}.spacing: {spacing!r}: give linear (the default) or log (a knob that is not a "
                         f"layer, from > 0)")
    if layer:
        every = list(range(int(lo), int(hi) + 1))
        step = max(1, math.ceil(len(every) / grid))
        values = every[::step] + ([every[-1]] if (len(every) - 1) % step else [])
    elif spacing == "log":
        values = sorted({float(f"{lo * (hi / lo) ** (i / (grid - 1)):.4g}") for i in range(grid)})
    else:
        values = sorted({float(f"{lo + (hi - lo) * i / (grid - 1):.4g}") for i in range(grid)})
    return [float(v) for v in values], points


def expand_table(table: str, points: dict[str, Any], n_layers: int | None = None,
                 auto: dict[str, float] | None = None
                 ) -> tuple[dict[str, Any], dict[str, SweepPosition], dict[str, Screen]]:
    """Expand the swept points of ``decode.<table>``, their layer fields resolved for ``n_layers`` (None: checked
    against :data:`NOMINAL_LAYERS`).

    Args:
        auto: a screened sweep's name → its profile's largest τ (``to: auto``); a sweep missing here is checked
            but not expanded.

    Returns:
        The table with each swept point replaced by its points (in the listed or grid order), the
        :class:`SweepPosition` of each expanded point, and the :class:`Screen` of each screened sweep (without
        ``n_layers`` or its ``auto``: its grid left empty and its points absent from the table, the point checked
        at its ``from`` value).

    Raises:
        ValueError: naming ``decode.<table>.<point>.<field>``: a list or range on a field that is not the method's
            knob, more than one, an empty list, a non-numeric or duplicate value, a bad range (:func:`grid_of`) or
            mix of a range and its values (:func:`listed`), a bad relative layer, an expanded name that is taken.
    """
    out: dict[str, Any] = {}
    curves: dict[str, SweepPosition] = {}
    screens: dict[str, Screen] = {}
    for name, raw in points.items():
        where = f"decode.{table}.{name}"
        if not isinstance(raw, dict):
            out[name] = raw
            continue
        method = raw.get("method", "full")
        knob = knob_of(method) if method in STRATEGIES or method in CRITERIA else None
        swept = [k for k, v in raw.items() if isinstance(v, list | dict) or (v == "all" and k == knob)]
        raw = {k: resolve_layer(f"{where}.{k}", v, n_layers) if k in LAYER_FIELDS and k not in swept else v
               for k, v in raw.items()}
        if not swept:
            out[name] = raw
            continue
        if len(swept) > 1 or swept[0] != knob:
            field = next((k for k in swept if k != knob), swept[1] if len(swept) > 1 else swept[0])
            raise ValueError(f"{where}.{field}: a list or range sweeps the method's knob only (method {method!r}: "
                             f"{knob or 'no knob'}); give {field} one value")
        given = raw[knob] if isinstance(raw[knob], list) else listed(f"{where}.{knob}", raw[knob])
        if given is not None:
            at = f"{where}.{knob}" + ("" if isinstance(raw[knob], list) else f".{VALUES}")
            given = [resolve_layer(at, v, n_layers) if knob in LAYER_FIELDS else v for v in given]
            values, screen = _values(at, given), None
        else:
            spec = raw[knob] if isinstance(raw[knob], dict) else "all"
            has_profile = method in CRITERIA and "profile" in inspect.signature(CRITERIA.get(method)).parameters
            found = grid_of(f"{where}.{knob}", knob, spec, n_layers, (auto or {}).get(name), has_profile)
            if found is None or n_layers is None:  # checked; expanded once the model (and profile) is known
                first = spec.get("from", 1) if isinstance(spec, dict) else 1
                out[name] = {**raw, knob: resolve_layer(f"{where}.{knob}", first, None)}
                kept = spec.get("points", DEFAULT_POINTS) if isinstance(spec, dict) else DEFAULT_POINTS
                screens[name] = Screen(table=table, name=name, knob=knob, points=kept, values=[])
                continue
            values, kept = found
            screen = Screen(table=table, name=name, knob=knob, points=kept, values=values)
            screens[name] = screen
        for value in values:
            value = int(value) if knob in LAYER_FIELDS else value
            expanded = swept_name(name, value)
            if expanded in out or expanded in points:
                raise ValueError(f"{where}.{knob}: the value {value!r} makes point {expanded!r}, a name already "
                                 f"taken in decode.{table}; rename one of them")
            out[expanded] = {**raw, knob: value}
            curves[expanded] = SweepPosition(curve=name, knob=knob, value=float(value), screened=screen is not None)
    return out, curves, screens
