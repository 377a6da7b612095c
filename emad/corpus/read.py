"""Reading a sampled corpus folder (``calib.jsonl`` / ``eval.jsonl`` + ``manifest.json``)."""

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
