"""Rank-side part of the Prometheus tests over a real group (module-level, so spawned ranks can
import it): a checked, pressured run scraped through ``prometheus_client`` on every rank."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helix_kv.distributed.prometheus import register_rank_metrics

from . import dist_scenarios as sc

Samples = dict[str, tuple[str, dict[str, str], float]]


def scrape(registry: CollectorRegistry) -> Samples:
    """``{sample name: (family type, labels, value)}`` of one scrape, read back from the
    exposition text with prometheus_client's own parser. A sample with a ``position`` label
    (acceptance per draft position) is keyed ``name[position]``, its labels without it."""
    text = generate_latest(registry).decode("utf-8")
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            position = labels.pop("position", None)
            name = sample.name if position is None else f"{sample.name}[{position}]"
            assert name not in samples, f"{name} exposed twice"
            samples[name] = (family.type, labels, float(sample.value))
    return samples


def scenario_scraped_run(rank: int, world: int, backend: str) -> dict[str, Any]:
    """A pressured run with the schedule check on, scraped after every step."""
    built = sc.pressured_rank(world)
    registry = CollectorRegistry()
    register_rank_metrics(built, registry)
    sc.add_workload(built, count=12)
    scrapes: list[Samples] = [scrape(registry)]
    for _ in sc.drive(built):
        scrapes.append(scrape(registry))  # between schedule() and update()
    scrapes.append(scrape(registry))
    assert built.checker is not None
    return {
        "scrapes": scrapes,
        "checks": built.checker.checks,
        "check_seconds": built.checker.check_seconds,
        "metrics": built.scheduler.metrics().to_dict(),
    }
