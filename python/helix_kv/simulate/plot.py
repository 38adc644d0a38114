"""``--plot FILE``: KV utilisation, running/waiting counts and preemptions per step.

The file's extension picks the format (``run.png``, ``run.svg``, ``run.pdf``...); an unknown
or missing extension is refused before the run. matplotlib is optional
(``pip install 'helix_kv[plot]'``); it is imported only here, with the non-interactive Agg
backend, so plotting works without a display.
"""

from __future__ import annotations

from pathlib import Path

from helix_kv.errors import PlotUnavailableError as PlotUnavailableError  # also from here
from helix_kv.simulate.report import describe_config
from helix_kv.simulate.step_loop import SimulationResult

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


def plot_run(result: SimulationResult, path: str | Path) -> None:
    """Draw the run's per-step series into ``path``, in the format its extension names."""
    file_format = plot_format(path)
    _use_agg()
    import matplotlib.pyplot as plt
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

    figure.savefig(path, format=file_format, dpi=100)
    plt.close(figure)
