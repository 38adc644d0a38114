"""Prefix caching end to end on CPU (gloo, float64): a prefill that starts after the cached
tokens reads their pages (written by another request with the same prefix), and the greedy
tokens equal those with caching off and a dense scheduler-free reference, for cp = 1, 2 and
4, plain and one step ahead, with recompute-pauses and with the host tier.

Same-step sharing: a burst of requests behind one system prompt is admitted in one step, and
the later ones read the first one's superblocks as that very step writes them (the executor
writes each layer's KV before that layer's attention); the tokens still equal caching off,
the dense reference and transformers' own ``generate``."""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv
from helix_kv.executor.model import TinyConfig, TinyTransformer
from helix_kv.executor.reference import greedy_generate
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_group, run_rank

from .test_executor_e2e import config as e2e_config

pytestmark = pytest.mark.skipif(
    not hasattr(helix_kv, "Scheduler"), reason="helix_kv.Scheduler binding not built yet"
)

MAX_NEW = 10
MODEL = TinyConfig(num_layers=2, seed=11)
CP_SIZES = (1, 2, 4)
#: (name, global KV tokens, host tier pages per rank): roomy, then tight enough to preempt.
POOLS = (("roomy", 1024, 0), ("tight", 96, 0), ("host_tier", 96, 64))
MODES = ("plain", "overlap")
#: The burst's system prompt: whole superblocks at cp 1 and 2 (4-token pages), 2.5 at cp 4.
SYSTEM_LEN = 40
#: A step budget that admits the whole burst in its first step (its first prompt, then the
#: others' tails).
BURST_TOKENS = 128


def prompts() -> dict[int, list[int]]:
    """Three system prompts (32 and 48 tokens: whole superblocks at every cp here, and a
    partial one), each followed by a few requests' own tokens."""
    rng = np.random.default_rng(5)
    systems = [rng.integers(0, MODEL.vocab_size, size=n).tolist() for n in (32, 48, 21)]
    out = {}
    for i in range(9):
        own = rng.integers(0, MODEL.vocab_size, size=3 + (5 * i) % 7).tolist()
        out[200 + i] = systems[i % 3] + own
    return out


def burst_prompts(vocab: int = MODEL.vocab_size) -> dict[int, list[int]]:
    """Six requests behind one system prompt of :data:`SYSTEM_LEN` tokens, all arriving at
    once: the first two with the very same prompt, the others with a few tokens of their own
    (one with a single token)."""
    rng = np.random.default_rng(17)
    system = rng.integers(0, vocab, size=SYSTEM_LEN).tolist()
    twin = system + rng.integers(0, vocab, size=5).tolist()
    out = {300: twin, 301: list(twin)}
    for i, own in enumerate((1, 7, 3, 9)):
        out[302 + i] = system + rng.integers(0, vocab, size=own).tolist()
    return out


def burst_hits(prompts_by_id: dict[int, list[int]], per_superblock: int) -> int:
    """Prompt tokens the burst's later requests find in the superblocks of the requests
    before them, when all are admitted in one step: each one's longest common prefix with an
    earlier prompt, at most all but its last token, in whole superblocks."""
    seen: list[list[int]] = []
    hits = 0
    for prompt in prompts_by_id.values():
        common = max((_common_prefix(prompt, other) for other in seen), default=0)
        hits += min(common, len(prompt) - 1) // per_superblock * per_superblock
        seen.append(prompt)
    return hits


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def config(
    cp: int,
    kv_tokens: int,
    host_pages: int,
    overlap: bool,
    caching: bool,
    max_num_tokens: int = 40,
) -> ExecutorConfig:
    """The end-to-end test's configuration (same page size and batch), this test's model and
    a larger step budget, with prefix caching on or off."""
    base = e2e_config(cp, kv_tokens, overlap=overlap, host_pages=host_pages)
    return base.with_(
        model=MODEL,
        max_num_tokens=max_num_tokens,
        scheduler_options={"enable_prefix_caching": caching},
    )


def job(
    cp: int, pool: str, mode: str, caching: bool
) -> tuple[dict[int, list[int]], int, ExecutorConfig]:
    """The run of a key of :func:`runs`: a pool of :data:`POOLS` over :func:`prompts`, or
    ``"burst"``, :func:`burst_prompts` in a roomy pool with :data:`BURST_TOKENS` a step."""
    overlap = mode == "overlap"
    if pool == "burst":
        return (
            burst_prompts(),
            MAX_NEW,
            config(cp, 1024, 0, overlap, caching, max_num_tokens=BURST_TOKENS),
        )
    kv, host = next((k, h) for n, k, h in POOLS if n == pool)
    return prompts(), MAX_NEW, config(cp, kv, host, overlap, caching)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, str, str, bool], RunResult]:
    """{(cp, pool, mode, caching): rank-0 result}; ranks checked to agree by the runner."""
    results = {}
    for cp in CP_SIZES:
        keys = [
            (cp, name, mode, caching)
            for name in [*(p[0] for p in POOLS), "burst"]
            for mode in MODES
            for caching in (False, True)
        ]
        jobs = [job(*key) for key in keys]
        if cp == 1:
            per_job = [[run_rank(*job)] for job in jobs]
        else:
            per_job = run_group(jobs, cp, backend="gloo", timeout_s=300)
        for key, ranks in zip(keys, per_job):
            assert all(r.outputs == ranks[0].outputs for r in ranks), key
            results[key] = ranks[0]
    return results


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    model = TinyTransformer(MODEL)
    return {rid: greedy_generate(model, p, MAX_NEW) for rid, p in prompts().items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pool", [name for name, *_ in POOLS])
@pytest.mark.parametrize("cp", CP_SIZES)
def test_caching_changes_no_token(runs, reference, cp, pool, mode):
    on, off = runs[cp, pool, mode, True], runs[cp, pool, mode, False]
    assert on.outputs == off.outputs == reference
    assert off.metrics["prefix_cache_hits"] == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_a_burst_shares_its_system_prompt_in_its_first_step(runs, cp, mode):
    """The burst is admitted in one step: every hit is in a superblock the step's earlier
    entries write (none was cached before), each later request skips exactly the superblocks
    its prompt shares with an earlier one, and the tokens equal caching off and the dense
    reference."""
    on, off = runs[cp, "burst", mode, True], runs[cp, "burst", mode, False]
    model = TinyTransformer(MODEL)
    reference = {rid: greedy_generate(model, p, MAX_NEW) for rid, p in burst_prompts().items()}
    assert on.outputs == off.outputs == reference
    expected = burst_hits(burst_prompts(), 4 * cp)
    assert expected > 0
    assert on.metrics["prefix_cache_hits"] == expected
    assert on.metrics["prefix_cache_same_step_hits"] == expected
    assert off.metrics["prefix_cache_hits"] == off.metrics["prefix_cache_same_step_hits"] == 0
    assert off.tokens_run - on.tokens_run == expected


@pytest.mark.parametrize("cp", CP_SIZES)
def test_requests_hit_the_shared_prompts(runs, cp):
    def hits(result: RunResult) -> float:
        return result.metrics["prefix_cache_hits"] + result.metrics["prefix_cache_recompute_hits"]

    for mode in MODES:
        on, off = runs[cp, "roomy", mode, True], runs[cp, "roomy", mode, False]
        assert on.metrics["prefix_cache_hits"] > 0, mode
        assert on.metrics["prefix_cache_hits"] <= on.metrics["prefix_cache_queries"]
        assert on.metrics["computed_tokens"] < off.metrics["computed_tokens"], mode
    # Under pressure the small pool evicts most of the cache (at cp 4 a superblock is 16
    # tokens of a 96-token pool), but some prefix survives somewhere.
    pressured = [runs[cp, pool, mode, True] for pool in ("tight", "host_tier") for mode in MODES]
    assert sum(hits(r) for r in pressured) > 0
    assert all(r.metrics["prefix_cache_evictions"] > 0 for r in pressured)


def test_the_tight_pool_preempts_and_the_host_tier_suspends(runs):
    for cp in CP_SIZES:
        assert runs[cp, "tight", "plain", True].metrics["preemptions"] > 0, cp
        host = runs[cp, "host_tier", "plain", True].metrics
        assert host["preemptions"] + host["suspensions"] > 0, cp


def test_bench_prompts_share_their_system_prompts():
    """``synthetic_prompts`` with a shared prefix: prompt ``i`` starts with system prompt
    ``i % system_prompts``, its own tokens differ; without one, nothing is shared; a
    ``BenchSpec`` refuses a shared prefix longer than the prompt."""
    from helix_kv.executor.bench import BenchSpec, synthetic_prompts

    shared = synthetic_prompts(6, 20, 1000, seed=3, shared_prefix_len=12, system_prompts=2)
    assert all(len(p) == 20 for p in shared.values())
    assert shared[0][:12] == shared[2][:12] == shared[4][:12]
    assert shared[1][:12] == shared[3][:12] != shared[0][:12]
    assert shared[0][12:] != shared[2][12:]
    plain = synthetic_prompts(6, 20, 1000, seed=3)
    assert len({tuple(p[:12]) for p in plain.values()}) == 6
    with pytest.raises(ValueError, match="shared_prefix_len"):
        BenchSpec(prompt_len=16, shared_prefix_len=17)
    with pytest.raises(ValueError, match="system_prompts"):
        BenchSpec(system_prompts=0)


def test_bench_prefix_caching_reuses_the_shared_pages():
    """The executor bench's workload with shared system prompts: with prefix caching the
    later requests hit the cached superblocks and the forward runs fewer tokens; without it,
    no query and no hit."""
    from helix_kv.executor.bench import BenchSpec, measure

    figures = {}
    for caching in (False, True):
        spec = BenchSpec(
            cp_size=1,
            requests=6,
            prompt_len=80,
            new_tokens=4,
            max_num_tokens=96,  # one prompt a step: the later ones find the cached pages
            dtype="float32",
            device="cpu",
            model=MODEL,
            prefix_caching=caching,
            shared_prefix_len=64,
            system_prompts=2,
        )
        figures[caching] = measure(spec, single_run=True)
    assert figures[False]["prefix_cache_queries"] == figures[False]["prefix_cache_hits"] == 0
    assert figures[True]["prefix_cache_hits"] > 0
    # every hit token is one the forward did not run (a roomy pool: no recompute)
    saved = figures[False]["tokens_run"] - figures[True]["tokens_run"]
    assert saved == figures[True]["prefix_cache_hits"]


def _hf_burst(tmp_path, family: str):
    """A tiny checkpoint of ``family`` saved by transformers, the burst's prompts in its
    vocabulary and transformers' greedy tokens and logits for them."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from helix_kv.executor.hf_oracle import hf_greedy, save_tiny_checkpoint

    path = save_tiny_checkpoint(family, tmp_path / family, seed=11)
    burst = burst_prompts(vocab=128)
    return path, burst, hf_greedy(path, burst, MAX_NEW)


def _check_burst(result: RunResult, burst: dict[int, list[int]], oracle, cp: int) -> None:
    from helix_kv.executor.hf_oracle import first_divergence

    expected_hits = burst_hits(burst, 4 * cp)
    assert result.metrics["prefix_cache_same_step_hits"] == expected_hits > 0
    for rid, tokens in oracle.tokens.items():
        problem = first_divergence(result.outputs[rid], tokens, oracle.logits[rid], 1e-5)
        assert problem is None, f"request {rid}: {problem}"


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("cp", [1, 2])
def test_a_burst_matches_transformers_generate(tmp_path, cp, family):
    """Tiny models saved by transformers (GQA, and MLA: one latent KV per token): the burst
    shares its system prompt in its first step, plain and one step ahead, on the general path
    (every entry's KV written to the pool before any entry's attention, layer by layer), and
    the greedy tokens equal transformers' ``generate``."""
    path, burst, oracle = _hf_burst(tmp_path, family)
    jobs = [
        (
            burst,
            MAX_NEW,
            config(cp, 1024, 0, mode == "overlap", True, max_num_tokens=BURST_TOKENS).with_(
                model=str(path)
            ),
        )
        for mode in MODES
    ]
    if cp == 1:
        per_job = [[run_rank(*j)] for j in jobs]
    else:
        per_job = run_group(jobs, cp, backend="gloo", timeout_s=300)
    for ranks in per_job:
        _check_burst(ranks[0], burst, oracle, cp)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_a_burst_with_the_decode_kernels_matches_transformers_generate(tmp_path, family):
    """The burst with ``decode_kernel`` one step ahead: its decodes through the Triton paged
    kernels (GQA, and MLA over the latent) planned once a step and run per layer after the
    layer's KV write, decode-only steps on the fast path; the tokens still equal
    transformers'. CUDA tensors where there is a GPU, else Triton's interpreter on the CPU
    (``tests/executor/devices.py``)."""
    from .devices import run_fast_path

    path, burst, oracle = _hf_burst(tmp_path, family)
    job = config(1, 1024, 0, True, True, max_num_tokens=BURST_TOKENS).with_(
        model=str(path), decode_kernel=True
    )
    (result,) = run_fast_path([(burst, MAX_NEW, job)], 1)
    assert result.fast_path_steps > 0
    _check_burst(result, burst, oracle, 1)
