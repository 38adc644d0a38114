"""Prometheus metrics of a :class:`~helix_kv.distributed.HelixKVRank` (the ``metrics`` extra).

:func:`register_rank_metrics` registers a :class:`RankCollector` for one rank on a
``prometheus_client`` registry. The collector reads the rank's counters when the registry is
scraped, never per step: the scheduler already keeps its totals (``Scheduler.metrics()``), and
the few counters the core cannot keep (deadlocks, schedule-check time) are plain
attribute increments in :class:`~helix_kv.distributed.HelixKVRank` and
:class:`~helix_kv.distributed.ScheduleChecker`.

Names follow vLLM's where vLLM has the metric (``vllm:num_preemptions_total`` becomes
``helix_kv:num_preemptions_total``, with the same type and meaning), so a vLLM dashboard ports by
swapping the prefix; the table is in ``docs/kv-memory-pressure.md``. Every sample carries a
``cp_rank`` label (and ``model_name`` when given, as vLLM does).

This is the only module of helix_kv that imports ``prometheus_client``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client.core import (
    REGISTRY,
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from helix_kv.distributed.rank import HelixKVRank

__all__ = ["METRICS", "PREFIX", "MetricInfo", "RankCollector", "register_rank_metrics"]

#: Prefix of every metric name (vLLM's is ``vllm:``).
PREFIX = "helix_kv:"

#: How long a scrape waits for a ``schedule()``/``update()`` running on another thread.
_BUSY_WAIT_S = 5.0
_BUSY_SLEEP_S = 0.0005


class MetricInfo(NamedTuple):
    """One exported metric: its full name (as scraped), Prometheus type and help text."""

    name: str
    type: str
    help: str


#: Every metric the collector exports, in scrape order. ``name`` is the name in the
#: exposition text: counters end in ``_total``; the summary exposes ``_count`` and ``_sum``.
METRICS: tuple[MetricInfo, ...] = (
    MetricInfo(
        PREFIX + "num_requests_running",
        "gauge",
        "Live requests holding KV (prefilling or decoding).",
    ),
    MetricInfo(
        PREFIX + "num_requests_waiting",
        "gauge",
        "Live requests with nothing computed (new or recompute-paused).",
    ),
    MetricInfo(
        PREFIX + "num_requests_swapped",
        "gauge",
        "Live requests suspended to the host KV tier.",
    ),
    MetricInfo(
        PREFIX + "kv_cache_usage_perc",
        "gauge",
        "KV-cache usage as a fraction of the agreed pool (1 = 100 percent).",
    ),
    MetricInfo(
        PREFIX + "cpu_cache_usage_perc",
        "gauge",
        "Host KV tier usage as a fraction of the tier (0 without a tier).",
    ),
    MetricInfo(
        PREFIX + "num_preemptions_total",
        "counter",
        "Recompute-pauses (a request's KV freed; it is computed again).",
    ),
    MetricInfo(
        PREFIX + "request_success_total",
        "counter",
        "Requests finished by length or end-of-sequence (aborts are not counted).",
    ),
    MetricInfo(PREFIX + "num_steps_total", "counter", "Steps run (updated, not reverted)."),
    MetricInfo(
        PREFIX + "num_computed_tokens_total",
        "counter",
        "Context and decode tokens run, recomputation included.",
    ),
    MetricInfo(
        PREFIX + "num_recomputed_tokens_total",
        "counter",
        "KV tokens thrown away by recompute-pauses (computed again later).",
    ),
    MetricInfo(
        PREFIX + "num_sat_out_total",
        "counter",
        "Times a decoding request sat out a step that ran.",
    ),
    MetricInfo(
        PREFIX + "num_suspensions_total", "counter", "Suspends of a request to the host KV tier."
    ),
    MetricInfo(
        PREFIX + "num_resumes_total",
        "counter",
        "Resumes from the host KV tier, in steps that were updated.",
    ),
    MetricInfo(PREFIX + "num_aborts_total", "counter", "Requests aborted."),
    MetricInfo(
        PREFIX + "prefix_cache_queries_total",
        "counter",
        "Prefix caching: prompt tokens admissions looked up (re-prefills apart).",
    ),
    MetricInfo(
        PREFIX + "prefix_cache_hits_total",
        "counter",
        "Prefix caching: of those, tokens found cached.",
    ),
    MetricInfo(
        PREFIX + "prefix_cache_recompute_queries_total",
        "counter",
        "Prefix caching: tokens re-prefills after a recompute-pause looked up.",
    ),
    MetricInfo(
        PREFIX + "prefix_cache_recompute_hits_total",
        "counter",
        "Prefix caching: of those, tokens found cached.",
    ),
    MetricInfo(
        PREFIX + "prefix_cache_same_step_hits_total",
        "counter",
        "Prefix caching: of both kinds of hits, tokens an earlier entry of the same step computed.",
    ),
    MetricInfo(
        PREFIX + "prefix_cache_evictions_total",
        "counter",
        "Prefix caching: cached superblocks evicted to make room.",
    ),
    MetricInfo(
        PREFIX + "spec_decode_num_drafts_total",
        "counter",
        "Speculative decoding: decodes that verified at least one draft token.",
    ),
    MetricInfo(
        PREFIX + "spec_decode_num_draft_tokens_total",
        "counter",
        "Speculative decoding: draft tokens verified.",
    ),
    MetricInfo(
        PREFIX + "spec_decode_num_accepted_tokens_total",
        "counter",
        "Speculative decoding: draft tokens accepted.",
    ),
    MetricInfo(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
        "counter_per_position",
        "Speculative decoding: draft tokens accepted, by draft position (label position, from 0).",
    ),
    MetricInfo(
        PREFIX + "spec_decode_num_trimmed_tokens_total",
        "counter",
        "Speculative decoding: proposed draft tokens a step gave no room (drafts give way first).",
    ),
    MetricInfo(
        PREFIX + "num_deadlocks_total",
        "counter",
        "DeadlockError raised by schedule() (steps without progress).",
    ),
    MetricInfo(
        PREFIX + "schedule_check_seconds",
        "summary",
        "Host time of the per-step schedule check, start plus finish (none when it is off).",
    ),
)


class _Reading(NamedTuple):
    """What one scrape read from the rank."""

    values: dict[str, float]
    accepted_per_position: list[int]
    checks: int
    check_seconds: float


class RankCollector(Collector):
    """A ``prometheus_client`` collector for one :class:`~helix_kv.distributed.HelixKVRank`.

    ``collect()`` reads the rank when the registry is scraped. It may run on another thread
    than the engine (``prometheus_client.start_http_server`` scrapes on its own): a scrape that
    lands while ``schedule()`` or ``update()`` runs (they release the GIL and hold the
    scheduler) waits for the call to end, up to a few seconds, then fails that scrape with
    :class:`TimeoutError`. A scrape never fails an engine call: it holds the scheduler only
    within a read that keeps the GIL, so the engine never finds it held.

    Counters only grow. Reading them changes nothing on the rank. Scheduler values are equal
    on every rank of a group; ``schedule_check_seconds`` is this rank's own.
    """

    def __init__(self, rank: HelixKVRank, *, model_name: str | None = None) -> None:
        self.rank = rank
        self.label_names: list[str] = ["cp_rank"]
        self.label_values: list[str] = [str(rank.cp_rank)]
        if model_name is not None:
            self.label_names.insert(0, "model_name")
            self.label_values.insert(0, model_name)

    def describe(self) -> Iterator[Metric]:
        """The metric names without values: lets a registry refuse a second collector with
        the same names (two ranks on one registry would expose every name twice)."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        """The rank's metrics as of now."""
        return self._families(self._read())

    def _families(self, reading: _Reading | None) -> Iterator[Metric]:
        labels, values = self.label_names, self.label_values
        for info in METRICS:
            if info.type == "counter_per_position":
                counter = CounterMetricFamily(info.name, info.help, labels=[*labels, "position"])
                if reading is not None:
                    for position, count in enumerate(reading.accepted_per_position):
                        counter.add_metric([*values, str(position)], count)
                yield counter
                continue
            if info.type == "summary":
                summary = SummaryMetricFamily(info.name, info.help, labels=labels)
                if reading is not None:
                    summary.add_metric(values, reading.checks, reading.check_seconds)
                yield summary
                continue
            family = (GaugeMetricFamily if info.type == "gauge" else CounterMetricFamily)(
                info.name, info.help, labels=labels
            )
            if reading is not None:
                family.add_metric(values, reading.values[info.name])
            yield family

    def _read(self) -> _Reading:
        deadline = time.monotonic() + _BUSY_WAIT_S
        while True:
            try:
                return self._read_once()
            except RuntimeError as exc:
                # pyo3's "Already mutably borrowed": schedule()/update() is running on
                # another thread with the GIL released. Nothing was read; try again.
                if "borrowed" not in str(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"helix_kv metrics of CP rank {self.rank.cp_rank}: the scheduler stayed "
                        f"busy for {_BUSY_WAIT_S} s (a schedule() or update() on another thread)"
                    ) from exc
                time.sleep(_BUSY_SLEEP_S)

    def _read_once(self) -> _Reading:
        rank = self.rank
        scheduler = rank.scheduler
        totals = scheduler.metrics()
        host_tier = rank.host_tier_superblocks
        host_used = scheduler.host_used_superblocks
        gauges = {
            "num_requests_running": scheduler.num_running,
            "num_requests_waiting": scheduler.num_waiting,
            "num_requests_swapped": scheduler.num_suspended,
            "kv_cache_usage_perc": totals.kv_utilization,
            "cpu_cache_usage_perc": host_used / host_tier if host_tier else 0.0,
        }
        counters = {
            "num_preemptions_total": totals.preemptions,
            "request_success_total": totals.finished,
            "num_steps_total": totals.steps,
            "num_computed_tokens_total": totals.computed_tokens,
            "num_recomputed_tokens_total": totals.recomputed_tokens,
            "num_sat_out_total": totals.sat_out,
            "num_suspensions_total": totals.suspensions,
            "num_resumes_total": totals.resumes,
            "num_aborts_total": totals.aborts,
            "prefix_cache_queries_total": totals.prefix_cache_queries,
            "prefix_cache_hits_total": totals.prefix_cache_hits,
            "prefix_cache_recompute_queries_total": totals.prefix_cache_recompute_queries,
            "prefix_cache_recompute_hits_total": totals.prefix_cache_recompute_hits,
            "prefix_cache_same_step_hits_total": totals.prefix_cache_same_step_hits,
            "prefix_cache_evictions_total": totals.prefix_cache_evictions,
            "spec_decode_num_drafts_total": totals.spec_decode_num_drafts,
            "spec_decode_num_draft_tokens_total": totals.spec_decode_num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": totals.spec_decode_num_accepted_tokens,
            "spec_decode_num_trimmed_tokens_total": totals.spec_decode_num_trimmed_tokens,
            "num_deadlocks_total": rank.deadlocks,
        }
        per_position = [int(n) for n in scheduler.spec_decode_accepted_per_position()]
        checker = rank.checker
        checks, seconds = (0, 0.0) if checker is None else (checker.checks, checker.check_seconds)
        values = {PREFIX + name: float(value) for name, value in {**gauges, **counters}.items()}
        return _Reading(values, per_position, checks, seconds)


def register_rank_metrics(
    rank: HelixKVRank,
    registry: CollectorRegistry | None = None,
    *,
    model_name: str | None = None,
) -> RankCollector:
    """Registers a :class:`RankCollector` for ``rank`` on ``registry`` (default:
    ``prometheus_client.REGISTRY``, the one ``start_http_server`` serves) and returns it;
    ``registry.unregister(collector)`` removes it.

    One rank per registry: each rank process serves its own, labelled with its ``cp_rank``.
    Registering a second rank on the same registry raises ``ValueError`` (duplicated
    timeseries); give each rank its own registry when one process drives several.
    """
    collector = RankCollector(rank, model_name=model_name)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
