"""The scheduler contract: Scheduler, SimulatedCPGroup and HelixKVRank take the same calls and,
fed the same ones, give the same results.

(The signatures are checked statically too: ``helix_kv.contract`` assigns each class to the
Protocol under ``TYPE_CHECKING``, and CI runs ``mypy --strict`` over the package.)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import helix_kv
from helix_kv.contract import SchedulerProtocol

from .helpers.scheduler import prompt

CONTRACT = (
    "add_request",
    "abort",
    "abort_many",
    "schedule",
    "update",
    "revert",
    "take_output",
    "metrics",
    "has_unfinished",
    "num_running",
    "num_waiting",
)


def config() -> helix_kv.SchedulerConfig:
    # a pool too small for every request at once, so the run preempts
    return helix_kv.SchedulerConfig(tokens_per_block=4, kv_superblocks=24, max_num_tokens=64)


def helix_rank(scheduler_config: helix_kv.SchedulerConfig) -> Any:
    """A lone-process HelixKVRank (no process group) with ``scheduler_config``'s pool."""
    pytest.importorskip("torch")
    from helix_kv.distributed import EngineConfig, HelixKVRank

    engine = EngineConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        dtype_bytes=1,
        kv_factor=1,
        tokens_per_block=scheduler_config.tokens_per_block,
        max_num_tokens=scheduler_config.max_num_tokens,
    )
    rank = HelixKVRank.create(engine, scheduler_config.kv_superblocks * engine.page_bytes)
    assert rank.scheduler_config == scheduler_config
    return rank


BUILDERS: dict[str, Callable[[helix_kv.SchedulerConfig], Any]] = {
    "Scheduler": helix_kv.Scheduler,
    "SimulatedCPGroup": helix_kv.SimulatedCPGroup,
    "HelixKVRank": helix_rank,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_each_implementation_satisfies_the_protocol(name: str) -> None:
    implementation = BUILDERS[name](config())
    assert isinstance(implementation, SchedulerProtocol)
    for member in CONTRACT:
        assert hasattr(implementation, member), member


def test_an_object_missing_a_call_does_not_satisfy_it() -> None:
    class NoRevert:
        def __getattr__(self, name: str) -> Any:
            if name == "revert":
                raise AttributeError(name)
            return lambda *args: None

    assert not isinstance(object(), SchedulerProtocol)
    assert not isinstance(NoRevert(), SchedulerProtocol)


def drive(scheduler: SchedulerProtocol) -> list[Any]:
    """A run through every call of the contract; what it saw, step by step."""
    seen: list[Any] = []
    for request_id in range(6):
        tokens = prompt(10 + 3 * request_id, request_id)
        scheduler.add_request(request_id, tokens, 8, priority=request_id % 2)
    step = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        seen.append(("schedule", out.step, out.digest, out.sample_ids.tolist()))
        seen.append(("counts", scheduler.num_running, scheduler.num_waiting))
        if step == 2:
            scheduler.abort(5)  # while the step is pending: aborted when it closes
        if step == 4:
            seen.append(("revert", scheduler.revert().tolist()))
        else:
            tokens = (out.sample_ids.astype(np.int64) * 7 + step) % 50
            finished = scheduler.update(tokens.astype(np.int32))
            seen.append(("finished", finished.dtype.str, finished.tolist()))
            for request_id in finished.tolist():
                output = scheduler.take_output(request_id)
                seen.append((request_id, output.finish_reason, output.token_ids.tolist()))
        if step == 6:
            scheduler.abort_many([3, 1])  # between steps: aborted at once
            for request_id in (3, 1):
                output = scheduler.take_output(request_id)
                seen.append((request_id, output.finish_reason, output.token_ids.tolist()))
        step += 1
        assert step < 500
    seen.append(("metrics", scheduler.metrics().to_dict()))
    return seen


def test_the_same_calls_give_the_same_results_everywhere() -> None:
    runs = {
        name: drive(build(config())) for name, build in BUILDERS.items() if name != "HelixKVRank"
    }
    reference = runs["Scheduler"]
    assert ("revert", []) in reference
    reasons = [entry[1] for entry in reference if isinstance(entry[0], int)]
    assert sorted(reasons) == ["aborted"] * 3 + ["length"] * 3
    assert dict(reference[-1][1])["preemptions"] > 0
    assert runs["SimulatedCPGroup"] == reference


def test_helix_kv_rank_gives_the_same_results_as_a_scheduler() -> None:
    assert drive(helix_rank(config())) == drive(helix_kv.Scheduler(config()))


def test_simulated_group_returns_rank_zeros_output() -> None:
    group = helix_kv.SimulatedCPGroup(
        helix_kv.SchedulerConfig(cp_size=2, tokens_per_block=4, kv_superblocks=16)
    )
    group.add_request(0, np.arange(9, dtype=np.int32), 2)
    prefill = group.schedule_per_rank()
    assert len(prefill) == 2
    assert prefill[0].context_ids.tolist() == [0]
    finished = group.update(np.array([1], dtype=np.int32))
    assert finished.dtype == np.uint64
    assert finished.size == 0
    # the decode token at position 9 lives in page 2, owned by rank (9 // 4) % 2 == 0
    out = group.schedule()
    assert out.generation_positions.tolist() == [9]
    assert out.generation_active.tolist() == [True]  # rank 0's view
    assert group.revert().size == 0
    ranks = group.schedule_per_rank()
    assert [r.generation_active.tolist() for r in ranks] == [[True], [False]]
    assert sum(int(r.generation_local_lens[0]) for r in ranks) == 10
