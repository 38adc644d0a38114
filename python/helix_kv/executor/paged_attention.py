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

The kernels run on CUDA tensors, compiled by Triton. They also run on CPU tensors through
Triton's interpreter (slow; the CI tests without a GPU use it), which Triton switches on for a
whole process: ``TRITON_INTERPRET=1`` must be in the environment before triton is first
imported (``tests/executor/conftest.py`` does that when there is no CUDA device). They
allocate nothing but their outputs, take no host sync and are safe to capture in a CUDA graph.
They are written for Triton 3.6 and later.
"""

from __future__ import annotations

import math
import os
from types import ModuleType

import torch

from helix_kv.executor.attention import PartialAttention, accumulation_dtype

#: Keys per block of the decode kernel's online softmax.
DECODE_BLOCK_KEYS = 32


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


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    local_lens: torch.Tensor,
    tokens_per_block: int,
    scale: float | None = None,
) -> PartialAttention:
    """Partial attention of one decode query per request over this rank's paged KV.

    Args:
        query: ``[requests, q_heads, head_dim]`` (last dim contiguous).
        key_cache, value_cache: one layer of the pool, ``[slots, kv_heads, head_dim]`` (last
            dim contiguous); ``q_heads`` a multiple of ``kv_heads`` (query head ``h`` reads kv
            head ``h // (q_heads // kv_heads)``).
        block_table: ``[requests, width]`` page ids (any int dtype, any row stride, column
            stride 1); only the first ``ceil(local_len / tokens_per_block)`` are read.
        local_lens: ``[requests]`` keys this rank holds of each request (any int dtype,
            any stride); ``0`` gives output 0 and LSE ``-inf`` (e.g. a padding row).
        tokens_per_block: slots per page.
        scale: score scale, ``1 / sqrt(head_dim)`` by default.

    Returns:
        :class:`~helix_kv.executor.attention.PartialAttention`: ``output``
        ``[requests, q_heads, head_dim]`` and ``lse`` ``[requests, q_heads]`` in
        :func:`~helix_kv.executor.attention.accumulation_dtype` of the query.
    """
    requests, q_heads, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    if key_cache.shape != value_cache.shape or key_cache.shape[2] != head_dim:
        raise ValueError(
            f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not match "
            f"query {tuple(query.shape)}"
        )
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    if block_table.dim() != 2 or block_table.shape[0] < requests or local_lens.shape[0] < requests:
        raise ValueError(
            f"block table {tuple(block_table.shape)} / local lens {tuple(local_lens.shape)} "
            f"do not cover {requests} requests"
        )
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    if block_table.shape[1] and block_table.stride(1) != 1:
        raise ValueError("block_table must have contiguous rows")
    group = q_heads // kv_heads
    compute_dtype = accumulation_dtype(query.dtype)
    output = query.new_empty(query.shape, dtype=compute_dtype)
    lse = query.new_empty((requests, q_heads), dtype=compute_dtype)
    if requests == 0:
        return PartialAttention(output, lse)
    _check_device(query.device)
    _kernels().decode_attention_kernel[(requests, kv_heads)](
        query,
        key_cache,
        value_cache,
        block_table,
        local_lens,
        output,
        lse,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        tokens_per_block,
        group,
        head_dim,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        block_table.stride(0),
        local_lens.stride(0),
        output.stride(0),
        output.stride(1),
        lse.stride(0),
        BLOCK_G=_next_power_of_2(group),
        BLOCK_N=DECODE_BLOCK_KEYS,
        BLOCK_D=_next_power_of_2(head_dim),
        ACC_FP64=compute_dtype == torch.float64,
    )
    return PartialAttention(output, lse)


def write_paged_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> None:
    """Store each token's KV at its slot of one layer's caches; a slot ``< 0`` stores nothing.

    Args:
        key, value: ``[tokens, kv_heads, head_dim]`` (last dim contiguous).
        slots: ``[tokens]`` slot of each token on this rank, ``-1`` where another rank owns
            it (or for a padding row); any int dtype and stride.
        key_cache, value_cache: ``[slots, kv_heads, head_dim]``; values are cast to their dtype.
    """
    tokens, kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape[1:] != key.shape[1:]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the cache "
            f"{tuple(key_cache.shape)}"
        )
    if tokens == 0:
        return
    _check_device(key.device)
    _kernels().write_kv_kernel[(tokens,)](
        key,
        value,
        slots,
        key_cache,
        value_cache,
        kv_heads,
        head_dim,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        slots.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        BLOCK_H=_next_power_of_2(kv_heads),
        BLOCK_D=_next_power_of_2(head_dim),
    )


__all__ = ["DECODE_BLOCK_KEYS", "interpreted", "paged_decode_attention", "write_paged_kv"]
