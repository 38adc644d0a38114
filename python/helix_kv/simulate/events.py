"""The simulator's event stream: one record per scheduler step and one per request outcome.

:func:`helix_kv.simulate.step_loop.run_simulation` takes an ``events=`` sink (anything with
``on_step`` and ``on_request``, see :class:`EventSink`) and calls it as the run goes: a
:class:`StepEvent` after every scheduler step and a :class:`RequestEvent` whenever a request
finishes or is aborted. Without a sink nothing is built. :class:`JsonlEventWriter` is the sink
behind ``helix-kv simulate --events FILE``: a ``"meta"`` line, then one JSON object per event,
in the order they happen (a step's record comes before the records of the requests that
finished in it). :class:`EventLog` keeps them in lists.

Counts are global (the CP group's, equal on every rank). Times are in steps of the simulated
clock; the ``*_ms`` fields are ``null`` unless a step-time model is on (:mod:`.timing`), and are
then modelled, not measured. docs/user-guide.md has the schema table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from helix_kv.types import FinishReason

__all__ = [
    "EVENTS_SCHEMA",
    "EVENTS_SCHEMA_VERSION",
    "FLOAT_DIGITS",
    "STDOUT_TARGET",
    "EventLog",
    "EventSink",
    "JsonlEventWriter",
    "RequestEvent",
    "StepEvent",
]

#: The ``schema`` of an events file's first (``"meta"``) line, and its version: a version
#: changes when a key is removed or changes meaning (new keys may appear without one).
EVENTS_SCHEMA = "helix_kv.simulate.events"
EVENTS_SCHEMA_VERSION = 1

#: ``--events -``: where the CLI passes this string (not a ``Path``: ``Path("-")`` is a file
#: named ``-``) as the events target, the events go to standard output.
STDOUT_TARGET = "-"


@dataclass(frozen=True)
class StepEvent:
    """One scheduler step: what it did, and the state it left.

    ``running``, ``waiting`` and ``suspended`` are counted at the end of the step (its tokens
    fed, its finished requests gone); the KV figures are read right after it was scheduled,
    when its pages are reserved (the report's utilisation figures are these); the other counts
    are what this step did.
    """

    step: int
    """Scheduler steps before this one in the run (0, 1, 2, ...: idle time is no step)."""
    clock: int
    """The simulated clock at this step (it jumps over idle time)."""
    running: int
    """Requests holding KV (prefilling or decoding)."""
    waiting: int
    """Requests waiting for (re-)admission."""
    suspended: int
    """Requests suspended to the host tier (``non_helix`` mode with a host tier only)."""
    kv_used_superblocks: int
    kv_utilization: float
    """``kv_used_superblocks`` over the pool's capacity."""
    scheduled_tokens: int
    """``context_tokens + decode_tokens`` (``+ draft_tokens`` with drafts): the step's
    ``num_tokens``."""
    context_tokens: int
    """Prompt (or re-prefill) tokens in the step's prefill chunks."""
    decode_tokens: int
    """Decode entries, one token each."""
    kv_tokens_read: int
    """Global KV tokens the step's attention reads (see :func:`.timing.kv_tokens_read`)."""
    samples: int
    """Tokens sampled (decode entries plus prefills that completed their prompt)."""
    preemptions: int
    """Requests recompute-paused by this step."""
    suspensions: int
    """Requests suspended to the host tier by this step."""
    resumes: int
    """Suspended requests brought back by this step."""
    sat_out: int
    """Decode entries that found neither pages nor a victim and sat this step out."""
    aborted: int
    """Requests aborted since the previous step (aborts applied after the last step appear
    only as request records)."""
    finished: int
    """Requests that finished by this step (reached their length)."""
    start_ms: float | None = None
    """Modelled time the step starts at (``null`` without a step-time model)."""
    duration_ms: float | None = None
    """Modelled duration of the step (``null`` without a step-time model)."""
    cached_tokens: int = 0
    """Prompt tokens the step's admissions (and re-admissions after a recompute-pause) found
    in the prefix cache instead of computing them (the sum of ``context_cached_lens``; 0
    without prefix caching)."""
    drafts: int | None = None
    """Speculative decoding: decode entries that verified at least one draft token (``None``,
    and no key in the file, without drafts)."""
    draft_tokens: int | None = None
    """Speculative decoding: draft tokens the step verified (counted in ``scheduled_tokens``,
    not in ``decode_tokens``)."""
    accepted_tokens: int | None = None
    """Speculative decoding: of those, the draft tokens accepted (each a token kept on top of
    its decode's own)."""

    def to_record(self) -> dict[str, Any]:
        """The step as a JSON object with ``"type": "step"`` (the draft keys only when the
        run had drafts)."""
        record = {"type": "step", **vars(self)}
        for key in _DRAFT_KEYS:
            if record[key] is None:
                del record[key]
        return record


_DRAFT_KEYS = ("drafts", "draft_tokens", "accepted_tokens")


@dataclass(frozen=True)
class RequestEvent:
    """What happened to one request, once it finished or was aborted."""

    request_id: int
    prompt_tokens: int
    finish_reason: FinishReason
    """``"length"`` (it generated every token it asked for) or ``"aborted"``."""
    arrival_step: int
    first_token_step: int | None
    """The step that sampled its first token; ``None`` if it was aborted before one."""
    finish_step: int
    """The step that sampled its last token; for an aborted request, the clock step it was
    aborted before."""
    generated_tokens: int
    victim_choices: int
    """Times it was chosen as a victim (recompute-paused or suspended)."""
    recomputed_tokens: int
    """Tokens computed again after its recompute-pauses."""
    steps_waited: int
    """Steps it was live but got no work."""
    output_exact: bool
    """It generated exactly the tokens it would have without any preemption (an aborted
    request: exactly their start)."""
    arrival_ms: float | None = None
    """Modelled time of its arrival: the start of its arrival clock step (a timed workload:
    its ``arrival_ms`` itself, which may fall inside a step: it waits for the next one)."""
    first_token_ms: float | None = None
    """Modelled time its first token was sampled: the end of that step."""
    finish_ms: float | None = None
    """Modelled time it finished: the end of its last step, or when it was aborted."""
    cached_tokens: int = 0
    """Tokens it found in the prefix cache over its admissions (its re-prefills after
    recompute-pauses included); 0 without prefix caching."""

    def to_record(self) -> dict[str, Any]:
        """The request as a JSON object with ``"type": "request"``."""
        return {"type": "request", **vars(self)}


@runtime_checkable
class EventSink(Protocol):
    """What ``run_simulation(events=...)`` calls; both methods are called in order, as the run
    goes, on the thread that runs it."""

    def on_step(self, event: StepEvent) -> None:
        """After each scheduler step."""
        ...

    def on_request(self, event: RequestEvent) -> None:
        """When a request finishes or is aborted."""
        ...


@dataclass
class EventLog:
    """An :class:`EventSink` that keeps every event, in order of arrival per kind."""

    steps: list[StepEvent] = field(default_factory=list)
    requests: list[RequestEvent] = field(default_factory=list)

    def on_step(self, event: StepEvent) -> None:
        self.steps.append(event)

    def on_request(self, event: RequestEvent) -> None:
        self.requests.append(event)


def meta_record(config: Mapping[str, Any]) -> dict[str, Any]:
    """The first line of an events file: the schema, its version, the run's configuration
    (``config``, the report's) and the step-time model (``null`` when off)."""
    return {
        "type": "meta",
        "schema": EVENTS_SCHEMA,
        "version": EVENTS_SCHEMA_VERSION,
        "step_time_model": config.get("step_time_model"),
        "config": dict(config),
    }


#: Significant digits of the floats of the step and request lines: the last bits of a sum of
#: modelled step times (``15.410400000000001``) are noise, not precision.
FLOAT_DIGITS = 10


def _rounded(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with each float value cut to :data:`FLOAT_DIGITS` significant digits."""
    return {
        key: float(f"{value:.{FLOAT_DIGITS}g}") if isinstance(value, float) else value
        for key, value in record.items()
    }


class JsonlEventWriter:
    """An :class:`EventSink` writing JSON Lines: the ``"meta"`` line (written when the writer
    is made), then one line per event, its floats to :data:`FLOAT_DIGITS` significant digits
    (the :class:`EventLog` and the records keep them whole). ``target`` is a path (opened,
    truncated, and closed by :meth:`close`) or an open text file (left open). Use it as a
    context manager."""

    def __init__(self, target: str | Path | IO[str], config: Mapping[str, Any]) -> None:
        if isinstance(target, (str, Path)):
            self._file: IO[str] = open(target, "w", encoding="utf-8")  # noqa: SIM115
            self._owned = True
        else:
            self._file = target
            self._owned = False
        self._write(meta_record(config))

    def _write(self, record: dict[str, Any]) -> None:
        # allow_nan=False: every figure is finite; a NaN would make the line invalid JSON
        self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def on_step(self, event: StepEvent) -> None:
        self._write(_rounded(event.to_record()))

    def on_request(self, event: RequestEvent) -> None:
        self._write(_rounded(event.to_record()))

    def close(self) -> None:
        """Flush, and close the file if the writer opened it."""
        if self._owned:
            self._file.close()
        else:
            self._file.flush()

    def __enter__(self) -> JsonlEventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
