"""Reading a sampled corpus folder (``calib.jsonl`` / ``eval.jsonl`` + ``manifest.json``, task item files)."""

from __future__ import annotations

import json
from pathlib import Path

from emad.corpus.sources import CorpusError


def read_split(corpus_dir: str | Path, split: str = "calib") -> tuple[list[str], str]:
    """Texts of one split and the corpus manifest hash.

    Raises:
        CorpusError: a missing, damaged or empty file, named.
    """
    corpus_dir = Path(corpus_dir)
    manifest_path, split_path = corpus_dir / "manifest.json", corpus_dir / f"{split}.jsonl"
    for path in (manifest_path, split_path):
        if not path.is_file():
            raise CorpusError(f"{path} does not exist (sample the corpus first: stage sample_corpus)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        texts = [json.loads(line)["text"] for line in split_path.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CorpusError(f"corpus files in {corpus_dir} are damaged ({type(err).__name__}: {err})") from None
    if not texts:
        raise CorpusError(f"{split_path} holds no documents")
    return texts, manifest.get("manifest_sha256", "")


def read_items(corpus_dir: str | Path, task: str) -> list[dict]:
    """The item records of a task's file (``<task>.jsonl``, built by stage sample_corpus from ``corpus.tasks``).

    Raises:
        CorpusError: a missing, damaged or empty file, named, with the params key that builds it.
    """
    path = Path(corpus_dir) / f"{task}.jsonl"
    if not path.is_file():
        raise CorpusError(f"{path} does not exist: set corpus.tasks.{task} in params.yaml and sample the corpus "
                          "(stage sample_corpus)")
    try:
        items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorpusError(f"{path} is damaged ({type(err).__name__}: {err})") from None
    if not items or not all(isinstance(item, dict) for item in items):
        raise CorpusError(f"{path} holds no items (one JSON object per line)")
    return items
