"""Shards of a domain's teacher-forced requests: the screen's work split so that one domain fills many workers.

A teacher-forced task's requests (perplexity windows, agreement prompts, cloze and choice items) are scored in
batches by the sweep (:class:`emad.decode.Sweep`, one pass a batch; the batches depend on the requests alone,
:mod:`emad.decode.batches`). A shard is a list of batches: every ``count``-th batch of each task, starting at
``index`` (interleaved, so that each shard holds a share of every task); :func:`merge` puts the shards' scores back
in request order, so the scores — and every number made from them — are those of one process scoring every batch. A method the sweep does not serve scores its requests
as one batch (:func:`emad.decode.score_requests`), whose floats depend on the batch: such methods are not split but
spread, each scored whole by one shard (:meth:`Shard.owns`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from emad.decode.results import Scored

# method label -> teacher-forced task -> (the task's request count, {request index: its continuations' scores})
ShardScores = dict[str, dict[str, tuple[int, dict[int, list[Scored]]]]]


@dataclass(frozen=True)
class Shard:
    """Every ``count``-th batch of each task, from ``index`` (``Shard(0, 1)``: every batch)."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} of {self.count}: need count >= 1 and 0 <= index < count")

    def indices(self, n: int) -> list[int]:
        """This shard's indices among ``n`` (a task's batches)."""
        return list(range(self.index, n, self.count))

    def owns(self, j: int) -> bool:
        """Whether the ``j``-th of the methods a shard cannot split (scored token by token, as one batch) is this
        shard's to score whole."""
        return j % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index + 1}/{self.count}"


WHOLE = Shard()


def shards_per_domain(workers: int, domains: int) -> int:
    """How many shards each domain's screen is cut into so that ``workers`` all get work: one per worker spread
    over the domains (at least one; one worker or as many domains as workers: one)."""
    if workers < 1 or domains < 1:
        raise ValueError(f"workers {workers} and domains {domains}: need at least one of each")
    return max(1, math.ceil(workers / domains))


def merge(parts: list[ShardScores]) -> dict[str, dict[str, list[list[Scored]]]]:
    """The shards' scores in request order: ``{method: {task: [[Scored per continuation] per request]}}``, as one
    process scoring every request gives them. Raises ValueError when a request is missing or scored twice, or
    the shards disagree on a task's request count."""
    out: dict[str, dict[str, list[list[Scored]]]] = {}
    sizes: dict[tuple[str, str], int] = {}
    found: dict[tuple[str, str], dict[int, list[Scored]]] = {}
    for part in parts:
        for name, tasks in part.items():
            out.setdefault(name, {})  # a method on a domain without teacher-forced tasks: no task, still a method
            for task, (n, rows) in tasks.items():
                key = (name, task)
                if sizes.setdefault(key, n) != n:
                    raise ValueError(f"{name} on {task}: shards disagree on the request count ({sizes[key]}, {n})")
                have = found.setdefault(key, {})
                twice = sorted(set(have) & set(rows))
                if twice:
                    raise ValueError(f"{name} on {task}: requests {twice[:5]} scored by two shards")
                have.update(rows)
    for (name, task), rows in found.items():
        missing = sorted(set(range(sizes[name, task])) - set(rows))
        if missing:
            raise ValueError(f"{name} on {task}: requests {missing[:5]} scored by no shard")
        out.setdefault(name, {})[task] = [rows[i] for i in range(sizes[name, task])]
    return out


def groups(jobs: list[tuple[str, str, float]], count: int) -> list[frozenset[str]]:
    """A domain's run phase in at most ``count`` groups of job labels, from ``(label, family, weight)`` per job: a
    family's jobs stay together (its C2 candidates are timed in turn, and a candidate that decides C2 spares the
    later ones), families placed heaviest first on the lightest group (ties: the first), so that the groups' summed
    weights — the work they are expected to take — are close. The groups depend on the jobs alone, in a fixed
    order; empty groups are left out."""
    if count < 1:
        raise ValueError(f"run groups: need count >= 1, got {count}")
    weight: dict[str, float] = {}
    members: dict[str, list[str]] = {}
    for label, family, w in jobs:
        weight[family] = weight.get(family, 0.0) + w
        members.setdefault(family, []).append(label)
    loads, out = [0.0] * count, [[] for _ in range(count)]
    for family in sorted(weight, key=lambda f: (-weight[f], f)):
        k = loads.index(min(loads))
        loads[k] += weight[family]
        out[k] += members[family]
    return [frozenset(group) for group in out if group]
