"""Workloads for the simulator: a seeded synthetic generator and a JSONL trace reader.

A workload is a list of :class:`RequestSpec` in queue order: by arrival step, then by
position in the source (generation order or trace line order). The scheduler's queue order
is the order of adding, so this order is what every rank sees.

A request's prompt is its own unless the workload says what it holds (``RequestSpec.content``):
a synthetic shared system prompt or conversation history (:class:`PromptParts`), a trace's
``token_ids`` (:class:`PromptTokens`) or its ``hash_ids`` (:class:`HashBlocks`). Content is a
pure function of the workload, so every rank and every process feeds the same tokens, and two
contents are equal when they hold the same tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from helix_kv.errors import TraceError as TraceError  # also importable from here
from helix_kv.simulate.tokens import (
    expected_output,
    hash_block_tokens,
    prompt_tokens,
    shared_prefix_tokens,
    user_tokens,
)

#: Largest request id the scheduler accepts (ids are ``u64`` in the core).
MAX_REQUEST_ID = 2**64 - 1

#: The keys of one trace line; ``priority`` (default 0), ``abort_step`` (default: never
#: aborted) and the prompt's content, ``token_ids`` or ``hash_ids`` (default: a prompt of its
#: own), are optional, other keys are ignored (:func:`parse_trace` reports them). With
#: ``token_ids``, ``prompt_len`` may be left out (it is their number). ``arrival_step`` may be
#: given in time instead, as one of :data:`TRACE_TIME_KEYS` (``arrival_ms`` or ``arrival_s``,
#: with ``abort_ms`` or ``abort_s``): the trace is then *timed* (every line in time).
TRACE_REQUIRED_KEYS = ("id", "arrival_step", "prompt_len", "output_len")
TRACE_OPTIONAL_KEYS = ("priority", "abort_step", "token_ids", "hash_ids")
#: A timed trace line's arrival (one of the first two) and abort (one of the last two).
TRACE_TIME_KEYS = ("arrival_ms", "arrival_s", "abort_ms", "abort_s")
TRACE_KEYS = TRACE_REQUIRED_KEYS + TRACE_OPTIONAL_KEYS + TRACE_TIME_KEYS

#: Latest arrival a timed trace may name, in ms (about 31,700 years: far past any trace, and
#: modelled times stay exact to well under a microsecond).
MAX_ARRIVAL_MS = 1e15

#: Longest prompt or output of a request, in tokens, that the simulator takes (synthetic or
#: from a trace: a trace line over it is refused). Also ``simulate.options.MAX_REQUEST_TOKENS``.
MAX_REQUEST_TOKENS = 1 << 20

#: Largest step a trace may name.
MAX_STEP = 2**62

#: Tokens one trace ``hash_ids`` entry stands for unless told otherwise: the Mooncake trace
#: convention (``helix-kv simulate --hash-block-tokens``).
DEFAULT_HASH_BLOCK_TOKENS = 512

_I32_MAX = 2**31 - 1
_U64_MAX = 2**64 - 1

#: The cache salt of a request whose prompt is its own (``RequestSpec.content`` is ``None``):
#: this tag and its id, so that it shares no cached KV with any other request whatever its
#: tokens (:func:`~helix_kv.simulate.tokens.prompt_tokens` repeats for ids VOCAB_SIZE apart).
OWN_PROMPT_SALT = b"helix_kv.simulate:own-prompt:"


class PromptContent:
    """What a request's prompt holds, when the workload says (``RequestSpec.content``).

    ``len(content)`` is the prompt's length and :meth:`tokens` its int32 token ids, a pure
    function of the content. Contents are immutable and compare (and hash) by their tokens,
    whatever their form: the synthetic parts of a prompt equal the ``token_ids`` a trace writes
    of them.
    """

    def tokens(self) -> np.ndarray:
        """The prompt: ``len(self)`` int32 token ids."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptContent):
            return NotImplemented
        if type(self) is type(other) and self._fields() == other._fields():
            return True
        return len(self) == len(other) and np.array_equal(self.tokens(), other.tokens())

    def __hash__(self) -> int:
        return hash(self.tokens().tobytes())


@dataclass(frozen=True, eq=False)
class PromptTokens(PromptContent):
    """A prompt given token by token (a trace's ``token_ids``): ``data`` is the token ids as
    little-endian int32 bytes (:meth:`of` makes it from an array)."""

    data: bytes

    def __post_init__(self) -> None:
        if not self.data or len(self.data) % 4:
            raise ValueError(f"PromptTokens needs 4 bytes per token, got {len(self.data)} bytes")

    @classmethod
    def of(cls, tokens: Any) -> PromptTokens:
        """The content holding ``tokens`` (anything ``numpy`` makes an int32 array of)."""
        return cls(np.asarray(tokens, dtype="<i4").tobytes())

    def __len__(self) -> int:
        return len(self.data) // 4

    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<i4").astype(np.int32)

    def __repr__(self) -> str:
        head = self.tokens()[:4].tolist()
        more = ", ..." if len(self) > len(head) else ""
        return f"PromptTokens({len(self)} tokens: [{', '.join(map(str, head))}{more}])"


@dataclass(frozen=True, eq=False)
class HashBlocks(PromptContent):
    """A prompt given as a trace's ``hash_ids``: one id per block of ``block_tokens`` tokens,
    each id standing for the same tokens wherever it appears
    (:func:`~helix_kv.simulate.tokens.hash_block_tokens`), the last block cut so the prompt has
    ``prompt_len`` tokens. ``data`` is the ids as little-endian uint64 bytes (:meth:`of`)."""

    data: bytes
    block_tokens: int
    prompt_len: int

    def __post_init__(self) -> None:
        blocks = len(self.data) // 8
        if len(self.data) % 8 or self.block_tokens < 1 or self.prompt_len < 1:
            raise ValueError("HashBlocks needs 8 bytes per id and positive lengths")
        if blocks != -(-self.prompt_len // self.block_tokens):
            raise ValueError(
                f"{blocks} hash ids of {self.block_tokens} tokens cannot hold a prompt of "
                f"{self.prompt_len} tokens"
            )

    @classmethod
    def of(cls, hash_ids: Iterable[int], block_tokens: int, prompt_len: int) -> HashBlocks:
        """The content of ``hash_ids`` (integers in ``[0, 2**64)``)."""
        return cls(np.asarray(list(hash_ids), dtype="<u8").tobytes(), block_tokens, prompt_len)

    @property
    def hash_ids(self) -> tuple[int, ...]:
        """The ids, one per block."""
        return tuple(np.frombuffer(self.data, dtype="<u8").tolist())

    def __len__(self) -> int:
        return self.prompt_len

    def tokens(self) -> np.ndarray:
        ids = np.frombuffer(self.data, dtype="<u8").astype(np.uint64)
        return hash_block_tokens(ids, self.block_tokens, self.prompt_len)

    def __repr__(self) -> str:
        ids = self.hash_ids
        shown = ", ".join(map(str, ids[:4])) + (", ..." if len(ids) > 4 else "")
        return (
            f"HashBlocks([{shown}] ({len(ids)} ids), block_tokens={self.block_tokens}, "
            f"prompt_len={self.prompt_len})"
        )


class SegmentKind(str, enum.Enum):
    """What a :class:`Segment` of a synthetic prompt holds."""

    SHARED = "shared"
    """A shared system prompt; ``source``: its id
    (:func:`~helix_kv.simulate.tokens.shared_prefix_tokens`)."""
    USER = "user"
    """New user tokens; ``source``: the request they are new in
    (:func:`~helix_kv.simulate.tokens.user_tokens`)."""
    ANSWER = "answer"
    """A request's answer, its deterministic output; ``source``: that request
    (:func:`~helix_kv.simulate.tokens.expected_output`)."""


@dataclass(frozen=True)
class Segment:
    """``length`` tokens of a synthetic prompt, of one kind and source."""

    kind: SegmentKind
    source: int
    length: int

    def __repr__(self) -> str:
        return f"Segment(SegmentKind.{self.kind.name}, {self.source}, {self.length})"

    def tokens(self) -> np.ndarray:
        """The segment's ``length`` int32 token ids (an array of its own)."""
        return _segment_tokens(self).copy()


@functools.lru_cache(maxsize=2048)
def _segment_tokens(segment: Segment) -> np.ndarray:
    """:meth:`Segment.tokens`, read-only and kept for the segments used last: every turn of a
    conversation repeats the segments of the turns before it, and a long run would otherwise
    regenerate each of them once per later turn (a pure function of the segment, so what is
    kept is what would be made again)."""
    if segment.kind is SegmentKind.SHARED:
        tokens = shared_prefix_tokens(segment.source, segment.length)
    elif segment.kind is SegmentKind.USER:
        tokens = user_tokens(segment.source, segment.length)
    else:
        tokens = expected_output(segment.source, segment.length)
    tokens.flags.writeable = False
    return tokens


@dataclass(frozen=True, eq=False)
class PromptParts(PromptContent):
    """A synthetic prompt, segment after segment: a shared system prompt, then a
    conversation's earlier turns (each turn's new user tokens and its answer), then this turn's
    new user tokens. A few integers per segment, whatever the lengths."""

    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if not self.segments or any(segment.length < 1 for segment in self.segments):
            raise ValueError("PromptParts needs segments of at least one token")

    def __len__(self) -> int:
        return sum(segment.length for segment in self.segments)

    def tokens(self) -> np.ndarray:
        return np.concatenate([_segment_tokens(segment) for segment in self.segments])


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload; lengths are in global tokens.

    ``abort_step``: the client aborts the request before step ``abort_step`` is scheduled
    (``>= arrival_step``; ``None``: never). A request that finished earlier is not affected.
    ``content``: what its prompt holds (``len(content) == prompt_len``); ``None``, a prompt of
    its own (:func:`~helix_kv.simulate.tokens.prompt_tokens`) that shares nothing with any
    other request's (see :attr:`cache_salt`). :meth:`prompt` gives the tokens either way.
    ``arrival_ms`` / ``abort_ms``: the modelled time of its arrival / its client's abort (a
    timed workload: every request has an ``arrival_ms``; ``None``: it arrives at a step).
    """

    request_id: int
    arrival_step: int
    prompt_len: int
    output_len: int
    priority: int = 0
    abort_step: int | None = None
    content: PromptContent | None = None
    arrival_ms: float | None = None
    """A timed request's arrival in modelled ms (``arrival_step`` is then 0 and unused): it is
    added at the first step that starts at or after it (see :func:`is_timed`)."""
    abort_ms: float | None = None
    """A timed request's abort (``>= arrival_ms``; ``None``: never): the client aborts it
    before the first step that starts at or after this time."""

    def __post_init__(self) -> None:
        if self.content is not None and len(self.content) != self.prompt_len:
            raise ValueError(
                f"request {self.request_id}: its content has {len(self.content)} tokens, "
                f"its prompt_len is {self.prompt_len}"
            )
        for name in ("arrival_ms", "abort_ms"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise ValueError(
                    f"request {self.request_id}: {name} must be a number, got {value!r}"
                )
        if self.arrival_ms is None:
            if self.abort_ms is not None:
                raise ValueError(f"request {self.request_id}: abort_ms needs an arrival_ms")
            return
        if not 0.0 <= self.arrival_ms <= MAX_ARRIVAL_MS:  # also rejects NaN
            raise ValueError(
                f"request {self.request_id}: arrival_ms must be in [0, {MAX_ARRIVAL_MS:g}], "
                f"got {self.arrival_ms}"
            )
        if self.arrival_step != 0 or self.abort_step is not None:
            raise ValueError(
                f"request {self.request_id}: a timed request (arrival_ms) has no arrival_step "
                "or abort_step"
            )
        if self.abort_ms is not None and not self.arrival_ms <= self.abort_ms <= MAX_ARRIVAL_MS:
            raise ValueError(
                f"request {self.request_id}: abort_ms ({self.abort_ms}) must be in "
                f"[arrival_ms ({self.arrival_ms}), {MAX_ARRIVAL_MS:g}]"
            )

    @property
    def timed(self) -> bool:
        """Whether it arrives in modelled time (``arrival_ms``) rather than at a step."""
        return self.arrival_ms is not None

    @property
    def total_len(self) -> int:
        """Prompt plus every output token: what the request holds when it finishes."""
        return self.prompt_len + self.output_len

    def prompt(self) -> np.ndarray:
        """The prompt's ``prompt_len`` int32 token ids: the same on every call, rank and
        process."""
        if self.content is None:
            return prompt_tokens(self.request_id, self.prompt_len)
        return self.content.tokens()

    @property
    def cache_salt(self) -> bytes | None:
        """The cache salt to add the request with: ``None`` (the shared, empty salt) when the
        workload gives its prompt's content; else one of its own (:data:`OWN_PROMPT_SALT` and
        its id), so that under prefix caching it hits only its own KV (after a recompute-pause),
        never another request's."""
        if self.content is not None:
            return None
        return OWN_PROMPT_SALT + self.request_id.to_bytes(8, "little")


def is_timed(workload: Sequence[RequestSpec]) -> bool:
    """Whether ``workload`` arrives in time (every request has ``arrival_ms``) rather than at
    steps (none has); a mix raises ``ValueError`` naming the first request of the other
    kind. An empty workload is not timed."""
    if not workload:
        return False
    timed = workload[0].timed
    for request in workload:
        if request.timed != timed:
            kind = "arrival_ms" if request.timed else "arrival_step"
            raise ValueError(
                f"request {request.request_id} arrives by {kind}, request "
                f"{workload[0].request_id} does not: a workload arrives in steps or in time"
            )
    return timed


class LengthDistribution(str, enum.Enum):
    """How synthetic prompt and output lengths are drawn around their mean."""

    FIXED = "fixed"
    """Every request gets exactly the mean."""
    UNIFORM = "uniform"
    """Uniform integers on ``[1, 2*mean - 1]``."""
    LOGNORMAL = "lognormal"
    """Log-normal with the given mean and ``sigma = 0.6``: a long tail, like real traffic."""


LOGNORMAL_SIGMA = 0.6

#: Mean think gap between a conversation's turns, in steps, unless told otherwise.
DEFAULT_THINK_STEPS = 16.0
#: Longest mean think gap: arrival steps must stay well within int64.
MAX_THINK_STEPS = 1_000_000_000
#: Mean think gap between a conversation's turns in a timed workload (``request_rate``), in s.
DEFAULT_THINK_S = 10.0
#: Longest mean think gap in a timed workload, in s (a day).
MAX_THINK_S = 86_400.0
#: Highest ``request_rate`` (requests per modelled second).
MAX_REQUEST_RATE = 1e6
#: The id of the synthetic shared system prompt.
SHARED_PREFIX_ID = 0


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of a synthetic workload. The same spec always gives the same requests.

    ``arrival_rate`` is the mean number of arrivals per scheduler step (a Poisson process);
    ``0`` puts every request at step 0. Lengths are clipped to ``[1, *_max]``. Priorities
    are uniform on ``0 .. priority_levels - 1`` (higher is more important). A fraction
    ``abort_rate`` of the requests (each independently) is aborted by its client at a step
    drawn uniformly from ``arrival .. arrival + output_len - 1``, which is always before it
    could have finished.

    Shared content (both off by default, and then the workload is what it always was):
    ``shared_prefix_len`` tokens of one shared system prompt start the prompts of a fraction
    ``shared_prefix_share`` of the requests (each independently), before their drawn prompt
    length of their own. With ``turns`` > 1 the requests come in conversations of ``turns``
    turns (the last one may be shorter; ``arrival_rate`` is then the rate of new
    conversations): turn t's prompt is turn t-1's prompt, then turn t-1's answer (its
    deterministic output), then new user tokens of the drawn prompt length, and it arrives
    ``output_len`` steps after turn t-1 (the earliest it could have finished) plus a think gap
    drawn from an exponential of mean ``think_steps`` (rounded down). A conversation's turns
    share its system prompt or none. Ids are then given in arrival order.

    In time (``request_rate`` given, in requests per modelled second; ``arrival_rate`` is then
    unused): arrivals are a Poisson process in modelled time, each request's ``arrival_ms``
    set (the workload is timed, see :func:`is_timed`), and an abort lands at
    ``arrival_ms + offset * 1000 / request_rate`` for an offset drawn as above (so an abort
    comes within about ``output_len`` mean inter-arrival gaps). With turns, turn t arrives a
    think gap (exponential, mean ``think_s`` seconds) after turn t-1's arrival, whether or not
    turn t-1 has finished by then in the run; ``request_rate`` is then the rate of new
    conversations.
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
    shared_prefix_len: int = 0
    shared_prefix_share: float = 1.0
    turns: int = 1
    think_steps: float = DEFAULT_THINK_STEPS
    request_rate: float | None = None
    think_s: float = DEFAULT_THINK_S

    @property
    def timed(self) -> bool:
        """Whether its requests arrive in modelled time (``request_rate`` given)."""
        return self.request_rate is not None

    @property
    def shares_content(self) -> bool:
        """Whether prompts share content (a shared system prompt or conversations)."""
        return self.shared_prefix_len > 0 or self.turns > 1

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
        if self.shared_prefix_len < 0:
            raise ValueError(f"shared prefix len must be >= 0, got {self.shared_prefix_len}")
        if not 0.0 <= self.shared_prefix_share <= 1.0:
            raise ValueError(
                f"shared prefix share must be in [0, 1], got {self.shared_prefix_share}"
            )
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if not 0.0 <= self.think_steps <= MAX_THINK_STEPS:
            raise ValueError(
                f"think steps must be in [0, {MAX_THINK_STEPS}], got {self.think_steps}"
            )
        if self.request_rate is not None and not 0.0 < self.request_rate <= MAX_REQUEST_RATE:
            raise ValueError(
                f"request rate must be in (0, {MAX_REQUEST_RATE:g}] requests per second, got "
                f"{self.request_rate}"
            )
        if not 0.0 <= self.think_s <= MAX_THINK_S:
            raise ValueError(f"think seconds must be in [0, {MAX_THINK_S:g}], got {self.think_s}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the report's resolved configuration)."""
        return {
            "source": "synthetic",
            "requests": self.num_requests,
            "seed": self.seed,
            **(
                {"request_rate": self.request_rate}
                if self.request_rate is not None
                else {"arrival_rate": self.arrival_rate}
            ),
            "prompt_len_mean": self.prompt_len_mean,
            "prompt_len_max": self.prompt_len_max,
            "output_len_mean": self.output_len_mean,
            "output_len_max": self.output_len_max,
            "length_distribution": self.length_distribution.value,
            "priority_levels": self.priority_levels,
            "abort_rate": self.abort_rate,
            # only when on: the configuration of a workload without them is unchanged
            **(
                {
                    "shared_prefix_len": self.shared_prefix_len,
                    "shared_prefix_share": self.shared_prefix_share,
                }
                if self.shared_prefix_len
                else {}
            ),
            **({"turns": self.turns, self._think_key: self._think_value} if self.turns > 1 else {}),
        }

    @property
    def _think_key(self) -> str:
        return "think_s" if self.timed else "think_steps"

    @property
    def _think_value(self) -> float:
        return self.think_s if self.timed else self.think_steps


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

    Arrivals, prompt lengths, output lengths, priorities, aborts, who shares the system
    prompt and think gaps come from independent streams of one seed, so changing one knob
    (say the output mean, or the abort rate) leaves the others unchanged.
    """
    spec.validate()
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(7)]
    arrival_rng, prompt_rng, output_rng, priority_rng, abort_rng, share_rng, think_rng = streams
    count = spec.num_requests
    turns = min(spec.turns, count)
    conversations = -(-count // turns)
    prompts = _draw_lengths(
        prompt_rng, count, spec.prompt_len_mean, spec.prompt_len_max, spec.length_distribution
    )
    outputs = _draw_lengths(
        output_rng, count, spec.output_len_mean, spec.output_len_max, spec.length_distribution
    )
    priorities = priority_rng.integers(0, spec.priority_levels, size=count)
    # Drawn for every request whatever the rate, so a request's abort depends only on the seed
    # and its own output length: this many steps after its arrival (in time: this many mean
    # inter-arrival gaps).
    aborted = abort_rng.random(count) < spec.abort_rate
    abort_offsets = np.floor(abort_rng.random(count) * outputs)
    # Request g (in generation order) is turn g % turns of conversation g // turns.
    conversation, turn = np.divmod(np.arange(count, dtype=np.int64), turns)
    if spec.request_rate is None:
        starts = _draw_arrivals(arrival_rng, conversations, spec.arrival_rate)
        arrivals = _turn_arrivals(think_rng, starts, conversation, turn, outputs, spec.think_steps)
    else:
        arrivals = _timed_arrivals(arrival_rng, think_rng, spec, conversation, turn)
    shares = np.zeros(conversations, dtype=bool)
    if spec.shared_prefix_len:
        shares = share_rng.random(conversations) < spec.shared_prefix_share
    # Queue order: by arrival, ties in generation order (the identity without turns).
    order = np.argsort(arrivals, kind="stable")
    ids = np.empty(count, dtype=np.int64)
    ids[order] = np.arange(count, dtype=np.int64)
    contents = _contents(spec, ids, turn, conversation, shares, prompts, outputs)
    requests = []
    for g in order.tolist():
        content = contents[g]
        common: dict[str, Any] = {
            "request_id": int(ids[g]),
            "prompt_len": int(prompts[g]) if content is None else len(content),
            "output_len": int(outputs[g]),
            "priority": int(priorities[g]),
            "content": content,
        }
        if spec.request_rate is None:
            abort_step = int(arrivals[g] + int(abort_offsets[g])) if aborted[g] else None
            requests.append(
                RequestSpec(arrival_step=int(arrivals[g]), abort_step=abort_step, **common)
            )
        else:
            arrival = float(arrivals[g])
            abort_ms = None
            if aborted[g]:
                gap_ms = 1000.0 / spec.request_rate
                abort_ms = min(arrival + float(abort_offsets[g] * gap_ms), MAX_ARRIVAL_MS)
            requests.append(
                RequestSpec(arrival_step=0, arrival_ms=arrival, abort_ms=abort_ms, **common)
            )
    return requests


def _timed_arrivals(
    arrival_rng: np.random.Generator,
    think_rng: np.random.Generator,
    spec: WorkloadSpec,
    conversation: np.ndarray,
    turn: np.ndarray,
) -> np.ndarray:
    """Arrival times in ms, generation order: conversations start as a Poisson process of
    ``request_rate`` per second, and each later turn comes a think gap (exponential, mean
    ``think_s`` seconds) after the turn before it."""
    assert spec.request_rate is not None
    gaps = arrival_rng.exponential(1000.0 / spec.request_rate, size=int(conversation[-1]) + 1)
    gaps[0] = 0.0  # the first request opens the run
    arrivals: np.ndarray = np.cumsum(gaps)[conversation]
    if turn.any():
        think = think_rng.exponential(spec.think_s * 1000.0, size=len(turn))
        think[turn == 0] = 0.0
        offsets = np.cumsum(think)
        first = np.flatnonzero(turn == 0)
        arrivals = arrivals + offsets - offsets[first][conversation]
    capped: np.ndarray = np.minimum(arrivals, MAX_ARRIVAL_MS)
    return capped


def _turn_arrivals(
    rng: np.random.Generator,
    starts: np.ndarray,
    conversation: np.ndarray,
    turn: np.ndarray,
    outputs: np.ndarray,
    think_steps: float,
) -> np.ndarray:
    """Arrival steps in generation order: a conversation's first turn at its start, each later
    turn ``output_len`` of the turn before it plus a think gap after that turn's arrival."""
    if not turn.any():  # one turn each: the conversations' starts are the arrivals
        arrivals: np.ndarray = starts[conversation]
        return arrivals
    gaps = np.floor(rng.exponential(think_steps, size=len(turn))).astype(np.int64)
    steps = np.zeros(len(turn), dtype=np.int64)
    steps[1:] = outputs[:-1] + gaps[1:]
    steps[turn == 0] = 0
    offsets = np.cumsum(steps)
    first = np.flatnonzero(turn == 0)  # the first request of each conversation
    arrivals = starts[conversation] + offsets - offsets[first][conversation]
    return arrivals


def _contents(
    spec: WorkloadSpec,
    ids: np.ndarray,
    turn: np.ndarray,
    conversation: np.ndarray,
    shares: np.ndarray,
    prompts: np.ndarray,
    outputs: np.ndarray,
) -> list[PromptContent | None]:
    """The content of each request (generation order): ``None`` for a prompt of its own."""
    shared = Segment(SegmentKind.SHARED, SHARED_PREFIX_ID, spec.shared_prefix_len)
    contents: list[PromptContent | None] = []
    history: tuple[Segment, ...] = ()
    for g in range(len(ids)):
        request_id = int(ids[g])
        if turn[g] == 0:
            history = (shared,) if shares[conversation[g]] else ()
            if not history and spec.turns == 1:
                contents.append(None)  # its own prompt, as without shared content
                continue
        else:  # the previous turn's answer follows its prompt
            history += (Segment(SegmentKind.ANSWER, int(ids[g - 1]), int(outputs[g - 1])),)
        history += (Segment(SegmentKind.USER, request_id, int(prompts[g])),)
        contents.append(PromptParts(history))
    return contents


def _int_field(record: dict[str, Any], key: str, minimum: int, maximum: int) -> int:
    if key not in record:
        raise ValueError(f"missing key {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key!r} must be an integer, got {json.dumps(value)}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{key!r} must be in [{minimum}, {maximum}], got {value}")
    return value


def _shown(value: Any) -> str:
    """``value`` as JSON, cut to a few dozen characters (a message stays one short line)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer_list(record: dict[str, Any], key: str, maximum: int, what: str) -> list[int]:
    """``record[key]``: a non-empty list of integers in ``[0, maximum]`` (``what`` names one)."""
    value = record[key]
    if not isinstance(value, list):
        raise ValueError(f"{key!r} must be a list of {what}s, got {_shown(value)}")
    if not value:
        raise ValueError(f"{key!r} must not be empty")
    if set(map(type, value)) != {int}:  # bools are not ints here, nor floats such as 1.0
        index, bad = next((i, v) for i, v in enumerate(value) if type(v) is not int)
        raise ValueError(f"{key!r} entry {index} must be an integer, got {_shown(bad)}")
    if min(value) < 0 or max(value) > maximum:
        index, bad = next((i, v) for i, v in enumerate(value) if not 0 <= v <= maximum)
        raise ValueError(
            f"{key!r} entry {index} must be a {what} in [0, {maximum}], got {_shown(bad)}"
        )
    return value


def _prompt_content(
    record: dict[str, Any], hash_block_tokens: int
) -> tuple[int, PromptContent | None]:
    """The prompt's length and content (``None``: none given, a prompt of its own)."""
    token_ids = record.get("token_ids")
    hash_ids = record.get("hash_ids")
    if token_ids is not None and hash_ids is not None:
        raise ValueError("give the prompt as 'token_ids' or as 'hash_ids', not both")
    if token_ids is not None:
        tokens = _integer_list(record, "token_ids", _I32_MAX, "token id")
        if len(tokens) > MAX_REQUEST_TOKENS:
            raise ValueError(
                f"'token_ids' has {len(tokens)} tokens; the simulator takes a prompt of at most "
                f"{MAX_REQUEST_TOKENS}"
            )
        if "prompt_len" in record:
            prompt_len = _int_field(record, "prompt_len", 1, MAX_REQUEST_TOKENS)
            if prompt_len != len(tokens):
                raise ValueError(
                    f"'prompt_len' ({prompt_len}) must be the number of 'token_ids' ({len(tokens)})"
                )
        return len(tokens), PromptTokens.of(tokens)
    prompt_len = _int_field(record, "prompt_len", 1, MAX_REQUEST_TOKENS)
    if hash_ids is None:
        return prompt_len, None
    ids = _integer_list(record, "hash_ids", _U64_MAX, "hash id")
    blocks = -(-prompt_len // hash_block_tokens)
    if len(ids) != blocks:
        raise ValueError(
            f"'hash_ids' has {len(ids)} ids; a 'prompt_len' of {prompt_len} in blocks of "
            f"{hash_block_tokens} tokens (--hash-block-tokens) takes {blocks}"
        )
    return prompt_len, HashBlocks.of(ids, hash_block_tokens, prompt_len)


def parse_trace_line(text: str, hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS) -> RequestSpec:
    """Parse one JSONL line into a request; raise ``ValueError`` saying what is wrong.

    ``hash_block_tokens``: the tokens one ``hash_ids`` entry stands for."""
    return _request_from_record(_decode_line(text), hash_block_tokens)


def _decode_line(text: str) -> dict[str, Any]:
    """One line's JSON object; ``ValueError`` saying what is wrong (where the JSON is wrong: the
    column on the line, its line break left out)."""
    text = text.rstrip("\r\n")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        where = f"column {err.colno}"
        if err.pos >= len(text):
            where += ", the end of the line"
        raise ValueError(f"not valid JSON ({err.msg} at {where})") from None
    except RecursionError:
        raise ValueError("not valid JSON here (nested too deeply)") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def require_keys(record: dict[str, Any], keys: Iterable[str]) -> None:
    """``ValueError`` naming the ``keys`` that ``record`` lacks (none: nothing)."""
    missing = [key for key in keys if key not in record]
    if missing:
        raise ValueError(
            "missing key" + ("s " if len(missing) > 1 else " ") + ", ".join(map(repr, missing))
        )


def _request_from_record(record: dict[str, Any], hash_block_tokens: int) -> RequestSpec:
    """The request one line's JSON object describes; ``ValueError`` saying what is wrong."""
    required: tuple[str, ...] = TRACE_REQUIRED_KEYS
    if record.get("token_ids") is not None:  # the prompt's length is theirs
        required = tuple(key for key in required if key != "prompt_len")
    timed = any(key in record for key in _TIMED_ARRIVAL_KEYS)
    if timed:  # the arrival is in time
        required = tuple(key for key in required if key != "arrival_step")
    missing = [key for key in required if key not in record]
    if missing:
        message = (
            "missing key" + ("s " if len(missing) > 1 else " ") + ", ".join(map(repr, missing))
        )
        if "arrival_step" in missing:
            message += " (the arrival may be in time instead: 'arrival_ms' or 'arrival_s')"
        raise ValueError(message)
    priority = record.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"'priority' must be an integer, got {json.dumps(priority)}")
    if not -(2**31) <= priority < 2**31:
        raise ValueError(f"'priority' must fit in 32 bits, got {priority}")
    arrival_step = 0
    abort_step = None
    arrival_ms = abort_ms = None
    if timed:
        arrival_ms, abort_ms = _timed_arrival(record)
    else:
        arrival_step = _int_field(record, "arrival_step", 0, MAX_STEP)
        for key in ("abort_ms", "abort_s"):
            if record.get(key) is not None:
                raise ValueError(
                    f"{key!r} is a timed line's abort; this line arrives by 'arrival_step' "
                    "(give 'abort_step', or the arrival as 'arrival_ms' or 'arrival_s')"
                )
        abort_step = record.get("abort_step")
        if abort_step is not None:
            abort_step = _int_field(record, "abort_step", 0, MAX_STEP)
            if abort_step < arrival_step:
                raise ValueError(
                    f"'abort_step' ({abort_step}) must be >= 'arrival_step' ({arrival_step})"
                )
    request_id = _int_field(record, "id", 0, MAX_REQUEST_ID)
    prompt_len, content = _prompt_content(record, hash_block_tokens)
    return RequestSpec(
        request_id=request_id,
        arrival_step=arrival_step,
        prompt_len=prompt_len,
        output_len=_int_field(record, "output_len", 1, MAX_REQUEST_TOKENS),
        priority=priority,
        abort_step=abort_step,
        content=content,
        arrival_ms=arrival_ms,
        abort_ms=abort_ms,
    )


#: The keys of a timed line's arrival, and the ms in one of their unit.
_TIMED_ARRIVAL_KEYS = {"arrival_ms": 1.0, "arrival_s": 1000.0}
_TIMED_ABORT_KEYS = {"abort_ms": 1.0, "abort_s": 1000.0}


def _time_field(record: dict[str, Any], units: dict[str, float], what: str) -> float | None:
    """The one key of ``units`` that ``record`` gives (``None``: neither, or null), in ms: a
    finite number >= 0 that is at most :data:`MAX_ARRIVAL_MS` in ms."""
    given = [key for key in units if record.get(key) is not None]
    if len(given) > 1:
        raise ValueError(f"give the {what} as {' or as '.join(map(repr, given))}, not both")
    if not given:
        return None
    (key,) = given
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key!r} must be a number, got {_shown(value)}")
    limit = MAX_ARRIVAL_MS / units[key]
    if not 0 <= value <= limit:  # also rejects NaN and infinities
        raise ValueError(f"{key!r} must be a number in [0, {limit:g}], got {_shown(value)}")
    return float(value) * units[key]


def _timed_arrival(record: dict[str, Any]) -> tuple[float, float | None]:
    """A timed line's arrival and abort, in ms."""
    if record.get("arrival_step") is not None:
        raise ValueError(
            "give the arrival as 'arrival_step' or in time ('arrival_ms' or 'arrival_s'), not both"
        )
    if record.get("abort_step") is not None:
        raise ValueError(
            "'abort_step' is a step line's abort; this line arrives in time (give 'abort_ms' "
            "or 'abort_s')"
        )
    arrival_ms = _time_field(record, _TIMED_ARRIVAL_KEYS, "arrival")
    if arrival_ms is None:  # every arrival key null
        raise ValueError("'arrival_ms' must be a number, got null")
    abort_ms = _time_field(record, _TIMED_ABORT_KEYS, "abort")
    if abort_ms is not None and abort_ms < arrival_ms:
        raise ValueError(
            f"the abort ({abort_ms:g} ms) must be at or after the arrival ({arrival_ms:g} ms)"
        )
    return arrival_ms, abort_ms


def parse_trace(
    lines: Iterable[str],
    path: str | Path = "<trace>",
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
    unknown_keys: dict[str, int] | None = None,
) -> list[RequestSpec]:
    """Parse JSONL trace lines (blank lines are skipped) into a workload in queue order.

    Requests are ordered by ``arrival_step`` (a timed trace: ``arrival_ms``), ties in line
    order; every line arrives by step or every line in time, else the first line that differs
    is refused. Raises :class:`TraceError`
    naming the line number and the problem for the first bad line, a duplicate id (naming
    both lines), or an empty trace. ``hash_block_tokens``: the tokens one ``hash_ids`` entry
    stands for. ``unknown_keys``: filled with each key not in :data:`TRACE_KEYS` (ignored)
    and the first line that has it.
    """
    if hash_block_tokens < 1:
        raise ValueError(f"hash_block_tokens must be >= 1, got {hash_block_tokens}")
    requests: list[RequestSpec] = []
    first_line_of_id: dict[int, int] = {}
    first_line = 0
    for line_number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = _decode_line(text)
            request = _request_from_record(record, hash_block_tokens)
        except ValueError as err:
            raise TraceError(path, str(err), line_number) from None
        if requests and request.timed != requests[0].timed:
            kinds = ("in time ('arrival_ms' or 'arrival_s')", "by 'arrival_step'")
            this, first = kinds if request.timed else kinds[::-1]
            raise TraceError(
                path,
                f"this line arrives {this}, line {first_line} {first}: a trace gives every "
                "arrival in steps or every arrival in time",
                line_number,
            )
        first_line = first_line or line_number
        if unknown_keys is not None:
            for key in (key for key in record if key not in TRACE_KEYS):
                unknown_keys.setdefault(key, line_number)
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
    if requests[0].timed:
        requests.sort(key=lambda r: r.arrival_ms or 0.0)  # stable: ties keep line order
    else:
        requests.sort(key=lambda r: r.arrival_step)
    return requests


def read_trace(
    path: str | Path,
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
    unknown_keys: dict[str, int] | None = None,
) -> list[RequestSpec]:
    """Read a JSONL trace: one ``{"id", "arrival_step", "prompt_len", "output_len"}`` per line.

    An optional integer ``"priority"`` (default 0, higher is more important) is used by the
    ``priority`` victim policy. An optional integer ``"abort_step"`` (``>= arrival_step``;
    absent or ``null``: never) aborts the request before that step is scheduled, unless it
    finished earlier. The prompt's content is optional too (absent or ``null``: a prompt of its
    own, sharing nothing): ``"token_ids"``, the prompt itself (a non-empty list of token ids in
    ``[0, 2**31)``; ``prompt_len`` may then be left out, and if given must be their number), or
    ``"hash_ids"``, one id in ``[0, 2**64)`` per block of ``hash_block_tokens`` tokens, each id
    standing for the same tokens wherever it appears, the last block cut to ``prompt_len``
    (``ceil(prompt_len / hash_block_tokens)`` ids; the Mooncake trace convention), not both.
    A timed trace gives each arrival in time instead of ``arrival_step``: ``"arrival_ms"`` or
    ``"arrival_s"`` (a number >= 0), with ``"abort_ms"`` or ``"abort_s"`` (at or after the
    arrival) instead of ``abort_step``; its requests carry ``arrival_ms`` (see
    :func:`is_timed`), and every line of the file must arrive in time.
    Other keys are ignored (``unknown_keys``: filled with them, as :func:`parse_trace` does).
    """
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_trace(handle, path, hash_block_tokens, unknown_keys)
    except OSError as err:
        raise TraceError(path, f"cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise TraceError(path, f"not UTF-8 text ({err.reason})") from None


def write_trace(
    requests: Iterable[RequestSpec],
    path: str | Path,
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
) -> None:
    """Write requests as a JSONL trace that :func:`read_trace` (with the same
    ``hash_block_tokens``) reads back equal.

    A request's content is written as its ``hash_ids`` when it has them in blocks of
    ``hash_block_tokens``, else as its ``token_ids`` (a synthetic shared prefix or
    conversation is written out token by token); a prompt of its own has neither.
    """
    with open(path, "w", encoding="utf-8") as handle:
        for request in requests:
            record: dict[str, Any] = {"id": request.request_id}
            if request.arrival_ms is not None:
                record["arrival_ms"] = request.arrival_ms
            else:
                record["arrival_step"] = request.arrival_step
            record["prompt_len"] = request.prompt_len
            record["output_len"] = request.output_len
            record["priority"] = request.priority
            if request.abort_step is not None:
                record["abort_step"] = request.abort_step
            if request.abort_ms is not None:
                record["abort_ms"] = request.abort_ms
            content = request.content
            if isinstance(content, HashBlocks) and content.block_tokens == hash_block_tokens:
                record["hash_ids"] = list(content.hash_ids)
            elif content is not None:
                record["token_ids"] = content.tokens().tolist()
            handle.write(json.dumps(record) + "\n")
