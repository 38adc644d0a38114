"""The simulator's step loop: feed a workload to a group of ranks and record what happens.

The loop drives the scheduler contract (:class:`helix_kv.contract.SchedulerProtocol`), so it
is the same whether the ranks live in this process (a :class:`helix_kv.SimulatedCPGroup`) or
in separate processes over gloo (each process runs this loop over its own
``helix_kv.distributed.HelixKVRank``, which compares the ranks' schedules every step). Each
step:

1. requests whose ``arrival_step`` has come are added (on every rank, in queue order);
   then live requests whose ``abort_step`` has come are aborted (one ``abort_many`` on
   every rank, in queue order); when nothing is live the clock jumps to the next arrival
   (a timed workload: its ``arrival_ms`` and ``abort_ms`` against the modelled clock at the
   step's start, which a step-time model advances by every step's modelled duration and an
   idle group moves to the next arrival; every rank computes the same clock from the same
   schedules, so it is rank-invariant like the step count);
2. ``schedule()`` on every rank; the group checks that the ranks agree;
3. one deterministic token per ``sample_ids`` entry (see :mod:`.tokens`) goes to ``update``;
4. finished requests have their metrics read and their output checked against the output
   they would have had without any preemption (an aborted request's against its start).

Aborts are applied between steps only, never while a step is pending, so no sampled token
is dropped and every rank sees the same calls in the same order.

With ``overlap=True`` the loop runs one step ahead, as an overlapping executor does, through
:class:`helix_kv.StepDriver` (which holds the step in flight and closes it once the next one is
scheduled): the aborts due at a clock step are then applied right after step t's update, while
step t+1 is pending; a request aborted then keeps the tokens of the steps before t+1, as in the
plain loop, and finishes when step t+1 closes. The outputs must be those of the plain loop.

With a draft model (``drafts=``, a :class:`~helix_kv.simulate.drafts.DraftModel`: speculative
decoding, ``--spec-tokens K --acceptance P``) the loop proposes drafts to every rank before each
``schedule()`` (``propose_drafts``: ``min(K, left - 1)`` for each request that has sampled a
token), verifies the drafts the step scheduled against the tokens it samples (each generation
entry samples ``1 + k`` rows: its next ``1 + k`` tokens) and gives ``update`` the accepted
counts; the scheduler keeps ``accepted + 1`` tokens of each and rolls the rest back. Outputs must
stay exactly those without drafts. See :mod:`.drafts` for the acceptance model.

Two optional additions, both off by default and costing nothing then: ``events=`` receives a
:class:`~helix_kv.simulate.events.StepEvent` after every step and a
:class:`~helix_kv.simulate.events.RequestEvent` per request outcome (see :mod:`.events`), and
``step_time=`` (a :class:`~helix_kv.simulate.timing.StepTimeModel`) gives every step a modelled
duration, so outcomes also carry modelled milliseconds.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from helix_kv._core import ScheduleOutput, SchedulerMetrics
from helix_kv._renamed import renamed_keywords
from helix_kv.contract import SchedulerProtocol
from helix_kv.errors import HelixKVError, ScheduleMismatchError, SimulationSetupError
from helix_kv.simulate.drafts import DraftModel, verify
from helix_kv.simulate.events import EventSink, RequestEvent, StepEvent
from helix_kv.simulate.timing import StepTimeModel, kv_tokens_read
from helix_kv.simulate.tokens import expected_output, sampled_tokens
from helix_kv.simulate.workload import RequestSpec, is_timed
from helix_kv.step_driver import StepDriver
from helix_kv.types import FinishReason

#: ``progress(clock, requests_finished, requests_total, steps)``, called after each step.
ProgressCallback = Callable[[int, int, int, int], None]


@dataclass
class StepSeries:
    """Per-step figures of a run, one entry per scheduler step (idle gaps are not steps)."""

    clock: list[int] = field(default_factory=list)
    kv_utilization: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    #: Victims recompute-paused in the step (``preempted_ids``).
    preempted: list[int] = field(default_factory=list)
    #: Victims suspended to the host tier in the step (``suspended_ids``).
    suspended: list[int] = field(default_factory=list)
    sat_out: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    #: Each step's modelled start, in ms (0.0 every step without a step-time model).
    start_ms: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.clock)


@dataclass
class RequestOutcome:
    """What happened to one finished or aborted request; times are in steps of the
    simulated clock. An aborted request finishes at the step it was aborted before, and
    has no ``first_token_step`` if it was aborted before sampling one."""

    request_id: int
    arrival_step: int
    first_token_step: int | None
    finish_step: int
    generated_tokens: int
    victim_choices: int
    recomputed_tokens: int
    steps_waited: int
    output_exact: bool
    finish_reason: FinishReason = "length"
    #: CRC-32 of the generated tokens (int32 bytes), to compare runs without keeping them.
    output_crc: int = 0
    # modelled times (a step-time model is on), in ms: see RequestEvent for their meaning
    arrival_ms: float | None = None
    first_token_ms: float | None = None
    finish_ms: float | None = None
    #: The start of the first step that scheduled it (its first prompt chunk); ``None`` if
    #: none did (aborted while waiting) or without a model.
    first_scheduled_ms: float | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "aborted"

    @property
    def completion_steps(self) -> int:
        """Steps from arrival to finish, both counted."""
        return self.finish_step - self.arrival_step + 1

    @property
    def first_token_steps(self) -> int | None:
        """Steps from arrival to its first sampled token, both counted."""
        if self.first_token_step is None:
            return None
        return self.first_token_step - self.arrival_step + 1


@dataclass
class SimulationResult:
    """Everything a run produced; :mod:`.report` turns it into figures."""

    requests_total: int
    outcomes: list[RequestOutcome]
    series: StepSeries
    final_metrics: SchedulerMetrics
    """The scheduler's counters at the end of the run (a frozen, picklable record)."""
    generated_tokens: int
    clock: int
    rank_agreement: bool
    mismatch: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False
    """The run was stopped early on request (``should_stop``); the figures cover its steps."""
    modelled_time_ms: float | None = None
    """The modelled time at the end of the run (a step-time model is on), in ms."""
    overlap: bool = False
    """The run scheduled one step ahead (``overlap=True``)."""
    outputs_match_plain: bool | None = None
    """For an overlap run, whether every request's output equals that of the plain run of the
    same workload (set by the caller that ran both, see :func:`outputs_match`)."""
    drafts: DraftModel | None = None
    """The draft model of a speculative-decoding run (``None``: no drafts)."""
    decode_entries: int = 0
    """With drafts: decode entries of the steps scheduled (each one request decoding in one
    step, its drafts included); 0 without."""
    accepted_per_position: list[int] | None = None
    """With drafts: the scheduler's ``spec_decode_accepted_per_position()`` at the end (times
    draft position ``j``, 0 the first after the decode token, was accepted)."""
    failed_step: int | None = None
    """The step (0-based, as ``--events`` numbers them) in which a scheduler error ended the
    run; the figures cover the steps before it. ``None``: the run did not fail. A failed run's
    result is only reached through :func:`partial_result` of the error."""
    failure: str | None = None
    """The class name of the error that ended the run (with ``failed_step``)."""

    @property
    def requests_finished(self) -> int:
        """Requests that finished by length (aborted ones are not counted)."""
        return sum(1 for outcome in self.outcomes if not outcome.aborted)

    @property
    def requests_aborted(self) -> int:
        return sum(1 for outcome in self.outcomes if outcome.aborted)

    @property
    def outputs_exact(self) -> bool:
        """Every finished request produced exactly the tokens it would have without pressure
        (an aborted one: exactly their start), and an overlap run's outputs equal the plain
        run's (when that comparison was made)."""
        if self.outputs_match_plain is False:
            return False
        return all(outcome.output_exact for outcome in self.outcomes)


#: The attribute of a scheduler error raised by :func:`run_simulation` that holds the result
#: of the steps before it (it pickles with the error, so a ``--procs`` rank's comes back too).
_PARTIAL_RESULT = "partial_result"


def partial_result(error: BaseException) -> SimulationResult | None:
    """The result of the steps a run made before ``error``, a scheduler error that
    :func:`run_simulation` raised, ended it (``failed_step`` says where); ``None`` for an
    error raised elsewhere."""
    result = getattr(error, _PARTIAL_RESULT, None)
    return result if isinstance(result, SimulationResult) else None


def outputs_match(overlap: SimulationResult, plain: SimulationResult) -> bool:
    """Whether two runs of one workload gave every request the same output: the same
    requests, and each request that finished (not aborted) in both with the same finish
    reason and tokens. An abort lands at a clock step, and how far a request got by then
    depends on the schedule, which one step ahead differs under pressure: a request aborted
    in either run is compared through ``output_exact`` (each output the start of its full
    output), not token for token."""

    def outputs(result: SimulationResult) -> dict[int, tuple[str, int, int]]:
        return {
            o.request_id: (o.finish_reason, o.generated_tokens, o.output_crc)
            for o in result.outcomes
        }

    first, second = outputs(overlap), outputs(plain)
    if first.keys() != second.keys():
        return False
    return all(
        first[request_id] == second[request_id]
        for request_id in first
        if "aborted" not in (first[request_id][0], second[request_id][0])
    )


def _sample_indices(ids: np.ndarray, generated: dict[int, int]) -> np.ndarray:
    # map over the bound lookup: no generator frame per sampled id
    return np.fromiter(map(generated.__getitem__, ids.tolist()), dtype=np.uint64, count=len(ids))


def _row_indices(
    ids: np.ndarray, generated: dict[int, int], rows_per_entry: np.ndarray
) -> np.ndarray:
    """The output index each sample row samples: a generation entry's ``1 + k`` rows (the
    first runs of ``ids``, ``rows_per_entry[i]`` rows for entry ``i``) its next ``1 + k``
    tokens, and each completing context entry its next one."""
    base = _sample_indices(ids, generated)
    generation_rows = int(rows_per_entry.sum())
    starts = np.cumsum(rows_per_entry) - rows_per_entry
    offsets = np.arange(generation_rows, dtype=np.int64) - np.repeat(starts, rows_per_entry)
    base[:generation_rows] += offsets.astype(np.uint64)
    return base


@dataclass(frozen=True, eq=False)
class _Launched:
    """What a step was launched with: its sampled rows and (with drafts) the accepted counts."""

    tokens: np.ndarray
    accepted: np.ndarray | None = None


def accepted_per_position(group: SchedulerProtocol) -> list[int]:
    """The scheduler's ``spec_decode_accepted_per_position()`` of ``group``: a
    :class:`helix_kv.SimulatedCPGroup` (checked equal on its ranks) or one rank's
    ``Scheduler``, directly or as the ``scheduler`` of a ``HelixKVRank``."""
    source: Any = group
    if not hasattr(source, "spec_decode_accepted_per_position"):
        source = getattr(group, "scheduler", None)
    if source is None or not hasattr(source, "spec_decode_accepted_per_position"):
        raise SimulationSetupError(
            f"{type(group).__name__} has no spec_decode_accepted_per_position()"
        )
    return [int(count) for count in np.asarray(source.spec_decode_accepted_per_position())]


class _StepLoop:
    """The state of one run: what has arrived, what each request has generated, the record."""

    def __init__(
        self,
        group: SchedulerProtocol,
        workload: Sequence[RequestSpec],
        events: EventSink | None = None,
        step_time: StepTimeModel | None = None,
        cp_size: int = 1,
        overlap: bool = False,
        drafts: DraftModel | None = None,
    ) -> None:
        self.group = group
        self.overlap = overlap
        self.drafts = drafts
        #: The steps scheduled and "run", each launched with its sampled tokens.
        self.driver: StepDriver[_Launched] = StepDriver(group, one_step_ahead=overlap)
        self.workload = workload
        self.by_id = {request.request_id: request for request in workload}
        self.generated: dict[int, int] = {}
        #: The workload arrives in modelled time (``arrival_ms``), not at steps.
        self.timed = is_timed(workload)
        #: Live requests that will be aborted, in queue order, with their abort step (timed:
        #: their abort time in ms).
        self.abort_at: dict[int, float] = {}
        #: Timed: the clock step at which each live request was added.
        self.added_step: dict[int, int] = {}
        self.first_token_step: dict[int, int] = {}
        self.outcomes: list[RequestOutcome] = []
        self.series = StepSeries()
        self.total_generated = 0
        self.next_arrival = 0
        self.clock = 0
        self.events = events
        self.step_time = step_time
        self.cp_size = cp_size
        #: Modelled time at the start of the current clock step (stays 0 without a model).
        self.now_ms = 0.0
        #: The start of the last step scheduled, in modelled ms.
        self.step_start_ms = 0.0
        self.arrival_ms: dict[int, float] = {}
        self.first_token_ms: dict[int, float] = {}
        #: The start of the first step that scheduled each live request (its first chunk).
        self.first_scheduled_ms: dict[int, float] = {}
        #: For the events only: requests suspended now, and aborts since the last step.
        self.suspended: set[int] = set()
        self.aborted_since_step = 0
        #: For the events only: prompt tokens each live request found in the prefix cache.
        self.cached_tokens: dict[int, int] = {}
        #: One step ahead: requests aborted while a step is pending (no drafts for them).
        self.aborting: set[int] = set()
        self.decode_entries = 0
        #: With drafts, for the events: the last step's drafted decodes, draft tokens and
        #: accepted draft tokens.
        self.step_drafts = (0, 0, 0)
        #: The step being run (0-based): the one a scheduler error is raised in.
        self.step = 0

    def run_to_end(
        self,
        config: dict[str, Any] | None,
        progress: ProgressCallback | None,
        max_steps: int | None,
        should_stop: Callable[[], bool] | None,
    ) -> SimulationResult:
        """Runs steps until the workload is done, ``max_steps``, ``should_stop()`` or a
        mismatch (see :func:`run_simulation`); a scheduler error carries the result so far."""
        mismatch: str | None = None
        interrupted = False
        steps_limit = math.inf if max_steps is None else max_steps
        try:
            while len(self.series) < steps_limit and self.admit_arrivals():
                if should_stop is not None and should_stop():
                    interrupted = True
                    break
                self.run_step()
                if progress is not None:
                    progress(self.clock, len(self.outcomes), len(self.workload), len(self.series))
            if not interrupted:
                self.flush()  # an error here is the last step's (its update, one step ahead)
        except ScheduleMismatchError as err:
            mismatch = str(err)
        except HelixKVError as err:  # a scheduler error: it carries the figures so far
            failed = self.result(config, mismatch, interrupted, self.step, type(err).__name__)
            setattr(err, _PARTIAL_RESULT, failed)
            raise
        return self.result(config, mismatch, interrupted)

    def result(
        self,
        config: dict[str, Any] | None,
        mismatch: str | None,
        interrupted: bool,
        failed_step: int | None = None,
        failure: str | None = None,
    ) -> SimulationResult:
        """What the run did so far."""
        return SimulationResult(
            requests_total=len(self.workload),
            outcomes=self.outcomes,
            series=self.series,
            final_metrics=self.group.metrics(),
            generated_tokens=self.total_generated,
            clock=self.clock,
            rank_agreement=mismatch is None,
            mismatch=mismatch,
            config=dict(config or {}),
            interrupted=interrupted,
            modelled_time_ms=self.now_ms if self.step_time is not None else None,
            overlap=self.overlap,
            drafts=self.drafts,
            decode_entries=self.decode_entries,
            accepted_per_position=(
                accepted_per_position(self.group) if self.drafts is not None else None
            ),
            failed_step=failed_step,
            failure=failure,
        )

    def admit_arrivals(self) -> bool:
        """Add the requests that have arrived; jump over idle time. False when all is done."""
        while True:
            while self.next_arrival < len(self.workload) and self.arrived(
                self.workload[self.next_arrival]
            ):
                request = self.workload[self.next_arrival]
                self.group.add_request(
                    request.request_id,
                    request.prompt(),
                    request.output_len,
                    request.priority,
                    cache_salt=request.cache_salt,
                )
                self.generated[request.request_id] = 0
                if request.arrival_ms is not None:  # timed: it waited since then
                    self.arrival_ms[request.request_id] = request.arrival_ms
                    self.added_step[request.request_id] = self.clock
                elif self.step_time is not None:
                    self.arrival_ms[request.request_id] = self.now_ms
                abort_at = request.abort_step if request.abort_ms is None else request.abort_ms
                if abort_at is not None:
                    self.abort_at[request.request_id] = abort_at
                self.next_arrival += 1
            if not self.overlap:
                self.apply_aborts()
            if self.group.has_unfinished():
                return True
            if self.next_arrival >= len(self.workload):
                return False
            upcoming = self.workload[self.next_arrival]
            if upcoming.arrival_ms is not None:  # idle: the modelled clock jumps ahead
                self.now_ms = max(self.now_ms, upcoming.arrival_ms)
                continue
            idle_steps = upcoming.arrival_step - self.clock
            if self.step_time is not None:
                self.now_ms += idle_steps * self.step_time.idle_step_ms
            self.clock += idle_steps  # idle: jump ahead

    def arrived(self, request: RequestSpec) -> bool:
        """Whether ``request`` has arrived by the start of the current clock step."""
        if request.arrival_ms is not None:
            return request.arrival_ms <= self.now_ms
        return request.arrival_step <= self.clock

    def apply_aborts(self) -> None:
        """Abort the live requests whose abort step (timed: time) has come (one call, queue
        order)."""
        # one step ahead, they are applied after the step of this clock step was scheduled:
        # due by its start, as in the plain loop
        now = (
            (self.step_start_ms if self.driver.pending else self.now_ms)
            if self.timed
            else self.clock
        )
        due = [rid for rid, at in self.abort_at.items() if at <= now]
        if not due:
            return
        self.group.abort_many(np.asarray(due, dtype=np.int64))
        self.aborted_since_step += len(due)
        if self.driver.pending:
            # one step ahead: they finish when the pending step closes (update's ids)
            for request_id in due:
                del self.abort_at[request_id]
            self.aborting.update(due)
            return
        for request_id in due:
            self.collect(request_id)

    def propose_drafts(self) -> int:
        """Proposes the draft model's drafts for the next step on every rank; returns how many
        draft tokens were proposed."""
        assert self.drafts is not None
        live = (
            (request_id, generated, self.by_id[request_id].output_len)
            for request_id, generated in self.generated.items()
            if request_id not in self.aborting
        )
        proposal = self.drafts.propose(live)
        self.driver.propose_drafts(proposal.request_ids, proposal.counts, proposal.tokens)
        return int(proposal.tokens.size)

    def run_step(self) -> None:
        """Schedule one step on every rank, record it, feed the tokens, collect finishers."""
        self.step = len(self.series)
        if self.drafts is not None:
            self.propose_drafts()
        output = self.driver.schedule()
        metrics = self.group.metrics()
        series = self.series
        series.clock.append(self.clock)
        series.kv_utilization.append(float(metrics.kv_utilization))
        series.running.append(int(self.group.num_running))
        series.waiting.append(int(self.group.num_waiting))
        series.preempted.append(len(output.preempted_ids))
        series.suspended.append(len(output.suspended_ids))
        series.sat_out.append(len(output.sat_out_ids))
        series.num_tokens.append(int(output.num_tokens))
        start_ms = self.step_start_ms = self.now_ms
        series.start_ms.append(start_ms)
        kv_read = 0
        if self.step_time is not None or self.events is not None:
            kv_read = kv_tokens_read(output)
        if self.step_time is not None:
            self.now_ms += self.step_time.step_ms(int(output.num_tokens), kv_read, self.cp_size)
            for request_id in np.asarray(output.context_ids).tolist():
                self.first_scheduled_ms.setdefault(request_id, start_ms)

        sample_ids = np.asarray(output.sample_ids, dtype=np.int64)
        accepted: np.ndarray | None = None
        kept: np.ndarray | None = None
        if self.drafts is None:
            # One sample a request: its output index is its count so far, taken and counted
            # in one pass (close_due below reads no count).
            counts = self.note_tokens(sample_ids.tolist())
            tokens = sampled_tokens(sample_ids, np.array(counts, dtype=np.uint64))
        else:
            generation_ids = np.asarray(output.generation_ids, dtype=np.int64)
            self.decode_entries += int(generation_ids.size)
            draft_counts = np.asarray(output.generation_draft_counts, dtype=np.int64)
            rows = draft_counts + 1
            generation_rows = int(rows.sum())
            if not np.array_equal(sample_ids[:generation_rows], np.repeat(generation_ids, rows)):
                raise SimulationSetupError("sample_ids do not start with 1 + k rows per decode")
            indices = _row_indices(sample_ids, self.generated, rows)
            tokens = sampled_tokens(sample_ids, indices)
            accepted = verify(
                draft_counts,
                np.asarray(output.generation_draft_tokens, dtype=np.int32),
                tokens[:generation_rows],
            )
            kept = np.concatenate(
                [np.repeat(generation_ids, accepted + 1), sample_ids[generation_rows:]]
            )
            self.step_drafts = (
                int(np.count_nonzero(draft_counts)),
                int(draft_counts.sum()),
                int(accepted.sum()),
            )
        if self.overlap:
            self.check_inputs_in_flight()
        self.driver.launched(_Launched(tokens, accepted))
        finished = self.close_due()
        if kept is not None:  # with drafts: each accepted row is a token
            self.note_tokens(kept.tolist())
        self.total_generated += len(sample_ids if kept is None else kept)
        if self.events is not None:
            self.emit_step(output, metrics, kv_read, len(finished), start_ms)
        for request_id in np.asarray(finished).tolist():
            self.collect(request_id)
        self.clock += 1

    def note_tokens(self, request_ids: list[int]) -> list[int]:
        """Counts one generated token for each of ``request_ids`` (in order; a request once
        per token), noting each request's first; returns each token's output index (the
        request's count before it)."""
        generated = self.generated
        indices = []
        for request_id in request_ids:
            count = generated[request_id]
            indices.append(count)
            generated[request_id] = count + 1
            if count == 0:
                self.first_token_step[request_id] = self.clock
                if self.step_time is not None:
                    self.first_token_ms[request_id] = self.now_ms  # the end of this step
        return indices

    def check_inputs_in_flight(self) -> None:
        """Overlap: each input of the step just scheduled that is still in flight names a row
        the step before it sampled for the same request (the simulated model needs no inputs,
        so this is where the rows are checked)."""
        step = self.driver.newest
        assert step is not None
        flight = step.inputs_in_flight
        if not len(flight):
            return
        if step.previous is None:
            raise SimulationSetupError("an input in flight without a step in flight")
        named = np.asarray(step.previous.output.sample_ids)[flight.rows]
        if not np.array_equal(named, np.asarray(step.output.generation_ids)[flight.entries]):
            raise SimulationSetupError("an input in flight names another request's row")

    def close_due(self) -> np.ndarray:
        """Updates the step due (plain: the one just run; overlap: the one before it, after
        which the aborts due now are applied). Returns the ids that finished."""
        step = self.driver.due()
        if step is None:
            return np.zeros(0, dtype=np.uint64)
        finished = np.asarray(
            self.driver.complete(step.sampled.tokens, None, step.sampled.accepted)
        )
        if self.overlap:
            self.apply_aborts()
        return finished

    def flush(self) -> None:
        """Overlap: updates the step still in flight at the end of the run."""
        for step in self.driver.drain():
            launched = step.sampled
            closed = self.driver.complete(launched.tokens, None, launched.accepted)
            for request_id in np.asarray(closed).tolist():
                self.collect(request_id)

    def collect(self, request_id: int) -> None:
        """Read a finished or aborted request's output and metrics, and check the output."""
        request = self.by_id[request_id]
        output = self.group.take_output(request_id)
        tokens = np.asarray(output.token_ids)
        expected = expected_output(request_id, request.output_len)
        if output.finish_reason == "aborted":
            # Exactly the start of its output, and short of the whole of it.
            exact = tokens.size < expected.size and np.array_equal(tokens, expected[: tokens.size])
        else:
            exact = np.array_equal(tokens, expected)
        request_metrics = output.metrics
        self.outcomes.append(
            RequestOutcome(
                request_id=request_id,
                arrival_step=self.added_step.pop(request_id, request.arrival_step),
                first_token_step=self.first_token_step.get(request_id),
                finish_step=self.clock,
                generated_tokens=int(request_metrics.generated_tokens),
                victim_choices=int(request_metrics.victim_choices),
                recomputed_tokens=int(request_metrics.recomputed_tokens),
                steps_waited=int(request_metrics.steps_waited),
                output_exact=bool(exact),
                finish_reason=output.finish_reason,
                output_crc=zlib.crc32(tokens.astype(np.int32).tobytes()),
            )
        )
        del self.generated[request_id]
        self.abort_at.pop(request_id, None)
        self.aborting.discard(request_id)
        if self.step_time is not None:
            outcome = self.outcomes[-1]
            outcome.arrival_ms = self.arrival_ms.pop(request_id)
            outcome.first_token_ms = self.first_token_ms.pop(request_id, None)
            outcome.first_scheduled_ms = self.first_scheduled_ms.pop(request_id, None)
            outcome.finish_ms = self.now_ms  # the end of its last step, or its abort
        if self.events is not None:
            self.suspended.discard(request_id)
            cached = self.cached_tokens.pop(request_id, 0)
            self.events.on_request(_request_event(self.outcomes[-1], request.prompt_len, cached))

    def emit_step(
        self,
        output: ScheduleOutput,
        metrics: SchedulerMetrics,
        kv_read: int,
        finished: int,
        start_ms: float,
    ) -> None:
        """Send the step just run to the event sink."""
        assert self.events is not None
        self.suspended.update(output.suspended_ids.tolist())
        self.suspended.difference_update(output.resumed_ids.tolist())
        context_tokens = int(output.context_lens.sum(dtype=np.int64))
        cached_lens = np.asarray(output.context_cached_lens)
        hit = np.flatnonzero(cached_lens)
        for request_id, cached in zip(
            np.asarray(output.context_ids)[hit].tolist(), cached_lens[hit].tolist()
        ):
            self.cached_tokens[request_id] = self.cached_tokens.get(request_id, 0) + cached
        timed = self.step_time is not None
        series = self.series
        speculative: dict[str, int] = {}
        if self.drafts is not None:
            drafted, draft_tokens, accepted = self.step_drafts
            speculative = {
                "drafts": drafted,
                "draft_tokens": draft_tokens,
                "accepted_tokens": accepted,
            }
        self.events.on_step(
            StepEvent(
                step=len(series) - 1,
                clock=self.clock,
                running=int(self.group.num_running),  # after the update: the step's end
                waiting=int(self.group.num_waiting),
                suspended=len(self.suspended),
                kv_used_superblocks=int(metrics.kv_used_superblocks),
                kv_utilization=series.kv_utilization[-1],
                scheduled_tokens=int(output.num_tokens),
                context_tokens=context_tokens,
                decode_tokens=int(output.generation_ids.size),
                kv_tokens_read=kv_read,
                samples=int(output.num_samples),
                preemptions=series.preempted[-1],
                suspensions=int(output.suspended_ids.size),
                resumes=int(output.resumed_ids.size),
                sat_out=series.sat_out[-1],
                aborted=self.aborted_since_step,
                finished=finished,
                start_ms=start_ms if timed else None,
                duration_ms=self.now_ms - start_ms if timed else None,
                cached_tokens=int(cached_lens.sum(dtype=np.int64)),
                **speculative,
            )
        )
        self.aborted_since_step = 0


def _request_event(outcome: RequestOutcome, prompt_tokens: int, cached: int) -> RequestEvent:
    return RequestEvent(
        request_id=outcome.request_id,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        finish_reason=outcome.finish_reason,
        arrival_step=outcome.arrival_step,
        first_token_step=outcome.first_token_step,
        finish_step=outcome.finish_step,
        generated_tokens=outcome.generated_tokens,
        victim_choices=outcome.victim_choices,
        recomputed_tokens=outcome.recomputed_tokens,
        steps_waited=outcome.steps_waited,
        output_exact=outcome.output_exact,
        arrival_ms=outcome.arrival_ms,
        first_token_ms=outcome.first_token_ms,
        finish_ms=outcome.finish_ms,
    )


@renamed_keywords(cp="cp_size")
def run_simulation(
    group: SchedulerProtocol,
    workload: Sequence[RequestSpec],
    *,
    config: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
    max_steps: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    events: EventSink | None = None,
    step_time: StepTimeModel | None = None,
    cp_size: int | None = None,
    overlap: bool = False,
    drafts: DraftModel | None = None,
) -> SimulationResult:
    """Run ``workload`` to completion on ``group`` and return what happened.

    Stops early (with ``rank_agreement=False`` and the mismatch message) if the ranks
    disagree on any call, or after ``max_steps`` scheduler steps, or (``interrupted=True``)
    when ``should_stop()``, asked before every step, says so: a step is never cut in half.
    Other scheduler errors (deadlock, preemption disabled) propagate, each carrying the result
    of the steps before it (:func:`partial_result`, with ``failed_step``).

    A timed workload (its requests carry ``arrival_ms``, see
    :func:`~helix_kv.simulate.workload.is_timed`) is run on the modelled clock: each request is
    added at the first step that starts at or after its arrival, an idle group jumps to the
    next arrival, and its ``arrival_ms`` (not the step that added it) is its outcome's; it
    needs ``step_time`` (else :class:`SimulationSetupError`). Its outcomes' ``arrival_step`` is
    the clock step that added it.

    ``events``: an :class:`~helix_kv.simulate.events.EventSink` called after every step and
    for every request outcome. ``step_time``: a
    :class:`~helix_kv.simulate.timing.StepTimeModel`; its per-KV-token term divides by
    ``cp_size``, the group's CP size (default: ``config["cp"]``, the report's key; one of them
    is needed with a model, else :class:`SimulationSetupError`; ``cp``: the deprecated name of
    ``cp_size``, kept for one release). ``overlap``: schedule one step ahead (see the module
    docs); compare the outputs with a plain run's through :func:`outputs_match`. ``drafts``:
    speculative decoding with this draft model (the group's ``num_speculative_tokens`` must
    be at least its ``num_tokens``, else :class:`SimulationSetupError`).
    """
    loop = _StepLoop(
        group,
        workload,
        events,
        step_time,
        _checked_cp_size(group, workload, config, step_time, cp_size, drafts),
        overlap,
        drafts,
    )
    return loop.run_to_end(config, progress, max_steps, should_stop)


def _checked_cp_size(
    group: SchedulerProtocol,
    workload: Sequence[RequestSpec],
    config: dict[str, Any] | None,
    step_time: StepTimeModel | None,
    cp_size: int | None,
    drafts: DraftModel | None,
) -> int:
    """The group's CP size for the step-time model (``cp_size``, else ``config["cp"]``; 1
    without a model), once :func:`run_simulation`'s inputs are checked to fit together."""
    try:
        timed = is_timed(workload)
    except ValueError as err:
        raise SimulationSetupError(f"run_simulation: {err}") from None
    if timed and step_time is None:
        raise SimulationSetupError(
            "run_simulation: the workload arrives in time (arrival_ms); its clock needs a "
            "step-time model: pass step_time= (e.g. timing.DEFAULT_STEP_TIME)"
        )
    if cp_size is None and config is not None and "cp" in config:
        cp_size = int(config["cp"])
    if step_time is not None and (cp_size is None or cp_size < 1):
        raise SimulationSetupError(
            "run_simulation: a step-time model needs the group's CP size: pass cp_size=N (N >= 1)"
        )
    if drafts is not None:
        allowed = _speculative_tokens(group)
        if allowed is not None and allowed < drafts.num_tokens:
            raise SimulationSetupError(
                f"run_simulation: the draft model proposes {drafts.num_tokens} drafts, the "
                f"scheduler takes at most num_speculative_tokens = {allowed}"
            )
    return cp_size or 1


def _speculative_tokens(group: SchedulerProtocol) -> int | None:
    """The group's ``num_speculative_tokens``, where its configuration can be read."""
    for holder in (group, getattr(group, "scheduler", None)):
        config = getattr(holder, "config", None)
        value = getattr(config, "num_speculative_tokens", None)
        if isinstance(value, int):
            return value
    schedulers = getattr(group, "schedulers", None)
    if schedulers:
        return int(schedulers[0].config.num_speculative_tokens)
    return None
