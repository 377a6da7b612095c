"""The shared full-depth states of a sweep's batch, and every per-row value read from them, memoised.

A batch's continuations are laid end to end as ``N`` rows (:class:`~emad.decode.monotone.Segments`): their states
after each kept layer ``[N, d]``, positions and targets ``[N]``. What a method reads at a probe is computed once
for every method that reads the same thing and kept per row: a readout's summary (:data:`SUMMARY`: the exact
entropy and max probability, each target's log-probability and greedy hit, and what criteria derive from the
logits, :data:`DERIVED`), an estimator's estimate. Rows are computed only where some method still needs them
(the rows it still runs, or the rows that exit), in aligned blocks of :data:`BLOCK` rows, so that a row's value is
computed in the same blocks whichever methods asked for it (a later sweep on kept states computes what a fresh
pass computes, bit for bit). A ``[rows, V]`` readout lives only while its probe is being read (:meth:`Rows.release`):
the logits a criterion reads (contrastive) and a stateful estimator's (pruning).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from emad.decode.monotone import ESTIMATE, Segments, estimated_probes
from emad.decode.step import Method
from emad.engine.fused import readout_scores, readout_scores_top2
from emad.exits.criteria import MEMO_BLOCK
from emad.exits.estimators import Estimate, Exact

BLOCK = 8  # rows computed together: a row's value never depends on which other rows were asked for
CHUNK = 256  # rows read out in one head product at most (a multiple of BLOCK): bounds the [rows, V] in flight
LOGIT = ("logit", "")
SUMMARY = ("entropy", "max_prob", "logprob", "greedy")  # what every readout of a row gives
# what criteria derive from a probe's logits (memo keys (name, layer)), computed with the summary when asked for:
# name -> the kernel giving the summary and, fifth, that value, in one pass over the logits
DERIVED: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "top2_gap": readout_scores_top2}


def canonical(views: dict, key: tuple, probe: int) -> tuple:
    """The readout key at ``probe``: readouts without a translator there read out as the logit lens."""
    lens = views[key][0].lens
    return LOGIT if lens is None or probe not in lens.layers else key


def estimator_key(estimator) -> tuple:
    """Estimators with equal keys give equal estimates on equal states (fitted ones: the same object)."""
    return (estimator.name, json.dumps(estimator.describe(), sort_keys=True, default=str),
            id(estimator) if estimator.needs_fit else None)


def whole_rows(estimator) -> bool:
    """An estimator evaluated on every row at once, at every probe of its sequence: a stateful one (a row's
    estimate depends on its earlier probes), or one whose estimate carries logits of its own."""
    return estimator.stateful or (estimator.gives_logits and not isinstance(estimator, Exact))


def blocks(want: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """Rows to compute (``[r]`` long, ascending) for the ``want`` rows not ``done`` (``[N]`` bool each): the aligned
    blocks of :data:`BLOCK` rows that hold one, with the blocks before a short last block until there are
    :data:`BLOCK` rows (a head product of fewer rows may round differently)."""
    n = len(want)
    missing = (want & ~done).nonzero()[:, 0]
    if not len(missing):
        return missing
    chosen = torch.zeros((n + BLOCK - 1) // BLOCK, dtype=torch.bool)
    chosen[missing // BLOCK] = True
    picked = chosen.nonzero()[:, 0]
    while n >= BLOCK and int(torch.clamp(n - picked * BLOCK, max=BLOCK).sum()) < BLOCK:
        chosen[int(picked[0]) - 1] = True  # only a short last block was asked for: take the one before too
        picked = chosen.nonzero()[:, 0]
    rows = (picked[:, None] * BLOCK + torch.arange(BLOCK)[None]).flatten()
    return rows[rows < n]


def chunks(rows: torch.Tensor) -> list[torch.Tensor]:
    """``rows`` in runs of at most :data:`CHUNK` (whole blocks; a short tail joins the run before it)."""
    out = list(rows.split(CHUNK))
    if len(out) > 1 and len(out[-1]) < BLOCK:
        out[-2:] = [torch.cat(out[-2:])]
    return out


class RowValues:
    """Named per-row values ``[N]`` and, per name, which rows hold one (``[N]`` bool, on the host)."""

    def __init__(self, n: int, device):
        self.n, self.device = n, device
        self.values: dict[str, torch.Tensor] = {}
        self.done: dict[str, torch.Tensor] = {}

    def missing(self, want: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
        """The rows to compute so that every ``want`` row holds every name (:func:`blocks`)."""
        done = torch.ones(self.n, dtype=torch.bool)
        for name in names:
            done &= self.done.get(name, torch.zeros(self.n, dtype=torch.bool))
        return blocks(want, done)

    def put(self, rows: torch.Tensor, **values: torch.Tensor) -> None:
        """Store each name's values ``[r]`` of ``rows`` ``[r]``; a row that holds one already keeps it (a value,
        once read, never changes under a method that read it)."""
        for name, value in values.items():
            if name not in self.values:
                fill = False if value.dtype == torch.bool else float("nan")
                self.values[name] = torch.full((self.n,), fill, dtype=value.dtype, device=self.device)
                self.done[name] = torch.zeros(self.n, dtype=torch.bool)
            new = ~self.done[name][rows]
            self.values[name][rows[new].to(self.device)] = value[new.to(value.device)]
            self.done[name][rows[new]] = True


def summarise(logits: torch.Tensor, targets: torch.Tensor, derived: Sequence[str]) -> dict[str, torch.Tensor]:
    """A readout's summary per row (``logits`` ``[r, V]``, ``targets`` ``[r]``): :data:`SUMMARY`
    (:func:`~emad.engine.fused.readout_scores`, one fused kernel) and each ``derived`` value, from the kernel that
    gives it with the summary (:data:`DERIVED`; the summary is the first one's)."""
    kernels = [DERIVED[name](logits, targets) for name in derived] or [readout_scores(logits, targets)]
    return dict(zip(SUMMARY, kernels[0])) | {name: out[len(SUMMARY)] for name, out in zip(derived, kernels)}


class Rows:
    """A batch's shared full-depth states and what the sweep's methods read from them (module docstring).

    Args:
        states: kept layer → ``[N, d]`` states after it.
        positions: ``[N]`` position ids; targets: ``[N]`` each row's next token.
        segments: which rows belong to which continuation.
        views: readout key → (stack reading through it, its cost model), shared with the sweep.
    """

    def __init__(self, states: dict[int, torch.Tensor], positions: torch.Tensor, targets: torch.Tensor,
                 segments: Segments, views: dict):
        self.states_at, self.positions, self.targets, self.segments = states, positions, targets, segments
        self.views = views
        self.n, self.device = len(targets), targets.device
        self._values: dict[tuple, RowValues] = {}  # (canonical readout, probe) or (.., estimator key, probe)
        self._raw: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (canonical, probe) -> (slot of row, logits)
        self._whole: dict[tuple, Estimate] = {}  # (readout, estimator key, sequence, probe) -> its estimate
        self._sequence_at: dict[tuple, tuple] = {}  # (readout, estimator key, sequence) -> its last probe, estimator
        self._memos: dict[tuple, dict] = {}  # (readout, estimator key) -> what criteria derive, shared
        self._estimators: dict[int, object] = {}  # the fitted estimators keyed by id: alive while these are
        self.work: Counter[str] = Counter()  # FLOPs computed, by kind (readouts, estimators): the sweep's own

    # ------------------------------------------------------------------ what methods read
    def bind(self, method: Method, key: tuple) -> MethodRows:
        """``method``'s view of the rows (its readout ``key``)."""
        self._estimators.setdefault(id(method.estimator), method.estimator)
        memo = self._memos.setdefault((key, estimator_key(method.estimator)), {})
        return MethodRows(self, method, key, memo)

    def canonical(self, key: tuple, probe: int) -> tuple:
        return canonical(self.views, key, probe)

    def readout(self, key: tuple, probe: int, want: torch.Tensor, names: Sequence[str] = SUMMARY,
                raw: torch.Tensor | None = None) -> RowValues:
        """The summary of ``key``'s readout at ``probe`` (:func:`summarise`), holding ``names`` for every ``want``
        row (``[N]`` bool); with ``raw`` (``[N]`` bool, whole blocks), those rows' logits too, kept until
        :meth:`release` (:meth:`logits`). Every row read out is summarised: rows read for their logits cost no
        second readout."""
        canon = self.canonical(key, probe)
        store = self._values.setdefault((canon, probe), RowValues(self.n, self.device))
        names = sorted(set(SUMMARY) | set(names))
        todo = store.missing(want, names)
        slot, held = self._raw.get((canon, probe), (torch.full((self.n,), -1, dtype=torch.long), None))
        fetch = raw & (slot < 0) if raw is not None else torch.zeros(self.n, dtype=torch.bool)
        if bool(fetch.any()):
            todo = torch.unique(torch.cat([todo, fetch.nonzero()[:, 0]]))
        if not len(todo):
            return store
        view = self.views[key][0]
        derived = [name for name in names if name in DERIVED]
        kept = [] if held is None else [held]
        self.work["readouts"] += len(todo) * self.views[key][1].readout_at(probe)[0]
        for rows in chunks(todo):
            dev = rows.to(self.device)
            logits = view.readout(self.states_at[probe][dev], probe)  # [r, V]
            store.put(rows, **summarise(logits, self.targets[dev], derived))
            mine = fetch[rows]
            if bool(mine.any()):
                slot[rows[mine]] = torch.arange(int(mine.sum())) + sum(len(x) for x in kept)
                kept.append(logits if bool(mine.all()) else logits[mine.to(self.device)])  # all: no copy
        if kept:
            self._raw[canon, probe] = slot, torch.cat(kept) if len(kept) > 1 else kept[0]
        return store

    def logits(self, key: tuple, probe: int) -> RowLogits:
        """The logits kept by :meth:`readout` (``raw``) at ``probe``, addressed by row."""
        return RowLogits(*self._raw[self.canonical(key, probe), probe], self.n, self.device)

    def estimate(self, method: Method, key: tuple, probe: int, live: torch.Tensor) -> Estimate:
        """``method``'s estimate at ``probe`` for every row ``[N]`` (rows it does not run there: NaN)."""
        estimator = method.estimator
        if isinstance(estimator, Exact):
            return self._exact(method, key, probe, live)
        if whole_rows(estimator):
            return self._whole_rows(method, key, probe)
        store = self._values.setdefault((self.canonical(key, probe), estimator_key(estimator), probe),
                                        RowValues(self.n, self.device))
        todo = store.missing(live, ("entropy", "max_prob"))
        cost = self.views[key][1]
        self.work["estimators"] += len(todo) * (estimator.probe_cost(cost)[0] + cost.translation(probe)[0])
        for rows in chunks(todo):
            est = estimator.estimate(self.views[key][0], self.states_at[probe][rows.to(self.device)], probe,
                                     rows.to(self.device))
            store.put(rows, entropy=est.entropy.float(), max_prob=est.max_prob.float())
        return Estimate(store.values["entropy"], store.values["max_prob"])

    def _exact(self, method: Method, key: tuple, probe: int, live: torch.Tensor) -> Estimate:
        """The exact estimate: the readout's own entropy (the exit scores are its too: ``read_out``). A criterion
        that reads the logits gets them (:class:`RowLogits`), unless everything it derives from them is in the
        summary (:data:`DERIVED`): then it finds that in its memo."""
        criterion = method.criterion
        derived = criterion.derived_from_logits(probe) if criterion.needs_logits else ()
        served = derived is not None and all(name in DERIVED for name, *_ in derived)
        store = self.readout(key, probe, live, [name for name, *_ in derived or ()] if served else SUMMARY,
                             None if served else self.raw_rows(live))
        memo = self._memos[key, estimator_key(method.estimator)]
        for name, *rest in derived or () if served else ():
            memo[(name, *rest)] = store.values[name]  # [N], filled in place as more rows are read out
        logits = None if served else self.logits(key, probe)
        return Estimate(store.values["entropy"], store.values["max_prob"], logits, read_out=True)

    def raw_rows(self, live: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: the whole blocks of :data:`~emad.exits.criteria.MEMO_BLOCK` rows that hold a ``live``
        row (a criterion that reads the logits reads them by those blocks)."""
        out = torch.zeros(self.n, dtype=torch.bool)
        for start in (live.nonzero()[:, 0] // MEMO_BLOCK * MEMO_BLOCK).unique().tolist():
            out[start:start + MEMO_BLOCK] = True
        return out

    def _whole_rows(self, method: Method, key: tuple, probe: int) -> Estimate:
        """A stateful estimator's estimate at ``probe``, its sequence of estimated probes run on every row in
        order from a fresh state (continued from the probe before when that was the last one run)."""
        sequence = tuple(estimated_probes(method.criterion, self.views[key][0].n_layers))
        base = (key, estimator_key(method.estimator), sequence)
        if base + (probe,) in self._whole:
            return self._whole[base + (probe,)]
        at = sequence.index(probe)
        last, estimator = self._sequence_at.get(base, (None, method.estimator))  # the instance that holds its state
        todo = sequence[at:at + 1] if at and last == sequence[at - 1] else sequence[:at + 1]
        if todo[0] == sequence[0]:
            estimator = method.estimator
            estimator.begin(self.n)
        every = torch.arange(self.n, device=self.device)
        cost = self.views[key][1]
        for layer in todo:
            est = estimator.estimate(self.views[key][0], self.states_at[layer], layer, every)
            self._whole[base + (layer,)] = est
            per_row = float(est.cost[0].sum()) if est.cost is not None else self.n * estimator.probe_cost(cost)[0]
            self.work["estimators"] += per_row + self.n * cost.translation(layer)[0]
        self._sequence_at[base] = probe, estimator
        return self._whole[base + (probe,)]

    def exit_scores(self, key: tuple, probe: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` read out at ``probe``: each target's log-probability and greedy hit."""
        want = torch.zeros(self.n, dtype=torch.bool)
        want[rows.cpu()] = True
        store = self.readout(key, probe, want)
        return store.values["logprob"][rows], store.values["greedy"][rows]

    # ------------------------------------------------------------------ a probe's reads, for many methods at once
    def prepare(self, probe: int, phase: int, needs: Sequence[tuple[Method, tuple, torch.Tensor]]) -> None:
        """Read what the methods of ``needs`` (each with its readout key and rows) read next at ``probe`` in
        ``phase`` (:data:`~emad.decode.monotone.ESTIMATE` or ``EXIT``) — per readout (and estimator), the union
        of their rows in one pass — so that each method's own read finds it done."""
        groups: dict[tuple, list] = {}  # (canonical readout, estimator key or None) -> [rows, method, key, names, raw]
        for method, key, rows in needs:
            estimator, criterion = method.estimator, method.criterion
            if phase == ESTIMATE and whole_rows(estimator):
                continue  # every row, when its first method asks
            estimated = phase == ESTIMATE and not isinstance(estimator, Exact)
            group = groups.setdefault((self.canonical(key, probe), estimator_key(estimator) if estimated else None),
                                      [torch.zeros(self.n, dtype=torch.bool), method, key, set(), None])
            group[0] |= rows
            if phase == ESTIMATE and not estimated and criterion.needs_logits:
                derived = criterion.derived_from_logits(probe)
                if derived is not None and all(name in DERIVED for name, *_ in derived):
                    group[3].update(name for name, *_ in derived)
                else:
                    raw = self.raw_rows(rows)
                    group[4] = raw if group[4] is None else group[4] | raw
        for (_, est), (rows, method, key, names, raw) in groups.items():
            if est is not None:
                self.estimate(method, key, probe, rows)
            else:
                self.readout(key, probe, rows, sorted(names), raw)

    def release(self, probe: int) -> None:
        """Drop what holds a row per vocabulary entry at ``probe``: kept logits and stateful estimates."""
        for key in [k for k in self._raw if k[1] == probe]:
            del self._raw[key]
        for key in [k for k in self._whole if k[-1] == probe]:
            del self._whole[key]

    def compact(self) -> None:
        """Drop every ``[N, V]`` value still held (and memo entries of criteria that hold them, e.g. contrastive's
        per-block log-probabilities): a later sweep of these states reads them out again where it needs them; the
        per-row values stay."""
        self._raw.clear()
        self._whole.clear()
        self._sequence_at.clear()
        for memo in self._memos.values():
            for k in [k for k, v in memo.items() if _large(v)]:
                del memo[k]


def _large(value) -> bool:
    """A tensor (or a tuple holding one) with a row per vocabulary entry: ``[m, V]``."""
    if isinstance(value, (tuple, list)):
        return any(_large(v) for v in value)
    return isinstance(value, torch.Tensor) and value.dim() > 1


class RowLogits:
    """Logits of some rows of a batch, addressed by row (a slice or a LongTensor of rows): what a criterion that
    reads the logits sees in a sweep (it reads the blocks of the rows it still runs)."""

    def __init__(self, slot: torch.Tensor, logits: torch.Tensor, n: int, device):
        self.slot, self.held, self.n, self.device = slot, logits, n, device  # slot: [N] row -> its row in held
        self.dtype = logits.dtype

    def __len__(self) -> int:
        return self.n

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.held.shape[-1]

    def __getitem__(self, rows) -> torch.Tensor:
        index = self.slot[rows.cpu() if isinstance(rows, torch.Tensor) else rows]
        if bool((index < 0).any()):
            raise IndexError("a row whose logits were not read out at this probe")
        if isinstance(rows, slice) and len(index) and bool((index[1:] - index[:-1] == 1).all()):
            return self.held[int(index[0]):int(index[-1]) + 1]  # held side by side: a view, no copy
        return self.held[index.to(self.device)]


class MethodRows:
    """One method's view of a batch's rows (:class:`~emad.decode.monotone.StateSource`): every row's states and
    estimates, its exit scores, and the memo it shares with the methods that read the same (readout, estimator)."""

    def __init__(self, rows: Rows, method: Method, key: tuple, memo: dict):
        self.rows, self.method, self.key, self.memo = rows, method, key, memo
        self.positions = rows.positions

    def run_to(self, probe: int, live: torch.Tensor) -> None:
        """Nothing to run: the shared full-depth pass holds every row's states."""

    def estimate(self, k: int, probe: int, live: torch.Tensor) -> Estimate:
        return self.rows.estimate(self.method, self.key, probe, live)

    def exit_scores(self, probe: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.exit_scores(self.key, probe, rows)
