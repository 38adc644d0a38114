"""helix_kv.distributed in one process: config, budget arithmetic, guards and the warn-once path
of the schedule check (no process group needed; the mismatch report is tests/test_mismatch.py)."""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import helix_kv
from helix_kv.distributed import (
    CHECK_SCHEDULE_ENV,
    EngineConfig,
    HelixKVRank,
    InitSyncConfigMismatchError,
    ScheduleChecker,
    check_config_guards,
    group_fields,
    schedule_check_requested,
    superblocks_for_budget,
)
from helix_kv.distributed.check import (
    sampled_fields,
    to_int64,
    updates_fields,
    updates_fingerprint,
)
from helix_kv.distributed.config import SCHEDULER_FIELDS
from helix_kv.distributed.sync import ConfigIdentity, config_mismatch

from . import dist_scenarios as sc


def test_budget_becomes_whole_pages() -> None:
    config = sc.engine_config()
    assert config.bytes_per_token == 2 * 2 * 2 * 8 * 2
    assert config.page_bytes == sc.TOKENS_PER_BLOCK * config.bytes_per_token == sc.PAGE_BYTES
    assert superblocks_for_budget(config, 10 * sc.PAGE_BYTES + sc.PAGE_BYTES - 1) == 10
    mla = sc.engine_config(kv_factor=1, num_kv_heads=1, head_dim=512)
    assert mla.bytes_per_token == 2 * 1 * 1 * 512 * 2
    with pytest.raises(helix_kv.ConfigError, match="holds no KV page: one page is 512 bytes"):
        superblocks_for_budget(config, 511)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_layers": 0}, "num_layers = 0 must be an integer >= 1"),
        ({"head_dim": 2.5}, "head_dim = 2.5"),
        ({"kv_factor": 3}, "kv_factor = 3 must be 2"),
        ({"host_cache_bytes": -1}, "host_cache_bytes = -1 must be >= 0"),
        ({"kv_connector": ""}, "kv_connector = '' must be a connector name"),
    ],
)
def test_engine_config_names_the_bad_field(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(helix_kv.ConfigError, match=needle):
        sc.engine_config(**changes)


def test_engine_config_from_dict_names_unknown_keys() -> None:
    with pytest.raises(helix_kv.ConfigError, match=r"unknown EngineConfig field\(s\) host_tier"):
        EngineConfig.from_dict({"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "host_tier": 1})


@pytest.mark.parametrize(
    ("guard", "why", "instead"),
    [
        (
            "host_tier",
            "per-rank free counts and utilisation",
            "aggregated_host_tier = True",
        ),
        ("disk_tier", "per-rank state the mirrored ledger does not see", "disk_cache_bytes = 0"),
        ("kv_connector", "changes one rank's capacity", "serving_mode='disaggregated_generation'"),
        ("kv_pool_rebalance", "needs the same capacity on every rank", "size the pool with"),
    ],
)
def test_each_guard_says_why_and_what_instead(guard: str, why: str, instead: str) -> None:
    config = sc.engine_config(**sc.GUARDS[guard])
    for check in (
        lambda: check_config_guards(config, cp_size=2),
        lambda: HelixKVRank.create(config, 64 * sc.PAGE_BYTES),  # one process: raised as is
    ):
        with pytest.raises(helix_kv.ConfigGuardError) as info:
            check()
        assert why in str(info.value)
        assert instead in str(info.value)


def test_all_violated_guards_are_listed_at_once() -> None:
    options: dict[str, Any] = {}
    for option in sc.GUARDS.values():
        options.update(option)
    with pytest.raises(helix_kv.ConfigGuardError) as info:
        check_config_guards(sc.engine_config(**options), cp_size=4)
    assert len(str(info.value).splitlines()) == len(sc.GUARDS)


def test_non_helix_and_disaggregated_keep_their_options() -> None:
    check_config_guards(
        sc.engine_config(
            serving_mode="non_helix", **{k: v for o in sc.GUARDS.values() for k, v in o.items()}
        ),
        cp_size=1,
    )
    check_config_guards(
        sc.engine_config(serving_mode="disaggregated_generation", host_cache_bytes=1 << 20,
                         disk_cache_bytes=1 << 30, kv_connector="nixl", kv_pool_rebalance=True),
        cp_size=1,
    )  # fmt: skip
    with pytest.raises(helix_kv.ConfigGuardError, match=r"rejected under Helix \(cp_size = 2\)"):
        check_config_guards(
            sc.engine_config(serving_mode="disaggregated_generation", kv_pool_rebalance=True), 2
        )


def test_non_helix_gets_a_host_tier_aggregated_helix_skips_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = 16 * sc.PAGE_BYTES
    explicit = HelixKVRank.create(
        sc.engine_config(serving_mode="non_helix", host_cache_bytes=4 * sc.PAGE_BYTES), budget
    )
    assert explicit.host_tier_superblocks == 4
    automatic = HelixKVRank.create(sc.engine_config(serving_mode="non_helix"), budget)
    assert automatic.host_tier_superblocks == 16
    with caplog.at_level(logging.INFO, logger="helix_kv"):
        helix = HelixKVRank.create(sc.engine_config(), budget)
    assert helix.host_tier_superblocks == 0
    assert "automatic host KV tier skipped" in caplog.text
    # helix_kv's own host tier under aggregated Helix: given, or as large as the GPU budget
    own = HelixKVRank.create(
        sc.engine_config(aggregated_host_tier=True, host_cache_bytes=4 * sc.PAGE_BYTES), budget
    )
    assert own.host_tier_superblocks == own.scheduler_config.host_tier_superblocks == 4
    with caplog.at_level(logging.INFO, logger="helix_kv"):
        auto = HelixKVRank.create(sc.engine_config(aggregated_host_tier=True), budget)
    assert auto.host_tier_superblocks == 16
    assert "automatic host KV tier of" in caplog.text
    disagg = HelixKVRank.create(
        sc.engine_config(serving_mode="disaggregated_generation", host_cache_bytes=1 << 20), budget
    )
    assert disagg.host_tier_superblocks == 0  # the engine's; this scheduler never suspends


def test_single_process_rank() -> None:
    built = HelixKVRank.create(
        sc.engine_config(), 10 * sc.PAGE_BYTES + 3, allocate=lambda r: "pool"
    )
    assert (built.cp_rank, built.cp_size, built.capacity_superblocks) == (0, 1, 10)
    assert built.capacity_tokens == 10 * sc.TOKENS_PER_BLOCK
    assert built.kv_storage == "pool"
    assert built.checker is None
    with pytest.raises(RuntimeError, match="boom"):  # one process: its own error, unchanged
        HelixKVRank.create(sc.engine_config(), 10 * sc.PAGE_BYTES, allocate=_boom)


def _boom(_rank: HelixKVRank) -> None:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("on", True), ("", False), ("0", False)]
)
def test_check_variable(value: str, expected: bool) -> None:
    assert schedule_check_requested({CHECK_SCHEDULE_ENV: value}) is expected


def test_check_variable_rejects_nonsense() -> None:
    with pytest.raises(helix_kv.ConfigError, match="HELIX_KV_CHECK_SCHEDULE = 'maybe'"):
        schedule_check_requested({CHECK_SCHEDULE_ENV: "maybe"})


def test_check_warns_once_when_it_cannot_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_SCHEDULE_ENV, "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = HelixKVRank.create(sc.engine_config(), 32 * sc.PAGE_BYTES)
        sc.add_workload(built, count=3)
        steps = sum(1 for _ in sc.drive(built))
    assert steps > 0
    assert built.checker is not None
    assert not built.checker.enabled
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "cannot apply: this CP group has one rank" in messages[0]
    with pytest.warns(RuntimeWarning, match="cannot apply"):
        ScheduleChecker().check(None)  # disabled: never reads the output


def test_digest_travels_as_int64() -> None:
    assert to_int64(0) == 0
    assert to_int64(2**63 - 1) == 2**63 - 1
    assert to_int64(2**63) == -(2**63)
    assert to_int64(2**64 - 1) == -1


def test_sampled_tokens_become_one_field_to_compare() -> None:
    ids, tokens = np.array([3, 5], dtype=np.uint64), np.array([17, 22], dtype=np.int32)
    assert sampled_fields(None) == {}
    assert sampled_fields((ids, tokens, None)) == {"sampled_tokens": "3:17 5:22"}
    eos = np.array([False, True])
    assert sampled_fields((ids, tokens, eos)) == {"sampled_tokens": "3:17 5:22 (eos: 5)"}
    assert sampled_fields((ids, tokens, None), step=12) == {"sampled_tokens": "step 12: 3:17 5:22"}


def test_updates_between_two_checks_are_all_compared_in_order() -> None:
    """One step ahead, two updates can close between two schedules (the end of a run):
    both reach the next check, each named with its step, and their order counts."""
    ids = np.array([3, 5], dtype=np.uint64)
    first = (12, (ids, np.array([17, 22], dtype=np.int32), None))
    second = (13, (ids, np.array([22, 17], dtype=np.int32), np.array([False, True])))
    assert updates_fields([]) == {}
    assert updates_fingerprint([]) == 0
    assert updates_fields([first, second]) == {
        "sampled_tokens": "step 12: 3:17 5:22; step 13: 3:22 5:17 (eos: 5)"
    }
    both = updates_fingerprint([first, second])
    assert both not in (updates_fingerprint([first]), updates_fingerprint([second]))
    assert both != updates_fingerprint([second, first])


def test_rank_records_each_update_with_the_step_it_closed() -> None:
    """HelixKVRank one step ahead: update closes the oldest pending step, revert drops the
    newest; the checker is handed each update with its step, and each step's check is
    started by its schedule and finished before its update (or its revert) changes the
    scheduler, never later."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        built = HelixKVRank.create(sc.engine_config(), 64 * sc.PAGE_BYTES)
    recorded: list[tuple[int | None, list[int]]] = []
    calls: list[tuple[str, int | None, int]] = []  # (call, step, scheduler's pending steps)

    class Recorder:
        """The real checker's call rules (one check in flight; a start finishes it first)."""

        in_flight_step: int | None = None

        def start(self, output: Any) -> None:
            self.finish()
            calls.append(("start", int(output.step), built.pending_steps()))
            self.in_flight_step = int(output.step)

        def finish(self) -> None:
            if self.in_flight_step is not None:
                calls.append(("finish", self.in_flight_step, built.pending_steps()))
            self.in_flight_step = None

        def record_update(
            self, sample_ids: Any, tokens: Any, eos: Any = None, *, step: Any = None
        ) -> None:
            recorded.append((step, np.asarray(sample_ids).tolist()))
            calls.append(("record", step, built.pending_steps()))

    built.checker = Recorder()  # type: ignore[assignment]
    built.add_request(1, sc.prompt_tokens(1, 6), 8)
    first = built.schedule()
    second = built.schedule()  # one step ahead
    assert built.pending_steps() == 2
    built.revert()  # drops the newest (second)
    assert built.pending_steps() == 1
    built.update(np.zeros(len(first.sample_ids), dtype=np.int32))
    third = built.schedule()
    fourth = built.schedule()
    built.update(np.zeros(len(third.sample_ids), dtype=np.int32))
    built.update(np.zeros(len(fourth.sample_ids), dtype=np.int32))
    fifth = built.schedule()  # plain: its update finishes its check
    built.update(np.zeros(len(fifth.sample_ids), dtype=np.int32))
    sixth = built.schedule()
    built.finish_check()  # the executor, before it waits for the step's tokens
    built.finish_check()  # nothing in flight: nothing
    calls.append(("tokens", None, built.pending_steps()))
    built.update(np.zeros(len(sixth.sample_ids), dtype=np.int32))
    assert built.pending_steps() == 0
    assert [step for step, _ in recorded] == [
        int(first.step), int(third.step), int(fourth.step), int(fifth.step), int(sixth.step)
    ]  # fmt: skip
    assert int(second.step) not in [step for step, _ in recorded]
    assert recorded[1][1] == np.asarray(third.sample_ids).tolist()
    s1, s2, s3, s4, s5, s6 = (int(o.step) for o in (first, second, third, fourth, fifth, sixth))
    assert calls == [
        ("start", s1, 1),
        ("finish", s1, 2),  # by the next start, one step ahead
        ("start", s2, 2),
        ("finish", s2, 2),  # by revert, before the scheduler drops the step
        ("record", s1, 0),
        ("start", s3, 1),
        ("finish", s3, 2),
        ("start", s4, 2),
        ("record", s3, 1),  # update(third) leaves the newer step's check in flight
        ("finish", s4, 1),  # update(fourth): before the scheduler commits it
        ("record", s4, 0),
        ("start", s5, 1),
        ("finish", s5, 1),
        ("record", s5, 0),
        ("start", s6, 1),
        ("finish", s6, 1),
        ("tokens", None, 1),
        ("record", s6, 0),
    ]


def test_checker_fingerprint_folds_updates_as_they_come() -> None:
    """record_update folds the same fingerprint as updates_fingerprint over what it kept,
    copies the caller's buffers, and any one differing token or flag changes it."""
    checker = ScheduleChecker.__new__(ScheduleChecker)  # the local part only: no group
    checker.enabled = True
    checker._pending_updates, checker._tokens_crc, checker._flags_crc = [], 0, 0
    rng = np.random.default_rng(3)
    ids = np.arange(40, dtype=np.uint64)
    buffer = rng.integers(0, 32000, size=40).astype(np.int64)
    flags = buffer % 7 == 0
    checker.record_update(ids, buffer, flags, step=4)
    checker.record_update(ids[:9], buffer[:9], None, step=5)
    buffer[:] = -1  # reused by the caller: what was recorded must not change
    kept = checker._pending_updates
    assert [step for step, _ in kept] == [4, 5]
    assert kept[0][1][1].dtype == np.int32
    assert kept[0][1][1][0] != -1
    folded = (checker._tokens_crc << 32) | checker._flags_crc
    assert folded == updates_fingerprint(kept)
    for _ in range(200):
        position = int(rng.integers(0, 40))
        tokens = kept[0][1][1].copy()
        tokens[position] += int(rng.integers(1, 2**31 - 32000))
        changed = [(4, (ids, tokens, kept[0][1][2])), kept[1]]
        assert updates_fingerprint(changed) != folded
        other = kept[0][1][2].copy()
        other[position] = not other[position]
        assert updates_fingerprint([(4, (ids, kept[0][1][1], other)), kept[1]]) != folded


def test_finish_without_start_does_nothing() -> None:
    """finish() with no check in flight (never started, or already finished) is a no-op,
    so a caller may finish at every update; a disabled checker ignores start too."""
    checker = ScheduleChecker.__new__(ScheduleChecker)
    checker.enabled = True
    checker._in_flight, checker.checks, checker.check_seconds = None, 0, 0.0
    checker.finish()
    assert (checker.checks, checker.in_flight_step) == (0, None)
    with pytest.warns(RuntimeWarning, match="cannot apply"):
        disabled = ScheduleChecker()
    disabled.start(None)
    disabled.finish()
    assert (disabled.checks, disabled.in_flight_step) == (0, None)


def test_group_fields_are_the_decision_fields_and_the_rest_of_the_engine_config() -> None:
    config = sc.engine_config(chunk_unit=None)
    scheduler_config = helix_kv.SchedulerConfig(**config.scheduler_kwargs(), kv_superblocks=9)
    fields = dict(group_fields(config, scheduler_config))
    decisions = dict(scheduler_config.decision_fields())
    # agreed by the quota sync (the minimum over the ranks)
    assert "capacity_superblocks" not in fields
    assert "host_tier_superblocks" not in fields
    assert "cp_rank" not in fields
    for name, value in decisions.items():
        assert name in ("capacity_superblocks", "host_tier_superblocks") or fields[name] == value
    engine_only = {f.name for f in dataclasses.fields(EngineConfig)} - set(SCHEDULER_FIELDS)
    assert engine_only <= set(fields)
    assert {"num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "kv_factor"} <= engine_only
    assert fields["chunk_unit"] == sc.TOKENS_PER_BLOCK  # the unit in effect
    assert len(fields) == len(group_fields(config, scheduler_config))  # no name twice
    other = sc.engine_config(head_dim=16)
    assert ConfigIdentity(0, 2, group_fields(config, scheduler_config)).fingerprint != (
        ConfigIdentity(0, 2, group_fields(other, scheduler_config)).fingerprint
    )
    # helix_kv's own host tier is sized per rank (the group takes the minimum): its bytes may
    # differ between ranks; an engine's (disaggregated) host tier must match
    own = sc.engine_config(aggregated_host_tier=True, host_cache_bytes=1 << 20)
    assert "host_cache_bytes" not in dict(group_fields(own, scheduler_config))
    assert "host_cache_bytes" in fields


def _config_report(rank: int, size: int, **changes: Any) -> dict[str, Any]:
    fields = {"tokens_per_block": 4, "victim_policy": "newest_first", "num_layers": 2}
    fields.update(changes)
    return {"group_rank": rank, "group_size": size, "cp_rank": rank, "cp_size": size,
            "fields": tuple(fields.items())}  # fmt: skip


def test_config_mismatch_names_ranks_fields_and_values() -> None:
    reports = [_config_report(r, 4) for r in range(4)]
    reports[2] = _config_report(2, 4, tokens_per_block=8)
    reports[3]["cp_rank"] = 0
    error = config_mismatch(reports)
    assert isinstance(error, helix_kv.ConfigMismatchError)
    assert isinstance(error, helix_kv.InitSyncError)
    assert isinstance(error, InitSyncConfigMismatchError)
    assert error.ranks == error.failed_ranks == [2, 3]
    assert error.fields == {
        "tokens_per_block": {0: 4, 1: 4, 2: 8, 3: 4},
        "cp_rank": {0: 0, 1: 1, 2: 2, 3: 0},
    }
    assert error.reasons == {
        2: "tokens_per_block = 8 (rank 0: 4)",
        3: "cp_rank = 0, not its group rank 3",
    }
    text = str(error)
    assert "rank(s) 2, 3 of 4 differ from rank(s) 0, 1 in tokens_per_block, cp_rank" in text
    assert "  tokens_per_block: 4 on rank(s) 0, 1, 3 | 8 on rank(s) 2" in text
    assert "(must equal the group rank: rank 3 has 3)" in text


def test_config_mismatch_names_a_field_one_rank_lacks() -> None:
    reports = [_config_report(0, 2), _config_report(1, 2)]
    reports[1]["fields"] += (("new_field", 1),)
    error = config_mismatch(reports)
    assert error.ranks == [1]
    assert "new_field: (absent) on rank(s) 0 | 1 on rank(s) 1" in str(error)


def test_a_lone_process_releases_its_partial_pool_when_allocation_fails() -> None:
    refs: list[Any] = []

    def allocate(built: HelixKVRank) -> sc.KVPool:
        pool = sc.KVPool(built.capacity_superblocks)
        refs.append(weakref.ref(pool))
        if len(refs) == 1:
            raise RuntimeError("injected: out of memory")
        return pool

    try:
        HelixKVRank.create(sc.engine_config(), 8 * sc.PAGE_BYTES, allocate=allocate)
    except RuntimeError:
        assert refs[0]() is None  # not even the half-built pool outlives the failure
        retried = HelixKVRank.create(sc.engine_config(), 8 * sc.PAGE_BYTES, allocate=allocate)
    assert retried.kv_storage is refs[1]()
