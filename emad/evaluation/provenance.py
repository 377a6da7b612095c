"""Where and how a work unit was computed, and the rule for merging units.

A unit's numbers depend on where it ran: ``device`` and ``dtype`` ``auto`` resolve per node, the GPU model and the
torch and transformers versions change kernels, the code revision changes the method, and the torch thread count
changes the order of reductions. Each unit records :func:`provenance` beside its results (run files, MLflow tags);
the stage's driver refuses to merge units whose :data:`MUST_AGREE` settings differ (:func:`check_mergeable`), so a
mixed cluster cannot silently mix numbers computed differently. ``EMAD_ALLOW_MIXED_UNITS=1`` merges them anyway
and the mix is recorded in every run file (``provenance.mixed``) and in the report. Host, worker and CPU model are
recorded, not enforced: a CPU type's rounding is a finding to read, not a setting.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

MUST_AGREE = ("device", "dtype", "torch_threads", "gpu", "torch", "transformers", "code_revision")  # every unit's
ALLOW_MIXED = "EMAD_ALLOW_MIXED_UNITS"  # set to 1: merge units whose settings differ, recording the mix


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def ray_node() -> str | None:
    """The Ray node this process runs on when it is a Ray actor (None otherwise, the driver included)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return context.get_node_id() if context.get_actor_id() is not None else None


def gpu_of(device: torch.device | str) -> str | None:
    """``<name>, <memory> GiB`` of a CUDA ``device`` (None on any other)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"


def provenance(device: torch.device | str, dtype: torch.dtype | str, worker: str = "") -> dict[str, Any]:
    """Where this process computes: ``host``, ``worker`` (as the executor names it), ``ray_node`` (None outside
    Ray), the resolved ``device`` and ``dtype``, ``gpu`` (name and memory; None off CUDA), ``torch_threads``,
    ``cpu`` (model name), ``torch`` and ``transformers`` versions and ``code_revision`` (the git commit,
    ``unknown`` outside a checkout)."""
    import transformers

    from emad.tracking import git_rev

    return {"host": socket.gethostname(), "worker": worker, "ray_node": ray_node(), "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "gpu": gpu_of(device), "torch_threads": torch.get_num_threads(),
            "cpu": cpu_model(), "torch": torch.__version__, "transformers": transformers.__version__,
            "code_revision": git_rev()}


def check_mergeable(units: Sequence[tuple[str, dict[str, Any]]]) -> str | None:
    """Refuse to merge units computed under different settings (unless ``EMAD_ALLOW_MIXED_UNITS=1``).

    Args:
        units: ``(unit name, its provenance)`` per unit.

    Returns:
        None when every :data:`MUST_AGREE` setting agrees; with the override set, the mix (each differing key
        with the units behind each value), for the caller to record.

    Raises:
        ValueError: naming each :data:`MUST_AGREE` key whose values differ, with the units behind each value, and
            the override.
    """
    problems = []
    for key in MUST_AGREE:
        seen: dict[Any, list[str]] = {}
        for name, prov in units:
            seen.setdefault(prov.get(key), []).append(name)
        if len(seen) > 1:
            problems.append(f"{key}: " + "; ".join(f"{value} ({', '.join(names)})" for value, names in seen.items()))
    if not problems:
        return None
    mix = " | ".join(problems)
    if os.environ.get(ALLOW_MIXED) == "1":
        return mix
    raise ValueError("the work units were computed under different settings and cannot be merged — " + mix
                     + ": give decode.device / decode.dtype explicitly, run every node on the same GPU model, "
                     "torch and transformers versions and code revision with the same torch thread count "
                     f"(OMP_NUM_THREADS), or set {ALLOW_MIXED}=1 to merge them with the mix recorded")


def record_mix(provenances: Sequence[dict[str, Any]], mix: str | None) -> None:
    """Write the mix :func:`check_mergeable` allowed into every unit's provenance (``mixed``; nothing when None)."""
    if mix is not None:
        for prov in provenances:
            prov["mixed"] = mix
