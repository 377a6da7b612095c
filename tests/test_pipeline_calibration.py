"""Stages calibrate and smooth on a tiny model: outputs, MLflow runs, torchrun equivalence, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from emad.calibration.profile import Profile
from emad.calibration.stats import CalibrationStats
from tests.tiny import save_tiny_pretrained

ROOT = Path(__file__).resolve().parent.parent
PARAMS = {
    "calibrate": {"sources": ["toy"], "window": 16, "batch_size": 2, "probe_layers": [1, 2],
                  "strata": {"position_edges": [4], "confidence_edges": []}, "checkpoint_every": 2,
                  "device": "cpu", "dtype": "float32"},
    "smooth": {"statistic": "mean", "min_count": 5},
}
TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Entropy decreases with depth. ") * 4


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("calib")
    save_tiny_pretrained(root / "model", smollm2.tokenizer)
    corpus = root / "corpus"
    corpus.mkdir()
    docs = [{"id": str(i), "text": TEXT[i * 7:] + f" document {i}", "n_tokens": 0} for i in range(9)]
    (corpus / "calib.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (corpus / "manifest.json").write_text(json.dumps({"manifest_sha256": "toyhash"}))
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    return root


def _env(root: Path) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _calibrate(root: Path, out: Path, nproc: int = 1, params: Path | None = None) -> subprocess.CompletedProcess:
    args = ["--model-dir", str(root / "model"), "--corpus", str(root / "corpus"), "--out", str(out),
            "--params", str(params or root / "params.yaml")]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    return subprocess.run([*launcher, str(ROOT / "pipeline" / "calibrate.py"), *args], env=_env(root),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.heavy
def test_two_process_torchrun_equals_one_process(workspace):
    one = _calibrate(workspace, workspace / "one" / "stats.json")
    assert one.returncode == 0, one.stderr
    two = _calibrate(workspace, workspace / "two" / "stats.json", nproc=2)
    assert two.returncode == 0, two.stderr
    a = CalibrationStats.load(workspace / "one" / "stats.json")
    b = CalibrationStats.load(workspace / "two" / "stats.json")
    assert a.tokens == b.tokens > 0
    for x, y in zip(a.arrays(), b.arrays()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    assert a.corpus == "toyhash" and a.model["n_layers"] == 4
    assert not list((workspace / "two").glob("*.ckpt*"))


@pytest.mark.heavy  # two stage processes (calibrate, smooth), about 25 s
def test_smooth_writes_profile_plot_and_mlflow_runs(workspace):
    stats = workspace / "one" / "stats.json"
    if not stats.exists():
        assert _calibrate(workspace, stats).returncode == 0
    out, plot = workspace / "one" / "profile.json", workspace / "plots" / "profile.png"
    done = subprocess.run([sys.executable, str(ROOT / "pipeline" / "smooth.py"), "--stats", str(stats), "--out",
                           str(out), "--plot", str(plot), "--params", str(workspace / "params.yaml")],
                          env=_env(workspace), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    profile = Profile.load(out)
    assert profile.strata.names() == ["pos[0,4)", "pos[4,inf)"]
    for tau in profile.tau.values():
        assert all(a >= b for a, b in zip(tau, tau[1:]))
    # one file per stratification reachable by dropping axes; the calibrated one equals profile.json
    assert sorted(p.name for p in (out.parent / "strata").iterdir()) == ["none.json", "position.json"]
    assert Profile.load(out.parent / "strata" / "position.json").tau == profile.tau
    assert Profile.load(out.parent / "strata" / "none.json").strata.names() == ["all"]
    assert plot.stat().st_size > 1000
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["emad"])
    stages = set(runs["tags.dvc_stage"])
    assert {"calibrate", "smooth"} <= stages
    assert (runs["status"] == "FINISHED").all()
    smooth_run = runs[runs["tags.dvc_stage"] == "smooth"].iloc[0]
    history = mlflow.MlflowClient().get_metric_history(smooth_run.run_id, "tau.pos_0_4_")
    assert [m.step for m in history] == [1, 2, 4]  # step = probe layer; L = 4 is always a probe


@pytest.mark.parametrize("change, culprit", [
    ({"probe_layers": [0, 2]}, "probe_layers"),
    ({"probe_layers": [1, 9]}, "1..4"),
    ({"window": 100000}, "window"),
    ({"strata": {"position_edges": [8, 4]}}, "position_edges"),
    ({"batch_sise": 2}, "calibrate.batch_sise"),
])
def test_bad_calibrate_params_fail_before_work_naming_the_culprit(workspace, tmp_path, change, culprit):
    params = json.loads(json.dumps(PARAMS))
    params["calibrate"].update(change)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "stats.json"
    done = _calibrate(workspace, out, params=tmp_path / "params.yaml")
    assert done.returncode != 0 and culprit in done.stderr
    assert not out.exists() and not list(tmp_path.glob("*.ckpt*"))
