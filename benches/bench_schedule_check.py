"""Per-step cost of the cross-rank schedule check (``HELIX_KV_CHECK_SCHEDULE=1``).

Spawns one process per rank (gloo on CPU, or NCCL with one GPU per rank), builds each rank with
:meth:`helix_kv.distributed.HelixKVRank.create` and measures, per step:

* ``check``: :meth:`ScheduleChecker.check` alone (one all-reduce of two int64), repeated on
  one schedule: the pure cost of the collective round trip;
* ``in run``: the blocking ``check()`` inside a pressured schedule/update loop (preemptions,
  chunked prefill) with no model work, next to what ``schedule()`` itself costs there;
* ``overlapped``: the pressured run again through :class:`HelixKVRank` (which starts the
  check in ``schedule()`` and finishes it in the step's ``update()``) with a stand-in for
  the step's forward between them: ``--forward-us`` of device work on the current stream
  (NCCL: ``torch.cuda._sleep``; gloo: host work) and one all-reduce on the world group (the
  model's collective), then the sampled tokens' readback. Plain (``schedule; forward;
  update``) and one step ahead (``schedule t+1; forward t+1; update t``), next to the
  blocking ``check()`` in the same loop. The host time of the check per step is what
  ``start`` plus ``finish`` took (``ScheduleChecker.check_seconds``), and ``+ record`` adds
  ``record_update`` (the copy and fingerprint of the fed tokens).

Usage::

    python benches/bench_schedule_check.py                      # gloo, 2 and 4 ranks
    NCCL_NVLS_ENABLE=0 python benches/bench_schedule_check.py --backend nccl --ranks 2

Target on NCCL: <= 50 us per step (p50 of the host time in a pressured run). Figures are
medians over ranks' medians; nothing is asserted (timings depend on the machine).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

ISOLATED_ROUNDS = 2000
#: The loops run under a stand-in forward: the blocking check() (as before the split), the
#: split check finished right before the tokens are waited for (as the executor does), the
#: same finished at update(), and the executor's one-step-ahead loop.
OVERLAPPED_MODES = ("blocking", "plain", "plain_at_update", "overlap")
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


class _Forward:
    """A stand-in for one step's forward: ``us`` of device work on the current stream, the
    model's collective (an all-reduce on the world group) and the tokens' readback to the
    host (pinned, waited on by :meth:`wait`). On CPU (gloo) the device work is host work."""

    def __init__(self, us: float, nccl: bool) -> None:
        import torch

        self.nccl = nccl
        self.us = us
        if nccl:
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.cycles_per_us = _calibrate_sleep()
            self.value = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.hosts = [torch.empty(1, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self.launched = 0
        else:
            self.value = torch.zeros(1, dtype=torch.int64)

    def launch(self) -> Any:
        """Queues the step's work; returns a handle for :meth:`wait`."""
        import torch
        import torch.distributed as dist

        if not self.nccl:
            until = time.perf_counter() + self.us * 1e-6
            while time.perf_counter() < until:
                pass
            dist.all_reduce(self.value)
            return None
        torch.cuda._sleep(int(self.us * self.cycles_per_us))
        dist.all_reduce(self.value)
        host = self.hosts[self.launched % 2]  # two steps in flight at most
        self.launched += 1
        host.copy_(self.value, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return done

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.synchronize()


def _calibrate_sleep() -> float:
    """GPU cycles per microsecond of ``torch.cuda._sleep``."""
    import torch

    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def _add_requests(built: Any, requests: int, first_id: int) -> None:
    rng = np.random.default_rng(7)  # same seed on every rank: same workload
    for rid in range(requests):
        length = int(rng.integers(16, 400))
        prompt = rng.integers(0, 32000, size=length).astype(np.int32)
        built.scheduler.add_request(first_id + rid, prompt, int(rng.integers(16, 200)), 0)


def _overlapped_run(
    built: Any, forward: _Forward, overlap: bool, early_finish: bool = True
) -> dict[str, Any]:
    """A pressured run through ``built`` (HelixKVRank: check started by ``schedule()``,
    finished by the step's ``update()``) with ``forward`` between them; per step, the host
    time of the check (start + finish) and of ``record_update``. ``early_finish``: finish the
    check right before waiting for the step's tokens (``finish_check()``, as the executor
    does); else at ``update`` (where the forward has covered it)."""
    checker = built.checker
    recorded = checker.record_update
    record_s: list[float] = []

    def timed_record(*args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        recorded(*args, **kwargs)
        record_s.append(time.perf_counter() - started)

    checker.record_update = timed_record
    check_s, with_record_s, step_s = [], [], []
    pending: list[tuple[Any, Any]] = []
    try:
        while built.has_unfinished() or pending:
            started = time.perf_counter()
            before, records = checker.check_seconds, len(record_s)
            if built.has_unfinished():
                out = built.schedule()
                pending.append((out, forward.launch()))
            if len(pending) > (1 if overlap else 0) or not built.has_unfinished():
                out, handle = pending.pop(0)
                if early_finish:
                    built.finish_check()
                forward.wait(handle)
                built.update(_tokens(out))
            spent = checker.check_seconds - before
            check_s.append(spent)
            with_record_s.append(spent + sum(record_s[records:]))
            step_s.append(time.perf_counter() - started)
    finally:
        del checker.record_update
    return {
        "check": _stats(check_s[WARMUP // 10 :]),
        "with_record": _stats(with_record_s[WARMUP // 10 :]),
        "record": _stats(record_s),
        "step": _stats(step_s[WARMUP // 10 :]),
        "steps": len(check_s),
    }


def _blocking_run(built: Any, forward: _Forward) -> dict[str, Any]:
    """The same loop with the blocking ``check()`` right after ``schedule()`` (the check
    before this split): its host time per step."""
    checker = built.checker
    check_s, step_s = [], []
    while built.scheduler.has_unfinished():
        scheduled = time.perf_counter()
        out = built.scheduler.schedule()
        started = time.perf_counter()
        checker.check(out)
        check_s.append(time.perf_counter() - started)
        forward.wait(forward.launch())
        tokens = _tokens(out)
        built.scheduler.update(tokens)
        checker.record_update(out.sample_ids, tokens, step=int(out.step))
        step_s.append(time.perf_counter() - scheduled)
    return {
        "check": _stats(check_s[WARMUP // 10 :]),
        "step": _stats(step_s[WARMUP // 10 :]),
        "steps": len(check_s),
    }


def rank_worker(rank: int, world: int, requests: int, forward_us: float = 0.0) -> dict[str, Any]:
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
    _add_requests(built, requests, 0)

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
    overlapped: dict[str, Any] = {}
    if forward_us > 0:
        forward = _Forward(forward_us, nccl)
        for index, mode in enumerate(OVERLAPPED_MODES):
            _add_requests(built, requests, (index + 1) * requests)
            if mode == "blocking":
                overlapped[mode] = _blocking_run(built, forward)
            else:
                early = mode != "plain_at_update"
                overlapped[mode] = _overlapped_run(built, forward, mode == "overlap", early)
    return {
        "isolated": _stats(isolated),
        "in_run": _stats(check_s),
        "schedule": _stats(schedule_s),
        "steps": len(check_s),
        "preemptions": int(metrics.preemptions),
        "checker_mib": checker_mib,
        "graphed": bool(getattr(checker._reduce, "graphed", False)),
        "overlapped": overlapped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="group sizes")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--forward-us", type=float, default=300.0,
        help="the stand-in forward's device work per step (0: skip the overlapped runs)",
    )  # fmt: skip
    args = parser.parse_args()
    ranks = args.ranks or ([2, 4] if args.backend == "gloo" else [2])

    import torch

    from helix_kv.distributed.launch import spawn_group

    for world in ranks:
        if args.backend == "nccl" and torch.cuda.device_count() < world:
            print(f"skip nccl x{world}: {torch.cuda.device_count()} GPU(s)")
            continue
        results = spawn_group(
            rank_worker, world, args=(args.requests, args.forward_us), backend=args.backend,
            timeout_s=300.0,
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
        if results[0]["overlapped"]:
            _print_overlapped(args.backend, world, args.forward_us, results)


def _print_overlapped(backend: str, world: int, forward_us: float, results: list[Any]) -> None:
    def median(mode: str, key: str, field: str = "median_us") -> float:
        return float(np.median([r["overlapped"][mode][key][field] for r in results]))

    runs = results[0]["overlapped"]
    line = (
        f"schedule check under a {forward_us:.0f} us forward, {backend}, {world} ranks, host "
        f"time per step p50 (p90): blocking check() {median('blocking', 'check'):.1f} "
        f"({median('blocking', 'check', 'p90_us'):.1f}) us"
    )
    labels = {
        "plain": "start+finish (finish before the token wait)",
        "plain_at_update": "finish at update",
        "overlap": "one step ahead",
    }
    line += f", step {median('blocking', 'step'):.1f} us"
    for mode, label in labels.items():
        line += (
            f"; {label} {median(mode, 'check'):.1f} ({median(mode, 'check', 'p90_us'):.1f}) us, "
            f"+ record_update {median(mode, 'with_record'):.1f} us, step "
            f"{median(mode, 'step'):.1f} us"
        )
    steps = ", ".join(f"{mode} {run['steps']}" for mode, run in runs.items())
    print(line + f" (steps: {steps}; record_update {median('plain', 'record'):.1f} us)", flush=True)


if __name__ == "__main__":
    main()
