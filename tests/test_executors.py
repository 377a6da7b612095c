"""Decode executors (emad.evaluation.executors): serial and Ray (local, 3 CPUs) give the same outputs on a tiny
model, whatever order the units are submitted in; bad executor names and unreachable clusters fail first."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.tiny import save_tiny_pretrained, save_tiny_profiles

TEXT = "Entropy falls with depth for easy tokens. The quick brown fox jumps over the lazy dog. " * 12
DOMAINS = ("toy-a", "toy-b")
DECODE = {
    "domains": {d: ["perplexity", "agreement", "fidelity"] for d in DOMAINS},
    "tasks": {"perplexity": {"tokens": 96, "window": 48, "prefix": 16},
              "agreement": {"prompts": 16, "prompt_tokens": 8, "new_tokens": 2},
              "fidelity": {"prompts": 16, "prompt_tokens": 8, "new_tokens": 2}},
    "baselines": {"full": {"method": "full"}, "fixed": {"method": "fixed", "depth": [2, 3]}},
    "points": {"emad": {"method": "emad", "margin": [0.0, 1.0], "strata": "none"}},
    "heatmap_texts": 1, "speed_repeats": 1, "speed_tokens": 2, "device": "cpu",
    "dtype": "float32",
}
TIMED = ("seconds", "per_s", "speed", "load_avg", "mlflow_run_id")  # keys whose values are timings or run ids
WHERE = ("worker", "ray_node", "split")  # provenance keys: which process computed a unit, how the work was split


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("executors")
    save_tiny_pretrained(root / "model", smollm2.tokenizer)
    for i, domain in enumerate(DOMAINS):
        corpus = root / "corpora" / domain
        corpus.mkdir(parents=True)
        docs = [{"id": str(j), "text": TEXT[(i + j) * 7:], "n_tokens": 0} for j in range(3)]
        (corpus / "eval.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (corpus / "manifest.json").write_text(json.dumps({"manifest_sha256": domain}))
    save_tiny_profiles(root / "model", [TEXT] * 2, root / "profile.json")
    (root / "params.yaml").write_text(yaml.safe_dump({"decode": DECODE}))
    return root


@pytest.fixture(scope="module")
def local_ray():
    """Ray started in this process on 3 CPUs (as the stage starts it when RAY_ADDRESS is unset)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _args(root: Path, out: str) -> list[str]:
    return ["--kind", "baseline", "--kind", "point", "--model", "tiny", "--model-dir", str(root / "model"),
            "--corpora", str(root / "corpora"), "--calibration", "toy", "--profile", str(root / "profile.json"),
            "--out", str(root / out / "runs"), "--artifacts", str(root / out / "art"),
            "--params", str(root / "params.yaml")]


def _untimed(value):
    """``value`` without the keys whose values are timings, run ids or the process that computed it."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not any(t in k for t in TIMED) and k not in WHERE}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _outputs(folder: Path) -> dict[str, object]:
    """Every run file (untimed) and artifact under ``folder``, by relative path."""
    out: dict[str, object] = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".json":
            out[str(path.relative_to(folder))] = _untimed(json.loads(path.read_text()))
        elif path.suffix == ".html":
            out[str(path.relative_to(folder))] = path.read_text()
        elif path.is_file():
            out[str(path.relative_to(folder))] = path.stat().st_size > 0
    return out


def _outcomes(per_unit) -> list:
    return [[(o.label, o.domain, _untimed(o.tasks), _untimed(o.cost), o.histogram, o.heatmap) for o in unit]
            for unit in per_unit]


def test_a_ray_address_nothing_answers_is_named_before_any_work(workspace, monkeypatch):
    ray = pytest.importorskip("ray")
    import pipeline.decode as stage

    assert not ray.is_initialized()  # runs before the tests that start Ray in this process
    monkeypatch.setenv("EMAD_DECODE_EXECUTOR", "ray")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConnectionError, match=r"RAY_ADDRESS='127.0.0.1:1': no Ray cluster answers"):
        stage.main(_args(workspace, "no-cluster"))
    assert not (workspace / "no-cluster").exists()


@pytest.mark.heavy  # a minute: every unit decoded twice, serially and on Ray
def test_ray_writes_what_serial_writes_and_units_come_back_in_unit_order(workspace, local_ray, monkeypatch):
    import pipeline.decode as stage
    from emad.evaluation.executors import Unit, ray_executor, serial

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow.db'}")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("EMAD_DECODE_EXECUTOR", "serial")
    assert stage.main(_args(workspace, "serial")) == 0
    monkeypatch.setenv("EMAD_DECODE_EXECUTOR", "ray")
    assert stage.main(_args(workspace, "ray")) == 0
    serial_out, ray_out = _outputs(workspace / "serial"), _outputs(workspace / "ray")
    assert len([k for k in serial_out if k.endswith(".json")]) == 5 * len(DOMAINS)  # full, 2 fixed, 2 emad
    assert ray_out == serial_out

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["emad"], filter_string="tags.dvc_stage = 'decode'")
    assert len(runs) == 2 * 5 * len(DOMAINS) and set(runs["status"]) == {"FINISHED"}
    assert runs["tags.worker"].str.contains(":").sum() == 5 * len(DOMAINS)  # host:pid of the Ray actor

    plan = stage.plan(stage.parse_args(_args(workspace, "unused")))
    units = [Unit("run", d) for d in plan.domains]  # the second phase alone: each unit scores its domain itself
    reversed_ray = ray_executor(plan, units, 2, order=lambda ix: ix[::-1])
    assert [[o.domain for o in unit] for unit in reversed_ray] == [[d] * 5 for d in plan.domains]
    assert _outcomes(reversed_ray) == _outcomes(serial(plan, units))


@pytest.mark.heavy  # minutes: one domain decoded serially, on 1 and on 3 Ray workers
def test_one_domain_fills_every_ray_worker_and_writes_what_serial_writes(workspace, local_ray, monkeypatch):
    """A one-domain plan on 3 workers: its screen in 3 shards, each scored by its own actor, merged in request
    order, and its run phase in groups of families on them — the run files equal the serial stage's and those of
    1 worker."""
    import torch

    import pipeline.decode as stage

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one CPU per actor; the serial stage computes with the same thread count
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow-one.db'}")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        outs = {}
        for executor, workers in (("serial", 1), ("ray", 1), ("ray", 3)):
            params = workspace / f"one-{executor}-{workers}.yaml"
            params.write_text(yaml.safe_dump({"decode": {**DECODE, "workers": workers}}))
            name = f"one-{executor}-{workers}"
            args = _args(workspace, name)
            monkeypatch.setenv("EMAD_DECODE_EXECUTOR", executor)
            assert stage.main([*args[:-1], str(params), "--domain", DOMAINS[0]]) == 0
            outs[name] = _outputs(workspace / name)
    finally:
        torch.set_num_threads(threads)
    assert len([k for k in outs["one-serial-1"] if k.endswith(".json")]) == 5
    assert outs["one-ray-1"] == outs["one-serial-1"] and outs["one-ray-3"] == outs["one-serial-1"]
    record = json.loads((workspace / "one-ray-3" / "runs" / f"tiny--full--{DOMAINS[0]}.json").read_text())
    split = record["provenance"]["split"]
    assert split["workers"] == 3 and split["screen_shards_per_domain"] == 3
    assert split["screen_workers"][DOMAINS[0]][0] == 3  # the first round's 3 shards: 3 distinct actors
    assert split["run_groups"][DOMAINS[0]] == split["run_workers"] == 3  # the families of 5 jobs in 3 groups


HOMED = """
import os
import time


class Homed:
    \"\"\"A stand-in for the decode actor: a unit sleeps ``unit.args[0]`` seconds, then gives (its pid, its home).\"\"\"

    def __init__(self, plan, cwd, threads):
        pass

    def run(self, index, unit):
        time.sleep(unit.args[0])
        return index, (os.getpid(), unit.home)
"""


def test_a_unit_runs_where_its_home_ran_before_and_outcomes_come_in_unit_order(local_ray, monkeypatch):
    """Three homes on three actors, the first unit delayed so that the others finish first; the next phase's
    units, in the reverse order, each on the actor its home ran on; outcomes in unit order, and the actors are
    the same from phase to phase."""
    import torch

    from emad.evaluation.executors import Unit, ray_executor

    namespace = {"__name__": "homed"}
    exec(HOMED, namespace)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    phases = []

    def then(out):
        phases.append(out)
        return [Unit("run", "d", (0.0,), home=h) for h in (2, 1, 0)] if len(phases) == 1 else None

    last = ray_executor(None, [Unit("score", "d", (delay,), home=h) for h, delay in enumerate((1.0, 0.0, 0.0))],
                        3, actor=namespace["Homed"], then=then)
    first = phases[0]
    assert [home for _, home in first] == [0, 1, 2] and [home for _, home in last] == [2, 1, 0]
    assert len({pid for pid, _ in first}) == 3
    assert {home: pid for pid, home in first} == {home: pid for pid, home in last}


def test_an_unknown_executor_is_named_before_any_work(workspace, monkeypatch):
    import pipeline.decode as stage

    monkeypatch.setenv("EMAD_DECODE_EXECUTOR", "dask")
    with pytest.raises(ValueError, match=r"EMAD_DECODE_EXECUTOR = 'dask'.*valid: ray, serial"):
        stage.main(_args(workspace, "bad-env"))
    monkeypatch.delenv("EMAD_DECODE_EXECUTOR")
    params = workspace / "bad-params.yaml"
    params.write_text(yaml.safe_dump({"decode": {**DECODE, "executor": "dask"}}))
    with pytest.raises(ValueError, match=r"executor.*'dask'.*valid: ray, serial"):
        stage.main([*_args(workspace, "bad-params")[:-1], str(params)])
    assert not (workspace / "bad-env").exists() and not (workspace / "bad-params").exists()


STUCK = """
import os
import time
from pathlib import Path


class Stuck:
    \"\"\"A stand-in for the decode actor: unit ``slow*`` writes its pid into the folder and waits for minutes; unit
    ``fail`` raises once ``slow`` is under way.\"\"\"

    def __init__(self, folder, cwd, threads):
        self.folder = Path(folder)

    def run(self, index, domain):
        if domain.startswith("slow"):
            (self.folder / f"{domain}.pid").write_text(str(os.getpid()))
            time.sleep(600)
        deadline = time.monotonic() + 120
        while not (self.folder / "slow.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("unit fail: broken on purpose")
"""
# the executor on Stuck actors in a process of its own, as a stage runs it: Ray started inside (RAY_ADDRESS unset)
STUCK_STAGE = STUCK + """
import sys

import torch

from emad.evaluation.executors import ray_executor

torch.set_num_threads(1)  # one CPU per actor: both run at once on 2 CPUs
ray_executor(sys.argv[1], sys.argv[2:], 2, actor=Stuck)
"""


def _gone(pid: int, timeout: float = 15) -> bool:
    import psutil

    try:
        psutil.Process(pid).wait(timeout=timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def test_a_failed_unit_ends_the_other_actors_at_once_and_is_raised(local_ray, tmp_path, monkeypatch):
    """Unit ``slow`` would take minutes; unit ``fail`` raises once ``slow`` is under way: the executor raises that
    error at once and the actor running ``slow`` is gone."""
    import torch

    from emad.evaluation.executors import ray_executor

    namespace = {"__name__": "stuck"}  # a module no worker can import: Ray ships the class by value
    exec(STUCK, namespace)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one CPU per actor: both run at once on 2 CPUs
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="broken on purpose"):
        ray_executor(str(tmp_path), ["slow", "fail"], 2, actor=namespace["Stuck"])
    assert time.monotonic() - began < 150
    assert _gone(int((tmp_path / "slow.pid").read_text()))  # ray.kill ended it
    assert local_ray.is_initialized()  # a Ray the executor did not start stays up


ROOT = Path(__file__).resolve().parent.parent


def _ray_processes(mark: str) -> list[str]:
    """The live processes whose environment carries ``EMAD_RAY_MARK=mark`` (a stage's Ray inherits it)."""
    import psutil

    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if process.environ().get("EMAD_RAY_MARK") == mark and process.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(process.info["cmdline"] or [process.info["name"]])[:80])
    return found


def _no_ray_process_left(mark: str, timeout: float = 10) -> list[str]:
    """What is left of the Ray marked ``mark`` after ``timeout`` s (processes signalled may take a moment)."""
    deadline, left = time.monotonic() + timeout, _ray_processes(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _ray_processes(mark)
    return left


def _marked_env(tmp_path: Path, **extra: str) -> tuple[str, dict]:
    mark = uuid.uuid4().hex
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return mark, {**environ, "EMAD_DECODE_EXECUTOR": "ray", "OMP_NUM_THREADS": "1", "EMAD_RAY_MARK": mark,
                  "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "HF_HUB_OFFLINE": "1", **extra}


@pytest.mark.heavy
def test_a_stage_that_started_ray_leaves_no_ray_process_when_it_finishes(workspace, tmp_path):
    """``RAY_ADDRESS=local``: Ray started inside the decode stage; once the stage has exited, no process of it
    (gcs_server, raylet, workers, agents) is left."""
    mark, environ = _marked_env(tmp_path, RAY_ADDRESS="local")
    done = subprocess.run([sys.executable, "pipeline/decode.py", *_args(workspace, "local")], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Started a local Ray instance" in done.stderr  # the stage's own Ray, not one joined
    assert len(list((workspace / "local" / "runs").glob("*.json"))) == 5 * len(DOMAINS)
    assert not _no_ray_process_left(mark)


@pytest.mark.heavy
@pytest.mark.parametrize("end", ["a failed unit", "SIGTERM"])
def test_a_stage_that_started_ray_leaves_no_ray_process_when_it_fails(tmp_path, end):
    """A unit that fails, or SIGTERM while two units are under way: the process exits (1, or 143) with every
    actor ended and no process of the Ray it started left."""
    mark, environ = _marked_env(tmp_path)
    units = ["slow", "fail"] if end == "a failed unit" else ["slow", "slow-2"]
    stage = subprocess.Popen([sys.executable, "-c", STUCK_STAGE, str(tmp_path), *units], cwd=ROOT, env=environ,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if end == "SIGTERM":
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"{u}.pid").exists() for u in units) and time.monotonic() < deadline:
            assert stage.poll() is None
            time.sleep(0.1)
        stage.send_signal(signal.SIGTERM)
    log = stage.communicate(timeout=300)[0]
    assert stage.returncode == (1 if end == "a failed unit" else 143), log[-3000:]
    assert "Started a local Ray instance" in log
    assert ("broken on purpose" in log) == (end == "a failed unit")
    assert not _no_ray_process_left(mark), log[-3000:]


RISK = {"domain": "toy-a", "calibration": "toy", "prompts": 4, "fresh_prompts": 2, "prompt_tokens": 8,
        "new_tokens": 4, "delta": 0.3, "epsilon": 0.3, "loss": "agreement", "device": "cpu", "dtype": "float32",
        "searches": {"margin": {"point": {"method": "emad", "strata": "none"}, "knob": "margin",
                                "values": [10.0, 0.0]},
                     "threshold": {"point": {"method": "confidence"}, "knob": "threshold", "values": [0.1, 5.0]}}}


@pytest.mark.heavy  # the risk stage twice, serially and on Ray
def test_the_risk_stage_writes_the_same_on_ray_as_serial(workspace, local_ray, monkeypatch):
    """Each search is a unit: on Ray actors the result files equal the stage's own process's."""
    import pipeline.risk as stage

    params = workspace / "params-risk.yaml"
    params.write_text(yaml.safe_dump({"risk": RISK}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow.db'}")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    outs = {}
    for executor in ("serial", "ray"):
        monkeypatch.setenv("EMAD_DECODE_EXECUTOR", executor)
        assert stage.main(["--model", "tiny", "--model-dir", str(workspace / "model"), "--corpus",
                           str(workspace / "corpora" / "toy-a"), "--calibration", "toy", "--profile",
                           str(workspace / "profile.json"), "--out", str(workspace / f"risk-{executor}"),
                           "--params", str(params)]) == 0
        outs[executor] = _outputs(workspace / f"risk-{executor}")
    assert sorted(outs["serial"]) == ["tiny--margin--cal-toy.json", "tiny--threshold--cal-toy.json"]
    assert outs["ray"] == outs["serial"]
    record = json.loads((workspace / "risk-ray" / "tiny--margin--cal-toy.json").read_text())
    assert record["provenance"]["ray_node"] and record["provenance"]["dtype"] == "float32"


def test_the_ray_runtime_env_carries_an_allow_list_and_hf_token_only_when_asked(monkeypatch):
    from emad.evaluation.executors import forwarded_env

    for key, value in {"HF_HOME": "/h", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_TOKEN": "hf_secret",
                       "HF_ENDPOINT": "https://x", "EMAD_CACHE_DIR": "/c", "MLFLOW_TRACKING_PASSWORD": "pw"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("EMAD_RAY_FORWARD_TOKEN", raising=False)
    env = forwarded_env()
    assert {"HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "EMAD_CACHE_DIR"} <= set(env)
    assert not {"HF_TOKEN", "HF_ENDPOINT", "MLFLOW_TRACKING_PASSWORD"} & set(env)
    assert "hf_secret" not in env.values()
    monkeypatch.setenv("EMAD_RAY_FORWARD_TOKEN", "1")
    assert forwarded_env()["HF_TOKEN"] == "hf_secret" and "EMAD_RAY_FORWARD_TOKEN" not in forwarded_env()
