"""Fidelity to full depth: greedy continuations of the same prompts under a method and at full depth."""

from __future__ import annotations

from collections.abc import Sequence

from emad.decode import Method, Prefills, generate
from emad.engine.stack import LayerStack
from emad.exits.criteria import Full


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens until the first position where the sequences differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def fidelity(stack: LayerStack, tokenizer, prompts: Sequence[Sequence[int]], method: Method,
             max_new_tokens: int = 32, reference=None, sink: list | None = None, prefills: Prefills | None = None
             ) -> dict:
    """Exact-match rate, mean tokens until first divergence, token agreement and ROUGE-L F1 vs full depth.

    ``samples`` holds them per prompt: exact match 0/1, tokens to divergence, ``[agreeing, compared]`` tokens
    (token agreement = Σagreeing / Σcompared) and ROUGE-L F1; ``finest_units`` counts the compared tokens for
    exact match and ROUGE-L (when every prompt equals full depth's, so does every token).

    Args:
        reference: a full-depth :class:`~emad.decode.Generation` of the same prompts (computed when None).
        sink: when given, every :class:`~emad.decode.Generation` / :class:`~emad.decode.Scored` of the method is
            appended to it (traces, timing).
        prefills: prompt passes to reuse (:class:`~emad.decode.Prefills`; the method's generation is then not
            timed).
    """
    reference = reference or generate(stack, tokenizer, prompts, Full(), max_new_tokens, prefills=prefills)
    ours = generate(stack, tokenizer, prompts, method, max_new_tokens, prefills=prefills)
    if sink is not None:
        sink.append(ours)
    # imported here: rouge_score pulls in nltk and scikit-learn (~1.3 s), paid only where ROUGE is computed
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    exact, diverge, agreement, rouge = [], [], [], []
    for a, b, ta, tb in zip(ours.token_ids, reference.token_ids, ours.texts, reference.texts):
        exact.append(int(a == b))
        diverge.append(first_divergence(a, b))
        agreement.append([sum(x == y for x, y in zip(a, b)), max(len(a), len(b))])
        # a text equals itself (1) also where ROUGE's tokenizer finds no word in it (its F1 would be 0)
        rouge.append(1.0 if ta == tb else scorer.score(tb, ta)["rougeL"].fmeasure)
    n = len(prompts)
    agree, total = sum(p[0] for p in agreement), sum(p[1] for p in agreement)
    return {"exact_match": sum(exact) / n, "tokens_to_divergence": sum(diverge) / n,
            "token_agreement": agree / max(total, 1), "rouge_l": sum(rouge) / n,
            "flops_ratio": ours.cost_ratio(), "bytes_ratio": ours.cost_ratio(kind="bytes"),
            "samples": {"exact_match": exact, "tokens_to_divergence": diverge, "token_agreement": agreement,
                        "rouge_l": rouge},
            # a prompt's exact match and ROUGE-L equal full depth's (1) only when every generated token does
            "finest_units": {"exact_match": total, "rouge_l": total}, "unit_flops": ours.unit_flops()}
