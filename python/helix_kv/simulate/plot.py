"""``--plot FILE``: KV utilisation, running/waiting counts and victims over the steps (with a
step-time model, the steps' modelled time along the top as well).

The file's extension picks the format (``run.png``, ``run.svg``, ``run.pdf``...); an unknown
or missing extension is refused before the run. matplotlib is optional
(``pip install 'helix_kv[plot]'``); it is imported only here, with the non-interactive Agg
backend, so plotting works without a display.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from helix_kv.errors import PlotUnavailableError as PlotUnavailableError  # also from here
from helix_kv.simulate.report import describe_config
from helix_kv.simulate.step_loop import SimulationResult

if TYPE_CHECKING:  # matplotlib is optional: imported only when a plot is drawn
    from matplotlib.figure import Figure

MISSING_MATPLOTLIB = (
    "--plot needs matplotlib, which is not installed; "
    "install it with: pip install 'helix_kv[plot]' (or pip install matplotlib)"
)


#: Formats ``--plot`` writes, by extension, where matplotlib's Agg backend supports them
#: (pgf is left out: it needs a LaTeX installation).
PLOT_FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def _use_agg() -> None:
    """Select matplotlib's non-interactive Agg backend (before pyplot is first imported);
    raise :class:`PlotUnavailableError` without matplotlib."""
    try:
        import matplotlib  # here, not at the top: matplotlib is optional
    except ImportError:
        raise PlotUnavailableError(MISSING_MATPLOTLIB) from None
    matplotlib.use("Agg")


def plot_formats() -> tuple[str, ...]:
    """The extensions ``--plot`` accepts here (raises :class:`PlotUnavailableError` without
    matplotlib)."""
    _use_agg()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    supported = FigureCanvasAgg.get_supported_filetypes()
    return tuple(name for name in PLOT_FORMATS if name in supported)


def plot_format(path: str | Path) -> str:
    """The format of ``path``, from its extension; raise :class:`PlotUnavailableError` (a
    one-line reason) for a missing or unknown extension or without matplotlib."""
    formats = plot_formats()
    extension = Path(path).suffix.lower().lstrip(".")
    if extension not in formats:
        known = ", ".join(f".{name}" for name in formats)
        what = f"extension .{extension} is not one" if extension else "has no extension, give one"
        raise PlotUnavailableError(f"--plot {path}: {what} of {known}")
    return extension


def check_plot_target(path: str | Path) -> None:
    """Check now, rather than after a long run, that ``path`` can be drawn."""
    plot_format(path)


#: The most bars the victims panel draws: a longer run's steps are counted in bins of several
#: steps, so that every bar is wide enough to show (one bar a step of a 20k-step run is
#: narrower than a pixel).
MAX_BARS = 200
#: The title (the run's settings) is wrapped at this many characters to stay inside the figure.
TITLE_WIDTH = 120


def steps_per_bin(steps: int, max_bars: int = MAX_BARS) -> int:
    """Steps each bar of the victims panel counts: 1 for a run of up to ``max_bars`` steps,
    else the smallest of 2, 5, 10, 20, 50, 100... that makes at most ``max_bars`` bars (a round
    number, so that the axis reads "per 100 steps")."""
    if steps <= max_bars:
        return 1
    scale = 1
    while True:
        for step in (2 * scale, 5 * scale, 10 * scale):
            if -(-steps // step) <= max_bars:
                return step
        scale *= 10


def binned_counts(counts: Sequence[int], bin_steps: int) -> list[int]:
    """``counts`` (one a step) summed over consecutive bins of ``bin_steps`` steps, the first
    bin starting at step 0 (the last bin holds what is left)."""
    if bin_steps < 1:
        raise ValueError(f"bin_steps must be >= 1, got {bin_steps}")
    return [sum(counts[start : start + bin_steps]) for start in range(0, len(counts), bin_steps)]


def modelled_seconds(result: SimulationResult) -> list[float] | None:
    """Each step's modelled start in seconds, for the plot's time axis: ``None`` without a
    step-time model, or when the starts do not increase step after step (a model that gives
    some step no time), where no axis of time can follow the steps."""
    starts = result.series.start_ms
    if result.modelled_time_ms is None or len(starts) != len(result.series) or len(starts) < 2:
        return None
    if any(later <= earlier for earlier, later in zip(starts, starts[1:])):
        return None
    return [start / 1000.0 for start in starts]


def draw_run(result: SimulationResult) -> Figure:
    """The figure of the run's per-step series: KV utilisation, running and waiting requests,
    and the victims (recompute-pauses and suspensions) counted per bin of steps, with their
    running totals. The caller closes it (``matplotlib.pyplot.close``)."""
    _use_agg()
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series = result.series
    steps = list(range(len(series)))
    figure, (kv_axis, queue_axis, victim_axis) = plt.subplots(
        3, 1, figsize=(10, 8), sharex=True, constrained_layout=True
    )
    figure.suptitle(textwrap.fill(describe_config(result.config), TITLE_WIDTH), fontsize=9)

    kv_axis.plot(steps, [100.0 * u for u in series.kv_utilization], color="tab:blue", lw=1)
    kv_axis.set_ylabel("KV utilisation (%)")
    kv_axis.set_ylim(0, 105)
    kv_axis.grid(alpha=0.3)
    seconds = modelled_seconds(result)
    if seconds is not None:  # the steps' modelled start times along the top
        time_axis = kv_axis.secondary_xaxis(
            "top",
            functions=(
                lambda step: np.interp(step, steps, seconds),
                lambda second: np.interp(second, seconds, steps),
            ),
        )
        time_axis.set_xlabel("modelled time (s)")

    queue_axis.plot(steps, series.running, label="running", color="tab:green", lw=1)
    queue_axis.plot(steps, series.waiting, label="waiting", color="tab:orange", lw=1)
    queue_axis.set_ylabel("requests")
    queue_axis.legend(loc="upper right")
    queue_axis.grid(alpha=0.3)

    bin_steps = steps_per_bin(len(series))
    starts = steps[::bin_steps]
    paused = binned_counts(series.preempted, bin_steps)
    suspended = binned_counts(series.suspended, bin_steps)
    bars = {"align": "edge", "width": bin_steps}
    victim_axis.bar(starts, paused, color="tab:red", label="recompute-pauses", **bars)
    victim_axis.bar(
        starts, suspended, bottom=paused, color="tab:purple", label="suspensions", **bars
    )
    peak = max((p + s for p, s in zip(paused, suspended)), default=0)
    victim_axis.set_ylim(0, max(1, peak) * 1.05)
    victim_axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    per = "step" if bin_steps == 1 else f"{bin_steps} steps"
    victim_axis.set_ylabel(f"victims per {per}")
    victim_axis.set_xlabel("scheduler step")
    victim_axis.grid(alpha=0.3)

    totals = victim_axis.twinx()
    paused_total = list(accumulate(series.preempted))
    suspended_total = list(accumulate(series.suspended))
    totals.plot(steps, paused_total, color="black", lw=1, label="recompute-pauses (total)")
    totals.plot(steps, suspended_total, color="black", lw=1, ls="--", label="suspensions (total)")
    top = max([1, *paused_total[-1:], *suspended_total[-1:]])
    totals.set_ylim(0, top * 1.05)
    totals.yaxis.set_major_locator(MaxNLocator(integer=True))
    totals.set_ylabel("victims (total)")
    handles, labels = victim_axis.get_legend_handles_labels()
    more_handles, more_labels = totals.get_legend_handles_labels()
    victim_axis.legend(handles + more_handles, labels + more_labels, loc="upper left", fontsize=8)
    return figure


def plot_run(result: SimulationResult, path: str | Path) -> None:
    """Draw the run's per-step series (:func:`draw_run`) into ``path``, in the format its
    extension names."""
    file_format = plot_format(path)
    figure = draw_run(result)
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, format=file_format, dpi=100)
    finally:
        plt.close(figure)
