"""The record of one decode run: what it holds, its run file, and the MLflow params, metrics and tags it gives.

:class:`RunRecord` is the one definition of a run (model × operating point × calibration source × domain). The
decode stage fills it, :mod:`emad.evaluation.runfile` writes it (``emad-run`` v1: its fields are the file's keys,
in this order), the aggregate stage reads it back, and :mod:`emad.tracking` logs what it gives. Quality names come
from :data:`emad.evaluation.metrics.METRICS`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from emad.evaluation import runfile
from emad.evaluation.identity import CurveId
from emad.evaluation.metrics import intervals_of, mlflow_name, quality_of
from emad.tracking import metric_name, run_name

# cost keys logged under their own name; every other number of ``cost`` is logged as ``cost.<key>``
HEADLINE_COST = ("flops_ratio", "bytes_ratio", "step_ratio", "mean_depth", "speedup", "tokens_per_s")
# fields every decode run logs as MLflow params (beside its options, knob and value)
UNIFORM_PARAMS = ("family", "readout", "curve", "calibration", "domain", "model", "point", "kind")


class RunRecord(BaseModel):
    """One decode run. Fields older run files lack default to None or empty."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    run_id: str  # <model>--<point>[--cal-<source>]--<domain> (emad.evaluation.identity.run_id)
    model: str
    point: str  # its name in params.yaml decode
    kind: str | None = None  # baseline, point, ablation, related
    family: str  # the criterion or strategy: full, fixed, confidence, emad, ead ...
    readout: str | None = None  # logit, tuned
    curve: str | None = None  # the sweep it is on (or the point itself)
    knob: str | None = None  # the option the sweep varies
    value: float | None = None  # the knob's value
    screened: bool = False  # the value was kept from a screened range (emad.evaluation.screen)
    options: dict[str, Any] = {}  # the point's given options
    calibration: str | None = None  # the profile's calibration source (None: no profile)
    domain: str
    model_fingerprint: str | None = None
    n_layers: int | None = None
    free_prompts: int | None = None  # free-running tasks' prompts (a swept point's; None: all; 0: none run)
    not_run: dict[str, str] = {}  # each task of the domain not run, and why (a point the screen rules out)
    method: dict[str, Any] | None = None  # the built method's description
    profile_fingerprint: str | None = None  # sha256[:16] of the profile file
    factors: dict[str, Any] = {}  # what ablation tables vary (points with a profile)
    oracle: dict[str, float] | None = None  # share of calibration tokens per oracle depth
    tasks: dict[str, dict[str, Any]] = {}  # each task's result, with its per-unit "samples"
    quality: dict[str, float] = {}  # one number per quality metric (METRICS)
    intervals: dict[str, dict[str, Any]] = {}  # per quality metric: lo, hi, n, method
    cost: dict[str, Any] = {}  # flops_ratio, bytes_ratio, mean_depth, speedup ... (None: not measured)
    depth_histogram: dict[str, int] = {}  # tokens per exit depth
    identity: dict[str, Any] = {}  # whether its output is full depth's by construction (emad.evaluation.proof)
    split: dict[str, Any] = {}  # the units' selection / confirmation split (emad.evaluation.units)
    provenance: dict[str, Any] = {}  # where and how it was computed (emad.evaluation.provenance)
    mlflow_run_id: str | None = None

    def with_results(self, tasks: dict[str, dict], cost: dict[str, Any], depth_histogram: dict[int, int],
                     mlflow_run_id: str | None) -> RunRecord:
        """This record with its task results, their quality and 95% intervals, cost and exit depths."""
        return self.model_copy(update={
            "tasks": tasks, "quality": quality_of(tasks), "intervals": intervals_of(tasks), "cost": cost,
            "depth_histogram": {str(d): n for d, n in depth_histogram.items()}, "mlflow_run_id": mlflow_run_id})

    @property
    def curve_id(self) -> CurveId:
        """The curve this run sits on."""
        return CurveId.of_run(self.model_dump())

    # --- the run file ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, in file order (a record read from an older file keeps only its keys)."""
        return self.model_dump(exclude_unset=True)

    def save(self, path: str | Path) -> None:
        """Write the ``emad-run`` v1 file."""
        runfile.save(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "run record") -> RunRecord:
        """A record from a run file's dict (``format`` and ``version`` ignored); bad fields raise
        :class:`~emad.evaluation.runfile.RunFileError` naming ``where``."""
        fields = {k: v for k, v in data.items() if k not in ("format", "version")}
        try:
            return cls.model_validate(fields)
        except ValidationError as err:
            raise runfile.RunFileError(f"{where}: not a valid run record: {err}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> RunRecord:
        """The record of an ``emad-run`` v1 file."""
        return cls.from_dict(runfile.load(path), str(path))

    # --- MLflow ---------------------------------------------------------------------------------------------

    def mlflow_params(self) -> dict[str, str | float | int]:
        """Uniform MLflow params: the point's given ``options`` (nested values as JSON), then ``family``,
        ``readout``, ``curve``, ``calibration``, ``domain``, ``model``, ``point``, ``kind``, ``knob`` and ``value``
        (these win over an option of the same name). Only what is set: ``knob`` is ``"none"`` off a sweep (and
        ``value`` left out), ``calibration`` ``"none"`` without a profile, ``curve`` the point itself without one.
        """
        out: dict[str, str | float | int] = {}
        for key, value in self.options.items():
            if _set(value):
                out[metric_name(str(key))] = _param_value(value)
        for key in UNIFORM_PARAMS:
            value = getattr(self, key)
            if key == "curve" and not _set(value):
                value = self.point  # a lone point is a curve of one
            if _set(value):
                out[key] = _param_value(value)
        out["knob"] = str(self.knob) if _set(self.knob) else "none"
        out.setdefault("calibration", "none")
        if _set(self.knob) and self.value is not None:
            out["value"] = float(self.value)
        else:
            out.pop("value", None)
        return out

    def mlflow_metrics(self) -> dict[str, float]:
        """Uniform MLflow metrics: :data:`HEADLINE_COST` under their names, the other numbers of ``cost`` as
        ``cost.<key>``, every quality metric as ``quality.<task>.<key>`` with its interval ``.lo`` / ``.hi`` and
        size ``.n``. Only numbers (no None, undefined bounds left out); names MLflow-safe."""
        out: dict[str, float] = {}
        for key, value in self.cost.items():
            if _number(value) is not None:
                out[key if key in HEADLINE_COST else metric_name(f"cost.{key}")] = _number(value)
        for metric, value in self.quality.items():
            if _number(value) is not None:
                out[metric_name(mlflow_name(metric))] = _number(value)
        for metric, interval in self.intervals.items():
            for part in ("lo", "hi", "n"):
                if _number((interval or {}).get(part)) is not None:
                    out[f"{metric_name(mlflow_name(metric))}.{part}"] = _number(interval[part])
        return out

    def mlflow_tags(self) -> dict[str, str]:
        """Tags that find the run: ``model_fingerprint``, ``run_id``, ``family``, ``profile_fingerprint`` (empty
        without a profile), ``readout``, and where it was computed as ``provenance.<key>``."""
        return {"model_fingerprint": self.model_fingerprint, "run_id": self.run_id, "family": self.family,
                "profile_fingerprint": self.profile_fingerprint or "", "readout": self.readout,
                **{f"provenance.{k}": "" if v is None else str(v) for k, v in self.provenance.items()}}

    def mlflow_run_name(self) -> str:
        """``decode <model> <point> <domain>``, then ``cal <source>`` when calibrated."""
        return run_name("decode", self.model, self.point, self.domain,
                        *(("cal", self.calibration) if _set(self.calibration) else ()))


def load_records(folder: str | Path) -> list[RunRecord]:
    """Every run file under ``folder`` (recursively) as a record, sorted by run id; an error if there is none."""
    return sorted((RunRecord.from_file(p) for p in runfile.run_files(folder)), key=lambda r: r.run_id)


def profile_facts(path: Path | None, method) -> dict[str, Any]:
    """``profile_fingerprint``, ``factors`` and ``oracle`` of the profile file behind a method (None, {} and None
    without one)."""
    if path is None:
        return {"profile_fingerprint": None, "factors": {}, "oracle": None}
    profile = method.criterion.profile
    factors = {"margin": method.criterion.margin, "policy": method.policy, "estimator": method.estimator.name,
               "probe_stride": method.criterion.probe_stride, "strata": profile.strata.variant}
    return {"profile_fingerprint": hashlib.sha256(path.read_bytes()).hexdigest()[:16], "factors": factors,
            "oracle": {str(layer): share for layer, share in zip(profile.probe_layers, profile.oracle)}}


def _set(value: Any) -> bool:
    return value is not None and value != "" and value != [] and value != {}


def _param_value(value: Any) -> str | float | int:
    """Numbers and strings as they are, booleans as ``true`` / ``false``, anything else as compact JSON."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float, str)):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
