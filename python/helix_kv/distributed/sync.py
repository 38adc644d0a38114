"""Construction-time agreement across a CP group: KV quota, configuration and init status.

Construction succeeds on every rank or raises on every rank. Each phase runs its local work
under ``try``, then every rank enters the same collective whether its work failed or not, so a
failure on one rank never leaves its peers waiting in a later collective. When any rank
failed, the ranks gather each other's reasons and all raise an :class:`InitSyncError` naming
the failing ranks. The quota collective also compares a fingerprint of every configuration
field the ranks must share (:class:`ConfigIdentity`); on a difference the ranks gather each
other's fields and all raise an :class:`InitSyncConfigMismatchError` naming the ranks and the
fields, with their values.

Timeouts: these collectives (and the schedule check's) run on the caller's process group and
are bounded by its timeout, set with ``torch.distributed.init_process_group(timeout=...)`` or
``new_group(timeout=...)``: gloo enforces it on every collective; NCCL enforces it through its
watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default), which aborts the communicator.
A rank that dies or stalls before a sync makes its peers raise :class:`InitSyncError` when the
collective fails or times out.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from helix_kv.distributed.group import ProcessGroup, collective_device
from helix_kv.errors import (
    ConfigError,
    ConfigGuardError,
    HelixKVError,
    InitSyncConfigError,
    InitSyncConfigGuardError,
    InitSyncConfigMismatchError,
    InitSyncError,
)

logger = logging.getLogger("helix_kv")

_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class ConfigIdentity:
    """What one rank was built from: the CP rank and size its scheduler was given, and every
    field the group must agree on (:func:`helix_kv.distributed.config.group_fields`)."""

    cp_rank: int
    cp_size: int
    fields: tuple[tuple[str, Any], ...]

    @property
    def fingerprint(self) -> int:
        """A stable 64-bit hash of ``fields`` as a signed int64 (the same in every process,
        unlike ``hash()``)."""
        digest = hashlib.blake2b(repr(self.fields).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)


#: The error raised when every failing rank failed with the same configuration error class.
_COMMON_CAUSE: dict[str, type[InitSyncError]] = {
    "ConfigGuardError": InitSyncConfigGuardError,
    "ConfigError": InitSyncConfigError,
}


class GroupSync:
    """Agreement collectives of one rank; with one rank they only re-raise local failures.

    ``rank`` and ``size`` are read from ``group`` itself (``0`` and ``1`` without one), so
    the configuration check can compare them with the ``cp_rank``/``cp_size`` a rank was
    built with.
    """

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.size = 0, 1
        if group is not None:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def agree_quota(
        self,
        local_superblocks: int | None,
        check: bool,
        failure: BaseException | None,
        identity: ConfigIdentity | None = None,
        local_host_superblocks: int = 0,
    ) -> tuple[int, bool, int]:
        """The group's minimum KV superblocks, its (verified identical) configuration and
        schedule-check setting, and its minimum host-tier superblocks, after the configuration
        phase; raises on every rank if any rank failed or the ranks' configurations differ.

        One all-reduce MIN of eight int64: ``superblocks``; ``host superblocks`` (each rank's
        host byte budget in whole host pages: a host superblock is one host page on every
        rank, so the group takes the smallest); ``-status`` (so MIN yields the
        highest status); ``check`` and ``-check`` (MIN and MAX of the setting);
        ``fingerprint`` and ``~fingerprint`` of ``identity`` (MIN and, complemented, MAX:
        equal on every rank iff they agree); ``-misplaced`` (whether this rank's ``cp_rank``
        or ``cp_size`` is not its place in the group). ``identity`` may be ``None`` only on a
        rank that failed.
        """
        place = (self.rank, self.size)
        misplaced = identity is not None and (identity.cp_rank, identity.cp_size) != place
        if self.size == 1:
            if failure is not None:
                raise failure
            assert local_superblocks is not None
            if misplaced:
                assert identity is not None
                raise config_mismatch([self._report(identity)])
            return local_superblocks, check, local_host_superblocks
        offered = _INT64_MAX if local_superblocks is None else local_superblocks
        host_offered = _INT64_MAX if failure is not None else local_host_superblocks
        flag = int(check)
        fp = 0 if identity is None else identity.fingerprint
        values = self._all_reduce_min(
            [
                offered,
                host_offered,
                -int(failure is not None),
                flag,
                -flag,
                fp,
                ~fp,
                -int(misplaced),
            ],
            failure,
        )
        (
            superblocks,
            host_superblocks,
            neg_status,
            check_min,
            neg_check_max,
            fp_min,
            not_fp_max,
            neg_misplaced,
        ) = values
        if neg_status < 0:
            self._raise_failures(failure, "configuration")
        if fp_min != ~not_fp_max or neg_misplaced < 0:
            assert identity is not None  # only a failing rank has none
            self._raise_config_mismatch(identity)
        if check_min != -neg_check_max:
            self._raise_check_disagreement(check)
        return superblocks, bool(check_min), host_superblocks

    def agree_status(self, failure: BaseException | None, phase: str) -> None:
        """All-reduce MAX of a status code (0 = ok) after ``phase``; raises on every rank if
        any rank failed."""
        if self.size == 1:
            if failure is not None:
                raise failure
            return
        (neg_status,) = self._all_reduce_min([-int(failure is not None)], failure)
        if neg_status < 0:
            self._raise_failures(failure, phase)

    def _all_reduce_min(self, values: list[int], failure: BaseException | None) -> list[int]:
        assert self.group is not None
        tensor = torch.tensor(values, dtype=torch.int64, device=collective_device(self.group))
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as exc:
            raise self._lost_peer(exc) from (failure or exc)
        return tensor.tolist()

    def _raise_failures(self, failure: BaseException | None, phase: str) -> None:
        mine = None
        if failure is not None:
            mine = (type(failure).__name__, str(failure), _helix_kv_base(type(failure)))
        reports: list[Any] = [None] * self.size
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
        raise error_type(
            f"helix_kv construction failed on CP rank(s) {ranks} of {self.size} during the "
            f"{phase} phase, so every rank stops:\n{reasons}",
            failed_ranks=sorted(failed),
            reasons={rank: f"{name}: {message}" for rank, (name, message, _) in failed.items()},
        ) from failure

    def _report(self, identity: ConfigIdentity) -> dict[str, Any]:
        return {
            "group_rank": self.rank,
            "group_size": self.size,
            "cp_rank": identity.cp_rank,
            "cp_size": identity.cp_size,
            "fields": identity.fields,
        }

    def _raise_config_mismatch(self, identity: ConfigIdentity) -> None:
        reports: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(reports, self._report(identity), group=self.group)
        except RuntimeError as exc:
            raise self._lost_peer(exc) from exc
        raise config_mismatch(reports)

    def _raise_check_disagreement(self, check: bool) -> None:
        flags: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(flags, check, group=self.group)
        except RuntimeError as exc:
            raise self._lost_peer(exc) from exc
        on = [str(rank) for rank, flag in enumerate(flags) if flag]
        off = [str(rank) for rank, flag in enumerate(flags) if not flag]
        raise InitSyncConfigError(
            f"HELIX_KV_CHECK_SCHEDULE differs across the CP group (on for rank(s) "
            f"{', '.join(on)}, off for rank(s) {', '.join(off)}): the check is a collective "
            "every rank must run; set it to the same value on every rank",
            failed_ranks=[int(r) for r in (off if len(off) <= len(on) else on)],
        )

    def _lost_peer(self, exc: BaseException) -> InitSyncError:
        return InitSyncError(
            f"helix_kv init sync on CP rank {self.rank} of {self.size} failed: a peer rank "
            "died or did not reach the sync within the process group's timeout "
            f"({type(exc).__name__}: {exc})"
        )


def config_mismatch(reports: Sequence[dict[str, Any]]) -> InitSyncConfigMismatchError:
    """The error every rank raises for the gathered ``reports`` (one per group rank, in rank
    order: its ``group_rank``, ``group_size``, ``cp_rank``, ``cp_size`` and ``fields``)."""
    everyone = range(len(reports))
    per_field: dict[str, dict[int, Any]] = {}
    for rank, report in enumerate(reports):
        for name, value in report["fields"]:
            per_field.setdefault(name, {})[rank] = value
    fields = {
        name: {rank: values.get(rank, _ABSENT) for rank in everyone}
        for name, values in per_field.items()
        if len(values) < len(reports) or len(set(values.values())) > 1
    }
    # Ranks outside the largest agreeing set (ties: the set holding the lowest rank).
    agreeing: dict[tuple[tuple[str, Any], ...], list[int]] = {}
    for rank, report in enumerate(reports):
        agreeing.setdefault(tuple(report["fields"]), []).append(rank)
    majority = max(agreeing.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    differing = {rank for rank in everyone if rank not in majority}
    reference = min(majority)
    reasons: dict[int, list[str]] = {rank: [] for rank in everyone}
    for name, values in fields.items():
        for rank in differing:
            if values[rank] != values[reference]:
                reasons[rank].append(
                    f"{name} = {values[rank]!r} (rank {reference}: {values[reference]!r})"
                )
    # cp_rank / cp_size must be the rank's place in the group (compared per rank, not across).
    notes: dict[str, str] = {}
    for key, place in (("cp_rank", "group_rank"), ("cp_size", "group_size")):
        wrong = [rank for rank, report in enumerate(reports) if report[key] != report[place]]
        if wrong:
            fields[key] = {rank: report[key] for rank, report in enumerate(reports)}
            differing.update(wrong)
            what = place.replace("_", " ")
            notes[key] = f"must equal the {what}: " + ", ".join(
                f"rank {rank} has {reports[rank][place]}" for rank in wrong
            )
            for rank in wrong:
                reasons[rank] = [r for r in reasons[rank] if not r.startswith(f"{key} = ")]
                reasons[rank].append(
                    f"{key} = {reports[rank][key]}, not its {what} {reports[rank][place]}"
                )
    ranks = sorted(differing)
    others = [rank for rank in everyone if rank not in differing]
    lines = [
        "helix_kv construction stopped on every CP rank: the ranks were built from different "
        f"configurations; rank(s) {_ranks(ranks)} of {len(reports)} differ"
        + (f" from rank(s) {_ranks(others)}" if others else "")
        + f" in {', '.join(fields)}"
    ]
    for name, values in fields.items():
        by_value: dict[Any, list[int]] = {}
        for rank, value in values.items():
            by_value.setdefault(value, []).append(rank)
        shown = " | ".join(f"{value!r} on rank(s) {_ranks(rs)}" for value, rs in by_value.items())
        lines.append(f"  {name}: {shown}" + (f" ({notes[name]})" if name in notes else ""))
    lines.append(
        "Build every rank from the same EngineConfig (only kv_budget_bytes may differ: the "
        "group agrees on the smallest), with cp_rank and cp_size its place in the group. Ranks "
        "that disagree place and schedule tokens differently: KV is dropped or written twice."
    )
    return InitSyncConfigMismatchError(
        "\n".join(lines),
        ranks=ranks,
        fields=fields,
        reasons={rank: "; ".join(reasons[rank]) for rank in ranks},
    )


class _Absent:
    """The value of a field a rank did not report (another helix_kv version)."""

    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def _helix_kv_base(cls: type[BaseException]) -> str:
    """The name of the helix_kv error class a failure counts as (``""`` for foreign errors)."""
    for base in (ConfigGuardError, ConfigError, HelixKVError):
        if issubclass(cls, base):
            return base.__name__
    return ""
