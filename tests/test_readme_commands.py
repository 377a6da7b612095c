"""The README's commands work as typed in a fresh shell: after `source .venv/bin/activate` (as the README says),
every program its command blocks call resolves to the project's environment, and `python` is the one whose packages
the stages import — from a shell whose PATH holds no virtual environment."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)


def _programs() -> set[str]:
    """The first word of every command in the README's bash blocks (environment assignments skipped)."""
    text = (ROOT / "README.md").read_text()
    found = set()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            words = [w for w in line.split("#")[0].split() if "=" not in w or w.startswith("-")]
            if words and words[0] not in ("source", "cd", "export") and not words[0].startswith("-"):
                found.add(words[0])
    return found


@pytest.mark.skipif(not (VENV / "bin" / "activate").is_file(), reason="tests run outside a virtual environment")
def test_readme_commands_resolve_in_a_fresh_shell_after_activating():
    assert "source .venv/bin/activate" in (ROOT / "README.md").read_text()
    programs = sorted(_programs() - {"git", "make"})  # git and make come with the system
    assert {"dvc", "mlflow"} <= set(programs)
    script = (f"source {VENV}/bin/activate && for p in {' '.join(programs)}; do command -v $p || echo MISSING $p; "
              f"done && python -c 'import tqdm, emad, dvc, mlflow; print(\"imports ok\")'")
    fresh = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(Path.home())}
    without = subprocess.run(["bash", "-c", "command -v dvc || echo none"], env=fresh, capture_output=True, text=True,
                             cwd=ROOT)
    assert str(VENV) not in without.stdout  # the fresh shell does not see the environment by itself
    done = subprocess.run(["bash", "-c", script], env=fresh, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "MISSING" not in done.stdout and "imports ok" in done.stdout
    for line in done.stdout.splitlines()[:-1]:
        if line.split("/")[-1] in ("dvc", "mlflow", "python"):
            assert line.startswith(str(VENV)), line


# The docs whose examples run on another params file than the repository's params.yaml: scaling.md's recipe is the
# one tests/test_pipeline_e2e.py runs on the tiny-model graph.
TINY_GRAPH_DOCS = {"docs/scaling.md"}
SET_PARAM = re.compile(r"(?:-S|--set-param)\s+'?([A-Za-z0-9_+-]+\.[A-Za-z0-9_.+-]+)=")  # section.key: not the placeholder key
POINT = re.compile(r"--point\s+([A-Za-z0-9_.-]+)")
KIND = re.compile(r"--kind\s+([a-z]+)")
TABLES = {"baseline": "baselines", "point": "points", "ablation": "ablations", "related": "related"}


def _examples() -> list[tuple[str, str, dict]]:
    """(document, text, the params its examples run on) for the README and every page of docs/."""
    import yaml

    from tests.tiny_graph import params as tiny_params

    repo = yaml.safe_load((ROOT / "params.yaml").read_text())
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        name = str(path.relative_to(ROOT))
        out.append((name, path.read_text(), tiny_params(Path("tiny-model")) if name in TINY_GRAPH_DOCS else repo))
    return out


def _has(params: dict, key: str) -> bool:
    node = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_key_an_example_sets_exists_in_its_params():
    """`dvc exp run -S decode.points.<point>.margin=...` names a point (and an ablation) the params file has."""
    found, bad = 0, []
    for name, text, params in _examples():
        for key in SET_PARAM.findall(text):
            found += 1
            if not _has(params, key):
                bad.append(f"{name}: -S {key}")
    assert found >= 5 and not bad, bad


def test_every_point_an_example_runs_exists_in_its_params():
    """`pipeline/decode.py --kind related --point ead-tuned` names a point (or sweep) of that kind's table."""
    found, bad = 0, []
    for name, text, params in _examples():
        for line in text.splitlines():
            kinds = KIND.findall(line) or list(TABLES)
            for point in POINT.findall(line):
                found += 1
                if not any(point in (params["decode"].get(TABLES[kind]) or {}) for kind in kinds):
                    bad.append(f"{name}: --point {point} (--kind {', '.join(kinds)})")
    assert found >= 2 and not bad, bad
