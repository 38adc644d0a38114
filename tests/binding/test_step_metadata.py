"""Packed step metadata (``Scheduler.write_step_metadata``) against the calls it replaces.

Every section of the buffer is compared, step after step, with what ``block_table``,
``slot_mapping``, the ``ScheduleOutput`` fields and ``Layout.local_lens`` give, on random runs
under KV pressure at cp = 1, 2 and 4 (one scheduler per rank, every rank checked). Hostile
buffers and stale outputs are refused with the buffer and the scheduler unchanged.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import helix_kv
from tests.helpers.scheduler import config, needs_scheduler, prompt, snapshot

pytestmark = needs_scheduler

SENTINEL = -7777


def expected_sections(
    s: helix_kv.Scheduler, out: helix_kv.ScheduleOutput, layout: helix_kv.StepMetadataLayout
) -> dict[str, np.ndarray]:
    """Each section's written front, from the calls the packed buffer replaces."""
    cfg = s.config
    rank = cfg.cp_rank
    gen_ids = np.asarray(out.generation_ids, dtype=np.uint64)
    ctx_ids = np.asarray(out.context_ids, dtype=np.uint64)
    g = gen_ids.size
    ctx_starts = np.asarray(out.context_starts, dtype=np.int64)
    ctx_lens = np.asarray(out.context_lens, dtype=np.int64)
    ids = np.concatenate([gen_ids, ctx_ids])
    starts = np.concatenate([np.asarray(out.generation_positions, dtype=np.int64), ctx_starts])
    counts = np.concatenate([np.ones(g, dtype=np.int64), ctx_lens])
    n = int(counts.sum())
    within = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.repeat(starts, counts) + within
    if ids.size:
        table = s.block_table(ids, layout.table_width)
        slots = s.slot_mapping(ids, starts, counts)
    else:
        table = np.zeros((0, layout.table_width), dtype=np.int32)
        slots = np.zeros(0, dtype=np.int64)
    local = cfg.layout.local_lens(ctx_starts + ctx_lens, rank)
    past = cfg.layout.local_lens(ctx_starts, rank)
    completes = np.asarray(out.context_completes, dtype=bool)
    samples = np.concatenate([np.arange(g), (g + np.cumsum(ctx_lens) - 1)[completes]])
    e = ids.size
    width_used = max((len(s.block_table([i])[0]) for i in ids.tolist()), default=0)
    step = np.array([out.step], dtype=np.int64).view(np.int32)
    return {
        "header": np.array([*step, n, e, g, samples.size, width_used, 0]),
        "token_ids": np.concatenate([out.generation_input_tokens, out.context_token_ids]),
        "positions": positions,
        "slot_mapping": slots,
        "query_start": np.concatenate([[0], np.cumsum(counts)]),
        "local_lens": np.concatenate([out.generation_local_lens, local]),
        "past_seen_lens": np.concatenate([out.generation_past_seen_lens, past]),
        "batch_slots": np.concatenate([out.generation_batch_slots, out.context_batch_slots]),
        "sample_rows": samples,
        "block_table": table.ravel(),
    }


def check_step(
    s: helix_kv.Scheduler, out: helix_kv.ScheduleOutput, layout: helix_kv.StepMetadataLayout
) -> helix_kv.StepMetadata:
    """Writes the step into a sentinel-filled buffer and compares every section: its front
    with the reference, the rest untouched."""
    buffer = np.full(layout.total_words, SENTINEL, dtype=np.int32)
    meta = s.write_step_metadata(out, buffer, layout)
    views = helix_kv.step_metadata_views(buffer, layout)
    expected = expected_sections(s, out, layout)
    assert meta.num_tokens == expected["positions"].size == out.num_tokens
    assert meta.num_entries == out.generation_ids.size + out.context_ids.size
    assert meta.num_generation == out.generation_ids.size
    assert meta.num_samples == out.sample_ids.size
    written = 0
    for name, _offset, length, dtype in layout.sections:
        view = getattr(views, name).ravel()
        assert view.size == length
        want = expected[name]
        np.testing.assert_array_equal(view[: want.size], want.astype(dtype), err_msg=name)
        rest = view[want.size :].view(np.int32)
        assert (rest == SENTINEL).all(), f"{name}: written past its {want.size} elements"
        written += want.size * (2 if dtype == "int64" else 1)
    # Nothing outside the sections (alignment padding) is written either.
    assert int((buffer != SENTINEL).sum()) <= written
    return meta


def random_run(cp: int, seed: int, steps: int, read_fields: bool) -> int:
    """A random workload under KV pressure, one scheduler per rank, every step checked on
    every rank. Returns the steps that preempted or suspended (so pressure is real)."""
    rng = np.random.default_rng(seed)
    tpb = int(rng.choice([2, 4, 3]))
    superblocks = int(rng.integers(6, 14))
    cfg = config(
        cp,
        tpb,
        superblocks=superblocks,
        max_batch_size=8,
        max_num_tokens=int(rng.integers(16, 48)),
        max_seq_len=120,
        chunk_unit=tpb,
    )
    ranks = [helix_kv.Scheduler(cfg.with_rank(r)) for r in range(cp)]
    layouts = [s.step_metadata_layout() for s in ranks]
    assert layouts[0].table_width == min(-(-120 // (cp * tpb)), superblocks)
    longest = min(120, superblocks * cp * tpb)
    next_id, pressured = 0, 0
    for _ in range(steps):
        for _ in range(int(rng.integers(0, 3))):
            length = int(rng.integers(1, longest // 2 + 1))
            max_new = int(rng.integers(1, longest - length + 1))
            for s in ranks:
                s.add_request(next_id, prompt(length, next_id), max_new)
            next_id += 1
        outs = [s.schedule() for s in ranks]
        if outs[0].preempted_ids.size or outs[0].suspended_ids.size:
            pressured += 1
        if read_fields:  # fields Python read are lent from its numpy arrays instead
            for out in outs:
                for name in helix_kv.ScheduleOutput.FIELDS:
                    getattr(out, name)
        metas = [check_step(s, out, lay) for s, out, lay in zip(ranks, outs, layouts)]
        assert len({(m.num_tokens, m.num_entries, m.num_samples) for m in metas}) == 1
        tokens = np.asarray(rng.integers(0, 1000, outs[0].sample_ids.size), dtype=np.int32)
        eos = rng.random(outs[0].sample_ids.size) < 0.05
        for s in ranks:
            for finished in s.update(tokens, eos).tolist():
                s.take_output(finished)
    return pressured


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_packed_buffer_equals_the_separate_calls(cp: int, seed: int) -> None:
    pressured = random_run(cp, seed, steps=60, read_fields=seed % 2 == 1)
    assert pressured > 0, "the run never came under KV pressure"


def test_layout_is_fixed_by_capacities_and_picklable() -> None:
    layout = helix_kv.StepMetadataLayout(10, 3, 5)
    names = [name for name, *_ in layout.sections]
    assert names == [
        "header",
        "token_ids",
        "positions",
        "slot_mapping",
        "query_start",
        "local_lens",
        "past_seen_lens",
        "batch_slots",
        "sample_rows",
        "block_table",
    ]
    end = 0
    for _name, offset, length, dtype in layout.sections:
        assert offset >= end
        if dtype == "int64":
            assert offset % 2 == 0
        end = offset + length * (2 if dtype == "int64" else 1)
    assert layout.total_words == end
    assert pickle.loads(pickle.dumps(layout)) == layout
    for huge in [(2**32 - 1, 2**32 - 1, 2**32 - 1), (2**31, 1, 1), (1, 2**16, 2**16)]:
        with pytest.raises(helix_kv.InvalidLengthError):
            helix_kv.StepMetadataLayout(*huge)
    for hostile in [(-1, 1, 1), (1, 2**32, 1)]:
        with pytest.raises(helix_kv.InvalidLengthError):
            helix_kv.StepMetadataLayout(*hostile)
    with pytest.raises(helix_kv.InvalidTypeError):
        helix_kv.StepMetadataLayout(1.0, 1, 1)  # type: ignore[arg-type]
    meta = helix_kv.StepMetadata(
        step=1, num_tokens=2, num_entries=1, num_generation=1, num_samples=1, table_width_used=1,
        num_draft_tokens=0,
    )  # fmt: skip
    assert pickle.loads(pickle.dumps(meta)) == meta


def pending(cp: int = 2) -> tuple[helix_kv.Scheduler, helix_kv.ScheduleOutput]:
    s = helix_kv.Scheduler(config(cp, 4, superblocks=16, max_batch_size=4, max_num_tokens=64))
    for i in range(3):
        s.add_request(i, prompt(9, i), 5)
    return s, s.schedule()


def refused(
    s: helix_kv.Scheduler,
    out: object,
    buffer: object,
    layout: object,
    error: type[Exception],
) -> None:
    before = snapshot(s)
    copy = np.array(buffer, copy=True) if isinstance(buffer, np.ndarray) else None
    with pytest.raises(error):
        s.write_step_metadata(out, buffer, layout)  # type: ignore[arg-type]
    assert snapshot(s) == before
    if copy is not None:
        np.testing.assert_array_equal(buffer, copy)


def test_hostile_buffers_are_refused_and_nothing_changes() -> None:
    s, out = pending()
    layout = s.step_metadata_layout()
    words = layout.total_words
    good = np.full(words + 2, SENTINEL, dtype=np.int32)
    read_only = good.copy()
    read_only.setflags(write=False)
    cases: list[tuple[object, type[Exception]]] = [
        (good.tolist(), helix_kv.InvalidTypeError),
        (good.astype(np.float32), helix_kv.InvalidTypeError),
        (good.astype(np.int64), helix_kv.InvalidTypeError),
        (good.astype(np.uint32), helix_kv.InvalidTypeError),
        (good.astype(">i4"), helix_kv.InvalidTypeError),
        (good[: words - 1], helix_kv.InvalidLengthError),
        (good[1:], helix_kv.InvalidArgumentError),  # 4-byte aligned only
        (np.full((2, words), SENTINEL, dtype=np.int32), helix_kv.InvalidArgumentError),
        (np.full(2 * words, SENTINEL, dtype=np.int32)[::2], helix_kv.InvalidArgumentError),
        (read_only, helix_kv.InvalidArgumentError),
    ]
    for buffer, error in cases:
        refused(s, out, buffer, layout, error)
    refused(s, out, good, "layout", helix_kv.InvalidTypeError)
    refused(s, "out", good, layout, helix_kv.InvalidTypeError)
    # Capacities smaller than the step: too few tokens, too few entries, narrow rows.
    for small in [
        helix_kv.StepMetadataLayout(out.num_tokens - 1, 4, layout.table_width),
        helix_kv.StepMetadataLayout(64, 2, layout.table_width),
        helix_kv.StepMetadataLayout(64, 4, 1),
    ]:
        refused(
            s,
            out,
            np.full(small.total_words, SENTINEL, dtype=np.int32),
            small,
            helix_kv.InvalidLengthError,
        )
    # The buffer is still usable after every refusal.
    check_step(s, out, layout)


def test_only_the_pending_steps_output_is_accepted() -> None:
    s, out = pending()
    layout = s.step_metadata_layout()
    buffer = np.full(layout.total_words, SENTINEL, dtype=np.int32)
    s.update(np.full(out.num_samples, 7, dtype=np.int32))
    refused(s, out, buffer, layout, helix_kv.InvalidStateError)  # closed
    new = s.schedule()
    refused(s, out, buffer, layout, helix_kv.InvalidStateError)  # an older step
    check_step(s, new, layout)
    s.revert()
    refused(s, new, buffer, layout, helix_kv.InvalidStateError)


FORGED = "changed after it was scheduled"


def test_forged_output_is_refused() -> None:
    """An output rebuilt with the pending step's number and digest but other contents
    (tokens it does not reserve, requests it does not hold) is refused when it is rebuilt:
    its digest is recomputed from its fields. (The checks ``write_step_metadata`` makes
    against the ledger behind the digest are the core's: rust/core/tests/step_metadata.rs.)"""
    s, out = pending()
    layout = s.step_metadata_layout()
    fields = out.__reduce__()[1][0]  # the stored fields, the placement and the fingerprint
    starts = fields["context_starts"] + 1000
    ids = fields["context_ids"].copy()
    ids[-1] = 999
    for changed in ({"context_starts": starts}, {"context_ids": ids}):
        with pytest.raises(helix_kv.InvalidArgumentError, match=FORGED):
            helix_kv.ScheduleOutput._from_fields({**fields, **changed})
    check_step(s, out, layout)


def test_a_long_step_is_written_alike() -> None:
    """A step past the size the call keeps the GIL for (its fields are copied out and the
    GIL let go) writes the same sections."""
    cfg = config(2, 16, superblocks=1200, max_batch_size=4, max_num_tokens=40_000)
    s = helix_kv.Scheduler(cfg.with_rank(1))
    s.add_request(0, prompt(18_000, 0), 4)
    s.add_request(1, prompt(3_000, 1), 4)
    out = s.schedule()
    assert out.num_tokens == 21_000
    check_step(s, out, s.step_metadata_layout())


# -- decode rows (Scheduler.write_decode_rows) ----------------------------------------------

COLUMNS = helix_kv.DECODE_ROW_COLUMNS
FIXED = COLUMNS.index("block_table")


def check_rows(
    s: helix_kv.Scheduler, out: helix_kv.ScheduleOutput, pages: int, capacity: int = 8
) -> helix_kv.DecodeRowCounts | None:
    """Writes the step's decode rows into a sentinel-filled buffer and compares them with
    the separate calls; a step with context chunks must be refused with nothing written."""
    buffer = np.full((capacity, FIXED + pages), SENTINEL, dtype=np.int32)
    g = out.generation_ids.size
    pad_to = min(g + 2, capacity)
    if out.context_ids.size:
        refused_rows(s, out, buffer, pad_to, helix_kv.InvalidArgumentError)
        return None
    counts = s.write_decode_rows(out, buffer, pad_to)
    assert (counts.step, counts.rows, counts.padded_to) == (out.step, g, max(g, pad_to))
    refs = np.asarray(out.generation_input_refs)
    assert counts.in_flight == int((refs >= 0).sum())
    ids = np.asarray(out.generation_ids, dtype=np.uint64)
    positions = np.asarray(out.generation_positions, dtype=np.int64)
    expected = {
        "token_id": out.generation_input_tokens,
        "position": positions,
        "local_len": out.generation_local_lens,
        "past_seen_len": out.generation_past_seen_lens,
        "input_ref": refs,
    }
    if g:
        expected["slot"] = s.slot_mapping(ids, positions, np.ones(g, dtype=np.int64))
        np.testing.assert_array_equal(buffer[:g, FIXED:], s.block_table(ids, pages))
    for name, want in expected.items():
        np.testing.assert_array_equal(buffer[:g, COLUMNS.index(name)], want, err_msg=name)
    padding = buffer[g : counts.padded_to]
    assert (padding[:, :FIXED] == helix_kv.DECODE_ROW_PADDING).all()
    assert (padding[:, FIXED:] == SENTINEL).all()  # a padding row's table is left alone
    assert (buffer[counts.padded_to :] == SENTINEL).all()
    return counts


def refused_rows(
    s: helix_kv.Scheduler, out: object, buffer: object, pad_to: object, error: type[Exception]
) -> None:
    before = snapshot(s)
    copy = np.array(buffer, copy=True) if isinstance(buffer, np.ndarray) else None
    with pytest.raises(error):
        s.write_decode_rows(out, buffer, pad_to)  # type: ignore[arg-type]
    assert snapshot(s) == before
    if copy is not None:
        np.testing.assert_array_equal(buffer, copy)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "one_step_ahead"])
def test_decode_rows_equal_the_separate_calls(cp: int, ahead: bool) -> None:
    """Random workloads under KV pressure, every rank checked every step, plain and one
    step ahead (``schedule()`` while the previous step is pending: inputs in flight)."""
    decode_steps = in_flight = pressured = 0
    for seed in range(3):
        rng = np.random.default_rng(1000 + seed)
        tpb = int(rng.choice([2, 4, 3]))
        superblocks = int(rng.integers(6, 14))
        cfg = config(
            cp,
            tpb,
            superblocks=superblocks,
            max_batch_size=8,
            max_num_tokens=int(rng.integers(16, 48)),
            max_seq_len=120,
            chunk_unit=tpb,
        )
        ranks = [helix_kv.Scheduler(cfg.with_rank(r)) for r in range(cp)]
        pages = ranks[0].step_metadata_layout().table_width
        longest = min(120, superblocks * cp * tpb)
        next_id = 0
        pending: helix_kv.ScheduleOutput | None = None
        for step in range(60):
            if step % 4 == 0:
                for _ in range(int(rng.integers(0, 3))):
                    length = int(rng.integers(1, longest // 2 + 1))
                    max_new = int(rng.integers(1, longest - length + 1))
                    for s in ranks:
                        s.add_request(next_id, prompt(length, next_id), max_new)
                    next_id += 1
            out = None
            if ranks[0].has_unfinished():
                outs = [s.schedule() for s in ranks]
                pressured += bool(outs[0].preempted_ids.size)
                for s, o in zip(ranks, outs):
                    counts = check_rows(s, o, pages)
                    if counts is not None:
                        decode_steps += 1
                        in_flight += counts.in_flight
                out = outs[0]
            closing = pending if ahead else out
            pending = out if ahead else None
            if closing is not None:
                tokens = np.asarray(rng.integers(0, 1000, closing.num_samples), dtype=np.int32)
                for s in ranks:
                    for finished in s.update(tokens).tolist():
                        s.take_output(finished)
    assert decode_steps > 0
    assert pressured > 0
    assert (in_flight > 0) == ahead


def decode_pending(cp: int = 2) -> tuple[helix_kv.Scheduler, helix_kv.ScheduleOutput]:
    """A scheduler whose pending step decodes three requests (nothing else)."""
    s = helix_kv.Scheduler(config(cp, 4, superblocks=16, max_batch_size=4, max_num_tokens=64))
    for i in range(3):
        s.add_request(i, prompt(9, i), 5)
    s.update(np.full(s.schedule().num_samples, 7, dtype=np.int32))
    out = s.schedule()
    assert out.generation_ids.size == 3
    assert not out.context_ids.size
    return s, out


def test_hostile_row_buffers_are_refused_and_nothing_changes() -> None:
    s, out = decode_pending()
    pages = s.step_metadata_layout().table_width
    good = np.full((4, FIXED + pages), SENTINEL, dtype=np.int32)
    read_only = good.copy()
    read_only.setflags(write=False)
    cases: list[tuple[object, object, type[Exception]]] = [
        (good.tolist(), None, helix_kv.InvalidTypeError),
        (good.astype(np.float32), None, helix_kv.InvalidTypeError),
        (good.astype(np.int64), None, helix_kv.InvalidTypeError),
        (good.astype(np.uint32), None, helix_kv.InvalidTypeError),
        (good.astype(">i4"), None, helix_kv.InvalidTypeError),
        (good.ravel(), None, helix_kv.InvalidArgumentError),  # one-dimensional
        (good[:, ::2], None, helix_kv.InvalidArgumentError),  # not C-contiguous
        (np.asfortranarray(good), None, helix_kv.InvalidArgumentError),
        (read_only, None, helix_kv.InvalidArgumentError),
        (good[:2], None, helix_kv.InvalidLengthError),  # 3 rows, 2 fit
        (good, 5, helix_kv.InvalidLengthError),  # padded past the buffer
        (good, -1, helix_kv.InvalidLengthError),
        (good, 1.0, helix_kv.InvalidTypeError),
        (good, "4", helix_kv.InvalidTypeError),
        (good[:, : FIXED + 1].copy(), None, helix_kv.InvalidLengthError),  # narrower than a table
        (good[:, :FIXED].copy(), None, helix_kv.InvalidLengthError),  # no table column
        (good[:, : FIXED - 1].copy(), None, helix_kv.InvalidArgumentError),  # no fixed columns
    ]
    assert s.block_table(out.generation_ids).shape[1] > 1
    for buffer, pad_to, error in cases:
        refused_rows(s, out, buffer, pad_to, error)
    refused_rows(s, "out", good, None, helix_kv.InvalidTypeError)
    # The buffer is still usable after every refusal.
    check_rows(s, out, pages, capacity=4)


def test_decode_rows_of_a_stale_or_forged_output_are_refused() -> None:
    s, out = decode_pending()
    pages = s.step_metadata_layout().table_width
    buffer = np.full((4, FIXED + pages), SENTINEL, dtype=np.int32)
    fields = out.__reduce__()[1][0]  # the stored fields, the placement and the fingerprint
    ids = fields["generation_ids"].copy()
    ids[0] = 999
    refs = fields["generation_input_refs"].copy()
    refs[1] = -2
    for changed in (
        {"generation_ids": ids},
        {"generation_positions": fields["generation_positions"] + 100},
        {"generation_input_refs": refs},
    ):
        with pytest.raises(helix_kv.InvalidArgumentError, match=FORGED):
            helix_kv.ScheduleOutput._from_fields({**fields, **changed})
    check_rows(s, out, pages, capacity=4)
    s.update(np.full(out.num_samples, 7, dtype=np.int32))
    refused_rows(s, out, buffer, None, helix_kv.InvalidStateError)  # closed


def test_decode_row_columns_come_from_the_core() -> None:
    from helix_kv.executor.decode_step import DecodeLayout

    assert COLUMNS == (
        "token_id",
        "position",
        "slot",
        "local_len",
        "past_seen_len",
        "input_ref",
        "block_table",
    )
    assert len(helix_kv.DECODE_ROW_PADDING) == FIXED
    layout = DecodeLayout(max_batch=4, max_pages=3)
    assert layout.width == FIXED + 3
    assert [layout.TOKEN_ID, layout.INPUT_REF, layout.BLOCK_TABLE] == [0, 5, 6]
    counts = helix_kv.DecodeRowCounts(step=1, rows=2, padded_to=4, in_flight=1, table_width_used=1)
    assert pickle.loads(pickle.dumps(counts)) == counts


def decoding_1024() -> tuple[helix_kv.Scheduler, helix_kv.ScheduleOutput]:
    """A scheduler (cp = 2, tpb = 4) whose pending step decodes 1024 requests, and that step."""
    cfg = config(2, 4, superblocks=2048, max_batch_size=1024, max_num_tokens=16384)
    s = helix_kv.Scheduler(cfg)
    for i in range(1024):
        s.add_request(i, prompt(9, i), 4)
    s.update(np.full(s.schedule().num_samples, 7, dtype=np.int32))
    return s, s.schedule()


def test_decode_rows_of_a_thousand_requests_match() -> None:
    """A batch of 1024 decodes (the fast path's N): the same rows as the separate calls."""
    s, out = decoding_1024()
    assert out.generation_ids.size == 1024
    check_rows(s, out, 4, capacity=1024)


def test_decode_rows_holding_or_releasing_the_gil_match() -> None:
    """Rows up to 2**16 words are written holding the GIL, more (many or wide rows) with it
    released: both match the separate calls, and the same step gives the same bytes."""
    s, out = decoding_1024()
    held = np.full((1024, FIXED + 4), SENTINEL, dtype=np.int32)  # 10 240 words: held
    s.write_decode_rows(out, held, 1024)
    check_rows(s, out, 4, capacity=1024)
    wide = np.full((1024, FIXED + 64), SENTINEL, dtype=np.int32)  # 71 680 words: released
    s.write_decode_rows(out, wide, 1024)
    check_rows(s, out, 64, capacity=1024)
    np.testing.assert_array_equal(wide[:, : FIXED + 4], held)
    assert (wide[:, FIXED + 4 :] == -1).all()
    padded = np.full((8192, FIXED + 4), SENTINEL, dtype=np.int32)  # 81 920 words: released
    counts = s.write_decode_rows(out, padded, 8192)
    assert (counts.rows, counts.padded_to) == (1024, 8192)
    np.testing.assert_array_equal(padded[:1024], held)
    assert (padded[1024:, :FIXED] == helix_kv.DECODE_ROW_PADDING).all()
    assert (padded[1024:, FIXED:] == SENTINEL).all()
