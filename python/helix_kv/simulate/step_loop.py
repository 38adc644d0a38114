"""The simulator's step loop: feed a workload to a group of ranks and record what happens.

The loop drives the scheduler contract (:class:`helix_kv.contract.SchedulerProtocol`), so it
is the same whether the ranks live in this process (a :class:`helix_kv.SimulatedCPGroup`) or
in separate processes over gloo (each process runs this loop over its own
``helix_kv.distributed.HelixKVRank``, which compares the ranks' schedules every step). Each
step:

1. requests whose ``arrival_step`` has come are added (on every rank, in queue order);
   then live requests whose ``abort_step`` has come are aborted (one ``abort_many`` on
   every rank, in queue order); when nothing is live the clock jumps to the next arrival;
2. ``schedule()`` on every rank; the group checks that the ranks agree;
3. one deterministic token per ``sample_ids`` entry (see :mod:`.tokens`) goes to ``update``;
4. finished requests have their metrics read and their output checked against the output
   they would have had without any preemption (an aborted request's against its start).

Aborts are applied between steps only, never while a step is pending, so no sampled token
is dropped and every rank sees the same calls in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from helix_kv._core import SchedulerMetrics
from helix_kv.contract import SchedulerProtocol
from helix_kv.errors import ScheduleMismatchError
from helix_kv.simulate.tokens import expected_output, prompt_tokens, sampled_tokens
from helix_kv.simulate.workload import RequestSpec
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
    preempted: list[int] = field(default_factory=list)
    sat_out: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)

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
    preemptions: int
    recomputed_tokens: int
    steps_waited: int
    output_exact: bool
    finish_reason: FinishReason = "length"

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
        (an aborted one: exactly their start)."""
        return all(outcome.output_exact for outcome in self.outcomes)


def _sample_indices(ids: np.ndarray, generated: dict[int, int]) -> np.ndarray:
    return np.fromiter((generated[i] for i in ids.tolist()), dtype=np.uint64, count=len(ids))


class _StepLoop:
    """The state of one run: what has arrived, what each request has generated, the record."""

    def __init__(self, group: SchedulerProtocol, workload: Sequence[RequestSpec]) -> None:
        self.group = group
        self.workload = workload
        self.by_id = {request.request_id: request for request in workload}
        self.generated: dict[int, int] = {}
        #: Live requests that will be aborted, in queue order, with their abort step.
        self.abort_steps: dict[int, int] = {}
        self.first_token_step: dict[int, int] = {}
        self.outcomes: list[RequestOutcome] = []
        self.series = StepSeries()
        self.total_generated = 0
        self.next_arrival = 0
        self.clock = 0

    def admit_arrivals(self) -> bool:
        """Add the requests that have arrived; jump over idle time. False when all is done."""
        while True:
            while (
                self.next_arrival < len(self.workload)
                and self.workload[self.next_arrival].arrival_step <= self.clock
            ):
                request = self.workload[self.next_arrival]
                self.group.add_request(
                    request.request_id,
                    prompt_tokens(request.request_id, request.prompt_len),
                    request.output_len,
                    request.priority,
                )
                self.generated[request.request_id] = 0
                if request.abort_step is not None:
                    self.abort_steps[request.request_id] = request.abort_step
                self.next_arrival += 1
            self.apply_aborts()
            if self.group.has_unfinished():
                return True
            if self.next_arrival >= len(self.workload):
                return False
            self.clock = self.workload[self.next_arrival].arrival_step  # idle: jump ahead

    def apply_aborts(self) -> None:
        """Abort the live requests whose abort step has come (one call, queue order)."""
        due = [rid for rid, step in self.abort_steps.items() if step <= self.clock]
        if not due:
            return
        self.group.abort_many(np.asarray(due, dtype=np.int64))
        for request_id in due:
            self.collect(request_id)

    def run_step(self) -> None:
        """Schedule one step on every rank, record it, feed the tokens, collect finishers."""
        output = self.group.schedule()
        metrics = self.group.metrics()
        series = self.series
        series.clock.append(self.clock)
        series.kv_utilization.append(float(metrics.kv_utilization))
        series.running.append(int(self.group.num_running))
        series.waiting.append(int(self.group.num_waiting))
        series.preempted.append(len(output.preempted_ids))
        series.sat_out.append(len(output.sat_out_ids))
        series.num_tokens.append(int(output.num_tokens))

        sample_ids = np.asarray(output.sample_ids, dtype=np.int64)
        tokens = sampled_tokens(sample_ids, _sample_indices(sample_ids, self.generated))
        finished = self.group.update(tokens)
        for request_id in sample_ids.tolist():
            if self.generated[request_id] == 0:
                self.first_token_step[request_id] = self.clock
            self.generated[request_id] += 1
        self.total_generated += len(sample_ids)
        for request_id in np.asarray(finished).tolist():
            self.collect(request_id)
        self.clock += 1

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
                arrival_step=request.arrival_step,
                first_token_step=self.first_token_step.get(request_id),
                finish_step=self.clock,
                generated_tokens=int(request_metrics.generated_tokens),
                preemptions=int(request_metrics.preemptions),
                recomputed_tokens=int(request_metrics.recomputed_tokens),
                steps_waited=int(request_metrics.steps_waited),
                output_exact=bool(exact),
                finish_reason=output.finish_reason,
            )
        )
        del self.generated[request_id]
        self.abort_steps.pop(request_id, None)


def run_simulation(
    group: SchedulerProtocol,
    workload: Sequence[RequestSpec],
    *,
    config: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
    max_steps: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> SimulationResult:
    """Run ``workload`` to completion on ``group`` and return what happened.

    Stops early (with ``rank_agreement=False`` and the mismatch message) if the ranks
    disagree on any call, or after ``max_steps`` scheduler steps, or (``interrupted=True``)
    when ``should_stop()``, asked before every step, says so: a step is never cut in half.
    Other scheduler errors (deadlock, preemption disabled) propagate.
    """
    loop = _StepLoop(group, workload)
    mismatch: str | None = None
    interrupted = False
    steps_limit = math.inf if max_steps is None else max_steps
    try:
        while len(loop.series) < steps_limit and loop.admit_arrivals():
            if should_stop is not None and should_stop():
                interrupted = True
                break
            loop.run_step()
            if progress is not None:
                progress(loop.clock, len(loop.outcomes), len(workload), len(loop.series))
    except ScheduleMismatchError as err:
        mismatch = str(err)

    return SimulationResult(
        requests_total=len(workload),
        outcomes=loop.outcomes,
        series=loop.series,
        final_metrics=group.metrics(),
        generated_tokens=loop.total_generated,
        clock=loop.clock,
        rank_agreement=mismatch is None,
        mismatch=mismatch,
        config=dict(config or {}),
        interrupted=interrupted,
    )
