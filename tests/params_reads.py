"""The params keys a stage reads, derived from the code it runs (used by tests/test_stage_params.py).

Two halves, because a test cannot run a stage's work:

- **Loading, watched.** The stage script's own params-loading function (``load_params``; ``plan`` for the decode
  stages) runs on a params file while every section object that :func:`emad.params.load_section` and
  :func:`emad.params.load_decode` hand out is watched. A scalar field read is a read of its key; a list or mapping
  field is read when its contents are used (iterated, indexed, sized, tested), a mapping's entry by its own key
  (``decode.points.<name>``); ``model_dump`` reads the fields it dumps. A section's own validators run before the
  stage sees the object: their checks are not reads. A list or mapping the function returns is read in full.
- **The run, read from the code** (:mod:`tests.params_code`). A section object the loading function returns (it
  travels into the stage's work: the decode stages' ``Plan.cfg``) is read by code the test does not run: its reads
  ``cfg.<field>`` in the stage script and every project module it imports, outside the functions that ran while
  loading.

A field's key is ``<section>.<field>`` where the params file sets it; a field left at its default, or filled from
others (``decode.curves``, ``decode.screens``), has no key DVC could track. The control's decode section maps each
field to ``control.decode.<field>``, or to the ``decode.<field>`` it inherits (:data:`emad.params.CONTROL_INHERITS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pickle
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import emad.params
from emad.config import Section, read_params
from tests.params_code import run_reads

ROOT = Path(__file__).resolve().parent.parent
DUMPS = ("model_dump", "model_dump_json")
LOADED = "loading"  # where a read seen while the loading function ran happened
VALIDATE_PARAMS = emad.params.validate_params


@dataclasses.dataclass
class Node:
    """A watched section object: field → its params key (None: not in the file) and the file's raw value."""

    keys: dict[str, str | None]
    raw: dict[str, Any]


@dataclasses.dataclass
class Watch:
    """What one loading function read: params key → where (``loading``, or ``file:line in function``)."""

    reads: dict[str, str] = dataclasses.field(default_factory=dict)
    nodes: dict[int, tuple[Section, Node]] = dataclasses.field(default_factory=dict)

    def read(self, key: str | None, where: str = LOADED) -> None:
        if key:
            self.reads.setdefault(key, where)

    def watch(self, cfg: Section, node: Node) -> Section:
        self.nodes[id(cfg)] = (cfg, node)  # the object kept alive: its id stays its own
        return cfg

    def field(self, node: Node, name: str, value: Any) -> Any:
        """``value`` of field ``name`` as the stage sees it: a container that records its use, or the value (read)."""
        key = node.keys.get(name)
        if key is None:
            return value
        raw = node.raw.get(name)
        if isinstance(value, dict) and not isinstance(value, TrackedDict):
            return TrackedDict(value, key, set(raw) if isinstance(raw, dict) else set(), self)
        if isinstance(value, list) and not isinstance(value, TrackedList):
            return TrackedList(value, key, self)
        self.read(key)
        return value


class TrackedDict(dict):
    """A section's mapping field: an entry's use reads ``<key>.<entry>`` (an entry the file does not name, a
    sweep's expanded point, reads the whole field); any other use reads the whole field."""

    def __init__(self, data: dict, key: str, names: set[str], watch: Watch):
        super().__init__(data)
        self._key, self._names, self._watch = key, names, watch

    def _entry(self, name: Any) -> None:
        self._watch.read(f"{self._key}.{name}" if name in self._names else self._key)

    def _all(self) -> None:
        self._watch.read(self._key)

    def __getitem__(self, name):
        self._entry(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self._entry(name)
        return super().get(name, default)

    def __contains__(self, name) -> bool:
        self._entry(name)
        return super().__contains__(name)


class TrackedList(list):
    """A section's list field: any use of its contents reads the whole field."""

    def __init__(self, data: list, key: str, watch: Watch):
        super().__init__(data)
        self._key, self._watch = key, watch

    def _all(self) -> None:
        self._watch.read(self._key)


def _reading(name: str) -> Callable:
    def method(self, *args, **kwargs):
        self._all()
        return getattr(super(type(self), self), name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in ("__iter__", "__len__", "__eq__", "__ne__", "__repr__", "keys", "items", "values", "copy"):
    setattr(TrackedDict, _name, _reading(_name))
for _name in ("__iter__", "__len__", "__eq__", "__ne__", "__repr__", "__getitem__", "__contains__", "__reversed__",
              "__add__", "index", "count", "copy"):
    setattr(TrackedList, _name, _reading(_name))

_ACTIVE: Watch | None = None


def _getattribute(self: Section, name: str) -> Any:
    """``Section.__getattribute__`` while a loading function is watched: field reads of a watched object recorded."""
    value = object.__getattribute__(self, name)
    watch = _ACTIVE
    entry = watch.nodes.get(id(self)) if watch is not None and not name.startswith("_") else None
    if entry is None:
        return value
    node = entry[1]
    if name in type(self).model_fields:
        return watch.field(node, name, value)
    if name in DUMPS:
        return _dumping(watch, node, value)
    return value


def _dumping(watch: Watch, node: Node, dump: Callable) -> Callable:
    """``model_dump`` of a watched object: reads the keys of the fields it dumps."""

    def dumped(*args, include=None, exclude=None, **kwargs):
        for name, key in node.keys.items():
            if (include is None or name in include) and (exclude is None or name not in exclude):
                watch.read(key)
        return dump(*args, include=include, exclude=exclude, **kwargs)

    return dumped


def section_node(raw: dict, name: str) -> Node:
    """The node of section ``name`` of the params file ``raw``."""
    own = raw.get(name) or {}
    return Node({field: f"{name}.{field}" for field in own}, dict(own))


def control_node(raw: dict) -> Node:
    """The control's decode section: its own keys, then those of ``decode`` it inherits."""
    own = (raw.get("control") or {}).get("decode") or {}
    base = {k: v for k, v in (raw.get("decode") or {}).items() if k in emad.params.CONTROL_INHERITS}
    keys = {**{k: f"decode.{k}" for k in base}, **{k: f"control.decode.{k}" for k in own}}
    return Node(keys, {**base, **own})


def _watched_loaders(watch: Watch) -> dict[str, Callable]:
    """Stand-ins for ``load_section`` and ``load_decode`` that watch what they return."""
    load_section, load_decode = emad.params.load_section, emad.params.load_decode

    def watched_section(name, model, path="params.yaml", points=True):
        return watch.watch(load_section(name, model, path, points), section_node(_read_once(path), name))

    def watched_decode(path="params.yaml", control=False, context=None):
        raw = _read_once(path)
        node = control_node(raw) if control else section_node(raw, "decode")
        return watch.watch(load_decode(path, control=control, context=context), node)

    return {"load_section": watched_section, "load_decode": watched_decode}


def _stamp(path: str | Path) -> tuple[Path, int, int] | None:
    path = Path(path).resolve()
    stat = path.stat() if path.is_file() else None
    return None if stat is None else (path, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _parsed(stamp: tuple[Path, int, int]) -> bytes:
    return pickle.dumps(read_params(stamp[0]))


def _read_once(path: str | Path = "params.yaml") -> dict:
    """``read_params``, parsing each file once (the stages read it once per section they load)."""
    stamp = _stamp(path)
    return read_params(path) if stamp is None else pickle.loads(_parsed(stamp))


@functools.cache
def _validated(stamp: tuple[Path, int, int], points: bool) -> dict:
    return VALIDATE_PARAMS(stamp[0], points)


def _validate_once(path: str | Path = "params.yaml", points: bool = True) -> dict:
    """``validate_params``, checking each file once (a check, not a read: every stage checks the whole file)."""
    stamp = _stamp(path)
    return VALIDATE_PARAMS(path, points) if stamp is None else _validated(stamp, points)


@contextlib.contextmanager
def watching(stage: Any) -> Iterator[tuple[Watch, set]]:
    """While inside: the params loaders of ``emad.params`` and of the stage module watched, ``Section`` attribute
    reads recorded, and every Python function that runs collected (its code object)."""
    global _ACTIVE
    watch, ran = Watch(), set()
    with pytest.MonkeyPatch.context() as mp:
        for name, loader in _watched_loaders(watch).items():
            mp.setattr(emad.params, name, loader)
            if hasattr(stage, name):
                mp.setattr(stage, name, loader)
        mp.setattr(emad.params, "read_params", _read_once)
        mp.setattr(emad.params, "validate_params", _validate_once)
        mp.setattr(Section, "__getattribute__", _getattribute)
        previous, _ACTIVE = _ACTIVE, watch
        sys.setprofile(lambda frame, event, arg: ran.add(frame.f_code) if event == "call" else None)
        try:
            yield watch, ran
        finally:
            sys.setprofile(None)
            _ACTIVE = previous


def escaped(value: Any, watch: Watch, seen: set | None = None) -> Iterator[Section]:
    """The watched section objects reachable from ``value`` (what the loading function returns); a tracked list or
    mapping found on the way is read in full (the stage uses it later)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (TrackedDict, TrackedList)):
        watch.read(value._key)
    elif id(value) in watch.nodes:
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from escaped(getattr(value, f.name), watch, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from escaped(item, watch, seen)
    elif isinstance(value, dict):
        for item in value.values():
            yield from escaped(item, watch, seen)


def stage_reads(script: Path, loader: str, args: Any) -> dict[str, str]:
    """Params key → where it is read, for the stage whose script is ``script`` (a module ``pipeline.<name>``,
    imported), loading its params with its function ``loader(args)``."""
    module = sys.modules[f"pipeline.{script.stem}"]
    with watching(module) as (watch, ran):
        loaded = getattr(module, loader)(args)
    for cfg in list(escaped(loaded, watch)):
        run_reads(script, loader, cfg, watch.nodes[id(cfg)][1], ran, watch)
    return watch.reads
