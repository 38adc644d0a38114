"""One process per CP rank: drive helix_kv's scheduler and run the tiny model through the pool.

The loop every rank runs (the embedding pattern for a real executor), through a
:class:`helix_kv.StepDriver` over the rank's :class:`helix_kv.distributed.HelixKVRank`::

    out = driver.schedule()                         # identical on every rank
    plan = StepPlan.from_schedule(helix.scheduler, out, placement)
    batch = pool.prepare(plan)                      # pinned staging + async copy + device tables
    driver.gather_inputs(on_device)                 # one step ahead: inputs in flight
    hidden = model.forward(batch, pool, combine)    # writes owned KV, one all-gather per layer
    tokens = greedy(model.logits(hidden[batch.sample_index]))  # sample_ids order
    driver.launched(step)                           # its tokens, and their copy to the host
    finished = driver.complete(due.host_tokens.wait())  # the step due (see StepDriver.due)

With ``ExecutorConfig(overlap=True)`` the driver runs one step ahead: step ``t + 1`` is
scheduled, planned and queued while step ``t`` runs on the device, its decode inputs still in
flight gathered on the device from step ``t``'s sampled tokens
(:class:`helix_kv.executor.overlap.DecodeInputGather`); only then does the host wait for step
``t``'s tokens (an async copy to pinned memory) and complete it.

The loop makes only the calls of the scheduler contract
(:class:`helix_kv.contract.SchedulerProtocol`) on ``helix``, plus the block tables the step
plan reads from its scheduler and ``finish_check()`` before it waits for a step's tokens (the
schedule check runs under the step's work).

:func:`run_rank` runs that loop to completion in the calling process (``cp_size = 1``, or
inside an initialised process group); :func:`run_group` spawns the ranks (gloo on CPU, NCCL on GPUs)
and checks that they agree.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from helix_kv._renamed import Renamed, renamed_fields, renamed_keywords
from helix_kv.distributed import EngineConfig, HelixKVRank
from helix_kv.distributed.launch import spawn_group
from helix_kv.executor.decode_step import DecodeLayout, DecodeMetadata, DecodeStep
from helix_kv.executor.drafter import NgramDrafter, greedy_acceptance
from helix_kv.executor.host_pool import HostKVPool
from helix_kv.executor.kv_pool import KVPool
from helix_kv.executor.model import ModelConfig, TinyConfig, Transformer, group_combine
from helix_kv.executor.ngram_device import DeviceNgramDrafter
from helix_kv.executor.overlap import DecodeInputGather, HostTokens, StepTimeline, TokenReadback
from helix_kv.executor.placement import RankPlacement
from helix_kv.executor.step_plan import StepPlan, generation_draft_counts
from helix_kv.step_driver import PendingStep, StepDriver

Prompts = Mapping[int, Sequence[int]]


@renamed_fields
@dataclass(frozen=True)
class ExecutorConfig:
    """What one run needs besides the prompts (picklable, identical on every rank).

    ``cp_size``: the ranks of the CP group (``cp``: its deprecated name, kept for one release).
    ``model``: a :class:`~helix_kv.executor.model.LlamaConfig` or
    :class:`~helix_kv.executor.model.MLAConfig` (seeded random weights), or the path of a
    Hugging Face checkpoint directory (:mod:`helix_kv.executor.checkpoint`; every rank
    loads it).
    ``kv_superblocks`` is this rank's own KV budget in pages; the group agrees on the minimum
    (``docs/distributed.md``, "Quota sync") through :class:`helix_kv.distributed.HelixKVRank`.
    ``scheduler_options`` go to its ``EngineConfig`` as they are (e.g. ``victim_policy``,
    ``max_preemptions_per_request``).
    ``check_schedule``: compare every step's schedule across the ranks (``None``: read
    ``HELIX_KV_CHECK_SCHEDULE``).
    ``decode_kernel``: attend decode entries with the Triton paged kernel, and run decode-only
    steps on the fast path (:mod:`helix_kv.executor.decode_step`: persistent buffers, one H2D
    copy). ``cuda_graphs`` (implies ``decode_kernel``, CUDA only): replay those steps from
    CUDA graphs captured for ``graph_batch_sizes`` (default: powers of two up to
    ``max_batch_size``). ``max_pages_per_request``: block-table columns of the fast path
    (default: enough for the longest prompt plus its new tokens); a step with a wider request
    takes the general path.
    ``host_tier_pages``: this rank's host KV tier in pages (0: none). Under aggregated Helix it
    turns on helix_kv's own host tier (``EngineConfig.aggregated_host_tier``); the group
    agrees on the minimum, and suspended pages are copied through a :class:`HostKVPool`.
    ``overlap``: schedule step ``t + 1`` while step ``t`` runs (one step ahead; see the
    module docs). ``eos_token_id``: an id, or a tuple of ids, a sampled token equal to any of
    which ends its request, as transformers' ``generate`` stops on any of a list (``None``
    or ``()``: requests run to their ``max_new_tokens``;
    :func:`~helix_kv.executor.checkpoint.eos_token_ids` reads a checkpoint's). The fast path
    (``decode_kernel`` / ``cuda_graphs``) takes every decode-only step, with ``overlap`` too:
    its rows carry the in-flight references and its graph gathers those inputs from the
    previous step's samples on the device. A graphed fast-path step is one fill (Rust) and
    one graph replay whose first node is the H2D copy of its rows.
    ``step_timeline``: record the device start and end of each step (two CUDA events per
    step, from a ring allocated once; ``RunResult.host_gap_us``); off, a step records none.
    ``num_speculative_tokens``: speculative decoding with up to that many drafts per request
    and step (0: off; it becomes the ``EngineConfig``'s ``num_speculative_tokens``), proposed
    by a prompt-lookup :class:`~helix_kv.executor.drafter.NgramDrafter` over each request's
    own tokens (``drafter_max_ngram`` down to ``drafter_min_ngram``, matched within the last
    ``drafter_max_search`` tokens, ``None``: all; on CUDA its search runs on the GPU,
    :class:`~helix_kv.executor.ngram_device.DeviceNgramDrafter`, the same drafts) and
    verified greedily in the same forward; the outputs are the greedy tokens without drafts,
    token for token. With the draft backoff on (``scheduler_options``'
    ``draft_backoff_misses``) a request it stopped is not searched. On the fast path a
    drafted step is one kernel row per query token; ``group_draft_rows`` attends a request's
    rows in one kernel program (each key block loaded once for them; off by default: alone
    it timed slower than one program per row on an H200 at k = 4, docs/gpu-results.md).
    """

    cp_size: int = 1
    tokens_per_block: int = 4
    kv_superblocks: int = 64
    max_batch_size: int = 16
    max_num_tokens: int = 128
    model: ModelConfig | str = field(default_factory=TinyConfig)
    dtype: str = "float64"
    kv_dtype: str | None = None
    device: str = "cpu"
    record_logits: bool = False
    check_schedule: bool | None = None
    decode_kernel: bool = False
    cuda_graphs: bool = False
    graph_batch_sizes: tuple[int, ...] | None = None
    max_pages_per_request: int | None = None
    time_table_build: bool = False
    max_steps: int = 100_000
    scheduler_options: Mapping[str, Any] = field(default_factory=dict)
    host_tier_pages: int = 0
    overlap: bool = False
    eos_token_id: int | tuple[int, ...] | None = None
    step_timeline: bool = True
    num_speculative_tokens: int = 0
    drafter_max_ngram: int = 3
    drafter_min_ngram: int = 1
    drafter_max_search: int | None = None
    group_draft_rows: bool = False

    cp = Renamed[int]("cp_size")

    @renamed_keywords(cp="cp_size")
    def with_(self, **changes: Any) -> ExecutorConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)


#: One job of :func:`run_group`: ``(prompts, max_new_tokens, config)``, as :func:`run_rank` takes
#: them (a runtime alias: ``Union``, not ``|``, for Python 3.9).
Job = tuple[Prompts, Union[int, Mapping[int, int]], ExecutorConfig]


@renamed_fields
@dataclass
class RunResult:
    """What rank ``cp_rank`` saw: outputs, scheduler metrics, per-step trace and timings.

    ``rank``: the deprecated name of ``cp_rank`` (kept for one release).

    ``fast_path_steps``: decode-only steps run on the decode fast path (``decode_kernel``);
    ``fast_path_inputs_in_flight``: their inputs gathered on the device from the previous
    step's samples (one step ahead).
    ``table_build_us`` (with ``time_table_build``): per step, from ``schedule()`` returning
    to the step's device tables being ready (a device sync; on the eager fast path, waiting
    for its one copy); ``metadata_host_us``: on the fast path, the host part of it (fill the
    pinned rows, enqueue the one H2D copy). On the graphed fast path the copy is the first
    node of the step's graph: both are the host time up to the replay (the fill, and the
    device gather's enqueue for inputs of a step not on the fast path). The step timeline's
    start event (``step_timeline``) is instrumentation and is not counted in either.

    Speculative decoding (``ExecutorConfig.num_speculative_tokens``): ``decode_tokens``
    counts the tokens the decode steps generated (``1 + accepted`` per entry);
    ``draft_steps`` the steps that verified drafts (``fast_path_draft_steps``: of them, those
    run on the decode fast path), ``proposed_draft_tokens`` the drafts the
    drafter proposed (the scheduler may trim them; what it scheduled, accepted and trimmed
    is in ``metrics``: ``spec_decode_*``); ``draft_us`` the host µs of each step's drafting
    (reading the requests' tokens, the n-gram search, ``propose_drafts``), part of
    ``schedule_us``.
    """

    cp_rank: int
    outputs: dict[int, list[int]]
    metrics: dict[str, float]
    request_metrics: dict[int, dict[str, float]]
    digests: list[int]
    preempted: list[list[int]]
    capacity_superblocks: int
    logits: dict[int, np.ndarray] = field(default_factory=dict)
    host_tier_superblocks: int = 0
    host_bytes_out: int = 0
    host_bytes_in: int = 0
    total_s: float = 0.0
    tokens_run: int = 0
    #: Victims that had sampled at least one token when chosen (their KV held generated
    #: tokens, or they had moved on to decode).
    preempted_while_decoding: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    fast_path_steps: int = 0
    fast_path_inputs_in_flight: int = 0
    schedule_us: list[float] = field(default_factory=list)
    table_build_us: list[float] = field(default_factory=list)
    metadata_host_us: list[float] = field(default_factory=list)
    host_gap_us: list[float] = field(default_factory=list)
    draft_steps: int = 0
    fast_path_draft_steps: int = 0
    proposed_draft_tokens: int = 0
    draft_us: list[float] = field(default_factory=list)

    rank = Renamed[int]("cp_rank")

    @property
    def preemptions(self) -> int:
        """Requests recompute-paused over the run (counted from the schedule outputs)."""
        return sum(len(step) for step in self.preempted)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second over steps that ran decode entries only."""
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def tokens_per_decode_step(self) -> float:
        """Generated tokens per decode-only step (1 per request and step without drafts)."""
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafts over the drafts the scheduler scheduled (0 without drafts)."""
        drafted = self.metrics.get("spec_decode_num_draft_tokens", 0)
        return self.metrics.get("spec_decode_num_accepted_tokens", 0) / drafted if drafted else 0.0

    @property
    def spec_decode(self) -> dict[str, float]:
        """The scheduler's speculative-decoding metrics (``spec_decode_*``) of the run."""
        return {k: v for k, v in self.metrics.items() if k.startswith("spec_decode_")}

    @property
    def host_gap_us_median(self) -> float:
        """Median µs the device idled between consecutive steps (CUDA only; 0 otherwise)."""
        return float(np.median(self.host_gap_us)) if self.host_gap_us else 0.0

    @property
    def table_build_us_median(self) -> float:
        """Median µs per step to build the step's device tables (plan + stage + expand)."""
        return float(np.median(self.table_build_us)) if self.table_build_us else 0.0


def build_model(
    model: ModelConfig | str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    decode_kernel: bool = False,
) -> Transformer:
    """The model an :class:`ExecutorConfig` names: a config (seeded random weights) or the
    path of a Hugging Face checkpoint directory (:func:`helix_kv.executor.checkpoint.load_model`;
    every rank loads it)."""
    if isinstance(model, str):
        from helix_kv.executor.checkpoint import load_model

        return load_model(model, dtype, device, decode_kernel)
    return Transformer(model, dtype=dtype, device=device, decode_kernel=decode_kernel)


def _eos_ids(eos_token_id: int | Sequence[int] | None) -> npt.NDArray[np.int64] | None:
    """The EOS ids of ``ExecutorConfig.eos_token_id`` as an array (``None``: no EOS)."""
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, (int, np.integer)) else list(eos_token_id)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"eos_token_id must be an int or a tuple of ints, got {eos_token_id!r}")
    return np.asarray(ids, dtype=np.int64) if ids else None


def run_rank(
    prompts: Prompts,
    max_new_tokens: int | Mapping[int, int],
    config: ExecutorConfig,
    group: dist.ProcessGroup | None = None,
) -> RunResult:
    """Run every prompt to completion on this rank; greedy decoding.

    With ``config.cp_size > 1`` a process group of ``cp_size`` ranks must be initialised
    (``group`` or the default group); this process is its rank ``dist.get_rank(group)``.
    """
    return _RankRun(prompts, max_new_tokens, config, group).run()


def _engine_config(
    config: ExecutorConfig, model: ModelConfig, kv_dtype: torch.dtype
) -> EngineConfig:
    """The ``EngineConfig`` of a run: the model's KV geometry, the run's batch limits and
    scheduler options (its drafts; its host tier, in pages, as helix_kv's own)."""
    options = dict(config.scheduler_options)
    if config.num_speculative_tokens:
        options["num_speculative_tokens"] = config.num_speculative_tokens
    engine = EngineConfig(
        num_layers=model.num_layers,
        num_kv_heads=model.cache_heads,
        head_dim=model.cache_head_dim,
        kv_factor=model.kv_factor,
        dtype_bytes=torch.empty((), dtype=kv_dtype).element_size(),
        tokens_per_block=config.tokens_per_block,
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        **options,
    )
    if config.host_tier_pages:
        engine = dataclasses.replace(
            engine,
            aggregated_host_tier=True,
            host_cache_bytes=config.host_tier_pages * engine.page_bytes,
        )
    return engine


class _RankRun:
    """One rank's run: its model, its :class:`HelixKVRank` and pools, the step driver and
    the decode fast path, and what the run records (:attr:`result`). :meth:`run` is the
    loop; :meth:`launch` queues a step, :meth:`close` feeds one its tokens."""

    def __init__(
        self,
        prompts: Prompts,
        max_new_tokens: int | Mapping[int, int],
        config: ExecutorConfig,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.config = config
        self.group = group
        self.device = _device(config.device)
        dtype = getattr(torch, config.dtype)
        self.kv_dtype = getattr(torch, config.kv_dtype) if config.kv_dtype else dtype
        fast_path = config.decode_kernel or config.cuda_graphs
        self.model = build_model(config.model, dtype, self.device, fast_path)
        engine = _engine_config(config, self.model.config, self.kv_dtype)
        self.spec_tokens = int(engine.num_speculative_tokens)
        self.eos_ids = _eos_ids(config.eos_token_id)
        self.drafter = _drafter(config, self.spec_tokens, self.device) if self.spec_tokens else None
        # The draft backoff on: a request it stopped is not searched (its drafts would be
        # ignored).
        self.skip_backed_off = bool(engine.draft_backoff_misses)
        # quota sync (MIN over the ranks' budgets) + init-status sync + optional schedule check
        self.helix = HelixKVRank.create(
            engine,
            config.kv_superblocks * engine.page_bytes,
            group,
            allocate=self._allocate_pool,
            check_schedule=config.check_schedule,
        )
        helix = self.helix
        if helix.cp_size != config.cp_size:
            raise ValueError(
                f"cp_size = {config.cp_size} but the process group has {helix.cp_size} ranks"
            )
        self.pool: KVPool = helix.kv_storage
        self.host_pool = (
            HostKVPool(self.pool, helix.host_tier_superblocks)
            if helix.host_tier_superblocks
            else None
        )
        # The loop drives the scheduler contract (helix_kv.contract.SchedulerProtocol) through
        # ``helix``; only the step plan reads this rank's block tables from its scheduler.
        for request_id, prompt in prompts.items():
            budget = (
                max_new_tokens if isinstance(max_new_tokens, int) else max_new_tokens[request_id]
            )
            helix.add_request(int(request_id), np.asarray(prompt, dtype=np.int32), budget)
        self.combine = group_combine(group)
        self.decode_step = self._decode_step(prompts, max_new_tokens) if fast_path else None
        self.result = RunResult(helix.cp_rank, {}, {}, {}, [], [], helix.capacity_superblocks)
        self.logits_rows: dict[int, list[np.ndarray]] = {}
        self.gather = DecodeInputGather(self.device)
        self.readback = TokenReadback(self.device)
        self.timeline = StepTimeline(self.device, enabled=config.step_timeline)
        self.broadcast_src = dist.get_global_rank(group, 0) if group else 0
        self.driver: StepDriver[_LaunchedStep] = StepDriver(helix, one_step_ahead=config.overlap)
        #: The requests of the step closed last that sampled a token in it (drafting candidates).
        self.last_sampled: list[int] = []

    def _allocate_pool(self, built: HelixKVRank) -> KVPool:
        placement = RankPlacement(built.cp_size, self.config.tokens_per_block, built.cp_rank)
        return self.model.new_kv_pool(placement, built.capacity_superblocks, self.kv_dtype)

    def _decode_step(self, prompts: Prompts, max_new_tokens: int | Mapping[int, int]) -> DecodeStep:
        """The decode fast path's buffers (and graphs): a row per query token, a block table
        as wide as the longest request (prompt and new tokens) needs."""
        config = self.config
        budgets = [max_new_tokens] if isinstance(max_new_tokens, int) else max_new_tokens.values()
        longest = max((len(p) for p in prompts.values()), default=1) + max(budgets, default=1)
        placement = self.pool.placement
        max_pages = config.max_pages_per_request or placement.layout.superblocks_for(longest)
        # With drafts a row per query token: up to 1 + K per request, within the token budget.
        max_rows = config.max_batch_size
        if self.spec_tokens:
            max_rows = min(
                config.max_batch_size * (1 + self.spec_tokens),
                max(config.max_batch_size, config.max_num_tokens),
            )
        buckets = config.graph_batch_sizes
        if buckets is not None:
            buckets = tuple(sorted({b for b in buckets if b < max_rows} | {max_rows}))
        metadata = DecodeMetadata(DecodeLayout(max_rows, max_pages), self.device, buckets)
        # grouped draft rows: the Llama family's kernel only
        grouped = config.group_draft_rows and not self.model.mla
        # collective when graphed: every rank captures the same buckets in the same order
        return DecodeStep(
            self.model,
            self.pool,
            self.combine,
            metadata,
            config.cuda_graphs,
            rows_per_request=1 + self.spec_tokens if grouped else 1,
        )

    def run(self) -> RunResult:
        """Launch and close steps until every request finished; the run's record."""
        helix, driver, result = self.helix, self.driver, self.result
        started = last_close = time.perf_counter()
        while helix.has_unfinished() or driver.pending:
            if helix.has_unfinished():
                if len(result.digests) + driver.pending >= self.config.max_steps:
                    raise RuntimeError(f"no completion after {self.config.max_steps} steps")
                driver.launched(self.launch())
            due = driver.due(final=not helix.has_unfinished())
            if due is not None:
                last_close = self.close(due.sampled, last_close)
        result.total_s = time.perf_counter() - started
        result.host_gap_us = self.timeline.gaps_us()
        result.metrics = dict(helix.metrics().to_dict())
        if self.host_pool is not None:
            result.host_tier_superblocks = self.host_pool.num_pages
            result.host_bytes_out = self.host_pool.bytes_out
            result.host_bytes_in = self.host_pool.bytes_in
        result.logits = {rid: np.stack(rows) for rid, rows in self.logits_rows.items()}
        return result

    def propose(self, drafter: NgramDrafter | DeviceNgramDrafter) -> None:
        """Drafts for the requests that may decode in the step scheduled next, from the
        tokens known on the host (identical on every rank). One step ahead, a request whose
        newest token is still being sampled by the pending step drafts past it (``skip=1``);
        one whose pending decode carries drafts is left out (it is not planned again before
        that step closes)."""
        skips: dict[int, int] = {}
        blocked: set[int] = set()
        pending = self.driver.newest
        if pending is not None:
            p_out = pending.output
            p_gen = np.asarray(p_out.generation_ids, dtype=np.int64)
            p_drafted = generation_draft_counts(p_out, len(p_gen)) > 0
            p_ctx = np.asarray(p_out.context_ids, dtype=np.int64)
            p_done = np.asarray(p_out.context_completes, dtype=bool)
            blocked.update(p_gen[p_drafted].tolist())
            for rid in p_gen[~p_drafted].tolist() + p_ctx[p_done].tolist():
                skips[rid] = 1
            blocked.update(p_ctx[~p_done].tolist())
        for rid in self.last_sampled:
            if rid not in skips and rid not in blocked:
                skips[rid] = 0
        ids = [rid for rid in skips if rid not in self.result.outputs]
        if ids and self.skip_backed_off:
            paused = self.helix.scheduler.drafts_paused(np.asarray(ids, dtype=np.uint64))
            ids = [rid for rid, off in zip(ids, paused.tolist()) if not off]
        if not ids:
            return
        histories = [self.helix.scheduler.tokens(rid) for rid in ids]
        counts, tokens = drafter.propose(histories, [skips[rid] for rid in ids])
        drafted = counts > 0
        if drafted.any():
            ids_drafted = np.asarray(ids, dtype=np.int64)[drafted]
            self.driver.propose_drafts(ids_drafted, counts[drafted], tokens)
            self.result.proposed_draft_tokens += int(counts.sum())

    def launch(self) -> _LaunchedStep:
        """Schedules the next step and queues its device work, after the step in flight's
        (overlap mode: its sampled tokens are read on the device): on the decode fast path
        where it takes the step (also one step ahead: inputs in flight gathered in its
        graph), else on the general path."""
        result = self.result
        step_start = time.perf_counter()
        if self.drafter is not None:
            self.propose(self.drafter)
            result.draft_us.append((time.perf_counter() - step_start) * 1e6)
        out = self.driver.schedule()
        build_start = time.perf_counter()
        result.schedule_us.append((build_start - step_start) * 1e6)
        _count_victims_that_generated(self.helix, out, result)
        if self.host_pool is not None:
            self.host_pool.copy_step(out)  # queued before anything of the step writes KV
        if self.decode_step is not None:
            launched = self._launch_fast(self.decode_step, out, step_start, build_start)
            if launched is not None:
                result.fast_path_steps += 1
                return launched
        return self._launch_general(out, step_start, build_start)

    def _launch_general(self, out: Any, step_start: float, build_start: float) -> _LaunchedStep:
        """Queues a step on the general path: its plan, the pool's staged tables, the
        forward over every token, greedy samples."""
        config, pool, model = self.config, self.pool, self.model
        plan = StepPlan.from_schedule(self.helix.scheduler, out, pool.placement)
        build_start += _start_timeline(self.timeline)  # instrumentation, not table building
        batch = pool.prepare(plan)
        token_offsets = plan.token_offsets  # a drafted entry's input token starts its tokens
        self.driver.gather_inputs(
            lambda entries, rows, previous: self.gather.apply(
                batch.token_ids, token_offsets[entries], rows, previous.tokens
            )
        )
        if config.time_table_build:
            _synchronize(self.device)
            self.result.table_build_us.append((time.perf_counter() - build_start) * 1e6)
        tokens = torch.zeros(out.num_samples, dtype=torch.int64, device=self.device)
        logits = None
        if plan.num_tokens:
            logits = model.logits(model.forward(batch, pool, self.combine)[batch.sample_index])
            tokens = logits.argmax(dim=-1)
        self._agree_on(tokens, out.num_samples)
        host_tokens = self.readback.start(tokens)
        self.timeline.end()
        kept_logits = logits if config.record_logits else None
        return _LaunchedStep(
            out,
            plan.num_tokens,
            plan.num_generation,
            plan.num_entries,
            tokens,
            host_tokens,
            kept_logits,
            step_start,
        )

    def _launch_fast(
        self, step: DecodeStep, out: Any, step_start: float, build_start: float
    ) -> _LaunchedStep | None:
        """Queues a decode-only step on the fast path (its rows written by one core call, one
        H2D copy, a graph replay); ``None`` (nothing queued) when the step has context chunks
        or more rows or pages than the layout holds. Inputs still in flight (a previous step
        pending, one step ahead) are gathered on the device from its samples."""
        if len(out.context_ids) or not len(out.generation_ids):
            return None
        counts = step.metadata.fill_if_fits(self.helix.scheduler, out)
        if counts is None:  # more rows or pages than the layout holds
            return None
        config, result = self.config, self.result
        rows = counts.rows
        result.fast_path_inputs_in_flight += counts.in_flight
        if rows > len(out.generation_ids):  # one row per query token: drafts to verify
            result.fast_path_draft_steps += 1
        build_start += _start_timeline(self.timeline)  # instrumentation, not metadata work
        if counts.in_flight:
            previous = _previous_of(self.driver)
            if previous is None:
                raise RuntimeError(
                    "the step reads sampled tokens of a previous step, but none is in flight"
                )
            if not previous.fast:  # a fast-path step sampled into step.tokens already
                step.take_previous(previous.tokens)
        self._run_rows(step, rows, build_start)
        tokens = step.tokens[:rows]
        self._agree_on(tokens, rows)
        host_tokens = step.start_readback(rows)
        self.timeline.end()
        # The logits buffer is overwritten by the next step: kept ones are copied.
        logits = step.logits[:rows].clone() if config.record_logits else None
        entries = len(out.generation_ids)  # rows: one per query token (1 + drafts per entry)
        return _LaunchedStep(
            out, rows, entries, entries, tokens, host_tokens, logits, step_start, True
        )

    def _run_rows(self, step: DecodeStep, rows: int, build_start: float) -> None:
        """Runs the fast-path step of the ``rows`` just filled, timing its tables if asked."""
        result = self.result
        if self.config.time_table_build and not step.graphed:
            bucket = step.metadata.upload(rows)
            result.metadata_host_us.append((time.perf_counter() - build_start) * 1e6)
            step.metadata.wait_uploaded()
            result.table_build_us.append((time.perf_counter() - build_start) * 1e6)
            step.run(bucket)
            return
        if self.config.time_table_build:  # graphed: the copy is the graph's first node
            ready_us = (time.perf_counter() - build_start) * 1e6
            result.metadata_host_us.append(ready_us)
            result.table_build_us.append(ready_us)
        # Graphed: one replay (the H2D copy of the rows, then the forward), no event; the
        # staging buffer is released when this step's readback is waited (close), before
        # the step after next fills it (checked: StagingBufferBusy).
        step.launch(rows)

    def _agree_on(self, tokens: torch.Tensor, samples: int) -> None:
        """Rank 0's samples on every rank: the ranks compute identical logits, and the
        broadcast makes identical tokens a guarantee."""
        if self.config.cp_size > 1 and samples:
            dist.broadcast(tokens, src=self.broadcast_src, group=self.group)

    def close(self, step: _LaunchedStep, last_close: float) -> float:
        """Feeds the oldest pending step its sampled tokens; returns when it closed."""
        helix, result = self.helix, self.result
        helix.finish_check()  # before blocking on the step's device work (see finish_check)
        tokens = step.host_tokens.wait()
        eos = None if self.eos_ids is None else np.isin(tokens, self.eos_ids)
        out = step.out
        num_gen = len(out.generation_ids)
        drafts = generation_draft_counts(out, num_gen)
        accepted = kept = None
        generated = num_gen
        if drafts.any():
            # greedy verification on the host: leading drafts equal to the argmax before each
            accepted, kept = greedy_acceptance(tokens, drafts, out.generation_draft_tokens, eos)
            generated = num_gen + int(accepted.sum())
            result.draft_steps += 1
        finished = self.driver.complete(tokens, eos, accepted)
        closed = time.perf_counter()
        sampled_ids = np.asarray(out.generation_ids, dtype=np.int64).tolist()
        ctx_done = np.asarray(out.context_completes, dtype=bool)
        sampled_ids += np.asarray(out.context_ids, dtype=np.int64)[ctx_done].tolist()
        self.last_sampled[:] = sampled_ids
        if step.logits is not None:
            self._keep_logits(out, step.logits, kept)
        # One step ahead, a step's host work overlaps the previous one's: its time is what
        # it added after the previous step closed.
        _account_step(
            result,
            out,
            step.num_tokens,
            step.num_generation,
            step.num_entries,
            generated,
            closed - max(step.started, last_close),
        )
        _take_finished(helix, result, finished)
        return closed

    def _keep_logits(
        self, out: Any, logits: torch.Tensor, kept: npt.NDArray[np.bool_] | None
    ) -> None:
        """Records the logits rows of a closed step (``record_logits``). A request that
        finished (EOS) while this step was pending ran in it anyway; the scheduler dropped
        that token, so its row is not kept either; nor are the rows of rejected drafts."""
        ran = np.asarray(out.sample_ids, np.int64)
        if kept is not None:
            ran, logits = ran[kept], logits[torch.from_numpy(np.flatnonzero(kept))]
        ran_ids = ran.tolist()
        live = [rid for rid in ran_ids if rid not in self.result.outputs]
        _record_logits(self.logits_rows, live, ran_ids, logits)


def _drafter(
    config: ExecutorConfig, spec_tokens: int, device: torch.device
) -> NgramDrafter | DeviceNgramDrafter:
    """The run's n-gram drafter: the search on the GPU where the run is on one (its own
    stream: it waits for no step in flight), else the host drafter; the same drafts."""
    host = NgramDrafter(
        spec_tokens, config.drafter_max_ngram, config.drafter_min_ngram, config.drafter_max_search
    )
    return DeviceNgramDrafter(host, device) if device.type == "cuda" else host


def _previous_of(driver: StepDriver[_LaunchedStep]) -> _LaunchedStep | None:
    """The step in flight behind the one just scheduled (one step ahead), if any."""
    newest: PendingStep[_LaunchedStep] | None = driver.newest
    previous = newest.previous if newest is not None else None
    return previous.sampled if previous is not None else None


def _start_timeline(timeline: StepTimeline) -> float:
    """Records the step's start on the timeline; returns the seconds that took, which the
    table-build and metadata timings leave out: the event is instrumentation, and one CUDA
    event record costs tens of microseconds on the GPU host measured (docs/gpu-results.md)."""
    mark = time.perf_counter()
    timeline.start()
    return time.perf_counter() - mark


def _count_victims_that_generated(helix: HelixKVRank, out: Any, result: RunResult) -> None:
    """Adds the step's victims that had sampled a token to ``preempted_while_decoding``.

    Asked right after ``schedule()``, while every victim is live (one step ahead, a victim
    may finish when the older step closes), and of the victims only: no per-step pass over
    the batch. One step ahead, a token still in flight for a victim is not counted yet.
    """
    if len(out.preempted_ids):
        result.preempted_while_decoding += sum(
            helix.scheduler.request_metrics(rid).generated_tokens > 0
            for rid in np.asarray(out.preempted_ids, dtype=np.int64).tolist()
        )


def _take_finished(helix: HelixKVRank, result: RunResult, finished: Any) -> None:
    for request_id in np.asarray(finished, dtype=np.int64).tolist():
        output = helix.take_output(request_id)
        result.request_metrics[request_id] = dict(output.metrics.to_dict())
        result.outputs[request_id] = output.token_ids.tolist()


@dataclass
class _LaunchedStep:
    """A step whose device work is queued and whose ``update`` has not happened yet."""

    out: Any
    num_tokens: int
    num_generation: int
    num_entries: int
    tokens: torch.Tensor  # sampled tokens on the device, sample_ids order
    host_tokens: HostTokens  # their copy to the host
    logits: torch.Tensor | None  # kept for record_logits
    started: float  # perf_counter when its schedule() began
    fast: bool = False  # run on the decode fast path (its tokens are DecodeStep.tokens)


@renamed_keywords(cp="cp_size")
def run_group(
    jobs: Sequence[Job],
    cp_size: int,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
) -> list[list[RunResult]]:
    """Run ``(prompts, max_new_tokens, config)`` jobs one after another on a spawned CP group.

    All jobs share one group of ``cp_size`` processes (``config.cp_size`` must equal
    ``cp_size``; ``cp``: its deprecated name, kept for one release). Returns, per job, the
    result of every rank, after checking that the ranks agree on every step's digest, on the
    preempted requests and on the generated tokens.
    """
    for _, _, config in jobs:
        if config.cp_size != cp_size:
            raise ValueError(f"job for cp_size = {config.cp_size} in a group of {cp_size}")
    per_rank = spawn_group(
        _group_worker,
        cp_size,
        args=(list(jobs),),
        backend=backend,
        timeout_s=timeout_s,
        threads_per_rank=threads_per_rank,
    )
    per_job = [[per_rank[rank][job] for rank in range(cp_size)] for job in range(len(jobs))]
    for results in per_job:
        check_ranks_agree(results)
    return per_job


def check_ranks_agree(results: Sequence[RunResult]) -> None:
    """Raise if the ranks of one run disagree on decisions or outputs."""
    first = results[0]
    for other in results[1:]:
        for name in ("digests", "preempted", "outputs"):
            if getattr(other, name) != getattr(first, name):
                raise AssertionError(
                    f"rank {other.cp_rank} differs from rank {first.cp_rank} in {name}"
                )


def _group_worker(rank: int, world_size: int, jobs: list[Job]) -> list[RunResult]:
    return [run_rank(prompts, max_new, config) for prompts, max_new, config in jobs]


def _device(name: str) -> torch.device:
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record_logits(
    rows: dict[int, list[np.ndarray]],
    kept: Sequence[int],
    sample_ids: Sequence[int],
    logits: torch.Tensor,
) -> None:
    """Appends the logits rows of the requests in ``kept`` (rows in ``sample_ids`` order)."""
    host = logits.float().cpu().numpy() if logits.dtype == torch.bfloat16 else logits.cpu().numpy()
    keep = set(kept)
    for request_id, row in zip(sample_ids, host):
        if request_id in keep:
            rows.setdefault(request_id, []).append(row)


def _account_step(
    result: RunResult,
    out: Any,
    num_tokens: int,
    num_generation: int,
    num_entries: int,
    generated: int,
    seconds: float,
) -> None:
    result.digests.append(int(out.digest))
    result.preempted.append(np.asarray(out.preempted_ids, dtype=np.int64).tolist())
    result.tokens_run += num_tokens
    if num_generation and num_generation == num_entries:
        result.decode_steps += 1
        result.decode_tokens += generated
        result.decode_s += seconds
