"""Hub corpus sources (online): WikiText-103 articles and an uncopyrighted Pile mirror, read with `datasets`.

Both take the dataset `path` and `data_files` as options, so the same loader reads a small local file
(``path="text"`` / ``"json"`` with ``data_files=...``) offline. Without network they fail with an error that
names the source and says it needs the hub.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from emad.corpus.sources import SOURCES, Document, Source, SourceUnavailableError

_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_LOCAL_BUILDERS = frozenset({"text", "json", "csv", "parquet", "arrow"})


def _offline() -> list[str]:
    return [v for v in _OFFLINE_VARS if os.environ.get(v, "").upper() in {"1", "ON", "YES", "TRUE"}]


def _is_local(path: str, data_files: Any) -> bool:
    return data_files is not None or path in _LOCAL_BUILDERS or Path(path).exists()


def _unavailable(source: str, path: str, data_files: Any, err: Exception) -> SourceUnavailableError:
    first_line = (str(err).strip().splitlines() or [""])[0]
    cause = f"{type(err).__name__}: {first_line}"
    if _is_local(path, data_files):
        return SourceUnavailableError(f"corpus source {source!r} cannot read {data_files or path!r}: {cause}")
    hint = f" ({' and '.join(_offline())} set: unset to allow downloads)" if _offline() else ""
    return SourceUnavailableError(
        f"corpus source {source!r} needs network access to the Hugging Face Hub for dataset {path!r}{hint}; "
        f"or pass path= and data_files= to read a local copy ({cause})"
    )


def load_rows(
    source: str,
    path: str,
    config: str | None,
    *,
    split: str,
    data_files: Any = None,
    streaming: bool = False,
    cache_dir: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Yields the rows of a `datasets` dataset; a failure becomes a `SourceUnavailableError` naming `source`.

    Args:
        source: the corpus source name, for error messages.
        path, config, split, data_files, streaming, cache_dir: passed to `datasets.load_dataset`.
    """
    try:
        import datasets
    except ImportError as err:
        raise SourceUnavailableError(
            f"corpus source {source!r} needs package 'datasets': pip install datasets"
        ) from err
    try:
        rows = datasets.load_dataset(
            path, config, split=split, data_files=data_files, streaming=streaming, cache_dir=cache_dir
        )
        yield from rows  # a streaming dataset reads (and can fail) only here
    except (GeneratorExit, KeyboardInterrupt):
        raise
    except Exception as err:
        raise _unavailable(source, path, data_files, err) from err


_TITLE = re.compile(r"= (?!=)(.*?)(?<!=) =")  # " = Title = ", not " = = Section = = "


def wikitext_articles(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """Reassembles WikiText lines into (title, article text); an article starts at a `` = Title = `` line.

    Lines before the first title belong to no article and are dropped.
    """
    title, body = None, []
    for raw in lines:
        line = raw.rstrip("\n")
        heading = _TITLE.fullmatch(line.strip())
        if heading:
            if title is not None:
                yield title, "\n".join(body).strip() + "\n"
            title, body = heading.group(1).strip(), []
        if title is not None:
            body.append(line.strip())
    if title is not None:
        yield title, "\n".join(body).strip() + "\n"


@SOURCES.register("wikitext-103")
class Wikitext103(Source):
    """Wikipedia articles of WikiText-103 (raw), reassembled from its lines; id = "<n>:<title>" (n from 0).

    Args:
        path: dataset path on the hub, or a builder ("text", "json", "parquet") for a local copy.
        config: dataset configuration name (None for a builder).
        split: dataset split.
        data_files: local file(s) with a `text_column` of lines.
        streaming: stream instead of downloading and caching the whole split.
        cache_dir: `datasets` cache folder (default: its own).
        max_documents: stop after this many articles (None: all).
        text_column: column that holds the lines.
    """

    needs_network = True

    def __init__(
        self,
        path: str = "Salesforce/wikitext",
        config: str | None = "wikitext-103-raw-v1",
        split: str = "train",
        data_files: Any = None,
        streaming: bool = False,
        cache_dir: str | None = None,
        max_documents: int | None = None,
        text_column: str = "text",
    ) -> None:
        super().__init__()
        self.path, self.config, self.split, self.data_files = path, config, split, data_files
        self.streaming, self.cache_dir, self.max_documents = streaming, cache_dir, max_documents
        self.text_column = text_column

    def info(self) -> dict[str, Any]:
        return {"dataset": self.path, "config": self.config, "split": self.split}

    def documents(self) -> Iterator[Document]:
        rows = load_rows(
            self.name,
            self.path,
            self.config,
            split=self.split,
            data_files=self.data_files,
            streaming=self.streaming,
            cache_dir=self.cache_dir,
        )
        articles = wikitext_articles(row[self.text_column] or "" for row in rows)
        for n, (title, text) in enumerate(articles):
            if self.max_documents is not None and n >= self.max_documents:
                return
            yield Document(f"{n}:{title}", text)


@SOURCES.register("pile")
class PileUncopyrighted(Source):
    """The Pile without its copyrighted subsets (``monology/pile-uncopyrighted``), streamed; id = row number.

    Args:
        path: dataset path on the hub, or "json" for a local JSON-lines copy.
        split: dataset split.
        data_files: local file(s) with a "text" column (and optionally "meta": {"pile_set_name": ...}).
        streaming: stream (default) instead of downloading the whole split.
        cache_dir: `datasets` cache folder (default: its own).
        max_documents: stop after this many documents (the hub split is ~ 200 GB).
        subsets: keep only rows whose ``meta.pile_set_name`` is listed (None: all).
    """

    needs_network = True

    def __init__(
        self,
        path: str = "monology/pile-uncopyrighted",
        split: str = "train",
        data_files: Any = None,
        streaming: bool = True,
        cache_dir: str | None = None,
        max_documents: int | None = 10_000,
        subsets: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.path, self.split, self.data_files, self.streaming = path, split, data_files, streaming
        self.cache_dir, self.max_documents = cache_dir, max_documents
        self.subsets = None if subsets is None else frozenset(subsets)

    def info(self) -> dict[str, Any]:
        return {"dataset": self.path, "split": self.split}

    def documents(self) -> Iterator[Document]:
        rows = load_rows(
            self.name,
            self.path,
            None,
            split=self.split,
            data_files=self.data_files,
            streaming=self.streaming,
            cache_dir=self.cache_dir,
        )
        kept = 0
        for n, row in enumerate(rows):
            if self.max_documents is not None and kept >= self.max_documents:
                return
            subset = (row.get("meta") or {}).get("pile_set_name")
            if self.subsets is not None and subset not in self.subsets:
                continue
            kept += 1
            yield Document(str(n), row.get("text") or "")
