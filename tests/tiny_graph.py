"""The tiny-model graph: the project's dvc.yaml, pipeline/ and emad/ copied into a fresh git + DVC repository whose
params.yaml is shrunk (a random 4-layer model, a tiny corpus, every stage kind and the positive control) so that
`dvc repro` runs in about a minute on 2 cores. Used by the end-to-end, Ray cluster and tracking server tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from tests.tiny import save_tiny_pretrained

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def params(model_dir: Path) -> dict:
    """The tiny graph's params.yaml for the tiny model saved at ``model_dir``."""
    return {
        "models": {"tiny": str(model_dir)},
        "corpus": {"seed": 0, "calib_tokens": 600, "eval_tokens": 1200, "tokenizer_model": str(model_dir),
                   "sources": ["stdlib-prose"]},
        "readouts": {"layers": 1, "tokens": 192, "selection": 64, "holdout": 64, "window": 32, "epochs": 2, "batch_tokens": 64,
                     "vocab_sample": 32, "top_k": 4, "source": "stdlib-prose", "device": "cpu", "dtype": "float32"},
        "calibrate": {"sources": ["stdlib-prose"], "window": 32, "batch_size": 4, "probe_layers": 1,
                      "readouts": ["logit", "tuned"], "max_tokens": 256, "device": "cpu", "dtype": "float32"},
        "smooth": {"statistic": "mean", "min_count": 5},
        "estimators": {"topk": {"k": 64}, "lowrank": {"rank": 8}, "tokens": 256, "window": 32,
                       "readouts": ["logit", "tuned"]},
        "decode": {
            "domains": {"stdlib-prose": ["perplexity", "agreement", "fidelity"]},
            "tasks": {"perplexity": {"tokens": 128, "window": 64, "prefix": 16},
                      "agreement": {"prompts": 16, "prompt_tokens": 16, "new_tokens": 8},
                      "fidelity": {"prompts": 16, "prompt_tokens": 16, "new_tokens": 8}},
            "baselines": {"full": {"method": "full"}, "fixed-2-tuned": {"method": "fixed", "depth": 2,
                                                                        "readout": "tuned"},
                          "fixed": {"method": "fixed", "depth": [3]},
                          "conf": {"method": "confidence", "threshold": [0.5, 3, 100], "probe_every": 1}},
            "swept_prompts": 1, "sweep_batch": 4, "sweep_batch_tokens": 4096, "speed_repeats": 2, "speed_prompts": 8, "speed_tokens": 8, "speed_tokens_by_device": {"cuda": 16}, "speed_flops_below": 1.0, "speed_candidates": None, "split_seed": 0,
            "shift_points": None, "unserved_tokens": 64,
            "points": {"emad-m0": {"method": "emad", "margin": 0.0},
                       "emad-m0-tuned": {"method": "emad", "margin": 0.0, "readout": "tuned"}},
            "default_point": "emad-m0",
            "ablations": {"backfill": {"policy": "backfill"}},
            "ablation_domains": ["stdlib-prose"], "ablation_tasks": ["perplexity"],
            "ablation_calibration": "stdlib-prose",
            "related": {"ead-k2": {"method": "ead", "small_layers": 2, "tau": 3.0, "window": 2, "d_min": 2}},
            "related_domains": ["stdlib-prose"], "related_tasks": None,
            "heatmap_texts": 1, "device": "cpu", "dtype": "float32", "engine": "auto",
        },
        "risk": {"domain": "stdlib-prose", "calibration": "stdlib-prose", "prompts": 4, "fresh_prompts": 2,
                 "prompt_tokens": 8, "new_tokens": 4, "delta": 0.3, "epsilon": 0.3, "loss": "agreement",
                 "device": "cpu", "dtype": "float32",
                 "searches": {"margin": {"point": {"method": "emad"}, "knob": "margin", "values": [10.0, 0.0]}}},
        # the positive control: the tiny model with 40 idle layers; fixed depth 4 (the tiny model's own) is lossless
        "control": {"model": "tiny+idle40", "spec": f"{model_dir}+idle40", "base": "tiny", "source": "stdlib-prose",
                    "decode": {"domains": {"stdlib-prose": ["perplexity", "agreement"]},
                               "tasks": CONTROL_TASKS,
                               "baselines": {"full": {"method": "full"}, "fixed": {"method": "fixed", "depth": [3, 4]}},
                               "points": {"emad-topk": {"method": "emad", "margin": 0.0, "estimator": "topk"}}}},
        "aggregate": {"methods": ["emad"], "ppl_rel_tol": 0.01, "acc_abs_tol": 0.01, "min_flops_reduction": 0.15,
                      "min_speed_gain": 0.10},
    }


# ≥ 8 units per check (perplexity windows, prompts), so that the control's checks enter the verdict, and ≥ 368
# tokens each, so that a lossless point's checks can be met (DESIGN.md §4)
CONTROL_TASKS = {"perplexity": {"tokens": 512, "window": 64, "prefix": 16},
                 "agreement": {"prompts": 16, "prompt_tokens": 16, "new_tokens": 24}}


def env(**extra: str) -> dict:
    """The stages' environment: offline, one torch thread, the repository's own MLflow store unless ``extra`` names
    one (MLFLOW_TRACKING_URI), a git identity; ``extra`` added last."""
    base = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return {**base, "PATH": f"{BIN}{os.pathsep}{base.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DVC_NO_ANALYTICS": "1",
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t", **extra}


def sh(repo: Path, *cmd: str, timeout: int = 600, environ: dict | None = None) -> str:
    """Run ``cmd`` in ``repo`` (environment ``environ``, else :func:`env`); its stdout, or an assertion with its
    output's tail."""
    done = subprocess.run(cmd, cwd=repo, env=environ or env(), capture_output=True, text=True, timeout=timeout)
    errors = "\n".join(line for line in done.stderr.splitlines() if "/s]" not in line)  # no progress bars
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{errors[-6000:]}"
    return done.stdout


def make_repo(base: Path, tokenizer, change=None) -> Path:
    """A git + DVC repository under ``base`` holding the tiny graph (nothing run yet); ``change(params)`` may edit
    its params.yaml first."""
    model_dir = save_tiny_pretrained(base / "tiny-model", tokenizer)
    repo = base / "repo"
    repo.mkdir()
    for name in ("pipeline", "emad"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    (repo / "reports" / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "reports" / "bench" / "coverage.json", repo / "reports" / "bench")  # the verdict's table
    values = params(model_dir)
    if change:
        change(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    (repo / ".gitignore").write_text("mlflow.db\nmlflow.db.lock\nmlruns/\n/data/\n")
    sh(repo, "git", "init", "-q")
    sh(repo, "dvc", "init", "-q")
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    sh(repo, "dvc", "config", "plots.html_template", "plots/offline.html")
    return repo


def mlflow_runs(uri: str):
    """Every run of the experiment ``emad`` in the store ``uri``, as MLflow's data frame."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=["emad"])


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
