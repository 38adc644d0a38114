"""Copy-out and copy-in throughput of one rank's host KV tier (:class:`HostKVPool`), against
a plain pinned copy of the same bytes (what the link gives).

    python benches/gpu_host_tier.py                  # bench model, bf16, 256 pages per step
    python benches/gpu_host_tier.py --pages 64 --scattered

A step's suspended pages are gathered from the GPU pool (one index_select per cache), staged
contiguously and copied to their host pages on the tier's side stream; resumed pages come back
the other way. ``--scattered`` takes every other GPU page (a fragmented pool) instead of a
contiguous run. Times are CUDA events on the side stream's work, ten repetitions after a
warm-up; GB/s counts the KV bytes moved (keys and values of every layer).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from helix_kv.executor.bench import BENCH_MODEL
from helix_kv.executor.host_pool import HostKVPool
from helix_kv.executor.model import TinyTransformer
from helix_kv.executor.placement import RankPlacement

REPEATS = 10


def _timed(work: object, stream: torch.cuda.Stream | None = None) -> float:
    """Median seconds of ``work()`` over the repeats, timed with CUDA events."""
    times = []
    for _ in range(REPEATS + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()  # type: ignore[operator]
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256, help="pages moved per step")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--scattered", action="store_true", help="every other GPU page")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    model = TinyTransformer(BENCH_MODEL, dtype=dtype, device=torch.device("cuda"))
    placement = RankPlacement(1, args.tokens_per_block, 0)
    pool = model.new_kv_pool(placement, 4 * args.pages, dtype)
    pool.key_cache.normal_()
    pool.value_cache.normal_()
    host = HostKVPool(pool, args.pages)
    step = 2 if args.scattered else 1
    gpu_pages = np.arange(0, step * args.pages, step, dtype=np.int64)
    host_pages = np.arange(args.pages, dtype=np.int64)
    moved = args.pages * host.page_bytes
    side = host._stream  # the tier's side stream

    def copy_out() -> None:
        with torch.cuda.stream(side):
            host._copy_out(gpu_pages, host_pages)

    def copy_in() -> None:
        with torch.cuda.stream(side):
            host._copy_in(host_pages, gpu_pages + 2 * args.pages)

    before = pool.key_cache.clone()
    out_s, in_s = _timed(copy_out, side), _timed(copy_in, side)
    # the copy-in wrote pages 2P.. from the host copy of pages 0..: check one layer's bytes
    paged = pool.key_cache.view(
        pool.key_cache.shape[0], -1, args.tokens_per_block, *pool.key_cache.shape[2:]
    )
    old = before.view_as(paged)
    assert torch.equal(
        paged[:, torch.from_numpy(gpu_pages + 2 * args.pages).cuda()],
        old[:, torch.from_numpy(gpu_pages).cuda()],
    )
    device_bytes = torch.empty(moved, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(moved, dtype=torch.uint8, pin_memory=True)
    d2h = _timed(lambda: pinned.copy_(device_bytes, non_blocking=True))
    h2d = _timed(lambda: device_bytes.copy_(pinned, non_blocking=True))
    gb = moved / 1e9
    print(
        f"helix_kv host tier: {torch.cuda.get_device_name(0)}, {args.dtype}, {args.pages} pages "
        f"x {host.page_bytes / 2**20:.2f} MiB ({'scattered' if args.scattered else 'contiguous'})"
    )
    print(
        f"  copy_out_GB_per_s: {gb / out_s:.1f}  (plain pinned D2H of the same bytes: "
        f"{gb / d2h:.1f})"
    )
    print(
        f"  copy_in_GB_per_s: {gb / in_s:.1f}  (plain pinned H2D of the same bytes: {gb / h2d:.1f})"
    )
    print(f"  copy_out_ms: {out_s * 1e3:.2f}  copy_in_ms: {in_s * 1e3:.2f}")


if __name__ == "__main__":
    main()
