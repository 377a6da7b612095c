"""A model's fingerprint: what profiles, statistics and run files record to say which model they belong to.

Without torch or transformers: a stage that only reads those files (``smooth``) names the model by it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies a model for profiles and runs: equal fingerprints mean interchangeable models."""

    spec: str
    model_type: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_sha256: str

    def as_dict(self) -> dict[str, Any]:
        """Returns the fields as a plain dict (JSON-ready)."""
        return asdict(self)

    @property
    def digest(self) -> str:
        """Returns 16 hex characters of the sha256 of the sorted JSON of the fields."""
        blob = json.dumps(self.as_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def tokenizer_sha256(tokenizer: Any) -> str:
    """Returns the sha256 of a tokenizer's vocabulary and special tokens (stable across save/load)."""
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    blob = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "special": special}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
