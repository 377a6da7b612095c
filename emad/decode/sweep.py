"""Score requests' continuations under many methods in one pass (a sweep), exactly as each would score alone.

Under the monotone policy with teacher forcing, a position that runs layer ℓ attends there only to earlier
positions that also ran ℓ, so every hidden state it computes is the full-depth pass's. Hence one full-depth pass,
with the hidden states kept at every probe layer, serves every per-token criterion and knob value: each method
takes its own running prefix and exit layers from the shared states (:func:`emad.decode.monotone.walk`).

A pass scores a batch of requests (:meth:`Sweep.score_batch`): the prompts left-padded with masks as generation
pads them, each continuation after its prompt's keys (right-padded, so padding is never attended), and every
continuation's positions laid end to end as the rows of one set of states (:mod:`emad.decode.sweep_rows`). The
methods then walk their probes in step, probe by probe, over every row of the batch at once (the methods that read
the same probes through the same estimator as one walk, :func:`~emad.decode.monotone.walk_key`): at each probe each
distinct (readout, estimator) is evaluated once, on the rows some method still runs there, and the exit readouts
once on the rows that exit. A request's scores do not depend on its batch-mates beyond float rounding. Costs are
charged exactly as the single-method path charges them.

What the equivalence does not cover is refused by name (:func:`sweep_refusal`): other policies (the skipped
layers' K/V differ), strategies (EAD, speculative decoding) and criteria that read every exit's token from
themselves (``contrastive_output``). Those score alone with :func:`emad.decode.score_continuations`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import torch

from emad.decode.monotone import ESTIMATE, Exits, Segments, full_depth_flops, layer_flops, walk, walk_key
from emad.decode.results import Request, Scored
from emad.decode.score import check_context_length
from emad.decode.step import Method, as_method, elapsed, left_pad, positions_of
from emad.decode.strategy import Strategy
from emad.decode.sweep_rows import LOGIT, Rows, canonical, estimator_key
from emad.engine.cost import CostModel
from emad.engine.fused import summary
from emad.engine.stack import LayerStack
from emad.exits.criteria import Criterion

FIRST_ROWS = 256  # prompt rows read out in one head product at most, for their continuations' first tokens


def sweep_refusal(method) -> str | None:
    """Why ``method`` cannot be scored exactly from a shared full-depth pass, or None when it can."""
    if isinstance(method, Strategy):
        if method.scored_as() is not None or method.replays():
            return None  # scored as a per-token method, or replayed from the shared pass's readouts
        return f"strategy {type(method).__name__} decodes with its own models and caches"
    method = as_method(method)
    if method.policy != "monotone":
        return f"policy {method.policy!r} lets depth rise, so skipped layers' K/V differ from the full-depth pass"
    if method.criterion.reads_every_exit:
        return f"criterion {method.criterion.name!r} reads every exit's token from itself (contrastive_output)"
    return None


def _readout_key(method: Method | Strategy) -> tuple[str, str]:
    readout = method.readout
    return LOGIT if readout is None or not readout.layers else (readout.name, readout.digest)


class Sweep:
    """Many methods, checked and grouped once, scored together on any number of requests.

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
        self.stack, self.names, n = stack, names, stack.n_layers
        walked = [(i, m.scored_as() if isinstance(m, Strategy) else as_method(m)) for i, m in enumerate(methods)
                  if not (isinstance(m, Strategy) and m.scored_as() is None)]
        self.methods = [m for _, m in walked]  # walked (:func:`walk`); strategies that replay are apart
        self._order = [i for i, _ in walked] + [i for i, m in enumerate(methods) if i not in dict(walked)]
        self.replays = [m for i, m in enumerate(methods) if i not in dict(walked)]  # their readouts replayed
        self._views: dict[tuple, tuple[LayerStack, CostModel]] = {}
        digests: dict[int, tuple] = {}  # id(readout) -> its key: a shared readout is hashed once
        for method in self.methods + self.replays:
            method.validate(n)
            if id(method.readout) not in digests:
                digests[id(method.readout)] = _readout_key(method)
            key = digests[id(method.readout)]
            if key not in self._views:
                view = stack.with_readout(method.readout)
                self._views[key] = view, CostModel.from_stack(view)
        self.keys = [digests[id(m.readout)] for m in self.methods]
        self.replay_keys = [digests[id(m.readout)] for m in self.replays]
        self.depth0 = [m.criterion.prefill_depth(n) for m in self.methods]
        for name, method, depth0 in zip([names[i] for i, _ in walked], self.methods, self.depth0):
            if depth0 != method.criterion.probes(n)[-1]:
                raise ValueError(f"{name}: its prompt runs {depth0} layers, not its deepest probe")
        self.layers = sorted({p for m in self.methods for p in m.criterion.probes(n)}  # states kept here
                             | {p for m in self.replays for p in m.replay_layers(n)})
        self.work: Counter[str] = Counter()  # FLOPs computed so far, by kind: layers, readouts, estimators

    @torch.inference_mode()
    def score(self, prompt: Sequence[int], continuations: Sequence[Sequence[int]], kept: dict | None = None
              ) -> list[list[Scored]]:
        """Score each continuation after ``prompt`` under every method: :meth:`score_batch` of one request.

        Returns:
            ``[method][continuation]`` :class:`Scored`, each equal to :func:`~emad.decode.score_continuations` of
            that method alone.
        """
        return self.score_batch([(prompt, continuations)], kept)[0]

    @torch.inference_mode()
    def score_batch(self, requests: Sequence[Request], kept: dict | None = None) -> list[list[list[Scored]]]:
        """Score every request's continuations under every method, the requests in one pass.

        Args:
            requests: ``(prompt, continuations)`` each (prompts and continuations non-empty).
            kept: what earlier sweeps of the same model kept of this batch's pass (:class:`Kept`, keyed by the
                batch's requests), reused when it holds every layer this sweep needs, and filled otherwise; None
                keeps nothing. A later sweep (e.g. a screen's refinement) then runs no layer and reads out again
                only what it needs that the earlier ones did not.

        Returns:
            ``[request][method][continuation]`` :class:`Scored`, each equal to
            :func:`~emad.decode.score_continuations` of that method alone on that request alone (depths and FLOPs
            identical, log-probabilities to float rounding, wherever no estimate lies within rounding of its
            threshold). The pass's time is split evenly over the results' ``seconds``.
        """
        started = time.perf_counter()
        if not requests:
            raise ValueError("a sweep needs at least one request")
        for prompt, continuations in requests:
            if not prompt or not continuations or not all(continuations):
                raise ValueError("a sweep needs a non-empty prompt and continuations")
            for continuation in continuations:
                check_context_length(self.stack, len(prompt) + len(continuation) - 1)
        batch = tuple((tuple(p), tuple(map(tuple, cs))) for p, cs in requests)
        found = None if kept is None else kept.get(batch)
        if found is None or not found.serves(self.layers):
            found = self._pass(batch)
            if kept is not None:
                kept[batch] = found
        first = self._first_scores(found)
        if found.rows is not None:
            found.rows.work = self.work
        exits = self._exits(found.rows) if found.rows is not None and self.methods else [None] * len(self.methods)
        out = self._scored(found, first, exits, [len(cs) for _, cs in batch])
        if found.rows is not None:
            found.rows.compact()
        seconds = elapsed(self.stack.device, started) / (len(self._order) * len(found.pairs))
        for request in out:
            for row in request:
                for scored in row:
                    scored.seconds = seconds
        return out

    def _pass(self, batch: tuple) -> Kept:
        """The batch's full-depth pass: the prompts' last states and every continuation's states at each kept
        layer."""
        stack, device = self.stack, self.stack.device
        prompts = list(dict.fromkeys(p for p, _ in batch))  # each distinct prompt once
        row_of = {p: i for i, p in enumerate(prompts)}
        pairs = [(row_of[p], c) for p, cs in batch for c in cs]  # (prompt row, continuation) per continuation
        lengths = [len(p) for p in prompts]
        ids, real = left_pad(prompts, 0, device)  # [B, P]
        longest = max(len(c) for _, c in pairs) - 1  # continuation inputs: every token but the last
        cache = stack.new_cache(len(prompts), ids.shape[1] + longest)
        states = self._run(cache, ids, positions_of(real), cache.allocate(real))
        self.work["layers"] += sum(self._layer_flops(0, n) for n in lengths)
        last = {layer: h[:, -1] for layer, h in states.items()}  # [B, d] each prompt's last position
        scored = [(row, c) for row, c in pairs if len(c) > 1]  # continuations with a position after the first
        if not scored:
            return Kept(last, None, pairs, lengths)
        rows = torch.tensor([row for row, _ in scored], device=device)  # [C] each continuation's prompt row
        if len(scored) != len(prompts) or bool((rows != torch.arange(len(prompts), device=device)).any()):
            cache = cache.take(rows)  # a row per continuation, its prompt's keys copied
        x = torch.zeros(len(scored), longest, dtype=torch.long)  # [C, M] inputs, right-padded
        real = torch.zeros(len(scored), longest, dtype=torch.bool)
        for i, (_, c) in enumerate(scored):
            x[i, :len(c) - 1] = torch.tensor(c[:-1])
            real[i, :len(c) - 1] = True
        x, real = x.to(device), real.to(device)
        start = torch.tensor([lengths[row] for row, _ in scored], device=device)  # [C]
        positions = start[:, None] + torch.arange(longest, device=device)[None]  # [C, M]
        states = self._run(cache, x, positions, cache.allocate(real))
        self.work["layers"] += sum(self._layer_flops(lengths[row], len(c) - 1) for row, c in scored)
        states = {layer: h[real] for layer, h in states.items()}  # [N, d] the real rows, continuation by continuation
        targets = torch.tensor([t for _, c in scored for t in c[1:]], device=device)  # [N]
        rows = Rows(states, positions[real], targets, Segments([len(c) - 1 for _, c in scored]), self._views)
        return Kept(last, rows, pairs, lengths)

    def _layer_flops(self, before: int, n: int) -> int:
        """FLOPs of ``n`` real tokens after ``before`` others through the kept layers (token i attends to
        ``before + i + 1`` keys; padding, which the pass also runs, not counted)."""
        cost, depth = self._views[self.keys[0]][1], self.layers[-1]
        keys = n * before + n * (n + 1) // 2
        return 2 * n * sum(cost.layer_params[:depth]) + 4 * cost.d_model * depth * keys

    def _first_scores(self, found: Kept) -> dict[tuple, tuple[list[float], list[bool], list[float]]]:
        """``(readout key, depth) ->`` each continuation's first-token log-probability, greedy hit and the readout's
        entropy, read out of its prompt's last state at that depth (each method's depth0, each replayed strategy's
        layers) — once per canonical readout and depth (readouts without a translator at a layer read out as the
        logit lens there), the depths of one readout in head products of at most :data:`FIRST_ROWS` rows. Not kept
        across sweeps: a prompt's ``[V]`` rows per depth would outweigh everything else a screen keeps of it."""
        needs = [*zip(self.keys, self.depth0),
                 *((key, d) for key, m in zip(self.replay_keys, self.replays) for d in m.replay_layers(
                     self.stack.n_layers))]
        wanted: dict[tuple, tuple] = {}  # (canonical readout, depth) -> the first key that reads it there
        for key, depth in needs:
            wanted.setdefault((canonical(self._views, key, depth), depth), key)
        depths: dict[tuple, list[int]] = {}  # key -> the depths its view reads out
        for (_, depth), key in wanted.items():
            depths.setdefault(key, []).append(depth)
        prompt_rows = torch.tensor([row for row, _ in found.pairs], device=self.stack.device)  # [C]
        tokens = torch.tensor([c[0] for _, c in found.pairs], device=self.stack.device)  # [C]
        read: dict[tuple, tuple[list[float], list[bool], list[float]]] = {}
        n_prompts = len(found.lengths)
        for key, these in depths.items():
            per = max(1, FIRST_ROWS // n_prompts)  # depths per head product
            for at in range(0, len(these), per):
                group = these[at:at + per]
                logits = self._views[key][0].readouts({d: found.last[d] for d in group})  # depth -> [B, V]
                cost = self._views[key][1]
                self.work["readouts"] += n_prompts * sum(cost.readout_at(d)[0] for d in group)
                for depth, rows in logits.items():
                    logp = torch.log_softmax(rows.float(), -1)[prompt_rows]  # [C, V]
                    best = rows.argmax(-1)[prompt_rows]  # [C]
                    entropy = summary(rows)[0][prompt_rows] if self.replays else best  # [C] (replays read it)
                    read[canonical(self._views, key, depth), depth] = (
                        logp.gather(-1, tokens[:, None])[:, 0].tolist(), (best == tokens).tolist(), entropy.tolist())
        return {(key, depth): read[canonical(self._views, key, depth), depth] for key, depth in needs}

    def _exits(self, rows: Rows) -> list[Exits]:
        """Every method's exits on the batch's rows: the methods walk their probes in step (:func:`walk`; those that
        read the same probes through the same estimator walk together, :func:`walk_key`), each probe's reads
        prepared for all of them at once (:meth:`Rows.prepare`), its logits dropped once read."""
        n_layers, dtype = self.stack.n_layers, self.stack.dtype
        together: dict[tuple, list[int]] = {}  # walk key -> the methods that walk together
        for i, (method, key) in enumerate(zip(self.methods, self.keys)):
            shared = walk_key(method, n_layers, key, estimator_key(method.estimator))
            together.setdefault(("alone", i) if shared is None else shared, []).append(i)
        groups = list(together.values())
        walks = [walk([self.methods[i] for i in group], rows.bind(self.methods[group[0]], self.keys[group[0]]),
                      rows.targets, n_layers, self._views[self.keys[group[0]]][1], dtype, rows.segments)
                 for group in groups]
        pending, done = {}, {}

        def advance(g: int) -> None:
            try:
                pending[g] = walks[g].send(None)
            except StopIteration as finished:
                pending.pop(g, None)
                done.update(zip(groups[g], finished.value))

        for g in range(len(walks)):
            advance(g)
        while pending:
            probe, phase = min((need.probe, need.phase) for need in pending.values())
            ready = [g for g, need in pending.items() if (need.probe, need.phase) == (probe, phase)]
            rows.prepare(probe, phase, [(self.methods[groups[g][0]], self.keys[groups[g][0]], pending[g].rows)
                                        for g in ready])
            for g in ready:
                advance(g)
            if phase == ESTIMATE:
                rows.release(probe)
        return [done[i] for i in range(len(self.methods))]

    def _scored(self, found: Kept, first: dict, exits: list[Exits | None], counts: list[int]
                ) -> list[list[list[Scored]]]:
        """``[request][method][continuation]`` :class:`Scored` (``counts``: each request's continuations) from each
        method's first-token scores and exits:
        each position's layers charged with the keys it attends (every earlier position ran at least as deep),
        and the full-depth cost of the same tokens."""
        rows = found.rows
        scored_at = {}  # continuation index -> its segment
        for i, (_, c) in enumerate(found.pairs):
            if len(c) > 1:
                scored_at[i] = len(scored_at)
        per_method = []
        for key, depth0, ex in zip(self.keys, self.depth0, exits):
            cost = self._views[key][1]
            logprobs, greedy, _ = first[key, depth0]
            readout, full0 = cost.readout_at(depth0)[0], float(cost.readout_flops)
            if ex is not None:
                segments = rows.segments
                keys = torch.tensor(found.lengths)[torch.tensor([found.pairs[i][0] for i in scored_at])]  # [S]
                keys = keys[segments.seg] + 1 + segments.local  # [N] keys each attends
                # every term is a whole number of FLOPs below 2^53, so these sums are exact in any order
                spent = layer_flops(cost, ex.depth, keys) + ex.charged  # [N]
                spent = torch.zeros(len(segments.lengths), dtype=torch.float64).index_add_(0, segments.seg, spent)
                spent, lp, gr, dp = spent.tolist(), ex.logprob.tolist(), ex.greedy.tolist(), ex.depth.tolist()
            out = []
            for i, (row, c) in enumerate(found.pairs):
                if i not in scored_at:  # a one-token continuation is read out of the prompt alone
                    out.append(Scored([logprobs[i]], [depth0], readout, full0, greedy=[greedy[i]]))
                    continue
                s = scored_at[i]
                at, m = int(rows.segments.offsets[s]), len(c) - 1
                out.append(Scored([logprobs[i], *lp[at:at + m]], [depth0, *dp[at:at + m]], readout + spent[s],
                                  full0 + float(full_depth_flops(cost, found.lengths[row] + 1, m)),
                                  greedy=[greedy[i], *gr[at:at + m]]))
            per_method.append(out)
        per_method += self._replayed(found, first, scored_at)
        per_method = [row for _, row in sorted(zip(self._order, per_method), key=lambda x: x[0])]
        result, at = [], 0
        for count in counts:
            result.append([row[at:at + count] for row in per_method])
            at += count
        return result

    def _replayed(self, found: Kept, first: dict, scored_at: dict[int, int]) -> list[list[Scored]]:
        """Each replayed strategy's :class:`Scored` per continuation, from the readouts of the shared pass at its
        layers (:meth:`~emad.decode.strategy.Strategy.replay`): the prompt's last position, then every row."""
        out = []
        for strategy, key in zip(self.replays, self.replay_keys):
            layers = strategy.replay_layers(self.stack.n_layers)
            at_rows = {}  # layer -> (entropy, logprob, greedy) of every row
            if found.rows is not None:
                for layer in layers:
                    values = found.rows.readout(key, layer, torch.ones(found.rows.n, dtype=torch.bool)).values
                    at_rows[layer] = tuple(values[name].tolist() for name in ("entropy", "logprob", "greedy"))
            scored = []
            for i, (row, c) in enumerate(found.pairs):
                reads = {}
                for layer in layers:
                    logprob, greedy, entropy = first[key, layer]
                    reads[layer] = ([entropy[i]], [logprob[i]], [greedy[i]])
                    if i in scored_at:
                        at, m = int(found.rows.segments.offsets[scored_at[i]]), len(c) - 1
                        reads[layer] = tuple(a + b[at:at + m] for a, b in zip(reads[layer], at_rows[layer]))
                scored.append(strategy.replay(reads, found.lengths[row], c, self._views[key][1]))
            out.append(scored)
        return out

    def _run(self, cache, x: torch.Tensor, positions: torch.Tensor, slots) -> dict[int, torch.Tensor]:
        """Run ``x`` ``[B, q]`` through the layers up to the deepest kept one; the states ``[B, q, d]`` after each
        kept layer."""
        h = self.stack.embed(x, positions)
        done, kept = 0, {}
        for layer in self.layers:
            h = self.stack.run(h, done, layer, cache, positions, slots)
            kept[layer], done = h, layer
        return kept


class Kept:
    """What a sweep keeps of one batch's full-depth pass for later sweeps of the same model: each prompt's last
    state at each kept layer ``[B, d]``, the continuations' rows (:class:`~emad.decode.sweep_rows.Rows`: states
    ``[N, d]`` per kept layer and the per-row values read from them, without ``[N, V]`` readouts; None when every
    continuation is one token), each continuation's prompt row, and each prompt's length."""

    def __init__(self, last: dict[int, torch.Tensor], rows: Rows | None, pairs: list[tuple[int, tuple]],
                 lengths: list[int]):
        self.last, self.rows, self.pairs, self.lengths = last, rows, pairs, lengths

    def serves(self, layers: Sequence[int]) -> bool:
        """Every layer a sweep keeps states at is here."""
        return set(layers) <= set(self.last)


def score_sweep(stack: LayerStack, prompt: Sequence[int], continuations: Sequence[Sequence[int]],
                methods: Sequence[Method | Criterion]) -> list[list[Scored]]:
    """Score ``continuations`` after ``prompt`` under every method in one pass (:class:`Sweep`).

    Returns:
        ``[method][continuation]`` :class:`Scored`, each equal to :func:`~emad.decode.score_continuations` of that
        method alone (depths identical, log-probabilities to float rounding, FLOPs equal).
    """
    return Sweep(stack, methods).score(prompt, continuations)
