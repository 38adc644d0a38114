"""The scheduler through the binding: configuration, array dtypes and shapes, typed errors
that change nothing, victim policies, serving modes, deadlock remedies, revert."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import helix_kv

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


def make(cp: int = 1, tpb: int = 4, superblocks: int = 16, **overrides) -> helix_kv.Scheduler:
    return helix_kv.Scheduler(
        helix_kv.SchedulerConfig(
            cp_size=cp, tokens_per_block=tpb, kv_superblocks=superblocks, **overrides
        )
    )


def prompt(n: int) -> np.ndarray:
    return np.arange(100, 100 + n, dtype=np.int32)


def step(s: helix_kv.Scheduler, token: int = 7) -> helix_kv.ScheduleOutput:
    out = s.schedule()
    s.update(np.full(out.num_samples, token, dtype=np.int32))
    return out


def snapshot(s: helix_kv.Scheduler) -> tuple:
    return (s.state_digest(), s.queue_ids().tolist(), s.metrics(), s.step_pending)


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
        ({"kv_superblocks": 4, "host_tier_superblocks": 2}, "raise the GPU KV budget"),
        ({"kv_superblocks": 4, "serving_mode": "non_helix", "cp_size": 2}, "cp_size == 1"),
        ({"kv_superblocks": 4, "deadlock_steps": 0}, "deadlock_steps"),
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
    s = make(cp=2, tpb=2, superblocks=6, max_preemptions_per_request=8)
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
    s = make()
    s.add_request(1, [5, 6, 7], 2)
    s.add_request(2, np.array([1, 2], dtype=np.int64), 2)
    out = s.schedule()
    s.update(np.array([8, 9], dtype=np.int64), eos=[0, 1])
    assert out.context_token_ids.tolist() == [5, 6, 7, 1, 2]
    assert s.take_output(2).token_ids.tolist() == [9]
    assert s.tokens(1).tolist() == [5, 6, 7, 8]
    assert s.tokens(1).dtype == np.int32


def test_block_table_and_slot_mapping_follow_the_layout() -> None:
    s = make(cp=2, tpb=2, superblocks=8)
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


def test_summary_lines_are_stable() -> None:
    s = make(cp=2, tpb=2, superblocks=64, max_num_tokens=10, chunk_unit=4)
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


# -- typed errors change nothing ------------------------------------------------------


def test_bad_input_raises_typed_errors_and_changes_nothing() -> None:
    s = make(cp=2, superblocks=8, max_seq_len=60, enable_chunked_prefill=False, max_num_tokens=32)
    s.add_request(1, prompt(8), 4)
    cases = [
        (
            helix_kv.DuplicateRequestError,
            "duplicate request 1",
            lambda: s.add_request(1, prompt(8), 4),
        ),
        (helix_kv.InvalidLengthError, "empty prompt", lambda: s.add_request(2, [], 4)),
        (helix_kv.InvalidLengthError, "max_new_tokens = 0", lambda: s.add_request(2, [1], 0)),
        (helix_kv.InvalidLengthError, "max_new_tokens must be", lambda: s.add_request(2, [1], -3)),
        (
            helix_kv.RequestTooLargeError,
            "max_seq_len = 60",
            lambda: s.add_request(2, prompt(50), 20),
        ),
        (
            helix_kv.RequestTooLargeError,
            "max_num_tokens = 32",
            lambda: s.add_request(2, prompt(30), 6),
        ),
        (helix_kv.InvalidArgumentError, "request ids must be", lambda: s.add_request(-1, [1], 1)),
        (helix_kv.InvalidArgumentError, "must fit int32", lambda: s.add_request(2, [2**40], 1)),
        (
            helix_kv.InvalidArgumentError,
            "priority must be an integer in",
            lambda: s.add_request(2, [1], 1, 2**40),
        ),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.tokens(9)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.request_metrics(9)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.take_output(9)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.request_state(9)),
        (helix_kv.InvalidStateError, "not finished", lambda: s.take_output(1)),
        (helix_kv.InvalidStateError, "call schedule", lambda: s.update([])),
        (helix_kv.InvalidStateError, "call schedule", lambda: s.revert()),
    ]
    for error, needle, call in cases:
        before = snapshot(s)
        with pytest.raises(error, match=needle):
            call()
        assert snapshot(s) == before, needle
    out = s.schedule()
    assert out.sample_ids.tolist() == [1]
    pending = [
        (helix_kv.InvalidStateError, "neither updated nor reverted", lambda: s.schedule()),
        (helix_kv.InvalidArgumentError, "got 2 tokens for the 1 entries", lambda: s.update([1, 2])),
        (helix_kv.InvalidArgumentError, "got 0 eos flags", lambda: s.update([1], [])),
        (helix_kv.InvalidArgumentError, "must fit int32", lambda: s.update([2**33])),
    ]
    for error, needle, call in pending:
        before = snapshot(s)
        with pytest.raises(error, match=needle):
            call()
        assert snapshot(s) == before, needle
    s.update([3], np.array([True]))
    assert s.take_output(1).token_ids.tolist() == [3]
    s.add_request(1, prompt(8), 4)  # the id is free again once its output is taken


def test_every_error_is_a_helix_kv_error() -> None:
    for name in (
        "ConfigError",
        "InvalidArgumentError",
        "InvalidLengthError",
        "UnknownRequestError",
        "DuplicateRequestError",
        "RequestTooLargeError",
        "PreemptionDisabledError",
        "DeadlockError",
        "InvalidStateError",
        "ScheduleMismatchError",
    ):
        assert issubclass(getattr(helix_kv, name), helix_kv.HelixKVError)


# -- policies and modes ---------------------------------------------------------------


def full_pool(policy: str) -> helix_kv.Scheduler:
    """Requests 0..4 prefilled into a pool that is then exactly full."""
    s = make(tpb=4, superblocks=9, victim_policy=policy)
    for request_id, (length, priority) in enumerate([(4, 0), (8, -3), (4, 0), (12, -3), (8, 1)]):
        s.add_request(request_id, prompt(length), 10, priority)
    out = step(s)
    assert out.context_ids.tolist() == [0, 1, 2, 3, 4]
    return s


@pytest.mark.parametrize(
    ("policy", "victim"), [("newest_first", 4), ("least_computed_first", 2), ("priority", 3)]
)
def test_each_victim_policy_picks_what_it_promises(policy: str, victim: int) -> None:
    s = full_pool(policy)
    out = s.schedule()
    assert out.preempted_ids[0] == victim
    assert out.preempted_requester_ids[0] == 0
    assert out.generation_ids[0] == 0
    assert s.request_state(victim) == "waiting"
    assert s.request_metrics(victim).preemptions == 1


def test_guaranteed_no_evict_reserves_everything_at_admission() -> None:
    s = make(superblocks=16, capacity_policy="guaranteed_no_evict")
    s.add_request(0, prompt(10), 30)
    s.schedule()
    assert s.block_table([0]).shape == (1, 10)  # 40 tokens in superblocks of 4
    s.revert()
    assert s.block_table([0]).shape == (1, 0)


def test_disaggregated_generation_refuses_with_a_remedy_and_changes_nothing() -> None:
    s = make(cp=2, tpb=2, superblocks=4, serving_mode="disaggregated_generation")
    s.add_request(0, prompt(8), 8)
    s.add_request(1, prompt(8), 8)
    step(s)
    before = snapshot(s)
    with pytest.raises(helix_kv.PreemptionDisabledError) as info:
        s.schedule()
    message = str(info.value)
    for needle in ("kv_superblocks", "max_batch_size", "guaranteed_no_evict", "aggregated_helix"):
        assert needle in message
    assert snapshot(s) == before
    with pytest.raises(helix_kv.PreemptionDisabledError):
        s.schedule()


def test_non_helix_suspends_to_the_host_tier_before_recomputing() -> None:
    s = make(tpb=4, superblocks=40, serving_mode="non_helix", host_tier_superblocks=6)
    for request_id in range(8):
        s.add_request(request_id, prompt(10), 30)
    while True:
        out = step(s)
        if out.suspended_ids.size or out.preempted_ids.size:
            break
    assert out.suspended_ids.size > 0
    assert s.request_state(int(out.suspended_ids[0])) == "suspended"
    assert s.num_suspended == out.suspended_ids.size
    assert out.suspended_block_counts.sum() == out.suspended_block_ids.size


@pytest.mark.parametrize(("cp", "mode"), [(2, "aggregated_helix"), (1, "non_helix")])
def test_deadlock_fires_with_a_remedy_that_fits_the_mode(cp: int, mode: str) -> None:
    s = make(
        cp=cp,
        tpb=2,
        superblocks=8 if cp == 1 else 6,
        serving_mode=mode,
        max_preemptions_per_request=0,
        deadlock_steps=3,
    )
    for request_id in range(2):
        s.add_request(request_id, prompt(4 * cp), 8)
    for _ in range(40):
        before = snapshot(s)
        try:
            step(s)
        except helix_kv.DeadlockError as error:
            message = str(error)
            break
    else:
        pytest.fail("no deadlock")
    assert snapshot(s) == before
    assert "3 consecutive steps" in message
    assert "max_preemptions_per_request" in message
    if mode == "aggregated_helix":
        assert "host" not in message
    else:
        assert "host_tier_superblocks" in message


def test_revert_restores_state_without_preemption_and_keeps_preemptions() -> None:
    s = make(cp=2, tpb=2, superblocks=32)
    for request_id in range(3):
        s.add_request(request_id, prompt(5 + request_id), 6)
    step(s)
    before = s.state_digest()
    out = s.schedule()
    assert out.preempted_ids.size == 0
    s.revert()
    assert s.state_digest() == before
    assert not s.step_pending

    s = full_pool("newest_first")
    out = s.schedule()
    s.revert()
    assert out.preempted_ids.size > 0
    for victim in out.preempted_ids.tolist():
        assert s.request_state(victim) == "waiting"
        assert s.block_table([victim]).shape == (1, 0)
    assert s.metrics().preemptions == out.preempted_ids.size
    assert s.schedule().step > out.step


def test_admission_after_preemption_is_configurable() -> None:
    for admit in (False, True):
        s = make(tpb=4, superblocks=3, admit_after_preemption=admit)
        s.add_request(0, prompt(4), 6)
        s.add_request(1, prompt(8), 4)
        step(s)
        s.add_request(2, prompt(2), 1)
        out = step(s)
        assert out.preempted_ids.tolist() == [1]
        assert (2 in out.context_ids.tolist()) == admit


def test_counters_and_metrics() -> None:
    s = make(tpb=4, superblocks=64, max_batch_size=2)
    for request_id in range(3):
        s.add_request(request_id, prompt(4), 2 + request_id)
    assert (s.num_live, s.num_waiting, s.num_running, s.num_suspended) == (3, 3, 0, 0)
    first = step(s)
    assert first.context_batch_slots.tolist() == [0, 1]
    assert (s.num_waiting, s.num_running) == (1, 2)
    assert s.request_state(0) == "decoding"
    assert s.queue_ids().tolist() == [0, 1, 2]
    while s.has_unfinished():
        for request_id in s.update(np.full(s.schedule().num_samples, 1, np.int32)).tolist():
            metrics = s.request_metrics(request_id)
            assert metrics.generated_tokens == 2 + request_id
            assert metrics.to_dict()["generated_tokens"] == metrics.generated_tokens
            s.take_output(request_id)
    totals = s.metrics()
    assert totals.finished == 3
    assert totals.computed_tokens == 3 * 4 + (1 + 2 + 3)
    assert totals.kv_used_superblocks == 0
    assert totals.kv_utilization == 0.0
    assert 0.0 < totals.kv_utilization_peak <= 1.0
    assert set(totals.to_dict()) >= {"steps", "preemptions", "kv_utilization_peak"}
    assert "SchedulerMetrics(steps=" in repr(totals)


# -- abort and the output record --------------------------------------------------------


def decoding(s: helix_kv.Scheduler, *request_ids: int, steps: int = 2) -> None:
    for request_id in request_ids:
        s.add_request(request_id, prompt(5), 8)
    for token in range(11, 11 + steps):
        step(s, token)


def test_abort_between_steps_finishes_the_request_with_its_tokens() -> None:
    s = make(superblocks=16)
    decoding(s, 1, 2)
    before = s.state_digest()
    assert s.abort(1) is None
    assert s.state_digest() != before
    assert s.queue_ids().tolist() == [2]
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
    s.abort_many(np.array([2], dtype=np.int64))
    assert s.metrics().kv_used_superblocks == 0
    assert s.host_used_superblocks == 0


def test_abort_while_pending_is_deferred_to_update_or_revert() -> None:
    s = make(superblocks=16)
    decoding(s, 1, 2, 3)
    out = s.schedule()
    assert out.generation_ids.tolist() == [1, 2, 3]
    s.abort_many([3, 1])
    assert s.is_abort_requested(1)
    assert not s.is_abort_requested(2)
    assert s.num_live == 3
    assert s.metrics().aborts == 0
    with pytest.raises(helix_kv.InvalidStateError, match="not finished"):
        s.take_output(1)
    assert s.update([21, 22, 23]).tolist() == [1, 3]
    assert s.take_output(1).token_ids.tolist() == [11, 12]  # 21 was dropped
    assert s.take_output(3).finish_reason == "aborted"
    s.schedule()
    s.abort(2)
    aborted = s.revert()
    assert aborted.dtype == np.uint64
    assert aborted.tolist() == [2]
    assert s.take_output(2).token_ids.tolist() == [11, 12, 22]
    assert s.metrics().kv_used_superblocks == 0
    s.schedule()  # nothing live: an empty step
    assert s.revert().tolist() == []


def test_abort_of_a_finished_request_is_a_no_op_and_unknown_ids_fail() -> None:
    s = make(superblocks=16)
    s.add_request(1, prompt(3), 1)
    step(s, 5)
    before = snapshot(s)
    s.abort(1)
    s.abort_many([1, 1])
    assert snapshot(s) == before
    output = s.take_output(1)
    assert (output.token_ids.tolist(), output.finish_reason) == ([5], "length")
    decoding(s, 2)
    cases = [
        (helix_kv.UnknownRequestError, "unknown request 1", lambda: s.abort(1)),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.abort_many([2, 9])),
        (helix_kv.UnknownRequestError, "unknown request 9", lambda: s.is_abort_requested(9)),
        (helix_kv.InvalidArgumentError, "request ids must be", lambda: s.abort(-1)),
        (helix_kv.InvalidArgumentError, r"0\.\.=2\*\*64-1", lambda: s.abort_many([2, -4])),
    ]
    for error, needle, call in cases:
        before = snapshot(s)
        with pytest.raises(error, match=needle):
            call()
        assert snapshot(s) == before, needle
    assert s.queue_ids().tolist() == [2]


def test_eos_and_length_finish_reasons() -> None:
    s = make(superblocks=16)
    for request_id in (1, 2):
        s.add_request(request_id, prompt(4), 3)
    s.schedule()
    s.update([7, 7], eos=[False, True])
    assert s.take_output(2).finish_reason == "eos"
    while s.has_unfinished():
        step(s)
    assert s.take_output(1).finish_reason == "length"


def test_request_output_is_a_frozen_picklable_record() -> None:
    s = make(superblocks=16)
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
        "metrics=RequestMetrics(preemptions=0, recomputed_tokens=0, steps_waited=0, "
        "generated_tokens=3))"
    )
    long = helix_kv.RequestOutput(1, list(range(40)), "length", helix_kv.RequestMetrics())
    assert "... (40 tokens)" in repr(long)
    metrics = helix_kv.RequestMetrics(preemptions=2, steps_waited=5)
    assert pickle.loads(pickle.dumps(metrics)) == metrics
    with pytest.raises(helix_kv.InvalidArgumentError, match="finish_reason must be"):
        helix_kv.RequestOutput(1, [1], "stop", metrics)
    with pytest.raises(helix_kv.InvalidArgumentError, match="must fit int32"):
        helix_kv.RequestOutput(1, [2**40], "eos", metrics)


def test_abort_of_a_suspended_request_frees_its_host_tier_share() -> None:
    s = make(tpb=4, superblocks=40, serving_mode="non_helix", host_tier_superblocks=6)
    for request_id in range(8):
        s.add_request(request_id, prompt(10), 30)
    while s.num_suspended == 0:
        step(s, 1)
    held = s.host_used_superblocks
    (victim,) = [r for r in s.queue_ids().tolist() if s.request_state(r) == "suspended"][:1]
    s.abort(victim)
    assert s.host_used_superblocks < held
    assert s.take_output(victim).finish_reason == "aborted"
    s.abort_many(s.queue_ids())
    assert (s.host_used_superblocks, s.metrics().kv_used_superblocks, s.num_live) == (0, 0, 0)
