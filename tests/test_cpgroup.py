"""SimulatedCPGroup: cp schedulers in one process fed the same calls, their outputs compared
every step; divergence reported with the ranks and fields; aborts, reverts and eos flags
reach every rank.

The scheduler's rules under pressure (replay, victims, the ladder, aborts in every state) are
tested in Rust by a group of the same design (``rust/core/tests/scheduler_group.rs``); here
two pressured runs of the Python harness (``tests/helpers/harness.py``) carry a group through
every array the binding hands out: slot mappings, block tables, suspended pages, resumes."""

from __future__ import annotations

import types

import numpy as np
import pytest

import helix_kv

from .helpers.harness import Executor, Spec, assert_matches_reference_with_aborts
from .helpers.scheduler import config


def run_with_aborts(
    cfg: helix_kv.SchedulerConfig, specs, revert_every: int = 0, overlap: bool = False
):
    """Runs ``specs`` with their aborts, then the survivors alone: same tokens. With
    ``overlap`` the executor schedules one step ahead (and reverts the newest step)."""
    result = Executor(cfg, overlap=overlap).run(specs, revert_every=revert_every)
    assert_matches_reference_with_aborts(specs, result)
    survivors = [
        Spec(
            s.request_id,
            s.prompt_len,
            s.max_new_tokens,
            s.priority,
            s.arrival_step,
            shared_prefix=s.shared_prefix,
        )
        for s in specs
        if s.request_id not in result.aborted
    ]
    alone = Executor(cfg, overlap=overlap).run(survivors, revert_every=revert_every)
    assert alone.outputs == result.outputs, "aborts changed a surviving request's output"
    return result


def aborting(spec: Spec, state: str, pending: bool) -> Spec:
    """``spec``, aborted the first time it is seen in ``state``."""
    return Spec(
        spec.request_id,
        spec.prompt_len,
        spec.max_new_tokens,
        spec.priority,
        spec.arrival_step,
        abort_step=0,
        abort_pending=pending,
        abort_state=state,
        shared_prefix=spec.shared_prefix,
    )


#: Request -> (the state it is aborted in, while a step is pending).
EVERY_STATE = {
    1: ("prefilling", False),
    2: ("decoding", True),
    3: ("waiting", False),
    5: ("recompute-paused", False),
    6: ("recompute-paused", True),
    7: ("prefilling", True),
    8: ("recompute-paused", False),
    9: ("recompute-paused", True),
    10: ("recompute-paused", True),
    11: ("decoding", False),
    12: ("recompute-paused", False),
    13: ("waiting", True),
    15: ("recompute-paused", True),
}


@pytest.mark.parametrize("caching", [False, True], ids=["no_cache", "prefix_cache"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_pressured_group_with_chunks_aborts_and_reverts_replays_exactly(
    cp: int, overlap: bool, caching: bool
) -> None:
    # With prefix caching every prompt opens with the same 32 tokens (whole superblocks).
    shared = 32 if caching else 0
    specs = []
    for i in range(16):
        spec = Spec(i, 10 + (i * 7) % 30, 24, (i * 5) % 3 - 1, i // 3, shared_prefix=shared)
        if i in EVERY_STATE:
            spec = aborting(spec, *EVERY_STATE[i])
        elif i == 14:  # a fixed step, whatever its state then
            spec = Spec(
                i, spec.prompt_len, 24, spec.priority, spec.arrival_step, 40, shared_prefix=shared
            )
        specs.append(spec)
    cfg = config(
        cp, 4, kv_tokens=192 + 2 * shared, max_num_tokens=24, chunk_unit=8,
        victim_policy="priority", enable_prefix_caching=caching,
    )  # fmt: skip
    result = run_with_aborts(cfg, specs, revert_every=5, overlap=overlap)
    if caching:
        assert result.cached_tokens > 0
        assert result.metrics.prefix_cache_hits > 0
    # what the run must have carried through the group for the test to mean anything
    assert result.metrics.preemptions > 0
    assert result.reverted > 0
    assert result.metrics.aborts == len(result.aborted) >= 8
    # one step ahead, a step is always pending: every abort waits for a step's close (with
    # the cache, admissions start later in their prompts, so the states met differ)
    states = ("waiting", "decoding", "recompute-paused") if caching else STATES
    for state in states:
        for when in (" while pending",) if overlap else ("", " while pending"):
            assert state + when in result.abort_states, (state + when, result.abort_states)


STATES = ("waiting", "prefilling", "decoding", "recompute-paused")


@pytest.mark.parametrize("caching", [False, True], ids=["no_cache", "prefix_cache"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_host_tier_group_suspends_resumes_and_aborts_suspended_requests(
    overlap: bool, caching: bool
) -> None:
    # With the cache, requests 0, 2 and 4 share a system prompt (from their first step, where
    # they are admitted together: same-step sharing): a victim sharing it is recompute-paused
    # (never copied out from under the others), the others suspend (6 and 7 are aborted so).
    def shared(i: int) -> int:
        return 8 if caching and i in (0, 2, 4) else 0

    specs = [Spec(i, 10, 30, shared_prefix=shared(i)) for i in range(8)]
    specs[2] = Spec(2, 10, 30, abort_step=18, shared_prefix=shared(2))
    for i, pending in ((7, False), (6, True)):
        specs[i] = aborting(specs[i], "suspended", pending)
    cfg = config(
        1, 4, kv_tokens=160 + 8 * caching, serving_mode="non_helix", host_tier_superblocks=6,
        enable_prefix_caching=caching,
    )  # fmt: skip
    result = run_with_aborts(cfg, specs, revert_every=4, overlap=overlap)
    if caching:
        metrics = result.metrics
        assert metrics.prefix_cache_hits + metrics.prefix_cache_recompute_hits > 0
    # suspended pages copied out, back in, and dropped; recompute once the host tier is full
    assert result.metrics.suspensions > 0
    assert result.resumed > 0
    assert result.metrics.preemptions > 0
    expected = {"suspended while pending"} if overlap else {"suspended", "suspended while pending"}
    assert expected <= result.abort_states


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("policy", helix_kv.SchedulerConfig.SUSPEND_POLICIES)
def test_aggregated_helix_with_a_host_tier_suspends_and_resumes_by_host_page(
    cp: int, policy: str
) -> None:
    # Decode pressure, then chunked-prefill pressure; aborts of suspended requests and
    # reverted steps mixed in. The harness copies each rank's share of every page through
    # its own host pool by the schedules' host page ids.
    decode = [Spec(i, 10, 30) for i in range(8)]
    decode[6] = aborting(decode[6], "suspended", True)
    chunked = [Spec(i, 30 + 9 * i, 12, 0, i // 2) for i in range(6)]
    for specs, extra in ((decode, {}), (chunked, {"max_num_tokens": 32, "chunk_unit": 8})):
        cfg = config(
            cp, 4, kv_tokens=160, host_tier_superblocks=48 // cp, suspend_policy=policy, **extra
        )
        result = run_with_aborts(cfg, specs, revert_every=5)
        metrics = result.metrics
        assert metrics.suspensions + metrics.preemptions > 0, (cp, policy)
        if specs is decode or policy != "recompute_first":  # it suspends decoding victims only
            assert metrics.suspensions > 0, (cp, policy)
            assert metrics.suspended_superblocks > 0, (cp, policy)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_full_aggregated_host_tier_falls_back_to_recompute(cp: int) -> None:
    specs = [Spec(i, 10, 30) for i in range(10)]
    cfg = config(cp, 4, kv_tokens=160, host_tier_superblocks=12 // cp)
    result = Executor(cfg).run(specs, revert_every=6)
    assert_matches_reference_with_aborts(specs, result)
    assert result.metrics.suspensions > 0
    assert result.metrics.preemptions > 0
    assert result.resumed > 0


def test_schedule_returns_one_output_per_rank_with_rank_fields() -> None:
    group = helix_kv.SimulatedCPGroup(config(4, 2, kv_tokens=64))
    group.add_request(1, np.arange(5, dtype=np.int32), 3)
    outputs = group.schedule_per_rank()
    assert len(outputs) == 4
    group.update(np.array([7], dtype=np.int32))
    outputs = group.schedule_per_rank()
    active = [bool(o.generation_active[0]) for o in outputs]
    assert active == [False, False, True, False]  # position 5 is in block 2 -> rank 2
    assert [int(o.generation_local_lens[0]) for o in outputs] == [2, 2, 2, 0]
    assert len(group) == 4
    assert group.state_digests() == [group.state_digests()[0]] * 4


def test_divergence_names_the_ranks_and_the_fields() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=256))
    group.add_request(1, np.arange(6, dtype=np.int32), 4)
    group.update(np.zeros(group.schedule().num_samples, dtype=np.int32))
    group.schedulers[1].add_request(99, np.arange(3, dtype=np.int32), 2)  # only rank 1
    with pytest.raises(helix_kv.ScheduleMismatchError) as info:
        group.schedule()
    error = info.value
    message = str(error)
    assert "schedule of step 1: rank(s) 1 differ from rank(s) 0 in context_ids," in message
    assert "  context: rank 0: (none) | rank 1: 99:0+3\n" in message
    assert error.ranks == [1]
    assert "context_ids" in error.fields
    assert "digest" in error.fields
    assert error.step == 1
    assert set(error.summaries) == {0, 1}


def test_calls_that_fail_alike_raise_the_core_error_unchanged() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=32))
    with pytest.raises(helix_kv.RequestTooLargeError, match="whole KV pool"):
        group.add_request(1, np.arange(40, dtype=np.int32), 1)
    with pytest.raises(helix_kv.InvalidStateError):
        group.update(np.zeros(0, dtype=np.int32))


def test_calls_that_fail_on_one_rank_only_are_a_mismatch() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=256))
    group.schedulers[0].add_request(5, np.arange(3, dtype=np.int32), 2)
    with pytest.raises(helix_kv.ScheduleMismatchError, match=r"add_request\(\) ended differently"):
        group.add_request(5, np.arange(3, dtype=np.int32), 2)


def test_inconsistent_rank_fields_are_reported() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=64))

    def fake(active: list[bool]) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            step=3,
            generation_positions=np.array([5]),
            generation_owner_ranks=np.array([1], dtype=np.int32),
            generation_active=np.array(active),
            generation_local_lens=np.array([4 if active[0] else 2]),
            generation_past_seen_lens=np.array([4 if active[0] else 1]),
            summary=lambda: "step: 3\n",
        )

    with pytest.raises(helix_kv.ScheduleMismatchError, match="exactly the owner rank"):
        group._check_rank_fields([fake([True]), fake([True])])


def test_finished_outputs_agree_and_metrics_come_from_rank_zero() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=256))
    group.add_request(4, [1, 2, 3], 2)
    finished = np.zeros(0, dtype=np.int64)
    while group.has_unfinished():
        n = group.schedule().num_samples
        finished = group.update(np.full(n, 9, dtype=np.int32))
    assert finished.tolist() == [4]
    output = group.take_output(4)
    assert (output.token_ids.tolist(), output.finish_reason) == ([9, 9], "length")
    assert group.metrics().finished == 1


def test_eos_flags_reach_every_rank() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=64))
    for request_id in (1, 2):
        group.add_request(request_id, [1, 2, 3], 4)
    n = group.schedule().num_samples
    finished = group.update(np.full(n, 5, dtype=np.int32), np.array([False, True]))
    assert finished.tolist() == [2]
    for scheduler in group.schedulers:
        assert scheduler.queue_ids().tolist() == [1]
    output = group.take_output(2)
    assert (output.token_ids.tolist(), output.finish_reason) == ([5], "eos")


# -- aborts through the group ---------------------------------------------------------------


def decoding_group(cp: int = 2) -> helix_kv.SimulatedCPGroup:
    """Requests 1 and 2 decoding (two tokens each so far), 3 waiting behind them."""
    group = helix_kv.SimulatedCPGroup(config(cp, 4, kv_tokens=64, max_batch_size=2))
    for request_id in (1, 2, 3):
        group.add_request(request_id, np.arange(5, dtype=np.int32), 8)
    for token in (11, 12):
        n = group.schedule().num_samples
        group.update(np.full(n, token, dtype=np.int32))
    return group


def test_group_abort_between_steps_frees_everything_on_every_rank() -> None:
    group = decoding_group()
    digests = group.state_digests()
    group.abort_many([3, 1])
    assert group.state_digests() != digests
    assert len(set(group.state_digests())) == 1
    for request_id, tokens in ((1, [11, 12]), (3, [])):
        output = group.take_output(request_id)
        assert (output.token_ids.tolist(), output.finish_reason) == (tokens, "aborted")
    assert group.metrics().aborts == 2
    for scheduler in group.schedulers:
        assert scheduler.queue_ids().tolist() == [2]
        assert scheduler.metrics().kv_used_superblocks > 0  # 2 still holds its pages
    group.abort(2)
    for scheduler in group.schedulers:
        assert scheduler.metrics().kv_used_superblocks == 0
        assert not scheduler.has_unfinished()


def test_group_abort_while_pending_takes_effect_at_update_or_revert() -> None:
    group = decoding_group()
    outputs = group.schedule_per_rank()
    assert outputs[0].generation_ids.tolist() == [1, 2]
    group.abort(1)
    assert all(s.is_abort_requested(1) for s in group.schedulers)
    with pytest.raises(helix_kv.InvalidStateError, match="not finished"):
        group.take_output(1)
    finished = group.update(np.array([13, 13], dtype=np.int32))
    assert finished.tolist() == [1]
    assert group.take_output(1).token_ids.tolist() == [11, 12]  # its token 13 was dropped

    group.schedule()
    group.abort(2)
    assert group.revert().tolist() == [2]
    output = group.take_output(2)
    assert (output.token_ids.tolist(), output.finish_reason) == ([11, 12, 13], "aborted")
    assert group.revert.__doc__
    assert group.metrics().aborts == 2


def test_group_abort_of_a_finished_request_keeps_its_output_and_reason() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=64))
    group.add_request(4, [1, 2, 3], 1)
    group.schedule()
    group.update(np.array([9], dtype=np.int32))
    digests = group.state_digests()
    assert group.abort(4) is False
    assert group.state_digests() == digests
    output = group.take_output(4)
    assert (output.token_ids.tolist(), output.finish_reason) == ([9], "length")
    assert group.metrics().aborts == 0
    digests = group.state_digests()
    assert group.abort_many([4, 5]).tolist() == [False, False], "taken, and never added"
    assert group.state_digests() == digests


def test_group_abort_many_answers_per_id_and_skips_unknown_ones() -> None:
    group = decoding_group()
    digests = group.state_digests()
    assert group.abort_many([7]).tolist() == [False]
    assert group.state_digests() == digests, "an unknown id changes nothing"
    assert group.abort_many([1, 7]).tolist() == [True, False]
    assert group.schedulers[0].queue_ids().tolist() == [2, 3]
    assert all(s.queue_ids().tolist() == [2, 3] for s in group.schedulers)


def test_group_abort_reports_ranks_that_diverged() -> None:
    group = decoding_group()
    group.schedulers[0].abort(3)  # only rank 0 is told
    with pytest.raises(helix_kv.ScheduleMismatchError, match="state_digest") as caught:
        group.abort(2)
    assert caught.value.ranks == [1]
    group = decoding_group()
    group.schedulers[1].abort(3)
    group.schedulers[1].take_output(3)  # rank 1 no longer knows request 3
    with pytest.raises(helix_kv.ScheduleMismatchError, match="live ids") as caught:
        group.abort(3)
    assert caught.value.ranks == [1]
