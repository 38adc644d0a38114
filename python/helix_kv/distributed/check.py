"""Per-step schedule consistency check across the ranks of a CP group.

Every rank's scheduler must make bit-identical decisions. :class:`ScheduleChecker` compares
the 64-bit digest of each rank's :class:`~helix_kv.ScheduleOutput` with one all-reduce MIN of
two int64 (``digest`` and ``~digest``: the minimum of the second is ``~max``), so the happy path
costs one small collective per step. On a mismatch every rank gathers the ranks' summaries and
raises the same :class:`~helix_kv.ScheduleMismatchError`, naming the ranks and fields that
differ.
"""

from __future__ import annotations

import time
import warnings
import zlib
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch.distributed as dist

from helix_kv import ScheduleMismatchError
from helix_kv.distributed.group import ProcessGroup, resolve_group
from helix_kv.distributed.reduce import HostMinAllReduce

#: Longest field value quoted in an error message (the full summaries ride on the error).
_QUOTE_CHARS = 160


def to_int64(value: int) -> int:
    """An unsigned 64-bit value as the signed int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


class ScheduleChecker:
    """Compares each step's schedule digest across the ranks of ``group`` (default: world).

    ``check(output)`` must be called by every rank for every step, in the same order. With one
    rank there is nothing to compare: the checker warns once, at construction, and ``check``
    does nothing (``enabled`` is False).

    On NCCL the checker runs on its own communicator over the same ranks (so constructing it
    is collective; ``connect=False`` defers that part to :meth:`connect`) and replays a CUDA
    graph on a side stream: the check waits for its own collective only, never for compute
    queued on the current stream or for the model's collectives (see
    :mod:`helix_kv.distributed.reduce`). A rank that stops calling ``check``
    leaves its peers blocked until ``timeout`` (default: the group's own timeout), after which
    they raise.
    """

    def __init__(
        self,
        group: Optional[ProcessGroup] = None,
        *,
        timeout: Optional[timedelta] = None,
        connect: bool = True,
    ) -> None:
        self.group, self.rank, self.size = resolve_group(group)
        self.enabled = self.size > 1
        self._pending_update: Optional[Tuple[int, tuple]] = None
        #: Comparisons done and their wall time in seconds, for metrics (the clock never reaches
        #: a decision). Both only grow; a mismatch's gather is not timed.
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

    def record_update(self, sample_ids: Any, tokens: Any, eos: Optional[Any] = None) -> None:
        """Folds the tokens fed to ``update`` (one per ``sample_ids`` entry) into the next
        ``check``.

        A sampled token that differs between ranks is then caught at the very next check, even
        when the request finishes in that update and never reaches another schedule.
        """
        if not self.enabled:
            return
        tokens = np.array(tokens, dtype=np.int32)
        flags = None if eos is None else np.array(eos, dtype=np.bool_)
        fingerprint = zlib.crc32(tokens.tobytes()) << 32
        if flags is not None:
            fingerprint |= zlib.crc32(flags.tobytes())
        self._pending_update = (fingerprint, (np.array(sample_ids), tokens, flags))

    def check(self, output: Any) -> None:
        """Raises :class:`~helix_kv.ScheduleMismatchError` on every rank if any two ranks'
        schedules for this step differ (or, after :meth:`record_update`, the tokens they fed)."""
        if not self.enabled:
            return
        started = time.perf_counter()
        value = output.digest
        if self._pending_update is not None:
            value ^= self._pending_update[0]
        value = to_int64(value)
        values = self._reduce.values
        values[0] = value
        values[1] = ~value
        self._reduce()
        agreed = values[0] == value and ~values[1] == value
        pending, self._pending_update = self._pending_update, None
        self.check_seconds += time.perf_counter() - started
        self.checks += 1
        if not agreed:
            self._raise_mismatch(output, pending)

    def _raise_mismatch(self, output: Any, pending: Optional[Tuple[int, tuple]]) -> None:
        record = {
            "rank": self.rank,
            "global_rank": dist.get_rank(),
            "step": int(output.step),
            "digest": int(output.digest),
            "summary": output.summary(),
            "fields": summary_fields(output, None if pending is None else pending[1]),
        }
        records: List[Any] = [None] * self.size
        dist.all_gather_object(records, record, group=self.group)
        error = ScheduleMismatchError(describe_mismatch(records))
        ranks, fields = divergence(records)
        summaries = {r["rank"]: r["summary"] for r in records}
        vars(error).update(step=int(output.step), ranks=ranks, fields=fields, summaries=summaries)
        raise error


def summary_fields(output: Any, sampled: Optional[tuple]) -> Dict[str, str]:
    """``output.summary()`` as ``{field: value}``, plus the token fields the summary leaves out
    (the digest covers them): context chunk tokens, decode input tokens and, when recorded,
    the tokens fed to the previous ``update``."""
    fields: Dict[str, str] = {}
    for line in output.summary().splitlines():
        name, _, value = line.partition(":")
        if name != "digest":
            fields[name.strip()] = value.strip()
    context_tokens = np.asarray(output.context_token_ids, dtype=np.int32)
    fields["context_tokens"] = (
        f"{context_tokens.size} tokens, crc32 {zlib.crc32(context_tokens.tobytes()):08x}"
    )
    fields["generation_input_tokens"] = " ".join(
        f"{rid}:{tok}"
        for rid, tok in zip(
            np.asarray(output.generation_ids).tolist(),
            np.asarray(output.generation_input_tokens).tolist(),
        )
    )
    if sampled is not None:
        ids, tokens, flags = sampled
        text = " ".join(f"{rid}:{tok}" for rid, tok in zip(ids.tolist(), tokens.tolist()))
        if flags is not None:
            ended = [str(rid) for rid, flag in zip(ids.tolist(), flags.tolist()) if flag]
            text += f" (eos: {' '.join(ended) or '-'})"
        fields["sampled_tokens"] = text
    return fields


def divergence(records: Sequence[Dict[str, Any]]) -> Tuple[List[int], List[str]]:
    """The ranks outside the largest agreeing set (ties: the set holding the lowest rank) and
    the fields in which they differ from it."""
    groups: Dict[Tuple[int, Tuple[Tuple[str, str], ...]], List[int]] = {}
    for record in records:
        key = (record["digest"], tuple(sorted(record["fields"].items())))
        groups.setdefault(key, []).append(record["rank"])
    majority = max(groups.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    reference = records[min(majority)]["fields"]
    ranks = sorted(r["rank"] for r in records if r["rank"] not in majority)
    fields: List[str] = []
    for record in records:
        if record["rank"] in majority:
            continue
        names = list(reference) + [n for n in record["fields"] if n not in reference]
        for name in names:
            if record["fields"].get(name) != reference.get(name) and name not in fields:
                fields.append(name)
    return ranks, fields


def describe_mismatch(records: Sequence[Dict[str, Any]]) -> str:
    """The error text: who disagrees, on what, with the differing values quoted."""
    ranks, fields = divergence(records)
    agreeing = [r["rank"] for r in records if r["rank"] not in ranks]
    reference = records[agreeing[0]]
    steps = sorted({r["step"] for r in records})
    step = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    lines = [
        f"CP ranks disagree on the schedule of {step}: rank(s) {_ranks(ranks)} differ from "
        f"rank(s) {_ranks(agreeing)} in {', '.join(fields) or 'fields outside the summary'}"
    ]
    for name in fields:
        shown = [reference] + [r for r in records if r["rank"] in ranks]
        values = [f"rank {r['rank']}: {_quote(r['fields'].get(name))}" for r in shown]
        lines.append(f"  {name}: " + " | ".join(values))
    lines.append("  digests: " + ", ".join(f"rank {r['rank']} {r['digest']:016x}" for r in records))
    lines.append(
        "Every decision must read only rank-invariant inputs; the requests, sampled tokens and "
        "config fed to each rank must be identical. Full summaries are on the error's "
        "`summaries` attribute."
    )
    return "\n".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def _quote(value: Optional[str]) -> str:
    if value is None:
        return "(absent)"
    if value == "":
        return "(none)"
    return value if len(value) <= _QUOTE_CHARS else value[: _QUOTE_CHARS - 3] + "..."
