"""Sample a calibration and an evaluation split from a corpus source, deterministically by seed.

Documents are ordered by ``sha256(f"{seed}:{doc.id}")``. The evaluation split is filled first, then
calibration, each with whole documents until the next one would overflow its budget; that document is cut at
the last whitespace (line or word) boundary that still fits, and the split is closed. A split therefore holds
between ``budget - (tokens of one word)`` and ``budget`` tokens, never more. The rest of a cut document is
dropped: no document, whole or in part, is in both splits. Empty documents and exact duplicates of an earlier
text are skipped and reported in the manifest, as are inputs the source could not read.

Outputs in `out_dir`: ``eval.jsonl`` and ``calib.jsonl`` (one ``{"id", "text", "n_tokens"}`` per line), the
task item files asked for (``cloze.jsonl``, ``choice.jsonl``: cut out of the eval split, see
:mod:`emad.corpus.items`) and ``manifest.json``, each written atomically (temp file in `out_dir`, then `os.replace`). Every check runs
before anything is written; an old manifest is removed first and the new one written last, so a manifest is
present only beside the files it describes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emad.corpus.boundaries import truncate_to_budget
from emad.corpus.items import BUILDERS, ItemBuilds, build_items
from emad.corpus.sources import CorpusError, Document, Source, build_source
from emad.io import atomic_write_bytes

SPLITS = ("eval", "calib")  # fill order
MANIFEST = "manifest.json"


@dataclass
class Split:
    """A split being filled: its records, its token count and the id of its cut document (if any)."""

    name: str
    budget: int
    records: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    truncated: str | None = None
    full: bool = False

    def add(self, doc_id: str, text: str, n_tokens: int) -> None:
        self.records.append({"id": doc_id, "text": text, "n_tokens": n_tokens})
        self.tokens += n_tokens
        self.full = self.tokens >= self.budget


def order_documents(docs: Iterable[Document], seed: int) -> list[Document]:
    """`docs` sorted by ``sha256(f"{seed}:{id}")`` (ties, impossible for unique ids, by id)."""
    return sorted(docs, key=lambda d: (hashlib.sha256(f"{seed}:{d.id}".encode()).hexdigest(), d.id))


def clean_documents(source: Source) -> tuple[list[Document], dict[str, list[str]]]:
    """The source's non-empty documents with distinct texts, and the skipped ids by reason.

    Raises:
        CorpusError: the source yields one id twice.
    """
    docs, seen_ids, seen_texts = [], set(), set()
    skipped: dict[str, list[str]] = {}
    for doc in source.documents():
        if doc.id in seen_ids:
            raise CorpusError(f"corpus source {source.name!r} yields document id {doc.id!r} twice")
        seen_ids.add(doc.id)
        digest = hashlib.sha256(doc.text.encode()).digest()
        reason = "empty" if not doc.text.strip() else "duplicate text" if digest in seen_texts else None
        if reason:
            skipped.setdefault(reason, []).append(doc.id)
            continue
        seen_texts.add(digest)
        docs.append(doc)
    for doc_id, reason in source.skipped.items():
        skipped.setdefault(reason, []).append(doc_id)
    return docs, skipped


def fill_splits(
    docs: list[Document], budgets: dict[str, int], count_tokens: Callable[[str], int], source: str
) -> dict[str, Split]:
    """Fills the splits in `SPLITS` order from `docs` (already ordered) to their `budgets`.

    Raises:
        CorpusError: the documents run out before every split is full; states the source's size.
    """
    splits = {name: Split(name, budgets[name]) for name in SPLITS}
    docs_iter, available = iter(docs), 0
    for split in splits.values():
        for doc in docs_iter:
            n = count_tokens(doc.text)
            available += n
            if split.tokens + n <= split.budget:
                split.add(doc.id, doc.text, n)
            else:
                prefix, n_prefix = truncate_to_budget(doc.text, split.budget - split.tokens, count_tokens)
                if prefix:
                    split.add(doc.id, prefix, n_prefix)
                    split.truncated = doc.id
                split.full = True
            if split.full:
                break
        if not split.full:  # every document was counted: `available` is the whole source
            need = sum(budgets.values())
            raise CorpusError(
                f"corpus source {source!r} has {len(docs)} usable documents with {available} tokens in all, "
                f"fewer than eval_tokens + calib_tokens = {budgets['eval']} + {budgets['calib']} = {need}; "
                "lower the budgets or choose a larger source"
            )
    check_disjoint(splits)
    return splits


def check_disjoint(splits: dict[str, Split]) -> None:
    """Raises AssertionError when two splits share a document id or a text (an internal invariant)."""
    ids = [{r["id"] for r in s.records} for s in splits.values()]
    texts = [{r["text"] for r in s.records} for s in splits.values()]
    if set.intersection(*ids) or set.intersection(*texts):
        raise AssertionError("calibration and evaluation share a document")


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def sample_corpus(
    source: str | Source,
    count_tokens: Callable[[str], int],
    calib_tokens: int,
    eval_tokens: int,
    seed: int,
    out_dir: str | Path,
    *,
    tokenizer_id: str = "unknown",
    tasks: ItemBuilds | None = None,
    **source_options: Any,
) -> dict[str, Any]:
    """Samples disjoint calibration and evaluation splits of a source into `out_dir` (see the module doc).

    Args:
        source: a registered source name (built with `source_options`) or a `Source` instance.
        count_tokens: the number of tokens of a text (the tokenizer of the model to be calibrated).
        calib_tokens, eval_tokens: token budget of each split (positive).
        seed: orders the documents; the same seed gives byte-identical files.
        out_dir: output folder, created when the sample succeeds.
        tokenizer_id: names the tokenizer behind `count_tokens` in the manifest.
        tasks: the task item files to build from the eval split (none when None; only when the source is one of
            ``tasks.sources``).
        **source_options: constructor options of a source given by name.

    Returns:
        The manifest: source, options, seed, budgets, tokenizer, per split (file, documents, tokens, truncated
        id, sha256 of the file), the skipped ids by reason, and ``manifest_sha256`` = sha256 of the calib and
        eval file hashes (hex, concatenated in that order; the item files, listed under ``tasks`` with their
        settings, item count and sha256, do not enter it).

    Raises:
        CorpusError: unknown source or option, a budget < 1, an empty source, budgets beyond the source, or an
            eval split too short for the items asked for.
    """
    if isinstance(source, Source):
        if source_options:
            raise CorpusError("source options are for a source given by name, not a Source instance")
        src = source
    else:
        src = build_source(source, **source_options)
    budgets = {"eval": eval_tokens, "calib": calib_tokens}
    for name, budget in budgets.items():
        if not isinstance(budget, int) or budget < 1:
            raise CorpusError(f"{name}_tokens must be a positive integer, got {budget!r}")
    docs, skipped = clean_documents(src)
    if not docs:
        detail = "; ".join(f"{len(ids)} {reason}" for reason, ids in skipped.items()) or "nothing at all"
        raise CorpusError(
            f"corpus source {src.name!r} has 0 usable documents (0 tokens): it yielded {detail}"
        )
    splits = fill_splits(order_documents(docs, seed), budgets, count_tokens, src.name)
    tasks = tasks or ItemBuilds()
    items = build_items(tasks, [(r["id"], r["text"]) for r in splits["eval"].records], count_tokens, seed, src.name)

    blobs = {name: _jsonl(splits[name].records) for name in ("calib", "eval")}
    hashes = {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}
    item_blobs = {name: _jsonl(records) for name, records in items.items()}
    manifest = {
        "source": src.name,
        "source_options": source_options,
        "source_info": src.info(),
        "seed": seed,
        "budgets": {"calib_tokens": calib_tokens, "eval_tokens": eval_tokens},
        "tokenizer": tokenizer_id,
        "usable_documents": len(docs),
        "splits": {
            name: {
                "file": f"{name}.jsonl",
                "documents": len(splits[name].records),
                "tokens": splits[name].tokens,
                "truncated": splits[name].truncated,
                "sha256": hashes[name],
            }
            for name in ("calib", "eval")
        },
        "skipped": {reason: sorted(ids) for reason, ids in sorted(skipped.items())},
        "tasks": {
            name: {"file": f"{name}.jsonl", "items": len(items[name]), "sha256": hashlib.sha256(blob).hexdigest(),
                   "settings": getattr(tasks, name).model_dump()}
            for name, blob in item_blobs.items()
        },
        "manifest_sha256": hashlib.sha256((hashes["calib"] + hashes["eval"]).encode()).hexdigest(),
    }
    manifest = json.loads(json.dumps(manifest, default=str))  # what is returned is what is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    for name, blob in {**blobs, **item_blobs}.items():
        atomic_write_bytes(out / f"{name}.jsonl", blob)
    for name in set(BUILDERS) - set(item_blobs):  # an item file of an earlier sample no longer asked for
        (out / f"{name}.jsonl").unlink(missing_ok=True)
    atomic_write_bytes(out / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return manifest
