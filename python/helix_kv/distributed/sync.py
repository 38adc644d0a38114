"""Construction-time agreement across a CP group: KV quota and init status.

Construction succeeds on every rank or raises on every rank. Each phase runs its local work
under ``try``, then every rank enters the same collective whether its work failed or not, so a
failure on one rank never leaves its peers waiting in a later collective. When any rank
failed, the ranks gather each other's reasons and all raise an :class:`InitSyncError` naming
the failing ranks.

Timeouts: these collectives (and the schedule check's) run on the caller's process group and
are bounded by its timeout, set with ``torch.distributed.init_process_group(timeout=...)`` or
``new_group(timeout=...)``: gloo enforces it on every collective; NCCL enforces it through its
watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default), which aborts the communicator.
A rank that dies or stalls before a sync makes its peers raise :class:`InitSyncError` when the
collective fails or times out.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist

from helix_kv import ConfigError, ConfigGuardError, HelixKVError, InitSyncError
from helix_kv.distributed.group import ProcessGroup, collective_device

logger = logging.getLogger("helix_kv")

_INT64_MAX = (1 << 63) - 1


class InitSyncConfigGuardError(InitSyncError, ConfigGuardError):
    """Every failing rank was stopped by a configuration guard (catch either class)."""


class InitSyncConfigError(InitSyncError, ConfigError):
    """Every failing rank had an invalid configuration (catch either class)."""


#: The error raised when every failing rank failed with the same configuration error class.
_COMMON_CAUSE: Dict[str, Type[InitSyncError]] = {
    "ConfigGuardError": InitSyncConfigGuardError,
    "ConfigError": InitSyncConfigError,
}


class GroupSync:
    """Agreement collectives of one rank; with one rank they only re-raise local failures."""

    def __init__(self, group: Optional[ProcessGroup], rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def agree_quota(
        self, local_superblocks: Optional[int], check: bool, failure: Optional[BaseException]
    ) -> Tuple[int, bool]:
        """The group's minimum KV superblocks and its (verified identical) schedule-check
        setting, after the configuration phase; raises on every rank if any rank failed.

        One all-reduce MIN of four int64: ``superblocks``, ``-status`` (so MIN yields the
        highest status), ``check`` and ``-check`` (MIN and MAX of the setting).
        """
        if self.size == 1:
            if failure is not None:
                raise failure
            assert local_superblocks is not None
            return local_superblocks, check
        offered = _INT64_MAX if local_superblocks is None else local_superblocks
        flag = int(check)
        values = self._all_reduce_min([offered, -int(failure is not None), flag, -flag], failure)
        superblocks, neg_status, check_min, neg_check_max = values
        if neg_status < 0:
            self._raise_failures(failure, "configuration")
        if check_min != -neg_check_max:
            self._raise_check_disagreement(check)
        return superblocks, bool(check_min)

    def agree_status(self, failure: Optional[BaseException], phase: str) -> None:
        """All-reduce MAX of a status code (0 = ok) after ``phase``; raises on every rank if
        any rank failed."""
        if self.size == 1:
            if failure is not None:
                raise failure
            return
        (neg_status,) = self._all_reduce_min([-int(failure is not None)], failure)
        if neg_status < 0:
            self._raise_failures(failure, phase)

    def _all_reduce_min(self, values: List[int], failure: Optional[BaseException]) -> List[int]:
        assert self.group is not None
        tensor = torch.tensor(values, dtype=torch.int64, device=collective_device(self.group))
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as exc:
            raise self._lost_peer(exc) from (failure or exc)
        return tensor.tolist()

    def _raise_failures(self, failure: Optional[BaseException], phase: str) -> None:
        mine = None
        if failure is not None:
            mine = (type(failure).__name__, str(failure), _helix_kv_base(type(failure)))
        reports: List[Any] = [None] * self.size
        try:
            dist.all_gather_object(reports, mine, group=self.group)
        except RuntimeError as exc:
            raise self._lost_peer(exc) from (failure or exc)
        failed = {rank: report for rank, report in enumerate(reports) if report is not None}
        reasons = "\n".join(
            f"  rank {rank}: {name}: {message}" for rank, (name, message, _) in failed.items()
        )
        common = {base for _, _, base in failed.values()}
        error_type = InitSyncError
        if len(common) == 1:
            error_type = _COMMON_CAUSE.get(common.pop(), InitSyncError)
        ranks = ", ".join(str(rank) for rank in failed)
        error = error_type(
            f"helix_kv construction failed on CP rank(s) {ranks} of {self.size} during the "
            f"{phase} phase, so every rank stops:\n{reasons}"
        )
        vars(error).update(
            failed_ranks=sorted(failed),
            reasons={rank: f"{name}: {message}" for rank, (name, message, _) in failed.items()},
        )
        raise error from failure

    def _raise_check_disagreement(self, check: bool) -> None:
        flags: List[Any] = [None] * self.size
        try:
            dist.all_gather_object(flags, check, group=self.group)
        except RuntimeError as exc:
            raise self._lost_peer(exc) from exc
        on = [str(rank) for rank, flag in enumerate(flags) if flag]
        off = [str(rank) for rank, flag in enumerate(flags) if not flag]
        error = InitSyncConfigError(
            f"HELIX_KV_CHECK_SCHEDULE differs across the CP group (on for rank(s) "
            f"{', '.join(on)}, off for rank(s) {', '.join(off)}): the check is a collective "
            "every rank must run; set it to the same value on every rank"
        )
        vars(error).update(failed_ranks=[int(r) for r in (off if len(off) <= len(on) else on)])
        raise error

    def _lost_peer(self, exc: BaseException) -> InitSyncError:
        return InitSyncError(
            f"helix_kv init sync on CP rank {self.rank} of {self.size} failed: a peer rank "
            "died or did not reach the sync within the process group's timeout "
            f"({type(exc).__name__}: {exc})"
        )


def _helix_kv_base(cls: Type[BaseException]) -> str:
    """The name of the helix_kv error class a failure counts as (``""`` for foreign errors)."""
    for base in (ConfigGuardError, ConfigError, HelixKVError):
        if issubclass(cls, base):
            return base.__name__
    return ""
