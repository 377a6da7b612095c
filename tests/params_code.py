"""The second half of :mod:`tests.params_reads`: what a stage's work reads of a section object that its loading
function hands on, read from the code (the stage script and every project module it imports) rather than run.

Each read ``cfg.<field>`` / ``<...>.cfg.<field>`` (or ``getattr(cfg, "<field>")``; ``cfg`` is the project's name for
a section object) in a function that did not run while loading, and that the stage's ``main`` reaches otherwise than
through the loading function, is a read of that field; a call ``cfg.<method>()`` reads what the method reads of
``self``, unless the loading ran that method.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from emad.config import Section

ROOT = Path(__file__).resolve().parent.parent

@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


@functools.cache
def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


# `from emad.x import a, b` / `from pipeline.x import (a, b)` / `import emad.x`, at the top or inside a function
IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+((?:emad|pipeline)[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)"
                    r"|import[ \t]+((?:emad|pipeline)[\w.]*))", re.M)


@functools.cache
def _imports(path: Path) -> frozenset[Path]:
    """The project modules (``emad``, ``pipeline``) that ``path`` imports, at the top or inside a function."""
    out = set()
    for module, names, plain in IMPORT.findall(path.read_text(encoding="utf-8")):
        names = re.sub(r"#[^\n]*", "", names).strip("() \n")
        full = [plain] if plain else [module, *(f"{module}.{n.split()[0]}" for n in names.split(",") if n.strip())]
        for name in full:
            parts = name.split(".")
            out |= {f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i])))}
    return frozenset(out)


@functools.cache
def closure(script: Path) -> tuple[Path, ...]:
    """``script`` and every project module it imports, directly or not."""
    todo, seen = [script], {script}
    while todo:
        for path in _imports(todo.pop()) - seen:
            seen.add(path)
            todo.append(path)
    return tuple(sorted(seen))


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``function``'s body, not those of the functions defined inside it."""
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(node))


def _attribute_reads(function: ast.AST, receiver: Callable[[ast.AST], bool]) -> Iterator[tuple[str, int]]:
    """(attribute, line) of every ``<receiver>.<attribute>`` and ``getattr(<receiver>, "<attribute>")``."""
    for node in _own_nodes(function):
        if isinstance(node, ast.Attribute) and receiver(node.value):
            yield node.attr, node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and receiver(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            yield node.args[1].value, node.lineno


def _is_cfg(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "cfg") or (isinstance(node, ast.Attribute) and node.attr == "cfg")


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


@functools.cache
def cfg_reads(path: Path) -> tuple[tuple[str, int, str, int], ...]:
    """(attribute, line, function, its first line) of every read of a ``cfg`` in the functions of ``path``."""
    out = []
    if "cfg" not in path.read_text(encoding="utf-8"):
        return ()
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [(attr, line, node.name, _first_line(node)) for attr, line in _attribute_reads(node, _is_cfg)]
    return tuple(out)


def _method(cls: type, name: str) -> Callable | None:
    """The function behind method (or property) ``name`` of section class ``cls``, if the project defines it."""
    for klass in cls.__mro__:
        if klass is Section:
            return None
        found = klass.__dict__.get(name)
        if found is not None:
            found = getattr(found, "fget", None) or getattr(found, "__func__", found)
            return found if inspect.isfunction(found) else None
    return None


def method_reads(cls: type, name: str, ran: set, seen: set | None = None) -> set[str]:
    """The fields of ``cls`` that method ``name`` reads of ``self``, through the methods it calls that the loading
    did not run."""
    seen = set() if seen is None else seen
    function = _method(cls, name)
    if function is None or function.__code__ in ran or name in seen:
        return set()
    seen.add(name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    out = set()
    for attr, _ in _attribute_reads(tree.body[0], _is_self):
        out |= {attr} if attr in cls.model_fields else method_reads(cls, attr, ran, seen)
    return out


@functools.cache
def loading_only(script: Path, loader: str) -> frozenset[tuple[str, int, str]]:
    """The functions of the stage script that run only inside its loading function ``loader``: those ``main``
    reaches, by the names the script's definitions use, only through ``loader``."""
    defs = {node.name: node for node in _tree(script).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    uses = {name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & set(defs) for name, node in defs.items()}
    reached, todo = {"main"}, ["main"]
    while todo:
        for name in uses.get(todo.pop(), set()) - reached - {loader}:
            reached.add(name)
            todo.append(name)
    return frozenset((str(script), _first_line(f), f.name) for name in set(defs) - reached
                     for f in ast.walk(defs[name]) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))


def run_reads(script: Path, loader: str, cfg: Section, node: Any, ran: set, watch: Any) -> None:
    """Records what the stage's code reads of the escaped section object ``cfg`` outside the loading function."""
    cls, done = type(cfg), {(str(Path(c.co_filename).resolve()), c.co_firstlineno, c.co_name) for c in ran}
    done |= loading_only(script, loader)
    for path in closure(script):
        for attr, line, function, first in cfg_reads(path):
            if (str(path), first, function) in done:
                continue  # ran while loading (its reads were seen), or runs only there
            where = f"{path.relative_to(ROOT)}:{line} in {function}"
            fields = {attr} if attr in cls.model_fields else method_reads(cls, attr, ran)
            for name in sorted(fields):
                watch.read(node.keys.get(name), where)
