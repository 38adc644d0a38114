"""Scheduler step cost from Python: ``schedule()`` + ``update()`` with N running decode
requests at cp = 4, without and with steady KV pressure.

Target (issue 13): <= 12 ns per request per step + 5 us fixed at N = 256..4096, cp = 4; at
most 2x that under steady pressure; doubling N at most doubles the time. The fixed part is
measured on its own (one request). One step ahead (overlap: each ``schedule()`` runs while
the previous step is pending, then that step is updated) is measured at N = 1024 against the
plain step.
With prefix caching on and no hits (every prompt its own), at N = 1024 and 4096: at most
1.15x the step with it off. Admitting a request whose 8k-token prompt is cached: time per
superblock found. Keying a 128k-token prompt (``add_request`` with caching on, less off): ns
per token.
With speculative decoding (issue 24), N = 1024 decoding, k = 4 drafts each, 2 accepted (the
rest rolled back): at most 2x the step with k = 0, ns per request reported.
Run with ``python -m pytest benches/bench_scheduler.py --benchmark-enable -s``.
"""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv
from scheduler_loops import CP, PROMPT, TPB, AheadLoop, DraftAheadLoop, DraftLoop, Loop

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


@pytest.mark.parametrize("drafts", [0, 4], ids=["k0", "k4"])
@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "one_step_ahead"])
def test_bench_decode_step_with_drafts(benchmark, report_figure, drafts: int, ahead: bool) -> None:
    """N = 1024 decoding at cp = 4: propose_drafts() + schedule() + update(accepted) with k = 4
    drafts per request, 2 of them accepted (the other 2 rolled back, some superblocks given
    back), against the same loop with k = 0 (drafts off); plain and one step ahead (each
    step scheduled while the previous one is pending; a request whose pending decode carries
    drafts is planned in the step after, so about half the batch decodes per step)."""
    n, accepted = 1024, 2
    max_new = (steps_needed() + 100) * (1 + accepted)
    per_request = -(-(PROMPT + max_new + drafts) // (CP * TPB))
    loop = (DraftAheadLoop if ahead else DraftLoop)(n, n * per_request, max_new, drafts, accepted)
    loop.prefill()
    out = loop.step()
    if not ahead:
        assert out.generation_ids.size == n
        assert int(out.generation_draft_counts.sum()) == n * drafts
    benchmark.pedantic(loop.step, rounds=ROUNDS, warmup_rounds=WARMUP)
    metrics = loop.s.metrics()
    assert metrics.preemptions == 0
    # a step that admits replacements' prompts has less budget left: some drafts are trimmed
    assert metrics.spec_decode_num_accepted_tokens <= accepted * metrics.spec_decode_num_drafts
    assert (metrics.spec_decode_num_drafts > 0) == (drafts > 0)
    mode = "one step ahead" if ahead else "plain"
    report_figure(
        benchmark, f"propose+schedule+update, {n} decoding, cp={CP}, k={drafts} drafts, {mode}",
        n, "request", "k = 4 <= 2x k = 0 of the same mode",
    )  # fmt: skip


def test_bench_fixed_cost(benchmark, report_figure) -> None:
    """One decoding request: the per-step cost that does not scale with N."""
    loop = Loop(1, 64, steps_needed() + 100)
    loop.prefill()
    benchmark.pedantic(loop.step, rounds=2000, warmup_rounds=50)
    report_figure(benchmark, "schedule+update, 1 request (fixed cost)", 1, "step", "<= 5 us")


@pytest.mark.parametrize("caching", [False, True], ids=["cache_off", "cache_on_no_hits"])
@pytest.mark.parametrize("n", [1024, 4096])
def test_bench_decode_step_with_prefix_caching(benchmark, report_figure, n: int, caching: bool):
    """N decoding, prefix caching off and on (distinct prompts in both, so no hits): the
    cost of the cache's references and keys on the decode step."""
    max_new = steps_needed() + 100
    per_request = -(-(PROMPT + max_new) // (CP * TPB))
    loop = Loop(n, n * per_request, max_new, prefix_caching=True)
    if not caching:  # the same prompts, caching off
        loop.s = helix_kv.Scheduler(
            helix_kv.SchedulerConfig(**{**loop.s.config.to_dict(), "enable_prefix_caching": False})
        )
        loop.next_id = 0
        for _ in range(n):
            loop.add()
    loop.prefill()
    benchmark.pedantic(loop.step, rounds=ROUNDS, warmup_rounds=WARMUP)
    assert loop.s.metrics().prefix_cache_hits == 0
    state = "on, no hits" if caching else "off"
    report_figure(
        benchmark, f"schedule+update, {n} decoding, cp={CP}, prefix caching {state}", n,
        "request", "caching on <= 1.15x off",
    )  # fmt: skip


def _cached_8k() -> tuple[helix_kv.Scheduler, np.ndarray]:
    config = helix_kv.SchedulerConfig(
        cp_size=CP, tokens_per_block=TPB, kv_superblocks=256, max_num_tokens=16384,
        enable_prefix_caching=True,
    )  # fmt: skip
    scheduler = helix_kv.Scheduler(config)
    prompt = np.arange(8192, dtype=np.int32)
    scheduler.add_request(0, prompt, 1)
    out = scheduler.schedule()
    scheduler.update(np.full(out.num_samples, 7, np.int32))
    scheduler.take_output(0)
    return scheduler, prompt


def test_bench_admission_of_a_cached_8k_prompt(benchmark, report_figure) -> None:
    """A request whose 8k-token prompt is cached (all but its last superblock): schedule()
    (the lookups, the attach, the one-superblock chunk) and revert() (which puts the hits
    back); the figure is per superblock found."""
    scheduler, prompt = _cached_8k()
    scheduler.add_request(1, prompt, 1)
    found = int(scheduler.schedule().context_cached_lens[0]) // (CP * TPB)
    scheduler.revert()
    assert found == 8192 // (CP * TPB) - 1

    def admit() -> None:
        scheduler.schedule()
        scheduler.revert()

    benchmark.pedantic(admit, rounds=500, warmup_rounds=20)
    report_figure(
        benchmark, f"admission of a cached 8k-token prompt ({found} superblocks found), "
        "schedule+revert", found, "superblock", "reported",
    )  # fmt: skip


@pytest.mark.parametrize("caching", [False, True], ids=["cache_off", "cache_on"])
def test_bench_keying_a_128k_prompt(benchmark, report_figure, caching: bool) -> None:
    """add_request (then abort) of a 128k-token prompt: with caching on it also keys the
    prompt's full superblocks (BLAKE3 over the chain); the difference of the two figures is
    the hashing cost per token."""
    tokens = 131_072
    config = helix_kv.SchedulerConfig(
        cp_size=CP, tokens_per_block=TPB, kv_superblocks=tokens // (CP * TPB) + 8,
        max_seq_len=tokens + 8, enable_prefix_caching=caching,
    )  # fmt: skip
    scheduler = helix_kv.Scheduler(config)
    prompt = np.random.default_rng(0).integers(0, 32_000, size=tokens, dtype=np.int32)

    def add_and_abort() -> None:
        scheduler.add_request(1, prompt, 1)
        scheduler.abort(1)
        scheduler.take_output(1)

    benchmark.pedantic(add_and_abort, rounds=30, warmup_rounds=3)
    state = "on" if caching else "off"
    report_figure(
        benchmark, f"add_request of a 128k-token prompt, prefix caching {state}", tokens,
        "token", "hashing is not the bottleneck of admitting it",
    )  # fmt: skip
