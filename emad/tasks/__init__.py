"""Evaluation tasks, one small module each, registered by name."""

from emad.tasks.cloze import cloze
from emad.tasks.fidelity import fidelity
from emad.tasks.gsm8k import gsm8k
from emad.tasks.humaneval import humaneval
from emad.tasks.multiple_choice import multiple_choice
from emad.tasks.perplexity import perplexity

__all__ = ["cloze", "fidelity", "gsm8k", "humaneval", "multiple_choice", "perplexity"]
