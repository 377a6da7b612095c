"""Corpora for calibration and evaluation: named sources (a registry) and a deterministic, disjoint sampler.

from emad.corpus import SOURCES, build_source, sample_corpus
sample_corpus("shakespeare", lambda t: len(t.split()), calib_tokens=40_000, eval_tokens=10_000, seed=0,
              out_dir="data/corpus/shakespeare")
"""

from emad.corpus import hub, stdlib  # noqa: F401  (register their sources)
from emad.corpus.read import read_items, read_split
from emad.corpus.sample import sample_corpus
from emad.corpus.sources import (
    SOURCES,
    CorpusError,
    Document,
    Source,
    SourceUnavailableError,
    build_source,
    check_options,
)

__all__ = [
    "read_items",
    "read_split",
    "SOURCES",
    "CorpusError",
    "Document",
    "Source",
    "SourceUnavailableError",
    "build_source",
    "check_options",
    "sample_corpus",
]
