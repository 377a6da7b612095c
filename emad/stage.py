"""How every pipeline stage script ends: one exit code per outcome, one line on stderr for an error a user can fix.

Kept free of heavy imports: ``sample_corpus`` sets the offline switches before the hub libraries load.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import NoReturn

USER_ERRORS = (ValueError, KeyError, OSError)
"""A bad params value (``ConfigError`` and pydantic's ``ValidationError`` are ValueErrors), an unknown registered
name (``Registry.get`` raises KeyError), a missing or damaged input (``OSError``, or the library's ValueErrors)."""

EXIT_ERROR = 2  # as argparse exits on a bad argument
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a process ended by Ctrl-C


def run_stage(name: str, main: Callable[[], int | None]) -> NoReturn:
    """Runs a stage's ``main()`` and exits the process with its outcome.

    - first, the tracking store ``MLFLOW_TRACKING_URI`` names must answer (:func:`emad.tracking.require_store`);
      a store that does not is a user error, before any work.
    - ``main`` returns: exit with its return value (``None`` is 0).
    - a user error (:data:`USER_ERRORS`): ``<name>: error: <message>`` on stderr, exit 2.
    - SIGINT (KeyboardInterrupt): ``<name>: interrupted`` on stderr, exit 130.
    - SystemExit passes through: argparse's usage errors (2), SIGTERM under ``tracking.stage_run`` (143).

    Args:
        name: the stage, as dvc.yaml names it.
        main: the stage's entry point; it reads ``sys.argv``.
    """
    from emad.tracking import require_store  # no mlflow import: the standard library only

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
