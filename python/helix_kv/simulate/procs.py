"""``--procs``: run the ``cp`` ranks as real processes over a gloo process group.

Each process builds its own scheduler (its own rank), runs the same workload through the
same step loop and compares its schedule with its peers every step through
:class:`helix_kv.distributed.ScheduleChecker` (``HELIX_KV_CHECK_SCHEDULE=1`` is set in every
process). Rank 0's result comes back to the caller. torch is imported only here, and only
when this runs.

Ctrl-C reaches every process of the terminal's foreground group. The rank processes ignore it
(they are started with SIGINT ignored, so not even their start-up can print a traceback);
the parent decides: asked to stop (``should_stop``), it creates a stop file, and every
:data:`STOP_CHECK_STEPS` steps the ranks agree through one all-reduce whether any of them has
seen it, so they all stop before the same step and rank 0 sends back its partial result. If
the parent is interrupted outright (``KeyboardInterrupt``), it ends the ranks with SIGTERM.
"""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from helix_kv.errors import ProcsUnavailableError, RankFailedError
from helix_kv.simulate.options import SimulationOptions
from helix_kv.simulate.step_loop import SimulationResult, run_simulation
from helix_kv.simulate.workload import RequestSpec

MISSING_TORCH = (
    "--procs needs torch (the ranks talk over torch.distributed with gloo), which is not "
    "installed; install it with: pip install 'helix_kv[torch]', or drop --procs to simulate "
    "the ranks in one process"
)

RESULT_FILE = "result.pkl"
ERROR_FILE = "error-rank{rank}.pkl"
STOP_FILE = "stop"

#: The ranks agree whether to stop every this many steps (one small all-reduce each time).
STOP_CHECK_STEPS = 16
#: How often the parent looks at ``should_stop`` while the ranks run, in seconds.
POLL_SECONDS = 0.1
#: How long a rank has to exit after SIGTERM before it is killed, in seconds.
TERMINATE_GRACE_SECONDS = 5.0


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


class _AgreedStop:
    """``should_stop`` of a rank process: every :data:`STOP_CHECK_STEPS` calls, the ranks
    all-reduce (MAX) whether any of them sees the stop file or has lost its parent, so every
    rank answers the same on the same step (each rank calls it once per step)."""

    def __init__(self, stop_path: Path, parent_pid: int) -> None:
        self.stop_path = stop_path
        self.parent_pid = parent_pid
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls % STOP_CHECK_STEPS:
            return False
        import torch
        import torch.distributed as dist

        seen = self.stop_path.exists() or os.getppid() != self.parent_pid
        flag = torch.tensor([int(seen)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _rank_main(
    rank: int,
    options: SimulationOptions,
    workload: Sequence[RequestSpec],
    config: dict[str, Any],
    workdir: str,
    show_progress: bool,
    parent_pid: int,
) -> None:
    """Entry point of one rank process (run by ``torch.multiprocessing.start_processes``)."""
    if options.cp > 1:  # with one rank there is nothing to compare (the checker would warn)
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
            group,
            workload,
            config=config,
            progress=progress,
            max_steps=options.max_steps,
            should_stop=_AgreedStop(Path(workdir) / STOP_FILE, parent_pid),
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


def _start_ranks(options: SimulationOptions, args: tuple[Any, ...]) -> Any:
    """Start one process per rank with SIGINT ignored; return torch's ``ProcessContext``."""
    import torch.multiprocessing as mp

    # A child inherits an ignored SIGINT through exec, and Python then leaves it ignored, so a
    # Ctrl-C can never raise KeyboardInterrupt in a rank, not even while it imports torch. The
    # parent ignores SIGINT only while it starts them (a Ctrl-C in that instant is lost).
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        return mp.start_processes(
            _rank_main, args=args, nprocs=options.cp, join=False, start_method="spawn"
        )
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def _end_ranks(context: Any) -> None:
    """SIGTERM every rank still running (it exits without a word), then SIGKILL stragglers."""
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(TERMINATE_GRACE_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


def run_in_processes(
    options: SimulationOptions,
    workload: Sequence[RequestSpec],
    config: Optional[dict[str, Any]] = None,
    show_progress: bool = False,
    should_stop: Optional[Callable[[], bool]] = None,
) -> SimulationResult:
    """Run the simulation with one process per rank; return rank 0's result.

    Raises the rank's ``helix_kv`` error if the schedulers raised one (they raise together:
    every decision is rank-invariant), :class:`RankFailedError` if a process died otherwise.
    Once ``should_stop()`` (polled while the ranks run) says so, the ranks stop together on a
    step boundary and the result covers the steps so far (``interrupted=True``).
    """
    check_procs_available()

    with tempfile.TemporaryDirectory(prefix="helix-kv-procs-") as tmp:
        workdir = Path(tmp)
        args = (options, list(workload), dict(config or {}), tmp, show_progress, os.getpid())
        context = _start_ranks(options, args)
        try:
            while not context.join(timeout=POLL_SECONDS):
                if should_stop is not None and should_stop():
                    (workdir / STOP_FILE).touch()
        except Exception as err:  # a rank died (join has ended the others): one line
            _raise_rank_error(workdir, options.cp)
            last_line = str(err).strip().splitlines()[-1:] or [type(err).__name__]
            raise RankFailedError(f"a rank process failed: {last_line[0]}") from None
        except BaseException:  # KeyboardInterrupt: end the ranks before the folder goes
            _end_ranks(context)
            raise
        _raise_rank_error(workdir, options.cp)
        with open(workdir / RESULT_FILE, "rb") as handle:
            result: SimulationResult = pickle.load(handle)
    return result
