"""The decode step's weight products alone, against the copy bandwidth (one GPU, bf16).

    python benches/gpu_decode_gemms.py                     # rows 64 and 256
    python benches/gpu_decode_gemms.py --rows 64 --calls 50
    python benches/gpu_decode_gemms.py --head-blocks 64,64,64 32,128,64   # head_matmul tiles

Two tables per row count:

* every weight GEMM of the two stacks of ``gpu_decode_floor.py`` (``rows x K @ K x N``, four
  copies of the weight read in turn so L2 holds none), under each cuBLAS backend torch offers
  (``torch.backends.cuda.preferred_blas_library``: cublas and cublaslt), as µs a call and
  the weight bytes read per second;
* MLA's absorbed per-head products at DeepSeek-V3's sizes (32 heads, no-RoPE 128, latent
  512, v 128): the key up-projection into the query (the old path: a batched matmul on the
  heads-first views, written through a transposed ``out``) and the value up-projection of
  the float32 combine output (the old path: a cast, an ``einsum`` and the copy the output
  projection's ``reshape`` makes), against :func:`helix_kv.executor.fused.head_matmul` with
  each ``--head-blocks`` tiling (rows, columns, inner: ``HEAD_MATMUL_BLOCKS``).

Each op is captured ``--calls`` times in one CUDA graph and replayed; µs = median replay /
calls. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

from gpu_decode_floor import copy_bandwidth  # a sibling script: benches/ is on sys.path
from helix_kv.executor import fused

#: (name, K, N) of each weight GEMM: the Llama stack's, then the MLA stack's (its fused input
#: projection is 32 x (128 + 64) query columns and 512 + 64 latent ones).
GEMMS = [
    ("llama wqkv", 4096, 6144),
    ("llama wo / mla wo", 4096, 4096),
    ("llama w_gate_up", 4096, 2 * 14336),
    ("llama w_down", 14336, 4096),
    ("mla w_in", 4096, 32 * 192 + 576),
    ("mla w_gate_up", 4096, 2 * 13824),
    ("mla w_down", 13824, 4096),
    ("lm head", 4096, 32000),
]
COPIES = 4


def graph_us(op: Callable[[int], object], calls: int, replays: int = 20) -> float:
    """µs per call of ``op(i)`` (``i``: the call's index), ``calls`` of them in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            op(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            op(i)
    times = []
    for _ in range(replays + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times[2:])


def gemm_rows(rows: int, calls: int, bandwidth: float) -> list[str]:
    lines = [f"rows {rows}: weight GEMMs (µs a call, weight TB/s, share of the copy bandwidth)"]
    backends = ["cublas", "cublaslt"]
    lines.append(f"  {'weight':<20} {'K x N':>13} " + " ".join(f"{b:>24}" for b in backends))
    for name, k, n in GEMMS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        cells = []
        for backend in backends:
            torch.backends.cuda.preferred_blas_library(backend)

            def op(
                i: int,
                x: torch.Tensor = x,
                weights: list[torch.Tensor] = weights,
                outs: list[torch.Tensor] = outs,
            ) -> None:
                torch.matmul(x, weights[i % COPIES], out=outs[i % COPIES])

            us = graph_us(op, calls)
            rate = k * n * 2 / (us * 1e-6)
            cells.append(f"{us:8.1f} {rate / 1e12:5.2f} {100 * rate / bandwidth:4.0f}%")
        torch.backends.cuda.preferred_blas_library("cublas")
        lines.append(f"  {name:<20} {f'{k} x {n}':>13} " + " ".join(f"{c:>24}" for c in cells))
    return lines


def product_rows(rows: int, calls: int, tilings: list[tuple[int, int, int]]) -> list[str]:
    heads, nope, latent, v = 32, 128, 512, 128
    q = torch.randn(rows, heads, nope + 64, device="cuda", dtype=torch.bfloat16)
    query = torch.empty(rows, heads, latent + 64, device="cuda", dtype=torch.bfloat16)
    combined = torch.randn(rows, heads, latent, device="cuda", dtype=torch.float32)
    w_uk = [
        torch.randn(heads, nope, latent, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)
    ]
    w_uv = [
        torch.randn(heads, v, latent, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)
    ]
    flat = torch.empty(rows, heads * v, device="cuda", dtype=torch.bfloat16)

    def uk_old(i: int) -> None:
        torch.matmul(
            q[..., :nope].transpose(0, 1),
            w_uk[i % COPIES],
            out=query[..., :latent].transpose(0, 1),
        )

    def uk_new(i: int) -> None:
        fused.head_matmul(q[..., :nope], w_uk[i % COPIES], out=query[..., :latent])

    def uv_old(i: int) -> None:
        out = torch.einsum("thl,hvl->thv", combined.to(torch.bfloat16), w_uv[i % COPIES])
        flat.copy_(out.reshape(rows, -1))

    def uv_new(i: int) -> None:
        out = fused.head_matmul(combined, w_uv[i % COPIES].transpose(1, 2))
        flat.copy_(out.reshape(rows, -1))  # a view: the copy stands for wo reading it

    lines = [f"rows {rows}: MLA per-head products at 32 heads (µs a call)"]
    kept = fused.HEAD_MATMUL_BLOCKS
    for name, old, new in (
        ("w_uk (into the query)", uk_old, uk_new),
        ("w_uv (+ reshape)", uv_old, uv_new),
    ):
        cells = [f"torch {graph_us(old, calls):7.1f}"]
        for tiling in tilings:
            fused.HEAD_MATMUL_BLOCKS = tiling
            cells.append(f"{','.join(map(str, tiling))} {graph_us(new, calls):7.1f}")
        fused.HEAD_MATMUL_BLOCKS = kept
        lines.append(f"  {name:<24} " + "   ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument(
        "--head-blocks",
        nargs="+",
        default=[",".join(map(str, fused.HEAD_MATMUL_BLOCKS))],
        help="head_matmul tilings to time: rows,columns,inner",
    )
    parser.add_argument("--products-only", action="store_true", help="skip the GEMM table")
    args = parser.parse_args()
    tilings = [tuple(int(v) for v in text.split(",")) for text in args.head_blocks]
    if not torch.cuda.is_available():
        sys.exit("gpu_decode_gemms.py needs a CUDA device")
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    for rows in args.rows:
        if not args.products_only:
            print("\n".join(gemm_rows(rows, args.calls, bandwidth)))
        print("\n".join(product_rows(rows, args.calls, tilings)))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
