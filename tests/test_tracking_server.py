"""MLflow on a tracking server backed by PostgreSQL (tools/tracking_server.py, `make tracking-server`): eight
processes opening the experiment at once on a fresh database make one experiment and eight runs; the decode stage
logs there and the store passes check_store. And a store that does not answer stops a stage before any work."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.mlflow_checks import check_store

ROOT = Path(__file__).resolve().parent.parent
OPEN_ONE_RUN = """
import sys
from emad import tracking
with tracking.stage_run("race", {"i": int(sys.argv[1])}, run_name=f"race {sys.argv[1]}") as run:
    assert run.active, "the store was not opened"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """A fresh PostgreSQL + mlflow server in a folder the ``postgres`` user can reach (pytest's tmp is root-only)."""
    from tools.tracking_server import pg_bin

    pg_bin("initdb")  # missing binaries: FileNotFoundError with the install instruction, never a silent skip
    folder = Path(tempfile.mkdtemp(prefix="emad-tracking-"))
    folder.chmod(0o755)
    port, pg_port = _free_port(), _free_port()
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
def test_the_decode_stage_logs_to_the_server_and_its_store_passes_check_store(server, tmp_path, smollm2):
    import yaml

    from tests.test_executors import DECODE
    from tests.tiny import save_tiny_pretrained

    save_tiny_pretrained(tmp_path / "model", smollm2.tokenizer)
    corpus = tmp_path / "corpora" / "toy-a"
    corpus.mkdir(parents=True)
    corpus.joinpath("eval.jsonl").write_text('{"id": "0", "text": "' + "The quick brown fox jumps. " * 40 + '"}\n')
    corpus.joinpath("manifest.json").write_text('{"manifest_sha256": "toy"}')
    params = {**DECODE, "domains": {"toy-a": DECODE["domains"]["toy-a"]}, "points": {}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"decode": params}))
    args = ["--kind", "baseline", "--model", "tiny", "--model-dir", str(tmp_path / "model"), "--corpora",
            str(tmp_path / "corpora"), "--out", str(tmp_path / "runs"), "--artifacts", str(tmp_path / "art"),
            "--params", str(tmp_path / "params.yaml")]
    env = {**os.environ, "MLFLOW_TRACKING_URI": server}
    done = subprocess.run([sys.executable, "pipeline/decode.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "MLflow skipped" not in done.stderr
    check_store(server)

    import mlflow

    runs = mlflow.MlflowClient(tracking_uri=server).search_runs(
        [mlflow.MlflowClient(tracking_uri=server).get_experiment_by_name("emad").experiment_id])
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}  # full, fixed_2, fixed_3
    artifacts = mlflow.MlflowClient(tracking_uri=server).list_artifacts(runs[0].info.run_id)
    assert {"depth.png", "heatmap.html", "decode_settings.json"} <= {a.path for a in artifacts}


@pytest.mark.parametrize("scheme", ["http", "postgresql"])
def test_a_tracking_store_that_does_not_answer_stops_a_stage_before_any_work(tmp_path, scheme):
    uri = f"{scheme}://127.0.0.1:{_free_port()}" + ("/mlflow" if scheme == "postgresql" else "")  # nothing listens
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    done = subprocess.run([sys.executable, "pipeline/decode.py", "--kind", "baseline", "--model", "tiny",
                           "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "runs"),
                           "--artifacts", str(tmp_path / "art")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"decode: error: MLFLOW_TRACKING_URI={uri}: the tracking store does not answer" in done.stderr
    assert "make tracking-server" in done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "art").exists()
