"""`dvc repro` of the whole graph on a tiny random model and a tiny corpus, then a queued 2-job sweep.

The project's dvc.yaml, pipeline/ and emad/ are copied into a fresh git + DVC repository; params.yaml is shrunk
so the graph runs in about a minute on 2 cores. Checks every output, the report's verdict, `dvc metrics show`,
and that MLflow holds one run per stage execution — including the runs of two experiments run in parallel.
"""

from __future__ import annotations

import json
import os
import re
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
        "corpus": {"seed": 0, "calib_tokens": 600, "eval_tokens": 1200, "tokenizer_model": str(model_dir),
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
                          "fixed": {"method": "fixed", "depth": [3]},
                          "conf": {"method": "confidence", "threshold": [0.5, 3, 100], "probe_every": 1}},
            "swept_prompts": 1, "speed_repeats": 2, "speed_pairs": 5, "speed_tokens": 8,
            "shift_points": None, "unserved_tokens": 64,
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
        # the positive control: the tiny model with 40 idle layers; fixed depth 4 (the tiny model's own) is lossless
        "control": {"model": "tiny+idle40", "spec": f"{model_dir}+idle40", "source": "stdlib-prose",
                    "decode": {"domains": {"stdlib-prose": ["perplexity", "agreement"]},
                               "tasks": CONTROL_TASKS,
                               "baselines": {"full": {"method": "full"}, "fixed": {"method": "fixed", "depth": [3, 4]}},
                               "points": {"emad-topk": {"method": "emad", "margin": 0.0, "estimator": "topk"}}}},
        "aggregate": {"methods": ["emad"], "ppl_rel_tol": 0.01, "acc_abs_tol": 0.01},
    }


# ≥ 8 units per check (perplexity windows, prompts), so that the control's checks enter the verdict
CONTROL_TASKS = {"perplexity": {"tokens": 512, "window": 64, "prefix": 16},
                 "agreement": {"prompts": 8, "prompt_tokens": 16, "new_tokens": 8}}


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
        "tiny--full--stdlib-prose.json", "tiny--fixed-2-tuned--stdlib-prose.json", "tiny--fixed_3--stdlib-prose.json",
        "tiny+idle40--full--stdlib-prose.json", "tiny+idle40--fixed_3--stdlib-prose.json",
        "tiny+idle40--fixed_4--stdlib-prose.json", "tiny+idle40--emad-topk--cal-stdlib-prose--stdlib-prose.json",
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


def test_the_positive_control_passes_c1_with_fixed_depth_and_the_model_without_idle_layers_fails(repo):
    """Full depth of the control equals the tiny model's; fixed depth 4 (the tiny model's own depth) of 44 is lossless,
    so the fixed family passes C1 on the control, and fails on the tiny model itself."""
    def run(name: str) -> dict:
        (path,) = (repo / "reports" / "runs").rglob(f"{name}--stdlib-prose.json")
        return json.loads(path.read_text())

    control, base = run("tiny+idle40--full"), run("tiny--full")
    assert control["n_layers"] == 44 and base["n_layers"] == 4
    assert control["tasks"]["perplexity"]["samples"]["perplexity"][:2] == \
        base["tasks"]["perplexity"]["samples"]["perplexity"][:2]  # the same windows, the same NLL, bit for bit
    lossless = run("tiny+idle40--fixed_4")
    assert lossless["tasks"]["perplexity"]["samples"] == control["tasks"]["perplexity"]["samples"]
    assert lossless["cost"]["flops_ratio"] < 0.85 and lossless["cost"]["speed_timing"] == "pairs"
    assert len(lossless["cost"]["speed_pairs"]) == 5
    families = json.loads((repo / "reports" / "metrics.json").read_text())
    assert families["tiny+idle40"]["fixed"]["c1"] == "pass"
    assert families["tiny"]["fixed"]["c1"] == "fail"
    assert "tiny+idle40" in (repo / "reports" / "report.md").read_text()


def test_mlflow_holds_one_run_per_stage_execution(repo):
    runs = _mlflow_runs(repo)
    stages = runs["tags.dvc_stage"].value_counts().to_dict()
    # the control (tiny+idle40) runs its own fit_readouts, calibrate, smooth and fit_estimators instances
    assert stages == {"fit_readouts": 2, "calibrate": 4, "smooth": 4, "fit_estimators": 4, "decode": 8,
                      "control_decode": 4, "decode_ablation": 1, "decode_related": 1, "risk": 1, "aggregate": 1}
    names = dict(zip(runs["tags.mlflow.runName"], runs["tags.dvc_stage"]))
    assert {"fit_readouts tiny stdlib-prose", "calibrate tiny stdlib-prose tuned", "smooth tiny stdlib-prose logit",
            "fit_estimators tiny stdlib-prose tuned", "risk tiny margin stdlib-prose", "aggregate"} <= set(names)
    check_store(f"sqlite:///{repo / 'mlflow.db'}")  # names, no None params, uniform decode params and metrics
    parent = runs[runs["tags.dvc_stage"] == "aggregate"].iloc[0]["run_id"]
    nested = runs[runs["tags.mlflow.parentRunId"] == parent]
    assert len(nested) == 8 + 4 + 1 + 1  # every decode run, the control's included
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
    # each experiment reruns the decode stage (its 8 runs: the baselines beside the EMAD points, scored in one pass),
    # the ablations built on emad-m0, and the aggregate; not the control, whose points are its own
    assert per_stage == {"decode": 16, "decode_ablation": 2, "aggregate": 2}, per_stage
    decode = runs[runs["tags.dvc_stage"] == "decode"]
    margins = sorted(float(m) for m in decode[decode["tags.run_id"].str.contains("--emad-m0--")]
                     ["params.margin"])
    assert margins == [0.5, 1.0]


def test_two_clones_share_experiments_through_a_dvc_remote(repo, tmp_path):
    """docs/scaling.md's recipe: a bare git remote and a directory DVC remote shared by two clones."""
    git, store, other = tmp_path / "emad.git", tmp_path / "dvc-store", tmp_path / "b"
    _sh(repo, "git", "add", "-A")
    _sh(repo, "git", "commit", "-qm", "before sharing", "--allow-empty")
    _sh(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(git))
    _sh(repo, "git", "remote", "add", "origin", str(git))
    _sh(repo, "dvc", "remote", "add", "-d", "shared", str(store))
    _sh(repo, "git", "add", ".dvc/config")
    _sh(repo, "git", "commit", "-qm", "DVC remote")
    _sh(repo, "git", "push", "-q", "origin", "HEAD:main")
    _sh(repo, "dvc", "push", "--run-cache")
    _sh(repo, "dvc", "exp", "run", "-n", "margin-a", "-S", "decode.points.emad-m0.margin=0.25", timeout=900)
    _sh(repo, "dvc", "exp", "push", "origin", "margin-a")

    _sh(tmp_path, "git", "clone", "-q", str(git), str(other))
    _sh(other, "dvc", "pull", "--run-cache")
    restored = _sh(other, "dvc", "repro")
    ran = re.findall(r"Running stage '([^']+)'", restored)
    # only the models are rebuilt (cache: false, from the embedded wheel); every other stage is restored
    assert ran and all(s.startswith(("prepare_model", "control_model")) for s in ran), restored
    assert "changed" not in _sh(other, "dvc", "status")
    _sh(other, "dvc", "exp", "run", "-n", "margin-b", "-S", "decode.points.emad-m0.margin=0.75", timeout=900)
    _sh(other, "dvc", "exp", "pull", "origin", "margin-a")

    def experiments(clone: Path) -> dict[str, dict]:
        """``dvc exp show --json``: experiment name -> its rev, params, metrics and output hashes."""
        out = {}
        for baseline in json.loads(_sh(clone, "dvc", "exp", "show", "--json")):
            for experiment in baseline.get("experiments") or []:
                for rev in experiment["revs"]:
                    out[rev["name"]] = {"rev": rev["rev"], **{k: rev["data"].get(k) for k in ("params", "metrics",
                                                                                              "outs")}}
        return out

    here, there = experiments(repo), experiments(other)
    assert {"margin-a", "margin-b"} <= set(there)
    assert there["margin-a"] == here["margin-a"]  # the same commit, params, metrics and output hashes
