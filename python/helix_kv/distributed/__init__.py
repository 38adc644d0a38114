"""helix_kv over torch.distributed: build a CP rank's scheduler in agreement with its group.

This subpackage imports torch; ``import helix_kv`` never imports it. A serving executor embeds
helix_kv in a few lines::

    import torch.distributed as dist
    from helix_kv.distributed import EngineConfig, HelixKVRank

    dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    config = EngineConfig(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                          tokens_per_block=32, max_batch_size=64)
    rank = HelixKVRank.create(config, kv_budget_bytes=free_bytes)   # world group = CP group
    out = rank.schedule(); ...; rank.update(tokens)

See ``docs/distributed.md``: quota and configuration sync, init-status sync, the
``HELIX_KV_CHECK_SCHEDULE`` schedule check and the configuration guards.
"""

from helix_kv._needs_torch import require_torch

require_torch("helix_kv.distributed")

from helix_kv.distributed.check import ScheduleChecker
from helix_kv.distributed.config import (
    CHECK_SCHEDULE_ENV,
    EngineConfig,
    check_config_guards,
    group_fields,
    host_tier_superblocks,
    schedule_check_requested,
    superblocks_for_budget,
)
from helix_kv.distributed.rank import HelixKVRank
from helix_kv.errors import (
    InitSyncConfigError,
    InitSyncConfigGuardError,
    InitSyncConfigMismatchError,
)

__all__ = [
    "CHECK_SCHEDULE_ENV",
    "EngineConfig",
    "HelixKVRank",
    "InitSyncConfigError",
    "InitSyncConfigGuardError",
    "InitSyncConfigMismatchError",
    "ScheduleChecker",
    "check_config_guards",
    "group_fields",
    "host_tier_superblocks",
    "schedule_check_requested",
    "superblocks_for_budget",
]
