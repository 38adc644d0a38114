"""The configuration's decision fields and fingerprint through the binding: each Python keyword
reaches its field and the fingerprint, values keep their Python types, ``cp_rank`` changes
nothing.

That the fingerprint seeds every digest (schedulers whose configurations differ in any decision
field disagree from the first step on, ranks with different block sizes included) is tested in
Rust: ``rust/core/tests/config_fingerprint.rs``."""

from __future__ import annotations

import pickle
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
BACKOFF = {**BASE, "num_speculative_tokens": 3, "draft_backoff_misses": 2}

#: decision field -> (base keyword arguments, the keyword that sets the field, its new value).
CHANGES: dict[str, tuple[dict[str, Any], str, Any]] = {
    "cp_size": (BASE, "cp_size", 4),
    "tokens_per_block": (BASE, "tokens_per_block", 8),
    "capacity_superblocks": (BASE, "kv_superblocks", 17),
    "max_batch_size": (BASE, "max_batch_size", 9),
    "max_num_tokens": (BASE, "max_num_tokens", 65),
    "enable_chunked_prefill": (BASE, "enable_chunked_prefill", False),
    "chunk_unit": (BASE, "chunk_unit", 8),
    "long_prefill_token_threshold": (BASE, "long_prefill_token_threshold", 8),
    "long_prefill_token_threshold_adaptive": (BASE, "long_prefill_token_threshold_adaptive", True),
    "max_seq_len": (BASE, "max_seq_len", 257),
    "capacity_policy": (BASE, "capacity_policy", "guaranteed_no_evict"),
    "serving_mode": (BASE, "serving_mode", "disaggregated_generation"),
    "host_tier_superblocks": (NON_HELIX, "host_tier_superblocks", 2),
    "suspend_policy": (BASE, "suspend_policy", "cost"),
    "suspend_cost_per_token": (BASE, "suspend_cost_per_token", 3),
    "recompute_cost_per_token": (BASE, "recompute_cost_per_token", 7),
    "admission_policy": (BASE, "admission_policy", "priority"),
    "victim_policy": (BASE, "victim_policy", "priority"),
    "max_preemptions_per_request": (BASE, "max_preemptions_per_request", 9),
    "admit_after_preemption": (BASE, "admit_after_preemption", True),
    "deadlock_steps": (BASE, "deadlock_steps", 65),
    "enable_prefix_caching": (BASE, "enable_prefix_caching", True),
    "num_speculative_tokens": (BASE, "num_speculative_tokens", 3),
    "draft_backoff_misses": (BASE, "draft_backoff_misses", 2),
    "draft_backoff_tokens": (BACKOFF, "draft_backoff_tokens", 32),
}


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
def test_each_keyword_changes_its_field_and_the_fingerprint(field: str) -> None:
    base, keyword, value = CHANGES[field]
    a = helix_kv.SchedulerConfig(**base)
    b = helix_kv.SchedulerConfig(**{**base, keyword: value})
    differ = [name for (name, x), (_, y) in zip(a.decision_fields(), b.decision_fields()) if x != y]
    assert differ == [field]
    assert a.fingerprint != b.fingerprint


def test_the_fingerprint_survives_pickling_and_ignores_the_rank() -> None:
    config = helix_kv.SchedulerConfig(**BASE)
    assert isinstance(config.fingerprint, int)
    assert 0 <= config.fingerprint < 2**64
    assert pickle.loads(pickle.dumps(config)).fingerprint == config.fingerprint
    assert config.with_rank(1).fingerprint == config.fingerprint


def test_the_draft_backoff_off_hashes_as_absent() -> None:
    """With ``draft_backoff_misses = 0`` neither backoff field reaches the fingerprint, so a
    configuration from before the backoff keeps its fingerprint (and every digest its
    value); turned on, both do."""
    base = helix_kv.SchedulerConfig(**{**BASE, "num_speculative_tokens": 3})
    longer = helix_kv.SchedulerConfig(
        **{**BASE, "num_speculative_tokens": 3, "draft_backoff_tokens": 99}
    )
    assert base.fingerprint == longer.fingerprint
    on = helix_kv.SchedulerConfig(**BACKOFF)
    assert on.fingerprint != base.fingerprint
