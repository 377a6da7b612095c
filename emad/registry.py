"""A tiny name → class registry that rejects duplicates and lists valid names on error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to classes (criteria, policies, estimators, tasks ...).

    Args:
        kind: what is registered, used in error messages (e.g. ``"exit criterion"``).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, type[T]] = {}

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
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        """Forgets ``name`` (a test's temporary entry); raises ``KeyError`` listing the valid names."""
        self.get(name)
        del self._entries[name]

    def values(self) -> list:
        """Registered entries in the order they were registered."""
        return list(self._entries.values())

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``; raises ``KeyError`` listing the valid names."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
