"""Process-group plumbing shared by the init sync and the schedule check."""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def resolve_group(group: ProcessGroup | None) -> tuple[ProcessGroup | None, int, int]:
    """``(group, rank, size)``; ``group=None`` means the world group.

    Without an initialised process group (and ``group=None``) this process is a group of one:
    ``(None, 0, 1)``.
    """
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: ProcessGroup) -> torch.device:
    """Where a tensor for a collective on ``group`` must live (the current GPU for NCCL)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
