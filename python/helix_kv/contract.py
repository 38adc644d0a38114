"""The scheduler contract: the calls an executor (or the simulator) makes on a scheduler.

Three classes satisfy :class:`SchedulerProtocol`, with the same semantics:

- :class:`helix_kv.Scheduler`: one rank's scheduler (the Rust core);
- :class:`helix_kv.SimulatedCPGroup`: every rank of a CP group in one process, fed identical
  calls and compared after each (a divergence raises
  :class:`~helix_kv.errors.ScheduleMismatchError`);
- ``helix_kv.distributed.HelixKVRank``: this process's rank of a ``torch.distributed`` group,
  its schedules compared across the group every step when the schedule check is on.

The simulator's step loop (:func:`helix_kv.simulate.step_loop.run_simulation`) and the
reference executor (``helix_kv.executor.runner.run_rank``) drive this contract and nothing
else of the scheduler (the executor also reads block tables and slot mappings, which are
per-rank and outside the contract), through :class:`helix_kv.StepDriver`.

One step: optionally ``propose_drafts()`` (speculative decoding), ``schedule()``, run the model
on what it scheduled, then either ``update()`` with one sampled token per ``sample_ids`` entry
(and the accepted draft counts) or ``revert()`` to drop the step. An overlapping
executor schedules the next step while one is pending (one step ahead);
:class:`helix_kv.StepDriver` owns that protocol for an executor, plain or one step ahead
(which step closes when, the inputs a step planned ahead reads from the one before it), and
its docs state its rules. Requests are added and aborted between steps (an abort while a step
is pending completes when the step closes); a finished request's output is taken once with
``take_output()``. Every call that raises has changed nothing. Modelled on vLLM's
``SchedulerInterface`` (``vllm/v1/core/sched/interface.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from helix_kv._core import RequestOutput, ScheduleOutput, SchedulerMetrics
from helix_kv.types import FlagArray, IntArray, TokenArray

__all__ = ["SchedulerProtocol"]


@runtime_checkable
class SchedulerProtocol(Protocol):
    """What :class:`helix_kv.Scheduler`, :class:`helix_kv.SimulatedCPGroup` and
    ``helix_kv.distributed.HelixKVRank`` all provide (``isinstance`` checks the names only;
    ``mypy`` checks the signatures)."""

    def add_request(
        self,
        request_id: int,
        prompt: TokenArray,
        max_new_tokens: int,
        priority: int = 0,
        *,
        cache_salt: str | bytes | None = None,
    ) -> None:
        """Queues a request (``DuplicateRequestError`` if the id is live or its output not
        yet taken; ``RequestTooLargeError`` if it can never fit). ``cache_salt``: with
        prefix caching, it shares cached KV only with requests of the same salt."""
        ...

    def reset_prefix_cache(self) -> int:
        """Drops every cached superblock no request references (the same on every rank) and
        returns how many; ``InvalidStateError`` while a step is pending."""
        ...

    def abort(self, request_id: int) -> bool:
        """Aborts a live request and returns True; while a step is pending, it is aborted
        when the step closes (one already being aborted is left alone, and is True). An id
        with no live request (finished, its output taken or not, or never added) is a no-op
        that returns False: client disconnects race with completion."""
        ...

    def abort_many(self, request_ids: IntArray) -> npt.NDArray[np.bool_]:
        """Aborts requests (see :meth:`abort`); returns, per id, whether it was live when the
        call was made. Between steps they retire in queue order, whatever the order given."""
        ...

    def schedule(self) -> ScheduleOutput:
        """Schedules the next step. Allowed while one step is pending (one step ahead, see
        :class:`helix_kv.StepDriver`); ``InvalidStateError`` while two are."""
        ...

    def pending_steps(self) -> int:
        """How many scheduled steps await ``update()`` or ``revert()``: 0, 1 or 2."""
        ...

    def update(
        self,
        tokens: TokenArray,
        eos: FlagArray | None = None,
        accepted: IntArray | None = None,
    ) -> npt.NDArray[np.uint64]:
        """Closes the oldest pending step with one sampled token (and optionally an end-of-sequence
        flag) per ``sample_ids`` entry; returns the ids that finished, whose outputs are now
        ready for :meth:`take_output`. With drafts, ``accepted`` gives per generation entry how
        many of its drafts were accepted (its ``1 + drafts`` rows are all in ``tokens``)."""
        ...

    def propose_drafts(self, request_ids: IntArray, counts: IntArray, tokens: TokenArray) -> None:
        """Proposes draft tokens for the next ``schedule()`` (speculative decoding; at most
        ``num_speculative_tokens`` each), identical on every rank; replaces earlier proposals."""
        ...

    def revert(self) -> npt.NDArray[np.uint64]:
        """Undoes the newest pending step the executor did not run (its preemptions stay applied:
        the victims re-prefill); returns the ids of requests whose abort was requested while
        it was pending, aborted now."""
        ...

    def take_output(self, request_id: int) -> RequestOutput:
        """The output of a finished or aborted request (its tokens, finish reason and
        counters); taking it frees the id."""
        ...

    def metrics(self) -> SchedulerMetrics:
        """The scheduler's totals (equal on every rank)."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request is still live (waiting, running or suspended)."""
        ...

    @property
    def num_running(self) -> int:
        """Requests holding KV (prefilling or decoding)."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests waiting for (re-)admission."""
        ...


if TYPE_CHECKING:
    # Static proof that the three implementations satisfy the contract (``mypy --strict`` in
    # CI checks these assignments; the tests check it at run time).
    from helix_kv._core import Scheduler
    from helix_kv.cpgroup import SimulatedCPGroup
    from helix_kv.distributed.rank import HelixKVRank

    def _implementations(
        scheduler: Scheduler, group: SimulatedCPGroup, rank: HelixKVRank
    ) -> list[SchedulerProtocol]:
        return [scheduler, group, rank]
