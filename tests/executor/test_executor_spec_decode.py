"""Speculative decoding end to end on CPU (gloo, float64): prompt-lookup drafts verified in
the same forward, greedy acceptance, and the greedy tokens equal to those without drafts.

Prompts repeat a short random pattern and the tiny model's greedy outputs fall into cycles, so
the n-gram drafter finds matches and many drafts are accepted. For cp = 1, 2 and 4 (drafts of
4 tokens cross page and so rank boundaries at 4 tokens per page), plain and one step ahead,
with a roomy pool, a pool tight enough to recompute-pause (drafts trimmed there: they are
allocated last, from free pages only), the tight pool with a host tier (suspend / resume) and
an EOS token, the outputs must equal the run without drafts and the dense reference. The decode
fast path (``decode_kernel``: one kernel row per query token; Triton's interpreter on the CPU,
CUDA tensors on a GPU machine: ``devices.py``) must give the same tokens too.
"""

from __future__ import annotations

import numpy as np
import pytest

from helix_kv.executor.model import TinyConfig, TinyTransformer
from helix_kv.executor.reference import greedy_generate
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_group, run_rank

from ..helpers.scheduler import needs_scheduler
from .devices import run_fast_path

pytestmark = needs_scheduler

TPB = 4
K = 4
MAX_NEW = 16
MODEL = TinyConfig(num_layers=2, seed=7)
CP_SIZES = (1, 2, 4)
MODES = ("plain", "overlap")
#: Sampled early by four of the six requests' greedy outputs (at output index 3 to 13); the
#: other two never sample it.
EOS_TOKEN = 94
#: (name, global KV tokens, eos, host tier pages per rank)
POOLS = (
    ("roomy", 1024, None, 0),
    ("tight", 64, None, 0),
    ("host_tier", 64, None, 64),
    ("eos", 64, EOS_TOKEN, 0),
)


def prompts() -> dict[int, list[int]]:
    """Six prompts, each a short random pattern repeated (periods 2 to 7)."""
    rng = np.random.default_rng(31)
    out = {}
    for i, (period, n) in enumerate([(3, 26), (5, 17), (4, 30), (6, 11), (2, 21), (7, 25)]):
        base = rng.integers(0, MODEL.vocab_size, size=period).tolist()
        out[300 + i] = (base * (n // period + 1))[:n]
    return out


def config(
    cp: int, kv_tokens: int, k: int, overlap: bool, eos: int | None = None, host_pages: int = 0
) -> ExecutorConfig:
    return ExecutorConfig(
        cp_size=cp,
        tokens_per_block=TPB,
        kv_superblocks=kv_tokens // (TPB * cp),
        max_batch_size=8,
        max_num_tokens=32,
        model=MODEL,
        check_schedule=cp > 1,
        overlap=overlap,
        eos_token_id=eos,
        host_tier_pages=host_pages,
        num_speculative_tokens=k,
    )


def cut_after_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS_TOKEN) + 1] if EOS_TOKEN in tokens else tokens


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    model = TinyTransformer(MODEL)
    return {rid: greedy_generate(model, p, MAX_NEW) for rid, p in prompts().items()}


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, str, str, int], RunResult]:
    """{(cp, pool, mode, k): rank-0 result}; every rank agrees (checked by run_group)."""
    results = {}
    for cp in CP_SIZES:
        keys = [(cp, name, mode, K) for name, *_ in POOLS for mode in MODES]
        keys += [(cp, "roomy", mode, 0) for mode in MODES]
        pools = {name: (kv, eos, host) for name, kv, eos, host in POOLS}
        jobs = [
            (prompts(), MAX_NEW, config(cp, pools[name][0], k, mode == "overlap", *pools[name][1:]))
            for _, name, mode, k in keys
        ]
        if cp == 1:
            per_job = [[run_rank(*job)] for job in jobs]
        else:
            per_job = run_group(jobs, cp, backend="gloo", timeout_s=300)
        for key, ranks in zip(keys, per_job):
            results[key] = ranks[0]
            r = ranks[0]
            print(
                f"\n{key}: {len(r.digests)} steps, {r.preemptions} preemptions, "
                f"{r.tokens_per_decode_step:.2f} tokens per decode step, {r.spec_decode}"
            )
    return results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pool", [name for name, *_ in POOLS])
@pytest.mark.parametrize("cp", CP_SIZES)
def test_drafted_tokens_equal_greedy_without_drafts(runs, reference, cp, pool, mode):
    run = runs[cp, pool, mode, K]
    want = reference if pool != "eos" else {r: cut_after_eos(t) for r, t in reference.items()}
    assert run.outputs == want
    if pool != "eos":
        assert run.outputs == runs[cp, "roomy", mode, 0].outputs  # the same run without drafts
    spec = run.spec_decode
    assert spec["spec_decode_num_drafts"] > 0
    assert run.draft_steps > 0
    assert 0 < spec["spec_decode_num_accepted_tokens"] <= spec["spec_decode_num_draft_tokens"]
    assert run.proposed_draft_tokens >= spec["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("cp", CP_SIZES)
def test_drafts_are_accepted_and_save_steps(runs, cp):
    """Plain mode: most drafts are right on these cycles, so each decode step generates more
    than one token per request on average and the run takes fewer steps."""
    spec, base = runs[cp, "roomy", "plain", K], runs[cp, "roomy", "plain", 0]
    assert spec.draft_acceptance_rate > 0.4, spec.spec_decode
    assert len(spec.digests) < len(base.digests)
    assert spec.tokens_per_decode_step > base.tokens_per_decode_step
    # the same tokens generated, in fewer decode steps
    assert spec.metrics["spec_decode_num_accepted_tokens"] > 0
    assert sum(len(t) for t in spec.outputs.values()) == sum(len(t) for t in base.outputs.values())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_pressure_preempts_and_trims_drafts(runs, cp, mode):
    tight = runs[cp, "tight", mode, K]
    assert tight.preemptions >= 1
    assert tight.metrics["spec_decode_num_trimmed_tokens"] > 0
    host = runs[cp, "host_tier", mode, K]
    assert host.metrics["suspensions"] >= 1
    assert host.metrics["resumes"] == host.metrics["suspensions"]


@pytest.mark.parametrize("cp", CP_SIZES[:2])
def test_rejected_drafts_return_superblocks(runs, cp):
    """Drafts reach superblocks of their own (4 and 8 tokens here; at cp = 4 a superblock of
    16 tokens is reached first by a decode token in this workload), and superblocks reached
    only by rejected drafts go back to the pool."""
    spec = runs[cp, "roomy", "plain", K].spec_decode
    assert spec["spec_decode_draft_superblocks"] > 0
    assert spec["spec_decode_returned_superblocks"] > 0
    assert spec["spec_decode_returned_superblocks"] <= spec["spec_decode_draft_superblocks"]


@pytest.fixture(scope="module")
def fast_path_runs() -> dict[tuple[int, str, bool], RunResult]:
    """The decode fast path with drafts, few tokens: float64 on CUDA tensors where there is a
    GPU (cp = 2: on two GPUs, else in spawned ranks through Triton's interpreter), else on the
    CPU through the interpreter (``tests/executor/devices.py``)."""
    subset = {rid: p for rid, p in prompts().items() if rid in (300, 302, 304, 305)}
    results = {}
    for cp in (1, 2):
        keys = [(cp, mode, False) for mode in MODES] + [(cp, "plain", True)]
        jobs = [
            (
                subset,
                10,
                config(cp, 1024, K, mode == "overlap").with_(
                    decode_kernel=True, group_draft_rows=grouped
                ),
            )
            for _, mode, grouped in keys
        ]
        results.update(zip(keys, run_fast_path(jobs, cp)))
    return results


@pytest.mark.parametrize(
    ("mode", "grouped"), [("plain", False), ("overlap", False), ("plain", True)]
)
@pytest.mark.parametrize("cp", [1, 2])
def test_fast_path_verifies_drafts(fast_path_runs, reference, cp, mode, grouped):
    """One kernel row per query token; ``grouped``: a request's rows in one program."""
    run = fast_path_runs[cp, mode, grouped]
    assert run.outputs == {rid: reference[rid][:10] for rid in run.outputs}
    assert run.draft_steps > 0
    assert run.metrics["spec_decode_num_accepted_tokens"] > 0
    assert run.fast_path_draft_steps > 0  # drafted decode-only steps ran on the fast path
    if mode == "overlap":
        assert run.fast_path_inputs_in_flight > 0
