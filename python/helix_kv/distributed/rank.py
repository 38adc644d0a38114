"""One CP rank's KV ledger + scheduler, built in agreement with its process group."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import numpy as np

import helix_kv
from helix_kv.distributed.check import ScheduleChecker
from helix_kv.distributed.config import (
    EngineConfig,
    check_config_guards,
    host_tier_superblocks,
    schedule_check_requested,
    superblocks_for_budget,
)
from helix_kv.distributed.group import ProcessGroup, resolve_group
from helix_kv.distributed.sync import GroupSync

logger = logging.getLogger("helix_kv")


class HelixKVRank:
    """A rank's scheduler (with its superblock ledger) and, optionally, its KV storage.

    Build it with :meth:`create`. ``schedule()`` / ``update()`` / ``revert()`` forward to the
    scheduler and, when the schedule check is on, compare every step across the group.

    Attributes:
        config: the engine configuration.
        scheduler: the :class:`helix_kv.Scheduler` of this rank.
        scheduler_config: the :class:`helix_kv.SchedulerConfig` it was built from.
        group: the CP process group (``None``: a single process without torch.distributed).
        cp_rank, cp_size: this rank and the group size.
        capacity_superblocks: the KV pool size the group agreed on (its smallest budget).
        local_superblocks: what this rank's own budget would have held.
        host_tier_superblocks: host tier given to the scheduler (``non_helix`` only).
        checker: the :class:`ScheduleChecker`, or ``None`` when the check is off.
        kv_storage: whatever ``allocate`` returned (``None`` without ``allocate``).
    """

    def __init__(
        self,
        config: EngineConfig,
        scheduler_config: Any,
        group: Optional[ProcessGroup],
        local_superblocks: int,
        checker: Optional[ScheduleChecker],
    ) -> None:
        self.config = config
        self.scheduler_config = scheduler_config
        self.scheduler = helix_kv.Scheduler(scheduler_config)
        self.group = group
        self.cp_rank: int = scheduler_config.cp_rank
        self.cp_size: int = scheduler_config.cp_size
        self.capacity_superblocks: int = scheduler_config.capacity_superblocks
        self.host_tier_superblocks: int = scheduler_config.host_tier_superblocks
        self.local_superblocks = local_superblocks
        self.checker = checker
        self.kv_storage: Any = None
        self._sample_ids: Optional[np.ndarray] = None

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        kv_budget_bytes: int,
        group: Optional[ProcessGroup] = None,
        *,
        allocate: Optional[Callable[[HelixKVRank], Any]] = None,
        check_schedule: Optional[bool] = None,
    ) -> HelixKVRank:
        """Builds this rank's scheduler in agreement with every rank of ``group``.

        Every rank of the group must call it (collectively). ``cp_size`` and ``cp_rank`` are
        the group's size and this process's rank in it; ``group=None`` means the world group
        (or a lone process when torch.distributed is not initialised).

        1. Locally: the guards (:func:`check_config_guards`), the config, and this rank's
           ``kv_budget_bytes`` turned into whole pages, i.e. superblocks.
        2. Quota + status sync: one all-reduce MIN gives the group's smallest superblock count
           (logged) and whether any rank failed step 1.
        3. The scheduler is built with the agreed capacity, then ``allocate(rank)`` (e.g. the
           KV pool tensors for ``rank.capacity_superblocks`` pages) runs; a status all-reduce
           follows.
        If any rank fails, every rank raises :class:`helix_kv.InitSyncError` naming the failing
        ranks and their reasons (an instance of :class:`helix_kv.ConfigGuardError` too when
        every failure was a guard, of :class:`helix_kv.ConfigError` when every failure was a
        config error). A lone process raises its own error unchanged.

        ``check_schedule``: run the per-step schedule check; ``None`` reads
        ``HELIX_KV_CHECK_SCHEDULE`` (which must then agree on every rank).
        """
        group, rank, size = resolve_group(group)
        sync = GroupSync(group, rank, size)

        local_superblocks: Optional[int] = None
        check = False
        failure: Optional[BaseException] = None
        try:
            check = schedule_check_requested() if check_schedule is None else bool(check_schedule)
            check_config_guards(config, size)
            local_superblocks = superblocks_for_budget(config, kv_budget_bytes)
            host_superblocks = host_tier_superblocks(config, kv_budget_bytes)
            scheduler_kwargs = dict(
                config.scheduler_kwargs(), cp_size=size, cp_rank=rank,
                host_tier_superblocks=host_superblocks,
            )  # fmt: skip
            helix_kv.SchedulerConfig(**scheduler_kwargs, kv_superblocks=local_superblocks)
        except Exception as exc:
            failure = exc
        capacity, check = sync.agree_quota(local_superblocks, check, failure)
        assert local_superblocks is not None  # agree_quota raised otherwise
        if size > 1:
            logger.info(
                "KV quota agreed by %d CP ranks: %d superblocks (%d global tokens); "
                "rank %d offered %d",
                size, capacity, capacity * config.tokens_per_block * size, rank,
                local_superblocks,
            )  # fmt: skip

        built: Optional[HelixKVRank] = None
        try:
            scheduler_config = helix_kv.SchedulerConfig(**scheduler_kwargs, kv_superblocks=capacity)
            built = cls(config, scheduler_config, group, local_superblocks, None)
            if allocate is not None:
                built.kv_storage = allocate(built)
        except Exception as exc:
            failure = exc
        sync.agree_status(failure, "scheduler and KV allocation")
        assert built is not None
        if check:
            built.checker = ScheduleChecker(group)
        return built

    @property
    def capacity_tokens(self) -> int:
        """Global tokens the agreed KV pool holds."""
        return self.capacity_superblocks * self.config.tokens_per_block * self.cp_size

    def schedule(self) -> Any:
        """The next step's :class:`helix_kv.ScheduleOutput`, checked across the group when
        the schedule check is on (raises :class:`helix_kv.ScheduleMismatchError`)."""
        output = self.scheduler.schedule()
        if self.checker is not None:
            self.checker.check(output)
        self._sample_ids = output.sample_ids
        return output

    def update(self, tokens: Any, eos: Optional[Any] = None) -> np.ndarray:
        """Feeds the step's sampled tokens (one per ``sample_ids`` entry); returns the ids
        that finished. With the check on, the tokens are compared at the next ``schedule``."""
        finished = self.scheduler.update(tokens, eos)
        if self.checker is not None and self._sample_ids is not None:
            self.checker.record_update(self._sample_ids, tokens, eos)
        return finished

    def revert(self) -> np.ndarray:
        """Undoes the scheduled step that was not run; returns the ids of requests whose
        abort was requested while it was pending (aborted now)."""
        return self.scheduler.revert()

    def abort(self, request_id: int) -> None:
        """Aborts a request (see :meth:`helix_kv.Scheduler.abort`). Every rank must make
        the same abort calls between the same steps, in the same order; with the schedule
        check on, the next step's check covers them (the state they leave drives it)."""
        self.scheduler.abort(request_id)

    def abort_many(self, request_ids: Any) -> None:
        """Aborts requests in order, all or nothing (see
        :meth:`helix_kv.Scheduler.abort_many`); the same rule as :meth:`abort` applies."""
        self.scheduler.abort_many(request_ids)
