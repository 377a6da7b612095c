"""Which units a decision reads: all, the selection split or the confirmation split (DESIGN.md §4).

The teacher-forced screen, point placement and C2's early stop choose on the *selection* split of each task's units
(perplexity windows, prompts, items, problems); every check of the verdict is computed on the disjoint
*confirmation* split, so that no point is judged on the data it was chosen on. Units are split by blocks of
:data:`BLOCK` consecutive units — neighbouring windows of one text, prompts cut next to each other — so that units
that share a source do not sit on both sides (adjacent windows in opposite halves would let a point's selection
and confirmation units share a passage): of blocks ``2j`` and ``2j + 1`` one goes to each split, by a coin of
``(seed, task, j)``. The split is thus balanced (the halves differ by at most one block), fixed by the seed, and the
same for a run that scored only a task's leading units (a point scored on fewer perplexity windows) as for full
depth.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ALL, SELECTION, CONFIRMATION = "all", "selection", "confirmation"
Which = Literal["all", "selection", "confirmation"]


BLOCK = 4  # consecutive units kept on one side of the split


def in_selection(seed: int, task: str, index: int) -> bool:
    """Unit ``index`` (0-based) of ``task`` belongs to the selection split under ``seed``: its block's side."""
    block = index // BLOCK
    coin = zlib.crc32(f"{seed}/{task}/{block // 2}".encode()) & 1
    return block % 2 == coin


def indices(n: int, which: Which, seed: int, task: str) -> list[int]:
    """The unit indices of ``task``'s ``n`` units in split ``which`` (``all``: every one)."""
    if which == ALL:
        return list(range(n))
    want = which == SELECTION
    return [i for i in range(n) if in_selection(seed, task, i) == want]


@dataclass(frozen=True)
class Units:
    """A unit selector: the split ``which`` under ``seed``."""

    which: Which = CONFIRMATION
    seed: int = 0

    def take(self, task: str, samples: Sequence) -> list:
        """The samples of ``task``'s units in this split."""
        return [samples[i] for i in indices(len(samples), self.which, self.seed, task)]

    def blocks(self, task: str, n: int) -> list[int]:
        """The split block of each of ``task``'s units in this split (of ``n``), in :meth:`take`'s order: the block
        a bootstrap resamples whole (:data:`BLOCK` consecutive units)."""
        return [i // BLOCK for i in indices(n, self.which, self.seed, task)]

    def describe(self) -> str:
        return "every unit" if self.which == ALL else f"the {self.which} split (seed {self.seed})"


def split_record(tasks: dict[str, dict], seed: int) -> dict:
    """What a run file records of the split: the seed and, per task, the unit indices of each half."""
    out: dict = {"seed": seed, "rule": f"blocks of {BLOCK} consecutive units; of blocks 2j and 2j+1 one to each "
                                       f"split, by a coin of (seed, task, j)"}
    for task, result in sorted(tasks.items()):
        samples = result.get("samples") or {}
        n = max((len(v) for v in samples.values()), default=0)
        if n:
            out[task] = {SELECTION: indices(n, SELECTION, seed, task), CONFIRMATION: indices(n, CONFIRMATION, seed, task)}
    return out
