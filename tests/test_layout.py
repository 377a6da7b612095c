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
