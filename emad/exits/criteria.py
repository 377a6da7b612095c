"""Exit criteria: at which probe layer a token stops and reads out its prediction.

A criterion names its probe layers (1-based, ascending; the last is the deepest a token may run) and, at each
probe, decides per row whether the token exits there, from a :class:`ProbeView` (the estimated entropy Ĥ and what
stratifies the token). The decode loop knows nothing else about it. New criteria are one small class registered
in :data:`CRITERIA`; every criterion takes ``min_exit_layer`` (no exit below it).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from emad.engine.fused import fused, second_largest
from emad.exits.contrastive import (
    amateur_of,
    choose_amateur,
    contrastive_logprobs,
    contrastive_top,
    jsd_probs,
    log_distribution,
    plausibility_alpha,
)
from emad.registry import Registry

MEMO_BLOCK = 8  # rows a sweep's memo computes together for a criterion that reads only the running rows: a fixed
# split, so that a row's value never depends on how many rows the other methods needed


@dataclass
class ProbeView:
    """What a criterion sees at one probe, for the ``a`` rows still running.

    Attributes:
        layer: the probe layer (1-based).
        entropy: ``[a]`` estimated entropy Ĥ (nats).
        positions: ``[a]`` position id of each token (tokens before it in its context).
        first_confidence: ``[a]`` max probability at the token's first probe (for strata), or None.
        logits: ``[a, V]`` the probe's readout when the estimator gave one (``-inf`` outside a pruned
            vocabulary), else None.
        rows: ``[a]`` which rows of the step these are (for criteria that remember earlier probes of a token).
        memo: what criteria derive from the readouts (keyed by what they compute, layer included), shared by
            every method that reads the same states of the same rows at every probe (a sweep), or None.
        running: with a memo, which rows are still running (``[a]`` bool: the decisions of the rest are never
            read, a criterion may skip them), or None (every row).
    """

    layer: int
    entropy: torch.Tensor
    positions: torch.Tensor
    first_confidence: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    memo: dict | None = None
    running: torch.Tensor | None = None

    def shared(self, key: tuple, compute):
        """``compute()``, or the value a method reading the same states already computed under ``key``."""
        if self.memo is None:
            return compute()
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


class Criterion:
    """Base class. Subclasses set :attr:`name` through the registry and override what they need.

    Attributes:
        needs_estimate: False when the criterion never looks at Ĥ (then probes cost nothing before the exit).
        needs_logits: True when decisions read the probe's readout (estimators that give it: exact, prune).
        reads_every_exit: True when the exit token comes from :meth:`exit_logits` at every exit, the last
            probe included (then the last probe is estimated too).
        min_exit_layer: no exit below this layer.
        knobs: the scalar options that make the criterion more or less eager, each with the end that exits
            less (``"high"`` or ``"low"``); risk control searches them from that end.
        on_device: True when the exit test is a tensor function of one probe's estimate and of the tables
            :meth:`tables` makes (:meth:`test`), with no state across probes: a decode step then keeps its whole
            state on the device (:mod:`emad.decode.device_step`).
    """

    name: ClassVar[str]
    knobs: ClassVar[dict[str, str]] = {}
    needs_estimate: ClassVar[bool] = True
    needs_logits: ClassVar[bool] = False
    reads_every_exit: ClassVar[bool] = False
    on_device: ClassVar[bool] = False
    min_exit_layer: int = 1

    @classmethod
    def from_options(cls, **options) -> Criterion:
        """Build from a bag of options (CLI flags, params), taking the ones ``__init__`` names.

        Raises:
            ValueError: naming the option this criterion needs and did not get.
        """
        params = [p for p in inspect.signature(cls.__init__).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        missing = [p.name for p in params if p.default is p.empty and options.get(p.name) is None]
        if missing:
            raise ValueError(f"method {cls.name!r} needs {', '.join(missing)}")
        return cls(**{p.name: options[p.name] for p in params if options.get(p.name) is not None})

    def validate(self, n_layers: int) -> None:
        """Raise ``ValueError`` naming the parameter when this criterion cannot run on an L-layer model."""
        if not isinstance(self.min_exit_layer, int) or not 1 <= self.min_exit_layer <= n_layers:
            raise ValueError(f"min_exit_layer must be in 1..{n_layers}, got {self.min_exit_layer!r}")

    def probes(self, n_layers: int) -> list[int]:
        """Probe layers, 1-based and ascending; the last is the deepest any token runs."""
        return [n_layers]

    def prefill_depth(self, n_layers: int) -> int:
        """How many layers the prompt runs."""
        return n_layers

    def needs_first_confidence(self) -> bool:
        """True when decisions use the max probability at the first probe (confidence strata)."""
        return False

    def begin(self, batch_size: int) -> None:
        """A new token for each of ``batch_size`` rows is about to be probed."""

    def wants_estimate(self, k: int, layer: int) -> bool:
        """Whether the ``k``-th probe (at ``layer``) is estimated: from the minimum exit layer on, and the first
        probe when strata use its confidence."""
        return layer >= self.min_exit_layer or (k == 0 and self.needs_first_confidence())

    def observe(self, view: ProbeView) -> None:
        """Called at every estimated probe, before :meth:`exits` (which runs from the minimum exit layer on)."""

    def exits(self, view: ProbeView) -> torch.Tensor:
        """Per-row exit decision at a probe: bool ``[a]``."""
        return torch.zeros_like(view.entropy, dtype=torch.bool)

    def exit_logits(self, view: ProbeView) -> torch.Tensor | None:
        """Logits ``[a, V]`` the exit token is read from at this probe (default: the probe's readout)."""
        return view.logits

    @property
    def tokens_from_readout(self) -> bool:
        """The exit token is the readout's own at the exit layer (False where :meth:`exit_logits` changes it)."""
        return True

    def derived_from_logits(self, layer: int) -> tuple[tuple, ...] | None:
        """The memo keys of everything this criterion derives from the readout at ``layer`` (a criterion that reads
        the logits): when a sweep's memo holds them all, its decisions there need no readout, and its exit token
        is the probe's own. None: it reads the logits themselves."""
        return None

    def tables(self, n_layers: int, device) -> dict[str, torch.Tensor]:
        """What :meth:`test` reads besides the estimate, as tensors on ``device``: the values that differ between
        points of one kind (thresholds, τ − margin), so that a compiled test serves every point of its kind."""
        return {}

    def test(self, view: ProbeView, tables: dict[str, torch.Tensor], k) -> torch.Tensor:
        """:meth:`exits` at the ``k``-th probe (an int, or a ``[1]`` tensor in compiled code: one compiled test serves
        every probe), reading its values from ``tables`` (:meth:`tables`) and nothing of the criterion but its kind
        (:meth:`kind`): bool ``[a]``."""
        return self.exits(view)

    def structure(self, n_layers: int) -> tuple:
        """What a step program of this criterion is kept for (points equal in it share one): :meth:`kind` and the
        probes."""
        return (*self.kind(), tuple(self.probes(n_layers)))

    def kind(self) -> tuple:
        """What a compiled :meth:`test` specialises on, whatever the probe (points equal in it share one): the
        class and the description without the knobs."""
        fixed = sorted((k, repr(v)) for k, v in self.describe().items() if k not in self.knobs)
        return type(self).__name__, tuple(fixed)

    def describe(self) -> dict:
        """Parameters identifying this operating point (for traces, JSON and MLflow)."""
        return {"method": self.name}


CRITERIA: Registry[Criterion] = Registry("exit criterion")


def _check_threshold(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (inf allowed), got {value!r}")


def _every(probe_every: int, n_layers: int) -> list[int]:
    if not isinstance(probe_every, int) or not 1 <= probe_every <= n_layers:
        raise ValueError(f"probe_every must be in 1..{n_layers}, got {probe_every!r}")
    return sorted(set(range(probe_every, n_layers + 1, probe_every)) | {n_layers})


@CRITERIA.register("full")
class Full(Criterion):
    """Every token runs all L layers (the reference)."""

    needs_estimate = False
    on_device = True


@CRITERIA.register("fixed")
class Fixed(Criterion):
    """Every token, prompt included, runs layers 1..m and reads out at m (the model truncated to m layers).

    Args:
        depth: m, in 1..L.
    """

    knobs = {"depth": "high"}
    needs_estimate = False
    on_device = True

    def __init__(self, depth: int):
        self.depth = depth

    def validate(self, n_layers: int) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or not 1 <= self.depth <= n_layers:
            raise ValueError(f"depth must be an integer in 1..{n_layers} for this model, got {self.depth!r}")

    def probes(self, n_layers: int) -> list[int]:
        return [self.depth]

    def prefill_depth(self, n_layers: int) -> int:
        return self.depth

    def describe(self) -> dict:
        return {"method": self.name, "depth": self.depth}


@CRITERIA.register("confidence")
class Confidence(Criterion):
    """Exit at the first probe with Ĥ ≤ h0 (one global entropy threshold).

    Args:
        threshold: h0 in nats (>= 0).
        probe_every: probe every k-th layer (L always probed).
        min_exit_layer: no exit below this layer.
    """

    knobs = {"threshold": "low"}
    on_device = True

    def __init__(self, threshold: float, probe_every: int = 3, min_exit_layer: int = 1):
        _check_threshold("threshold", threshold)
        self.threshold, self.probe_every, self.min_exit_layer = float(threshold), probe_every, min_exit_layer

    def validate(self, n_layers: int) -> None:
        super().validate(n_layers)
        _every(self.probe_every, n_layers)

    def probes(self, n_layers: int) -> list[int]:
        return _every(self.probe_every, n_layers)

    def exits(self, view: ProbeView) -> torch.Tensor:
        return view.entropy <= self.threshold

    def tables(self, n_layers: int, device) -> dict[str, torch.Tensor]:
        """``limit`` ``[P]``: h0 at every probe (float32, as ``exits`` compares)."""
        return {"limit": torch.full((len(self.probes(n_layers)),), self.threshold, dtype=torch.float32,
                                    device=device)}

    def test(self, view: ProbeView, tables: dict[str, torch.Tensor], k) -> torch.Tensor:
        return view.entropy <= tables["limit"][k]

    def describe(self) -> dict:
        return {"method": self.name, "threshold": self.threshold, "probe_every": self.probe_every,
                "min_exit_layer": self.min_exit_layer}


@CRITERIA.register("emad")
class Emad(Criterion):
    """Exit at the shallowest probe ℓ with Ĥ_ℓ ≤ τ_ℓ(stratum of the token) − margin.

    Args:
        profile: the target profile (its probe layers are the probes).
        margin: m in nats (>= 0; +inf never exits early).
        min_exit_layer: no exit below this layer.
        probe_stride: probe every k-th of the profile's probe layers, counted down from L (1 = all of them).
    """

    knobs = {"margin": "high"}
    on_device = True

    def __init__(self, profile, margin: float, min_exit_layer: int = 1, probe_stride: int = 1):
        _check_threshold("margin", margin)
        if isinstance(probe_stride, bool) or not isinstance(probe_stride, int) or probe_stride < 1:
            raise ValueError(f"probe_stride must be an integer >= 1, got {probe_stride!r}")
        self.profile, self.margin, self.min_exit_layer = profile, float(margin), min_exit_layer
        self.probe_stride = probe_stride
        self._tau: torch.Tensor | None = None  # [S, P] on the decoding device
        self._column = {layer: i for i, layer in enumerate(profile.probe_layers)}

    def validate(self, n_layers: int) -> None:
        super().validate(n_layers)
        layers = self.profile.probe_layers
        if any(not 1 <= x <= n_layers for x in layers) or layers[-1] != n_layers:
            raise ValueError(f"profile probe layers {layers} do not fit a {n_layers}-layer model "
                             f"(they must lie in 1..{n_layers} and end at {n_layers})")
        if self.probe_stride > 1 and self.profile.strata.uses_confidence:
            raise ValueError("probe_stride > 1 would move the first probe that confidence strata were calibrated "
                             "at; use a profile without confidence strata")

    def probes(self, n_layers: int) -> list[int]:
        return list(self.profile.probe_layers)[::-1][:: self.probe_stride][::-1]

    def needs_first_confidence(self) -> bool:
        return self.profile.strata.uses_confidence

    def exits(self, view: ProbeView) -> torch.Tensor:
        if self._tau is None or self._tau.device != view.entropy.device:
            self._tau = self.profile.table(view.entropy.device)
        first = self.probes(self.profile.probe_layers[-1])[0]  # where first_confidence was read
        strata = view.shared(("strata", repr(self.profile.strata.as_dict()), first),  # one assignment a sweep's rows
                             lambda: self.profile.strata.assign(view.positions, view.first_confidence))  # [a]
        tau = self._tau[strata, self._column[view.layer]]  # [a]
        return view.entropy <= tau - self.margin

    def tables(self, n_layers: int, device) -> dict[str, torch.Tensor]:
        """``limit`` ``[S, P]``: τ − margin of each stratum at each probe (float32, as ``exits`` computes it); the
        strata's edges."""
        strata = self.profile.strata
        columns = [self._column[layer] for layer in self.probes(n_layers)]
        limit = (self.profile.table(device) - self.margin)[:, columns]  # [S, P]
        return {"limit": limit, **strata.edge_tensors(device)}

    def test(self, view: ProbeView, tables: dict[str, torch.Tensor], k) -> torch.Tensor:
        strata = self.profile.strata.assign(view.positions, view.first_confidence, tables)  # [a]
        return view.entropy <= tables["limit"][strata, k]

    def kind(self) -> tuple:
        return (*super().kind(), self.profile.strata.as_dict().__repr__(), len(self.profile.strata))

    def describe(self) -> dict:
        return {"method": self.name, "margin": self.margin, "min_exit_layer": self.min_exit_layer,
                "probe_stride": self.probe_stride, "strata": self.profile.strata.variant,
                "profile_model": self.profile.model.get("spec", ""), "profile_corpus": self.profile.corpus}


def _check_unit(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


@CRITERIA.register("softmax")
class SoftmaxResponse(Criterion):
    """CALM's softmax response: exit when the gap between the two largest probabilities of the probe's readout is
    ≥ the threshold (one global threshold, or one per layer).

    Args:
        threshold: the gap threshold in [0, 1] for every probe without a layer threshold (> 1 never exits).
        layer_thresholds: ``{layer: threshold}`` overriding it at those probes.
        probe_every: probe every k-th layer (L always probed).
        min_exit_layer: no exit below this layer.
    """

    needs_logits = True
    knobs = {"threshold": "high"}
    on_device = True

    def __init__(self, threshold: float, layer_thresholds: dict[int, float] | None = None, probe_every: int = 3,
                 min_exit_layer: int = 1):
        _check_threshold("threshold", threshold)
        for layer, value in (layer_thresholds or {}).items():
            _check_threshold(f"layer_thresholds[{layer}]", value)
        self.threshold, self.probe_every, self.min_exit_layer = float(threshold), probe_every, min_exit_layer
        self.layer_thresholds = {int(k): float(v) for k, v in (layer_thresholds or {}).items()}

    def validate(self, n_layers: int) -> None:
        super().validate(n_layers)
        _every(self.probe_every, n_layers)
        stray = [x for x in self.layer_thresholds if x not in self.probes(n_layers)]
        if stray:
            raise ValueError(f"layer_thresholds name layers {stray} that are not probes {self.probes(n_layers)}")

    def probes(self, n_layers: int) -> list[int]:
        return _every(self.probe_every, n_layers)

    def exits(self, view: ProbeView) -> torch.Tensor:
        gap = view.shared(("top2_gap", view.layer), lambda: fused_top2_gap(view.logits))  # [a]
        return gap >= self.layer_thresholds.get(view.layer, self.threshold)

    def tables(self, n_layers: int, device) -> dict[str, torch.Tensor]:
        """``limit`` ``[P]``: the gap threshold at each probe (float32, as ``exits`` compares)."""
        limits = [self.layer_thresholds.get(layer, self.threshold) for layer in self.probes(n_layers)]
        return {"limit": torch.tensor(limits, dtype=torch.float32, device=device)}

    def test(self, view: ProbeView, tables: dict[str, torch.Tensor], k) -> torch.Tensor:
        return top2_gap(view.logits) >= tables["limit"][k]

    def kind(self) -> tuple:
        fixed = sorted((k, repr(v)) for k, v in self.describe().items() if k not in ("threshold", "layer_thresholds"))
        return type(self).__name__, tuple(fixed)

    def derived_from_logits(self, layer: int) -> tuple[tuple, ...]:
        return (("top2_gap", layer),)

    def describe(self) -> dict:
        out = {"method": self.name, "threshold": self.threshold, "probe_every": self.probe_every,
               "min_exit_layer": self.min_exit_layer}
        if self.layer_thresholds:
            out["layer_thresholds"] = self.layer_thresholds
        return out


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """``p_(1) − p_(2)`` of softmax(logits) per row: ``[a, V]`` → ``[a]`` float32 (a one-token vocabulary: 1), as
    ``(1 − exp(l_(2) − l_(1))) / Σ exp(l − l_(1))`` from the two largest logits ``l_(1) ≥ l_(2)`` (tied: gap 0):
    three reductions over the row, no ``[a, V]`` probabilities or sort."""
    if logits.shape[-1] < 2:
        return torch.ones(logits.shape[:-1], device=logits.device)
    x = logits.float()
    top = x.amax(dim=-1, keepdim=True)  # [a, 1]
    second = second_largest(x, top)  # [a, 1]
    total = torch.exp(x - top).sum(dim=-1, keepdim=True)  # [a, 1] softmax's normaliser
    return ((1 - torch.exp(second - top)) / total)[..., 0]


fused_top2_gap = fused(top2_gap)  # one kernel over a wide vocabulary (a sweep's summaries and an eager step's exits)


@CRITERIA.register("contrastive")
class Contrastive(Criterion):
    """Within-model contrast (see :mod:`emad.exits.contrastive`): the amateur is the earlier probe layer of the token
    with the largest distance-discounted JSD from the current layer's readout; the contrastive distribution is
    ``softmax(log p − w·log p_amateur)`` on the plausible set. Exit when its top probability is ≥ the threshold
    (no exit at the first probe, which has no amateur). With ``contrastive_output`` the token is also read from
    the contrastive distribution (DoLa-style), at every exit including L.

    Args:
        threshold: exit confidence in [0, 1] (> 1 never exits).
        alpha: α of the plausibility schedule, in [0, 1].
        alpha_rate: r >= 0 of ``α′ = α/(1 + r·ℓ)·(1 − confidence)``.
        distance_discount: d >= 0 of ``JSD/(1 + d·(ℓ − m))``.
        contrast_weight: w >= 0 (1 = DoLa).
        contrastive_output: read exit tokens from the contrastive distribution.
        probe_every: probe every k-th layer (L always probed; every probe is a candidate amateur).
        min_exit_layer: no exit below this layer.
    """

    needs_logits = True
    knobs = {"threshold": "high"}

    def __init__(self, threshold: float, alpha: float = 0.1, alpha_rate: float = 0.0,
                 distance_discount: float = 0.0, contrast_weight: float = 1.0, contrastive_output: bool = False,
                 probe_every: int = 3, min_exit_layer: int = 1):
        _check_threshold("threshold", threshold)
        _check_unit("alpha", alpha)
        for name, value in (("alpha_rate", alpha_rate), ("distance_discount", distance_discount),
                            ("contrast_weight", contrast_weight)):
            _check_threshold(name, value)
        self.threshold, self.alpha, self.alpha_rate = float(threshold), float(alpha), float(alpha_rate)
        self.distance_discount, self.weight = float(distance_discount), float(contrast_weight)
        self.output, self.probe_every, self.min_exit_layer = bool(contrastive_output), probe_every, min_exit_layer
        self.reads_every_exit = self.output
        self.begin(0)

    def validate(self, n_layers: int) -> None:
        super().validate(n_layers)
        _every(self.probe_every, n_layers)

    def probes(self, n_layers: int) -> list[int]:
        return _every(self.probe_every, n_layers)

    def begin(self, batch_size: int) -> None:
        self._history: dict[int, torch.Tensor] = {}  # layer -> [B, V] log-probabilities of earlier probes
        self._seen: list[int] = []  # layers observed for this token (the history when it lives in a memo)
        self._batch = batch_size
        self._cache: tuple | None = None  # (layer, contrast [a, V], its max probability [a])

    def wants_estimate(self, k: int, layer: int) -> bool:
        return True  # every probe's readout is a candidate amateur

    def observe(self, view: ProbeView) -> None:
        if view.memo is not None:  # a sweep: the memo holds every probe's log-probabilities of the same rows
            self._seen.append(view.layer)
            n = len(view.logits)
            live = torch.ones(n, dtype=torch.bool) if view.running is None else view.running.cpu()
            starts = (live.nonzero()[:, 0] // MEMO_BLOCK * MEMO_BLOCK).unique().tolist()  # blocks holding a live row
            parts = {start: self._block(view, start, min(start + MEMO_BLOCK, n)) for start in starts}
            if not parts or next(iter(parts.values()))[1] is None:  # the first probe: no amateur yet
                self._cache = (view.layer, None, None)
                return
            top = torch.zeros(n, device=view.entropy.device)  # [a] the contrast's max probability (0: not read)
            for start, (_, block_top) in parts.items():
                top[start:start + len(block_top)] = block_top
            self._cache = (view.layer, None, top)  # contrastive_output is never in a sweep
            return
        logp = torch.log_softmax(view.logits.float(), dim=-1)  # [a, V]
        rows = view.rows if view.rows is not None else torch.arange(len(logp), device=logp.device)
        amateur = self._amateur(view.layer, logp, rows)  # [a, V] or None
        if amateur is None:
            self._cache = (view.layer, None, None)
        else:
            contrast = self._contrast_with(view.layer, logp, amateur) if self.output else None
            self._cache = (view.layer, contrast, self._contrast_top(view.layer, logp, amateur))
        store = self._history.setdefault(view.layer, logp.new_full((max(self._batch, int(rows.max()) + 1),
                                                                    logp.shape[-1]), float("nan")))
        store[rows] = logp

    def _block(self, view: ProbeView, start: int, stop: int) -> tuple[None, torch.Tensor | None]:
        """The contrast's top probabilities ``[b]`` of rows ``[start, stop)`` (None at the first probe), computed
        once for every method of these settings that reads the memo; the block's log-probabilities, probabilities
        and entropy at this probe are kept in the memo for the probes after it (one fused pass)."""
        if ("logp", view.layer, start) not in view.memo:
            logp, p, entropy = log_distribution(view.logits[start:stop])  # [b, V], [b, V], [b]
            view.memo[("logp", view.layer, start)], view.memo[("probs", view.layer, start)] = logp, (p, entropy)
        key = ("contrast", view.layer, self.alpha, self.alpha_rate, self.distance_discount, self.weight,
               tuple(self._seen), start, "top")
        return None, view.shared(key, lambda: self._top_shared(view, start))

    def _top_shared(self, view: ProbeView, start: int) -> torch.Tensor | None:
        """The contrast's top probability ``[b]`` (:meth:`_contrast_top`) for the rows of the block at ``start``, with
        the history read from the memo (the block was read at every earlier probe: a method's running rows never
        grow)."""
        earlier = self._seen[:-1]
        if not earlier:
            return None
        logp = view.memo[("logp", view.layer, start)]  # [b, V] (_block put it there)
        p, h_p = view.memo[("probs", view.layer, start)]
        earlier_probs = [view.memo[("probs", m, start)] for m in earlier]  # (q [b, V], H(q) [b]) each
        scores = torch.stack([jsd_probs(p, q, h_p, h_q) for q, h_q in earlier_probs])  # [C, b]
        pick = amateur_of(scores, view.layer, earlier, self.distance_discount)  # [b]
        picked = pick.unique().tolist()
        if len(picked) == 1:  # one amateur for the whole block: its log-probabilities as they are
            return self._contrast_top(view.layer, logp, view.memo[("logp", earlier[picked[0]], start)])
        amateur = torch.empty_like(logp)  # [b, V] each row's amateur's log-probabilities, copied once per row
        for c in picked:
            rows = (pick == c).nonzero()[:, 0]
            amateur.index_copy_(0, rows, view.memo[("logp", earlier[c], start)].index_select(0, rows))
        return self._contrast_top(view.layer, logp, amateur)

    def _amateur(self, layer: int, logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """Each row's amateur's log-probabilities ``[a, V]`` (the earlier probe of the largest discounted JSD from
        ``logp``), or None at the first probe."""
        layers = sorted(x for x in self._history if x < layer)
        if not layers:
            return None
        candidates = torch.stack([self._history[m][rows] for m in layers])  # [C, a, V]
        pick = choose_amateur(logp, candidates, layer, layers, self.distance_discount)  # [a]
        return candidates[pick, torch.arange(len(rows), device=logp.device)]

    def _contrast_top(self, layer: int, logp: torch.Tensor, amateur: torch.Tensor) -> torch.Tensor:
        """The top probability ``[a]`` of :meth:`_contrast_with`'s distribution (one fused kernel)."""
        return contrastive_top(logp, amateur, self.alpha / (1 + self.alpha_rate * layer), self.weight)

    def _contrast_with(self, layer: int, logp: torch.Tensor, amateur: torch.Tensor) -> torch.Tensor:
        alpha = plausibility_alpha(self.alpha, self.alpha_rate, layer, logp.max(-1).values.exp())
        return contrastive_logprobs(logp, amateur, alpha, self.weight)

    def exits(self, view: ProbeView) -> torch.Tensor:
        top = self._cache[2] if self._cache and self._cache[0] == view.layer else None  # [a] contrast max prob
        if top is None:
            return torch.zeros(len(view.entropy), dtype=torch.bool, device=view.entropy.device)
        return top >= self.threshold

    @property
    def tokens_from_readout(self) -> bool:
        return not self.output

    def exit_logits(self, view: ProbeView) -> torch.Tensor | None:
        contrast = self._cache[1] if self._cache and self._cache[0] == view.layer else None
        if not self.output or contrast is None:
            return view.logits
        return contrast.to(view.logits.dtype)

    def describe(self) -> dict:
        return {"method": self.name, "threshold": self.threshold, "alpha": self.alpha, "alpha_rate": self.alpha_rate,
                "distance_discount": self.distance_discount, "contrast_weight": self.weight,
                "contrastive_output": self.output, "probe_every": self.probe_every,
                "min_exit_layer": self.min_exit_layer}
