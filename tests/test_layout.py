"""The package layout: no import cycle anywhere in emad/, a public API from the top, the old module paths gone."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import emad

PACKAGE = Path(emad.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    """Dotted module name → file, for every module of emad/ (a package is named by its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The emad modules ``name`` imports (TYPE_CHECKING and function-level imports included), parents excluded."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk of ``graph`` (module → modules it imports)."""
    cycles, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                done.add(nxt)
                walk(nxt, path + [nxt])

    for node in sorted(graph):
        if node not in done:
            done.add(node)
            walk(node, [node])
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_emad():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert import_cycles(graph) == []


def test_params_is_the_only_module_that_knows_every_section():
    from emad import params

    modules = _modules()
    importers = {name for name, path in modules.items() if "emad.params" in _imports(name, path, set(modules))}
    assert importers <= {"emad.cli"}, importers
    assert set(params.sections()) == {"models", "control", "corpus", "readouts", "calibrate", "smooth", "estimators", "decode",
                                      "risk", "aggregate"}


@pytest.mark.parametrize("name", emad.__all__)
def test_public_names_resolve(name):
    assert getattr(emad, name) is not None


def test_unknown_public_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        emad.nope  # noqa: B018


@pytest.mark.parametrize("old", ["models", "stack", "cost", "criteria", "estimators", "policies", "profile",
                                 "stats", "calibrate", "operating_point", "runfile", "risk", "plots",
                                 "eval_config", "calibration_config", "lm_eval_model", "lm_eval_tasks"])
def test_old_module_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"emad.{old}")


# --- layering and the DVC stages' code dependencies ------------------------------------------------------------

BELOW_REPORT = ("engine", "exits", "calibration", "decode", "methods", "tasks", "evaluation", "corpus")


def test_nothing_below_the_report_imports_it():
    """The data flow runs one way: what decodes and evaluates never reads the report (DESIGN.md §2)."""
    modules = _modules()
    known = set(modules)
    offenders = {name: sorted(m for m in _imports(name, path, known) if m.startswith("emad.report"))
                 for name, path in modules.items() if name.split(".")[1:2] and name.split(".")[1] in BELOW_REPORT}
    assert not {k: v for k, v in offenders.items() if v}, offenders


# emad.params checks every section of params.yaml before a stage works (a typo fails the first stage); what a stage
# computes comes from its own section's model, which its script imports itself: params.py is a dependency, the other
# sections' models it checks are not.
CHECKS_ONLY = {"emad.params"}


def _closure(start: set[str], modules: dict[str, Path]) -> set[str]:
    """Every emad module that importing ``start`` runs: their imports, transitively, and each one's packages
    (the imports of :data:`CHECKS_ONLY` modules aside)."""
    known, seen, todo = set(modules), set(), list(start)
    while todo:
        name = todo.pop()
        if name in seen or name not in known:
            continue
        seen.add(name)
        if name in CHECKS_ONLY:
            continue
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += sorted(_imports(name, modules[name], known))
    return seen


def _script_imports(script: Path, modules: dict[str, Path]) -> set[str]:
    """The emad modules a pipeline script runs when it is executed (function-level imports included)."""
    tree = ast.parse(script.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return _closure({m for m in found if m in modules}, modules)


def _stages() -> dict[str, tuple[Path, list[str]]]:
    """dvc.yaml stage → (its pipeline script, its deps as written)."""
    import re

    import yaml

    root = PACKAGE.parent
    out = {}
    for name, stage in yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))["stages"].items():
        body = stage.get("do", stage)
        script = re.search(r"python (pipeline/\w+\.py)", body["cmd"])
        if script:
            out[name] = (root / script.group(1), [str(d) if isinstance(d, str) else next(iter(d)) for d in
                                                  body.get("deps", [])])
    return out


@pytest.mark.parametrize("stage", sorted(_stages()))
def test_every_emad_module_a_stage_runs_is_a_dependency_of_it(stage):
    """A change to any module a stage's script imports (transitively) reruns that stage under `dvc repro`."""
    script, deps = _stages()[stage]
    modules = _modules()
    root = PACKAGE.parent
    covered = [root / d for d in deps if "$" not in d]
    missing = sorted(str(modules[m].relative_to(root)) for m in _script_imports(script, modules)
                     if not any(modules[m] == c or c in modules[m].parents for c in covered))
    assert not missing, f"dvc.yaml stage {stage!r} ({script.name}) lacks deps on {missing}"
