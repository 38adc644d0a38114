"""Speculative decoding in the reference Helix executor on one GPU: decode throughput with
prompt-lookup (n-gram) drafts against none, and the verification kernel's time per query token
against the plain decode kernel's.

    python benches/gpu_spec_decode.py                    # k = 4 vs 0, CUDA graphs, float32
    python benches/gpu_spec_decode.py --k 2 4 8          # several draft lengths
    python benches/gpu_spec_decode.py --path kernel      # eager fast path (no graphs)
    python benches/gpu_spec_decode.py --path reference   # the general path only
    python benches/gpu_spec_decode.py --overlap          # one step ahead as well
    python benches/gpu_spec_decode.py --group-draft-rows # a request's rows in one program
    python benches/gpu_spec_decode.py --dtype bfloat16 --requests 128 --prompt-len 1024
    python benches/gpu_spec_decode.py --tie-embeddings   # nearly every draft right: the ceiling
    python benches/gpu_spec_decode.py --kernel-only      # only the kernel timing
    python benches/gpu_spec_decode.py --draft-backoff 2  # the draft backoff on

The workload repeats itself: every prompt is a random pattern of ``--period`` tokens repeated
to ``--prompt-len``, and the greedy outputs of the randomly initialised model settle into
cycles, so the drafter finds matches. For each draft length it prints decode tokens/s (steps
that only decode), decode steps, tokens generated per decode step, the acceptance rate
(accepted over scheduled drafts), the scheduler's ``spec_decode_*`` metrics and whether the
tokens equal the ``k = 0`` run's (greedy verification keeps exactly the model's tokens; on a
GPU a different batch shape may move a near tie: ``parted`` counts the requests whose tokens
differ).

The kernel part times :func:`~helix_kv.executor.paged_attention.paged_decode_attention`
alone (captured in a CUDA graph, as the fast path runs it): ``requests`` rows of one query
each (plain decode) against ``requests * (1 + k)`` rows (verification: one row per query
token, each row's local length its causal mask), and prints µs per call and per query token,
for the plain kernel (one program per row) and for the verification kernel that attends a
request's ``1 + k`` rows in one program (``rows_per_request``, what the fast path runs with
drafts). CUDA only; exits with a message without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import numpy as np
import torch

from helix_kv.executor.bench import BENCH_MODEL
from helix_kv.executor.model import TinyConfig
from helix_kv.executor.paged_attention import DecodeWorkspace, paged_decode_attention
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_group, run_rank

REPEATS = 20


def repetitive_prompts(
    count: int, length: int, period: int, vocab_size: int, seed: int
) -> dict[int, list[int]]:
    """``count`` prompts, each a random pattern of ``period`` tokens repeated to ``length``."""
    rng = np.random.default_rng(seed)
    prompts = {}
    for i in range(count):
        pattern = rng.integers(0, vocab_size, size=period).tolist()
        prompts[i] = (pattern * (length // period + 1))[:length]
    return prompts


def config(args: argparse.Namespace, model: TinyConfig, k: int, overlap: bool) -> ExecutorConfig:
    superblock = args.tokens_per_block * args.cp
    per_request = -(-(args.prompt_len + args.new_tokens + k) // superblock)
    return ExecutorConfig(
        cp_size=args.cp,
        tokens_per_block=args.tokens_per_block,
        kv_superblocks=args.requests * per_request + 1,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        model=model,
        dtype=args.dtype,
        device="cuda",
        decode_kernel=args.path in ("kernel", "graphs"),
        cuda_graphs=args.path == "graphs",
        overlap=overlap,
        num_speculative_tokens=k,
        drafter_max_ngram=args.max_ngram,
        drafter_min_ngram=args.min_ngram,
        group_draft_rows=args.group_draft_rows,
        scheduler_options=(
            {"draft_backoff_misses": args.draft_backoff} if args.draft_backoff and k else {}
        ),
    )


def run_all(args: argparse.Namespace, model: TinyConfig) -> dict[tuple[int, bool], RunResult]:
    """Every (k, overlap) run on one group, after a warm-up run of the first."""
    prompts = repetitive_prompts(
        args.requests, args.prompt_len, args.period, model.vocab_size, args.seed
    )
    keys = [
        (k, overlap) for overlap in ([False, True] if args.overlap else [False]) for k in args.k
    ]
    keys = [(0, False)] + [key for key in keys if key != (0, False)]
    jobs = [(prompts, args.new_tokens, config(args, model, k, ov)) for k, ov in keys]
    jobs = [jobs[0], *jobs]  # the first job warms up (kernel compiles, allocator)
    if args.cp == 1:
        results = [run_rank(*job) for job in jobs]
    else:
        per_job = run_group(jobs, args.cp, backend="nccl", timeout_s=args.timeout)
        results = [ranks[0] for ranks in per_job]
    return dict(zip(keys, results[1:]))


def report(args: argparse.Namespace, runs: dict[tuple[int, bool], RunResult]) -> None:
    base = runs[0, False]
    print(
        f"{'k':>3} {'mode':>8} {'tok/s':>10} {'speedup':>8} {'steps':>6} {'dec.steps':>9} "
        f"{'tok/step':>8} {'tok/req/step':>12} {'accept':>7} {'fast':>5} {'equal':>6} parted"
    )
    for (k, overlap), run in runs.items():
        mode = "overlap" if overlap else "plain"
        speedup = run.decode_tokens_per_s / max(base.decode_tokens_per_s, 1e-9)
        per_request = run.decode_tokens / _decode_entries(run)
        equal = run.outputs == base.outputs
        parted = [rid for rid, tokens in base.outputs.items() if run.outputs.get(rid) != tokens]
        print(
            f"{k:>3} {mode:>8} {run.decode_tokens_per_s:>10,.0f} {speedup:>8.2f} "
            f"{len(run.digests):>6} {run.decode_steps:>9} {run.tokens_per_decode_step:>8.1f} "
            f"{per_request:>12.2f} {run.draft_acceptance_rate:>7.2f} {run.fast_path_steps:>5} "
            f"{equal!s:>6} {len(parted)}"
        )
    for (k, overlap), run in runs.items():
        if k:
            step_ms = 1e3 * run.decode_s / max(run.decode_steps, 1)
            print(
                f"  k={k} {'overlap' if overlap else 'plain'}: {step_ms:.2f} ms per decode step "
                f"(k=0: {1e3 * base.decode_s / max(base.decode_steps, 1):.2f}), drafting "
                f"{np.median(run.draft_us):.0f} us per step (median), {run.spec_decode}"
            )


def _decode_entries(run: RunResult) -> int:
    """Decode entries (request-steps) of the run's decode steps: generated tokens minus the
    accepted drafts (each entry generates 1 + its accepted drafts)."""
    accepted = int(run.metrics.get("spec_decode_num_accepted_tokens", 0))
    return max(run.decode_tokens - accepted, 1)


def kernel_problem(
    model: TinyConfig,
    requests: int,
    local_tokens: int,
    rows_per_request: int,
    tpb: int,
    cp: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Paged caches with every request's pages scattered, and ``rows_per_request`` query rows
    per request at consecutive positions: row ``j`` of a request sees ``local_tokens - (rows
    - 1 - j)`` keys (about the causal mask of a verified draft on one rank)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = -(-local_tokens // tpb)
    pages = requests * width
    table = torch.randperm(pages, device="cuda", generator=gen).view(requests, width)
    shape = (pages * tpb, model.num_kv_heads, model.head_dim)
    rows = requests * rows_per_request
    within = torch.arange(rows_per_request, device="cuda").repeat(requests)
    lens = local_tokens - (rows_per_request - 1 - within)
    positions = local_tokens * cp - (rows_per_request - 1 - within)
    return {
        "query": torch.randn(rows, model.num_heads, model.head_dim, device="cuda", generator=gen)
        .to(dtype)
        .contiguous(),
        "key_cache": torch.randn(shape, device="cuda", generator=gen).to(dtype),
        "value_cache": torch.randn(shape, device="cuda", generator=gen).to(dtype),
        "block_table": table.repeat_interleave(rows_per_request, dim=0).to(torch.int32),
        "local_lens": lens.clamp(min=0).to(torch.int32),
        "positions": positions.clamp(min=0).to(torch.int32),
    }


def time_kernel(
    p: dict[str, torch.Tensor],
    model: TinyConfig,
    tpb: int,
    cp: int,
    calls: int,
    rows_per_request: int,
) -> tuple[float, torch.Tensor]:
    """Median µs per call over CUDA-graph replays of ``calls`` calls (default split rule, a
    workspace as the fast path has), and one call's output. ``rows_per_request`` 1: one
    program per row; above: a request's rows in one program."""
    rows = p["query"].shape[0]
    workspace = DecodeWorkspace.for_decode(
        rows,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        p["block_table"].shape[1],
        tpb,
        p["query"].dtype,
        "cuda",
        rows_per_request,
    )

    def call() -> torch.Tensor:
        return paged_decode_attention(
            p["query"],
            p["key_cache"],
            p["value_cache"],
            p["block_table"],
            p["local_lens"],
            tpb,
            workspace=workspace,
            positions=p["positions"],
            rows_per_request=rows_per_request,
            tokens_per_superblock=tpb * cp,
        ).output

    out = call().clone()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times), out


def kernel_report(args: argparse.Namespace, model: TinyConfig) -> None:
    dtype = getattr(torch, args.dtype)
    tpb = args.tokens_per_block
    local = -(-(args.prompt_len + args.new_tokens) // args.cp)
    print(
        f"# paged decode kernel, {args.requests} requests x {local} local tokens (cp "
        f"{args.cp}), q/kv heads {model.num_heads}/{model.num_kv_heads}, head_dim "
        f"{model.head_dim}, {tpb} tokens per page, {args.dtype}"
    )
    print(
        "kernel: 'row' one program per query row (the plain decode kernel), 'request' a "
        "request's 1 + k rows in one program (each key block loaded once for them)"
    )
    print(
        f"{'k':>3} {'kernel':>8} {'rows':>6} {'us/call':>9} {'us/query':>9} "
        f"{'vs k=0/query':>12} {'max|d|':>9}"
    )
    plain = None
    for k in sorted({0, *args.k}):
        p = kernel_problem(model, args.requests, local, 1 + k, tpb, args.cp, dtype)
        rows = p["query"].shape[0]
        baseline = None
        for label, per_request in (("row", 1), ("request", 1 + k)):
            if label == "request" and k == 0:
                continue
            micros, out = time_kernel(p, model, tpb, args.cp, args.calls, per_request)
            baseline = out if baseline is None else baseline
            diff = float((out.float() - baseline.float()).abs().max())
            per_query = micros / rows
            plain = per_query if plain is None else plain
            print(
                f"{k:>3} {label:>8} {rows:>6} {micros:>9.1f} {per_query:>9.3f} "
                f"{per_query / plain:>12.2f} {diff:>9.2e}"
            )
        del p
        torch.cuda.empty_cache()


def main() -> None:
    """Parse, run the executor comparison and the kernel timing, print both."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="draft lengths (vs 0)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--period", type=int, default=32, help="tokens of each prompt's pattern")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--min-ngram", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--path", default="graphs", choices=["reference", "kernel", "graphs"])
    parser.add_argument("--overlap", action="store_true", help="also run one step ahead")
    parser.add_argument(
        "--group-draft-rows",
        action="store_true",
        help="attend a request's draft rows in one kernel program (ExecutorConfig option)",
    )
    parser.add_argument("--small", action="store_true", help="use the tiny test model")
    parser.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="tie the LM head to the embedding: the random model then mostly repeats its "
        "input, so nearly every draft is right (the ceiling of the drafted path)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--draft-backoff", type=int, default=0, metavar="MISSES",
        help="the scheduler's draft_backoff_misses (0: off): a request stops drafting for a "
        "while after this many drafted decodes in a row with no draft accepted",
    )  # fmt: skip
    parser.add_argument("--calls", type=int, default=20, help="kernel calls per graph")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--kernel-only", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_spec_decode.py needs a CUDA device")
    model = TinyConfig() if args.small else BENCH_MODEL
    if args.tie_embeddings:
        model = dataclasses.replace(model, tie_embeddings=True)
    print(
        f"# {torch.cuda.get_device_name()}; cp {args.cp}, {args.dtype}, path {args.path}; "
        f"{args.requests} requests x {args.prompt_len} prompt (period {args.period}) + "
        f"{args.new_tokens} new; n-grams {args.max_ngram}..{args.min_ngram}"
    )
    if not args.kernel_only:
        report(args, run_all(args, model))
    kernel_report(args, model)


if __name__ == "__main__":
    main()
