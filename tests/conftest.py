"""Shared fixtures. Tests run offline; the embedded SmolLM2 is converted once per machine (~20 s) and cached
under $EMAD_CACHE_DIR (default ~/.cache/emad), so later runs load it in well under a second."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub, which reads these once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `make test`'s workers (one per core): one thread each, also
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"  # for the processes its tests start

import pytest  # noqa: E402

from emad.engine.models import LoadedModel, load_model  # noqa: E402


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct on CPU in float32 (tests that use it are marked slow)."""
    return load_model("smollm2-135m", device="cpu", dtype="float32")
