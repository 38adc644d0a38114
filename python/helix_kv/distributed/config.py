"""The engine-side configuration of one CP rank, its KV budget arithmetic and the guards.

Nothing here talks to other ranks: :mod:`helix_kv.distributed.rank` runs these checks on every
rank and then agrees on the outcome with the group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from helix_kv._core import SchedulerConfig
from helix_kv.errors import ConfigError, ConfigGuardError
from helix_kv.types import (
    AdmissionPolicy,
    CapacityPolicy,
    ServingMode,
    SuspendPolicy,
    VictimPolicy,
)

logger = logging.getLogger("helix_kv")

#: Set to ``1`` on every rank to compare the ranks' schedules each step.
CHECK_SCHEDULE_ENV = "HELIX_KV_CHECK_SCHEDULE"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

#: The scheduler's defaults (the core's), which EngineConfig's scheduler fields take.
_DEFAULTS = SchedulerConfig.DEFAULTS

#: SchedulerConfig keywords an EngineConfig does not give: the process group fixes
#: ``cp_size`` and ``cp_rank``, the host cache bytes fix the host tier.
_NOT_ENGINE_FIELDS = ("cp_size", "cp_rank", "host_tier_superblocks")

#: EngineConfig fields handed to :class:`helix_kv.SchedulerConfig` unchanged: every field the
#: core declares (``SchedulerConfig.FIELDS``) but the KV pool and those above, in its order.
#: EngineConfig declares each below (type checkers need them written out);
#: tests/binding/test_config_fields.py holds them to the core's list, type and default.
SCHEDULER_FIELDS = tuple(
    field.name
    for field in SchedulerConfig.FIELDS
    if not field.required and field.name not in _NOT_ENGINE_FIELDS
)


@dataclass(frozen=True)
class EngineConfig:
    """What a serving engine knows about one CP rank's KV cache and scheduler.

    Must be the same on every rank of the group (the KV byte budget, which may differ, is
    passed separately to :meth:`HelixKVRank.create <helix_kv.distributed.HelixKVRank.create>`).

    Scheduler fields: as :class:`helix_kv.SchedulerConfig`, with its defaults
    (``SchedulerConfig.DEFAULTS``); ``cp_size``, ``cp_rank`` and the capacity come from the
    process group and the KV budget.

    KV geometry (what one token costs on one rank): ``num_layers`` x ``kv_factor`` (2 for K
    and V, 1 for a latent cache such as MLA) x ``num_kv_heads`` (KV heads stored on this rank,
    after any tensor-parallel split) x ``head_dim`` x ``dtype_bytes``.

    Serving options the guards look at:
        host_cache_bytes: a host-memory KV tier. ``None`` (not configured) lets the engine
            default apply: a host tier as large as the GPU budget for ``non_helix`` (and for
            aggregated Helix with ``aggregated_host_tier``), none under aggregated Helix
            otherwise (skipped, logged at info) or for disaggregated generation.
        aggregated_host_tier: accept helix_kv's own host tier under aggregated Helix (a
            mirrored host ledger: each rank's host bytes become whole host pages and the group
            takes the minimum). Off: the old behaviour (a host tier is rejected there).
        disk_cache_bytes: a disk KV tier (the engine's; ``0`` = none).
        kv_connector: name of a KV connector that loads/offloads pages outside the scheduler.
        kv_pool_rebalance: whether the engine may resize the KV pool at run time.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    kv_factor: int = 2

    tokens_per_block: int = _DEFAULTS["tokens_per_block"]
    max_batch_size: int = _DEFAULTS["max_batch_size"]
    max_num_tokens: int = _DEFAULTS["max_num_tokens"]
    enable_chunked_prefill: bool = _DEFAULTS["enable_chunked_prefill"]
    chunk_unit: int | None = _DEFAULTS["chunk_unit"]
    long_prefill_token_threshold: int = _DEFAULTS["long_prefill_token_threshold"]
    long_prefill_token_threshold_adaptive: bool = _DEFAULTS["long_prefill_token_threshold_adaptive"]
    max_seq_len: int = _DEFAULTS["max_seq_len"]
    capacity_policy: CapacityPolicy = _DEFAULTS["capacity_policy"]
    serving_mode: ServingMode = _DEFAULTS["serving_mode"]
    suspend_policy: SuspendPolicy = _DEFAULTS["suspend_policy"]
    suspend_cost_per_token: int = _DEFAULTS["suspend_cost_per_token"]
    recompute_cost_per_token: int = _DEFAULTS["recompute_cost_per_token"]
    admission_policy: AdmissionPolicy = _DEFAULTS["admission_policy"]
    victim_policy: VictimPolicy = _DEFAULTS["victim_policy"]
    max_preemptions_per_request: int = _DEFAULTS["max_preemptions_per_request"]
    admit_after_preemption: bool = _DEFAULTS["admit_after_preemption"]
    deadlock_steps: int = _DEFAULTS["deadlock_steps"]
    enable_prefix_caching: bool = _DEFAULTS["enable_prefix_caching"]
    num_speculative_tokens: int = _DEFAULTS["num_speculative_tokens"]
    draft_backoff_misses: int = _DEFAULTS["draft_backoff_misses"]
    draft_backoff_tokens: int = _DEFAULTS["draft_backoff_tokens"]

    host_cache_bytes: int | None = None
    aggregated_host_tier: bool = False
    disk_cache_bytes: int = 0
    kv_connector: str | None = None
    kv_pool_rebalance: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "tokens_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"EngineConfig.{name} = {value!r} must be an integer >= 1",
                    field=name,
                    value=value,
                )
        if self.kv_factor not in (1, 2):
            raise ConfigError(
                f"EngineConfig.kv_factor = {self.kv_factor!r} must be 2 (separate K and V) "
                "or 1 (one latent vector per token, e.g. MLA)",
                field="kv_factor",
                value=self.kv_factor,
            )
        for name in ("host_cache_bytes", "disk_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(
                    f"EngineConfig.{name} = {value!r} must be an integer", field=name, value=value
                )
            if value is not None and value < 0:
                raise ConfigError(
                    f"EngineConfig.{name} = {value} must be >= 0", field=name, value=value
                )
        if self.kv_connector is not None and not (
            isinstance(self.kv_connector, str) and self.kv_connector
        ):
            raise ConfigError(
                f"EngineConfig.kv_connector = {self.kv_connector!r} must be a connector name "
                "or None",
                field="kv_connector",
                value=self.kv_connector,
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EngineConfig:
        """Builds a config from a mapping, naming any unknown key."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown EngineConfig field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}",
                field=unknown[0],
                value=values[unknown[0]],
            )
        return cls(**values)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token costs on the rank that holds it."""
        return (
            self.num_layers * self.kv_factor * self.num_kv_heads * self.head_dim * self.dtype_bytes
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one physical KV page (``tokens_per_block`` tokens) on one rank."""
        return self.tokens_per_block * self.bytes_per_token

    def scheduler_kwargs(self) -> dict[str, Any]:
        """The :class:`helix_kv.SchedulerConfig` keyword arguments this config fixes."""
        return {name: getattr(self, name) for name in SCHEDULER_FIELDS}


def group_fields(config: EngineConfig, scheduler_config: Any) -> tuple[tuple[str, Any], ...]:
    """Every ``(field, value)`` the ranks of a CP group must agree on, in a fixed order.

    First ``scheduler_config.decision_fields()`` (the Rust core's one list of the fields that
    can change a decision or a placement; ``cp_rank`` is not among them) less
    ``capacity_superblocks``, which the quota sync agrees on as the group's minimum; then
    every :class:`EngineConfig` field that is not handed to the scheduler: the KV geometry
    (``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype_bytes``, ``kv_factor``: the shape
    of each rank's KV pool) and the tier, connector and rebalance options.
    ``host_tier_superblocks`` is left out too, and so is ``host_cache_bytes`` when it sizes
    helix_kv's own host tier (aggregated Helix with ``aggregated_host_tier``): like the KV
    budget, each rank's host budget may differ, and the quota sync agrees on the minimum of
    the host pages they hold. A disaggregated server's host tier is the engine's and must
    match.
    """
    own_host_tier = config.serving_mode == "aggregated_helix" and config.aggregated_host_tier
    per_rank = ("host_cache_bytes",) if own_host_tier else ()
    agreed_by_quota = ("capacity_superblocks", "host_tier_superblocks")
    fields = [pair for pair in scheduler_config.decision_fields() if pair[0] not in agreed_by_quota]
    fields += [
        (field.name, getattr(config, field.name))
        for field in dataclasses.fields(config)
        if field.name not in SCHEDULER_FIELDS and field.name not in per_rank
    ]
    return tuple(fields)


def superblocks_for_budget(config: EngineConfig, kv_budget_bytes: int) -> int:
    """Whole physical pages that fit in one rank's KV byte budget.

    A superblock is one page on every rank, so a rank's page count is the number of
    superblocks it can hold. Raises :class:`~helix_kv.ConfigError` if not even one page fits.
    """
    if isinstance(kv_budget_bytes, bool) or not isinstance(kv_budget_bytes, int):
        raise ConfigError(
            f"kv_budget_bytes = {kv_budget_bytes!r} must be an integer",
            field="kv_budget_bytes",
            value=kv_budget_bytes,
        )
    pages = kv_budget_bytes // config.page_bytes
    if pages < 1:
        raise ConfigError(
            f"kv_budget_bytes = {kv_budget_bytes} holds no KV page: one page is "
            f"{config.page_bytes} bytes (tokens_per_block {config.tokens_per_block} x "
            f"{config.bytes_per_token} bytes per token); raise the KV budget or lower "
            "tokens_per_block",
            field="kv_budget_bytes",
            value=kv_budget_bytes,
        )
    return min(pages, 2**32 - 1)


def check_config_guards(config: EngineConfig, cp_size: int) -> None:
    """Rejects serving options that would break rank invariance.

    Under aggregated Helix the superblock ledger must look the same on every rank, so foreign
    host/disk tiers, KV connectors and KV-pool rebalance are rejected; helix_kv's own host tier
    (a mirrored host ledger) is accepted when ``aggregated_host_tier`` is on. Any CP group
    (``cp_size > 1``) rejects rebalance. Every violated guard is
    listed in one :class:`~helix_kv.ConfigGuardError`, each with why and what to do instead.
    Non-Helix and disaggregated configurations keep the tiers and connectors.
    """
    aggregated = config.serving_mode == "aggregated_helix"
    problems = []
    if aggregated and config.host_cache_bytes and not config.aggregated_host_tier:
        problems.append(
            f"host_cache_bytes = {config.host_cache_bytes}: an engine host KV tier is rejected "
            "under aggregated Helix. An engine's own tier offloads and restores pages by per-rank "
            "free counts and utilisation, which differ between ranks and break rank-invariant "
            "scheduling; under KV pressure helix_kv recompute-pauses instead. Set "
            "aggregated_host_tier = True to use helix_kv's host tier (a mirrored host ledger "
            "every rank decides from alike), or set host_cache_bytes to None or 0."
        )
    if aggregated and config.disk_cache_bytes:
        problems.append(
            f"disk_cache_bytes = {config.disk_cache_bytes}: a disk KV tier is rejected under "
            "aggregated Helix: the engine's disk tier offloads and brings pages back by per-rank "
            "state the mirrored ledger does not see (helix_kv's mirrored tier is host memory "
            "only). Set disk_cache_bytes = 0; use aggregated_host_tier with host_cache_bytes, "
            "or raise the GPU KV budget."
        )
    if aggregated and config.kv_connector is not None:
        problems.append(
            f"kv_connector = {config.kv_connector!r}: KV connectors are rejected under aggregated "
            "Helix. A connector loads and offloads pages outside the scheduler, which changes one "
            "rank's capacity and contents behind a ledger that must be identical on every rank. "
            "Remove kv_connector; to move KV between servers, serve the decode side with "
            "serving_mode='disaggregated_generation'."
        )
    if config.kv_pool_rebalance and (aggregated or cp_size > 1):
        where = "aggregated Helix" if aggregated else f"Helix (cp_size = {cp_size})"
        problems.append(
            f"kv_pool_rebalance = True: KV-pool rebalance is rejected under {where}. It resizes "
            "a rank's pool at run time, while the superblock ledger needs the same capacity on "
            "every rank, fixed at construction when the group agrees on the smallest budget. "
            "Set kv_pool_rebalance = False and size the pool with kv_budget_bytes."
        )
    if problems:
        raise ConfigGuardError("\n".join(problems))


def host_tier_superblocks(config: EngineConfig, kv_budget_bytes: int) -> int:
    """This rank's host-tier superblocks: its host byte budget in whole host pages (after
    :func:`check_config_guards`). A CP group takes the minimum over its ranks
    (:meth:`helix_kv.distributed.sync.GroupSync.agree_quota`).

    ``non_helix`` suspends to a host tier; so does aggregated Helix with
    ``aggregated_host_tier`` (helix_kv's mirrored host ledger). An unset ``host_cache_bytes``
    provisions one as large as the GPU budget there (logged at info under aggregated Helix);
    without ``aggregated_host_tier`` the automatic tier is skipped under aggregated Helix
    (logged at info). A disaggregated generation server never suspends: a host tier it
    configures is left to the engine and the scheduler gets none.
    """
    aggregated = config.serving_mode == "aggregated_helix"
    if config.serving_mode == "non_helix" or (aggregated and config.aggregated_host_tier):
        host_bytes = kv_budget_bytes if config.host_cache_bytes is None else config.host_cache_bytes
        pages = min(host_bytes // config.page_bytes, 2**31 - 1)
        if aggregated and config.host_cache_bytes is None:
            logger.info(
                "aggregated Helix: automatic host KV tier of %d bytes = %d host pages per rank "
                "(as large as the GPU budget; the group takes the smallest rank's)",
                host_bytes, pages,
            )  # fmt: skip
        return pages
    if aggregated and config.host_cache_bytes is None:
        logger.info(
            "aggregated Helix: automatic host KV tier skipped (aggregated_host_tier is off; "
            "under KV pressure requests are recompute-paused, not suspended)"
        )
    return 0


def schedule_check_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`CHECK_SCHEDULE_ENV` asks for the per-step schedule check."""
    value = (os.environ if environ is None else environ).get(CHECK_SCHEDULE_ENV, "")
    normalized = value.strip().lower()
    if normalized in _TRUE:
        return True
    if normalized in _FALSE:
        return False
    raise ConfigError(
        f"{CHECK_SCHEDULE_ENV} = {value!r} is not understood; set it to 1 (check every step) "
        "or 0 (off) on every rank",
        field=CHECK_SCHEDULE_ENV,
        value=value,
    )
