"""``--procs``: run the ``cp`` ranks as real processes over a gloo process group.

Each process builds its own rank, a :class:`helix_kv.distributed.HelixKVRank` (its own
scheduler, with the schedule check on when there is a peer to compare with), runs the same
workload through the same step loop and compares its schedule with its peers every step. The
processes are started by :func:`helix_kv.distributed.launch.spawn_group`; rank 0's result comes
back to the caller, and a rank's helix_kv error comes back typed. torch is imported only here,
and only when this runs.

Ctrl-C reaches every process of the terminal's foreground group. The rank processes ignore it
(the launcher starts them with SIGINT ignored, so not even their start-up can print a
traceback); the parent decides: asked to stop (``should_stop``), the launcher creates a stop
file, and every :data:`STOP_CHECK_STEPS` steps the ranks agree through one all-reduce whether
any of them has seen it, so they all stop before the same step and rank 0 sends back its
partial result. If the parent is interrupted outright (``KeyboardInterrupt``), the launcher
ends the ranks with SIGTERM.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from helix_kv.contract import SchedulerProtocol
from helix_kv.errors import ProcsUnavailableError, RankFailedError
from helix_kv.simulate.events import STDOUT_TARGET, JsonlEventWriter
from helix_kv.simulate.options import SimulationOptions
from helix_kv.simulate.progress import ProgressLine
from helix_kv.simulate.step_loop import SimulationResult, run_simulation
from helix_kv.simulate.workload import RequestSpec

if TYPE_CHECKING:  # torch is imported only when the ranks run
    from helix_kv.distributed import HelixKVRank

__all__ = [
    "STOP_CHECK_STEPS",
    "ProcsUnavailableError",
    "RankFailedError",
    "check_procs_available",
    "run_in_processes",
    "run_with_options",
]

MISSING_TORCH = (
    "--procs needs torch (the ranks talk over torch.distributed with gloo), which is not "
    "installed; install it with: pip install 'helix_kv[torch]', or drop --procs to simulate "
    "the ranks in one process"
)

#: The ranks agree whether to stop every this many steps (one small all-reduce each time).
STOP_CHECK_STEPS = 16
#: Timeout of the ranks' collectives, in seconds (torch's default for gloo): the ranks run in
#: lockstep, so only a rank that died or hangs makes its peers wait this long.
RANK_TIMEOUT_S = 1800.0


def check_procs_available() -> None:
    """Raise :class:`ProcsUnavailableError` if torch.distributed cannot be used."""
    try:
        import torch.distributed as dist
        import torch.multiprocessing  # noqa: F401  (imported to check that it imports)
    except ImportError:
        raise ProcsUnavailableError(MISSING_TORCH) from None
    if not dist.is_available():
        raise ProcsUnavailableError(
            "--procs needs torch.distributed, which this torch build does not have"
        )


class _AgreedStop:
    """``should_stop`` of a rank process: every :data:`STOP_CHECK_STEPS` calls, the ranks
    all-reduce (MAX) whether any of them sees a stop request (or has lost its parent), so
    every rank answers the same on the same step (each rank calls it once per step)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls % STOP_CHECK_STEPS:
            return False
        import torch  # here, not at the top: --procs is the only part that needs torch
        import torch.distributed as dist

        from helix_kv.distributed.launch import stop_requested

        flag = torch.tensor([int(stop_requested())], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _rank_scheduler(options: SimulationOptions, cp_rank: int) -> HelixKVRank:
    """This process's :class:`~helix_kv.distributed.HelixKVRank`.

    Built directly rather than with ``HelixKVRank.create``: the parent has checked the
    configuration, every rank builds the same one from the same options, and a simulated rank
    holds no KV tensors, so there is no byte budget to agree on. Its ``EngineConfig`` carries
    the scheduler fields and a notional geometry of one byte per token.
    """
    from helix_kv.distributed import EngineConfig, HelixKVRank, ScheduleChecker  # imports torch
    from helix_kv.distributed.config import SCHEDULER_FIELDS

    config = options.scheduler_config(cp_rank)
    fields = {name: value for name, value in config.to_dict().items() if name in SCHEDULER_FIELDS}
    engine = EngineConfig(
        num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=1, kv_factor=1, **fields
    )
    # one rank has no peer to compare with (the checker would warn that it cannot apply)
    checker = ScheduleChecker() if options.cp_size > 1 else None
    return HelixKVRank(engine, config, None, config.kv_superblocks, checker)


def run_with_options(
    build_scheduler: Callable[[], SchedulerProtocol],
    workload: Sequence[RequestSpec],
    options: SimulationOptions,
    config: dict[str, Any],
    *,
    progress_label: str | None,
    events_path: Path | str | None,
    should_stop: Callable[[], bool] | None,
) -> SimulationResult:
    """The step loop, in this process, over the scheduler ``build_scheduler()`` makes (once the
    progress line and the events file are open), with the run's options: a progress line
    labelled ``progress_label`` (none for ``None``) and the events written to ``events_path``
    (none for ``None``; :data:`~.events.STDOUT_TARGET`: standard output), both closed however
    the run ends. The in-process run and every
    ``--procs`` rank go through here."""
    progress = ProgressLine(label=progress_label) if progress_label is not None else None
    events = None
    if events_path is not None:
        target = sys.stdout if events_path == STDOUT_TARGET else events_path
        events = JsonlEventWriter(target, config)
    try:
        return run_simulation(
            build_scheduler(),
            workload,
            config=config,
            progress=progress,
            max_steps=options.max_steps,
            should_stop=should_stop,
            events=events,
            step_time=options.step_time,
            cp_size=options.cp_size,
            overlap=options.overlap,
            drafts=options.drafts,
        )
    finally:
        if progress is not None:
            progress.close()
        if events is not None:
            events.close()


def _rank_worker(
    rank: int,
    world_size: int,
    options: SimulationOptions,
    workload: Sequence[RequestSpec],
    config: dict[str, Any],
    show_progress: bool,
    events_path: Path | str | None = None,
) -> SimulationResult | None:
    """One rank process (run by ``spawn_group``): the step loop over this rank; rank 0's
    result goes back to the parent, and rank 0 writes the events (every rank's are the same:
    they are rank-invariant)."""
    result = run_with_options(
        lambda: _rank_scheduler(options, rank),
        workload,
        options,
        config,
        progress_label=f"rank {rank}" if show_progress and rank == 0 else None,
        events_path=events_path if rank == 0 else None,
        should_stop=_AgreedStop(),
    )
    return result if rank == 0 else None


def run_in_processes(
    options: SimulationOptions,
    workload: Sequence[RequestSpec],
    config: dict[str, Any] | None = None,
    show_progress: bool = False,
    should_stop: Callable[[], bool] | None = None,
    events_path: Path | str | None = None,
) -> SimulationResult:
    """Run the simulation with one process per rank; return rank 0's result.

    Raises the rank's ``helix_kv`` error if the schedulers raised one (they raise together:
    every decision is rank-invariant), :class:`RankFailedError` if a process died otherwise.
    Once ``should_stop()`` (polled while the ranks run) says so, the ranks stop together on a
    step boundary and the result covers the steps so far (``interrupted=True``). With
    ``events_path``, rank 0's process writes the run's events there.
    """
    check_procs_available()
    from helix_kv.distributed.launch import spawn_group  # imports torch

    results = spawn_group(
        _rank_worker,
        options.cp_size,
        args=(options, list(workload), dict(config or {}), show_progress, events_path),
        timeout_s=RANK_TIMEOUT_S,
        should_stop=should_stop,
    )
    result: SimulationResult = results[0]
    return result
