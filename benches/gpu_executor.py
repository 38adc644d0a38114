"""Decode throughput, per-step block-table build time and host gap of the reference Helix
executor, plain and (with ``--overlap``) one step ahead.

    python benches/gpu_executor.py                      # cp = 2 over NCCL, bf16, 2 GPUs
    python benches/gpu_executor.py --overlap            # the same, plain and overlap
    python benches/gpu_executor.py --cp 1 --dtype float32
    python benches/gpu_executor.py --kv-tokens 20000     # a tight pool: preemptions
    python benches/gpu_executor.py --kv-tokens 20000 --host-tier-pages 512  # ... suspended
    python benches/gpu_executor.py --decode-kernel       # Triton paged decode, eager
    python benches/gpu_executor.py --cuda-graphs         # ... and CUDA-graph decode steps
    python benches/gpu_executor.py --cuda-graphs --split-k off   # ... one split per request
    python benches/gpu_executor.py --cuda-graphs --requests 256 --prompt-len 4096 \
        --max-batch-size 256
    python benches/gpu_executor.py --shared-prefix-len 448 [--prefix-caching]  # prefix reuse
    python benches/gpu_executor.py --device cpu --cp 2 --requests 8 --prompt-len 64 \
        --new-tokens 16 --small                         # CPU/gloo smoke run
    python benches/gpu_executor.py --export-step-time-profile llama.json [--model-family mla]

Prints decode tokens/s (steps that only decode), the median / p90 µs per step to build the
step's device tables (plan from the scheduler's arrays, pinned staging, async copy, device
expansion; measured with a device sync; on the decode fast path: filling the pinned metadata
rows, one H2D copy, sync), the host gap between GPU steps (CUDA events: from the end of step
t's last kernel to the start of step t + 1's first; ``nan`` on the CPU) and the preemptions the
run needed. ``--overlap`` runs the workload once more one step ahead (step t + 1 scheduled and
queued while step t runs) and adds its ``overlap_*`` figures: decode tokens/s, host gap,
speedup, and whether its tokens equal the plain run's. ``--shared-prefix-len N`` starts every
prompt with the first ``N`` tokens of one of ``--system-prompts`` random system prompts;
with ``--prefix-caching`` their pages are reused: ``prefix_cache_hits`` (of
``prefix_cache_queries``) and fewer ``tokens_run`` than the same workload without it, and
``run_s`` the whole run's wall time.

``--export-step-time-profile FILE`` instead measures a sweep of workloads step by step (one
rank, ``--model-family``'s stack of ``benches/gpu_decode_floor.py`` at ``--layers`` layers,
CUDA graphs unless ``--no-cuda-graphs``), fits the step-time model's three coefficients and
writes them as a profile ``helix-kv simulate --step-time-profile`` reads
(``benches/gpu_step_profile.py`` says how); with ``--device cpu --small``, the tiny models.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from helix_kv.executor.bench import BenchSpec, format_figures, measure
from helix_kv.executor.model import TinyConfig


def main() -> None:
    """Parse the workload, run it, print the figures."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchSpec()
    parser.add_argument("--cp", type=int, default=defaults.cp_size)
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--tokens-per-block", type=int, default=defaults.tokens_per_block)
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="global KV budget in tokens (default: everything fits)",
    )
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    parser.add_argument("--max-num-tokens", type=int, default=defaults.max_num_tokens)
    parser.add_argument(
        "--dtype", default=defaults.dtype, choices=["float64", "float32", "bfloat16"]
    )
    parser.add_argument("--device", default=defaults.device, choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="use the tiny test model")
    parser.add_argument(
        "--decode-kernel",
        action="store_true",
        help="Triton paged decode attention; decode-only steps on the persistent-buffer path",
    )
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="replay decode-only steps from CUDA graphs"
    )
    parser.add_argument(
        "--single-run",
        action="store_true",
        help="one run (tables timed with a sync per step) instead of a timed and an untimed one",
    )
    parser.add_argument(
        "--overlap", action="store_true", help="also run one step ahead and report both"
    )
    parser.add_argument(
        "--host-tier-pages",
        type=int,
        default=0,
        help="each rank's host KV tier in pages: suspend to host instead of recomputing",
    )
    parser.add_argument(
        "--prefix-caching", action="store_true", help="the scheduler's prefix cache on"
    )
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=defaults.shared_prefix_len,
        help="leading tokens each prompt shares with one of --system-prompts (0: none)",
    )
    parser.add_argument("--system-prompts", type=int, default=defaults.system_prompts)
    parser.add_argument(
        "--split-k",
        default="auto",
        help="splits of the paged decode kernel: auto (the static rule), off (one) or N; "
        "sets HELIX_KV_DECODE_SPLITS for the ranks",
    )
    profile = parser.add_argument_group("step-time profile (--export-step-time-profile)")
    profile.add_argument(
        "--export-step-time-profile",
        metavar="FILE",
        default=None,
        help="measure a sweep of steps, fit the step-time model, write its profile to FILE",
    )
    profile.add_argument("--model-family", default="llama", choices=["llama", "mla"])
    profile.add_argument("--layers", type=int, default=32, help="layers of the profiled stack")
    profile.add_argument(
        "--no-cuda-graphs", dest="profile_graphs", action="store_false", help="eager decode steps"
    )
    profile.add_argument(
        "--time-budget", type=float, default=120.0, help="seconds; later workloads are skipped"
    )
    args = parser.parse_args()
    os.environ["HELIX_KV_DECODE_SPLITS"] = args.split_k
    if args.export_step_time_profile:
        export_profile(args)
        return
    spec = BenchSpec(
        cp_size=args.cp,
        requests=args.requests,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        tokens_per_block=args.tokens_per_block,
        kv_tokens=args.kv_tokens,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        dtype=args.dtype,
        device=args.device,
        model=TinyConfig() if args.small else defaults.model,
        decode_kernel=args.decode_kernel,
        cuda_graphs=args.cuda_graphs,
        overlap=args.overlap,
        host_tier_pages=args.host_tier_pages,
        prefix_caching=args.prefix_caching,
        shared_prefix_len=args.shared_prefix_len,
        system_prompts=args.system_prompts,
    )
    print(format_figures(spec, measure(spec, single_run=args.single_run)))


def export_profile(args: argparse.Namespace) -> None:
    """``--export-step-time-profile``: :func:`gpu_step_profile.export` with this run's options."""
    if args.device == "cpu":  # before triton is first imported: the kernels' interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--export-step-time-profile needs a CUDA device (or --device cpu --small)")
    from gpu_step_profile import export  # benches/ is on sys.path

    args.cuda_graphs = args.profile_graphs
    args.dtype = "float32" if args.device == "cpu" and args.dtype == "bfloat16" else args.dtype
    export(args)


if __name__ == "__main__":
    main()
