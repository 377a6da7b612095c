"""The target entropy profile τ[stratum][probe]: smoothing calibration statistics, JSON io, fingerprint checks.

File format ``emad-profile`` version 1 (JSON): ``probe_layers``, ``strata`` (edges) and ``strata_names``,
``tau`` / ``raw`` / ``count`` as ``{stratum name: [value per probe]}``, ``backed_off`` (``{stratum: source}``
for strata too thin to stand alone), ``smoothing`` (statistic, isotonic, min_count), ``monotonicity`` (how far
the raw values were from non-increasing), ``agreement`` and ``oracle`` (per probe), ``model`` (fingerprint) and
``corpus`` (manifest hash).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from emad.calibration.stats import CalibrationStats
from emad.exits.strata import Strata
from emad.io import atomic_write_json, read_json

if TYPE_CHECKING:
    import torch

FORMAT, VERSION = "emad-profile", 1


def variant_path(profile_path: str | Path, variant: str) -> Path:
    """Where the smooth stage writes the ``variant`` stratification of a profile: ``strata/<variant>.json`` beside it."""
    return Path(profile_path).parent / "strata" / f"{variant}.json"


class ProfileError(ValueError):
    """A profile file is unusable: missing, truncated, another format, or made for another model."""


def non_increasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted isotonic regression onto non-increasing sequences (scipy's pool-adjacent-violators; where scipy is
    not installed, as on a bare GPU image, :func:`pool_adjacent_violators`: the same fit up to rounding)."""
    weights = np.maximum(weights, 1e-12)
    # imported on use: scipy.optimize takes 2 s to import, and every stage that reads a profile imports this module
    try:
        from scipy.optimize import isotonic_regression
    except ImportError:
        return pool_adjacent_violators(values, weights)
    return isotonic_regression(values, weights=weights, increasing=False).x


def pool_adjacent_violators(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-increasing fit of ``values`` ``[n]`` (weights > 0): neighbours that rise are
    pooled into their weighted mean until none does."""
    blocks: list[list[float]] = []  # [weighted mean, weight, length] of each pooled block, left to right
    for value, weight in zip(np.asarray(values, dtype=float), np.asarray(weights, dtype=float)):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:  # a rise: pool the two
            (v1, w1, n1), (v2, w2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(n, v) for v, _, n in blocks]) if blocks else np.zeros(0)


def violation(values: np.ndarray) -> dict:
    """How far a sequence is from non-increasing: the largest and the summed rises between neighbours."""
    rises = np.clip(np.diff(values), 0, None)
    return {"max": float(rises.max(initial=0.0)), "total": float(rises.sum())}


@dataclass
class Profile:
    """τ per stratum and probe layer, with provenance."""

    probe_layers: list[int]
    strata: Strata
    tau: dict[str, list[float]]
    raw: dict[str, list[float]] = field(default_factory=dict)
    count: dict[str, list[float]] = field(default_factory=dict)
    backed_off: dict[str, str] = field(default_factory=dict)
    smoothing: dict = field(default_factory=dict)
    monotonicity: dict = field(default_factory=dict)
    agreement: list[float] = field(default_factory=list)
    oracle: list[float] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    corpus: str = ""
    readout: str = "logit"

    # ----------------------------------------------------------------- lookup
    def table(self, device=None) -> torch.Tensor:
        """τ as a tensor ``[S, P]`` in stratum-index order."""
        import torch  # a decode's table; the smooth stage reads and writes profiles without torch

        return torch.tensor([self.tau[name] for name in self.strata.names()], dtype=torch.float32, device=device)

    def check_model(self, fingerprint: dict) -> None:
        """Refuse a model other than the one this profile was calibrated on, showing both fingerprints."""
        keys = ("model_type", "n_layers", "hidden_size", "vocab_size", "tokenizer_sha256")
        mine = {k: self.model.get(k) for k in keys}
        theirs = {k: fingerprint.get(k) for k in keys}
        if mine != theirs:
            raise ProfileError(f"profile was calibrated on model {mine} but is used with model {theirs}")

    # ----------------------------------------------------------------- io
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "probe_layers": self.probe_layers,
                "strata": self.strata.as_dict(), "strata_names": self.strata.names(), "tau": self.tau,
                "raw": self.raw, "count": self.count, "backed_off": self.backed_off, "smoothing": self.smoothing,
                "monotonicity": self.monotonicity, "agreement": self.agreement, "oracle": self.oracle,
                "model": self.model, "corpus": self.corpus, "readout": self.readout}

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = read_json(path, "profile", ProfileError)
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ProfileError(f"{path} is not an {FORMAT} v{VERSION} file")
        try:
            fields = {k: data[k] for k in ("probe_layers", "tau")}
            extra = {k: data[k] for k in ("raw", "count", "backed_off", "smoothing", "monotonicity", "agreement",
                                          "oracle", "model", "corpus", "readout") if k in data}
            profile = cls(strata=Strata(**data["strata"]), **fields, **extra)
        except (KeyError, TypeError, ValueError) as err:
            raise ProfileError(f"profile {path} is malformed ({type(err).__name__}: {err})") from None
        if set(profile.tau) != set(profile.strata.names()):
            raise ProfileError(f"profile {path}: tau strata {sorted(profile.tau)} do not match its strata spec")
        return profile


def smooth(stats: CalibrationStats, statistic: str = "mean", min_count: int = 50, isotonic: bool = True) -> Profile:
    """Statistics → target profile.

    τ[s][ℓ] = the mean entropy (``statistic="mean"``) or a quantile (``"q0.25"`` …) of stratum s at probe ℓ,
    made non-increasing in ℓ by weighted isotonic regression (weights = counts). A stratum with fewer than
    ``min_count`` tokens takes its parent's profile: the position-only marginal for (position, confidence) strata
    when that has enough tokens, else the global profile.

    Args:
        stats: calibration statistics.
        statistic: ``"mean"`` or ``"q<fraction>"``.
        min_count: tokens a stratum needs to stand alone (>= 1).
        isotonic: False keeps the raw values (an ablation).
    """
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    value_of = _statistic(statistic)
    strata, names = stats.strata, stats.strata.names()
    counts = stats.count  # [S, P]
    raw = value_of(stats)
    global_stats = _marginal(stats, [list(range(len(strata)))])
    global_raw, global_count = value_of(global_stats)[0], global_stats.count[0]
    position_groups = [list(range(i * strata.n_confidence, (i + 1) * strata.n_confidence))
                       for i in range(strata.n_position)]
    position_stats = _marginal(stats, position_groups)
    parents = strata.parents()

    tau, raw_out, count_out, backed, mono = {}, {}, {}, {}, {}
    for s, name in enumerate(names):
        values, weights, source = raw[s], counts[s], name
        if counts[s, -1] < min_count:
            parent = parents[s]
            if parent is not None and position_stats.count[parent, -1] >= min_count:
                values, weights = value_of(position_stats)[parent], position_stats.count[parent]
                source = f"position marginal {strata.names()[s].split('|')[0]}"
            else:
                values, weights, source = global_raw, global_count, "global"
            backed[name] = source
        if np.isnan(values).any():
            raise ValueError(f"stratum {name!r}: no tokens at all, even after backing off (calibrate on more text)")
        smoothed = non_increasing(values, weights) if isotonic else values
        tau[name] = [float(x) for x in smoothed]
        raw_out[name] = [float(x) for x in raw[s]]
        count_out[name] = [float(x) for x in counts[s]]
        mono[name] = {**violation(values), "max_abs_change": float(np.abs(smoothed - values).max())}
    return Profile(
        probe_layers=list(stats.probe_layers), strata=strata, tau=tau, raw=raw_out, count=count_out,
        backed_off=backed, smoothing={"statistic": statistic, "isotonic": isotonic, "min_count": min_count},
        monotonicity=mono, agreement=stats.agreement().tolist(),
        oracle=(stats.oracle / max(stats.tokens, 1)).tolist(), model=stats.model, corpus=stats.corpus,
        readout=stats.readout,
    )


def smooth_variants(stats: CalibrationStats, statistic: str = "mean", min_count: int = 50,
                    isotonic: bool = True) -> dict[str, Profile]:
    """One profile per stratification reachable from the calibrated one by dropping axes (see :func:`variant_path`).

    Each is smoothed from folded statistics, which equal those of a calibration run with fewer axes.
    """
    return {v: smooth(stats.restrict(v), statistic, min_count, isotonic) for v in stats.strata.variants()}


def _statistic(statistic: str):
    if statistic == "mean":
        return lambda st: st.mean()
    if statistic.startswith("q"):
        try:
            q = float(statistic[1:])
        except ValueError:
            q = -1.0
        if 0 < q < 1:
            return lambda st: st.quantile(q)
    raise ValueError(f"statistic must be 'mean' or 'q<fraction in (0,1)>' such as 'q0.25', got {statistic!r}")


def _marginal(stats: CalibrationStats, groups: list[list[int]]) -> CalibrationStats:
    """Stats with strata summed within each group (only count/sum/sumsq/hist are meaningful)."""
    out = CalibrationStats(stats.probe_layers, Strata(), stats.vocab_size, stats.hist_bins)
    for name in ("count", "sum", "sumsq", "hist"):
        arr = getattr(stats, name)
        setattr(out, name, np.stack([arr[g].sum(0) for g in groups]))
    return out
