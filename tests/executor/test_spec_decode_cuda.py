"""CUDA: speculative decoding in float32 on one GPU (and over NCCL on two): the greedy run with
n-gram drafts against the run without, on the general path, the eager fast path (Triton kernel,
one row per query token) and CUDA graphs, plain and one step ahead, roomy and tight.

Run on a GPU machine with ``python -m pytest tests/executor/test_spec_decode_cuda.py -m cuda
-s -o addopts=""``. Skips cleanly without CUDA (the two-GPU test with fewer than two GPUs).

In float32 a drafted step computes the same logits as the undrafted one up to rounding (a
different batch shape), so the comparison is :func:`~helix_kv.executor.agreement.compare_runs`'
with the float32 tolerance of the other CUDA tests (``1e-4``): logits within it up to the first
token where two runs part, and they may only part at a near tie.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helix_kv.executor.agreement import compare_runs
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

ATOL = 1e-4
TPB = 8
K = 4
MAX_NEW = 32
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
PATHS = {
    "general": {},
    "kernel": {"decode_kernel": True},
    "graphs": {"cuda_graphs": True},
}
MODES = ("plain", "overlap")
ROOMY, TIGHT = 4096, 384  # global KV tokens; TIGHT preempts


def prompts() -> dict[int, list[int]]:
    """Twelve prompts, each a random pattern (3 to 12 tokens) repeated to 20-100 tokens."""
    rng = np.random.default_rng(5)
    out = {}
    for i in range(12):
        pattern = rng.integers(0, MODEL.vocab_size, size=int(rng.integers(3, 13))).tolist()
        n = int(rng.integers(20, 100))
        out[i] = (pattern * (n // len(pattern) + 1))[:n]
    return out


def config(cp: int, kv_tokens: int, k: int, path: str, overlap: bool) -> ExecutorConfig:
    return ExecutorConfig(
        cp_size=cp,
        tokens_per_block=TPB,
        kv_superblocks=kv_tokens // (TPB * cp),
        max_batch_size=16,
        max_num_tokens=256,
        model=MODEL,
        dtype="float32",
        device="cuda",
        record_logits=True,
        overlap=overlap,
        num_speculative_tokens=k,
        **PATHS[path],  # type: ignore[arg-type]
    )


def check(reference: RunResult, other: RunResult, label: str) -> None:
    agreement = compare_runs(reference, other, ATOL)
    print(
        f"\n{label}: max |logit diff| {agreement.max_logit_diff:.3g} over "
        f"{agreement.compared_rows} rows; parted: {agreement.diverged}; "
        f"{other.tokens_per_decode_step:.2f} tokens per decode step, acceptance "
        f"{other.draft_acceptance_rate:.2f}, {other.fast_path_draft_steps} drafted fast steps"
    )
    assert agreement.ok, agreement.unexplained


@pytest.fixture(scope="module")
def baseline() -> dict[str, RunResult]:
    return {
        pool: run_rank(prompts(), MAX_NEW, config(1, kv, 0, "general", False))
        for pool, kv in (("roomy", ROOMY), ("tight", TIGHT))
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_drafts_agree_with_no_drafts_on_one_gpu(baseline, pool, path, mode):
    kv = ROOMY if pool == "roomy" else TIGHT
    run = run_rank(prompts(), MAX_NEW, config(1, kv, K, path, mode == "overlap"))
    check(baseline[pool], run, f"1 GPU {pool} {path} {mode} k={K}")
    assert run.draft_steps > 0
    assert run.metrics["spec_decode_num_accepted_tokens"] > 0
    if path != "general":
        assert run.fast_path_draft_steps > 0
    if pool == "tight":
        assert run.preemptions > 0


def test_graphs_equal_eager_fast_path_with_drafts():
    eager = run_rank(prompts(), MAX_NEW, config(1, ROOMY, K, "kernel", False))
    graphed = run_rank(prompts(), MAX_NEW, config(1, ROOMY, K, "graphs", False))
    assert graphed.outputs == eager.outputs
    assert graphed.digests == eager.digests
    for rid, rows in eager.logits.items():
        np.testing.assert_array_equal(graphed.logits[rid], rows)  # same kernels, same shapes


def test_drafts_save_steps_on_one_gpu(baseline):
    run = run_rank(prompts(), MAX_NEW, config(1, ROOMY, K, "graphs", False))
    base = baseline["roomy"]
    print(
        f"\nsteps {len(run.digests)} vs {len(base.digests)}; tokens per decode step "
        f"{run.tokens_per_decode_step:.2f} vs {base.tokens_per_decode_step:.2f}"
    )
    assert len(run.digests) < len(base.digests)
    assert run.tokens_per_decode_step > base.tokens_per_decode_step


@two_gpus
@pytest.mark.parametrize("mode", MODES)
def test_drafts_agree_with_no_drafts_over_nccl(baseline, mode):
    jobs = [
        (prompts(), MAX_NEW, config(2, ROOMY, K, path, mode == "overlap"))
        for path in ("general", "graphs")
    ]
    per_job = run_group(jobs, 2, backend="nccl", timeout_s=300)
    for path, ranks in zip(("general", "graphs"), per_job):
        check(baseline["roomy"], ranks[0], f"2 GPUs {path} {mode} k={K}")
        assert ranks[0].metrics["spec_decode_num_accepted_tokens"] > 0
