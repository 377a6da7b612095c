"""The run record: its run file is its serialisation, it gives the decode run's MLflow params, metrics and tags, and
a quality metric registered in one place reaches the run file, MLflow and the aggregate with no other edit."""

from __future__ import annotations

import json

import pytest
import yaml

from emad import tracking
from emad.evaluation import runfile
from emad.evaluation.metrics import METRICS, higher_is_better, register_metric, relative_tolerance
from emad.evaluation.record import RunRecord, load_records

UNITS = 12


def _tasks(ppl: float, score: float) -> dict:
    """Perplexity windows ([nll, tokens]) and a ``toy`` task whose per-unit scores average ``score``."""
    import math

    nll = [100 * math.log(ppl) + 0.01 * (i % 3 - 1) for i in range(UNITS)]
    scores = [score + 0.01 * (i % 3 - 1) for i in range(UNITS)]
    return {"perplexity": {"perplexity": ppl, "samples": {"perplexity": [[v, 100] for v in nll]}},
            "toy": {"score": score, "samples": {"score": scores}}}


def _record(point: str, family: str, ppl: float, score: float, flops: float) -> RunRecord:
    base = RunRecord(run_id=f"m--{point}--prose", model="m", point=point, kind="baseline", family=family,
                     readout="logit", curve=point, knob=None, value=None, screened=False, options={"method": family},
                     calibration=None, domain="prose", model_fingerprint="abc", n_layers=30, free_prompts=None, not_run={},
                     method={"method": family}, profile_fingerprint=None, factors={}, oracle=None,
                     identity={"proved": True, "why": "never exits", "final_from": 30}, split={"seed": 0},
                     provenance={"host": "h", "device": "cpu", "dtype": "float32", "ray_node": None})
    cost = {"flops_ratio": flops, "bytes_ratio": flops, "mean_depth": 30 * flops, "tokens": 1000.0,
            "seconds": 10.0, "tokens_per_s": 100.0, "speedup": None}
    return base.with_results(_tasks(ppl, score), cost, {30: 1000}, None)


@pytest.fixture
def toy_metric():
    """A quality metric registered for one test: ``toy.score``, higher-better, absolute tolerance."""
    metric = register_metric("toy.score", "toy", "score")
    yield metric
    METRICS.remove("toy.score")
    assert "toy.score" not in METRICS


def test_the_registry_says_direction_and_tolerance():
    assert not higher_is_better("perplexity") and relative_tolerance("perplexity")
    assert higher_is_better("fidelity.token_agreement") and not relative_tolerance("fidelity.token_agreement")
    assert higher_is_better("unknown.metric")  # as before: unknown metrics count as higher-better
    assert [m.name for m in METRICS.values()][:2] == ["perplexity", "fidelity.token_agreement"]
    with pytest.raises(ValueError, match="already registered"):
        register_metric("perplexity", "perplexity", "perplexity")


def test_the_run_file_is_the_record(tmp_path):
    record = _record("full", "full", 10.0, 0.5, 1.0)
    record.save(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert list(data) == ["format", "version", *RunRecord.model_fields]  # every field, in order
    assert RunRecord.from_file(tmp_path / "r.json") == record
    assert runfile.load_all(tmp_path) == [{"format": "emad-run", "version": 1, **record.to_dict()}]
    older = {k: v for k, v in data.items() if k not in ("kind", "readout", "curve", "knob", "value")}
    (tmp_path / "r.json").write_text(json.dumps(older))
    assert load_records(tmp_path)[0].to_dict() == {k: v for k, v in older.items() if k not in ("format", "version")}
    (tmp_path / "r.json").write_text(json.dumps({**data, "qualty": {}}))
    with pytest.raises(runfile.RunFileError, match="qualty"):
        RunRecord.from_file(tmp_path / "r.json")


def test_the_record_gives_its_mlflow_tags_and_name():
    record = _record("full", "full", 10.0, 0.5, 1.0)
    assert record.mlflow_tags() == {"model_fingerprint": "abc", "run_id": "m--full--prose", "family": "full",
                                    "profile_fingerprint": "", "readout": "logit", "provenance.host": "h",
                                    "provenance.device": "cpu", "provenance.dtype": "float32",
                                    "provenance.ray_node": ""}
    assert record.mlflow_run_name() == "decode m full prose"
    assert record.curve_id.family == "full" and record.curve_id.domain == "prose"


def test_a_registered_metric_reaches_the_run_file_mlflow_and_the_aggregate(toy_metric, tmp_path, monkeypatch):
    import pipeline.aggregate as aggregate

    runs = tmp_path / "runs"
    for r in (_record("full", "full", 10.0, 0.5, 1.0), _record("emad-a", "emad", 10.05, 0.495, 0.8)):
        r.save(runs / f"{r.run_id}.json")
    # the run file
    saved = runfile.load(runs / "m--emad-a--prose.json")
    assert saved["quality"]["toy.score"] == pytest.approx(0.495)
    assert saved["intervals"]["toy.score"]["n"] == UNITS
    # MLflow, through a real store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    record = RunRecord.from_file(runs / "m--emad-a--prose.json")
    metrics = record.mlflow_metrics()
    assert metrics["quality.toy.score"] == pytest.approx(0.495) and metrics["quality.toy.score.n"] == UNITS
    with tracking.stage_run("decode", record.mlflow_params(), record.mlflow_tags(),
                            run_name=record.mlflow_run_name()) as run:
        run.log_metrics(metrics)
    import mlflow

    logged = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri()).get_run(run.run_id).data
    assert logged.metrics["quality.toy.score"] == pytest.approx(0.495)
    assert {"quality.toy.score.lo", "quality.toy.score.hi"} <= set(logged.metrics)
    # the aggregate
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"aggregate": {"methods": ["emad"]}}))
    out = {name: tmp_path / "reports" / name for name in ("metrics.json", "details.json", "pareto", "figures",
                                                           "report.md")}
    assert aggregate.main(["--runs", str(runs), "--default-point", "emad-m05", "--metrics", str(out["metrics.json"]),
                           "--details", str(out["details.json"]), "--pareto", str(out["pareto"]),
                           "--figures", str(out["figures"]), "--report", str(out["report.md"]),
                           "--params", str(tmp_path / "params.yaml")]) == 0
    details = json.loads(out["details.json"].read_text())
    assert details["models"]["m"]["runs"]["emad-a"]["prose"]["toy.score"] == pytest.approx(0.495)
    rows = json.loads((out["pareto"] / "flops" / "m--prose--toy.score.json").read_text())
    assert {r["point"]: r["quality"] for r in rows if r["run_id"]}["emad-a"] == pytest.approx(0.495)
