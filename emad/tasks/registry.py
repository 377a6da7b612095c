"""Tasks by name, each with its settings model and its data: what the decode stage runs on an eval domain.

A task is a small class registered in :data:`TASKS`: ``Settings`` (a params section, ``decode.tasks.<name>``),
``load(settings, corpus_dir, tokenizer)`` → its data (done before any decoding, so bad input fails first), and
``run(stack, tokenizer, method, data, settings, sink)`` → its metrics. A teacher-forced task (``teacher_forced``)
splits ``run`` in two: ``requests`` (the prompts and continuations it scores, the same for every method) and
``reduce`` (metrics from one method's scores), so one sweep pass can score a request for many methods
(:mod:`emad.evaluation.evaluate`). Text tasks read the domain's sampled eval
split; ``cloze`` and ``choice`` read the item files sample_corpus cut out of it (``corpus.tasks``); ``gsm8k`` and
``humaneval`` read their embedded packages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from emad.config import Section, validate_section
from emad.corpus import CorpusError, read_items, read_split
from emad.decode import Generation, Prefills, Scored, generate, score_continuations
from emad.decode.results import Request
from emad.exits.criteria import Full
from emad.registry import Registry
from emad.tasks.agreement import agreement_metrics, agreement_requests
from emad.tasks.cloze import ClozeItem, cloze_generation, cloze_metrics, cloze_requests
from emad.tasks.fidelity import fidelity
from emad.tasks.gsm8k import gsm8k, test_rows
from emad.tasks.humaneval import humaneval, problems
from emad.tasks.multiple_choice import Item, arc_items, choice_metrics, choice_requests
from emad.tasks.perplexity import first_tokens, perplexity_metrics, perplexity_requests


@dataclass
class Shared:
    """What the tasks of one domain share across the points that run them: full-depth greedy generations of their
    prompts, made once (fidelity's reference, the agreement task's continuations), and the passes of prompt sets
    of more than one prompt (:class:`~emad.decode.Prefills`: a batch's prompt pass costs most of its generation,
    which then is not timed; a single prompt's generation stays timed, for the cheap speed measure)."""

    references: dict[tuple, Generation] = field(default_factory=dict)
    prefills: Prefills = field(default_factory=Prefills)

    def reference(self, stack, tokenizer, prompts: Sequence[Sequence[int]], new_tokens: int) -> Generation:
        key = (tuple(map(tuple, prompts)), new_tokens)
        if key not in self.references:
            self.references[key] = generate(stack, tokenizer, prompts, Full(), new_tokens,
                                            prefills=self.passes(prompts))
        return self.references[key]

    def passes(self, prompts: Sequence[Sequence[int]]) -> Prefills | None:
        """The prompt passes generations of ``prompts`` reuse: none for a single prompt."""
        return self.prefills if len(prompts) > 1 else None


class Task:
    """Base class: a task's settings, data loading and evaluation.

    ``run(..., limit=n)`` decodes only the first ``n`` prompts (problems) of a free-running task (swept points,
    ``decode.swept_prompts``); teacher-forced tasks score all theirs.
    """

    name: ClassVar[str]
    Settings: ClassVar[type[Section]] = Section
    corpus_items: ClassVar[str | None] = None  # the corpus.tasks item file it reads, when it reads one
    teacher_forced: ClassVar[bool] = False  # metrics from scored requests (requests + reduce)

    @classmethod
    def settings(cls, raw: dict | None) -> Section:
        """Validated settings; errors name ``decode.tasks.<name>.<key>``."""
        return validate_section(f"decode.tasks.{cls.name}", raw, cls.Settings)

    def load(self, settings, corpus_dir: Path | None, tokenizer) -> Any:
        raise NotImplementedError

    def requests(self, stack, tokenizer, data, settings, shared: Shared) -> list[Request]:
        """A teacher-forced task's requests: the same for every method."""
        raise NotImplementedError

    def fewer(self, requests: list[Request], tokens: int) -> list[Request]:
        """The requests a method scored token by token scores when ``decode.unserved_tokens`` is set (all): always
        the leading ones, so that full depth's results on the same units are its first ones."""
        return requests

    def reduce(self, stack, tokenizer, method, data, settings, scored: list[list[Scored]], sink: list,
               limit: int | None = None, shared: Shared | None = None) -> dict:
        """A teacher-forced task's metrics from ``method``'s scores of (the leading) requests (``shared``: what its
        generations may share across points)."""
        raise NotImplementedError

    def speed_prompts(self, data, settings) -> tuple[list[list[int]], int] | None:
        """Prompts and new tokens whose generation times a point's speed-up (None: this task has none)."""
        return None

    def full_depth_reference(self, stack, tokenizer, data, settings, shared: Shared, limit: int | None = None
                             ) -> tuple[list[list[int]], Generation] | None:
        """The prompts a free-running task generates from (its first ``limit``) and their full-depth generation,
        when its generations are judged against full depth (fidelity); None for other tasks."""
        return None

    def run(self, stack, tokenizer, method, data, settings, sink: list, shared: Shared | None = None,
            limit: int | None = None) -> dict:
        """The task's metrics under ``method``; a teacher-forced task scores its requests alone and reduces them."""
        if not self.teacher_forced:
            raise NotImplementedError
        scored = [score_continuations(stack, prompt, continuations, method)
                  for prompt, continuations in self.requests(stack, tokenizer, data, settings, shared or Shared())]
        sink.extend(s for row in scored for s in row)
        return self.reduce(stack, tokenizer, method, data, settings, scored, sink, limit)


TASKS: Registry[Task] = Registry("task")


def _eval_docs(corpus_dir: Path | None, tokenizer, max_tokens: int) -> list[list[int]]:
    """Token ids of the eval split's documents, in order, until ``max_tokens`` tokens are taken."""
    if corpus_dir is None:
        raise ValueError("this task reads a sampled corpus folder (data/corpus/<domain>); none was given")
    texts, _ = read_split(corpus_dir, "eval")
    docs, left = [], max_tokens
    for text in texts:
        ids = tokenizer(text)["input_ids"][:left]
        docs.append(ids)
        left -= len(ids)
        if left <= 0:
            break
    return docs


@TASKS.register("perplexity")
class Perplexity(Task):
    """Adaptive-depth perplexity on the domain's eval split (DESIGN.md §4)."""

    class Settings(Section):
        tokens: int = Field(2048, ge=2)
        window: int = Field(256, ge=2)
        prefix: int = Field(64, ge=1)

    teacher_forced = True

    def load(self, settings, corpus_dir, tokenizer):
        if not settings.prefix < settings.window:
            raise ValueError(f"decode.tasks.perplexity.prefix ({settings.prefix}) must be < window "
                             f"({settings.window})")
        return _eval_docs(corpus_dir, tokenizer, settings.tokens)

    def requests(self, stack, tokenizer, data, settings, shared):
        return perplexity_requests(data, settings.window, settings.prefix)

    def fewer(self, requests, tokens):
        return first_tokens(requests, tokens)

    def reduce(self, stack, tokenizer, method, data, settings, scored, sink, limit=None, shared=None):
        return perplexity_metrics(scored, settings.prefix)


@TASKS.register("fidelity")
class Fidelity(Task):
    """Greedy continuations vs full depth, from prompts cut out of the eval split."""

    class Settings(Section):
        prompts: int = Field(16, ge=1)  # 8 in the confirmation half: C2's prompts (decode.speed_prompts)
        prompt_tokens: int = Field(64, ge=1)
        new_tokens: int = Field(32, ge=1)

    def load(self, settings, corpus_dir, tokenizer):
        ids = [t for doc in _eval_docs(corpus_dir, tokenizer, settings.prompts * settings.prompt_tokens * 4)
               for t in doc]
        step = len(ids) // settings.prompts
        if step < settings.prompt_tokens:
            raise ValueError(f"the eval split of {corpus_dir} is too short for {settings.prompts} prompts of "
                             f"{settings.prompt_tokens} tokens (decode.tasks.fidelity)")
        return [ids[i * step: i * step + settings.prompt_tokens] for i in range(settings.prompts)]

    def speed_prompts(self, data, settings):
        return data, settings.new_tokens

    def full_depth_reference(self, stack, tokenizer, data, settings, shared, limit=None):
        prompts = data[:limit]
        return prompts, shared.reference(stack, tokenizer, prompts, settings.new_tokens)

    def run(self, stack, tokenizer, method, data, settings, sink, shared=None, limit=None):
        shared = shared or Shared()
        prompts, reference = self.full_depth_reference(stack, tokenizer, data, settings, shared, limit)
        return fidelity(stack, tokenizer, prompts, method, settings.new_tokens, reference=reference, sink=sink,
                        prefills=shared.passes(prompts))


@TASKS.register("agreement")
class Agreement(Fidelity):
    """Teacher-forced token agreement: the full-depth greedy continuations of fidelity's prompts fed back
    (:mod:`emad.tasks.agreement`)."""

    teacher_forced = True
    run = Task.run

    def requests(self, stack, tokenizer, data, settings, shared):
        return agreement_requests(data, shared.reference(stack, tokenizer, data, settings.new_tokens))

    def reduce(self, stack, tokenizer, method, data, settings, scored, sink, limit=None, shared=None):
        return agreement_metrics(scored)


@TASKS.register("gsm8k")
class Gsm8k(Task):
    """GSM8K strict-match accuracy on the first problems of the embedded test set; shots from its end."""

    class Settings(Section):
        problems: int = Field(8, ge=1)
        shots: int = Field(3, ge=0)
        max_new_tokens: int = Field(160, ge=1)

    def load(self, settings, corpus_dir, tokenizer):
        rows = test_rows()
        if settings.problems + settings.shots > len(rows):
            raise ValueError(f"decode.tasks.gsm8k: {settings.problems} problems + {settings.shots} shots exceed "
                             f"the {len(rows)} available")
        pairs = [(r["question"], r["answer"]) for r in rows]
        return pairs[: settings.problems], pairs[len(pairs) - settings.shots:]

    def run(self, stack, tokenizer, method, data, settings, sink, shared=None, limit=None):
        problems, shots = data
        problems = problems[:limit]
        return gsm8k(stack, tokenizer, problems, method, shots, settings.max_new_tokens, sink=sink)


@TASKS.register("humaneval")
class HumanEval(Task):
    """HumanEval pass@1 on the first problems, checked in a sandboxed subprocess."""

    class Settings(Section):
        problems: int = Field(8, ge=1)
        max_new_tokens: int = Field(160, ge=1)
        timeout: float = Field(5.0, gt=0)

    def load(self, settings, corpus_dir, tokenizer):
        return problems()[: settings.problems]

    def run(self, stack, tokenizer, method, data, settings, sink, shared=None, limit=None):
        return humaneval(stack, tokenizer, data[:limit], method, settings.max_new_tokens, settings.timeout, sink=sink)


@TASKS.register("multiple_choice")
class MultipleChoice(Task):
    """ARC-style accuracy by log-likelihood (hub ``allenai/ai2_arc`` online, or a local file)."""

    class Settings(Section):
        config: str = "ARC-Easy"
        split: str = "test"
        data_files: str | None = None  # a local JSON-lines file with ARC's fields instead of the hub
        items: int = Field(50, ge=1)

    teacher_forced = True

    def load(self, settings, corpus_dir, tokenizer):
        return arc_items(settings.split, settings.config, settings.data_files)[: settings.items]

    def requests(self, stack, tokenizer, data, settings, shared):
        return choice_requests(tokenizer, data)

    def reduce(self, stack, tokenizer, method, data, settings, scored, sink, limit=None, shared=None):
        return choice_metrics(data, scored)


def _items(corpus_dir: Path | None, task: str, make) -> list:
    """The items of ``<corpus_dir>/<task>.jsonl``, each record made into an item by ``make``."""
    if corpus_dir is None:
        raise ValueError("this task reads a sampled corpus folder (data/corpus/<domain>); none was given")
    items = []
    for number, record in enumerate(read_items(corpus_dir, task), start=1):
        try:
            items.append(make(record))
        except (KeyError, TypeError, ValueError) as err:
            raise CorpusError(f"{Path(corpus_dir) / f'{task}.jsonl'} line {number} is not a {task} item "
                              f"({type(err).__name__}: {err})") from None
    return items


@TASKS.register("cloze")
class Cloze(Task):
    """Last-word accuracy (LAMBADA-style) on passages of the eval split: by log-likelihood (teacher forced, the
    passage's last ``adaptive_tokens`` at adaptive depth) and by generation (the first ``limit`` passages)."""

    class Settings(Section):
        adaptive_tokens: int = Field(8, ge=0)  # the passage's last tokens scored at adaptive depth before the target

    corpus_items = "cloze"  # built by sample_corpus from corpus.tasks.cloze
    teacher_forced = True

    def load(self, settings, corpus_dir, tokenizer):
        return _items(corpus_dir, "cloze", lambda r: ClozeItem(r["context"], r["target"]))

    def requests(self, stack, tokenizer, data, settings, shared):
        return cloze_requests(tokenizer, data, settings.adaptive_tokens)[0]

    def reduce(self, stack, tokenizer, method, data, settings, scored, sink, limit=None, shared=None):
        """``limit`` 0: the scored metrics only (no greedy generation, no ``generation_acc``: a screen)."""
        generated = (cloze_generation(stack, tokenizer, data[:limit], method, shared and shared.passes(data[:limit]))
                     if limit != 0 else None)
        if generated is not None:
            sink.append(generated)
        return cloze_metrics(data, scored, cloze_requests(tokenizer, data, settings.adaptive_tokens)[1], generated)


@TASKS.register("choice")
class Choice(MultipleChoice):
    """Multiple-choice continuation of passages of the eval split, distractors from the same split: ``acc`` and
    ``acc_norm`` by log-likelihood (lm-eval semantics), per-item ``samples``, and ``chance``."""

    Settings = Section  # nothing to set: sample_corpus cut the items
    corpus_items = "choice"  # built by sample_corpus from corpus.tasks.choice

    def load(self, settings, corpus_dir, tokenizer):
        return _items(corpus_dir, "choice", lambda r: Item(r["context"], tuple(r["choices"]), r["answer"]))

    def reduce(self, stack, tokenizer, method, data, settings, scored, sink, limit=None, shared=None):
        chance = sum(1 / len(item.choices) for item in data) / len(data)  # 1 / choices
        return {**super().reduce(stack, tokenizer, method, data, settings, scored, sink, limit, shared),
                "chance": chance}
