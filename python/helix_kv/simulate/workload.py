"""Workloads for the simulator: a seeded synthetic generator and a JSONL trace reader.

A workload is a list of :class:`RequestSpec` in queue order: by arrival step, then by
position in the source (generation order or trace line order). The scheduler's queue order
is the order of adding, so this order is what every rank sees.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from helix_kv.errors import TraceError as TraceError  # also importable from here

#: Largest request id the scheduler accepts (ids are ``u64`` in the core).
MAX_REQUEST_ID = 2**64 - 1

#: The keys of one trace line; ``priority`` (default 0) and ``abort_step`` (default: never
#: aborted) are optional, other keys are ignored.
TRACE_REQUIRED_KEYS = ("id", "arrival_step", "prompt_len", "output_len")
TRACE_OPTIONAL_KEYS = ("priority", "abort_step")

#: Largest step a trace may name.
MAX_STEP = 2**62


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload; lengths are in global tokens.

    ``abort_step``: the client aborts the request before step ``abort_step`` is scheduled
    (``>= arrival_step``; ``None``: never). A request that finished earlier is not affected.
    """

    request_id: int
    arrival_step: int
    prompt_len: int
    output_len: int
    priority: int = 0
    abort_step: int | None = None

    @property
    def total_len(self) -> int:
        """Prompt plus every output token: what the request holds when it finishes."""
        return self.prompt_len + self.output_len


class LengthDistribution(str, enum.Enum):
    """How synthetic prompt and output lengths are drawn around their mean."""

    FIXED = "fixed"
    """Every request gets exactly the mean."""
    UNIFORM = "uniform"
    """Uniform integers on ``[1, 2*mean - 1]``."""
    LOGNORMAL = "lognormal"
    """Log-normal with the given mean and ``sigma = 0.6``: a long tail, like real traffic."""


LOGNORMAL_SIGMA = 0.6


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of a synthetic workload. The same spec always gives the same requests.

    ``arrival_rate`` is the mean number of arrivals per scheduler step (a Poisson process);
    ``0`` puts every request at step 0. Lengths are clipped to ``[1, *_max]``. Priorities
    are uniform on ``0 .. priority_levels - 1`` (higher is more important). A fraction
    ``abort_rate`` of the requests (each independently) is aborted by its client at a step
    drawn uniformly from ``arrival .. arrival + output_len - 1``, which is always before it
    could have finished.
    """

    num_requests: int = 96
    seed: int = 0
    arrival_rate: float = 0.5
    prompt_len_mean: int = 384
    prompt_len_max: int = 2048
    output_len_mean: int = 192
    output_len_max: int = 1024
    length_distribution: LengthDistribution = LengthDistribution.LOGNORMAL
    priority_levels: int = 3
    abort_rate: float = 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line reason if a parameter is out of range."""
        if self.num_requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.num_requests}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not math.isfinite(self.arrival_rate) or self.arrival_rate < 0:
            raise ValueError(f"arrival rate must be a finite number >= 0, got {self.arrival_rate}")
        for name in ("prompt_len", "output_len"):
            mean = getattr(self, f"{name}_mean")
            upper = getattr(self, f"{name}_max")
            if mean < 1:
                raise ValueError(f"{name.replace('_', ' ')} mean must be >= 1, got {mean}")
            if upper < mean:
                raise ValueError(
                    f"{name.replace('_', ' ')} max ({upper}) must be >= its mean ({mean})"
                )
        if self.priority_levels < 1:
            raise ValueError(f"priority levels must be >= 1, got {self.priority_levels}")
        if not 0.0 <= self.abort_rate <= 1.0:  # also rejects NaN
            raise ValueError(f"abort rate must be in [0, 1], got {self.abort_rate}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the report's resolved configuration)."""
        return {
            "source": "synthetic",
            "requests": self.num_requests,
            "seed": self.seed,
            "arrival_rate": self.arrival_rate,
            "prompt_len_mean": self.prompt_len_mean,
            "prompt_len_max": self.prompt_len_max,
            "output_len_mean": self.output_len_mean,
            "output_len_max": self.output_len_max,
            "length_distribution": self.length_distribution.value,
            "priority_levels": self.priority_levels,
            "abort_rate": self.abort_rate,
        }


def _draw_lengths(
    rng: np.random.Generator,
    count: int,
    mean: int,
    upper: int,
    distribution: LengthDistribution,
) -> np.ndarray:
    if distribution is LengthDistribution.FIXED:
        lengths = np.full(count, mean, dtype=np.int64)
    elif distribution is LengthDistribution.UNIFORM:
        lengths = rng.integers(1, 2 * mean, size=count, dtype=np.int64)
    else:
        mu = math.log(mean) - LOGNORMAL_SIGMA**2 / 2
        lengths = np.rint(rng.lognormal(mu, LOGNORMAL_SIGMA, size=count)).astype(np.int64)
    return np.clip(lengths, 1, upper)


def _draw_arrivals(rng: np.random.Generator, count: int, rate: float) -> np.ndarray:
    if rate == 0:
        return np.zeros(count, dtype=np.int64)
    gaps = rng.exponential(1.0 / rate, size=count)
    gaps[0] = 0.0  # the first request opens the run
    return np.floor(np.cumsum(gaps)).astype(np.int64)


def synthetic_workload(spec: WorkloadSpec) -> list[RequestSpec]:
    """Draw ``spec.num_requests`` requests; ids are ``0 .. n-1`` in arrival order.

    Arrivals, prompt lengths, output lengths, priorities and aborts come from independent
    streams of one seed, so changing one knob (say the output mean, or the abort rate)
    leaves the others unchanged.
    """
    spec.validate()
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(5)]
    arrival_rng, prompt_rng, output_rng, priority_rng, abort_rng = streams
    count = spec.num_requests
    arrivals = _draw_arrivals(arrival_rng, count, spec.arrival_rate)
    prompts = _draw_lengths(
        prompt_rng, count, spec.prompt_len_mean, spec.prompt_len_max, spec.length_distribution
    )
    outputs = _draw_lengths(
        output_rng, count, spec.output_len_mean, spec.output_len_max, spec.length_distribution
    )
    priorities = priority_rng.integers(0, spec.priority_levels, size=count)
    # Drawn for every request whatever the rate, so a request's abort step depends only on
    # the seed and its own output length.
    aborted = abort_rng.random(count) < spec.abort_rate
    abort_offsets = np.floor(abort_rng.random(count) * outputs).astype(np.int64)
    return [
        RequestSpec(
            request_id=i,
            arrival_step=int(arrivals[i]),
            prompt_len=int(prompts[i]),
            output_len=int(outputs[i]),
            priority=int(priorities[i]),
            abort_step=int(arrivals[i] + abort_offsets[i]) if aborted[i] else None,
        )
        for i in range(count)
    ]


def _int_field(record: dict[str, Any], key: str, minimum: int, maximum: int) -> int:
    if key not in record:
        raise ValueError(f"missing key {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key!r} must be an integer, got {json.dumps(value)}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{key!r} must be in [{minimum}, {maximum}], got {value}")
    return value


def parse_trace_line(text: str) -> RequestSpec:
    """Parse one JSONL line into a request; raise ``ValueError`` saying what is wrong."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in TRACE_REQUIRED_KEYS if key not in record]
    if missing:
        raise ValueError(
            "missing key" + ("s " if len(missing) > 1 else " ") + ", ".join(map(repr, missing))
        )
    priority = record.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"'priority' must be an integer, got {json.dumps(priority)}")
    if not -(2**31) <= priority < 2**31:
        raise ValueError(f"'priority' must fit in 32 bits, got {priority}")
    arrival_step = _int_field(record, "arrival_step", 0, MAX_STEP)
    abort_step = record.get("abort_step")
    if abort_step is not None:
        abort_step = _int_field(record, "abort_step", 0, MAX_STEP)
        if abort_step < arrival_step:
            raise ValueError(
                f"'abort_step' ({abort_step}) must be >= 'arrival_step' ({arrival_step})"
            )
    return RequestSpec(
        request_id=_int_field(record, "id", 0, MAX_REQUEST_ID),
        arrival_step=arrival_step,
        prompt_len=_int_field(record, "prompt_len", 1, 2**31 - 1),
        output_len=_int_field(record, "output_len", 1, 2**32 - 1),
        priority=priority,
        abort_step=abort_step,
    )


def parse_trace(lines: Iterable[str], path: str | Path = "<trace>") -> list[RequestSpec]:
    """Parse JSONL trace lines (blank lines are skipped) into a workload in queue order.

    Requests are ordered by ``arrival_step``, ties in line order. Raises :class:`TraceError`
    naming the line number and the problem for the first bad line, a duplicate id (naming
    both lines), or an empty trace.
    """
    requests: list[RequestSpec] = []
    first_line_of_id: dict[int, int] = {}
    for line_number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            request = parse_trace_line(text)
        except ValueError as err:
            raise TraceError(path, str(err), line_number) from None
        if request.request_id in first_line_of_id:
            raise TraceError(
                path,
                f"duplicate id {request.request_id} "
                f"(first used on line {first_line_of_id[request.request_id]})",
                line_number,
            )
        first_line_of_id[request.request_id] = line_number
        requests.append(request)
    if not requests:
        raise TraceError(path, "no requests (the file is empty or only blank lines)")
    requests.sort(key=lambda r: r.arrival_step)  # stable: ties keep line order
    return requests


def read_trace(path: str | Path) -> list[RequestSpec]:
    """Read a JSONL trace: one ``{"id", "arrival_step", "prompt_len", "output_len"}`` per line.

    An optional integer ``"priority"`` (default 0, higher is more important) is used by the
    ``priority`` victim policy. An optional integer ``"abort_step"`` (``>= arrival_step``;
    absent or ``null``: never) aborts the request before that step is scheduled, unless it
    finished earlier. Other keys are ignored.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_trace(handle, path)
    except OSError as err:
        raise TraceError(path, f"cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise TraceError(path, f"not UTF-8 text ({err.reason})") from None


def write_trace(requests: Iterable[RequestSpec], path: str | Path) -> None:
    """Write requests as a JSONL trace that :func:`read_trace` reads back unchanged."""
    with open(path, "w", encoding="utf-8") as handle:
        for request in requests:
            record = {
                "id": request.request_id,
                "arrival_step": request.arrival_step,
                "prompt_len": request.prompt_len,
                "output_len": request.output_len,
                "priority": request.priority,
            }
            if request.abort_step is not None:
                record["abort_step"] = request.abort_step
            handle.write(json.dumps(record) + "\n")
