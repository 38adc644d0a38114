"""Scenarios every rank of a test group runs (module-level so spawned ranks can import them).

Each takes ``(rank, world, backend)``, runs collectively on the default (world) group and
returns what the parent test asserts on. Expected errors are caught and described, never
re-raised: a scenario that raises has failed.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Callable, NamedTuple

import numpy as np

import helix_kv
from helix_kv.distributed import EngineConfig, HelixKVRank
from helix_kv.simulate.tokens import prompt_tokens, sampled_tokens

TOKENS_PER_BLOCK = 4
#: Pool of the pressured runs, in global tokens (the superblock count depends on cp).
PRESSURE_KV_TOKENS = 96


def engine_config(**changes: Any) -> EngineConfig:
    """A tiny model: 512-byte pages (4 tokens x 2 layers x K,V x 2 heads x 8 dims x 2 bytes)."""
    values: dict[str, Any] = dict(
        num_layers=2, num_kv_heads=2, head_dim=8, dtype_bytes=2,
        tokens_per_block=TOKENS_PER_BLOCK, max_batch_size=8, max_num_tokens=64,
        max_seq_len=256, deadlock_steps=32,
    )  # fmt: skip
    values.update(changes)
    return EngineConfig(**values)


PAGE_BYTES = engine_config().page_bytes


def describe(exc: BaseException, started: float) -> dict[str, Any]:
    """What the parent needs to know about an expected error."""
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "is_init_sync": isinstance(exc, helix_kv.InitSyncError),
        "is_guard": isinstance(exc, helix_kv.ConfigGuardError),
        "is_config": isinstance(exc, helix_kv.ConfigError),
        "is_mismatch": isinstance(exc, helix_kv.ScheduleMismatchError),
        "is_config_mismatch": isinstance(exc, helix_kv.ConfigMismatchError),
        "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None,
        "failed_ranks": getattr(exc, "failed_ranks", None),
        "ranks": getattr(exc, "ranks", None),
        "fields": getattr(exc, "fields", None),
        "step": getattr(exc, "step", None),
        "seconds": time.monotonic() - started,
    }


def attempt(build: Callable[[], Any]) -> dict[str, Any]:
    """Runs ``build``; ``{"ok": True, ...}`` or the description of what it raised."""
    started = time.monotonic()
    try:
        built = build()
    except helix_kv.HelixKVError as exc:
        return {"ok": False, **describe(exc, started)}
    return {"ok": True, "built": built, "seconds": time.monotonic() - started}


class LogCapture(logging.Handler):
    """Collects ``helix_kv`` log records (INFO and up) while in a ``with`` block."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> LogCapture:
        logger = logging.getLogger("helix_kv")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logger = logging.getLogger("helix_kv")
        logger.removeHandler(self)
        logger.setLevel(self._level)


# --- quota sync -----------------------------------------------------------------------------


def quota_budget(rank: int) -> int:
    """Different budgets per rank, none a whole number of pages; the last rank is smallest."""
    return PAGE_BYTES * (40 - 3 * rank) + 7 * rank + 5


def scenario_quota(rank: int, world: int, backend: str) -> dict[str, Any]:
    shapes: list[int] = []

    def allocate(built: HelixKVRank) -> str:
        shapes.append(built.capacity_superblocks)
        return f"pool of {built.capacity_superblocks} pages"

    with LogCapture() as logs:
        built = HelixKVRank.create(engine_config(), quota_budget(rank), allocate=allocate)
    return {
        "capacity": built.capacity_superblocks,
        "capacity_tokens": built.capacity_tokens,
        "scheduler_capacity": built.scheduler_config.capacity_superblocks,
        "local": built.local_superblocks,
        "cp_rank": built.cp_rank,
        "cp_size": built.cp_size,
        "fingerprint": built.scheduler_config.fingerprint,
        "allocated_for": shapes,
        "kv_storage": built.kv_storage,
        "logs": logs.messages,
    }


# --- init-status sync -----------------------------------------------------------------------


def scenario_init_failure(rank: int, world: int, backend: str) -> dict[str, Any]:
    """The KV allocation fails on the last rank only (after the quota sync)."""

    def allocate(built: HelixKVRank) -> None:
        if built.cp_rank == world - 1:
            raise RuntimeError(
                f"injected: CUDA out of memory allocating the KV pool on rank {rank}"
            )

    result = attempt(
        lambda: HelixKVRank.create(engine_config(), 64 * PAGE_BYTES, allocate=allocate)
    )
    result.pop("built", None)
    return result


def scenario_init_failures_mixed(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Rank 0's budget holds no page; the last rank alone sets a host tier (a guard)."""
    budget = PAGE_BYTES // 2 if rank == 0 else 64 * PAGE_BYTES
    config = engine_config(host_cache_bytes=1 << 20) if rank == world - 1 else engine_config()
    result = attempt(lambda: HelixKVRank.create(config, budget))
    result.pop("built", None)
    return result


def scenario_init_failure_budget(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Only rank 1's budget is too small: a config error on one rank stops every rank."""
    budget = 100 if rank == 1 else 64 * PAGE_BYTES
    result = attempt(lambda: HelixKVRank.create(engine_config(), budget))
    result.pop("built", None)
    return result


def scenario_check_env_mismatch(rank: int, world: int, backend: str) -> dict[str, Any]:
    """HELIX_KV_CHECK_SCHEDULE set on rank 0 only: every rank refuses to start."""
    with env_var("HELIX_KV_CHECK_SCHEDULE", "1" if rank == 0 else None):
        result = attempt(lambda: HelixKVRank.create(engine_config(), 64 * PAGE_BYTES))
    result.pop("built", None)
    return result


def scenario_check_env_on(rank: int, world: int, backend: str) -> dict[str, Any]:
    with env_var("HELIX_KV_CHECK_SCHEDULE", "1"):
        built = HelixKVRank.create(engine_config(), 64 * PAGE_BYTES)
    return {"checker": built.checker is not None and built.checker.enabled}


# --- configuration agreement ----------------------------------------------------------------


class Mismatch(NamedTuple):
    """One class of field the ranks must agree on: ``changes`` on the differing ranks (on top
    of ``base`` on every rank) must be caught, naming ``field``."""

    field: str
    changes: dict[str, Any]
    base: dict[str, Any] | None = None


DISAGG = {"serving_mode": "disaggregated_generation"}

MISMATCHES: dict[str, Mismatch] = {
    "layout": Mismatch("tokens_per_block", {"tokens_per_block": 8}),
    "batch_limit": Mismatch("max_batch_size", {"max_batch_size": 16}),
    "token_limit": Mismatch("max_num_tokens", {"max_num_tokens": 128}),
    "seq_limit": Mismatch("max_seq_len", {"max_seq_len": 512}),
    # Compared as the unit in effect, so the base names it (None would mean tokens_per_block).
    "chunk_unit": Mismatch("chunk_unit", {"chunk_unit": 8}, {"chunk_unit": TOKENS_PER_BLOCK}),
    "chunking": Mismatch("enable_chunked_prefill", {"enable_chunked_prefill": False}),
    "victim_policy": Mismatch("victim_policy", {"victim_policy": "priority"}),
    "serving_mode": Mismatch("serving_mode", DISAGG),
    "capacity_policy": Mismatch("capacity_policy", {"capacity_policy": "guaranteed_no_evict"}),
    "preemption_bound": Mismatch("max_preemptions_per_request", {"max_preemptions_per_request": 2}),
    "admit_after_preemption": Mismatch("admit_after_preemption", {"admit_after_preemption": True}),
    "deadlock_steps": Mismatch("deadlock_steps", {"deadlock_steps": 8}),
    # Under aggregated Helix a host tier is a guard error; a disaggregated server keeps the
    # engine's, which must still be the same on every rank.
    "host_tier": Mismatch("host_cache_bytes", {"host_cache_bytes": 1 << 20}, DISAGG),
    "layers": Mismatch("num_layers", {"num_layers": 4}),
    "kv_heads": Mismatch("num_kv_heads", {"num_kv_heads": 1}),
    "head_dim": Mismatch("head_dim", {"head_dim": 16}),
    "dtype": Mismatch("dtype_bytes", {"dtype_bytes": 4}),
    "kv_factor": Mismatch("kv_factor", {"kv_factor": 1}),
}


class claimed_place:
    """Makes ``HelixKVRank.create`` in this process take ``(cp_rank, cp_size)`` for its place
    in the group: a stand-in for an engine that derived them wrongly."""

    def __init__(self, cp_rank: int, cp_size: int) -> None:
        self.place = (cp_rank, cp_size)

    def __enter__(self) -> None:
        import helix_kv.distributed.rank as module

        self.saved = module.resolve_group
        module.resolve_group = lambda group: (self.saved(group)[0], *self.place)

    def __exit__(self, *exc: Any) -> None:
        import helix_kv.distributed.rank as module

        module.resolve_group = self.saved


def create_mismatched(rank: int, differing: Sequence[int], mismatch: Mismatch) -> dict[str, Any]:
    changes = {**(mismatch.base or {}), **(mismatch.changes if rank in differing else {})}
    result = attempt(lambda: HelixKVRank.create(engine_config(**changes), 64 * PAGE_BYTES))
    result.pop("built", None)
    return result


def scenario_config_mismatch(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Each class of field differs on the last rank; then splits and misplaced ranks."""
    last = world - 1
    out = {name: create_mismatched(rank, [last], m) for name, m in MISMATCHES.items()}
    # Half the group differs from the other half (a tie: the half holding rank 0 agrees).
    upper = list(range(world // 2, world))
    out["split"] = create_mismatched(rank, upper, MISMATCHES["layout"])
    # Two fields differ on two different ranks.
    lone = {0: {"victim_policy": "priority"}, last: {"num_layers": 4}}.get(rank, {})
    out["two_ranks"] = attempt(lambda: HelixKVRank.create(engine_config(**lone), 64 * PAGE_BYTES))
    # The last rank takes rank 0's cp_rank (two owners for rank 0's tokens, none for its own);
    # then a cp_size that is not the group's size.
    with claimed_place(0 if rank == last else rank, world):
        out["cp_rank"] = attempt(lambda: HelixKVRank.create(engine_config(), 64 * PAGE_BYTES))
    with claimed_place(rank, world + 1 if rank == last else world):
        out["cp_size"] = attempt(lambda: HelixKVRank.create(engine_config(), 64 * PAGE_BYTES))
    # A check that fails on one rank still takes precedence: the guard is what it reports.
    guard = engine_config(kv_connector="nixl") if rank == last else engine_config(num_layers=4)
    out["failure_first"] = attempt(lambda: HelixKVRank.create(guard, 64 * PAGE_BYTES))
    # Still in step after all of that: an agreeing group builds.
    out["agreeing"] = attempt(lambda: HelixKVRank.create(engine_config(), 64 * PAGE_BYTES))
    for value in out.values():
        value.pop("built", None)
    return out


# --- failed init: checker inside the sync, pools released -----------------------------------


class KVPool:
    """Stands in for a KV pool allocation (weak-referenceable)."""

    def __init__(self, pages: int) -> None:
        self.pages = pages


def scenario_checker_failure(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Building the schedule checker fails on the last rank only: every rank raises through
    the init-status sync instead of peers running on (gloo) or waiting for it (NCCL)."""
    import helix_kv.distributed.rank as module

    saved = module.ScheduleChecker

    def broken(group: Any, **options: Any) -> Any:
        raise RuntimeError(f"injected: schedule checker construction failed on rank {rank}")

    if rank == world - 1:
        module.ScheduleChecker = broken  # type: ignore[assignment, misc]
    try:
        result = attempt(
            lambda: HelixKVRank.create(engine_config(), 64 * PAGE_BYTES, check_schedule=True)
        )
    finally:
        module.ScheduleChecker = saved  # type: ignore[misc]
    result.pop("built", None)
    return result


def scenario_retry_releases_pool(rank: int, world: int, backend: str) -> dict[str, Any]:
    """The KV allocation fails on the last rank (after allocating part of its pool); every
    rank retries inside its ``except`` block. No rank may hold the first pool by then."""
    refs: list[Any] = []

    def allocate(built: HelixKVRank) -> KVPool:
        pool = KVPool(built.capacity_superblocks)
        refs.append(weakref.ref(pool))
        if rank == world - 1 and len(refs) == 1:
            raise RuntimeError("injected: out of memory for the second half of the KV pool")
        return pool

    try:
        HelixKVRank.create(engine_config(), 64 * PAGE_BYTES, allocate=allocate)
    except helix_kv.InitSyncError as exc:
        first_alive_in_except = refs[0]() is not None
        retried = HelixKVRank.create(engine_config(), 64 * PAGE_BYTES, allocate=allocate)
        alive_after_retry = [ref() is not None for ref in refs]
        return {
            "raised": type(exc).__name__,
            "first_alive_in_except": first_alive_in_except,
            "alive_after_retry": alive_after_retry,
            "retry_holds_its_pool": retried.kv_storage is refs[-1](),
        }
    return {"raised": None}


# --- guards ---------------------------------------------------------------------------------

GUARDS: dict[str, dict[str, Any]] = {
    "host_tier": {"host_cache_bytes": 1 << 20},
    "disk_tier": {"disk_cache_bytes": 1 << 30},
    "kv_connector": {"kv_connector": "lmcache"},
    "kv_pool_rebalance": {"kv_pool_rebalance": True},
}


def scenario_guards(rank: int, world: int, backend: str) -> dict[str, Any]:
    budget = 64 * PAGE_BYTES
    out: dict[str, Any] = {}
    for name, option in GUARDS.items():
        out[f"reject/{name}"] = attempt(
            lambda o=option: HelixKVRank.create(engine_config(**o), budget)
        )
    # A guard tripped on one rank only (configs differ): every rank stops, naming that rank.
    lone = engine_config(kv_connector="nixl") if rank == 1 else engine_config()
    out["reject/one_rank"] = attempt(lambda: HelixKVRank.create(lone, budget))
    # Disaggregated Helix keeps tiers and connectors, but not rebalance (the ledger needs the
    # same capacity on every rank).
    disagg = {"serving_mode": "disaggregated_generation"}
    out["reject/disagg_rebalance"] = attempt(
        lambda: HelixKVRank.create(engine_config(**disagg, kv_pool_rebalance=True), budget)
    )
    allowed = engine_config(
        **disagg, host_cache_bytes=1 << 20, disk_cache_bytes=1 << 30, kv_connector="nixl"
    )
    out["allow/disagg_tiers_connector"] = attempt(lambda: HelixKVRank.create(allowed, budget))
    # helix_kv's own host tier under aggregated Helix: each rank's host bytes become host
    # pages and the group takes the smallest.
    own = engine_config(aggregated_host_tier=True, host_cache_bytes=8 * (rank + 1) * PAGE_BYTES)
    out["allow/aggregated_host_tier"] = attempt(lambda: HelixKVRank.create(own, budget))
    built = out["allow/aggregated_host_tier"].get("built")
    out["aggregated_host_tier_superblocks"] = built and built.host_tier_superblocks
    with LogCapture() as logs:
        out["allow/aggregated_default"] = attempt(
            lambda: HelixKVRank.create(engine_config(), budget)
        )
        auto = attempt(lambda: HelixKVRank.create(engine_config(aggregated_host_tier=True), budget))
    out["aggregated_auto_host_tier_superblocks"] = auto.get("built") and (
        auto["built"].host_tier_superblocks
    )
    out["auto_host_tier_logs"] = logs.messages
    for value in out.values():
        if isinstance(value, dict) and value.pop("built", None) is not None:
            value["built"] = True
    return out


# --- schedule check -------------------------------------------------------------------------


def pressured_rank(world: int, **changes: Any) -> HelixKVRank:
    superblocks = PRESSURE_KV_TOKENS // (TOKENS_PER_BLOCK * world)
    return HelixKVRank.create(
        engine_config(**changes), superblocks * PAGE_BYTES, check_schedule=True
    )


def add_workload(
    built: HelixKVRank,
    count: int = 16,
    priorities: dict[int, int] | None = None,
    shared_prefix: int = 0,
):
    """Requests that together need several times the pool: preemptions are certain. With
    ``shared_prefix``, every prompt opens with the same system prompt of that many tokens."""
    system = prompt_tokens(SYSTEM_PROMPT_ID, shared_prefix)
    for rid in range(count):
        length = 6 + (rid * 5) % 23
        new_tokens = 12 + (rid * 7) % 25
        prompt = np.concatenate([system, prompt_tokens(rid, length)])
        built.scheduler.add_request(rid, prompt, new_tokens, (priorities or {}).get(rid, 0))


#: The request id whose prompt tokens are the shared system prompt (no request uses it).
SYSTEM_PROMPT_ID = 2**40


#: Edits one step's sampled tokens before they are fed to ``update`` (a divergence).
Edit = Callable[[np.ndarray], np.ndarray]
#: End-of-sequence flags of one step: ``eos(sample_ids, tokens)``.
EosRule = Callable[[np.ndarray, np.ndarray], np.ndarray]


def sample_at_close(scheduler: Any, out: Any) -> np.ndarray:
    """The tokens of ``out``, the oldest pending step, sampled as it closes (the simulator's
    formula, :func:`tests.helpers.scheduler.sample`): every older step is closed by then, so
    a request's output index is the tokens it has generated. In overlap mode a request may
    have finished (by EOS) or been aborted while this step was pending; its entry here is
    dropped by the scheduler, so its token is a placeholder."""
    ids = np.asarray(out.sample_ids, dtype=np.uint64)
    generated = []
    for rid in ids.tolist():
        try:
            generated.append(scheduler.request_metrics(rid).generated_tokens)
        except helix_kv.UnknownRequestError:
            generated.append(0)  # retired while pending: the scheduler drops this token
    return sampled_tokens(ids, np.asarray(generated, dtype=np.uint64))


def eos_every_fifth(ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """End of sequence for even request ids whose token is a multiple of 5 (a function of
    the request and its output index, so both modes end the same requests at the same
    token)."""
    return (np.asarray(tokens) % 5 == 0) & (np.asarray(ids, dtype=np.int64) % 2 == 0)


def close_oldest(
    built: HelixKVRank, out: Any, edit: Edit | None = None, eos: EosRule | None = None
) -> np.ndarray:
    """Feeds the oldest pending step (``out``) its sampled tokens; returns the finished ids."""
    tokens = sample_at_close(built.scheduler, out)
    if edit is not None:
        tokens = edit(tokens)
    flags = None if eos is None else eos(np.asarray(out.sample_ids), tokens)
    return built.update(tokens, flags)


def drive(
    built: HelixKVRank,
    max_steps: int = 5000,
    *,
    overlap: bool = False,
    eos: EosRule | None = None,
    revert_every: int = 0,
) -> Iterator[Any]:
    """Schedule/update until every request finished; yields each step's output right after
    its ``schedule()`` (the caller may send back an :data:`Edit` of that step's tokens,
    applied when the step is updated, or add and abort requests).

    ``overlap``: schedule step ``t + 1`` while step ``t`` is pending, then update ``t``
    (one step ahead, as an overlapping executor does). ``revert_every``: every n-th
    scheduled step is reverted right after it is scheduled (the newest pending step)."""
    pending: deque[tuple[Any, Edit | None]] = deque()
    full = 2 if overlap else 1
    for scheduled in range(1, max_steps + 1):
        if built.has_unfinished():
            out = built.schedule()
            edit = yield out
            if revert_every and scheduled % revert_every == 0:
                built.revert()
            else:
                pending.append((out, edit))
        if not pending:
            if not built.has_unfinished():
                return
            continue  # the step was reverted
        if len(pending) == full or not built.has_unfinished():
            close_oldest(built, *pending.popleft(), eos=eos)
    raise AssertionError(f"workload did not finish in {max_steps} steps")


def take_outputs(built: HelixKVRank, ids: Iterator[int] | range) -> dict[str, Any]:
    """Every request's tokens and finish reason, and the run's totals."""
    outputs, reasons = {}, {}
    for rid in ids:
        output = built.take_output(rid)
        outputs[rid], reasons[rid] = output.token_ids.tolist(), output.finish_reason
    metrics = built.metrics()
    return {
        "outputs": outputs,
        "reasons": reasons,
        "preemptions": int(metrics.preemptions),
        "recomputed_tokens": int(metrics.recomputed_tokens),
        "prefix_cache_hits": int(metrics.prefix_cache_hits + metrics.prefix_cache_recompute_hits),
        "kv_used": int(metrics.kv_used_superblocks),
        "live": int(built.scheduler.num_live),
    }


def scenario_long_run(rank: int, world: int, backend: str, overlap: bool = False) -> dict[str, Any]:
    """A pressured run to completion with the check on every step: no false positive."""
    built = pressured_rank(world)
    add_workload(built, count=24)
    steps = 0
    for _ in drive(built, overlap=overlap):
        steps += 1
    return {"steps": steps, **take_outputs(built, range(24))}


def scenario_long_run_overlap(rank: int, world: int, backend: str) -> dict[str, Any]:
    return scenario_long_run(rank, world, backend, overlap=True)


# --- overlap mode: the same outputs as plain mode ---------------------------------------------

#: Requests of the equivalence workloads.
EQUIVALENCE_REQUESTS = 20


def run_workload(world: int, name: str, overlap: bool) -> dict[str, Any]:
    """One pressured workload to completion (schedule check on), plain or one step ahead."""
    count = EQUIVALENCE_REQUESTS
    options: dict[str, Any] = {}
    eos: EosRule | None = None
    revert_every = 0
    arrivals: dict[int, list[int]] = {}
    if name == "chunked_prefill":
        options["max_num_tokens"] = 8  # prompts of up to 28 tokens take several chunks
    elif name == "eos":
        eos = eos_every_fifth
    elif name == "reverts":
        revert_every = 4
    elif name == "prefix_caching":
        options["enable_prefix_caching"] = True
        revert_every = 5  # reverts put hits and evictions back
    built = pressured_rank(world, **options)
    if name == "staggered":
        for rid in range(count):  # two requests at the start, then one every third step
            arrivals.setdefault(max(0, 3 * (rid - 1)), []).append(rid)
        add_arrivals(built, arrivals.pop(0))
    else:
        add_workload(built, count=count, shared_prefix=16 if name == "prefix_caching" else 0)
    steps = 0
    gen = drive(built, overlap=overlap, eos=eos, revert_every=revert_every)
    for out in gen:
        steps += 1
        add_arrivals(built, arrivals.pop(int(out.step), []))
    assert not arrivals, f"steps {sorted(arrivals)} never came"
    return {"steps": steps, **take_outputs(built, range(count))}


def add_arrivals(built: HelixKVRank, ids: list[int]) -> None:
    for rid in ids:
        length, new_tokens = 6 + (rid * 5) % 23, 12 + (rid * 7) % 25
        built.add_request(rid, prompt_tokens(rid, length), new_tokens)


#: Workloads run in both modes by scenario_overlap_equivalence.
EQUIVALENCE_WORKLOADS = (
    "decode_pressure",
    "chunked_prefill",
    "staggered",
    "eos",
    "reverts",
    "prefix_caching",
)


def scenario_overlap_equivalence(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Every workload in plain mode and one step ahead: the outputs must be equal."""
    return {
        name: {mode: run_workload(world, name, mode == "overlap") for mode in ("plain", "overlap")}
        for name in EQUIVALENCE_WORKLOADS
    }


def scenario_check_cost(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Per-step cost of the check alone, on this group's backend."""
    from helix_kv.distributed import ScheduleChecker

    built = pressured_rank(world)
    add_workload(built, count=4)
    out = built.scheduler.schedule()
    checker = ScheduleChecker()
    timeout = getattr(checker._reduce, "timeout", None)
    for _ in range(50):
        checker.check(out)
    rounds = 400
    samples = np.empty(rounds)
    for i in range(rounds):
        started = time.perf_counter()
        checker.check(out)
        samples[i] = time.perf_counter() - started
    return {
        "timeout_s": None if timeout is None else timeout.total_seconds(),
        "median_us": float(np.median(samples) * 1e6),
        "p90_us": float(np.quantile(samples, 0.9) * 1e6),
    }


def scenario_check_split(rank: int, world: int, backend: str) -> dict[str, Any]:
    """ScheduleChecker's two halves directly: finish with nothing in flight does nothing; a
    collective on the caller's group may run between start and finish; a second start
    finishes the first check (both are compared); a mismatch in the first of two started
    checks is raised by the second start on every rank, naming the first step."""
    import torch
    import torch.distributed as dist

    from helix_kv.distributed import ScheduleChecker

    built = HelixKVRank.create(engine_config(), 64 * PAGE_BYTES, check_schedule=False)
    add_workload(built, count=4)
    checker = ScheduleChecker()
    report: dict[str, Any] = {}
    checker.finish()  # nothing in flight
    report["finish_without_start"] = [checker.checks, checker.in_flight_step]
    first = built.scheduler.schedule()
    second = built.scheduler.schedule()  # one step ahead: two steps pending
    checker.start(first)
    report["in_flight"] = checker.in_flight_step
    # the step's own work on the same group while the check is in flight
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    mine = torch.full((1,), float(rank), device=device)
    everyone = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(everyone, mine)
    report["gathered"] = [float(t.item()) for t in everyone]
    checker.start(second)  # finishes the first check before starting this one
    report["after_second_start"] = [checker.checks, checker.in_flight_step]
    checker.finish()
    checker.finish()  # already finished: nothing
    report["after_finishes"] = [checker.checks, checker.in_flight_step]
    report["steps"] = [int(first.step), int(second.step)]

    for out in (first, second):  # the last rank feeds a different token for the first step
        tokens = sample_at_close(built.scheduler, out)
        built.scheduler.update(tokens)
        if out is first and rank == world - 1:
            tokens = tokens.copy()
            tokens[0] += 1
        checker.record_update(out.sample_ids, tokens, step=int(out.step))
    third = built.scheduler.schedule()
    fourth = built.scheduler.schedule()
    checker.start(third)  # compares the diverged tokens
    started = time.monotonic()
    try:
        checker.start(fourth)
        report["mismatch"] = None
    except helix_kv.ScheduleMismatchError as exc:
        report["mismatch"] = describe(exc, started)
    report["after_mismatch"] = [checker.checks, checker.in_flight_step]
    report["third"] = int(third.step)
    checker.check(fourth)  # nothing left over: the next comparison agrees
    report["after_recovery"] = [checker.checks, checker.in_flight_step]
    return report


def run_until_mismatch(
    gen: Iterator[Any], inject: Callable[[Any], Edit | None], built: HelixKVRank | None = None
):
    """Drives ``gen``; ``inject(out)`` may return an edit of that step's tokens. Returns
    (steps run, step of the last successful schedule, what the error was) and, given
    ``built``, the steps its scheduler still holds pending after the error (the caught step
    among them: nothing of it was committed) and the check left in flight."""
    started = time.monotonic()
    last_step = None
    try:
        out = next(gen)
        while True:
            last_step = int(out.step)
            out = gen.send(inject(out))
    except StopIteration:
        return {"caught": False, "last_step": last_step}
    except helix_kv.ScheduleMismatchError as exc:
        after = {}
        if built is not None:
            after = {
                "pending_after": built.pending_steps(),
                "check_in_flight": built.checker.in_flight_step if built.checker else None,
            }
        return {"caught": True, "last_step": last_step, **describe(exc, started), **after}


INJECT_STEP = 12


def scenario_diverge_token(
    rank: int, world: int, backend: str, overlap: bool = False
) -> dict[str, Any]:
    """At step INJECT_STEP the last rank samples a different token for its first entry."""
    built = pressured_rank(world)
    add_workload(built)
    injected: dict[str, Any] = {}

    def inject(out: Any) -> Edit | None:
        if int(out.step) != INJECT_STEP or len(out.sample_ids) == 0:
            return None
        injected["request"] = int(out.sample_ids[0])
        bump = np.zeros(len(out.sample_ids), dtype=np.int32)
        if rank == world - 1:
            bump[0] = 1
        return lambda tokens: tokens + bump

    result = run_until_mismatch(drive(built, overlap=overlap), inject, built)
    return {**result, **injected}


def scenario_diverge_request(
    rank: int, world: int, backend: str, overlap: bool = False
) -> dict[str, Any]:
    """At step INJECT_STEP a request arrives; the last rank sees a longer prompt."""
    built = pressured_rank(world, admit_after_preemption=True)
    add_workload(built, count=2)
    injected: dict[str, Any] = {}

    def inject(out: Any) -> None:
        if int(out.step) == INJECT_STEP:
            length = 30 if rank == world - 1 else 10
            built.scheduler.add_request(100, prompt_tokens(100, length), 4, 0)
            injected["added_after_step"] = INJECT_STEP

    result = run_until_mismatch(drive(built, overlap=overlap), inject, built)
    return {**result, **injected}


def scenario_diverge_victim(
    rank: int, world: int, backend: str, overlap: bool = False
) -> dict[str, Any]:
    """Priority victims; the last rank gives the newest request a higher priority, so the
    first preemption picks a different victim there."""
    built = pressured_rank(world, victim_policy="priority")
    newest = 15
    add_workload(built, priorities={newest: 5} if rank == world - 1 else None)
    first: dict[str, Any] = {}

    def inject(out: Any) -> None:
        if len(out.preempted_ids) and "first_preemption_step" not in first:
            first["first_preemption_step"] = int(out.step)

    return {**run_until_mismatch(drive(built, overlap=overlap), inject, built), **first}


def scenario_diverge_accepted(
    rank: int, world: int, backend: str, overlap: bool = False
) -> dict[str, Any]:
    """Speculative decoding: every rank proposes the same two drafts to every decoding
    request before each step and accepts none, except that at the first step from
    INJECT_STEP on with drafts the last rank is fed one accepted draft for its first drafted
    entry. The schedule check must catch it on the next check of that rank."""
    built = pressured_rank(world, num_speculative_tokens=2)
    add_workload(built)
    pending: deque[Any] = deque()
    full = 2 if overlap else 1
    injected: dict[str, Any] = {}
    started = time.monotonic()
    last_step = None
    try:
        for _ in range(5000):
            if built.has_unfinished():
                live = [int(i) for i in built.scheduler.queue_ids()]
                decoding = [i for i in live if built.scheduler.request_state(i) == "decoding"]
                if decoding:
                    drafts = np.full(2 * len(decoding), 7, dtype=np.int32)
                    built.propose_drafts(decoding, [2] * len(decoding), drafts)
                out = built.schedule()
                last_step = int(out.step)
                pending.append(out)
            if not pending:
                return {"caught": False, "last_step": last_step}
            if len(pending) == full or not built.has_unfinished():
                out = pending.popleft()
                counts = np.asarray(out.generation_draft_counts, dtype=np.int64)
                accepted = np.zeros(counts.size, dtype=np.int64)
                drafted = np.flatnonzero(counts > 0)
                if int(out.step) >= INJECT_STEP and not injected and drafted.size:
                    injected["injected_step"] = int(out.step)
                    if rank == world - 1:
                        accepted[drafted[0]] = 1
                built.update(sample_at_close(built.scheduler, out), None, accepted)
        return {"caught": False, "last_step": last_step}
    except helix_kv.ScheduleMismatchError as exc:
        return {"caught": True, "last_step": last_step, **describe(exc, started), **injected}


def scenario_diverge_accepted_overlap(rank: int, world: int, backend: str) -> dict[str, Any]:
    return scenario_diverge_accepted(rank, world, backend, overlap=True)


def scenario_diverge_token_overlap(rank: int, world: int, backend: str) -> dict[str, Any]:
    return scenario_diverge_token(rank, world, backend, overlap=True)


def scenario_diverge_request_overlap(rank: int, world: int, backend: str) -> dict[str, Any]:
    return scenario_diverge_request(rank, world, backend, overlap=True)


def scenario_diverge_victim_overlap(rank: int, world: int, backend: str) -> dict[str, Any]:
    return scenario_diverge_victim(rank, world, backend, overlap=True)


# --- abort ----------------------------------------------------------------------------------

#: Request -> (state it is aborted in the first time it is seen there, while a step is pending).
ABORT_PLAN = {
    1: ("prefilling", False),
    2: ("decoding", True),
    3: ("waiting", False),
    5: ("recompute-paused", False),
    6: ("recompute-paused", True),
    7: ("prefilling", True),
    9: ("recompute-paused", True),
    10: ("recompute-paused", False),
    12: ("recompute-paused", False),
    14: ("recompute-paused", False),
    15: ("recompute-paused", False),
    11: ("decoding", False),
    13: ("waiting", True),
}
#: Every REVERT_EVERY-th scheduled step is reverted (aborts requested in it take effect then).
REVERT_EVERY = 5
#: A small step budget, so prompts are prefilled in several chunks.
ABORT_STEP_TOKENS = 16


def state_label(scheduler: Any, rid: int) -> str:
    state = scheduler.request_state(rid)
    if state == "waiting" and scheduler.request_metrics(rid).preemptions > 0:
        return "recompute-paused"
    return state


def run_with_aborts(
    built: HelixKVRank, plan: dict[int, tuple], overlap: bool = False
) -> dict[str, Any]:
    """Drives ``built`` to the end, aborting per ``plan`` and reverting now and then; returns
    what every request produced and in which states the aborts landed.

    "While pending" means right after a ``schedule()``: one step pending in plain mode, two
    in overlap mode (where "between steps" still has one pending, so every abort there waits
    for a step to close too)."""
    scheduler = built.scheduler
    outputs: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    states: list[str] = []
    requested: set = set()
    full = 2 if overlap else 1

    def collect(rids: Any) -> None:
        for rid in np.asarray(rids, dtype=np.int64).tolist():
            output = scheduler.take_output(rid)
            outputs[rid], reasons[rid] = output.token_ids.tolist(), output.finish_reason

    def abort_due() -> None:
        pending = built.pending_steps() >= full
        live = scheduler.queue_ids().tolist()
        due = [
            rid
            for rid in live
            if rid in plan
            and rid not in requested
            and plan[rid] == (state_label(scheduler, rid), pending)
        ]
        states.extend(plan[rid][0] + (" while pending" if pending else "") for rid in due)
        requested.update(due)
        built.abort_many(np.asarray(due, dtype=np.int64))  # every rank: same calls, same order
        if built.pending_steps() == 0:  # aborted at once; otherwise when a step closes
            collect(due)

    pending: deque[Any] = deque()
    for scheduled in range(1, 5000):
        abort_due()
        if scheduler.has_unfinished():
            out = built.schedule()
            abort_due()
            if scheduled % REVERT_EVERY == 0:
                collect(built.revert())
            else:
                pending.append(out)
        if not pending:
            if not scheduler.has_unfinished():
                break
            continue
        if len(pending) == full or not scheduler.has_unfinished():
            collect(close_oldest(built, pending.popleft()))
    metrics = scheduler.metrics()
    return {
        "outputs": outputs,
        "reasons": reasons,
        "states": sorted(set(states)),
        "aborts": int(metrics.aborts),
        "preemptions": int(metrics.preemptions),
        "suspensions": int(metrics.suspensions),
        "resumes": int(metrics.resumes),
        "kv_used": int(metrics.kv_used_superblocks),
        "host_used": int(scheduler.host_used_superblocks),
        "live": int(scheduler.num_live),
    }


def scenario_abort(rank: int, world: int, backend: str, overlap: bool = False) -> dict[str, Any]:
    """Aborts in every state a CP group has (waiting, part-prefilled, decoding,
    recompute-paused), between steps and while a step is pending, with the schedule check on;
    then the survivors alone in a fresh group: they must generate the same tokens."""
    built = pressured_rank(world, max_num_tokens=ABORT_STEP_TOKENS)
    add_workload(built, count=16)
    with_aborts = run_with_aborts(built, ABORT_PLAN, overlap)
    aborted = {rid for rid, reason in with_aborts["reasons"].items() if reason == "aborted"}
    alone = pressured_rank(world, max_num_tokens=ABORT_STEP_TOKENS)
    for rid in range(16):
        if rid not in aborted:
            length, new_tokens = 6 + (rid * 5) % 23, 12 + (rid * 7) % 25
            alone.scheduler.add_request(rid, prompt_tokens(rid, length), new_tokens, 0)
    return {**with_aborts, "alone": run_with_aborts(alone, {}, overlap)["outputs"]}


#: Aborts of suspended requests in the host-tier scenario (between steps, while pending).
HOST_TIER_ABORT_PLAN = {3: ("suspended", False), 9: ("suspended", True), 12: ("suspended", True)}


def scenario_host_tier(
    rank: int, world: int, backend: str, overlap: bool = False
) -> dict[str, Any]:
    """Aggregated Helix with helix_kv's host tier, the schedule check on every step: each
    rank offers a different host budget (the group takes the smallest), requests are
    suspended and resumed, some aborted while suspended, steps reverted now and then."""
    host_pages = 24 + 8 * rank  # rank 0's 24 host pages are the group's
    built = pressured_rank(
        world,
        max_num_tokens=ABORT_STEP_TOKENS,
        aggregated_host_tier=True,
        host_cache_bytes=host_pages * PAGE_BYTES,
    )
    add_workload(built, count=16)
    report = run_with_aborts(built, HOST_TIER_ABORT_PLAN, overlap)
    return {**report, "host_tier_superblocks": built.host_tier_superblocks}


def scenario_host_tier_overlap(rank: int, world: int, backend: str) -> dict[str, Any]:
    return scenario_host_tier(rank, world, backend, overlap=True)


def scenario_abort_overlap(rank: int, world: int, backend: str) -> dict[str, Any]:
    return scenario_abort(rank, world, backend, overlap=True)


def scenario_diverge_abort(
    rank: int, world: int, backend: str, overlap: bool = False
) -> dict[str, Any]:
    """After step INJECT_STEP the last rank alone aborts a decoding request: the schedule
    check catches it at the next step."""
    built = pressured_rank(world)
    add_workload(built)
    injected: dict[str, Any] = {}

    def inject(out: Any) -> None:
        if int(out.step) == INJECT_STEP + 1 and len(out.generation_ids):
            # this step is pending: the abort takes effect when a step is updated
            injected["request"] = int(out.generation_ids[0])
            if rank == world - 1:
                built.abort(injected["request"])

    return {**run_until_mismatch(drive(built, overlap=overlap), inject), **injected}


def scenario_diverge_abort_overlap(rank: int, world: int, backend: str) -> dict[str, Any]:
    return scenario_diverge_abort(rank, world, backend, overlap=True)


class env_var:
    """Sets (or, with ``None``, removes) one environment variable inside a ``with`` block."""

    def __init__(self, name: str, value: str | None) -> None:
        self.name, self.value = name, value

    def __enter__(self) -> None:
        self.saved = os.environ.get(self.name)
        if self.value is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.value

    def __exit__(self, *exc: Any) -> None:
        if self.saved is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.saved


def scenario_rank_dies(rank: int, world: int, backend: str) -> dict[str, Any]:
    """The last rank dies before construction; its peers raise InitSyncError, never hang.

    It dies only once every peer has said (through the group's store, not a collective) that
    its own process-group init returned: a rank that died while a peer was still connecting
    its gloo mesh failed that peer's ``init_process_group`` instead, a crash this scenario is
    not about (a CI run lost to it when the machine was loaded)."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if rank == world - 1:
        store.wait([f"rank_dies/initialised/{peer}" for peer in range(world - 1)])
        os._exit(17)
    store.set(f"rank_dies/initialised/{rank}", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = attempt(lambda: HelixKVRank.create(engine_config(), 64 * PAGE_BYTES))
    result.pop("built", None)
    return result


def scenario_check_timeout(rank: int, world: int, backend: str) -> dict[str, Any]:
    """NCCL: the last rank skips a check; the others raise after the checker's timeout instead
    of waiting forever on the replayed graph (which torch's watchdog does not see)."""
    from datetime import timedelta

    from helix_kv.distributed import ScheduleChecker

    checker = ScheduleChecker(timeout=timedelta(seconds=2))
    built = pressured_rank(world)
    add_workload(built, count=2)
    out = built.scheduler.schedule()
    checker.check(out)  # every rank: fine
    if rank == world - 1:
        time.sleep(6.0)  # skips the next check
        return {"skipped": True}
    started = time.monotonic()
    try:
        checker.check(out)
    except helix_kv.HelixKVError as exc:
        return {"skipped": False, **describe(exc, started)}
    return {"skipped": False, "type": None, "seconds": time.monotonic() - started}
