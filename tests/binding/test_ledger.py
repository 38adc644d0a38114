"""The superblock ledger through the binding: invariants, determinism, errors, arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import helix_kv
from tests.helpers import examples

IDS = st.integers(0, 5)
LENS = st.integers(0, 120)
OPS = st.one_of(
    st.tuples(st.just("add"), IDS, LENS),
    st.tuples(st.just("grow"), IDS, LENS),
    st.tuples(st.just("shrink"), IDS, LENS),
    st.tuples(st.just("free"), IDS),
    st.tuples(st.just("allocate_decode"), IDS, st.integers(0, 2)),
    st.tuples(st.just("revert_decode"), IDS, st.integers(0, 2)),
    st.tuples(st.just("reset_for_recompute"), IDS, st.integers(0, 2)),
    st.tuples(st.just("suspend"), IDS),
    st.tuples(st.just("resume"), IDS),
    st.tuples(
        st.just("grow_many"), st.lists(IDS, max_size=4), st.lists(LENS, min_size=4, max_size=4)
    ),
    st.tuples(st.just("free_many"), st.lists(IDS, max_size=3)),
    st.tuples(
        st.just("add_many"), st.lists(IDS, max_size=3), st.lists(LENS, min_size=3, max_size=3)
    ),
)


def apply(ledger: helix_kv.Ledger, op: tuple) -> str:
    name, *args = op
    if name in ("grow_many", "add_many"):
        ids, lens = args
        args = [np.array(ids, dtype=np.int64), np.array(lens[: len(ids)], dtype=np.int64)]
    try:
        result = getattr(ledger, name)(*args)
    except helix_kv.HelixKVError as err:
        return f"{type(err).__name__}: {err}"
    if isinstance(result, np.ndarray):
        result = result.tolist()
    if name in ("grow", "allocate_decode", "resume") and (result is False or result is None):
        return "refused"
    return f"ok {result}"


def snapshot(ledger: helix_kv.Ledger) -> tuple:
    ids, counts = ledger.holdings()
    tables = {int(i): ledger.table(int(i)).tolist() for i in ids}
    return ledger.state_digest(), ledger.free_superblocks, tables, counts.tolist()


def check_invariants(ledger: helix_kv.Ledger) -> None:
    ids, counts = ledger.holdings()
    assert ids.dtype == np.uint64
    assert counts.dtype == np.int32
    pages = [p for i in ids for p in ledger.table(int(i)).tolist()]
    assert len(pages) == len(set(pages)), "a page is held twice"
    assert all(0 <= p < ledger.capacity for p in pages)
    assert ledger.used_superblocks == len(pages) == int(counts.sum())
    assert ledger.free_superblocks + ledger.used_superblocks == ledger.capacity
    layout = ledger.layout
    for i in ids:
        state = ledger.request(int(i))
        expected = 0 if state.suspended else layout.superblocks_for(state.length)
        assert state.superblocks == expected


@settings(max_examples=examples(150), deadline=None)
@given(
    cp=st.integers(1, 4),
    tpb=st.integers(1, 8),
    capacity=st.integers(1, 12),
    ops=st.lists(OPS, min_size=1, max_size=60),
)
def test_two_ledgers_fed_the_same_calls_stay_identical(cp, tpb, capacity, ops) -> None:
    layout = helix_kv.Layout(cp, tpb)
    a, b = helix_kv.Ledger(layout, capacity), helix_kv.Ledger(layout, capacity)
    for op in ops:
        before = snapshot(a)
        out_a, out_b = apply(a, op), apply(b, op)
        assert out_a == out_b
        assert snapshot(a) == snapshot(b)
        if not out_a.startswith("ok"):
            assert snapshot(a) == before, f"failed call {op} changed the ledger"
        check_invariants(a)


def test_grow_that_cannot_be_satisfied_allocates_nothing() -> None:
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 4), 4)  # 32 global tokens
    ledger.add(1, 1)
    ledger.add(2, 1)
    assert ledger.grow(1, 20)  # 3 superblocks
    assert not ledger.grow(2, 9)  # needs 2, only 1 free
    assert ledger.request(2).length == 0
    assert ledger.free_superblocks == 1
    assert ledger.grow(2, 8)


def test_misuse_raises_typed_errors_and_leaves_ledger_unchanged() -> None:
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 4), 4)
    ledger.add(1, 5)
    assert ledger.grow(1, 5)
    before = snapshot(ledger)
    cases = [
        (helix_kv.DuplicateRequestError, "already in use", lambda: ledger.add(1, 3)),
        (helix_kv.UnknownRequestError, "already freed", lambda: ledger.free(9)),
        (helix_kv.InvalidLengthError, "non-negative", lambda: ledger.grow(1, -1)),
        (helix_kv.InvalidLengthError, "exceed the whole pool", lambda: ledger.grow(1, 33)),
        (helix_kv.InvalidLengthError, "use shrink", lambda: ledger.grow(1, 2)),
        (helix_kv.InvalidLengthError, "use grow", lambda: ledger.shrink(1, 6)),
        (helix_kv.InvalidArgumentError, "non-negative", lambda: ledger.free(-1)),
        (helix_kv.InvalidArgumentError, "appears twice", lambda: ledger.grow_many([1, 1], [6, 7])),
        (
            helix_kv.InvalidArgumentError,
            "2 ids but 1 lengths",
            lambda: ledger.grow_many([1, 2], [6]),
        ),
        (helix_kv.UnknownRequestError, "request 5", lambda: ledger.free_many([1, 5])),
        (helix_kv.InvalidArgumentError, "wider than", lambda: ledger.block_table([1], width=0)),
        (
            helix_kv.InvalidLengthError,
            "not all reserved",
            lambda: ledger.slot_mapping([1], [0], [6], 0),
        ),
        (helix_kv.InvalidArgumentError, "outside the CP group", lambda: ledger.view(1, 2)),
        (helix_kv.InvalidStateError, "not suspended", lambda: ledger.resume(1)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
        assert snapshot(ledger) == before
    ledger.free(1)
    with pytest.raises(helix_kv.UnknownRequestError):
        ledger.free(1)  # double free


def test_block_table_and_slot_mapping_arrays() -> None:
    layout = helix_kv.Layout(2, 4)
    ledger = helix_kv.Ledger(layout, 8)
    ledger.add(10, 1)
    ledger.add(11, 1)
    ok = ledger.grow_many(np.array([10, 11]), np.array([20, 5]))
    assert ok.dtype == np.bool_
    assert ok.tolist() == [True, True]
    table = ledger.block_table(np.array([10, 11]))
    assert table.dtype == np.int32
    assert table.shape == (2, 3)
    assert table.tolist() == [[0, 1, 2], [3, -1, -1]]
    assert ledger.block_table([11], width=5).tolist() == [[3, -1, -1, -1, -1]]
    # Request 10 writes positions 16..19 (superblock 2, owner rank 0), request 11 position 4
    # (superblock 0 of its table = page 3, owner rank 1).
    ids, starts, counts = [10, 11], [16, 4], [4, 1]
    on_rank0 = ledger.slot_mapping(ids, starts, counts, 0)
    on_rank1 = ledger.slot_mapping(ids, starts, counts, 1)
    assert on_rank0.dtype == np.int64
    assert on_rank0.tolist() == [8, 9, 10, 11, -1]
    assert on_rank1.tolist() == [-1, -1, -1, -1, 12]
    # Every new token has exactly one owner slot across the ranks.
    assert ((on_rank0 >= 0).astype(int) + (on_rank1 >= 0).astype(int)).tolist() == [1] * 5


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_decode_view_marks_exactly_one_active_rank(cp: int) -> None:
    tpb = 4
    layout = helix_kv.Layout(cp, tpb)
    ledger = helix_kv.Ledger(layout, 64)
    ledger.add(1, 13)
    assert ledger.grow(1, 13)
    for step in range(40):
        pos = ledger.allocate_decode(1, step)
        assert pos == 13 + step
        assert ledger.allocate_decode(1, step) == pos, "a retry derives the same position"
        views = [ledger.view(1, r) for r in range(cp)]
        # view() looks at the *next* position; the token just reserved is pos.
        assert sum(v.local_len for v in views) == pos + 1
        assert all(v.next_position == pos + 1 for v in views)
        owners = [r for r, v in enumerate(views) if not v.inactive]
        assert owners == [layout.owner_rank(pos + 1)] == [((pos + 1) // tpb) % cp]
        assert sum(v.past_seen_len for v in views) == pos + 1


def test_reset_for_recompute_folds_generated_tokens_and_frees_pages() -> None:
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 2), 8)
    ledger.add(3, 5)
    assert ledger.grow(3, 5)
    for step in range(3):
        ledger.allocate_decode(3, step)
    ledger.reset_for_recompute(3, 4)  # first token from prefill + 3 decoded
    state = ledger.request(3)
    assert (state.prompt_len, state.decode_count, state.length, state.superblocks) == (9, 0, 0, 0)
    assert ledger.free_superblocks == 8
    view = ledger.view(3, 0)
    assert view.next_position == 9
    with pytest.raises(helix_kv.InvalidStateError, match="prefill must be allocated"):
        ledger.allocate_decode(3, 7)


def test_batch_calls_reuse_no_argument_between_calls() -> None:
    """grow_many/free_many keep their converted arguments between calls: batches of
    changing sizes and array kinds (int64, uint64, lists, a batch past what is kept), and
    refused ones in between, answer and leave the state as a twin fed lists does."""
    layout = helix_kv.Layout(2, 4)
    big = (1 << 16) + 3
    ledger, twin = helix_kv.Ledger(layout, big + 64), helix_kv.Ledger(layout, big + 64)
    kinds = [
        lambda v: np.array(v, dtype=np.int64),
        lambda v: np.array(v, dtype=np.uint64),
        lambda v: np.array(v, dtype=np.int64)[::-1][::-1].copy(),
        list,
    ]
    batches = [list(range(5)), [3], [], list(range(2, 9)), list(range(big)), [1, 4]]
    for round_, ids in enumerate(batches):
        as_kind = kinds[round_ % len(kinds)]
        lens = [8 * (1 + (i + round_) % 3) for i in ids]
        for led in (ledger, twin):
            led.add_many(ids, [1] * len(ids))
        ok = ledger.grow_many(as_kind(ids), as_kind(lens))
        assert ok.tolist() == twin.grow_many(ids, lens).tolist()
        assert len(ok) == len(ids)
        # A refused batch (a repeated id, a length past the pool) changes nothing.
        before = snapshot(ledger)
        if ids:
            with pytest.raises(helix_kv.InvalidArgumentError, match="appears twice"):
                ledger.grow_many(as_kind([*ids, ids[0]]), as_kind([*lens, 8]))
            with pytest.raises(helix_kv.InvalidLengthError):
                ledger.grow_many(as_kind(ids), as_kind([*lens[:-1], 1 << 62]))
        with pytest.raises(helix_kv.UnknownRequestError):
            ledger.free_many(as_kind([*ids, big + 7]))
        assert snapshot(ledger) == before
        assert snapshot(ledger) == snapshot(twin)
        ledger.free_many(as_kind(ids))
        twin.free_many(ids)
        assert snapshot(ledger) == snapshot(twin)
    assert len(ledger) == 0
    assert ledger.free_superblocks == ledger.capacity


def test_drafts_extend_a_decode_and_rejected_ones_go_back() -> None:
    """Speculative positions through the binding: drafts after the step's decode token, taken
    from free superblocks only; the rejected ones (and the superblocks only they reached)
    given back; a refused extension changes nothing."""
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 2), 5)  # superblocks of 4 tokens
    ledger.add(1, 3)
    assert ledger.grow(1, 3)
    assert ledger.allocate_decode(1, 5) == 3
    ledger.add(2, 8)
    assert ledger.grow(2, 8)  # two superblocks: two are free
    before = ledger.state_digest()
    assert ledger.extend_decode(1, 5, 9) is None  # 13 tokens: three more superblocks
    assert ledger.state_digest() == before
    with pytest.raises(helix_kv.InvalidLengthError):
        ledger.extend_decode(1, 5, 17)  # past the whole pool
    assert ledger.extend_decode(1, 5, 5) == 4
    assert ledger.free_superblocks == 0
    ledger.retract_drafts(1, 5, 3, 6)  # two of five accepted
    assert ledger.free_superblocks == 1
    assert ledger.allocate_decode(1, 6) == 6
    with pytest.raises(helix_kv.InvalidStateError):
        ledger.extend_decode(1, 5, 1)  # not the step of its decode token
