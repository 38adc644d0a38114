"""Run functions on every rank of a fresh torch.distributed group, with a hard deadline.

Each rank is a ``torch.multiprocessing`` spawn process that joins a gloo (CPU) or NCCL (one GPU
per rank) group through a ``file://`` store and runs a list of scenarios: module-level
functions ``fn(rank, world, backend) -> picklable``. Every scenario's result (or traceback)
travels back through a multiprocessing queue as soon as it is done. A rank that dies, or a
group that runs past the deadline, fails the caller instead of hanging it: the processes are
killed and the error says which ranks were missing.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helix_kv.distributed.launch import DEFAULT_RANK_ENV, init_rank

Scenario = Callable[[int, int, str], Any]

#: Loopback for gloo and the NCCL bootstrap: the tests never need another interface (and the
#: GPU machines have no network at all).
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def cuda_ranks_available(world: int) -> bool:
    """Whether an NCCL group of ``world`` ranks (one GPU each) can run here."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= world


@dataclass
class GroupRun:
    """What came back from one group: ``results[name][rank]`` and ``errors[name][rank]``."""

    world: int
    backend: str
    results: dict[str, dict[int, Any]] = field(default_factory=dict)
    errors: dict[str, dict[int, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def scenario(self, name: str) -> list[Any]:
        """Every rank's result of ``name``; fails with the ranks' tracebacks otherwise."""
        got = self.results.get(name, {})
        if len(got) == self.world:
            return [got[rank] for rank in range(self.world)]
        lines = [f"scenario {name!r} on {self.world} {self.backend} ranks did not complete"]
        lines += [f"rank {r}:\n{tb}" for r, tb in sorted(self.errors.get(name, {}).items())]
        missing = sorted(set(range(self.world)) - set(got) - set(self.errors.get(name, {})))
        if missing:
            lines.append(f"no report from rank(s) {missing}")
        lines += self.problems
        raise AssertionError("\n".join(lines))


def run_group(
    scenarios: Sequence[Scenario],
    world: int,
    backend: str = "gloo",
    *,
    deadline_s: float = 90.0,
    group_timeout_s: float = 20.0,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    allowed_exits: dict[int, int] | None = None,
    exit_grace_s: float = 10.0,
) -> GroupRun:
    """Runs ``scenarios`` in order on ``world`` fresh ranks and collects their reports.

    ``group_timeout_s`` is the process group's timeout (bounds every collective);
    ``deadline_s`` bounds the whole run. ``allowed_exits`` maps a rank to the exit code it is
    expected to die with (a scenario that kills its rank on purpose). Ranks still alive
    ``exit_grace_s`` after the last report (e.g. stuck tearing down a broken NCCL
    communicator) are killed.
    """
    run = GroupRun(world, backend)
    common_env = {**DEFAULT_RANK_ENV, **LOOPBACK_ENV, **(env or {})}
    allowed_exits = allowed_exits or {}
    ctx = mp.get_context("spawn")
    reports: Any = ctx.Queue()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="helix_kv_dist_") as scratch:
        init_method = f"file://{Path(scratch) / 'store'}"
        procs = []
        for rank in range(world):
            rank_vars = {**common_env, **(rank_env or {}).get(rank, {})}
            args = (rank, world, backend, init_method, group_timeout_s, rank_vars, scenarios,
                    reports)  # fmt: skip
            proc = ctx.Process(target=_rank_main, args=args, daemon=True)
            proc.start()
            procs.append(proc)
        done: set = set()
        try:
            while len(done) < world:
                if time.monotonic() - start > deadline_s:
                    run.problems.append(
                        f"deadline of {deadline_s:.0f}s passed; rank(s) "
                        f"{sorted(set(range(world)) - done)} still running (killed)"
                    )
                    break
                try:
                    _record(run, done, reports.get(timeout=0.1))
                    continue
                except queue.Empty:
                    pass
                for rank, proc in enumerate(procs):
                    if rank in done or proc.exitcode is None:
                        continue
                    _drain(run, done, reports)  # its last reports may still be in the pipe
                    if rank not in done:
                        done.add(rank)
                        if allowed_exits.get(rank) != proc.exitcode:
                            run.problems.append(
                                f"rank {rank} died (exit code {proc.exitcode}) before finishing"
                            )
        finally:
            left = max(0.0, deadline_s - (time.monotonic() - start))
            exit_by = time.monotonic() + min(exit_grace_s, left)
            for proc in procs:
                proc.join(timeout=max(0.0, exit_by - time.monotonic()))
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            reports.close()
    run.seconds = time.monotonic() - start
    return run


def _record(run: GroupRun, done: set, report: tuple[int, str, str, Any]) -> None:
    rank, name, status, payload = report
    if status == "done":
        done.add(rank)
    elif status == "ok":
        run.results.setdefault(name, {})[rank] = payload
    else:
        run.errors.setdefault(name, {})[rank] = payload


def _drain(run: GroupRun, done: set, reports: Any) -> None:
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        try:
            _record(run, done, reports.get(timeout=0.05))
        except queue.Empty:
            return


def _rank_main(
    rank: int,
    world: int,
    backend: str,
    init_method: str,
    group_timeout_s: float,
    env: dict[str, str],
    scenarios: Sequence[Scenario],
    reports: Any,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        init_rank(rank, world, backend, init_method, group_timeout_s)
    except BaseException:
        reports.put((rank, "<init>", "error", traceback.format_exc()))
        raise
    try:
        for scenario in scenarios:
            try:
                result = scenario(rank, world, backend)
            except BaseException:
                # The group may now be out of step: stop here, report, let the peers time out.
                reports.put((rank, scenario.__name__, "error", traceback.format_exc()))
                break
            reports.put((rank, scenario.__name__, "ok", result))
    finally:
        reports.put((rank, "", "done", None))
        dist.destroy_process_group()
