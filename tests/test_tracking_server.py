"""MLflow on a tracking server backed by PostgreSQL (tools/tracking_server.py, `make tracking-server`): eight
processes opening the experiment at once on a fresh database make one experiment and eight runs; `dvc repro` of the
tiny-model graph logs there and the store passes check_store. And a store that does not answer stops a stage before
any work."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.mlflow_checks import check_store
from tests.tiny_graph import free_port

ROOT = Path(__file__).resolve().parent.parent
OPEN_ONE_RUN = """
import sys
from emad import tracking
with tracking.stage_run("race", {"i": int(sys.argv[1])}, run_name=f"race {sys.argv[1]}") as run:
    assert run.active, "the store was not opened"
"""


@pytest.fixture(scope="module")
def server():
    """A fresh PostgreSQL + mlflow server in a folder the ``postgres`` user can reach (pytest's tmp is root-only)."""
    from tools.tracking_server import pg_bin

    pg_bin("initdb")  # missing binaries: FileNotFoundError with the install instruction, never a silent skip
    folder = Path(tempfile.mkdtemp(prefix="emad-tracking-"))
    folder.chmod(0o755)
    port, pg_port = free_port(), free_port()
    cmd = [sys.executable, "tools/tracking_server.py", "--dir", str(folder), "--port", str(port),
           "--pg-port", str(pg_port)]
    started = subprocess.run([*cmd, "--detach"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    uri = f"http://127.0.0.1:{port}"
    assert f"export MLFLOW_TRACKING_URI={uri}" in started.stdout
    yield uri
    subprocess.run([*cmd, "--stop"], cwd=ROOT, capture_output=True, timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.heavy
def test_eight_processes_opening_the_experiment_at_once_make_one_experiment_and_eight_runs(server):
    env = {**os.environ, "MLFLOW_TRACKING_URI": server, "EMAD_MLFLOW_EXPERIMENT": "race"}
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_ONE_RUN, str(i)], cwd=ROOT, env=env,
                              stderr=subprocess.PIPE, text=True) for i in range(8)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, errors
    assert not [e for e in errors if "MLflow skipped" in e], errors

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=server)
    experiments = [e for e in client.search_experiments() if e.name == "race"]
    assert len(experiments) == 1
    runs = client.search_runs([experiments[0].experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(f"race {i}" for i in range(8))
    assert {r.info.status for r in runs} == {"FINISHED"}
    default = client.get_experiment_by_name("Default")
    assert default is None or not client.search_runs([default.experiment_id])  # none dropped into Default


@pytest.mark.heavy
def test_the_tiny_graph_logs_to_the_server_and_its_store_passes_check_store(server, tmp_path, smollm2):
    from tests.tiny_graph import env, make_repo, mlflow_runs, sh

    graph = make_repo(tmp_path, smollm2.tokenizer)
    sh(graph, "dvc", "repro", timeout=1200, environ=env(MLFLOW_TRACKING_URI=server))
    assert "changed" not in sh(graph, "dvc", "status")
    assert not (graph / "mlflow.db").exists()  # nothing went to the repository's own store
    check_store(server)  # names, no None params, uniform decode params and metrics

    runs = mlflow_runs(server)
    runs = runs[runs["tags.dvc_stage"].notna()]
    assert set(runs["status"]) == {"FINISHED"}
    assert runs["tags.dvc_stage"].value_counts().to_dict() == {
        "fit_readouts": 2, "calibrate": 4, "smooth": 4, "fit_estimators": 4, "decode": 8, "control_decode": 4,
        "decode_ablation": 1, "decode_related": 1, "risk": 1, "aggregate": 1}
    import mlflow

    decode = runs[runs["tags.dvc_stage"] == "decode"].iloc[0]["run_id"]
    artifacts = {a.path for a in mlflow.MlflowClient(tracking_uri=server).list_artifacts(decode)}
    assert {"depth.png", "heatmap.html", "decode_settings.json"} <= artifacts  # served by the server's store


@pytest.mark.parametrize("scheme", ["http", "postgresql"])
def test_a_tracking_store_that_does_not_answer_stops_a_stage_before_any_work(tmp_path, scheme):
    uri = f"{scheme}://127.0.0.1:{free_port()}" + ("/mlflow" if scheme == "postgresql" else "")  # nothing listens
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    done = subprocess.run([sys.executable, "pipeline/decode.py", "--kind", "baseline", "--model", "tiny",
                           "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "runs"),
                           "--artifacts", str(tmp_path / "art")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"decode: error: MLFLOW_TRACKING_URI={uri}: the tracking store does not answer" in done.stderr
    assert "make tracking-server" in done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "art").exists()
