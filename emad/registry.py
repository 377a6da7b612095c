"""A tiny name → class registry that rejects duplicates and lists valid names on error."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to classes (criteria, policies, estimators, tasks ...).

    A registry may be *declared*: its names are given where it is made and its entries live in ``home``, a module
    imported on the first :meth:`get` of a name not yet registered. Checking a name (``in``, :meth:`names`) then
    imports nothing: a params check lists the readouts without importing torch.

    Args:
        kind: what is registered, used in error messages (e.g. ``"exit criterion"``).
        home: the module whose import registers the declared names (with ``names``).
        names: the declared names; ``home`` may register only these.
    """

    def __init__(self, kind: str, home: str | None = None, names: Iterable[str] = ()):
        self.kind = kind
        self._entries: dict[str, type[T]] = {}
        self._home = home
        self._declared = tuple(names)
        if bool(home) != bool(self._declared):
            raise ValueError(f"{kind} registry: a declared registry gives both its home module and its names")

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator registering ``cls`` under ``name``; a second registration of a name is an error."""

        def decorate(cls: type[T]) -> type[T]:
            self.add(name, cls)
            cls.name = name
            return cls

        return decorate

    def add(self, name: str, entry) -> None:
        """Registers ``entry`` (a class, or a value such as a metric's description) under a new ``name``."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if self._declared and name not in self._declared:
            raise ValueError(f"{self.kind} {name!r} is not declared; declared: {', '.join(self._declared)} (add it "
                             f"to the names the registry is made with)")
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        """Forgets ``name`` (a test's temporary entry); raises ``KeyError`` listing the valid names."""
        self.get(name)
        del self._entries[name]

    def values(self) -> list:
        """Registered entries in the order they were registered (a declared registry's home imported first)."""
        if self._declared and len(self._entries) < len(self._declared):
            importlib.import_module(self._home)
        return list(self._entries.values())

    def get(self, name: str) -> type[T]:
        """The class registered as ``name`` (a declared name: after importing its home); raises ``KeyError``
        listing the valid names."""
        if name not in self._entries and name in self._declared:
            importlib.import_module(self._home)
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Registered (and declared) names, sorted."""
        return sorted({*self._entries, *self._declared})

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._declared
