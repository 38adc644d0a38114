"""Decode throughput, table-build time and host gap of the reference executor (CPU/gloo or
GPU/NCCL), plain and one step ahead (overlap).

Used by ``benches/gpu_executor.py`` and by the CUDA tests, which print the figures. The host
gap is the device time between the end of one step's last kernel and the start of the next
step's first (CUDA events; not measured on the CPU, reported as ``nan``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from helix_kv._renamed import Renamed, renamed_fields
from helix_kv.executor.model import TinyConfig
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_group, run_rank

#: A model big enough that the GPU does real work per step, small enough to build in seconds.
BENCH_MODEL = TinyConfig(
    vocab_size=4096,
    hidden_size=1024,
    num_layers=4,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=2816,
    seed=0,
)


@renamed_fields
@dataclass(frozen=True)
class BenchSpec:
    """One measured workload (``cp``: the deprecated name of ``cp_size``, kept for one
    release)."""

    cp_size: int = 2
    requests: int = 64
    prompt_len: int = 512
    new_tokens: int = 128
    tokens_per_block: int = 32
    kv_tokens: int | None = None  # global KV budget; None: room for every request at once
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    dtype: str = "bfloat16"
    device: str = "cuda"
    model: TinyConfig = BENCH_MODEL
    seed: int = 0
    decode_kernel: bool = False  # Triton paged decode kernel + persistent-buffer fast path
    cuda_graphs: bool = False  # replay decode-only steps from CUDA graphs (implies the kernel)
    overlap: bool = False  # also run the workload one step ahead and report both
    host_tier_pages: int = 0  # each rank's host KV tier (suspend to host under pressure)
    prefix_caching: bool = False  # the scheduler's prefix cache (enable_prefix_caching)
    shared_prefix_len: int = 0  # leading tokens each prompt shares with others (0: none)
    system_prompts: int = 4  # distinct shared prefixes, dealt round robin over the prompts

    cp = Renamed[int]("cp_size")

    def __post_init__(self) -> None:
        if not 0 <= self.shared_prefix_len <= self.prompt_len:
            raise ValueError(
                f"shared_prefix_len {self.shared_prefix_len} must be within the prompt's "
                f"{self.prompt_len} tokens"
            )
        if self.system_prompts < 1:
            raise ValueError(f"system_prompts must be at least 1, got {self.system_prompts}")


def synthetic_prompts(
    count: int,
    length: int,
    vocab_size: int,
    seed: int,
    shared_prefix_len: int = 0,
    system_prompts: int = 1,
) -> dict[int, list[int]]:
    """``count`` random prompts of ``length`` tokens, ids ``0..count-1``; with
    ``shared_prefix_len``, prompt ``i`` starts with the first that many tokens of system prompt
    ``i % system_prompts`` (random too), then its own random tokens."""
    rng = np.random.default_rng(seed)
    if not shared_prefix_len:
        return {i: rng.integers(0, vocab_size, size=length).tolist() for i in range(count)}
    systems = rng.integers(0, vocab_size, size=(system_prompts, shared_prefix_len))
    return {
        i: systems[i % system_prompts].tolist()
        + rng.integers(0, vocab_size, size=length - shared_prefix_len).tolist()
        for i in range(count)
    }


def executor_config(
    spec: BenchSpec, time_table_build: bool, overlap: bool = False
) -> ExecutorConfig:
    """The executor configuration of a workload."""
    superblock = spec.tokens_per_block * spec.cp_size
    if spec.kv_tokens is None:  # every request's whole sequence at once
        per_request = -(-(spec.prompt_len + spec.new_tokens) // superblock)
        superblocks = spec.requests * per_request
    else:
        superblocks = max(1, spec.kv_tokens // superblock)
    return ExecutorConfig(
        cp_size=spec.cp_size,
        tokens_per_block=spec.tokens_per_block,
        kv_superblocks=superblocks,
        max_batch_size=spec.max_batch_size,
        max_num_tokens=spec.max_num_tokens,
        model=spec.model,
        dtype=spec.dtype,
        device=spec.device,
        time_table_build=time_table_build,
        decode_kernel=spec.decode_kernel,
        cuda_graphs=spec.cuda_graphs,
        overlap=overlap,
        host_tier_pages=spec.host_tier_pages,
        scheduler_options={"enable_prefix_caching": True} if spec.prefix_caching else {},
    )


def measure(
    spec: BenchSpec, timeout_s: float = 300.0, single_run: bool = False
) -> dict[str, float]:
    """Run the workload on one group: once timing the table build (a device sync per step),
    once untimed for throughput and host gap (``single_run``: only the timed run, which gives
    both), and with ``spec.overlap`` once more, untimed, one step ahead. Returns rank 0's
    figures (``overlap_*`` for the overlap run)."""
    prompts = synthetic_prompts(
        spec.requests,
        spec.prompt_len,
        spec.model.vocab_size,
        spec.seed,
        spec.shared_prefix_len,
        spec.system_prompts,
    )
    jobs = [(prompts, spec.new_tokens, executor_config(spec, time_table_build=True))]
    if not single_run:
        jobs.append((prompts, spec.new_tokens, executor_config(spec, time_table_build=False)))
    if spec.overlap:
        jobs.append((prompts, spec.new_tokens, executor_config(spec, False, overlap=True)))
    if spec.cp_size == 1:
        results = [run_rank(*job) for job in jobs]
    else:
        backend = "nccl" if spec.device == "cuda" else "gloo"
        per_job = run_group(jobs, spec.cp_size, backend=backend, timeout_s=timeout_s)
        results = [ranks[0] for ranks in per_job]
    plain = results[-2] if spec.overlap else results[-1]
    numbers = figures(results[0], plain)
    if spec.overlap:
        numbers.update(overlap_figures(plain, results[-1]))
    return numbers


def figures(timed: RunResult, untimed: RunResult) -> dict[str, float]:
    """The reported numbers of one measured workload."""
    build = np.asarray(timed.table_build_us[1:] or timed.table_build_us)  # drop the warm-up
    return {
        "decode_tokens_per_s": untimed.decode_tokens_per_s,
        "decode_steps": float(untimed.decode_steps),
        "decode_step_ms": 1e3 * untimed.decode_s / max(untimed.decode_steps, 1),
        "tokens_per_s_overall": untimed.tokens_run / untimed.total_s,
        "table_build_us_median": float(np.median(build)),
        "table_build_us_p90": float(np.percentile(build, 90)),
        "metadata_host_us_median": float(np.median(timed.metadata_host_us or [0.0])),
        "schedule_us_median": float(np.median(untimed.schedule_us)),
        **host_gap_figures(untimed),
        "steps": float(len(untimed.digests)),
        "fast_path_steps": float(untimed.fast_path_steps),
        "preemptions": float(untimed.preemptions),
        "suspensions": float(untimed.metrics.get("suspensions", 0)),
        "recomputed_tokens": float(untimed.metrics.get("recomputed_tokens", 0)),
        "capacity_superblocks": float(untimed.capacity_superblocks),
        # tokens the forward ran (prompts, recomputes, decodes): prefix-cache hits skip theirs
        "tokens_run": float(untimed.tokens_run),
        "run_s": untimed.total_s,
        "prefix_cache_hits": float(untimed.metrics.get("prefix_cache_hits", 0)),
        "prefix_cache_queries": float(untimed.metrics.get("prefix_cache_queries", 0)),
    }


def host_gap_figures(run: RunResult, prefix: str = "") -> dict[str, float]:
    """Median and p90 µs the device idled between steps (``nan`` without CUDA events)."""
    gaps = np.asarray(run.host_gap_us[1:] or run.host_gap_us)  # drop the warm-up
    median = float(np.median(gaps)) if gaps.size else float("nan")
    p90 = float(np.percentile(gaps, 90)) if gaps.size else float("nan")
    return {f"{prefix}host_gap_us_median": median, f"{prefix}host_gap_us_p90": p90}


def overlap_figures(plain: RunResult, overlap: RunResult) -> dict[str, float]:
    """The overlap run's figures next to the plain run's; ``overlap_outputs_equal`` is 1.0
    when both generated the same tokens (greedy; on a GPU a different batch composition may
    move a near-tie, see :mod:`helix_kv.executor.agreement`)."""
    return {
        "overlap_decode_tokens_per_s": overlap.decode_tokens_per_s,
        "overlap_decode_step_ms": 1e3 * overlap.decode_s / max(overlap.decode_steps, 1),
        "overlap_tokens_per_s_overall": overlap.tokens_run / overlap.total_s,
        **host_gap_figures(overlap, "overlap_"),
        "overlap_speedup": overlap.decode_tokens_per_s / max(plain.decode_tokens_per_s, 1e-9),
        "overlap_steps": float(len(overlap.digests)),
        "overlap_preemptions": float(overlap.preemptions),
        "overlap_outputs_equal": float(overlap.outputs == plain.outputs),
    }


def format_figures(spec: BenchSpec, numbers: dict[str, float]) -> str:
    """One readable line per figure."""
    device = (
        torch.cuda.get_device_name(0)
        if spec.device == "cuda" and torch.cuda.is_available()
        else spec.device
    )
    head = (
        f"helix_kv executor: cp={spec.cp_size} {spec.dtype} on {device}, {spec.requests} requests "
        f"x {spec.prompt_len} prompt + {spec.new_tokens} new, tpb={spec.tokens_per_block}, "
        f"decode kernel {'on' if spec.decode_kernel or spec.cuda_graphs else 'off'}, "
        f"CUDA graphs {'on' if spec.cuda_graphs else 'off'}"
        + (", plain and overlap" if spec.overlap else "")
        + (", prefix caching" if spec.prefix_caching else "")
        + (
            f", prompts share {spec.shared_prefix_len} tokens with one of "
            f"{spec.system_prompts} system prompts"
            if spec.shared_prefix_len
            else ""
        )
    )
    lines = [head] + [f"  {name}: {value:,.1f}" for name, value in numbers.items()]
    return "\n".join(lines)
