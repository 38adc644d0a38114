"""SimulatedCPGroup: cp schedulers in one process, identical decisions every step, replay
exact under pressure, and divergence reported with the ranks and fields."""

from __future__ import annotations

import types

import numpy as np
import pytest

import helix_kv
from scheduler_harness import Executor, Model, Spec, assert_matches_reference

CPS = (1, 2, 4)
PLAIN = Model()


def config(cp: int, tpb: int, kv_tokens: int, **overrides) -> helix_kv.SchedulerConfig:
    return helix_kv.SchedulerConfig(
        cp_size=cp, tokens_per_block=tpb, kv_tokens=kv_tokens, **overrides
    )


def run(cfg: helix_kv.SchedulerConfig, specs, model: Model = PLAIN, revert_every: int = 0):
    result = Executor(cfg, model).run(specs, revert_every=revert_every)
    assert_matches_reference(specs, result, model)
    # past the bound only for the queue head (the executor checks each such preemption)
    assert (
        result.max_request_preemptions <= cfg.max_preemptions_per_request
        or result.preemptions_past_bound > 0
    )
    return result


@pytest.mark.parametrize("cp", CPS)
def test_decode_pressure_preempts_identically_and_replays_exactly(cp: int) -> None:
    specs = [Spec(i, 10, 30) for i in range(8)]
    result = run(config(cp, 4, 160), specs)
    assert result.metrics.preemptions > 0


@pytest.mark.parametrize("cp", CPS)
def test_chunked_prefill_pressure(cp: int) -> None:
    specs = [Spec(i, 40 + 9 * i, 12) for i in range(6)]
    result = run(config(cp, 4, 192, max_num_tokens=32, chunk_unit=8), specs)
    assert result.metrics.preemptions > 0


@pytest.mark.parametrize("cp", CPS)
def test_staggered_arrivals(cp: int) -> None:
    specs = [Spec(i, 5 + (i * 13) % 40, 8 + (i * 7) % 25, 0, (i * 3) % 17) for i in range(12)]
    result = run(config(cp, 2, 128, max_num_tokens=48, chunk_unit=4), specs)
    assert result.metrics.preemptions > 0


@pytest.mark.parametrize("policy", ["newest_first", "least_computed_first", "priority"])
def test_every_victim_policy_keeps_ranks_in_step(policy: str) -> None:
    specs = [Spec(i, 6 + (i * 5) % 17, 20, (i * 7) % 5 - 2, i // 3) for i in range(10)]
    result = run(config(4, 4, 160, victim_policy=policy), specs)
    assert result.metrics.preemptions > 0


@pytest.mark.parametrize("cp", CPS)
def test_reverted_steps_change_no_output(cp: int) -> None:
    specs = [Spec(i, 9 + i, 24, 0, i // 2) for i in range(8)]
    result = run(config(cp, 4, 160, max_num_tokens=40, chunk_unit=8), specs, revert_every=4)
    assert result.reverted > 0
    assert result.metrics.preemptions > 0


def test_eos_ends_requests_early() -> None:
    model = Model(vocab=16, eos=3)
    specs = [Spec(i, 8, 40) for i in range(10)]
    result = run(config(2, 4, 160), specs, model)
    assert any(len(o) < 40 for o in result.outputs.values())


def test_host_tier_suspends_then_recomputes_and_replays() -> None:
    specs = [Spec(i, 10, 30) for i in range(8)]
    cfg = config(1, 4, 160, serving_mode="non_helix", host_tier_superblocks=6)
    result = run(cfg, specs, revert_every=5)
    assert result.metrics.suspensions > 0
    assert result.metrics.preemptions > 0


def test_guaranteed_no_evict_never_preempts() -> None:
    specs = [Spec(i, 10, 30, 0, i // 3) for i in range(8)]
    result = run(config(2, 4, 160, capacity_policy="guaranteed_no_evict"), specs)
    assert result.metrics.preemptions + result.metrics.suspensions == 0


def test_schedule_returns_one_output_per_rank_with_rank_fields() -> None:
    group = helix_kv.SimulatedCPGroup(config(4, 2, 64))
    group.add_request(1, np.arange(5, dtype=np.int32), 3)
    outputs = group.schedule()
    assert len(outputs) == 4
    group.update(np.array([7], dtype=np.int32))
    outputs = group.schedule()
    active = [bool(o.generation_active[0]) for o in outputs]
    assert active == [False, False, True, False]  # position 5 is in block 2 -> rank 2
    assert [int(o.generation_local_lens[0]) for o in outputs] == [2, 2, 2, 0]
    assert len(group) == 4
    assert group.state_digests() == [group.state_digests()[0]] * 4


def test_divergence_names_the_ranks_and_the_fields() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, 256))
    group.add_request(1, np.arange(6, dtype=np.int32), 4)
    group.update(np.zeros(group.schedule()[0].num_samples, dtype=np.int32))
    group.schedulers[1].add_request(99, np.arange(3, dtype=np.int32), 2)  # only rank 1
    with pytest.raises(helix_kv.ScheduleMismatchError) as info:
        group.schedule()
    error = info.value
    message = str(error)
    assert "CP ranks [1] scheduled differently from rank 0" in message
    assert "context: rank 0: ''" in message
    assert "context: rank 1: '99:0+3'" in message
    assert error.ranks == [1]
    assert "context_ids" in error.fields
    assert "digest" in error.fields
    assert error.step == 1
    assert set(error.summaries) == {0, 1}


def test_calls_that_fail_alike_raise_the_core_error_unchanged() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, 32))
    with pytest.raises(helix_kv.RequestTooLargeError, match="whole KV pool"):
        group.add_request(1, np.arange(40, dtype=np.int32), 1)
    with pytest.raises(helix_kv.InvalidStateError):
        group.update(np.zeros(0, dtype=np.int32))


def test_calls_that_fail_on_one_rank_only_are_a_mismatch() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, 256))
    group.schedulers[0].add_request(5, np.arange(3, dtype=np.int32), 2)
    with pytest.raises(helix_kv.ScheduleMismatchError, match=r"add_request\(\) ended differently"):
        group.add_request(5, np.arange(3, dtype=np.int32), 2)


def test_inconsistent_rank_fields_are_reported() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, 64))

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
    group = helix_kv.SimulatedCPGroup(config(2, 4, 256))
    group.add_request(4, [1, 2, 3], 2)
    finished = np.zeros(0, dtype=np.int64)
    while group.has_unfinished():
        n = group.schedule()[0].num_samples
        finished = group.update(np.full(n, 9, dtype=np.int32))
    assert finished.tolist() == [4]
    assert group.take_output(4).tolist() == [9, 9]
    assert group.metrics().finished == 1
