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
