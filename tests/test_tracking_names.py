"""MLflow a person can compare in: run names, uniform decode params and metrics, the experiment's description,
and :func:`tests.mlflow_checks.check_store` on a store made through :func:`emad.tracking.stage_run`."""

from __future__ import annotations

import math

import pytest

from emad import tracking
from emad.evaluation.record import RunRecord
from emad.tracking import label, profile_qualifiers, run_name
from tests.mlflow_checks import check_store


def decode_params(record: dict) -> dict:
    return RunRecord.from_dict(record).mlflow_params()


def decode_metrics(record: dict) -> dict:
    return RunRecord.from_dict(record).mlflow_metrics()


def decode_run_name(record: dict) -> str:
    return RunRecord.from_dict(record).mlflow_run_name()


def _record(**changes) -> dict:
    """A decode run record as pipeline/decode.py writes it (emad/evaluation/record.py), on a sweep."""
    record = {
        "run_id": "smollm2-135m--emad-m05--cal-stdlib-prose--stdlib-code", "model": "smollm2-135m",
        "model_fingerprint": "abc", "n_layers": 30, "point": "emad-m05", "kind": "point", "family": "emad",
        "readout": "tuned", "curve": "emad", "knob": "margin", "value": 0.5,
        "options": {"method": "emad", "margin": 0.5, "policy": "monotone", "estimator": "exact", "strata": None,
                    "readout": "tuned", "probe_layers": [3, 6, 30], "exact": True},
        "method": {"name": "emad"}, "calibration": "stdlib-prose", "domain": "stdlib-code",
        "profile_fingerprint": "0123456789abcdef", "factors": {}, "oracle": None,
        "tasks": {"perplexity": {"perplexity": 12.5}, "fidelity": {"token_agreement": 0.9}},
        "quality": {"perplexity": 12.5, "fidelity.token_agreement": 0.9, "humaneval.pass_at_1": 0.0},
        "intervals": {"perplexity": {"lo": 11.0, "hi": 14.0, "n": 11, "method": "bootstrap-bca"},
                      "fidelity.token_agreement": {"lo": 0.85, "hi": 0.94, "n": 64, "method": "bootstrap"},
                      "humaneval.pass_at_1": {"lo": None, "hi": None, "n": None, "method": "undefined"}},
        "cost": {"flops_ratio": 0.8, "step_ratio": 0.9, "bytes_ratio": 0.85, "mean_depth": 24.1,
                 "backfill_share": 0.0, "policy_events": 0, "tokens": 4096, "seconds": 40.2, "tokens_per_s": 101.9,
                 "speedup": 1.12, "large_token_share": None},
        "depth_histogram": {"3": 10, "30": 4086}, "mlflow_run_id": None,
    }
    record.update(changes)
    return record


def test_decode_params_are_uniform_and_only_what_is_set():
    params = decode_params(_record())
    assert params == {"method": "emad", "margin": 0.5, "policy": "monotone", "estimator": "exact",
                      "readout": "tuned", "probe_layers": "[3,6,30]", "exact": "true", "family": "emad",
                      "curve": "emad", "calibration": "stdlib-prose", "domain": "stdlib-code",
                      "model": "smollm2-135m", "point": "emad-m05", "kind": "point", "knob": "margin", "value": 0.5}
    assert all(v is not None and v != "" and v != "None" for v in params.values())


def test_decode_params_of_a_lone_uncalibrated_point():
    record = _record(point="full", family="full", readout="logit", options={"method": "full"}, calibration=None,
                     kind="baseline", knob=None, value=None)
    del record["curve"]
    params = decode_params(record)
    assert params["knob"] == "none" and "value" not in params  # not on a sweep: no value
    assert params["curve"] == "full"  # a lone point is a curve of one
    assert params["calibration"] == "none"  # every decode run has it, filterable
    assert set(params) >= {"family", "readout", "knob", "calibration", "domain"}
    assert all(v is not None and v != "None" for v in params.values())
    older = _record(options={"method": "emad"})  # a run file from before sweeps: no knob, value or curve
    for key in ("knob", "value", "curve"):
        del older[key]
    assert decode_params(older)["knob"] == "none" and "value" not in decode_params(older)


def test_decode_metrics_have_uniform_names_and_no_none():
    metrics = decode_metrics(_record())
    assert {"flops_ratio": 0.8, "bytes_ratio": 0.85, "step_ratio": 0.9, "mean_depth": 24.1, "speedup": 1.12,
            "tokens_per_s": 101.9}.items() <= metrics.items()
    assert metrics["quality.perplexity.perplexity"] == 12.5
    assert metrics["quality.perplexity.perplexity.lo"] == 11.0 and metrics["quality.perplexity.perplexity.hi"] == 14.0
    assert metrics["quality.perplexity.perplexity.n"] == 11
    assert metrics["quality.fidelity.token_agreement.hi"] == 0.94
    assert metrics["quality.humaneval.pass_at_1"] == 0.0  # a zero is a value, not a missing one
    assert not any(k.startswith("quality.humaneval.pass_at_1.") for k in metrics)  # undefined interval left out
    assert metrics["cost.tokens"] == 4096 and "cost.large_token_share" not in metrics
    assert all(isinstance(v, float) and not math.isnan(v) for v in metrics.values())
    assert all(tracking.metric_name(k) == k for k in metrics)


def test_decode_metrics_leave_out_a_missing_speedup_and_sanitise_names():
    cost = {k: v for k, v in _record()["cost"].items() if k != "speedup"}
    assert "speedup" not in decode_metrics(_record(cost=cost))
    assert "speedup" not in decode_metrics(_record(cost={**cost, "speedup": None}))
    odd = decode_metrics(_record(quality={"choice,acc": 0.5}, intervals={}, cost={"flops_ratio": 1.0}))
    assert odd == {"flops_ratio": 1.0, "quality.choice_acc.choice_acc": 0.5}


def test_run_names_say_which_instance():
    assert run_name("calibrate", label("data/models/smollm2-135m"), label("data/corpus/stdlib-prose/"),
                    "tuned") == "calibrate smollm2-135m stdlib-prose tuned"
    assert run_name("aggregate") == "aggregate" and run_name("risk", "m", None, "") == "risk m"
    assert label("HuggingFaceTB/SmolLM2-135M") == "SmolLM2-135M"
    path = "data/profiles/smollm2-135m/stdlib-prose/logit/profile.json"
    assert run_name("smooth", *profile_qualifiers(path, "logit")) == "smooth smollm2-135m stdlib-prose logit"
    assert profile_qualifiers("elsewhere/profile.json", "tuned") == ("elsewhere", "tuned")
    assert profile_qualifiers("profile.json", "tuned") == ("tuned",)
    assert decode_run_name(_record()) == "decode smollm2-135m emad-m05 stdlib-code cal stdlib-prose"
    assert decode_run_name(_record(point="full", calibration=None)) == "decode smollm2-135m full stdlib-code"


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _decode_run(record: dict) -> None:
    with tracking.stage_run("decode", {"run_id": record["run_id"], "calibration": record["calibration"]},
                            {"run_id": record["run_id"]}, run_name=decode_run_name(record)) as run:
        run.log_params(decode_params(record))
        run.log_metrics(decode_metrics(record))


def test_a_store_made_through_stage_run_passes_check_store(store):
    with tracking.stage_run("calibrate", {"calibrate": {"window": 32, "max_tokens": None}},
                            run_name=run_name("calibrate", "smollm2-135m", "stdlib-prose", "tuned")):
        pass
    _decode_run(_record())
    _decode_run(_record(point="full", family="full", calibration=None, knob=None, value=None, options={}))
    with tracking.stage_run("aggregate", {"runs": 2}, run_name=run_name("aggregate")):
        pass
    check_store(store)
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name(tracking.EXPERIMENT)
    note = experiment.tags[tracking.NOTE]
    assert note == tracking.DESCRIPTION
    assert "flops_ratio" in note and "quality.perplexity.perplexity" in note and "dvc_stage" in note
    assert experiment.tags[tracking.KIND] == "custom_model_development"  # the UI opens on runs, not traces
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    calibrate = runs["calibrate smollm2-135m stdlib-prose tuned"]
    assert calibrate.data.params == {"calibrate.window": "32"}  # the unset max_tokens is not a column of None
    full = runs["decode smollm2-135m full stdlib-code"]
    assert full.data.params["knob"] == "none" and full.data.params["calibration"] == "none"
    assert "value" not in full.data.params


def test_check_store_names_each_problem(store):
    with tracking.stage_run("calibrate", {"a": 1}):  # bare stage name
        pass
    with tracking.stage_run("smooth", {"a": "None"}, run_name="smooth m s logit"):
        pass
    with tracking.stage_run("decode_baseline", {}, run_name="decode m full d") as run:
        run.log_params({"family": "full"})
        run.log_metrics({"cost.flops_ratio": 1.0})
    with pytest.raises(AssertionError) as failed:
        check_store(store)
    text = str(failed.value)
    assert "run 'calibrate' (stage calibrate): the name does not say which instance" in text
    assert "run 'smooth m s logit' (stage smooth): params logged as 'None': a" in text
    assert "without params readout, knob, calibration, domain" in text
    assert "without metric flops_ratio" in text and "without any quality." in text
    assert text.startswith("5 problem(s)")


def test_the_description_reaches_a_store_made_before_it(store):
    import mlflow

    mlflow.set_tracking_uri(store)
    mlflow.create_experiment(tracking.EXPERIMENT)  # an older store: no description
    with tracking.stage_run("aggregate", {}, run_name="aggregate"):
        pass
    note = mlflow.MlflowClient().get_experiment_by_name(tracking.EXPERIMENT).tags.get(tracking.NOTE)
    assert note == tracking.DESCRIPTION


def test_tag_param_and_metric_names_are_made_safe(store):
    import mlflow

    with tracking.stage_run("aggregate", {}, run_name="aggregate") as run:
        run.set_tags({"family.emad+tuned.tiny.c1": "fail"})
        run.log_params({"a,b": 1, "unset": None})
        run.log_metrics({"family.emad+tuned.tiny.c1_passed": 0.0})
    found = mlflow.MlflowClient(tracking_uri=store).get_run(run.run_id).data
    assert found.tags["family.emad_tuned.tiny.c1"] == "fail" and found.params == {"a_b": "1"}
    assert found.metrics == {"family.emad_tuned.tiny.c1_passed": 0.0}
