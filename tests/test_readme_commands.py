"""The README's commands work as typed in a fresh shell: after `source .venv/bin/activate` (as the README says),
every program its command blocks call resolves to the project's environment, and `python` is the one whose packages
the stages import — from a shell whose PATH holds no virtual environment."""

from __future__ import annotations

import re
import shlex
import shutil
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


# section.key: not the placeholder key, nor one that `+` adds
SET_PARAM = re.compile(r"(?:-S|--set-param)\s+'?([A-Za-z0-9_-]+\.[A-Za-z0-9_.+-]+)=")
POINT = re.compile(r"--point\s+([A-Za-z0-9_.-]+)")
KIND = re.compile(r"--kind\s+([a-z]+)")
TABLES = {"baseline": "baselines", "point": "points", "ablation": "ablations", "related": "related"}


def _examples() -> list[tuple[str, str, dict]]:
    """(document, text, the params its examples run on: the repository's params.yaml) for the README and every page
    of docs/."""
    import yaml

    repo = yaml.safe_load((ROOT / "params.yaml").read_text())
    return [(str(path.relative_to(ROOT)), path.read_text(), repo)
            for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]


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


PLACEHOLDER = "key=value"  # `dvc exp run -S key=value`: the syntax in prose, not a command to run


def _experiments() -> list[tuple[str, str, list[str]]]:
    """(document, command, its ``-S`` overrides) for each `dvc exp run` that sets params in the README and docs/:
    the commands of their shell blocks and inline code (tests/test_docs.py's reading of them)."""
    from tests.test_docs import _all_commands

    out = []
    for doc, cmd in _all_commands():
        if cmd[:3] != ["dvc", "exp", "run"]:
            continue
        overrides, args = [], cmd[3:]
        for i, arg in enumerate(args):
            if arg in ("-S", "--set-param") and i + 1 < len(args):  # a bare `dvc exp run -S` names the flag
                overrides.append(args[i + 1])
            elif arg.startswith("--set-param="):
                overrides.append(arg.partition("=")[2])
        if overrides and overrides != [PLACEHOLDER]:
            out.append((doc, shlex.join(cmd), overrides))
    return out


def test_every_documented_experiment_applies_to_the_default_params_and_passes_their_check(tmp_path):
    """Each `dvc exp run -S ...` of the docs, as printed: DVC's own override code (Hydra's grammar) applied to a copy
    of the repository's params.yaml, then the params check every stage runs first; a failure names the command and
    DVC's or the check's message."""
    from dvc.exceptions import DvcException
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import apply_overrides

    from emad.config import ConfigError
    from emad.params import validate_params

    found, bad = _experiments(), []
    for i, (doc, line, overrides) in enumerate(found):
        work = tmp_path / str(i)
        work.mkdir()
        shutil.copy(ROOT / "params.yaml", work / "params.yaml")
        try:
            for name, group in to_path_overrides(overrides).items():  # -S [<params file>:]<override>
                if name != "params.yaml":
                    shutil.copy(ROOT / name, work / name)
                apply_overrides(work / name, group)
            validate_params(work / "params.yaml")
        except (DvcException, ConfigError, OSError) as err:
            chain = [err]
            while chain[-1].__cause__ is not None:  # as DVC prints it: Invalid `--set-param` value: <Hydra's>: ...
                chain.append(chain[-1].__cause__)
            bad.append(f"{doc}: {line}: {': '.join(map(str, chain))}")
    assert len(found) >= 8 and not bad, "\n".join(bad)  # the README's sweeps and queue, params.md, pipeline.md...
