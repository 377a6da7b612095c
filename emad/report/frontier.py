"""Frontier data: every run as a row of quality against cost, the Pareto frontiers, speed-ups and oracle bounds.

Every function reads run records in the ``emad-run`` format (see :mod:`emad.evaluation.runfile`). The baseline of a run is
the ``full`` run of the same model and domain. The speed-up of a run is its own ``cost.speedup`` when the decode stage
measured one (against full-depth generations of the same prompts in the same process: :mod:`emad.evaluation.speed`), else
``tokens_per_s / tokens_per_s(full)`` against the full run's file. Rows of a sweep carry its ``curve`` (the base point
name; equal to ``point`` when unswept), ``knob`` and ``value`` (None when unswept), beside ``readout`` and ``domain``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from emad.evaluation import identity
from emad.evaluation.checks import full_on_units
from emad.evaluation.identity import FULL, CurveId
from emad.evaluation.metrics import higher_is_better

ORACLE = "oracle"  # the family of the oracle bounds



def point_label(run: dict[str, Any]) -> str:
    """The operating point of a run as one string: ``<point>`` or ``<point>@<calibration source>``."""
    return identity.point_label(str(run["point"]), run.get("calibration"))


def finite(x: Any) -> bool:
    """A real number that is neither inf nor nan (bools are not numbers here)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def baselines(runs: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The full-depth run per (model, domain).

    Raises:
        ValueError: two full runs for the same model and domain (the baseline would be ambiguous).
    """
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        if run.get("family") != FULL:
            continue
        key = (run["model"], run["domain"])
        if key in out:
            raise ValueError(f"two full-depth runs for model {key[0]!r} on domain {key[1]!r}: "
                             f"{out[key]['run_id']} and {run['run_id']} (keep one full point per model)")
        out[key] = run
    return out


def speedup(run: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """The speed-up of ``run`` against full depth.

    The run's own ``cost.speedup`` when present and finite (measured against a full-depth reference in the same
    process, so machine load cancels); else ``tokens_per_s`` of ``run`` over that of its full-depth ``base``;
    None when neither is available (no own speed-up, and ``base`` or a tokens/s missing or zero).
    """
    own = run.get("cost", {}).get("speedup")
    if finite(own) and own > 0:
        return float(own)
    if base is None:
        return None
    tps, ref = run.get("cost", {}).get("tokens_per_s"), base.get("cost", {}).get("tokens_per_s")
    if not (finite(tps) and finite(ref)) or ref <= 0:
        return None
    return tps / ref


def _dominates(a: dict, b: dict, cost_key: str, quality_key: str, higher_better: bool,
               cost_lower_better: bool) -> bool:
    ca, cb = (a[cost_key], b[cost_key]) if cost_lower_better else (-a[cost_key], -b[cost_key])
    qa, qb = (a[quality_key], b[quality_key]) if higher_better else (-a[quality_key], -b[quality_key])
    return ca <= cb and qa >= qb and (ca < cb or qa > qb)


def frontier(points: Sequence[dict[str, Any]], cost_key: str, quality_key: str, higher_better: bool,
             cost_lower_better: bool = True) -> list[dict[str, Any]]:
    """The Pareto-optimal subset of ``points``: no other point is at least as cheap and at least as good.

    Args:
        points: dicts holding ``cost_key`` and ``quality_key``; points where either is missing or not finite are
            left out.
        cost_key: the cost axis (minimised; maximised when ``cost_lower_better`` is False, e.g. a speed-up).
        quality_key: the quality axis.
        higher_better: the direction of the quality axis.
        cost_lower_better: the direction of the cost axis.

    Returns:
        The frontier points (the same dict objects), sorted by ascending ``cost_key``, then best quality first,
        then input order. Ties: points with identical cost and quality do not dominate each other, so all of
        them stay on the frontier.
    """
    valid = [(i, p) for i, p in enumerate(points) if finite(p.get(cost_key)) and finite(p.get(quality_key))]
    keep = [(i, p) for i, p in valid
            if not any(_dominates(q, p, cost_key, quality_key, higher_better, cost_lower_better)
                       for _, q in valid)]
    sign = -1.0 if higher_better else 1.0
    keep.sort(key=lambda ip: (ip[1][cost_key], sign * ip[1][quality_key], ip[0]))
    return [p for _, p in keep]


def oracle_flops_ratio(oracle: dict[str, float] | None, n_layers: int) -> float | None:
    """FLOPs ratio an oracle reaches that exits every token at its oracle depth: ≈ Σ_ℓ share_ℓ · ℓ / L.

    The approximation counts decoder layers only: every layer costs the same, and the probes, the output head
    and KV-cache consistency are free. So it is a lower bound on what any exit criterion on these probes can
    reach at full-depth quality. Shares are normalised by their sum.

    Args:
        oracle: share of calibration tokens per oracle depth, keyed by layer number as a string.
        n_layers: L, the model's number of decoder layers.
    """
    if not oracle or not n_layers:
        return None
    total = sum(oracle.values())
    if total <= 0:
        return None
    return sum(float(share) * int(layer) for layer, share in oracle.items()) / (total * n_layers)


def oracle_bounds(runs: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Oracle FLOPs ratio per model and profile (:attr:`~emad.evaluation.identity.CurveId.profile`: the
    calibration source, ``source+tuned`` when read through the tuned readout), from the runs that carry a
    profile's oracle."""
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        ratio = oracle_flops_ratio(run.get("oracle"), run.get("n_layers") or 0)
        profile = CurveId.of_run(run).profile
        if ratio is not None and profile:
            out.setdefault(run["model"], {})[profile] = ratio
    return {m: dict(sorted(v.items())) for m, v in sorted(out.items())}


@dataclass
class ParetoSeries:
    """One model × domain × quality metric: every run as a row, with frontier flags and the oracle bound.

    Attributes:
        rows: one dict per run (``run_id, point, curve, knob, value, family, readout, calibration, domain,
            flops_ratio, bytes_ratio, speedup, tokens_per_s, quality, full_quality (full depth's on the units the
            run scored: what its quality is compared with), on_frontier_flops, on_frontier_speed, mlflow_run_id``; ``curve`` etc. None when the run file lacks them), sorted by
            descending ``flops_ratio`` then run id — the data file of a ``dvc plots`` definition.
        full_quality: the metric of the full-depth run (None when there is none).
        oracle: ``{profile: oracle FLOPs ratio}`` for the model (see :func:`oracle_flops_ratio`).
        screen: the screened values of the model's sweeps on this domain (``family, curve, calibration, value,
            flops_ratio, quality, kept``; teacher forced: :mod:`emad.evaluation.screen`), drawn faintly.
    """

    model: str
    domain: str
    metric: str
    higher_better: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    full_quality: float | None = None
    oracle: dict[str, float] = field(default_factory=dict)
    screen: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``<model>--<domain>--<metric>``: a stable file stem."""
        return f"{self.model}--{self.domain}--{self.metric}"

    def run_ids(self) -> list[str]:
        return [r["run_id"] for r in self.rows]

    def mlflow_run_ids(self) -> list[str]:
        return [r["mlflow_run_id"] for r in self.rows if r.get("mlflow_run_id")]

    def plot_rows(self) -> list[dict[str, Any]]:
        """``rows`` plus one row per oracle bound (family ``oracle``, at the full-depth quality)."""
        extra = [{"run_id": None, "point": f"oracle@{cal}", "curve": None, "knob": None, "value": None,
                  "family": ORACLE, "readout": None, "calibration": cal, "domain": self.domain, "flops_ratio": ratio,
                  "bytes_ratio": None, "speedup": None, "tokens_per_s": None,
                  "quality": self.full_quality, "full_quality": self.full_quality, "on_frontier_flops": False, "on_frontier_speed": False,
                  "mlflow_run_id": None} for cal, ratio in self.oracle.items()]
        return self.rows + extra

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}


def _row(run: dict[str, Any], metric: str, base: dict[str, Any] | None) -> dict[str, Any]:
    cost = run.get("cost", {})
    return {"run_id": run["run_id"], "point": point_label(run), "curve": run.get("curve"), "knob": run.get("knob"),
            "value": run.get("value"), "family": run.get("family"), "readout": run.get("readout"),
            "calibration": run.get("calibration"), "domain": run.get("domain"), "flops_ratio": cost.get("flops_ratio"),
            "bytes_ratio": cost.get("bytes_ratio"), "speedup": speedup(run, base),
            "tokens_per_s": cost.get("tokens_per_s"), "quality": run["quality"][metric],
            "full_quality": full_on_units(metric, run, base) if base else None,
            "on_frontier_flops": False, "on_frontier_speed": False, "mlflow_run_id": run.get("mlflow_run_id")}


def _series(model: str, domain: str, metric: str, runs: list[dict], base: dict | None,
            oracle: dict[str, float]) -> ParetoSeries:
    hb = higher_is_better(metric)
    rows = [_row(r, metric, base) for r in runs if metric in r.get("quality", {})]
    rows.sort(key=lambda r: (-(r["flops_ratio"] if finite(r["flops_ratio"]) else math.inf), r["run_id"]))
    for r in frontier(rows, "flops_ratio", "quality", hb):
        r["on_frontier_flops"] = True
    for r in frontier(rows, "speedup", "quality", hb, cost_lower_better=False):
        r["on_frontier_speed"] = True
    full_q = base["quality"].get(metric) if base else None
    return ParetoSeries(model, domain, metric, hb, rows, full_q, oracle)


def screen_rows(screens: Sequence[dict[str, Any]], model: str, domain: str, metric: str) -> list[dict[str, Any]]:
    """The rows of the screen records (``emad-screen`` files) of ``model`` on ``domain`` that carry ``metric``."""
    return [{"family": r["family"], "curve": r["curve"], "calibration": r["calibration"], "value": r["value"],
             "flops_ratio": r["flops_ratio"], "quality": r["quality"][metric], "kept": r["kept"]}
            for s in screens if s["model"] == model for r in s["rows"]
            if r["domain"] == domain and metric in r["quality"]]


def pareto_data(runs: Sequence[dict[str, Any]], screens: Sequence[dict[str, Any]] = ()) -> list[ParetoSeries]:
    """One :class:`ParetoSeries` per (model, domain, quality metric) present in ``runs``, sorted by name, with the
    rows of the decode stages' ``screens`` (:func:`screen_rows`).

    Speed-ups are the runs' own ``cost.speedup`` where measured, else need the full-depth run of the model ×
    domain; without either they are None (and such a point is not on the speed frontier), while the FLOPs
    frontier is still drawn.

    Raises:
        ValueError: empty ``runs``, or two full runs for one model × domain.
    """
    if not runs:
        raise ValueError("no run records to aggregate (run the decode stage first)")
    base = baselines(runs)
    oracles = oracle_bounds(runs)
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["model"], run["domain"]), []).append(run)
    out = []
    for (model, domain), group in sorted(groups.items()):
        metrics = sorted({m for r in group for m in r.get("quality", {})})
        out += [_series(model, domain, m, group, base.get((model, domain)), oracles.get(model, {}))
                for m in metrics]
        for series in out[len(out) - len(metrics):]:
            series.screen = screen_rows(screens, model, domain, series.metric)
    return out
