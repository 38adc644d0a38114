"""``add_request_ranks``, ``schedule_ranks`` and ``update_ranks``: the in-process group's calls
on every rank in one crossing, and their verdict on whether the ranks agree.

The verdict must be exactly the group's own checks: equal digests, the per-rank fields that
``SimulatedCPGroup._check_rank_fields`` accepts (the oracle here, on every layout and rank
subset tried), equal finished ids; each rank's result or exception comes back as it would
from that rank's own call.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import helix_kv
from helix_kv._core import add_request_ranks, schedule_ranks, update_ranks


def config(cp: int, tpb: int, rank: int = 0) -> helix_kv.SchedulerConfig:
    return helix_kv.SchedulerConfig(cp_size=cp, tokens_per_block=tpb, kv_tokens=4096, cp_rank=rank)


def schedulers(cp: int, tpb: int, ranks: tuple[int, ...]) -> list[helix_kv.Scheduler]:
    """One scheduler per rank of ``ranks``, each with the same three requests decoding."""
    made = [helix_kv.Scheduler(config(cp, tpb, rank)) for rank in ranks]
    for scheduler in made:
        for request_id, length in ((1, 5), (2, 13), (3, 30)):
            scheduler.add_request(request_id, np.arange(length, dtype=np.int32), 40)
        output = scheduler.schedule()
        scheduler.update(np.zeros(output.num_samples, dtype=np.int32))
    return made


def test_every_rank_is_scheduled_and_updated_as_by_its_own_calls() -> None:
    group = schedulers(4, 4, (0, 1, 2, 3))
    alone = schedulers(4, 4, (0, 1, 2, 3))
    outputs, agree = schedule_ranks(group, group[0].config.layout, (0, 1, 2, 3))
    assert agree
    for output, scheduler in zip(outputs, alone):
        assert isinstance(output, helix_kv.ScheduleOutput)
        assert output == scheduler.schedule()  # every field, the per-rank ones too
    tokens = np.full(outputs[0].num_samples, 7, dtype=np.int32)
    finished, agree = update_ranks(group, tokens)
    assert agree
    for ids, scheduler in zip(finished, alone):
        assert np.array_equal(ids, scheduler.update(tokens))
        assert ids.dtype == np.uint64
    assert [s.state_digest() for s in group] == [s.state_digest() for s in alone]


def test_a_diverging_rank_is_no_agreement_and_every_output_comes_back() -> None:
    group = schedulers(2, 4, (0, 1))
    group[1].add_request(99, np.arange(3, dtype=np.int32), 2)  # rank 1 only
    outputs, agree = schedule_ranks(group, None, (0, 1))
    assert not agree
    assert outputs[0].digest != outputs[1].digest
    assert 99 in outputs[1].context_ids.tolist()


def test_errors_come_back_as_the_exceptions_each_rank_raised() -> None:
    group = schedulers(2, 4, (0, 1))
    results, agree = update_ranks(group, np.zeros(0, dtype=np.int32))  # no step pending
    assert not agree
    assert [type(r) for r in results] == [helix_kv.InvalidStateError] * 2
    with pytest.raises(helix_kv.InvalidStateError) as own:
        group[0].update(np.zeros(0, dtype=np.int32))
    assert str(results[0]) == str(own.value)
    group[0].schedule()  # rank 0 only: a second schedule fails there
    results, agree = schedule_ranks(group, None, (0, 1))
    assert not agree
    assert isinstance(results[1], helix_kv.ScheduleOutput)
    assert isinstance(results[0], helix_kv.ScheduleOutput)  # one step ahead is allowed
    results, agree = schedule_ranks(group, None, (0, 1))
    assert not agree
    assert isinstance(results[0], helix_kv.InvalidStateError)  # two ahead are not


def test_finished_ids_that_differ_are_no_agreement() -> None:
    group = [helix_kv.Scheduler(config(2, 4, rank)) for rank in (0, 1)]
    for scheduler, max_new in zip(group, (5, 1)):  # rank 1's request ends after one token
        scheduler.add_request(1, np.arange(6, dtype=np.int32), max_new)
        scheduler.schedule()
    finished, agree = update_ranks(group, np.zeros(1, dtype=np.int32))
    assert not agree
    assert [f.tolist() for f in finished] == [[], [1]]


def test_arguments_are_read_as_update_reads_them() -> None:
    group = schedulers(2, 4, (0, 1))
    schedule_ranks(group, None, (0, 1))
    with pytest.raises(helix_kv.InvalidArgumentError, match="sampled tokens must fit int32"):
        update_ranks(group, [2**40])
    # a bad argument changes nothing: each is checked before any rank is called
    with pytest.raises(helix_kv.InvalidTypeError, match="schedulers"):
        schedule_ranks([group[0], "rank 1"], None, (0, 1))
    with pytest.raises(helix_kv.InvalidTypeError, match="layout"):
        schedule_ranks(group, "4x4", (0, 1))
    with pytest.raises(helix_kv.InvalidArgumentError, match="2 schedulers but 1 ranks"):
        schedule_ranks(group, group[0].config.layout, (0,))
    with pytest.raises(helix_kv.InvalidTypeError, match="schedulers"):
        update_ranks([group[0], None], np.zeros(3, dtype=np.int32))
    assert [s.pending_steps() for s in group] == [1, 1]


def python_verdict(outputs: list[helix_kv.ScheduleOutput], cp: int, tpb: int, ranks) -> bool:
    """Whether the group's own Python check accepts ``outputs`` as ranks ``ranks`` of a
    ``cp`` x ``tpb`` group (the oracle)."""
    group = helix_kv.SimulatedCPGroup(config(cp, tpb), ranks=ranks)
    try:
        group._check_rank_fields(outputs)
    except helix_kv.ScheduleMismatchError:
        return False
    return True


@pytest.mark.parametrize(("cp", "tpb"), [(1, 4), (2, 4), (4, 2), (4, 4)])
def test_the_rank_field_verdict_is_the_python_checks(cp: int, tpb: int) -> None:
    """Outputs of a ``cp`` x ``tpb`` group, judged as every rank subset of every nearby
    layout: schedule_ranks agrees exactly where the Python check passes (the right layout
    and ranks pass; a wrong layout or a rank named wrongly fails, once a decode shows it)."""
    verdicts: list[bool] = []
    for claimed_cp, claimed_tpb in itertools.product((1, 2, 4), (2, 4)):
        for size in range(1, claimed_cp + 1):
            for claimed in itertools.combinations(range(claimed_cp), size):
                actual = tuple(r % cp for r in claimed)
                if len(set(actual)) != len(actual):
                    continue
                group = schedulers(cp, tpb, actual)
                layout = helix_kv.Layout(cp_size=claimed_cp, tokens_per_block=claimed_tpb)
                outputs, agree = schedule_ranks(group, layout, claimed)
                expected = python_verdict(outputs, claimed_cp, claimed_tpb, claimed)
                assert agree == expected, (claimed_cp, claimed_tpb, claimed, actual)
                if (claimed_cp, claimed_tpb, claimed) == (cp, tpb, actual):
                    assert agree
                verdicts.append(agree)
    assert True in verdicts
    assert False in verdicts


def caching(cp: int, rank: int) -> helix_kv.SchedulerConfig:
    return helix_kv.SchedulerConfig(
        cp_size=cp, tokens_per_block=4, kv_tokens=4096, cp_rank=rank, enable_prefix_caching=True
    )


def test_add_request_ranks_adds_as_each_rank_s_own_add_request() -> None:
    # Ranks of two groups of different superblock sizes in one call: the prompt is keyed
    # once, and each scheduler must still hit exactly as its own add_request makes it hit.
    made = [helix_kv.Scheduler(caching(cp, rank)) for cp in (2, 1) for rank in range(cp)]
    alone = [helix_kv.Scheduler(caching(cp, rank)) for cp in (2, 1) for rank in range(cp)]
    shared = np.arange(100, 140, dtype=np.int32)
    for request_id, own in ((1, 3), (2, 9)):
        prompt = np.concatenate([shared, np.arange(own, dtype=np.int32) + 1000 * request_id])
        outcomes = add_request_ranks(made, request_id, prompt, 4, 2, cache_salt="tenant")
        assert outcomes == [None] * len(made)
        for scheduler in alone:
            scheduler.add_request(request_id, prompt, 4, 2, cache_salt="tenant")
        for a, b in zip(made, alone):
            output = a.schedule()
            assert output == b.schedule()
            tokens = np.zeros(output.num_samples, dtype=np.int32)
            a.update(tokens)
            b.update(tokens)
            assert a.state_digest() == b.state_digest()
    assert all(s.metrics().prefix_cache_hits > 0 for s in made)


def test_add_request_ranks_returns_each_rank_s_refusal_and_raises_a_bad_argument_first() -> None:
    made = [helix_kv.Scheduler(config(2, 4, rank)) for rank in (0, 1)]
    made[1].add_request(5, np.arange(3, dtype=np.int32), 2)  # rank 1 only
    outcomes = add_request_ranks(made, 5, np.arange(3, dtype=np.int32), 2)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], helix_kv.DuplicateRequestError)
    digests = [s.state_digest() for s in made]
    for bad, error in (
        (dict(max_new_tokens=0), helix_kv.InvalidLengthError),
        (dict(prompt=np.array([], dtype=np.int32)), helix_kv.InvalidLengthError),
        (dict(cache_salt=3), helix_kv.InvalidArgumentError),
        (dict(schedulers=[made[0], "rank 1"]), helix_kv.InvalidArgumentError),
    ):
        args: dict[str, object] = dict(
            schedulers=made, request_id=6, prompt=np.arange(3, dtype=np.int32), max_new_tokens=2
        )
        args.update(bad)
        if "max_new_tokens" in bad or "prompt" in bad:
            # Refused by each scheduler (as its own add_request refuses it), not up front.
            outcomes = add_request_ranks(**args)  # type: ignore[arg-type]
            assert all(isinstance(o, error) for o in outcomes), outcomes
        else:
            with pytest.raises(error):
                add_request_ranks(**args)  # type: ignore[arg-type]
    assert [s.state_digest() for s in made] == digests
