"""The draft backoff in the reference executor: prompts whose drafts are mostly rejected (no
repeated pattern), the backoff on (``draft_backoff_misses = 2``) against off, at cp 1 and 2,
plain and one step ahead. The outputs stay the greedy tokens without drafts; the backoff
verifies fewer drafts and the runner searches fewer requests (it skips the stopped ones)."""

from __future__ import annotations

import numpy as np
import pytest

from helix_kv.executor.model import TinyConfig, TinyTransformer
from helix_kv.executor.reference import greedy_generate
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_group, run_rank

from ..helpers.scheduler import needs_scheduler

pytestmark = needs_scheduler

TPB = 4
MAX_NEW = 24
MODEL = TinyConfig(num_layers=2, seed=11)


def prompts() -> dict[int, list[int]]:
    """Six random prompts over a small vocabulary slice: n-grams recur (so the drafter
    proposes) but the model rarely continues them (so the drafts are rejected)."""
    rng = np.random.default_rng(5)
    lengths = range(9, 21, 2)
    return {500 + i: rng.integers(0, 12, size=n).tolist() for i, n in enumerate(lengths)}


def config(cp: int, overlap: bool, misses: int) -> ExecutorConfig:
    return ExecutorConfig(
        cp_size=cp, tokens_per_block=TPB, kv_superblocks=512 // (TPB * cp), max_batch_size=8,
        max_num_tokens=64, model=MODEL, check_schedule=cp > 1, overlap=overlap,
        num_speculative_tokens=4, scheduler_options={"draft_backoff_misses": misses},
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, bool, int], RunResult]:
    results = {}
    for cp in (1, 2):
        keys = [(cp, overlap, misses) for overlap in (False, True) for misses in (0, 2)]
        jobs = [(prompts(), MAX_NEW, config(*key)) for key in keys]
        if cp == 1:
            per_job = [[run_rank(*job)] for job in jobs]
        else:
            per_job = run_group(jobs, cp, backend="gloo", timeout_s=300)
        for key, ranks in zip(keys, per_job):
            results[key] = ranks[0]
    return results


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("cp", [1, 2])
def test_the_backoff_verifies_fewer_drafts_and_keeps_the_tokens(runs, cp, overlap):
    model = TinyTransformer(MODEL)
    want = {rid: greedy_generate(model, p, MAX_NEW) for rid, p in prompts().items()}
    off, on = runs[cp, overlap, 0], runs[cp, overlap, 2]
    assert off.outputs == want
    assert on.outputs == want
    drafted_off = off.spec_decode["spec_decode_num_draft_tokens"]
    drafted_on = on.spec_decode["spec_decode_num_draft_tokens"]
    rate_off = off.spec_decode["spec_decode_num_accepted_tokens"] / drafted_off
    assert rate_off < 0.5, "the workload must reject most drafts"
    assert 0 < drafted_on < drafted_off
    assert on.proposed_draft_tokens < off.proposed_draft_tokens
