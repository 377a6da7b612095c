"""The README and docs/ stay honest: the README is short and links every document; every relative link, `make`
target, `dvc` command (subcommand and flags), `emad` / `python -m emad...` command (subcommand and flags) and
script path they name exists. Fast (a few seconds): `dvc <sub> --help` runs once per subcommand, in parallel."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FILES = [README, *DOCS]
MAX_README_LINES = 250
# Links under these folders point at pipeline outputs that may not exist yet (the overview figure is written by
# `aggregate`): only their folder has to.
OUTPUT_DIRS = ("reports",)

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"|", "||", "&", "&&", ";", ";;"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return FENCE.sub("", text)


def _shell_snippets(text: str) -> list[str]:
    """Command lines: each logical line of the shell code blocks (backslash continuations joined, comments
    dropped) and each inline code span of the prose."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang.strip().lower() in SHELL_LANGS:
            out += body.replace("\\\n", " ").splitlines()
    out += [span.replace("\n", " ") for span in INLINE.findall(_prose(text))]
    return [s for s in out if s.strip()]


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars="|&;")
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote in prose-like code: split on blanks
        return line.split()


def _commands(text: str) -> list[list[str]]:
    """Every simple command of the shell snippets, as tokens, with leading `VAR=value` assignments removed."""
    out = []
    for line in _shell_snippets(text):
        cmd: list[str] = []
        for tok in [*_tokens(line), ";"]:
            if tok in SEPARATORS:
                while cmd and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    return out


def _all_commands() -> list[tuple[str, list[str]]]:
    return [(_rel(f), cmd) for f in FILES for cmd in _commands(_text(f))]


def _flags(args: list[str]) -> list[str]:
    flags = []
    for a in args:
        if a == "--":
            break
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", a):
            flags.append(a.split("=", 1)[0])
    return flags


def _is_exe(tok: str, name: str) -> bool:
    return tok == name or tok.endswith("/" + name)


# --- the README's shape ---------------------------------------------------------------------------------------


def test_readme_is_short():
    n = len(_text(README).splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}); move detail to docs/"


def test_readme_links_every_document():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in LINK.findall(_prose(_text(README)))}
    missing = [_rel(d) for d in DOCS if d.resolve() not in linked]
    assert DOCS and not missing, f"docs not linked from README.md: {missing}"


# --- links -----------------------------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(_text(path)).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def test_relative_links_resolve():
    bad = []
    for f in FILES:
        for target in LINK.findall(_prose(_text(f))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (f.parent / path_part).resolve() if path_part else f
            try:
                rel = dest.relative_to(ROOT)
            except ValueError:
                bad.append(f"{_rel(f)}: {target} (outside the repository)")
                continue
            if not dest.exists():
                if rel.parts and rel.parts[0] in OUTPUT_DIRS and dest.parent.is_dir():
                    continue
                bad.append(f"{_rel(f)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{_rel(f)}: {target} (no heading #{anchor} in {rel})")
    assert not bad, "broken links:\n" + "\n".join(bad)


# --- make ------------------------------------------------------------------------------------------------------


def _make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\- ]+?)\s*::?(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets


def test_make_targets_exist():
    targets = _make_targets()
    named = set()
    for where, cmd in _all_commands():
        if _is_exe(cmd[0], "make"):
            named |= {(where, t) for t in cmd[1:] if not t.startswith("-") and "=" not in t}
    assert named, "no `make <target>` found in the docs"
    unknown = sorted(f"{where}: make {t}" for where, t in named if t not in targets)
    assert not unknown, f"make targets missing from the Makefile ({sorted(targets)}):\n" + "\n".join(unknown)


# --- dvc -------------------------------------------------------------------------------------------------------


def _dvc_exe() -> str | None:
    here = Path(sys.executable).parent / "dvc"
    return str(here) if here.exists() else shutil.which("dvc")


@functools.cache
def _dvc_help(words: tuple[str, ...]) -> str | None:
    """`dvc <words> --help`, or None when DVC refuses the words."""
    res = subprocess.run([_dvc_exe(), *words, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    return res.stdout if res.returncode == 0 else None


def _dvc_group_choices(help_text: str) -> list[str]:
    usage = help_text.split("\n\n", 1)[0]
    m = re.search(r"\{([\w,-]+)\}", usage)
    return m.group(1).split(",") if m else []


def _dvc_uses() -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(where, subcommand words, the rest of the command) for every dvc command named."""
    uses = []
    for where, cmd in _all_commands():
        if not _is_exe(cmd[0], "dvc") or len(cmd) < 2 or cmd[1].startswith("-"):
            continue
        uses.append((where, cmd[1], cmd[2:]))
    return uses


@pytest.mark.skipif(_dvc_exe() is None, reason="dvc is not installed")
def test_dvc_commands_and_flags_exist():
    uses = _dvc_uses()
    assert uses, "no dvc command found in the docs"
    with ThreadPoolExecutor(8) as pool:  # warm the cache: one --help per subcommand, in parallel
        list(pool.map(_dvc_help, {(sub,) for _, sub, _ in uses}))
    resolved = []
    bad = []
    for where, sub, rest in uses:
        top = _dvc_help((sub,))
        if top is None:
            bad.append(f"{where}: dvc {sub} (no such subcommand)")
            continue
        words = (sub,)
        choices = _dvc_group_choices(top)
        if choices:
            if not rest or rest[0] not in choices:
                bad.append(f"{where}: dvc {sub} {' '.join(rest[:1])} (expected one of {choices})")
                continue
            words, rest = (sub, rest[0]), rest[1:]
        resolved.append((where, words, rest))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(_dvc_help, {w for _, w, _ in resolved}))
    for where, words, rest in resolved:
        text = _dvc_help(words)
        if text is None:
            bad.append(f"{where}: dvc {' '.join(words)} (refused by DVC)")
            continue
        for flag in _flags(rest):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                bad.append(f"{where}: dvc {' '.join(words)} {flag} (not an option)")
    assert not bad, "dvc commands the installed DVC does not accept:\n" + "\n".join(bad)


# --- emad ------------------------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _emad_uses() -> list[tuple[str, str | None, list[str]]]:
    """(where, module, arguments) of every `emad ...` (module None: the console script, emad.cli) and
    `python -m emad...` command."""
    uses = []
    for where, cmd in _all_commands():
        if _is_exe(cmd[0], "emad") and len(cmd) > 1:  # a bare `emad` is the package's or the family's name
            uses.append((where, None, cmd[1:]))
        elif re.fullmatch(r"(.*/)?python[0-9.]*", cmd[0]) and len(cmd) > 2 and cmd[1] == "-m" \
                and re.fullmatch(r"emad(\.\w+)*", cmd[2]):
            uses.append((where, cmd[2], cmd[3:]))
    return uses


def _runnable(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    return spec.submodule_search_locations is None or importlib.util.find_spec(module + ".__main__") is not None


def test_emad_commands_exist():
    from emad.cli import build_parser

    uses = _emad_uses()
    assert uses, "no emad command found in the docs"
    bad = []
    for where, module, args in uses:
        if module is not None:
            if not _runnable(module):
                bad.append(f"{where}: python -m {module} (no such runnable module; the CLI is the `emad` script)")
                continue
            if module != "emad":  # another program (e.g. emad.lm_eval wraps lm-eval's own CLI)
                continue
        shown = " ".join(["emad", *args[:2]])
        parser = build_parser()
        while (subs := _subparsers(parser)):
            if not args or args[0] not in subs:
                bad.append(f"{where}: {shown} (subcommands: {sorted(subs)})")
                break
            parser, args = subs[args[0]], args[1:]
        else:
            unknown = [f for f in _flags(args) if f not in _options(parser)]
            if unknown:
                bad.append(f"{where}: {shown}: unknown options {unknown}")
    assert not bad, "emad commands that do not exist:\n" + "\n".join(bad)


# --- paths -----------------------------------------------------------------------------------------------------


SCRIPT = re.compile(r"(?<![\w./-])((?:pipeline|benchmarks|tools|tests|emad)/[\w./-]*?\.py)\b")


def test_named_scripts_exist():
    missing = sorted({f"{_rel(f)}: {p}" for f in FILES for p in SCRIPT.findall(_text(f)) if not (ROOT / p).is_file()})
    assert not missing, "scripts named in the docs that do not exist:\n" + "\n".join(missing)


# --- the module map ------------------------------------------------------------------------------------------------

LAYOUT = ROOT / "docs" / "layout.md"
MODULE = re.compile(r"`emad/([\w/]+\.py)`")


def test_layout_names_every_module_of_the_library():
    """docs/layout.md names each module of emad/ as `emad/<folder>/<module>.py` (package __init__ files aside), and
    every module it names exists."""
    modules = {str(p.relative_to(ROOT / "emad")) for p in (ROOT / "emad").rglob("*.py") if p.name != "__init__.py"}
    named = set(MODULE.findall(_text(LAYOUT)))
    assert not modules - named, "modules not in docs/layout.md:\n" + "\n".join(sorted(modules - named))
    assert not named - modules, "docs/layout.md names modules that do not exist:\n" + "\n".join(sorted(named - modules))
