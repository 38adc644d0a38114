"""One-step-ahead (overlap) scheduling through the binding and SimulatedCPGroup: ``schedule()``
while one step is pending, inputs still in flight given as rows of that step's sampled tokens
(``generation_input_refs``), ``update()`` closing the oldest pending step and ``revert()`` the
newest. The rules are tested in Rust (``rust/core/tests/scheduler_overlap.rs``) and every Rust
group workload runs in both modes; here the Python harness runs whole pressured workloads one
step ahead, every rank compared every step, against the plain run."""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv
from helix_kv.contract import SchedulerProtocol

from .helpers.harness import Executor, Model, Spec, assert_matches_reference
from .helpers.scheduler import config


def test_a_step_planned_ahead_refers_to_the_tokens_in_flight() -> None:
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=128))
    group.add_request(1, np.arange(5, dtype=np.int32), 3)
    group.add_request(2, np.arange(3, dtype=np.int32), 3)
    assert group.pending_steps() == 0
    first = group.schedule()
    assert group.pending_steps() == 1
    ahead = group.schedule()
    assert group.pending_steps() == 2
    assert ahead.generation_input_refs.dtype == np.int32
    assert ahead.generation_input_refs.tolist() == [0, 1]
    assert ahead.generation_input_tokens.tolist() == [-1, -1]
    assert first.sample_ids.tolist() == ahead.generation_ids.tolist()
    with pytest.raises(helix_kv.InvalidStateError, match="at most one ahead"):
        group.schedule()
    # update closes the oldest step, revert undoes the newest
    group.update(np.array([7, 8], dtype=np.int32))
    assert group.pending_steps() == 1
    assert group.revert().tolist() == []
    assert group.pending_steps() == 0
    again = group.schedule()
    assert again.generation_input_refs.tolist() == [-1, -1]
    assert again.generation_input_tokens.tolist() == [7, 8]


def test_every_contract_implementation_counts_pending_steps() -> None:
    scheduler = helix_kv.Scheduler(config(1, 4, kv_tokens=64))
    group = helix_kv.SimulatedCPGroup(config(2, 4, kv_tokens=64))
    for implementation in (scheduler, group):
        assert isinstance(implementation, SchedulerProtocol)
        assert implementation.pending_steps() == 0
    scheduler.add_request(1, [1, 2, 3], 2)
    scheduler.schedule()
    scheduler.schedule()
    assert scheduler.pending_steps() == 2
    assert scheduler.step_pending


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_pressured_group_one_step_ahead_gives_the_plain_outputs(cp: int) -> None:
    model = Model(vocab=40, eos=3)
    specs = [
        Spec(i, 6 + (i * 7) % 23, 5 + (i * 3) % 11, (i * 5) % 3 - 1, i // 3) for i in range(14)
    ]
    cfg = config(cp, 4, kv_tokens=128, max_num_tokens=24, chunk_unit=8)
    plain = Executor(cfg, model).run(specs, revert_every=6)
    overlap = Executor(cfg, model, overlap=True).run(specs, revert_every=6)
    assert overlap.inputs_in_flight > 0
    assert overlap.reverted > 0
    assert overlap.metrics is not None
    assert overlap.metrics.preemptions > 0
    assert any(tokens[-1:] == [3] for tokens in overlap.outputs.values()), "no eos"
    assert overlap.outputs == plain.outputs
    assert_matches_reference(specs, overlap, model)
