"""Mergeable calibration statistics of readout entropy per (stratum, probe layer).

File format ``emad-stats`` version 1 (JSON): ``probe_layers`` (1-based, ascending, last = L), ``strata``
(bucket edges), ``hist_bins`` / ``hist_max`` (fixed bins over ``[0, hist_max]`` nats, ``hist_max = log V``), and
arrays: ``count[S][P]``, ``sum[S][P]``, ``sumsq[S][P]`` (of entropies, nats), ``hist[S][P][B]``, ``agree[P]``
(tokens whose argmax at the probe equals the final argmax), ``oracle[P]`` (tokens whose oracle depth — the
shallowest probe whose argmax equals the final argmax — is that probe), ``tokens``; plus ``model`` (fingerprint)
and ``corpus`` (manifest hash). Two stats over disjoint tokens merge by adding every array.

The arrays are float64 numpy arrays: the smooth stage reads them without torch; only :meth:`CalibrationStats.add`
(the calibrate stage, on a model's tensors) imports it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from emad.exits.strata import VARIANTS, Strata
from emad.io import atomic_write_text, read_json

if TYPE_CHECKING:
    import torch

FORMAT, VERSION = "emad-stats", 1
_ARRAYS = ("count", "sum", "sumsq", "hist", "agree", "oracle")


class StatsFormatError(ValueError):
    """A stats file is missing, truncated, of another format or version."""


@dataclass
class CalibrationStats:
    """Accumulators for one model and one calibration corpus.

    Attributes:
        probe_layers: probe layers, 1-based ascending, ending at L.
        strata: the stratification.
        vocab_size: V (sets the histogram range ``[0, log V]``).
        hist_bins: number of histogram bins.
        model: the model fingerprint (dict).
        corpus: the corpus manifest hash.
        readout: the readout the entropies were read through (``logit`` or ``tuned``).
    """

    probe_layers: list[int]
    strata: Strata
    vocab_size: int
    hist_bins: int = 100
    model: dict = field(default_factory=dict)
    corpus: str = ""
    readout: str = "logit"

    def __post_init__(self):
        s, p = len(self.strata), len(self.probe_layers)
        self.count = np.zeros((s, p))  # float64, as every array
        self.sum = np.zeros((s, p))
        self.sumsq = np.zeros((s, p))
        self.hist = np.zeros((s, p, self.hist_bins))
        self.agree = np.zeros(p)
        self.oracle = np.zeros(p)

    @property
    def hist_max(self) -> float:
        return math.log(self.vocab_size)

    @property
    def tokens(self) -> int:
        return int(self.count[:, -1].sum())

    # ----------------------------------------------------------------- accumulate
    def add(self, entropy: torch.Tensor, argmax: torch.Tensor, strata: torch.Tensor) -> None:
        """Add tokens.

        Args:
            entropy: ``[N, P]`` readout entropy of each token at each probe (nats).
            argmax: ``[N, P]`` readout argmax at each probe.
            strata: ``[N]`` stratum index of each token.
        """
        import torch

        entropy, argmax, strata = entropy.double().cpu(), argmax.cpu(), strata.cpu()
        n, p = entropy.shape
        s = len(self.strata)
        index = strata[:, None] * p + torch.arange(p)[None, :]  # [N, P] flat (stratum, probe) cell
        self.count += torch.bincount(index.flatten(), minlength=s * p).view(s, p).double().numpy()
        self.sum += torch.zeros(s * p, dtype=torch.float64).index_add_(
            0, index.flatten(), entropy.flatten()).view(s, p).numpy()
        self.sumsq += torch.zeros(s * p, dtype=torch.float64).index_add_(
            0, index.flatten(), entropy.flatten() ** 2).view(s, p).numpy()
        bins = (entropy / self.hist_max * self.hist_bins).long().clamp(0, self.hist_bins - 1)
        cell = index * self.hist_bins + bins
        self.hist += torch.bincount(cell.flatten(), minlength=s * p * self.hist_bins).view(s, p, -1).double().numpy()
        agree = argmax == argmax[:, -1:]  # [N, P]
        self.agree += agree.double().sum(0).numpy()
        first = agree.double().argmax(-1)  # shallowest agreeing probe (the last one always agrees)
        self.oracle += torch.bincount(first, minlength=p).double().numpy()

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """Add another accumulator over disjoint tokens (same probes, strata, bins) into this one."""
        if (other.probe_layers, other.strata, other.hist_bins, other.vocab_size) != (
                self.probe_layers, self.strata, self.hist_bins, self.vocab_size):
            raise ValueError("cannot merge stats with different probe layers, strata, bins or vocabulary")
        for name in _ARRAYS:
            getattr(self, name).__iadd__(getattr(other, name))
        return self

    def restrict(self, variant: str) -> CalibrationStats:
        """The same tokens with only the strata axes of ``variant`` kept (the dropped axes summed out).

        Smoothing the result is smoothing a calibration run made with those axes alone: every array is a sum over
        tokens, so folding strata together is exact.
        """
        strata = self.strata.keep(variant)
        pos, conf = VARIANTS[variant]
        n_pos, n_conf = self.strata.n_position, self.strata.n_confidence

        def fold(array: np.ndarray) -> np.ndarray:  # [S, ...] -> [S', ...]
            grid = array.reshape(n_pos, n_conf, *array.shape[1:])
            grid = grid if conf else grid.sum(1, keepdims=True)
            grid = grid if pos else grid.sum(0, keepdims=True)
            return grid.reshape(-1, *array.shape[1:]).copy()

        out = CalibrationStats(list(self.probe_layers), strata, self.vocab_size, self.hist_bins, self.model,
                               self.corpus, self.readout)
        for name in ("count", "sum", "sumsq", "hist"):
            setattr(out, name, fold(getattr(self, name)))
        out.agree, out.oracle = self.agree.copy(), self.oracle.copy()
        return out

    def grown(self, probe_layers: list[int], model: dict) -> CalibrationStats:
        """The statistics of a model grown from this one's by idle layers (:mod:`emad.engine.idle`), on the same
        tokens, at ``probe_layers`` (ending at the grown L): below this model's L its states are this model's, and
        from there on every state is the final one, bit for bit — so each probe below reads as this model's probe
        there, and each probe from this model's L on as its final layer (every token agrees with the final argmax;
        the tokens whose oracle depth is this model's L have it at the grown model's first probe from there).

        Raises:
            ValueError: a probe below this model's L that it has no statistics for.
        """
        n = self.probe_layers[-1]
        missing = [p for p in probe_layers if p < n and p not in self.probe_layers]
        if missing:
            raise ValueError(f"the base statistics have no probes {missing} (probes {self.probe_layers}): calibrate "
                             f"both with the same calibrate.probe_layers")
        cols = [self.probe_layers.index(min(p, n)) for p in probe_layers]
        out = CalibrationStats(list(probe_layers), self.strata, self.vocab_size, self.hist_bins, model, self.corpus,
                               self.readout)
        for name in ("count", "sum", "sumsq", "hist"):
            setattr(out, name, getattr(self, name)[:, cols])  # a copy (index lists copy)
        out.agree = self.agree[cols]
        first = next(i for i, p in enumerate(probe_layers) if p >= n)  # the grown model's first probe from L on
        out.oracle[:first] = self.oracle[cols[:first]]
        out.oracle[first] = self.oracle[-1]
        return out

    def arrays(self) -> list[np.ndarray]:
        """The accumulator arrays (for all-reduce)."""
        return [getattr(self, name) for name in _ARRAYS]

    # ----------------------------------------------------------------- read
    def mean(self) -> np.ndarray:
        """Mean entropy ``[S, P]`` (NaN where a cell is empty)."""
        with np.errstate(invalid="ignore"):
            return self.sum / self.count

    def quantile(self, q: float) -> np.ndarray:
        """The q-quantile of entropy ``[S, P]`` read off the histograms (linear within a bin)."""
        cdf = self.hist.cumsum(-1)  # [S, P, B]
        total = cdf[..., -1:]
        target = q * total
        idx = np.minimum((cdf < target).sum(-1, keepdims=True), self.hist_bins - 1)  # [S, P, 1] first bin >= target
        below = np.where(idx > 0, np.take_along_axis(cdf, np.maximum(idx - 1, 0), -1), 0.0)
        in_bin = np.take_along_axis(self.hist, idx, -1)
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(in_bin > 0, (target - below) / in_bin, 0.0)
        width = self.hist_max / self.hist_bins
        out = ((idx + frac) * width).squeeze(-1)
        return np.where(total.squeeze(-1) > 0, out, np.nan)

    def agreement(self) -> np.ndarray:
        """Per probe, the share of tokens whose argmax equals the final argmax ``[P]``."""
        return self.agree / max(self.tokens, 1)

    # ----------------------------------------------------------------- io
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "probe_layers": list(self.probe_layers),
            "strata": self.strata.as_dict(),
            "strata_names": self.strata.names(),
            "vocab_size": self.vocab_size,
            "hist_bins": self.hist_bins,
            "hist_max": self.hist_max,
            "tokens": self.tokens,
            "model": self.model,
            "corpus": self.corpus,
            "readout": self.readout,
            **{name: getattr(self, name).tolist() for name in _ARRAYS},
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "stats") -> CalibrationStats:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise StatsFormatError(
                f"{source}: not an {FORMAT} v{VERSION} file (format {data.get('format')!r}, "
                f"version {data.get('version')!r})")
        try:
            stats = cls(list(data["probe_layers"]), Strata(**data["strata"]), int(data["vocab_size"]),
                        int(data["hist_bins"]), data.get("model", {}), data.get("corpus", ""),
                        data.get("readout", "logit"))
            for name in _ARRAYS:
                value = np.asarray(data[name], dtype=np.float64)
                if value.shape != getattr(stats, name).shape:
                    raise StatsFormatError(f"{source}: array {name!r} has shape {tuple(value.shape)}")
                setattr(stats, name, value)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, StatsFormatError):
                raise
            raise StatsFormatError(f"{source}: malformed stats ({type(err).__name__}: {err})") from None
        return stats

    def save(self, path: str | Path) -> None:
        """Write atomically as JSON."""
        atomic_write_text(path, json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> CalibrationStats:
        return cls.from_dict(read_json(path, "stats file", StatsFormatError), str(path))
