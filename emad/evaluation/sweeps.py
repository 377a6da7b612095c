"""Sweeps in params: a point that gives a list for its method's knob stands for one operating point per value.

``emad-tuned: {method: emad, readout: tuned, margin: [0.5, 1, 2]}`` expands to the points ``emad-tuned_0.5``,
``emad-tuned_1`` and ``emad-tuned_2``, each a first-class point (its own run file, MLflow run and report row) that
remembers its :class:`SweepPosition`: the sweep it belongs to, the knob and the value. Everything here runs while the
params are validated, so a bad sweep fails before any stage works.
"""

from __future__ import annotations

from typing import Any

from emad.config import Section
from emad.decode.strategy import Strategy
from emad.exits.criteria import CRITERIA
from emad.methods import STRATEGIES


class SweepPosition(Section):
    """Where a point sits on its family's curve: ``curve`` (the sweep's name in params, or the point's own when it
    is not swept), ``knob`` (the method's knob, None for a method without one) and its ``value``."""

    curve: str
    knob: str | None = None
    value: float | None = None


def knob_of(method: str) -> str | None:
    """The option a sweep of ``method`` varies (its criterion's or strategy's first knob); None without one."""
    cls: type[Strategy] | Any = STRATEGIES.get(method) if method in STRATEGIES else CRITERIA.get(method)
    return next(iter(cls.knobs), None)


def swept_name(base: str, value: float) -> str:
    """The name of a sweep's point: ``<base>_<value>`` (``emad-tuned_1.5``)."""
    return f"{base}_{value:g}"


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


def expand_table(table: str, points: dict[str, Any]) -> tuple[dict[str, Any], dict[str, SweepPosition]]:
    """Expand the swept points of ``decode.<table>``.

    Returns:
        The table with each swept point replaced by its points (in the listed order), and the :class:`SweepPosition` of
        each expanded point.

    Raises:
        ValueError: naming ``decode.<table>.<point>.<field>``: a list on a field that is not the method's knob,
            more than one list, an empty list, a non-numeric or duplicate value, an expanded name that is taken.
    """
    out: dict[str, Any] = {}
    curves: dict[str, SweepPosition] = {}
    for name, raw in points.items():
        lists = [k for k, v in raw.items() if isinstance(v, list)] if isinstance(raw, dict) else []
        if not lists:
            out[name] = raw
            continue
        where = f"decode.{table}.{name}"
        method = raw.get("method", "full")
        knob = knob_of(method) if method in STRATEGIES or method in CRITERIA else None
        if len(lists) > 1 or lists[0] != knob:
            field = next((k for k in lists if k != knob), lists[1] if len(lists) > 1 else lists[0])
            raise ValueError(f"{where}.{field}: a list sweeps the method's knob only (method {method!r}: "
                             f"{knob or 'no knob'}); give {field} one value")
        for value in _values(f"{where}.{knob}", raw[knob]):
            expanded = swept_name(name, value)
            if expanded in out or expanded in points:
                raise ValueError(f"{where}.{knob}: the value {value!r} makes point {expanded!r}, a name already "
                                 f"taken in decode.{table}; rename one of them")
            out[expanded] = {**raw, knob: value}
            curves[expanded] = SweepPosition(curve=name, knob=knob, value=float(value))
    return out, curves
