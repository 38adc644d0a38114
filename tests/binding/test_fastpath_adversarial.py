"""An outside fuzzer's view of the calls an engine makes every step.

The rule under test (docs/errors.md, "Argument rules"): bad input raises a typed error of
helix_kv's one namespace (a :class:`helix_kv.HelixKVError`), the call changes nothing (state
digest, and the caller's output buffer where the docstring says so), the extension never
panics or aborts the process, and nothing is silently coerced.

Covered here, beyond ``test_hostile_inputs`` and ``test_step_metadata``:

- sequences that lie about their length (``__len__``): the binding reads their items, never
  trusts the size for an allocation;
- :func:`helix_kv.step_metadata_views` (a Python helper) raises helix_kv's errors;
- random call sequences (one step ahead, reverts of the newer step, aborts while pending,
  eos on the older step): every ``write_step_metadata`` / ``write_decode_rows`` equals a
  brute-force oracle built from ``block_table``, ``slot_mapping``, ``Layout`` and the
  ``ScheduleOutput`` arrays, on every rank;
- random hostile buffers, ``pad_to`` values and forged outputs: a typed error with the
  buffer and the scheduler unchanged, or a write;
- ``Ledger`` batch calls with one bad element hidden among good ones: all or nothing;
- outputs of another scheduler (refused) or another rank (this rank's rows are written).
"""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import helix_kv
from tests.helpers import examples
from tests.helpers.scheduler import config, needs_scheduler, prompt, snapshot

pytestmark = needs_scheduler


# -- sequences that lie about their length -----------------------------------------------


class LyingList(list):  # type: ignore[type-arg]
    """A list whose ``len()`` is made up (``2**62`` by default): a binding that sizes an
    allocation from it overflows (a panic) or cannot allocate (the process aborts)."""

    claimed = 1 << 62

    def __len__(self) -> int:
        return self.claimed


class LyingSequence(Sequence[Any]):
    """A ``collections.abc.Sequence`` (not a list) whose ``len()`` is made up; iterating it
    yields its real items."""

    def __init__(self, items: Sequence[Any], claimed: int = 1 << 62) -> None:
        self.items = list(items)
        self.claimed = claimed

    def __len__(self) -> int:
        return self.claimed

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)


def lying(kind: str, items: Sequence[Any]) -> Any:
    return LyingList(items) if kind == "list" else LyingSequence(items)


def ledger_with(ids: Sequence[int], length: int = 6) -> helix_kv.Ledger:
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 4), 16)
    ledger.add_many(list(ids), [length] * len(ids))
    assert ledger.grow_many(list(ids), [length] * len(ids)).all()
    return ledger


#: Each case calls one method with ``wrap`` applied to its sequence arguments and returns
#: something comparable: the same call with honest lists must give the same result.
LEDGER_CASES: dict[str, Callable[[Callable[[Sequence[Any]], Any]], Any]] = {
    "add_many": lambda w: (lambda led: (led.add_many(w([7, 8]), w([3, 4])), led.state_digest()))(
        ledger_with([1])
    ),
    "grow_many": lambda w: (
        lambda led: (led.grow_many(w([1]), w([9])).tolist(), led.state_digest())
    )(ledger_with([1])),
    "free_many": lambda w: (lambda led: (led.free_many(w([1])), led.state_digest()))(
        ledger_with([1, 2])
    ),
    "block_table": lambda w: ledger_with([1, 2]).block_table(w([2, 1])).tolist(),
    "slot_mapping": lambda w: (
        ledger_with([1, 2]).slot_mapping(w([1, 2]), w([0, 2]), w([3, 4]), 1).tolist()
    ),
    "layout_owner_ranks": lambda w: helix_kv.Layout(2, 4).owner_ranks(w([0, 4, 9])).tolist(),
    "layout_slot_mapping": lambda w: (
        helix_kv.Layout(2, 4).slot_mapping([w([0, 1]), w([2, 3])], w([1, 0]), w([5, 1]), 0).tolist()
    ),
}


def scheduler_case(w: Callable[[Sequence[Any]], Any]) -> Any:
    s = helix_kv.Scheduler(config(1, 4, superblocks=16))
    s.add_request(1, w([5, 6, 7]), 3)
    s.add_request(2, w([5]), 3)
    out = s.schedule()
    finished = s.update(w([11] * out.num_samples), w([False, True]))
    s.abort_many(w([1]))
    return finished.tolist(), s.state_digest(), s.num_live


@pytest.mark.parametrize("kind", ["list", "sequence"])
@pytest.mark.parametrize("case", [*LEDGER_CASES, "scheduler"])
def test_a_made_up_len_is_not_trusted(case: str, kind: str) -> None:
    """A sequence claiming ``2**62`` items but holding two is read as its two items: the same
    result as the honest list, no ``PanicException`` (capacity overflow)."""
    call = scheduler_case if case == "scheduler" else LEDGER_CASES[case]
    honest = call(list)
    assert call(lambda items: lying(kind, items)) == honest


def test_a_made_up_len_cannot_abort_the_process() -> None:
    """``2**58`` items of 16 bytes fit ``isize`` but not memory: an allocation sized from the
    claim aborts the process (``memory allocation ... failed``, SIGABRT). Run in a child."""
    code = textwrap.dedent(
        """
        import helix_kv

        class LyingList(list):
            def __len__(self):
                return 1 << 58

        ledger = helix_kv.Ledger(helix_kv.Layout(1, 4), 16)
        ledger.add_many(LyingList([3]), LyingList([5]))
        s = helix_kv.Scheduler(helix_kv.SchedulerConfig(kv_superblocks=16))
        s.add_request(1, LyingList([1, 2]), 3)
        s.schedule()
        s.update(LyingList([4]), LyingList([True]))
        print("survived", len(ledger), s.num_live)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["survived", "1", "0"]


# -- helix_kv.step_metadata_views ---------------------------------------------------------


def test_step_metadata_views_raises_helix_kv_errors() -> None:
    """The Python helper follows the extension's rules: a wrong type or dtype is an
    ``InvalidTypeError``, a wrong shape or a strided buffer an ``InvalidArgumentError``, a
    buffer shorter than the layout an ``InvalidLengthError`` (no bare ``ValueError`` or
    ``AttributeError``)."""
    layout = helix_kv.StepMetadataLayout(8, 4, 2)
    words = layout.total_words
    good = np.zeros(words, dtype=np.int32)
    cases: list[tuple[object, object, type[Exception]]] = [
        (good.tolist(), layout, helix_kv.InvalidTypeError),
        (good.astype(np.int64), layout, helix_kv.InvalidTypeError),
        (good.astype(np.float32), layout, helix_kv.InvalidTypeError),
        (good.astype(">i4"), layout, helix_kv.InvalidTypeError),
        (good, "layout", helix_kv.InvalidTypeError),
        (good, None, helix_kv.InvalidTypeError),
        (np.zeros((2, words), dtype=np.int32), layout, helix_kv.InvalidArgumentError),
        (np.zeros(2 * words, dtype=np.int32)[::2], layout, helix_kv.InvalidArgumentError),
        (good[: words - 1], layout, helix_kv.InvalidLengthError),
        (np.zeros(0, dtype=np.int32), layout, helix_kv.InvalidLengthError),
    ]
    for buffer, lay, error in cases:
        with pytest.raises(error):
            helix_kv.step_metadata_views(buffer, lay)  # type: ignore[arg-type]
    views = helix_kv.step_metadata_views(good, layout)
    assert views.block_table.shape == (4, 2)
    assert np.shares_memory(views.slot_mapping, good)


# -- a brute-force oracle over random call sequences --------------------------------------

SENTINEL = -7777
FIXED = helix_kv.DECODE_ROW_COLUMNS.index("block_table")


def known_tokens(s: helix_kv.Scheduler, request_id: int) -> np.ndarray | None:
    """The request's tokens (prompt + generated), or None once it is no longer live (a
    request that finished in the older step stays held for the newer one)."""
    try:
        return s.tokens(request_id)
    except helix_kv.UnknownRequestError:
        return None


def oracle_rows(
    s: helix_kv.Scheduler,
    out: helix_kv.ScheduleOutput,
    older: helix_kv.ScheduleOutput | None,
    width: int,
) -> list[dict[str, Any]]:
    """Every entry of ``out`` (generation entries, then context chunks), token by token, from
    the ledger's block table and ``Layout`` alone: the per-rank fields of ``out`` are not
    read, and each token id is checked against the request's tokens or, in flight, against
    the older step's ``sample_ids``."""
    cfg = s.config
    lay, rank = cfg.layout, cfg.cp_rank
    tpb, tps = lay.tokens_per_block, lay.tokens_per_superblock
    gen_ids = out.generation_ids.tolist()
    ctx_ids = out.context_ids.tolist()
    table = s.block_table(np.asarray(gen_ids + ctx_ids, dtype=np.uint64), width)
    rows = []
    for i, rid in enumerate(gen_ids):
        pos = int(out.generation_positions[i])
        ref = int(out.generation_input_refs[i])
        token = int(out.generation_input_tokens[i])
        if ref >= 0:
            assert older is not None, "a token in flight without an older pending step"
            assert int(older.sample_ids[ref]) == rid
            assert token == -1
        else:
            tokens = known_tokens(s, rid)
            if tokens is not None:
                assert token == int(tokens[pos])
        owner = lay.owner_rank(pos)
        assert owner == int(out.generation_owner_ranks[i])
        page = int(table[i][pos // tps])
        rows.append(
            {
                "id": rid,
                "token": token,
                "positions": [pos],
                "slots": [page * tpb + pos % tpb if owner == rank else -1],
                "local_len": lay.local_len(pos + 1, rank),
                "past_seen_len": lay.local_len(pos, rank),
                "input_ref": ref,
                "table": table[i],
                "slot": int(out.generation_batch_slots[i]),
            }
        )
    for j, rid in enumerate(ctx_ids):
        start, count = int(out.context_starts[j]), int(out.context_lens[j])
        tokens = known_tokens(s, rid)
        if tokens is not None:
            flat_start = sum(int(n) for n in out.context_lens[:j])
            np.testing.assert_array_equal(
                out.context_token_ids[flat_start : flat_start + count],
                tokens[start : start + count],
            )
        row = table[len(gen_ids) + j]
        positions = list(range(start, start + count))
        rows.append(
            {
                "id": rid,
                "positions": positions,
                "slots": [
                    int(row[p // tps]) * tpb + p % tpb if lay.owner_rank(p) == rank else -1
                    for p in positions
                ],
                "local_len": lay.local_len(start + count, rank),
                "past_seen_len": lay.local_len(start, rank),
                "completes": bool(out.context_completes[j]),
                "table": row,
                "slot": int(out.context_batch_slots[j]),
            }
        )
    return rows


def check_packed(
    s: helix_kv.Scheduler,
    out: helix_kv.ScheduleOutput,
    older: helix_kv.ScheduleOutput | None,
) -> None:
    """``write_step_metadata`` of the pending step against the oracle, section by section."""
    layout = s.step_metadata_layout()
    buffer = np.full(layout.total_words + 4, SENTINEL, dtype=np.int32)
    meta = s.write_step_metadata(out, buffer, layout)
    v = helix_kv.step_metadata_views(buffer, layout)
    entries = oracle_rows(s, out, older, layout.table_width)
    g = out.generation_ids.size
    positions = [p for e in entries for p in e["positions"]]
    n, e = len(positions), len(entries)
    samples = list(range(g))
    row = g
    for entry in entries[g:]:
        row += len(entry["positions"])
        if entry["completes"]:
            samples.append(row - 1)
    width_used = max((int((x["table"] >= 0).sum()) for x in entries), default=0)
    assert (meta.step, meta.num_tokens, meta.num_entries) == (out.step, n, e)
    assert (meta.num_generation, meta.num_samples) == (g, len(samples))
    assert meta.table_width_used == width_used
    assert (meta.num_samples, meta.num_tokens) == (out.num_samples, out.num_tokens)
    head = v.header
    assert int(head[:2].view(np.int64)[0]) == out.step
    assert head[2:].tolist() == [n, e, g, len(samples), width_used, 0]
    tokens = [x["token"] for x in entries[:g]] + out.context_token_ids.tolist()
    assert v.token_ids[:n].tolist() == tokens
    assert v.positions[:n].tolist() == positions
    assert v.slot_mapping[:n].tolist() == [p for x in entries for p in x["slots"]]
    assert (
        v.query_start[: e + 1].tolist()
        == np.cumsum([0] + [len(x["positions"]) for x in entries]).tolist()
    )
    assert v.local_lens[:e].tolist() == [x["local_len"] for x in entries]
    assert v.past_seen_lens[:e].tolist() == [x["past_seen_len"] for x in entries]
    assert v.batch_slots[:e].tolist() == [x["slot"] for x in entries]
    assert v.sample_rows[: len(samples)].tolist() == samples
    if e:
        np.testing.assert_array_equal(v.block_table[:e], np.stack([x["table"] for x in entries]))
    assert (buffer[layout.total_words :] == SENTINEL).all()


def check_rows(
    s: helix_kv.Scheduler,
    out: helix_kv.ScheduleOutput,
    older: helix_kv.ScheduleOutput | None,
    pad_to: int,
) -> None:
    """``write_decode_rows`` of the pending step against the oracle (or refused, with the
    buffer untouched, when the step has context chunks)."""
    pages = s.step_metadata_layout().table_width
    g = out.generation_ids.size
    capacity = max(g, pad_to) + 1
    buffer = np.full((capacity, FIXED + pages), SENTINEL, dtype=np.int32)
    if out.context_ids.size:
        with pytest.raises(helix_kv.InvalidArgumentError):
            s.write_decode_rows(out, buffer, pad_to)
        assert (buffer == SENTINEL).all()
        return
    counts = s.write_decode_rows(out, buffer, pad_to)
    entries = oracle_rows(s, out, older, pages)
    assert (counts.step, counts.rows, counts.padded_to) == (out.step, g, max(g, pad_to))
    assert counts.in_flight == sum(x["input_ref"] >= 0 for x in entries)
    for i, x in enumerate(entries):
        fixed = [
            x["token"],
            x["positions"][0],
            x["slots"][0],
            x["local_len"],
            x["past_seen_len"],
            x["input_ref"],
        ]
        assert buffer[i, :FIXED].tolist() == fixed, (i, x)
        assert buffer[i, FIXED:].tolist() == x["table"].tolist()
    padding = buffer[g : counts.padded_to]
    assert (padding[:, :FIXED] == helix_kv.DECODE_ROW_PADDING).all()
    assert (padding[:, FIXED:] == SENTINEL).all()
    assert (buffer[counts.padded_to :] == SENTINEL).all()


def check_refused(s: helix_kv.Scheduler, out: helix_kv.ScheduleOutput) -> None:
    """An output that is not the pending step's is an ``InvalidStateError`` for both forms,
    with the buffers and the scheduler unchanged."""
    before = snapshot(s)
    layout = s.step_metadata_layout()
    buffer = np.full(layout.total_words, SENTINEL, dtype=np.int32)
    rows = np.full((out.generation_ids.size + 1, FIXED + layout.table_width), SENTINEL, np.int32)
    with pytest.raises(helix_kv.InvalidStateError):
        s.write_step_metadata(out, buffer, layout)
    with pytest.raises(helix_kv.InvalidStateError):
        s.write_decode_rows(out, rows)
    assert (buffer == SENTINEL).all()
    assert (rows == SENTINEL).all()
    assert snapshot(s) == before


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 12)),
        st.tuples(st.just("schedule"), st.booleans(), st.integers(0, 3)),
        st.tuples(st.just("run"), st.integers(1, 12), st.booleans()),
        st.tuples(st.just("update"), st.floats(0.0, 0.3), st.booleans()),
        st.tuples(st.just("revert"), st.booleans(), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.booleans()),
    ),
    min_size=10,
    max_size=60,
)


def drive(
    cp: int, tpb: int, superblocks: int, batch: int, ops: list[tuple[Any, ...]], seed: int
) -> Counter[str]:
    """Runs ``ops`` on one scheduler per rank; every pending step (after ``schedule``, after
    an ``update`` that leaves the newer step pending, after a ``revert`` of the newer step
    that leaves the older one pending, after an abort) is checked on every rank against the
    oracle in both forms, and every output that is not pending must be refused. Returns
    what was seen (so a sweep can show the pressure was real)."""
    rng = np.random.default_rng(seed)
    cfg = config(
        cp,
        tpb,
        superblocks=superblocks,
        max_batch_size=batch,
        max_num_tokens=8 * tpb,
        max_seq_len=superblocks * cp * tpb,
        chunk_unit=tpb,
    )
    ranks = [helix_kv.Scheduler(cfg.with_rank(r)) for r in range(cp)]
    Outs = list[helix_kv.ScheduleOutput]  # one output per rank
    pending: list[Outs] = []
    closed: list[Outs] = []
    # The step pending when each output was scheduled (its inputs in flight come from it).
    planned_after: dict[int, Outs | None] = {}
    seen: Counter[str] = Counter()
    next_id = 0
    longest = superblocks * cp * tpb
    half = max(1, longest // 2)

    def check_pending(pad_to: int) -> None:
        if not pending:
            return
        newest = pending[-1]
        older = planned_after[newest[0].step]
        out = newest[0]
        seen["checked"] += 1
        seen["decode_only"] += bool(out.generation_ids.size and not out.context_ids.size)
        seen["in_flight"] += bool((out.generation_input_refs >= 0).any())
        seen["two_pending"] += len(pending) == 2
        seen["preempted"] += bool(out.preempted_ids.size)
        for r, s in enumerate(ranks):
            check_packed(s, newest[r], older[r] if older else None)
            check_rows(s, newest[r], older[r] if older else None, pad_to)
            for stale in pending[:-1] + closed[-2:]:
                check_refused(s, stale[r])

    def schedule(pad_to: int) -> bool:
        if ranks[0].pending_steps() == 2 or not ranks[0].has_unfinished():
            return False
        outs = [s.schedule() for s in ranks]
        assert len({o.digest for o in outs}) == 1
        planned_after[outs[0].step] = pending[0] if pending else None
        pending.append(outs)
        check_pending(pad_to)
        return True

    def update(eos_rate: float, with_eos: bool) -> None:
        oldest = pending.pop(0)
        n = oldest[0].num_samples
        tokens = rng.integers(0, 1000, n).astype(np.int32)
        eos = rng.random(n) < eos_rate
        for s in ranks:
            for rid in s.update(tokens, eos if with_eos else None).tolist():
                s.take_output(rid)
        closed.append(oldest)
        check_pending(0)

    for op in ops:
        kind = op[0]
        if kind == "add":
            # Up to half the pool each, so a few requests decoding run it short.
            length = max(1, op[1] * half // 24)
            max_new = max(1, min(op[2] * half // 12, longest - length))
            for s in ranks:
                s.add_request(next_id, prompt(length, next_id), max_new)
            next_id += 1
        elif kind == "schedule":
            schedule(op[2])
        elif kind == "run":  # a few steps, one ahead or not
            for _ in range(op[1]):
                scheduled = schedule(op[1] % 3)
                if pending and (len(pending) == 2 or not op[2] or not scheduled):
                    update(0.05, True)
        elif kind == "update" and pending:
            update(op[1], op[2])
        elif kind == "revert" and pending:
            closed.append(pending.pop())
            seen["reverted"] += 1
            for s in ranks:
                for rid in s.revert().tolist():
                    s.take_output(rid)
            check_pending(op[2])
        elif kind == "abort":
            live = ranks[0].queue_ids().tolist()
            if live:
                victim = live[op[1] % len(live)]
                for s in ranks:
                    s.abort(victim)
                check_pending(0)
    return seen


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cp=st.integers(1, 3),
    tpb=st.integers(1, 4),
    superblocks=st.integers(3, 10),
    batch=st.integers(1, 5),
    ops=OPS,
    seed=st.integers(0, 2**32 - 1),
)
def test_step_metadata_equals_the_oracle_over_random_calls(
    cp: int, tpb: int, superblocks: int, batch: int, ops: list[tuple[Any, ...]], seed: int
) -> None:
    drive(cp, tpb, superblocks, batch, ops, seed)


def random_ops(rng: random.Random) -> list[tuple[Any, ...]]:
    """What ``OPS`` draws, drawn uniformly (hypothesis favours small values: little pressure)."""
    ops: list[tuple[Any, ...]] = []
    for _ in range(rng.randint(20, 60)):
        kind = rng.choice(["add", "add", "schedule", "run", "run", "update", "revert", "abort"])
        if kind == "add":
            ops.append((kind, rng.randint(1, 24), rng.randint(1, 12)))
        elif kind in ("schedule", "revert"):
            ops.append((kind, rng.random() < 0.5, rng.randint(0, 3)))
        elif kind == "run":
            ops.append((kind, rng.randint(1, 12), rng.random() < 0.5))
        elif kind == "update":
            ops.append((kind, rng.random() * 0.3, rng.random() < 0.5))
        else:
            ops.append((kind, rng.randint(0, 30), rng.random() < 0.5))
    return ops


def test_step_metadata_equals_the_oracle_under_pressure() -> None:
    """A seeded sweep of the same driver, uniform draws: preemptions, inputs in flight, two
    pending steps and reverts all happen, and every step matches the oracle."""
    rng = random.Random(20261201)
    seen: Counter[str] = Counter()
    for _ in range(150):
        seen += drive(
            rng.randint(1, 3),
            rng.randint(1, 4),
            rng.randint(3, 10),
            rng.randint(1, 5),
            random_ops(rng),
            rng.randrange(2**32),
        )
    for what in ["decode_only", "in_flight", "two_pending", "preempted", "reverted"]:
        assert seen[what] >= 10, seen


# -- outputs of another scheduler ---------------------------------------------------------


def decoding(cp: int, rank: int, prompt_seed: int, tpb: int = 4) -> helix_kv.Scheduler:
    """A scheduler whose pending step decodes three requests (ids 0..2)."""
    cfg = config(cp, tpb, superblocks=16, max_batch_size=4, max_num_tokens=64)
    s = helix_kv.Scheduler(cfg.with_rank(rank))
    for i in range(3):
        s.add_request(i, prompt(9, i + prompt_seed), 5)
    out = s.schedule()
    s.update(np.full(out.num_samples, 7, dtype=np.int32))
    return s


def prefilling(prompt_seed: int, tpb: int = 4) -> helix_kv.Scheduler:
    """A scheduler whose pending step (step 0) prefills three requests (ids 0..2)."""
    s = helix_kv.Scheduler(config(1, tpb, superblocks=16, max_batch_size=4, max_num_tokens=64))
    for i in range(3):
        s.add_request(i, prompt(9, i + prompt_seed), 5)
    return s


def test_another_schedulers_output_of_the_same_step_is_refused() -> None:
    """Two schedulers at the same step number with the same request ids and lengths but
    other prompts (or another configuration): the other's output has another digest, and
    writing it would put the other's token ids (or pages) into this rank's metadata. It is
    an ``InvalidStateError``, as for a stale output; the scheduler's own output (also after a
    pickle round trip) is accepted."""
    mine = prefilling(0)
    out = mine.schedule()
    for other in [prefilling(100), prefilling(0, tpb=2)]:
        theirs = other.schedule()
        assert theirs.step == out.step
        assert theirs.digest != out.digest
        check_refused(mine, theirs)
    # A decode step: another configuration with the same decisions has another digest too.
    mine, other = decoding(1, 0, 0), decoding(1, 0, 0, tpb=2)
    out, theirs = mine.schedule(), other.schedule()
    assert (theirs.step, theirs.generation_ids.tolist()) == (out.step, [0, 1, 2])
    assert theirs.digest != out.digest
    check_refused(mine, theirs)
    layout = mine.step_metadata_layout()
    buffer = np.zeros(layout.total_words, dtype=np.int32)
    for accepted in [out, pickle.loads(pickle.dumps(out))]:
        assert mine.write_step_metadata(accepted, buffer, layout).step == out.step
        assert mine.write_decode_rows(accepted, np.zeros((3, FIXED + 4), np.int32)).rows == 3


def test_another_ranks_output_gives_this_ranks_rows() -> None:
    """Rank 1's output given to rank 0's scheduler (same step, same digest: only the per-rank
    fields differ) writes rank 0's rows and packed metadata, as rank 0's own output does:
    the writers compute each entry's owner, local and past-seen lengths from its position
    for their own rank (cp=2, tpb=4, position 9: rank 0 holds 6 / 5 tokens, rank 1 4 / 4).
    A forged output whose placement (so its per-rank arrays) is rank 1's but whose step and
    digest are rank 0's writes the same. Rank 1's per-rank arrays given with rank 0's
    placement are refused: they are computed from the placement."""
    rank0, rank1 = decoding(2, 0, 0), decoding(2, 1, 0)
    out0, out1 = rank0.schedule(), rank1.schedule()
    assert out0.digest == out1.digest
    assert out0.generation_local_lens.tolist() != out1.generation_local_lens.tolist()
    cls = helix_kv.ScheduleOutput
    stored = {name: getattr(out0, name) for name in cls.RANK_INVARIANT_FIELDS}
    stored["config_fingerprint"] = out0.config_fingerprint
    forged = cls._from_fields(
        {**stored, **{name: getattr(out1, name) for name in cls.PLACEMENT_FIELDS}}
    )
    assert forged == out1
    with pytest.raises(helix_kv.InvalidArgumentError, match="computed from them"):
        cls._from_fields(
            {
                **stored,
                **{name: getattr(out0, name) for name in cls.PLACEMENT_FIELDS},
                **{name: getattr(out1, name) for name in cls.PER_RANK_FIELDS},
            }
        )
    rows0 = np.full((3, FIXED + 4), SENTINEL, dtype=np.int32)
    rank0.write_decode_rows(out0, rows0)
    local, past = (helix_kv.DECODE_ROW_COLUMNS.index(c) for c in ("local_len", "past_seen_len"))
    assert rows0[:, local].tolist() == out0.generation_local_lens.tolist()
    assert rows0[:, past].tolist() == out0.generation_past_seen_lens.tolist()
    layout = rank0.step_metadata_layout()
    packed0 = np.full(layout.total_words, SENTINEL, dtype=np.int32)
    rank0.write_step_metadata(out0, packed0, layout)
    for other in (out1, forged):
        rows = np.full((3, FIXED + 4), SENTINEL, dtype=np.int32)
        rank0.write_decode_rows(other, rows)
        np.testing.assert_array_equal(rows, rows0)
        packed = np.full(layout.total_words, SENTINEL, dtype=np.int32)
        rank0.write_step_metadata(other, packed, layout)
        np.testing.assert_array_equal(packed, packed0)


# -- random hostile buffers, pad_to values and forged outputs ------------------------------

DTYPES = ["int32", "int64", "uint32", "int16", "float32", ">i4", "bool"]
PAD_TO = st.one_of(
    st.none(),
    st.integers(0, 5),
    st.integers(-3, 12),
    st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63)]),
    st.sampled_from([True, False, 1.0, "2", b"2", [2], np.int64(3), np.uint64(5), np.int8(-1)]),
    st.sampled_from([np.float64(2.0), np.bool_(True), np.array(2), np.array([2])]),
)


@st.composite
def hostile_buffers(draw: st.DrawFn, rows_wanted: int, width_wanted: int) -> Any:
    """Mostly near-valid: right or wrong dtype, rows and width around the wanted ones,
    C or Fortran order, strided, offset by one word, read-only; sometimes not an array."""
    if draw(st.booleans()):  # a valid buffer, to see the writes and the hostile pad_to
        rows, width = draw(st.integers(rows_wanted, 8)), draw(st.integers(0, 2)) + width_wanted
        return np.full((rows, width), SENTINEL, dtype=np.int32)
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from([None, [[0] * width_wanted], "buffer", 3, memoryview(b"")]))
    dtype = draw(st.sampled_from(["int32"] * len(DTYPES) + DTYPES))
    rows = draw(st.integers(0, rows_wanted + 2))
    width = draw(st.integers(max(0, width_wanted - 3), width_wanted + 2))
    ndim = draw(st.sampled_from([2, 2, 2, 1, 3]))
    shape: tuple[int, ...] = {1: (rows * width,), 2: (rows, width), 3: (rows, width, 1)}[ndim]
    base = np.full([n + 1 for n in shape], SENTINEL).astype(dtype)
    view = base[tuple(slice(0, n) for n in shape)]
    how = draw(st.sampled_from(["plain"] * 4 + ["fortran", "strided", "offset", "readonly"]))
    if how == "plain":
        view = np.ascontiguousarray(view)
    elif how == "fortran":
        view = np.asfortranarray(view)
    elif how == "strided" and ndim >= 2:
        view = np.full((rows, 2 * width, *shape[2:]), SENTINEL).astype(dtype)[:, ::2]
    elif how == "offset":
        flat = np.full(view.size + 1, SENTINEL).astype(dtype)
        view = flat[1:].reshape(shape)
    elif how == "readonly":
        view = np.ascontiguousarray(view)
        view.setflags(write=False)
    return view


def call_and_check(
    s: helix_kv.Scheduler, call: Callable[[], Any], buffer: Any
) -> tuple[Any, BaseException | None]:
    """Calls ``call``: a helix_kv error (anything else fails the test) leaves the scheduler
    and ``buffer`` as they were."""
    before = snapshot(s)
    copy = np.array(buffer, copy=True) if isinstance(buffer, np.ndarray) else None
    try:
        return call(), None
    except helix_kv.HelixKVError as err:
        assert snapshot(s) == before
        if copy is not None:
            np.testing.assert_array_equal(buffer, copy)
        return None, err


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data(), cp=st.integers(1, 3), tpb=st.sampled_from([1, 3, 4]))
def test_hostile_decode_row_buffers_raise_typed_errors_and_change_nothing(
    data: st.DataObject, cp: int, tpb: int
) -> None:
    s = decoding(cp, data.draw(st.integers(0, cp - 1)), 0, tpb=tpb)
    out = s.schedule()
    pages = s.step_metadata_layout().table_width
    buffer = data.draw(hostile_buffers(3, FIXED + pages))
    pad_to = data.draw(PAD_TO)
    counts, err = call_and_check(s, lambda: s.write_decode_rows(out, buffer, pad_to), buffer)
    event("written" if err is None else type(err).__name__)
    if err is None:
        # Accepted: a C-contiguous, writeable int32 [rows, width] array and an int pad_to
        # (a Python int or numpy integer scalar) it holds; the rows are the reference's.
        assert isinstance(buffer, np.ndarray)
        assert buffer.dtype == np.int32
        assert buffer.ndim == 2
        assert buffer.flags.c_contiguous
        assert not isinstance(pad_to, (bool, np.bool_, float, np.floating))
        reference = np.full(buffer.shape, SENTINEL, dtype=np.int32)
        assert s.write_decode_rows(out, reference, pad_to) == counts
        np.testing.assert_array_equal(buffer, reference)


@settings(max_examples=examples(100), deadline=None)
@given(
    data=st.data(),
    words=st.integers(-3, 3),
    dtype=st.sampled_from(["int32"] * len(DTYPES) + DTYPES),
)
def test_hostile_packed_buffers_raise_typed_errors_and_change_nothing(
    data: st.DataObject, words: int, dtype: str
) -> None:
    s = prefilling(0)
    out = s.schedule()
    layout = s.step_metadata_layout()
    how = data.draw(st.sampled_from(["plain", "plain", "offset", "strided", "readonly", "2d"]))
    n = max(0, layout.total_words + words)
    base = np.full(2 * n + 2, SENTINEL).astype(dtype)
    buffer = {
        "plain": base[:n],
        "offset": base[1 : n + 1],
        "strided": base[: 2 * n : 2],
        "readonly": base[:n],
        "2d": base[: 2 * (n // 2)].reshape(2, -1),
    }[how]
    if how == "readonly":
        buffer.setflags(write=False)
    meta, err = call_and_check(s, lambda: s.write_step_metadata(out, buffer, layout), buffer)
    event("written" if err is None else type(err).__name__)
    if err is None:
        assert (dtype, how) in {("int32", "plain")}
        assert words >= 0
        assert meta.num_tokens == out.num_tokens
    elif dtype == "int32" and how == "plain" and words >= 0:
        pytest.fail(f"a valid buffer was refused: {err!r}")


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data(), decode=st.booleans())
def test_forged_outputs_raise_typed_errors_and_change_nothing(
    data: st.DataObject, decode: bool
) -> None:
    """One to three values of the pending step's arrays replaced (through ``_from_fields``,
    keeping the digest): refused when rebuilt (its digest is recomputed from its fields), or
    it is the scheduled output (every value drawn was the one it had), whose metadata is
    written; never another exception (a panic)."""
    s = decoding(2, data.draw(st.integers(0, 1)), 0) if decode else prefilling(0)
    out = s.schedule()
    fields = out.__reduce__()[1][0]  # the stored fields and the placement
    arrays = [n for n, v in fields.items() if isinstance(v, np.ndarray) and v.size]
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(arrays))
        values = fields[name].copy()
        i = data.draw(st.integers(0, values.size - 1))
        info = np.iinfo(values.dtype) if values.dtype != bool else None
        if info is None:
            values[i] = not values[i]
        else:
            values[i] = data.draw(
                st.one_of(
                    st.integers(int(info.min), int(info.max)),
                    st.sampled_from(
                        [v for v in (-2, -1, 0, 1, 2, 9, 10, 2**31 - 1) if v >= info.min]
                    ),
                )
            )
        fields[name] = values
    try:
        forged = helix_kv.ScheduleOutput._from_fields(fields)
    except helix_kv.HelixKVError as err:
        event("rebuilt: " + type(err).__name__)
        return
    assert forged == out  # it has the scheduled output's digest, recomputed from its fields
    layout = s.step_metadata_layout()
    buffer = np.full(layout.total_words, SENTINEL, dtype=np.int32)
    _, err = call_and_check(s, lambda: s.write_step_metadata(forged, buffer, layout), buffer)
    event("packed: " + ("written" if err is None else type(err).__name__))
    rows = np.full((4, FIXED + layout.table_width), SENTINEL, dtype=np.int32)
    _, err = call_and_check(s, lambda: s.write_decode_rows(forged, rows, 4), rows)
    event("rows: " + ("written" if err is None else type(err).__name__))


# -- the executor's CPU parts (helix_kv.executor.staging / decode_step, no CUDA) -----------


def test_the_executor_fast_path_modules_import_and_run_without_cuda() -> None:
    """``helix_kv.executor.decode_step`` and ``staging`` import with a CPU-only torch, and
    their CPU paths run (no pinned memory, no events)."""
    torch = pytest.importorskip("torch")
    from helix_kv.executor import decode_step, staging

    stager = staging.HostToDeviceStager(torch.device("cpu"))
    arrays = [
        np.array([3, -1, 7], dtype=np.int32),
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([2**63 - 1], dtype=np.uint64),
        np.zeros(0, dtype=np.int16),
        [[1, 2], [3, 4]],
    ]
    staged = stager.stage(arrays)
    for array, tensor in zip(arrays, staged):
        assert tensor.dtype == torch.int64
        np.testing.assert_array_equal(tensor.numpy(), np.asarray(array).astype(np.int64))
    layout = decode_step.DecodeLayout(max_batch=4, max_pages=4)
    meta = decode_step.DecodeMetadata(layout, "cpu")
    assert meta.buckets == (1, 2, 4)
    assert (meta.host.numpy()[:, : layout.BLOCK_TABLE] == helix_kv.DECODE_ROW_PADDING).all()


@pytest.mark.parametrize(
    ("array", "error"),
    [
        (np.array([1.7, -2.9]), helix_kv.InvalidTypeError),  # was truncated to [1, -2]
        (np.array(["7"]), helix_kv.InvalidTypeError),  # was parsed to 7
        (np.array([True, False]), helix_kv.InvalidTypeError),  # was 1, 0
        (np.array([1 + 2j]), helix_kv.InvalidTypeError),
        (np.array([None, 1], dtype=object), helix_kv.InvalidTypeError),
        (np.array([2**63], dtype=np.uint64), helix_kv.InvalidArgumentError),  # was -2**63
        (np.array([2**64 - 1], dtype=np.uint64), helix_kv.InvalidArgumentError),  # was -1
    ],
)
def test_staging_refuses_what_int64_cannot_hold_exactly(array: np.ndarray, error: type) -> None:
    """The stager packs index arrays into one int64 buffer: a float, bool, string or object
    array, or a uint64 value past int64, is refused rather than cast (numpy's assignment
    truncates floats, parses strings and wraps uint64)."""
    torch = pytest.importorskip("torch")
    from helix_kv.executor.staging import HostToDeviceStager

    stager = HostToDeviceStager(torch.device("cpu"))
    with pytest.raises(error):
        stager.stage([np.arange(3), array])
    # An empty array of any dtype holds nothing to cast (np.array([]) is float64).
    (empty,) = stager.stage([np.array([])])
    assert empty.numel() == 0


def test_decode_metadata_fill_from_schedule_matches_and_is_all_or_nothing() -> None:
    """On CPU: the staged rows are ``write_decode_rows``' rows padded to the bucket; a step
    the core refuses (context chunks) leaves the current staging buffer, its index and its
    contents as they were."""
    torch = pytest.importorskip("torch")
    from helix_kv.executor.decode_step import DecodeLayout, DecodeMetadata

    s = decoding(2, 1, 0)
    pages = s.step_metadata_layout().table_width
    meta = DecodeMetadata(DecodeLayout(max_batch=4, max_pages=pages), torch.device("cpu"))
    out = s.schedule()
    counts = meta.fill_from_schedule(s, out)
    assert (counts.rows, counts.padded_to) == (3, 4)
    reference = np.full((4, FIXED + pages), SENTINEL, dtype=np.int32)
    s.write_decode_rows(out, reference, 4)
    np.testing.assert_array_equal(meta.host.numpy()[:3], reference[:3])
    assert (meta.host.numpy()[3, :FIXED] == helix_kv.DECODE_ROW_PADDING).all()
    s.update(np.full(out.num_samples, 5, dtype=np.int32))
    s.add_request(9, prompt(5, 9), 2)
    mixed = s.schedule()
    assert mixed.context_ids.size
    current = meta.current
    staging = [buffer.clone() for buffer in meta._staging]
    with pytest.raises(helix_kv.InvalidArgumentError):
        meta.fill_from_schedule(s, mixed)
    assert meta.current == current
    for before, after in zip(staging, meta._staging):
        assert torch.equal(before, after)


# -- Ledger batch calls: one bad element among good ones -----------------------------------

BAD_GROW = st.sampled_from(
    [
        ("unknown id", 999, None, helix_kv.UnknownRequestError),
        ("repeated id", "repeat", None, helix_kv.InvalidArgumentError),
        ("negative id", -1, None, helix_kv.InvalidArgumentError),
        ("id 2**64", 2**64, None, helix_kv.InvalidArgumentError),
        ("bool id", True, None, helix_kv.InvalidTypeError),
        ("float length", None, 8.0, helix_kv.InvalidTypeError),
        ("bool length", None, True, helix_kv.InvalidTypeError),
        ("negative length", None, -1, helix_kv.InvalidLengthError),
        ("length 2**63", None, 2**63, helix_kv.InvalidLengthError),
        ("length past the pool", None, 2**63 - 1, helix_kv.InvalidLengthError),
        ("shorter length", None, "shorter", helix_kv.InvalidLengthError),
    ]
)


@settings(max_examples=examples(150), deadline=None)
@given(
    held=st.integers(2, 8),
    data=st.data(),
    bad=BAD_GROW,
    as_array=st.booleans(),
)
def test_a_bad_element_anywhere_in_a_batch_changes_nothing(
    held: int, data: st.DataObject, bad: tuple[str, Any, Any, type], as_array: bool
) -> None:
    """``grow_many`` / ``free_many`` / ``add_many`` with one bad element at a random place
    among valid ones (lists, or arrays where the bad value has an integer form): the typed
    error, and the ledger digest unchanged (nothing before the bad element applied)."""
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 4), 64)
    ids = list(range(held))
    ledger.add_many(ids, [1] * held)
    assert ledger.grow_many(ids, [5] * held).all()
    digest = ledger.state_digest()
    # The last id is left out of the valid part: a bad length is given to it.
    chosen = data.draw(st.lists(st.sampled_from(ids[:-1]), min_size=1, unique=True))
    lengths = [data.draw(st.integers(5, 40)) for _ in chosen]
    _, bad_id, bad_len, error = bad
    at = data.draw(st.integers(0, len(chosen)))
    ids_in = list(chosen)
    lens_in: list[Any] = list(lengths)
    if bad_id == "repeat":
        ids_in.insert(at, chosen[0])
        lens_in.insert(at, 40)
    elif bad_id is not None:
        ids_in.insert(at, bad_id)
        lens_in.insert(at, 40)
    else:
        ids_in.insert(at, ids[-1])
        lens_in.insert(at, 4 if bad_len == "shorter" else bad_len)
    ids_arg: Any = ids_in
    lens_arg: Any = lens_in
    if as_array:
        if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 for v in ids_in):
            ids_arg = np.array(ids_in, dtype=np.uint64)
        if all(type(v) is int and -(2**63) <= v < 2**63 for v in lens_in):
            lens_arg = np.array(lens_in, dtype=np.int64)
    with pytest.raises(error):
        ledger.grow_many(ids_arg, lens_arg)
    assert ledger.state_digest() == digest
    if bad_id is not None:
        with pytest.raises(error):
            ledger.free_many(ids_arg)
        assert ledger.state_digest() == digest
    fresh = [100 + i for i in range(len(chosen))]
    fresh.insert(at, chosen[0])  # already held
    with pytest.raises(helix_kv.DuplicateRequestError):
        ledger.add_many(fresh, [3] * len(fresh))
    assert ledger.state_digest() == digest
    assert len(ledger) == held


# -- ScheduleOutput: pickling, equality, read-only arrays ----------------------------------


def test_schedule_output_round_trips_and_stays_read_only() -> None:
    """A pickled output (every protocol) has every field equal, of the same dtype and
    read-only; ``differing_fields`` is empty and the digest equal. ``==`` compares every
    field (as the other records do) and ``hash`` comes from the digest, so a copy equals its
    original and hashes alike, while another rank's output of the same step (its per-rank
    fields differ) and the next step's output do not equal it. ``_from_fields`` copies the
    caller's arrays, so mutating them later changes nothing."""
    s = decoding(2, 1, 0)
    s.add_request(7, prompt(6, 7), 3)
    out = s.schedule()
    assert out.generation_ids.size
    assert out.context_ids.size
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(out, protocol=protocol))
        assert copy.differing_fields(out) == []
        assert (copy.digest, copy.summary()) == (out.digest, out.summary())
        for name in helix_kv.ScheduleOutput.FIELDS:
            mine, theirs = getattr(out, name), getattr(copy, name)
            if isinstance(mine, np.ndarray):
                assert theirs.dtype == mine.dtype, name
                np.testing.assert_array_equal(theirs, mine, err_msg=name)
                assert not theirs.flags.writeable, name
                with pytest.raises(ValueError, match="read-only"):
                    theirs[...] = 0
            else:
                assert theirs == mine, name
        assert (copy == out, copy != out) == (True, False)
        assert hash(copy) == hash(out)
        assert {copy: protocol}[out] == protocol
    assert out != object()
    assert out != out.digest
    other_rank = decoding(2, 0, 0)
    other_rank.add_request(7, prompt(6, 7), 3)
    theirs = other_rank.schedule()
    assert theirs.digest == out.digest
    assert theirs.differing_fields(out) == []
    assert theirs != out  # another rank: its placement (so its per-rank fields) differs
    tokens = out.context_token_ids.copy()
    # every field, the per-rank ones too (checked against the placement), and the placement
    cls = helix_kv.ScheduleOutput
    fields = {name: getattr(out, name) for name in cls.FIELDS + cls.PLACEMENT_FIELDS}
    fields["config_fingerprint"] = out.config_fingerprint
    rebuilt = helix_kv.ScheduleOutput._from_fields({**fields, "context_token_ids": tokens})
    tokens[0] += 1
    assert rebuilt.context_token_ids[0] == out.context_token_ids[0]
    layout = s.step_metadata_layout()
    written = np.zeros(layout.total_words, dtype=np.int32)
    s.write_step_metadata(rebuilt, written, layout)
    direct = np.zeros(layout.total_words, dtype=np.int32)
    s.write_step_metadata(out, direct, layout)
    np.testing.assert_array_equal(written, direct)


@pytest.mark.parametrize(
    ("column", "value", "error"),
    [
        ("local_lens", [7, 7, 7], helix_kv.InvalidArgumentError),  # 3 values for 2 rows
        ("token_ids", np.array([1.9, 2.5]), helix_kv.InvalidTypeError),  # was 1, 2
        ("token_ids", np.array([True, False]), helix_kv.InvalidTypeError),
        ("slots", np.array(["5", "6"]), helix_kv.InvalidTypeError),
        ("positions", np.array([2**32 + 3, 4]), helix_kv.InvalidLengthError),  # was 3
        ("positions", [2**32 + 3, 4], helix_kv.InvalidLengthError),  # was an OverflowError
        ("past_seen_lens", [-(2**31) - 1, 0], helix_kv.InvalidLengthError),
        ("input_refs", np.array([2**31, 0], dtype=np.uint64), helix_kv.InvalidArgumentError),
        ("block_table", np.array([[0.5, 1], [2, 3]]), helix_kv.InvalidTypeError),
        ("block_table", [[0, 2**31], [2, 3]], helix_kv.InvalidArgumentError),
        ("block_table", [0, 1], helix_kv.InvalidArgumentError),  # one-dimensional
    ],
)
def test_decode_metadata_fill_is_checked_before_anything_is_written(
    column: str, value: Any, error: type
) -> None:
    """``DecodeMetadata.fill`` (the executor's path for callers without a scheduler) writes
    int32 rows: a column that does not fit them exactly (another length, a float, bool or
    string dtype, a value past int32) is a helix_kv error raised before the staging buffer
    turns or a word is written (as for ``StagingBufferBusy``), never a silent cast."""
    torch = pytest.importorskip("torch")
    from helix_kv.executor.decode_step import DecodeLayout, DecodeMetadata

    meta = DecodeMetadata(DecodeLayout(max_batch=4, max_pages=2), torch.device("cpu"))
    columns: dict[str, Any] = {
        "token_ids": [1, 2],
        "positions": [3, 4],
        "slots": [5, 6],
        "local_lens": [7, 8],
        "past_seen_lens": [6, 7],
        "block_table": [[0, 1], [2, -1]],
        "input_refs": [-1, 0],
    }
    assert meta.fill(**columns) == 2
    current = meta.current
    staging = [buffer.clone() for buffer in meta._staging]
    with pytest.raises(error):
        meta.fill(**{**columns, column: value})
    assert meta.current == current
    for before, after in zip(staging, meta._staging):
        assert torch.equal(before, after)
