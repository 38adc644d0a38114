"""Per-step schedule consistency check across the ranks of a CP group.

Every rank's scheduler must make bit-identical decisions. :class:`ScheduleChecker` compares
the 64-bit digest of each rank's :class:`~helix_kv.ScheduleOutput` with one all-reduce MIN of
two int64 (``digest`` and ``~digest``: the minimum of the second is ``~max``), so the happy path
costs one small collective per step. On a mismatch every rank gathers the ranks' outputs and
raises the same :class:`~helix_kv.ScheduleMismatchError` (built by
:func:`helix_kv.mismatch.schedule_mismatch`), naming the ranks and fields that differ.

The check comes in two halves so the collective can run under the step's model work:
:meth:`ScheduleChecker.start` (after ``schedule()``, before the step's work is queued) and
:meth:`ScheduleChecker.finish` (before the step's sampled tokens are committed by ``update``).
:class:`~helix_kv.distributed.HelixKVRank` calls them there; ``check`` is both at once.
"""

from __future__ import annotations

import time
import warnings
import zlib
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import numpy.typing as npt

from helix_kv.distributed.group import ProcessGroup, resolve_group
from helix_kv.distributed.reduce import HostMinAllReduce
from helix_kv.mismatch import schedule_mismatch

#: What ``record_update`` keeps of an update: sample ids, tokens and eos flags (or ``None``).
SampledTokens = tuple[npt.NDArray[Any], npt.NDArray[np.int32], Optional[npt.NDArray[np.bool_]]]

#: One recorded update: the step it closed (``None``: not given) and what it fed.
RecordedUpdate = tuple[Optional[int], SampledTokens]


#: int64 wrap-around of a 64-bit value (see :func:`to_int64`; :meth:`ScheduleChecker.start`
#: inlines it).
_SIGN = 1 << 63
_WRAP = 1 << 64


def to_int64(value: int) -> int:
    """An unsigned 64-bit value as the signed int64 with the same bits."""
    return value - _WRAP if value >= _SIGN else value


class ScheduleChecker:
    """Compares each step's schedule digest across the ranks of ``group`` (default: world).

    Every rank must check every step, in the same order, either with ``check(output)`` (the
    whole comparison, blocking) or split in two: :meth:`start` right after ``schedule()``
    sends this step's value into the collective and returns at once, and :meth:`finish`
    waits for the result and raises. Between the two the caller queues the step's model
    work, which then covers the collective's round trip. With one rank there is nothing to
    compare: the checker warns once, at construction, and every call does nothing
    (``enabled`` is False).

    At most one check is in flight: a :meth:`start` while one is in flight finishes that one
    first (so two steps scheduled back to back, one step ahead, are still both compared, in
    order, and the checker's communicator never runs two operations at once). A
    :meth:`finish` with nothing in flight does nothing (a caller may finish at every
    ``update`` without tracking whether a later ``start`` already did).

    On NCCL the checker runs on its own communicator over the same ranks (so constructing it
    is collective; ``connect=False`` defers that part to :meth:`connect`) and replays a CUDA
    graph on a side stream: the check waits for its own collective only, never for compute
    queued on the current stream or for the model's collectives (see
    :mod:`helix_kv.distributed.reduce`). On gloo :meth:`start` issues an asynchronous
    ``all_reduce`` and :meth:`finish` waits for it. A rank that stops checking leaves its
    peers blocked in :meth:`finish` until ``timeout`` (default: the group's own timeout),
    after which they raise.
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        *,
        timeout: timedelta | None = None,
        connect: bool = True,
    ) -> None:
        self.group, self.rank, self.size = resolve_group(group)
        self.enabled = self.size > 1
        #: Updates recorded since the last start, oldest first (usually one; an executor
        #: that scheduled one step ahead may close two steps before its next schedule).
        self._pending_updates: list[RecordedUpdate] = []
        #: Their fingerprint so far (:func:`updates_fingerprint`, folded as they come).
        self._tokens_crc = 0
        self._flags_crc = 0
        #: The check started and not finished yet: (output, value sent, its updates).
        self._in_flight: tuple[Any, int, list[RecordedUpdate]] | None = None
        #: Comparisons finished and the host time spent in them in seconds (start plus
        #: finish: a finish whose collective already completed costs next to nothing), for
        #: metrics (the clock never reaches a decision). Both only grow; a mismatch's gather
        #: is not timed.
        self.checks = 0
        self.check_seconds = 0.0
        if not self.enabled:
            warnings.warn(
                "helix_kv schedule check requested but it cannot apply: this CP group has one "
                "rank, so there is no other schedule to compare; the check is off",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        assert self.group is not None
        self._reduce = HostMinAllReduce(self.group, timeout, connect=connect)

    def connect(self) -> None:
        """The collective part of construction, when it was deferred with ``connect=False``:
        on NCCL, creating and warming up the checker's own communicator. Every rank of the
        group calls it; it does nothing on gloo, for a disabled checker, or once done.

        Deferring lets a caller first agree that every rank built the local part: a rank that
        failed before the collective part would leave its peers waiting inside it.
        """
        if self.enabled:
            self._reduce.connect()

    def record_update(
        self,
        sample_ids: Any,
        tokens: Any,
        eos: Any | None = None,
        *,
        step: int | None = None,
        accepted: Any | None = None,
    ) -> None:
        """Folds the tokens fed to ``update`` (one per ``sample_ids`` entry) into the next
        check; ``step``: the step that update closed, named in a mismatch report.

        A sampled token that differs between ranks is then caught at the very next check, even
        when the request finishes in that update and never reaches another schedule. In
        overlap mode (one step scheduled ahead) the update of step ``t`` follows the schedule
        of step ``t + 1``, so its tokens are compared at step ``t + 2``; every update recorded
        between two checks is compared, in order.

        The tokens and flags are copied (the caller may reuse its buffers) and folded into
        the fingerprint here, so :meth:`start` only XORs one integer into the digest.
        ``sample_ids`` is not copied (it only names the tokens in a report): pass an
        array nobody overwrites, such as the step's ``ScheduleOutput.sample_ids``.
        """
        if not self.enabled:
            return
        tokens = np.array(tokens, dtype=np.int32, order="C")
        self._tokens_crc = zlib.crc32(tokens.data, self._tokens_crc)
        flags = None
        if eos is not None:
            flags = np.array(eos, dtype=np.bool_, order="C")
            self._flags_crc = zlib.crc32(flags.data, self._flags_crc)
        if accepted is not None:
            # The accepted draft counts decide what the ledger keeps: folded with the flags.
            counts = np.array(accepted, dtype=np.int64, order="C")
            self._flags_crc = zlib.crc32(b"accepted" + counts.tobytes(), self._flags_crc)
        self._pending_updates.append((step, (np.asarray(sample_ids), tokens, flags)))

    @property
    def in_flight_step(self) -> int | None:
        """The step whose check was started and not finished (``None``: none)."""
        return None if self._in_flight is None else int(self._in_flight[0].step)

    def start(self, output: Any) -> None:
        """Sends this step's value (the digest of ``output`` and the fingerprint of the
        updates recorded since the last start) into the collective and returns without
        waiting for it; :meth:`finish` completes the comparison. A check still in flight is
        finished first, so this raises what that :meth:`finish` raises.

        ``output`` (kept until :meth:`finish`, for a mismatch report) must not change."""
        if not self.enabled:
            return
        if self._in_flight is not None:
            self.finish()
        started = time.perf_counter()
        value = output.digest ^ ((self._tokens_crc << 32) | self._flags_crc)
        if value >= _SIGN:
            value -= _WRAP
        values = self._reduce.values
        values[0] = value
        values[1] = ~value
        self._reduce.start()
        self._in_flight = (output, value, self._pending_updates)
        self._pending_updates = []
        self._tokens_crc = self._flags_crc = 0
        self.check_seconds += time.perf_counter() - started

    def finish(self) -> None:
        """Waits for the check started by :meth:`start` and raises
        :class:`~helix_kv.ScheduleMismatchError` on every rank if any two ranks' values
        differed (the schedules of that step, or the tokens recorded before it). Does nothing
        when no check is in flight (never started, or already finished)."""
        in_flight = self._in_flight
        if in_flight is None:
            return
        started = time.perf_counter()
        self._in_flight = None  # a timeout below leaves nothing to finish (the group is stuck)
        self._reduce.wait()
        output, value, pending = in_flight
        values = self._reduce.values
        agreed = values[0] == value and ~values[1] == value
        self.check_seconds += time.perf_counter() - started
        self.checks += 1
        if not agreed:
            self._raise_mismatch(output, pending)

    def check(self, output: Any) -> None:
        """Raises :class:`~helix_kv.ScheduleMismatchError` on every rank if any two ranks'
        schedules for this step differ (or, after :meth:`record_update`, the tokens they fed):
        :meth:`start` then :meth:`finish`."""
        self.start(output)
        self.finish()

    def _raise_mismatch(self, output: Any, pending: list[RecordedUpdate]) -> None:
        # Every rank's whole output (pickled) and the tokens it fed: the same description as
        # the in-process group's, from the core's own comparison.
        # Gathered over the check's own communicator (NCCL): the step's model work, queued
        # on the caller's streams and group with a schedule that differs, may never finish.
        records = self._reduce.all_gather_object(
            {"output": output, "extra": updates_fields(pending)}
        )
        raise schedule_mismatch([r["output"] for r in records], [r["extra"] for r in records])


def updates_fingerprint(updates: list[RecordedUpdate]) -> int:
    """A 64-bit fingerprint of the recorded updates, in order (0 for none): a CRC chained over
    the tokens (high half) and over the eos flags (low half). The step numbers are left out:
    they follow from the schedules, which the digest compares.

    :meth:`ScheduleChecker.record_update` folds the same value as updates come. A CRC-32
    detects every error burst of up to 32 bits, so two runs of tokens that differ in any one
    token (or any one flag) always have different fingerprints."""
    tokens_crc = flags_crc = 0
    for _, (_, tokens, flags) in updates:
        tokens_crc = zlib.crc32(np.ascontiguousarray(tokens, dtype=np.int32).data, tokens_crc)
        if flags is not None:
            flags_crc = zlib.crc32(np.ascontiguousarray(flags, dtype=np.bool_).data, flags_crc)
    return (tokens_crc << 32) | flags_crc


def sampled_fields(sampled: SampledTokens | None, step: int | None = None) -> dict[str, str]:
    """The tokens (and eos flags) fed to the previous ``update`` as the ``sampled_tokens``
    field the ranks must agree on, prefixed with the step they were sampled in when
    ``step`` is given; nothing when none were recorded."""
    if sampled is None:
        return {}
    ids, tokens, flags = sampled
    text = " ".join(f"{rid}:{tok}" for rid, tok in zip(ids.tolist(), tokens.tolist()))
    if flags is not None:
        ended = [str(rid) for rid, flag in zip(ids.tolist(), flags.tolist()) if flag]
        text += f" (eos: {' '.join(ended) or '-'})"
    return {"sampled_tokens": text if step is None else f"step {step}: {text}"}


def updates_fields(updates: list[RecordedUpdate]) -> dict[str, str]:
    """:func:`sampled_fields` of every update recorded since the last check, joined with
    ``"; "`` (two when one step was scheduled ahead and two closed before the check)."""
    texts = [sampled_fields(sampled, step)["sampled_tokens"] for step, sampled in updates]
    return {"sampled_tokens": "; ".join(texts)} if texts else {}
