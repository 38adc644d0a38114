"""Hostile arguments to every public call of Layout, Ledger, SchedulerConfig and Scheduler,
and to every constructor of the extension (the value records' keywords among them).

Each case corrupts one argument of an otherwise valid call (floats, strings, bools, None,
objects, out-of-range ints, arrays of the wrong dtype kind or shape, mismatched lengths,
huge widths, misaligned arrays of bad values) and checks the rules of docs/errors.md: the
call raises the documented HelixKVError subclass and the object's state_digest() is
unchanged. Every array argument is also given its valid values in every layout numpy makes
(misaligned, strided, byte-swapped, Fortran order), which must give what the plain values
give. The table is run exhaustively; hypothesis interleaves hostile calls with valid ones. A
panic would surface as pyo3's PanicException (not a HelixKVError) and an abort would kill
the test run.
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import helix_kv
from helix_kv import (
    ConfigError,
    HelixKVError,
    InvalidArgumentError,
    InvalidLengthError,
    InvalidTypeError,
)
from tests.helpers import examples

MAX_ID = 2**64 - 1


class RaisingIndex:
    """An "integer" whose __index__ fails with something other than TypeError."""

    def __index__(self) -> int:
        raise ValueError("no")


class RaisingGetattr:
    """Every attribute lookup fails (so hasattr() itself raises)."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(name)


class RaisingSequence:
    """A sequence that fails while it is read."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        raise RuntimeError("unreadable")


class RaisingArray:
    """An array-like whose __array__ fails."""

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no array")


def misaligned(values: Any, dtype: Any) -> np.ndarray:
    """`values` as an array of `dtype` one byte past an aligned address (what
    ``np.frombuffer(buf, dtype, offset=1)`` gives): contiguous, but no slice can borrow it."""
    plain = np.asarray(values, dtype=dtype)
    buffer = bytearray(plain.nbytes + 1)
    array = np.frombuffer(buffer, plain.dtype, count=plain.size, offset=1).reshape(plain.shape)
    array[...] = plain
    assert not array.flags.aligned
    assert array.flags.c_contiguous
    return array


# -- hostile values, each with the error it must raise -------------------------------------

NOT_INTS = [
    3.7,
    2.0,
    -0.5,
    float("nan"),
    float("inf"),
    "7",
    "",
    b"7",
    None,
    object(),
    True,
    False,
    np.float64(2.0),
    np.float32(1.0),
    np.bool_(True),
    np.array(2.0),
    [1],
    (1,),
    {1: 2},
    1 + 2j,
    Decimal(3),
    Fraction(3, 1),
    RaisingIndex(),
    RaisingGetattr(),
]
NOT_INT_ARRAYS = [
    np.array([1.0, 2.0]),
    np.array([1.5]),
    np.array(["1", "2"]),
    np.array([b"1"]),
    np.array([1, 2], dtype=object),
    np.array([True, False]),
    np.array([1 + 1j]),
    np.array([1], dtype="datetime64[s]"),
    ["1", "2"],
    [1.0, 2.0],
    [1, None],
    [True, 1],
    [np.float64(1.0)],
    [[1, 2]],
    "12",
    b"12",
    None,
    5,
    5.0,
    {1, 2},
    {1: 2},
    object(),
    RaisingSequence(),
    RaisingArray(),
    RaisingGetattr(),
    [RaisingIndex()],
    misaligned([1.0, 2.0], np.float64),
]
NOT_1D = [
    np.zeros((2, 2), np.int64),
    np.array(3),
    np.zeros((1, 2, 1), np.int64),
    misaligned(np.zeros((2, 2)), np.int64),
]


@dataclass(frozen=True)
class Kind:
    """One kind of argument: what is wrong with each hostile value and the error it gets."""

    name: str
    hostile: tuple  # (value, expected error class) pairs


def _kind(name: str, type_values: list, range_values: list, range_error: type) -> Kind:
    pairs = [(v, InvalidTypeError) for v in type_values]
    pairs += [(v, range_error) for v in range_values]
    return Kind(name, tuple(pairs))


ID = _kind("id", NOT_INTS, [-1, -(2**63), -(2**70), 2**64, 2**100], InvalidArgumentError)
LENGTH = _kind("length", NOT_INTS, [-1, -(2**63), 2**63, MAX_ID, 2**64, 2**100], InvalidLengthError)
STEP = _kind("step", NOT_INTS, [-1, 2**64, 2**80], InvalidArgumentError)
RANK = _kind("rank", NOT_INTS, [-1, 2, 7, 2**32, 2**64], InvalidArgumentError)  # cp is 2
MAX_NEW = _kind("max_new_tokens", NOT_INTS, [-1, 0, 2**32, 2**64], InvalidLengthError)
PRIORITY = _kind("priority", NOT_INTS, [2**31, -(2**31) - 1, 2**64], InvalidArgumentError)
WIDTH = _kind(
    "width",
    [v for v in NOT_INTS if v is not None],  # None means "the widest table"
    [-1, 2**61, 2**62, 2**63 - 1, 2**63, 2**64],  # sizes numpy cannot describe
    InvalidLengthError,
)
CONFIG_INT = _kind("config int", NOT_INTS, [-1, 2**32, 2**64], ConfigError)
FLAG = _kind("flag", [1, 0, "yes", None, 1.0, np.int64(1), object()], [], ConfigError)
NAME = _kind("name", [1, None, b"newest_first", ["newest_first"], 1.5], ["no_such"], ConfigError)
CONFIG = _kind("config", ["x", None, 3, {}, helix_kv.Layout(2, 4)], [], ConfigError)
LAYOUT = _kind("layout", ["x", None, 3, (2, 4)], [], ConfigError)
LAYOUT_SIZE = _kind("layout size", NOT_INTS, [0, -1, 2**25, 2**32, 2**64], ConfigError)
# Page ids are int32 in block tables: a pool past 2**31-1 superblocks is refused up front.
CAPACITY = _kind("capacity", NOT_INTS, [0, -1, 2**31, 2**32 - 1, 2**32, 2**64], ConfigError)


def _array_kind(name: str, range_values: list, range_error: type) -> Kind:
    pairs = [(v, InvalidTypeError) for v in NOT_INT_ARRAYS]
    pairs += [(v, InvalidArgumentError) for v in NOT_1D]
    pairs += [(v, range_error) for v in range_values]
    return Kind(name, tuple(pairs))


IDS = _array_kind(
    "ids",
    [
        [-1],
        np.array([-1, 1]),
        [2**64],
        [2**100],
        [-(2**70)],
        np.array([-(2**63)]),
        misaligned([-1, 1], np.int64),
        misaligned([-1, 1], np.int32),
    ],
    InvalidArgumentError,
)
LENGTHS = _array_kind(
    "lengths",
    [
        [-1],
        np.array([-3, 1]),
        [2**63],
        np.array([2**63, 1], np.uint64),
        [2**64],
        [-(2**70)],
        misaligned([-3, 1], np.int64),
        misaligned([2**63, 1], np.uint64),
    ],
    InvalidLengthError,
)
TOKENS = _array_kind(
    "tokens",
    [
        [2**31],
        [-(2**31) - 1],
        np.array([2**40]),
        np.array([2**31], np.uint32),
        [2**64],
        misaligned([2**40], np.int64),
        misaligned([2**31], np.uint32),
    ],
    InvalidArgumentError,
)
# Draft counts (proposed or accepted): the scheduler below allows 2 drafts and its pending step
# verifies none, so 3 (or any positive accepted count) is out of range there.
COUNTS = _array_kind(
    "draft counts",
    [
        [-1, 0],
        np.array([0, -3]),
        [3, 0],
        [2**32, 0],
        [2**64, 0],
        misaligned([-1, 0], np.int64),
    ],
    InvalidArgumentError,
)
# `update`'s accepted counts are optional: None is their default, not a hostile value.
ACCEPTED = Kind("accepted counts", tuple(pair for pair in COUNTS.hostile if pair[0] is not None))
FLAGS = Kind(
    "flags",
    tuple(
        [(v, InvalidTypeError) for v in (np.array([0.0, 1.0]), ["yes", "no"], [None, True])]
        + [(v, InvalidTypeError) for v in ([1.5, 0], "ab", np.array(["a", "b"]), 3, object())]
        + [(v, InvalidArgumentError) for v in ([2, 0], np.array([0, -1]), [1, 2**70])]
        + [(misaligned([2, 0], np.int64), InvalidArgumentError)]
        + [(misaligned([0.0, 1.0], np.float64), InvalidTypeError)]
        + [(np.zeros((2, 1), bool), InvalidArgumentError)]
    ),
)

# Block tables (two-dimensional): Layout(2, 4) with positions 0 and 5 reads page [row][0].
TABLE = Kind(
    "table",
    tuple(
        [(v, InvalidTypeError) for v in (np.array([[1.0, 2.0]]), np.array([[True, False]]))]
        + [(v, InvalidTypeError) for v in (np.array([["a", "b"]]), [[1.5, 2]], [["1"]], [[None]])]
        + [(v, InvalidTypeError) for v in ("12", None, 5, object(), RaisingGetattr())]
        + [(v, InvalidTypeError) for v in ([RaisingSequence()], [[RaisingIndex()]])]
        + [(v, InvalidArgumentError) for v in (np.zeros(2, np.int64), np.zeros((1, 2, 1), int))]
        + [(v, InvalidArgumentError) for v in ([[3, 0], [1]], np.zeros((0, 2), np.int64))]
        + [(v, InvalidArgumentError) for v in (np.zeros((1, 0), np.int64), [[-1, 0]])]
        + [(v, InvalidArgumentError) for v in (np.array([[2**40, 0]]), [[2**64, 0]])]
        + [(misaligned([[1.0, 2.0]], np.float64), InvalidTypeError)]
        + [(misaligned([[2**40, 0]], np.int64), InvalidArgumentError)]
        + [(misaligned([1, 2], np.int64), InvalidArgumentError)]  # one-dimensional
    ),
)


def _mismatched(good: Any) -> tuple:
    """Arrays one entry longer and one shorter than `good` (paired arguments)."""
    values = list(good)
    return ((values + values[:1], InvalidArgumentError), (values[:-1], InvalidArgumentError))


# -- the objects under test, in a state with something to lose ------------------------------


def make_ledger() -> helix_kv.Ledger:
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 4), 16)
    ledger.add_many(np.array([1, 2, 3, MAX_ID], np.uint64), [5, 9, 3, 4])
    assert ledger.grow(1, 12)
    assert ledger.grow(2, 9)
    assert ledger.grow(MAX_ID, 4)
    assert ledger.allocate_decode(1, 0) == 5
    ledger.suspend(3)
    return ledger


def make_config(**overrides: Any) -> helix_kv.SchedulerConfig:
    kwargs: dict[str, Any] = {
        "cp_size": 2, "tokens_per_block": 4, "kv_superblocks": 16, "num_speculative_tokens": 2,
    }  # fmt: skip
    kwargs.update(overrides)
    return helix_kv.SchedulerConfig(**kwargs)


def make_scheduler(pending: bool) -> helix_kv.Scheduler:
    scheduler = helix_kv.Scheduler(make_config())
    scheduler.add_request(1, [5, 6, 7], 6)
    scheduler.add_request(MAX_ID, np.array([1, 2], np.int32), 4, priority=-3)
    scheduler.add_request(3, [8], 1)  # finishes on the first update: take_output(3)
    out = scheduler.schedule()
    scheduler.update(np.full(out.num_samples, 9, np.int32))
    scheduler.add_request(2, [4] * 5, 3)
    if pending:
        scheduler.schedule()
    return scheduler


def pending_output() -> helix_kv.ScheduleOutput:
    """The output of the step a `make_scheduler(pending=True)` scheduler has pending (the
    scheduler is deterministic: a twin schedules the same step)."""
    twin = make_scheduler(False)
    return twin.schedule()


STEP_LAYOUT = make_scheduler(False).step_metadata_layout(4)
_BUFFER_WORDS = STEP_LAYOUT.total_words
_READ_ONLY = np.zeros(_BUFFER_WORDS, np.int32)
_READ_ONLY.setflags(write=False)
OUTPUT = _kind("schedule output", ["x", None, 3, object(), STEP_LAYOUT], [], InvalidTypeError)
BUFFER = Kind(
    "buffer",
    tuple(
        [(v, InvalidTypeError) for v in ([0] * _BUFFER_WORDS, None, "x", 3, object())]
        + [(np.zeros(_BUFFER_WORDS, t), InvalidTypeError) for t in (np.int64, np.float32, ">i4")]
        + [(np.zeros(_BUFFER_WORDS, np.uint32), InvalidTypeError)]
        + [(np.zeros((2, _BUFFER_WORDS), np.int32), InvalidArgumentError)]
        + [(np.zeros(2 * _BUFFER_WORDS, np.int32)[::2], InvalidArgumentError)]
        + [(np.zeros(_BUFFER_WORDS + 1, np.int32)[1:], InvalidArgumentError)]  # misaligned
        + [(_READ_ONLY, InvalidArgumentError)]
        + [(np.zeros(_BUFFER_WORDS - 1, np.int32), InvalidLengthError)]
    ),
)
_HELD_READ_ONLY = np.zeros(4, np.int64)
_HELD_READ_ONLY.setflags(write=False)
HELD = Kind(
    "held counts",
    tuple(
        [(v, InvalidTypeError) for v in ([0] * 4, None, "x", 3, object())]
        + [(np.zeros(4, t), InvalidTypeError) for t in (np.int32, np.float64, np.uint64)]
        + [(np.zeros((2, 4), np.int64), InvalidTypeError)]
        + [(np.zeros(8, np.int64)[::2], InvalidArgumentError)]
        + [(_HELD_READ_ONLY, InvalidArgumentError)]
        + [(np.zeros(1, np.int64), InvalidArgumentError)]  # request 1 past its end
        + [(np.full(4, -1, np.int64), InvalidArgumentError)]
    ),
)
STEP_LAYOUT_ARG = Kind(
    "step metadata layout",
    tuple(
        [(v, InvalidTypeError) for v in ("x", None, 3, (8, 8, 4), helix_kv.Layout(2, 4))]
        + [(helix_kv.StepMetadataLayout(1, 1, 4), InvalidLengthError)]  # smaller than the step
    ),
)


@dataclass(frozen=True)
class Call:
    """A valid call; `kinds[i]` says how argument `i` may be corrupted (None: left alone)."""

    owner: str  # "layout", "ledger", "idle", "pending" (schedulers), "config", "new"
    method: str
    args: tuple
    kinds: tuple
    paired: tuple = ()  # indices of arrays whose length must match another argument's


LAYOUT_CALLS = [
    Call("layout", "owner_rank", (9,), (LENGTH,)),
    Call("layout", "local_len", (21, 1), (LENGTH, RANK)),
    Call("layout", "superblocks_for", (21,), (LENGTH,)),
    Call("layout", "local_index", (9,), (LENGTH,)),
    Call("layout", "global_position", (1, 5), (RANK, LENGTH)),
    Call("layout", "owner_ranks", ([1, 9],), (LENGTHS,)),
    Call("layout", "local_lens", ([1, 21], 1), (LENGTHS, RANK)),
    Call("layout", "superblocks_for_many", ([1, 21],), (LENGTHS,)),
    Call("layout", "global_positions", (1, [0, 5]), (RANK, LENGTHS)),
    Call(
        "layout",
        "slot_mapping",
        ([[3, 0]], [0, 0], [0, 5], 1),
        (TABLE, IDS, LENGTHS, RANK),
        paired=(1, 2),
    ),
]
LEDGER_CALLS = [
    Call("ledger", "add", (10, 4), (ID, LENGTH)),
    Call("ledger", "grow", (1, 20), (ID, LENGTH)),
    Call("ledger", "shrink", (1, 7), (ID, LENGTH)),
    Call("ledger", "free", (2,), (ID,)),
    Call("ledger", "add_many", ([10, 11], [3, 4]), (IDS, LENGTHS), paired=(0, 1)),
    Call("ledger", "grow_many", ([1, 2], [14, 10]), (IDS, LENGTHS), paired=(0, 1)),
    Call("ledger", "free_many", ([2, 1],), (IDS,)),
    Call("ledger", "allocate_decode", (2, 5), (ID, STEP)),
    Call("ledger", "revert_decode", (1, 0), (ID, STEP)),
    Call("ledger", "extend_decode", (1, 0, 2), (ID, STEP, LENGTH)),
    Call("ledger", "retract_drafts", (1, 0, 0, 12), (ID, STEP, LENGTH, LENGTH)),
    Call("ledger", "reset_for_recompute", (2, 0), (ID, LENGTH)),
    Call("ledger", "suspend", (2,), (ID,)),
    Call("ledger", "resume", (3,), (ID,)),
    Call("ledger", "view", (1, 1), (ID, RANK)),
    Call("ledger", "request", (1,), (ID,)),
    Call("ledger", "table", (1,), (ID,)),
    Call("ledger", "block_table", ([1, 2], 4), (IDS, WIDTH)),
    Call(
        "ledger",
        "slot_mapping",
        ([1, 2], [0, 0], [3, 2], 0),
        (IDS, LENGTHS, LENGTHS, RANK),
        paired=(0, 1, 2),
    ),
]
SCHEDULER_CALLS = [
    Call("idle", "add_request", (50, [1, 2, 3], 4, 0), (ID, TOKENS, MAX_NEW, PRIORITY)),
    Call("pending", "update", ([3, 3, 3], [False, True, False]), (TOKENS, FLAGS), paired=(0, 1)),
    Call("pending", "update", ([3, 3, 3], [False] * 3, [0, 0]), (TOKENS, FLAGS, ACCEPTED)),
    Call("idle", "propose_drafts", ([1, 2], [2, 0], [5, 6]), (IDS, COUNTS, TOKENS), paired=(0, 1)),
    Call("idle", "take_output", (3,), (ID,)),
    Call("idle", "tokens", (1,), (ID,)),
    Call("idle", "request_state", (1,), (ID,)),
    Call("idle", "drafts_paused", ([1, 2],), (IDS,)),
    Call("idle", "block_table", ([1, 2], 4), (IDS, WIDTH)),
    Call("pending", "block_table_tails", ([1, MAX_ID], [0, 1]), (IDS, LENGTHS), paired=(0, 1)),
    Call("pending", "grow_block_tables", ([1], np.zeros(4, np.int64)), (IDS, HELD)),
    Call(
        "pending",
        "slot_mapping",
        ([1, MAX_ID], [0, 0], [3, 2]),
        (IDS, LENGTHS, LENGTHS),
        paired=(0, 1, 2),
    ),
    Call("idle", "request_metrics", (1,), (ID,)),
    Call("idle", "abort", (1,), (ID,)),
    Call("idle", "abort_many", ([1, 2],), (IDS,)),
    Call("pending", "is_abort_requested", (1,), (ID,)),
    Call("idle", "step_metadata_layout", (4,), (WIDTH,)),
    Call(
        "pending",
        "write_step_metadata",
        (pending_output(), np.zeros(_BUFFER_WORDS, np.int32), STEP_LAYOUT),
        (OUTPUT, BUFFER, STEP_LAYOUT_ARG),
    ),
]
# RequestOutput(request_id, token_ids, finish_reason, metrics): what unpickling calls.
FINISH_REASON = Kind(
    "finish_reason",
    tuple(
        [(v, InvalidTypeError) for v in (None, 1, 0, True, b"eos", ["eos"], 1.5, object())]
        + [(v, InvalidArgumentError) for v in ("EOS", "", "stop", "eos ", "Length")]
    ),
)
METRICS = _kind(
    "metrics",
    [None, {}, 0, "x", {"victim_choices": 0}, (0, 0, 0, 0), make_scheduler(False).metrics()],
    [],
    InvalidTypeError,
)
# StepMetadataLayout(max_tokens, max_entries, table_width): capacities, u32.
METADATA_CAPACITY = _kind(
    "metadata capacity", NOT_INTS, [-1, 2**32, 2**64, 2**100], InvalidLengthError
)

CONFIG_CALLS = [Call("config", "with_rank", (1,), (CONFIG_INT,))]
CONSTRUCTOR_CALLS = [
    Call("new", "Layout", (2, 4), (LAYOUT_SIZE, LAYOUT_SIZE)),
    Call("new", "Ledger", (helix_kv.Layout(2, 4), 8), (LAYOUT, CAPACITY)),
    Call("new", "Scheduler", (make_config(),), (CONFIG,)),
    Call(
        "new",
        "RequestOutput",
        (MAX_ID, [1, 2], "eos", helix_kv.RequestMetrics(victim_choices=1)),
        (ID, TOKENS, FINISH_REASON, METRICS),
    ),
    Call(
        "new",
        "StepMetadataLayout",
        (8, 4, 2),
        (METADATA_CAPACITY, METADATA_CAPACITY, METADATA_CAPACITY),
    ),
]
CALLS = LAYOUT_CALLS + LEDGER_CALLS + SCHEDULER_CALLS + CONFIG_CALLS + CONSTRUCTOR_CALLS

# Methods that take no argument (nothing to corrupt) or are covered by their own tests below.
NO_ARGUMENTS = {
    "Ledger": {"holdings", "state_digest"},
    "Scheduler": {
        "schedule",
        "revert",
        "metrics",
        "has_unfinished",
        "queue_ids",
        "queue_holdings",
        "state_digest",
        "pending_steps",
        "write_decode_rows",  # needs a decode-only step: tests/binding/test_step_metadata.py
        "reset_prefix_cache",  # refused while a step is pending: tests/binding/test_prefix_cache.py
        "spec_decode_accepted_per_position",
        "spec_decode_backoffs",
    },
    "SchedulerConfig": {"to_dict", "decision_fields"},
    "Layout": set(),
}

CONFIG_KEYWORDS = {
    "cp_size": CONFIG_INT,
    "cp_rank": CONFIG_INT,
    "tokens_per_block": CONFIG_INT,
    "kv_superblocks": CONFIG_INT,
    "max_batch_size": CONFIG_INT,
    "max_num_tokens": CONFIG_INT,
    "enable_chunked_prefill": FLAG,
    "chunk_unit": CONFIG_INT,
    "long_prefill_token_threshold": CONFIG_INT,
    "long_prefill_token_threshold_adaptive": FLAG,
    "max_seq_len": _kind("max_seq_len", NOT_INTS, [-1, 2**63, 2**64], ConfigError),
    "capacity_policy": NAME,
    "serving_mode": NAME,
    "host_tier_superblocks": CONFIG_INT,
    "suspend_policy": NAME,
    "suspend_cost_per_token": CONFIG_INT,
    "recompute_cost_per_token": CONFIG_INT,
    "admission_policy": NAME,
    "victim_policy": NAME,
    "max_preemptions_per_request": CONFIG_INT,
    "admit_after_preemption": FLAG,
    "deadlock_steps": CONFIG_INT,
    "enable_prefix_caching": FLAG,
    "num_speculative_tokens": CONFIG_INT,
    "draft_backoff_misses": CONFIG_INT,
    "draft_backoff_tokens": CONFIG_INT,
}

# The value records' keyword-only constructors (what unpickling calls): each field by the
# type the core gives it, with a valid value (its type's largest, for the integers).
U32 = _kind("u32 field", NOT_INTS, [-1, 2**32, 2**64, 2**100], InvalidArgumentError)
U64 = _kind("u64 field", NOT_INTS, [-1, -(2**63), 2**64, 2**100], InvalidArgumentError)
RECORD_FLAG = _kind(
    "flag field", [1, 0, "yes", None, 1.0, np.int64(1), object()], [], InvalidArgumentError
)
FRACTION = _kind(
    "fraction field",
    [
        None,
        True,
        False,
        np.bool_(True),
        "0.5",
        b"1",
        [0.5],
        0.5 + 0j,
        Decimal("0.5"),
        np.float32(0.5),
        object(),
        RaisingGetattr(),
    ],
    [float("nan"), float("inf"), -float("inf"), -0.25, 1.5, 1e300, -1, 2, 2**64],
    InvalidArgumentError,
)
VALID_FIELD = {"u32 field": 2**32 - 1, "u64 field": 2**64 - 1, "flag field": True}
VALID_FIELD["fraction field"] = 0.5
_COUNTS = dict.fromkeys(
    (
        "steps",
        "preemptions",
        "suspensions",
        "resumes",
        "suspended_superblocks",
        "resumed_superblocks",
        "suspended_tokens",
        "recomputed_tokens",
        "computed_tokens",
        "sat_out",
        "finished",
        "aborts",
    ),
    U64,
)
RECORD_FIELDS: dict[str, dict[str, Kind]] = {
    "SchedulerMetrics": _COUNTS
    | {"kv_used_superblocks": U32, "kv_capacity_superblocks": U32}
    | {"kv_utilization": FRACTION, "kv_utilization_peak": FRACTION}
    | dict.fromkeys(
        (
            "prefix_cache_queries",
            "prefix_cache_hits",
            "prefix_cache_recompute_queries",
            "prefix_cache_recompute_hits",
            "prefix_cache_same_step_hits",
            "prefix_cache_evictions",
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
            "spec_decode_num_trimmed_tokens",
            "spec_decode_draft_superblocks",
            "spec_decode_returned_superblocks",
        ),
        U64,
    ),
    "RequestMetrics": {"victim_choices": U32}
    | dict.fromkeys(("recomputed_tokens", "steps_waited", "generated_tokens"), U64),
    "DecodeView": {"global_len": U64, "next_position": U64, "owner_rank": U32}
    | {"inactive": RECORD_FLAG, "local_len": U64, "past_seen_len": U64},
    "RequestHoldings": dict.fromkeys(("request_id", "length", "prompt_len", "decode_count"), U64)
    | {"superblocks": U32, "suspended": RECORD_FLAG},
    "StepMetadata": dict.fromkeys(
        ("step", "num_tokens", "num_entries", "num_generation", "num_samples"), U64
    )
    | {"table_width_used": U64, "num_draft_tokens": U64},  # usize: 64-bit
    "DecodeRowCounts": dict.fromkeys(
        ("step", "rows", "padded_to", "in_flight", "table_width_used"), U64
    ),
}


def test_every_public_method_has_a_hostile_case() -> None:
    """A method added to the binding without a row here fails this test."""
    covered: dict[str, set[str]] = {"Layout": set(), "Ledger": set(), "Scheduler": set()}
    owner_class = {"layout": "Layout", "ledger": "Ledger", "idle": "Scheduler"}
    owner_class |= {"pending": "Scheduler", "config": "SchedulerConfig"}
    covered["SchedulerConfig"] = set()
    for call in CALLS:
        if call.owner != "new":
            covered[owner_class[call.owner]].add(call.method)
    for name, methods in covered.items():
        cls = getattr(helix_kv, name)
        public = {
            attr
            for attr, value in vars(cls).items()
            if not attr.startswith("_") and callable(value) and not isinstance(value, property)
        }
        public = {m for m in public if not inspect.isdatadescriptor(getattr(cls, m))}
        assert public - NO_ARGUMENTS[name] == methods, name
    config_keywords = set(inspect.signature(helix_kv.SchedulerConfig).parameters)
    assert config_keywords - {"kv_tokens"} == set(CONFIG_KEYWORDS)


def test_every_constructor_has_hostile_cases() -> None:
    """A class of the extension given a constructor (``#[new]``: it has a text signature)
    without rows here fails this test; so does a record field without a row."""
    constructors = {
        name
        for name, cls in vars(helix_kv._core).items()
        if isinstance(cls, type)
        and not issubclass(cls, BaseException)
        and getattr(cls, "__text_signature__", None)
    }
    positional = {call.method for call in CONSTRUCTOR_CALLS}
    assert constructors == positional | {"SchedulerConfig"} | set(RECORD_FIELDS)
    for record, kinds in RECORD_FIELDS.items():
        assert tuple(kinds) == getattr(helix_kv, record).FIELDS, record


# -- the property ---------------------------------------------------------------------------


def _target(owner: str) -> tuple[Any, Callable[[], Any]]:
    """The object to call and a fingerprint of everything a call could change."""
    if owner == "layout":
        layout = helix_kv.Layout(2, 4)
        return layout, lambda: (layout.cp_size, layout.tokens_per_block, hash(layout))
    if owner == "ledger":
        ledger = make_ledger()
        return ledger, ledger.state_digest
    if owner in ("idle", "pending"):
        scheduler = make_scheduler(owner == "pending")
        return scheduler, lambda: (scheduler.state_digest(), scheduler.step_pending)
    if owner == "config":
        config = make_config()
        return config, lambda: (hash(config), config.to_dict())
    return helix_kv, lambda: None


def _hostile_values(call: Call, index: int) -> tuple:
    values = call.kinds[index].hostile
    if index in call.paired:
        values += _mismatched(call.args[index])
    return values


CASES = [(call, i) for call in CALLS for i in range(len(call.args)) if call.kinds[i] is not None]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c.owner}.{c.method}")
def test_the_valid_form_of_every_call_succeeds(call: Call) -> None:
    """So each hostile case below fails because of its one corrupted argument."""
    target, _ = _target(call.owner)
    getattr(target, call.method)(*call.args)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0].owner}.{c[0].method}[{c[1]}]:{c[0].kinds[c[1]].name}"
)
def test_hostile_argument_raises_typed_error_and_changes_nothing(case) -> None:
    """Every hostile value of the argument's kind, each on a fresh object (exhaustive: the
    whole table runs in about a second)."""
    call, index = case
    for value, expected in _hostile_values(call, index):
        target, fingerprint = _target(call.owner)
        before = fingerprint()
        args = list(call.args)
        args[index] = value
        with pytest.raises(HelixKVError) as raised:
            getattr(target, call.method)(*args)
        assert isinstance(raised.value, expected), (call.method, index, value, raised.value)
        assert fingerprint() == before, (call.method, index, value)


@pytest.mark.parametrize("keyword", sorted(CONFIG_KEYWORDS))
def test_hostile_config_keyword_raises_typed_error(keyword) -> None:
    for value, expected in CONFIG_KEYWORDS[keyword].hostile:
        if value is None and keyword in ("kv_superblocks", "chunk_unit"):
            continue  # None is their documented default
        with pytest.raises(expected):
            make_config(**{keyword: value})


@pytest.mark.parametrize("record", sorted(RECORD_FIELDS))
def test_hostile_record_keyword_raises_typed_error(record: str) -> None:
    """Each keyword of a value record's constructor is checked like every argument: a bool
    is no integer, a value outside the field's type is an InvalidArgumentError naming the
    record and the field. Each field's largest value (and numpy scalars) round-trips."""
    cls = getattr(helix_kv, record)
    kinds = RECORD_FIELDS[record]
    valid = {field: VALID_FIELD[kind.name] for field, kind in kinds.items()}
    built = cls(**valid)
    assert built.to_dict() == valid
    assert pickle.loads(pickle.dumps(built)) == built
    scalars = {np.uint32: "u32 field", np.uint64: "u64 field", np.bool_: "flag field"}
    scalars[np.float64] = "fraction field"
    numpy_valid = {
        field: next(t for t, name in scalars.items() if name == kind.name)(valid[field])
        for field, kind in kinds.items()
    }
    assert cls(**numpy_valid) == built
    for field, kind in kinds.items():
        for value, expected in kind.hostile:
            with pytest.raises(HelixKVError) as raised:
                cls(**{**valid, field: value})
            assert isinstance(raised.value, expected), (record, field, value, raised.value)
            assert f"{record}.{field}" in str(raised.value), raised.value


# -- valid values in every numpy layout -----------------------------------------------------

# The dtypes each kind of array argument is given in (each kind's values fit them).
ARRAY_DTYPES = {
    "ids": (np.int64, np.uint64, np.int32),
    "lengths": (np.int64, np.uint64, np.int32),
    "tokens": (np.int32, np.int64, np.int16),
    "flags": (np.bool_, np.int64, np.uint8),
    "table": (np.int64, np.int32),
}


def _layouts(values: Any, dtype: Any) -> dict[str, np.ndarray]:
    """`values` as arrays of `dtype` in every layout numpy makes: misaligned (bytes of a
    wider dtype), strided, byte-swapped, both at once, and Fortran order (two dimensions)."""
    plain = np.asarray(values, dtype=dtype)
    layouts = {"strided": np.repeat(plain, 2, axis=-1)[..., ::2]}
    if plain.dtype.itemsize > 1:
        swapped = plain.dtype.newbyteorder()
        layouts["misaligned"] = misaligned(plain, dtype)
        layouts["byte-swapped"] = plain.astype(swapped)
        layouts["misaligned byte-swapped"] = misaligned(plain, swapped)
    if plain.ndim == 2:
        layouts["fortran"] = np.asfortranarray(np.repeat(plain, 2, axis=0))[::2]
    return layouts


def _fits(values: Any, dtype: Any) -> bool:
    flat = np.asarray(values, dtype=object).ravel().tolist()
    if np.dtype(dtype) == np.bool_:
        return all(isinstance(v, bool) for v in flat)
    info = np.iinfo(dtype)
    return all(info.min <= int(v) <= info.max for v in flat)


def _comparable(result: Any) -> Any:
    if isinstance(result, np.ndarray):
        return (result.dtype.str, result.shape, result.tolist())
    if isinstance(result, tuple):
        return tuple(_comparable(r) for r in result)
    return result


LAYOUT_CASES = [
    (call, i)
    for call in CALLS
    for i in range(len(call.args))
    if call.kinds[i] is not None and call.kinds[i].name in ARRAY_DTYPES
]


@pytest.mark.parametrize(
    "case",
    LAYOUT_CASES,
    ids=lambda c: f"{c[0].owner}.{c[0].method}[{c[1]}]:{c[0].kinds[c[1]].name}",
)
def test_array_arguments_in_any_numpy_layout_give_what_their_values_give(case) -> None:
    """A misaligned (``np.frombuffer(buf, np.int64, offset=1)``), strided, byte-swapped or
    Fortran-order array is read through a contiguous copy: the call returns and changes what
    it does with the plain values (a misaligned array once raised a bare TypeError)."""
    call, index = case
    reference, fingerprint = _target(call.owner)
    expected = _comparable(getattr(reference, call.method)(*call.args))
    after = fingerprint()
    tried = 0
    for dtype in ARRAY_DTYPES[call.kinds[index].name]:
        if not _fits(call.args[index], dtype):
            continue  # a request id past int64, say
        for layout, value in _layouts(call.args[index], dtype).items():
            target, fingerprint = _target(call.owner)
            args = list(call.args)
            args[index] = value
            result = getattr(target, call.method)(*args)
            assert _comparable(result) == expected, (call.method, index, dtype, layout)
            assert fingerprint() == after, (call.method, index, dtype, layout)
            tried += 1
    assert tried >= 4


@settings(max_examples=examples(150), deadline=None)
@given(
    ops=st.lists(
        st.sampled_from([c for c in LEDGER_CALLS if c.method != "add"]), min_size=1, max_size=6
    ),
    data=st.data(),
)
def test_valid_calls_between_hostile_ones_keep_the_state_consistent(ops, data) -> None:
    """Hostile calls interleaved with valid ones: each hostile call is a no-op, and the
    ledger still answers every table query afterwards (no half-applied change)."""
    ledger = make_ledger()
    twin = make_ledger()
    for call in ops:
        index = data.draw(st.integers(0, len(call.args) - 1))
        value, _ = data.draw(st.sampled_from(_hostile_values(call, index)))
        args = list(call.args)
        args[index] = value
        with pytest.raises(HelixKVError):
            getattr(ledger, call.method)(*args)
        for target in (ledger, twin):  # the same valid call on both
            with contextlib.suppress(HelixKVError):
                getattr(target, call.method)(*call.args)
        assert ledger.state_digest() == twin.state_digest()
    ids, _ = ledger.holdings()
    for request_id in ids.tolist():
        state = ledger.request(request_id)
        if not state.suspended:
            slots = ledger.slot_mapping([request_id], [0], [state.length], 0)
            assert slots.size == state.length


# -- what is accepted, and the regressions of issue 9 --------------------------------------


def test_contains_answers_false_for_ints_outside_the_id_range_and_refuses_other_types() -> None:
    ledger = make_ledger()
    assert MAX_ID in ledger
    assert np.uint64(MAX_ID) in ledger
    assert -1 not in ledger
    assert 2**64 not in ledger
    for value in (1.0, "1", None, True):
        with pytest.raises(InvalidTypeError):
            value in ledger  # noqa: B015  (the comparison is the call under test)


def test_the_full_u64_id_range_round_trips() -> None:
    scheduler = helix_kv.Scheduler(make_config())
    scheduler.add_request(MAX_ID, [1, 2], 2)
    scheduler.add_request(np.uint64(2**63), [3], 2)
    scheduler.add_request(np.int64(7), [3], 2)
    queue = scheduler.queue_ids()
    assert queue.dtype == np.uint64
    assert queue.tolist() == [MAX_ID, 2**63, 7]
    out = scheduler.schedule()
    assert out.sample_ids.tolist() == [MAX_ID, 2**63, 7]
    table = scheduler.block_table(np.array([MAX_ID, 2**63], np.uint64))
    assert table.shape[0] == 2
    finished = scheduler.update(np.array([5, 5, 5], np.int16), eos=np.array([1, 0, 1], np.uint8))
    assert finished.dtype == np.uint64
    assert finished.tolist() == [MAX_ID, 7]
    assert scheduler.take_output(MAX_ID).token_ids.tolist() == [5]


def test_accepted_forms_of_integer_arguments() -> None:
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 4), 16)
    ledger.add_many(np.array([1, 2], np.int8), (3, 4))
    ledger.add(np.uint64(3), np.int32(5))
    assert ledger.grow_many(range(1, 4), np.array([3, 4, 5], np.uint16)).tolist() == [True] * 3
    reversed_ids = np.array([3, 2, 1], np.int64)[::-1]  # not contiguous
    assert ledger.block_table(reversed_ids).shape == (3, 1)
    assert ledger.block_table([], width=None).shape == (0, 0)
    ledger.free_many(np.array([]))  # empty: float64, but holds no value to coerce
    assert ledger.block_table(np.array([], np.float64)).shape == (0, 0)
    assert helix_kv.Layout(2, 4).global_positions(1, np.array([5], ">i8")).tolist() == [13]


def test_issue_9_revert_decode_after_shrink_keeps_slot_mapping_consistent() -> None:
    led = helix_kv.Ledger(helix_kv.Layout(2, 4), 8)
    led.add(4, 12)
    assert led.grow(4, 60)
    assert led.allocate_decode(4, 11) == 12
    led.shrink(4, 21)
    assert led.revert_decode(4, 11)
    assert (led.request(4).length, led.request(4).superblocks) == (21, 3)
    with pytest.raises(InvalidLengthError, match="not all reserved"):
        led.slot_mapping([4], [0], [60], 0)
    assert led.slot_mapping([4], [0], [21], 0).size == 21


def test_issue_9_coercions_are_refused() -> None:
    scheduler = helix_kv.Scheduler(make_config())
    before = scheduler.state_digest()
    for prompt in ([3.7, -1.9, 2.5], ["7", "12"], np.array([1.9, -2.9])):
        with pytest.raises(InvalidTypeError):
            scheduler.add_request(1, prompt, 2)
    with pytest.raises(TypeError):  # InvalidTypeError is also a TypeError
        scheduler.add_request(1.0, [1], 2)
    scheduler.add_request(1, [1, 2], 3)
    scheduler.schedule()
    digest = scheduler.state_digest()
    with pytest.raises(InvalidTypeError):
        scheduler.update(np.array([1.9]))
    with pytest.raises(InvalidTypeError):
        scheduler.update([1], eos=["yes"])
    assert scheduler.state_digest() == digest
    scheduler.revert()
    assert scheduler.state_digest() != before  # the request is still queued
    with pytest.raises(InvalidLengthError):
        helix_kv.Layout(2, 4).global_positions(1, [2**62])
    with pytest.raises(InvalidLengthError, match="empty prompt"):
        helix_kv.Ledger(helix_kv.Layout(2, 4), 8).add(1, 0)


def _overcommit_always() -> bool:
    path = Path("/proc/sys/vm/overcommit_memory")
    return path.exists() and path.read_text().strip() == "1"


@pytest.mark.skipif(
    _overcommit_always(), reason="with overcommit_memory=1 a 4 TiB reservation succeeds"
)
def test_issue_9_block_table_widths_that_cannot_be_allocated_are_errors() -> None:
    scheduler = make_scheduler(pending=False)
    digest = scheduler.state_digest()
    for width in (2**63, 2**62, 2**40):
        with pytest.raises(InvalidLengthError):
            scheduler.block_table([1], width)
    assert scheduler.state_digest() == digest
