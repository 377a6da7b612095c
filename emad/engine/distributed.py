"""Data-parallel stages under ``torchrun``: join the process group its environment describes."""

from __future__ import annotations

import os

import torch.distributed as dist


def join(device: str) -> tuple[str, int, int]:
    """Join the process group when ``torchrun`` started several processes (``WORLD_SIZE`` > 1).

    Returns:
        ``(device, rank, world)``: a CUDA device becomes this process's ``cuda:<LOCAL_RANK>`` (NCCL), others stay
        as given (gloo); one process is rank 0 of 1.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device, dist.get_rank() if dist.is_initialized() else 0, world


def leave() -> None:
    """Leave the process group, if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
