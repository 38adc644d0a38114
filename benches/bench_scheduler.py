"""Scheduler step cost from Python: ``schedule()`` + ``update()`` with N running decode
requests at cp = 4, without and with steady KV pressure.

Target (issue 13): <= 12 ns per request per step + 5 us fixed at N = 256..4096, cp = 4; at
most 2x that under steady pressure; doubling N at most doubles the time. The fixed part is
measured on its own (one request). One step ahead (overlap: each ``schedule()`` runs while
the previous step is pending, then that step is updated) is measured at N = 1024 against the
plain step.
Run with ``python -m pytest benches/bench_scheduler.py --benchmark-enable -s``.
"""

from __future__ import annotations

import pytest

from scheduler_loops import CP, PROMPT, TPB, AheadLoop, Loop

ROUNDS = 300
WARMUP = 20


def steps_needed() -> int:
    return 300 + WARMUP + ROUNDS  # prefill steps, pytest-benchmark's warm-up, the rounds


@pytest.mark.parametrize("n", [256, 1024, 4096])
def test_bench_decode_step(benchmark, report_figure, n: int) -> None:
    """Every request decodes every step; nobody finishes during the run."""
    max_new = steps_needed() + 100
    per_request = -(-(PROMPT + max_new) // (CP * TPB))
    loop = Loop(n, n * per_request, max_new)
    loop.prefill()  # from here on every step is pure decode
    benchmark.pedantic(loop.step, rounds=ROUNDS, warmup_rounds=WARMUP)
    assert loop.s.metrics().preemptions == 0
    report_figure(
        benchmark, f"schedule+update, {n} decoding, cp={CP}", n, "request",
        f"<= 12 ns/request + 5 us fixed, i.e. <= {12 * n / 1000 + 5:.0f} us/step",
    )  # fmt: skip


@pytest.mark.parametrize("n", [256, 1024, 4096])
def test_bench_decode_step_under_steady_pressure(benchmark, report_figure, n: int) -> None:
    """About two thirds of the KV the live set needs: preemptions every step, victims
    re-prefill, finished requests are replaced (their add_request is timed too)."""
    loop = Loop(n, 2 * n, 300)
    for _ in range(200):
        loop.step()
    before = loop.s.metrics().preemptions
    benchmark.pedantic(loop.step, rounds=ROUNDS, warmup_rounds=WARMUP)
    if benchmark.stats is not None:
        assert loop.s.metrics().preemptions > before, "the workload must keep preempting"
    report_figure(
        benchmark, f"schedule+update under steady pressure, {n} live, cp={CP}", n, "request",
        f"<= 2x the decode step, i.e. <= {2 * (12 * n / 1000 + 5):.0f} us/step",
    )  # fmt: skip


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "one_step_ahead"])
def test_bench_decode_step_with_a_step_in_flight(benchmark, report_figure, ahead: bool) -> None:
    """N = 1024 decoding: schedule()+update() with a step in flight (every decode input a row
    of the pending step's tokens) against the same loop without."""
    n = 1024
    max_new = steps_needed() + 100
    per_request = -(-(PROMPT + max_new) // (CP * TPB))
    loop = (AheadLoop if ahead else Loop)(n, n * per_request, max_new)
    loop.prefill()
    out = loop.step()
    assert out.generation_ids.size == n
    assert bool((out.generation_input_refs >= 0).all()) == ahead
    benchmark.pedantic(loop.step, rounds=ROUNDS, warmup_rounds=WARMUP)
    assert loop.s.metrics().preemptions == 0
    mode = "one step ahead" if ahead else "plain"
    report_figure(
        benchmark, f"schedule+update, {n} decoding, cp={CP}, {mode}", n, "request",
        "one step ahead <= 1.5x plain (the marks, refs and kept decode undos of a step ahead)",
    )  # fmt: skip


def test_bench_fixed_cost(benchmark, report_figure) -> None:
    """One decoding request: the per-step cost that does not scale with N."""
    loop = Loop(1, 64, steps_needed() + 100)
    loop.prefill()
    benchmark.pedantic(loop.step, rounds=2000, warmup_rounds=50)
    report_figure(benchmark, "schedule+update, 1 request (fixed cost)", 1, "step", "<= 5 us")
