"""Reference Helix executor: torch KV pool, Helix attention and a tiny transformer.

This subpackage imports torch; ``import helix_kv`` never imports it. Import it explicitly::

    from helix_kv.executor import KVPool, TinyTransformer
    from helix_kv.executor.runner import ExecutorConfig, run_group, run_rank
"""

from helix_kv._needs_torch import require_torch

require_torch("helix_kv.executor")

from helix_kv.executor.attention import (
    PAD_KEY_POSITION,
    PAD_QUERY_POSITION,
    PartialAttention,
    all_gather_combine,
    combine_partial_list,
    combine_partials,
    partial_attention,
    reference_attention,
)
from helix_kv.executor.decode_step import (
    DecodeLayout,
    DecodeMetadata,
    DecodeStep,
    StagingBufferBusy,
)
from helix_kv.executor.drafter import NgramDrafter, greedy_acceptance
from helix_kv.executor.host_pool import HostKVPool
from helix_kv.executor.kv_pool import AttentionGroup, KVPool, StepBatch
from helix_kv.executor.model import DecodeRows, TinyConfig, TinyTransformer, group_combine
from helix_kv.executor.paged_attention import (
    DecodeAttentionPlan,
    MLADecodeAttentionPlan,
    paged_decode_attention,
    paged_mla_decode_attention,
    write_paged_kv,
)
from helix_kv.executor.placement import RankPlacement
from helix_kv.executor.step_plan import StepPlan

__all__ = [
    "PAD_KEY_POSITION",
    "PAD_QUERY_POSITION",
    "AttentionGroup",
    "DecodeAttentionPlan",
    "DecodeLayout",
    "DecodeMetadata",
    "DecodeRows",
    "DecodeStep",
    "HostKVPool",
    "KVPool",
    "MLADecodeAttentionPlan",
    "NgramDrafter",
    "PartialAttention",
    "RankPlacement",
    "StagingBufferBusy",
    "StepBatch",
    "StepPlan",
    "TinyConfig",
    "TinyTransformer",
    "all_gather_combine",
    "combine_partial_list",
    "combine_partials",
    "greedy_acceptance",
    "group_combine",
    "paged_decode_attention",
    "paged_mla_decode_attention",
    "partial_attention",
    "reference_attention",
    "write_paged_kv",
]
