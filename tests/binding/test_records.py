"""Records built from one field list: value records (metrics, views) and ScheduleOutput expose
their field names, convert, print and pickle from that list; ScheduleOutput's arrays are
read-only; the config's capacity, layout and the batch slot mapping come from the core."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest

import helix_kv

ROOT = Path(__file__).resolve().parents[2]


def scheduler(cp: int = 2, rank: int = 0, **overrides) -> helix_kv.Scheduler:
    config = helix_kv.SchedulerConfig(
        cp_size=cp, cp_rank=rank, tokens_per_block=4, kv_superblocks=8, **overrides
    )
    return helix_kv.Scheduler(config)


def pressured() -> tuple[helix_kv.Scheduler, list[helix_kv.ScheduleOutput]]:
    """A scheduler that decoded, chunked and preempted; its outputs."""
    s = scheduler(max_num_tokens=16, chunk_unit=4)
    for rid in range(4):
        s.add_request(rid, np.arange(10 + rid, dtype=np.int32), 20)
    outputs = []
    while s.has_unfinished() and len(outputs) < 40:
        out = s.schedule()
        outputs.append(out)
        s.update(np.full(out.num_samples, 3, dtype=np.int32))
    assert any(len(o.preempted_ids) for o in outputs)
    return s, outputs


def value_records() -> list:
    s, _ = pressured()
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 4), 8)
    ledger.add(7, 9)
    assert ledger.grow(7, 9)
    s.add_request(99, np.arange(5, dtype=np.int32), 8)
    for _ in range(3):
        s.update(np.full(s.schedule().num_samples, 3, dtype=np.int32))
    assert s.request_metrics(99).generated_tokens == 3
    return [s.metrics(), s.request_metrics(99), ledger.view(7, 1), ledger.request(7)]


@pytest.mark.parametrize("record", value_records(), ids=lambda r: type(r).__name__)
def test_value_records_list_convert_print_and_pickle_their_fields(record) -> None:
    cls = type(record)
    fields = cls.FIELDS
    values = record.to_dict()
    assert tuple(values) == fields
    assert [getattr(record, name) for name in fields] == list(values.values())
    assert (
        repr(record)
        == f"{cls.__name__}("
        + ", ".join(f"{name}={value!r}" for name, value in values.items())
        + ")"
    )
    again = pickle.loads(pickle.dumps(record))
    assert type(again) is cls
    assert again == record
    assert cls(**values) == record
    changed = {**values, fields[0]: values[fields[0]] + 1}
    assert cls(**changed) != record
    with pytest.raises(AttributeError):
        setattr(record, fields[0], 1)
    if cls is not helix_kv.RequestMetrics:  # its keywords default to 0 (see below)
        with pytest.raises(TypeError, match=fields[-1]):
            cls(**{name: value for name, value in values.items() if name != fields[-1]})


@pytest.mark.parametrize("record", [helix_kv.SchedulerMetrics, helix_kv.RequestMetrics])
def test_the_scheduler_contract_lists_every_metrics_field_in_order(record: type) -> None:
    """docs/internals/scheduler.md's bullet of each metrics record names its fields, read
    from the record, in its order, and nothing else."""
    text = (ROOT / "docs" / "internals" / "scheduler.md").read_text(encoding="utf-8")
    section = text[text.index("### Metrics and outputs") :]
    bullet = section[section.index(f"- `{record.__name__}`") :]
    bullet = bullet[: bullet.index("\n- ")]
    named = re.findall(r"`(\w+)`", bullet)
    assert named[0] == record.__name__
    assert named[1:] == list(record.FIELDS)


def test_request_metrics_keywords_default_to_zero() -> None:
    assert helix_kv.RequestMetrics().to_dict() == dict.fromkeys(helix_kv.RequestMetrics.FIELDS, 0)


def test_schedule_output_field_lists_cover_every_getter() -> None:
    cls = helix_kv.ScheduleOutput
    assert set(cls.RANK_INVARIANT_FIELDS) | set(cls.PER_RANK_FIELDS) == set(cls.FIELDS)
    assert not set(cls.RANK_INVARIANT_FIELDS) & set(cls.PER_RANK_FIELDS)
    assert [f for f in cls.FIELDS if f in cls.PER_RANK_FIELDS] == list(cls.PER_RANK_FIELDS)
    assert cls.PER_RANK_FIELDS == (
        "generation_active",
        "generation_local_lens",
        "generation_past_seen_lens",
    )
    # the stored fields, then the per-rank ones computed from the positions and the placement;
    # the computed owner ranks and sample ids where they were once stored (after the
    # positions, after sat_out_ids)
    assert cls.FIELDS[-3:] == cls.PER_RANK_FIELDS
    computed, invariant = cls.COMPUTED_FIELDS, cls.RANK_INVARIANT_FIELDS
    assert computed == ("generation_owner_ranks", "sample_ids", *cls.PER_RANK_FIELDS)
    assert computed == tuple(f for f in cls.FIELDS if f in computed)
    assert {"generation_owner_ranks", "sample_ids"} <= set(invariant)
    at = cls.FIELDS.index("generation_positions")
    assert cls.FIELDS[at + 1] == "generation_owner_ranks"
    assert invariant[-4:] == ("sat_out_ids", "sample_ids", "num_tokens", "digest")
    assert invariant == tuple(f for f in cls.FIELDS if f not in cls.PER_RANK_FIELDS)
    assert cls.PLACEMENT_FIELDS == ("cp_rank", "cp_size", "tokens_per_block")
    assert not set(cls.PLACEMENT_FIELDS) & set(cls.FIELDS)
    assert {"step", "num_tokens", "digest", "sample_ids"} <= set(cls.RANK_INVARIANT_FIELDS)
    getters = {name for name, value in vars(cls).items() if hasattr(value, "__get__")}
    assert set(cls.FIELDS) | set(cls.PLACEMENT_FIELDS) <= getters
    shown = {field for _, fields in cls.SUMMARY_ENTRIES for field in fields}
    assert shown <= set(cls.RANK_INVARIANT_FIELDS)


def test_schedule_output_arrays_are_read_only() -> None:
    _, outputs = pressured()
    out = outputs[-1]
    for name in helix_kv.ScheduleOutput.FIELDS:
        value = getattr(out, name)
        if isinstance(value, np.ndarray):
            assert not value.flags.writeable, name
            with pytest.raises(ValueError, match="WRITEABLE"):
                value.flags.writeable = True
            if value.size:
                with pytest.raises(ValueError, match="read-only"):
                    value[0] = value[0]


def test_summary_is_its_pairs_and_the_pickled_output_is_the_same_step() -> None:
    _, outputs = pressured()
    for out in outputs:
        pairs = out.summary_fields()
        assert [name for name, _ in pairs] == [
            e for e, _ in helix_kv.ScheduleOutput.SUMMARY_ENTRIES
        ]
        lines = [f"{name}: {value}" if value else f"{name}:" for name, value in pairs]
        assert out.summary() == "\n".join(lines) + "\n"
        again = pickle.loads(pickle.dumps(out))
        assert again.summary() == out.summary()
        assert again.differing_fields(out) == [] == out.differing_fields(again)
        for name in helix_kv.ScheduleOutput.FIELDS:
            ours, theirs = getattr(out, name), getattr(again, name)
            assert np.array_equal(ours, theirs), name
            assert np.asarray(ours).dtype == np.asarray(theirs).dtype, name
    assert outputs[0].differing_fields(outputs[1])[0] == "step"


def test_differing_fields_leave_the_per_rank_fields_out() -> None:
    outputs = []
    for rank in range(2):
        s = scheduler(rank=rank)
        s.add_request(1, np.arange(6, dtype=np.int32), 3)
        s.update(np.full(s.schedule().num_samples, 4, dtype=np.int32))
        outputs.append(s.schedule())
    assert not np.array_equal(outputs[0].generation_local_lens, outputs[1].generation_local_lens)
    assert outputs[0].differing_fields(outputs[1]) == []
    with pytest.raises(helix_kv.InvalidTypeError):
        outputs[0].differing_fields("not an output")  # type: ignore[arg-type]


def test_an_inconsistent_pickle_is_refused() -> None:
    _, outputs = pressured()
    out = next(o for o in outputs if len(o.context_ids))
    fields = out.__reduce__()[1][0]
    rebuild = helix_kv.ScheduleOutput._from_fields
    assert rebuild(dict(fields)).summary() == out.summary()
    short = {**fields, "context_lens": fields["context_lens"][:-1]}
    with pytest.raises(helix_kv.InvalidArgumentError, match="one value per entry"):
        rebuild(short)
    with pytest.raises(helix_kv.InvalidArgumentError, match="sample_ids"):
        rebuild({**fields, "sample_ids": np.zeros(0, dtype=np.uint64)})
    with pytest.raises(helix_kv.InvalidTypeError):
        rebuild({**fields, "context_ids": fields["context_ids"].astype(np.int64)})
    with pytest.raises(helix_kv.InvalidArgumentError, match="digest is missing"):
        rebuild({k: v for k, v in fields.items() if k != "digest"})
    # Negative lengths or ranks in a pickle are refused, not wrapped into huge unsigned ones.
    negative_len = np.array([-1] * len(fields["context_lens"]), dtype=np.int64)
    with pytest.raises(helix_kv.InvalidLengthError, match="context_lens"):
        rebuild({**fields, "context_lens": negative_len})
    generating = next(o for o in outputs if len(o.generation_ids))
    gen_fields = generating.__reduce__()[1][0]
    negative_rank = np.full(len(gen_fields["generation_positions"]), -2, dtype=np.int32)
    with pytest.raises(helix_kv.InvalidArgumentError, match="generation_owner_ranks"):
        rebuild({**gen_fields, "generation_owner_ranks": negative_rank})


class Tampered:
    """Pickles as ``ScheduleOutput._from_fields(fields)``: what an edited pickle of an
    output unpickles as."""

    def __init__(self, fields: dict) -> None:
        self.fields = fields

    def __reduce__(self) -> tuple:
        return (helix_kv.ScheduleOutput._from_fields, (self.fields,))


def test_a_tampered_pickle_is_refused_by_its_digest() -> None:
    """An output rebuilt from fields has its digest recomputed from them (the scheduler's
    own digest, seeded with ``config_fingerprint``): a pickle whose tokens, ids, positions,
    step, digest or fingerprint were changed is refused (``InvalidArgumentError``), so it
    cannot pass for the scheduled output; the untouched pickle loads as the output, and
    its fingerprint is the configuration's."""
    s, outputs = pressured()
    assert all(o.config_fingerprint == s.config.fingerprint for o in outputs)
    out = next(o for o in outputs if len(o.context_ids) and len(o.generation_ids))
    fields = out.__reduce__()[1][0]
    assert fields["config_fingerprint"] == s.config.fingerprint
    assert pickle.loads(pickle.dumps(Tampered(fields))) == out
    tokens = fields["context_token_ids"].copy()
    tokens[0] += 1
    ids = fields["generation_ids"].copy()
    ids[0] ^= 1 << 63
    positions = fields["generation_positions"] + 1
    for changed in (
        {"context_token_ids": tokens},
        {"generation_ids": ids},
        {"generation_positions": positions},
        {"step": out.step + 1},
        {"digest": out.digest ^ 1},
        {"config_fingerprint": out.config_fingerprint ^ 1},
    ):
        payload = pickle.dumps(Tampered({**fields, **changed}))
        with pytest.raises(helix_kv.InvalidArgumentError, match="changed after it was scheduled"):
            pickle.loads(payload)
    rebuild = helix_kv.ScheduleOutput._from_fields
    with pytest.raises(helix_kv.InvalidArgumentError, match="config_fingerprint is missing"):
        rebuild({k: v for k, v in fields.items() if k != "config_fingerprint"})
    for wrong, error in [
        (1.0, helix_kv.InvalidTypeError),
        (True, helix_kv.InvalidTypeError),
        (None, helix_kv.InvalidTypeError),
        (-1, helix_kv.InvalidArgumentError),
        (2**64, helix_kv.InvalidArgumentError),
    ]:
        with pytest.raises(error, match="config_fingerprint"):
            rebuild({**fields, "config_fingerprint": wrong})


def test_a_pickle_of_misaligned_strided_or_byte_swapped_arrays_loads() -> None:
    """``_from_fields`` reads arrays numpy lays out in any way (a misaligned view, a strided
    one) through a contiguous copy, and refuses another byte order as another dtype."""
    _, outputs = pressured()
    out = next(o for o in outputs if len(o.context_ids) and len(o.generation_ids))
    fields = out.__reduce__()[1][0]
    for name in ("context_ids", "context_token_ids", "generation_positions"):
        values = fields[name]
        buffer = bytearray(values.nbytes + 1)
        misaligned = np.frombuffer(buffer, values.dtype, count=values.size, offset=1)
        misaligned[...] = values
        assert not misaligned.flags.aligned
        strided = np.repeat(values, 2)[::2]
        for layout in (misaligned, strided):
            assert helix_kv.ScheduleOutput._from_fields({**fields, name: layout}) == out
        swapped = values.astype(values.dtype.newbyteorder())
        with pytest.raises(helix_kv.InvalidTypeError, match=name):
            helix_kv.ScheduleOutput._from_fields({**fields, name: swapped})


def two_ranks_decoding() -> list[helix_kv.ScheduleOutput]:
    """Both ranks' outputs of one step with three decodes (cp=2, tpb=4)."""
    outputs = []
    for rank in range(2):
        s = scheduler(rank=rank)
        for rid, length in enumerate((3, 6, 9)):
            s.add_request(rid, np.arange(length, dtype=np.int32), 4)
        s.update(np.full(s.schedule().num_samples, 4, dtype=np.int32))
        outputs.append(s.schedule())
    return outputs


def test_per_rank_fields_are_computed_from_the_positions_and_the_placement() -> None:
    """Each rank's per-rank arrays are the layout's, computed on first read and cached
    (read-only like every array); the placement is the rank's."""
    outputs = two_ranks_decoding()
    layout = helix_kv.Layout(2, 4)
    positions = outputs[0].generation_positions
    assert positions.tolist() == [3, 6, 9]
    for rank, out in enumerate(outputs):
        assert (out.cp_rank, out.cp_size, out.tokens_per_block) == (rank, 2, 4)
        active = out.generation_active
        assert active is out.generation_active  # cached
        assert active.dtype == np.bool_
        assert not active.flags.writeable
        np.testing.assert_array_equal(active, layout.owner_ranks(positions) == rank)
        local, past = out.generation_local_lens, out.generation_past_seen_lens
        assert local.dtype == past.dtype == np.int64
        np.testing.assert_array_equal(local, layout.local_lens(positions + 1, rank))
        np.testing.assert_array_equal(past, layout.local_lens(positions, rank))


def test_two_ranks_outputs_differ_and_each_pickles_to_itself() -> None:
    """Two ranks' outputs of the same step: equal rank-invariant fields and digests, unequal
    outputs (their placements differ); each pickled copy equals its own original, with the
    same per-rank arrays. The pickle carries the placement, not the per-rank arrays."""
    cls = helix_kv.ScheduleOutput
    outputs = two_ranks_decoding()
    assert outputs[0].digest == outputs[1].digest
    assert outputs[0].differing_fields(outputs[1]) == []
    assert outputs[0] != outputs[1]
    for rank, out in enumerate(outputs):
        fields = out.__reduce__()[1][0]
        stored = set(cls.FIELDS) - set(cls.COMPUTED_FIELDS)
        assert set(fields) == stored | set(cls.PLACEMENT_FIELDS) | {"config_fingerprint"}
        assert "generation_owner_ranks" not in fields
        assert "sample_ids" not in fields
        assert (fields["cp_rank"], fields["cp_size"], fields["tokens_per_block"]) == (rank, 2, 4)
        again = pickle.loads(pickle.dumps(out))
        assert again == out
        assert hash(again) == hash(out)
        assert again != outputs[1 - rank]
        for name in cls.COMPUTED_FIELDS:
            np.testing.assert_array_equal(getattr(again, name), getattr(out, name))
        assert again.summary() == out.summary()


def test_owner_ranks_are_computed_from_the_positions_and_the_layout() -> None:
    """The owner ranks are the layout's (the same on every rank), int32, read-only, computed
    on first read and cached; the summary shows them as before (``id@pos/rOWNER``)."""
    outputs = two_ranks_decoding()
    layout = helix_kv.Layout(2, 4)
    positions = outputs[0].generation_positions
    for out in outputs:
        owners = out.generation_owner_ranks
        assert owners is out.generation_owner_ranks  # cached
        assert owners.dtype == np.int32
        assert not owners.flags.writeable
        assert owners.tolist() == layout.owner_ranks(positions).tolist() == [0, 1, 0]
        generation = dict(out.summary_fields())["generation"]
        assert generation == "0@3/r0 1@6/r1 2@9/r0"
    assert outputs[0].summary() == outputs[1].summary()


def brute_force_sample_ids(out: helix_kv.ScheduleOutput) -> list[int]:
    """The generation ids, then each context id whose chunk completes its prompt."""
    completing = [int(rid) for rid, done in zip(out.context_ids, out.context_completes) if done]
    return [int(rid) for rid in out.generation_ids] + completing


def test_sample_ids_are_computed_from_the_entries() -> None:
    """``sample_ids`` is the generation ids, then the completing context ids: uint64,
    read-only, computed on first read and cached; ``num_samples`` is its length (read before
    or after it, on a fresh output or a pickled one); ``update`` takes the tokens in that
    order. Over a run that chunks, completes prompts and preempts, plain and one step ahead."""
    seen = {"completing": 0, "incomplete": 0, "preempted": 0, "ahead": 0}
    for ahead in (False, True):
        s = scheduler(max_num_tokens=16, chunk_unit=4)
        for rid in range(4):
            s.add_request(rid, np.arange(10 + rid, dtype=np.int32), 20)
        pending: list[helix_kv.ScheduleOutput] = []
        for _ in range(200):
            if not s.has_unfinished() and not pending:
                break
            if s.has_unfinished() and len(pending) < 1 + ahead:
                out = s.schedule()
                again = pickle.loads(pickle.dumps(out))
                expected = brute_force_sample_ids(out)
                assert out.num_samples == len(expected)  # before the array is made
                ids = out.sample_ids
                assert ids is out.sample_ids  # cached
                assert ids.dtype == np.uint64
                assert not ids.flags.writeable
                assert ids.tolist() == expected == again.sample_ids.tolist()
                assert out.num_samples == again.num_samples == len(expected)
                completes = out.context_completes
                seen["completing"] += int(completes.sum())
                seen["incomplete"] += int((~completes).sum())
                seen["preempted"] += len(out.preempted_ids)
                seen["ahead"] += int((out.generation_input_refs >= 0).sum())
                pending.append(out)
                if len(pending) < 1 + ahead and s.has_unfinished():
                    continue
            older = pending.pop(0)
            tokens = (1000 + 7 * np.arange(older.num_samples) + older.step).astype(np.int32)
            finished = set(s.update(tokens).tolist())
            for rid, token in zip(older.sample_ids.tolist(), tokens.tolist()):
                held = s.take_output(rid).token_ids if rid in finished else s.tokens(rid)
                assert int(held[-1]) == token, (rid, older.step)
        assert not s.has_unfinished()
        assert not pending
    assert all(seen.values()), seen


def test_a_pickle_with_wrong_sample_ids_is_refused() -> None:
    """``_from_fields`` computes ``sample_ids``; a given one (old pickles carried it) must be
    what it computes, or the output is refused (the same typed errors as the other computed
    fields)."""
    _, outputs = pressured()
    rebuild = helix_kv.ScheduleOutput._from_fields
    out = next(o for o in outputs if len(o.generation_ids) and o.context_completes.any())
    fields = out.__reduce__()[1][0]
    ids = out.sample_ids
    assert len(ids) >= 2
    assert ids[0] != ids[-1]
    assert rebuild({**fields, "sample_ids": ids}) == out
    assert rebuild({**fields, "sample_ids": ids.copy()}).sample_ids.tolist() == ids.tolist()
    computed = "sample_ids is not what generation_ids, context_ids and context_completes give"
    for wrong in (ids[::-1], ids[:-1], np.append(ids, ids[:1]), ids + 1, ids[:0]):
        with pytest.raises(helix_kv.InvalidArgumentError, match=computed):
            rebuild({**fields, "sample_ids": np.ascontiguousarray(wrong, dtype=np.uint64)})
    with pytest.raises(helix_kv.InvalidTypeError, match="sample_ids"):
        rebuild({**fields, "sample_ids": ids.astype(np.int64)})
    # another step's sample ids are refused
    other = next(o for o in outputs if o.sample_ids.tolist() != ids.tolist())
    with pytest.raises(helix_kv.InvalidArgumentError, match=computed):
        rebuild({**fields, "sample_ids": other.sample_ids})


def test_a_pickle_with_a_bad_placement_or_wrong_computed_arrays_is_refused() -> None:
    """``_from_fields`` needs the placement (a rank of a valid layout) and computes the
    owner ranks and the per-rank arrays; any given must be what it computes (old pickles
    carried them)."""
    cls = helix_kv.ScheduleOutput
    rebuild = cls._from_fields
    ours, theirs = two_ranks_decoding()
    fields = ours.__reduce__()[1][0]
    given = {name: getattr(ours, name) for name in cls.COMPUTED_FIELDS}
    assert rebuild({**fields, **given}) == ours
    computed = "is not what cp_rank, cp_size and tokens_per_block give for generation_positions"
    for name in cls.PER_RANK_FIELDS:
        with pytest.raises(helix_kv.InvalidArgumentError, match=f"{name} {computed}"):
            rebuild({**fields, name: getattr(theirs, name)})
        with pytest.raises(helix_kv.InvalidArgumentError, match=name):
            rebuild({**fields, name: getattr(ours, name)[:-1]})
    # the owner ranks are the same on every rank: another rank's are ours, others are not
    owners = ours.generation_owner_ranks
    assert rebuild({**fields, "generation_owner_ranks": theirs.generation_owner_ranks}) == ours
    for wrong in (1 - owners, owners[:-1], np.zeros(0, dtype=np.int32)):
        with pytest.raises(
            helix_kv.InvalidArgumentError, match=f"generation_owner_ranks {computed}"
        ):
            rebuild({**fields, "generation_owner_ranks": wrong.astype(np.int32)})
    with pytest.raises(helix_kv.InvalidTypeError, match="generation_owner_ranks"):
        rebuild({**fields, "generation_owner_ranks": owners.astype(np.int64)})
    # the owners of another layout (cp_size 3) for the same positions are refused too
    other_layout = helix_kv.Layout(3, 4).owner_ranks(ours.generation_positions)
    assert other_layout.tolist() != owners.tolist()
    with pytest.raises(helix_kv.InvalidArgumentError, match="generation_owner_ranks"):
        rebuild({**fields, "generation_owner_ranks": other_layout})
    with pytest.raises(helix_kv.InvalidTypeError):
        rebuild({**fields, "generation_local_lens": ours.generation_local_lens.astype(np.int32)})
    with pytest.raises(helix_kv.InvalidLengthError, match="generation_past_seen_lens"):
        rebuild({**fields, "generation_past_seen_lens": np.full(3, -1, dtype=np.int64)})
    # an old pickle: the per-rank arrays and no placement
    old = {k: v for k, v in fields.items() if k not in cls.PLACEMENT_FIELDS}
    with pytest.raises(helix_kv.InvalidArgumentError, match="cp_rank is missing"):
        rebuild({**old, **given})
    for changed, error, match in [
        ({"cp_rank": 2}, helix_kv.InvalidArgumentError, "rank 2 is outside"),
        ({"cp_rank": -1}, helix_kv.InvalidArgumentError, "cp_rank"),
        ({"cp_size": 0}, helix_kv.InvalidArgumentError, "cp_size must be at least 1"),
        ({"tokens_per_block": 0}, helix_kv.InvalidArgumentError, "tokens_per_block"),
        ({"cp_size": 2**12, "tokens_per_block": 2**13}, helix_kv.InvalidArgumentError, "exceeds"),
        ({"tokens_per_block": 2**32}, helix_kv.InvalidArgumentError, "tokens_per_block"),
        ({"cp_rank": 1.0}, helix_kv.InvalidTypeError, "cp_rank"),
        ({"cp_size": True}, helix_kv.InvalidTypeError, "cp_size"),
        ({"tokens_per_block": None}, helix_kv.InvalidTypeError, "tokens_per_block"),
    ]:
        with pytest.raises(error, match=match):
            rebuild({**fields, **changed})
    # another rank's placement is a valid output: that rank's
    assert rebuild({**fields, "cp_rank": 1}) == theirs


def test_config_capacity_and_layout_are_the_cores() -> None:
    config = helix_kv.SchedulerConfig(cp_size=4, tokens_per_block=8, kv_tokens=1000)
    assert config.layout == helix_kv.Layout(4, 8)
    ledger = helix_kv.Ledger(config.layout, config.capacity_superblocks)
    assert config.capacity_tokens == config.kv_tokens == ledger.capacity_tokens == 31 * 32


def test_layout_pickles_and_its_batch_slot_mapping_is_the_schedulers() -> None:
    layout = helix_kv.Layout(2, 4)
    assert pickle.loads(pickle.dumps(layout)) == layout
    s = scheduler(max_num_tokens=16, chunk_unit=4)
    for rid in range(4):
        s.add_request(rid, np.arange(10 + rid, dtype=np.int32), 20)
    compared = 0
    while s.has_unfinished():
        out = s.schedule()
        ids = np.concatenate([out.context_ids, out.generation_ids])
        starts = np.concatenate([out.context_starts, out.generation_positions])
        counts = np.concatenate([out.context_lens, np.ones(len(out.generation_ids), np.int64)])
        if len(ids):
            table = s.block_table(ids)
            rows = np.repeat(np.arange(len(ids)), counts)
            positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, counts)])
            expected = s.slot_mapping(ids, starts, counts)
            assert np.array_equal(layout.slot_mapping(table, rows, positions, 0), expected)
            other = layout.slot_mapping(table, rows, positions, 1)
            assert np.array_equal(other >= 0, expected < 0)  # one rank owns each token
            compared += 1
        s.update(np.full(out.num_samples, 3, dtype=np.int32))
    assert compared > 10
    with pytest.raises(helix_kv.InvalidArgumentError, match="falls on page id -1"):
        layout.slot_mapping([[3, -1]], [0], [9], 0)  # padding, on whichever rank
    with pytest.raises(helix_kv.InvalidArgumentError, match="past row 0"):
        layout.slot_mapping([[3, -1]], [0], [16], 1)
