"""Heavy: a Ray cluster of two nodes simulated on this machine — a head and a second node, each started with
`ray start` on ports of its own, one CPU each, token authentication with a token the hosts share. `RAY_ADDRESS=…
dvc repro` of the tiny-model graph runs the decode units on both nodes with the outputs of the serial executor and
leaves `dvc status` clean; a decode of one domain runs its shards and run groups on both nodes with the serial
outputs; losing the second node while it runs a shard leaves the stage's outputs complete and equal to the serial
ones (the shard retried on the head node), and no MLflow run RUNNING."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.test_executors import (
    _args,
    _outputs,
    workspace,  # noqa: F401 - the tiny two-domain workspace
)
from tests.tiny_graph import BIN, env, free_port, make_repo, mlflow_runs, sh

pytestmark = pytest.mark.heavy
ROOT = Path(__file__).resolve().parent.parent
DECODE_STAGES = ("decode@tiny", "decode_ablation@tiny", "decode_related@tiny", "control_decode")


@dataclass
class Cluster:
    address: str  # host:port of the head's GCS, what RAY_ADDRESS names
    auth: dict[str, str]  # the environment every process of the cluster shares (RAY_AUTH_MODE, RAY_AUTH_TOKEN)
    head: subprocess.Popen  # `ray start --head --block`, leader of its own process group
    second: subprocess.Popen  # `ray start --address … --block`: the second "host"


def _ray_start(*args: str, auth: dict, log: Path, workers: int) -> subprocess.Popen:
    """``ray start --block`` with one CPU, in a session of its own (its raylet and workers die with its group);
    every port it opens is its own, its workers' from ``workers`` on (below the ephemeral range)."""
    ports = {flag: str(free_port()) for flag in ("--node-manager-port", "--object-manager-port",
                                                 "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                                                 "--metrics-export-port", "--runtime-env-agent-port")}
    cmd = [str(BIN / "ray"), "start", "--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
           "--object-store-memory", str(100 * 2**20), "--disable-usage-stats",
           "--min-worker-port", str(workers), "--max-worker-port", str(workers + 499),
           *[x for flag, port in ports.items() for x in (flag, port)], *args]
    return subprocess.Popen(cmd, env={**os.environ, **auth}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _alive_nodes(address: str, auth: dict) -> int:
    done = subprocess.run([str(BIN / "ray"), "status", "--address", address], env={**os.environ, **auth},
                          capture_output=True, text=True, timeout=60)
    active = done.stdout.split("Active:")[-1].split("Pending:")[0]
    return len(re.findall(r"node_[0-9a-f]+", active))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ray-logs")
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = _ray_start("--head", "--port", str(port), "--include-dashboard=false", auth=auth, log=logs / "head.log",
                      workers=21000)
    second = None
    try:
        deadline = time.time() + 120
        while _alive_nodes(address, auth) < 1 and time.time() < deadline:
            time.sleep(1)
        second = _ray_start("--address", address, auth=auth, log=logs / "second.log", workers=21500)
        while _alive_nodes(address, auth) < 2 and time.time() < deadline:
            time.sleep(1)
        assert _alive_nodes(address, auth) == 2, (logs / "head.log").read_text() + (logs / "second.log").read_text()
        yield Cluster(address, auth, head, second)
    finally:
        for node in (second, head):
            if node and node.poll() is None:
                os.killpg(node.pid, signal.SIGTERM)
                node.wait(timeout=60)
        current = Path("/tmp/ray/ray_current_cluster")  # what `ray start` leaves for `ray.init("auto")`
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):  # the head's address, any IP
            current.unlink()


def _two_domains_on_ray(values: dict) -> None:
    """The tiny graph with a second eval domain (two decode units) and ``decode.executor: ray``."""
    values["corpus"]["sources"] = ["stdlib-prose", "stdlib-code"]
    decode = values["decode"]
    decode["domains"] = {"stdlib-prose": decode["domains"]["stdlib-prose"], "stdlib-code": ["perplexity", "agreement"]}
    decode["executor"] = "ray"


def test_dvc_repro_on_the_cluster_runs_units_on_both_nodes_with_the_serial_outputs(tmp_path, smollm2, cluster):
    graph = make_repo(tmp_path, smollm2.tokenizer, change=_two_domains_on_ray)
    on_cluster = env(RAY_ADDRESS=cluster.address, **cluster.auth)
    log = sh(graph, "dvc", "repro", timeout=1200, environ=on_cluster)
    assert "changed" not in sh(graph, "dvc", "status")
    for stage in DECODE_STAGES:
        assert f"Running stage '{stage}'" in log

    runs = mlflow_runs(f"sqlite:///{graph / 'mlflow.db'}")
    decode = runs[runs["tags.dvc_stage"].isin(["decode", "decode_ablation", "decode_related", "control_decode"])]
    assert decode["tags.worker"].notna().all()  # every unit's node, recorded on each of its runs
    node_of_domain = {d: set(w.split(" node ")[1] for w in group["tags.worker"])
                      for d, group in decode[decode["tags.dvc_stage"] == "decode"].groupby("params.domain")}
    assert set(node_of_domain) == {"stdlib-prose", "stdlib-code"}
    assert all(len(nodes) == 1 for nodes in node_of_domain.values())  # a unit runs on one node
    assert len(set.union(*node_of_domain.values())) == 2, node_of_domain  # the two units on the two nodes

    ray_outputs = {name: _outputs(graph / "reports" / name) for name in ("runs", "artifacts")}
    # the serial executor's outputs: the decode stages again (DVC removes their outputs first), no cluster
    sh(graph, "dvc", "repro", "-f", "-s", *DECODE_STAGES, environ=env(EMAD_DECODE_EXECUTOR="serial"))
    assert {name: _outputs(graph / "reports" / name) for name in ("runs", "artifacts")} == ray_outputs


def _decode(root: Path, out: str, environ: dict, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "pipeline/decode.py", *_args(root, out), *extra], cwd=ROOT,
                            env=environ, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def _stage_env(root: Path, **extra: str) -> dict:
    # one torch thread: each one-CPU node hosts one actor, computing as the serial run does
    return env(MLFLOW_TRACKING_URI=f"sqlite:///{root / 'cluster.db'}", **extra)


def _wait_for_a_unit_on(node: subprocess.Popen, stage: subprocess.Popen, timeout: float = 300) -> list:
    """The processes of ``node`` (its ``ray start`` and every descendant) once one of them runs a unit: Ray names
    an actor's process after the method it is executing (``ray::_Worker.run``), and ``ray::_Worker`` when idle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and stage.poll() is None:
        processes = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
        for process in processes:
            with contextlib.suppress(psutil.Error):
                if process.cmdline()[:1] == ["ray::_Worker.run"]:
                    return processes
        time.sleep(0.05)
    raise AssertionError(f"no unit started on the second node within {timeout:.0f} s (stage: {stage.poll()})")


ONE_DOMAIN = ("--domain", "toy-a")  # a decode of one domain: its shards fill both nodes


@pytest.fixture(scope="module")
def one_domain_serial(workspace, tmp_path_factory):  # noqa: F811
    """The serial stage's outputs for one domain (the reference of the cluster's runs)."""
    log = tmp_path_factory.mktemp("serial") / "serial.log"
    serial = _decode(workspace, "c-serial", _stage_env(workspace, EMAD_DECODE_EXECUTOR="serial"), log, *ONE_DOMAIN)
    assert serial.wait(timeout=600) == 0, log.read_text()
    return _outputs(workspace / "c-serial")


def _stage_runs(store: str, before: int):
    runs = mlflow_runs(store)
    return runs.iloc[: len(runs) - before]  # newest first: this stage's runs


def test_one_domain_runs_on_both_nodes_with_the_serial_outputs(workspace, cluster, one_domain_serial,  # noqa: F811
                                                               tmp_path):
    """A decode of one domain on two nodes: its screen's shards, then its run phase's groups of families, on both
    nodes — the run files equal the serial stage's."""
    store = f"sqlite:///{workspace / 'cluster.db'}"
    before = len(mlflow_runs(store))
    log = tmp_path / "both.log"
    proc = _decode(workspace, "c-both", _stage_env(workspace, EMAD_DECODE_EXECUTOR="ray",
                                                   RAY_ADDRESS=cluster.address, **cluster.auth), log, *ONE_DOMAIN)
    assert proc.wait(timeout=600) == 0, log.read_text()
    assert _outputs(workspace / "c-both") == one_domain_serial, log.read_text()
    runs = _stage_runs(store, before)
    assert len(runs) == 5 and set(runs["status"]) == {"FINISHED"}
    assert len({worker.split(" node ")[1] for worker in runs["tags.worker"]}) == 2  # run groups on both nodes
    split = json.loads(next((workspace / "c-both" / "runs").glob("*.json")).read_text())["provenance"]["split"]
    assert split["workers"] == 2 and split["screen_shards_per_domain"] == 2 and split["screen_workers"]["toy-a"][0] == 2


def test_losing_a_node_while_it_runs_a_unit_leaves_the_serial_outputs(workspace, cluster, one_domain_serial,  # noqa: F811
                                                                      tmp_path):
    """Last in this module: the second node does not come back. Its unit (a shard of the one domain's screen) is
    retried on the head node; the actor idle there is ended to make room for it."""
    store = f"sqlite:///{workspace / 'cluster.db'}"
    before = len(mlflow_runs(store))
    log = tmp_path / "lost.log"
    proc = _decode(workspace, "c-lost", _stage_env(workspace, EMAD_DECODE_EXECUTOR="ray",
                                                   RAY_ADDRESS=cluster.address, **cluster.auth), log, *ONE_DOMAIN)
    second = _wait_for_a_unit_on(cluster.second, proc)
    os.killpg(cluster.second.pid, signal.SIGKILL)  # the second host's raylet and workers, at once
    for process in second:  # and any of them that left its process group
        with contextlib.suppress(psutil.Error):
            process.kill()
    code = proc.wait(timeout=600)
    assert code == 0, log.read_text()
    assert _outputs(workspace / "c-lost") == one_domain_serial, log.read_text()
    runs = _stage_runs(store, before)
    assert len(runs) == 5 and set(runs["status"]) == {"FINISHED"}
    nodes = {worker.split(" node ")[1] for worker in runs["tags.worker"]}
    assert len(nodes) == 1, nodes  # every unit after the loss ran on the head node
