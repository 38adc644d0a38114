"""A whole CP group in one process: one :class:`helix_kv.Scheduler` per rank, fed the same
calls, compared after every call.

Each rank's scheduler is built from ``config.with_rank(r)``. After every ``schedule()`` the
group checks that the ranks' digests (which cover every rank-invariant field) agree, and that
the per-rank fields are consistent with the Helix layout (exactly one rank, the owner, appends
each decode token; the per-rank lengths add up to the global length). A divergence raises
:class:`helix_kv.ScheduleMismatchError` naming the ranks and the fields (with the differing
summary entries), built by :func:`helix_kv.mismatch.schedule_mismatch` like the error a real
group raises through its schedule check.

Every step costs one core call to schedule every rank and one to update them
(:func:`helix_kv._core.schedule_ranks`, :func:`helix_kv._core.update_ranks`), each of which
also compares the ranks' results; the comparison here, which builds the message, runs only
when they disagree, so the message is the one it always was. A request is added to every rank
in one call too (:func:`helix_kv._core.add_request_ranks`), which checks its arguments and keys
its prompt for the prefix cache once.

A group may also run a subset of the ranks (``ranks=``): every scheduler holds every request's
tokens, so memory and time grow with the ranks run, and a capacity-planning run at a large
``cp_size`` need not pay for all of them. The ranks run are then compared with each other every
step, and each one's per-rank fields are checked against the layout's own lengths for that
rank (the sums over all ranks need them all); the ranks left out are not verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, cast

import numpy as np
import numpy.typing as npt

from helix_kv._core import (
    Layout,
    RequestOutput,
    ScheduleOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerMetrics,
    add_request_ranks,
    schedule_ranks,
    update_ranks,
)
from helix_kv._renamed import Renamed
from helix_kv.errors import ConfigError, ScheduleMismatchError
from helix_kv.mismatch import schedule_mismatch
from helix_kv.types import FlagArray, IntArray, TokenArray

__all__ = ["SimulatedCPGroup"]


def _short(values: npt.NDArray[Any], limit: int = 12) -> str:
    shown = " ".join(str(v) for v in values[:limit].tolist())
    more = f" ... ({values.size} values)" if values.size > limit else ""
    return shown + more


class SimulatedCPGroup:
    """``config.cp_size`` schedulers, one per rank (or one per rank of ``ranks``), driven with
    identical calls.

    It satisfies :class:`helix_kv.contract.SchedulerProtocol` like one rank's
    :class:`helix_kv.Scheduler`: each call goes to every rank run, as given (each rank applies
    the argument rules itself), and returns the first rank's result (rank 0's unless ``ranks``
    leaves it out) once the ranks are seen to agree.

    Args:
        config: the configuration of any rank; each rank gets ``config.with_rank(r)``.
        check_rank_fields: also check the per-rank fields against the Helix layout.
        ranks: the ranks to run, in increasing order (default: all ``cp_size`` of them).
            Only these get a scheduler and are compared; ``schedulers``,
            :meth:`schedule_per_rank` and :meth:`state_digests` follow this order. An empty,
            unordered or out-of-range list raises :class:`helix_kv.ConfigError`.

    ``cp_size`` is the group's size (``len(group)``; ``cp``: its deprecated name, kept for one
    release).
    """

    cp = Renamed[int]("cp_size")

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        check_rank_fields: bool = True,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        self.cp_size = int(config.cp_size)
        self.check_rank_fields = check_rank_fields
        self.ranks: tuple[int, ...] = (
            tuple(range(self.cp_size)) if ranks is None else _checked_ranks(ranks, self.cp_size)
        )
        self.schedulers: list[Scheduler] = [Scheduler(config.with_rank(r)) for r in self.ranks]

    @property
    def runs_every_rank(self) -> bool:
        """Whether every rank of the group has a scheduler here (not a subset)."""
        return len(self.ranks) == self.cp_size

    def __len__(self) -> int:
        return self.cp_size

    def __repr__(self) -> str:
        ranks = "" if self.runs_every_rank else f", ranks={list(self.ranks)}"
        return f"SimulatedCPGroup(cp_size={self.cp_size}{ranks}, schedulers={self.schedulers!r})"

    # -- calls fed to every rank --------------------------------------------------------

    def _on_every_rank(self, call: str, action: Callable[[Scheduler], Any]) -> list[Any]:
        """Runs ``action`` on every rank; ranks must all succeed or all fail alike."""
        results: list[Any] = []
        errors: list[BaseException | None] = []
        for scheduler in self.schedulers:
            try:
                results.append(action(scheduler))
                errors.append(None)
            except Exception as error:  # compared below, re-raised unchanged if all agree
                results.append(None)
                errors.append(error)
        return self._settle(call, results, errors)

    def _settled(self, call: str, outcomes: Sequence[Any]) -> list[Any]:
        """:meth:`_settle` of what the core's group calls (``schedule_ranks``,
        ``update_ranks``) return: each rank's result, or the exception it raised."""
        errors = [o if isinstance(o, Exception) else None for o in outcomes]
        results = [None if e is not None else o for o, e in zip(outcomes, errors)]
        return self._settle(call, results, errors)

    def _settle(
        self, call: str, results: list[Any], errors: Sequence[BaseException | None]
    ) -> list[Any]:
        """The results of ``call`` on every rank if all succeeded; the error unchanged if all
        failed alike; else a mismatch naming the ranks."""
        outcomes = [None if e is None else (type(e), str(e)) for e in errors]
        if all(outcome == outcomes[0] for outcome in outcomes):
            if errors[0] is not None:
                raise errors[0]
            return results
        described = "; ".join(
            f"rank {rank}: " + ("ok" if e is None else f"{type(e).__name__}: {e}")
            for rank, e in zip(self.ranks, errors)
        )
        ranks = [r for r, outcome in zip(self.ranks, outcomes) if outcome != outcomes[0]]
        raise self._mismatch(
            f"{call}() ended differently on the CP ranks: {described}", None, ranks, [call], {}
        )

    def add_request(
        self,
        request_id: int,
        prompt: TokenArray,
        max_new_tokens: int,
        priority: int = 0,
        *,
        cache_salt: str | bytes | None = None,
    ) -> None:
        """Queues the request on every rank."""
        # One core call adds it to every rank, checking the arguments and keying the prompt
        # for the prefix cache once (the keys are a pure function of the tokens and salt).
        outcomes = add_request_ranks(
            self.schedulers, request_id, prompt, max_new_tokens, priority, cache_salt=cache_salt
        )
        self._settled("add_request", outcomes)

    def propose_drafts(self, request_ids: IntArray, counts: IntArray, tokens: TokenArray) -> None:
        """Proposes the same draft tokens to every rank (see
        :meth:`helix_kv.Scheduler.propose_drafts`)."""
        self._on_every_rank(
            "propose_drafts", lambda s: s.propose_drafts(request_ids, counts, tokens)
        )

    def reset_prefix_cache(self) -> int:
        """Drops every unreferenced cached superblock on every rank (they must agree)."""
        dropped = self._on_every_rank("reset_prefix_cache", lambda s: s.reset_prefix_cache())
        assert len(set(dropped)) == 1, f"ranks dropped {dropped} superblocks"
        return int(dropped[0])

    def schedule(self) -> ScheduleOutput:
        """Schedules a step on every rank, checks agreement, returns rank 0's output (every
        rank-invariant field is the same on every rank; :meth:`schedule_per_rank` returns
        each rank's)."""
        return self.schedule_per_rank()[0]

    def schedule_per_rank(self) -> list[ScheduleOutput]:
        """Schedules a step on every rank, checks agreement, returns the per-rank outputs
        (those of :attr:`ranks`, in rank order)."""
        # One core call schedules every rank and compares them; the detailed comparison (and
        # its message) runs only where they do not agree.
        layout = self.config.layout if self.check_rank_fields else None
        outcomes, agree = schedule_ranks(self.schedulers, layout, self.ranks)
        if agree:
            return cast("list[ScheduleOutput]", outcomes)  # every one succeeded
        outputs: list[ScheduleOutput] = self._settled("schedule", outcomes)
        self._check(outputs)
        return outputs

    def update(
        self,
        tokens: TokenArray,
        eos: FlagArray | None = None,
        accepted: IntArray | None = None,
    ) -> npt.NDArray[np.uint64]:
        """Feeds the same sampled tokens (eos flags, accepted draft counts) to every rank;
        returns the finished ids (equal on every rank)."""
        outcomes, agree = update_ranks(self.schedulers, tokens, eos, accepted)
        if not agree:
            finished = self._settled("update", outcomes)
            self._agree("update", finished, "finished_ids")
        return cast("npt.NDArray[np.uint64]", outcomes[0])

    def revert(self) -> npt.NDArray[np.uint64]:
        """Reverts the scheduled step on every rank; returns the ids of requests whose
        abort was requested while it was pending (aborted now; equal on every rank)."""
        aborted = self._on_every_rank("revert", Scheduler.revert)
        self._agree("revert", aborted, "aborted_ids")
        result: npt.NDArray[np.uint64] = aborted[0]
        return result

    def abort(self, request_id: int) -> bool:
        """Aborts a request on every rank (see :meth:`helix_kv.Scheduler.abort`); returns
        whether it was live."""
        return bool(self.abort_many([request_id])[0])

    def abort_many(self, request_ids: IntArray) -> npt.NDArray[np.bool_]:
        """Aborts requests on every rank, in order (see
        :meth:`helix_kv.Scheduler.abort_many`); checks the ranks' answers and state digests
        agree, and returns the answers (per id, whether it was live)."""
        live = self._on_every_rank("abort_many", lambda s: s.abort_many(request_ids))
        self._agree("abort_many", live, "live ids")
        digests = [np.asarray([d], dtype=np.uint64) for d in self.state_digests()]
        self._agree("abort_many", digests, "state_digest")
        answer: npt.NDArray[np.bool_] = live[0]
        return answer

    def take_output(self, request_id: int) -> RequestOutput:
        """:meth:`~helix_kv.contract.SchedulerProtocol.take_output`, checked equal on
        every rank (tokens and finish reason)."""
        outputs = self._on_every_rank("take_output", lambda s: s.take_output(request_id))
        self._agree("take_output", [o.token_ids for o in outputs], "generated_tokens")
        reasons = [np.asarray([o.finish_reason]) for o in outputs]
        self._agree("take_output", reasons, "finish_reason")
        output: RequestOutput = outputs[0]
        return output

    # -- views (the first rank run; the state digests agree after every call) ------------

    def has_unfinished(self) -> bool:
        """:meth:`~helix_kv.contract.SchedulerProtocol.has_unfinished` (the first rank's)."""
        return self.schedulers[0].has_unfinished()

    def pending_steps(self) -> int:
        """:meth:`~helix_kv.contract.SchedulerProtocol.pending_steps`, checked equal on
        every rank."""
        counts = [np.asarray([s.pending_steps()]) for s in self.schedulers]
        self._agree("pending_steps", counts, "pending_steps")
        return int(counts[0][0])

    def metrics(self) -> SchedulerMetrics:
        """:meth:`~helix_kv.contract.SchedulerProtocol.metrics` (the first rank's)."""
        return self.schedulers[0].metrics()

    def spec_decode_accepted_per_position(self) -> npt.NDArray[np.uint64]:
        """How many times each draft position was accepted (see
        :meth:`helix_kv.Scheduler.spec_decode_accepted_per_position`; checked equal on every
        rank)."""
        counts = [s.spec_decode_accepted_per_position() for s in self.schedulers]
        self._agree("spec_decode_accepted_per_position", counts, "accepted_per_position")
        result: npt.NDArray[np.uint64] = counts[0]
        return result

    @property
    def num_running(self) -> int:
        """:attr:`~helix_kv.contract.SchedulerProtocol.num_running` (the first rank's)."""
        return self.schedulers[0].num_running

    @property
    def num_waiting(self) -> int:
        """:attr:`~helix_kv.contract.SchedulerProtocol.num_waiting` (the first rank's)."""
        return self.schedulers[0].num_waiting

    def state_digests(self) -> list[int]:
        """Every rank's ``state_digest()`` (those of :attr:`ranks`; equal unless something
        diverged)."""
        return [s.state_digest() for s in self.schedulers]

    # -- checks -------------------------------------------------------------------------

    def _mismatch(
        self,
        headline: str,
        step: int | None,
        ranks: Sequence[int],
        fields: Sequence[str],
        summaries: dict[int, str],
    ) -> ScheduleMismatchError:
        return ScheduleMismatchError(
            headline, step=step, ranks=ranks, fields=fields, summaries=summaries
        )

    def _agree(self, call: str, values: Sequence[npt.NDArray[Any]], what: str) -> None:
        differing = [i for i, v in enumerate(values) if not _same(v, values[0])]
        if differing:
            first = self.ranks[0]
            ranks = [self.ranks[i] for i in differing]
            shown = [0, *differing]
            detail = "; ".join(f"rank {self.ranks[i]}: {_short(values[i])}" for i in shown)
            raise self._mismatch(
                f"{call}(): ranks {ranks} differ from rank {first} in {what}: {detail}",
                None,
                ranks,
                [what],
                {},
            )

    def _check(self, outputs: Sequence[ScheduleOutput]) -> None:
        # The digest covers every rank-invariant field: equal digests, equal schedules. The
        # field-by-field comparison (and any array) is only built on a mismatch.
        digest = outputs[0].digest
        if any(output.digest != digest for output in outputs[1:]):
            raise schedule_mismatch(outputs, ranks=self.ranks)
        if self.check_rank_fields:
            self._check_rank_fields(outputs)

    def _check_rank_fields(self, outputs: Sequence[ScheduleOutput]) -> None:
        reference = outputs[0]
        positions = np.asarray(reference.generation_positions, dtype=np.int64)
        if positions.size == 0:
            return
        layout: Layout = self.config.layout
        owners = layout.owner_ranks(positions).astype(np.int64)
        problems: list[str] = []
        # rank-invariant, so covered by the digests already compared: one rank's will do
        if not np.array_equal(reference.generation_owner_ranks, owners):
            problems.append("generation_owner_ranks is not the layout's owner of the position")
        if self.runs_every_rank:
            problems += self._every_rank_problems(outputs, positions, owners)
        else:
            problems += self._subset_problems(outputs, positions, owners)
        if problems:
            step = int(reference.step)
            raise self._mismatch(
                f"step {step}: per-rank fields are inconsistent: " + "; ".join(problems),
                step,
                list(self.ranks),
                list(ScheduleOutput.PER_RANK_FIELDS),
                {rank: output.summary() for rank, output in zip(self.ranks, outputs)},
            )

    def _every_rank_problems(
        self,
        outputs: Sequence[ScheduleOutput],
        positions: npt.NDArray[np.int64],
        owners: npt.NDArray[np.int64],
    ) -> list[str]:
        """Every rank is here: the lengths must add up over the ranks."""
        # np.array builds the (ranks, requests) arrays in C; np.stack loops in Python
        active = np.array([o.generation_active for o in outputs], dtype=bool)
        after = np.array([o.generation_local_lens for o in outputs], dtype=np.int64)
        before = np.array([o.generation_past_seen_lens for o in outputs], dtype=np.int64)
        problems: list[str] = []
        expected_active = owners[None, :] == np.arange(self.cp_size)[:, None]
        if not np.array_equal(active, expected_active):
            problems.append("generation_active is not exactly the owner rank")
        if not np.array_equal(after.sum(axis=0), positions + 1):
            problems.append("generation_local_lens do not add up to position + 1")
        if not np.array_equal(before.sum(axis=0), positions):
            problems.append("generation_past_seen_lens do not add up to the position")
        if not np.array_equal(after - before, expected_active.astype(np.int64)):
            problems.append("only the owner rank's length may grow by the decode token")
        return problems

    def _subset_problems(
        self,
        outputs: Sequence[ScheduleOutput],
        positions: npt.NDArray[np.int64],
        owners: npt.NDArray[np.int64],
    ) -> list[str]:
        """Some ranks are missing, so nothing adds up over the group: each rank run must hold
        exactly what the layout gives that rank, before and after the decode token."""
        layout: Layout = self.config.layout
        problems: list[str] = []
        for rank, output in zip(self.ranks, outputs):
            active = np.asarray(output.generation_active, dtype=bool)
            if not np.array_equal(active, owners == rank):
                problems.append(f"rank {rank}: generation_active is not exactly the owner rank")
            if not np.array_equal(
                output.generation_local_lens, layout.local_lens(positions + 1, rank)
            ):
                problems.append(
                    f"rank {rank}: generation_local_lens are not the layout's lengths of "
                    "position + 1 tokens"
                )
            if not np.array_equal(
                output.generation_past_seen_lens, layout.local_lens(positions, rank)
            ):
                problems.append(
                    f"rank {rank}: generation_past_seen_lens are not the layout's lengths of "
                    "position tokens"
                )
        return problems


def _same(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    """``np.array_equal`` for the core's arrays (one dtype per field), without its overhead:
    it runs once per rank per call."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _checked_ranks(ranks: Sequence[int], cp_size: int) -> tuple[int, ...]:
    """``ranks`` as a tuple, if it is a non-empty increasing list of ranks of the group."""
    chosen = tuple(int(rank) for rank in ranks)
    if not chosen:
        raise ConfigError("ranks must name at least one rank", field="ranks", value=[])
    if any(not 0 <= rank < cp_size for rank in chosen):
        raise ConfigError(
            f"ranks must be in [0, {cp_size}) for cp_size = {cp_size}, got {list(chosen)}",
            field="ranks",
            value=list(chosen),
        )
    if any(a >= b for a, b in zip(chosen, chosen[1:])):
        raise ConfigError(
            f"ranks must be strictly increasing, got {list(chosen)}",
            field="ranks",
            value=list(chosen),
        )
    return chosen
