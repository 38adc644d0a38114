"""Start one process per CP rank with an initialised torch.distributed group.

Used by the multi-process tests (gloo on CPU) and by the GPU bench (NCCL, one GPU per rank).
Processes are started with ``torch.multiprocessing`` spawn and rendezvous through a
``file://`` store in a fresh temporary directory, so no port has to be found free.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Environment every spawned rank gets (NVLink multicast off: see the device notes).
DEFAULT_RANK_ENV = {"NCCL_NVLS_ENABLE": "0"}


def spawn_group(
    worker: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
    env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` processes; results by rank.

    Each process joins a process group of ``backend`` before calling ``worker`` (NCCL ranks
    also select GPU ``rank``) and leaves it afterwards. ``worker`` must be importable by name
    (a module-level function) and return something picklable. An exception in any rank is
    re-raised here after the other ranks are stopped. ``timeout_s`` bounds the rendezvous and
    every collective.
    """
    rank_env = {**DEFAULT_RANK_ENV, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="helix_kv_group_") as scratch:
        init_method = f"file://{Path(scratch) / 'store'}"
        mp.spawn(
            _rank_main,
            args=(
                world_size,
                worker,
                tuple(args),
                backend,
                init_method,
                timeout_s,
                threads_per_rank,
                rank_env,
                scratch,
            ),
            nprocs=world_size,
            join=True,
        )
        results = []
        for rank in range(world_size):
            with open(Path(scratch) / f"rank{rank}.pkl", "rb") as handle:
                results.append(pickle.load(handle))
    return results


def init_rank(rank: int, world_size: int, backend: str, init_method: str, timeout_s: float) -> None:
    """Join the process group as ``rank`` (NCCL: on GPU ``rank % device_count``)."""
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _rank_main(
    rank: int,
    world_size: int,
    worker: Callable[..., Any],
    args: tuple,
    backend: str,
    init_method: str,
    timeout_s: float,
    threads: int,
    env: Dict[str, str],
    scratch: str,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(threads)
    init_rank(rank, world_size, backend, init_method, timeout_s)
    try:
        result = worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    with open(Path(scratch) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(result, handle)
