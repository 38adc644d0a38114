"""The executor side of the step protocol, in one class: :class:`StepDriver`.

An executor drives a scheduler (any :class:`helix_kv.contract.SchedulerProtocol`) one step at
a time: ``schedule()``, run the step, then ``update()`` with its sampled tokens or
``revert()``. One step ahead (an overlapping executor) it schedules step ``t + 1`` while step
``t`` runs, so the driver then holds two steps, and three rules apply that every such executor
would otherwise write itself:

- step ``t + 1``'s decode inputs still being sampled by step ``t`` are rows of step ``t``'s
  sampled tokens (``ScheduleOutput.generation_input_refs``): the driver resolves them, on the
  host (:meth:`StepDriver.decode_inputs`) or through a callback that gathers on the device
  (:meth:`StepDriver.gather_inputs`);
- ``update()`` closes the **oldest** pending step and ``revert()`` drops the **newest**
  (:meth:`StepDriver.complete`, :meth:`StepDriver.revert`);
- step ``t`` closes once step ``t + 1`` is planned behind it, or when nothing follows it
  (:meth:`StepDriver.due`, :meth:`StepDriver.drain`).

The driver decides nothing itself: the scheduler plans every step, and the driver sequences
the calls and gathers tokens by the rows the scheduler names. What the executor keeps of a
launched step (its sampled tokens as a numpy array, a device tensor, or a record holding
them) is the driver's type parameter ``S``; the driver stores it and hands it back. Misuse
raises :class:`~helix_kv.errors.InvalidStateError` (a call out of order),
:class:`~helix_kv.errors.InvalidTypeError` or :class:`~helix_kv.errors.InvalidLengthError`
(sampled tokens that are not one integer per sample), and changes nothing; an error of the
scheduler's own call propagates, with the driver unchanged too.

``docs/executor.md`` ("The step driver") shows the loop an engine runs with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar, cast

import numpy as np
import numpy.typing as npt

from helix_kv._core import InvalidLengthError, InvalidStateError, InvalidTypeError, ScheduleOutput
from helix_kv.contract import SchedulerProtocol
from helix_kv.types import FlagArray, IntArray, TokenArray

__all__ = ["InputsInFlight", "PendingStep", "StepDriver"]

#: What the executor keeps of a launched step (its sampled tokens, or a record holding them).
S = TypeVar("S")

#: ``gather(entries, rows, previous)``: write row ``rows[k]`` of ``previous`` (the sampled
#: tokens of the step in flight, as the executor keeps them) into decode entry ``entries[k]``
#: of the step being launched (:meth:`StepDriver.gather_inputs`).
GatherInputs = Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64], S], object]


@dataclass(frozen=True, eq=False)
class InputsInFlight:
    """A step's decode inputs still being sampled by the step pending before it: decode entry
    ``entries[k]`` (an index into the step's ``generation_ids``) takes row ``rows[k]`` of that
    step's sampled tokens (its ``sample_ids`` order). Both int64, in entry order."""

    entries: npt.NDArray[np.int64]
    rows: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.entries.size)


class PendingStep(Generic[S]):
    """A step the driver scheduled and has not closed: its schedule (:attr:`output`), what the
    executor launched it with (:attr:`sampled`) and the step pending before it
    (:attr:`previous`, one step ahead), whose samples its inputs in flight are rows of."""

    __slots__ = ("_flight", "_launched", "_sampled", "output", "previous")

    def __init__(self, output: ScheduleOutput, previous: PendingStep[S] | None) -> None:
        self.output = output
        #: The step pending when this one was scheduled (``None`` in plain mode, and once
        #: this step is closed: its inputs were needed before it ran).
        self.previous = previous
        self._launched = False
        self._sampled: S | None = None
        self._flight: InputsInFlight | None = None

    @property
    def launched(self) -> bool:
        """Whether :meth:`StepDriver.launched` recorded this step's sampled tokens."""
        return self._launched

    @property
    def sampled(self) -> S:
        """What the executor launched this step with (:meth:`StepDriver.launched`);
        ``InvalidStateError`` before that."""
        if not self._launched:
            raise InvalidStateError(
                f"step {self.output.step} has not been launched: StepDriver.launched(sampled) "
                "records what it sampled"
            )
        return cast(S, self._sampled)

    @property
    def inputs_in_flight(self) -> InputsInFlight:
        """The decode entries whose input is a row of the previous step's samples (none in a
        plain step): the scheduler's ``generation_input_refs``, read once."""
        if self._flight is None:
            refs = np.asarray(self.output.generation_input_refs)
            entries = np.flatnonzero(refs >= 0).astype(np.int64, copy=False)
            self._flight = InputsInFlight(entries, refs[entries].astype(np.int64))
        return self._flight

    def __repr__(self) -> str:
        state = "launched" if self._launched else "scheduled"
        return f"PendingStep(step={self.output.step}, {state})"


class StepDriver(Generic[S]):
    """Owns the step protocol for an executor: plain, or one step ahead.

    Args:
        scheduler: the scheduler the executor drives (:class:`helix_kv.Scheduler`,
            :class:`helix_kv.SimulatedCPGroup`, ``helix_kv.distributed.HelixKVRank``), with no
            step pending. Every ``schedule``, ``update`` and ``revert`` goes through the
            driver from then on; requests are added, aborted and taken on the scheduler.
        one_step_ahead: schedule step ``t + 1`` while step ``t`` is pending (an overlapping
            executor); otherwise each step closes before the next is scheduled.

    A step of the loop, in either mode::

        out = driver.schedule()                  # plan the next step
        inputs = driver.decode_inputs()          # or driver.gather_inputs(on_device)
        driver.launched(run(out, inputs))        # what the step sampled (array, tensor...)
        step = driver.due(final=not scheduler.has_unfinished())
        if step is not None:                     # plain: this step; ahead: the one before
            finished = driver.complete(tokens_of(step.sampled))

    and at the end ``for step in driver.drain(): driver.complete(tokens_of(step.sampled))``.

    Raises:
        InvalidStateError: ``scheduler`` has a step pending.
    """

    def __init__(self, scheduler: SchedulerProtocol, *, one_step_ahead: bool = False) -> None:
        self._scheduler = scheduler
        self._one_step_ahead = bool(one_step_ahead)
        self._steps: deque[PendingStep[S]] = deque()
        pending = scheduler.pending_steps()
        if pending:
            raise InvalidStateError(
                f"StepDriver: the scheduler has {pending} pending step(s); a driver starts "
                "between steps"
            )

    @property
    def scheduler(self) -> SchedulerProtocol:
        """The scheduler this driver drives."""
        return self._scheduler

    @property
    def one_step_ahead(self) -> bool:
        """Whether the next step is scheduled while one is pending."""
        return self._one_step_ahead

    @property
    def pending(self) -> int:
        """Steps scheduled and not closed yet: 0 or 1 (plain), up to 2 (one step ahead)."""
        return len(self._steps)

    @property
    def steps(self) -> tuple[PendingStep[S], ...]:
        """The pending steps, oldest first."""
        return tuple(self._steps)

    @property
    def oldest(self) -> PendingStep[S] | None:
        """The step :meth:`complete` closes next, if any."""
        return self._steps[0] if self._steps else None

    @property
    def newest(self) -> PendingStep[S] | None:
        """The step scheduled last and not closed (the one :meth:`revert` drops), if any."""
        return self._steps[-1] if self._steps else None

    def schedule(self) -> ScheduleOutput:
        """Schedules the next step and holds it as the newest pending step.

        Plain, no step may be pending; one step ahead, at most one, and it must be launched
        (the new step's inputs in flight are rows of what it sampled). Otherwise
        ``InvalidStateError`` and nothing is scheduled. The scheduler's errors (deadlock,
        preemption disabled, a schedule mismatch) propagate with nothing held.
        """
        limit = 2 if self._one_step_ahead else 1
        if len(self._steps) >= limit:
            mode = "one step ahead" if self._one_step_ahead else "plain"
            raise InvalidStateError(
                f"StepDriver.schedule: {len(self._steps)} step(s) pending, at most {limit - 1} "
                f"while scheduling ({mode}); complete or revert one first"
            )
        previous = self._steps[-1] if self._steps else None
        if previous is not None and not previous.launched:
            raise InvalidStateError(
                f"StepDriver.schedule: step {previous.output.step} is pending but not launched; "
                "launched(sampled) must record its samples before the step after it is planned"
            )
        output = self._scheduler.schedule()
        self._steps.append(PendingStep(output, previous))
        return output

    def propose_drafts(self, request_ids: IntArray, counts: IntArray, tokens: TokenArray) -> None:
        """Proposes draft tokens for the step :meth:`schedule` plans next (speculative
        decoding; see :meth:`helix_kv.Scheduler.propose_drafts`). One step ahead, a request
        whose decode in the pending step carries drafts is not planned again until that step
        completes (its next position depends on how many are accepted), so drafts for it
        are ignored until then."""
        self._scheduler.propose_drafts(request_ids, counts, tokens)

    def launched(self, sampled: S) -> None:
        """Records that the newest step runs (its work is queued) and what it samples into:
        its sampled tokens (an integer array, one per ``sample_ids`` entry, for
        :meth:`decode_inputs`), a device tensor, or any record of the executor's. The step
        after it resolves its inputs in flight from ``sampled``; :meth:`due` and
        :meth:`drain` hand it back when the step is to be completed.

        ``InvalidStateError`` when no step is pending or the newest was launched already.
        """
        step = self._newest("launched")
        if step.launched:
            raise InvalidStateError(f"StepDriver.launched: step {step.output.step} already ran")
        step._sampled = sampled
        step._launched = True

    def decode_inputs(self) -> npt.NDArray[np.int32]:
        """The newest step's decode input tokens (int32, one per generation entry, entry
        order): ``generation_input_tokens``, with each input still in flight taken from the
        previous step's sampled tokens, which must then be what that step was launched with
        (an integer array, one token per its ``sample_ids`` entry).

        ``InvalidStateError`` when no step is pending; ``InvalidTypeError`` or
        ``InvalidLengthError`` when the previous step's samples are not such an array.
        """
        step = self._newest("decode_inputs")
        inputs = np.array(step.output.generation_input_tokens, dtype=np.int32)
        flight = step.inputs_in_flight
        if len(flight):
            previous = self._previous_of(step, "decode_inputs")
            tokens = _sampled_tokens(previous)
            inputs[flight.entries] = tokens[flight.rows]
        return inputs

    def gather_inputs(self, gather: GatherInputs[S]) -> int:
        """Resolves the newest step's inputs in flight through ``gather(entries, rows,
        previous)``: write row ``rows[k]`` of ``previous`` (what the previous step was
        launched with, e.g. its sampled tokens on the device) into decode entry
        ``entries[k]`` (int64 index arrays on the host). Not called when no input is in
        flight. Returns how many inputs were in flight.

        ``InvalidStateError`` when no step is pending.
        """
        step = self._newest("gather_inputs")
        flight = step.inputs_in_flight
        if not len(flight):
            return 0
        gather(flight.entries, flight.rows, self._previous_of(step, "gather_inputs").sampled)
        return len(flight)

    def due(self, *, final: bool = False) -> PendingStep[S] | None:
        """The step to :meth:`complete` now, if any: plain, the pending step; one step
        ahead, the oldest once a step is scheduled behind it, or once ``final`` says no
        step will be (the workload is done for now)."""
        if not self._steps:
            return None
        if not self._one_step_ahead or final or len(self._steps) > 1:
            return self._steps[0]
        return None

    def complete(
        self,
        tokens: TokenArray,
        eos: FlagArray | None = None,
        accepted: IntArray | None = None,
    ) -> npt.NDArray[np.uint64]:
        """Closes the oldest pending step (``update``): one sampled token, and optionally
        an end-of-sequence flag, per its ``sample_ids`` entry, and with drafts the accepted
        draft count of each generation entry. Returns the ids that finished
        (by length, EOS, or an abort requested while it was pending), whose outputs the
        scheduler's ``take_output`` now gives.

        ``InvalidStateError`` when no step is pending; the scheduler's errors (wrong token
        count or type) propagate; either way nothing changed.
        """
        if not self._steps:
            raise InvalidStateError("StepDriver.complete: no step is pending")
        if accepted is None:
            # Without drafts the two-argument call, which every contract implementation
            # before speculative decoding takes too.
            finished = self._scheduler.update(tokens, eos)
        else:
            finished = self._scheduler.update(tokens, eos, accepted)
        self._steps.popleft().previous = None
        return finished

    def revert(self) -> npt.NDArray[np.uint64]:
        """Drops the newest pending step (``revert``: the executor did not run it; one step
        ahead the older step stays pending). Returns the ids of requests whose abort was
        requested while it was pending and that are aborted now.

        ``InvalidStateError`` when no step is pending (nothing changed).
        """
        if not self._steps:
            raise InvalidStateError("StepDriver.revert: no step is pending")
        aborted = self._scheduler.revert()
        self._steps.pop().previous = None
        return aborted

    def drain(self) -> Iterator[PendingStep[S]]:
        """Yields each pending step, oldest first, for the caller to :meth:`complete` (or
        :meth:`revert`) before the next one is asked for: the end of a run. A step left
        pending when the next one is asked for raises ``InvalidStateError``."""
        while self._steps:
            step = self._steps[0]
            yield step
            if self._steps and self._steps[0] is step:
                raise InvalidStateError(
                    f"StepDriver.drain: step {step.output.step} was yielded and not closed"
                )

    def _newest(self, call: str) -> PendingStep[S]:
        if not self._steps:
            raise InvalidStateError(f"StepDriver.{call}: no step is pending")
        return self._steps[-1]

    def _previous_of(self, step: PendingStep[S], call: str) -> PendingStep[S]:
        previous = step.previous
        if previous is None or not previous.launched:
            # the scheduler refers to a pending step only, and schedule() saw it launched
            raise InvalidStateError(
                f"StepDriver.{call}: step {step.output.step} has inputs in flight but no "
                "launched step before it"
            )
        return previous

    def __repr__(self) -> str:
        mode = "one_step_ahead" if self._one_step_ahead else "plain"
        return f"StepDriver({mode}, pending={list(self._steps)})"


def _sampled_tokens(step: PendingStep[S]) -> npt.NDArray[np.integer]:
    """What ``step`` was launched with, as its sampled tokens: an integer array of one token
    per ``sample_ids`` entry."""
    try:
        tokens = np.asarray(step.sampled)
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor on a device
        tokens = np.asarray(None)
    if tokens.dtype.kind not in "iu":
        raise InvalidTypeError(
            f"step {step.output.step} was launched with {type(step.sampled).__name__} of dtype "
            f"{tokens.dtype}, not its sampled tokens: decode_inputs needs an integer array "
            "(gather_inputs takes any)"
        )
    expected = int(step.output.num_samples)
    if tokens.shape != (expected,):
        raise InvalidLengthError(
            f"step {step.output.step} was launched with tokens of shape {tokens.shape}, "
            f"not one per sample ({expected})"
        )
    return tokens
