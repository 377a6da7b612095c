"""Python standard library sources: ``stdlib-prose`` (docstrings as English prose) and ``stdlib-code``.

Both walk the running Python's stdlib folder in sorted order, skipping tests, IDLE, lib2to3 and installed
packages; a document is one module, its id the module's path relative to the stdlib folder.
"""

from __future__ import annotations

import ast
import gc
import os
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from emad.corpus.sources import SOURCES, Document, Source, decode_utf8

STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
)


def stdlib_files(root: str | Path | None = None) -> Iterator[tuple[str, Path]]:
    """Yields (posix relative path, path) of the .py files under the stdlib, sorted, skipping tests and tools.

    Also skips ``_sysconfigdata*.py``: generated per machine (build paths), so not the same text everywhere.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_SKIP_DIRS)
        for file in sorted(files):
            if file.endswith(".py") and not file.startswith("_sysconfigdata"):
                path = Path(folder) / file
                yield path.relative_to(base).as_posix(), path


class _StdlibSource(Source):
    def __init__(self, root: str | None = None) -> None:
        super().__init__()
        self.root = root

    def info(self) -> dict[str, Any]:
        return {"python": platform.python_version()} if self.root is None else {"root": str(self.root)}

    def _texts(self) -> Iterator[tuple[str, str]]:
        for rel, path in stdlib_files(self.root):
            text = decode_utf8(path.read_bytes())
            if text is None:
                self.skipped[rel] = "not UTF-8"
            else:
                yield rel, text


@SOURCES.register("stdlib-prose")
class StdlibProse(_StdlibSource):
    """English technical prose: per stdlib module, its docstrings (module, classes, functions), in order.

    Args:
        root: folder to walk instead of the running Python's standard library.
        min_chars: modules with fewer characters of docstrings are left out.
    """

    def __init__(self, root: str | None = None, min_chars: int = 200) -> None:
        super().__init__(root)
        self.min_chars = min_chars

    def documents(self) -> Iterator[Document]:
        for rel, text in self._texts():
            prose = module_prose(text, rel)
            if prose is None:
                self.skipped[rel] = "not parsable"
            elif len(prose) >= self.min_chars:
                yield Document(rel, prose)


def module_prose(text: str, filename: str = "<unknown>") -> str | None:
    """The docstrings of module source `text` joined by blank lines, or None when it does not parse."""
    enabled = gc.isenabled()
    gc.disable()  # an AST has no cycles; with a large heap (torch loaded) gen-2 passes would double the time
    try:
        return "\n\n".join(docstrings(ast.parse(text, filename=filename)))
    except (SyntaxError, ValueError):
        return None
    finally:
        if enabled:
            gc.enable()


def docstrings(tree: ast.AST) -> list[str]:
    """The cleaned (`inspect.cleandoc`) docstrings of a module, its classes and functions, in source order."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                found.append(doc.strip())
        for child in ast.iter_child_nodes(node):  # defs live only in statements: skip expressions
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                visit(child)

    visit(tree)
    return found


@SOURCES.register("stdlib-code")
class StdlibCode(_StdlibSource):
    """Python code: one document per stdlib source file.

    Args:
        root: folder to walk instead of the running Python's standard library.
        min_chars: shorter files (mostly package stubs) are left out.
        max_bytes: larger files (generated tables) are left out.
    """

    def __init__(self, root: str | None = None, min_chars: int = 500, max_bytes: int = 200_000) -> None:
        super().__init__(root)
        self.min_chars, self.max_bytes = min_chars, max_bytes

    def documents(self) -> Iterator[Document]:
        for rel, text in self._texts():
            if len(text) >= self.min_chars and len(text.encode()) <= self.max_bytes:
                yield Document(rel, text)
