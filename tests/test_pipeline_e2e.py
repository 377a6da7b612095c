"""`dvc repro` of the whole graph on a tiny random model and a tiny corpus, then a queued 2-job sweep.

The project's dvc.yaml, pipeline/ and emad/ are copied into a fresh git + DVC repository; params.yaml is shrunk
so the graph runs in about a minute on 2 cores. Checks every output, the report's verdict, `dvc metrics show`,
and that MLflow holds one run per stage execution — including the runs of two experiments run in parallel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.mlflow_checks import check_store
from tests.tiny import save_tiny_pretrained

pytestmark = pytest.mark.heavy  # run by `make test-heavy` (and CI), not `make test`

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _params(model_dir: Path) -> dict:
    return {
        "models": {"tiny": str(model_dir)},
        "corpus": {"seed": 0, "calib_tokens": 600, "eval_tokens": 400, "tokenizer_model": str(model_dir),
                   "sources": ["stdlib-prose"]},
        "readouts": {"layers": 1, "tokens": 256, "holdout": 64, "window": 32, "epochs": 2, "batch_tokens": 64,
                     "vocab_sample": 32, "top_k": 4, "source": "stdlib-prose", "device": "cpu", "dtype": "float32"},
        "calibrate": {"sources": ["stdlib-prose"], "window": 32, "batch_size": 4, "probe_layers": 1,
                      "readouts": ["logit", "tuned"], "max_tokens": 256, "device": "cpu", "dtype": "float32"},
        "smooth": {"statistic": "mean", "min_count": 5},
        "estimators": {"topk": {"k": 64}, "lowrank": {"rank": 8}, "tokens": 256, "window": 32,
                       "readouts": ["logit", "tuned"]},
        "decode": {
            "domains": {"stdlib-prose": ["perplexity", "agreement", "fidelity"]},
            "tasks": {"perplexity": {"tokens": 128, "window": 64, "prefix": 16},
                      "agreement": {"prompts": 2, "prompt_tokens": 16, "new_tokens": 8},
                      "fidelity": {"prompts": 2, "prompt_tokens": 16, "new_tokens": 8}},
            "baselines": {"full": {"method": "full"}, "fixed-2-tuned": {"method": "fixed", "depth": 2,
                                                                        "readout": "tuned"},
                          "conf": {"method": "confidence", "threshold": [0.5, 3, 100], "probe_every": 1}},
            "swept_prompts": 1, "speed_repeats": 2, "unserved_tokens": 64,
            "points": {"emad-m0": {"method": "emad", "margin": 0.0},
                       "emad-m0-tuned": {"method": "emad", "margin": 0.0, "readout": "tuned"}},
            "default_point": "emad-m0",
            "ablations": {"backfill": {"policy": "backfill"}},
            "ablation_domains": ["stdlib-prose"], "ablation_tasks": ["perplexity"],
            "ablation_calibration": "stdlib-prose",
            "related": {"ead-k2": {"method": "ead", "small_layers": 2, "tau": 3.0, "window": 2, "d_min": 2}},
            "related_domains": ["stdlib-prose"], "related_tasks": None,
            "heatmap_texts": 1, "device": "cpu", "dtype": "float32",
        },
        "risk": {"domain": "stdlib-prose", "calibration": "stdlib-prose", "prompts": 4, "fresh_prompts": 2, "prompt_tokens": 8, "new_tokens": 4,
                 "delta": 0.3, "epsilon": 0.3, "loss": "agreement", "device": "cpu", "dtype": "float32",
                 "searches": {"margin": {"point": {"method": "emad"}, "knob": "margin", "values": [10.0, 0.0]}}},
        "aggregate": {"methods": ["emad"]},
    }


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the repo's own default store
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DVC_NO_ANALYTICS": "1",
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t"}


def _sh(repo: Path, *cmd: str, timeout: int = 600) -> str:
    done = subprocess.run(cmd, cwd=repo, env=_env(), capture_output=True, text=True, timeout=timeout)
    errors = "\n".join(line for line in done.stderr.splitlines() if "/s]" not in line)  # no progress bars
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{errors[-6000:]}"
    return done.stdout


def _mlflow_runs(repo: Path):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=["emad"])


@pytest.fixture(scope="module")
def repo(tmp_path_factory, smollm2) -> Path:
    base = tmp_path_factory.mktemp("e2e")
    model_dir = save_tiny_pretrained(base / "tiny-model", smollm2.tokenizer)
    repo = base / "repo"
    repo.mkdir()
    for name in ("pipeline", "emad"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    (repo / "params.yaml").write_text(yaml.safe_dump(_params(model_dir), sort_keys=False))
    (repo / ".gitignore").write_text("mlflow.db\nmlflow.db.lock\nmlruns/\n/data/\n")
    _sh(repo, "git", "init", "-q")
    _sh(repo, "dvc", "init", "-q")
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    _sh(repo, "dvc", "config", "plots.html_template", "plots/offline.html")
    started = time.perf_counter()
    _sh(repo, "dvc", "repro", timeout=900)
    repo_seconds = time.perf_counter() - started
    print(f"dvc repro of the tiny graph: {repo_seconds:.0f} s")
    return repo


def test_repro_writes_every_output(repo):
    runs = sorted(p.name for p in (repo / "reports" / "runs").rglob("*.json"))
    assert runs == sorted([
        "tiny--full--stdlib-prose.json", "tiny--fixed-2-tuned--stdlib-prose.json",
        "tiny--emad-m0--cal-stdlib-prose--stdlib-prose.json", "tiny--emad-m0-tuned--cal-stdlib-prose--stdlib-prose.json",
        "tiny--backfill--cal-stdlib-prose--stdlib-prose.json", "tiny--ead-k2--stdlib-prose.json",
        *(f"tiny--conf_{v}--stdlib-prose.json" for v in ("0.5", "3", "100"))])
    swept = [json.loads((repo / "reports/runs/tiny--decode" / f"tiny--conf_{v}--stdlib-prose.json").read_text())
             for v in ("0.5", "3", "100")]
    assert [(r["curve"], r["knob"], r["value"]) for r in swept] == [("conf", "threshold", v) for v in (0.5, 3, 100)]
    assert all(r["cost"]["reference_tokens_per_s"] > 0 and r["cost"]["speedup"] > 0 for r in swept)
    folders = {"full": "decode", "fixed-2-tuned": "decode", "emad-m0--cal-stdlib-prose": "decode",
               "emad-m0-tuned--cal-stdlib-prose": "decode", "backfill--cal-stdlib-prose": "ablations--cal-stdlib-prose",
               "ead-k2": "related"}  # one folder per stage: every point of its kinds, one run file per domain
    for point, folder in folders.items():
        (run,) = (repo / "reports" / "runs" / f"tiny--{folder}").glob(f"tiny--{point}--stdlib-prose.json")
        assert (repo / "reports" / "artifacts" / f"tiny--{folder}" / point / "stdlib-prose" / "heatmap.html").is_file()
    for path in ("data/profiles/tiny/stdlib-prose/logit/profile.json", "data/profiles/tiny/stdlib-prose/tuned/profile.json",
                 "data/profiles/tiny/stdlib-prose/tuned/estimators.json", "reports/profiles/tiny-stdlib-prose-tuned.png",
                 "data/readouts/tiny/stdlib-prose/readouts.safetensors", "data/readouts/tiny/stdlib-prose/metrics.json",
                 "reports/readouts/tiny-stdlib-prose.png", "reports/report.md", "reports/metrics.json",
                 "reports/risk/tiny--cal-stdlib-prose/tiny--margin--cal-stdlib-prose.json"):
        assert (repo / path).is_file(), path
    assert list((repo / "reports" / "figures").glob("*.png"))
    assert list((repo / "reports" / "pareto" / "flops").glob("*.json"))
    report = (repo / "reports" / "report.md").read_text()
    assert "C1" in report and "C2" in report and "MLflow runs" in report
    assert "## Risk-controlled thresholds" in report and "| tiny | margin | stdlib-prose | margin |" in report
    metrics = json.loads(_sh(repo, "dvc", "metrics", "show", "--json"))
    assert "tiny" in json.dumps(metrics)
    status = _sh(repo, "dvc", "status")
    assert "changed" not in status


def test_mlflow_holds_one_run_per_stage_execution(repo):
    runs = _mlflow_runs(repo)
    stages = runs["tags.dvc_stage"].value_counts().to_dict()
    assert stages == {"fit_readouts": 1, "calibrate": 2, "smooth": 2, "fit_estimators": 2, "decode": 7,
                      "decode_ablation": 1, "decode_related": 1, "risk": 1, "aggregate": 1}
    names = dict(zip(runs["tags.mlflow.runName"], runs["tags.dvc_stage"]))
    assert {"fit_readouts tiny stdlib-prose", "calibrate tiny stdlib-prose tuned", "smooth tiny stdlib-prose logit",
            "fit_estimators tiny stdlib-prose tuned", "risk tiny margin stdlib-prose", "aggregate"} <= set(names)
    check_store(f"sqlite:///{repo / 'mlflow.db'}")  # names, no None params, uniform decode params and metrics
    parent = runs[runs["tags.dvc_stage"] == "aggregate"].iloc[0]["run_id"]
    nested = runs[runs["tags.mlflow.parentRunId"] == parent]
    assert len(nested) == 9
    swept = runs[runs["tags.run_id"].str.contains("--conf_", na=False)]
    assert sorted(swept["tags.run_id"]) == [f"tiny--conf_{v}--stdlib-prose" for v in ("0.5", "100", "3")]
    tuned = json.loads((repo / "reports/runs/tiny--decode"
                        / "tiny--emad-m0-tuned--cal-stdlib-prose--stdlib-prose.json").read_text())
    assert tuned["readout"] == "tuned" and tuned["method"]["readout"] == "tuned"


def test_offline_plots_render(repo):
    _sh(repo, "dvc", "plots", "show", "--out", "plots-html")
    page = (repo / "plots-html" / "index.html").read_text()
    assert "<script src" not in page and "flops_ratio" in page


def test_queued_two_job_sweep_keeps_every_mlflow_run(repo):
    _sh(repo, "git", "add", "-A")
    _sh(repo, "git", "commit", "-qm", "baseline")
    before = len(_mlflow_runs(repo))
    for margin in ("0.5", "1.0"):
        _sh(repo, "dvc", "exp", "run", "--queue", "-S", f"decode.points.emad-m0.margin={margin}")
    _sh(repo, "dvc", "queue", "start", "-j", "2")
    deadline = time.time() + 600
    while time.time() < deadline:
        status = _sh(repo, "dvc", "queue", "status")
        if "Queued" not in status and "Running" not in status:
            break
        time.sleep(3)
    assert "Failed" not in status, _sh(repo, "dvc", "queue", "logs", status.split()[0]) if status else status
    runs = _mlflow_runs(repo).iloc[: len(_mlflow_runs(repo)) - before]
    per_stage = runs["tags.dvc_stage"].value_counts().to_dict()
    # each experiment reruns the decode stage (its 7 runs: the baselines beside the EMAD points, scored in one pass),
    # the ablations built on emad-m0, and the aggregate
    assert per_stage == {"decode": 14, "decode_ablation": 2, "aggregate": 2}, per_stage
    decode = runs[runs["tags.dvc_stage"] == "decode"]
    margins = sorted(float(m) for m in decode[decode["tags.run_id"].str.contains("--emad-m0--")]
                     ["params.margin"])
    assert margins == [0.5, 1.0]
