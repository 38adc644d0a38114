"""helix_kv.distributed.prometheus: a rank's metrics scraped as Prometheus text and read back
with prometheus_client's parser: vLLM's names and types, the ``cp_rank`` label, values equal to
the scheduler's own totals, counters that never decrease, and scrapes from another thread."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry

import helix_kv
from helix_kv.distributed import HelixKVRank
from helix_kv.distributed import prometheus as prom
from helix_kv.simulate.tokens import prompt_tokens

from ..helpers.scheduler import sample
from . import dist_scenarios as sc
from .prometheus_scenarios import Samples, scrape

ROOT = Path(__file__).resolve().parents[2]

#: Sample name -> family type. Written out (not read from the module) so a renamed or retyped
#: metric fails here: the first five and the preemption counter are vLLM's names and types.
EXPECTED_TYPES = {
    "helix_kv:num_requests_running": "gauge",
    "helix_kv:num_requests_waiting": "gauge",
    "helix_kv:num_requests_swapped": "gauge",
    "helix_kv:kv_cache_usage_perc": "gauge",
    "helix_kv:cpu_cache_usage_perc": "gauge",
    "helix_kv:num_preemptions_total": "counter",
    "helix_kv:request_success_total": "counter",
    "helix_kv:num_steps_total": "counter",
    "helix_kv:num_computed_tokens_total": "counter",
    "helix_kv:num_recomputed_tokens_total": "counter",
    "helix_kv:num_sat_out_total": "counter",
    "helix_kv:num_suspensions_total": "counter",
    "helix_kv:num_resumes_total": "counter",
    "helix_kv:num_aborts_total": "counter",
    "helix_kv:num_deadlocks_total": "counter",
    "helix_kv:prefix_cache_queries_total": "counter",
    "helix_kv:prefix_cache_hits_total": "counter",
    "helix_kv:prefix_cache_recompute_queries_total": "counter",
    "helix_kv:prefix_cache_recompute_hits_total": "counter",
    "helix_kv:prefix_cache_same_step_hits_total": "counter",
    "helix_kv:prefix_cache_evictions_total": "counter",
    "helix_kv:spec_decode_num_drafts_total": "counter",
    "helix_kv:spec_decode_num_draft_tokens_total": "counter",
    "helix_kv:spec_decode_num_accepted_tokens_total": "counter",
    "helix_kv:spec_decode_num_trimmed_tokens_total": "counter",
    "helix_kv:schedule_check_seconds_count": "summary",
    "helix_kv:schedule_check_seconds_sum": "summary",
}
COUNTERS = [name for name, kind in EXPECTED_TYPES.items() if kind != "gauge"]


def expected_values(rank: HelixKVRank) -> dict[str, float]:
    """What each sample must read, from the scheduler's own totals and the rank's counters."""
    scheduler = rank.scheduler
    totals = scheduler.metrics()
    host = rank.host_tier_superblocks
    checker = rank.checker
    return {
        "helix_kv:num_requests_running": scheduler.num_running,
        "helix_kv:num_requests_waiting": scheduler.num_waiting,
        "helix_kv:num_requests_swapped": scheduler.num_suspended,
        "helix_kv:kv_cache_usage_perc": totals.kv_utilization,
        "helix_kv:cpu_cache_usage_perc": scheduler.host_used_superblocks / host if host else 0.0,
        "helix_kv:num_preemptions_total": totals.preemptions,
        "helix_kv:request_success_total": totals.finished,
        "helix_kv:num_steps_total": totals.steps,
        "helix_kv:num_computed_tokens_total": totals.computed_tokens,
        "helix_kv:num_recomputed_tokens_total": totals.recomputed_tokens,
        "helix_kv:num_sat_out_total": totals.sat_out,
        "helix_kv:num_suspensions_total": totals.suspensions,
        "helix_kv:num_resumes_total": rank.scheduler.metrics().resumes,
        "helix_kv:num_aborts_total": totals.aborts,
        "helix_kv:num_deadlocks_total": rank.deadlocks,
        "helix_kv:prefix_cache_queries_total": totals.prefix_cache_queries,
        "helix_kv:prefix_cache_hits_total": totals.prefix_cache_hits,
        "helix_kv:prefix_cache_recompute_queries_total": totals.prefix_cache_recompute_queries,
        "helix_kv:prefix_cache_recompute_hits_total": totals.prefix_cache_recompute_hits,
        "helix_kv:prefix_cache_same_step_hits_total": totals.prefix_cache_same_step_hits,
        "helix_kv:prefix_cache_evictions_total": totals.prefix_cache_evictions,
        "helix_kv:spec_decode_num_drafts_total": totals.spec_decode_num_drafts,
        "helix_kv:spec_decode_num_draft_tokens_total": totals.spec_decode_num_draft_tokens,
        "helix_kv:spec_decode_num_accepted_tokens_total": totals.spec_decode_num_accepted_tokens,
        "helix_kv:spec_decode_num_trimmed_tokens_total": totals.spec_decode_num_trimmed_tokens,
        "helix_kv:schedule_check_seconds_count": 0 if checker is None else checker.checks,
        "helix_kv:schedule_check_seconds_sum": 0.0 if checker is None else checker.check_seconds,
    }


def check_scrape(samples: Samples, rank: HelixKVRank, labels: dict[str, str]) -> None:
    assert {name: kind for name, (kind, _, _) in samples.items()} == EXPECTED_TYPES
    for name, (_, got_labels, _) in samples.items():
        assert got_labels == labels, name
    values = {name: value for name, (_, _, value) in samples.items()}
    assert values == pytest.approx(expected_values(rank), rel=0, abs=0)


def check_monotonic(before: Samples, after: Samples) -> None:
    for name in COUNTERS:
        assert after[name][2] >= before[name][2], name


def pressured_non_helix_rank() -> HelixKVRank:
    """One process, ``non_helix`` with a small host tier: the workload below both suspends
    (and resumes) requests and recompute-pauses others once the tier is full."""
    config = sc.engine_config(serving_mode="non_helix", host_cache_bytes=8 * sc.PAGE_BYTES)
    return HelixKVRank.create(config, 24 * sc.PAGE_BYTES, check_schedule=False)


def test_scrape_parses_and_matches_the_scheduler_on_every_step() -> None:
    rank = pressured_non_helix_rank()
    registry = CollectorRegistry()
    collector = prom.register_rank_metrics(rank, registry, model_name="tiny")
    labels = {"model_name": "tiny", "cp_rank": "0"}
    sc.add_workload(rank, count=16)
    previous = scrape(registry)
    check_scrape(previous, rank, labels)
    resumed_in_updated_steps = 0
    resumed_in_reverted_steps = 0
    for step in range(5000):
        if not rank.scheduler.has_unfinished():
            break
        out = rank.schedule()
        mid_step = scrape(registry)  # between schedule() and update(): still consistent
        check_scrape(mid_step, rank, labels)
        check_monotonic(previous, mid_step)
        if step == 10:
            rank.abort(14)  # pending step: takes effect when it closes
        if step % 9 == 4:
            rank.revert()  # its resumes are undone and must not be counted
            resumed_in_reverted_steps += out.resumed_ids.size
        else:
            rank.update(sample(rank.scheduler, out))
            resumed_in_updated_steps += out.resumed_ids.size
        if step == 20:
            rank.abort(15)  # between steps: takes effect now
        current = scrape(registry)
        check_scrape(current, rank, labels)
        check_monotonic(mid_step, current)
        previous = current
    else:
        pytest.fail("workload did not finish")

    values = {name: value for name, (_, _, value) in previous.items()}
    assert resumed_in_reverted_steps > 0  # else the revert rule goes untested
    # The workload exercised every counter (else the equalities above prove little).
    for name in (
        "num_preemptions_total",
        "num_recomputed_tokens_total",
        "num_suspensions_total",
        "num_resumes_total",
        "num_sat_out_total",
    ):
        assert values["helix_kv:" + name] > 0, name
    assert values["helix_kv:num_aborts_total"] == 2
    assert values["helix_kv:request_success_total"] == 14
    assert values["helix_kv:num_resumes_total"] == resumed_in_updated_steps
    assert values["helix_kv:num_requests_running"] == 0
    assert values["helix_kv:kv_cache_usage_perc"] == 0.0
    registry.unregister(collector)
    assert scrape(registry) == {}


def test_speculative_decoding_counters_match_the_scheduler() -> None:
    """With drafts: the four spec-decode counters and one acceptance sample per draft position
    (label ``position``) read what the scheduler counted, scrape after scrape."""
    config = sc.engine_config(num_speculative_tokens=3)
    rank = HelixKVRank.create(config, 64 * sc.PAGE_BYTES, check_schedule=False)
    registry = CollectorRegistry()
    prom.register_rank_metrics(rank, registry)
    for i in range(4):
        rank.add_request(i, prompt_tokens(i, 6), 12)
    step = 0
    while rank.scheduler.has_unfinished():
        live = [int(i) for i in rank.scheduler.queue_ids()]
        decoding = [i for i in live if rank.scheduler.request_state(i) == "decoding"]
        if decoding:
            rank.propose_drafts(decoding, [3] * len(decoding), [7, 8, 9] * len(decoding))
        out = rank.schedule()
        counts = np.asarray(out.generation_draft_counts, dtype=np.int64)
        accepted = (counts + step) % (counts + 1)  # some full, some partial, some none
        rank.update(np.full(out.num_samples, 5, dtype=np.int32), accepted=accepted)
        step += 1
        samples = scrape(registry)
        check_scrape({k: v for k, v in samples.items() if "[" not in k}, rank, {"cp_rank": "0"})
        per_position = rank.scheduler.spec_decode_accepted_per_position()
        assert [
            samples[f"helix_kv:spec_decode_num_accepted_tokens_per_pos_total[{j}]"][2]
            for j in range(3)
        ] == per_position.tolist()
    totals = rank.scheduler.metrics()
    assert totals.spec_decode_num_drafts > 0
    assert 0 < totals.spec_decode_num_accepted_tokens < totals.spec_decode_num_draft_tokens
    assert int(per_position.sum()) == totals.spec_decode_num_accepted_tokens


def test_gauges_read_mid_run() -> None:
    rank = pressured_non_helix_rank()
    registry = CollectorRegistry()
    prom.register_rank_metrics(rank, registry)
    sc.add_workload(rank, count=16)
    seen: dict[str, float] = {}
    for out in sc.drive(rank):
        del out
        for name, (_, _, value) in scrape(registry).items():
            seen[name] = max(seen.get(name, 0.0), value)
    assert seen["helix_kv:num_requests_running"] > 0
    assert seen["helix_kv:num_requests_waiting"] > 0
    assert seen["helix_kv:num_requests_swapped"] > 0
    assert 0.5 < seen["helix_kv:kv_cache_usage_perc"] <= 1.0
    assert 0.0 < seen["helix_kv:cpu_cache_usage_perc"] <= 1.0


def test_deadlocks_are_counted_per_raise() -> None:
    config = sc.engine_config(
        serving_mode="non_helix", host_cache_bytes=0, max_preemptions_per_request=0,
        deadlock_steps=3,
    )  # fmt: skip
    rank = HelixKVRank.create(config, 6 * sc.PAGE_BYTES, check_schedule=False)
    registry = CollectorRegistry()
    prom.register_rank_metrics(rank, registry)
    for rid in range(2):
        rank.scheduler.add_request(rid, prompt_tokens(rid, 8), 12)
    raised = 0
    for _ in range(100):
        try:
            out = rank.schedule()
        except helix_kv.DeadlockError:
            raised += 1
            if raised == 3:
                break
            continue
        rank.update(sample(rank.scheduler, out))
    assert raised == 3
    samples = scrape(registry)
    assert samples["helix_kv:num_deadlocks_total"][2] == rank.deadlocks == 3
    check_scrape(samples, rank, {"cp_rank": "0"})


def test_a_second_rank_on_one_registry_is_refused() -> None:
    registry = CollectorRegistry()
    first = HelixKVRank.create(sc.engine_config(), 16 * sc.PAGE_BYTES)
    prom.register_rank_metrics(first, registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        prom.register_rank_metrics(first, registry)
    check_scrape(scrape(registry), first, {"cp_rank": "0"})  # the first one still serves


def test_default_registry_is_prometheus_clients() -> None:
    from prometheus_client import REGISTRY

    rank = HelixKVRank.create(sc.engine_config(), 16 * sc.PAGE_BYTES)
    collector = prom.register_rank_metrics(rank)
    try:
        assert REGISTRY.get_sample_value("helix_kv:num_steps_total", {"cp_rank": "0"}) == 0.0
    finally:
        REGISTRY.unregister(collector)


class _HeldScheduler:
    """A real scheduler that looks held by another thread for its first ``busy`` reads, as
    pyo3 reports it while ``schedule()`` runs with the GIL released."""

    def __init__(self, inner: Any, busy: int) -> None:
        self.inner = inner
        self.busy = busy

    def metrics(self) -> Any:
        if self.busy:
            self.busy -= 1
            raise RuntimeError("Already mutably borrowed")
        return self.inner.metrics()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_scrape_waits_while_the_scheduler_is_held() -> None:
    rank = pressured_non_helix_rank()
    registry = CollectorRegistry()
    prom.register_rank_metrics(rank, registry)
    sc.add_workload(rank, count=16)
    for _, out in zip(range(30), sc.drive(rank)):
        del out
    held = _HeldScheduler(rank.scheduler, busy=3)
    rank.scheduler = held
    samples = scrape(registry)
    assert held.busy == 0
    rank.scheduler = held.inner
    check_scrape(samples, rank, {"cp_rank": "0"})


def test_scrapes_from_another_thread_never_fail() -> None:
    """``schedule()``/``update()`` release the GIL while they hold the scheduler; a scrape
    landing then must wait and succeed, never raise, and never disturb the engine."""
    rank = HelixKVRank.create(
        sc.engine_config(max_batch_size=256, max_num_tokens=8192), 4096 * sc.PAGE_BYTES
    )
    registry = CollectorRegistry()
    prom.register_rank_metrics(rank, registry)
    for rid in range(2000):
        rank.scheduler.add_request(rid, prompt_tokens(rid, 40 + rid % 50), 30)
    errors: list[BaseException] = []
    scrapes: list[Samples] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            try:
                scrapes.append(scrape(registry))
            except BaseException as exc:
                errors.append(exc)
                return

    thread = threading.Thread(target=scraper)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # hand the GIL over often: more scrapes land mid-call
    thread.start()
    try:
        steps = sum(1 for _ in sc.drive(rank))
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert steps > 0
    assert len(scrapes) > 1
    for before, after in zip(scrapes, scrapes[1:]):
        check_monotonic(before, after)
    check_monotonic(scrapes[-1], scrape(registry))
    check_scrape(scrape(registry), rank, {"cp_rank": "0"})


class _BusyScheduler:
    """A scheduler that always looks held by another thread (or fails otherwise)."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.calls = 0

    def metrics(self) -> Any:
        self.calls += 1
        raise RuntimeError(self.message)


def _fake_rank(scheduler: Any, cp_rank: int = 3) -> Any:
    return SimpleNamespace(
        scheduler=scheduler, cp_rank=cp_rank, host_tier_superblocks=0, checker=None,
        deadlocks=0,
    )  # fmt: skip


def test_a_scheduler_busy_too_long_fails_the_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prom, "_BUSY_WAIT_S", 0.05)
    busy = _BusyScheduler("Already mutably borrowed")
    collector = prom.RankCollector(_fake_rank(busy))
    with pytest.raises(TimeoutError, match="CP rank 3: the scheduler stayed busy"):
        list(collector.collect())
    assert busy.calls > 1  # it waited and retried
    other = _BusyScheduler("something else")
    with pytest.raises(RuntimeError, match="something else"):
        list(prom.RankCollector(_fake_rank(other)).collect())
    assert other.calls == 1


def test_metric_table_is_what_is_exposed() -> None:
    """``METRICS`` (what the docs table lists) names exactly the exposed families."""
    names = set()
    for info in prom.METRICS:
        if info.type == "summary":
            names |= {info.name + "_count", info.name + "_sum"}
        else:
            names.add(info.name)
        assert info.name.startswith(prom.PREFIX)
        assert info.type.startswith("counter") == info.name.endswith("_total")
    # The acceptance per draft position has one sample per position (none without drafts).
    per_position = {"helix_kv:spec_decode_num_accepted_tokens_per_pos_total"}
    assert names == set(EXPECTED_TYPES) | per_position
    docs = (ROOT / "docs" / "kv-memory-pressure.md").read_text(encoding="utf-8")
    for info in prom.METRICS:
        assert f"`{info.name}`" in docs, info.name


@pytest.mark.parametrize("module", ["helix_kv", "helix_kv.distributed"])
def test_importing_helix_kv_does_not_import_prometheus_client(module: str) -> None:
    code = f"import sys, {module}; assert 'prometheus_client' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_metrics_extra_declares_prometheus_client() -> None:
    tomllib: Any | None = pytest.importorskip("tomllib")  # Python 3.11+
    assert tomllib is not None
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    for extra in ("metrics", "test"):
        assert any(r.startswith("prometheus_client") for r in extras[extra]), extra


def test_each_rank_of_a_gloo_group_serves_its_own_labelled_metrics() -> None:
    """Two gloo ranks with the schedule check on: each scrape is labelled with its rank, the
    scheduler's values are equal on both ranks at every scrape (they are rank-invariant), and
    ``schedule_check_seconds`` counts every step's check on each rank."""
    from ..helpers.process_group import run_group
    from .prometheus_scenarios import scenario_scraped_run

    run = run_group([scenario_scraped_run], 2, "gloo", deadline_s=100.0, group_timeout_s=20.0)
    reports = run.scenario("scenario_scraped_run")
    own = {"helix_kv:schedule_check_seconds_sum"}
    for rank, report in enumerate(reports):
        scrapes = report["scrapes"]
        for samples in scrapes:
            assert {name: kind for name, (kind, _, _) in samples.items()} == EXPECTED_TYPES
            assert all(labels == {"cp_rank": str(rank)} for _, labels, _ in samples.values())
        for before, after in zip(scrapes, scrapes[1:]):
            check_monotonic(before, after)
        last = {name: value for name, (_, _, value) in scrapes[-1].items()}
        steps = report["metrics"]["steps"]
        assert last["helix_kv:num_steps_total"] == steps
        assert last["helix_kv:num_preemptions_total"] == report["metrics"]["preemptions"] > 0
        assert last["helix_kv:schedule_check_seconds_count"] == report["checks"] == steps
        assert last["helix_kv:schedule_check_seconds_sum"] == report["check_seconds"] > 0
    for first, second in zip(reports[0]["scrapes"], reports[1]["scrapes"]):
        shared = {name: value for name, (_, _, value) in first.items() if name not in own}
        assert shared == {name: second[name][2] for name in shared}


def test_prefix_cache_counters_count_a_shared_prompt() -> None:
    config = sc.engine_config(enable_prefix_caching=True)
    rank = HelixKVRank.create(config, 64 * sc.PAGE_BYTES, check_schedule=False)
    registry = CollectorRegistry()
    prom.register_rank_metrics(rank, registry)
    system = prompt_tokens(7, 40)
    for request_id in range(4):
        rank.add_request(request_id, np.concatenate([system, prompt_tokens(request_id, 3)]), 2)
        out = rank.schedule()  # one admission a step: each finds the one before cached
        rank.update(sample(rank.scheduler, out))
    samples = scrape(registry)
    check_scrape(samples, rank, {"cp_rank": "0"})
    values = {name: value for name, (_, _, value) in samples.items()}
    assert values["helix_kv:prefix_cache_hits_total"] > 0
    assert values["helix_kv:prefix_cache_queries_total"] == 4 * 43
