"""The device a run's C2 pairs were timed on, and the one device a point's C2 interval is read on.

A speed-up belongs to the hardware it was timed on: pairs from a GPU and from a CPU are not draws of one speed-up,
and pooling them gives an interval of neither. Each speed record names its device (``cost.speed_device``,
:func:`device_name`: ``cuda: NVIDIA H200, 139 GiB``, ``cpu: <CPU model>``). A run file without it (an older
version) is named by its provenance in the same words (``device`` with ``gpu``, else ``cpu``); one without either
counts as one unnamed device. A point's C2 interval pools the pairs of its runs on one device, the one with the
most pairs (ties: the first name in sorted order); the runs on other devices are left out, and named
(:func:`split_by_device`). Where every run names one device, every run is kept: nothing changes.

No torch here: the verdict reads run files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def device_name(device: str, gpu: str | None, cpu: str | None) -> str:
    """``<device type>: <GPU name and memory>`` where there is a GPU, else ``<device type>: <CPU model>``
    (``device`` as torch writes it, ``cuda:0`` or ``cpu``)."""
    return f"{str(device).split(':', 1)[0]}: {gpu or cpu or 'unknown'}"


def run_device(run: dict[str, Any]) -> str | None:
    """The device ``run``'s speed pairs were timed on: ``cost.speed_device``, else its provenance's device in the
    same words (:func:`device_name`), else None (an unnamed device)."""
    named = (run.get("cost") or {}).get("speed_device")
    if named:
        return str(named)
    prov = run.get("provenance") or {}
    return device_name(prov["device"], prov.get("gpu"), prov.get("cpu")) if prov.get("device") else None


def _pairs(run: dict[str, Any]) -> int:
    return len((run.get("cost") or {}).get("speed_pairs") or [])


@dataclass(frozen=True)
class DeviceSplit:
    """A point's runs split by the device of their speed pairs.

    Attributes:
        judged: the device whose pairs C2 reads (None: unnamed).
        kept: the runs timed on it.
        left_out: the runs timed on another device.
        pairs: speed pairs per device, every device of the runs.
    """

    judged: str | None
    kept: list[dict[str, Any]]
    left_out: list[dict[str, Any]] = field(default_factory=list)
    pairs: dict[str | None, int] = field(default_factory=dict)

    @property
    def mixed(self) -> bool:
        """The runs were timed on more than one device."""
        return len(self.pairs) > 1

    def left_out_summary(self) -> list[dict[str, Any]]:
        """Per run left out: its ``domain``, ``run_id``, ``device`` and number of speed ``pairs``."""
        return [{"domain": r.get("domain"), "run_id": r.get("run_id"), "device": run_device(r), "pairs": _pairs(r)}
                for r in self.left_out]


def split_by_device(runs: Sequence[dict[str, Any]]) -> DeviceSplit:
    """``runs`` split by :func:`run_device`: the device with the most speed pairs is judged (ties: the first name in
    sorted order, an unnamed device first), its runs kept, the others left out."""
    pairs: dict[str | None, int] = {}
    for r in runs:
        device = run_device(r)
        pairs[device] = pairs.get(device, 0) + _pairs(r)
    if not pairs:
        return DeviceSplit(None, [])
    judged = min(pairs, key=lambda d: (-pairs[d], d or ""))
    kept = [r for r in runs if run_device(r) == judged]
    return DeviceSplit(judged, kept, [r for r in runs if run_device(r) != judged], pairs)
