"""Entropy estimators: how Ĥ is computed at a probe, and what one probe costs.

``exact`` reads out the full head; cheaper estimators register beside it. An estimator that already produced the
full readout hands its logits back, so the exit readout is not paid twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from emad.engine.cost import CostModel
from emad.engine.entropy import readout_summary
from emad.engine.fused import fused, summary
from emad.registry import Registry


@dataclass
class Estimate:
    """Ĥ at one probe for ``a`` rows.

    Attributes:
        entropy: ``[a]`` estimated entropy (nats).
        max_prob: ``[a]`` estimated max probability (confidence strata).
        logits: ``[a, V]`` the readout when the estimator computed it (``-inf`` outside a pruned vocabulary),
            else None.
        cost: per-row ``(FLOPs [a], bytes [a])`` of this probe when it varies by row and layer; None means
            :meth:`Estimator.probe_cost` for every row.
        read_out: the probe's full readout was computed (an exit there costs no further readout) though
            ``logits`` does not hold it (a sweep keeps it apart, :mod:`emad.decode.sweep`).
    """

    entropy: torch.Tensor
    max_prob: torch.Tensor
    logits: torch.Tensor | None = None
    cost: tuple[torch.Tensor, torch.Tensor] | None = None
    read_out: bool = False


class Estimator:
    """Base class of entropy estimators.

    Attributes:
        gives_logits: True when every estimate carries the readout logits (criteria that read them need it).
        needs_fit: True when the estimator is loaded from a fitted estimators file; else it is built from the
            operating point's options (its constructor arguments).
        stateful: True when a token's estimate depends on its earlier probes (then :meth:`begin` resets it).
        fusable: True when :meth:`estimate` is a pure function of the states (no host reads, no state), so a
            compiled engine may run it compiled over every row of a batch (:mod:`emad.engine.compiled`).
        whole_vocabulary: False when the logits an estimate carries read only part of the head (the exit token
            may then differ from the readout's own).
    """

    name: ClassVar[str]
    gives_logits: ClassVar[bool] = False
    needs_fit: ClassVar[bool] = True
    stateful: ClassVar[bool] = False
    fusable: ClassVar[bool] = False
    whole_vocabulary: ClassVar[bool] = True

    @classmethod
    def from_sample(cls, stack, sample: dict, **options) -> Estimator:
        """Build for fitting, given a calibration sample (see :func:`emad.calibration.estimator_fit.collect`)."""
        return cls(**options)

    def begin(self, batch_size: int) -> None:
        """A new token for each of ``batch_size`` rows is about to be probed (forget the previous token's state)."""

    def estimate(self, stack, h: torch.Tensor, layer: int, rows: torch.Tensor | None = None) -> Estimate:
        """Ĥ for hidden states ``h`` ``[a, d]`` at probe ``layer``; ``rows`` ``[a]`` says which of the
        :meth:`begin` rows they are (None: rows 0..a-1)."""
        raise NotImplementedError

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        """(FLOPs, bytes) of one probe for one token."""
        raise NotImplementedError

    def from_input(self, stack, x: torch.Tensor, correction=None) -> Estimate:
        """Ĥ from the head's input ``x`` ``[a, d]`` (``stack.readout_input(h, layer)``, made once per probe by the
        caller), with ``correction`` ``(slope, intercept)`` (None: none): a fusable estimator's estimate, the same
        numbers as :meth:`estimate` of the states, without the NaN/inf check of a readout (the caller reads it
        from the entropy, which is NaN wherever the logits it came from hold NaN or +inf)."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"estimator": self.name}


ESTIMATORS: Registry[Estimator] = Registry("entropy estimator")


@ESTIMATORS.register("exact")
class Exact(Estimator):
    """Full readout (final norm + head) and its exact entropy: a probe costs one readout."""

    gives_logits = True
    needs_fit = False
    fusable = True

    def estimate(self, stack, h: torch.Tensor, layer: int, rows: torch.Tensor | None = None) -> Estimate:
        logits = stack.readout(h, layer)  # [a, V]
        entropy, _, max_prob = readout_summary(logits)
        return Estimate(entropy, max_prob, logits)

    def from_input(self, stack, x: torch.Tensor, correction=None) -> Estimate:
        logits = stack.head_logits(x)  # [a, V]
        entropy, _, max_prob = readout_summary(logits)
        return Estimate(entropy, max_prob, logits)

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        return float(cost.readout_flops), float(cost.readout_bytes)


class _Corrected(Estimator):
    """An approximate estimator with a per-layer linear correction ``Ĥ = slope_ℓ · raw + intercept_ℓ``.

    The correction is fitted on calibration tokens (:func:`emad.calibration.estimator_fit.fit`); without one, the raw
    estimate is used. ``exact_by_construction`` estimators (K = V, r = d) keep the raw value.
    """

    exact_by_construction = False
    fusable = True

    def __init__(self, correction: dict | None = None):
        self.correction = {int(k): tuple(v) for k, v in (correction or {}).items()}

    def corrected(self, raw: torch.Tensor, layer: int) -> torch.Tensor:
        return self.apply(raw, self.correction_at(layer))

    def correction_at(self, layer: int) -> tuple[float, float] | None:
        """``(slope, intercept)`` at ``layer``, or None where the raw estimate stands."""
        if self.exact_by_construction or layer not in self.correction:
            return None
        return self.correction[layer]

    @staticmethod
    def apply(raw: torch.Tensor, correction) -> torch.Tensor:
        """``raw`` ``[a]`` corrected by ``(slope, intercept)`` (numbers or 0-d tensors), or as it is (None)."""
        if correction is None:
            return raw
        slope, intercept = correction[0], correction[1]
        return (raw * slope + intercept).clamp_min(0.0)

    def exact_for(self, stack) -> bool:
        """Whether this estimator is exact by construction on ``stack`` (its raw estimate then stands)."""
        return False

    def correction_table(self, stack, probes) -> torch.Tensor:
        """``[P, 2]`` float32: ``(slope, intercept)`` at each probe, ``(1, 0)`` where the raw estimate stands (the
        same numbers: ``raw · 1 + 0`` is ``raw``, which is ≥ 0)."""
        rows = [(1.0, 0.0) if self.exact_for(stack) or p not in self.correction else self.correction[p]
                for p in probes]
        return torch.tensor(rows, dtype=torch.float32)


@ESTIMATORS.register("topk")
class TopK(_Corrected):
    """Entropy over a shortlist of K candidate tokens (the head rows of the shortlist only), with a per-layer
    tail-mass correction fitted on calibration tokens. The shortlist is the K tokens most often predicted
    (final-layer argmax) on the calibration split, topped up with the most frequent input tokens.

    Args:
        k: shortlist size (1..V; K = V is the exact entropy).
        shortlist: token ids (length k), from fitting; None = the first k ids (only meaningful for K = V).
        correction: ``{layer: (slope, intercept)}``.
    """

    def __init__(self, k: int, shortlist: list[int] | None = None, correction: dict | None = None):
        super().__init__(correction)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"topk: k must be an integer >= 1, got {k!r}")
        self.k, self.shortlist = k, shortlist
        self._rows: torch.Tensor | None = None  # [k, d] head rows of the shortlist

    @classmethod
    def from_sample(cls, stack, sample: dict, **options) -> TopK:
        """Shortlist: the K tokens most often predicted at the final layer, topped up with frequent inputs."""
        vocab, k = stack.vocab_size, options["k"]
        counts = torch.bincount(sample["final_argmax"].cpu(), minlength=vocab).double() * vocab
        counts += torch.bincount(sample["inputs"].cpu(), minlength=vocab).double()
        return cls(shortlist=counts.argsort(descending=True, stable=True)[:k].tolist(), **options)

    def _head_rows(self, stack) -> torch.Tensor:
        if self._rows is None:
            vocab = stack.vocab_size
            if self.k > vocab:
                raise ValueError(f"topk: k = {self.k} exceeds the vocabulary size {vocab}")
            ids = torch.tensor(self.shortlist if self.shortlist is not None else range(self.k), dtype=torch.long)
            self.exact_by_construction = self.k == vocab
            self._rows = stack.head.weight[ids.to(stack.device)].detach()
        return self._rows

    def estimate(self, stack, h: torch.Tensor, layer: int, rows: torch.Tensor | None = None) -> Estimate:
        rows_ = self._head_rows(stack)  # made first: it decides whether the estimate is exact by construction
        return self._estimate(stack, stack.readout_input(h, layer), rows_, self.correction_at(layer))

    def from_input(self, stack, x: torch.Tensor, correction=None) -> Estimate:
        return self._estimate(stack, x, self._head_rows(stack), correction)

    def _estimate(self, stack, x: torch.Tensor, head_rows: torch.Tensor, correction) -> Estimate:
        logits = x @ head_rows.T  # [a, k]
        if stack.softcap is not None:
            logits = torch.tanh(logits / stack.softcap) * stack.softcap
        raw, _, max_prob = readout_summary(logits)
        return Estimate(self.apply(raw, correction), max_prob, None)

    def exact_for(self, stack) -> bool:
        return self.k == stack.vocab_size

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        """``2 × d × K`` FLOPs and the K head rows' bytes (the final norm is element-wise, not counted)."""
        return 2.0 * cost.head_in * self.k, float(cost.head_element_bytes * cost.head_in * self.k)

    def options(self) -> dict:
        return {"k": self.k, "shortlist": self.shortlist}

    def describe(self) -> dict:
        return {"estimator": self.name, "k": self.k}


_SVD = WeakIdKeyDictionary()  # head weight -> (its version, its SVD)


def head_svd(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD ``(U [V, d], S [d], Vh [d, d])`` of a head's weight ``[V, d]`` in fp32, computed once per weight
    (and again after the weight changes in place): every low-rank estimator of a process slices the same one."""
    held = _SVD.get(weight)
    if held is None or held[0] != weight._version:
        held = weight._version, torch.linalg.svd(weight.detach().float(), full_matrices=False)
        _SVD[weight] = held
    return held[1]


@ESTIMATORS.register("lowrank")
class LowRank(_Corrected):
    """Readout through a rank-r factorisation ``W ≈ A·B`` of the unembedding (truncated SVD), then its entropy,
    with a per-layer linear correction fitted on calibration tokens.

    Args:
        rank: r (1..d; r = d is the exact readout up to rounding).
        correction: ``{layer: (slope, intercept)}``.
    """

    def __init__(self, rank: int, correction: dict | None = None):
        super().__init__(correction)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lowrank: rank must be an integer >= 1, got {rank!r}")
        self.rank = rank
        self._factors: tuple[torch.Tensor, torch.Tensor] | None = None  # A [V, r], B [r, d]

    def _ab(self, stack) -> tuple[torch.Tensor, torch.Tensor]:
        if self._factors is None:
            d = stack.head.weight.shape[1]
            if self.rank > d:
                raise ValueError(f"lowrank: rank = {self.rank} exceeds the hidden size {d}")
            u, s, vh = head_svd(stack.head.weight)
            r = self.rank
            self.exact_by_construction = r == d
            self._factors = ((u[:, :r] * s[:r]).to(stack.dtype), vh[:r].to(stack.dtype))
        return self._factors

    def estimate(self, stack, h: torch.Tensor, layer: int, rows: torch.Tensor | None = None) -> Estimate:
        self._ab(stack)  # made first: it decides whether the estimate is exact by construction
        return self.from_input(stack, stack.readout_input(h, layer), self.correction_at(layer))

    def from_input(self, stack, x: torch.Tensor, correction=None) -> Estimate:
        a, b = self._ab(stack)
        logits = (x @ b.T) @ a.T  # [a, V]
        if stack.softcap is not None:
            logits = torch.tanh(logits / stack.softcap) * stack.softcap
        raw, max_prob = summary(logits)
        return Estimate(self.apply(raw, correction), max_prob, None)

    def exact_for(self, stack) -> bool:
        return self.rank == stack.head.weight.shape[1]

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        """``2 × r × (d + V)`` FLOPs and the bytes of the two factors."""
        params = self.rank * (cost.head_in + cost.vocab_size)
        return 2.0 * params, float(cost.head_element_bytes * params)

    def options(self) -> dict:
        return {"rank": self.rank}

    def describe(self) -> dict:
        return {"estimator": self.name, "rank": self.rank}


@fused(width=lambda weight, ids, x: weight.shape[0])
def head_rows_logits(weight: torch.Tensor, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each row's logits over its own head rows: ``weight`` ``[V, d]``, ``ids`` ``[a, w]``, ``x`` ``[a, d]`` →
    ``[a, w]`` (``weight[ids[i, j]] · x[i]``; fused, the ``[a, w, d]`` rows are never gathered in memory)."""
    return (weight[ids] * x[:, None, :]).sum(-1)


@ESTIMATORS.register("prune")
class Prune(Estimator):
    """CALM-style vocabulary pruning: the first probe of a token (layer j) reads out the full head and keeps its
    best tokens; every later probe of that token reads out only the kept head rows (logits ``-inf`` elsewhere, so
    the exit token maps back to the full vocabulary). Entropy and confidence are those of the pruned softmax.

    How many tokens a later probe at layer ℓ reads (per row):

    - ``fixed``: k = ``prune_k``;
    - ``decay``: from k0 = ``prune_k`` at j down to k* = ``prune_k_min`` at L, linearly in the layer:
      ``k_ℓ = round(k0 + (k* − k0)·(ℓ − j)/(L − j))``;
    - ``adaptive``: ``ceil(V·(1 − 0.9·c))``, c the max probability at the row's previous probe, never more
      than the previous probe read.

    A later probe reads the best tokens of the set by the latest logits. It costs ``2·d·k`` FLOPs and the bytes
    of k head rows for its row's k (rows batched together compute the largest k among them); the first probe
    costs one full readout.

    Args:
        prune_k: k (fixed) or k0 (decay), in 1..V (unused by adaptive).
        prune_schedule: ``fixed``, ``decay`` or ``adaptive``.
        prune_k_min: k* of ``decay``, in 1..prune_k.
    """

    gives_logits = True
    needs_fit = False
    stateful = True
    whole_vocabulary = False
    SCHEDULES = ("fixed", "decay", "adaptive")

    def __init__(self, prune_k: int = 512, prune_schedule: str = "fixed", prune_k_min: int | None = None):
        if isinstance(prune_k, bool) or not isinstance(prune_k, int) or prune_k < 1:
            raise ValueError(f"prune_k (the kept vocabulary size k) must be an integer >= 1, got {prune_k!r}")
        if prune_schedule not in self.SCHEDULES:
            raise ValueError(f"prune_schedule must be one of {', '.join(self.SCHEDULES)}, got {prune_schedule!r}")
        if prune_schedule == "decay" and (isinstance(prune_k_min, bool) or not isinstance(prune_k_min, int)
                                          or not 1 <= prune_k_min <= prune_k):
            raise ValueError(f"prune_k_min (k* of the decay schedule) must be an integer in 1..prune_k "
                             f"({prune_k}), got {prune_k_min!r}")
        self.k, self.schedule, self.k_min = prune_k, prune_schedule, prune_k_min
        self._readout_cost: tuple[float, float] | None = None
        self.begin(0)

    def begin(self, batch_size: int) -> None:
        self._batch = batch_size
        self._sets: torch.Tensor | None = None  # [B, K] kept token ids, best first
        self._first = None  # [B] layer of the row's full readout (0: not probed yet)
        self._next = None  # [B] adaptive: how many tokens the next probe reads

    def probe_cost(self, cost: CostModel) -> tuple[float, float]:
        """The most a probe costs: one full readout (pruned probes report their own cost)."""
        return float(cost.readout_flops), float(cost.readout_bytes)

    def estimate(self, stack, h: torch.Tensor, layer: int, rows: torch.Tensor | None = None) -> Estimate:
        if self.k > stack.vocab_size and self.schedule != "adaptive":
            raise ValueError(f"prune_k = {self.k} is outside 1..{stack.vocab_size} (the vocabulary size)")
        rows = torch.arange(h.shape[0], device=h.device) if rows is None else rows
        if self._sets is None:
            batch = max(self._batch, int(rows.max()) + 1)
            width = stack.vocab_size if self.schedule == "adaptive" else self.k
            self._sets = torch.zeros(batch, width, dtype=torch.long, device=h.device)
            self._first = torch.zeros(batch, dtype=torch.long, device=h.device)
            self._next = torch.zeros(batch, dtype=torch.long, device=h.device)
        fresh = self._first[rows] == 0
        parts = [(m, fn(stack, h[m], layer, rows[m])) for m, fn in ((fresh, self._full), (~fresh, self._pruned))
                 if bool(m.any())]
        return parts[0][1] if len(parts) == 1 else _merge(parts, stack.vocab_size)

    def _full(self, stack, h, layer, rows) -> Estimate:
        logits = stack.readout(h, layer)  # [a, V]
        entropy, max_prob = summary(logits)
        keep = self._adaptive(max_prob, self._sets.shape[1], stack.vocab_size)  # adaptive: the next probe's size
        width = int(keep.max()) if self.schedule == "adaptive" else self._sets.shape[1]
        self._sets[rows, :width] = logits.topk(width, dim=-1).indices  # [a, width] best first
        self._first[rows] = layer
        self._next[rows] = keep
        if self._readout_cost is None:
            self._readout_cost = self.probe_cost(CostModel.from_stack(stack))
        ones = torch.ones(len(rows), dtype=torch.float64)
        return Estimate(entropy, max_prob, logits, (ones * self._readout_cost[0], ones * self._readout_cost[1]))

    def _pruned(self, stack, h, layer, rows) -> Estimate:
        size = self._size(layer, rows, stack.n_layers)  # [a]
        width = int(size.max())
        ids = self._sets[rows, :width]  # [a, w]
        z = head_rows_logits(stack.head.weight, ids, stack.readout_input(h, layer))  # [a, w]
        if stack.softcap is not None:
            z = torch.tanh(z / stack.softcap) * stack.softcap
        z = z.masked_fill(torch.arange(width, device=z.device)[None] >= size[:, None], float("-inf"))
        entropy, _, max_prob = readout_summary(z)
        order = z.argsort(dim=-1, descending=True, stable=True)
        self._sets[rows, :width] = ids.gather(1, order)  # best first by the latest logits
        self._next[rows] = self._adaptive(max_prob, size, stack.vocab_size)
        logits = torch.full((len(rows), stack.vocab_size), float("-inf"), dtype=z.dtype, device=z.device)
        logits.scatter_(1, ids, z)
        d_in, elem = stack.head.weight.shape[1], stack.head.weight.element_size()
        n = size.double().cpu()
        return Estimate(entropy, max_prob, logits, (2.0 * d_in * n, elem * d_in * n))

    def _size(self, layer: int, rows: torch.Tensor, n_layers: int) -> torch.Tensor:
        """Tokens the probe at ``layer`` reads, per row ``[a]``."""
        if self.schedule == "fixed":
            return torch.full_like(rows, self.k)
        if self.schedule == "adaptive":
            return self._next[rows]
        j = self._first[rows].double()
        frac = (layer - j) / (n_layers - j).clamp_min(1)
        return torch.round(self.k + (self.k_min - self.k) * frac).long().clamp(self.k_min, self.k)

    @staticmethod
    def _adaptive(confidence: torch.Tensor, cap, vocab: int) -> torch.Tensor:
        want = torch.ceil(vocab * (1 - 0.9 * confidence.double())).long().clamp_min(1)
        return torch.minimum(want, torch.as_tensor(cap, device=want.device))

    def describe(self) -> dict:
        out = {"estimator": self.name, "prune_schedule": self.schedule}
        if self.schedule != "adaptive":
            out["prune_k"] = self.k
        if self.schedule == "decay":
            out["prune_k_min"] = self.k_min
        return out


def _merge(parts: list[tuple[torch.Tensor, Estimate]], vocab: int) -> Estimate:
    """One estimate for all rows from estimates of complementary row masks ``[a]``."""
    a = len(parts[0][0])
    sample = parts[0][1]
    out = Estimate(sample.entropy.new_empty(a), sample.max_prob.new_empty(a),
                   sample.logits.new_empty(a, vocab), (torch.empty(a, dtype=torch.float64),
                                                       torch.empty(a, dtype=torch.float64)))
    for mask, est in parts:
        out.entropy[mask], out.max_prob[mask], out.logits[mask] = est.entropy, est.max_prob, est.logits
        cpu = mask.cpu()
        out.cost[0][cpu], out.cost[1][cpu] = est.cost
    return out
