"""The executor against transformers (CPU, gloo, float64): real model families, an oracle
nobody here wrote.

transformers builds a tiny random model of each family (``helix_kv.executor.hf_oracle``:
Llama with llama3 RoPE scaling, Mistral with its own head_dim and one KV head, Qwen2 with QKV
biases and tied embeddings, DeepSeek-V3 MLA without and with the query bottleneck, the
latter with yarn RoPE; interleaved RoPE as DeepSeek ships it) and saves it; the executor
loads the saved directory and its greedy tokens must equal transformers' own greedy
``generate`` for prompts of different lengths: with a roomy pool, under KV pressure with
recompute, with the host tier, with an EOS token, with n-gram drafts, each plain and one
step ahead, for cp = 1, 2 and 4 (one real scheduler per rank, every step's digest compared).

Tolerance for near ties (stated in :func:`helix_kv.executor.hf_oracle.first_divergence`):
transformers computes RoPE tables and RMSNorm in float32 whatever the model dtype, so a
differing token passes only where transformers' own logits put it within ``TIE_TOLERANCE``
of its choice (none did when this was written); logits of the steps before any divergence
must agree within ``LOGIT_ATOL``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

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
from helix_kv.executor.runner import (
    ExecutorConfig,
    RunResult,
    run_group,
    run_rank,
)

from .devices import run_fast_path

pytestmark = pytest.mark.skipif(
    not hasattr(helix_kv, "Scheduler"), reason="helix_kv.Scheduler binding not built yet"
)

FAMILIES = tuple(TINY_FAMILIES)
TPB = 4
MAX_NEW = 12
VOCAB = 128
ROOMY_TOKENS = 1024
TIGHT_TOKENS = 48  # about one request at a time: recompute-pause
HOST_PAGES = 64
#: transformers' logit gap below which a differing greedy token is a near tie.
TIE_TOLERANCE = 1e-5
#: Largest logit difference from transformers before any divergence (float64 here, float32
#: RoPE tables and norms there).
LOGIT_ATOL = 1e-4
CP_SIZES = (1, 2, 4)
MODES = ("plain", "overlap")
#: (name, global KV tokens, host tier pages per rank, EOS?, drafts per step)
POOLS = (
    ("roomy", ROOMY_TOKENS, 0, False, 0),
    ("tight", TIGHT_TOKENS, 0, False, 0),
    ("host_tier", TIGHT_TOKENS, HOST_PAGES, False, 0),
    ("eos", TIGHT_TOKENS, 0, True, 0),
    ("drafts", TIGHT_TOKENS, HOST_PAGES, False, 3),
)


def prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(2025)
    lengths = [27, 9, 30, 5, 18, 23]
    return {100 + i: rng.integers(0, VOCAB, size=n).tolist() for i, n in enumerate(lengths)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: save_tiny_checkpoint(f, root / f, seed=11) for f in FAMILIES}


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> dict[str, OracleRun]:
    return {f: hf_greedy(path, prompts(), MAX_NEW) for f, path in checkpoints.items()}


def eos_token(run: OracleRun) -> int:
    """A token the oracle samples after its first outputs in some requests (the commonest)."""
    counts = np.bincount([t for tokens in run.tokens.values() for t in tokens[2:]], minlength=VOCAB)
    return int(counts.argmax())


def cut_after(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def config(
    cp: int, path: Path, pool: tuple[str, int, int, bool, int], overlap: bool, eos: int
) -> ExecutorConfig:
    name, kv_tokens, host_pages, with_eos, drafts = pool
    return ExecutorConfig(
        cp_size=cp,
        tokens_per_block=TPB,
        kv_superblocks=kv_tokens // (TPB * cp),
        max_batch_size=8,
        max_num_tokens=24,
        model=str(path),
        dtype="float64",
        check_schedule=cp > 1,
        overlap=overlap,
        eos_token_id=eos if with_eos else None,
        host_tier_pages=host_pages,
        num_speculative_tokens=drafts,
        record_logits=name == "roomy" and not overlap,
    )


@pytest.fixture(scope="module")
def runs(
    checkpoints: dict[str, Path], oracle: dict[str, OracleRun]
) -> dict[tuple[int, str, str, str], RunResult]:
    """{(cp, family, pool, mode): rank-0 result}; run_group checks that the ranks agree."""
    results = {}
    for cp in CP_SIZES:
        keys = [(cp, f, p[0], m) for f in FAMILIES for p in POOLS for m in MODES]
        jobs = [
            (
                prompts(),
                MAX_NEW,
                config(cp, checkpoints[f], p, m == "overlap", eos_token(oracle[f])),
            )
            for f in FAMILIES
            for p in POOLS
            for m in MODES
        ]
        if cp == 1:
            per_job = [[run_rank(*job)] for job in jobs]
        else:
            per_job = run_group(jobs, cp, backend="gloo", timeout_s=600)
        results.update({key: ranks[0] for key, ranks in zip(keys, per_job)})
    return results


def check_against_oracle(ours: dict[int, list[int]], run: OracleRun, eos: int | None) -> None:
    for rid, tokens in run.tokens.items():
        expected = cut_after(tokens, eos) if eos is not None else tokens
        problem = first_divergence(ours[rid], expected, run.logits[rid], TIE_TOLERANCE)
        assert problem is None, f"request {rid}: {problem}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pool", [p[0] for p in POOLS])
@pytest.mark.parametrize("cp", CP_SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(runs, oracle, family, cp, pool, mode):
    result = runs[cp, family, pool, mode]
    eos = eos_token(oracle[family]) if pool == "eos" else None
    check_against_oracle(result.outputs, oracle[family], eos)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_logits(runs, oracle, family):
    result = runs[1, family, "roomy", "plain"]
    for rid, expected in oracle[family].logits.items():
        ours = result.logits[rid]
        agree = 0
        while agree < len(ours) and result.outputs[rid][agree] == oracle[family].tokens[rid][agree]:
            agree += 1
        assert agree == MAX_NEW, (rid, agree)
        np.testing.assert_allclose(ours[:agree], expected[:agree].numpy(), rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("cp", CP_SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_pressure_modes_ran(runs, oracle, family, cp):
    """The tight pools recompute-paused, the host tier suspended and resumed, drafts were
    verified and EOS ended some requests early, in both modes."""
    for mode in MODES:
        tight = runs[cp, family, "tight", mode]
        assert tight.preemptions >= 1
        assert tight.metrics["recomputed_tokens"] > 0
        host = runs[cp, family, "host_tier", mode].metrics
        assert host["suspensions"] >= 1
        assert host["resumes"] == host["suspensions"]
        drafted = runs[cp, family, "drafts", mode]
        assert drafted.metrics["spec_decode_num_draft_tokens"] > 0
        eos_run = runs[cp, family, "eos", mode]
        assert any(len(tokens) < MAX_NEW for tokens in eos_run.outputs.values())
        assert runs[cp, family, "roomy", mode].preemptions == 0


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("family", ["mistral", "deepseek_v3_lora_yarn"])
def test_the_fast_path_equals_transformers_generate(checkpoints, oracle, family, cp):
    """The decode fast path (the Triton paged kernels of each family: GQA, and the MLA kernel
    over one latent head), one step ahead under pressure with the host tier and drafts:
    transformers' tokens. float64 on CUDA tensors where there is a GPU (cp = 2: on two GPUs,
    else in spawned ranks through Triton's interpreter), else on the CPU through the
    interpreter (``tests/executor/devices.py``)."""
    pool = next(p for p in POOLS if p[0] == "drafts")
    job = config(cp, checkpoints[family], pool, True, 0).with_(decode_kernel=True)
    (result,) = run_fast_path([(prompts(), MAX_NEW, job)], cp)
    assert result.fast_path_steps > 0
    assert result.fast_path_draft_steps > 0  # drafts verified on the fast path too
    assert result.metrics["suspensions"] >= 1
    check_against_oracle(result.outputs, oracle[family], None)
