"""Last-word (cloze) accuracy, LAMBADA-style, under adaptive depth: by log-likelihood and by greedy generation.

Each item is a passage and its target word; the continuation is ``" " + target``, tokenised as lm-eval does
(the whole text is encoded and the passage's tokens split off). Metrics:

- ``acc`` (lm-eval ``lambada`` semantics): every target token is the argmax of its exit readout, teacher forced
  with :func:`~emad.decode.score_continuations` (generation semantics). The passage's last ``adaptive_tokens``
  tokens are scored too (teacher forced, at adaptive depth) rather than prefilled, so the target is read where the
  method's exits have taken the depth, not at the prompt's full depth; metrics read the target's tokens only.
- ``generation_acc``: the first word of the greedy continuation (:func:`~emad.decode.generate`, all passages in one
  batch, one token more than the longest target so a longer word is not taken for the target) equals the target.
- ``loglikelihood``: mean log-likelihood of the continuation (nats); ``perplexity`` = exp(-mean), as lm-eval's
  ``lambada`` perplexity.
- ``chance``: the majority baseline, the share of items whose target is the most frequent target.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from emad.decode import Generation, Method, Prefills, Scored, generate, score_continuations
from emad.decode.results import Request
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


def cloze_requests(tokenizer, items: Sequence[ClozeItem], adaptive_tokens: int) -> tuple[list[Request], list[int]]:
    """One request per item: the passage less its last ``adaptive_tokens`` tokens as the prompt, those tokens and
    the target's as the continuation; and each item's target length in tokens (the scored tail). Tokenised once
    per process for every point that reads them."""
    requests, tails = _cloze_requests(tokenizer, tuple(items), adaptive_tokens)
    return [(list(prompt), [list(c) for c in continuations]) for prompt, continuations in requests], list(tails)


@functools.lru_cache(maxsize=16)
def _cloze_requests(tokenizer, items: tuple[ClozeItem, ...], adaptive_tokens: int) -> tuple[list, list]:
    requests, tails = [], []
    for item in items:
        context, whole = encode_pair(tokenizer, item.context, " " + item.target)
        cut = len(context) - min(adaptive_tokens, len(context) - 1)
        requests.append((context[:cut], [whole[cut:]]))
        tails.append(len(whole) - len(context))
    return requests, tails


def cloze_metrics(items: Sequence[ClozeItem], scored: Sequence[Sequence[Scored]], tails: Sequence[int],
                  generated: Generation | None = None) -> dict:
    """Cloze metrics (see the module doc) from each item's scored continuation, read on its target tokens, and the
    greedy generation of the first items' passages (``generation_acc`` over those; absent without one)."""
    rows = [row[0] for row in scored]
    if len(rows) != len(tails) or any(len(s.greedy) != len(s.logprobs) for s in rows):
        raise ValueError("this method's scoring reports no greedy flag per token (Scored.greedy): cloze acc "
                             "needs them")
    acc = [float(all(s.greedy[len(s.greedy) - tail:])) for s, tail in zip(rows, tails)]
    loglik = [sum(s.logprobs[len(s.logprobs) - tail:]) for s, tail in zip(rows, tails)]
    flops = sum(s.flops for s in rows)
    full = sum(s.full_flops for s in rows)
    units = [[s.flops, s.full_flops] for s in rows]  # per item: its scoring, and its generation where it has one
    n = len(items)
    out = {"acc": sum(acc) / n, "loglikelihood": sum(loglik) / n, "perplexity": math.exp(-sum(loglik) / n),
           "chance": majority_rate([item.target for item in items]), "n": n,
           "samples": {"acc": acc, "loglikelihood": loglik}}
    if generated is not None:
        hits = [float(first_word(text) == item.target) for text, item in zip(generated.texts, items)]
        out["generation_acc"] = sum(hits) / len(hits)
        out["samples"]["generation_acc"] = hits
        flops += sum(sum(row) for row in generated.flops)
        full += sum(sum(row) for row in generated.full_flops)
        for unit, (f, ff) in zip(units, generated.unit_flops()):
            unit[0], unit[1] = unit[0] + f, unit[1] + ff
    return {**out, "flops_ratio": flops / full if full else 1.0, "unit_flops": units}


def cloze_generation(stack: LayerStack, tokenizer, items: Sequence[ClozeItem], method: Method,
                     prefills: Prefills | None = None) -> Generation:
    """Greedy continuations of the items' passages, one token longer than the longest target (``prefills``: prompt
    passes to reuse, :class:`~emad.decode.Prefills`)."""
    pairs = [encode_pair(tokenizer, item.context, " " + item.target) for item in items]
    longest = max(len(whole) - len(context) for context, whole in pairs)
    return generate(stack, tokenizer, [context for context, _ in pairs], method, longest + 1, prefills=prefills)


def cloze(stack: LayerStack, tokenizer, items: Sequence[ClozeItem], method: Method, adaptive_tokens: int = 8,
          sink: list | None = None) -> dict:
    """Cloze metrics of ``items`` under ``method`` (see the module doc), with per-item ``samples``.

    Args:
        adaptive_tokens: the passage's last tokens scored at adaptive depth before the target (teacher forced),
            so that the target is read at an adaptive depth; the rest of the passage is the prefilled prompt.
        sink: when given, every :class:`~emad.decode.Generation` / :class:`~emad.decode.Scored` of the method is
            appended to it (traces, timing).

    Returns:
        ``{"acc", "generation_acc", "loglikelihood", "perplexity", "chance", "n", "flops_ratio",
        "samples": {"acc": [0/1 per item], "generation_acc": [...], "loglikelihood": [...]}}``.
    """
    if not items:
        raise ValueError("cloze needs at least one item")
    requests, tails = cloze_requests(tokenizer, items, adaptive_tokens)
    scored = [score_continuations(stack, prompt, continuations, method) for prompt, continuations in requests]
    out = cloze_generation(stack, tokenizer, items, method)
    if sink is not None:
        sink.extend([*(s for row in scored for s in row), out])
    return cloze_metrics(items, scored, tails, out)
