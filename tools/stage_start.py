"""Start a pipeline stage as DVC does, up to its first line of work, and say what that start imported.

Usage: ``python tools/stage_start.py pipeline/<stage>.py [the stage's arguments]`` in the project root. The script
is imported, its arguments parsed and its params loaded (its ``load_params``; the decode stages' plan needs a
model's depth, so there the decode section is loaded as the plan loads it), and nothing else. Prints one JSON line:
``heavy`` (the libraries of :data:`HEAVY` then imported) and ``seconds`` (from this interpreter's start).
Used by ``tests/test_stage_imports.py`` and ``benchmarks/bench_stage_start.py``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time

START = time.perf_counter()  # the interpreter's own start (about 20 ms) comes before it: a benchmark times it outside

HEAVY = ("torch", "transformers", "mlflow", "sqlalchemy", "scipy", "matplotlib", "pandas", "pyarrow", "datasets",
         "ray", "lm_eval")
"""Libraries whose import costs a stage start 0.3 s or more on a CPU host (``python -X importtime``)."""


def start(script: str, argv: list[str]) -> list[str]:
    """Imports ``script``, parses ``argv`` and loads its params; the heavy libraries then imported."""
    spec = importlib.util.spec_from_file_location("stage", script)
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    if hasattr(stage, "parse_args"):
        args = stage.parse_args(argv)
        if hasattr(stage, "load_params"):
            stage.load_params(args)
        else:  # decode: its plan loads the decode section, then reads the model's depth
            from emad.params import load_decode

            load_decode(args.params, control=args.control)
    return sorted(name for name in HEAVY if name in sys.modules)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].endswith(".py"):
        print("usage: python tools/stage_start.py pipeline/<stage>.py [its arguments]", file=sys.stderr)
        return 2
    heavy = start(argv[0], argv[1:])
    seconds = time.perf_counter() - START
    print(json.dumps({"script": argv[0], "heavy": heavy, "seconds": round(seconds, 3)}))
    return 0

if __name__ == "__main__":
    sys.path.insert(0, ".")  # the project root, as a stage run by DVC sees it (editable install or not)
    sys.exit(main())
