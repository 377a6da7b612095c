"""Heavy: the decode stage on a Ray cluster of two nodes simulated on this machine (a head and a second node, each
with one CPU): its units run on both nodes with outputs identical to the serial run; losing the second node mid-stage
leaves the outputs complete and identical, or absent — never a partial set, never a RUNNING MLflow run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_executors import (
    _args,
    _outputs,
    workspace,  # noqa: F401 - the tiny two-domain workspace
)

pytestmark = pytest.mark.heavy
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "include_dashboard": False})
    second = made.add_node(num_cpus=1)
    made.wait_for_nodes()
    yield made, second
    made.shutdown()


def _decode(root: Path, out: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "pipeline/decode.py", *_args(root, out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _env(root: Path, **extra: str) -> dict:
    # one torch thread: each one-CPU node hosts one actor, computing as the serial run does
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'cluster.db'}", "OMP_NUM_THREADS": "1", **extra}


def _runs(root: Path):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{root / 'cluster.db'}")
    return mlflow.search_runs(experiment_names=["emad"])


def test_units_run_on_both_nodes_with_the_serial_outputs(workspace, cluster):  # noqa: F811
    made, _ = cluster
    serial = _decode(workspace, "c-serial", _env(workspace, EMAD_DECODE_EXECUTOR="serial"))
    assert serial.wait(timeout=600) == 0, serial.stdout.read()
    ray_run = _decode(workspace, "c-ray", _env(workspace, EMAD_DECODE_EXECUTOR="ray", RAY_ADDRESS=made.address))
    assert ray_run.wait(timeout=600) == 0, ray_run.stdout.read()
    assert _outputs(workspace / "c-ray") == _outputs(workspace / "c-serial")
    workers = _runs(workspace)["tags.worker"].dropna()
    nodes = {w.split(" node ")[1] for w in workers if " node " in w}
    assert len(nodes) == 2, workers.tolist()  # one unit (domain) on each node


def test_losing_a_node_mid_stage_leaves_complete_outputs_or_none(workspace, cluster):  # noqa: F811
    made, second = cluster
    if not (workspace / "c-serial").exists():
        serial = _decode(workspace, "c-serial", _env(workspace, EMAD_DECODE_EXECUTOR="serial"))
        assert serial.wait(timeout=600) == 0, serial.stdout.read()
    before = len(_runs(workspace))
    proc = _decode(workspace, "c-lost", _env(workspace, EMAD_DECODE_EXECUTOR="ray", RAY_ADDRESS=made.address))
    seen, deadline = [], time.time() + 300
    while time.time() < deadline:  # both units under way: each actor has printed its teacher-forced pass
        line = proc.stdout.readline()
        seen.append(line)
        if sum("teacher-forced tasks" in s for s in seen) >= 2 or not line:
            break
    made.remove_node(second)
    log = "".join(seen) + proc.stdout.read()
    code = proc.wait(timeout=600)
    runs = _runs(workspace).iloc[: len(_runs(workspace)) - before]
    assert "RUNNING" not in set(runs["status"])
    if code == 0:  # the lost unit was retried on the head node
        assert _outputs(workspace / "c-lost") == _outputs(workspace / "c-serial"), log
    else:
        assert not (workspace / "c-lost").exists(), log
        assert len(runs) == 0, log
