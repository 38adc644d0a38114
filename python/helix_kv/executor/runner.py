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
    ``drafter_max_search`` tokens, ``None``: all) and verified greedily in the same forward;
    the outputs are the greedy tokens without drafts, token for token. On the fast path a
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
    device = _device(config.device)
    dtype = getattr(torch, config.dtype)
    kv_dtype = getattr(torch, config.kv_dtype) if config.kv_dtype else dtype
    fast_path = config.decode_kernel or config.cuda_graphs
    model = build_model(config.model, dtype, device, fast_path)
    geometry = model.config
    options = dict(config.scheduler_options)
    if config.num_speculative_tokens:
        options["num_speculative_tokens"] = config.num_speculative_tokens
    engine = EngineConfig(
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.cache_heads,
        head_dim=geometry.cache_head_dim,
        kv_factor=geometry.kv_factor,
        dtype_bytes=torch.empty((), dtype=kv_dtype).element_size(),
        tokens_per_block=config.tokens_per_block,
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        **options,
    )
    spec_tokens = int(engine.num_speculative_tokens)
    eos_ids = _eos_ids(config.eos_token_id)
    drafter = (
        NgramDrafter(
            spec_tokens,
            config.drafter_max_ngram,
            config.drafter_min_ngram,
            config.drafter_max_search,
        )
        if spec_tokens
        else None
    )
    if config.host_tier_pages:
        engine = dataclasses.replace(
            engine,
            aggregated_host_tier=True,
            host_cache_bytes=config.host_tier_pages * engine.page_bytes,
        )

    def allocate_pool(built: HelixKVRank) -> KVPool:
        placement = RankPlacement(built.cp_size, config.tokens_per_block, built.cp_rank)
        return model.new_kv_pool(placement, built.capacity_superblocks, kv_dtype)

    # quota sync (MIN over the ranks' budgets) + init-status sync + optional schedule check
    helix = HelixKVRank.create(
        engine,
        config.kv_superblocks * engine.page_bytes,
        group,
        allocate=allocate_pool,
        check_schedule=config.check_schedule,
    )
    if helix.cp_size != config.cp_size:
        raise ValueError(
            f"cp_size = {config.cp_size} but the process group has {helix.cp_size} ranks"
        )
    cp_rank, pool = helix.cp_rank, helix.kv_storage
    placement = pool.placement
    host_pool = (
        HostKVPool(pool, helix.host_tier_superblocks) if helix.host_tier_superblocks else None
    )
    # The loop drives the scheduler contract (helix_kv.contract.SchedulerProtocol) through
    # ``helix``; only the step plan reads this rank's block tables from its scheduler.
    for request_id, prompt in prompts.items():
        budget = max_new_tokens if isinstance(max_new_tokens, int) else max_new_tokens[request_id]
        helix.add_request(int(request_id), np.asarray(prompt, dtype=np.int32), budget)

    combine = group_combine(group)
    decode_step = None
    if fast_path:
        budgets = [max_new_tokens] if isinstance(max_new_tokens, int) else max_new_tokens.values()
        longest = max((len(p) for p in prompts.values()), default=1) + max(budgets, default=1)
        max_pages = config.max_pages_per_request or placement.layout.superblocks_for(longest)
        # With drafts a row per query token: up to 1 + K per request, within the token budget.
        max_rows = config.max_batch_size
        if spec_tokens:
            max_rows = min(
                config.max_batch_size * (1 + spec_tokens),
                max(config.max_batch_size, config.max_num_tokens),
            )
        buckets = config.graph_batch_sizes
        if buckets is not None:
            buckets = tuple(sorted({b for b in buckets if b < max_rows} | {max_rows}))
        metadata = DecodeMetadata(DecodeLayout(max_rows, max_pages), device, buckets)
        # collective when graphed: every rank captures the same buckets in the same order
        decode_step = DecodeStep(
            model,
            pool,
            combine,
            metadata,
            config.cuda_graphs,
            # grouped draft rows: the Llama family's kernel only
            rows_per_request=1 + spec_tokens if config.group_draft_rows and not model.mla else 1,
        )
    result = RunResult(cp_rank, {}, {}, {}, [], [], helix.capacity_superblocks)
    logits_rows: dict[int, list[np.ndarray]] = {}
    gather, readback, timeline = (
        DecodeInputGather(device),
        TokenReadback(device),
        StepTimeline(device, enabled=config.step_timeline),
    )
    broadcast_src = dist.get_global_rank(group, 0) if group else 0
    driver: StepDriver[_LaunchedStep] = StepDriver(helix, one_step_ahead=config.overlap)
    #: The requests of the step closed last that sampled a token in it (drafting candidates).
    last_sampled: list[int] = []

    def propose(drafter: NgramDrafter) -> None:
        """Drafts for the requests that may decode in the step scheduled next, from the
        tokens known on the host (identical on every rank). One step ahead, a request whose
        newest token is still being sampled by the pending step drafts past it (``skip=1``);
        one whose pending decode carries drafts is left out (it is not planned again before
        that step closes)."""
        skips: dict[int, int] = {}
        pending = driver.newest
        if pending is not None:
            p_out = pending.output
            p_gen = np.asarray(p_out.generation_ids, dtype=np.int64)
            p_drafted = generation_draft_counts(p_out, len(p_gen)) > 0
            p_ctx = np.asarray(p_out.context_ids, dtype=np.int64)
            p_done = np.asarray(p_out.context_completes, dtype=bool)
            blocked = set(p_gen[p_drafted].tolist())
            for rid in p_gen[~p_drafted].tolist() + p_ctx[p_done].tolist():
                skips[rid] = 1
            for rid in p_ctx[~p_done].tolist():
                blocked.add(rid)
        else:
            blocked = set()
        for rid in last_sampled:
            if rid not in skips and rid not in blocked:
                skips[rid] = 0
        ids = [rid for rid in skips if rid not in result.outputs]
        if not ids:
            return
        histories = [helix.scheduler.tokens(rid) for rid in ids]
        counts, tokens = drafter.propose(histories, [skips[rid] for rid in ids])
        drafted = counts > 0
        if drafted.any():
            driver.propose_drafts(np.asarray(ids, dtype=np.int64)[drafted], counts[drafted], tokens)
            result.proposed_draft_tokens += int(counts.sum())

    def launch() -> _LaunchedStep:
        """Schedules the next step and queues its device work, after the step in flight's
        (overlap mode: its sampled tokens are read on the device)."""
        step_start = time.perf_counter()
        if drafter is not None:
            propose(drafter)
            result.draft_us.append((time.perf_counter() - step_start) * 1e6)
        out = driver.schedule()
        build_start = time.perf_counter()
        result.schedule_us.append((build_start - step_start) * 1e6)
        _count_victims_that_generated(helix, out, result)
        if host_pool is not None:
            host_pool.copy_step(out)  # queued before anything of the step writes KV
        if decode_step is not None:
            # The fast path, also one step ahead (inputs in flight gathered in its graph).
            launched = _launch_decode_step(
                decode_step,
                helix.scheduler,
                out,
                config,
                result,
                _previous_of(driver),
                timeline,
                (step_start, build_start),
                group,
                broadcast_src,
            )
            if launched is not None:
                result.fast_path_steps += 1
                return launched
        plan = StepPlan.from_schedule(helix.scheduler, out, placement)
        build_start += _start_timeline(timeline)  # instrumentation, not table building
        batch = pool.prepare(plan)
        token_offsets = plan.token_offsets  # a drafted entry's input token starts its tokens
        driver.gather_inputs(
            lambda entries, rows, previous: gather.apply(
                batch.token_ids, token_offsets[entries], rows, previous.tokens
            )
        )
        if config.time_table_build:
            _synchronize(device)
            result.table_build_us.append((time.perf_counter() - build_start) * 1e6)
        tokens = torch.zeros(out.num_samples, dtype=torch.int64, device=device)
        logits = None
        if plan.num_tokens:
            logits = model.logits(model.forward(batch, pool, combine)[batch.sample_index])
            tokens = logits.argmax(dim=-1)
        if config.cp_size > 1 and out.num_samples:
            # ranks compute identical logits; broadcasting makes identical tokens a guarantee
            dist.broadcast(tokens, src=broadcast_src, group=group)
        host_tokens = readback.start(tokens)
        timeline.end()
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

    def close(step: _LaunchedStep, last_close: float) -> float:
        """Feeds the oldest pending step its sampled tokens; returns when it closed."""
        helix.finish_check()  # before blocking on the step's device work (see finish_check)
        tokens = step.host_tokens.wait()
        eos = None if eos_ids is None else np.isin(tokens, eos_ids)
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
        finished = driver.complete(tokens, eos, accepted)
        closed = time.perf_counter()
        sampled_ids = np.asarray(out.generation_ids, dtype=np.int64).tolist()
        ctx_done = np.asarray(out.context_completes, dtype=bool)
        sampled_ids += np.asarray(out.context_ids, dtype=np.int64)[ctx_done].tolist()
        last_sampled[:] = sampled_ids
        if step.logits is not None:
            # A request that finished (EOS) while this step was pending ran in it anyway;
            # the scheduler dropped that token, so its row is not kept either; nor are the
            # rows of rejected drafts.
            ran = np.asarray(out.sample_ids, np.int64)
            step_logits = step.logits
            if kept is not None:
                ran, step_logits = ran[kept], step_logits[torch.from_numpy(np.flatnonzero(kept))]
            ran_ids = ran.tolist()
            _record_logits(
                logits_rows,
                [rid for rid in ran_ids if rid not in result.outputs],
                ran_ids,
                step_logits,
            )
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

    started = last_close = time.perf_counter()
    while helix.has_unfinished() or driver.pending:
        if helix.has_unfinished():
            if len(result.digests) + driver.pending >= config.max_steps:
                raise RuntimeError(f"no completion after {config.max_steps} steps")
            driver.launched(launch())
        due = driver.due(final=not helix.has_unfinished())
        if due is not None:
            last_close = close(due.sampled, last_close)
    result.total_s = time.perf_counter() - started
    result.host_gap_us = timeline.gaps_us()
    result.metrics = dict(helix.metrics().to_dict())
    if host_pool is not None:
        result.host_tier_superblocks = host_pool.num_pages
        result.host_bytes_out, result.host_bytes_in = host_pool.bytes_out, host_pool.bytes_in
    result.logits = {rid: np.stack(rows) for rid, rows in logits_rows.items()}
    return result


def _launch_decode_step(
    step: DecodeStep,
    scheduler: Any,
    out: Any,
    config: ExecutorConfig,
    result: RunResult,
    previous: _LaunchedStep | None,
    timeline: StepTimeline,
    started: tuple[float, float],
    group: dist.ProcessGroup | None,
    broadcast_src: int,
) -> _LaunchedStep | None:
    """Queues a decode-only step on the fast path (its rows written by one core call, one
    H2D copy, a graph replay); ``None`` (nothing queued) when the step has context chunks
    or a request wider than the layout. Inputs still in flight (``previous`` pending, one
    step ahead) are gathered on the device from the previous step's samples."""
    if len(out.context_ids) or not len(out.generation_ids):
        return None
    counts = step.metadata.fill_if_fits(scheduler, out)
    if counts is None:  # more rows or pages than the layout holds
        return None
    rows = counts.rows
    result.fast_path_inputs_in_flight += counts.in_flight
    if rows > len(out.generation_ids):  # one row per query token: drafts to verify
        result.fast_path_draft_steps += 1
    step_start, build_start = started
    build_start += _start_timeline(timeline)  # instrumentation, not metadata work
    if counts.in_flight:
        if previous is None:
            raise RuntimeError(
                "the step reads sampled tokens of a previous step, but none is in flight"
            )
        if not previous.fast:  # a fast-path step sampled into step.tokens already
            step.take_previous(previous.tokens)
    if config.time_table_build and not step.graphed:
        bucket = step.metadata.upload(rows)
        result.metadata_host_us.append((time.perf_counter() - build_start) * 1e6)
        step.metadata.wait_uploaded()
        result.table_build_us.append((time.perf_counter() - build_start) * 1e6)
        step.run(bucket)
    else:
        if config.time_table_build:  # graphed: the copy is the graph's first node
            ready_us = (time.perf_counter() - build_start) * 1e6
            result.metadata_host_us.append(ready_us)
            result.table_build_us.append(ready_us)
        # Graphed: one replay (the H2D copy of the rows, then the forward), no event; the
        # staging buffer is released when this step's readback is waited (close), before
        # the step after next fills it (checked: StagingBufferBusy).
        step.launch(rows)
    tokens = step.tokens[:rows]
    if config.cp_size > 1:
        # ranks compute identical logits; broadcasting makes identical tokens a guarantee
        dist.broadcast(tokens, src=broadcast_src, group=group)
    host_tokens = step.start_readback(rows)
    timeline.end()
    # The logits buffer is overwritten by the next step: kept ones are copied.
    logits = step.logits[:rows].clone() if config.record_logits else None
    entries = len(out.generation_ids)  # rows: one per query token (1 + drafts per entry)
    return _LaunchedStep(out, rows, entries, entries, tokens, host_tokens, logits, step_start, True)


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
