"""Step times of the reference executor, measured, and the step-time model fitted to them:
what ``benches/gpu_executor.py --export-step-time-profile FILE`` runs.

    python benches/gpu_executor.py --export-step-time-profile llama.json --model-family llama
    python benches/gpu_executor.py --export-step-time-profile mla.json --model-family mla
    python benches/gpu_executor.py --export-step-time-profile tiny.json --device cpu --small

A sweep of workloads (:data:`GPU_SWEEP`; :data:`CPU_SWEEP` with ``--small``), each ``requests``
prompts of ``prompt_len`` random tokens and ``new_tokens`` to generate, the scheduler's
``max_num_tokens`` the prompt chunk size: its prefill steps carry chunks of up to that many
tokens at growing context lengths, its decode steps one token a request at the prompts'
lengths (plus the tokens generated). Each runs on one rank (cp = 1) as the reference
executor runs it in plain mode: ``StepDriver.schedule()``, then the decode fast path for a
decode-only step (its rows filled from the schedule, one CUDA-graph replay on a GPU; the
Triton interpreter on the CPU) or the general path (``StepPlan``, ``KVPool.prepare``,
``forward``, ``logits``) for a step with prompt chunks, then the tokens read back and
``complete()``. A step's time is the host's, from ``schedule()`` to its tokens on the host
(what a step of the engine's loop takes, as the simulator's step stands for it); the device
time between CUDA events around its device work is printed beside it. The first step of each
workload is left out of the fit (it pays one-time costs: kernel compilation, library
heuristics); the rest are fitted by :func:`helix_kv.simulate.timing.fit_step_time`
(non-negative least squares of the relative error) to ``scheduled_tokens`` and
``kv_tokens_read`` (:func:`helix_kv.simulate.timing.kv_tokens_read`), and the fit's error
printed per workload and kind of step (prefill: a step with a prompt chunk; decode: decode
only), then written as a profile ``helix-kv simulate --step-time-profile`` reads, with a
``description`` naming the model, dtype, device and commit.

The models are ``benches/gpu_decode_floor.py``'s families at ``--layers`` layers (32 by
default: a Llama-3-8B-shaped stack, and an MLA stack of about its bytes), seeded random
weights (drawn on the device).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Workload:
    """``requests`` prompts of ``prompt_len`` tokens, ``new_tokens`` each, prompt chunks of up
    to ``chunk`` tokens a step (the scheduler's ``max_num_tokens``)."""

    requests: int
    prompt_len: int
    chunk: int
    new_tokens: int

    def __str__(self) -> str:
        return f"{self.requests} x ({self.prompt_len} + {self.new_tokens}), chunk {self.chunk}"


#: Decode batches from 1 to 128 at 1024-token prompts, 16 requests at 4096, and one request
#: set in chunks of 256 and 1024 tokens (prefill steps at every context length).
GPU_SWEEP = (
    Workload(1, 1024, 4096, 16),
    Workload(8, 1024, 4096, 12),
    Workload(32, 1024, 4096, 8),
    Workload(64, 1024, 4096, 8),
    Workload(128, 1024, 4096, 8),
    Workload(16, 4096, 4096, 8),
    Workload(4, 4096, 256, 4),
    Workload(4, 2048, 1024, 4),
)
#: The tiny model on the CPU (tests): a few steps of each kind.
CPU_SWEEP = (
    Workload(1, 24, 64, 4),
    Workload(3, 40, 32, 3),
    Workload(2, 70, 32, 2),
)


@dataclass(frozen=True)
class StepRecord:
    """One measured step."""

    workload: int  # index in the sweep
    kind: str  # "prefill" (a prompt chunk in it) or "decode"
    tokens: int  # scheduled tokens
    kv_tokens: int  # global KV tokens its attention read
    ms: float  # host time: schedule() to its tokens on the host
    device_ms: float  # CUDA events around its device work (nan on the CPU)
    first: bool  # the workload's first step (left out of the fit)


def run_workload(model: Any, index: int, workload: Workload, tpb: int, graphs: bool) -> list[Any]:
    """Run one workload to completion on one rank, plain mode; its steps' records."""
    from helix_kv import StepDriver
    from helix_kv.distributed import EngineConfig, HelixKVRank
    from helix_kv.executor import RankPlacement, StepPlan, group_combine
    from helix_kv.executor.decode_step import DecodeLayout, DecodeMetadata, DecodeStep
    from helix_kv.simulate.timing import kv_tokens_read

    device = model.device
    geometry = model.config
    engine = EngineConfig(
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.cache_heads,
        head_dim=geometry.cache_head_dim,
        kv_factor=geometry.kv_factor,
        dtype_bytes=torch.empty((), dtype=model.dtype).element_size(),
        tokens_per_block=tpb,
        max_batch_size=workload.requests,
        max_num_tokens=workload.chunk,
    )
    per_request = -(-(workload.prompt_len + workload.new_tokens) // tpb)

    def allocate(rank: HelixKVRank) -> Any:
        placement = RankPlacement(rank.cp_size, tpb, rank.cp_rank)
        return model.new_kv_pool(placement, rank.capacity_superblocks)

    helix = HelixKVRank.create(
        engine, workload.requests * per_request * engine.page_bytes, allocate=allocate
    )
    pool = helix.kv_storage
    rng = np.random.default_rng(index)
    for request_id in range(workload.requests):
        prompt = rng.integers(0, geometry.vocab_size, size=workload.prompt_len, dtype=np.int32)
        helix.add_request(request_id, prompt, workload.new_tokens)
    combine = group_combine(None)
    # one bucket: every decode-only step of the workload has its requests (or fewer)
    layout = DecodeLayout(workload.requests, per_request)
    metadata = DecodeMetadata(layout, device, [workload.requests])
    fast = DecodeStep(model, pool, combine, metadata, cuda_graphs=graphs)
    cuda = device.type == "cuda"
    driver: StepDriver[Any] = StepDriver(helix)
    records = []
    while helix.has_unfinished():
        start_event = torch.cuda.Event(enable_timing=True) if cuda else None
        end_event = torch.cuda.Event(enable_timing=True) if cuda else None
        started = time.perf_counter()
        out = driver.schedule()
        kind = "prefill" if len(out.context_ids) else "decode"
        if start_event is not None:
            start_event.record()
        host = None
        if kind == "decode":
            # None: more rows or pages than the layout holds, the general path
            counts = metadata.fill_if_fits(helix.scheduler, out)
            if counts is not None:
                fast.launch(counts.rows)
                if end_event is not None:
                    end_event.record()
                host = fast.read_tokens(counts.rows)
        if host is None:
            plan = StepPlan.from_schedule(helix.scheduler, out, pool.placement)
            batch = pool.prepare(plan)
            tokens = torch.zeros(out.num_samples, dtype=torch.int64, device=device)
            if plan.num_tokens:
                hidden = model.forward(batch, pool, combine)
                tokens = model.logits(hidden[batch.sample_index]).argmax(dim=-1)
            if end_event is not None:
                end_event.record()
            host = tokens.cpu().numpy()
        seconds = time.perf_counter() - started
        for request_id in driver.complete(host.astype(np.int32)).tolist():
            helix.take_output(request_id)
        device_ms = start_event.elapsed_time(end_event) if start_event and end_event else math.nan
        records.append(
            StepRecord(
                index,
                kind,
                int(out.num_tokens),
                kv_tokens_read(out),
                seconds * 1e3,
                device_ms,
                not records,
            )
        )
    return records


def commit() -> str:
    """The commit the run is of: ``--commit``'s, ``HELIX_KV_COMMIT``, git's, else unknown."""
    if os.environ.get("HELIX_KV_COMMIT"):
        return os.environ["HELIX_KV_COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def model_name(family: str, config: Any, small: bool) -> str:
    """What the profile's description calls the model."""
    shape = f"hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads"
    if family == "mla":
        shape += f", latent {config.kv_lora_rank} + rope {config.qk_rope_head_dim}"
    else:
        shape += f" / {config.num_kv_heads} kv heads of {config.head_dim}"
    shape += f", MLP {config.intermediate_size}, vocab {config.vocab_size}"
    what = {"llama": "Llama-3-8B-shaped stack", "mla": "DeepSeek-V3-style MLA stack"}[family]
    return f"{'tiny test model' if small else what} ({shape}; seeded random weights)"


def fit_report(records: list[StepRecord], sweep: tuple[Workload, ...], model: Any) -> list[str]:
    """The fit's error per workload and kind of step (mean measured vs mean modelled)."""
    lines = [
        "| workload | kind | steps | tokens (mean) | KV tokens (mean) | measured ms | device ms "
        "| modelled ms | error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for index, workload in enumerate(sweep):
        for kind in ("prefill", "decode"):
            group = [r for r in records if r.workload == index and r.kind == kind and not r.first]
            if not group:
                continue
            tokens = np.array([r.tokens for r in group])
            kv = np.array([r.kv_tokens for r in group])
            measured = float(np.mean([r.ms for r in group]))
            device = float(np.mean([r.device_ms for r in group]))
            modelled = float(np.mean(model.predict_ms(tokens, kv)))
            lines.append(
                f"| {workload} | {kind} | {len(group)} | {tokens.mean():.0f} | {kv.mean():.0f} | "
                f"{measured:.3f} | {device:.3f} | {modelled:.3f} | "
                f"{(modelled - measured) / measured:+.1%} |"
            )
    return lines


def export(args: argparse.Namespace) -> None:
    """Measure the sweep on ``args.model_family``, fit, print, write the profile."""
    from gpu_decode_floor import FAMILIES  # benches/ is on sys.path
    from helix_kv.simulate.timing import fit_step_time, load_profile, save_profile

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    graphs = device.type == "cuda" and args.cuda_graphs
    options = argparse.Namespace(small=args.small, layers=args.layers, exact_init=False)
    t0 = time.perf_counter()
    with torch.no_grad():
        family = FAMILIES[args.model_family](options, dtype, device)
        model = family.model
        sweep = CPU_SWEEP if args.small else GPU_SWEEP
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        name = model_name(args.model_family, model.config, args.small)
        print(
            f"# step-time profile: {args.model_family}, {name}, {args.dtype}, {gpu}, "
            f"tokens_per_block {args.tokens_per_block}, CUDA graphs "
            f"{'on' if graphs else 'off'}; built in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        records: list[StepRecord] = []
        started = time.perf_counter()
        for index, workload in enumerate(sweep):
            if time.perf_counter() - started > args.time_budget:
                print(f"# time budget of {args.time_budget:.0f} s spent: {workload} on skipped")
                break
            t1 = time.perf_counter()
            steps = run_workload(model, index, workload, args.tokens_per_block, graphs)
            records += steps
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(
                f"# {workload}: {len(steps)} steps in {time.perf_counter() - t1:.1f} s",
                flush=True,
            )
    kept = [r for r in records if not r.first]
    if not kept:
        raise SystemExit("no step to fit: every workload ran one step at most")
    tokens = np.array([r.tokens for r in kept])
    kv = np.array([r.kv_tokens for r in kept])
    measured = np.array([r.ms for r in kept])
    fitted = fit_step_time(tokens, kv, measured, source=args.export_step_time_profile)
    errors = (fitted.predict_ms(tokens, kv) - measured) / measured
    rms, worst = float(np.sqrt(np.mean(errors**2))), float(np.max(np.abs(errors)))
    description = (
        f"fitted by benches/gpu_executor.py --export-step-time-profile on the reference executor "
        f"(cp 1, plain mode, decode-only steps on the fast path, CUDA graphs "
        f"{'on' if graphs else 'off'}): {name}, {args.dtype}, {gpu}, commit {commit()}; "
        f"{len(kept)} steps of {len(sweep)} workloads, "
        f"relative error RMS {rms:.1%}, max {worst:.1%}"
    )
    profile = type(fitted)(
        fitted.fixed_ms,
        fitted.per_token_ms,
        fitted.per_kv_token_ms,
        source=fitted.source,
        description=description,
    )
    print()
    print("\n".join(fit_report(records, sweep, profile)))
    print()
    print(
        f"fit: {profile.describe()}; relative error over {len(kept)} steps: RMS {rms:.1%}, "
        f"max {worst:.1%}, median {statistics.median(np.abs(errors)):.1%}"
    )
    save_profile(profile, args.export_step_time_profile)
    back = load_profile(args.export_step_time_profile)  # the file reads back as written
    assert (back.fixed_ms, back.per_token_ms, back.per_kv_token_ms) == (
        profile.fixed_ms,
        profile.per_token_ms,
        profile.per_kv_token_ms,
    )
    print(f"wrote {args.export_step_time_profile}: {back.description}")
