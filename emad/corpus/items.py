"""Task items cut out of a sampled evaluation split, deterministically by seed (stage ``sample_corpus``).

``cloze`` (LAMBADA-style last word): a passage of at most ``context_tokens`` tokens, starting at a word, that
ends right before a target word of at least ``min_word_chars`` ASCII letters (preceded by one space, followed by
whitespace or one punctuation mark). The task scores the continuation ``" " + target``; the passage stops before
that space, so the target itself is never part of it. ``targets`` picks which words may be targets: ``seen``
(default), words that also occur earlier in the passage, as most LAMBADA targets do (the passage, not the last
sentence, tells the word); ``unseen``, words that do not (case-insensitive); ``any``. A target at least
``context_tokens`` tokens into its document is needed so every passage is full length.

``choice`` (multiple-choice cloze): a passage of at most ``context_tokens`` tokens ending before a space, its
true continuation and ``choices - 1`` distractors. Every choice is the longest run of whole words of at most
``continuation_tokens`` tokens that starts at a space between two words and stops before the end of its
document; distractors come from other places of the split (never from the item's own passage), and no two
choices of an item are equal after folding case and whitespace.

Items never overlap one another in the text. Candidates are shuffled with ``random.Random(f"<task>:{seed}")``:
the same split and seed give the same items, in the same order.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field

from emad.config import Section
from emad.corpus.boundaries import BOUNDARY, TAIL_CHARS_PER_TOKEN, tail_within_budget, truncate_to_budget
from emad.corpus.sources import CorpusError

CountTokens = Callable[[str], int]
Docs = Sequence[tuple[str, str]]  # (document id, text) of the eval split, in file order

SPACE_BETWEEN_WORDS = re.compile(r"(?<=\S) (?=\S)")
LETTERS = re.compile(r"[A-Za-z]+")


class ClozeBuild(Section):
    """``corpus.tasks.cloze``: last-word items.

    Attributes:
        items: how many items to build.
        context_tokens: tokens of each passage (at most; a target needs at least this many before it).
        min_word_chars: a target is a word of at least this many letters.
        targets: ``seen`` (the target word also occurs earlier in its passage), ``unseen`` (it does not) or ``any``.
    """

    items: int = Field(40, ge=1)
    context_tokens: int = Field(64, ge=1)
    min_word_chars: int = Field(3, ge=1)
    targets: Literal["seen", "unseen", "any"] = "seen"


class ChoiceBuild(Section):
    """``corpus.tasks.choice``: multiple-choice continuation items.

    Attributes:
        items: how many items to build.
        context_tokens: tokens of each passage (at most; the true continuation needs at least this many before it).
        continuation_tokens: tokens of each choice (at most).
        choices: choices per item (the true continuation and ``choices - 1`` distractors).
    """

    items: int = Field(30, ge=1)
    context_tokens: int = Field(48, ge=1)
    continuation_tokens: int = Field(8, ge=1)
    choices: int = Field(4, ge=2)


class ItemBuilds(Section):
    """``corpus.tasks``: item files built from the eval split of each source in ``sources`` (None: every sampled
    source); a task left out is not built."""

    sources: list[str] | None = None
    cloze: ClozeBuild | None = None
    choice: ChoiceBuild | None = None

    def for_source(self, source: str) -> ItemBuilds:
        """These builds when ``source`` is one of ``sources``, else none."""
        return self if self.sources is None or source in self.sources else ItemBuilds()

    def builds(self, source: str, task: str) -> bool:
        """Whether the items of ``task`` are built from ``source``."""
        return getattr(self.for_source(source), task) is not None


class _Spans:
    """Character spans taken by items, per document (items never overlap)."""

    def __init__(self) -> None:
        self.taken: dict[int, list[tuple[int, int]]] = defaultdict(list)

    def free(self, doc: int, start: int, end: int) -> bool:
        return all(end <= s or start >= e for s, e in self.taken[doc])

    def take(self, doc: int, start: int, end: int) -> None:
        self.taken[doc].append((start, end))


def _fold(text: str) -> str:
    return " ".join(text.split()).casefold()


def cloze_items(docs: Docs, count_tokens: CountTokens, build: ClozeBuild, seed: int, source: str) -> list[dict]:
    """``build.items`` records ``{"id": "<doc id>@<char of the target>", "context", "target"}`` (see module doc).

    Raises:
        CorpusError: the split yields fewer items; states the minimum passage length and the params to change.
    """
    target = re.compile(rf"(?<=\S) ([A-Za-z]{{{build.min_word_chars},}})(?=[.,;:!?]?(?:\s|$))")
    candidates = [(d, m) for d, (_, text) in enumerate(docs) for m in target.finditer(text)]
    random.Random(f"cloze:{seed}").shuffle(candidates)
    items, spans = [], _Spans()
    for d, match in candidates:
        doc_id, text = docs[d]
        space, end = match.start(), match.end(1)
        if not spans.free(d, space, end):
            continue
        cut = tail_within_budget(text[:space], build.context_tokens, count_tokens)
        if cut is None:
            continue
        context, word = cut[0], match.group(1)
        seen = word.casefold() in {w.casefold() for w in LETTERS.findall(context)}
        if build.targets != "any" and seen != (build.targets == "seen"):
            continue
        if not spans.free(d, space - len(context), end):
            continue
        spans.take(d, space - len(context), end)
        items.append({"id": f"{doc_id}@{match.start(1)}", "context": context, "target": word})
        if len(items) == build.items:
            return items
    raise CorpusError(
        f"the eval split of {source!r} yields {len(items)} cloze items, fewer than corpus.tasks.cloze.items = "
        f"{build.items}: its passages are too short. An item needs a passage of at least "
        f"corpus.tasks.cloze.context_tokens = {build.context_tokens} tokens before its target (a word of at least "
        f"{build.min_word_chars} letters, {build.targets} in the passage), and items do not overlap; lower items "
        "or context_tokens, or raise corpus.eval_tokens")


def choice_items(docs: Docs, count_tokens: CountTokens, build: ChoiceBuild, seed: int, source: str) -> list[dict]:
    """``build.items`` records ``{"id": "<doc id>@<char of the space before the true continuation>", "context",
    "choices", "answer"}`` (see module doc); ``choices[answer]`` is the true continuation.

    Raises:
        CorpusError: the split yields fewer items; states the minimum passage length and the params to change.
    """
    rng = random.Random(f"choice:{seed}")
    places = [(d, m.start()) for d, (_, text) in enumerate(docs) for m in SPACE_BETWEEN_WORDS.finditer(text)]
    order, pool = rng.sample(places, len(places)), rng.sample(places, len(places))
    heads: dict[tuple[int, int], str | None] = {}

    def continuation(d: int, at: int) -> str | None:
        """The choice starting at the space ``docs[d][1][at]``, or None when its document ends within the budget."""
        if (d, at) not in heads:
            rest = docs[d][1][at:]
            window = rest[: build.continuation_tokens * TAIL_CHARS_PER_TOKEN]
            if len(window) < len(rest) and not rest[len(window)].isspace():  # never end inside a word
                window = window[: max((m.start() for m in BOUNDARY.finditer(window)), default=0)]
            head, _ = truncate_to_budget(window, build.continuation_tokens, count_tokens)
            heads[d, at] = head if head.strip() and len(head) < len(rest.rstrip()) else None
        return heads[d, at]

    items, spans, next_pool = [], _Spans(), 0
    for d, at in order:
        answer = continuation(d, at)
        cut = tail_within_budget(docs[d][1][:at], build.context_tokens, count_tokens) if answer else None
        if cut is None or not spans.free(d, at - len(cut[0]), at + len(answer)):
            continue
        start, end = at - len(cut[0]), at + len(answer)
        chosen, seen = [], {_fold(answer)}
        for _ in range(len(pool)):
            pd, pat = pool[next_pool % len(pool)]
            next_pool += 1
            other = continuation(pd, pat)
            if other is None or _fold(other) in seen or (pd == d and pat < end and pat + len(other) > start):
                continue
            chosen.append(other)
            seen.add(_fold(other))
            if len(chosen) == build.choices - 1:
                break
        if len(chosen) < build.choices - 1:
            break  # the whole split has too few distinct continuations
        answer_at = rng.randrange(build.choices)
        spans.take(d, start, end)
        items.append({"id": f"{docs[d][0]}@{at}", "context": cut[0],
                      "choices": chosen[:answer_at] + [answer] + chosen[answer_at:], "answer": answer_at})
        if len(items) == build.items:
            return items
    raise CorpusError(
        f"the eval split of {source!r} yields {len(items)} choice items, fewer than corpus.tasks.choice.items = "
        f"{build.items}: its passages are too short. An item needs a passage of at least "
        f"corpus.tasks.choice.context_tokens = {build.context_tokens} tokens before its true continuation, "
        f"{build.choices} distinct continuations of corpus.tasks.choice.continuation_tokens = "
        f"{build.continuation_tokens} tokens, and items do not overlap; lower items, context_tokens or "
        "continuation_tokens, or raise corpus.eval_tokens")


BUILDERS: dict[str, Callable[[Docs, CountTokens, Section, int, str], list[dict]]] = {
    "cloze": cloze_items, "choice": choice_items}


def build_items(builds: ItemBuilds, docs: Docs, count_tokens: CountTokens, seed: int, source: str) -> dict[str, list[dict]]:
    """Task name → its item records, for every task set in ``builds``, built from the eval split ``docs``."""
    return {name: BUILDERS[name](docs, count_tokens, getattr(builds, name), seed, source)
            for name in BUILDERS if builds.builds(source, name)}
