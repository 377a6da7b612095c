"""Evaluation tasks as functions, one module each, usable without the registry: ``perplexity``, ``agreement``,
``fidelity``, ``cloze``, ``multiple_choice`` (which also scores the ``choice`` task's items), ``gsm8k`` and
``humaneval``. :mod:`emad.tasks.registry` registers each by name in ``TASKS``, with its settings and data loading,
for the decode stage."""

from emad.tasks.agreement import agreement
from emad.tasks.cloze import cloze
from emad.tasks.fidelity import fidelity
from emad.tasks.gsm8k import gsm8k
from emad.tasks.humaneval import humaneval
from emad.tasks.multiple_choice import multiple_choice
from emad.tasks.perplexity import perplexity

__all__ = ["agreement", "cloze", "fidelity", "gsm8k", "humaneval", "multiple_choice", "perplexity"]
