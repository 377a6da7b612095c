"""Last-word (cloze) accuracy, LAMBADA-style, under adaptive depth: by log-likelihood and by greedy generation.

Each item is a passage and its target word; the continuation is ``" " + target``, tokenised as lm-eval does
(the whole text is encoded and the passage's tokens split off). Metrics:

- ``acc`` (lm-eval ``lambada`` semantics): every target token is the argmax of its exit readout, teacher forced
  with :func:`~emad.decode.score_adaptive` (generation semantics).
- ``generation_acc``: the first word of the greedy continuation (:func:`~emad.decode.generate`, all passages in one
  batch, one token more than the longest target so a longer word is not taken for the target) equals the target.
- ``loglikelihood``: mean log-likelihood of the continuation (nats); ``perplexity`` = exp(-mean), as lm-eval's
  ``lambada`` perplexity.
- ``chance``: the majority baseline, the share of items whose target is the most frequent target.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from emad.decode import Method, generate, score_adaptive
from emad.engine.stack import LayerStack
from emad.tasks.multiple_choice import encode_pair

FIRST_WORD = re.compile(r"\s*([A-Za-z]+)")


@dataclass(frozen=True)
class ClozeItem:
    """A passage (ending before a space) and the word that follows it."""

    context: str
    target: str

    def __post_init__(self):
        if not self.context or not self.target or self.target != self.target.strip():
            raise ValueError(f"a cloze item needs a passage and a target word without spaces, got {self!r}")


def first_word(text: str) -> str | None:
    """The leading run of letters of a continuation (after whitespace), or None."""
    match = FIRST_WORD.match(text)
    return match.group(1) if match else None


def majority_rate(targets: Sequence[str]) -> float:
    """Accuracy of always answering the most frequent target."""
    return Counter(targets).most_common(1)[0][1] / len(targets)


def cloze(stack: LayerStack, tokenizer, items: Sequence[ClozeItem], method: Method, sink: list | None = None) -> dict:
    """Cloze metrics of ``items`` under ``method`` (see the module doc), with per-item ``samples``.

    Args:
        sink: when given, every :class:`~emad.decode.Generation` / :class:`~emad.decode.Scored` of the method is
            appended to it (traces, timing).

    Returns:
        ``{"acc", "generation_acc", "loglikelihood", "perplexity", "chance", "n", "flops_ratio",
        "samples": {"acc": [0/1 per item], "generation_acc": [...], "loglikelihood": [...]}}``.
    """
    if not items:
        raise ValueError("cloze needs at least one item")
    pairs = [encode_pair(tokenizer, item.context, " " + item.target) for item in items]
    contexts = [context for context, _ in pairs]
    scored = []
    for context, whole in pairs:
        scored.append(score_adaptive(stack, context, whole[len(context):], method))
        if len(scored[-1].greedy) != len(whole) - len(context):
            raise ValueError("this method's scoring reports no greedy flag per token (Scored.greedy): cloze acc "
                             "needs them")
    longest = max(len(whole) - len(context) for context, whole in pairs)
    out = generate(stack, tokenizer, contexts, method, longest + 1)
    if sink is not None:
        sink.extend([*scored, out])
    acc = [float(all(s.greedy)) for s in scored]
    generated = [float(first_word(text) == item.target) for text, item in zip(out.texts, items)]
    loglik = [-s.nll for s in scored]
    flops = sum(s.flops for s in scored) + sum(sum(row) for row in out.flops)
    full = sum(s.full_flops for s in scored) + sum(sum(row) for row in out.full_flops)
    n = len(items)
    return {"acc": sum(acc) / n, "generation_acc": sum(generated) / n, "loglikelihood": sum(loglik) / n,
            "perplexity": math.exp(-sum(loglik) / n), "chance": majority_rate([item.target for item in items]),
            "n": n, "flops_ratio": flops / full if full else 1.0,
            "samples": {"acc": acc, "generation_acc": generated, "loglikelihood": loglik}}
