"""Per-step cost of the cross-rank schedule check (``HELIX_KV_CHECK_SCHEDULE=1``).

Spawns one process per rank (gloo on CPU, or NCCL with one GPU per rank), builds each rank with
:meth:`helix_kv.distributed.HelixKVRank.create` and measures, per step:

* ``check``: :meth:`ScheduleChecker.check` alone (one all-reduce of two int64), repeated on
  one schedule: the pure cost of the collective round trip;
* ``in run``: the check inside a pressured schedule/update loop (preemptions, chunked
  prefill), next to what ``schedule()`` itself costs there.

Usage::

    python benches/bench_schedule_check.py                      # gloo, 2 and 4 ranks
    NCCL_NVLS_ENABLE=0 python benches/bench_schedule_check.py --backend nccl --ranks 2

Target on NCCL: <= 50 us per step. Figures are medians over ranks' medians; nothing is
asserted (timings depend on the machine).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

ISOLATED_ROUNDS = 2000
WARMUP = 100


def _config() -> Any:
    from helix_kv.distributed import EngineConfig

    return EngineConfig(
        num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, max_batch_size=64,
        max_num_tokens=512, max_seq_len=4096,
    )  # fmt: skip


def _tokens(out: Any) -> np.ndarray:
    completes = np.asarray(out.context_completes, dtype=bool)
    positions = np.concatenate(
        [
            np.asarray(out.generation_positions, dtype=np.int64) + 1,
            (np.asarray(out.context_starts) + np.asarray(out.context_lens))[completes],
        ]
    )
    return ((np.asarray(out.sample_ids) * 7919 + positions * 104729) % 32000).astype(np.int32)


def _stats(samples: list[float]) -> dict[str, float]:
    array = np.asarray(samples) * 1e6
    return {
        "median_us": float(np.median(array)),
        "p90_us": float(np.quantile(array, 0.9)),
        "n": len(samples),
    }


def rank_worker(rank: int, world: int, requests: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from helix_kv.distributed import HelixKVRank

    nccl = "nccl" in str(dist.get_backend())
    if nccl:  # create the world communicator first, so the figure below is the checker's own
        dist.all_reduce(torch.zeros(1, device="cuda"))
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
    config = _config()
    # A pool of 6144 global tokens, about a third of what the requests need: KV pressure.
    pages = 6144 // (config.tokens_per_block * world)
    built = HelixKVRank.create(config, pages * config.page_bytes, check_schedule=True)
    checker = built.checker
    checker_mib = (free_before - torch.cuda.mem_get_info()[0]) / 2**20 if nccl else 0.0
    assert checker is not None
    assert checker.enabled
    rng = np.random.default_rng(7)  # same seed on every rank: same workload
    for rid in range(requests):
        length = int(rng.integers(16, 400))
        prompt = rng.integers(0, 32000, size=length).astype(np.int32)
        built.scheduler.add_request(rid, prompt, int(rng.integers(16, 200)), 0)

    # Isolated: the collective round trip on one schedule.
    out = built.scheduler.schedule()
    for _ in range(WARMUP):
        checker.check(out)
    isolated = []
    for _ in range(ISOLATED_ROUNDS):
        started = time.perf_counter()
        checker.check(out)
        isolated.append(time.perf_counter() - started)
    built.scheduler.update(_tokens(out))

    # In a pressured run: schedule() vs. the check of that step.
    schedule_s, check_s = [], []
    while built.scheduler.has_unfinished():
        started = time.perf_counter()
        out = built.scheduler.schedule()
        scheduled = time.perf_counter()
        checker.check(out)
        checked = time.perf_counter()
        schedule_s.append(scheduled - started)
        check_s.append(checked - scheduled)
        tokens = _tokens(out)
        checker.record_update(out.sample_ids, tokens)
        built.scheduler.update(tokens)
    metrics = built.scheduler.metrics()
    return {
        "isolated": _stats(isolated),
        "in_run": _stats(check_s),
        "schedule": _stats(schedule_s),
        "steps": len(check_s),
        "preemptions": int(metrics.preemptions),
        "checker_mib": checker_mib,
        "graphed": bool(getattr(checker._reduce, "graphed", False)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="group sizes")
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    ranks = args.ranks or ([2, 4] if args.backend == "gloo" else [2])

    import torch

    from helix_kv.distributed.launch import spawn_group

    for world in ranks:
        if args.backend == "nccl" and torch.cuda.device_count() < world:
            print(f"skip nccl x{world}: {torch.cuda.device_count()} GPU(s)")
            continue
        results = spawn_group(
            rank_worker, world, args=(args.requests,), backend=args.backend, timeout_s=120.0,
            env={"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"},
        )  # fmt: skip

        def median(key: str, field: str = "median_us", res: list[Any] = results) -> float:
            return float(np.median([r[key][field] for r in res]))

        print(
            f"schedule check, {args.backend}, {world} ranks: "
            f"{median('isolated'):.1f} us/step isolated (p90 {median('isolated', 'p90_us'):.1f}); "
            f"{median('in_run'):.1f} us/step in a pressured run of {results[0]['steps']} steps "
            f"(p90 {median('in_run', 'p90_us'):.1f}; schedule() itself {median('schedule'):.1f} "
            f"us; {results[0]['preemptions']} preemptions)"
            + (
                f"; CUDA graph: {results[0]['graphed']}, checker communicator "
                f"{max(r['checker_mib'] for r in results):.0f} MiB of GPU memory"
                if args.backend == "nccl"
                else ""
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
