"""Benchmarks: run with ``python -m pytest benches --benchmark-enable``.

Each benchmark stores its per-unit figure in ``extra_info`` and prints it, so the numbers in
closing notes come straight from these runs. Targets are documented next to each figure and
are not asserted (timings depend on the machine).
"""

from __future__ import annotations

import pytest


def report(benchmark, label: str, units: int, unit: str, target: str) -> None:
    """Attach ``median / units`` to the benchmark and print it."""
    stats = benchmark.stats
    if stats is None:  # --benchmark-disable: the function ran once, untimed
        return
    median = stats.stats.median
    per_unit_ns = median / units * 1e9
    benchmark.extra_info[f"ns_per_{unit}"] = round(per_unit_ns, 2)
    benchmark.extra_info["median_us"] = round(median * 1e6, 2)
    print(f"\n{label}: median {median * 1e6:.1f} us, {per_unit_ns:.2f} ns/{unit} (target {target})")


@pytest.fixture
def report_figure():
    return report
