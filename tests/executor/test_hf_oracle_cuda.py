"""The executor against transformers on a GPU: every tiny family (``hf_oracle.TINY_FAMILIES``)
in float32 and in bf16, on the general path, the eager fast path (Triton kernels) and CUDA
graphs, roomy, under KV pressure with recompute, with the host tier, plain and one step ahead.

float32: greedy tokens equal transformers' ``generate`` on the GPU up to near ties (a
differing token passes where transformers' logits put it within ``F32_TIE`` of its choice,
and the sequences are not compared past it), logits within ``F32_LOGITS`` before that. bf16:
the two implementations round differently, so the tokens are compared the same way with a
logit tolerance ``BF16_TIE`` and the logits before a divergence within ``BF16_LOGITS``.
Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import helix_kv

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helix_kv.executor.hf_oracle import (
    TINY_FAMILIES,
    OracleRun,
    first_divergence,
    hf_greedy,
    save_tiny_checkpoint,
)
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_rank

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not hasattr(helix_kv, "Scheduler"), reason="binding not built"),
]

FAMILIES = tuple(TINY_FAMILIES)
TPB = 16
MAX_NEW = 24
VOCAB = 128
F32_TIE, F32_LOGITS = 1e-3, 2e-3
#: bf16: 0.25, or 3% of the largest logit where logits are larger (the tied Qwen2 model's
#: reach about 20: bf16 rounds them to 1/16 and its 8-bit mantissa compounds over the layers)
BF16_TIE, BF16_LOGITS, BF16_RELATIVE = 0.25, 0.25, 0.03
#: (name, global KV tokens, host tier pages)
POOLS = (("roomy", 4096, 0), ("tight", 160, 0), ("host_tier", 160, 64))
#: (name, decode_kernel, cuda_graphs, overlap)
PATHS = (
    ("general", False, False, False),
    ("kernel", True, False, False),
    ("graphs", True, True, False),
    ("graphs_overlap", True, True, True),
)


def prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(7)
    lengths = [61, 17, 90, 5, 33, 48, 120, 2]
    return {i: rng.integers(0, VOCAB, size=n).tolist() for i, n in enumerate(lengths)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_cuda")
    return {f: save_tiny_checkpoint(f, root / f, seed=5) for f in FAMILIES}


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> dict[tuple[str, str], OracleRun]:
    return {
        (f, dtype): hf_greedy(path, prompts(), MAX_NEW, getattr(torch, dtype), "cuda")
        for f, path in checkpoints.items()
        for dtype in ("float32", "bfloat16")
    }


def run(path: Path, dtype: str, pool: tuple[str, int, int], mode: tuple) -> RunResult:
    _, kv_tokens, host_pages = pool
    _, kernel, graphs, overlap = mode
    config = ExecutorConfig(
        tokens_per_block=TPB,
        kv_superblocks=kv_tokens // TPB,
        max_batch_size=8,
        max_num_tokens=256,
        model=str(path),
        dtype=dtype,
        device="cuda",
        decode_kernel=kernel,
        cuda_graphs=graphs,
        overlap=overlap,
        host_tier_pages=host_pages,
        record_logits=True,
    )
    return run_rank(prompts(), MAX_NEW, config)


def check(
    result: RunResult, expected: OracleRun, tie: float, atol: float, relative: float = 0.0
) -> None:
    scale = max(float(logits.abs().max()) for logits in expected.logits.values())
    tie, atol = max(tie, relative * scale), max(atol, relative * scale)
    for rid, tokens in expected.tokens.items():
        ours = result.outputs[rid]
        problem = first_divergence(ours, tokens, expected.logits[rid], tie)
        assert problem is None, f"request {rid}: {problem}"
        agree = 0
        while agree < len(tokens) and ours[agree] == tokens[agree]:
            agree += 1
        np.testing.assert_allclose(
            result.logits[rid][:agree], expected.logits[rid][:agree].numpy(), rtol=0, atol=atol
        )


@pytest.mark.parametrize("mode", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("pool", POOLS, ids=[p[0] for p in POOLS])
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_equals_transformers_on_the_gpu(checkpoints, oracle, family, pool, mode):
    result = run(checkpoints[family], "float32", pool, mode)
    check(result, oracle[family, "float32"], F32_TIE, F32_LOGITS)
    if pool[0] == "tight":
        assert result.preemptions >= 1
    if pool[0] == "host_tier":
        assert result.metrics["suspensions"] >= 1


@pytest.mark.parametrize("mode", PATHS[::2], ids=[p[0] for p in PATHS[::2]])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_within_a_logit_tolerance_of_transformers(checkpoints, oracle, family, mode):
    result = run(checkpoints[family], "bfloat16", POOLS[1], mode)
    check(result, oracle[family, "bfloat16"], BF16_TIE, BF16_LOGITS, BF16_RELATIVE)


@pytest.mark.parametrize("mode", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_burst_sharing_its_system_prompt_equals_transformers_on_the_gpu(tmp_path, family, mode):
    """Same-step sharing on the GPU, in float32, for every family (MLA included) and path:
    a burst behind one system prompt admitted in one step, the later requests reading the
    superblocks the first one writes in that step; the tokens equal transformers'."""
    from .test_executor_prefix_cache import BURST_TOKENS, burst_hits, burst_prompts

    path = save_tiny_checkpoint(family, tmp_path / family, seed=5)
    burst = burst_prompts(vocab=VOCAB)
    expected = hf_greedy(path, burst, MAX_NEW, torch.float32, "cuda")
    _, kernel, graphs, overlap = mode
    config = ExecutorConfig(
        tokens_per_block=TPB,
        kv_superblocks=4096 // TPB,
        max_batch_size=8,
        max_num_tokens=BURST_TOKENS,
        model=str(path),
        dtype="float32",
        device="cuda",
        decode_kernel=kernel,
        cuda_graphs=graphs,
        overlap=overlap,
        record_logits=True,
        scheduler_options={"enable_prefix_caching": True},
    )
    result = run_rank(burst, MAX_NEW, config)
    assert result.metrics["prefix_cache_same_step_hits"] == burst_hits(burst, TPB) > 0
    check(result, expected, F32_TIE, F32_LOGITS)
