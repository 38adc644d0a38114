"""CUDA: the executor at float32 / bf16 on one GPU and over NCCL on two, plus its figures, in
both modes: plain and overlap (step t + 1 queued while step t runs, its decode inputs gathered
on the device from step t's sampled tokens).

Run on a GPU machine with ``python -m pytest tests/executor -m cuda -s`` (``-s`` shows the
throughput and table-build figures). Skips cleanly without CUDA; the two-GPU tests skip with
fewer than two GPUs.

Stated tolerances (max |logit difference|, logits have a standard deviation of about 1):
float32 ``1e-4``, bf16 ``0.1``, up to and including the first token where two runs part; they
may only part at a near tie (see :mod:`helix_kv.executor.agreement`). Seen on two H200s
(torch 2.11): float32 within 2e-6 of float64; bf16 within 0.04 of float64 and 0.025 of the
single-GPU bf16 run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helix_kv.executor.agreement import compare_runs
from helix_kv.executor.bench import BenchSpec, format_figures, measure
from helix_kv.executor.model import TinyConfig
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_group, run_rank

from ..helpers.scheduler import needs_scheduler

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    needs_scheduler,
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
DTYPES = list(TOLERANCE)
MODES = ("plain", "overlap")
TPB = 8
MAX_NEW = 24
MODEL = TinyConfig(
    vocab_size=256,
    hidden_size=256,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=512,
    seed=11,
)


def prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(5)
    return {
        i: rng.integers(0, MODEL.vocab_size, size=int(n)).tolist()
        for i, n in enumerate(rng.integers(10, 120, size=12))
    }


def config(
    cp: int,
    dtype: str,
    kv_tokens: int,
    device: str = "cuda",
    overlap: bool = False,
    **options: object,
) -> ExecutorConfig:
    return ExecutorConfig(
        cp_size=cp,
        tokens_per_block=TPB,
        kv_superblocks=kv_tokens // (TPB * cp),
        max_batch_size=16,
        max_num_tokens=256,
        model=MODEL,
        dtype=dtype,
        device=device,
        record_logits=True,
        overlap=overlap,
        **options,  # type: ignore[arg-type]
    )


ROOMY, TIGHT = 4096, 512  # global KV tokens; TIGHT holds ~3 of the 12 requests


@pytest.fixture(scope="module")
def cpu_float64() -> RunResult:
    return run_rank(prompts(), MAX_NEW, config(1, "float64", ROOMY, device="cpu"))


@pytest.fixture(scope="module")
def single_gpu() -> dict[str, RunResult]:
    return {dtype: run_rank(prompts(), MAX_NEW, config(1, dtype, ROOMY)) for dtype in DTYPES}


@pytest.fixture(scope="module")
def single_gpu_overlap() -> dict[str, RunResult]:
    return {
        dtype: run_rank(prompts(), MAX_NEW, config(1, dtype, ROOMY, overlap=True))
        for dtype in DTYPES
    }


def check(reference: RunResult, other: RunResult, atol: float, label: str) -> None:
    agreement = compare_runs(reference, other, atol)
    print(
        f"\n{label}: max |logit diff| {agreement.max_logit_diff:.3g} (tolerance {atol}) over "
        f"{agreement.compared_rows} rows; requests whose tokens part: {agreement.diverged}"
    )
    assert agreement.ok, agreement.unexplained


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_gpu_matches_cpu_float64(cpu_float64, single_gpu, dtype):
    check(cpu_float64, single_gpu[dtype], TOLERANCE[dtype], f"1 GPU {dtype} vs CPU float64")


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_gpu_overlap_matches_plain_and_cpu_float64(
    cpu_float64, single_gpu, single_gpu_overlap, dtype
):
    overlap = single_gpu_overlap[dtype]
    check(cpu_float64, overlap, TOLERANCE[dtype], f"1 GPU {dtype} overlap vs CPU float64")
    check(single_gpu[dtype], overlap, TOLERANCE[dtype], f"1 GPU {dtype} overlap vs plain")
    # the host gap was measured (CUDA events) in both modes
    assert overlap.host_gap_us
    assert single_gpu[dtype].host_gap_us


@two_gpus
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_gpu_nccl_matches_single_gpu_with_and_without_preemption(
    single_gpu, cpu_float64, dtype
):
    jobs = [
        (prompts(), MAX_NEW, config(2, dtype, kv, overlap=mode == "overlap"))
        for mode in MODES
        for kv in (ROOMY, TIGHT)
    ]
    results = run_group(jobs, cp_size=2, backend="nccl", timeout_s=300)
    for index, mode in enumerate(MODES):
        (roomy, *_), (tight, *_) = results[2 * index], results[2 * index + 1]
        print(
            f"\ncp=2 {dtype} {mode}: roomy {roomy.preemptions} preemptions, tight "
            f"{tight.preemptions} preemptions ({tight.preempted_while_decoding} while decoding), "
            f"recomputed {tight.metrics.get('recomputed_tokens')} tokens"
        )
        assert roomy.preemptions == 0
        assert tight.preemptions >= 1
        label = f"2 GPUs {dtype} {mode}"
        check(single_gpu[dtype], roomy, TOLERANCE[dtype], f"{label} vs 1 GPU")
        check(single_gpu[dtype], tight, TOLERANCE[dtype], f"{label} tight vs 1 GPU")
        check(cpu_float64, tight, TOLERANCE[dtype], f"{label} tight vs CPU float64")


@pytest.fixture(scope="module")
def single_gpu_fast() -> dict[str, dict[str, RunResult]]:
    """{dtype: {"kernel": eager fast path, "graphs": CUDA-graph fast path}}, tight pool."""
    return {
        dtype: {
            "kernel": run_rank(prompts(), MAX_NEW, config(1, dtype, TIGHT, decode_kernel=True)),
            "graphs": run_rank(prompts(), MAX_NEW, config(1, dtype, TIGHT, cuda_graphs=True)),
        }
        for dtype in DTYPES
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_gpu_fast_path_matches_cpu_float64(cpu_float64, single_gpu_fast, dtype):
    runs = single_gpu_fast[dtype]
    for name, run in runs.items():
        assert run.preemptions >= 1
        assert run.fast_path_steps > 0
        check(cpu_float64, run, TOLERANCE[dtype], f"1 GPU {dtype} {name} (tight) vs CPU float64")
    # same kernels on the same padded shapes: graphs change nothing, bit for bit
    assert runs["graphs"].outputs == runs["kernel"].outputs
    for request_id, rows in runs["kernel"].logits.items():
        assert np.array_equal(runs["graphs"].logits[request_id], rows)


@two_gpus
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_gpu_fast_path_matches_single_gpu(single_gpu, single_gpu_fast, dtype):
    jobs = [(prompts(), MAX_NEW, config(2, dtype, kv, cuda_graphs=True)) for kv in (ROOMY, TIGHT)]
    (roomy, *_), (tight, *_) = run_group(jobs, cp_size=2, backend="nccl", timeout_s=300)
    assert roomy.fast_path_steps > 0
    assert tight.preemptions >= 1
    check(single_gpu[dtype], roomy, TOLERANCE[dtype], f"2 GPUs {dtype} graphs vs 1 GPU")
    check(single_gpu[dtype], tight, TOLERANCE[dtype], f"2 GPUs {dtype} graphs tight vs 1 GPU")


@two_gpus
def test_two_gpu_throughput_table_build_and_host_gap_figures():
    spec = BenchSpec(cp_size=2, overlap=True)
    numbers = measure(spec)
    print("\n" + format_figures(spec, numbers))
    assert numbers["decode_tokens_per_s"] > 0
    assert numbers["overlap_decode_tokens_per_s"] > 0
    assert numbers["table_build_us_median"] > 0
    assert numbers["host_gap_us_median"] >= 0  # measured (not nan)
    assert numbers["overlap_host_gap_us_median"] >= 0


def test_single_gpu_figures():
    spec = BenchSpec(cp_size=1, requests=32, overlap=True)
    numbers = measure(spec)
    print("\n" + format_figures(spec, numbers))
    assert numbers["decode_tokens_per_s"] > 0
    assert numbers["overlap_decode_tokens_per_s"] > 0


HOST_PAGES = 256  # each rank's host tier with the tight pool: room for every victim


@two_gpus
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_gpu_host_tier_matches_single_gpu_in_both_modes(single_gpu, cpu_float64, dtype):
    """Aggregated Helix with the host tier on 2 GPUs (NCCL): victims are suspended to pinned host
    pages and copied back on a side stream; logits stay within tolerance of the 1-GPU roomy run
    and of CPU float64, plain and one step ahead."""
    jobs = [
        (prompts(), MAX_NEW, config(2, dtype, TIGHT, overlap=overlap, host_tier_pages=HOST_PAGES))
        for overlap in (False, True)
    ]
    for (run, *_), mode in zip(run_group(jobs, cp_size=2, backend="nccl", timeout_s=300), MODES):
        assert run.metrics["suspensions"] >= 1, f"{mode}: the tight pool must suspend"
        assert run.metrics["resumes"] == run.metrics["suspensions"]
        assert run.host_bytes_out == run.host_bytes_in > 0
        label = f"2 GPUs {dtype} {mode} host tier"
        check(single_gpu[dtype], run, TOLERANCE[dtype], f"{label} vs 1 GPU")
        check(cpu_float64, run, TOLERANCE[dtype], f"{label} vs CPU float64")


def shared_prompts() -> dict[int, list[int]]:
    """Four system prompts, each opening three requests (their own tail after it)."""
    rng = np.random.default_rng(9)
    systems = [rng.integers(0, MODEL.vocab_size, size=n).tolist() for n in (64, 96, 40, 130)]
    return {
        i: systems[i % 4] + rng.integers(0, MODEL.vocab_size, size=5 + 7 * i % 23).tolist()
        for i in range(12)
    }


@pytest.mark.parametrize("mode", MODES)
def test_prefix_caching_on_one_gpu_matches_caching_off_in_float32(mode):
    """A prefill that starts after cached tokens reads KV another request wrote: float32
    logits within tolerance of the same run without caching (tokens part only at a near
    tie), in a roomy pool, a tight one (recompute-pauses: re-prefills hit their own KV) and
    the fast path with CUDA graphs."""
    overlap = mode == "overlap"
    for kv, options in ((ROOMY, {}), (TIGHT, {}), (TIGHT, {"cuda_graphs": True})):
        runs = {
            caching: run_rank(
                shared_prompts(),
                MAX_NEW,
                config(
                    1,
                    "float32",
                    kv,
                    overlap=overlap,
                    scheduler_options={"enable_prefix_caching": caching},
                    **options,
                ),
            )
            for caching in (False, True)
        }
        on, off = runs[True], runs[False]
        hits = on.metrics["prefix_cache_hits"] + on.metrics["prefix_cache_recompute_hits"]
        assert hits > 0, (kv, options)
        assert off.metrics["prefix_cache_hits"] == 0
        check(
            off,
            on,
            TOLERANCE["float32"],
            f"1 GPU float32 {mode} kv={kv} {options}: cache on vs off",
        )


def burst_prompts() -> dict[int, list[int]]:
    """Twelve requests behind one 120-token system prompt, all arriving at once (the first
    two with the very same 129-token prompt): a 256-token step admits the first whole and the
    others' tails beside it (at most 1 + 10 * 11 tokens)."""
    rng = np.random.default_rng(13)
    system = rng.integers(0, MODEL.vocab_size, size=120).tolist()
    tails = [9, 9, *rng.integers(1, 12, size=10).tolist()]
    twin = rng.integers(0, MODEL.vocab_size, size=9).tolist()
    return {
        i: system + (twin if i < 2 else rng.integers(0, MODEL.vocab_size, size=n).tolist())
        for i, n in enumerate(tails)
    }


@pytest.mark.parametrize("mode", MODES)
def test_a_burst_shares_its_system_prompt_on_one_gpu_in_float32(mode):
    """Same-step sharing on the GPU: the burst's later requests read the system prompt's KV
    as the step that admits them writes it (each layer's KV written before its attention),
    on the general path, with the decode kernel and on the fast path with CUDA graphs:
    float32 logits within tolerance of caching off."""
    overlap = mode == "overlap"
    for options in ({}, {"decode_kernel": True}, {"cuda_graphs": True}):
        runs = {
            caching: run_rank(
                burst_prompts(),
                MAX_NEW,
                config(
                    1,
                    "float32",
                    ROOMY,
                    overlap=overlap,
                    scheduler_options={"enable_prefix_caching": caching},
                    **options,
                ),
            )
            for caching in (False, True)
        }
        on, off = runs[True], runs[False]
        # the twin: 16 whole 8-token pages (all but its last token); the other ten: the
        # system prompt's 15 pages, all written by the first request in the same step
        assert on.metrics["prefix_cache_same_step_hits"] == 128 + 10 * 120, options
        assert off.tokens_run - on.tokens_run == on.metrics["prefix_cache_hits"]
        check(off, on, TOLERANCE["float32"], f"1 GPU float32 {mode} burst {options}: on vs off")
