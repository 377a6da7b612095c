"""``python -m emad.lm_eval``: lm-eval's command line with the ``emad`` model and the ``emad_*`` tasks.

It takes lm-eval's arguments (``run`` is implied, as with ``lm-eval``) with these differences: the ``emad`` model
is registered and is the default ``--model``; the embedded tasks (``emad_gsm8k``, ``emad_stdlib_lastword``,
``emad_stdlib_prose``, tag ``emad``) are on the include path beside any ``--include_path`` given; ``--device``
defaults to ``cuda:0`` where CUDA is available and ``cpu`` elsewhere (lm-eval's own default is ``cuda:0``).

    python -m emad.lm_eval --model_args model=smollm2-135m method=emad margin=0.2 \\
        profile=data/profiles/smollm2-135m/stdlib-prose/profile.json \\
        --tasks emad_stdlib_lastword,emad_gsm8k --limit 20 --output_path reports/lm_eval

At ``method=full`` the ``emad`` model reproduces ``--model hf`` on the same task; ``rolling_window=N`` (and
``rolling_prefix``) switches rolling log-likelihood to EMAD's perplexity windows (see :mod:`emad.lm_eval.model`).
``--help`` lists the model's model_args.

From Python: importing this module registers the model; :func:`task_manager` gives ``lm_eval.simple_evaluate``
a task manager that knows the tasks.
"""

from __future__ import annotations

import logging
import os
import sys
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from emad.lm_eval.model import ModelArgsError  # importing it registers the model "emad"

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
PROG = "python -m emad.lm_eval"
MODEL_HELP = """\
the emad model (the default --model; lm-eval's own models work too):
  --model_args model=<embedded alias | folder | hub id>,method=<full | emad | fixed | confidence | ...>
      [,profile=<profile.json>,margin=...,policy=...,estimator=...,readout=logit|tuned,readouts=<file>]
  At method=full it reproduces --model hf on the same task: the tokenizer's own BOS handling
  (add_bos_token=True|False forces it), max_length from the model's config (max_length=N), rolling
  log-likelihood over max_length-token windows, lm-eval's generation options.
  rolling_window=N[,rolling_prefix=P]: EMAD perplexity windows instead: N tokens each, the first P
  (default N // 4) context prefilled at full depth, as the pipeline's perplexity task (window/prefix);
  their scores are not comparable with --model hf.
  Also: device, dtype, batch_size (generation rows per batch), seed (sampling), estimators, and the
  strategies' options (method=ead,small_layers=..,tau=..; method=speculative,exit_layer=..).

"""


def default_device() -> str:
    """``cuda:0`` where CUDA is available, else ``cpu``."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def include_paths(user: str | Sequence[str] | None = None) -> list[str]:
    """The emad task folder, then a user's include paths (a list, or one string separated by ``os.pathsep``)."""
    given = user.split(os.pathsep) if isinstance(user, str) else list(user or [])
    return [str(TASKS_DIR), *(str(p) for p in given if p)]


def task_manager(metadata: dict[str, Any] | None = None, include_defaults: bool = True):
    """An lm-eval ``TaskManager`` that knows the ``emad_*`` tasks.

    Args:
        metadata: passed to every task (the ``emad_*`` datasets read ``n_docs`` from it).
        include_defaults: also index lm-eval's own tasks (about 10 s); False indexes only the emad tasks.
    """
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_paths(), include_defaults=include_defaults, metadata=metadata)


def apply_defaults(args: Namespace) -> Namespace:
    """Our defaults on parsed lm-eval arguments: model, device and include path, where the subcommand takes
    them and neither the command line nor its ``--config`` file gives them (our task folder is always added)."""
    given = _config_file(getattr(args, "config", None))
    if hasattr(args, "include_path"):
        args.include_path = include_paths(args.include_path or given.get("include_path"))
    if hasattr(args, "device") and not args.device and not given.get("device"):
        args.device = default_device()
    if hasattr(args, "model") and not args.model and not given.get("model"):
        args.model = "emad"
    return args


def _config_file(path: str | None) -> dict:
    """The settings of lm-eval's ``--config`` YAML (lm-eval itself reports a missing or bad file)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) if path else {}
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _share_lm_eval_logging() -> None:
    """Show our log lines (costs per request type) through lm-eval's handler."""
    ours, theirs = logging.getLogger("emad"), logging.getLogger("lm_eval")
    ours.setLevel(theirs.level)
    for handler in theirs.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)


def _describe_model(cli) -> None:
    """Our program name, and the emad model's model_args at the head of the help of lm-eval's CLI and ``run``."""
    parsers = [getattr(cli, "_parser", None), *getattr(getattr(cli, "_subparsers", None), "choices", {}).values()]
    for parser in parsers:
        if parser is not None:
            parser.prog = parser.prog.replace("lm-eval", PROG, 1)
            parser.usage = parser.usage and parser.usage.replace("lm-eval", PROG, 1)
            if parser.prog in (PROG, f"{PROG} run"):
                parser.epilog = MODEL_HELP + (parser.epilog or "")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse lm-eval arguments, apply our defaults and run lm-eval; returns the exit status."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    _share_lm_eval_logging()
    cli = HarnessCLI()
    _describe_model(cli)
    saved, sys.argv = sys.argv, [PROG, *(sys.argv[1:] if argv is None else argv)]
    try:
        args = cli.parse_args()  # reads sys.argv (it inserts the implied "run")
    finally:
        sys.argv = saved
    try:
        cli.execute(apply_defaults(args))
    except ModelArgsError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0

