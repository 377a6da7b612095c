"""The ``emad`` lm-eval model and tasks: exact scores at full depth, generation semantics, clear model_args errors,
one loglikelihood and one generation task end to end (in process and through ``python -m emad.lm_eval``), and
lm-eval's own ``hf`` model reproduced at full depth on local tasks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model, model_registry
from lm_eval.tasks._yaml_loader import load_yaml

from emad.calibration.calibrate import calibrate_texts
from emad.calibration.config import CalibrateConfig
from emad.calibration.profile import smooth
from emad.decode import generate
from emad.engine.models import load_model
from emad.lm_eval import TASKS_DIR, apply_defaults, default_device, task_manager
from emad.lm_eval.model import EmadLM, ModelArgsError
from emad.lm_eval.tasks import loaders
from emad.tasks.gsm8k import STRICT
from emad.tasks.gsm8k import test_rows as gsm8k_rows
from tests.tiny import save_tiny_pretrained

CONTEXTS = [("The answer is", " 42 dollars"), ("Natalia sold clips to ", "48 of her friends."), ("", "Hello world")]


def _byte_bpe(texts: list[str], vocab_size: int = 300, bos: bool = False):
    """A small byte-level BPE tokenizer trained on ``texts`` (lossless, no downloads); ``bos``: it has a BOS
    token ``<s>`` and adds it to every text by default, as Llama tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<eos>", *(["<s>"] if bos else [])]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if not bos:
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<s>")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [r["question"] + "\n" + r["answer"] for r in gsm8k_rows()[:40]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, texts) -> Path:
    return save_tiny_pretrained(tmp_path_factory.mktemp("lm_eval") / "model", _byte_bpe(texts))


@pytest.fixture(scope="module")
def profile_path(model_dir, texts) -> Path:
    loaded = load_model(str(model_dir), device="cpu", dtype="float32")
    cfg = CalibrateConfig(window=32, batch_size=4, probe_layers=[1, 2], max_tokens=1500, device="cpu",
                          dtype="float32")
    path = model_dir.parent / "profile.json"
    smooth(calibrate_texts(loaded, texts, cfg), "mean", min_count=1).save(path)
    return path


@pytest.fixture(scope="module")
def lm(model_dir) -> EmadLM:
    return EmadLM(model=str(model_dir), device="cpu")


def _hf_logprobs(lm: EmadLM, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, V]`` log-probabilities of the HF model's own forward pass."""
    with torch.no_grad():
        logits = lm.loaded.model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_full_depth_loglikelihood_equals_hf_logprobs(lm):
    results = lm.loglikelihood(_requests("loglikelihood", CONTEXTS), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(CONTEXTS, results):
        prompt, cont = lm.encode_pair(context, continuation)
        logp = _hf_logprobs(lm, prompt + cont)[len(prompt) - 1:]  # [len(cont), V]
        targets = torch.tensor(cont)
        assert logprob == pytest.approx(float(logp.gather(-1, targets[:, None]).sum()), abs=1e-5)
        assert greedy == bool((logp.argmax(-1) == targets).all())


def test_is_greedy_is_true_exactly_for_the_greedy_continuation(lm):
    prompt = lm.tok_encode("Question: how many eggs")
    with torch.no_grad():
        greedy = lm.loaded.model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):]
    greedy = greedy.tolist()
    assert lm.score_tokens(prompt, greedy)[1] is True
    other = (greedy[-1] + 1) % len(lm.tokenizer)
    assert lm.score_tokens(prompt, [*greedy[:-1], other])[1] is False


def test_adaptive_scores_follow_generation(model_dir):
    lm = EmadLM(model=str(model_dir), device="cpu", method="fixed", depth=2)
    prompt = lm.tok_encode("Janet's ducks lay 16 eggs")
    out = generate(lm.stack, lm.tokenizer, [prompt], lm.method, 6, eos_token_ids=[])
    logprob, greedy = lm.score_tokens(prompt, out.token_ids[0])
    assert greedy is True
    assert logprob == pytest.approx(sum(t.logprob for t in out.traces[0]), abs=1e-5)
    assert lm.costs["loglikelihood"].mean_depth == 2 and lm.costs["loglikelihood"].cost_ratio < 1


def test_rolling_loglikelihood_scores_every_token_once(lm, model_dir):
    text = "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting."
    tokens = lm.tok_encode(text)
    (rolled,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    logp = _hf_logprobs(lm, [lm.prefix_token_id, *tokens])
    assert rolled == pytest.approx(float(logp.gather(-1, torch.tensor(tokens)[:, None]).sum()), abs=1e-4)
    short = EmadLM(model=str(model_dir), device="cpu", rolling_window=9, rolling_prefix=3)
    windows = list(short.rolling_windows(text))
    assert len(windows) > 2 and [t for _, c in windows for t in c] == tokens
    assert windows[0][0] == [lm.prefix_token_id] and all(len(p) == 3 for p, _ in windows[1:-1])
    assert len(windows[-1][0]) >= 3  # the last, shorter window reads more context
    assert all(len(p) + len(c) <= 9 for p, c in windows)


@pytest.mark.parametrize("args, named", [
    ("method=bogus", "method='bogus'"),
    ("method=emad,margin=0.1", "profile="),
    ("colour=blue", "colour"),
    ("batch_size=0", "batch_size"),
    ("rolling_prefix=8", "rolling_prefix=8 .*needs rolling_window"),
    ("rolling_window=1", "rolling_window must be an integer >= 2"),
    ("rolling_window=wide", "rolling_window must be an integer"),
    ("rolling_window=16,rolling_prefix=0", r"rolling_prefix must be in 1\.\.15"),
    ("add_bos_token=sometimes", "add_bos_token must be True or False"),
    ("max_length=1", "max_length"),
])
def test_bad_model_args_fail_before_loading_and_name_the_argument(args, named):
    with pytest.raises(ModelArgsError, match=named):
        get_model("emad").create_from_arg_string(args, {"device": "cpu"})


def test_bad_model_args_after_loading_name_the_argument(model_dir, tmp_path):
    with pytest.raises(ModelArgsError, match="depth"):
        get_model("emad").create_from_arg_string(f"model={model_dir},method=fixed", {"device": "cpu"})
    with pytest.raises(ModelArgsError, match="nope.json"):
        get_model("emad").create_from_arg_string(
            f"model={model_dir},method=emad,margin=0.1,profile={tmp_path / 'nope.json'}", {"device": "cpu"})
    with pytest.raises(ModelArgsError, match="max_length"):
        EmadLM(model=str(model_dir), device="cpu", max_length=100_000)
    with pytest.raises(ModelArgsError, match="rolling_prefix"):
        EmadLM(model=str(model_dir), device="cpu", rolling_window=16, rolling_prefix=16)
    with pytest.raises(ModelArgsError, match=r"rolling_window must be in 2\.\.256 \(max_length\), got 300"):
        EmadLM(model=str(model_dir), device="cpu", rolling_window=300)


def test_the_builtin_models_stay_registered():
    assert {"emad", "hf"} <= set(model_registry.keys())


def test_simple_evaluate_runs_loglikelihood_rolling_and_generation_tasks(model_dir, profile_path, tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)  # task data must not depend on the working directory
    out = lm_eval.simple_evaluate(
        model="emad", model_args=f"model={model_dir},method=emad,profile={profile_path},margin=0.5",
        tasks=["emad_stdlib_lastword", "emad_stdlib_prose", "emad_gsm8k"], device="cpu",
        task_manager=task_manager({"n_docs": 3}, include_defaults=False), limit=2,
        gen_kwargs={"max_gen_toks": 8}, bootstrap_iters=0, log_samples=True)
    results = out["results"]
    assert 0 <= results["emad_stdlib_lastword"]["acc,none"] <= 1
    assert math.isfinite(results["emad_stdlib_lastword"]["perplexity,none"])
    assert results["emad_stdlib_prose"]["bits_per_byte,none"] > 0
    assert 0 <= results["emad_gsm8k"]["exact_match,strict-match"] <= 1
    answers = [s["resps"][0][0] for s in out["samples"]["emad_gsm8k"] if s["filter"] == "strict-match"]
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


@pytest.mark.heavy  # a fresh `python -m emad.lm_eval`, about 20 s
def test_module_entry_runs_tasks_on_the_default_device(model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "emad.lm_eval", "--model", "emad", "--model_args", f"model={model_dir}",
           "--tasks", "emad_stdlib_lastword,emad_gsm8k", "--limit", "2", "--metadata", "n_docs=3",
           "--gen_kwargs", "max_gen_toks=8", "--output_path", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "emad_stdlib_lastword" in done.stdout and "emad_gsm8k" in done.stdout
    (path,) = (tmp_path / "out").rglob("results_*.json")
    saved = json.loads(path.read_text())
    assert set(saved["results"]) == {"emad_stdlib_lastword", "emad_gsm8k"}
    assert saved["config"]["device"] == default_device()


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help_lists_the_models_args_and_its_windows(argv, capsys):
    from emad.lm_eval import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    shown = capsys.readouterr().out
    assert done.value.code == 0 and shown.startswith("usage: python -m emad.lm_eval")
    assert "reproduces --model hf" in shown and "rolling_window=N[,rolling_prefix=P]" in shown


def test_defaults_fill_only_what_the_user_left_out():
    args = apply_defaults(Namespace(command="run", model=None, device=None, include_path=f"a{os.pathsep}b",
                                    config=None))
    assert (args.model, args.device, args.include_path) == ("emad", default_device(), [str(TASKS_DIR), "a", "b"])
    args = apply_defaults(Namespace(command="run", model="hf", device="cuda:1", include_path=None, config=None))
    assert (args.model, args.device, args.include_path) == ("hf", "cuda:1", [str(TASKS_DIR)])


def test_task_yamls_match_the_library_and_hold_out_the_shots():
    config = load_yaml(TASKS_DIR / "emad_gsm8k.yaml", resolve_func=False)
    strict = next(f for f in config["filter_list"] if f["name"] == "strict-match")
    assert strict["filter"][0]["regex_pattern"] == STRICT.pattern
    data = loaders.gsm8k(n_docs=5)
    assert len(data["train"]) == loaders.GSM8K_SHOT_POOL and len(data["test"]) == 5
    assert not set(data["train"]["id"]) & set(data["test"]["id"])
    for row in loaders.stdlib_lastword(n_docs=5)["test"]:
        assert row["target"].startswith(" ") and row["target"][1:].isalpha() and not row["context"].endswith(" ")
    assert loaders.last_word_item("too short.") is None
    with pytest.raises(ValueError, match="n_docs"):
        loaders.gsm8k(n_docs=0)


def test_strategies_run_in_lm_eval(model_dir):
    """Speculative decoding is lossless in lm-eval too; EAD scores with the depths its generation chose."""
    full = EmadLM(model=str(model_dir), device="cpu")
    spec = EmadLM(model=str(model_dir), device="cpu", method="speculative", exit_layer=2, draft_policy="adaedl")
    ead = EmadLM(model=str(model_dir), device="cpu", method="ead", small_layers=2, tau=2.0, window=2, d_min=2)
    request = _requests("generate_until", [("Question: how many eggs", {"until": ["\n\n"], "max_gen_toks": 8})])
    assert spec.generate_until(request, disable_tqdm=True) == full.generate_until(request, disable_tqdm=True)
    ours, theirs = (m.loglikelihood(_requests("loglikelihood", CONTEXTS[:2]), disable_tqdm=True) for m in (spec, full))
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)
    (text,) = ead.generate_until(request, disable_tqdm=True)
    prompt = ead.tok_encode("Question: how many eggs")
    out = generate(ead.stack, ead.tokenizer, [prompt], ead.method, 8, eos_token_ids=[])
    logprob, greedy = ead.score_tokens(prompt, out.token_ids[0])
    assert greedy is True and logprob == pytest.approx(sum(t.logprob for t in out.traces[0]), abs=1e-5)
    assert isinstance(text, str)
    with pytest.raises(ModelArgsError, match=r"small_layers k=7.*1\.\.3"):
        EmadLM(model=str(model_dir), device="cpu", method="ead", small_layers=7, tau=1.0)


# --- lm-eval's own `hf` model, reproduced at full depth -------------------------------------------------------

ROLLING_TASK = """task: local_rolling
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}, cache_dir: {cache}}}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - {{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}}
"""
CHOICE_TASK = """task: local_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}, cache_dir: {cache}}}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
"""
GENERATION_TASK = """task: local_generation
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}, cache_dir: {cache}}}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n\\n", "?"], max_gen_toks: 10, do_sample: false}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
"""
LOCAL_TASKS = ["local_rolling", "local_choice", "local_generation"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory, texts) -> Path:
    """A task folder (YAMLs with absolute data paths) with a rolling, a multiple-choice and a generation task."""
    folder = tmp_path_factory.mktemp("local_tasks")
    rows = gsm8k_rows()[:10]
    first = [r["question"].split(". ")[0][:90] for r in rows]  # a sentence: under 100 tokens
    answers = [" " + r["answer"].rsplit("#### ", 1)[-1] for r in rows]
    data = {  # every request fits the model's 256 positions (see emad.lm_eval.tokens on longer ones)
        "local_rolling": [{"text": t} for t in first[:4]] + [{"text": ". ".join(first[4:7])}],
        "local_choice": [{"question": q, "label": i % 3, "choices": [answers[(i + k) % 10] for k in range(3)]}
                         for i, q in enumerate(first[:6])],
        "local_generation": [{"question": q, "answer": a} for q, a in zip(first[7:10], answers[7:10])],
    }
    templates = {"local_rolling": ROLLING_TASK, "local_choice": CHOICE_TASK, "local_generation": GENERATION_TASK}
    for name, rows_ in data.items():
        path = _jsonl(folder / f"{name}.jsonl", rows_)
        (folder / f"{name}.yaml").write_text(templates[name].format(data=path, cache=folder / "cache"),
                                             encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory, texts) -> Path:
    """A Llama model whose tokenizer adds a BOS token to every text by default."""
    return save_tiny_pretrained(tmp_path_factory.mktemp("lm_eval_bos") / "model", _byte_bpe(texts, bos=True))


def _evaluate(model: str, model_args: str, tasks_dir: Path, tasks: list[str] = LOCAL_TASKS) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, device="cpu",
                                   task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                                   bootstrap_iters=0, log_samples=True)


def _metrics(out: dict) -> dict[str, float]:
    return {f"{task}/{key}": value for task, res in out["results"].items() for key, value in res.items()
            if isinstance(value, float) and "stderr" not in key}


def test_simple_evaluate_reproduces_lm_evals_hf_model_by_default(bos_model_dir, local_tasks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hf = _evaluate("hf", f"pretrained={bos_model_dir},dtype=float32", local_tasks)
    ours = _evaluate("emad", f"model={bos_model_dir},method=full,dtype=float32", local_tasks)
    theirs, mine = _metrics(hf), _metrics(ours)
    assert set(theirs) == set(mine) and {"local_rolling/word_perplexity,none", "local_choice/acc_norm,none",
                                         "local_generation/exact_match,none"} <= set(mine)
    assert mine == pytest.approx(theirs, rel=1e-5)
    texts = {name: [s["resps"] for s in out["samples"]["local_generation"]] for name, out in (("hf", hf), ("emad", ours))}
    assert texts["emad"] == texts["hf"] and any(r[0][0] for r in texts["hf"])
    windows = _evaluate("emad", f"model={bos_model_dir},method=full,rolling_window=24,rolling_prefix=6", local_tasks,
                        ["local_rolling"])
    prefixed = _metrics(windows)["local_rolling/word_perplexity,none"]
    assert math.isfinite(prefixed) and prefixed != pytest.approx(theirs["local_rolling/word_perplexity,none"],
                                                                 rel=1e-3)


@pytest.fixture(scope="module", params=["no-bos", "bos"])
def backends(request, model_dir, bos_model_dir):
    """lm-eval's ``hf`` model and ours on the same folder, both with a short ``max_length`` (truncation and
    several rolling windows) and both at their defaults."""
    folder = str(model_dir if request.param == "no-bos" else bos_model_dir)
    hf = get_model("hf")
    return {
        "short": (hf(pretrained=folder, device="cpu", dtype="float32", max_length=24),
                  EmadLM(model=folder, device="cpu", dtype="float32", max_length=24)),
        "default": (hf(pretrained=folder, device="cpu", dtype="float32"),
                    EmadLM(model=folder, device="cpu", dtype="float32")),
    }


@pytest.mark.parametrize("setting", ["short", "default"])
def test_requests_score_as_lm_evals_hf_model(backends, setting, texts):
    hf, ours = backends[setting]
    assert (ours.max_length, ours.prefix_token_id) == (hf.max_length, hf.prefix_token_id)
    pairs = [*CONTEXTS, ("Weng earns $12 an hour.  ", "Yesterday"), ("", texts[3][:20])]
    documents = [texts[0][:100], texts[1][:60]]
    if setting == "short":  # truncated contexts and several rolling windows (by default these fit the model)
        pairs, documents = [*pairs, (texts[2][:200], " She sold")], [*documents, texts[2][:120]]
    scored = _requests("loglikelihood", pairs)
    rolled = _requests("loglikelihood_rolling", [(t,) for t in documents])
    theirs, mine = (m.loglikelihood(scored, disable_tqdm=True) for m in (hf, ours))
    assert [g for _, g in mine] == [g for _, g in theirs]
    assert [lp for lp, _ in mine] == pytest.approx([lp for lp, _ in theirs], rel=1e-5)
    theirs, mine = (m.loglikelihood_rolling(rolled, disable_tqdm=True) for m in (hf, ours))
    assert mine == pytest.approx(theirs, rel=1e-5)
    if setting == "short":
        assert len(ours.tok_encode(texts[2][:120])) > 3 * ours.max_length
    gen = _requests("generate_until", [("Natalia sold", {"until": ["."], "max_gen_toks": 6}),
                                       (texts[4][:60], {"max_gen_toks": 6})])
    assert ours.generate_until(gen, disable_tqdm=True) == hf.generate_until(gen, disable_tqdm=True)


def test_emad_windows_are_prefix_windows_and_differ_from_lm_evals(model_dir, texts):
    text = texts[0][:150]
    default = EmadLM(model=str(model_dir), device="cpu", max_length=48)
    windowed = EmadLM(model=str(model_dir), device="cpu", max_length=48, rolling_window=16)
    assert windowed.encoder.rolling.prefix == 4  # a quarter of the window
    theirs, mine = list(default.rolling_windows(text)), list(windowed.rolling_windows(text))
    tokens = default.tok_encode(text)
    for windows in (theirs, mine):
        assert [t for _, c in windows for t in c] == tokens
    # lm-eval's: one token of context (the last window, shorter, reads more of it); ours: a prefix of 4 tokens
    assert len(theirs) > 1 and {len(p) for p, _ in theirs[:-1]} == {1} and len(theirs[-1][0]) >= 1
    assert len(mine) > len(theirs) and {len(p) for p, _ in mine[1:-1]} == {4} and len(mine[-1][0]) >= 4
    assert max(len(p) + len(c) for p, c in theirs) == 49 and max(len(p) + len(c) for p, c in mine) == 16
    request = _requests("loglikelihood_rolling", [(text,)])
    (a,), (b,) = default.loglikelihood_rolling(request, disable_tqdm=True), windowed.loglikelihood_rolling(
        request, disable_tqdm=True)
    assert math.isfinite(b) and a != pytest.approx(b, rel=1e-4)
