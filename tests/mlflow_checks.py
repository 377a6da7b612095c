"""Checks that an MLflow store is one a person can compare in (DESIGN §5): used by the tests and by hand.

    python -c "from tests.mlflow_checks import check_store; check_store('sqlite:////abs/path/mlflow.db')"
"""

from __future__ import annotations

import os

from emad.tracking import SINGLE_INSTANCE

DECODE_PARAMS = ("family", "readout", "knob", "calibration", "domain")
SHOWN = 20  # problems listed in the message; the rest are counted


def run_problems(name: str, stage: str, params: dict[str, str], metrics: dict[str, float]) -> list[str]:
    """What is wrong with one run (empty when nothing): its name, its params, and for a decode run the uniform
    params and metrics the compare view needs."""
    problems = []
    who = f"run {name!r} (stage {stage or '?'})"
    if stage not in SINGLE_INSTANCE and (name.strip() == stage or " " not in name.strip()):
        problems.append(f"{who}: the name does not say which instance it is; expected '{stage} <qualifier> ...' "
                        "(tracking.run_name)")
    nones = sorted(k for k, v in params.items() if v == "None")
    if nones:
        problems.append(f"{who}: params logged as 'None': {', '.join(nones)} (log only what is set)")
    if stage.startswith("decode"):
        missing = [k for k in DECODE_PARAMS if k not in params]
        if missing:
            problems.append(f"{who}: decode run without params {', '.join(missing)} (RunRecord.mlflow_params)")
        if "flops_ratio" not in metrics:
            problems.append(f"{who}: decode run without metric flops_ratio (RunRecord.mlflow_metrics)")
        if not any(k.startswith("quality.") for k in metrics):
            problems.append(f"{who}: decode run without any quality.<task>.<metric> metric (RunRecord.mlflow_metrics)")
    return problems


def check_store(tracking_uri: str) -> None:
    """Raise AssertionError, listing every problem, unless each run of every experiment in the store is named for
    its stage instance (``calibrate smollm2-135m stdlib-prose tuned``; the stages of
    :data:`emad.tracking.SINGLE_INSTANCE` may use the bare stage name), logs no param as ``"None"``, and, for a
    decode run (tag ``dvc_stage`` starting with ``decode``), has params ``family``, ``readout``, ``knob``,
    ``calibration``, ``domain``, metric ``flops_ratio`` and at least one ``quality.`` metric."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = client.search_experiments()
    runs = [run for exp in experiments for run in _all_runs(client, exp.experiment_id)]
    assert runs, f"no runs in the MLflow store {tracking_uri}"
    problems = [p for run in runs for p in run_problems(run.info.run_name or "", run.data.tags.get("dvc_stage", ""),
                                                        run.data.params, run.data.metrics)]
    more = f"\n... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    assert not problems, (f"{len(problems)} problem(s) in the MLflow store {tracking_uri} ({len(runs)} runs):\n"
                          + "\n".join(problems[:SHOWN]) + more)


def _all_runs(client, experiment_id: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs
