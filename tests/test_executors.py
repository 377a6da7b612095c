"""Decode executors (emad.evaluation.executors): serial and Ray (local, 2 CPUs) give the same outputs on a tiny
model, whatever order the units are submitted in; bad executor names and unreachable clusters fail first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.tiny import save_tiny_pretrained, save_tiny_profiles

TEXT = "Entropy falls with depth for easy tokens. The quick brown fox jumps over the lazy dog. " * 12
DOMAINS = ("toy-a", "toy-b")
DECODE = {
    "domains": {d: ["perplexity", "agreement", "fidelity"] for d in DOMAINS},
    "tasks": {"perplexity": {"tokens": 96, "window": 48, "prefix": 16},
              "agreement": {"prompts": 8, "prompt_tokens": 12, "new_tokens": 6},
              "fidelity": {"prompts": 8, "prompt_tokens": 12, "new_tokens": 6}},
    "baselines": {"full": {"method": "full"}, "fixed": {"method": "fixed", "depth": [2, 3]}},
    "points": {"emad": {"method": "emad", "margin": [0.0, 1.0], "strata": "none"}},
    "heatmap_texts": 1, "speed_repeats": 1, "speed_tokens": 4, "device": "cpu",
    "dtype": "float32",
}
TIMED = ("seconds", "per_s", "speed", "load_avg", "mlflow_run_id")  # keys whose values are timings or run ids


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
    """Ray started in this process on 2 CPUs (as the stage starts it when RAY_ADDRESS is unset)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _args(root: Path, out: str) -> list[str]:
    return ["--kind", "baseline", "--kind", "point", "--model", "tiny", "--model-dir", str(root / "model"),
            "--corpora", str(root / "corpora"), "--calibration", "toy", "--profile", str(root / "profile.json"),
            "--out", str(root / out / "runs"), "--artifacts", str(root / out / "art"),
            "--params", str(root / "params.yaml")]


def _untimed(value):
    """``value`` without the keys whose values are timings or run ids."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not any(t in k for t in TIMED)}
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


def test_ray_writes_what_serial_writes_and_units_come_back_in_unit_order(workspace, local_ray, monkeypatch):
    import pipeline.decode as stage
    from emad.evaluation.executors import ray_executor, serial

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
    units = list(plan.domains)
    reversed_ray = ray_executor(plan, units, 2, order=lambda ix: ix[::-1])
    assert [[o.domain for o in unit] for unit in reversed_ray] == [[d] * 5 for d in units]
    assert _outcomes(reversed_ray) == _outcomes(serial(plan, units))


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
