# Triton ships no type information and its kernels are written in its untyped DSL:
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
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

import torch
import triton
import triton.language as tl

from helix_kv.executor.attention import PartialAttention, accumulation_dtype


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    tokens_per_block,
    group,
    head_dim,
    stride_q_row,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_table_row,
    stride_lens,
    stride_out_row,
    stride_out_head,
    stride_lse_row,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC_FP64: tl.constexpr,
):
    """One program: one request (axis 0) x one kv head (axis 1), all its query heads.

    Online softmax over the request's local keys in blocks of ``BLOCK_N`` (any block size:
    each key's page is looked up on its own, so a block may span pages).
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < head_dim
    heads = kv_head * group + g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
        mask=q_mask,
        other=0.0,
    ).to(acc_type)
    q = q * scale
    length = tl.load(lens_ptr + row * stride_lens).to(tl.int32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=acc_type)
    l_i = tl.zeros([BLOCK_G], dtype=acc_type)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=acc_type)
    for start in range(0, length, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_mask = j < length
        page = tl.load(
            table_ptr + row * stride_table_row + j // tokens_per_block, mask=j_mask, other=0
        )
        slot = page.to(tl.int64) * tokens_per_block + (j % tokens_per_block)
        kv_mask = j_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(acc_type)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
        scores = tl.where(j_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: the block has a visible key
        alpha = tl.exp(m_i - m_new)  # exp(-inf) = 0 on the first block
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + slot[:, None] * stride_v_slot + kv_head * stride_v_head + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(acc_type)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    seen = l_i > 0
    safe_l = tl.where(seen, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(seen, m_i + tl.log(safe_l), float("-inf"))
    tl.store(
        out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + d[None, :],
        out,
        mask=q_mask,
    )
    tl.store(lse_ptr + row * stride_lse_row + heads, lse, mask=g_mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    slots_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_heads,
    head_dim,
    stride_key_row,
    stride_key_head,
    stride_value_row,
    stride_value_head,
    stride_slots,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: store its KV at its slot, or nothing where the slot is < 0."""
    row = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
    owned = (tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0  # a block-shaped mask
    mask = (h[:, None] < kv_heads) & (d[None, :] < head_dim) & owned
    key = tl.load(
        key_ptr + row * stride_key_row + h[:, None] * stride_key_head + d[None, :],
        mask=mask,
        other=0.0,
    )
    value = tl.load(
        value_ptr + row * stride_value_row + h[:, None] * stride_value_head + d[None, :],
        mask=mask,
        other=0.0,
    )
    k_dst = k_cache_ptr + slot * stride_k_slot + h[:, None] * stride_k_head + d[None, :]
    v_dst = v_cache_ptr + slot * stride_v_slot + h[:, None] * stride_v_head + d[None, :]
    tl.store(k_dst, key.to(k_dst.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_dst.dtype.element_ty), mask=mask)


#: Keys per block of the decode kernel's online softmax.
DECODE_BLOCK_KEYS = 32


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
    _decode_attention_kernel[(requests, kv_heads)](
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
        BLOCK_G=max(2, triton.next_power_of_2(group)),
        BLOCK_N=DECODE_BLOCK_KEYS,
        BLOCK_D=max(2, triton.next_power_of_2(head_dim)),
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
    _write_kv_kernel[(tokens,)](
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
        BLOCK_H=max(2, triton.next_power_of_2(kv_heads)),
        BLOCK_D=max(2, triton.next_power_of_2(head_dim)),
    )


__all__ = ["DECODE_BLOCK_KEYS", "interpreted", "paged_decode_attention", "write_paged_kv"]
