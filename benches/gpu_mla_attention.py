"""Device time of the Triton MLA paged decode attention alone (one layer, one rank), at
DeepSeek-V3's sizes (latent 512 + RoPE 64, 32 tokens per page, bf16), tiling by tiling,
against the copy bandwidth, the bf16 matmul rate and the kernel's own roofline.

    python benches/gpu_mla_attention.py                     # 32 and 128 heads, every tiling
    python benches/gpu_mla_attention.py --heads 32 --shapes 64x2112 --tilings h32-k32-w4-s2 \\
        h32-k16-w4-s5-pf                                   # any fields, named or not
    python benches/gpu_mla_attention.py --split-sweep 2 4 8 16   # forced splits, best tiling
    python benches/gpu_mla_attention.py --json runs.jsonl --best-out best.txt

Each shape is ``rows x tokens`` (every row ``tokens`` local keys, pages scattered over the
pool). Each (head count, shape, tiling) is captured in a CUDA graph of ``--calls`` calls
with a :class:`DecodeWorkspace` and replayed (the split count: the tiling's rule, ``auto``;
with ``--split-sweep``, the best tiling of each head count and shape again at each forced
count). Per call it prints the median µs, the bytes the kernel must move (each latent once,
the queries, the float32 outputs and LSEs) per second and that over the copy bandwidth, its
FLOPs (``2 x (latent + rope + latent)`` a head and key: scores and values) per second and
that over the matmul rate, the share of the kernel's roofline (the larger of bytes / copy
bandwidth and FLOPs / matmul rate, over the time), and the largest difference from the
``--baseline`` tiling's output. Both rates are measured at the start of the run
(``gpu_decode_floor.copy_bandwidth`` / ``matmul_rate``). Last, a summary a head count and
shape: the baseline, the best tiling, and the issue's targets (32 heads: 75 % of the copy
bandwidth; 128 heads: 70 % of the roofline). ``--best-out`` writes the tiling table
(``paged_attention.parse_mla_tiling_table``'s form) of the best tiling a head count, by
the geometric mean of its times over the shapes. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from helix_kv.executor import paged_attention
from helix_kv.executor.paged_attention import (
    DecodeWorkspace,
    _mla_splits,
    paged_mla_decode_attention,
    parse_mla_tiling_table,
)

LATENT, ROPE = 512, 64
TOKENS_PER_BLOCK = 32
REPEATS = 20
#: The issue's targets: at 32 heads the share of the copy bandwidth, at 128 of the roofline.
TARGETS = {32: ("copy bandwidth", 0.75), 128: ("roofline", 0.70)}


@dataclass
class Result:
    """One timed call configuration."""

    heads: int
    shape: str
    tiling: str
    splits: int
    forced: bool
    us: float
    bytes: int
    flops: int
    bandwidth: float
    matmul_rate: float
    max_diff: float

    @property
    def roofline_us(self) -> float:
        return max(self.bytes / self.bandwidth, self.flops / self.matmul_rate) * 1e6

    def line(self) -> str:
        seconds = self.us / 1e6
        rate, flop_rate = self.bytes / seconds, self.flops / seconds
        label = f"{self.splits}" if self.forced else f"auto={self.splits}"
        return (
            f"{self.heads:>5} {self.shape:>9} {self.tiling:>26} {label:>8} {self.us:>9.1f} "
            f"{rate / 1e9:>8.0f} {rate / self.bandwidth:>6.0%} {flop_rate / 1e12:>7.1f} "
            f"{flop_rate / self.matmul_rate:>6.0%} {self.roofline_us / self.us:>6.0%} "
            f"{self.max_diff:>9.2e}"
        )


HEADER = (
    f"{'heads':>5} {'shape':>9} {'tiling':>26} {'splits':>8} {'us':>9} {'GB/s':>8} "
    f"{'of bw':>6} {'TFLOP/s':>7} {'of mm':>6} {'of rl':>6} {'max|d|':>9}"
)


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


def use_tiling(name: str) -> None:
    """Every call takes this tiling (any name :meth:`MLATiling.from_name` reads)."""
    paged_attention.MLA_TILING_TABLE = parse_mla_tiling_table(name)


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


def costs(rows: int, heads: int, tokens: int) -> tuple[int, int]:
    """Bytes the kernel must move (each latent once, the queries in, the float32 outputs and
    LSEs out) and its FLOPs (scores over latent + RoPE and values over the latent)."""
    dim = LATENT + ROPE
    moved = rows * tokens * dim * 2 + rows * heads * (dim * 2 + LATENT * 4 + 4)
    return moved, rows * tokens * heads * 2 * (dim + LATENT)


def measure(
    args: argparse.Namespace, heads: int, shape: str, bandwidth: float, rate: float, log
) -> list[Result]:
    """Every tiling at its auto split, then the best one at each forced split count."""
    rows, tokens = (int(x) for x in shape.split("x"))
    p = problem(rows, heads, tokens)
    moved, flops = costs(rows, heads, tokens)
    width = p["block_table"].shape[1]
    results: list[Result] = []
    baseline = None

    def run(tiling: str, splits: int | None) -> None:
        nonlocal baseline
        use_tiling(tiling)
        count = splits or _mla_splits(rows, heads, LATENT, True, width, TOKENS_PER_BLOCK, None)[0]
        try:
            micros, out = time_calls(p, heads, count, args.calls)
        except Exception as exc:  # a tiling that does not launch (resources) is reported
            log(f"{heads:>5} {shape:>9} {tiling:>26} failed: {type(exc).__name__}: {exc}"[:300])
            return
        if baseline is None:
            baseline = out
        diff = float((out.float() - baseline.float()).abs().max())
        result = Result(
            heads,
            shape,
            tiling,
            count,
            splits is not None,
            micros,
            moved,
            flops,
            bandwidth,
            rate,
            diff,
        )
        results.append(result)
        log(result.line())

    for tiling in [args.baseline] + [t for t in args.tilings if t != args.baseline]:
        run(tiling, None)
    auto = [r for r in results if not r.forced]
    if args.split_sweep and auto:
        best = min(auto, key=lambda r: r.us)
        for splits in args.split_sweep:
            if splits != best.splits:
                run(best.tiling, splits)
    return results


def best_table(results: list[Result], heads_list: list[int]) -> str:
    """The tiling table of the best auto-split tiling a head count (geometric mean of µs
    over the shapes it ran every shape of); the first entry from one head."""
    entries = []
    for index, heads in enumerate(heads_list):
        auto = [r for r in results if r.heads == heads and not r.forced]
        shapes = {r.shape for r in auto}
        means = {}
        for tiling in {r.tiling for r in auto}:
            times = [r.us for r in auto if r.tiling == tiling]
            if len(times) == len(shapes):
                means[tiling] = statistics.geometric_mean(times)
        if means:
            entries.append(f"{1 if index == 0 else heads}:{min(means, key=means.__getitem__)}")
    return ",".join(entries)


def summary(results: list[Result], baseline: str) -> list[str]:
    """A line a head count and shape: the baseline and the best, and the issue's target."""
    lines = [
        "| heads | shape | baseline µs | best (splits) | µs | speedup | of copy bw | of roofline "
        "| target |",
        "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    keys = sorted({(r.heads, r.shape) for r in results}, key=lambda k: (k[0], k[1]))
    for heads, shape in keys:
        group = [r for r in results if (r.heads, r.shape) == (heads, shape)]
        base = next((r for r in group if r.tiling == baseline and not r.forced), None)
        best = min(group, key=lambda r: r.us)
        share_bw = best.bytes / (best.us / 1e6) / best.bandwidth
        share_rl = best.roofline_us / best.us
        what, goal = TARGETS.get(heads, ("roofline", 0.70))
        share = share_bw if what == "copy bandwidth" else share_rl
        verdict = f"{goal:.0%} of the {what}: {'met' if share >= goal else 'not met'}"
        splits = f"{best.splits}" if best.forced else f"auto={best.splits}"
        base_us = f"{base.us:.1f}" if base else "-"
        speedup = f"{base.us / best.us:.2f}x" if base else "-"
        lines.append(
            f"| {heads} | {shape} | {base_us} | {best.tiling} ({splits}) | {best.us:.1f} | "
            f"{speedup} | {share_bw:.0%} | {share_rl:.0%} | {verdict} |"
        )
    return lines


def main() -> None:
    """Parse, time every head count, shape and tiling, print the table and the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--shapes", nargs="+", default=["64x2112", "8x32768", "256x576"])
    parser.add_argument(
        "--tilings", nargs="+", default=list(paged_attention.MLA_TILINGS), help="tiling names"
    )
    parser.add_argument(
        "--baseline",
        default=paged_attention.MLA_TILING_TABLE[0][1],
        help="the tiling each output is compared with (first timed)",
    )
    parser.add_argument(
        "--split-sweep", type=int, nargs="*", default=[], help="forced splits for the best"
    )
    parser.add_argument("--calls", type=int, default=10, help="calls per captured graph")
    parser.add_argument("--json", default=None, help="append one JSON line a result here")
    parser.add_argument("--best-out", default=None, help="write the best tiling table here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_mla_attention.py needs a CUDA device")
    for name in [args.baseline, *args.tilings]:
        parse_mla_tiling_table(name)  # refuse a bad name before any device time
    from gpu_decode_floor import copy_bandwidth, matmul_rate  # benches/ is on sys.path

    device = torch.device("cuda")
    bandwidth, rate = copy_bandwidth(device), matmul_rate(device)
    print(
        f"# {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 "
        f"matmul {rate / 1e12:.0f} TFLOP/s; latent {LATENT} + rope {ROPE}, "
        f"{TOKENS_PER_BLOCK} tokens a page, bf16; {args.calls} calls a graph",
        flush=True,
    )
    print(HEADER, flush=True)
    results: list[Result] = []
    for heads in args.heads:
        for shape in args.shapes:
            results += measure(args, heads, shape, bandwidth, rate, lambda s: print(s, flush=True))
            torch.cuda.empty_cache()  # the shape's problem is gone with measure's frame
    if args.json:
        with open(args.json, "a", encoding="utf-8") as out:
            for result in results:
                out.write(json.dumps(asdict(result)) + "\n")
    table = best_table(results, args.heads)
    if args.best_out:
        with open(args.best_out, "w", encoding="utf-8") as out:
            out.write(table + "\n")
    print()
    print("\n".join(summary(results, args.baseline)))
    print(f"best tiling table (geometric mean over the shapes): {table}")


if __name__ == "__main__":
    with torch.no_grad():
        main()
