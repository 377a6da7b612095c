"""Multiple-choice accuracy by log-likelihood (lm-eval style ``acc`` and ``acc_norm``), under adaptive depth.

Each choice is scored as the continuation of the question with :func:`~emad.decode.score_adaptive` (generation
semantics); ``acc`` picks the highest total log-likelihood, ``acc_norm`` the highest per character.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from emad.decode import Method, score_adaptive
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


def multiple_choice(stack: LayerStack, tokenizer, items: Sequence[Item], method: Method, sink: list | None = None) -> dict:
    """``acc`` and ``acc_norm`` over the items, with the FLOPs ratio of the scoring passes."""
    correct = correct_norm = 0
    flops = full = 0.0
    for item in items:
        context = tokenizer(item.context)["input_ids"]
        scores, norms = [], []
        for choice in item.choices:
            ids = tokenizer(item.context + choice)["input_ids"]
            if ids[: len(context)] != context or len(ids) == len(context):
                ids = context + tokenizer(choice, add_special_tokens=False)["input_ids"]
            scored = score_adaptive(stack, context, ids[len(context):], method)
            if sink is not None:
                sink.append(scored)
            scores.append(-scored.nll)
            norms.append(-scored.nll / max(len(choice), 1))
            flops += scored.flops
            full += scored.full_flops
        correct += scores.index(max(scores)) == item.answer
        correct_norm += norms.index(max(norms)) == item.answer
    n = len(items)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n, "flops_ratio": flops / full if full else 1.0}
