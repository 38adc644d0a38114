"""``--plot FILE.png``: KV utilisation, running/waiting counts and preemptions per step.

matplotlib is optional (``pip install 'helix_kv[plot]'``); it is imported only here, with
the non-interactive Agg backend, so plotting works without a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from helix_kv.simulate.report import describe_config
from helix_kv.simulate.runner import SimulationResult

MISSING_MATPLOTLIB = (
    "--plot needs matplotlib, which is not installed; "
    "install it with: pip install 'helix_kv[plot]' (or pip install matplotlib)"
)


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailableError(MISSING_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_available() -> None:
    """Raise :class:`PlotUnavailableError` now rather than after a long run."""
    _pyplot()


def plot_run(result: SimulationResult, path: Union[str, Path]) -> None:
    """Draw the run's per-step series into a PNG at ``path``."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    series = result.series
    steps = list(range(len(series)))
    figure, (kv_axis, queue_axis, preempt_axis) = plt.subplots(
        3, 1, figsize=(10, 8), sharex=True, constrained_layout=True
    )
    figure.suptitle(describe_config(result.config), fontsize=9)

    kv_axis.plot(steps, [100.0 * u for u in series.kv_utilization], color="tab:blue", lw=1)
    kv_axis.set_ylabel("KV utilisation (%)")
    kv_axis.set_ylim(0, 105)
    kv_axis.grid(alpha=0.3)

    queue_axis.plot(steps, series.running, label="running", color="tab:green", lw=1)
    queue_axis.plot(steps, series.waiting, label="waiting", color="tab:orange", lw=1)
    queue_axis.set_ylabel("requests")
    queue_axis.legend(loc="upper right")
    queue_axis.grid(alpha=0.3)

    preempt_axis.bar(steps, series.preempted, width=1.0, color="tab:red", label="this step")
    cumulative = preempt_axis.twinx()
    total = 0
    running_total = []
    for count in series.preempted:
        total += count
        running_total.append(total)
    cumulative.plot(steps, running_total, color="black", lw=1, label="cumulative")
    cumulative.set_ylim(bottom=0)
    preempt_axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    cumulative.yaxis.set_major_locator(MaxNLocator(integer=True))
    preempt_axis.set_ylabel("preemptions / step")
    cumulative.set_ylabel("preemptions (total)")
    preempt_axis.set_xlabel("scheduler step")
    preempt_axis.grid(alpha=0.3)

    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
