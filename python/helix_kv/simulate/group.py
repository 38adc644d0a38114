"""Rank groups the step loop drives: all ranks in this process, or this process's rank.

:class:`InProcessGroup` wraps :class:`helix_kv.SimulatedCPGroup` (``cp`` real schedulers in
one process, compared every step). :class:`ProcessRankGroup` is one rank of a real
``torch.distributed`` group; it checks agreement with
:class:`helix_kv.distributed.ScheduleChecker` every step. Both satisfy
:class:`helix_kv.simulate.step_loop.RankGroup`.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class InProcessGroup:
    """``cp`` schedulers in this process, one per rank, fed identical calls."""

    def __init__(self, config: Any) -> None:
        from helix_kv import SimulatedCPGroup

        self._group = SimulatedCPGroup(config)
        self.cp = int(config.cp_size)

    def add_request(
        self, request_id: int, prompt: np.ndarray, max_new_tokens: int, priority: int
    ) -> None:
        self._group.add_request(request_id, prompt, max_new_tokens, priority)

    def schedule(self) -> Any:
        return self._group.schedule()[0]

    def update(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(self._group.update(tokens))

    def abort_many(self, request_ids: np.ndarray) -> None:
        self._group.abort_many(request_ids)

    def take_output(self, request_id: int) -> Any:
        return self._group.take_output(request_id)

    def metrics(self) -> Any:
        return self._group.metrics()

    def has_unfinished(self) -> bool:
        return bool(self._group.has_unfinished())

    @property
    def num_running(self) -> int:
        return int(self._group.schedulers[0].num_running)

    @property
    def num_waiting(self) -> int:
        return int(self._group.schedulers[0].num_waiting)


class ProcessRankGroup:
    """This process's rank of a ``torch.distributed`` CP group.

    Each process runs its own scheduler on the same workload; after every ``schedule()``
    the ranks compare digests through :class:`helix_kv.distributed.ScheduleChecker`, which
    raises :class:`helix_kv.ScheduleMismatchError` on every rank if they differ.
    """

    def __init__(self, config: Any, process_group: Any = None) -> None:
        from helix_kv import Scheduler
        from helix_kv.distributed import ScheduleChecker

        self.cp = int(config.cp_size)
        self.scheduler = Scheduler(config)
        # one rank has no peer to compare with (the checker would warn that it cannot apply)
        self.checker = ScheduleChecker(process_group) if self.cp > 1 else None
        self._sample_ids: Any = None

    def add_request(
        self, request_id: int, prompt: np.ndarray, max_new_tokens: int, priority: int
    ) -> None:
        self.scheduler.add_request(request_id, prompt, max_new_tokens, priority)

    def schedule(self) -> Any:
        output = self.scheduler.schedule()
        if self.checker is not None:
            self.checker.check(output)
        self._sample_ids = output.sample_ids
        return output

    def update(self, tokens: np.ndarray) -> np.ndarray:
        # the fed tokens join the next check, so a rank fed a different token is caught too
        if self.checker is not None:
            self.checker.record_update(self._sample_ids, tokens)
        return np.asarray(self.scheduler.update(tokens))

    def abort_many(self, request_ids: np.ndarray) -> None:
        # Same calls on every rank; the next step's check covers the state they leave.
        self.scheduler.abort_many(request_ids)

    def take_output(self, request_id: int) -> Any:
        return self.scheduler.take_output(request_id)

    def metrics(self) -> Any:
        return self.scheduler.metrics()

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished())

    @property
    def num_running(self) -> int:
        return int(self.scheduler.num_running)

    @property
    def num_waiting(self) -> int:
        return int(self.scheduler.num_waiting)
