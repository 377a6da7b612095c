"""The bad-input suite: each case asserts that the error names the culprit and that no partial output is left.

Params cases run the ``calibrate`` stage on a params file with one mistake: the whole file is checked before any
work. File cases run the ``decode`` stage on a tiny model with one damaged input. Runtime and sandbox cases call
the library.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from emad.calibration.calibrate import calibrate_texts
from emad.calibration.config import CalibrateConfig
from emad.calibration.profile import smooth
from emad.config import ConfigError
from emad.decode import ContextLengthError, generate
from emad.engine.models import ModelLoadError, ModelSpecError, load_model
from emad.engine.stack import LayerStack, NonFiniteLogitsError
from emad.params import validate_params
from emad.tasks.humaneval import run_sandboxed
from tests.tiny import save_tiny_pretrained, tiny_model

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Entropy falls with depth for easy tokens. The quick brown fox jumps over the lazy dog. " * 12

BASE = {
    "models": {"tiny": "tiny-folder"},
    "corpus": {"sources": ["stdlib-prose", "gsm8k"], "calib_tokens": 1000, "eval_tokens": 500},
    "calibrate": {"sources": ["stdlib-prose"], "window": 32, "probe_layers": [1, 2, 3], "readouts": ["logit", "tuned"],
                  "max_tokens": 500},
    "readouts": {"layers": [1, 2, 3], "tokens": 256, "selection": 64, "holdout": 64},
    "smooth": {"statistic": "mean", "min_count": 1},
    "estimators": {"topk": {"k": 16}},
    "decode": {
        "domains": {"stdlib-prose": ["perplexity", "fidelity"], "gsm8k": ["gsm8k", "fidelity"]},
        "tasks": {"perplexity": {"tokens": 64, "window": 32, "prefix": 8},
                  "fidelity": {"prompts": 16, "prompt_tokens": 8, "new_tokens": 4}},
        "baselines": {"full": {"method": "full"}},
        "points": {"p": {"method": "emad", "margin": 0.5}},
        "default_point": "p",
        "ablations": {"copy": {"policy": "copy"}},
        "ablation_domains": ["stdlib-prose"],
        "related": {"ead": {"method": "ead", "small_layers": 1, "tau": 1.0}},
        "related_domains": ["gsm8k"],
        "speed_tokens": 4,
        "device": "cpu", "dtype": "float32",
    },
    "risk": {"domain": "stdlib-prose", "prompts": 22, "delta": 0.1, "epsilon": 0.1,
             "searches": {"m": {"point": {"method": "emad"}, "knob": "margin", "values": [1.0, 0.5]}}},
    "control": {"model": "tiny+idle2", "spec": "tiny-folder+idle2", "base": "tiny", "source": "stdlib-prose",
                "decode": {"domains": {"stdlib-prose": ["perplexity", "fidelity"]}, "baselines": {"full": {"method": "full"}},
                           "points": {"p": {"method": "emad", "margin": 1}}}},
    "aggregate": {"min_flops_reduction": 0.15},
}


def _set(params: dict, path: str, value) -> dict:
    """A copy of ``params`` with ``a.b.c`` set to ``value`` (``...=DELETE`` removes it)."""
    out = copy.deepcopy(params)
    *parents, last = path.split("/")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return out


DELETE = object()

PARAMS_CASES = [  # (path with '/' between keys, value, what the message must name)
    ("decod", {"domains": {}}, r"unknown section\(s\) decod"),
    ("calibrate/windw", 256, r"calibrate\.windw"),
    ("calibrate/window", "big", r"calibrate\.window.*'big'"),
    ("calibrate/batch_size", 0, r"calibrate\.batch_size.*greater than or equal to 1"),
    ("calibrate/probe_layers", [0, 2], r"calibrate\.probe_layers"),
    ("calibrate/strata", {"position_edges": [8, 4]}, r"calibrate\.strata.*position_edges"),
    ("calibrate/strata", {"confidence_edges": [1.5]}, r"confidence_edges\[0\] = 1\.5"),
    ("calibrate/sources", ["shakespeare"], r"calibrate\.sources\[0\]: 'shakespeare' is not sampled"),
    ("smooth/statistic", "median", r"smooth\.statistic.*'median'"),
    ("smooth/min_count", 0, r"smooth\.min_count"),
    ("estimators/topk/k", 0, r"estimators\.topk\.k"),
    ("estimators/readouts", ["logit", "lens"], r"estimators\.readouts\[1\]: 'lens' has no profile; valid: "
                                               r"calibrate\.readouts \(logit, tuned\)"),
    ("corpus/sources", ["stdlib-prose", "wikitxt"], r"corpus\.sources\[1\].*wikitxt.*valid: "),
    ("corpus/calib_tokens", -5, r"corpus\.calib_tokens"),
    ("decode/domains/shakespeare", ["perplexity", "fidelity"], r"decode\.domains\.shakespeare: the domain is not sampled"),
    ("decode/domains/stdlib-code", ["perplexity"], r"decode\.domains\.stdlib-code: none of its tasks \(perplexity\) "
     r"gives the prompts C2 times a point on; add one of .*fidelity"),
    ("decode/domains/stdlib-prose", ["perplexty"], r"perplexty.*valid: "),
    ("decode/points/p/method", "emda", r"decode\.points\.p\.method.*'emda'.*valid: "),
    ("decode/points/p/margin", "wide", r"decode\.points\.p\.margin.*'wide'"),
    ("decode/points/p/strata", "all", r"decode\.points\.p\.strata.*valid: none, position, confidence, both"),
    ("decode/points/p/policy", "rewind", r"decode\.points\.p\.policy.*'rewind'"),
    ("decode/points/p", {"method": "emad", "margin": [0.5, 1], "estimator": "topq"},
     r"decode\.points\.p_0\.5\.estimator.*unknown estimator 'topq'; valid: .*topk"),
    ("decode/shift_points", ["nope"], r"shift_points \['nope'\] are not points or sweeps of points"),
    ("decode/speed_prompts", 5, r"decode\.speed_prompts = 5 is below the 8 distinct prompts per domain"),
    ("decode/tasks/fidelity", {"prompts": 8}, r"decode\.tasks\.fidelity\.prompts = 8 gives 4 prompts in the "
     r"confirmation half, fewer than decode\.speed_prompts = 8"),
    ("control/spec", "smollm2-135m", r"control\.spec.*has no idle layers.*\+idle<N>"),
    ("control/spec", "smollm2-135m+idle0", r"control\.spec.*idle-layer count.*positive integer"),
    ("control/spec", "smollm2-135m+idle2.5", r"control\.spec.*idle-layer count.*positive integer"),
    ("control/model", "a/b", r"control\.model.*should match pattern"),
    ("control/source", "shakespeare", r"control\.source: 'shakespeare' is not a calibration source"),
    ("control/base", "other", r"control\.base: 'other' is not the model of models that control\.spec "
     r"\('tiny-folder\+idle2'\) grows; valid: a model whose spec is 'tiny-folder' \(tiny\)"),
    ("control/decode/points/p/margin", "wide", r"control\.decode\.points\.p\.margin.*'wide'"),
    ("control/decode", {"domains": {"stdlib-prose": ["perplexity", "fidelity"]}}, r"control\.decode: give baselines, points"),
    ("decode/points/p.1", {"method": "emad", "margin": 1.0}, r"no dots.*p\.1"),
    ("decode/baselines/fixed", {"method": "fixed", "depht": 2}, r"decode\.baselines\.fixed\.depht"),
    ("decode/default_point", "nope", r"default_point 'nope'"),
    ("decode/ablations/copy", {"polcy": "copy"}, r"decode\.ablations\.copy\.polcy"),
    ("decode/ablation_domains", ["shakespeare"], r"ablation_domains \['shakespeare'\]"),
    ("decode/tasks/perplexity", {"tokens": 1}, r"decode\.tasks\.perplexity\.tokens"),
    ("decode/tasks/gsm8k", {"shot": 3}, r"decode\.tasks\.gsm8k\.shot"),
    ("decode/heatmap_texts", -1, r"decode\.heatmap_texts"),
    ("aggregate/min_flops_reduction", 1.5, r"aggregate\.min_flops_reduction"),
    ("aggregate/methods", [], r"aggregate\.methods"),
    ("decode/related/ead/tau", float("inf"), r"tau .*finite|decode\.related\.ead"),
    ("decode/related/s", {"method": "speculative", "exit_layer": 1, "max_draft": 0}, r"n \(the maximum draft"),
    ("decode/related/p", {"method": "softmax", "threshold": 0.5, "estimator": "prune", "prune_k": 0}, "prune_k"),
    ("decode/related/c", {"method": "contrastive", "threshold": 0.5, "alpha": 2.0}, "alpha"),
    ("risk/delta", 1.5, r"risk\.delta"),
    ("risk/prompts", 5, "need at least 22 held-out prompts, got 5"),
    ("risk/domain", "shakespeare", r"risk\.domain: 'shakespeare' is not sampled"),
    ("risk/calibration", "gsm8k", r"risk\.calibration: 'gsm8k' is not a calibration source; valid: .*stdlib-prose"),
    ("decode/ablation_calibration", "gsm8k", r"decode\.ablation_calibration: 'gsm8k' is not a calibration source"),
    ("risk/searches/m/knob", "depth", "knob 'depth' is not a scalar knob of method 'emad'"),
    ("readouts/rank", 0, r"readouts\.rank.*greater than or equal to 1"),
    ("readouts/lr", 0, r"readouts\.lr"),
    ("readouts/source", "shakespeare", r"readouts\.source: 'shakespeare' is not a calibration source"),
    ("readouts/layers", [2, 3], r"readouts\.layers = \[2, 3\] must cover calibrate\.probe_layers = \[1, 2, 3\]"),
    ("calibrate/max_tokens", 900, r"corpus\.calib_tokens = 1000 must hold calibrate\.max_tokens \(900\) \+ readouts"),
    ("readouts/selection", 8, r"readouts\.selection.*greater than or equal to 16"),
    ("readouts/selection", 700, r"corpus\.calib_tokens = 1000 must hold readouts\.tokens \+ readouts\.selection \+ "
                                r"readouts\.holdout = 256 \+ 700 \+ 64 = 1020.*at least 1020"),
    ("readouts/selection", 300, r"corpus\.calib_tokens = 1000 must hold calibrate\.max_tokens \(500\) \+ readouts\."
                                r"tokens \+ readouts\.selection \+ readouts\.holdout = 256 \+ 300 \+ 64 = 620, 1120 in "
                                r"all.*valid: corpus\.calib_tokens >= 1120"),
    ("calibrate/readouts", ["tuned", "lens"], r"calibrate\.readouts.*unknown readout 'lens'; valid: logit, tuned"),
    ("decode/points/p/readout", "trained", r"decode\.points\.p\.readout.*'trained'.*valid: logit, tuned"),
    ("models", {"smol.lm": "x"}, r"models\.smol\.lm"),
    ("models/tiny", " ", r"models\.tiny.*not empty"),
]


def test_a_control_calibrated_where_its_base_fits_no_readouts_is_refused():
    params = _set(_set(BASE, "calibrate/sources", ["stdlib-prose", "gsm8k"]), "readouts/source", "gsm8k")
    with pytest.raises(ConfigError, match=r"control\.source: 'stdlib-prose' must be readouts\.source \('gsm8k'\)"):
        validate_params_dict(params)


def test_the_base_params_and_the_project_params_are_valid():
    for params in (BASE, yaml.safe_load((ROOT / "params.yaml").read_text())):
        cfg = validate_params_dict(params)
        assert set(cfg) == set(BASE)


def validate_params_dict(params: dict) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "params.yaml"
        path.write_text(yaml.safe_dump(params))
        return validate_params(path)


@pytest.mark.parametrize("path, value, culprit", PARAMS_CASES, ids=[c[0] for c in PARAMS_CASES])
def test_a_params_mistake_stops_the_first_stage_naming_the_parameter(tmp_path, path, value, culprit):
    import pipeline.calibrate as stage

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(_set(BASE, path, value)))
    out = tmp_path / "out" / "stats.json"
    with pytest.raises(ValueError, match=culprit):
        stage.main(["--model-dir", str(tmp_path / "no-model"), "--corpus", str(tmp_path / "no-corpus"),
                    "--out", str(out), "--params", str(params)])
    assert not out.parent.exists()


def test_a_params_file_that_is_not_yaml_is_named(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("decode: [unclosed\n")
    with pytest.raises(ConfigError, match=f"params file {params} is not valid YAML"):
        validate_params(params)


# --------------------------------------------------------------------------------------------------- files
@pytest.fixture(scope="module")
def workspace(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("bad")
    save_tiny_pretrained(root / "model", smollm2.tokenizer)
    _corpus(root / "corpora" / "stdlib-prose", "".join(json.dumps({"id": str(i), "text": TEXT[i:]}) + "\n" for i in range(3)))
    loaded = load_model(str(root / "model"), device="cpu", dtype="float32")
    cfg = CalibrateConfig(window=32, probe_layers=[1, 2, 3], device="cpu", dtype="float32")
    smooth(calibrate_texts(loaded, [TEXT], cfg, "toy"), min_count=1).save(root / "profile.json")
    (root / "params.yaml").write_text(yaml.safe_dump({"decode": BASE["decode"]}))
    return root


def _corpus(folder: Path, eval_text: str | bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"manifest_sha256": "toy"}))
    data = eval_text.encode() if isinstance(eval_text, str) else eval_text
    (folder / "eval.jsonl").write_bytes(data)
    return folder


def _decode(root: Path, out: Path, model: Path | None = None, corpus: Path | None = None,
            profile: Path | None = None, monkeypatch=None) -> int:
    """Decode point ``p`` on domain stdlib-prose, whose corpus is ``corpus`` (a folder named after it)."""
    import pipeline.decode as stage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    return stage.main(["--kind", "point", "--point", "p", "--model", "tiny", "--model-dir",
                       str(model or root / "model"), "--domain", "stdlib-prose", "--corpora",
                       str((corpus or root / "corpora" / "stdlib-prose").parent), "--calibration", "toy",
                       "--profile", str(profile or root / "profile.json"), "--out", str(out / "runs"),
                       "--artifacts", str(out / "art"), "--params", str(root / "params.yaml")])


def _damaged_model(root: Path, tmp: Path) -> Path:
    import shutil

    folder = tmp / "model"
    shutil.copytree(root / "model", folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


def _gguf(root: Path, tmp: Path) -> Path:
    path = tmp / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 32)
    return path


def _truncated_profile(root: Path, tmp: Path) -> Path:
    path = tmp / "profile.json"
    path.write_text((root / "profile.json").read_text()[:200])
    return path


def _foreign_profile(root: Path, tmp: Path) -> Path:
    data = json.loads((root / "profile.json").read_text())
    data["model"]["n_layers"] = 30
    path = tmp / "profile.json"
    path.write_text(json.dumps(data))
    return path


FILE_CASES = [  # (which input is damaged, how, what the message must name)
    ("model", _damaged_model, r"cannot load .*model\.safetensors"),
    ("model", _gguf, r"cannot load .*broken\.gguf"),
    ("profile", _truncated_profile, r"profile .*profile\.json is truncated or not JSON"),
    ("profile", _foreign_profile, r"calibrated on model .*'n_layers': 30"),
    ("corpus", lambda root, tmp: _corpus(tmp / "c" / "stdlib-prose", ""), r"eval\.jsonl holds no documents"),
    ("corpus", lambda root, tmp: _corpus(tmp / "c" / "stdlib-prose", b'{"id": "0", "text": "caf\xe9"}\n'),
     r"corpus files in .*c/stdlib-prose are damaged \(UnicodeDecodeError"),
    ("corpus", lambda root, tmp: _corpus(tmp / "c" / "stdlib-prose", '{"id": "0", "text": "no end'), r"c/stdlib-prose are damaged"),
    ("profile", lambda root, tmp: tmp / "missing.json", r"profile .*missing\.json does not exist"),
]


@pytest.mark.parametrize("which, damage, culprit", FILE_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(FILE_CASES)])
def test_a_damaged_input_file_is_named_and_no_run_is_written(workspace, tmp_path, monkeypatch, which, damage,
                                                             culprit):
    bad = damage(workspace, tmp_path)
    out = tmp_path / "out"
    with pytest.raises((ValueError, FileNotFoundError, OSError), match=culprit):
        _decode(workspace, out, monkeypatch=monkeypatch, **{which: bad})
    assert not out.exists()


# --------------------------------------------------------------------------------------------------- runtime
def test_a_prompt_longer_than_the_context_is_refused_before_decoding(smollm2):
    stack = LayerStack(tiny_model("llama"))  # context 256
    with pytest.raises(ContextLengthError, match=r"prompt of 250 tokens \+ max_new_tokens 10 exceeds .* 256"):
        generate(stack, smollm2.tokenizer, [[5] * 250], _full(), 10, eos_token_ids=[])


def _full():
    from emad.exits.criteria import Full

    return Full()


def test_nan_or_inf_logits_from_a_bf16_overflow_name_the_dtype(smollm2):
    model = tiny_model("llama").to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.fill_(3e38)  # near bfloat16's largest value: the logits overflow
    stack = LayerStack(model)
    with pytest.raises(NonFiniteLogitsError, match=r"NaN or inf logits in torch\.bfloat16.*float32"):
        generate(stack, smollm2.tokenizer, [[5, 6, 7]], _full(), 4, eos_token_ids=[])


def test_an_unknown_model_while_offline_names_the_spec_and_the_aliases(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSpecError, match=r"nobody/no-such-model.*offline.*smollm2-135m"):
        load_model("nobody/no-such-model", device="cpu")


def test_a_missing_gguf_file_is_a_spec_error(tmp_path):
    with pytest.raises((ModelSpecError, ModelLoadError), match="nothing.gguf"):
        load_model(str(tmp_path / "nothing.gguf"), device="cpu")


# --------------------------------------------------------------------------------------------------- sandbox
@pytest.mark.parametrize("program, expect", [
    ("while True:\n    pass\n", "timed out"),
    ("import os\nwhile True:\n    os.fork()\n", "failed"),
    ("x = bytearray(10 * 1024 ** 3)\n", "MemoryError"),
    ("import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=2)\n", "failed"),
    ("def f(:\n", "SyntaxError"),
], ids=["loop", "fork-bomb", "10GB", "socket", "not-python"])
def test_hostile_or_broken_completions_fail_within_limits(program, expect):
    start = time.monotonic()
    outcome = run_sandboxed(program, timeout=3.0, memory_mb=512)
    assert not outcome.passed and expect in outcome.result
    assert time.monotonic() - start < 10


def test_a_completion_that_deletes_files_cannot(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    outcome = run_sandboxed(f"import os\nos.remove({str(victim)!r})\n", timeout=3.0)
    assert not outcome.passed and victim.read_text() == "precious"


@pytest.mark.parametrize("section, value, culprit", [
    ("topk", {"k": 10**6}, r"estimators\.topk\.k = 1000000 exceeds the vocabulary size of .*; valid: 1\.\.\d+"),
    ("lowrank", {"rank": 4096}, r"estimators\.lowrank\.rank = 4096 exceeds the hidden size of .*; valid: 1\.\.\d+"),
])
def test_an_estimator_larger_than_the_model_is_named_before_fitting(workspace, tmp_path, section, value, culprit):
    import pipeline.fit_estimators as stage

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"estimators": {"topk": None, section: value}}))
    corpus = _corpus(tmp_path / "corpus", "")
    (corpus / "calib.jsonl").write_text(json.dumps({"id": "0", "text": TEXT}) + "\n")
    out = tmp_path / "out" / "estimators.json"
    with pytest.raises(ValueError, match=culprit):
        stage.main(["--model-dir", str(workspace / "model"), "--corpus", str(corpus),
                    "--profile", str(workspace / "profile.json"), "--out", str(out), "--params", str(params)])
    assert not out.parent.exists()


def test_fit_estimators_only_names_the_estimators_it_may_fit(workspace, tmp_path):
    import pipeline.fit_estimators as stage

    out = tmp_path / "out" / "estimators.json"
    with pytest.raises(ValueError, match=r"--only topq: not fitted by the estimators section; valid: topk, lowrank"):
        stage.main(["--model-dir", str(workspace / "model"), "--corpus", str(workspace / "corpora" / "stdlib-prose"),
                    "--profile", str(workspace / "profile.json"), "--out", str(out), "--only", "topq",
                    "--params", str(workspace / "params.yaml")])
    assert not out.parent.exists()
