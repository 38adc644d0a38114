"""Public production traces read as they are published: Azure, Mooncake and BurstGPT.

:func:`read_trace_file` (a path) and :func:`parse_trace_lines` (any lines: a file, stdin)
read one trace in a :class:`TraceFormat` and return a :class:`TraceRead`: the workload in
queue order and what was left out. ``helix`` is the simulator's own JSONL
(:func:`~helix_kv.simulate.workload.parse_trace`); the others are the public traces:

- ``azure``: the Azure LLM inference traces (AzurePublicDataset), CSV with the columns
  ``TIMESTAMP`` (a date and time: ``2023-11-16 18:15:46.6805900`` in the 2023 release,
  ``2024-05-10 00:00:00.009930+00:00`` in the 2024 one; no offset is UTC), ``ContextTokens``
  (the prompt) and ``GeneratedTokens`` (the output);
- ``mooncake``: the Mooncake traces, JSONL with ``timestamp`` (ms), ``input_length``,
  ``output_length`` and optionally ``hash_ids`` (one id per block of ``hash_block_tokens``
  tokens: the prompt's content, :class:`~helix_kv.simulate.workload.HashBlocks`); other keys
  are ignored;
- ``burstgpt``: the BurstGPT traces, CSV with ``Timestamp`` (seconds), ``Request tokens``,
  ``Response tokens`` and optionally ``Log Type`` (other columns, ``Model``, ``Total tokens``,
  ``Session ID``..., are ignored).

``auto`` tells the format from the first non-blank line: a JSON object with ``input_length``
(and none of the helix keys) is Mooncake, any other JSON object helix; a CSV header with
Azure's three columns is Azure, one with BurstGPT's is BurstGPT.

Every row is checked before any request is made: a bad row is a :class:`TraceError` naming
the file, the line and the field (and the format, unless it is a detected helix trace). Rows
that hold no request that could run are skipped and counted by reason (:data:`SKIP_REASONS`):
a failed request (``Response tokens``/``GeneratedTokens``/``output_length`` 0, or a BurstGPT
``Log Type`` naming a failure) or an empty prompt.

Arrivals are times, not steps: the rows are sorted by time (stably: rows of one time keep
their file order), ``window_s`` keeps the rows whose arrival, in seconds after the trace's
earliest row, is in ``[start, end)``, the skipped rows are left out, ``limit`` keeps the first
requests, and each kept request's ``arrival_ms`` is its time after the first kept one
multiplied by ``time_scale`` (below 1 replays faster). The public formats have no ids: the
kept requests are numbered 0, 1, ... in file order. A helix trace keeps its ids, and its times
(``arrival_ms``) stand as written unless ``time_scale`` or ``window_s`` is given; one of
arrival steps takes neither.
"""

from __future__ import annotations

import csv
import dataclasses
import enum
import itertools
import json
import math
import re
import warnings
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from helix_kv.errors import TraceError
from helix_kv.simulate.workload import (
    DEFAULT_HASH_BLOCK_TOKENS,
    MAX_REQUEST_TOKENS,
    TRACE_KEYS,
    HashBlocks,
    PromptContent,
    RequestSpec,
    _decode_line,
    _integer_list,
    _shown,
    parse_trace,
    require_keys,
)


class TraceFormat(str, enum.Enum):
    """A trace file's format (``helix-kv simulate --trace-format``)."""

    AUTO = "auto"
    """Told from the first non-blank line."""
    HELIX = "helix"
    """The simulator's own JSONL (:func:`~helix_kv.simulate.workload.read_trace`)."""
    AZURE = "azure"
    """Azure LLM inference traces: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``."""
    MOONCAKE = "mooncake"
    """Mooncake traces: JSONL ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids``."""
    BURSTGPT = "burstgpt"
    """BurstGPT traces: CSV ``Timestamp`` (s), ``Request tokens``, ``Response tokens``,
    ``Log Type``..."""


#: Every ``--trace-format`` value.
TRACE_FORMATS = tuple(trace_format.value for trace_format in TraceFormat)

#: Why a row is skipped, the keys of :attr:`TraceRead.skipped`; a row counts under the first
#: that applies.
SKIP_FAILED_LOG_TYPE = "failed_log_type"
SKIP_ZERO_RESPONSE = "zero_response_tokens"
SKIP_ZERO_PROMPT = "zero_prompt_tokens"
SKIP_REASONS = (SKIP_FAILED_LOG_TYPE, SKIP_ZERO_RESPONSE, SKIP_ZERO_PROMPT)
_SKIP_CODE = {reason: 1 + i for i, reason in enumerate(SKIP_REASONS)}  # 0: kept

#: The columns each CSV format needs (others are ignored).
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
BURSTGPT_LOG_TYPE = "Log Type"
#: The keys of a Mooncake line that are read (others are ignored); ``hash_ids`` is optional.
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")

#: Keys that tell a JSON line is a helix one: its own (``hash_ids`` is Mooncake's too), those
#: of a timed helix trace included.
_HELIX_MARKS = (frozenset(TRACE_KEYS) - {"hash_ids"}) | {
    "arrival_ms",
    "arrival_s",
    "abort_ms",
    "abort_s",
}


@dataclass(frozen=True)
class TraceRead:
    """One trace read as a workload.

    ``requests``: in queue order (by arrival, ties in file order). ``trace_format``: the
    format it was read in (never ``auto``); ``detected``: told from its first line.
    ``rows``: the requests and skipped rows the file holds (blank lines aside). ``skipped``:
    the rows left out, by reason (:data:`SKIP_REASONS`; only reasons that occurred), counted
    inside the window and before the limit was reached. ``unknown_keys`` (helix only): each
    key the reader ignored and the first line that has it.
    """

    requests: list[RequestSpec]
    trace_format: TraceFormat
    detected: bool
    rows: int
    skipped: dict[str, int] = field(default_factory=dict)
    unknown_keys: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TraceSelection:
    """Which of a trace's requests to replay, and how fast (see the module's docstring).

    ``time_scale``: every arrival time is multiplied by it (> 0; below 1 replays faster).
    ``window_s``: ``(start, end)`` in seconds after the trace's earliest row (its own time,
    before ``time_scale``); rows in ``[start, end)`` are kept (``end`` may be ``inf``).
    ``limit``: the first ``limit`` kept requests (in queue order).
    """

    time_scale: float = 1.0
    window_s: tuple[float, float] | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0, got {self.time_scale}")
        if self.window_s is not None:
            start, end = self.window_s
            if not (math.isfinite(start) and start >= 0 and end > start):  # end: NaN fails
                raise ValueError(
                    f"window_s must be (start, end) with 0 <= start < end, got {self.window_s}"
                )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")

    @property
    def moves_time(self) -> bool:
        """Whether it scales or cuts the trace's time (which a trace of steps cannot take)."""
        return self.time_scale != 1.0 or self.window_s is not None


class _Rows:
    """The rows of a trace, column by column (compact: a 30 MB CSV holds a million rows):
    arrival in ms (any origin), prompt and output tokens, skip reason (0: none, else 1 + its
    index in :data:`SKIP_REASONS`), and the prompt's content when the format gives it."""

    def __init__(self) -> None:
        self.arrival_ms = array("d")
        self.prompt_len = array("q")
        self.output_len = array("q")
        self.skip = array("b")
        self.content: list[PromptContent | None] | None = None

    def add(self, arrival_ms: float, prompt_len: int, output_len: int, failed: bool) -> None:
        self.arrival_ms.append(arrival_ms)
        self.prompt_len.append(prompt_len)
        self.output_len.append(output_len)
        if failed:
            self.skip.append(_SKIP_CODE[SKIP_FAILED_LOG_TYPE])
        elif output_len == 0:
            self.skip.append(_SKIP_CODE[SKIP_ZERO_RESPONSE])
        elif prompt_len == 0:
            self.skip.append(_SKIP_CODE[SKIP_ZERO_PROMPT])
        else:
            self.skip.append(0)

    def extend(
        self,
        arrival_ms: np.ndarray,
        prompt_len: np.ndarray,
        output_len: np.ndarray,
        failed: np.ndarray,
    ) -> None:
        """Add rows column by column (as :meth:`add` adds one)."""
        skip = np.zeros(len(failed), dtype=np.int8)
        # the later reasons first: the earlier ones, written over them, win
        skip[prompt_len == 0] = _SKIP_CODE[SKIP_ZERO_PROMPT]
        skip[output_len == 0] = _SKIP_CODE[SKIP_ZERO_RESPONSE]
        skip[failed] = _SKIP_CODE[SKIP_FAILED_LOG_TYPE]
        self.arrival_ms.frombytes(np.ascontiguousarray(arrival_ms, dtype=np.float64).tobytes())
        self.prompt_len.frombytes(np.ascontiguousarray(prompt_len, dtype=np.int64).tobytes())
        self.output_len.frombytes(np.ascontiguousarray(output_len, dtype=np.int64).tobytes())
        self.skip.frombytes(skip.tobytes())

    def __len__(self) -> int:
        return len(self.skip)


# --- detection -------------------------------------------------------------------------------


def detect_format(first_line: str) -> TraceFormat | None:
    """The format a trace's first non-blank line says (``None``: none of them)."""
    text = first_line.lstrip("\ufeff").strip()
    if text.startswith("{"):
        try:
            record = json.loads(text)
        except (ValueError, RecursionError):
            return TraceFormat.HELIX  # the helix reader says what is wrong with it
        if (
            isinstance(record, dict)
            and "input_length" in record
            and not _HELIX_MARKS & record.keys()
        ):
            return TraceFormat.MOONCAKE
        return TraceFormat.HELIX
    header = set(_header(text))
    if header >= set(AZURE_COLUMNS):
        return TraceFormat.AZURE
    if header >= set(BURSTGPT_COLUMNS):
        return TraceFormat.BURSTGPT
    return None


def _header(line: str) -> list[str]:
    """A CSV header line's column names, stripped of spaces."""
    return [name.strip() for name in next(csv.reader([line]), [])]


# --- reading ---------------------------------------------------------------------------------


def read_trace_file(
    path: str | Path,
    trace_format: TraceFormat | str = TraceFormat.AUTO,
    selection: TraceSelection | None = None,
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
) -> TraceRead:
    """Read the trace at ``path`` (streamed, UTF-8) as :func:`parse_trace_lines` does."""
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            return parse_trace_lines(handle, path, trace_format, selection, hash_block_tokens)
    except OSError as err:
        raise TraceError(path, f"cannot read it ({err.strerror or err})") from None


def parse_trace_lines(
    lines: Iterable[str],
    path: str | Path = "<trace>",
    trace_format: TraceFormat | str = TraceFormat.AUTO,
    selection: TraceSelection | None = None,
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
) -> TraceRead:
    """Read a trace's lines in ``trace_format`` (``auto``: told from the first non-blank line)
    and select its requests (``selection``: all, at their own pace).

    Raises :class:`TraceError` for a format that cannot be told or does not fit, a bad row
    (naming its line and field), a trace of steps given a time scale or window, or a trace
    that leaves no request. ``hash_block_tokens``: the tokens one ``hash_ids`` entry stands
    for (helix and Mooncake)."""
    if hash_block_tokens < 1:
        raise ValueError(f"hash_block_tokens must be >= 1, got {hash_block_tokens}")
    selection = selection if selection is not None else TraceSelection()
    trace_format = TraceFormat(trace_format)
    detected = trace_format is TraceFormat.AUTO
    try:
        head, first_line, rest = _first_line(iter(lines))
        if trace_format is TraceFormat.AUTO:
            if first_line is None:
                raise TraceError(path, "no requests (the file is empty or only blank lines)")
            found = detect_format(first_line)
            if found is None:
                raise TraceError(
                    path,
                    f"cannot tell its format from line {len(head)} ({_shown(first_line.strip())}): "
                    "not a helix or mooncake JSON line, nor an azure or burstgpt CSV header; "
                    f"name it ({', '.join(TRACE_FORMATS[1:])})",
                    len(head),
                )
            trace_format = found
        all_lines = itertools.chain(head, rest)
        if trace_format is TraceFormat.HELIX:
            return _read_helix(all_lines, path, selection, hash_block_tokens, detected)
        try:
            rows = _read_rows(all_lines, trace_format, hash_block_tokens)
        except _RowError as err:
            where = _format_named(trace_format, len(head) if detected else None)
            raise TraceError(path, f"{err.reason} ({where})", err.line) from None
    except UnicodeDecodeError as err:
        raise TraceError(path, f"not UTF-8 text ({err.reason})") from None
    if not len(rows):
        raise TraceError(path, f"no requests (the {trace_format.value} trace has no rows)")
    requests, skipped = _select(rows, selection, path)
    return TraceRead(requests, trace_format, detected, len(rows), skipped)


def _format_named(trace_format: TraceFormat, detected_on: int | None) -> str:
    """How a message names the format a trace was read in (``detected_on``: the line it was
    told from; ``None``: it was given)."""
    if detected_on is None:
        return f"format {trace_format.value}, as given"
    return f"format {trace_format.value}, detected from line {detected_on}"


def _first_line(lines: Iterator[str]) -> tuple[list[str], str | None, Iterator[str]]:
    """The lines up to the first non-blank one (``head``, so far read), that line (``None``:
    none) and the lines after it, still unread."""
    head: list[str] = []
    for line in lines:
        head.append(line)
        if line.strip():
            return head, line, lines
    return head, None, lines


def _read_helix(
    lines: Iterable[str],
    path: str | Path,
    selection: TraceSelection,
    hash_block_tokens: int,
    detected: bool,
) -> TraceRead:
    unknown: dict[str, int] = {}
    try:
        requests = parse_trace(lines, path, hash_block_tokens, unknown)
    except TraceError as err:
        if detected:
            raise
        raise TraceError(
            path, f"{err.reason} ({_format_named(TraceFormat.HELIX, None)})", err.line_number
        ) from None
    rows = len(requests)
    if any(request.arrival_ms is None for request in requests):
        if selection.moves_time:
            raise TraceError(
                path,
                "its requests arrive at steps, not times: a time scale or window does not apply",
            )
        return TraceRead(
            requests[: selection.limit], TraceFormat.HELIX, detected, rows, {}, unknown
        )
    if not selection.moves_time:  # a timed helix trace's times stand as written
        return TraceRead(
            requests[: selection.limit], TraceFormat.HELIX, detected, rows, {}, unknown
        )
    timed = _Rows()
    for request in requests:
        assert request.arrival_ms is not None  # every one has it: checked above
        timed.add(request.arrival_ms, request.prompt_len, request.output_len, False)
    chosen, _ = _select(timed, selection, path, keep_ids=requests)
    return TraceRead(chosen, TraceFormat.HELIX, detected, rows, {}, unknown)


class _RowError(Exception):
    """A bad row: its line and what is wrong (the format is added by the caller)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line = line
        self.reason = reason


def _read_rows(lines: Iterable[str], trace_format: TraceFormat, hash_block_tokens: int) -> _Rows:
    if trace_format is TraceFormat.MOONCAKE:
        return _read_mooncake(lines, hash_block_tokens)
    return _read_csv(lines, trace_format)


#: Rows converted at a time (column by column, in numpy): bounds what a CSV's text costs.
_CHUNK_ROWS = 1 << 16

#: What an Azure ``TIMESTAMP`` starts with: ``YYYY-MM-DD HH:MM:SS`` (``d``: a digit, ``?``: a
#: space or ``T``); the rest (a fraction, an offset) and the ranges are numpy's to parse.
_DATETIME_SHAPE = "dddd-dd-dd?dd:dd:dd"
_UTC_OFFSET = re.compile(r"[+-]\d\d:\d\d", re.ASCII)


def _tokens(text: str, column: str) -> int:
    """A CSV token count: a whole number in ``[0, MAX_REQUEST_TOKENS]``."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{column!r} must be a whole number of tokens >= 0, got {_shown(text)}")
    if value > MAX_REQUEST_TOKENS:
        raise ValueError(
            f"{column!r} is {value} tokens; the simulator takes at most {MAX_REQUEST_TOKENS}"
        )
    return value


def _seconds(text: str) -> float:
    """A BurstGPT ``Timestamp``: seconds, a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"'Timestamp' must be a number of seconds >= 0, got {_shown(text)}")
    return value


def _datetime_ns(texts: list[str]) -> np.ndarray:
    """Azure ``TIMESTAMP`` texts as ns since the epoch, UTC (a time without an offset is
    UTC); ``ValueError`` if one is not a date and time."""
    shaped = np.array(texts)
    if shaped.dtype.itemsize < 4 * len(_DATETIME_SHAPE):
        raise ValueError("too short for a date and time")
    codes = shaped.view(np.uint32).reshape(len(texts), -1)[:, : len(_DATETIME_SHAPE)]
    for at, kind in enumerate(_DATETIME_SHAPE):
        column = codes[:, at]
        if kind == "d":
            good = (column >= ord("0")) & (column <= ord("9"))
        elif kind == "?":
            good = (column == ord(" ")) | (column == ord("T"))
        else:
            good = column == ord(kind)
        if not good.all():
            raise ValueError("not a date and time")
    shift_ns = 0
    tails = {text[-6:] for text in texts}
    if len(tails) == 1 and _UTC_OFFSET.fullmatch(tail := tails.pop()):
        # one offset for all (the 2024 traces: +00:00): numpy's own parse of it is slow
        texts = [text[:-6] for text in texts]
        sign = 1 if tail[0] == "-" else -1  # 10:00+02:00 is 08:00 UTC
        shift_ns = sign * (int(tail[1:3]) * 60 + int(tail[4:6])) * 60 * 10**9
    with warnings.catch_warnings():  # numpy applies an offset, then warns that it drops it
        warnings.filterwarnings("ignore", "no explicit representation of timezones")
        stamps = np.array(texts, dtype="datetime64[ns]")
    ns: np.ndarray = stamps.astype(np.int64) + shift_ns
    return ns


def _timestamp(text: str) -> None:
    """Check one Azure ``TIMESTAMP`` (``ValueError`` saying what is wrong)."""
    try:
        _datetime_ns([text])
    except (ValueError, OverflowError):
        raise ValueError(
            "'TIMESTAMP' must be a date and time such as 2023-11-16 18:15:46.6805900, got "
            f"{_shown(text)}"
        ) from None


class _CsvRows:
    """Azure or BurstGPT rows, converted a chunk at a time (numpy) into :class:`_Rows`; a
    chunk that does not convert is read again row by row to name its first bad row."""

    def __init__(self, trace_format: TraceFormat, names: list[str]) -> None:
        self.azure = trace_format is TraceFormat.AZURE
        self.columns = AZURE_COLUMNS if self.azure else BURSTGPT_COLUMNS
        self.places = [names.index(name) for name in self.columns]
        self.log_type_at = names.index(BURSTGPT_LOG_TYPE) if BURSTGPT_LOG_TYPE in names else None
        self.rows = _Rows()
        self.origin_ns: int | None = None  # Azure: the first row's time; ms count from it

    def add(self, chunk: list[list[str]], lines: list[int]) -> None:
        """Add ``chunk``, the rows read on ``lines`` (none empty)."""
        width = max(self.places) + 1
        if min(map(len, chunk), default=width) < width:
            chunk, lines = self._full_rows(chunk, lines, width)
        if not chunk:
            return
        time_at, prompt_at, output_at = self.places
        times = [row[time_at] for row in chunk]
        try:
            if self.azure:
                ns = _datetime_ns(times)
                if self.origin_ns is None:
                    self.origin_ns = int(ns[0])
                arrival_ms = (ns - self.origin_ns) / 1e6
            else:
                arrival_ms = np.array(times, dtype=np.float64) * 1000.0
                if not (np.isfinite(arrival_ms).all() and (arrival_ms >= 0).all()):
                    raise ValueError("a time that is not a number of seconds >= 0")
            prompts = np.array([row[prompt_at] for row in chunk], dtype=np.int64)
            outputs = np.array([row[output_at] for row in chunk], dtype=np.int64)
            for tokens in (prompts, outputs):
                if tokens.min() < 0 or tokens.max() > MAX_REQUEST_TOKENS:
                    raise ValueError("a token count out of range")
        except (ValueError, OverflowError):
            self._raise_first_bad_row(chunk, lines)
            raise  # not reached: a row of the chunk is bad
        failed = np.zeros(len(chunk), dtype=bool)
        if self.log_type_at is not None:
            at = self.log_type_at
            kinds = [row[at] if at < len(row) else "" for row in chunk]
            failures = [kind for kind in set(kinds) if "fail" in kind.lower()]
            if failures:
                failed = np.isin(np.array(kinds), failures)
        self.rows.extend(arrival_ms, prompts, outputs, failed)

    def _full_rows(
        self, chunk: list[list[str]], lines: list[int], width: int
    ) -> tuple[list[list[str]], list[int]]:
        """``chunk`` without its blank rows; a short row that is not blank is a bad row."""
        kept: list[list[str]] = []
        kept_lines: list[int] = []
        for row, line in zip(chunk, lines):
            if len(row) < width:
                if len(row) == 1 and not row[0].strip():
                    continue  # a line of spaces
                absent = [name for name, at in zip(self.columns, self.places) if at >= len(row)]
                raise _RowError(
                    line,
                    f"the row has {len(row)} field{'s' if len(row) > 1 else ''}; it lacks "
                    f"{', '.join(map(repr, absent))}",
                )
            kept.append(row)
            kept_lines.append(line)
        return kept, kept_lines

    def _raise_first_bad_row(self, chunk: list[list[str]], lines: list[int]) -> None:
        _, prompt_column, output_column = self.columns
        time_at, prompt_at, output_at = self.places
        for row, line in zip(chunk, lines):
            try:
                if self.azure:
                    _timestamp(row[time_at])
                else:
                    _seconds(row[time_at])
                _tokens(row[prompt_at], prompt_column)
                _tokens(row[output_at], output_column)
            except ValueError as err:
                raise _RowError(line, str(err)) from None


def _read_csv(lines: Iterable[str], trace_format: TraceFormat) -> _Rows:
    reader = csv.reader(lines)
    header: list[str] = []
    for header in reader:
        if header:
            break
    else:
        return _Rows()  # no header: no rows
    names = [name.strip().lstrip("\ufeff") for name in header]
    wanted = AZURE_COLUMNS if trace_format is TraceFormat.AZURE else BURSTGPT_COLUMNS
    missing = [name for name in wanted if name not in names]
    if missing:
        other = detect_format(",".join(names))
        hint = f"; it looks like format {other.value}" if other is not None else ""
        raise _RowError(
            reader.line_num,
            f"the header lacks the column{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))} (it has {', '.join(map(repr, names))[:120]}){hint}",
        )
    rows = _CsvRows(trace_format, names)
    chunk: list[list[str]] = []
    chunk_lines: list[int] = []
    for row in reader:
        if row:  # [] is a blank line
            chunk.append(row)
            chunk_lines.append(reader.line_num)
            if len(chunk) == _CHUNK_ROWS:
                rows.add(chunk, chunk_lines)
                chunk, chunk_lines = [], []
    rows.add(chunk, chunk_lines)
    return rows.rows


def _read_mooncake(lines: Iterable[str], hash_block_tokens: int) -> _Rows:
    rows = _Rows()
    rows.content = []
    for line_number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = _decode_line(text)
            require_keys(record, MOONCAKE_KEYS[:3])
            timestamp = record["timestamp"]
            if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
                raise ValueError(f"'timestamp' must be a number of ms, got {_shown(timestamp)}")
            if not (math.isfinite(timestamp) and timestamp >= 0):
                raise ValueError(
                    f"'timestamp' must be a number of ms >= 0, got {_shown(timestamp)}"
                )
            prompt_len = _json_tokens(record, "input_length")
            output_len = _json_tokens(record, "output_length")
            content: PromptContent | None = None
            if record.get("hash_ids") is not None and prompt_len > 0:
                ids = _integer_list(record, "hash_ids", 2**64 - 1, "hash id")
                blocks = -(-prompt_len // hash_block_tokens)
                if len(ids) != blocks:
                    raise ValueError(
                        f"'hash_ids' has {len(ids)} ids; an 'input_length' of {prompt_len} in "
                        f"blocks of {hash_block_tokens} tokens (--hash-block-tokens) takes {blocks}"
                    )
                content = HashBlocks.of(ids, hash_block_tokens, prompt_len)
        except ValueError as err:
            raise _RowError(line_number, str(err)) from None
        rows.add(float(timestamp), prompt_len, output_len, False)
        rows.content.append(content)
    return rows


def _json_tokens(record: dict[str, Any], key: str) -> int:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key!r} must be a whole number of tokens >= 0, got {_shown(value)}")
    if value > MAX_REQUEST_TOKENS:
        raise ValueError(
            f"{key!r} is {value} tokens; the simulator takes at most {MAX_REQUEST_TOKENS}"
        )
    return value


# --- selection -------------------------------------------------------------------------------


def _select(
    rows: _Rows,
    selection: TraceSelection,
    path: str | Path,
    keep_ids: list[RequestSpec] | None = None,
) -> tuple[list[RequestSpec], dict[str, int]]:
    """The requests ``selection`` keeps of ``rows``, in queue order, and the skipped rows by
    reason. ``keep_ids``: the requests the rows were read from (helix), kept with their ids and
    other fields, their times moved; else ids are 0, 1, ... in file order."""
    arrivals = np.frombuffer(rows.arrival_ms, dtype=np.float64)
    skip = np.frombuffer(rows.skip, dtype=np.int8)
    order = np.argsort(arrivals, kind="stable")  # ties keep file order
    if selection.window_s is not None:
        start, end = selection.window_s
        since_s = (arrivals[order] - arrivals[order[0]]) / 1000.0
        order = order[(since_s >= start) & (since_s < end)]
    kept_at = np.flatnonzero(skip[order] == 0)
    if selection.limit is not None and len(kept_at) >= selection.limit:
        order = order[: kept_at[selection.limit - 1] + 1]  # skips counted up to the last kept
        kept_at = kept_at[: selection.limit]
    reasons = np.bincount(skip[order], minlength=len(SKIP_REASONS) + 1)
    skipped = {
        reason: int(reasons[1 + i]) for i, reason in enumerate(SKIP_REASONS) if reasons[1 + i]
    }
    kept = order[kept_at]
    if not len(kept):
        if not len(order):
            raise TraceError(path, f"no requests: no row arrives in {_window_text(selection)}")
        what = "every row" if selection.window_s is None else "every row in the window"
        counts = ", ".join(f"{reason}: {count}" for reason, count in skipped.items())
        raise TraceError(path, f"no requests: {what} is skipped ({counts})")
    times = ((arrivals[kept] - arrivals[kept[0]]) * selection.time_scale).tolist()
    requests: list[RequestSpec] = []
    if keep_ids is not None:
        for at, arrival_ms in zip(kept.tolist(), times):
            request = keep_ids[at]
            moved: dict[str, Any] = {"arrival_ms": arrival_ms}
            if request.abort_ms is not None and request.arrival_ms is not None:
                ahead_ms = request.abort_ms - request.arrival_ms
                moved["abort_ms"] = arrival_ms + ahead_ms * selection.time_scale
            requests.append(dataclasses.replace(request, **moved))
        return requests, skipped
    ids = np.empty(len(kept), dtype=np.int64)
    ids[np.argsort(kept, kind="stable")] = np.arange(len(kept))  # numbered in file order
    prompts = np.frombuffer(rows.prompt_len, dtype=np.int64)[kept].tolist()
    outputs = np.frombuffer(rows.output_len, dtype=np.int64)[kept].tolist()
    contents = rows.content
    for i, (at, arrival_ms) in enumerate(zip(kept.tolist(), times)):
        requests.append(
            RequestSpec(
                request_id=int(ids[i]),
                arrival_step=0,
                prompt_len=prompts[i],
                output_len=outputs[i],
                content=None if contents is None else contents[at],
                arrival_ms=arrival_ms,
            )
        )
    return requests, skipped


def _window_text(selection: TraceSelection) -> str:
    """The window, as a message names it."""
    assert selection.window_s is not None
    start, end = selection.window_s
    return f"the window [{start:g}, {end:g}) s"
