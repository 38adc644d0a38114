"""Start one process per CP rank, each in an initialised torch.distributed group.

The package's one process-group launcher: the reference executor's group runs (gloo on CPU,
NCCL with one GPU per rank), ``helix-kv simulate --procs``, the multi-process tests and the
schedule-check bench all start their ranks with :func:`spawn_group`. Processes are started with
``torch.multiprocessing`` spawn and rendezvous through a ``file://`` store in a fresh temporary
directory, so no port has to be found free.

Errors: a rank's helix_kv error (a :class:`~helix_kv.errors.HelixKVError`) comes back typed,
with its attributes. Decisions are rank-invariant, so every rank raises the same one on the
same step; :func:`spawn_group` raises the lowest rank's, its message prefixed with the rank.
Any other failure of a rank (another exception, a crash) ends the others and raises
:class:`~helix_kv.errors.RankFailedError` with the failure's last line, chained to torch's
error, which carries the rank's traceback.

Stopping: the ranks start with SIGINT ignored, so a Ctrl-C at a terminal (which reaches every
process of the foreground group) never interrupts a rank, not even while it imports torch; the
launching process decides. Once ``should_stop()`` says so, it creates a stop file, which a rank
reads with :func:`stop_requested`; the ranks must agree when to act on it (e.g. with an
all-reduce every few steps) so that they stop before the same step. If the launching process
is interrupted outright (``KeyboardInterrupt``), the ranks get SIGTERM, then SIGKILL after
:data:`TERMINATE_GRACE_SECONDS`.
"""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessContext, start_processes

from helix_kv.errors import HelixKVError, RankFailedError

__all__ = [
    "DEFAULT_RANK_ENV",
    "POLL_SECONDS",
    "TERMINATE_GRACE_SECONDS",
    "init_rank",
    "spawn_group",
    "stop_requested",
]

#: Environment every spawned rank gets (NVLink multicast off: see the device notes).
DEFAULT_RANK_ENV = {"NCCL_NVLS_ENABLE": "0"}
#: How often the launching process checks on the ranks and asks ``should_stop``, in seconds.
POLL_SECONDS = 0.1
#: How long a rank has to exit after SIGTERM before it is killed, in seconds.
TERMINATE_GRACE_SECONDS = 5.0

_RESULT_FILE = "result-rank{rank}.pkl"
_ERROR_FILE = "error-rank{rank}.pkl"
_STOP_FILE = "stop"

# Set in each rank process before its worker runs (read by stop_requested).
_stop_path: Path | None = None
_parent_pid: int | None = None


def spawn_group(
    worker: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
    env: Mapping[str, str] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` processes; results by rank.

    Each process joins a process group of ``backend`` before calling ``worker`` (NCCL ranks
    also select GPU ``rank``) and leaves it afterwards. ``worker`` must be importable by name
    (a module-level function) and return something picklable. ``timeout_s`` bounds the
    rendezvous and every collective. ``env`` is added to each rank's environment (after
    :data:`DEFAULT_RANK_ENV`). ``should_stop`` is polled while the ranks run; once it says so,
    :func:`stop_requested` says so in every rank. Errors: see the module's docstring.
    """
    rank_env = {**DEFAULT_RANK_ENV, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="helix_kv_group_") as scratch:
        workdir = Path(scratch)
        rank_args = (
            world_size,
            worker,
            tuple(args),
            backend,
            f"file://{workdir / 'store'}",
            timeout_s,
            threads_per_rank,
            rank_env,
            scratch,
            os.getpid(),
        )
        context = _start_ranks(rank_args, world_size)
        try:
            while not context.join(timeout=POLL_SECONDS):
                if should_stop is not None and should_stop():
                    (workdir / _STOP_FILE).touch()
        except Exception as err:  # a rank failed (join has ended the others)
            _raise_rank_error(workdir, world_size)
            last_line = str(err).strip().splitlines()[-1:] or [type(err).__name__]
            raise RankFailedError(f"a rank process failed: {last_line[0]}") from err
        except BaseException:  # KeyboardInterrupt: end the ranks before the folder goes
            _end_ranks(context)
            raise
        _raise_rank_error(workdir, world_size)
        results = []
        for rank in range(world_size):
            with open(workdir / _RESULT_FILE.format(rank=rank), "rb") as handle:
                results.append(pickle.load(handle))
    return results


def stop_requested() -> bool:
    """In a rank started by :func:`spawn_group`: whether the launching process asked the
    ranks to stop, or is gone. This rank's view only; ``False`` outside such a rank."""
    if _stop_path is None:
        return False
    return _stop_path.exists() or os.getppid() != _parent_pid


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


def _start_ranks(rank_args: tuple[Any, ...], world_size: int) -> ProcessContext:
    """Start one process per rank with SIGINT ignored; return torch's ``ProcessContext``."""
    # A child inherits an ignored SIGINT through exec, and Python then leaves it ignored, so a
    # Ctrl-C can never raise KeyboardInterrupt in a rank, not even while it imports torch. The
    # parent ignores SIGINT only while it starts them (a Ctrl-C in that instant is lost).
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        context: ProcessContext = start_processes(
            _rank_main, args=rank_args, nprocs=world_size, join=False, start_method="spawn"
        )
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    return context


def _end_ranks(context: ProcessContext) -> None:
    """SIGTERM every rank still running (it exits without a word), then SIGKILL stragglers."""
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(TERMINATE_GRACE_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


def _raise_rank_error(workdir: Path, world_size: int) -> None:
    """Raise the lowest rank's helix_kv error, if a rank handed one back."""
    for rank in range(world_size):
        path = workdir / _ERROR_FILE.format(rank=rank)
        if path.exists():
            with open(path, "rb") as handle:
                error: BaseException = pickle.load(handle)
            error.args = (f"rank {rank}: {error}",)
            raise error


def _rank_main(
    rank: int,
    world_size: int,
    worker: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str,
    init_method: str,
    timeout_s: float,
    threads: int,
    env: dict[str, str],
    scratch: str,
    parent_pid: int,
) -> None:
    """Entry point of one rank process."""
    global _stop_path, _parent_pid
    os.environ.update(env)
    torch.set_num_threads(threads)
    _stop_path, _parent_pid = Path(scratch) / _STOP_FILE, parent_pid
    init_rank(rank, world_size, backend, init_method, timeout_s)
    try:
        result = worker(rank, world_size, *args)
    except HelixKVError as error:
        _dump(Path(scratch) / _ERROR_FILE.format(rank=rank), _picklable(error))
        return
    finally:
        dist.destroy_process_group()
    _dump(Path(scratch) / _RESULT_FILE.format(rank=rank), result)


def _picklable(error: HelixKVError) -> HelixKVError:
    """``error`` if it survives a pickle round trip, else a plain one with its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return HelixKVError(f"{type(error).__name__}: {error}")
    return error


def _dump(path: Path, value: Any) -> None:
    with open(path, "wb") as handle:
        pickle.dump(value, handle)
