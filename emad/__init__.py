"""EMAD: entropy-guided adaptive-depth decoding of LLMs."""

__version__ = "0.1.0"
