"""Evaluation tasks, one small module each, registered by name."""

from emad.tasks.fidelity import fidelity
from emad.tasks.perplexity import perplexity

__all__ = ["fidelity", "perplexity"]
