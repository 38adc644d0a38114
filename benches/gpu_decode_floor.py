"""The executor's graphed decode step against its HBM floor (cp = 1, or one GPU a CP rank).

    python benches/gpu_decode_floor.py                       # 64 x 576, 64 x 2112, 256 x 576
    python benches/gpu_decode_floor.py --profile             # ... and the per-part breakdown
    python benches/gpu_decode_floor.py --shapes 64x576 --replays 500
    python benches/gpu_decode_floor.py --model-family mla    # the MLA stack of the same bytes
    python benches/gpu_decode_floor.py --model-family mla --mla-tilings h32-k32-w4-s3-pf
    python benches/gpu_decode_floor.py --device cpu --small  # CPU smoke run (interpreter)
    python benches/gpu_decode_floor.py --cp 2                # 2 GPUs, NCCL (NCCL_NVLS_ENABLE=0)
    python benches/gpu_decode_floor.py --cp 2 --device cpu --small --shapes 4x64  # gloo

A decode step reads every weight once and every cached KV byte once, so no step runs faster
than ``(weight bytes + KV bytes read) / HBM bandwidth``. Per shape (``requests x context``:
each request attends to ``context`` keys, its new token written first) the bench builds the
decode fast path the executor runs (:class:`~helix_kv.executor.decode_step.DecodeStep` on
:class:`~helix_kv.executor.decode_step.DecodeMetadata` rows, one CUDA graph per step:
H2D copy of the rows, ``forward_decode``, logits, argmax) over a KV pool of random keys and
values on scattered pages, and prints:

* ``bw``: the HBM copy bandwidth measured in the same run (a 2 GiB device-to-device copy,
  bytes read + written / time, median);
* ``weights``: weight bytes one step reads (every layer weight the decode path reads, the
  final norm and the LM head; of the embedding table only the gathered rows);
* ``kv``: KV bytes the attention reads (every request's keys and values, every layer);
* ``byte floor`` = (weights + kv) / bw;
* ``roofline floor`` = max(weights / bw, weight-GEMM FLOPs / rate) + max(kv / bw, attention
  FLOPs / rate), ``rate`` the bf16 matmul rate measured in the same run (an 8192^3 product):
  past the ridge point (the GEMMs at 256 rows, MLA's attention at about 128 heads, which
  does about 2 x heads FLOPs a latent byte) a part takes its arithmetic's time, not its
  bytes'; the weight GEMMs count 2 FLOPs a weight and row, the attention 2 a multiply-add
  of its scores and values (MLA's absorbed form: latent + RoPE and latent a head and key);
* ``step``: the median of many graph replays (CUDA events around each
  ``DecodeStep.launch``), and the two ratios, step / byte floor and step / roofline floor.

``--profile`` adds a per-part breakdown: the kernels of a few graph replays
(``torch.profiler``) give the kernel time per step and the launch gaps (step time minus
kernel time); one eager step with each part of the forward wrapped in a
``record_function`` range attributes every kernel to its part (GEMMs, attention, norm, rope,
KV write, activation, LM head / argmax, other); and each weight's GEMM is timed alone
(``rows x K @ K x N``, the four layers' copies in turn so L2 holds none) against the copy
bandwidth.

Model families: ``--model-family`` picks a builder of :data:`FAMILIES`: ``llama`` (the
Llama-shaped stack above) or ``mla`` (a DeepSeek-V3-style MLA stack of about the same weight
bytes, :func:`mla_config`); each returns a :class:`Family` with the model, its bytes per step
and its profiled parts.

``--cp N`` runs one rank a GPU (``helix_kv.distributed.launch.spawn_group``: NCCL on GPUs,
gloo on the CPU). Every rank holds the whole model and its share of each request's keys
(``RankPlacement``: whole pages dealt round robin, the step's new token written by its
owner), and the step ends with the executor's cross-rank combine (an all-gather of each
layer's partial output and LSE, in the graph). A rank's floor counts the weights and the KV
it holds; the table gives the slowest rank's step and the largest floor (the rank with the
most keys), and ``ratio`` their quotient, so the combine's communication is in the step but
not in the floor. ``--profile`` runs at cp = 1 only.

Weights are seeded random numbers. ``--exact-init`` draws them as the model does everywhere
else (float64 on the CPU, about a minute for this size); by default the bench draws the same
normal weights (another seeded stream) on the GPU, which changes no timing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

#: Step parts of the breakdown, in print order.
PARTS = (
    "gemm",
    "attention",
    "norm",
    "rope",
    "kv write",
    "rope+kv write",
    "activation",
    "lm_head/argmax",
    "combine",
    "other",
)
GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|splitk|cublas", re.IGNORECASE)


@dataclass
class Family:
    """What the bench needs of one model family.

    ``parts``: ``(module, attribute, part)`` of the functions the decode forward calls, each
    wrapped in a ``record_function`` range of its part for the eager profile (absent
    attributes are skipped, so one list serves the fused and the unfused forward).
    ``gemm_weights``: ``name -> [per-layer weight]`` timed alone under ``--profile``.
    """

    name: str
    model: Any
    dtype: torch.dtype
    weight_bytes: int
    embedding_row_bytes: int
    kv_bytes_per_token: int
    #: attention FLOPs of one decode row and one key it reads, every layer (scores and
    #: values: 2 FLOPs a multiply-add)
    attention_flops_per_key: int = 0
    parts: list[tuple[str, str, str]] = field(default_factory=list)
    gemm_weights: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def llama_config(small: bool, layers: int) -> Any:
    from helix_kv.executor.model import TinyConfig

    if small:
        return TinyConfig(num_layers=layers)
    return TinyConfig(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        seed=0,
    )


@contextlib.contextmanager
def device_draws(device: torch.device, seed: int) -> Iterator[None]:
    """While open, ``torch.randn(..., generator=g, dtype=float64)`` of a CPU generator draws
    float32 normals on ``device`` from a generator seeded with ``seed`` (the model's
    constructor then scales and casts them there): the same distribution, seconds instead
    of a minute of CPU draws."""
    original = torch.randn
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("generator", None)
        kwargs.pop("dtype", None)
        return original(*shape, generator=generator, dtype=torch.float32, device=device, **kwargs)

    torch.randn = randn  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.randn = original


def llama_family(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> Family:
    """The Llama-shaped :class:`TinyTransformer` and its bytes per step."""
    from helix_kv.executor.model import TinyTransformer

    c = llama_config(args.small, args.layers)
    draws = contextlib.nullcontext() if args.exact_init else device_draws(device, c.seed)
    with draws:
        model = TinyTransformer(c, dtype=dtype, device=device, decode_kernel=True)
    esize = torch.empty((), dtype=dtype).element_size()
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = (
        c.hidden_size * (q_width + 2 * kv_width)  # wqkv
        + q_width * c.hidden_size  # wo
        + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
        + 2 * c.hidden_size  # the two norms
    )
    weights = c.num_layers * per_layer + c.hidden_size + c.hidden_size * c.vocab_size
    layers = model.layers
    gemms = {
        "wqkv": [w["wqkv"] for w in layers],
        "wo": [w["wo"] for w in layers],
        "w_gate": [w["w_gate"] for w in layers],
        "w_up": [w["w_up"] for w in layers],
        "w_down": [w["w_down"] for w in layers],
    }
    if "w_gate_up" in layers[0]:
        gemms["w_gate_up"] = [w["w_gate_up"] for w in layers]
    gemms["lm_head"] = [model.lm_head]
    model_module = "helix_kv.executor.model"
    fused_module = "helix_kv.executor.fused"
    parts = [
        (model_module, "_rms_norm", "norm"),
        (model_module, "_apply_rope", "rope"),
        (model_module + ".Transformer", "_rope_tables", "rope"),
        (model_module, "write_paged_kv", "kv write"),
        (model_module, "paged_decode_attention", "attention"),
        ("torch.nn.functional", "silu", "activation"),
        (fused_module, "rms_norm", "norm"),
        (fused_module, "add_rms_norm", "norm"),
        (fused_module, "rope_split_write", "rope+kv write"),
        (fused_module, "silu_mul", "activation"),
        (fused_module, "rope_tables", "rope"),
        (fused_module, "argmax", "lm_head/argmax"),
        (model_module + ".Transformer", "logits", "lm_head/argmax"),
        ("torch", "argmax", "lm_head/argmax"),
    ]
    return Family(
        "llama",
        model,
        dtype,
        weight_bytes=weights * esize,
        embedding_row_bytes=c.hidden_size * esize,
        kv_bytes_per_token=c.num_layers * 2 * kv_width * esize,
        # every query head: q . k and p * v over head_dim
        attention_flops_per_key=c.num_layers * 4 * c.num_heads * c.head_dim,
        parts=parts,
        gemm_weights=gemms,
    )


def mla_config(small: bool, layers: int) -> Any:
    """An MLA stack of about the Llama stack's weight bytes: hidden 4096, 32 heads, no query
    bottleneck, latent 512 + RoPE 64, no-RoPE and value dims 128 (48.5 M attention weights
    a layer against Llama's 41.9 M), MLP 13824 (169.9 M against 176.2 M): 218.4 M a layer
    against 218.1 M."""
    from helix_kv.executor.model import MLAConfig

    if small:
        return MLAConfig(num_layers=layers)
    return MLAConfig(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=layers,
        num_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=13824,
        seed=0,
    )


def mla_family(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> Family:
    """The MLA stack of :func:`mla_config` and its bytes per step: every weight once (the
    key and value up-projections are ``wkv_b``'s two halves, read as ``w_uk`` and
    ``w_uv``), one latent of ``kv_lora_rank + qk_rope_head_dim`` per token and layer."""
    from helix_kv.executor.model import Transformer

    c = mla_config(args.small, args.layers)
    draws = contextlib.nullcontext() if args.exact_init else device_draws(device, c.seed)
    with draws:
        model = Transformer(c, dtype=dtype, device=device, decode_kernel=True)
    esize = torch.empty((), dtype=dtype).element_size()
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q_weights = (
        c.hidden_size * c.num_heads * qk
        if c.q_lora_rank is None
        else c.hidden_size * c.q_lora_rank + c.q_lora_rank * (c.num_heads * qk + 1)
    )
    per_layer = (
        q_weights
        + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)  # kv_a
        + c.kv_lora_rank  # its norm
        + c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)  # w_uk, w_uv
        + c.num_heads * c.v_head_dim * c.hidden_size  # wo
        + 3 * c.hidden_size * c.intermediate_size
        + 2 * c.hidden_size
    )
    weights = c.num_layers * per_layer + c.hidden_size + c.hidden_size * c.vocab_size
    layers = model.layers
    gemms = {
        "w_in": [w["w_in"] for w in layers],
        "wo": [w["wo"] for w in layers],
        "w_gate_up": [w["w_gate_up"] for w in layers],
        "w_down": [w["w_down"] for w in layers],
        "lm_head": [model.lm_head],
    }
    model_module = "helix_kv.executor.model"
    fused_module = "helix_kv.executor.fused"
    parts = [
        (model_module, "_rms_norm", "norm"),
        (model_module, "_apply_rope", "rope"),
        (model_module, "write_paged_kv", "kv write"),
        (model_module, "paged_mla_decode_attention", "attention"),
        (fused_module, "add_rms_norm", "norm"),
        (fused_module, "silu_mul", "activation"),
        (fused_module, "rope_tables", "rope"),
        (fused_module, "argmax", "lm_head/argmax"),
        (model_module + ".Transformer", "logits", "lm_head/argmax"),
    ]
    return Family(
        "mla",
        model,
        dtype,
        weight_bytes=weights * esize,
        embedding_row_bytes=c.hidden_size * esize,
        kv_bytes_per_token=c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * esize,
        # absorbed form, every query head: its score over latent + RoPE, its value the latent
        attention_flops_per_key=c.num_layers
        * 2
        * c.num_heads
        * (2 * c.kv_lora_rank + c.qk_rope_head_dim),
        parts=parts,
        gemm_weights=gemms,
    )


#: ``--model-family`` -> builder.
FAMILIES: dict[str, Callable[[argparse.Namespace, torch.dtype, torch.device], Family]] = {
    "llama": llama_family,
    "mla": mla_family,
}


def _resolve(path: str) -> Any:
    """A module or a class inside one (``pkg.mod.Class``); ``None`` if it does not import."""
    try:
        return importlib.import_module(path)
    except ImportError:
        head, _, tail = path.rpartition(".")
        try:
            return getattr(importlib.import_module(head), tail, None)
        except ImportError:
            return None


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def part_ranges(parts: list[tuple[str, str, str]]) -> Iterator[None]:
    """While open, each listed function runs inside a ``record_function("part:<part>")``
    range, the device synchronized before the range and at its end: every kernel the call
    launches runs inside the range's time span, and no other kernel does."""
    undo = []
    for path, name, part in parts:
        owner = _resolve(path)
        original = getattr(owner, name, None) if owner is not None else None
        if original is None:
            continue

        def wrapped(*a: Any, _f: Any = original, _p: str = part, **k: Any) -> Any:
            _synchronize()
            with torch.profiler.record_function("part:" + _p):
                result = _f(*a, **k)
                _synchronize()
            return result

        setattr(owner, name, wrapped)
        undo.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 20) -> float:
    """HBM bandwidth in bytes/s: bytes read + written by a device-to-device copy / time."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n * 4 / statistics.median(times)


def matmul_rate(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """Dense bf16 matrix-product rate in FLOP/s (random ``size``-cubed operands, median)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times)


@dataclass
class Shape:
    rows: int
    context: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        rows, context = text.lower().split("x")
        return cls(int(rows), int(context))

    def __str__(self) -> str:
        return f"{self.rows} x {self.context}"


class Setup:
    """A KV pool of random KV for one shape, its decode metadata and the graphed step."""

    def __init__(
        self,
        family: Family,
        shape: Shape,
        tpb: int,
        device: torch.device,
        graphs: bool,
        cp_size: int = 1,
        cp_rank: int = 0,
    ) -> None:
        from helix_kv.executor.decode_step import DecodeLayout, DecodeMetadata, DecodeStep
        from helix_kv.executor.model import group_combine
        from helix_kv.executor.placement import RankPlacement

        model = family.model
        self.shape = shape
        placement = RankPlacement(cp_size, tpb, cp_rank)
        # one page a superblock on every rank (at cp = 1 a superblock is a page)
        pages = int(placement.superblocks_for(shape.context))
        self.local_len = int(placement.local_lens(shape.context))
        total = shape.rows * pages
        self.pool = model.new_kv_pool(placement, total)
        generator = torch.Generator(device=device).manual_seed(1)
        for cache in (self.pool.key_cache, self.pool.value_cache):
            for layer in range(cache.shape[0]):  # random KV, never zeros
                cache[layer].normal_(generator=generator)
        order = torch.randperm(total, generator=torch.Generator().manual_seed(2))
        table = order.view(shape.rows, pages).numpy()  # scattered pages
        position = shape.context - 1  # the step's token, written first, then attended to
        # its slot on the rank that owns it, -1 on the others
        slots = placement.slot_mapping(table, np.arange(shape.rows), np.full(shape.rows, position))
        tokens = torch.randint(
            model.config.vocab_size, (shape.rows,), generator=torch.Generator().manual_seed(3)
        )
        self.metadata = DecodeMetadata(DecodeLayout(shape.rows, pages), device, [shape.rows])
        # the executor's combine: over the default group (cp = 1, none: the local combine)
        self.combine = group_combine(None)
        self.step = DecodeStep(model, self.pool, self.combine, self.metadata, cuda_graphs=graphs)
        self.rows = self.metadata.fill(
            tokens.numpy(), position, slots, self.local_len, position, table
        )

    def launch(self) -> None:
        """One step as the executor launches it (graphed: one replay, the rows' copy first)."""
        self.step.launch(self.rows)

    def check(self) -> None:
        """Finite logits and, across a CP group, the same on every rank (each rank's LM head
        reads the combined attention of all ranks' keys)."""
        logits = self.step.logits[: self.rows]
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError(f"{self.shape}: non-finite logits")
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, logits.contiguous())
            if not all(torch.equal(other, gathered[0]) for other in gathered):
                raise RuntimeError(f"{self.shape}: the ranks' logits differ")


def time_steps(setup: Setup, replays: int, device: torch.device) -> float:
    """Median seconds of one step (events around each launch, launches back to back)."""
    for _ in range(10):
        setup.launch()
    if device.type != "cuda":
        times = []
        for _ in range(replays):
            t0 = time.perf_counter()
            setup.launch()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        setup.launch()
        end.record()
    torch.cuda.synchronize()
    setup.metadata.release_all()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def _kernel_events(prof: Any) -> list[Any]:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def graph_kernels(setup: Setup, replays: int = 5) -> tuple[float, int, dict[str, float]]:
    """Kernel seconds per step, kernels per step and seconds per kernel name, of replays."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            setup.launch()
        torch.cuda.synchronize()
    setup.metadata.release_all()
    by_name: dict[str, float] = defaultdict(float)
    count = 0
    for event in _kernel_events(prof):
        if "memcpy" in event.name.lower() or "memset" in event.name.lower():
            continue
        by_name[event.name] += event.time_range.elapsed_us() / 1e6 / replays
        count += 1
    return sum(by_name.values()), count // replays, dict(by_name)


def eager_parts(family: Family, setup: Setup) -> dict[str, float]:
    """Kernel seconds of one eager step by part: a kernel that ran inside a part's range
    (the innermost) is that part's; any other is a GEMM or other by its name. Triton's
    launches are no torch ops, so kernels are placed by time, not by their launching op."""
    from torch.profiler import ProfilerActivity, profile

    from helix_kv.executor.decode_step import DecodeStep

    eager = DecodeStep(family.model, setup.pool, setup.combine, setup.metadata)
    with part_ranges(family.parts):
        combine = setup.combine

        def ranged_combine(partial: Any) -> Any:
            _synchronize()
            with torch.profiler.record_function("part:combine"):
                result = combine(partial)
                _synchronize()
            return result

        eager.combine = ranged_combine
        eager.launch(setup.rows)  # warm-up
        _synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eager.launch(setup.rows)
            _synchronize()
    setup.metadata.release_all()
    ranges = [
        (e.time_range.start, e.time_range.end, e.name[5:])
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("part:")
    ]
    parts: dict[str, float] = defaultdict(float)
    for kernel in _kernel_events(prof):
        name = kernel.name.lower()
        # the ranges' own spans on the GPU timeline (user annotations) are no kernels
        if "memcpy" in name or "memset" in name or kernel.name.startswith("part:"):
            continue
        middle = (kernel.time_range.start + kernel.time_range.end) / 2
        inside = [(end - start, part) for start, end, part in ranges if start <= middle <= end]
        by_name = "gemm" if GEMM_KERNEL.search(kernel.name) else "other"
        part = min(inside)[1] if inside else by_name
        parts[part] += kernel.time_range.elapsed_us() / 1e6
    return dict(parts)


def gemm_table(family: Family, rows: int, bandwidth: float, device: torch.device) -> list[str]:
    """Each weight's GEMM alone at ``rows`` rows: median µs, weight bytes / time, of bw."""
    lines = [
        f"| GEMM ({rows} rows) | K x N | µs | TB/s (weight bytes) | of copy bw |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, weights in family.gemm_weights.items():
        k, n = weights[0].shape
        x = torch.randn(rows, k, device=device, dtype=family.dtype)
        out = torch.empty(rows, n, device=device, dtype=family.dtype)
        for w in weights:
            torch.matmul(x, w, out=out)
        times = []
        for index in range(40):
            w = weights[index % len(weights)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(x, w, out=out)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        seconds = statistics.median(times)
        rate = weights[0].numel() * weights[0].element_size() / seconds
        lines.append(
            f"| {name} | {k} x {n} | {seconds * 1e6:.1f} | {rate / 1e12:.2f} | "
            f"{rate / bandwidth:.0%} |"
        )
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-family", default="llama", choices=sorted(FAMILIES))
    parser.add_argument("--shapes", default="64x576,64x2112,256x576")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="per-part breakdown")
    parser.add_argument("--kernels", type=int, default=14, help="kernels listed per shape")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="the tiny test model")
    parser.add_argument("--exact-init", action="store_true", help="the model's CPU draws")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--mla-tilings",
        nargs="+",
        default=None,
        help="MLA kernel: tiling tables, each MIN_HEADS:NAME,... or one NAME "
        "(paged_attention.MLA_TILINGS; A/B of paged_attention.MLA_TILING_TABLE): every shape "
        "is timed with each in turn, one model build",
    )
    parser.add_argument("--cp", type=int, default=1, help="CP ranks, one GPU each")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="rendezvous and collective timeout, s"
    )
    args = parser.parse_args()
    if args.cp < 1:
        parser.error(f"--cp must be at least 1, got {args.cp}")
    if args.cp > 1 and args.profile:
        parser.error("--profile runs at --cp 1 only")
    return args


def kernel_options(args: argparse.Namespace) -> list[str | None]:
    """The MLA tiling tables to time in turn (``None``: the module's own), each checked."""
    from helix_kv.executor import paged_attention

    for spec in args.mla_tilings or []:
        paged_attention.parse_mla_tiling_table(spec)  # a bad name fails before device time
    return list(args.mla_tilings or [None])


def apply_kernel_options(spec: str | None) -> None:
    """One MLA tiling table, set before the step is built (its graph captures the kernel)."""
    from helix_kv.executor import paged_attention

    if spec is not None:
        paged_attention.MLA_TILING_TABLE = paged_attention.parse_mla_tiling_table(spec)


class Row(NamedTuple):
    """One shape's figures (one rank's: its KV; across ranks :func:`combine_ranks`)."""

    shape: str
    weight_bytes: int
    kv_bytes: int
    step_s: float
    bandwidth: float  # copy bandwidth, B/s (read + write)
    matmul_rate: float  # bf16 FLOP/s of the 8192^3 product
    gemm_s: float  # the weight GEMMs' FLOPs (2 a weight and row) at the matmul rate
    attention_s: float  # the attention's FLOPs at the matmul rate

    @property
    def byte_floor_s(self) -> float:
        """Every weight and KV byte read once at the copy bandwidth."""
        return (self.weight_bytes + self.kv_bytes) / self.bandwidth

    @property
    def roofline_floor_s(self) -> float:
        """Each part at the larger of its bytes at the copy bandwidth and its FLOPs at the
        matmul rate: ``max(weights / bw, GEMM FLOPs / rate) + max(KV / bw, attention
        FLOPs / rate)``."""
        return max(self.weight_bytes / self.bandwidth, self.gemm_s) + max(
            self.kv_bytes / self.bandwidth, self.attention_s
        )


def measure(
    args: argparse.Namespace,
    device: torch.device,
    cp_size: int = 1,
    cp_rank: int = 0,
    log: Callable[[str], None] = functools.partial(print, flush=True),
) -> tuple[list[Row], list[Any], Family, float]:
    """Build the family on ``device`` and time every shape as rank ``cp_rank`` of
    ``cp_size``: the rows, the breakdowns (``--profile``), the family and the bandwidth."""
    dtype = getattr(torch, args.dtype)
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    graphs = device.type == "cuda"
    t0 = time.perf_counter()
    family = FAMILIES[args.model_family](args, dtype, device)
    built = time.perf_counter() - t0
    bandwidth = copy_bandwidth(device) if graphs else float("nan")
    rate = matmul_rate(device) if graphs else float("nan")
    name = torch.cuda.get_device_name(device) if graphs else "cpu"
    log(
        f"{family.name} model, {args.layers} layers, {args.dtype}, tokens_per_block "
        f"{args.tokens_per_block}, cp {cp_size}, {name}; built in {built:.1f} s; "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); "
        f"bf16 matmul {rate / 1e12:.0f} TFLOP/s (8192^3)"
    )
    esize = torch.empty((), dtype=dtype).element_size()
    rows = []
    breakdowns = []
    specs = kernel_options(args)
    for spec, shape in ((spec, shape) for spec in specs for shape in shapes):
        apply_kernel_options(spec)
        label = f"{shape}" if len(specs) == 1 or spec is None else f"{shape} [{spec}]"
        t0 = time.perf_counter()
        setup = Setup(family, shape, args.tokens_per_block, device, graphs, cp_size, cp_rank)
        seconds = time_steps(setup, args.replays, device)
        setup.check()
        weights = family.weight_bytes + shape.rows * family.embedding_row_bytes
        kv = shape.rows * setup.local_len * family.kv_bytes_per_token  # this rank's keys
        # the GEMMs' arithmetic (2 FLOP per weight and row) at the matmul rate: past the
        # ridge point (rows > rate / bw FLOP per byte) the weights take longer than reading
        gemm_s = 2 * shape.rows * (family.weight_bytes / esize) / rate
        attention_s = shape.rows * setup.local_len * family.attention_flops_per_key / rate
        row = Row(label, weights, kv, seconds, bandwidth, rate, gemm_s, attention_s)
        rows.append(row)
        log(
            f"{label}: step {seconds * 1e3:.3f} ms, byte floor {row.byte_floor_s * 1e3:.3f} ms "
            f"(ratio {seconds / row.byte_floor_s:.2f}), roofline floor "
            f"{row.roofline_floor_s * 1e3:.3f} ms (ratio {seconds / row.roofline_floor_s:.2f}) "
            f"(set up and timed in {time.perf_counter() - t0:.1f} s)"
        )
        if args.profile and graphs:
            try:
                kernel_s, kernels, by_name = graph_kernels(setup)
                parts = eager_parts(family, setup)
            except Exception as exc:  # a profiler failure keeps the timings
                log(f"{label}: profile failed: {exc!r}")
            else:
                breakdowns.append((label, seconds, kernel_s, kernels, by_name, parts))
        del setup
        if graphs:
            torch.cuda.empty_cache()

    return rows, breakdowns, family, bandwidth


def measure_rank(rank: int, world_size: int, options: dict[str, Any]) -> list[tuple[Any, ...]]:
    """One CP rank of ``--cp``, run by ``spawn_group`` inside its process group (NCCL ranks
    on GPU ``rank``): its rows; rank 0 prints its progress."""
    args = argparse.Namespace(**options)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if args.device == "cuda"
        else torch.device("cpu")
    )
    log = functools.partial(print, flush=True) if rank == 0 else (lambda line: None)
    with torch.no_grad():
        # plain tuples: the parent rebuilds the rows (no class crosses the processes)
        return [tuple(row) for row in measure(args, device, world_size, rank, log)[0]]


def combine_ranks(per_rank: list[list[Row]]) -> list[Row]:
    """One row a shape over the ranks: the slowest rank's step, and the bytes, rates and
    FLOP times of the rank of the largest roofline floor (the rank with the most keys)."""
    rows = []
    for shape_rows in zip(*per_rank):
        bound = max(shape_rows, key=lambda row: row.roofline_floor_s)
        rows.append(bound._replace(step_s=max(row.step_s for row in shape_rows)))
    return rows


def print_table(rows: list[Row]) -> None:
    """The floors and ratios, one line a shape."""
    print(
        "| requests x context | weights MB | KV MB | bw TB/s | bf16 TFLOP/s | weights: bytes / "
        "FLOPs ms | KV: bytes / FLOPs ms | byte floor ms | roofline floor ms | step ms "
        "| ratio (byte floor) | ratio (roofline floor) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        bw = row.bandwidth
        print(
            f"| {row.shape} | {row.weight_bytes / 1e6:.0f} | {row.kv_bytes / 1e6:.0f} | "
            f"{bw / 1e12:.2f} | {row.matmul_rate / 1e12:.0f} | "
            f"{row.weight_bytes / bw * 1e3:.3f} / {row.gemm_s * 1e3:.3f} | "
            f"{row.kv_bytes / bw * 1e3:.3f} / {row.attention_s * 1e3:.3f} | "
            f"{row.byte_floor_s * 1e3:.3f} | {row.roofline_floor_s * 1e3:.3f} | "
            f"{row.step_s * 1e3:.3f} | {row.step_s / row.byte_floor_s:.2f} | "
            f"**{row.step_s / row.roofline_floor_s:.2f}** |"
        )


def main() -> None:
    args = parse_args()
    kernel_options(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_decode_floor.py needs a CUDA device (or --device cpu --small)")
    if device.type == "cuda" and torch.cuda.device_count() < args.cp:
        sys.exit(
            f"--cp {args.cp} needs {args.cp} GPUs, this machine has {torch.cuda.device_count()}"
        )
    if device.type == "cpu":
        # before triton is first imported: the kernels run in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.replays = min(args.replays, 3)
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    graphs = device.type == "cuda"
    breakdowns: list[Any] = []
    if args.cp == 1:
        rows, breakdowns, family, bandwidth = measure(args, device)
    else:
        from helix_kv.distributed.launch import spawn_group

        per_rank = spawn_group(
            measure_rank,
            args.cp,
            (vars(args),),
            backend="nccl" if graphs else "gloo",
            timeout_s=args.timeout,
            env={"TRITON_INTERPRET": "1"} if not graphs else None,
        )
        per_rank = [[Row(*row) for row in rank_rows] for rank_rows in per_rank]
        for rank, rank_rows in enumerate(per_rank):
            for row in rank_rows:
                print(
                    f"rank {rank}: {row.shape}: step {row.step_s * 1e3:.3f} ms, KV "
                    f"{row.kv_bytes / 1e6:.0f} MB, roofline floor "
                    f"{row.roofline_floor_s * 1e3:.3f} ms"
                )
        rows = combine_ranks(per_rank)
    print()
    print_table(rows)
    for shape, seconds, kernel_s, kernels, by_name, parts in breakdowns:
        print()
        print(
            f"### {shape}: step {seconds * 1e6:.0f} µs, {kernels} kernels, kernel time "
            f"{kernel_s * 1e6:.0f} µs (graph replay), gaps {(seconds - kernel_s) * 1e6:.0f} µs"
        )
        print("| part (eager step, kernel time) | µs | of step |")
        print("| --- | ---: | ---: |")
        for part in [p for p in PARTS if p in parts] + sorted(set(parts) - set(PARTS)):
            print(f"| {part} | {parts[part] * 1e6:.1f} | {parts[part] / seconds:.1%} |")
        print(f"| (sum) | {sum(parts.values()) * 1e6:.1f} | {sum(parts.values()) / seconds:.1%} |")
        print()
        print("| kernel (graph replay) | µs per step |")
        print("| --- | ---: |")
        top = sorted(by_name.items(), key=lambda item: -item[1])[: args.kernels]
        for kernel, s in top:
            print(f"| {kernel[:100]} | {s * 1e6:.1f} |")
    if args.profile and graphs:
        for size in sorted({shape.rows for shape in shapes}):
            print()
            print("\n".join(gemm_table(family, size, bandwidth, device)))


if __name__ == "__main__":
    with torch.no_grad():
        main()
