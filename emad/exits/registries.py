"""Registries declared with their names, so that checking a name imports nothing heavy.

A params check (every stage's start) asks whether a readout exists; the classes live in modules that import torch,
imported only when a stage builds one (:class:`emad.registry.Registry`, declared form).
"""

from __future__ import annotations

from emad.registry import Registry

READOUTS: Registry = Registry("readout", home="emad.exits.readouts", names=("logit", "tuned"))
"""How a probe layer's hidden state becomes logits (:mod:`emad.exits.readouts`)."""

STRATEGIES: Registry = Registry("decoding strategy", home="emad.methods.strategies", names=("ead", "speculative"))
"""Strategies beyond a per-token exit (:mod:`emad.methods.strategies`): the verdict asks whether a family is one
(a strategy saves sequential passes, not FLOPs) without importing torch."""
