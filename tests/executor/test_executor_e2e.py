"""End to end on CPU (gloo, float64): the scheduler drives the model across cp ranks.

Greedy tokens must be identical for cp = 1, 2 and 4, with a roomy pool, with a pool small
enough that requests are recompute-paused, and with that pool plus a host tier (aggregated
Helix suspends requests to it and resumes them, copying each rank's pages through its
:class:`~helix_kv.executor.HostKVPool`), and equal to a dense scheduler-free reference; with
an end-of-sequence token, equal to the reference cut after its first EOS. Every run is done in
both modes, plain and overlap (step t + 1 scheduled while step t runs, its decode inputs
gathered on the device from step t's sampled tokens), and the overlap tokens must equal the
plain ones token for token. Each CP size runs all its jobs in one spawned process group to
keep CI time down.
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
EXPECTED_PREEMPTIONS = {
    "plain": {1: 7, 2: 4, 4: 3},
    # One step ahead, a step is planned before the previous one frees its finished requests'
    # pages, so the tight pool preempts differently (the outputs do not change).
    "overlap": {1: 8, 2: 4, 4: 3},
}
CP_SIZES = (1, 2, 4)
MODES = ("plain", "overlap")
MODEL = TinyConfig(num_layers=2, seed=7)
#: A token the greedy outputs reach early in four of the six requests (at output index 3 to
#: 8); the other two never sample it and run to MAX_NEW.
EOS_TOKEN = 46
#: Runs of each CP size: (name, global KV tokens, eos token, host tier pages per rank).
POOLS = (
    ("roomy", ROOMY_TOKENS, None, 0),
    ("tight", TIGHT_TOKENS, None, 0),
    ("eos", TIGHT_TOKENS, EOS_TOKEN, 0),
    ("host_tier", TIGHT_TOKENS, None, HOST_PAGES),
)


def prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(2024)
    lengths = [27, 9, 30, 5, 18, 23]  # uneven, several pages, some partial pages
    return {
        100 + i: rng.integers(0, MODEL.vocab_size, size=n).tolist() for i, n in enumerate(lengths)
    }


def config(
    cp: int, kv_tokens: int, overlap: bool = False, eos: int | None = None, host_pages: int = 0
) -> ExecutorConfig:
    return ExecutorConfig(
        cp_size=cp,
        tokens_per_block=TPB,
        kv_superblocks=kv_tokens // (TPB * cp),
        max_batch_size=8,
        max_num_tokens=24,
        model=MODEL,
        check_schedule=cp > 1,
        overlap=overlap,
        eos_token_id=eos,
        host_tier_pages=host_pages,
    )


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[tuple[str, str], RunResult]]:
    """{cp: {(pool, mode): rank-0 result}}; ranks checked to agree."""
    by_cp = {}
    for cp in CP_SIZES:
        keys = [(name, mode) for name, *_ in POOLS for mode in MODES]
        jobs = [
            (prompts(), MAX_NEW, config(cp, kv, mode == "overlap", eos, host_pages))
            for _, kv, eos, host_pages in POOLS
            for mode in MODES
        ]
        if cp == 1:
            per_job = [[run_rank(*job)] for job in jobs]
        else:
            per_job = run_group(jobs, cp, backend="gloo", timeout_s=180)
        by_cp[cp] = {key: results[0] for key, results in zip(keys, per_job)}
        for (name, mode), results in zip(keys, per_job):
            r = results[0]
            print(
                f"\ncp={cp} {name} {mode}: capacity {r.capacity_superblocks} superblocks, "
                f"{len(r.digests)} steps, {r.preemptions} preemptions "
                f"({r.preempted_while_decoding} while decoding), metrics {r.metrics}"
            )
    return by_cp


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    model = TinyTransformer(MODEL)
    return {rid: greedy_generate(model, p, MAX_NEW) for rid, p in prompts().items()}


def cut_after_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS_TOKEN) + 1] if EOS_TOKEN in tokens else tokens


def test_every_request_generates_its_budget(runs):
    for by_pool in runs.values():
        for (name, _), result in by_pool.items():
            assert sorted(result.outputs) == sorted(prompts())
            if name != "eos":
                assert all(len(tokens) == MAX_NEW for tokens in result.outputs.values())


@pytest.mark.parametrize("mode", MODES)
def test_roomy_pool_never_preempts(runs, mode):
    for cp, by_pool in runs.items():
        assert by_pool["roomy", mode].preemptions == 0, cp


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_tokens_equal_dense_reference(runs, reference, cp, mode):
    assert runs[cp]["roomy", mode].outputs == reference


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", CP_SIZES[1:])
def test_tokens_identical_across_cp(runs, cp, mode):
    assert runs[cp]["roomy", mode].outputs == runs[1]["roomy", "plain"].outputs


@pytest.mark.parametrize("pool", [name for name, *_ in POOLS])
@pytest.mark.parametrize("cp", CP_SIZES)
def test_overlap_tokens_equal_plain_tokens(runs, cp, pool):
    plain, overlap = runs[cp][pool, "plain"], runs[cp][pool, "overlap"]
    assert overlap.outputs == plain.outputs  # token for token
    generated = {rid: m["generated_tokens"] for rid, m in plain.request_metrics.items()}
    assert {rid: m["generated_tokens"] for rid, m in overlap.request_metrics.items()} == generated


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_preemption_changes_no_output(runs, cp, mode):
    tight, roomy = runs[cp]["tight", mode], runs[cp]["roomy", mode]
    assert tight.preemptions >= 1, "the tight pool must force recompute-pause"
    assert tight.preempted_while_decoding >= 1, "a victim must have generated tokens"
    assert tight.outputs == roomy.outputs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_preemption_counts_are_consistent(runs, cp, mode):
    tight = runs[cp]["tight", mode]
    # counted three ways: the schedule outputs, the scheduler metrics, the per-request metrics
    assert tight.preemptions == EXPECTED_PREEMPTIONS[mode][cp]
    assert tight.metrics["preemptions"] == tight.preemptions
    # every victim choice is a recompute-pause here (no host tier)
    per_request = sum(m["victim_choices"] for m in tight.request_metrics.values())
    assert per_request == tight.preemptions + tight.metrics["suspensions"]
    assert tight.metrics["recomputed_tokens"] > 0
    assert tight.capacity_superblocks == TIGHT_TOKENS // (TPB * cp)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_eos_ends_requests_at_their_first_eos(runs, reference, cp, mode):
    run = runs[cp]["eos", mode]
    assert run.outputs == {rid: cut_after_eos(tokens) for rid, tokens in reference.items()}
    stopped = [rid for rid, tokens in run.outputs.items() if len(tokens) < MAX_NEW]
    assert len(stopped) == 4, run.outputs  # and the two others ran to MAX_NEW
    assert run.preemptions >= 1  # under pressure too


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_suspend_and_resume_through_the_host_tier_change_no_output(runs, cp, mode):
    suspended, roomy = runs[cp]["host_tier", mode], runs[cp]["roomy", mode]
    metrics = suspended.metrics
    assert metrics["suspensions"] >= 1, "the tight pool with a host tier must suspend"
    assert metrics["resumes"] == metrics["suspensions"]
    assert suspended.outputs == roomy.outputs
    # each rank copied every suspended page out and back in, one page per superblock
    assert suspended.host_tier_superblocks == HOST_PAGES
    page_bytes = suspended.host_bytes_out // metrics["suspended_superblocks"]
    assert suspended.host_bytes_out == metrics["suspended_superblocks"] * page_bytes > 0
    assert suspended.host_bytes_in == metrics["resumed_superblocks"] * page_bytes
    assert metrics["recomputed_tokens"] < runs[cp]["tight", mode].metrics["recomputed_tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_a_request_ends_at_any_of_several_eos_ids(reference, mode):
    """``eos_token_id`` as a tuple (transformers' EOS list): a request ends at the first of
    any of them, under pressure, plain and one step ahead; one id in a tuple is that id."""
    # EOS_TOKEN, and a token a request that never samples it samples early
    second = next(t[2] for t in reference.values() if EOS_TOKEN not in t)
    ids = (EOS_TOKEN, second)
    tight = POOLS[1][1]
    result = run_rank(
        prompts(), MAX_NEW, config(1, tight, mode == "overlap").with_(eos_token_id=ids)
    )
    for rid, tokens in reference.items():
        ends = [i for i, t in enumerate(tokens) if t in ids]
        assert result.outputs[rid] == (tokens[: ends[0] + 1] if ends else tokens), rid
    assert any(len(t) < MAX_NEW and t[-1] == ids[0] for t in result.outputs.values())
    assert any(len(t) < MAX_NEW and t[-1] == ids[1] for t in result.outputs.values())
    single = run_rank(prompts(), MAX_NEW, config(1, tight).with_(eos_token_id=(EOS_TOKEN,)))
    assert single.outputs == {rid: cut_after_eos(t) for rid, t in reference.items()}
    with pytest.raises(TypeError, match="eos_token_id"):
        run_rank(prompts(), MAX_NEW, config(1, tight).with_(eos_token_id=(EOS_TOKEN, "2")))
