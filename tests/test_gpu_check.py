"""``make gpu-check`` (benchmarks/gpu_check.py) runs on a CPU as it will on a GPU — the compiled engine with its
graphs replayed on the CPU (:mod:`tests.cuda_like`) — so a GPU session spends its minutes measuring, not debugging:
every section runs, without errors, and the JSON holds every field the first GPU run reads."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.cuda_like import as_on_cuda

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_first_gpu_run_script_runs_every_section_on_a_cpu(tmp_path, monkeypatch):
    check = _script()
    monkeypatch.setattr("common.OUT_DIR", tmp_path)
    monkeypatch.setattr(check, "compiled_stack", lambda base: as_on_cuda(base, "aot_eager"))
    result = check.main(["--device", "cpu", "--reps", "1", "--out", "gpu-check-test"])
    written = json.loads((tmp_path / "gpu-check-test.json").read_text())
    assert written == json.loads(json.dumps(result)) and written["errors"] == []
    sections = written["sections"]
    assert list(sections) == ["environment", "latency", "if_node", "exactness", "decode", "c2_dry_run", "memory"]
    assert {"torch", "cuda", "if_nodes", "device"} <= set(sections["environment"])
    assert "host_read_us" in sections["latency"]
    assert sections["if_node"]["ok"] and {"replay_true_us", "replay_false_us"} <= set(sections["if_node"])
    for dtype in ("float32", "bfloat16"):
        rows = sections["exactness"][dtype]
        assert all(r["compiled_equals_eager_tokens"] and r["compiled_equals_eager_depths"] for r in rows.values())
        assert rows["full"]["rows_equal_hf_greedy"] == rows["full"]["rows"]
    for batch in sections["decode"]["batches"]:
        decoders = batch["decoders"]
        assert {"hf-static", "full/compiled", "fixed-0.5L/compiled", "fixed-0.8L/compiled",
                "emad-probes-exact/compiled", "emad-probes-topk/compiled", "emad-exits/compiled"} <= set(decoders)
        assert {"full_over_hf_static", "emad_probes_over_full", "fixed-0.5L_target"} <= set(batch["checks"])
        for steps in batch["steps"].values():  # the path CUDA takes with conditional nodes: one read, one launch
            assert steps == {"step_path": "device/graph-if", "host_reads_per_token": 1.0,
                             "graph_launches_per_token": 1.0}
    assert sections["c2_dry_run"]["built_nothing_while_timed"] and len(sections["c2_dry_run"]["points"]) == 2
    assert "peak_rss_gib" in sections["memory"]


def test_the_first_gpu_run_script_needs_no_pipeline_packages():
    """It runs on a bare CUDA machine with a few wheels added: no dvc, mlflow or ray on its imports."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import gpu_check; "
            "print(sorted(m for m in ('dvc', 'mlflow', 'ray', 'psycopg2', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
