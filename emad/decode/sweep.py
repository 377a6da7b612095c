"""Score one prompt's continuations under many methods in one pass (a sweep), exactly as each would score alone.

Under the monotone policy with teacher forcing, a position that runs layer ℓ attends there only to earlier
positions that also ran ℓ, so every hidden state it computes is the full-depth pass's. Hence one full-depth pass,
with the hidden states kept at every probe layer, serves every per-token criterion and knob value: each method
takes its own running prefix and exit layers from the shared states (:func:`emad.decode.monotone.monotone_exits`).
Each distinct (readout, estimator) is evaluated once per probe over all positions and sliced per method; the exit
readouts are shared the same way. Costs are charged exactly as the single-method path charges them.

What the equivalence does not cover is refused by name (:func:`sweep_refusal`): other policies (the skipped
layers' K/V differ), strategies (EAD, speculative decoding) and criteria that read every exit's token from
themselves (``contrastive_output``). Those score alone with :func:`emad.decode.score_continuations`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch

from emad.decode.monotone import (
    estimated_probes,
    first_scores,
    monotone_exits,
    scored_from_exits,
    target_scores,
)
from emad.decode.results import Scored
from emad.decode.score import check_context_length
from emad.decode.step import Method, as_method, elapsed, left_pad, positions_of
from emad.decode.strategy import Strategy
from emad.engine.cost import CostModel
from emad.engine.entropy import readout_summary
from emad.engine.stack import LayerStack
from emad.exits.criteria import Criterion
from emad.exits.estimators import Estimate, Exact


def sweep_refusal(method) -> str | None:
    """Why ``method`` cannot be scored exactly from a shared full-depth pass, or None when it can."""
    if isinstance(method, Strategy):
        return f"strategy {type(method).__name__} decodes with its own models and caches"
    method = as_method(method)
    if method.policy != "monotone":
        return f"policy {method.policy!r} lets depth rise, so skipped layers' K/V differ from the full-depth pass"
    if method.criterion.reads_every_exit:
        return f"criterion {method.criterion.name!r} reads every exit's token from itself (contrastive_output)"
    return None


LOGIT = ("logit", "")


def canonical(views: dict, key: tuple, probe: int) -> tuple:
    """The readout key at ``probe``: readouts without a translator there read out as the logit lens."""
    lens = views[key][0].lens
    return LOGIT if lens is None or probe not in lens.layers else key


def _readout_key(method: Method) -> tuple[str, str]:
    readout = method.readout
    return LOGIT if readout is None or not readout.layers else (readout.name, readout.digest)


def _estimator_key(estimator) -> tuple:
    """Estimators with equal keys give equal estimates on equal states (fitted ones: the same object)."""
    return (estimator.name, json.dumps(estimator.describe(), sort_keys=True, default=str),
            id(estimator) if estimator.needs_fit else None)


class Sweep:
    """Many methods, checked and grouped once, scored together on any number of prompts.

    Args:
        stack: the model (its own readout is ignored; each method reads out through its ``readout``).
        methods: per-token criteria or :class:`Method` s under the monotone policy.
        names: a name per method for error messages (default ``method 0``, ``method 1``, ...).

    Raises:
        ValueError: naming the method and the reason when one cannot be served exactly (:func:`sweep_refusal`).
    """

    def __init__(self, stack: LayerStack, methods: Sequence[Method | Criterion], names: Sequence[str] | None = None):
        names = list(names) if names is not None else [f"method {i}" for i in range(len(methods))]
        if len(names) != len(methods):
            raise ValueError(f"{len(names)} names for {len(methods)} methods")
        if not methods:
            raise ValueError("a sweep needs at least one method")
        for name, method in zip(names, methods):
            reason = sweep_refusal(method)
            if reason:
                raise ValueError(f"{name}: cannot be scored in a sweep ({reason}); score it alone with "
                                 f"score_continuations")
        self.stack, self.names = stack, names
        self.methods = [as_method(m) for m in methods]
        self._views: dict[tuple, tuple[LayerStack, CostModel]] = {}
        self.keys, digests = [], {}  # id(readout) -> its key: a shared readout is hashed once
        for method in self.methods:
            method.validate(stack.n_layers)
            if id(method.readout) not in digests:
                digests[id(method.readout)] = _readout_key(method)
            key = digests[id(method.readout)]
            if key not in self._views:
                view = stack.with_readout(method.readout)
                self._views[key] = view, CostModel.from_stack(view)
            self.keys.append(key)
        n = stack.n_layers
        self.depth0 = [m.criterion.prefill_depth(n) for m in self.methods]
        for name, method, depth0 in zip(names, self.methods, self.depth0):
            if depth0 != method.criterion.probes(n)[-1]:
                raise ValueError(f"{name}: its prompt runs {depth0} layers, not its deepest probe")
        self.layers = sorted({p for m in self.methods for p in m.criterion.probes(n)})  # states kept here

    @torch.inference_mode()
    def score(self, prompt: Sequence[int], continuations: Sequence[Sequence[int]], kept: dict | None = None
              ) -> list[list[Scored]]:
        """Score each continuation after ``prompt`` under every method.

        Args:
            kept: what earlier sweeps of the same model kept of this prompt's pass (:class:`Kept`, keyed by the
                prompt), reused when it holds every layer and continuation this sweep needs, and filled
                otherwise; None keeps nothing. A later sweep (e.g. a screen's refinement) then runs no layer and
                reads out again only what needs the logits themselves.

        Returns:
            ``[method][continuation]`` :class:`Scored`, each equal to
            :func:`~emad.decode.score_continuations` of that method alone. The pass's time is split evenly over
            the results' ``seconds``.
        """
        started = time.perf_counter()
        if not prompt or not continuations or not all(continuations):
            raise ValueError("a sweep needs a non-empty prompt and continuations")
        for continuation in continuations:
            check_context_length(self.stack, len(prompt) + len(continuation) - 1)
        stack, n_prompt = self.stack, len(prompt)
        found = None if kept is None else kept.get(tuple(prompt))
        if found is None or not found.serves(self.layers, continuations):
            cache = stack.new_cache(1, n_prompt + max(len(c) for c in continuations))
            ids, real = left_pad([prompt], 0, stack.device)
            last = self._run(cache, ids, positions_of(real), cache.allocate(real))
            found = Kept({layer: h[0, -1] for layer, h in last.items()}, {}, cache)  # [d] the prompt's last position
            if kept is not None:
                kept[tuple(prompt)] = found
        first = self._first_readouts(found.last)
        scores: dict[int, tuple[torch.Tensor, int]] = {}  # id(readout [V]) -> its first_scores, once per readout
        for logits in first.values():
            if id(logits) not in scores:
                scores[id(logits)] = first_scores(logits)
        first = {k: scores[id(logits)] for k, logits in first.items()}
        out: list[list[Scored]] = [[] for _ in self.methods]
        for continuation in continuations:
            shared = None
            if len(continuation) > 1:
                shared = found.shared.get(tuple(continuation))
                if shared is None:
                    shared = self._pass(found.cache, n_prompt, continuation)
                    found.shared[tuple(continuation)] = shared
                shared.views = self._views
            for j, (method, key, depth0) in enumerate(zip(self.methods, self.keys, self.depth0)):
                view, cost = self._views[key]
                exits = None
                if shared is not None:
                    exits = monotone_exits(method, shared.bind(method, key), shared.targets, stack.n_layers, cost,
                                           stack.dtype)
                out[j].append(scored_from_exits(continuation, first[key, depth0], depth0, exits, cost, n_prompt))
            if shared is not None:
                shared.compact()
        found.cache = None  # the K/V of a pass is not kept: every continuation's states are
        seconds = elapsed(stack.device, started) / (len(self.methods) * len(continuations))
        for row in out:
            for scored in row:
                scored.seconds = seconds
        return out

    def _first_readouts(self, last: dict[int, torch.Tensor]) -> dict[tuple, torch.Tensor]:
        """``(readout key, depth0) -> [V]``: the readout of the prompt's last state (``last``: layer -> ``[d]``)
        that predicts each continuation's first token, for every method's readout and prompt depth — read once per
        canonical readout and depth (readouts without a translator at a layer read out as the logit lens there),
        one head product per readout over every depth it reads. Not kept across sweeps: a prompt's ``[V]`` rows
        per depth would outweigh everything else a screen keeps of it."""
        wanted: dict[tuple, tuple] = {}  # (canonical readout, depth0) -> the first key that reads it there
        for key, depth0 in zip(self.keys, self.depth0):
            wanted.setdefault((canonical(self._views, key, depth0), depth0), key)
        depths: dict[tuple, list[int]] = {}  # key -> the depths its view reads out
        for (_, depth0), key in wanted.items():
            depths.setdefault(key, []).append(depth0)
        read: dict[tuple, torch.Tensor] = {}  # (canonical readout, depth0) -> [V]
        for key, these in depths.items():
            logits = self._views[key][0].readouts({depth0: last[depth0][None] for depth0 in these})  # -> [1, V]
            read |= {(canonical(self._views, key, depth0), depth0): row[0] for depth0, row in logits.items()}
        return {(key, depth0): read[canonical(self._views, key, depth0), depth0]
                for key, depth0 in zip(self.keys, self.depth0)}

    def _pass(self, cache, n_prompt: int, continuation: Sequence[int]) -> _Shared:
        """The full-depth states of ``continuation`` after the prompt in ``cache`` (cropped back to the prompt)."""
        cache.crop(n_prompt)
        stack = self.stack
        x = torch.tensor([list(continuation[:-1])], dtype=torch.long, device=stack.device)  # [1, m]
        positions = torch.arange(n_prompt, n_prompt + x.shape[1], device=stack.device)  # [m]
        states = self._run(cache, x, positions[None], cache.allocate(torch.ones_like(x, dtype=torch.bool)))
        targets = torch.tensor(list(continuation[1:]), dtype=torch.long, device=stack.device)  # [m]
        return _Shared({layer: h[0] for layer, h in states.items()}, positions, targets, self._views)

    def _run(self, cache, x: torch.Tensor, positions: torch.Tensor, slots) -> dict[int, torch.Tensor]:
        """Run ``x`` ``[1, q]`` through the layers up to the deepest kept one; the states ``[1, q, d]`` after each
        kept layer."""
        h = self.stack.embed(x, positions)
        done, kept = 0, {}
        for layer in self.layers:
            h = self.stack.run(h, done, layer, cache, positions, slots)
            kept[layer], done = h, layer
        return kept


class Kept:
    """What a sweep keeps of one prompt's full-depth pass for later sweeps of the same model: the prompt's last
    state at each kept layer ``[d]``, each continuation's :class:`_Shared` (states ``[m, d]`` per kept layer and
    what was derived from them, without the ``[m, V]`` readouts) and, while the pass runs, its K/V cache."""

    def __init__(self, last: dict[int, torch.Tensor], shared: dict[tuple, _Shared], cache):
        self.last, self.shared, self.cache = last, shared, cache

    def serves(self, layers: Sequence[int], continuations: Sequence[Sequence[int]]) -> bool:
        """Every layer a sweep keeps states at, and every continuation it scores, are here."""
        return set(layers) <= set(self.last) and all(tuple(c) in self.shared for c in continuations if len(c) > 1)


def _large(value) -> bool:
    """A tensor (or a tuple holding one) with a row per vocabulary entry: ``[m, V]``."""
    if isinstance(value, (tuple, list)):
        return any(_large(v) for v in value)
    return isinstance(value, torch.Tensor) and value.dim() > 1


class _Shared:
    """The shared full-depth states of one continuation, with estimates, readouts and exit scores over all its
    positions memoised per (readout, estimator) and handed whole to each method (criteria decide per row; a method
    reads the rows of its running prefix)."""

    def __init__(self, states: dict[int, torch.Tensor], positions: torch.Tensor, targets: torch.Tensor,
                 views: dict):
        self.states_at, self.positions, self.targets, self.views = states, positions, targets, views
        self._estimates: dict[tuple, Estimate] = {}
        self._readouts: dict[tuple, torch.Tensor] = {}
        self._scores: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._memos: dict[tuple, dict] = {}
        self._estimators: dict[int, object] = {}  # the fitted estimators keyed by id: alive while these are
        self._read: set[tuple] | None = set()  # readout keys read out at every layer at once (None: compacted)

    def bind(self, method: Method, key: tuple) -> _MethodSource:
        self._estimators.setdefault(id(method.estimator), method.estimator)
        memo = self._memos.setdefault((key, _estimator_key(method.estimator)), {})
        return _MethodSource(self, method, key, memo)

    def estimates(self, method: Method, key: tuple, probe: int) -> Estimate:
        """The method's estimate at ``probe`` over all positions (a stateful estimator runs its whole sequence of
        estimated probes once, from a fresh state)."""
        estimator = method.estimator
        n = len(self.positions)
        sequence = tuple(estimated_probes(method.criterion, self.views[key][0].n_layers))
        base = (key, _estimator_key(estimator))
        if not estimator.stateful:
            memo = (self.canonical(key, probe), *base[1:], probe)
            if isinstance(estimator, Exact):  # its logits are the exit readout's: handed only to criteria that
                if memo not in self._estimates:  # read them (the others' exits read the exit scores)
                    entropy, _, max_prob = readout_summary(self.readout(key, probe))
                    self._estimates[memo] = Estimate(entropy, max_prob, read_out=True)
                est = self._estimates[memo]
                return (Estimate(est.entropy, est.max_prob, self.readout(key, probe), read_out=True)
                        if method.criterion.needs_logits and not self._derived(method, key, probe) else est)
            if memo not in self._estimates:
                self._estimates[memo] = estimator.estimate(self.views[key][0], self.states_at[probe], probe,
                                                           torch.arange(n, device=self.positions.device))
            return self._estimates[memo]
        memo = base + (sequence, probe)
        if memo not in self._estimates:
            estimator.begin(n)
            for layer in sequence:
                self._estimates[base + (sequence, layer)] = estimator.estimate(
                    self.views[key][0], self.states_at[layer], layer, torch.arange(n, device=self.positions.device))
        return self._estimates[memo]

    def _derived(self, method: Method, key: tuple, probe: int) -> bool:
        """Whether the memo already holds all that ``method``'s criterion derives from the readout at ``probe``
        (an earlier method, or an earlier sweep of these states, computed it): then it is handed no logits."""
        wanted = method.criterion.derived_from_logits(probe)
        memo = self._memos.get((key, _estimator_key(method.estimator)), {})
        return wanted is not None and all(k in memo for k in wanted)

    def compact(self) -> None:
        """Drop what holds a row per vocabulary entry (readouts, estimates and memo entries ``[m, V]``): a later
        sweep that needs them reads them out again from the states; the per-position values stay."""
        self._readouts.clear()
        self._read = None
        self._estimates = {k: e for k, e in self._estimates.items() if e.logits is None}
        for memo in self._memos.values():
            for k in [k for k, v in memo.items() if _large(v)]:
                del memo[k]

    def canonical(self, key: tuple, probe: int) -> tuple:
        return canonical(self.views, key, probe)

    def readout(self, key: tuple, probe: int) -> torch.Tensor:
        """The states at ``probe`` read out through ``key``'s readout ``[m, V]``. The first time a readout is asked
        for, every kept layer it reads is read out at once (one head product: the sweep reads nearly all of them);
        after :meth:`compact`, only what is asked for."""
        canon = self.canonical(key, probe)
        if (canon, probe) not in self._readouts:
            view = self.views[key][0]
            if self._read is not None and canon not in self._read:
                self._read.add(canon)
                layers = [layer for layer in self.states_at if self.canonical(key, layer) == canon]
                read = view.readouts({layer: self.states_at[layer] for layer in layers})
                self._readouts.update({(canon, layer): logits for layer, logits in read.items()})
            else:
                self._readouts[canon, probe] = view.readout(self.states_at[probe], probe)  # [m, V]
        return self._readouts[canon, probe]

    def exit_scores(self, key: tuple, probe: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's target log-probability and greedy hit when read out at ``probe`` (``[m]`` each)."""
        memo = self.canonical(key, probe), probe
        if memo not in self._scores:
            self._scores[memo] = target_scores(self.readout(key, probe), self.targets)
        return self._scores[memo]


class _MethodSource:
    """One method's view of the shared states: every position's states and estimates, its running prefix's exit
    scores, and the memo it shares with the methods that read the same (readout, estimator)."""

    def __init__(self, shared: _Shared, method: Method, key: tuple, memo: dict):
        self.shared, self.method, self.key, self.memo = shared, method, key, memo
        self.positions = shared.positions

    def run_to(self, probe: int, running: int) -> None:
        """Nothing to run: the shared full-depth pass holds every position's states."""

    def estimate(self, k: int, probe: int, running: int) -> Estimate:
        return self.shared.estimates(self.method, self.key, probe)

    def exit_scores(self, probe: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        logprob, greedy = self.shared.exit_scores(self.key, probe)
        return logprob[lo:hi], greedy[lo:hi]


def score_sweep(stack: LayerStack, prompt: Sequence[int], continuations: Sequence[Sequence[int]],
                methods: Sequence[Method | Criterion]) -> list[list[Scored]]:
    """Score ``continuations`` after ``prompt`` under every method in one pass (:class:`Sweep`).

    Returns:
        ``[method][continuation]`` :class:`Scored`, each equal to :func:`~emad.decode.score_continuations` of that
        method alone (depths identical, log-probabilities to float rounding, FLOPs equal).
    """
    return Sweep(stack, methods).score(prompt, continuations)
