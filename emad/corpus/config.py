"""The ``corpus`` section of params.yaml: which sources to sample, the budgets, the seed and the tokenizer."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator

from emad.config import Section
from emad.corpus import SOURCES, CorpusError, build_source
from emad.corpus.items import ItemBuilds


def _registered(name: str) -> str:
    if name not in SOURCES:
        raise ValueError(f"unknown corpus source {name!r}; valid: {', '.join(SOURCES.names())}")
    return name


SourceName = Annotated[str, AfterValidator(_registered)]


class CorpusConfig(Section):
    """Params of stage ``sample_corpus``.

    Attributes:
        seed: orders the documents of every source (same seed, same files).
        calib_tokens: token budget of the calibration split of each source.
        eval_tokens: token budget of the evaluation split of each source.
        tokenizer_model: model spec (embedded alias, folder or hub id) whose tokenizer counts the tokens.
        sources: the sources sampled by ``dvc repro`` (one stage per source).
        options: per source name, its constructor options (e.g. ``{shakespeare: {edition: folio}}``).
        tasks: task item files (``cloze``, ``choice``) cut out of the eval split of ``tasks.sources`` (all
            sampled sources when null), seeded by ``seed``; see :mod:`emad.corpus.items`.
    """

    seed: int = Field(0, ge=0)
    calib_tokens: int = Field(40_000, gt=0)
    eval_tokens: int = Field(10_000, gt=0)
    tokenizer_model: str = Field("smollm2-135m", min_length=1)
    sources: list[SourceName] = Field(default_factory=lambda: ["stdlib-prose", "stdlib-code", "shakespeare"])
    options: dict[SourceName, dict[str, Any]] = Field(default_factory=dict)
    tasks: ItemBuilds = Field(default_factory=ItemBuilds)

    @field_validator("sources")
    @classmethod
    def _distinct(cls, sources: list[str]) -> list[str]:
        repeated = sorted({s for s in sources if sources.count(s) > 1})
        if repeated:
            raise ValueError(f"{', '.join(map(repr, repeated))} listed more than once")
        return sources

    @model_validator(mode="after")
    def _items_from_sampled_sources(self) -> CorpusConfig:
        for i, name in enumerate(self.tasks.sources or []):
            if name not in self.sources:
                raise ValueError(f"tasks.sources[{i}]: {name!r} is not sampled; add it to corpus.sources "
                                 f"({', '.join(self.sources)})")
        return self

    @field_validator("options")
    @classmethod
    def _buildable(cls, options: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, opts in options.items():
            try:
                build_source(name, **opts)  # constructors only check their options; nothing is read yet
            except CorpusError as err:
                raise ValueError(str(err)) from None
        return options

    def source_options(self, name: str) -> dict[str, Any]:
        """The constructor options of source `name` (empty when none are set)."""
        return dict(self.options.get(name, {}))
