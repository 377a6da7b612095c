"""Multiple-choice accuracy by log-likelihood (lm-eval style ``acc`` and ``acc_norm``), under adaptive depth.

Each choice is scored as the continuation of the question with :func:`~emad.decode.score_adaptive` (generation
semantics; the question is prefilled once for all its choices, :func:`~emad.decode.score_continuations`);
``acc`` picks the highest total log-likelihood, ``acc_norm`` the highest per character.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from emad.decode import Method, Scored, score_continuations
from emad.decode.results import Request
from emad.engine.stack import LayerStack


@dataclass(frozen=True)
class Item:
    """One question: its context text, the choices (each scored after the context) and the correct index."""

    context: str
    choices: tuple[str, ...]
    answer: int

    def __post_init__(self):
        if not 0 <= self.answer < len(self.choices):
            raise ValueError(f"answer index {self.answer} is outside the {len(self.choices)} choices")


def arc_items(split: str = "test", config: str = "ARC-Easy", data_files: str | None = None) -> list[Item]:
    """ARC items from the hub (``allenai/ai2_arc``) or, with ``data_files``, from a local JSON-lines file with the
    same fields (``question``, ``choices: {text, label}``, ``answerKey``)."""
    import datasets

    if data_files is not None:
        rows: Iterable[dict] = datasets.load_dataset("json", data_files=data_files, split="train")
    else:
        rows = datasets.load_dataset("allenai/ai2_arc", config, split=split)
    items = []
    for row in rows:
        labels = list(row["choices"]["label"])
        items.append(Item(f"Question: {row['question']}\nAnswer:",
                          tuple(" " + t for t in row["choices"]["text"]), labels.index(row["answerKey"])))
    return items


def choice_requests(tokenizer, items: Sequence[Item]) -> list[Request]:
    """One request per item: the context and each choice's continuation tokens (lm-eval's split)."""
    out = []
    for item in items:
        pairs = [encode_pair(tokenizer, item.context, choice) for choice in item.choices]
        context = pairs[0][0]
        out.append((context, [whole[len(context):] for _, whole in pairs]))
    return out


def choice_metrics(items: Sequence[Item], scored: Sequence[Sequence[Scored]]) -> dict:
    """``acc``, ``acc_norm``, ``n``, the FLOPs ratio and per-item samples from each item's scored choices."""
    correct, correct_norm = [], []
    for item, row in zip(items, scored, strict=True):
        scores = [-s.nll for s in row]
        norms = [-s.nll / max(len(choice), 1) for s, choice in zip(row, item.choices)]
        correct.append(int(scores.index(max(scores)) == item.answer))
        correct_norm.append(int(norms.index(max(norms)) == item.answer))
    flops = sum(s.flops for row in scored for s in row)
    full = sum(s.full_flops for row in scored for s in row)
    n = len(items)
    return {"acc": sum(correct) / n, "acc_norm": sum(correct_norm) / n, "n": n,
            "flops_ratio": flops / full if full else 1.0, "samples": {"acc": correct, "acc_norm": correct_norm},
            "unit_flops": [[sum(s.flops for s in row), sum(s.full_flops for s in row)] for row in scored]}


def multiple_choice(stack: LayerStack, tokenizer, items: Sequence[Item], method: Method, sink: list | None = None) -> dict:
    """``acc`` and ``acc_norm`` over the items, with the FLOPs ratio of the scoring passes; ``samples``: 1 or 0
    per item for each."""
    scored = [score_continuations(stack, context, continuations, method)
              for context, continuations in choice_requests(tokenizer, items)]
    if sink is not None:
        sink.extend(s for row in scored for s in row)
    return choice_metrics(items, scored)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, whole ids) as lm-eval splits a pair: encode ``context + continuation`` and take the context's
    own ids as its prefix; when they are not a prefix of the whole (a merge across the boundary), the whole is the
    context's ids followed by the continuation's own."""
    context_ids = tokenizer(context)["input_ids"]
    whole = tokenizer(context + continuation)["input_ids"]
    if whole[: len(context_ids)] != context_ids or len(whole) == len(context_ids):
        whole = context_ids + tokenizer(continuation, add_special_tokens=False)["input_ids"]
    return context_ids, whole
