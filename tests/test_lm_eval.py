"""The ``emad`` lm-eval model and tasks: exact scores at full depth, generation semantics, clear model_args errors,
and one loglikelihood and one generation task end to end (in process and through ``python -m emad.lm_eval``)."""

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


def _byte_bpe(texts: list[str], vocab_size: int = 300):
    """A small byte-level BPE tokenizer trained on ``texts`` (lossless, no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


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
    tokens = lm.tok_encode(text, special=False)
    (rolled,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    logp = _hf_logprobs(lm, [lm.prefix_token_id, *tokens])
    assert rolled == pytest.approx(float(logp.gather(-1, torch.tensor(tokens)[:, None]).sum()), abs=1e-4)
    short = EmadLM(model=str(model_dir), device="cpu", rolling_window=9, rolling_prefix=3)
    windows = list(short.rolling_windows(text))
    assert len(windows) > 2 and [t for _, c in windows for t in c] == tokens
    assert windows[0][0] == [lm.prefix_token_id] and all(len(p) == 3 for p, _ in windows[1:])
    assert all(len(p) + len(c) <= 9 for p, c in windows)


@pytest.mark.parametrize("args, named", [
    ("method=bogus", "method='bogus'"),
    ("method=emad,margin=0.1", "profile="),
    ("colour=blue", "colour"),
    ("batch_size=0", "batch_size"),
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
