"""The draft backoff through the binding: ``draft_backoff_misses`` / ``draft_backoff_tokens``,
``Scheduler.drafts_paused`` and ``Scheduler.spec_decode_backoffs``."""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv


def _scheduler(misses: int) -> helix_kv.Scheduler:
    config = helix_kv.SchedulerConfig(
        tokens_per_block=4, kv_superblocks=64, max_num_tokens=64, num_speculative_tokens=2,
        draft_backoff_misses=misses, draft_backoff_tokens=3,
    )  # fmt: skip
    scheduler = helix_kv.Scheduler(config)
    for request_id in (1, 2):
        scheduler.add_request(request_id, np.arange(5, dtype=np.int32), 100)
    out = scheduler.schedule()
    scheduler.update(np.full(out.num_samples, 7, np.int32))
    return scheduler


def _drafted_step(scheduler: helix_kv.Scheduler, accept: list[int]) -> np.ndarray:
    """Proposes 2 drafts to both requests, schedules, accepts ``accept[i]`` of entry i's."""
    scheduler.propose_drafts(np.array([1, 2]), np.array([2, 2]), np.full(4, 9, np.int32))
    out = scheduler.schedule()
    counts = out.generation_draft_counts.copy()
    accepted = np.minimum(np.array(accept), counts)
    scheduler.update(np.full(out.num_samples, 7, np.int32), None, accepted)
    return counts


@pytest.mark.parametrize("misses", [0, 2])
def test_rejected_drafts_pause_only_with_the_backoff_on(misses: int) -> None:
    scheduler = _scheduler(misses)
    # request 1 rejects every draft, request 2 accepts every one
    counts = [_drafted_step(scheduler, [0, 2]).tolist() for _ in range(6)]
    if misses:
        assert counts == [[2, 2], [2, 2], [0, 2], [0, 2], [0, 2], [2, 2]]
        assert scheduler.spec_decode_backoffs() == 1
    else:
        assert counts == [[2, 2]] * 6
        assert scheduler.spec_decode_backoffs() == 0


def test_drafts_paused_says_what_the_next_schedule_does() -> None:
    scheduler = _scheduler(2)
    for _ in range(2):
        assert scheduler.drafts_paused(np.array([1, 2], dtype=np.uint64)).tolist() == [False] * 2
        _drafted_step(scheduler, [0, 2])
    assert scheduler.drafts_paused([1, 2]).tolist() == [True, False]
    assert scheduler.drafts_paused([]).size == 0
    with pytest.raises(helix_kv.errors.UnknownRequestError):
        scheduler.drafts_paused([1, 3])


def test_the_config_fields_round_trip_and_are_checked() -> None:
    config = helix_kv.SchedulerConfig(kv_superblocks=8, draft_backoff_misses=3)
    assert (config.draft_backoff_misses, config.draft_backoff_tokens) == (3, 16)
    assert helix_kv.SchedulerConfig(**config.to_dict()) == config
    with pytest.raises(helix_kv.errors.ConfigError):
        helix_kv.SchedulerConfig(kv_superblocks=8, draft_backoff_tokens=0)
