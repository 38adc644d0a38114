"""Host time of a decode step's device metadata on the fast path (issue 13), CUDA only.

    python benches/gpu_decode_metadata.py                 # N = 64, 256, 1024, a minimal graph
    python benches/gpu_decode_metadata.py --step          # the real DecodeStep (bench model)
    python benches/gpu_decode_metadata.py --sizes 1024 --steps 400

A scheduler (cp = 1, 32 tokens per page, prompts of 512 tokens) holds N decoding requests;
each step (``schedule()`` and ``update()`` untimed) is written and launched two ways:

* eager: ``fill_from_schedule`` (one Rust call), then ``upload`` (pad, one ``non_blocking``
  copy, one event record) and the step;
* graphed: ``fill_from_schedule``, then one ``graph.replay()`` whose first node is the copy of
  the staging rows (:meth:`DecodeStep.launch`; no event).

Printed: the median µs of ``fill``, ``upload`` (eager copy launch + event),
``replay`` (graphed: the copy and the step, one call), ``ready`` = from after ``schedule()``
to the step's metadata queued (eager: fill + upload; graphed: fill, the replay excluded, as
the target counts it) and ``fill+replay``; and a ``StepTimeline`` start (one event record).
Without ``--step`` the graph is the copy plus one small kernel reading the rows (the replay
of a full step costs more host time per node). Target: ready <= 50 µs at N = 1024.
Each step's readback is waited before the step after next is filled, as the runner does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

import helix_kv
from helix_kv.executor.bench import BENCH_MODEL
from helix_kv.executor.decode_step import DecodeLayout, DecodeMetadata, DecodeStep
from helix_kv.executor.model import TinyTransformer
from helix_kv.executor.overlap import StepTimeline
from helix_kv.executor.placement import RankPlacement

TPB, PROMPT = 32, 512


class Decoding:
    """``n`` requests past their prefill; :meth:`advance` schedules the next decode step."""

    def __init__(self, n: int, steps: int, width: int) -> None:
        config = helix_kv.SchedulerConfig(
            cp_size=1,
            tokens_per_block=TPB,
            kv_superblocks=n * width,
            max_batch_size=n,
            max_num_tokens=n * PROMPT,
            max_seq_len=width * TPB,
        )
        self.s = helix_kv.Scheduler(config)
        prompt = np.arange(PROMPT, dtype=np.int32)
        for i in range(n):
            self.s.add_request(i, prompt, steps + 8)
        self.tokens = np.full(n, 7, dtype=np.int32)
        self.out = self.s.schedule()  # the prefill step
        self.advance()
        assert self.out.generation_ids.size == n

    def advance(self) -> None:
        self.s.update(self.tokens[: self.out.num_samples])
        self.out = self.s.schedule()


class MinimalStep:
    """A stand-in for :class:`DecodeStep`: per (bucket, staging buffer) a graph of the copy
    and one kernel reading the rows."""

    def __init__(self, metadata: DecodeMetadata) -> None:
        self.metadata = metadata
        self.sums = torch.zeros(metadata.layout.max_batch, dtype=torch.int64, device="cuda")
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        for bucket in metadata.buckets:
            for index in (0, 1):
                self._body(bucket, index)  # warm-up
        torch.cuda.synchronize()
        for bucket in metadata.buckets:
            for index in (0, 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._body(bucket, index)
                self.graphs[bucket, index] = graph
        torch.cuda.synchronize()

    def _body(self, bucket: int, index: int | None) -> None:
        if index is not None:
            self.metadata.copy_to_device(bucket, index)
        torch.sum(self.metadata.device_buffer[:bucket], dim=1, out=self.sums[:bucket])

    def launch(self, rows: int) -> None:
        bucket = self.metadata.pad(rows)
        self.graphs[bucket, self.metadata.current].replay()
        self.metadata.launched()

    def run(self, bucket: int) -> None:
        self._body(bucket, None)


def median_us(values: list[int]) -> float:
    return statistics.median(values) / 1e3


def measure(n: int, steps: int, real_step: bool) -> dict[str, float]:
    width = -(-(PROMPT + steps + 8) // TPB)
    d = Decoding(n, steps, width)
    metadata = DecodeMetadata(DecodeLayout(n, width), "cuda")
    step: DecodeStep | MinimalStep
    if real_step:
        model = TinyTransformer(
            BENCH_MODEL, dtype=torch.bfloat16, device="cuda", decode_kernel=True
        )
        pool = model.new_kv_pool(RankPlacement(1, TPB, 0), n * width)
        step = DecodeStep(model, pool, lambda part: part, metadata, cuda_graphs=True)
    else:
        step = MinimalStep(metadata)
    timeline = StepTimeline(torch.device("cuda"))
    times: dict[str, list[int]] = {
        k: [] for k in ("fill", "upload", "eager ready", "replay", "graphed ready", "timeline")
    }
    pending: list[tuple[int, torch.cuda.Event]] = []
    clock = time.perf_counter_ns
    for index in range(steps):
        graphed = index % 2 == 1  # alternate, so both see the same scheduler states
        t0 = clock()
        counts = metadata.fill_from_schedule(d.s, d.out)
        t1 = clock()
        if graphed:
            step.launch(counts.rows)
            t2 = clock()
            times["replay"].append(t2 - t1)
            times["graphed ready"].append(t1 - t0)
        else:
            bucket = metadata.upload(counts.rows)
            t2 = clock()
            if isinstance(step, DecodeStep):
                step._forward(bucket)  # the eager step (run() would replay its graph)
            else:
                step.run(bucket)
            times["upload"].append(t2 - t1)
            times["eager ready"].append(t2 - t0)
            metadata.launched()  # the eager step holds its buffer too (the rule, uniformly)
        times["fill"].append(t1 - t0)
        t3 = clock()
        timeline.start()
        times["timeline"].append(clock() - t3)
        timeline.end()
        done = torch.cuda.Event()
        done.record()  # the readback of the runner
        pending.append((metadata.launches - 1, done))
        if len(pending) == 2:  # one step ahead: read step t before filling step t + 2
            number, event = pending.pop(0)
            event.synchronize()
            metadata.release(number)
        d.advance()
    torch.cuda.synchronize()
    warm = slice(10, None)
    figures = {name: median_us(values[warm]) for name, values in times.items()}
    figures["fill+replay"] = figures["graphed ready"] + figures["replay"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step", action="store_true", help="replay the real DecodeStep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_decode_metadata.py needs a CUDA device")
    names = ("fill", "upload", "eager ready", "graphed ready", "replay", "fill+replay", "timeline")
    print(f"{'N':>6} " + " ".join(f"{name:>14}" for name in names) + "   (median us)")
    for n in args.sizes:
        figures = measure(n, args.steps, args.step)
        print(f"{n:>6} " + " ".join(f"{figures[name]:>14.1f}" for name in names))
    print("target: graphed ready (fill; the copy is the replay's first node) <= 50 us at N = 1024")


if __name__ == "__main__":
    main()
