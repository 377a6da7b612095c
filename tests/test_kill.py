"""Killed stages: SIGKILL mid-way, rerun, and the outputs equal an uninterrupted run's; MLflow runs end FAILED.

Each stage runs in a subprocess on a tiny model, paused at a known point by :mod:`tests.paused` (a checkpoint
written; the MLflow run open) and signalled there, so the signal cannot race the stage's end. ``calibrate`` resumes
from its checkpoint; a ``decode`` run leaves no run file (outputs are written atomically at the end), so the rerun
redoes it whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from emad.calibration.calibrate import calibrate_texts
from emad.calibration.config import CalibrateConfig
from emad.calibration.profile import smooth
from emad.calibration.stats import CalibrationStats
from emad.engine.models import load_model
from emad.evaluation import runfile
from emad.stage import checkpoint_beside
from tests.paused import paused_command
from tests.tiny import save_tiny_pretrained

pytestmark = pytest.mark.heavy  # run by `make test-heavy` (and CI), not `make test`

ROOT = Path(__file__).resolve().parent.parent
RUN = Path("runs") / "tiny--p--cal-toy--toy.json"
OPEN_RUN = "emad.tracking:Run.log_dict"  # the first thing decode does inside its open MLflow run
TEXT = "Entropy falls with depth for easy tokens. The quick brown fox jumps over the lazy dog. " * 40
PARAMS = {
    "calibrate": {"window": 32, "batch_size": 1, "probe_layers": [1, 2, 3], "checkpoint_every": 1,
                  "strata": {"position_edges": [8]}, "device": "cpu", "dtype": "float32"},
    "decode": {"domains": {"toy": ["fidelity"]},
               "tasks": {"fidelity": {"prompts": 16, "prompt_tokens": 16, "new_tokens": 160}},
               "points": {"p": {"method": "emad", "margin": 0.0}}, "device": "cpu", "dtype": "float32"},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("kill")
    save_tiny_pretrained(root / "model", smollm2.tokenizer)
    corpus = root / "corpora" / "toy"
    corpus.mkdir(parents=True)
    docs = [{"id": str(i), "text": TEXT[i * 11:]} for i in range(4)]  # ~2,800 tokens: ~90 calibration batches
    for split in ("calib", "eval"):
        (corpus / f"{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (corpus / "manifest.json").write_text(json.dumps({"manifest_sha256": "toy"}))
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    loaded = load_model(str(root / "model"), device="cpu", dtype="float32")
    cfg = CalibrateConfig(window=32, probe_layers=[1, 2, 3], device="cpu", dtype="float32")
    smooth(calibrate_texts(loaded, [TEXT], cfg, "toy"), min_count=1).save(root / "profile.json")
    return root


def _env(root: Path) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _calibrate_cmd(root: Path, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "pipeline" / "calibrate.py"), "--model-dir", str(root / "model"),
            "--corpus", str(root / "corpora" / "toy"), "--out", str(out), "--params", str(root / "params.yaml")]


def _decode_cmd(root: Path, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "pipeline" / "decode.py"), "--kind", "point", "--point", "p", "--model",
            "tiny", "--model-dir", str(root / "model"), "--domain", "toy", "--corpora", str(root / "corpora"),
            "--calibration", "toy", "--profile", str(root / "profile.json"), "--out", str(out / "runs"),
            "--artifacts", str(out / "art"), "--params", str(root / "params.yaml")]


def _run(cmd: list[str], root: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=_env(root), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def _start_and_kill(cmd: list[str], root: Path, pause_in: str, nth: int = 1, sig=signal.SIGKILL,
                    timeout: float = 120) -> int:
    """Start ``cmd`` with the ``nth`` call of ``pause_in`` (``module:attr``) pausing, wait until it pauses, then
    send ``sig``; fail if the command finished first.

    Returns the exit status (negative: killed by that signal)."""
    ready = root / "paused"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(paused_command(cmd, pause_in, ready, nth), env=_env(root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "never paused"
        time.sleep(0.02)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    return proc.returncode


def _runs(root: Path, stage: str):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["emad"], filter_string=f"tags.dvc_stage = '{stage}'")
    return runs.sort_values("start_time")


def test_killed_calibration_resumes_from_its_checkpoint_and_equals_an_uninterrupted_run(workspace):
    clean = workspace / "clean" / "stats.json"
    _run(_calibrate_cmd(workspace, clean), workspace)
    killed = workspace / "killed" / "stats.json"
    ckpt = checkpoint_beside(killed)  # outside the output's folder, which DVC removes before a rerun

    # killed right after its third checkpoint (one per batch)
    _start_and_kill(_calibrate_cmd(workspace, killed), workspace, "emad.calibration.calibrate:atomic_write_json", 3)
    assert not killed.exists() and json.loads(ckpt.read_text())["done_batches"] == 3
    rerun = _run(_calibrate_cmd(workspace, killed), workspace)
    assert "resuming from checkpoint" in rerun.stderr
    a, b = CalibrationStats.load(clean), CalibrationStats.load(killed)
    assert a.tokens == b.tokens > 0
    for x, y in zip(a.arrays(), b.arrays()):
        assert x.shape == y.shape and float(abs(x - y).max()) < 1e-6
    assert not ckpt.exists()
    statuses = list(_runs(workspace, "calibrate")["status"])
    assert statuses == ["FINISHED", "FAILED", "FINISHED"]  # the killed run was ended FAILED by the rerun


def test_killed_decode_run_leaves_nothing_and_its_rerun_equals_an_uninterrupted_run(workspace):
    clean, killed = workspace / "dclean", workspace / "dkilled"
    _run(_decode_cmd(workspace, clean), workspace)
    _start_and_kill(_decode_cmd(workspace, killed), workspace, OPEN_RUN)  # killed while its MLflow run is open
    assert not (killed / "runs").exists()
    _run(_decode_cmd(workspace, killed), workspace)
    a, b = runfile.load(clean / RUN), runfile.load(killed / RUN)
    for key in ("quality", "depth_histogram", "tasks"):
        strip = (lambda d: {k: v for k, v in d.items() if "seconds" not in k and "per_s" not in k})
        assert {t: strip(m) if isinstance(m, dict) else m for t, m in a[key].items()} == \
            {t: strip(m) if isinstance(m, dict) else m for t, m in b[key].items()}
    assert a["cost"]["flops_ratio"] == b["cost"]["flops_ratio"]
    runs = _runs(workspace, "decode")
    assert list(runs["status"]) == ["FINISHED", "FAILED", "FINISHED"]
    assert runs.iloc[1]["tags.error"].startswith("killed: process")


def test_sigterm_ends_the_mlflow_run_failed_with_the_error(workspace):
    out = workspace / "dterm"
    code = _start_and_kill(_decode_cmd(workspace, out), workspace, OPEN_RUN, sig=signal.SIGTERM)
    assert code == 143  # SystemExit(143), not the default SIGTERM death (-15) that would leave the run RUNNING
    last = _runs(workspace, "decode").iloc[-1]
    assert last["status"] == "FAILED" and last["tags.error"] == "SystemExit: 143"
    assert not (out / "runs").exists()


@pytest.mark.parametrize("during", ["start_run", "log_dict"])
def test_sigterm_while_the_run_is_being_created_ends_it_failed(tmp_path, monkeypatch, during):
    """Deterministic: SIGTERM arrives inside ``mlflow.start_run`` (the run just written to the store) or while it
    is being tagged, before the body could run. The run must end FAILED, not stay RUNNING."""
    import mlflow

    from emad import tracking

    def unhandled(signum, frame):  # stands in for the default action, which would kill pytest itself
        raise RuntimeError("SIGTERM reached the previous handler: stage_run did not cover it")

    real = getattr(mlflow, during)

    def then_sigterm(*args, **kwargs):
        result = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(mlflow, during, then_sigterm)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as exited, tracking.stage_run("decode", {"a": 1}, run_name="r"):
            pytest.fail("the body ran although SIGTERM came before it")
        assert signal.getsignal(signal.SIGTERM) is unhandled  # stage_run put the previous handler back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exited.value.code == 143 and mlflow.active_run() is None
    runs = _runs(tmp_path, "decode")
    assert list(runs["status"]) == ["FAILED"] and list(runs["tags.error"]) == ["SystemExit: 143"]
