"""How every pipeline stage script ends: one exit code per outcome, one line on stderr for an error a user can fix.

Kept free of heavy imports: ``sample_corpus`` sets the offline switches before the hub libraries load.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

USER_ERRORS = (ValueError, KeyError, OSError)
"""A bad params value (``ConfigError`` and pydantic's ``ValidationError`` are ValueErrors), an unknown registered
name (``Registry.get`` raises KeyError), a missing or damaged input (``OSError``, or the library's ValueErrors)."""

EXIT_ERROR = 2  # as argparse exits on a bad argument
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a process ended by Ctrl-C


def run_stage(name: str, main: Callable[[], int | None]) -> NoReturn:
    """Runs a stage's ``main()`` and exits the process with its outcome.

    - first, the tracking store ``MLFLOW_TRACKING_URI`` names must answer (:func:`emad.tracking.require_store`);
      a store that does not is a user error, before any work. Freed large tensors go back to the operating system
      (:func:`emad.engine.host_memory.return_large_frees`).
    - ``main`` returns: exit with its return value (``None`` is 0).
    - a user error (:data:`USER_ERRORS`): ``<name>: error: <message>`` on stderr, exit 2.
    - SIGINT (KeyboardInterrupt): ``<name>: interrupted`` on stderr, exit 130.
    - SystemExit passes through: argparse's usage errors (2), SIGTERM under ``tracking.stage_run`` (143).

    Args:
        name: the stage, as dvc.yaml names it.
        main: the stage's entry point; it reads ``sys.argv``.
    """
    from emad.engine.host_memory import return_large_frees  # the standard library only
    from emad.tracking import require_store  # no mlflow import: the standard library only

    return_large_frees()
    try:
        require_store()
        code = main()
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except USER_ERRORS as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err  # KeyError's str() quotes it
        print(f"{name}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    sys.exit(0 if code is None else code)


READOUT = "{readout}"  # the placeholder of a per-readout path template


def per_readout(template: str | Path, readouts: list[str], flag: str) -> dict[str, Path]:
    """One path per readout from ``template`` (``data/stats/m/s/{readout}.json``): a stage that handles every
    readout of a list in one process (model loaded and store opened once) writes each where its placeholder says.

    Raises:
        ValueError: several readouts and no ``{readout}`` in ``template`` (naming ``flag``).
    """
    text = str(template)
    if READOUT not in text and len(readouts) > 1:
        raise ValueError(f"{flag} {text}: {len(readouts)} readouts ({', '.join(readouts)}) need a {READOUT} "
                         f"placeholder in the path, e.g. {flag} out/{READOUT}.json")
    return {readout: Path(text.replace(READOUT, readout)) for readout in readouts}


def checkpoint_beside(out: Path) -> Path:
    """Where a stage keeps resumable progress for ``out``: beside its folder, which DVC removes (with the
    outputs in it) before it reruns the stage."""
    return out.parent.parent / f"{out.parent.name}.{out.name}.ckpt"
