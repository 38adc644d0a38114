"""helix_kv.distributed.launch: the one process-group launcher (gloo, two ranks)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

import torch.distributed as dist

import helix_kv.errors as errors
from helix_kv.distributed.launch import spawn_group, stop_requested


def _mismatch_worker(rank: int, world_size: int, step: int) -> None:
    # Every rank is past its process-group set-up before rank 0 leaves (else rank 1 can still
    # be connecting to it); then one rank fails, so which rank is reported is not a race.
    dist.barrier()
    if rank == 0:
        return
    raise errors.ScheduleMismatchError(
        f"ranks differ at step {step}", step=step, ranks=[1], fields=["digest"], summaries={}
    )


def _crash_worker(rank: int, world_size: int) -> int:
    dist.barrier()  # as above: nobody leaves while a peer may still be connecting
    if rank == 1:
        raise ValueError("not a helix_kv error")
    return rank


def _stop_worker(rank: int, world_size: int) -> tuple[int, int, int]:
    """Waits (up to a deadline) until the launcher asks the group to stop."""
    deadline = time.monotonic() + 60
    while not stop_requested():
        assert time.monotonic() < deadline, "the stop request never arrived"
        time.sleep(0.01)
    return rank, dist.get_rank(), dist.get_world_size()


def test_a_rank_helix_kv_error_comes_back_typed_with_its_attributes() -> None:
    with pytest.raises(errors.ScheduleMismatchError) as caught:
        spawn_group(_mismatch_worker, 2, args=(5,), timeout_s=60)
    error = caught.value
    assert str(error) == "rank 1: ranks differ at step 5"
    assert (error.step, error.ranks, error.fields) == (5, [1], ["digest"])


def test_another_failure_raises_rank_failed_error() -> None:
    with pytest.raises(errors.RankFailedError, match="ValueError: not a helix_kv error") as got:
        spawn_group(_crash_worker, 2, timeout_s=60)
    assert "Traceback" in str(got.value.__cause__)  # torch's error carries the rank's traceback


def test_should_stop_reaches_every_rank_and_results_come_back_by_rank() -> None:
    assert not stop_requested()  # outside a rank
    asked = []

    def should_stop() -> bool:
        asked.append(True)
        return True

    assert spawn_group(_stop_worker, 2, timeout_s=60, should_stop=should_stop) == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    assert asked
