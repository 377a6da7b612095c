"""The cloze and choice tasks: items cut out of an eval split by sample_corpus, scored at full depth as HF does."""

from __future__ import annotations

import functools
import json
import math
import re

import pytest
import torch

from emad.config import ConfigError, validate_section
from emad.corpus import CorpusError, Document, Source, build_source, sample_corpus
from emad.corpus.boundaries import tail_within_budget
from emad.corpus.config import CorpusConfig
from emad.corpus.items import ChoiceBuild, ClozeBuild, ItemBuilds, build_items, choice_items, cloze_items
from emad.decode import Method
from emad.engine.stack import LayerStack
from emad.exits.criteria import Fixed, Full
from emad.tasks.cloze import ClozeItem, cloze, first_word
from emad.tasks.multiple_choice import encode_pair
from emad.tasks.registry import TASKS
from tests.tiny import save_tiny_pretrained


def words(text: str) -> int:
    return len(text.split())


@functools.cache
def play() -> tuple[tuple[str, str], ...]:
    """Two embedded plays, cut to 30,000 characters each: (id, text) as in an eval split."""
    docs = sorted(build_source("shakespeare").documents(), key=lambda d: d.id)[:2]
    return tuple((d.id, d.text[:30_000]) for d in docs)


def _at(item: dict) -> tuple[str, int]:
    doc_id, at = item["id"].rsplit("@", 1)
    return dict(play())[doc_id], int(at)


# --- building -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["seen", "unseen", "any"])
def test_cloze_items_end_before_their_target_which_is_never_part_of_the_context(targets):
    build = ClozeBuild(items=40, context_tokens=40, targets=targets)
    items = cloze_items(play(), words, build, seed=0, source="shakespeare")
    assert len(items) == 40 and len({i["id"] for i in items}) == 40
    for item in items:
        text, at = _at(item)
        context, target = item["context"], item["target"]
        assert text[at - 1 - len(context): at + len(target)] == f"{context} {target}"  # the passage, then its word
        assert re.fullmatch(r"[A-Za-z]{3,}", target) and not text[at + len(target)].isalpha()
        assert not context[:1].isspace() and not context[-1:].isspace()
        assert 40 - 12 < words(context) <= 40
        seen = target.casefold() in {w.casefold() for w in re.findall(r"[A-Za-z]+", context)}
        assert seen == (targets == "seen") or targets == "any"


def test_choice_distractors_differ_from_the_answer_and_from_each_other():
    build = ChoiceBuild(items=40, context_tokens=30, continuation_tokens=6, choices=4)
    items = choice_items(play(), words, build, seed=0, source="shakespeare")
    assert len(items) == 40
    for item in items:
        text, at = _at(item)
        choices, answer = item["choices"], item["answer"]
        assert len(choices) == 4 and 0 <= answer < 4
        assert text[at - len(item["context"]): at + len(choices[answer])] == item["context"] + choices[answer]
        folded = [" ".join(c.split()).casefold() for c in choices]
        assert len(set(folded)) == 4  # no distractor equals the answer or another distractor
        assert all(c.startswith(" ") and c.strip() and words(c) <= 6 for c in choices)
        assert words(item["context"]) <= 30
    assert len({i["answer"] for i in items}) == 4  # the answer's place is drawn, not fixed


def test_items_do_not_overlap_in_the_text():
    items = cloze_items(play(), words, ClozeBuild(items=50, context_tokens=30), seed=3, source="s")
    spans = sorted((i["id"].rsplit("@")[0], int(i["id"].rsplit("@")[1]) - 1 - len(i["context"]),
                    int(i["id"].rsplit("@")[1]) + len(i["target"])) for i in items)
    for (doc_a, _, end_a), (doc_b, start_b, _) in zip(spans, spans[1:]):
        assert doc_a != doc_b or end_a <= start_b


def test_same_seed_same_items_other_seed_other_items():
    builds = ItemBuilds(cloze=ClozeBuild(items=20, context_tokens=30), choice=ChoiceBuild(items=10))
    first, again = (build_items(builds, play(), words, 5, "s") for _ in range(2))
    other = build_items(builds, play(), words, 6, "s")
    assert first == again
    assert [i["id"] for i in first["cloze"]] != [i["id"] for i in other["cloze"]]
    assert [i["id"] for i in first["choice"]] != [i["id"] for i in other["choice"]]


@pytest.mark.parametrize("build, match", [
    (ClozeBuild(items=5, context_tokens=64),
     r"yields 0 cloze items.*too short.*at least corpus\.tasks\.cloze\.context_tokens = 64 tokens"),
    (ChoiceBuild(items=5, context_tokens=64),
     r"yields 0 choice items.*too short.*at least corpus\.tasks\.choice\.context_tokens = 64 tokens"),
])
def test_passages_too_short_are_an_error_giving_the_minimum(build, match):
    short = [(f"d{i}", "The cat sat on the mat and looked at the quiet garden below. " * 3) for i in range(30)]
    builder = cloze_items if isinstance(build, ClozeBuild) else choice_items
    with pytest.raises(CorpusError, match=match):
        builder(short, words, build, seed=0, source="tiny")


def test_a_tail_starts_at_a_word_and_needs_a_full_budget_before_it():
    text = "alpha beta\ngamma delta epsilon zeta"
    assert tail_within_budget(text, 3, words) == ("delta epsilon zeta", 3)
    assert tail_within_budget(text, 6, words) == (text, 6)
    assert tail_within_budget(text, 7, words) is None  # fewer tokens than the budget: too short a passage
    long = "w " * 500 + "end"
    assert tail_within_budget(long, 4, words) == ("w w w end", 4)


class PlaySource(Source):
    name = "play"

    def documents(self):
        for doc_id, text in play():
            yield Document(doc_id, text)


def test_sample_corpus_writes_the_item_files_and_lists_them_in_the_manifest(tmp_path):
    tasks = ItemBuilds(cloze=ClozeBuild(items=12, context_tokens=30), choice=ChoiceBuild(items=8))
    runs = [sample_corpus(PlaySource(), words, 200, 4000, seed=1, out_dir=tmp_path / key, tasks=tasks)
            for key in "ab"]
    for name in ("cloze.jsonl", "choice.jsonl", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    manifest = runs[0]
    eval_text = "".join(json.loads(line)["text"] for line in (tmp_path / "a" / "eval.jsonl").read_text().splitlines())
    for name, n in (("cloze", 12), ("choice", 8)):
        entry = manifest["tasks"][name]
        assert entry["items"] == n and entry["settings"] == getattr(tasks, name).model_dump()
        records = [json.loads(line) for line in (tmp_path / "a" / f"{name}.jsonl").read_text().splitlines()]
        assert len(records) == n and all(r["context"] in eval_text for r in records)  # from the eval split only
    only = ItemBuilds(sources=["shakespeare"], cloze=ClozeBuild(items=12, context_tokens=30))
    sample_corpus(PlaySource(), words, 200, 4000, seed=1, out_dir=tmp_path / "a", tasks=only)  # not this source
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["calib.jsonl", "eval.jsonl", "manifest.json"]
    assert only.builds("shakespeare", "cloze") and not only.builds("shakespeare", "choice")


def test_an_eval_split_too_short_for_the_items_fails_before_writing(tmp_path):
    with pytest.raises(CorpusError, match=r"corpus\.tasks\.cloze\.context_tokens = 500"):
        sample_corpus(PlaySource(), words, 200, 600, seed=1, out_dir=tmp_path / "out",
                      tasks=ItemBuilds(cloze=ClozeBuild(items=2, context_tokens=500)))
    assert not (tmp_path / "out").exists()


def test_item_settings_errors_name_the_parameter(tmp_path):
    with pytest.raises(ConfigError, match=r"corpus\.tasks\.cloze\.context_tokens"):
        validate_section("corpus", {"tasks": {"cloze": {"context_tokens": 0}}}, CorpusConfig)
    with pytest.raises(ConfigError, match=r"corpus\.tasks\.choice\.choices"):
        validate_section("corpus", {"tasks": {"choice": {"choices": 1}}}, CorpusConfig)
    with pytest.raises(ConfigError, match=r"corpus: .*tasks\.sources\[1\]: 'gsm8k' is not sampled"):
        validate_section("corpus", {"sources": ["shakespeare"], "tasks": {"sources": ["shakespeare", "gsm8k"]}},
                         CorpusConfig)
    from emad.params import validate_params

    params = tmp_path / "params.yaml"
    params.write_text("corpus: {sources: [shakespeare]}\ndecode: {domains: {shakespeare: [perplexity, fidelity, cloze]}}\n")
    with pytest.raises(ConfigError, match=r"decode\.domains\.shakespeare: task 'cloze'.*corpus\.tasks\.cloze"):
        validate_params(params)


def test_task_load_names_a_missing_or_damaged_item_file(tmp_path):
    settings = TASKS.get("cloze").settings(None)
    with pytest.raises(CorpusError, match=r"cloze\.jsonl does not exist: set corpus\.tasks\.cloze"):
        TASKS.get("cloze")().load(settings, tmp_path, None)
    (tmp_path / "choice.jsonl").write_text('{"context": "a", "choices": [" b", " c"], "answer": 0}\n{"context": "a"}\n')
    with pytest.raises(CorpusError, match=r"choice\.jsonl line 2 is not a choice item"):
        TASKS.get("choice")().load(TASKS.get("choice").settings(None), tmp_path, None)


# --- scoring on a tiny model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer trained on the plays (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text for _, text in play()], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    path = save_tiny_pretrained(tmp_path_factory.mktemp("items") / "model", tokenizer)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokenizer


def _count(tokenizer):
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _hf_loglik(model, context: list[int], whole: list[int]) -> tuple[float, bool]:
    """Log-likelihood of whole[len(context):] after context with a plain HF forward, and whether it is greedy."""
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0, len(context) - 1:-1].float(), -1)
    target = torch.tensor(whole[len(context):])
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def test_cloze_at_full_depth_matches_hf_loglikelihoods_and_greedy_generation(tiny):
    model, tok = tiny
    records = cloze_items(play(), _count(tok), ClozeBuild(items=6, context_tokens=24), seed=0, source="play")
    items = [ClozeItem(r["context"], r["target"]) for r in records]
    got = cloze(LayerStack(model), tok, items, Method(Full()))
    lls, greedy, generated = [], [], []
    for item in items:
        context, whole = encode_pair(tok, item.context, " " + item.target)
        ll, is_greedy = _hf_loglik(model, context, whole)
        lls.append(ll)
        greedy.append(float(is_greedy))
        with torch.inference_mode():
            out = model.generate(torch.tensor([context]), max_new_tokens=len(whole) - len(context) + 1,
                                 do_sample=False, pad_token_id=0)
        generated.append(float(first_word(tok.decode(out[0, len(context):])) == item.target))
    assert got["samples"]["loglikelihood"] == pytest.approx(lls, rel=1e-4, abs=1e-4)
    assert got["samples"]["acc"] == greedy and got["samples"]["generation_acc"] == generated
    assert got["loglikelihood"] == pytest.approx(sum(lls) / 6, rel=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(-sum(lls) / 6), rel=1e-4)
    assert got["n"] == 6 and got["flops_ratio"] == pytest.approx(1.0)
    assert got["chance"] == max(sum(i.target == t.target for i in items) for t in items) / 6
    shallow = cloze(LayerStack(model), tok, items, Method(Fixed(1)))
    assert shallow["flops_ratio"] < 1 and shallow["samples"]["loglikelihood"] != got["samples"]["loglikelihood"]


def test_choice_task_at_full_depth_matches_hf_loglikelihoods(tiny, tmp_path):
    model, tok = tiny
    records = choice_items(play(), _count(tok), ChoiceBuild(items=5, context_tokens=24, continuation_tokens=6,
                                                            choices=3), seed=0, source="play")
    (tmp_path / "choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    task = TASKS.get("choice")()
    settings = task.settings(None)
    items = task.load(settings, tmp_path, tok)
    sink: list = []
    got = task.run(LayerStack(model), tok, Method(Full()), items, settings, sink)
    acc, acc_norm = [], []
    for item in items:
        lls = [_hf_loglik(model, *encode_pair(tok, item.context, c))[0] for c in item.choices]
        norms = [ll / len(c) for ll, c in zip(lls, item.choices)]
        acc.append(int(lls.index(max(lls)) == item.answer))
        acc_norm.append(int(norms.index(max(norms)) == item.answer))
        assert [-s.nll for s in sink[:3]] == pytest.approx(lls, rel=1e-4, abs=1e-4)
        sink = sink[3:]
    assert got["samples"] == {"acc": acc, "acc_norm": acc_norm}
    assert got["acc"] == sum(acc) / 5 and got["acc_norm"] == sum(acc_norm) / 5
    assert got["chance"] == pytest.approx(1 / 3) and got["n"] == 5


@pytest.mark.parametrize("policy", ["monotone", "copy", "backfill"])
def test_choices_after_one_prefilled_prompt_equal_each_scored_alone(policy):
    from emad.decode import score_adaptive, score_continuations
    from emad.exits.criteria import Confidence
    from tests.tiny import random_prompts, tiny_model

    stack = LayerStack(tiny_model("llama"))
    prompt, *continuations = random_prompts(4, [9, 5, 1, 7], seed=41)
    method = Method(Confidence(threshold=3.5, probe_every=1), policy)  # tokens exit at layers 1 to 4 here
    together = score_continuations(stack, prompt, continuations, method)
    for continuation, got in zip(continuations, together):
        alone = score_adaptive(stack, prompt, continuation, method)
        assert got.depths == alone.depths and got.greedy == alone.greedy
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert (got.flops, got.full_flops) == pytest.approx((alone.flops, alone.full_flops))
    assert len({d for s in together for d in s.depths}) > 1  # the exits really vary
    with pytest.raises(ValueError, match="non-empty"):
        score_continuations(stack, prompt, [[5], []], method)
