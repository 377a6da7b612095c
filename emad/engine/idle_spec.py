"""The spec of a model with idle layers, ``<base spec>+idle<N>`` (:mod:`emad.engine.idle`), read without torch: the
params checks and the report read it where no model is loaded."""

from __future__ import annotations

import re

_SPEC = re.compile(r"^(?P<base>.+)\+idle(?P<count>[^+]*)$")


class IdleSpecError(ValueError):
    """A ``+idle<N>`` spec whose count is not a positive integer."""


def parse_idle_spec(spec: str) -> tuple[str, int] | None:
    """``(base spec, N)`` of ``<base>+idle<N>``; None for a spec without the suffix.

    Raises:
        IdleSpecError: N is not a positive integer (``+idle0``, ``+idle-3``, ``+idle2.5``, ``+idle``).
    """
    match = _SPEC.match(spec)
    if match is None:
        return None
    count = match["count"]
    if not count.isdigit() or int(count) <= 0:
        raise IdleSpecError(f"model spec {spec!r}: the idle-layer count after '+idle' must be a positive integer "
                            f"(e.g. {match['base']}+idle30); got {count!r}")
    return match["base"], int(count)
