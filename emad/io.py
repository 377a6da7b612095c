"""Atomic file output: write to a temporary file in the same folder, then rename over the target."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Atomic UTF-8 text write."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, data: Any) -> Path:
    """Atomic JSON write (indented, trailing newline)."""
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def read_json(path: str | Path, what: str, error: type[Exception]) -> Any:
    """Parse a JSON file; a missing, truncated or non-UTF-8 file raises ``error`` naming ``what`` and the path."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{what} {path} is truncated or not JSON: {err}") from None
