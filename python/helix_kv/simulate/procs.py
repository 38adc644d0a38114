"""``--procs``: run the ``cp`` ranks as real processes over a gloo process group.

Each process builds its own scheduler (its own rank), runs the same workload through the
same step loop and compares its schedule with its peers every step through
:class:`helix_kv.distributed.ScheduleChecker` (``HELIX_KV_CHECK_SCHEDULE=1`` is set in every
process). Rank 0's result comes back to the caller. torch is imported only here, and only
when this runs.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from helix_kv.simulate.options import SimulationOptions
from helix_kv.simulate.runner import SimulationResult, run_simulation
from helix_kv.simulate.workload import RequestSpec

MISSING_TORCH = (
    "--procs needs torch (the ranks talk over torch.distributed with gloo), which is not "
    "installed; install it with: pip install 'helix_kv[torch]', or drop --procs to simulate "
    "the ranks in one process"
)

RESULT_FILE = "result.pkl"
ERROR_FILE = "error-rank{rank}.pkl"


class ProcsUnavailableError(RuntimeError):
    """torch (with torch.distributed) is not available."""


class RankFailedError(RuntimeError):
    """A rank process failed without a typed helix_kv error (a crash, a torch error)."""


def check_procs_available() -> None:
    """Raise :class:`ProcsUnavailableError` if torch.distributed cannot be used."""
    try:
        import torch.distributed as dist
        import torch.multiprocessing  # noqa: F401
    except ImportError:
        raise ProcsUnavailableError(MISSING_TORCH) from None
    if not dist.is_available():
        raise ProcsUnavailableError(
            "--procs needs torch.distributed, which this torch build does not have"
        )


def _rank_main(
    rank: int,
    options: SimulationOptions,
    workload: Sequence[RequestSpec],
    config: dict[str, Any],
    workdir: str,
    show_progress: bool,
) -> None:
    """Entry point of one rank process (run by ``torch.multiprocessing.spawn``)."""
    os.environ["HELIX_KV_CHECK_SCHEDULE"] = "1"
    import torch.distributed as dist

    from helix_kv import HelixKVError
    from helix_kv.simulate.group import ProcessRankGroup
    from helix_kv.simulate.progress import ProgressLine

    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(workdir) / 'rendezvous'}",
        rank=rank,
        world_size=options.cp,
    )
    progress = ProgressLine(label=f"rank {rank}") if show_progress and rank == 0 else None
    try:
        group = ProcessRankGroup(options.scheduler_config(rank), dist.group.WORLD)
        result = run_simulation(
            group, workload, config=config, progress=progress, max_steps=options.max_steps
        )
        if rank == 0:
            with open(Path(workdir) / RESULT_FILE, "wb") as handle:
                pickle.dump(result, handle)
    except HelixKVError as err:
        with open(Path(workdir) / ERROR_FILE.format(rank=rank), "wb") as handle:
            pickle.dump((type(err).__name__, str(err)), handle)
    finally:
        if progress is not None:
            progress.close()
        dist.destroy_process_group()


def _raise_rank_error(workdir: Path, cp: int) -> None:
    import helix_kv

    for rank in range(cp):
        path = workdir / ERROR_FILE.format(rank=rank)
        if path.exists():
            with open(path, "rb") as handle:
                name, message = pickle.load(handle)
            error_class = getattr(helix_kv, name, helix_kv.HelixKVError)
            raise error_class(f"rank {rank}: {message}")


def run_in_processes(
    options: SimulationOptions,
    workload: Sequence[RequestSpec],
    config: Optional[dict[str, Any]] = None,
    show_progress: bool = False,
) -> SimulationResult:
    """Run the simulation with one process per rank; return rank 0's result.

    Raises the rank's ``helix_kv`` error if the schedulers raised one (they raise together:
    every decision is rank-invariant), :class:`RankFailedError` if a process died otherwise.
    """
    check_procs_available()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="helix-kv-procs-") as tmp:
        workdir = Path(tmp)
        try:
            mp.spawn(
                _rank_main,
                args=(options, list(workload), dict(config or {}), tmp, show_progress),
                nprocs=options.cp,
                join=True,
            )
        except Exception as err:  # a rank died: report it in one line
            _raise_rank_error(workdir, options.cp)
            last_line = str(err).strip().splitlines()[-1:] or [type(err).__name__]
            raise RankFailedError(f"a rank process failed: {last_line[0]}") from None
        _raise_rank_error(workdir, options.cp)
        with open(workdir / RESULT_FILE, "rb") as handle:
            result: SimulationResult = pickle.load(handle)
    return result
