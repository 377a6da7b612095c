"""How each family is drawn: a fixed (colour, marker) pair per family, the same in every figure: the colour
names the method and readout, the marker the readout and estimator."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from emad.evaluation.identity import LOGIT, split_family
from emad.report.frontier import FULL, ORACLE

# Base method -> colour (matplotlib tab10 / tab20, all distinct) and one marker per readout.
_METHOD_COLOURS = {"emad": "#d62728", "fixed": "#1f77b4", "confidence": "#ff7f0e", "softmax": "#2ca02c",
                   "contrastive": "#9467bd", "ead": "#8c564b", "speculative": "#e377c2", "calm": "#17becf",
                   "related": "#bcbd22"}
_TUNED_COLOURS = {"emad": "#7f0000", "fixed": "#08306b", "confidence": "#a63603", "softmax": "#00441b",
                  "contrastive": "#3f007d", "ead": "#4a2b20", "speculative": "#8e0152", "calm": "#0b5c66",
                  "related": "#6b6b00"}
_READOUT_MARKERS = {"logit": "o", "tuned": "s"}
_ESTIMATOR_MARKERS = {"topk": ("^", "v"), "lowrank": ("D", "d"), "prune": ("P", "X")}  # (logit, tuned) readout
_FIXED_STYLES = {FULL: ("black", "*"), ORACLE: ("#2ca02c", "x")}
# Fallback combinations for families not in the table: probed in order from a hash of the name.
_SPARE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf")
_SPARE_MARKERS = ("^", "v", "D", "P", "X", "<", ">", "h", "p", "d")


@dataclass(frozen=True)
class Style:
    """How one family is drawn: line and marker colour, and marker."""

    colour: str
    marker: str


def _table_style(family: str) -> Style | None:
    if family in _FIXED_STYLES:
        return Style(*_FIXED_STYLES[family])
    method, readout, estimator, stride = split_family(family)
    if stride != 1 or method not in _METHOD_COLOURS or readout not in _READOUT_MARKERS or (
            estimator is not None and estimator not in _ESTIMATOR_MARKERS):
        return None
    colours = _METHOD_COLOURS if readout == LOGIT else _TUNED_COLOURS
    if estimator is None:
        return Style(colours[method], _READOUT_MARKERS[readout])
    return Style(colours[method], _ESTIMATOR_MARKERS[estimator][readout != LOGIT])


def family_styles(families: Iterable[str]) -> dict[str, Style]:
    """A distinct :class:`Style` for every family: from the fixed table when known (the same in every figure),
    else the first free spare combination from a hash of the name (deterministic for a given set of families)."""
    names = sorted(set(families))
    out = {f: s for f in names if (s := _table_style(f)) is not None}
    taken = {(s.colour, s.marker) for s in out.values()}
    spare = [(c, m) for m in _SPARE_MARKERS for c in _SPARE_COLOURS]
    for f in names:
        if f in out:
            continue
        start = zlib.crc32(f.encode()) % len(spare)
        for k in range(len(spare)):
            combo = spare[(start + k) % len(spare)]
            if combo not in taken:
                break
        taken.add(combo)
        out[f] = Style(*combo)
    return out
