"""The base of every params section's typed model, and reading the params file.

Each section's model lives beside the code that reads it and is the one place its defaults live;
:mod:`emad.params` assembles them. Unknown keys, wrong types and out-of-range values
fail before any work, with the full parameter path (``decode.methods.emad.margins[2]``), the value given and what
is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

S = TypeVar("S", bound="Section")


class ConfigError(ValueError):
    """A params.yaml value is missing, unknown, of the wrong type or out of range."""


class Section(BaseModel):
    """Base of every params section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _path(prefix: str, loc: tuple) -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def validate_section(name: str, raw: Any, model: type[S], context: dict | None = None) -> S:
    """Validate ``raw`` (the section's dict) as ``model`` (``context``: pydantic's validation context); errors name
    ``name.key[i]``, the value and the rule."""
    try:
        return model.model_validate({} if raw is None else raw, context=context)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            where = _path(name, tuple(p for p in e["loc"] if not str(p).startswith("function-")))
            whole = not e["loc"] and isinstance(e.get("input"), dict)  # a section-wide rule: its message says it
            given = "" if e["type"] == "missing" or whole else f" (got {e.get('input')!r})"
            lines.append(f"{where}: {e['msg']}{given}")
        raise ConfigError("invalid params: " + "; ".join(lines)) from None


def read_params(path: str | Path = "params.yaml") -> dict:
    """The whole params file as a dict; a clear error when it is missing or not YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"params file {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"params file {path} must hold a mapping of sections")
    return data
