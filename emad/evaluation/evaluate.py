"""One run: an operating point evaluated on one domain's tasks, with its cost, speed and exit depths.

:func:`prepare` loads every task's data (all bad input fails here, before any decoding); :func:`evaluate` runs
them and sums what the decode loop reported: FLOPs over every generated and scored token, bytes over generated
tokens, decoding speed over generated tokens only (scoring is a parallel pass and would flatter the number).
:func:`heatmap_inputs` picks the texts a run's token-depth heat map shows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emad.decode import Generation, Method, Scored, Sweep, score_requests
from emad.decode.batches import ONE, Batching
from emad.decode.strategy import Strategy
from emad.decode.sweep import sweep_refusal
from emad.engine.host_memory import release_free
from emad.engine.stack import LayerStack
from emad.evaluation.shards import WHOLE, Shard, ShardScores, merge
from emad.tasks.registry import TASKS, Shared


@dataclass
class Prepared:
    """A task ready to run: the task object, its validated settings and its loaded data."""

    name: str
    task: Any
    settings: Any
    data: Any


@dataclass
class Evaluation:
    """Task results and everything the decode loop produced along the way."""

    tasks: dict[str, dict]
    outputs: list[Generation | Scored] = field(default_factory=list)
    generated: dict[str, list[Generation]] = field(default_factory=dict)  # task -> the generations it made

    def generations(self) -> list[Generation]:
        return [o for o in self.outputs if isinstance(o, Generation)]

    def step_facts(self) -> dict:
        """How the point's generations stepped: ``step_path`` (the paths they took, :attr:`Generation.step_path`,
        sorted and joined; empty without decode steps) and ``host_reads_per_step`` (reads of the device per decode
        step over all of them; None without steps)."""
        gens = [g for g in self.generations() if g.decode_steps]
        steps = sum(g.decode_steps for g in gens)
        return {"step_path": ",".join(sorted({g.step_path for g in gens})),
                "host_reads_per_step": sum(g.host_reads for g in gens) / steps if steps else None}

    def depth_histogram(self) -> dict[int, int]:
        """Tokens per exit depth over all generated and scored tokens."""
        counts: Counter[int] = Counter()
        for out in self.outputs:
            rows = out.depths if isinstance(out, Generation) else [out.depths]
            for row in rows:
                counts.update(row)
        return dict(sorted(counts.items()))

    def cost(self) -> dict[str, float | None]:
        """FLOPs/bytes ratios vs full depth, the step ratio (:func:`emad.engine.cost.step_bound`: per batch step,
        its costliest row; a scored text is one row), mean depth, policy share (backfill, K/V copy, EAD catch-up),
        decoding speed, and a strategy's counts and rates."""
        gens = self.generations()
        scored = [s for s in self.outputs if isinstance(s, Scored)]
        flops = sum(_total(g.flops) for g in gens) + sum(s.flops for s in scored)
        full = sum(_total(g.full_flops) for g in gens) + sum(s.full_flops for s in scored)
        steps = [g.step_cost() for g in gens]
        step_spent = sum(s for s, _ in steps) + sum(s.flops for s in scored)
        step_full = sum(f for _, f in steps) + sum(s.full_flops for s in scored)
        gen_bytes, gen_full_bytes = sum(_total(g.bytes) for g in gens), sum(_total(g.full_bytes) for g in gens)
        gen_flops = sum(_total(g.flops) for g in gens)
        hist = self.depth_histogram()
        n_tokens = sum(hist.values())
        generated = sum(len(row) for g in gens for row in g.token_ids)
        timed = [g for g in gens if g.timed]  # a generation that reused its prompts' pass is no speed measure
        seconds = sum(g.seconds for g in timed)
        return {
            "flops_ratio": flops / full if full else None,
            "step_ratio": step_spent / step_full if step_full else None,
            "bytes_ratio": gen_bytes / gen_full_bytes if gen_full_bytes else None,
            "mean_depth": sum(d * n for d, n in hist.items()) / n_tokens if n_tokens else None,
            "backfill_share": sum(sum(g.policy_flops) for g in gens) / gen_flops if gen_flops else 0.0,
            "policy_events": float(sum(sum(g.policy_events) for g in gens)),
            "tokens": float(n_tokens),
            "generated_tokens": float(generated),
            "seconds": seconds,
            "tokens_per_s": sum(len(row) for g in timed for row in g.token_ids) / seconds if seconds > 0 else None,
            "scoring_seconds": sum(s.seconds for s in self.outputs if isinstance(s, Scored)),
            **strategy_stats(gens),
        }

    def heatmap_texts(self, tokenizer, n: int) -> list[list[tuple[str, int]]]:
        """The first ``n`` generated texts as (token text, depth) pairs."""
        texts = []
        for g in self.generations():
            for ids, depths in zip(g.token_ids, g.depths):
                if len(texts) == n:
                    return texts
                texts.append([(tokenizer.decode([t]), d) for t, d in zip(ids, depths)])
        return texts


def heatmap_inputs(stack: LayerStack, tokenizer, result: Evaluation, prepared: list[Prepared], shared: Shared,
                   n: int, limit: int | None = None) -> tuple[list, list[str] | None, list[str] | None]:
    """The heat map's texts (:meth:`Evaluation.heatmap_texts`), and beside them their prompts and full-depth
    continuations when the first free-running task judges its generations against full depth (its generations
    come first in ``result``; :meth:`~emad.tasks.registry.Task.full_depth_reference`), else None and None."""
    texts = result.heatmap_texts(tokenizer, n)
    first = next((p for p in prepared if not p.task.teacher_forced), None)
    found = (first.task.full_depth_reference(stack, tokenizer, first.data, first.settings, shared, limit)
             if first is not None and texts else None)
    if found is None:
        return texts, None, None
    prompts, reference = found
    return texts, [tokenizer.decode(p) for p in prompts[:len(texts)]], reference.texts[:len(texts)]


# Rates a strategy's counts give (numerator, denominator), reported when the denominator was counted.
STAT_RATES = {
    "acceptance_rate": ("accepted", "drafted"),
    "mean_accepted_per_verification": ("accepted", "verifications"),
    "target_passes_per_token": ("verifications", "verified_tokens"),
    "large_token_share": ("large_tokens", "ead_tokens"),
}


def strategy_stats(gens: list[Generation]) -> dict[str, float]:
    """A strategy's counts summed over generations (drafts, acceptances, large-model tokens, switches ...) and
    the rates of :data:`STAT_RATES` they give."""
    counts: Counter[str] = Counter()
    for g in gens:
        counts.update(g.stats)
    rates = {name: counts[num] / counts[den] for name, (num, den) in STAT_RATES.items() if counts.get(den)}
    return {**counts, **rates}


def _total(rows: list[list[float]]) -> float:
    return float(sum(sum(r) for r in rows))


def prepare(task_names: list[str], task_settings: dict[str, dict], corpus_dir: Path | None, tokenizer
            ) -> list[Prepared]:
    """Validate settings and load data for each task (no decoding yet)."""
    out = []
    for name in task_names:
        task = TASKS.get(name)()
        settings = task.settings(task_settings.get(name))
        out.append(Prepared(name, task, settings, task.load(settings, corpus_dir, tokenizer)))
    return out


Scores = dict[str, list[list[Scored]]]  # teacher-forced task -> per request, its continuations' scores


def score_all(stack: LayerStack, tokenizer, methods: dict[str, Method | Strategy], prepared: list[Prepared],
              shared: Shared, unserved_tokens: int | None = None, kept: dict | None = None,
              batching: Batching = ONE) -> dict[str, Scores]:
    """Every teacher-forced task's requests scored under every method: one sweep pass per batch of requests
    (``batching``, :mod:`emad.decode.batches`) for the methods a :class:`~emad.decode.Sweep` serves exactly, each
    other method alone (on the requests of its first ``unserved_tokens`` tokens where the task has a token count,
    e.g. perplexity). ``kept``: what the sweep passes keep for later calls on the same batches
    (:meth:`~emad.decode.Sweep.score_batch`), None: nothing.

    Returns:
        ``{method name: {task: [[Scored per continuation] per request]}}``, each as the method alone would score.
    """
    return merge([score_shard(stack, tokenizer, methods, prepared, shared, unserved_tokens, kept, WHOLE, batching)])


def score_shard(stack: LayerStack, tokenizer, methods: dict[str, Method | Strategy], prepared: list[Prepared],
                shared: Shared, unserved_tokens: int | None = None, kept: dict | None = None,
                shard: Shard = WHOLE, batching: Batching = ONE) -> ShardScores:
    """:func:`score_all` on the batches of ``shard`` only (:mod:`emad.evaluation.shards`: each task's requests in
    batches, every ``count``-th batch; a method the sweep does not serve: all its requests, in the one shard that
    owns it): ``{method: {task: (request count, {request index: [Scored per continuation]})}}``, merged back in
    order by :func:`~emad.evaluation.shards.merge`."""
    served = [name for name, method in methods.items() if sweep_refusal(method) is None]
    sweep = Sweep(stack, [methods[n] for n in served], served) if served else None
    out: ShardScores = {name: {} for name in methods}
    for p in prepared:
        if not p.task.teacher_forced:
            continue
        requests = p.task.requests(stack, tokenizer, p.data, p.settings, shared)
        for name in served:
            out[name][p.name] = (len(requests), {})
        batches = batching.batches(requests) if sweep else []
        for b in shard.indices(len(batches)):
            together = sweep.score_batch([requests[i] for i in batches[b]], kept)  # [request][method][continuation]
            for i, scored in zip(batches[b], together):
                for name, rows in zip(served, scored):
                    out[name][p.name][1][i] = rows
            if kept is not None:  # the pass's states stay between its freed readouts: give those pages back
                release_free(min_interval=1.0)
        alone = p.task.fewer(requests, unserved_tokens) if unserved_tokens else requests
        for j, name in enumerate(name for name in methods if name not in served):
            # a method scored token by token decodes its requests as one batch: whole, in one shard (the j-th
            # such method in shard j mod count), so its floats are those of one process scoring every request
            mine = shard.owns(j)
            out[name][p.name] = (len(alone), dict(enumerate(score_requests(stack, alone, methods[name])))
                                 if mine else {})
    return out


def evaluate(stack: LayerStack, tokenizer, method: Method, prepared: list[Prepared], shared: Shared | None = None,
             scores: Scores | None = None, limit: int | None = None) -> Evaluation:
    """Run each prepared task under ``method`` (each task decodes its prompts as one batch).

    Args:
        shared: what the domain's tasks share across points (full-depth references); new when None.
        scores: the method's teacher-forced scores from :func:`score_all` (tasks not in it score here).
        limit: free-running tasks decode only their first ``limit`` prompts (None: all).
    """
    result, shared, scores = Evaluation(tasks={}), shared or Shared(), scores or {}
    for p in prepared:
        start = len(result.outputs)
        if p.name in scores:
            result.outputs.extend(s for row in scores[p.name] for s in row)
            result.tasks[p.name] = p.task.reduce(stack, tokenizer, method, p.data, p.settings, scores[p.name],
                                                 result.outputs, limit, shared)
        else:
            result.tasks[p.name] = p.task.run(stack, tokenizer, method, p.data, p.settings, result.outputs, shared,
                                              limit)
        result.generated[p.name] = [o for o in result.outputs[start:] if isinstance(o, Generation)]
    return result
