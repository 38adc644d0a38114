"""The configuration fingerprint seeds every digest: schedulers built from configurations that
differ in any decision field disagree from the first step on; ``cp_rank`` changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

import helix_kv

#: A small CP-2 configuration every single-field change below keeps valid (the chunk unit is
#: pinned: left unset, the unit in effect would follow tokens_per_block).
BASE: dict[str, Any] = dict(
    cp_size=2, tokens_per_block=4, kv_superblocks=16, max_batch_size=8, max_num_tokens=64,
    max_seq_len=256, chunk_unit=4,
)  # fmt: skip
NON_HELIX = {**BASE, "cp_size": 1, "serving_mode": "non_helix"}

#: decision field -> (base keyword arguments, the keyword that sets the field, its new value).
CHANGES: dict[str, tuple[dict[str, Any], str, Any]] = {
    "cp_size": (BASE, "cp_size", 4),
    "tokens_per_block": (BASE, "tokens_per_block", 8),
    "capacity_superblocks": (BASE, "kv_superblocks", 17),
    "max_batch_size": (BASE, "max_batch_size", 9),
    "max_num_tokens": (BASE, "max_num_tokens", 65),
    "enable_chunked_prefill": (BASE, "enable_chunked_prefill", False),
    "chunk_unit": (BASE, "chunk_unit", 8),
    "max_seq_len": (BASE, "max_seq_len", 257),
    "capacity_policy": (BASE, "capacity_policy", "guaranteed_no_evict"),
    "serving_mode": (BASE, "serving_mode", "disaggregated_generation"),
    "host_tier_superblocks": (NON_HELIX, "host_tier_superblocks", 2),
    "victim_policy": (BASE, "victim_policy", "priority"),
    "max_preemptions_per_request": (BASE, "max_preemptions_per_request", 9),
    "admit_after_preemption": (BASE, "admit_after_preemption", True),
    "deadlock_steps": (BASE, "deadlock_steps", 65),
}


def loaded(config: Any) -> Any:
    scheduler = helix_kv.Scheduler(config)
    scheduler.add_request(0, [5] * 10, 5)
    scheduler.add_request(1, [6] * 7, 5)
    return scheduler


def digests(scheduler: Any, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        step = scheduler.schedule()
        out.append(step.digest)
        scheduler.update([9] * step.num_samples)
    return out


def test_every_decision_field_has_a_case() -> None:
    names = [name for name, _ in helix_kv.SchedulerConfig(**BASE).decision_fields()]
    assert names == list(CHANGES)
    assert "cp_rank" not in names


def test_decision_fields_match_the_config() -> None:
    config = helix_kv.SchedulerConfig(**{**BASE, "chunk_unit": None})
    fields = dict(config.decision_fields())
    as_dict = config.to_dict()
    for name, value in fields.items():
        if name == "capacity_superblocks":
            assert value == as_dict["kv_superblocks"] == 16
        elif name == "chunk_unit":
            assert value == 4  # the unit in effect
        else:
            assert value == as_dict[name], name
            assert type(value) is type(as_dict[name]), name


@pytest.mark.parametrize("field", list(CHANGES))
def test_a_single_field_change_changes_every_digest(field: str) -> None:
    base, keyword, value = CHANGES[field]
    a = helix_kv.SchedulerConfig(**base)
    b = helix_kv.SchedulerConfig(**{**base, keyword: value})
    differ = [name for (name, x), (_, y) in zip(a.decision_fields(), b.decision_fields()) if x != y]
    assert differ == [field]
    assert a.fingerprint != b.fingerprint
    sa, sb = loaded(a), loaded(b)
    assert sa.state_digest() != sb.state_digest()
    for step, (x, y) in enumerate(zip(digests(sa, 3), digests(sb, 3))):
        assert x != y, f"{field}: step {step}"


def test_cp_rank_changes_no_digest() -> None:
    a = helix_kv.SchedulerConfig(**BASE)
    b = a.with_rank(1)
    assert a.fingerprint == b.fingerprint
    sa, sb = loaded(a), loaded(b)
    assert digests(sa, 8) == digests(sb, 8)
    assert sa.state_digest() == sb.state_digest()


def test_ranks_with_different_block_sizes_disagree_from_step_zero() -> None:
    """The issue's pair: before the seed, their digests agreed on every step while their decode
    owners did not (tokens with no owner, or two)."""
    s = [
        helix_kv.Scheduler(
            helix_kv.SchedulerConfig(cp_size=2, cp_rank=0, tokens_per_block=2, kv_tokens=64)
        ),
        helix_kv.Scheduler(
            helix_kv.SchedulerConfig(cp_size=2, cp_rank=1, tokens_per_block=4, kv_tokens=64)
        ),
    ]
    for scheduler in s:
        scheduler.add_request(7, [3] * 5, 6)
    owners_differ = False
    for step in range(6):
        outs = [scheduler.schedule() for scheduler in s]
        assert outs[0].digest != outs[1].digest, f"step {step}"
        owners_differ |= list(outs[0].generation_owner_ranks) != list(
            outs[1].generation_owner_ranks
        )
        for scheduler, out in zip(s, outs):
            scheduler.update([1] * out.num_samples)
    assert owners_differ  # what the digests now catch
