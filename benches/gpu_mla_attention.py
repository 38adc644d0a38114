"""Device time of the Triton MLA paged decode attention alone (one layer, one rank), at
DeepSeek-V3's sizes (latent 512 + RoPE 64, 32 tokens per page, bf16): 16 query heads (a TP-8
shard of 128) and all 128, one split against split-K.

    python benches/gpu_mla_attention.py                          # 64 x 4096 and 8 x 32768
    python benches/gpu_mla_attention.py --heads 16 --shapes 1x131072 --splits off auto 32
    python benches/gpu_mla_attention.py --block-heads 16 --num-warps 8   # kernel tuning
    python benches/gpu_mla_attention.py --heads 128 --wide-block-heads 64   # wide tiles on

Each shape is ``rows x tokens`` (every row ``tokens`` local keys, pages scattered over the
pool). Each split setting (``off``: one split, ``auto``: the rule on rows x head tiles, ``N``)
is captured in a CUDA graph of ``--calls`` calls with a :class:`DecodeWorkspace` and replayed;
it prints the median µs per call, the latent bytes read per second (``rows x tokens x 576 x 2``
bytes: each row's cache read once; with several head tiles each tile reads it again, mostly
from L2) and the largest difference from the one-split result. CUDA only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch

from helix_kv.executor import paged_attention
from helix_kv.executor.paged_attention import (
    DecodeWorkspace,
    _mla_splits,
    paged_mla_decode_attention,
)

LATENT, ROPE = 512, 64
TOKENS_PER_BLOCK = 32
REPEATS = 20


def problem(rows: int, heads: int, local_tokens: int) -> dict[str, torch.Tensor]:
    """Random absorbed queries and a latent cache, each row's pages scattered over the pool."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = -(-local_tokens // TOKENS_PER_BLOCK)
    pages = rows * width
    table = torch.randperm(pages, device="cuda", generator=gen).view(rows, width)
    dim = LATENT + ROPE
    return {
        "query": torch.randn(rows, heads, dim, device="cuda", generator=gen).to(torch.bfloat16),
        "latent_cache": torch.randn(
            pages * TOKENS_PER_BLOCK, 1, dim, device="cuda", generator=gen
        ).to(torch.bfloat16),
        "block_table": table.to(torch.int32),
        "local_lens": torch.full((rows,), local_tokens, device="cuda", dtype=torch.int32),
    }


def split_count(setting: str, p: dict[str, torch.Tensor], heads: int) -> int:
    """The split count a setting gives for this problem."""
    if setting == "off":
        return 1
    if setting == "auto":
        rows, width = p["block_table"].shape
        return _mla_splits(rows, heads, LATENT, True, width, TOKENS_PER_BLOCK, None)[0]
    return int(setting)


def time_calls(
    p: dict[str, torch.Tensor], heads: int, splits: int, calls: int
) -> tuple[float, torch.Tensor]:
    """Median µs per call over graph replays of ``calls`` calls, and one call's output."""
    rows = p["block_table"].shape[0]
    workspace = DecodeWorkspace.allocate(rows, heads, LATENT, splits, torch.bfloat16, "cuda")

    def call() -> torch.Tensor:
        return paged_mla_decode_attention(
            p["query"],
            p["latent_cache"],
            p["block_table"],
            p["local_lens"],
            TOKENS_PER_BLOCK,
            LATENT,
            1.0 / math.sqrt(192),
            num_splits=splits,
            workspace=workspace,
        ).output

    out = call()  # compile outside the capture
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


def main() -> None:
    """Parse, run every head count, shape and split setting, print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--shapes", nargs="+", default=["64x4096", "8x32768"])
    parser.add_argument("--splits", nargs="+", default=["off", "auto", "4", "16"])
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--block-heads", type=int, default=paged_attention.MLA_BLOCK_HEADS)
    parser.add_argument("--block-elements", type=int, default=paged_attention.MLA_BLOCK_ELEMENTS)
    parser.add_argument("--num-warps", type=int, default=paged_attention.MLA_NUM_WARPS)
    parser.add_argument("--num-stages", type=int, default=paged_attention.MLA_NUM_STAGES)
    parser.add_argument(
        "--wide-block-heads",
        type=int,
        default=paged_attention.MLA_WIDE_BLOCK_HEADS,
        help="heads a wide tile, for requests of at least that many (0: off)",
    )
    parser.add_argument("--wide-num-warps", type=int, default=paged_attention.MLA_WIDE_NUM_WARPS)
    parser.add_argument(
        "--target-programs",
        type=int,
        default=paged_attention.MLA_TARGET_PROGRAMS,
        help="programs the auto split aims for (paged_attention.MLA_TARGET_PROGRAMS)",
    )
    parser.add_argument(
        "--full-programs",
        type=int,
        default=paged_attention.MLA_FULL_PROGRAMS,
        help="programs at which the auto split takes one (paged_attention.MLA_FULL_PROGRAMS)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_mla_attention.py needs a CUDA device")
    paged_attention.MLA_BLOCK_HEADS = args.block_heads
    paged_attention.MLA_BLOCK_ELEMENTS = args.block_elements
    paged_attention.MLA_NUM_WARPS = args.num_warps
    paged_attention.MLA_NUM_STAGES = args.num_stages
    paged_attention.MLA_WIDE_BLOCK_HEADS = args.wide_block_heads
    paged_attention.MLA_WIDE_NUM_WARPS = args.wide_num_warps
    paged_attention.MLA_TARGET_PROGRAMS = args.target_programs
    paged_attention.MLA_FULL_PROGRAMS = args.full_programs
    print(
        f"# {torch.cuda.get_device_name()}; latent {LATENT} + rope {ROPE}, "
        f"{TOKENS_PER_BLOCK} tokens per page, bf16; {args.block_heads} heads per program, "
        f"{args.block_elements} cache elements per key block, {args.num_warps} warps, "
        f"{args.num_stages} stages; wide tiles {args.wide_block_heads or 'off'} heads in "
        f"{args.wide_num_warps} warps; auto split aims for {args.target_programs} programs, "
        f"one at {args.full_programs}"
    )
    print(f"{'heads':>5} {'shape':>10} {'splits':>8} {'us':>9} {'GB/s':>8} {'max|d|':>9}")
    for heads in args.heads:
        for shape in args.shapes:
            rows, tokens = (int(x) for x in shape.split("x"))
            p = problem(rows, heads, tokens)
            latent_bytes = rows * tokens * (LATENT + ROPE) * 2
            baseline = None
            for setting in args.splits:
                splits = split_count(setting, p, heads)
                micros, out = time_calls(p, heads, splits, args.calls)
                if baseline is None:
                    baseline = out
                diff = (out - baseline).abs().max().item()
                label = f"{setting}={splits}" if setting == "auto" else setting
                print(
                    f"{heads:>5} {shape:>10} {label:>8} {micros:>9.1f} "
                    f"{latent_bytes / micros / 1e3:>8.0f} {diff:>9.2e}"
                )
            del p
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
