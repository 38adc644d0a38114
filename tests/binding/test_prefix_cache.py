"""Prefix caching through the binding: the flag, cache salts (and their hostile forms),
``reset_prefix_cache`` (refused while a step is pending), the metrics, and a simulated CP
group whose ranks cache identically."""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv
from helix_kv import InvalidArgumentError, InvalidStateError, InvalidTypeError


def _scheduler(cp_size: int = 2, caching: bool = True) -> helix_kv.Scheduler:
    config = helix_kv.SchedulerConfig(
        cp_size=cp_size, tokens_per_block=4, kv_superblocks=32, enable_prefix_caching=caching
    )
    return helix_kv.Scheduler(config)


def _step(scheduler: helix_kv.Scheduler) -> helix_kv.ScheduleOutput:
    out = scheduler.schedule()
    scheduler.update(np.full(out.num_samples, 7, np.int32))
    return out


SHARED = list(range(100, 120))  # 20 tokens: two full superblocks of 8 (cp 2 x 4)


def test_a_second_request_starts_after_the_cached_superblocks() -> None:
    scheduler = _scheduler()
    scheduler.add_request(1, [*SHARED, 1, 2], 3)
    _step(scheduler)
    scheduler.add_request(2, [*SHARED, 3, 4, 5], 3)
    out = _step(scheduler)
    assert out.context_ids.tolist() == [2]
    assert out.context_starts.tolist() == [16]
    table = scheduler.block_table([1, 2])
    assert table[0, :2].tolist() == table[1, :2].tolist()
    metrics = scheduler.metrics()
    assert metrics.prefix_cache_hits == 16
    assert metrics.prefix_cache_queries == 22 + 23
    assert metrics.to_dict()["prefix_cache_evictions"] == 0


def test_caching_is_off_by_default_and_part_of_the_fingerprint() -> None:
    off = helix_kv.SchedulerConfig(cp_size=2, tokens_per_block=4, kv_superblocks=32)
    assert off.enable_prefix_caching is False
    on = helix_kv.SchedulerConfig(**{**off.to_dict(), "enable_prefix_caching": True})
    assert on.fingerprint != off.fingerprint
    scheduler = helix_kv.Scheduler(off)
    scheduler.add_request(1, SHARED, 2)
    _step(scheduler)
    scheduler.add_request(2, SHARED, 2)
    assert _step(scheduler).context_starts.tolist() == [0]
    assert scheduler.reset_prefix_cache() == 0


@pytest.mark.parametrize("salt", ["tenant", b"tenant", "t\u00e9nant"])
def test_salts_keep_tenants_apart(salt: str | bytes) -> None:
    scheduler = _scheduler()
    scheduler.add_request(1, SHARED, 2, cache_salt=salt)
    _step(scheduler)
    scheduler.add_request(2, SHARED, 2)  # no salt: another tenant
    assert _step(scheduler).context_starts.tolist() == [0]
    scheduler.add_request(3, SHARED, 2, cache_salt=salt)
    assert _step(scheduler).context_starts.tolist() == [16]


@pytest.mark.parametrize("salt", [1, 1.5, ["a"], bytearray(b"a"), object()])
def test_a_salt_of_the_wrong_type_is_refused_and_changes_nothing(salt: object) -> None:
    scheduler = _scheduler()
    before = scheduler.state_digest()
    with pytest.raises(InvalidTypeError, match="cache_salt"):
        scheduler.add_request(1, SHARED, 2, cache_salt=salt)  # type: ignore[arg-type]
    assert scheduler.state_digest() == before
    assert scheduler.queue_ids().tolist() == []


def test_a_huge_salt_is_refused() -> None:
    scheduler = _scheduler()
    scheduler.add_request(1, SHARED, 2, cache_salt=b"x" * 4096)
    with pytest.raises(InvalidArgumentError, match="4096"):
        scheduler.add_request(2, SHARED, 2, cache_salt=b"x" * 4097)
    with pytest.raises(InvalidArgumentError):
        scheduler.add_request(2, SHARED, 2, cache_salt="x" * 10**6)
    with pytest.raises(InvalidArgumentError, match="Unicode"):
        scheduler.add_request(2, SHARED, 2, cache_salt="\ud800")
    assert scheduler.queue_ids().tolist() == [1]


def test_reset_while_a_step_is_pending_is_refused_and_changes_nothing() -> None:
    scheduler = _scheduler()
    scheduler.add_request(1, SHARED, 1)
    _step(scheduler)
    scheduler.add_request(2, SHARED, 1)
    scheduler.schedule()
    before = (scheduler.state_digest(), scheduler.metrics())
    with pytest.raises(InvalidStateError, match="pending"):
        scheduler.reset_prefix_cache()
    assert (scheduler.state_digest(), scheduler.metrics()) == before
    scheduler.revert()
    assert scheduler.reset_prefix_cache() == 2
    assert _step(scheduler).context_starts.tolist() == [0]


def test_a_simulated_group_caches_identically_on_every_rank() -> None:
    config = helix_kv.SchedulerConfig(
        cp_size=4, tokens_per_block=2, kv_superblocks=12, enable_prefix_caching=True
    )
    group = helix_kv.SimulatedCPGroup(config)
    hits = 0
    for request_id in range(10):
        group.add_request(request_id, [*SHARED, request_id], 12, cache_salt="a")
    for _ in range(400):
        if not group.has_unfinished():
            break
        out = group.schedule()
        hits += int(out.context_starts.sum())
        for request_id in group.update(np.full(out.num_samples, 7, np.int32)).tolist():
            assert group.take_output(request_id).finish_reason == "length"
    assert hits > 0
    metrics = group.metrics()
    assert metrics.prefix_cache_hits > 0
    assert group.reset_prefix_cache() >= 0


def test_request_metrics_preemptions_is_a_deprecated_alias() -> None:
    metrics = helix_kv.RequestMetrics(victim_choices=3)
    with pytest.warns(DeprecationWarning, match="victim_choices"):
        assert metrics.preemptions == 3
    assert "preemptions" not in metrics.to_dict()
