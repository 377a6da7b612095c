"""The identity of a run's curve: which (model, method, readout, estimator, probe stride, calibration, domain) it
belongs to.

One value type, :class:`CurveId`, built from a point's config or read back from a run record, and the strings it
is named by; nothing else builds or parses them:

- ``family``: the method as reports group it, marked with its readout unless ``logit``, with its entropy
  estimator unless ``exact`` and with its probe stride unless 1 (``emad``, ``emad+tuned``, ``emad+tuned:topk``,
  ``emad+tuned:topk/2``: every 2nd probe layer of the profile): :func:`family_of` / :func:`split_family`.
- ``profile``: the profile a run reads (``<source>`` or ``<source>+<readout>``), the key of an oracle bound;
  :func:`split_profile` and :func:`profile_in_domain` read it back.
- a point's artifact folder (:func:`point_folder`: ``<point>--cal-<source>``), run id (:func:`run_id`) and label
  (:func:`point_label`: ``<point>@<source>``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

LOGIT = "logit"
FULL = "full"  # the method and family of the full-depth runs: every change is taken against them
EXACT = "exact"


def family_of(method: str, readout: str = LOGIT, estimator: str | None = None, probe_stride: int = 1) -> str:
    """``emad`` for the logit readout, the exact estimator and every probe, ``emad+tuned`` for another readout,
    ``emad+tuned:topk`` for another estimator, ``emad+tuned:topk/2`` for every 2nd probe: the name verdicts,
    curves and figures group by."""
    family = method if readout == LOGIT else f"{method}+{readout}"
    family = family if estimator in (None, EXACT) else f"{family}:{estimator}"
    return family if probe_stride == 1 else f"{family}/{probe_stride}"


def split_family(family: str) -> tuple[str, str, str | None, int]:
    """``("emad", "tuned", "topk", 1)`` for ``"emad+tuned:topk"``, ``("emad", "logit", None, 2)`` for
    ``"emad/2"`` (inverse of :func:`family_of`; None: the exact estimator or none)."""
    family, _, stride = family.partition("/")
    family, _, estimator = family.partition(":")
    method, _, readout = family.partition("+")
    return method, readout or LOGIT, estimator or None, int(stride or 1)


def point_folder(point: str, calibration: str | None) -> str:
    """A point's artifact folder name: ``<point>`` or ``<point>--cal-<source>`` (unique per decode call)."""
    return point if calibration is None else f"{point}--cal-{calibration}"


def run_id(model: str, point: str, domain: str, calibration: str | None) -> str:
    """``<model>--<point>[--cal-<source>]--<domain>``: unique per run, stable across reruns."""
    return f"{model}--{point_folder(point, calibration)}--{domain}"


def point_label(point: str, calibration: str | None) -> str:
    """An operating point as one string: ``<point>`` or ``<point>@<calibration source>``."""
    return f"{point}@{calibration}" if calibration else point


@dataclass(frozen=True, order=True)
class CurveId:
    """Which curve a run sits on. ``calibration`` is None for methods without a profile, ``domain`` None for a
    curve over every domain of the model, ``estimator`` None for the exact estimator or a method without one,
    ``probe_stride`` k when the point reads every k-th probe of its profile."""

    model: str
    method: str
    readout: str = LOGIT
    estimator: str | None = None
    probe_stride: int = 1
    calibration: str | None = None
    domain: str | None = None

    @classmethod
    def of_run(cls, run: dict[str, Any]) -> CurveId:
        """The curve of a run record (``emad-run`` file or :class:`~emad.evaluation.record.RunRecord` dict)."""
        method, readout, estimator, stride = split_family(run.get("family") or "?")
        return cls(run.get("model") or "?", method, run.get("readout") or readout, estimator, stride,
                   run.get("calibration") or None, run.get("domain") or None)

    @property
    def family(self) -> str:
        return family_of(self.method, self.readout, self.estimator, self.probe_stride)

    @property
    def profile(self) -> str | None:
        """``<source>`` (logit readout) or ``<source>+<readout>``: the profile the curve's points read; None
        without a calibration."""
        if self.calibration is None:
            return None
        return self.calibration if self.readout == LOGIT else f"{self.calibration}+{self.readout}"

    @property
    def in_domain(self) -> bool:
        """True when calibrated on the domain it is evaluated on, or without calibration (no profile)."""
        return self.calibration is None or self.domain is None or self.calibration == self.domain

    def on(self, domain: str | None) -> CurveId:
        """The same curve on another domain (None: over every domain)."""
        return replace(self, domain=domain)

    def calibrated_on(self, source: str | None) -> CurveId:
        """The same curve calibrated on another source (``calibrated_on(domain)``: its in-domain twin)."""
        return replace(self, calibration=source)


def split_profile(profile: str) -> tuple[str, str]:
    """``("stdlib-prose", "tuned")`` for the profile key ``"stdlib-prose+tuned"`` (inverse of
    :attr:`CurveId.profile`)."""
    source, _, readout = profile.partition("+")
    return source, readout or LOGIT


def profile_in_domain(profile: str | None, domain: str) -> bool:
    """True when a profile key (:attr:`CurveId.profile`) was calibrated on ``domain``, or there is none."""
    return not profile or split_profile(profile)[0] == domain
