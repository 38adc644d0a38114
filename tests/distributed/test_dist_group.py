"""Multi-process tests over a real torch.distributed group: gloo on CPU (2 and 4 ranks), and
NCCL on two GPUs (four with four GPUs) when CUDA is present.

Every scenario that drives steps runs in both modes: plain (schedule, update) and overlap
(step ``t + 1`` scheduled while step ``t`` is pending, as an overlapping executor does), and
the overlap outputs must equal the plain ones token for token.

One group per (backend, ranks) runs every cooperative scenario in turn (``dist_scenarios``),
so the spawn and rendezvous are paid once; each test below asserts on its scenario's reports.
A rank that dies or hangs fails the tests (deadline), never the run.
"""

from __future__ import annotations

from typing import Any

import pytest

from helix_kv.simulate.tokens import expected_output

torch = pytest.importorskip("torch")

# after the torch skip: both import torch
from ..helpers.process_group import GroupRun, cuda_ranks_available, run_group  # noqa: E402
from . import dist_scenarios as sc  # noqa: E402

GROUP_TIMEOUT_S = 20.0

SCENARIOS = [
    sc.scenario_quota,
    sc.scenario_init_failure,
    sc.scenario_init_failure_budget,
    sc.scenario_init_failures_mixed,
    sc.scenario_check_env_mismatch,
    sc.scenario_check_env_on,
    sc.scenario_config_mismatch,
    sc.scenario_checker_failure,
    sc.scenario_retry_releases_pool,
    sc.scenario_guards,
    sc.scenario_diverge_token,
    sc.scenario_diverge_accepted,
    sc.scenario_diverge_request,
    sc.scenario_diverge_victim,
    sc.scenario_long_run,
    sc.scenario_check_cost,
    sc.scenario_check_split,
    sc.scenario_abort,
    sc.scenario_host_tier,
    sc.scenario_host_tier_overlap,
    sc.scenario_diverge_abort,
    sc.scenario_diverge_token_overlap,
    sc.scenario_diverge_accepted_overlap,
    sc.scenario_diverge_request_overlap,
    sc.scenario_diverge_victim_overlap,
    sc.scenario_long_run_overlap,
    sc.scenario_abort_overlap,
    sc.scenario_diverge_abort_overlap,
    sc.scenario_overlap_equivalence,
]

#: Scenario name suffix of each mode.
MODES = {"plain": "", "overlap": "_overlap"}
#: Steps between a step and the first check that compares its tokens: the next schedule in
#: plain mode; in overlap mode the update of step t follows the schedule of t + 1.
TOKEN_CHECK_DELAY = {"plain": 1, "overlap": 2}


def _needs(backend: str, world: int) -> list[Any]:
    if backend == "nccl" and not cuda_ranks_available(world):
        return [pytest.mark.skip(reason=f"NCCL test needs {world} CUDA GPUs")]
    return []


GROUPS = [
    pytest.param((backend, world), id=f"{backend}-{world}", marks=_needs(backend, world))
    for backend, world in [("gloo", 2), ("gloo", 4), ("nccl", 2), ("nccl", 4)]
]

_RUNS: dict[tuple, GroupRun] = {}


@pytest.fixture(params=GROUPS)
def group(request: pytest.FixtureRequest) -> GroupRun:
    """Every scenario's reports from one group (run once per backend and size)."""
    key = request.param
    if key not in _RUNS:
        backend, world = key
        _RUNS[key] = run_group(
            SCENARIOS, world, backend, deadline_s=150.0, group_timeout_s=GROUP_TIMEOUT_S
        )
    return _RUNS[key]


def test_ranks_with_different_budgets_agree_on_the_minimum(group: GroupRun) -> None:
    reports = group.scenario("scenario_quota")
    world = group.world
    smallest = min(sc.quota_budget(r) // sc.PAGE_BYTES for r in range(world))
    for rank, report in enumerate(reports):
        assert report["cp_rank"] == rank
        assert report["cp_size"] == world
        assert report["local"] == sc.quota_budget(rank) // sc.PAGE_BYTES
        assert report["capacity"] == report["scheduler_capacity"] == smallest
        assert report["capacity_tokens"] == smallest * sc.TOKENS_PER_BLOCK * world
        assert report["allocated_for"] == [smallest]
        agreed = [m for m in report["logs"] if "KV quota agreed" in m]
        assert agreed, report["logs"]
        assert f"{world} CP ranks: {smallest} superblocks" in agreed[0]
        assert f"= {report['capacity_tokens']} global tokens" in agreed[0]
        assert f"rank {rank} offered {report['local']}" in agreed[0]
        assert f"configuration fingerprint {report['fingerprint']:016x}" in agreed[0]
    # A lower budget shrinks everyone; the largest budget (rank 0) did not grow anyone.
    assert reports[0]["local"] > reports[0]["capacity"]


def test_failed_allocation_on_one_rank_raises_on_every_rank(group: GroupRun) -> None:
    failing = group.world - 1
    for rank, report in enumerate(group.scenario("scenario_init_failure")):
        assert not report["ok"]
        assert report["type"] == "InitSyncError", report
        assert report["failed_ranks"] == [failing]
        assert f"CP rank(s) {failing} of {group.world}" in report["message"]
        assert "injected: CUDA out of memory" in report["message"]
        assert report["cause"] == ("RuntimeError" if rank == failing else None)
        assert report["seconds"] < GROUP_TIMEOUT_S / 2


def test_config_error_on_one_rank_raises_on_every_rank(group: GroupRun) -> None:
    for report in group.scenario("scenario_init_failure_budget"):
        assert report["is_init_sync"], report
        assert report["is_config"]
        assert report["failed_ranks"] == [1]
        assert "rank 1: ConfigError: kv_budget_bytes = 100 holds no KV page" in report["message"]


def test_mixed_failures_name_every_failing_rank(group: GroupRun) -> None:
    last = group.world - 1
    for report in group.scenario("scenario_init_failures_mixed"):
        assert report["type"] == "InitSyncError", report
        assert report["failed_ranks"] == [0, last]
        assert "rank 0: ConfigError" in report["message"]
        assert f"rank {last}: ConfigGuardError: host_cache_bytes" in report["message"]


def test_check_setting_must_agree_across_ranks(group: GroupRun) -> None:
    for report in group.scenario("scenario_check_env_mismatch"):
        assert report["is_init_sync"], report
        assert "HELIX_KV_CHECK_SCHEDULE differs" in report["message"]
        assert "on for rank(s) 0" in report["message"]
    assert all(r["checker"] for r in group.scenario("scenario_check_env_on"))


def _mismatch_reports(group: GroupRun, case: str) -> list[dict[str, Any]]:
    reports = [report[case] for report in group.scenario("scenario_config_mismatch")]
    for report in reports:
        assert report.get("is_config_mismatch"), report
        assert report["is_init_sync"]
        assert report["is_config"]
        assert report["failed_ranks"] == report["ranks"]
        assert report["seconds"] < GROUP_TIMEOUT_S / 2
    assert len({report["message"] for report in reports}) == 1  # the same error everywhere
    return reports


@pytest.mark.parametrize("case", sorted(sc.MISMATCHES))
def test_config_mismatch_raises_on_every_rank_naming_the_field(group: GroupRun, case: str) -> None:
    mismatch = sc.MISMATCHES[case]
    last = group.world - 1
    base = sc.engine_config(**(mismatch.base or {}))
    expected = mismatch.changes[mismatch.field]
    for report in _mismatch_reports(group, case):
        assert report["ranks"] == [last]
        values = report["fields"][mismatch.field]
        assert values[last] == expected
        assert all(values[r] == getattr(base, mismatch.field) for r in range(last)), values
        assert f"rank(s) {last} of {group.world} differ from rank(s) 0" in report["message"]
        assert f"  {mismatch.field}: " in report["message"]
        assert f"{expected!r} on rank(s) {last}" in report["message"]


def test_config_mismatch_of_half_the_group_names_the_other_half(group: GroupRun) -> None:
    upper = list(range(group.world // 2, group.world))
    for report in _mismatch_reports(group, "split"):
        assert report["ranks"] == upper
        assert report["fields"]["tokens_per_block"] == {
            r: 8 if r in upper else sc.TOKENS_PER_BLOCK for r in range(group.world)
        }


def test_config_mismatch_on_two_ranks_names_both(group: GroupRun) -> None:
    last = group.world - 1
    for report in _mismatch_reports(group, "two_ranks"):
        assert report["ranks"] == [0, last] if group.world > 2 else [last]
        assert set(report["fields"]) == {"victim_policy", "num_layers"}
        assert report["fields"]["victim_policy"][0] == "priority"
        assert report["fields"]["num_layers"][last] == 4


def test_cp_rank_and_size_must_be_the_place_in_the_group(group: GroupRun) -> None:
    last, world = group.world - 1, group.world
    for report in _mismatch_reports(group, "cp_rank"):
        assert report["ranks"] == [last]
        assert report["fields"] == {"cp_rank": {r: 0 if r == last else r for r in range(world)}}
        assert f"must equal the group rank: rank {last} has {last}" in report["message"]
    for report in _mismatch_reports(group, "cp_size"):
        assert report["ranks"] == [last]
        assert report["fields"]["cp_size"][last] == world + 1
        assert f"must equal the group size: rank {last} has {world}" in report["message"]


def test_a_failure_is_reported_before_a_config_mismatch(group: GroupRun) -> None:
    last = group.world - 1
    for report in group.scenario("scenario_config_mismatch"):
        got = report["failure_first"]
        assert got["is_guard"], got
        assert not got["is_config_mismatch"]
        assert got["failed_ranks"] == [last]
        assert report["agreeing"]["ok"], report["agreeing"]


def test_checker_failure_is_reported_through_the_init_sync(group: GroupRun) -> None:
    last = group.world - 1
    for report in group.scenario("scenario_checker_failure"):
        assert report["type"] == "InitSyncError", report
        assert report["failed_ranks"] == [last]
        assert "injected: schedule checker construction failed" in report["message"]
        assert report["seconds"] < GROUP_TIMEOUT_S / 2


def test_a_retry_after_a_failed_init_does_not_hold_two_pools(group: GroupRun) -> None:
    for report in group.scenario("scenario_retry_releases_pool"):
        assert report["raised"] == "InitSyncError", report
        assert not report["first_alive_in_except"]
        assert report["alive_after_retry"] == [False, True]
        assert report["retry_holds_its_pool"]


@pytest.mark.parametrize("guard", sorted(sc.GUARDS))
def test_guard_rejects_on_every_rank(group: GroupRun, guard: str) -> None:
    needle = {
        "host_tier": "an engine host KV tier is rejected under aggregated Helix",
        "disk_tier": "a disk KV tier is rejected under aggregated Helix",
        "kv_connector": "KV connectors are rejected under aggregated Helix",
        "kv_pool_rebalance": "KV-pool rebalance is rejected under aggregated Helix",
    }[guard]
    for report in group.scenario("scenario_guards"):
        got = report[f"reject/{guard}"]
        assert got["is_guard"], got
        assert got["is_init_sync"]
        assert got["failed_ranks"] == list(range(group.world))
        assert needle in got["message"]


def test_guard_on_one_rank_stops_every_rank(group: GroupRun) -> None:
    for report in group.scenario("scenario_guards"):
        got = report["reject/one_rank"]
        assert got["is_guard"], got
        assert got["failed_ranks"] == [1]
        assert "kv_connector = 'nixl'" in got["message"]
        got = report["reject/disagg_rebalance"]
        assert got["is_guard"], got
        assert f"rejected under Helix (cp_size = {group.world})" in got["message"]


def test_allowed_configurations_construct(group: GroupRun) -> None:
    for report in group.scenario("scenario_guards"):
        assert report["allow/disagg_tiers_connector"]["ok"], report["allow/disagg_tiers_connector"]
        assert report["allow/aggregated_default"]["ok"]
        assert any("automatic host KV tier skipped" in m for m in report["auto_host_tier_logs"])


def test_aggregated_host_tier_takes_the_smallest_ranks_host_pages(group: GroupRun) -> None:
    for report in group.scenario("scenario_guards"):
        got = report["allow/aggregated_host_tier"]
        assert got["ok"], got
        # rank r offers 8 * (r + 1) host pages; the group takes rank 0's 8
        assert report["aggregated_host_tier_superblocks"] == 8
        automatic = report["aggregated_auto_host_tier_superblocks"]
        assert automatic == 64  # as large as the GPU budget (64 pages on every rank)
        assert any("automatic host KV tier of" in m for m in report["auto_host_tier_logs"])


@pytest.mark.parametrize("mode", MODES)
def test_divergent_accepted_draft_count_is_caught_at_the_next_check(
    group: GroupRun, mode: str
) -> None:
    """A rank fed another accepted count keeps another token: the next check that compares
    that update catches it, naming that rank."""
    reports = group.scenario("scenario_diverge_accepted" + MODES[mode])
    for report in reports:
        assert report["caught"], report
        injected = report["injected_step"]
        assert injected >= sc.INJECT_STEP
        # the first check that covers the update (or the schedule it changed) catches it
        assert injected < report["step"] <= injected + TOKEN_CHECK_DELAY[mode]
        assert report["ranks"] == [group.world - 1]


@pytest.mark.parametrize("mode", MODES)
def test_divergent_sampled_token_is_caught_at_the_next_check(group: GroupRun, mode: str) -> None:
    reports = group.scenario("scenario_diverge_token" + MODES[mode])
    caught_at = sc.INJECT_STEP + TOKEN_CHECK_DELAY[mode]
    for report in reports:
        assert report["caught"], report
        # raised after the schedule of the caught step returned and before the next one did:
        # by the step's update (plain) or the next schedule (one step ahead) ...
        assert report["last_step"] == caught_at
        assert report["step"] == caught_at
        # ... with the caught step still pending: nothing of it was committed
        assert report["pending_after"] == (1 if mode == "plain" else 2)
        assert report["check_in_flight"] is None
        assert report["ranks"] == [group.world - 1]
        assert "sampled_tokens" in report["fields"]
        last = group.world - 1
        assert f"schedule of step {caught_at}: rank(s) {last} differ" in report["message"]
        # the tokens are named with the step they were sampled in
        assert f"sampled_tokens: rank 0: step {sc.INJECT_STEP}: " in report["message"]
    assert len({r["message"] for r in reports}) == 1  # the same error on every rank


@pytest.mark.parametrize("mode", MODES)
def test_divergent_request_is_caught_on_the_step_it_is_scheduled(
    group: GroupRun, mode: str
) -> None:
    for report in group.scenario("scenario_diverge_request" + MODES[mode]):
        assert report["caught"], report
        assert report["step"] == sc.INJECT_STEP + 1
        assert report["ranks"] == [group.world - 1]
        assert "context_lens" in report["fields"], report["fields"]
        assert "100:0+10" in report["message"]
        assert "100:0+30" in report["message"]


@pytest.mark.parametrize("mode", MODES)
def test_divergent_schedule_is_raised_before_the_step_is_committed(
    group: GroupRun, mode: str
) -> None:
    """The schedule check runs under the step's work (started by schedule(), finished by the
    step's update()): a divergent schedule is still raised on every rank, at its own step,
    before the next schedule returns and with the step still pending."""
    for name in ("scenario_diverge_request", "scenario_diverge_victim"):
        reports = group.scenario(name + MODES[mode])
        for report in reports:
            assert report["caught"], report
            assert report["last_step"] == report["step"], report
            assert report["pending_after"] == (1 if mode == "plain" else 2), report
        assert len({(r["step"], r["message"]) for r in reports}) == 1


def test_split_check_halves(group: GroupRun) -> None:
    reports = group.scenario("scenario_check_split")
    for report in reports:
        first, second = report["steps"]
        assert report["finish_without_start"] == [0, None]
        assert report["in_flight"] == first
        assert report["gathered"] == [float(r) for r in range(group.world)]
        assert report["after_second_start"] == [1, second]
        assert report["after_finishes"] == [2, None]
        mismatch = report["mismatch"]
        assert mismatch is not None, report
        assert mismatch["is_mismatch"], report
        assert mismatch["step"] == report["third"]
        assert mismatch["ranks"] == [group.world - 1]
        assert "sampled_tokens" in mismatch["fields"]
        assert f"step {first}: " in mismatch["message"]
        assert report["after_mismatch"] == [3, None]
        assert report["after_recovery"] == [4, None]
    assert len({r["mismatch"]["message"] for r in reports}) == 1


@pytest.mark.parametrize("mode", MODES)
def test_divergent_victim_is_named(group: GroupRun, mode: str) -> None:
    for report in group.scenario("scenario_diverge_victim" + MODES[mode]):
        assert report["caught"], report
        assert report["ranks"] == [group.world - 1]
        assert "preempted_ids" in report["fields"], report["fields"]
        assert f"schedule of step {report['step']}:" in report["message"]


@pytest.mark.parametrize("mode", MODES)
def test_long_pressured_run_has_no_false_positive(group: GroupRun, mode: str) -> None:
    reports = group.scenario("scenario_long_run" + MODES[mode])
    assert all(r["preemptions"] > 0 for r in reports), [r["preemptions"] for r in reports]
    for report in reports[1:]:
        assert report == reports[0]
    assert all(len(tokens) > 0 for tokens in reports[0]["outputs"].values())
    assert (reports[0]["kv_used"], reports[0]["live"]) == (0, 0)


def test_long_pressured_run_overlap_outputs_equal_plain(group: GroupRun) -> None:
    plain = group.scenario("scenario_long_run")[0]
    overlap = group.scenario("scenario_long_run_overlap")[0]
    assert overlap["outputs"] == plain["outputs"]
    for rid, tokens in plain["outputs"].items():
        assert tokens == expected_output(rid, len(tokens)).tolist()


@pytest.mark.parametrize("workload", sc.EQUIVALENCE_WORKLOADS)
def test_overlap_outputs_equal_plain_outputs(group: GroupRun, workload: str) -> None:
    reports = group.scenario("scenario_overlap_equivalence")
    for report in reports[1:]:
        assert report[workload] == reports[0][workload]  # every rank, both modes
    plain, overlap = reports[0][workload]["plain"], reports[0][workload]["overlap"]
    assert overlap["outputs"] == plain["outputs"]  # token for token
    assert overlap["reasons"] == plain["reasons"]
    for run in (plain, overlap):
        assert run["preemptions"] > 0, workload  # every workload is pressured
        assert (run["kv_used"], run["live"]) == (0, 0)  # nothing leaked
    assert len(plain["outputs"]) == sc.EQUIVALENCE_REQUESTS
    for rid, tokens in plain["outputs"].items():
        assert tokens == expected_output(rid, len(tokens)).tolist()
    if workload == "prefix_caching":  # the shared system prompt is read from the cache
        assert plain["prefix_cache_hits"] > 0
        assert overlap["prefix_cache_hits"] > 0
    if workload == "eos":  # some requests stop early on EOS, at the same token in both modes
        stopped = [rid for rid, reason in plain["reasons"].items() if reason == "eos"]
        assert len(stopped) >= 3, plain["reasons"]
        for rid in stopped:
            last = plain["outputs"][rid][-1]
            assert rid % 2 == 0, rid
            assert last % 5 == 0, (rid, last)


@pytest.mark.parametrize("mode", MODES)
def test_aborts_in_every_state_keep_ranks_identical_and_survivors_unchanged(
    group: GroupRun, mode: str
) -> None:
    reports = group.scenario("scenario_abort" + MODES[mode])
    for report in reports[1:]:
        assert report == reports[0]  # outputs, finish reasons, states, metrics: every rank
    report = reports[0]
    aborted = {rid for rid, reason in report["reasons"].items() if reason == "aborted"}
    assert aborted <= set(sc.ABORT_PLAN), report["reasons"]
    assert len(aborted) >= 6, report["reasons"]
    assert report["aborts"] == len(aborted)
    assert report["preemptions"] > 0
    assert (report["kv_used"], report["live"]) == (0, 0)  # nothing left behind
    for state in ("waiting", "prefilling", "decoding", "recompute-paused"):
        for when in ("", " while pending"):
            assert state + when in report["states"], report["states"]
    survivors = {rid: out for rid, out in report["outputs"].items() if rid not in aborted}
    assert survivors == report["alone"]  # as if the aborted requests had never been sent
    for rid in aborted:  # what an aborted request generated is the start of its full output
        got = report["outputs"][rid]
        assert got == expected_output(rid, len(got)).tolist()


@pytest.mark.parametrize("mode", MODES)
def test_aggregated_host_tier_suspends_identically_on_every_rank(
    group: GroupRun, mode: str
) -> None:
    reports = group.scenario("scenario_host_tier" + MODES[mode])
    for report in reports[1:]:
        assert report == reports[0]  # outputs, states, metrics, agreed host tier: every rank
    report = reports[0]
    assert report["host_tier_superblocks"] == 24  # the smallest rank's host pages
    assert report["suspensions"] > 0
    assert report["resumes"] > 0
    assert (report["kv_used"], report["host_used"], report["live"]) == (0, 0, 0)
    aborted = {rid for rid, reason in report["reasons"].items() if reason == "aborted"}
    assert aborted, report["states"]
    assert set(report["states"]) <= {"suspended", "suspended while pending"}
    for rid, got in report["outputs"].items():  # finished ones whole, aborted ones a prefix
        assert got == expected_output(rid, len(got)).tolist()
        if rid not in aborted:
            assert len(got) == 12 + (rid * 7) % 25


@pytest.mark.parametrize("mode", MODES)
def test_an_abort_on_one_rank_only_is_caught_at_the_next_step(group: GroupRun, mode: str) -> None:
    for report in group.scenario("scenario_diverge_abort" + MODES[mode]):
        assert report["caught"], report
        assert report["step"] == sc.INJECT_STEP + 2
        assert report["ranks"] == [group.world - 1]


def test_check_cost_per_step(group: GroupRun, capsys: pytest.CaptureFixture) -> None:
    reports = group.scenario("scenario_check_cost")
    worst = max(r["median_us"] for r in reports)
    with capsys.disabled():
        print(
            f"\nschedule check on {group.world} {group.backend} ranks: median "
            + ", ".join(f"{r['median_us']:.1f}" for r in reports)
            + f" us/step per rank (p90 {max(r['p90_us'] for r in reports):.1f} us)"
        )
    assert worst < 5000  # sanity only; the figure is the output
    if group.backend == "nccl":  # the graph path polls against the group's own timeout
        assert all(r["timeout_s"] == GROUP_TIMEOUT_S for r in reports)


def test_group_finished_in_time(group: GroupRun) -> None:
    assert not group.problems, group.problems


@pytest.mark.parametrize("world", [2, 4])
def test_dead_rank_makes_peers_raise_not_hang(world: int) -> None:
    """gloo only: a dead NCCL peer is handled by NCCL's watchdog, which aborts the process."""
    run = run_group(
        [sc.scenario_rank_dies], world, "gloo", deadline_s=60.0, group_timeout_s=10.0,
        allowed_exits={world - 1: 17},
    )  # fmt: skip
    assert not run.problems, run.problems
    reports = run.results.get("scenario_rank_dies", {})
    assert sorted(reports) == list(range(world - 1)), (reports, run.errors)
    for report in reports.values():
        assert report["is_init_sync"], report
        assert "died or did not reach the sync" in report["message"]
        assert report["seconds"] < 15.0


@pytest.mark.skipif(not cuda_ranks_available(2), reason="needs 2 CUDA GPUs (NCCL)")
def test_stuck_peer_times_out_the_nccl_check() -> None:
    """The NCCL check replays a CUDA graph, which torch's watchdog does not watch: a peer that
    never arrives must make the others raise after the checker's timeout, not hang."""
    run = run_group([sc.scenario_check_timeout], 2, "nccl", deadline_s=60.0, exit_grace_s=3.0)
    reports = run.scenario("scenario_check_timeout")
    assert reports[1]["skipped"]
    waited = reports[0]
    assert waited["type"] == "HelixKVError", waited
    assert "did not reach this step's check within 2 s" in waited["message"]
    assert 2.0 <= waited["seconds"] < 5.0
