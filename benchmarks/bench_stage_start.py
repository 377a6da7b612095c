"""A stage's start, from its process's launch to its first line of work, per stage script of dvc.yaml.

Each stage script is started as DVC starts it (its first command line in ``dvc.yaml``, in the project root, a fresh
interpreter) through ``tools/stage_start.py``: the script imported, its arguments parsed, its params loaded. The
wall time of that process (launch to exit) is the start. ``--against REV`` times the same starts with the code of
another commit (``git archive REV`` into a temporary folder, first on ``PYTHONPATH``), alternating with this one,
so both see the same host. Separately: what a stage pays when it first logs a run (mlflow, its SQL store and one
run in a throwaway SQLite store), in a fresh interpreter. Medians of ``--repeats`` runs after one untimed run, to
reports/bench/stage_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
from common import write  # noqa: E402

LOG_A_RUN = """\
import time
started = time.perf_counter()
from emad import tracking
with tracking.stage_run("bench", {"what": "first run"}, run_name="stage start bench"):
    pass
print(time.perf_counter() - started)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", help="a commit whose stage starts to time alongside (e.g. HEAD~3)")
    parser.add_argument("--out", default="stage_start")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def command_lines() -> dict[str, list[str]]:
    """Script → its first command line in dvc.yaml, as DVC expands it."""
    from dvc.repo import Repo

    out: dict[str, list[str]] = {}
    with Repo(str(ROOT)) as repo:
        for stage in repo.index.stages:
            argv = shlex.split(stage.cmd)
            out.setdefault(argv[1], argv[1:])
    return dict(sorted(out.items()))


def start_seconds(argv: list[str], tree: Path | None) -> tuple[float, float, list[str]]:
    """(wall seconds from launch to exit, seconds inside the interpreter, heavy libraries) of one start."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "stage_start.py"), *argv], cwd=tree or ROOT,
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} ({tree or 'this tree'}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return wall, report["seconds"], report["heavy"]


def first_run_seconds() -> float:
    """Seconds a fresh interpreter spends importing mlflow, opening a SQLite store and logging one run."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
        subprocess.run([sys.executable, "-c", LOG_A_RUN], cwd=ROOT, env=env, check=True, capture_output=True)
        times = [float(subprocess.run([sys.executable, "-c", LOG_A_RUN], cwd=ROOT, env=env, check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
                 for _ in range(3)]
    return statistics.median(times)


def export(rev: str, into: Path) -> Path:
    """The files of commit ``rev`` under ``into`` (``git archive``)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    lines = command_lines()
    with tempfile.TemporaryDirectory() as tmp:
        other = export(args.against, Path(tmp)) if args.against else None
        trees = {"this": None, **({"against": other} if other else {})}
        rows = []
        for script, line in lines.items():
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
            heavy: dict[str, list[str]] = {}
            for name, tree in trees.items():  # one untimed start each (file caches)
                heavy[name] = start_seconds(line, tree)[2]
            for _ in range(args.repeats):
                for name, tree in trees.items():
                    wall, inside, _ = start_seconds(line, tree)
                    times[name].append((wall, inside))
            row = {"script": script, "command": " ".join(["python", *line])}
            for name in trees:
                row[name] = {"wall_s": round(statistics.median(w for w, _ in times[name]), 3),
                             "in_interpreter_s": round(statistics.median(i for _, i in times[name]), 3),
                             "heavy": heavy[name]}
            if other is not None:
                row["against_over_this"] = round(row["against"]["wall_s"] / row["this"]["wall_s"], 2)
            rows.append(row)
            print(f"{script}: " + ", ".join(f"{name} {row[name]['wall_s']:.2f} s" for name in trees), flush=True)
    result = {"benchmark": "stage_start", "repeats": args.repeats, "against": args.against,
              "python": sys.version.split()[0], "cpus": os.cpu_count(), "scripts": rows,
              "slowest": max(rows, key=lambda r: r["this"]["wall_s"])["script"],
              "first_run_s": round(first_run_seconds(), 3)}
    print(f"first logged run (mlflow, SQL store, one run): {result['first_run_s']:.2f} s")
    print(f"written to {write(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
