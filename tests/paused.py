"""Runs a pipeline script with one of its functions made to pause, so a test kills the stage at a known point.

``python -m tests.paused READY MODULE:ATTR N SCRIPT [ARGS...]`` runs ``SCRIPT ARGS...`` as ``__main__``; the N-th
call of ``MODULE.ATTR`` (``ATTR`` may be ``Class.method``) does its work, then creates the file ``READY`` and sleeps
until a signal ends the process. A test that waits for ``READY`` before it signals cannot race the stage's end.
"""

from __future__ import annotations

import functools
import importlib
import runpy
import sys
import time
from pathlib import Path


def paused_command(cmd: list[str], target: str, ready: Path, nth: int = 1) -> list[str]:
    """``cmd`` (``[python, script, args...]``) run through this module: the ``nth`` call of ``target`` pauses."""
    return [cmd[0], "-m", "tests.paused", str(ready), target, str(nth), *cmd[1:]]


def pause_at(target: str, nth: int, ready: Path) -> None:
    """Wrap ``MODULE:ATTR`` in place: its ``nth`` call creates ``ready`` and then sleeps (signals interrupt it)."""
    module, attr = target.split(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    real, calls = getattr(owner, name), [0]

    @functools.wraps(real)
    def paused(*args, **kwargs):
        result = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == nth:
            ready.touch()
            time.sleep(3600)
        return result

    setattr(owner, name, paused)


if __name__ == "__main__":
    ready, target, nth, script, *args = sys.argv[1:]
    pause_at(target, int(nth), Path(ready))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
