"""Side by side: vLLM v1's scheduler and helix_kv's, one decode step each, on the host.

Per step, with N requests all decoding: vLLM ``Scheduler.schedule()`` +
``update_from_output()`` (one sampled token per request) against helix_kv ``schedule()`` +
``update()`` at cp = 4 (the loop of ``bench_scheduler.py``, kept in ``scheduler_loops.py``), and
helix_kv plus the one call that writes the step's decode rows for the kernel
(``write_decode_rows``). Both run in this one process, one after the other, so they share the
machine's state.

With ``--prefix-caching`` both run with prefix caching on (distinct prompts, so the step
cost is the cache's bookkeeping alone), and a shared-prefix workload then reports the two
hit rates side by side: the same token streams (requests sharing a system prompt, admitted a
few at a time) through both schedulers, their prompt-token hit rates from their own counters
(vLLM's ``PrefixCacheStats``, helix_kv's ``prefix_cache_hits / prefix_cache_queries``).

vLLM is not a dependency of helix_kv: install it in a separate environment together with
helix_kv (``pip install vllm`` then ``pip install --no-deps <helix_kv wheel>``) and run
``python benches/vllm_compare.py [--prefix-caching] [N ...]``. vLLM's ``ModelConfig`` reads a
Hugging Face config; a small OPT-shaped ``config.json`` is written to a temporary directory,
so nothing is downloaded. vLLM's scheduler touches no model weights and no GPU here.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = 100
ROUNDS = 200
BLOCK_SIZE = 16

OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 8192,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
}


def vllm_configs(
    n: int,
    model_dir: str,
    prefix_caching: bool = False,
    *,
    num_speculative_tokens: int | None = None,
    blocks: int | None = None,
) -> tuple[Any, Any]:
    """vLLM's engine configuration and KV cache configuration of a scheduler for ``n``
    running requests of ``PROMPT`` tokens (by default room for ``ROUNDS`` decodes each and
    more), with an n-gram drafter proposing ``num_speculative_tokens`` when given."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0)
    sched = SchedulerConfig(
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n * PROMPT),
        max_model_len=8192,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    speculative = None
    if num_speculative_tokens:
        speculative = SpeculativeConfig(
            model="ngram", num_speculative_tokens=num_speculative_tokens
        )
    config = VllmConfig(
        scheduler_config=sched,
        model_config=model,
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        speculative_config=speculative,
    )
    if blocks is None:
        blocks = n * (PROMPT + ROUNDS + 64) // BLOCK_SIZE + n + 16
    cache.num_gpu_blocks = blocks
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    kv = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return config, kv


def vllm_scheduler(
    n: int,
    model_dir: str,
    prefix_caching: bool = False,
    prompts: list[list[int]] | None = None,
    *,
    scheduler_cls: Any = None,
    num_speculative_tokens: int | None = None,
    blocks: int | None = None,
    log_stats: bool | None = None,
) -> Any:
    """vLLM's own scheduler (or ``scheduler_cls``, built as vLLM's engine core builds it)
    with ``n`` requests added, or none when ``prompts`` is given; statistics on when
    ``log_stats`` (default: for the hit-rate workload)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config, kv = vllm_configs(
        n, model_dir, prefix_caching, num_speculative_tokens=num_speculative_tokens, blocks=blocks
    )
    scheduler = (scheduler_cls or Scheduler)(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=prompts is not None if log_stats is None else log_stats,
    )
    if prompts is not None:
        return scheduler
    for i in range(n):
        # With caching on, each prompt is its own (no hits), as in helix_kv's loop.
        prompt = [t + PROMPT * i for t in range(PROMPT)] if prefix_caching else list(range(PROMPT))
        vllm_add(scheduler, str(i), prompt, 1_000_000)
    return scheduler


def vllm_add(scheduler: Any, request_id: str, prompt: list[int], max_tokens: int) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(
        Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=vllm_block_hasher(scheduler),
        )
    )


def vllm_block_hasher(scheduler: Any) -> Any:
    """The block hasher vLLM's engine core gives each request when prefix caching is on (its
    default hash, SHA-256 over CBOR), built once per scheduler; ``None`` when caching is off."""
    if not scheduler.cache_config.enable_prefix_caching:
        return None
    hasher = getattr(scheduler, "_bench_block_hasher", None)
    if hasher is None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        scheduler._bench_block_hasher = hasher
    return hasher


def vllm_step(scheduler: Any, stats: list[Any] | None = None) -> int:
    """One step, each scheduled request sampling token 7. With ``stats``, the scheduler's
    stats of the step (``update_from_output`` makes them, and resets the counters) are
    appended to it."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=[[7]] * len(ids),
    )
    outputs = scheduler.update_from_output(out, runner_output)
    if stats is not None:
        stats.extend(o.scheduler_stats for o in outputs.values() if o.scheduler_stats is not None)
    return len(ids)


#: The shared-prefix workload of the hit-rate comparison: requests of a 1024-token system
#: prompt plus their own 64 tokens, 8 tokens out each, admitted 4 a step.
SHARED_REQUESTS, SHARED_SYSTEM, SHARED_OWN, SHARED_OUT, SHARED_PER_STEP = 64, 1024, 64, 8, 4


def shared_prompts() -> list[list[int]]:
    system = [(7 * t) % 50_000 for t in range(SHARED_SYSTEM)]
    return [
        system + [10_000 + 100 * i + t for t in range(SHARED_OWN)] for i in range(SHARED_REQUESTS)
    ]


def vllm_hit_rate(model_dir: str) -> float:
    scheduler = vllm_scheduler(SHARED_REQUESTS, model_dir, prefix_caching=True, prompts=[])
    queries = hits = 0
    prompts = shared_prompts()
    for step in range(10_000):
        for i in range(step * SHARED_PER_STEP, min((step + 1) * SHARED_PER_STEP, len(prompts))):
            vllm_add(scheduler, str(i), prompts[i], SHARED_OUT)
        stats: list[Any] = []
        vllm_step(scheduler, stats)
        for step_stats in stats:
            cache_stats = step_stats.prefix_cache_stats
            if cache_stats is not None:
                queries += cache_stats.queries
                hits += cache_stats.hits
        if (step + 1) * SHARED_PER_STEP >= len(prompts) and not scheduler.has_unfinished_requests():
            break
    return hits / queries if queries else 0.0


def helix_hit_rate() -> float:
    import numpy as np

    import helix_kv

    config = helix_kv.SchedulerConfig(
        cp_size=4, tokens_per_block=BLOCK_SIZE // 4, kv_superblocks=4096,
        max_num_tokens=8192, enable_prefix_caching=True,
    )  # fmt: skip
    scheduler = helix_kv.Scheduler(config)
    prompts = shared_prompts()
    for step in range(10_000):
        for i in range(step * SHARED_PER_STEP, min((step + 1) * SHARED_PER_STEP, len(prompts))):
            scheduler.add_request(i, np.array(prompts[i], dtype=np.int32), SHARED_OUT)
        out = scheduler.schedule()
        for request_id in scheduler.update(np.full(out.num_samples, 7, np.int32)).tolist():
            scheduler.take_output(request_id)
        if (step + 1) * SHARED_PER_STEP >= len(prompts) and not scheduler.has_unfinished():
            break
    metrics = scheduler.metrics()
    return metrics.prefix_cache_hits / max(metrics.prefix_cache_queries, 1)


def timed(step: Any, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def measure_vllm(n: int, model_dir: str, prefix_caching: bool = False) -> float:
    scheduler = vllm_scheduler(n, model_dir, prefix_caching)
    while vllm_step(scheduler) and any(r.num_computed_tokens < PROMPT for r in scheduler.running):
        pass
    assert len(scheduler.running) == n, "every request must be decoding"
    timed(lambda: vllm_step(scheduler), 5)
    return statistics.median(timed(lambda: vllm_step(scheduler), ROUNDS // 4))


def measure_helix(n: int, with_metadata: bool, prefix_caching: bool = False) -> float:
    spec = importlib.util.spec_from_file_location(
        "scheduler_loops", Path(__file__).with_name("scheduler_loops.py")
    )
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    loop = bench.Loop(n, superblocks=n * 16, max_new=100_000, prefix_caching=prefix_caching)
    loop.prefill()
    if not with_metadata:
        timed(loop.step, 20)
        return statistics.median(timed(loop.step, ROUNDS))
    import numpy as np

    import helix_kv

    # The fast path's rows: the fixed columns, then a block table wide enough for the run.
    width = len(helix_kv.DECODE_ROW_COLUMNS) - 1 + 16
    buffer = np.zeros((n, width), dtype=np.int32)

    def step() -> None:
        out = loop.s.schedule()
        loop.s.write_decode_rows(out, buffer)
        loop.s.update(loop.tokens[: out.num_samples])

    timed(step, 20)
    return statistics.median(timed(step, ROUNDS))


def main(argv: list[str]) -> None:
    caching = "--prefix-caching" in argv
    sizes = [int(a) for a in argv if a != "--prefix-caching"] or [1024, 4096]
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(OPT_CONFIG))
        if caching:
            print(
                f"prefix caching on in both; hit rate (prompt tokens) on {SHARED_REQUESTS} "
                f"requests sharing a {SHARED_SYSTEM}-token system prompt: vLLM v1 "
                f"{vllm_hit_rate(model_dir):.1%}, helix_kv {helix_hit_rate():.1%}"
            )
        print("| N decodes | vLLM v1 | helix_kv | ratio | helix_kv + decode rows | ratio |")
        print("|---|---|---|---|---|---|")
        for n in sizes:
            v = measure_vllm(n, model_dir, caching)
            h = measure_helix(n, with_metadata=False, prefix_caching=caching)
            m = measure_helix(n, with_metadata=True, prefix_caching=caching)
            print(
                f"| {n} | {v * 1e6:,.0f} us | {h * 1e6:.1f} us | {v / h:,.0f}x "
                f"| {m * 1e6:.1f} us | {v / m:,.0f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
