"""Device time of the Triton paged decode attention alone (one layer, one rank), one split
against split-K (flash-decoding), at the executor bench's geometry (16 query / 4 kv heads of
64, 32 tokens per page, bf16).

    python benches/gpu_paged_attention.py                  # 64 x 640 and 256 x 4224 tokens
    python benches/gpu_paged_attention.py --cp 2           # each rank's half of those keys
    python benches/gpu_paged_attention.py --shapes 8x32768 --splits off auto 4 16
    python benches/gpu_paged_attention.py --block-keys 64 --num-warps 8   # kernel tuning

Each shape is ``requests x tokens`` (every request ``tokens`` long; a rank holds
``tokens / cp`` of them, pages scattered over the pool). Each split setting (``off``: one
split, ``auto``: :func:`~helix_kv.executor.paged_attention.decode_splits`, ``N``) is captured
in a CUDA graph of ``--calls`` calls (with a :class:`DecodeWorkspace`, as a captured step
would) and replayed; it prints the median µs per call, the KV bytes read per second, and the
largest difference from the one-split result. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from helix_kv.executor import paged_attention
from helix_kv.executor.bench import BENCH_MODEL
from helix_kv.executor.paged_attention import (
    DecodeWorkspace,
    decode_splits,
    paged_decode_attention,
)

TOKENS_PER_BLOCK = 32
REPEATS = 20


def problem(requests: int, local_tokens: int, dtype: torch.dtype) -> dict[str, object]:
    """Random queries and caches, each request's pages scattered over the pool."""
    c = BENCH_MODEL
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = -(-local_tokens // TOKENS_PER_BLOCK)
    pages = requests * width
    table = torch.randperm(pages, device="cuda", generator=gen).view(requests, width)
    shape = (pages * TOKENS_PER_BLOCK, c.num_kv_heads, c.head_dim)
    return {
        "query": torch.randn(requests, c.num_heads, c.head_dim, device="cuda", generator=gen).to(
            dtype
        ),
        "key_cache": torch.randn(shape, device="cuda", generator=gen).to(dtype),
        "value_cache": torch.randn(shape, device="cuda", generator=gen).to(dtype),
        "block_table": table.to(torch.int32),
        "local_lens": torch.full((requests,), local_tokens, device="cuda", dtype=torch.int32),
    }


def split_count(setting: str, p: dict[str, object]) -> int:
    """The split count a setting gives for this problem."""
    if setting == "off":
        return 1
    if setting == "auto":
        table = p["block_table"]
        assert isinstance(table, torch.Tensor)
        return decode_splits(
            table.shape[0], BENCH_MODEL.num_kv_heads, table.shape[1], TOKENS_PER_BLOCK
        )
    return int(setting)


def time_calls(p: dict[str, object], splits: int, calls: int) -> tuple[float, torch.Tensor]:
    """Median µs per call over graph replays of ``calls`` calls, and one call's output."""
    c = BENCH_MODEL
    requests = p["block_table"].shape[0]  # type: ignore[attr-defined]
    workspace = DecodeWorkspace.allocate(
        requests, c.num_heads, c.head_dim, max(splits, 1), torch.bfloat16, "cuda"
    )

    def call() -> torch.Tensor:
        return paged_decode_attention(
            **p,  # type: ignore[arg-type]
            tokens_per_block=TOKENS_PER_BLOCK,
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
    """Parse, run every shape and split setting, print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["64x640", "256x4224"])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--splits", nargs="+", default=["off", "auto", "2", "4", "8", "16"])
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--block-keys", type=int, default=paged_attention.DECODE_BLOCK_KEYS)
    parser.add_argument("--num-warps", type=int, default=paged_attention.DECODE_NUM_WARPS)
    parser.add_argument("--num-stages", type=int, default=paged_attention.DECODE_NUM_STAGES)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_paged_attention.py needs a CUDA device")
    paged_attention.DECODE_BLOCK_KEYS = args.block_keys
    paged_attention.DECODE_NUM_WARPS = args.num_warps
    paged_attention.DECODE_NUM_STAGES = args.num_stages
    c = BENCH_MODEL
    print(
        f"# {torch.cuda.get_device_name()}; q/kv heads {c.num_heads}/{c.num_kv_heads}, "
        f"head_dim {c.head_dim}, {TOKENS_PER_BLOCK} tokens per page, bf16; "
        f"{args.block_keys} keys per block, {args.num_warps} warps, {args.num_stages} stages"
    )
    print(f"{'shape':>10} {'cp':>3} {'local':>6} {'splits':>6} {'us':>9} {'GB/s':>8} {'max|d|':>9}")
    for shape in args.shapes:
        requests, tokens = (int(x) for x in shape.split("x"))
        for cp in args.cp:
            local = -(-tokens // cp)
            p = problem(requests, local, torch.bfloat16)
            kv_bytes = 2 * requests * local * c.num_kv_heads * c.head_dim * 2
            baseline = None
            for setting in args.splits:
                splits = split_count(setting, p)
                micros, out = time_calls(p, splits, args.calls)
                if baseline is None:
                    baseline = out
                diff = (out - baseline).abs().max().item()
                label = f"{setting}={splits}" if setting == "auto" else setting
                print(
                    f"{shape:>10} {cp:>3} {local:>6} {label:>6} {micros:>9.1f} "
                    f"{kv_bytes / micros / 1e3:>8.0f} {diff:>9.2e}"
                )
            del p
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
