"""One CP rank's KV ledger + scheduler, built in agreement with its process group."""

from __future__ import annotations

import logging
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import numpy.typing as npt

import helix_kv
from helix_kv._core import RequestOutput, ScheduleOutput, SchedulerConfig, SchedulerMetrics
from helix_kv.distributed.check import ScheduleChecker
from helix_kv.distributed.config import (
    EngineConfig,
    check_config_guards,
    group_fields,
    host_tier_superblocks,
    schedule_check_requested,
    superblocks_for_budget,
)
from helix_kv.distributed.group import ProcessGroup, resolve_group
from helix_kv.distributed.sync import ConfigIdentity, GroupSync
from helix_kv.types import FlagArray, IntArray, TokenArray

logger = logging.getLogger("helix_kv")


@dataclass
class _LocalSetup:
    """Step 1 of :meth:`HelixKVRank.create`, on this rank alone: the schedule check asked
    for, the guards, this rank's budget in superblocks (KV and host), the scheduler's
    keywords and the configuration's identity; ``failure``: what stopped it (every rank
    learns of it in the quota sync)."""

    check: bool = False
    superblocks: int | None = None
    host_superblocks: int = 0
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    identity: ConfigIdentity | None = None
    failure: BaseException | None = None

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        kv_budget_bytes: int,
        rank: int,
        size: int,
        check_schedule: bool | None,
    ) -> _LocalSetup:
        setup = cls()
        try:
            setup.check = (
                schedule_check_requested() if check_schedule is None else bool(check_schedule)
            )
            check_config_guards(config, size)
            setup.superblocks = superblocks_for_budget(config, kv_budget_bytes)
            setup.host_superblocks = host_tier_superblocks(config, kv_budget_bytes)
            setup.scheduler_kwargs = dict(
                config.scheduler_kwargs(), cp_size=size, cp_rank=rank,
                host_tier_superblocks=setup.host_superblocks,
            )  # fmt: skip
            local_config = helix_kv.SchedulerConfig(
                **setup.scheduler_kwargs, kv_superblocks=setup.superblocks
            )
            setup.identity = ConfigIdentity(rank, size, group_fields(config, local_config))
        except Exception as exc:
            setup.failure = exc
        return setup


class HelixKVRank:
    """A rank's scheduler (with its superblock ledger) and, optionally, its KV storage.

    Build it with :meth:`create`. It satisfies :class:`helix_kv.contract.SchedulerProtocol`:
    the calls forward to the scheduler and, when the schedule check is on, every step is
    compared across the group (its schedule, with the tokens fed to the ``update()`` calls
    since the previous ``schedule()``).

    The comparison of step ``t`` runs while the executor works on it: ``schedule()`` starts
    it (:meth:`ScheduleChecker.start`, after the scheduler decided, before the output is
    returned, so before any of the step's model work is queued) and ``update()`` of step
    ``t`` finishes it (:meth:`ScheduleChecker.finish`) before the scheduler commits anything
    of the step. A mismatch in step ``t`` is therefore raised, on every rank, by ``update()``
    of step ``t`` (plain mode) or by the ``schedule()`` of step ``t + 1`` (one step ahead:
    that schedule finishes the check in flight before starting its own), always before
    step ``t``'s tokens are committed and before ``schedule()`` returns a step that would
    read step ``t``'s KV; the step stays pending in the scheduler. ``revert()`` finishes
    the check of the step it drops; :meth:`finish_check` finishes the check in flight
    earlier, for an executor about to wait for a step's tokens.

    Overlap mode (one step ahead) works as on the scheduler: ``schedule()`` may be called
    while one step is pending, ``update()`` closes the oldest pending step, ``revert()``
    drops the newest, and :meth:`pending_steps` says how many are open. The check still
    compares every step; the tokens of step ``t`` are compared at step ``t + 2`` there (their
    update follows the schedule of ``t + 1``), and a mismatch names both steps.

    Attributes:
        config: the engine configuration.
        scheduler: the :class:`helix_kv.Scheduler` of this rank.
        scheduler_config: the :class:`helix_kv.SchedulerConfig` it was built from.
        group: the CP process group (``None``: a single process without torch.distributed).
        cp_rank, cp_size: this rank and the group size.
        capacity_superblocks: the KV pool size the group agreed on (its smallest budget).
        local_superblocks: what this rank's own budget would have held.
        host_tier_superblocks: host tier given to the scheduler, in superblocks (one host page
            per rank each; the group's minimum).
        checker: the :class:`ScheduleChecker`, or ``None`` when the check is off.
        kv_storage: whatever ``allocate`` returned (``None`` without ``allocate``).
        deadlocks: :class:`helix_kv.DeadlockError` raised by :meth:`schedule`; only grows.
    """

    def __init__(
        self,
        config: EngineConfig,
        scheduler_config: SchedulerConfig,
        group: ProcessGroup | None,
        local_superblocks: int,
        checker: ScheduleChecker | None,
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
        # (step, sample_ids) of each pending step, oldest first: what the checker records
        # when ``update`` closes the oldest (two entries in overlap mode).
        self._pending: deque[tuple[int, npt.NDArray[np.uint64]]] = deque()
        # For metrics (helix_kv.distributed.prometheus): an error raised out of the core
        # is not something the core can count.
        self.deadlocks = 0

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        kv_budget_bytes: int,
        group: ProcessGroup | None = None,
        *,
        allocate: Callable[[HelixKVRank], Any] | None = None,
        check_schedule: bool | None = None,
    ) -> HelixKVRank:
        """Builds this rank's scheduler in agreement with every rank of ``group``.

        Every rank of the group must call it (collectively). ``cp_size`` and ``cp_rank`` are
        the group's size and this process's rank in it; ``group=None`` means the world group
        (or a lone process when torch.distributed is not initialised).

        1. Locally: the guards (:func:`check_config_guards`), the config, and this rank's
           ``kv_budget_bytes`` turned into whole pages, i.e. superblocks.
        2. Quota + status sync: one all-reduce MIN gives the group's smallest superblock count
           (logged), whether any rank failed step 1, and whether every rank was built from
           the same configuration (a fingerprint of
           :func:`~helix_kv.distributed.config.group_fields`: every scheduler decision field
           and every other :class:`EngineConfig` field, the KV geometry included) with
           ``cp_rank``/``cp_size`` its place in the group.
        3. The scheduler is built with the agreed capacity, then the schedule checker's local
           part (when on) and ``allocate(rank)`` (e.g. the KV pool tensors for
           ``rank.capacity_superblocks`` pages); a status all-reduce follows.
        4. With the check on: the checker's collective part (on NCCL, its own communicator),
           then one more status all-reduce.
        If any rank fails, every rank raises :class:`helix_kv.InitSyncError` naming the failing
        ranks and their reasons (an instance of :class:`helix_kv.ConfigGuardError` too when
        every failure was a guard, of :class:`helix_kv.ConfigError` when every failure was a
        config error). If the configurations differ, every rank raises
        :class:`~helix_kv.distributed.InitSyncConfigMismatchError` (a
        :class:`helix_kv.ConfigMismatchError` and an ``InitSyncError``) naming the ranks and
        the fields, with their values. A lone process raises its own error unchanged. After a
        failure no rank keeps its KV pool: ``allocate``'s result is dropped before the error
        is raised, so a retry in an ``except`` block does not hold two pools.

        ``check_schedule``: run the per-step schedule check; ``None`` reads
        ``HELIX_KV_CHECK_SCHEDULE`` (which must then agree on every rank).
        """
        group, rank, size = resolve_group(group)
        sync = GroupSync(group)
        local = _LocalSetup.of(config, kv_budget_bytes, rank, size, check_schedule)
        capacity, check, host_superblocks = sync.agree_quota(
            local.superblocks,
            local.check,
            local.failure,
            local.identity,
            local_host_superblocks=local.host_superblocks,
        )
        assert local.superblocks is not None  # agree_quota raised otherwise
        local.scheduler_kwargs["host_tier_superblocks"] = host_superblocks
        built: HelixKVRank | None = None
        failure: BaseException | None = None
        try:
            built = cls._build(config, local, capacity, group, check, allocate)
        except Exception as exc:
            failure = exc
            # A KV pool allocated in part lives on in the failed frames' locals; let it go.
            traceback.clear_frames(exc.__traceback__)
        try:
            sync.agree_status(failure, "scheduler, schedule check and KV allocation")
            assert built is not None  # agree_status raised otherwise
            if built.checker is not None:
                try:
                    built.checker.connect()
                except Exception as exc:
                    failure = exc
                sync.agree_status(failure, "schedule check connection")
        except BaseException:
            # Drop this rank's KV pool before raising: the traceback keeps this frame, and so
            # its locals, alive while the caller handles the error, and a retry in an
            # ``except`` block would otherwise hold two pools.
            if built is not None:
                built.kv_storage = built.checker = None
            built = None
            raise
        return built

    @classmethod
    def _build(
        cls,
        config: EngineConfig,
        local: _LocalSetup,
        capacity: int,
        group: ProcessGroup | None,
        check: bool,
        allocate: Callable[[HelixKVRank], Any] | None,
    ) -> HelixKVRank:
        """This rank with the agreed capacity (step 3 of :meth:`create`, inside the sync,
        so that its failure on one rank reaches every rank): the scheduler, the checker's
        local part, ``allocate``'s storage."""
        scheduler_config = helix_kv.SchedulerConfig(
            **local.scheduler_kwargs, kv_superblocks=capacity
        )
        size = scheduler_config.cp_size
        if size > 1:
            logger.info(
                "KV quota agreed by %d CP ranks: %d superblocks = %d global tokens "
                "(tokens_per_block %d x cp_size %d per superblock); rank %d offered %d; "
                "host tier %d superblocks (the group's minimum); "
                "configuration fingerprint %016x",
                size, capacity, scheduler_config.kv_tokens, scheduler_config.tokens_per_block,
                size, scheduler_config.cp_rank, local.superblocks,
                scheduler_config.host_tier_superblocks, scheduler_config.fingerprint,
            )  # fmt: skip
        # its collective part (NCCL) waits until every rank is known to have got this far
        checker = ScheduleChecker(group, connect=False) if check else None
        assert local.superblocks is not None
        built = cls(config, scheduler_config, group, local.superblocks, checker)
        if allocate is not None:
            built.kv_storage = allocate(built)
        return built

    @property
    def capacity_tokens(self) -> int:
        """Global tokens the agreed KV pool holds (the scheduler configuration's)."""
        return int(self.scheduler_config.capacity_tokens)

    # -- the scheduler contract (helix_kv.contract.SchedulerProtocol) -------------------

    def add_request(
        self,
        request_id: int,
        prompt: TokenArray,
        max_new_tokens: int,
        priority: int = 0,
        *,
        cache_salt: str | bytes | None = None,
    ) -> None:
        """Queues a request (see :meth:`helix_kv.Scheduler.add_request`). Every rank must add
        the same requests between the same steps, in the same order (and salts)."""
        self.scheduler.add_request(
            request_id, prompt, max_new_tokens, priority, cache_salt=cache_salt
        )

    def reset_prefix_cache(self) -> int:
        """Drops every unreferenced cached superblock (see
        :meth:`helix_kv.Scheduler.reset_prefix_cache`); every rank must call it between the
        same steps."""
        return self.scheduler.reset_prefix_cache()

    def schedule(self) -> ScheduleOutput:
        """The next step's :class:`helix_kv.ScheduleOutput`. With the schedule check on, its
        comparison across the group is started here and finished by the step's ``update()``
        (or ``revert()``); a comparison still in flight (one step ahead: the previous
        step's) is finished first, so this raises :class:`helix_kv.ScheduleMismatchError`
        when that step differed. Callable while one step is pending (overlap mode: see
        :meth:`helix_kv.Scheduler.schedule`)."""
        try:
            output = self.scheduler.schedule()
        except helix_kv.DeadlockError:
            self.deadlocks += 1
            raise
        # Recorded before the check: the step is pending in the scheduler even when the
        # check raises, and a later revert() must drop this entry, not an older one.
        self._pending.append((int(output.step), output.sample_ids))
        if self.checker is not None:
            self.checker.start(output)
        return output

    def update(
        self,
        tokens: TokenArray,
        eos: FlagArray | None = None,
        accepted: IntArray | None = None,
    ) -> npt.NDArray[np.uint64]:
        """Feeds the oldest pending step's sampled tokens (one per its ``sample_ids`` entry);
        returns the ids that finished. With the check on, the comparison of the step closed
        here is finished first (raising :class:`helix_kv.ScheduleMismatchError`, with
        nothing committed, when the ranks differed), and the tokens go into the check the next
        ``schedule`` starts (recorded once the update has succeeded: a rejected update
        changed nothing). With drafts, ``accepted`` (per generation entry) goes into the check
        too, so a rank fed different accepted counts is caught at the next check."""
        checker = self.checker
        if checker is not None and self._pending:
            in_flight = checker.in_flight_step
            if in_flight is not None and in_flight <= self._pending[0][0]:
                checker.finish()
        finished = self.scheduler.update(tokens, eos, accepted)
        if self._pending:
            step, sample_ids = self._pending.popleft()
            if self.checker is not None:
                if accepted is None:
                    self.checker.record_update(sample_ids, tokens, eos, step=step)
                else:
                    self.checker.record_update(
                        sample_ids, tokens, eos, step=step, accepted=accepted
                    )
        return finished

    def propose_drafts(self, request_ids: IntArray, counts: IntArray, tokens: TokenArray) -> None:
        """Proposes draft tokens for the next step (see
        :meth:`helix_kv.Scheduler.propose_drafts`); every rank must propose the same ones (the
        step's schedule, and so the check, covers the drafts it takes)."""
        self.scheduler.propose_drafts(request_ids, counts, tokens)

    def finish_check(self) -> None:
        """Finishes the schedule check in flight, if any (raising
        :class:`helix_kv.ScheduleMismatchError` on every rank when it failed); a no-op when
        the check is off or nothing is in flight. Optional: ``update`` finishes a step's check
        anyway. An executor calls it right before the host blocks on the step's device work
        (its sampled tokens): the check does not depend on that work, so a mismatch is raised
        even when a forward queued on a schedule that differs between ranks never completes.
        Every rank must call it at the same point of the step."""
        if self.checker is not None:
            self.checker.finish()

    def revert(self) -> npt.NDArray[np.uint64]:
        """Undoes the newest pending step (the one the executor did not run); returns the ids
        of requests whose abort was requested while it was pending (aborted now). With the
        check on, that step's comparison is finished first (a step that diverged is still
        reported)."""
        checker = self.checker
        if (
            checker is not None
            and self._pending
            and (checker.in_flight_step == self._pending[-1][0])
        ):
            checker.finish()
        reverted = self.scheduler.revert()
        if self._pending:
            self._pending.pop()
        return reverted

    def abort(self, request_id: int) -> bool:
        """Aborts a request (see :meth:`helix_kv.Scheduler.abort`). Every rank must make
        the same abort calls between the same steps, in the same order; with the schedule
        check on, the next step's check covers them (the state they leave drives it)."""
        return self.scheduler.abort(request_id)

    def abort_many(self, request_ids: IntArray) -> npt.NDArray[np.bool_]:
        """Aborts requests in order (see :meth:`helix_kv.Scheduler.abort_many`); the same
        rule as :meth:`abort` applies. Returns, per id, whether it was live."""
        return self.scheduler.abort_many(request_ids)

    def take_output(self, request_id: int) -> RequestOutput:
        """:meth:`~helix_kv.contract.SchedulerProtocol.take_output`."""
        return self.scheduler.take_output(request_id)

    def metrics(self) -> SchedulerMetrics:
        """:meth:`~helix_kv.contract.SchedulerProtocol.metrics`."""
        return self.scheduler.metrics()

    def has_unfinished(self) -> bool:
        """:meth:`~helix_kv.contract.SchedulerProtocol.has_unfinished`."""
        return self.scheduler.has_unfinished()

    def pending_steps(self) -> int:
        """:meth:`~helix_kv.contract.SchedulerProtocol.pending_steps`."""
        return self.scheduler.pending_steps()

    @property
    def num_running(self) -> int:
        """:attr:`~helix_kv.contract.SchedulerProtocol.num_running`."""
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """:attr:`~helix_kv.contract.SchedulerProtocol.num_waiting`."""
        return self.scheduler.num_waiting
