"""The scheduler through the binding: configuration keywords and their errors, array dtypes and
shapes, argument conversions, one error class per core error (and nothing changed), records.

The scheduler's rules (victim policies, serving modes, deadlock remedies, revert, abort in each
state, batch slots, admission) are tested once, in Rust: ``rust/core/tests/scheduler_rules.rs``
and ``scheduler_abort.rs``."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import helix_kv

from ..helpers.scheduler import prompt, scheduler, snapshot, step

UINT64 = (  # request ids: the whole u64 range
    "context_ids",
    "generation_ids",
    "preempted_ids",
    "preempted_requester_ids",
    "suspended_ids",
    "suspended_requester_ids",
    "resumed_ids",
    "sat_out_ids",
    "sample_ids",
)
INT64 = (
    "context_starts",
    "context_lens",
    "generation_positions",
    "generation_local_lens",
    "generation_past_seen_lens",
    "suspended_block_counts",
)
INT32 = (
    "context_batch_slots",
    "context_token_ids",
    "generation_owner_ranks",
    "generation_input_tokens",
    "generation_batch_slots",
    "suspended_block_ids",
)
BOOL = ("context_completes", "generation_active")


# -- configuration --------------------------------------------------------------------


def test_config_defaults_and_attributes() -> None:
    cfg = helix_kv.SchedulerConfig(kv_superblocks=64)
    assert (cfg.cp_size, cfg.cp_rank, cfg.tokens_per_block) == (1, 0, 32)
    assert (cfg.max_batch_size, cfg.max_num_tokens, cfg.max_seq_len) == (256, 8192, 131072)
    assert cfg.enable_chunked_prefill is True
    assert cfg.chunk_unit is None
    assert cfg.capacity_policy == "max_utilization"
    assert cfg.serving_mode == "aggregated_helix"
    assert cfg.victim_policy == "newest_first"
    assert cfg.admission_policy == "fcfs"
    assert cfg.long_prefill_token_threshold == 0
    assert cfg.long_prefill_token_threshold_adaptive is False
    assert (cfg.max_preemptions_per_request, cfg.deadlock_steps) == (8, 64)
    assert cfg.admit_after_preemption is False
    assert cfg.kv_superblocks == cfg.capacity_superblocks == 64
    assert cfg.kv_tokens == 64 * 32


def test_kv_tokens_round_down_to_superblocks() -> None:
    cfg = helix_kv.SchedulerConfig(cp_size=2, tokens_per_block=16, kv_tokens=100)
    assert cfg.kv_superblocks == 3
    with pytest.raises(helix_kv.ConfigError, match="less than one superblock"):
        helix_kv.SchedulerConfig(cp_size=2, tokens_per_block=16, kv_tokens=31)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "exactly one of kv_superblocks"),
        ({"kv_superblocks": 4, "kv_tokens": 400}, "exactly one of kv_superblocks"),
        ({"kv_superblocks": 0}, "capacity_superblocks"),
        ({"kv_superblocks": -1}, "kv_superblocks must be"),
        ({"kv_superblocks": 2**31}, "capacity_superblocks = 2147483648 is more than 2147483647"),
        ({"kv_tokens": 2**31 * 32}, "int32 page ids"),
        ({"kv_superblocks": 4, "cp_size": 0}, "cp_size"),
        ({"kv_superblocks": 4, "cp_rank": 1}, "cp_rank = 1 must be below cp_size = 1"),
        ({"kv_superblocks": 4, "max_num_tokens": 16}, "chunk_unit"),
        ({"kv_superblocks": 4, "victim_policy": "oldest"}, "newest_first, least_computed_first"),
        ({"kv_superblocks": 4, "serving_mode": "x"}, "aggregated_helix, non_helix"),
        ({"kv_superblocks": 4, "capacity_policy": "x"}, "guaranteed_no_evict"),
        (
            {
                "kv_superblocks": 4,
                "serving_mode": "disaggregated_generation",
                "host_tier_superblocks": 2,
            },
            "disaggregated generation server",
        ),
        ({"kv_superblocks": 4, "serving_mode": "non_helix", "cp_size": 2}, "cp_size == 1"),
        ({"kv_superblocks": 4, "deadlock_steps": 0}, "deadlock_steps"),
        ({"kv_superblocks": 4, "admission_policy": "lifo"}, "fcfs, priority"),
        ({"kv_superblocks": 4, "long_prefill_token_threshold": -1}, r"in 0\.\.=2\*\*32-1, got -1"),
        (
            {
                "kv_superblocks": 4,
                "long_prefill_token_threshold": 64,
                "enable_chunked_prefill": False,
            },
            "long_prefill_token_threshold = 64 .* needs chunked prefill",
        ),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, needle: str) -> None:
    with pytest.raises(helix_kv.ConfigError, match=needle):
        helix_kv.SchedulerConfig(**kwargs)


def test_config_round_trips_and_compares() -> None:
    cfg = helix_kv.SchedulerConfig(cp_size=4, tokens_per_block=8, kv_tokens=1000, chunk_unit=16)
    assert helix_kv.SchedulerConfig(**cfg.to_dict()) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert hash(cfg) == hash(helix_kv.SchedulerConfig(**cfg.to_dict()))
    other = cfg.with_rank(3)
    assert other.cp_rank == 3
    assert other != cfg
    assert other.with_rank(0) == cfg
    with pytest.raises(helix_kv.ConfigError, match="cp_rank"):
        cfg.with_rank(4)
    assert "SchedulerConfig(cp_size=4" in repr(cfg)
    with pytest.raises(TypeError):
        helix_kv.SchedulerConfig(4)  # keyword-only


# -- arrays ---------------------------------------------------------------------------


def test_every_output_array_has_its_dtype_and_shape() -> None:
    s = scheduler(cp=2, tpb=2, superblocks=6, max_preemptions_per_request=8)
    s.add_request(1, prompt(4), 12)
    s.add_request(2, prompt(5), 12)
    seen_preemption = False
    while s.has_unfinished():
        out = s.schedule()
        for name in UINT64:
            assert getattr(out, name).dtype == np.uint64, name
        for name in INT64:
            assert getattr(out, name).dtype == np.int64, name
        for name in INT32:
            assert getattr(out, name).dtype == np.int32, name
        for name in BOOL:
            assert getattr(out, name).dtype == np.bool_, name
        for name in UINT64 + INT64 + INT32 + BOOL:
            assert getattr(out, name).ndim == 1, name
        n_ctx, n_gen = out.context_ids.size, out.generation_ids.size
        for name in UINT64 + INT64 + INT32 + BOOL:
            if name.startswith("context_") and name != "context_token_ids":
                assert getattr(out, name).size == n_ctx, name
            if name.startswith("generation_"):
                assert getattr(out, name).size == n_gen, name
        assert out.context_token_ids.size == out.context_lens.sum()
        assert out.preempted_requester_ids.size == out.preempted_ids.size
        assert out.num_samples == out.sample_ids.size
        assert out.num_tokens == out.context_lens.sum() + n_gen
        assert isinstance(out.digest, int)
        assert out.generation_ids is out.generation_ids  # built once, then cached
        seen_preemption |= out.preempted_ids.size > 0
        finished = s.update(np.full(out.num_samples, 3, dtype=np.int32))
        assert finished.dtype == np.uint64
        for request_id in finished.tolist():
            taken = s.take_output(request_id)
            assert taken.token_ids.dtype == np.int32
            assert taken.token_ids.tolist() == [3] * 12
            assert taken.finish_reason == "length"
    assert seen_preemption


def test_inputs_accept_lists_and_other_integer_dtypes() -> None:
    s = scheduler()
    s.add_request(1, [5, 6, 7], 2)
    s.add_request(2, np.array([1, 2], dtype=np.int64), 2)
    out = s.schedule()
    s.update(np.array([8, 9], dtype=np.int64), eos=[0, 1])
    assert out.context_token_ids.tolist() == [5, 6, 7, 1, 2]
    finished = s.take_output(2)  # eos flags as 0/1 ints
    assert (finished.token_ids.tolist(), finished.finish_reason) == ([9], "eos")
    assert s.tokens(1).tolist() == [5, 6, 7, 8]
    assert s.tokens(1).dtype == np.int32


def test_block_table_and_slot_mapping_follow_the_layout() -> None:
    s = scheduler(cp=2, tpb=2, superblocks=8)
    s.add_request(1, prompt(6), 2)
    out = s.schedule()
    table = s.block_table([1])
    assert table.dtype == np.int32
    assert table.shape == (1, 2)  # 6 tokens in superblocks of 4
    slots = s.slot_mapping(out.context_ids, out.context_starts, out.context_lens)
    assert slots.dtype == np.int64
    owner = (np.arange(6) // 2) % 2
    assert np.array_equal(slots >= 0, owner == 0)
    assert s.block_table([1], width=4)[0, 2:].tolist() == [-1, -1]


def test_block_table_tails_give_each_table_past_its_start() -> None:
    s = scheduler(tpb=2, superblocks=8)
    s.add_request(1, prompt(5), 4)
    s.add_request(2, prompt(2, 2), 4)
    step(s)
    full = s.block_table([1, 2])
    pages, counts = s.block_table_tails(np.array([1, 2], dtype=np.uint64), [1, 0])
    assert (pages.dtype, counts.dtype) == (np.int32, np.int64)
    assert counts.tolist() == [2, 1]  # 3 superblocks past 1, 1 past 0
    assert pages.tolist() == [*full[0, 1:3].tolist(), full[1, 0]]
    pages, counts = s.block_table_tails([1, 2], [3, 4])
    assert (pages.tolist(), counts.tolist()) == ([], [0, -3])  # request 2 holds 1, not 4
    pages, counts = s.block_table_tails([], [])
    assert (pages.shape, counts.shape) == ((0,), (0,))


def test_block_table_tails_show_a_superblock_rejected_drafts_gave_back() -> None:
    s = scheduler(tpb=4, superblocks=8, num_speculative_tokens=3)
    s.add_request(1, prompt(3), 8)
    step(s)  # prefill: positions 0..2 in superblock 0, token 3 sampled
    _, held = s.block_table_tails([1], [0])
    s.propose_drafts([1], [3], [5, 6, 7])
    out = s.schedule()  # position 3 and drafts 4..6: a second superblock
    _, grown = s.block_table_tails([1], held)
    assert (held.tolist(), grown.tolist()) == ([1], [1])
    s.update(np.zeros(out.num_samples, np.int32), accepted=[0])
    _, after = s.block_table_tails([1], held + grown)
    assert after.tolist() == [-1]  # every draft rejected: the superblock went back


def test_grow_block_tables_gives_the_new_pages_and_counts_them_held() -> None:
    s = scheduler(tpb=2, superblocks=8)
    s.add_request(1, prompt(5), 4)
    s.add_request(2, prompt(2, 2), 4)
    step(s)
    full = s.block_table([1, 2])
    held = np.array([0, 1, 0, 0], np.int64)  # by request id: request 1 holds one
    pages, rows, counts = s.grow_block_tables(np.array([1, 2], np.uint64), held)
    assert (pages.dtype, rows.dtype, counts.dtype) == (np.int32, np.int64, np.int64)
    assert (rows.tolist(), counts.tolist()) == ([0, 1], [2, 1])
    assert pages.tolist() == [*full[0, 1:3].tolist(), full[1, 0]]
    assert held.tolist() == [0, 3, 1, 0]
    # nothing new: no row; the same as block_table_tails
    pages, rows, counts = s.grow_block_tables([2, 1], held)
    assert (pages.tolist(), rows.tolist(), counts.tolist()) == ([], [], [])
    assert s.block_table_tails([1, 2], held[[1, 2]])[1].tolist() == [0, 0]
    # a table shorter than held: None, and nothing written
    held[2] = 4
    before = held.copy()
    assert s.grow_block_tables([1, 2], held) is None
    assert held.tolist() == before.tolist()


def test_queue_holdings_follow_admission_and_aborts() -> None:
    s = scheduler(tpb=4, superblocks=4, max_num_tokens=8)
    for request_id in (1, 2, 3):
        s.add_request(request_id, prompt(4, request_id), 4)
    ids, held, aborting = s.queue_holdings()
    assert (ids.dtype, held.dtype, aborting.dtype) == (np.uint64, np.int64, np.bool_)
    assert (ids.tolist(), held.tolist(), aborting.tolist()) == ([1, 2, 3], [0] * 3, [False] * 3)
    s.schedule()  # admits 1 and 2: they hold their superblocks while the step is pending
    assert s.queue_holdings()[1].tolist() == [1, 1, 0]
    s.abort(2)  # deferred: the step is pending
    ids, held, aborting = s.queue_holdings()
    assert (held.tolist(), aborting.tolist()) == ([1, 1, 0], [False, True, False])
    assert s.update(np.zeros(2, np.int32)).tolist() == [2]  # the abort took effect
    ids, held, aborting = s.queue_holdings()
    assert (ids.tolist(), held.tolist(), aborting.tolist()) == ([1, 3], [1, 0], [False, False])


def test_block_table_tails_refuse_bad_arguments() -> None:
    s = scheduler()
    s.add_request(1, prompt(3), 2)
    with pytest.raises(helix_kv.UnknownRequestError):
        s.block_table_tails([1, 5], [0, 0])
    with pytest.raises(helix_kv.InvalidArgumentError, match="2 request ids and 1 starts"):
        s.block_table_tails([1, 1], [0])
    with pytest.raises(helix_kv.InvalidLengthError):
        s.block_table_tails([1], [-1])


def test_summary_lines_are_stable() -> None:
    s = scheduler(cp=2, tpb=2, superblocks=64, max_num_tokens=10, chunk_unit=4)
    s.add_request(0, prompt(21), 2)
    out = s.schedule()
    lines = out.summary().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "step",
        "num_tokens",
        "context",
        "incomplete_prompts",
        "generation",
        "preempted",
        "suspended",
        "resumed",
        "sat_out",
        "batch_slots",
        "digest",
    ]
    assert "context: 0:0+8!" in lines
    assert "incomplete_prompts: 0" in lines
    assert f"digest: {out.digest:016x}" in lines


# -- one error class per core error; a refused call changes nothing -----------------------


def refused(s: helix_kv.Scheduler, error: type, needle: str, call) -> None:
    before = snapshot(s)
    with pytest.raises(error, match=needle):
        call()
    assert snapshot(s) == before, needle


def test_each_core_error_raises_its_own_class_and_changes_nothing() -> None:
    """Each ``CoreError`` variant (when the core raises it is tested in Rust) comes out as its
    own HelixKVError subclass carrying the core's message; ConfigError is
    ``test_config_errors_name_the_field``, the two pressure errors are the test below."""
    s = scheduler(cp=2, superblocks=8)
    s.add_request(1, prompt(8), 4)
    cases = [
        (helix_kv.DuplicateRequestError, "duplicate request 1", lambda: s.add_request(1, [1], 4)),
        (helix_kv.InvalidLengthError, "empty prompt", lambda: s.add_request(2, [], 4)),
        (helix_kv.RequestTooLargeError, "whole KV pool", lambda: s.add_request(2, prompt(99), 4)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.tokens(9)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.request_metrics(9)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.take_output(9)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.request_state(9)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.is_abort_requested(9)),
        (helix_kv.InvalidStateError, "not finished", lambda: s.take_output(1)),
        (helix_kv.InvalidStateError, "call schedule", lambda: s.update([])),
        (helix_kv.InvalidStateError, "call schedule", lambda: s.revert()),
    ]
    for error, needle, call in cases:
        refused(s, error, needle, call)
    s.schedule()
    pending = [
        (helix_kv.InvalidArgumentError, "got 2 tokens for the 1 entries", lambda: s.update([1, 2])),
        (helix_kv.InvalidArgumentError, "got 0 eos flags", lambda: s.update([1], [])),
    ]
    for error, needle, call in pending:
        refused(s, error, needle, call)
    s.schedule()  # one step ahead is allowed, a third pending step is not
    refused(s, helix_kv.InvalidStateError, "at most one ahead", lambda: s.schedule())
    # update checks the oldest pending step's samples
    refused(s, helix_kv.InvalidArgumentError, "for the 1 entries", lambda: s.update([1, 2]))


def test_arguments_the_core_never_sees_are_refused_by_the_binding() -> None:
    """Conversions fail before the core is called: typed errors, nothing changed (every
    hostile value of every call is ``test_hostile_inputs.py``)."""
    s = scheduler(cp=2, superblocks=8)
    s.add_request(1, prompt(8), 4)
    cases = [
        (helix_kv.InvalidLengthError, "max_new_tokens must be", lambda: s.add_request(2, [1], -3)),
        (helix_kv.InvalidArgumentError, "request ids must be", lambda: s.add_request(-1, [1], 1)),
        (helix_kv.InvalidArgumentError, "must fit int32", lambda: s.add_request(2, [2**40], 1)),
        (
            helix_kv.InvalidArgumentError,
            "priority must be an integer in",
            lambda: s.add_request(2, [1], 1, 2**40),
        ),
        (helix_kv.InvalidArgumentError, "request ids must be", lambda: s.abort(-1)),
        (helix_kv.InvalidArgumentError, r"0\.\.=2\*\*64-1", lambda: s.abort_many([1, -4])),
    ]
    for error, needle, call in cases:
        refused(s, error, needle, call)
    s.schedule()
    refused(s, helix_kv.InvalidArgumentError, "must fit int32", lambda: s.update([2**33]))
    s.update([3], np.array([True]))
    assert s.take_output(1).token_ids.tolist() == [3]
    s.add_request(1, prompt(8), 4)  # the id is free again once its output is taken


def test_pressure_errors_raise_their_classes_and_change_nothing() -> None:
    """PreemptionDisabledError (a disaggregated server out of pages) and DeadlockError (no
    progress for deadlock_steps steps); their remedies are tested in Rust."""
    s = scheduler(cp=2, tpb=2, superblocks=4, serving_mode="disaggregated_generation")
    for request_id in range(2):
        s.add_request(request_id, prompt(8), 8)
    step(s)
    refused(s, helix_kv.PreemptionDisabledError, "kv_superblocks", s.schedule)

    s = scheduler(tpb=2, superblocks=8, max_preemptions_per_request=0, deadlock_steps=3)
    for request_id in range(2):
        s.add_request(request_id, prompt(4), 8)
    before: list[tuple] = []

    def run() -> None:
        for _ in range(40):
            before.append(snapshot(s))
            step(s)

    with pytest.raises(helix_kv.DeadlockError, match="3 consecutive steps"):
        run()
    assert snapshot(s) == before[-1]


# -- accessors and records ----------------------------------------------------------------


def test_counters_metrics_and_states_read_through() -> None:
    s = scheduler(tpb=4, superblocks=64, max_batch_size=2)
    for request_id in range(3):
        s.add_request(request_id, prompt(4), 2 + request_id)
    assert (s.num_live, s.num_waiting, s.num_running, s.num_suspended) == (3, 3, 0, 0)
    assert s.request_state(0) == "waiting"
    step(s)
    assert (s.num_waiting, s.num_running) == (1, 2)
    assert s.request_state(0) == "decoding"
    assert s.queue_ids().tolist() == [0, 1, 2]
    assert s.queue_ids().dtype == np.uint64
    while s.has_unfinished():
        for request_id in s.update(np.full(s.schedule().num_samples, 1, np.int32)).tolist():
            metrics = s.request_metrics(request_id)
            assert metrics.generated_tokens == 2 + request_id
            assert metrics.to_dict()["generated_tokens"] == metrics.generated_tokens
            s.take_output(request_id)
    totals = s.metrics()
    assert totals.finished == 3
    assert totals.kv_used_superblocks == 0
    assert totals.kv_utilization == 0.0
    assert 0.0 < totals.kv_utilization_peak <= 1.0
    assert set(totals.to_dict()) >= {"steps", "preemptions", "kv_utilization_peak"}
    assert "SchedulerMetrics(steps=" in repr(totals)


def decoding(s: helix_kv.Scheduler, *request_ids: int, steps: int = 2) -> None:
    for request_id in request_ids:
        s.add_request(request_id, prompt(5), 8)
    for token in range(11, 11 + steps):
        step(s, token)


def test_an_aborted_request_hands_back_its_record_and_abort_ids_convert() -> None:
    s = scheduler(superblocks=16)
    decoding(s, 1, 2, 3)
    assert s.abort(1) is True
    output = s.take_output(1)
    assert isinstance(output, helix_kv.RequestOutput)
    assert output.request_id == 1
    assert output.token_ids.tolist() == [11, 12]
    assert output.token_ids.dtype == np.int32
    assert output.finish_reason == "aborted"
    assert output.metrics == helix_kv.RequestMetrics(generated_tokens=2)
    metrics = s.metrics()
    assert (metrics.aborts, metrics.finished) == (1, 0)
    assert metrics.to_dict()["aborts"] == 1
    assert "aborts=1" in repr(metrics)
    s.schedule()
    s.abort_many(np.array([3], dtype=np.int64))  # while pending: takes effect at revert
    assert s.is_abort_requested(3) is True
    aborted = s.revert()
    assert aborted.dtype == np.uint64
    assert aborted.tolist() == [3]
    s.abort_many([2, 2])
    assert (s.metrics().kv_used_superblocks, s.host_used_superblocks) == (0, 0)


def test_request_output_is_a_frozen_picklable_record() -> None:
    s = scheduler(superblocks=16)
    decoding(s, 7, steps=3)
    s.abort(7)
    output = s.take_output(7)
    with pytest.raises(ValueError, match="read-only"):
        output.token_ids[0] = 1
    with pytest.raises(AttributeError):
        output.finish_reason = "length"  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(output))
    assert again == output
    assert hash(again) == hash(output)
    assert again.token_ids.tolist() == [11, 12, 13]
    assert output != helix_kv.RequestOutput(7, [11, 12, 13], "length", output.metrics)
    assert output != helix_kv.RequestOutput(7, [11, 12], "aborted", output.metrics)
    assert output != "not an output"
    assert repr(output) == (
        "RequestOutput(request_id=7, token_ids=[11, 12, 13], finish_reason='aborted', "
        "metrics=RequestMetrics(victim_choices=0, recomputed_tokens=0, steps_waited=0, "
        "generated_tokens=3))"
    )
    long = helix_kv.RequestOutput(1, list(range(40)), "length", helix_kv.RequestMetrics())
    assert "... (40 tokens)" in repr(long)
    metrics = helix_kv.RequestMetrics(victim_choices=2, steps_waited=5)
    assert pickle.loads(pickle.dumps(metrics)) == metrics
    with pytest.raises(helix_kv.InvalidArgumentError, match="finish_reason must be"):
        helix_kv.RequestOutput(1, [1], "stop", metrics)
    with pytest.raises(helix_kv.InvalidArgumentError, match="must fit int32"):
        helix_kv.RequestOutput(1, [2**40], "eos", metrics)


def _recycling_run(keep: bool, read: bool) -> list[helix_kv.ScheduleOutput]:
    """A run with growing, finishing and preempted requests. ``keep``: every output stays
    alive (none is dropped, so none lends its buffers to the next step); otherwise each is
    dropped once closed. ``read``: some arrays are read (made numpy) before the drop."""
    s = scheduler(cp=2, tpb=2, superblocks=12, max_batch_size=6)
    kept: list[helix_kv.ScheduleOutput] = []
    copies: list[helix_kv.ScheduleOutput] = []
    for r in range(7):
        s.add_request(r, prompt(3 + 2 * r, r), 4 + r)
    for _ in range(60):
        out = s.schedule()
        if read:
            out.generation_ids, out.generation_local_lens  # noqa: B018
        copies.append(pickle.loads(pickle.dumps(out)))
        s.update(np.full(out.num_samples, 5, dtype=np.int32))
        if keep:
            kept.append(out)
        del out
    return copies


@pytest.mark.parametrize("read", [False, True])
def test_outputs_dropped_lend_their_buffers_without_changing_any_step(read: bool) -> None:
    """A dropped output's buffers go to the next ``schedule()``; every step is the same as
    in a run that keeps every output alive (so never reuses one)."""
    recycled = _recycling_run(keep=False, read=read)
    fresh = _recycling_run(keep=True, read=read)
    assert any(o.preempted_ids.size for o in fresh), "the run must preempt"
    assert recycled == fresh


def test_arrays_read_from_a_dropped_output_stay_as_they_were() -> None:
    """An array Python read owns its buffer: dropping its output and scheduling again
    (which reuses the output's other buffers) leaves it unchanged."""
    s = scheduler(cp=2, tpb=2, superblocks=12)
    for r in range(3):
        s.add_request(r, prompt(4, r), 20)
    step(s)
    out = s.schedule()
    ids, positions = out.generation_ids, out.generation_positions
    expected = (ids.copy(), positions.copy())
    s.update(np.full(out.num_samples, 5, dtype=np.int32))
    del out
    for _ in range(5):
        step(s)
    assert ids.tolist() == expected[0].tolist()
    assert positions.tolist() == expected[1].tolist()


def test_abort_answers_whether_each_id_was_live_and_unknown_ids_are_no_ops() -> None:
    """An abort of an id with no live request (never added, finished with its output taken or
    not) changes nothing and answers False; a live one answers True (also while its abort is
    pending); ``abort_many`` answers, per id, whether it was live when the call was made."""
    s = scheduler(cp=2, superblocks=8)
    s.add_request(1, prompt(8), 4)
    s.add_request(2, prompt(8), 1)
    s.add_request(3, prompt(8), 4)
    before = snapshot(s)
    assert s.abort(9) is False
    live = s.abort_many(np.array([9, 7], dtype=np.int64))
    assert live.dtype == np.bool_
    assert live.tolist() == [False, False]
    assert snapshot(s) == before, "unknown ids change nothing"
    out = s.schedule()
    assert s.update(np.full(out.num_samples, 5, dtype=np.int32)).tolist() == [2]  # 1 token
    before = snapshot(s)
    assert s.abort(2) is False, "finished, output untaken"
    assert snapshot(s) == before
    assert s.take_output(2).finish_reason == "length", "it keeps its own reason"
    before = snapshot(s)
    assert s.abort(2) is False, "finished, output taken"
    assert snapshot(s) == before
    assert s.abort_many([3, 9, 3]).tolist() == [True, False, True]
    assert s.take_output(3).finish_reason == "aborted"
    s.schedule()
    assert s.abort_many([1, 1]).tolist() == [True, True], "marked while the step is pending"
    assert s.is_abort_requested(1)
    assert s.metrics().aborts == 1


# -- admission order and the prefill cap (their rules: rust/core/tests/scheduler_rules.rs) --


def test_priority_admission_orders_the_queue_and_the_admissions() -> None:
    """``admission_policy="priority"``: higher priority first, ties in arrival order; the
    queue, the admissions and ``update``'s finished ids follow it."""
    priorities = [0, 5, 1, 5, -2, 1]
    for policy, order in (("fcfs", [0, 1, 2, 3, 4, 5]), ("priority", [1, 3, 2, 5, 0, 4])):
        # a budget of one unchunked prompt a step: one admission each, each done at once
        s = scheduler(
            1, 4, 16, admission_policy=policy, max_num_tokens=8, enable_chunked_prefill=False
        )
        for request_id, priority in enumerate(priorities):
            s.add_request(request_id, prompt(8, request_id), 1, priority)
        assert s.queue_ids().tolist() == order, policy
        admitted = []
        for _ in priorities:
            out = s.schedule()
            admitted += out.context_ids.tolist()
            finished = s.update(np.full(out.num_samples, 7, dtype=np.int32))
            assert finished.tolist() == out.context_ids.tolist()
        assert admitted == order, policy
        assert helix_kv.SchedulerConfig.ADMISSION_POLICIES == ("fcfs", "priority")


def test_the_prefill_cap_shares_a_step_and_leaves_a_lone_request_alone() -> None:
    s = scheduler(1, 4, 64, max_num_tokens=64, long_prefill_token_threshold=16)
    s.add_request(0, prompt(40, 0), 2)
    s.add_request(1, prompt(40, 1), 2)
    out = step(s)
    assert out.context_lens.tolist() == [16, 16]
    assert out.context_completes.tolist() == [False, False]
    alone = scheduler(1, 4, 64, max_num_tokens=64, long_prefill_token_threshold=16)
    alone.add_request(0, prompt(40, 0), 2)
    assert step(alone).context_lens.tolist() == [40]
    fair = scheduler(
        1, 4, 64, max_num_tokens=64, long_prefill_token_threshold=8,
        long_prefill_token_threshold_adaptive=True,
    )  # fmt: skip
    fair.add_request(0, prompt(40, 0), 2)
    fair.add_request(1, prompt(40, 1), 2)
    assert step(fair).context_lens.tolist() == [32, 32]  # max(8, 64 // 2)
