"""End to end on CPU (gloo, float64): the scheduler drives the model across cp ranks.

Greedy tokens must be identical for cp = 1, 2 and 4, with a roomy pool, with a pool small
enough that requests are recompute-paused, and with that pool plus a host tier (aggregated
Helix suspends requests to it and resumes them, copying each rank's pages through its
:class:`~helix_kv.executor.HostKVPool`), and equal to a dense scheduler-free reference.
Each CP size runs its pools in one spawned process group to keep CI time down.
"""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv
from helix_kv.executor.model import TinyConfig, TinyTransformer
from helix_kv.executor.reference import greedy_generate
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_group, run_rank

pytestmark = pytest.mark.skipif(
    not hasattr(helix_kv, "Scheduler"), reason="helix_kv.Scheduler binding not built yet"
)

TPB = 4
MAX_NEW = 12
ROOMY_TOKENS = 1024  # global KV tokens: every request fits at once
TIGHT_TOKENS = 48  # global KV tokens: about one request at a time, forces recompute-pause
HOST_PAGES = 64  # each rank's host tier with the tight pool: room for every victim
# Recompute-pauses the tight pool needs per cp (deterministic: the scheduler's decisions depend
# only on the config and the requests). A change means the scheduler's choices changed.
EXPECTED_PREEMPTIONS = {1: 7, 2: 4, 4: 3}
CP_SIZES = (1, 2, 4)
MODEL = TinyConfig(num_layers=2, seed=7)


def prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(2024)
    lengths = [27, 9, 30, 5, 18, 23]  # uneven, several pages, some partial pages
    return {
        100 + i: rng.integers(0, MODEL.vocab_size, size=n).tolist() for i, n in enumerate(lengths)
    }


def config(cp: int, kv_tokens: int) -> ExecutorConfig:
    return ExecutorConfig(
        cp=cp,
        tokens_per_block=TPB,
        kv_superblocks=kv_tokens // (TPB * cp),
        max_batch_size=8,
        max_num_tokens=24,
        model=MODEL,
        check_schedule=cp > 1,
    )


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, RunResult]]:
    """{cp: {"roomy": rank-0 result, "tight": rank-0 result}}; ranks checked to agree."""
    by_cp = {}
    for cp in CP_SIZES:
        jobs = [(prompts(), MAX_NEW, config(cp, kv)) for kv in (ROOMY_TOKENS, TIGHT_TOKENS)]
        jobs.append(
            (prompts(), MAX_NEW, config(cp, TIGHT_TOKENS).with_(host_tier_pages=HOST_PAGES))
        )
        if cp == 1:
            per_job = [[run_rank(*job)] for job in jobs]
        else:
            per_job = run_group(jobs, cp, backend="gloo", timeout_s=90)
        names = ("roomy", "tight", "host_tier")
        by_cp[cp] = {name: results[0] for name, results in zip(names, per_job)}
        for name, results in zip(names, per_job):
            r = results[0]
            print(
                f"\ncp={cp} {name}: capacity {r.capacity_superblocks} superblocks, "
                f"{len(r.digests)} steps, {r.preemptions} preemptions "
                f"({r.preempted_while_decoding} while decoding), metrics {r.metrics}"
            )
    return by_cp


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    model = TinyTransformer(MODEL)
    return {rid: greedy_generate(model, p, MAX_NEW) for rid, p in prompts().items()}


def test_every_request_generates_its_budget(runs):
    for by_pool in runs.values():
        for result in by_pool.values():
            assert sorted(result.outputs) == sorted(prompts())
            assert all(len(tokens) == MAX_NEW for tokens in result.outputs.values())


def test_roomy_pool_never_preempts(runs):
    for cp, by_pool in runs.items():
        assert by_pool["roomy"].preemptions == 0, cp


@pytest.mark.parametrize("cp", CP_SIZES)
def test_tokens_equal_dense_reference(runs, reference, cp):
    assert runs[cp]["roomy"].outputs == reference


@pytest.mark.parametrize("cp", CP_SIZES[1:])
def test_tokens_identical_across_cp(runs, cp):
    assert runs[cp]["roomy"].outputs == runs[1]["roomy"].outputs


@pytest.mark.parametrize("cp", CP_SIZES)
def test_preemption_changes_no_output(runs, cp):
    tight, roomy = runs[cp]["tight"], runs[cp]["roomy"]
    assert tight.preemptions >= 1, "the tight pool must force recompute-pause"
    assert tight.preempted_while_decoding >= 1, "a victim must have generated tokens"
    assert tight.outputs == roomy.outputs


@pytest.mark.parametrize("cp", CP_SIZES)
def test_preemption_counts_are_consistent(runs, cp):
    tight = runs[cp]["tight"]
    # counted three ways: the schedule outputs, the scheduler metrics, the per-request metrics
    assert tight.preemptions == EXPECTED_PREEMPTIONS[cp]
    assert tight.metrics["preemptions"] == tight.preemptions
    per_request = sum(m["preemptions"] for m in tight.request_metrics.values())
    assert per_request == tight.preemptions
    assert tight.metrics["recomputed_tokens"] > 0
    assert tight.capacity_superblocks == TIGHT_TOKENS // (TPB * cp)


@pytest.mark.parametrize("cp", CP_SIZES)
def test_suspend_and_resume_through_the_host_tier_change_no_output(runs, cp):
    suspended, roomy = runs[cp]["host_tier"], runs[cp]["roomy"]
    metrics = suspended.metrics
    assert metrics["suspensions"] >= 1, "the tight pool with a host tier must suspend"
    assert metrics["resumes"] == metrics["suspensions"]
    assert suspended.outputs == roomy.outputs
    # each rank copied every suspended page out and back in, one page per superblock
    assert suspended.host_tier_superblocks == HOST_PAGES
    page_bytes = suspended.host_bytes_out // metrics["suspended_superblocks"]
    assert suspended.host_bytes_out == metrics["suspended_superblocks"] * page_bytes > 0
    assert suspended.host_bytes_in == metrics["resumed_superblocks"] * page_bytes
    assert metrics["recomputed_tokens"] < runs[cp]["tight"].metrics["recomputed_tokens"]
