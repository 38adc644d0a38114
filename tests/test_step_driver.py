"""helix_kv.StepDriver: the executor side of the step protocol, plain and one step ahead.

Every run is made twice, once through the driver and once by hand on a bare scheduler (the
hand loop resolves ``generation_input_refs`` itself, as an executor without the driver would),
and the two must make the same calls with the same results: the same schedules (digests), the
same sampled tokens, the same finished ids and outputs. The model's next token depends on its
input token, so a decode input resolved from the wrong row changes every later token.
Misuse raises a typed error and changes neither the driver nor the scheduler.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

import helix_kv
from helix_kv import (
    InvalidArgumentError,
    InvalidLengthError,
    InvalidStateError,
    InvalidTypeError,
    StepDriver,
)

from .helpers.scheduler import config, prompt

VOCAB = 50
EOS = 2  # the runs that stop on it end some requests by EOS (checked)


def next_token(request_id: int, token: int, position: int) -> int:
    """The toy model: a function of the request, its input token and its position."""
    return (request_id * 31 + token * 7 + position * 3) % VOCAB


def sample(out: helix_kv.ScheduleOutput, decode_inputs: np.ndarray) -> np.ndarray:
    """One token per ``sample_ids`` entry: decode entries from their inputs, completing prompt
    chunks from their last token."""
    by_request: dict[int, int] = {}
    for request_id, token, position in zip(
        out.generation_ids.tolist(), decode_inputs.tolist(), out.generation_positions.tolist()
    ):
        by_request[request_id] = next_token(request_id, token, position)
    ends = np.cumsum(out.context_lens)
    for request_id, end, start, length, completes in zip(
        out.context_ids.tolist(),
        ends.tolist(),
        out.context_starts.tolist(),
        out.context_lens.tolist(),
        out.context_completes.tolist(),
    ):
        if completes:
            last = int(out.context_token_ids[end - 1])
            by_request[request_id] = next_token(request_id, last, start + length - 1)
    return np.asarray([by_request[i] for i in out.sample_ids.tolist()], dtype=np.int32)


@dataclass(frozen=True)
class Plan:
    """What a run does besides scheduling: revert every ``revert_every``-th scheduled step,
    abort requests right after a given step is scheduled (while it is pending), stop on EOS."""

    one_step_ahead: bool
    revert_every: int = 0
    aborts: dict[int, list[int]] = field(default_factory=dict)
    eos: bool = False


@dataclass
class Record:
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    outputs: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    inputs_in_flight: int = 0

    def take(self, scheduler: helix_kv.Scheduler, finished: np.ndarray) -> None:
        for request_id in finished.tolist():
            output = scheduler.take_output(request_id)
            self.outputs[request_id] = (output.finish_reason, output.token_ids.tolist())


REQUESTS = [(i, 4 + (i * 5) % 13, 4 + (i * 3) % 7) for i in range(10)]


def new_scheduler() -> helix_kv.Scheduler:
    # a pool too small for every request at once, prompts chunked: the runs preempt
    scheduler = helix_kv.Scheduler(config(1, 4, kv_tokens=64, max_num_tokens=16, chunk_unit=4))
    for request_id, prompt_len, max_new in REQUESTS:
        scheduler.add_request(request_id, prompt(prompt_len, request_id), max_new)
    return scheduler


def small_scheduler() -> helix_kv.Scheduler:
    """Three requests whose prompts all complete in the first step (roomy pool)."""
    scheduler = helix_kv.Scheduler(config(1, 4, kv_tokens=128, max_num_tokens=64))
    for request_id, prompt_len in ((3, 5), (8, 9), (5, 2)):
        scheduler.add_request(request_id, prompt(prompt_len, request_id), 4)
    return scheduler


def by_request(out: helix_kv.ScheduleOutput, tokens: np.ndarray) -> dict[int, int]:
    return dict(zip(out.sample_ids.tolist(), tokens.tolist()))


def eos_of(plan: Plan, tokens: np.ndarray) -> np.ndarray | None:
    return tokens == EOS if plan.eos else None


def run_by_hand(plan: Plan) -> Record:
    """The protocol written out on a bare scheduler."""
    scheduler, record = new_scheduler(), Record()
    ahead = 1 if plan.one_step_ahead else 0
    in_flight: deque[tuple[helix_kv.ScheduleOutput, np.ndarray]] = deque()
    scheduled = 0
    for _ in range(1_000):
        if not (scheduler.has_unfinished() or in_flight):
            break
        if scheduler.has_unfinished():
            out = scheduler.schedule()
            scheduled += 1
            scheduler.abort_many(plan.aborts.get(scheduled, []))
            record.calls.append(("schedule", out.digest))
            if plan.revert_every and scheduled % plan.revert_every == 0:
                aborted = scheduler.revert()
                record.calls.append(("revert", aborted.tolist()))
                record.take(scheduler, aborted)
                continue
            inputs = out.generation_input_tokens.copy()
            refs = out.generation_input_refs
            rows = refs >= 0
            if rows.any():
                inputs[rows] = in_flight[-1][1][refs[rows]]
                record.inputs_in_flight += int(rows.sum())
            in_flight.append((out, sample(out, inputs)))
        if len(in_flight) > ahead or not scheduler.has_unfinished():
            _, tokens = in_flight.popleft()
            finished = scheduler.update(tokens, eos_of(plan, tokens))
            record.calls.append(("update", tokens.tolist(), finished.tolist()))
            record.take(scheduler, finished)
    else:
        raise AssertionError("the run does not end")
    return record


def numpy_inputs(driver: StepDriver[np.ndarray], record: Record) -> np.ndarray:
    step = driver.newest
    assert step is not None
    record.inputs_in_flight += len(step.inputs_in_flight)
    return driver.decode_inputs()


def callback_inputs(driver: StepDriver[np.ndarray], record: Record) -> np.ndarray:
    """As a device executor does: the driver names entries and rows, the callback copies."""
    step = driver.newest
    assert step is not None
    inputs = step.output.generation_input_tokens.copy()

    def gather(entries: np.ndarray, rows: np.ndarray, previous: np.ndarray) -> None:
        assert entries.dtype == rows.dtype == np.int64
        assert np.all(inputs[entries] == -1), "an input in flight is given as a row only"
        inputs[entries] = previous[rows]

    record.inputs_in_flight += driver.gather_inputs(gather)
    return inputs


def run_with_driver(
    plan: Plan, resolve: Callable[[StepDriver[np.ndarray], Record], np.ndarray]
) -> Record:
    """The same run through the driver."""
    scheduler, record = new_scheduler(), Record()
    driver: StepDriver[np.ndarray] = StepDriver(scheduler, one_step_ahead=plan.one_step_ahead)
    scheduled = 0
    for _ in range(1_000):
        if not (scheduler.has_unfinished() or driver.pending):
            break
        if scheduler.has_unfinished():
            out = driver.schedule()
            scheduled += 1
            scheduler.abort_many(plan.aborts.get(scheduled, []))
            record.calls.append(("schedule", out.digest))
            if plan.revert_every and scheduled % plan.revert_every == 0:
                aborted = driver.revert()
                record.calls.append(("revert", aborted.tolist()))
                record.take(scheduler, aborted)
                continue
            driver.launched(sample(out, resolve(driver, record)))
        due = driver.due(final=not scheduler.has_unfinished())
        if due is not None:
            tokens = due.sampled
            finished = driver.complete(tokens, eos_of(plan, tokens))
            record.calls.append(("update", tokens.tolist(), finished.tolist()))
            record.take(scheduler, finished)
    else:
        raise AssertionError("the run does not end")
    assert scheduler.pending_steps() == 0
    assert driver.oldest is None
    return record


PLANS = {
    "plain": Plan(False),
    "ahead": Plan(True),
    "plain-reverts": Plan(False, revert_every=4),
    "ahead-reverts": Plan(True, revert_every=4),
    "ahead-eos": Plan(True, eos=True),
    "plain-aborts": Plan(False, aborts={3: [1], 9: [4, 6]}),
    "ahead-aborts-reverts-eos": Plan(True, 5, {3: [1], 9: [4, 6], 10: [2]}, eos=True),
}


@pytest.mark.parametrize("resolve", [numpy_inputs, callback_inputs], ids=["numpy", "callback"])
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_the_driver_makes_the_calls_of_the_hand_driven_scheduler(plan: Plan, resolve) -> None:
    by_hand = run_by_hand(plan)
    driven = run_with_driver(plan, resolve)
    assert driven.calls == by_hand.calls
    assert driven.outputs == by_hand.outputs
    assert driven.inputs_in_flight == by_hand.inputs_in_flight
    assert set(driven.outputs) == {request_id for request_id, _, _ in REQUESTS}
    reasons = {reason for reason, _ in driven.outputs.values()}
    assert any(call[0] == "revert" for call in driven.calls) == bool(plan.revert_every)
    if plan.one_step_ahead:
        assert driven.inputs_in_flight > 0
    if plan.aborts:
        assert "aborted" in reasons
    if plan.eos:
        assert "eos" in reasons


def test_one_step_ahead_gives_the_plain_outputs() -> None:
    """The model reads every decode input, so this fails if an input in flight is wrong."""
    plain = run_with_driver(PLANS["plain"], numpy_inputs)
    ahead = run_with_driver(PLANS["ahead"], numpy_inputs)
    assert ahead.outputs == plain.outputs
    assert all(reason == "length" for reason, _ in plain.outputs.values())


def test_the_pending_steps_and_when_each_is_due() -> None:
    scheduler = new_scheduler()
    driver: StepDriver[np.ndarray] = StepDriver(scheduler, one_step_ahead=True)
    assert driver.pending == 0
    assert driver.oldest is driver.newest is driver.due(final=True) is None
    first = driver.schedule()
    step = driver.newest
    assert step is not None
    assert step.output is first
    assert step.previous is None
    assert not step.launched
    assert driver.due() is None  # one step ahead: it stays in flight while the next is planned
    assert driver.due(final=True) is step
    driver.launched(sample(first, driver.decode_inputs()))
    second = driver.schedule()
    assert driver.pending == scheduler.pending_steps() == 2
    assert driver.steps == (step, driver.newest)
    assert driver.newest is not None
    assert driver.newest.previous is step
    assert driver.due() is step  # the oldest closes once a step is planned behind it
    driver.launched(sample(second, driver.decode_inputs()))
    driver.complete(step.sampled)
    assert step.previous is None
    assert driver.oldest is driver.newest
    assert "pending=[PendingStep(step=1, launched)]" in repr(driver)

    plain: StepDriver[np.ndarray] = StepDriver(new_scheduler())
    assert not plain.one_step_ahead
    plain.schedule()
    assert plain.due() is plain.oldest  # plain: the step is due as soon as it is scheduled


def test_a_revert_one_step_ahead_drops_the_newest_and_keeps_the_one_in_flight() -> None:
    scheduler = small_scheduler()
    driver: StepDriver[np.ndarray] = StepDriver(scheduler, one_step_ahead=True)
    first = driver.schedule()
    tokens = sample(first, driver.decode_inputs())
    driver.launched(tokens)
    driver.schedule()
    assert driver.revert().tolist() == []
    assert driver.pending == scheduler.pending_steps() == 1
    assert driver.oldest is not None
    assert driver.oldest.output is first
    # planned again behind the same step in flight, its inputs taken from that step's samples
    again = driver.schedule()
    sampled = by_request(first, tokens)
    assert sorted(again.generation_ids.tolist()) == sorted(sampled)
    assert driver.decode_inputs().tolist() == [sampled[i] for i in again.generation_ids.tolist()]


def test_an_abort_while_pending_finishes_at_the_close() -> None:
    scheduler = small_scheduler()
    driver: StepDriver[np.ndarray] = StepDriver(scheduler, one_step_ahead=True)
    first = driver.schedule()
    driver.launched(sample(first, driver.decode_inputs()))
    second = driver.schedule()
    victim = int(first.sample_ids[0])
    scheduler.abort(victim)  # while two steps are pending
    assert scheduler.is_abort_requested(victim)
    driver.launched(sample(second, driver.decode_inputs()))
    oldest = driver.oldest
    assert oldest is not None
    finished = driver.complete(oldest.sampled)
    assert victim in finished.tolist()
    output = scheduler.take_output(victim)
    assert output.finish_reason == "aborted"
    assert output.token_ids.size == 0  # its token of the closed step is dropped
    for step in driver.drain():
        driver.complete(step.sampled)
    assert driver.pending == scheduler.pending_steps() == 0


def test_drain_closes_every_pending_step_oldest_first() -> None:
    scheduler = new_scheduler()
    driver: StepDriver[np.ndarray] = StepDriver(scheduler, one_step_ahead=True)
    steps = []
    for _ in range(2):
        out = driver.schedule()
        driver.launched(sample(out, driver.decode_inputs()))
        steps.append(out.step)
    closed = []
    for step in driver.drain():
        closed.append(step.output.step)
        driver.complete(step.sampled)
    assert closed == steps
    assert driver.pending == scheduler.pending_steps() == 0

    out = driver.schedule()
    driver.launched(sample(out, driver.decode_inputs()))
    with pytest.raises(InvalidStateError, match="yielded and not closed"):
        for _ in driver.drain():
            pass
    assert driver.pending == scheduler.pending_steps() == 1


def test_gather_is_not_called_without_inputs_in_flight() -> None:
    driver: StepDriver[Any] = StepDriver(small_scheduler(), one_step_ahead=True)
    calls: list[Any] = []
    driver.schedule()  # prompts only: nothing in flight
    assert driver.gather_inputs(lambda *args: calls.append(args)) == 0
    assert calls == []
    marker = object()  # any record of the executor's: gather_inputs hands it back as is
    driver.launched(marker)
    out = driver.schedule()
    count = driver.gather_inputs(lambda *args: calls.append(args))
    assert count == len(calls[0][0]) == 3
    entries, rows, previous = calls[0]
    assert previous is marker
    assert out.generation_input_tokens[entries].tolist() == [-1] * count
    first = driver.oldest
    assert first is not None
    assert first.output.sample_ids[rows].tolist() == out.generation_ids[entries].tolist()
    with pytest.raises(InvalidTypeError, match="not its sampled tokens"):
        driver.decode_inputs()  # the host path needs the tokens themselves


def test_the_driver_takes_any_contract_implementation() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=128))
    group.add_request(1, prompt(5, 1), 3)
    group.add_request(2, prompt(3, 2), 3)
    driver: StepDriver[np.ndarray] = StepDriver(group, one_step_ahead=True)
    first = driver.schedule()
    tokens = np.array([11, 12], dtype=np.int32)
    driver.launched(tokens)
    ahead = driver.schedule()
    sampled = by_request(first, tokens)
    assert driver.decode_inputs().tolist() == [sampled[i] for i in ahead.generation_ids.tolist()]
    driver.launched(np.array([13, 14], dtype=np.int32))
    for step in driver.drain():
        driver.complete(step.sampled)


# -- misuse: a typed error, and nothing changed -----------------------------------------


def state(driver: StepDriver[Any]) -> tuple[Any, ...]:
    scheduler = driver.scheduler
    assert isinstance(scheduler, helix_kv.Scheduler)
    return (
        driver.pending,
        [(s.output.step, s.launched) for s in driver.steps],
        scheduler.pending_steps(),
        scheduler.state_digest(),
    )


def unchanged(driver: StepDriver[Any], call: Callable[[], Any], error: type, match: str) -> None:
    before = state(driver)
    with pytest.raises(error, match=match):
        call()
    assert state(driver) == before


def test_closing_with_nothing_pending_is_refused() -> None:
    driver: StepDriver[np.ndarray] = StepDriver(new_scheduler())
    unchanged(driver, lambda: driver.complete([1]), InvalidStateError, "no step is pending")
    unchanged(driver, driver.revert, InvalidStateError, "no step is pending")
    unchanged(driver, lambda: driver.launched(np.zeros(1)), InvalidStateError, "no step")
    unchanged(driver, driver.decode_inputs, InvalidStateError, "no step is pending")
    unchanged(driver, lambda: driver.gather_inputs(print), InvalidStateError, "no step")


def test_a_wrong_token_count_is_the_schedulers_error_with_the_step_still_pending() -> None:
    driver: StepDriver[np.ndarray] = StepDriver(new_scheduler())
    out = driver.schedule()
    tokens = np.zeros(out.num_samples + 1, dtype=np.int32)
    too_many = f"got {tokens.size} tokens for the {out.num_samples} entries"
    unchanged(driver, lambda: driver.complete(tokens), InvalidArgumentError, too_many)
    strings = ["x"] * out.num_samples
    unchanged(driver, lambda: driver.complete(strings), InvalidTypeError, "int")
    driver.complete(tokens[:-1])
    assert driver.pending == 0


def test_scheduling_past_the_mode_is_refused() -> None:
    plain: StepDriver[np.ndarray] = StepDriver(new_scheduler())
    plain.schedule()
    unchanged(plain, plain.schedule, InvalidStateError, r"at most 0 .*\(plain\)")

    ahead: StepDriver[np.ndarray] = StepDriver(new_scheduler(), one_step_ahead=True)
    out = ahead.schedule()
    unchanged(ahead, ahead.schedule, InvalidStateError, "pending but not launched")
    ahead.launched(sample(out, ahead.decode_inputs()))
    unchanged(ahead, lambda: ahead.launched(np.zeros(1)), InvalidStateError, "already ran")
    ahead.schedule()
    unchanged(ahead, ahead.schedule, InvalidStateError, "at most 1")


def test_an_unlaunched_steps_samples_are_refused() -> None:
    driver: StepDriver[np.ndarray] = StepDriver(new_scheduler())
    driver.schedule()
    step = driver.newest
    assert step is not None
    with pytest.raises(InvalidStateError, match="has not been launched"):
        _ = step.sampled


@pytest.mark.parametrize(
    ("sampled", "error", "match"),
    [
        (np.zeros(3, dtype=np.float32), InvalidTypeError, "dtype float32"),
        (["a", "b"], InvalidTypeError, "not its sampled tokens"),
        (np.zeros(1, dtype=np.int32), InvalidLengthError, "not one per sample"),
        (np.zeros((10, 1), dtype=np.int32), InvalidLengthError, "shape"),
    ],
)
def test_decode_inputs_need_the_previous_steps_tokens(
    sampled: Any, error: type, match: str
) -> None:
    driver: StepDriver[Any] = StepDriver(small_scheduler(), one_step_ahead=True)
    driver.schedule()
    driver.launched(sampled)
    driver.schedule()
    unchanged(driver, driver.decode_inputs, error, match)


def test_a_driver_starts_between_steps() -> None:
    scheduler = new_scheduler()
    scheduler.schedule()
    with pytest.raises(InvalidStateError, match="1 pending step"):
        StepDriver(scheduler)


class FailingSchedule:
    """A scheduler whose schedule() fails once (as a deadlock or a schedule mismatch does)."""

    def __init__(self, scheduler: helix_kv.Scheduler) -> None:
        self.inner = scheduler
        self.fail = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def schedule(self) -> helix_kv.ScheduleOutput:
        if self.fail:
            self.fail = False
            raise helix_kv.DeadlockError("no progress")
        return self.inner.schedule()


def test_a_failed_schedule_holds_nothing() -> None:
    scheduler = FailingSchedule(new_scheduler())
    driver: StepDriver[np.ndarray] = StepDriver(scheduler)  # type: ignore[arg-type]
    with pytest.raises(helix_kv.DeadlockError):
        driver.schedule()
    assert driver.pending == 0
    out = driver.schedule()
    assert driver.oldest is not None
    assert driver.oldest.output is out
