"""Triton kernels of the decode fast path: paged partial attention with LSE, and the KV write.

:func:`paged_decode_attention` is one rank's partial attention for decode entries (one query
token per request), read straight from the paged KV cache through the block table: no gather of
whole pages, no dense mask. It returns what
:func:`~helix_kv.executor.attention.partial_attention` returns for the same problem (the
readable reference the tests compare it with): the output normalised over this rank's keys
and its log-sum-exp, ``0`` / ``-inf`` for a request this rank holds no key of, so the exact
LSE combine across the CP group (one collective per layer) is unchanged.

A decode query sees every key its rank holds after the step (the step's own token included:
it is written first), so the only mask is the request's local length: local key ``j`` is
visible iff ``j < local_len``, and sits in slot ``table[j // tpb] * tpb + j % tpb``.

:func:`paged_mla_decode_attention` is the same for multi-head latent attention (DeepSeek-V3,
absorbed form): one latent head per token (the compressed KV latent and its RoPE key, one
cache written by ``write_paged_kv(latent, None, slots, cache, None)``), read once per key
block for every query head of a tile, its latent serving as the value.

The kernels run on CUDA tensors, compiled by Triton. They also run on CPU tensors through
Triton's interpreter (slow; the CI tests without a GPU use it), which Triton switches on for a
whole process: ``TRITON_INTERPRET=1`` must be in the environment before triton is first
imported (``tests/executor/conftest.py`` does that when there is no CUDA device). They
allocate nothing but their outputs (and, with several splits and no
:class:`DecodeWorkspace` given, the splits' scratch), take no host sync and are safe to
capture in a CUDA graph: the split count comes from static sizes only (:func:`decode_splits`).
They are written for Triton 3.6 and later.
"""

from __future__ import annotations

import functools
import math
import os
import re
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from helix_kv.executor.attention import PartialAttention, accumulation_dtype

#: Keys per block of the decode kernel's online softmax.
DECODE_BLOCK_KEYS = 64
#: Warps and pipeline stages of the decode kernel.
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2
#: Smallest dot operand side Triton takes (query heads, keys and head dim are padded to it).
_DOT_MIN = 16
#: Programs (request x kv head x split) the split rule aims for: a few per SM of an H200
#: (132 SMs), so that short batches of long requests still fill the device.
DECODE_TARGET_PROGRAMS = 4 * 132
#: Programs at and above which the rule takes one split: about the resident programs of the
#: device (three per SM at 128-wide heads). Seen on one H200 (Llama shape, 8 kv heads of 128,
#: bf16, graph replay): 64 requests of 576 keys (512 programs) in one split 43 us, in two
#: 51 us; of 2112 keys 132 us against 140 us.
DECODE_FULL_PROGRAMS = 3 * 132
#: Fewest keys (of the widest request) per split: shorter splits cost more to combine than
#: they save.
DECODE_MIN_SPLIT_KEYS = 256
#: Most splits per request the rule picks.
DECODE_MAX_SPLITS = 128
#: Most elements of a broadcast product ``[heads, keys, latent]`` without tensor-core dots
#: (float64 on a GPU).
MLA_NODOT_ELEMENTS = 16 * 1024
#: Keys per block, warps and pipeline stages of the MLA decode kernel without dots.
_MLA_NODOT_KEYS = 16
_MLA_NODOT_WARPS = 4
_MLA_NODOT_STAGES = 2


@dataclass(frozen=True)
class MLATiling:
    """How :func:`paged_mla_decode_attention` tiles a call on tensor cores.

    ``block_heads`` query heads a program (a request of fewer heads gets a tile of its heads
    padded to a power of two, at least 16; each tile of a request reads all of its latents,
    so the wider the tile the fewer times the cache is read), ``block_keys`` keys a block of
    the online softmax, ``num_warps`` and ``num_stages`` the launch's, ``prefetch`` the
    kernel's loop with each block's slots looked up one block ahead (the pipeliner then
    keeps ``num_stages - 1`` blocks in flight; without it one buffer, each block's copy
    waited for before it computes), and the split rule's programs (request x head tile x
    split) to aim for and at which it takes one split (:func:`decode_splits`).
    """

    block_heads: int
    block_keys: int
    num_warps: int
    num_stages: int
    prefetch: bool
    target_programs: int = DECODE_TARGET_PROGRAMS
    full_programs: int = DECODE_FULL_PROGRAMS

    def __post_init__(self) -> None:
        for name in ("block_heads", "block_keys"):
            value = getattr(self, name)
            if value < _DOT_MIN or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {_DOT_MIN}, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(
                f"num_warps must be 1, 2, 4, 8 or 16 and num_stages >= 1, got "
                f"{self.num_warps} / {self.num_stages}"
            )
        if min(self.target_programs, self.full_programs) < 1:
            raise ValueError("the split rule's program counts must be at least 1")

    @classmethod
    def from_name(cls, name: str) -> MLATiling:
        """The tiling a :attr:`name` describes (any fields, named in :data:`MLA_TILINGS` or
        not), e.g. ``h32-k16-w4-s4-pf``; ``ValueError`` if it describes none."""
        match = _TILING_NAME.fullmatch(name)
        if match is None:
            raise ValueError(
                f"MLA tiling {name!r} is not h<heads>-k<keys>-w<warps>-s<stages>[-pf]"
                f"[-t<target>-f<full>] (named ones: {', '.join(MLA_TILINGS)})"
            )
        heads, keys, warps, stages, prefetch, target, full = match.groups()
        return cls(
            int(heads),
            int(keys),
            int(warps),
            int(stages),
            prefetch is not None,
            DECODE_TARGET_PROGRAMS if target is None else int(target),
            DECODE_FULL_PROGRAMS if full is None else int(full),
        )

    @property
    def name(self) -> str:
        """``h<heads>-k<keys>-w<warps>-s<stages>``, ``-pf`` with prefetch, ``-t<target>-f<full>``
        where the split rule's programs are not the decode kernel's."""
        name = f"h{self.block_heads}-k{self.block_keys}-w{self.num_warps}-s{self.num_stages}"
        if self.prefetch:
            name += "-pf"
        if (self.target_programs, self.full_programs) != (
            DECODE_TARGET_PROGRAMS,
            DECODE_FULL_PROGRAMS,
        ):
            name += f"-t{self.target_programs}-f{self.full_programs}"
        return name


_TILING_NAME = re.compile(r"h(\d+)-k(\d+)-w(\d+)-s(\d+)(-pf)?(?:-t(\d+)-f(\d+))?")


def _tilings(*tilings: MLATiling) -> dict[str, MLATiling]:
    return {tiling.name: tiling for tiling in tilings}


#: The MLA kernel's candidate tilings by name (``benches/gpu_mla_attention.py`` times them;
#: ``benches/triton_kernel_resources.py`` reads what Triton 3.6 compiles each to for
#: ``cuda:90``, DeepSeek-V3's 512 + 64 in bf16: registers, stack, shared memory, and so the
#: programs an SM holds). Without prefetch:
#:
#: - ``h32-k32-w4-s2``: one buffer, 255 registers, 104 bytes of stack, 74 KB, 2 programs an
#:   SM; at 32 heads 64 x 2112 in 112.8 µs a layer on one H200 (1.4 TB/s of latents), 98.7
#:   in 4 splits (docs/gpu-results.md);
#: - ``h64-k32-w8-s2``: warpgroup MMAs, two buffers, 229 registers, 144 KB, 1 an SM; at 128
#:   heads 9 to 30 % faster than four 32-head tiles (the "wide tiles" of docs/gpu-results.md).
#:
#: With prefetch: ``h32-k32-w4-s3-pf`` (2 buffers, 80 bytes of stack, 110 KB, 2 an SM),
#: ``h32-k16-w4-s3-pf`` (2 buffers, no stack, 73 KB, 2), ``h32-k16-w4-s4-pf`` (3 buffers,
#: 91 KB, 2), ``h32-k16-w4-s5-pf`` (4 buffers, 109 KB, 2), ``h16-k32-w4-s3-pf`` (230
#: registers, 91 KB, 2), ``h16-k16-w4-s4-pf`` (154 registers, 3 buffers, 73 KB, 3),
#: ``h64-k32-w8-s3-pf`` (3 buffers, 180 KB, 1), ``h64-k16-w8-s4-pf`` (4 buffers, 144 KB,
#: 1), ``h64-k64-w8-s2-pf`` (2 buffers, 216 KB, 1), and two with the split rule aimed at
#: about one wave of resident programs (264 for two an SM of 132, 132 for one).
MLA_TILINGS: dict[str, MLATiling] = _tilings(
    MLATiling(32, 32, 4, 2, prefetch=False),
    MLATiling(64, 32, 8, 2, prefetch=False),
    MLATiling(32, 32, 4, 3, prefetch=True),
    MLATiling(32, 16, 4, 3, prefetch=True),
    MLATiling(32, 16, 4, 4, prefetch=True),
    MLATiling(32, 16, 4, 5, prefetch=True),
    MLATiling(16, 32, 4, 3, prefetch=True),
    MLATiling(16, 16, 4, 4, prefetch=True),
    MLATiling(64, 32, 8, 3, prefetch=True),
    MLATiling(64, 16, 8, 4, prefetch=True),
    MLATiling(64, 64, 8, 2, prefetch=True),
    MLATiling(32, 32, 4, 3, prefetch=True, target_programs=264, full_programs=264),
    MLATiling(64, 32, 8, 3, prefetch=True, target_programs=132, full_programs=132),
)

#: Which tiling a call takes: ``(min_heads, name)`` entries in increasing ``min_heads``; a
#: call of ``heads`` query heads a row takes the last entry it reaches (the first if it
#: reaches none). The default is the kernel measured so far (one tiling for every head
#: count); a measured win moves an entry here (``benches/gpu_mla_attention.py --best-out``
#: prints the entries its sweep would pick). ``HELIX_KV_MLA_TILINGS`` overrides it for a
#: process (:func:`parse_mla_tiling_table`'s form, e.g. ``1:h32-k32-w4-s3-pf,64:h64-k32-w8-s3-pf``).
MLA_TILING_TABLE: tuple[tuple[int, str], ...] = ((1, "h32-k32-w4-s2"),)


def parse_mla_tiling_table(spec: str) -> tuple[tuple[int, str], ...]:
    """A tiling table from ``MIN_HEADS:NAME,...`` (or a bare ``NAME``: every head count):
    tiling names (:meth:`MLATiling.from_name`: those of :data:`MLA_TILINGS` or any other
    fields) in increasing ``MIN_HEADS`` >= 1."""
    entries = []
    for part in (p.strip() for p in spec.split(",")):
        heads_text, sep, name = part.rpartition(":")
        if not sep:
            heads_text = "1"
        _tiling_named(name)  # a name that describes no tiling is refused here
        if not heads_text.isdigit() or int(heads_text) < 1:
            raise ValueError(f"MLA tiling entry {part!r}: the head count must be an integer >= 1")
        entries.append((int(heads_text), name))
    if [heads for heads, _ in entries] != sorted({heads for heads, _ in entries}):
        raise ValueError(f"MLA tiling table {spec!r}: head counts must increase")
    return tuple(entries)


@functools.cache
def _tiling_override() -> tuple[tuple[int, str], ...] | None:
    """``HELIX_KV_MLA_TILINGS`` (read once per process; spawned ranks inherit it)."""
    raw = os.environ.get("HELIX_KV_MLA_TILINGS", "").strip()
    return parse_mla_tiling_table(raw) if raw else None


def mla_tiling(heads: int) -> MLATiling:
    """The tiling :func:`paged_mla_decode_attention` takes for rows of ``heads`` query heads
    on tensor cores (``HELIX_KV_MLA_TILINGS``, else :data:`MLA_TILING_TABLE`)."""
    table = _tiling_override() or MLA_TILING_TABLE
    chosen = table[0][1]
    for min_heads, name in table:
        if heads >= min_heads:
            chosen = name
    return _tiling_named(chosen)


def _tiling_named(name: str) -> MLATiling:
    """:data:`MLA_TILINGS`' tiling of that name, else the one the name describes."""
    tiling = MLA_TILINGS.get(name)
    return tiling if tiling is not None else MLATiling.from_name(name)


#: Most elements of the ``[splits, latent chunk]`` tile of one split-combine program (a
#: 128-split combine of a whole 512 latent spills).
MLA_COMBINE_ELEMENTS = 16 * 512


def _kernels() -> ModuleType:
    """The kernel module (imports triton on first use)."""
    try:
        from helix_kv.executor import _triton_kernels
    except ImportError as exc:  # a torch build without triton (CPU-only wheels, macOS)
        raise RuntimeError(f"the paged kernels need triton: {exc}") from exc
    return _triton_kernels


def _next_power_of_2(n: int) -> int:
    return 1 << max(1, (n - 1).bit_length())


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_device(device: torch.device) -> None:
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return
    raise ValueError(
        f"the paged kernels run on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 set "
        f"before triton is imported; got {device.type} tensors"
    )


def decode_splits(
    requests: int,
    kv_heads: int,
    width_pages: int,
    tokens_per_block: int,
    max_splits: int = DECODE_MAX_SPLITS,
    target_programs: int | None = None,
    full_programs: int | None = None,
) -> int:
    """How many splits (flash-decoding) :func:`paged_decode_attention` cuts each request into.

    A deterministic rule on static sizes only (the rows, the kv heads, the block table's width
    in pages: a CUDA graph bucket's capacities), so the count of a captured bucket is fixed and
    the same on every rank. One split while ``requests * kv_heads`` programs already reach
    ``full_programs`` (default :data:`DECODE_FULL_PROGRAMS`); otherwise enough splits to reach
    ``target_programs`` (default :data:`DECODE_TARGET_PROGRAMS`), no more than
    ``max_splits``, none shorter than :data:`DECODE_MIN_SPLIT_KEYS` keys of the widest
    request, and every split a whole number of pages with no split wholly past the width.
    """
    programs = max(1, requests * kv_heads)
    full = DECODE_FULL_PROGRAMS if full_programs is None else full_programs
    target = DECODE_TARGET_PROGRAMS if target_programs is None else target_programs
    if width_pages <= 1 or programs >= full or max_splits <= 1:
        return 1
    wanted = -(-target // programs)
    by_length = -(-(width_pages * tokens_per_block) // DECODE_MIN_SPLIT_KEYS)
    splits = max(1, min(wanted, by_length, max_splits, width_pages))
    pages_per_split = -(-width_pages // splits)
    return -(-width_pages // pages_per_split)


def _resolve_splits(
    requests: int,
    kv_heads: int,
    width_pages: int,
    tokens_per_block: int,
    asked: int | None,
    target_programs: int | None = None,
    full_programs: int | None = None,
) -> tuple[int, int]:
    """The splits a call runs and the pages of each: ``asked``, else the environment's
    override, else :func:`decode_splits` (with its program targets); then whole pages, none
    wholly past the width."""
    if asked is None:
        asked = _splits_override() or decode_splits(
            requests,
            kv_heads,
            width_pages,
            tokens_per_block,
            target_programs=target_programs,
            full_programs=full_programs,
        )
    pages_per_split = max(1, -(-width_pages // asked))
    return max(1, -(-width_pages // pages_per_split)), pages_per_split


@dataclass(frozen=True)
class DecodeWorkspace:
    """Scratch of split-K decode attention, allocated once and reused by every call (and
    every layer: calls on one stream run in order), so that a captured step allocates
    nothing.

    Two flat buffers, in the accumulation dtype of the queries they serve, of room for
    ``row_splits`` (request, split) pairs: a call of ``rows`` requests in ``splits`` splits
    uses their first ``rows * splits`` pairs (:meth:`views`), so one workspace serves every
    bucket of a CUDA-graph set (few rows in many splits, many rows in few).
    """

    output_scratch: torch.Tensor  # [row_splits * q_heads * head_dim]
    lse_scratch: torch.Tensor  # [row_splits * q_heads]
    q_heads: int
    head_dim: int
    row_splits: int

    @classmethod
    def allocate(
        cls,
        max_rows: int,
        q_heads: int,
        head_dim: int,
        max_splits: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> DecodeWorkspace:
        """Scratch for ``max_rows * max_splits`` (request, split) pairs of queries of
        ``dtype`` (stored in its :func:`~helix_kv.executor.attention.accumulation_dtype`)."""
        if min(max_rows, q_heads, head_dim, max_splits) < 1:
            raise ValueError(
                f"workspace sizes must be positive: rows {max_rows}, q_heads {q_heads}, "
                f"head_dim {head_dim}, splits {max_splits}"
            )
        acc = accumulation_dtype(dtype)
        pairs = max_rows * max_splits
        return cls(
            torch.empty(pairs * q_heads * head_dim, dtype=acc, device=device),
            torch.empty(pairs * q_heads, dtype=acc, device=device),
            q_heads,
            head_dim,
            pairs,
        )

    @classmethod
    def for_decode(
        cls,
        max_rows: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        width_pages: int,
        tokens_per_block: int,
        dtype: torch.dtype,
        device: torch.device | str,
        rows_per_request: int = 1,
    ) -> DecodeWorkspace:
        """Scratch for every call :func:`paged_decode_attention` makes with the default split
        count on up to ``max_rows`` rows and a block table ``width_pages`` wide (e.g. one
        per executor: its max batch and max pages per request), with ``rows_per_request``."""
        pairs = max(
            rows
            * _resolve_splits(
                _split_programs(rows, rows_per_request, q_heads // kv_heads),
                kv_heads,
                width_pages,
                tokens_per_block,
                None,
            )[0]
            for rows in range(1, max(1, max_rows) + 1)
        )
        return cls.allocate(pairs, q_heads, head_dim, 1, dtype, device)

    @classmethod
    def for_mla_decode(
        cls,
        max_rows: int,
        heads: int,
        latent_dim: int,
        width_pages: int,
        tokens_per_block: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> DecodeWorkspace:
        """Scratch for every call :func:`paged_mla_decode_attention` makes with the default
        split count on up to ``max_rows`` rows of ``heads`` query heads, a latent of
        ``latent_dim`` and a block table ``width_pages`` wide, queries of ``dtype`` on
        ``device``."""
        use_dot = _use_dot(dtype, torch.device(device))
        pairs = max(
            rows
            * _mla_splits(rows, heads, latent_dim, use_dot, width_pages, tokens_per_block, None)[0]
            for rows in range(1, max(1, max_rows) + 1)
        )
        return cls.allocate(pairs, heads, latent_dim, 1, dtype, device)

    def fits(self, rows: int, q_heads: int, head_dim: int, splits: int, dtype: torch.dtype) -> bool:
        """Whether a call of that shape (queries of ``dtype``) can use this scratch."""
        return (
            rows * splits <= self.row_splits
            and q_heads == self.q_heads
            and head_dim == self.head_dim
            and self.output_scratch.dtype == accumulation_dtype(dtype)
        )

    def views(self, rows: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The partial outputs ``[rows, q_heads, splits, head_dim]`` and LSEs
        ``[rows, q_heads, splits]`` of a call (views of the scratch's first pairs)."""
        pairs = rows * splits
        return (
            self.output_scratch[: pairs * self.q_heads * self.head_dim].view(
                rows, self.q_heads, splits, self.head_dim
            ),
            self.lse_scratch[: pairs * self.q_heads].view(rows, self.q_heads, splits),
        )


@functools.cache
def _splits_override() -> int | None:
    """``HELIX_KV_DECODE_SPLITS``: ``auto`` (or unset) for the rule, ``off`` for one split,
    ``N`` for N splits (benches compare them; read once per process, and spawned ranks
    inherit the environment)."""
    raw = os.environ.get("HELIX_KV_DECODE_SPLITS", "auto").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw == "off":
        return 1
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise ValueError(f"HELIX_KV_DECODE_SPLITS must be auto, off or N >= 1; got {raw!r}")


#: Most query slots (rows x query heads of a kv head, padded to powers of two) one program
#: of the grouped verification kernel holds; a wider group runs one program per row.
VERIFY_MAX_QUERY_SLOTS = 32


def _groups_rows(rows_per_request: int, group: int) -> bool:
    """Whether a request's rows fit one program of the verification kernel."""
    return _next_power_of_2(rows_per_request) * _next_power_of_2(group) <= VERIFY_MAX_QUERY_SLOTS


def _split_programs(rows: int, rows_per_request: int, group: int) -> int:
    """The row programs the split rule counts: grouped rows run one program per request
    (about ``rows / rows_per_request`` of them), otherwise one per row."""
    if rows_per_request > 1 and _groups_rows(rows_per_request, group):
        return max(1, -(-rows // rows_per_request))
    return rows


def _use_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels take tensor-core dots: always but for float64 on a GPU (the
    interpreter runs float64 dots exactly)."""
    return not (accumulation_dtype(dtype) == torch.float64 and device.type == "cuda")


def _mla_block_heads(heads: int, latent_dim: int, use_dot: bool) -> int:
    """Query heads per program of the MLA decode kernel: with dots, the heads (a power of
    two) up to the tiling's (:func:`mla_tiling`), at least the dot's smallest side (a row of
    fewer heads is padded); without, as many as keep the ``[heads, keys, latent]`` products
    within :data:`MLA_NODOT_ELEMENTS`, no more than the heads need."""
    if use_dot:
        return max(_DOT_MIN, min(mla_tiling(heads).block_heads, _next_power_of_2(heads)))
    fit = max(1, MLA_NODOT_ELEMENTS // (_MLA_NODOT_KEYS * _next_power_of_2(latent_dim)))
    return max(1, min(_floor_power_of_2(fit), _next_power_of_2(heads)))


def _mla_head_tiles(heads: int, latent_dim: int, use_dot: bool) -> int:
    """Programs per row of the MLA decode kernel (the split rule counts rows x these)."""
    return -(-heads // _mla_block_heads(heads, latent_dim, use_dot))


def _mla_splits(
    rows: int,
    heads: int,
    latent_dim: int,
    use_dot: bool,
    width_pages: int,
    tokens_per_block: int,
    asked: int | None,
) -> tuple[int, int]:
    """The splits an MLA decode call runs and the pages of each: :func:`_resolve_splits` with
    rows x head tiles as the programs and the tiling's program targets (:func:`mla_tiling`).
    Static sizes only, like :func:`decode_splits`."""
    tiles = _mla_head_tiles(heads, latent_dim, use_dot)
    tiling = mla_tiling(heads)
    return _resolve_splits(
        rows,
        tiles,
        width_pages,
        tokens_per_block,
        asked,
        target_programs=tiling.target_programs,
        full_programs=tiling.full_programs,
    )


def _floor_power_of_2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


@dataclass(frozen=True)
class _Splits:
    """How a plan cuts each row's keys: ``count`` ranges of ``keys_per_split`` keys (one
    range covering every key the table can hold when ``count`` is 1), and where the
    ranges' partial outputs and LSEs go: ``partials`` (views of the workspace, ``[rows,
    heads, splits, dim]`` and ``[rows, heads, splits]``), or, with one split, straight into
    the call's result."""

    count: int
    keys_per_split: int
    partials: tuple[torch.Tensor, torch.Tensor] | None

    def targets(
        self, output: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """Where a call stores its partials, and the kernels' row, head and split strides
        of them (output, then LSE; a split stride of 0 with one split)."""
        if self.partials is None:
            return output, lse, (*output.stride()[:2], 0, *lse.stride()[:2], 0)
        part_out, part_lse = self.partials
        return part_out, part_lse, (*part_out.stride()[:3], *part_lse.stride()[:3])


def _plan_splits(
    rows: int,
    heads: int,
    dim: int,
    splits: tuple[int, int],
    width: int,
    tokens_per_block: int,
    workspace: DecodeWorkspace | None,
    dtype: torch.dtype,
    device: torch.device,
) -> _Splits:
    """The :class:`_Splits` of ``splits`` (the count and the pages of each), their partials
    in ``workspace`` (checked to fit; ``None``: allocated here, once for the plan)."""
    count, pages_per_split = splits
    if count == 1:
        return _Splits(1, max(1, width * tokens_per_block), None)
    if workspace is None:
        workspace = DecodeWorkspace.allocate(rows, heads, dim, count, dtype, device)
    elif not workspace.fits(rows, heads, dim, count, dtype):
        raise ValueError(
            f"workspace of {workspace.row_splits} (request, split) pairs x "
            f"{workspace.q_heads} heads x {workspace.head_dim} "
            f"{workspace.output_scratch.dtype} does not fit {rows} rows x "
            f"{count} splits x {heads} heads x {dim} of {dtype}"
        )
    return _Splits(count, pages_per_split * tokens_per_block, workspace.views(rows, count))


def _check_step_rows(
    block_table: torch.Tensor, local_lens: torch.Tensor, num_splits: int | None
) -> int:
    """The rows of a step's metadata (the block table's), checked: a ``[rows, width]``
    table of contiguous rows, a length per row, a split count of at least 1."""
    if block_table.dim() != 2 or local_lens.dim() != 1 or local_lens.shape[0] < len(block_table):
        raise ValueError(
            f"block table {tuple(block_table.shape)} / local lens {tuple(local_lens.shape)} "
            "do not cover the same rows: [rows, width] / [rows]"
        )
    if block_table.shape[1] and block_table.stride(1) != 1:
        raise ValueError("block_table must have contiguous rows")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    return len(block_table)


def _check_layer_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """One layer's tensor of a planned call: its shape (``-1``: any size) and a contiguous
    last dim."""
    if tensor.dim() != len(shape) or any(
        want not in (-1, got) for want, got in zip(shape, tensor.shape)
    ):
        wanted = ", ".join("*" if size == -1 else str(size) for size in shape)
        raise ValueError(f"{name} {tuple(tensor.shape)} must be [{wanted}] (the plan's)")
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim")


def _combine_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    block_d: int,
    acc_fp64: bool,
) -> None:
    """The exact LSE combine of the split partials into the result: one program per (row,
    head, chunk of ``block_d`` of the head dim)."""
    rows, heads, splits, dim = part_out.shape
    _kernels().combine_splits_kernel[(rows, heads, -(-dim // block_d))](
        part_out,
        part_lse,
        output,
        lse,
        splits,
        dim,
        *part_out.stride()[:3],
        *part_lse.stride()[:3],
        *output.stride()[:2],
        *lse.stride()[:2],
        BLOCK_S=_next_power_of_2(splits),
        BLOCK_D=block_d,
        ACC_FP64=acc_fp64,
    )


class DecodeAttentionPlan:
    """One step's paged decode attention, planned once and run once per layer (FlashInfer's
    ``plan()`` / ``run()``): the partial attention of one query token per row over this
    rank's paged KV, as :func:`paged_decode_attention` describes.

    Made from the step's metadata (every layer reads the same block table, lengths and
    positions), it checks them, resolves the split count (:func:`decode_splits`, static
    sizes only) and its scratch, and picks the tiles; :meth:`run` then takes only a layer's
    query and caches, checks their shapes against the plan and launches the kernels. The
    metadata tensors are read by every run: a step captured in a CUDA graph plans on its
    persistent buffers, and its runs do no host work but the launches.

    Args:
        block_table: ``[rows, width]`` page ids (any int dtype, any row stride, column
            stride 1), on the device the kernels run on; only the first
            ``ceil(local_len / tokens_per_block)`` of a row are read, so every ``local_len``
            must be at most ``width * tokens_per_block``.
        local_lens: ``[>= rows]`` keys this rank holds of each row (any int dtype, any
            stride); ``0`` gives output 0 and LSE ``-inf`` (e.g. a padding row).
        tokens_per_block: slots per page.
        q_heads, kv_heads, head_dim: the queries' heads (a multiple of ``kv_heads``: query
            head ``h`` reads kv head ``h // (q_heads // kv_heads)``), the caches' heads, and
            the dim of both.
        dtype: the queries' dtype (the result is in its
            :func:`~helix_kv.executor.attention.accumulation_dtype`).
        scale: score scale, ``1 / sqrt(head_dim)`` by default.
        num_splits: splits per row; ``None``: :func:`decode_splits` of the static sizes (or
            ``HELIX_KV_DECODE_SPLITS`` where set); capped at the table's width in pages.
        workspace: scratch for the splits (:class:`DecodeWorkspace`, e.g. one per executor,
            so that captured steps allocate nothing); ``None``: allocated by the plan.
        positions: ``[>= rows]`` global position of each row (any int dtype and stride);
            needed with ``rows_per_request > 1``.
        rows_per_request: the most rows (query tokens) one request has (``1 + k``); above
            1, the rows of one request (consecutive rows at consecutive positions with one
            block table) are attended by one program, which loads each key block once for
            all of them (when they fit :data:`VERIFY_MAX_QUERY_SLOTS`; else one program per
            row), and the split rule counts those programs.
        tokens_per_superblock: ``tokens_per_block * cp_size`` (with ``rows_per_request >
            1``: a row continues the one before it when its position is one more and its
            superblock id, at its position, the same).
        out_dtype: dtype of ``output`` (default the accumulation dtype), e.g. the model's
            at cp = 1, where the output goes straight into the output projection: stored
            rounded once, as a cast of the accumulation-dtype output would be.
    """

    def __init__(
        self,
        block_table: torch.Tensor,
        local_lens: torch.Tensor,
        tokens_per_block: int,
        *,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,
        num_splits: int | None = None,
        workspace: DecodeWorkspace | None = None,
        positions: torch.Tensor | None = None,
        rows_per_request: int = 1,
        tokens_per_superblock: int | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        rows = _check_step_rows(block_table, local_lens, num_splits)
        if min(q_heads, kv_heads, head_dim) < 1 or q_heads % kv_heads:
            raise ValueError(
                f"{q_heads} query heads are not a multiple of {kv_heads} kv heads "
                f"(of dim {head_dim})"
            )
        if rows_per_request < 1:
            raise ValueError(f"rows_per_request must be at least 1, got {rows_per_request}")
        if rows_per_request > 1 and (
            positions is None
            or positions.shape[0] < rows
            or tokens_per_superblock is None
            or tokens_per_superblock < 1
        ):
            raise ValueError(
                "rows_per_request > 1 needs the rows' positions and tokens_per_superblock >= 1"
            )
        self.block_table, self.local_lens, self.positions = block_table, local_lens, positions
        self.tokens_per_block = tokens_per_block
        self.tokens_per_superblock = tokens_per_superblock or 0
        self.rows, self.q_heads, self.kv_heads, self.head_dim = rows, q_heads, kv_heads, head_dim
        self.dtype = dtype
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        compute_dtype = accumulation_dtype(dtype)
        self.out_dtype, self.lse_dtype = out_dtype or compute_dtype, compute_dtype
        self.group = group = q_heads // kv_heads
        if rows == 0:  # nothing to attend: the runs return empty results
            return
        device = block_table.device
        _check_device(device)
        width = block_table.shape[1]
        #: Whether a request's rows run in one program (else one program per row).
        self.grouped = rows_per_request > 1 and _groups_rows(rows_per_request, group)
        programs = _split_programs(rows, rows_per_request if self.grouped else 1, group)
        splits = _resolve_splits(programs, kv_heads, width, tokens_per_block, num_splits)
        self.splits = _plan_splits(
            rows, q_heads, head_dim, splits, width, tokens_per_block, workspace, dtype, device
        )
        self.tiles = self._tiles(dtype, device, rows_per_request)

    def _tiles(
        self, dtype: torch.dtype, device: torch.device, rows_per_request: int
    ) -> dict[str, Any]:
        """The kernel's tile sizes and launch options (tensor-core dots, except float64 on a
        GPU: the interpreter runs float64 dots exactly; a dot's sides at least 16)."""
        use_dot = _use_dot(dtype, device)
        floor = _DOT_MIN if use_dot else 1
        tiles: dict[str, Any] = {
            "BLOCK_N": max(floor, DECODE_BLOCK_KEYS),
            "BLOCK_D": max(floor, _next_power_of_2(self.head_dim)),
            "ACC_FP64": accumulation_dtype(dtype) == torch.float64,
            "USE_DOT": use_dot,
            "num_warps": DECODE_NUM_WARPS,
            "num_stages": DECODE_NUM_STAGES,
        }
        if not self.grouped:
            tiles["BLOCK_G"] = max(floor, _next_power_of_2(self.group))
            return tiles
        rows_p2 = _next_power_of_2(rows_per_request)
        # the dot's query side (rows x heads) at least _DOT_MIN
        block_group = max(_next_power_of_2(self.group), -(-floor // rows_p2))
        tiles.update(ROWS=rows_p2, BLOCK_GROUP=block_group)
        return tiles

    def run(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> PartialAttention:
        """This rank's partial attention of one layer: ``query`` ``[rows, q_heads,
        head_dim]`` and the layer's caches ``[slots, kv_heads, head_dim]`` (last dims
        contiguous, any number of slots); ``output`` ``[rows, q_heads, head_dim]`` (the
        plan's ``out_dtype``) and ``lse`` ``[rows, q_heads]``."""
        _check_layer_tensor("query", query, (self.rows, self.q_heads, self.head_dim))
        cache_shape = (-1, self.kv_heads, self.head_dim)
        _check_layer_tensor("key_cache", key_cache, cache_shape)
        _check_layer_tensor("value_cache", value_cache, cache_shape)
        if query.dtype != self.dtype:
            raise ValueError(f"query of {query.dtype}, the plan's of {self.dtype}")
        output = query.new_empty(query.shape, dtype=self.out_dtype)
        lse = query.new_empty((self.rows, self.q_heads), dtype=self.lse_dtype)
        if self.rows == 0:
            return PartialAttention(output, lse)
        part_out, part_lse, part_strides = self.splits.targets(output, lse)
        table, lens = self.block_table, self.local_lens
        tensors = (query, key_cache, value_cache, table, lens)
        # the last dims are contiguous (checked): their strides are not passed
        strides = (*query.stride()[:2], *key_cache.stride()[:2], *value_cache.stride()[:2])
        strides += (table.stride(0), lens.stride(0))
        sizes = (self.splits.keys_per_split, self.group, self.head_dim)
        grid = (self.rows, self.kv_heads, self.splits.count)
        kernels = _kernels()
        if not self.grouped:
            kernels.decode_attention_kernel[grid](
                *tensors,
                part_out,
                part_lse,
                self.scale,
                self.tokens_per_block,
                *sizes,
                *strides,
                *part_strides,
                **self.tiles,
            )
        else:
            positions = self.positions
            assert positions is not None  # checked by the plan
            kernels.verify_attention_kernel[grid](
                *tensors,
                positions,
                part_out,
                part_lse,
                self.scale,
                self.tokens_per_block,
                self.tokens_per_superblock,
                *sizes,
                self.rows,
                table.shape[1],
                *strides,
                positions.stride(0),
                *part_strides,
                **self.tiles,
            )
        if self.splits.count > 1:
            block_d = _next_power_of_2(self.head_dim)
            _combine_splits(part_out, part_lse, output, lse, block_d, self.tiles["ACC_FP64"])
        return PartialAttention(output, lse)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    local_lens: torch.Tensor,
    tokens_per_block: int,
    **options: Any,
) -> PartialAttention:
    """Partial attention of one decode query per row over this rank's paged KV, in one call:
    a :class:`DecodeAttentionPlan` of the query's rows, run once (a model plans once a step
    and runs the plan per layer).

    A row is one query token: a decode entry, or (speculative decoding) one of the ``1 + k``
    rows of an entry that verifies ``k`` drafts, each with its own local length (the causal
    mask inside the draft: every row's KV is written first).

    With one split, one program per (request, kv head) walks the request's local keys. With
    more (flash-decoding), the keys are cut into ``num_splits`` ranges of whole pages, one
    program per (request, kv head, split) stores a partial output and LSE in scratch, and a
    second kernel merges them with the exact LSE combine: the same result to rounding.

    Args:
        query: ``[requests, q_heads, head_dim]`` (last dim contiguous).
        key_cache, value_cache: one layer of the pool, ``[slots, kv_heads, head_dim]`` (last
            dim contiguous).
        block_table, local_lens, tokens_per_block: the rows' metadata, as
            :class:`DecodeAttentionPlan` takes it (at least ``requests`` rows; the first
            ``requests`` are read).
        options: the plan's keywords (``scale``, ``num_splits``, ``workspace``,
            ``positions``, ``rows_per_request``, ``tokens_per_superblock``, ``out_dtype``).

    Returns:
        :class:`~helix_kv.executor.attention.PartialAttention`: ``output``
        ``[requests, q_heads, head_dim]`` (``out_dtype``) and ``lse`` ``[requests, q_heads]``
        in :func:`~helix_kv.executor.attention.accumulation_dtype` of the query.
    """
    if query.dim() != 3 or key_cache.dim() != 3:
        raise ValueError(
            f"query {tuple(query.shape)} / key cache {tuple(key_cache.shape)} must be "
            "[requests, q_heads, head_dim] / [slots, kv_heads, head_dim]"
        )
    rows, q_heads, head_dim = query.shape
    plan = DecodeAttentionPlan(
        *_first_rows(rows, block_table, local_lens),
        tokens_per_block,
        q_heads=q_heads,
        kv_heads=key_cache.shape[1],
        head_dim=head_dim,
        dtype=query.dtype,
        **options,
    )
    return plan.run(query, key_cache, value_cache)


def _first_rows(
    rows: int, block_table: torch.Tensor, local_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata of a one-shot call's ``rows`` rows (views), if the tables cover them."""
    if block_table.dim() != 2 or len(block_table) < rows or local_lens.shape[0] < rows:
        raise ValueError(
            f"block table {tuple(block_table.shape)} / local lens {tuple(local_lens.shape)} "
            f"do not cover {rows} rows"
        )
    return block_table[:rows], local_lens[:rows]


class MLADecodeAttentionPlan:
    """One step's multi-head latent attention (DeepSeek-V3, absorbed form), planned once and
    run once per layer, as :class:`DecodeAttentionPlan` is (its ``block_table``,
    ``local_lens``, ``tokens_per_block``, ``num_splits`` and ``workspace``, with
    :meth:`DecodeWorkspace.for_mla_decode`'s scratch: ``head_dim`` the latent dim).

    Every query head attends to the one latent head of the cache: key ``j`` of a row is the
    cache row ``c`` of its slot (the compressed KV latent, then its RoPE key), its value the
    latent ``c[:latent_dim]``; ``score = scale * query[row, head] . c`` over the whole row.
    One program per (row, tile of query heads, split) loads each block of cache rows once for
    the score and the value products of all its heads; the split rule
    (:func:`decode_splits`) counts rows x head tiles as its programs, with the tiling's
    program targets (:func:`mla_tiling`).

    Args:
        heads: query heads per row.
        head_dim: the cache rows' and the queries' width, ``latent_dim + rope_dim``.
        latent_dim: the latent's width (the values' dim); ``rope_dim`` is the rest, both at
            least 1.
        dtype: the queries' dtype; ``kv_dtype``: the cache's (default ``dtype``), which
            the tiles depend on.
        scale: score scale (DeepSeek-V3: ``1 / sqrt(qk_nope_dim + qk_rope_dim)``, times its
            YaRN factor where it applies).
    """

    def __init__(
        self,
        block_table: torch.Tensor,
        local_lens: torch.Tensor,
        tokens_per_block: int,
        *,
        heads: int,
        head_dim: int,
        latent_dim: int,
        dtype: torch.dtype,
        scale: float,
        kv_dtype: torch.dtype | None = None,
        num_splits: int | None = None,
        workspace: DecodeWorkspace | None = None,
    ) -> None:
        rows = _check_step_rows(block_table, local_lens, num_splits)
        if not 1 <= latent_dim < head_dim:
            raise ValueError(
                f"latent_dim {latent_dim} must leave a RoPE part of at least 1 of the "
                f"query's {head_dim}"
            )
        self.block_table, self.local_lens = block_table, local_lens
        self.tokens_per_block = tokens_per_block
        self.rows, self.heads, self.head_dim, self.latent_dim = rows, heads, head_dim, latent_dim
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        # float arguments reach the kernel in float32: the scale in two parts, hi + lo
        self.scale_hi = struct.unpack("f", struct.pack("f", scale))[0]
        self.scale_lo = scale - self.scale_hi
        self.lse_dtype = accumulation_dtype(dtype)
        if rows == 0 or heads == 0:  # nothing to attend: the runs return empty results
            return
        device = block_table.device
        _check_device(device)
        width = block_table.shape[1]
        use_dot = _use_dot(dtype, device)
        self.block_heads = _mla_block_heads(heads, latent_dim, use_dot)
        splits = _mla_splits(rows, heads, latent_dim, use_dot, width, tokens_per_block, num_splits)
        self.splits = _plan_splits(
            rows, heads, latent_dim, splits, width, tokens_per_block, workspace, dtype, device
        )
        self.tiles = self._tiles(use_dot)

    def _tiles(self, use_dot: bool) -> dict[str, Any]:
        """The kernel's tile sizes and launch options: the tiling's (:func:`mla_tiling`)
        with dots, their own without (float64 on a GPU: broadcast products)."""
        block_l = _next_power_of_2(self.latent_dim)
        block_r = _next_power_of_2(self.head_dim - self.latent_dim)
        tiling = mla_tiling(self.heads)
        if use_dot:
            block_l, block_r = max(_DOT_MIN, block_l), max(_DOT_MIN, block_r)
            block_n, num_warps, num_stages = tiling.block_keys, tiling.num_warps, tiling.num_stages
            if max(self.dtype.itemsize, self.kv_dtype.itemsize) > 2:
                # float32 tiles take twice the shared memory: 16 keys a block and at most two
                # buffers keep every tiling within Hopper's 227 KB a program (64 heads: 221 KB)
                block_n, num_stages = _DOT_MIN, min(num_stages, 3)
        else:  # float64 on a GPU: broadcast products, their own tiles (the loop is the tiling's)
            block_n, num_warps, num_stages = _MLA_NODOT_KEYS, _MLA_NODOT_WARPS, _MLA_NODOT_STAGES
        return {
            "BLOCK_H": self.block_heads,
            "BLOCK_N": block_n,
            "BLOCK_L": block_l,
            "BLOCK_R": block_r,
            "ACC_FP64": self.lse_dtype == torch.float64,
            "USE_DOT": use_dot,
            "PREFETCH": tiling.prefetch,
            "num_warps": num_warps,
            "num_stages": num_stages,
        }

    def run(self, query: torch.Tensor, latent_cache: torch.Tensor) -> PartialAttention:
        """This rank's partial attention of one layer: ``query`` ``[rows, heads,
        head_dim]`` (each head's absorbed query, its no-RoPE query times its key
        up-projection, then its rotated RoPE query) and the layer's cache ``[slots, 1,
        head_dim]`` (last dims contiguous); ``output`` ``[rows, heads, latent_dim]`` and
        ``lse`` ``[rows, heads]`` in the accumulation dtype."""
        _check_layer_tensor("query", query, (self.rows, self.heads, self.head_dim))
        _check_layer_tensor("latent_cache", latent_cache, (-1, 1, self.head_dim))
        if (query.dtype, latent_cache.dtype) != (self.dtype, self.kv_dtype):
            raise ValueError(
                f"query / cache of {query.dtype} / {latent_cache.dtype}, the plan's of "
                f"{self.dtype} / {self.kv_dtype}"
            )
        output = query.new_empty((self.rows, self.heads, self.latent_dim), dtype=self.lse_dtype)
        lse = query.new_empty((self.rows, self.heads), dtype=self.lse_dtype)
        if self.rows == 0 or self.heads == 0:
            return PartialAttention(output, lse)
        part_out, part_lse, part_strides = self.splits.targets(output, lse)
        grid = (self.rows, -(-self.heads // self.block_heads), self.splits.count)
        _kernels().mla_decode_attention_kernel[grid](
            query,
            latent_cache,
            self.block_table,
            self.local_lens,
            part_out,
            part_lse,
            self.scale_hi,
            self.scale_lo,
            self.tokens_per_block,
            self.splits.keys_per_split,
            self.heads,
            self.latent_dim,
            self.head_dim - self.latent_dim,
            # the last dims are contiguous (checked), the cache has one head
            *query.stride()[:2],
            latent_cache.stride(0),
            self.block_table.stride(0),
            self.local_lens.stride(0),
            *part_strides,
            **self.tiles,
        )
        if self.splits.count > 1:
            # the latent in chunks: a [splits, chunk] tile of at most MLA_COMBINE_ELEMENTS
            block_s = _next_power_of_2(self.splits.count)
            block_c = min(
                _next_power_of_2(self.latent_dim), max(16, MLA_COMBINE_ELEMENTS // block_s)
            )
            _combine_splits(part_out, part_lse, output, lse, block_c, self.tiles["ACC_FP64"])
        return PartialAttention(output, lse)


def paged_mla_decode_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    local_lens: torch.Tensor,
    tokens_per_block: int,
    latent_dim: int,
    scale: float,
    num_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
) -> PartialAttention:
    """Multi-head latent attention (DeepSeek-V3, absorbed form) of one decode query per row
    over this rank's paged latent cache, in one call: an :class:`MLADecodeAttentionPlan` of
    the query's rows, run once (a model plans once a step and runs the plan per layer).

    Masks, slots, splits and results are those of :func:`paged_decode_attention`; the same
    result as :func:`~helix_kv.executor.attention.partial_attention` with ``key`` the
    gathered cache rows, ``value`` their latents and one kv head, to rounding.

    Args:
        query: ``[rows, heads, latent_dim + rope_dim]`` (last dim contiguous): each head's
            absorbed query followed by its rotated RoPE query.
        latent_cache: one layer of the pool, ``[slots, 1, latent_dim + rope_dim]`` (last dim
            contiguous).
        block_table, local_lens, tokens_per_block, latent_dim, scale, num_splits,
            workspace: as :class:`MLADecodeAttentionPlan` takes them (the tables at least
            ``rows`` rows; the first ``rows`` are read).

    Returns:
        :class:`~helix_kv.executor.attention.PartialAttention`: ``output``
        ``[rows, heads, latent_dim]`` and ``lse`` ``[rows, heads]`` in
        :func:`~helix_kv.executor.attention.accumulation_dtype` of the query.
    """
    if query.dim() != 3 or latent_cache.dim() != 3:
        raise ValueError(
            f"query {tuple(query.shape)} / latent cache {tuple(latent_cache.shape)} must be "
            f"[rows, heads, dim] / [slots, 1, dim]"
        )
    rows, heads, dim = query.shape
    if latent_cache.shape[1:] != (1, dim):
        raise ValueError(
            f"latent cache {tuple(latent_cache.shape)} does not match query "
            f"{tuple(query.shape)}: it must be [slots, 1, {dim}]"
        )
    plan = MLADecodeAttentionPlan(
        *_first_rows(rows, block_table, local_lens),
        tokens_per_block,
        heads=heads,
        head_dim=dim,
        latent_dim=latent_dim,
        dtype=query.dtype,
        scale=scale,
        kv_dtype=latent_cache.dtype,
        num_splits=num_splits,
        workspace=workspace,
    )
    return plan.run(query, latent_cache)


def write_paged_kv(
    key: torch.Tensor,
    value: torch.Tensor | None,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
) -> None:
    """Store each token's KV at its slot of one layer's caches; a slot ``< 0`` stores nothing.

    Args:
        key, value: ``[tokens, kv_heads, head_dim]`` (last dim contiguous). ``value`` and
            ``value_cache`` both ``None``: only the keys are stored (multi-head latent
            attention: ``key`` is each token's latent and RoPE key, ``[tokens, 1, dim]``).
        slots: ``[tokens]`` slot of each token on this rank, ``-1`` where another rank owns
            it (or for a padding row); any int dtype and stride.
        key_cache, value_cache: ``[slots, kv_heads, head_dim]``; values are cast to their dtype.
    """
    if key.dim() != 3 or key_cache.dim() != 3 or key_cache.shape[1:] != key.shape[1:]:
        raise ValueError(
            f"key {tuple(key.shape)} does not match the cache {tuple(key_cache.shape)}"
        )
    if (value is None) != (value_cache is None):
        raise ValueError("value and value_cache must both be given or both be None")
    if (
        value is not None
        and value_cache is not None
        and (value.shape != key.shape or value_cache.shape[1:] != key.shape[1:])
    ):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the caches "
            f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    _check_device(key.device)
    has_value = value is not None and value_cache is not None
    # keys only: the value arguments point at the keys and are never read
    value_in = value if value is not None else key
    value_out = value_cache if value_cache is not None else key_cache
    _kernels().write_kv_kernel[(tokens,)](
        key,
        value_in,
        slots,
        key_cache,
        value_out,
        kv_heads,
        head_dim,
        # the last dims are contiguous (documented): their strides are not passed
        *key.stride()[:2],
        *value_in.stride()[:2],
        slots.stride(0),
        *key_cache.stride()[:2],
        *value_out.stride()[:2],
        BLOCK_H=_next_power_of_2(kv_heads),
        BLOCK_D=_next_power_of_2(head_dim),
        HAS_VALUE=has_value,
    )


__all__ = [
    "DECODE_BLOCK_KEYS",
    "DECODE_FULL_PROGRAMS",
    "DECODE_MAX_SPLITS",
    "DECODE_MIN_SPLIT_KEYS",
    "DECODE_TARGET_PROGRAMS",
    "MLA_TILINGS",
    "MLA_TILING_TABLE",
    "DecodeAttentionPlan",
    "DecodeWorkspace",
    "MLADecodeAttentionPlan",
    "MLATiling",
    "decode_splits",
    "interpreted",
    "mla_tiling",
    "paged_decode_attention",
    "paged_mla_decode_attention",
    "parse_mla_tiling_table",
    "write_paged_kv",
]
