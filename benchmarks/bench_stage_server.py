"""A stage's start beside the stage server (emad/stage_server.py, what `make repro` runs) vs a fresh interpreter.

For each pipeline script, a probe does what the stage does before its work: it imports the script as a module (every
import at its top) and opens and ends a tracking run in a temporary SQLite store (mlflow and its SQL store). The
probe runs served (``python probe.py``, through the server's ``python``) and in a fresh interpreter (the real
one), alternating, ``--repeats`` times each, after one untimed run of each; the medians and their ratio per script
go to reports/bench/stage_server.json. The whole benchmark runs beside one server
(``python -m emad.stage_server -- python benchmarks/bench_stage_server.py --inner``).
"""

from __future__ import annotations

import argparse
import json
import os
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

from emad import stage_server  # noqa: E402

PROBE = """\
import importlib.util, sys
SERVED = "mlflow" in sys.modules  # a fresh interpreter has not imported it yet
spec = importlib.util.spec_from_file_location("stage_probe", {script!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)  # its imports; its main() runs only as __main__
from emad import tracking
with tracking.stage_run("bench", {{"script": {script!r}}}, run_name="stage server bench"):
    pass
print("served" if SERVED else "fresh")
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scripts", nargs="*", help="pipeline scripts (default: every pipeline/*.py)")
    parser.add_argument("--inner", action="store_true", help="(run beside the server: time the probes)")
    return parser.parse_args()


def _wall(cmd: list[str], expect: str) -> float:
    started = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - started
    if out.stdout.strip() != expect:
        raise RuntimeError(f"{' '.join(cmd)}: expected a {expect} start, got {out.stdout!r} {out.stderr[-2000:]}")
    return seconds


def inner(args: argparse.Namespace) -> dict:
    sock = Path(os.environ[stage_server.SOCKET_ENV])
    deadline = time.monotonic() + 120
    while not sock.exists():  # the command starts before the server listens
        if time.monotonic() > deadline:
            raise RuntimeError("the stage server never listened")
        time.sleep(0.1)
    scripts = args.scripts or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipeline").glob("*.py"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for script in scripts:
            probe = Path(tmp) / f"probe_{Path(script).stem}.py"
            probe.write_text(PROBE.format(script=str(ROOT / script)))
            served = ["python", str(probe)]  # through the server's shim (first on PATH)
            fresh = [sys.executable, str(probe)]  # the real interpreter
            _wall(served, "served"), _wall(fresh, "fresh")  # untimed: caches warm
            times = {"served": [], "fresh": []}
            for _ in range(args.repeats):
                times["served"].append(_wall(served, "served"))
                times["fresh"].append(_wall(fresh, "fresh"))
            row = {"script": script, **{f"{k}_s": statistics.median(v) for k, v in times.items()}, "runs": times}
            row["saved_s"] = row["fresh_s"] - row["served_s"]
            row["fresh_over_served"] = row["fresh_s"] / row["served_s"]
            rows.append(row)
            print(f"{script}: fresh {row['fresh_s']:.2f} s, served {row['served_s']:.2f} s "
                  f"(saves {row['saved_s']:.2f} s)", flush=True)
    return {"scripts": rows, "repeats": args.repeats, "cpu_count": os.cpu_count(),
            "mean_saved_s": statistics.fmean(r["saved_s"] for r in rows)}


def main() -> int:
    args = parse_args()
    if args.inner:
        print(json.dumps(inner(args)))
        return 0
    with tempfile.TemporaryDirectory() as store:  # the probes' runs: a throwaway store, not the project's
        env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{store}/bench.db",
                   EMAD_MLFLOW_EXPERIMENT="stage-server-bench", PYTHONPATH=os.pathsep.join(
                       filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "emad.stage_server", "--", sys.executable, __file__, "--inner",
               "--repeats", str(args.repeats), *(["--scripts", *args.scripts] if args.scripts else [])]
        out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"wrote {write('stage_server', result)}: mean saved per stage start {result['mean_saved_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
