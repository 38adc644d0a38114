"""``--plot``'s figure: victims (recompute-pauses and suspensions) counted per bin of steps, so
that a long run still shows them; integer counts; the title inside the figure."""

from __future__ import annotations

from pathlib import Path

import pytest

import helix_kv
from helix_kv.simulate.plot import binned_counts, draw_run, plot_run, steps_per_bin
from helix_kv.simulate.step_loop import SimulationResult, StepSeries

#: A settings line far wider than the figure, as a run with many settings has.
LONG_CONFIG = {
    "cp": 64,
    "kv_tokens": 1_048_576,
    "kv_tokens_effective": 1_048_576,
    "overlap": True,
    "scheduler": {
        "tokens_per_block": 32,
        "serving_mode": "aggregated_helix",
        "capacity_policy": "max_utilization",
        "victim_policy": "least_computed_first",
        "host_tier_superblocks": 4096,
        "suspend_policy": "recompute_first",
        "enable_prefix_caching": True,
    },
    "workload": {"source": "trace", "path": "/a/rather/long/path/to/a/mooncake/trace.jsonl"},
}


def test_binned_counts_sum_each_bin_of_steps() -> None:
    counts = [0, 2, 1, 0, 0, 3, 1]
    assert binned_counts(counts, 1) == counts
    # bins of 3 steps: [0, 2, 1], [0, 0, 3], [1] (what is left)
    assert binned_counts(counts, 3) == [3, 3, 1]
    assert binned_counts(counts, 7) == [7]
    assert binned_counts(counts, 100) == [7]
    assert binned_counts([], 5) == []
    with pytest.raises(ValueError, match="bin_steps must be >= 1"):
        binned_counts(counts, 0)


def test_bins_are_round_and_at_most_the_bar_limit() -> None:
    assert steps_per_bin(0) == steps_per_bin(1) == steps_per_bin(200) == 1
    assert steps_per_bin(201) == 2
    assert steps_per_bin(401) == 5
    assert steps_per_bin(1001) == 10
    assert steps_per_bin(21_000) == 200  # 105 bars of 200 steps
    for steps in (201, 999, 1000, 1001, 21_000, 123_457):
        per_bin = steps_per_bin(steps)
        assert -(-steps // per_bin) <= 200
        assert str(per_bin).strip("0") in ("1", "2", "5")


def _result(preempted: list[int], suspended: list[int], config: dict | None = None):
    steps = len(preempted)
    series = StepSeries(
        clock=list(range(steps)),
        kv_utilization=[0.5] * steps,
        running=[3] * steps,
        waiting=[1] * steps,
        preempted=preempted,
        suspended=suspended,
        sat_out=[0] * steps,
        num_tokens=[8] * steps,
    )
    metrics = helix_kv.SchedulerMetrics(
        **{**dict.fromkeys(helix_kv.SchedulerMetrics.FIELDS, 0), "kv_capacity_superblocks": 1}
    )
    return SimulationResult(
        requests_total=1,
        outcomes=[],
        series=series,
        final_metrics=metrics,
        generated_tokens=0,
        clock=steps,
        rank_agreement=True,
        config=config if config is not None else LONG_CONFIG,
    )


def _victim_axes(figure):
    """The victims panel and its totals axis (its twin)."""
    victims = figure.axes[2]
    (totals,) = [axis for axis in figure.axes[3:] if axis.bbox.bounds == victims.bbox.bounds]
    return victims, totals


def test_a_long_run_draws_every_victim_in_bins() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    steps = 21_000
    preempted = [0] * steps
    suspended = [0] * steps
    # hand-placed victims: bins of 200 steps (21000 steps: 105 bars)
    for step in (5, 199, 200, 20_999):
        preempted[step] = 1
    for step in (0, 0, 401, 402, 403):
        suspended[step] += 1
    figure = draw_run(_result(preempted, suspended))
    try:
        victims, totals = _victim_axes(figure)
        bars = victims.patches
        assert len(bars) == 2 * 105  # recompute-pauses, then suspensions stacked on them
        paused, stacked = bars[:105], bars[105:]
        heights = [bar.get_height() for bar in paused]
        assert heights[0] == 2
        assert heights[1] == 1
        assert heights[-1] == 1
        assert sum(heights) == 4
        suspended_heights = [bar.get_height() for bar in stacked]
        assert suspended_heights[0] == 2
        assert suspended_heights[2] == 3
        assert sum(suspended_heights) == 5
        assert stacked[0].get_y() == 2  # on top of that bin's recompute-pauses
        assert all(bar.get_width() == 200 for bar in bars)
        assert victims.get_ylabel() == "victims per 200 steps"
        # the totals: the last value of each running total
        ends = [line.get_ydata()[-1] for line in totals.get_lines()]
        assert ends == [4, 5]
    finally:
        plt.close(figure)


def test_a_run_without_victims_has_an_integer_axis_from_zero() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figure = draw_run(_result([0] * 50, [0] * 50))
    try:
        victims, totals = _victim_axes(figure)
        figure.canvas.draw()
        for axis in (victims, totals):
            low, high = axis.get_ylim()
            assert low == 0
            assert high >= 1
            ticks = [tick for tick in axis.get_yticks() if low <= tick <= high]
            assert ticks
            assert all(float(tick).is_integer() for tick in ticks)
        assert victims.get_ylabel() == "victims per step"
    finally:
        plt.close(figure)


def test_the_title_stays_inside_the_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figure = draw_run(_result([1, 0, 2], [0, 1, 0]))
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        title = figure.get_suptitle()
        assert "host_tier_superblocks=4096" in title
        assert len(title.splitlines()) > 1  # wrapped
        (text,) = [t for t in figure.texts if t.get_text() == title]
        box = text.get_window_extent(renderer)
        inside = figure.bbox
        assert inside.x0 <= box.x0
        assert box.x1 <= inside.x1
        assert inside.y0 <= box.y0
        assert box.y1 <= inside.y1
    finally:
        plt.close(figure)
    target = tmp_path / "run.png"
    plot_run(_result([1, 0, 2], [0, 1, 0]), target)
    assert target.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_modelled_run_has_its_time_along_the_top() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from helix_kv.simulate.plot import modelled_seconds

    result = _result([0, 1, 0, 0], [0, 0, 0, 1])
    assert modelled_seconds(result) is None  # no step-time model: no time axis
    figure = draw_run(result)
    try:
        assert not _time_axes(figure)
    finally:
        plt.close(figure)
    result.series.start_ms.extend([0.0, 500.0, 1500.0, 4000.0])
    assert modelled_seconds(result) is None  # still no model: the run's time is unknown
    result.modelled_time_ms = 5000.0
    assert modelled_seconds(result) == [0.0, 0.5, 1.5, 4.0]
    figure = draw_run(result)
    try:
        (time_axis,) = _time_axes(figure)
        # the axis maps step 2 to its start, 1.5 s, and back
        forward, inverse = time_axis._functions
        assert forward(2.0) == pytest.approx(1.5)
        assert inverse(1.0) == pytest.approx(1.5)  # halfway through step 1
    finally:
        plt.close(figure)
    result.series.start_ms[2] = 500.0  # a step of no modelled time: no axis can follow
    assert modelled_seconds(result) is None


def _time_axes(figure):  # type: ignore[no-untyped-def]
    """The figure's secondary axes labelled with modelled time (children of a panel)."""
    children = [child for axis in figure.axes for child in axis.child_axes]
    return [axis for axis in children if axis.get_xlabel() == "modelled time (s)"]
