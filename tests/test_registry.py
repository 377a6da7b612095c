"""Registries: names checked without importing the classes (declared registries), duplicates and strangers refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from emad.registry import Registry
from tests.params_reads import ROOT


def test_a_declared_registry_lists_its_names_and_imports_its_home_on_first_get():
    registry = Registry("widget", home="json", names=("a", "b"))  # json: any module, here a stand-in home
    assert registry.names() == ["a", "b"] and "a" in registry and "c" not in registry
    registry.add("a", 1)
    assert registry.get("a") == 1
    with pytest.raises(KeyError, match="unknown widget 'b'; valid: a, b"):  # declared, never registered by its home
        registry.get("b")
    with pytest.raises(ValueError, match="widget 'c' is not declared; declared: a, b"):
        registry.add("c", 3)
    with pytest.raises(ValueError, match="gives both its home module and its names"):
        Registry("widget", home="json")


def test_the_readouts_are_declared_as_their_module_registers_them():
    """The declared names are the registered ones, and checking a name imports no torch."""
    code = ("import sys; from emad.exits.registries import READOUTS; names = READOUTS.names(); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'tuned' in READOUTS and 'torch' not in sys.modules; "
            "cls = READOUTS.get('tuned'); assert 'torch' in sys.modules; "
            "import emad.exits.readouts as home; "
            "assert sorted(READOUTS._entries) == names, (sorted(READOUTS._entries), names); "
            "assert cls is home.TunedLens and home.READOUTS is READOUTS")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
