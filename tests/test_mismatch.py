"""helix_kv.mismatch: the one description of ranks that scheduled a step differently, read from
the core's structured summary and field comparison (never from the summary's text)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import helix_kv
from helix_kv.mismatch import schedule_mismatch


def config(rank: int = 0, **overrides) -> helix_kv.SchedulerConfig:
    return helix_kv.SchedulerConfig(
        cp_size=4, cp_rank=rank, tokens_per_block=2, kv_superblocks=64, **overrides
    )


def outputs(feed, ranks: int = 4) -> list[helix_kv.ScheduleOutput]:
    """One step on ``ranks`` schedulers; ``feed(rank, scheduler)`` adds the requests."""
    result = []
    for rank in range(ranks):
        scheduler = helix_kv.Scheduler(config(rank))
        feed(rank, scheduler)
        result.append(scheduler.schedule())
    return result


def test_the_minority_rank_and_its_fields_are_named() -> None:
    def feed(rank: int, scheduler: helix_kv.Scheduler) -> None:
        scheduler.add_request(1, np.arange(4, dtype=np.int32), 2)
        if rank == 2:
            scheduler.add_request(3, np.arange(6, dtype=np.int32), 2)

    error = schedule_mismatch(outputs(feed))
    assert isinstance(error, helix_kv.ScheduleMismatchError)
    message = str(error)
    assert error.ranks == [2]
    assert error.step == 0
    assert error.fields[:5] == [
        "context_ids",
        "context_starts",
        "context_lens",
        "context_cached_lens",
        "context_completes",
    ]
    assert error.fields[-2:] == ["num_tokens", "digest"]
    assert message.startswith(
        "CP ranks disagree on the schedule of step 0: rank(s) 2 differ from rank(s) 0, 1, 3 in "
        "context_ids, "
    )
    assert "\n  context: rank 0: 1:0+4 | rank 2: 1:0+4 3:0+6\n" in message
    assert "\n  batch_slots: rank 0: 1=0 | rank 2: 1=0 3=1\n" in message
    assert "\n  num_tokens: rank 0: 4 | rank 2: 10\n" in message
    assert "  context_token_ids: rank 0: 0 1 2 3 | rank 2: 0 1 2 3 0 1 2 3 4 5\n" in message
    assert "  sample_ids: rank 0: 1 | rank 2: 1 3\n" in message
    assert message.count("  context: ") == 1  # one line per summary entry
    assert set(error.summaries) == {0, 1, 2, 3}
    assert "3:0+6" in error.summaries[2]


def test_of_two_ranks_the_higher_one_differs_and_unsummarised_fields_show_values() -> None:
    def feed(rank: int, scheduler: helix_kv.Scheduler) -> None:
        tokens = np.array([5, 6, 7 + rank], dtype=np.int32)
        scheduler.add_request(1, tokens, 2)

    error = schedule_mismatch(outputs(feed, ranks=2))
    assert error.ranks == [1]
    assert error.fields == ["context_token_ids", "digest"]
    message = str(error)
    assert "rank(s) 1 differ from rank(s) 0 in context_token_ids, digest" in message
    assert "\n  context_token_ids: rank 0: 5 6 7 | rank 1: 5 6 8\n" in message
    assert "\n  context: " not in message  # the summary entries agree
    digests = [f"rank {r} {o:016x}" for r, o in enumerate(o.digest for o in outputs(feed, 2))]
    assert f"  digests: {', '.join(digests)}\n" in message


def test_extra_fields_are_compared_and_shown_like_fields() -> None:
    same = outputs(lambda rank, s: s.add_request(1, np.arange(3, dtype=np.int32), 2), ranks=3)
    extra = [{"sampled_tokens": "1:7"}, {"sampled_tokens": "1:8"}, {"sampled_tokens": "1:7"}]
    error = schedule_mismatch(same, extra)
    assert error.ranks == [1]
    assert error.fields == ["sampled_tokens"]
    assert "\n  sampled_tokens: rank 0: 1:7 | rank 1: 1:8\n" in str(error)
    missing = schedule_mismatch(same[:2], [{"sampled_tokens": "1:7"}, {}])
    assert "sampled_tokens: rank 0: 1:7 | rank 1: (absent)" in str(missing)
    with pytest.raises(ValueError, match="3 outputs but 2 extra"):
        schedule_mismatch(same, extra[:2])


def test_pickled_outputs_describe_the_same_mismatch() -> None:
    """What the distributed checker gathers (pickled outputs) reads like the originals."""

    def feed(rank: int, scheduler: helix_kv.Scheduler) -> None:
        scheduler.add_request(rank % 2, np.arange(5, dtype=np.int32), 2)

    original = outputs(feed)
    gathered = [pickle.loads(pickle.dumps(o)) for o in original]
    assert str(schedule_mismatch(gathered)) == str(schedule_mismatch(original))
    error = schedule_mismatch(gathered)
    assert error.ranks == [1, 3]  # two against two: the set holding rank 0 is the reference
    assert "rank(s) 1, 3 differ from rank(s) 0, 2" in str(error)


def test_a_config_difference_alone_shows_as_the_digest() -> None:
    schedulers = [
        helix_kv.Scheduler(config(0)),
        helix_kv.Scheduler(config(1, deadlock_steps=9)),
    ]
    for scheduler in schedulers:
        scheduler.add_request(1, np.arange(4, dtype=np.int32), 2)
    error = schedule_mismatch([s.schedule() for s in schedulers])
    assert error.fields == ["digest"]
    assert "in digest\n  digests: rank 0 " in str(error)
