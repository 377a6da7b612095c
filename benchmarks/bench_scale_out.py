"""Scale-out of a decode stage: the stage ``decode@<model>`` of a checkout that ran ``make repro``, on 1, 2 and 4
local Ray workers, one torch thread each — a check of correctness and balance, and the measured inputs of the
scaling model in docs/scaling.md.

Each width runs the stage in this process as dvc.yaml runs it (``pipeline/decode.py``, the checkout's params with
``decode.workers`` set), on the Ray executor with its trace on (:func:`emad.evaluation.executors.ray_executor`:
per unit its phase, actor and when it was submitted and done), writing into a folder of its own. Per width:

- ``equal``: the run files (and screens) equal those of the first width, timings and provenance aside
  (``tools/compare_runs.py``): the split does not change a number;
- ``phases``: per phase its units, span (first submitted to last done), the units' summed seconds and the largest;
- ``actors``: per actor its units, busy seconds and idle seconds (span of the stage's phases minus busy);
- ``serial_s``: the stage's wall time outside its phases (the plan, merging, choosing the screen's values, writing
  the run files and MLflow runs) — the share no worker takes; Ray's start (``ray_start_s``) is timed once, since
  one Ray (a CPU a worker, whatever the host's cores) serves every width.

Then ``worker_start``: one worker's start as a Ray actor, and the requests every worker makes again; and
``scaling``: the wall time predicted at 8, 64 and 512 workers from these costs, and the width from which adding
workers stops helping (docs/scaling.md says how). Writes reports/bench/scale_out.json.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
from common import write  # noqa: E402

PREDICT = (8, 64, 512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="a checkout that ran `make repro` (its data/)")
    parser.add_argument("--model", help="a model of its params (default: the first)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--point", action="append", help="only these points (default: every one of the stage)")
    parser.add_argument("--out", default="scale_out")
    parser.add_argument("--keep", type=Path, help="keep each width's outputs in this folder (default: deleted)")
    args = parser.parse_args(argv)
    if any(w < 1 for w in args.workers) or len(set(args.workers)) < 2:
        parser.error(f"--workers: at least two different widths, each >= 1 (the model is fitted from the two "
                     f"narrowest), got {args.workers}")
    args.workers = sorted(set(args.workers))
    if not (args.root / "data" / "models").is_dir():
        parser.error(f"--root {args.root}: no data/models there; run `make repro` in it first")
    return args


def stage_argv(root: Path, model: str) -> list[str]:
    """``decode@<model>``'s arguments as dvc.yaml gives them (its first command line)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        stage = next(s for s in repo.index.stages if getattr(s, "name", "") == f"decode@{model}")
        return shlex.split(stage.cmd)[2:]


def _retarget(argv: list[str], folder: Path, params: Path) -> list[str]:
    """``argv`` with its outputs under ``folder`` (as in a checkout: reports/...) and ``params``."""
    out = []
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in ("--out", "--artifacts"):
            value = str(folder / value)
        out += [flag, value]
    return [*out, "--params", str(params)]


def run_width(args, argv: list[str], width: int, folder: Path) -> dict:
    """The stage on ``width`` Ray workers (one thread each) into ``folder``: its wall time and trace."""
    import pipeline.decode as stage
    from emad.evaluation import executors

    params = yaml.safe_load((args.root / "params.yaml").read_text())
    params["decode"]["workers"] = width
    path = folder / "params.yaml"
    folder.mkdir(parents=True)
    path.write_text(yaml.safe_dump(params))
    trace: list[dict] = []

    def traced(plan, units, workers=None, actor=executors._Worker, then=None):
        return executors.ray_executor(plan, units, workers, actor=actor, then=then, trace=trace)

    executors.EXECUTORS.add("ray-traced", traced)
    os.environ.update(EMAD_DECODE_EXECUTOR="ray-traced", MLFLOW_TRACKING_URI=f"sqlite:///{folder / 'mlflow.db'}")
    points = [x for p in args.point or [] for x in ("--point", p)]
    try:
        began = time.perf_counter()
        stage.main([*_retarget(argv, folder, path), *points])
        wall = time.perf_counter() - began
    finally:
        executors.EXECUTORS.remove("ray-traced")
    return {"wall_s": wall, "trace": trace}


def summary(width: int, wall: float, trace: list[dict]) -> dict:
    """Per phase and per actor, from the trace; the serial share."""
    phases = {}
    for k in sorted({r["phase"] for r in trace}):
        units = [r for r in trace if r["phase"] == k]
        span = max(r["done"] for r in units) - min(r["submitted"] for r in units)
        phases[k] = {"kind": units[0]["kind"], "units": len(units), "span_s": span,
                     "unit_s_sum": sum(r["done"] - r["submitted"] for r in units),
                     "unit_s_max": max(r["done"] - r["submitted"] for r in units)}
    spans = sum(p["span_s"] for p in phases.values())
    actors = {}
    for a in sorted({r["actor"] for r in trace}):
        mine = [r for r in trace if r["actor"] == a]
        busy = sum(r["done"] - r["submitted"] for r in mine)
        actors[a] = {"units": len(mine), "busy_s": busy, "idle_s": spans - busy}
    return {"workers": width, "wall_s": wall, "serial_s": wall - spans, "phases": list(phases.values()),
            "actors": list(actors.values())}


def rounds(width: dict) -> list[tuple[str, float]]:
    """A width's phases as the work they do: each screen round (its shards' phase and the screen that reads them,
    or one screen unit that scores its domain itself) and the run phase, with its span in seconds."""
    out: list[tuple[str, float]] = []
    for p in width["phases"]:
        if p["kind"] == "screen" and out and out[-1][0] == "score":
            out[-1] = ("screen round", out[-1][1] + p["span_s"])
        else:
            out.append(("screen round" if p["kind"] == "screen" else p["kind"], p["span_s"]))
    return out


def model(widths: list[dict], ray_start: float, useful: dict[str, int]) -> dict:
    """The wall time at :data:`PREDICT` workers: T(w) = serial + Σ_round (fixed + work / min(w, cap)).

    Each round (a screen round, the run phase) is fitted from the two narrowest widths measured, ``a`` < ``b``:
    work = (t_a − t_b) / (1/a − 1/b) is what divides over the workers, fixed = t_a − work / a what each worker
    pays whatever the split (its start and model load in the first round, a task's requests made on each worker,
    the largest indivisible piece). A screen round divides over at most as many shards as a task has requests
    (``useful['score']``: more shards are empty), the run phase over at most its families (``useful['run']``).
    ``serial`` is the smallest measured wall time outside the phases (the plan, merging and writing: the driver's
    share) and Ray's start (``ray_start``: one Ray serves every width here, as a cluster serves every stage). Also the width from which one more worker gains less than 1%, and the width beyond which
    nothing divides further."""
    a, b = sorted(widths, key=lambda m: m["workers"])[:2]
    wa, wb = a["workers"], b["workers"]
    serial = min(m["serial_s"] for m in widths) + ray_start
    fitted = []
    for (kind, ta), (_, tb) in zip(rounds(a), rounds(b)):
        work = max(0.0, (ta - tb) / (1 / wa - 1 / wb))
        fitted.append({"round": kind, "work_s": work, "fixed_s": max(0.0, ta - work / wa),
                       "cap": useful["run"] if kind == "run" else useful["score"]})

    def predict(w: int) -> float:
        return serial + sum(r["fixed_s"] + r["work_s"] / min(w, r["cap"]) for r in fitted)

    stops = next(w for w in range(1, 1 << 16) if predict(w) - predict(w + 1) < 0.01 * predict(w))
    return {"fitted_from_workers": [wa, wb], "serial_s": serial, "ray_start_s": ray_start, "useful": useful,
            "rounds": fitted, "predicted_wall_s": {str(w): predict(w) for w in
                                                   (*(m["workers"] for m in widths), *PREDICT)},
            "measured_wall_s": {str(m["workers"]): m["wall_s"] for m in widths},
            "serial_share_at": {str(w): serial / predict(w) for w in PREDICT},
            "gain_below_1pct_from": stops, "saturates_at": max(r["cap"] for r in fitted)}


def worker_start(root: Path, argv: list[str], points: list[str]) -> dict:
    """What a worker pays whatever its share: its start as a Ray actor (``actor_start_s``: the process, its
    imports, the model loaded, every method built, the tasks prepared — until Ray reports it ready) and, in this
    process, the Decoder alone (``decoder_s``) and each teacher-forced task's requests (``requests_s``: what every
    worker makes again); and how far each phase can split (``useful``): the most requests any teacher-forced task
    of a domain has (a screen's shards beyond that are empty), and the families the run phase runs (its groups)."""
    import ray

    import pipeline.decode as stage
    from emad.evaluation.decoder import Decoder
    from emad.evaluation.executors import _Worker
    from emad.tasks.registry import Shared

    call = stage.plan(stage.parse_args([*_retarget(argv, Path(tempfile.mkdtemp()), root / "params.yaml"),
                                        *points]))
    began = time.perf_counter()
    actor = ray.remote(num_cpus=1)(_Worker).remote(call, os.getcwd(), 1)
    ray.get(actor.__ray_ready__.remote())
    actor_start = time.perf_counter() - began
    ray.kill(actor)
    began = time.perf_counter()
    decoder = Decoder(call)
    out = {"actor_start_s": actor_start, "decoder_s": time.perf_counter() - began, "requests_s": {}}
    stack, tokenizer, most = decoder.stack, decoder.loaded.tokenizer, 1
    for d in call.domains:
        for p in decoder.prepared[d]:
            if p.task.teacher_forced:
                began = time.perf_counter()
                most = max(most, len(p.task.requests(stack, tokenizer, p.data, p.settings, Shared())))
                out["requests_s"][f"{d}/{p.name}"] = time.perf_counter() - began
    return {**out, "useful": {"score": most, "run": len({job.point.family for job in call.jobs})}}


def difference(a: Path, b: Path, line: str) -> str:
    """``line`` of ``tools/compare_runs.py`` (``differs: <file>``) with the first key path where the two files
    differ and both values."""
    import json

    from tools.compare_runs import _clean

    name = line.removeprefix("differs: ")
    if name == line:
        return line

    def first(x, y, path: str) -> str | None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(x.keys() | y.keys()):
                found = first(x.get(k), y.get(k), f"{path}.{k}")
                if found:
                    return found
            return None
        if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            return next((f for i, (u, v) in enumerate(zip(x, y)) if (f := first(u, v, f"{path}[{i}]"))), None)
        return None if x == y else f"{path}: {str(x)[:200]} != {str(y)[:200]}"

    found = first(_clean(json.loads((a / name).read_text())), _clean(json.loads((b / name).read_text())), "")
    return f"{line} ({found})"


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)  # one CPU per actor; the stage computes with this thread count
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("RAY_ADDRESS", None)
    os.chdir(args.root)
    params = yaml.safe_load((args.root / "params.yaml").read_text())
    model_name = args.model or next(iter(params["models"]))
    argv_stage = stage_argv(args.root, model_name)
    points = [x for p in args.point or [] for x in ("--point", p)]
    import ray

    from tools.compare_runs import compare

    began = time.perf_counter()  # one Ray for every width, with a CPU a worker (the host's cores may be fewer)
    ray.init(address="local", num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - began
    widths, folders = [], {}
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmp:
        for w in args.workers:
            folders[w] = (args.keep or Path(tmp)) / f"w{w}"
            done = run_width(args, argv_stage, w, folders[w])
            widths.append(summary(w, done["wall_s"], done["trace"]))
            first = folders[args.workers[0]]
            widths[-1]["equal_to_workers"] = args.workers[0]
            widths[-1]["differences"] = [difference(first, folders[w], line) for line in compare(first, folders[w])
                                         ] if w != args.workers[0] else []
            print(f"scale-out: {w} workers: {done['wall_s']:.0f} s, serial {widths[-1]['serial_s']:.0f} s, "
                  f"{len(widths[-1]['differences'])} differences", file=sys.stderr)
    start = worker_start(args.root, argv_stage, points)
    ray.shutdown()
    result = {"model": model_name, "points": args.point or "every point of the stage", "threads_per_worker": 1,
              "host_cpus": os.cpu_count(), "ray_start_s": ray_start, "widths": widths,
              "worker_start": start, "scaling": model(widths, ray_start, start["useful"])}
    print(write(args.out, result))
    return 0 if all(not m["differences"] for m in widths) else 1


if __name__ == "__main__":
    sys.exit(main())
