"""Fused elementwise kernels of the decode fast path, each with its plain-torch reference.

A decode step of a small batch is a few weight-reading GEMMs, the attention kernel and, in
between, many tiny elementwise ops (norms, RoPE, the KV write, the MLP activation), each a
kernel launch that moves almost no bytes. These functions do each of those groups in one
kernel, with the same numbers as the unfused ops to rounding: computed in the accumulation
dtype (float32 for 16-bit inputs) and rounded to the input dtype wherever the unfused op
stores a tensor.

* :func:`add_rms_norm`: residual add + RMSNorm (the norm alone without a residual).
* :func:`rope_split_write`: split a fused QKV projection, rotate q and k (rotate-half RoPE),
  store k and v at their slots of one layer's paged caches; returns the rotated queries.
* :func:`silu_mul`: ``silu(gate) * up`` of a merged ``[gate | up]`` projection.
* :func:`rope_tables`: the RoPE cosine and sine tables of a step's positions.
* :func:`argmax`: the greedy token of each row of logits.
* :func:`head_matmul`: one small matrix product per head (MLA's absorbed value
  up-projection), read and written in the layouts the step holds, in one kernel.

The kernels (``_triton_fused.py``, imported on first use as the paged kernels are) are
compiled without floating-point contraction (a product fused into the sum after it would skip
the rounding the unfused ops store). They run on CUDA tensors, and on CPU tensors through
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first imported: the CPU
tests do that); elsewhere (CPU tensors without the interpreter) each function runs its torch
reference (``*_reference``: the unfused ops, as
:class:`~helix_kv.executor.model.TinyTransformer` runs them on its general path). None
allocates anything but its outputs or syncs the host: they are safe to capture in a CUDA
graph.
"""

from __future__ import annotations

from types import ModuleType

import torch

from helix_kv.executor.paged_attention import interpreted

#: Heads of the fused q | k | v axis one program of :func:`rope_split_write` handles.
ROPE_BLOCK_HEADS = 8
#: Columns one program of :func:`silu_mul` handles.
SILU_BLOCK = 1024
#: Columns one block of :func:`argmax` covers (a 32k vocabulary in one).
ARGMAX_BLOCK = 32768
#: Rows, columns and inner elements of one :func:`head_matmul` program's tiles (the inner
#: loop steps by the last); the fastest of seven tilings at MLA's value up-projection, 64 and
#: 256 rows (``benches/gpu_decode_gemms.py --head-blocks``).
HEAD_MATMUL_BLOCKS = (64, 128, 64)


def _kernels() -> ModuleType:
    """The kernel module (imports triton on first use)."""
    try:
        from helix_kv.executor import _triton_fused
    except ImportError as exc:  # a torch build without triton (CPU-only wheels, macOS)
        raise RuntimeError(f"the fused kernels need triton: {exc}") from exc
    return _triton_fused


def use_kernels(device: torch.device) -> bool:
    """Whether tensors on ``device`` run the Triton kernels (CUDA, or the interpreter on the
    CPU) rather than the torch references."""
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _flags(dtype: torch.dtype) -> tuple[bool, bool]:
    """``(ACC_FP64, ROUND)`` of a kernel on tensors of ``dtype``."""
    return dtype == torch.float64, dtype in (torch.float16, torch.bfloat16)


def _rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{name} must be [rows, width] with contiguous rows, got {tuple(x.shape)}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the model's unfused path computes it (float32 work for 16-bit inputs)."""
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + delta`` (``x`` where ``delta`` is ``None``) and ``rms_norm(h) * weight``:
    ``(normed, h)``, unfused."""
    h = x if delta is None else x + delta
    return rms_norm_reference(h, weight, eps), h


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm in one pass: ``(rms_norm(x + delta) * weight, x + delta)``.

    The sum is rounded to ``x``'s dtype (as ``x + delta`` stores it) before it is normed;
    with ``delta`` ``None`` it is ``x`` itself (returned as is, nothing stored).

    Args:
        x: ``[rows, width]`` the residual stream (contiguous rows).
        delta: ``[rows, width]`` what is added to it (same dtype), or ``None``.
        weight: ``[width]`` the norm's scale.
        eps: added to the mean square.
    """
    _rows(x, "x")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} does not match x")
    if delta is not None:
        _rows(delta, "delta")
    if not use_kernels(x.device):
        return add_rms_norm_reference(x, delta, weight, eps)
    rows, width = x.shape
    out = torch.empty_like(x)
    total = x if delta is None else torch.empty_like(x)
    if rows == 0:
        return out, total
    acc_fp64, round_ = _flags(x.dtype)
    block = _next_power_of_2(width)
    _kernels().add_rms_norm_kernel[(rows,)](
        x,
        x if delta is None else delta,
        weight,
        out,
        total,
        width,
        eps,
        x.stride(0),
        x.stride(0) if delta is None else delta.stride(0),
        out.stride(0),
        total.stride(0),
        HAS_DELTA=delta is not None,
        BLOCK=block,
        ACC_FP64=acc_fp64,
        ROUND=round_,
        num_warps=max(1, min(16, block // 256)),
        enable_fp_fusion=False,
    )
    return out, total


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, unfused; ``x``: ``[tokens, heads, head_dim]``, tables
    ``[tokens, head_dim / 2]``."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def rope_split_write_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """:func:`rope_split_write` unfused: split, rotate, write the owned rows' k / v."""
    rows = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    heads = qkv.view(rows, q_heads + 2 * kv_heads, head_dim)
    rotated = rope_reference(heads[:, : q_heads + kv_heads], cos, sin)
    owned = slots >= 0
    index = slots[owned].long()
    key_cache[index] = rotated[owned, q_heads:].to(key_cache.dtype)
    value_cache[index] = heads[owned, q_heads + kv_heads :].to(value_cache.dtype)
    return rotated[:, :q_heads]


def rope_split_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """Split a fused QKV projection, rotate q and k, store k and v; the rotated queries.

    Args:
        qkv: ``[rows, (q_heads + 2 * kv_heads) * head_dim]`` (q heads, then k, then v;
            contiguous rows).
        cos, sin: ``[rows, head_dim / 2]`` RoPE tables of each row's position (the dtype of
            ``qkv``: products are rounded to it, as the unfused ops round them).
        slots: ``[rows]`` slot of each row's KV in this rank's caches, ``< 0`` for none
            (another rank owns the token, or a padding row); any int dtype and stride.
        key_cache, value_cache: one layer's caches ``[slots, kv_heads, head_dim]`` (last dim
            contiguous); values are cast to their dtype.
        q_heads, kv_heads: heads of the projection.

    Returns:
        ``[rows, q_heads, head_dim]`` rotated queries (contiguous, ``qkv``'s dtype).
    """
    _rows(qkv, "qkv")
    rows = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    if (
        head_dim % 2
        or qkv.shape[1] != (q_heads + 2 * kv_heads) * head_dim
        or key_cache.shape[1:] != (kv_heads, head_dim)
        or value_cache.shape != key_cache.shape
    ):
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not hold {q_heads} + 2 x {kv_heads} heads of the "
            f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    half = head_dim // 2
    if cos.shape != (rows, half) or sin.shape != (rows, half):
        raise ValueError(f"tables {tuple(cos.shape)} / {tuple(sin.shape)} are not [{rows}, {half}]")
    if not use_kernels(qkv.device):
        return rope_split_write_reference(
            qkv, cos, sin, slots, key_cache, value_cache, q_heads, kv_heads
        )
    query = qkv.new_empty((rows, q_heads, head_dim))
    if rows == 0:
        return query
    for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    acc_fp64, round_ = _flags(qkv.dtype)
    heads = q_heads + 2 * kv_heads
    block_heads = _next_power_of_2(heads) if interpreted() else ROPE_BLOCK_HEADS
    _kernels().rope_split_write_kernel[(rows, -(-heads // block_heads))](
        qkv,
        cos,
        sin,
        slots,
        query,
        key_cache,
        value_cache,
        q_heads,
        kv_heads,
        half,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        slots.stride(0),
        *query.stride()[:2],
        *key_cache.stride()[:2],
        *value_cache.stride()[:2],
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=_next_power_of_2(half),
        ACC_FP64=acc_fp64,
        ROUND=round_,
        enable_fp_fusion=False,
    )
    return query


def mla_rope_norm_write_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    latent_cache: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    query: torch.Tensor,
) -> None:
    """:func:`mla_rope_norm_write` unfused."""
    latent = norm_weight.shape[0]
    nope = q.shape[-1] - (kv.shape[-1] - latent)
    query[..., latent:] = rope_reference(q[..., nope:], cos, sin)
    owned = slots >= 0
    index = slots[owned].long()
    row = torch.cat(
        [
            rms_norm_reference(kv[:, :latent], norm_weight, eps),
            rope_reference(kv[:, None, latent:], cos, sin)[:, 0],
        ],
        dim=-1,
    )
    latent_cache[index, 0] = row[owned].to(latent_cache.dtype)


def mla_rope_norm_write(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    latent_cache: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    query: torch.Tensor,
) -> None:
    """The RoPE, norm and KV write of an MLA decode step in one kernel (a program per row).

    Args:
        q: ``[rows, heads, nope + rope]`` the query projection (last dim contiguous).
        kv: ``[rows, latent + rope]`` the ``kv_a`` projection (contiguous rows).
        cos, sin: ``[rows, rope / 2]`` RoPE tables (``q``'s dtype).
        slots: ``[rows]`` each row's slot on this rank, ``< 0`` for none.
        latent_cache: one layer of a latent pool, ``[slots, 1, latent + rope]``.
        norm_weight: ``[latent]`` the latent's RMSNorm weight; ``eps`` its epsilon.
        query: ``[rows, heads, latent + rope]`` the absorbed query: its RoPE part
            (``[..., latent:]``) is written here, the rotated ``q[..., nope:]``.

    Stores, at each owned row's slot, the RMS-normed latent and the rotated shared key.
    """
    rows, heads, qk = q.shape
    latent = norm_weight.shape[0]
    rope = kv.shape[-1] - latent
    if (
        rope < 2
        or rope % 2
        or qk <= rope
        or query.shape != (rows, heads, latent + rope)
        or latent_cache.shape[1:] != (1, latent + rope)
        or kv.shape[0] != rows
    ):
        raise ValueError(
            f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, query {tuple(query.shape)} and the "
            f"cache {tuple(latent_cache.shape)} do not fit a latent of {latent}"
        )
    half = rope // 2
    if cos.shape != (rows, half) or sin.shape != (rows, half):
        raise ValueError(f"tables {tuple(cos.shape)} / {tuple(sin.shape)} are not [{rows}, {half}]")
    if not use_kernels(q.device):
        mla_rope_norm_write_reference(q, kv, cos, sin, slots, latent_cache, norm_weight, eps, query)
        return
    if rows == 0:
        return
    for name, tensor in (("q", q), ("kv", kv), ("query", query), ("latent_cache", latent_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    acc_fp64, round_ = _flags(q.dtype)
    _kernels().mla_rope_norm_write_kernel[(rows,)](
        q,
        kv,
        cos,
        sin,
        slots,
        norm_weight,
        query,
        latent_cache,
        heads,
        qk - rope,
        latent,
        half,
        eps,
        *q.stride()[:2],
        kv.stride(0),
        cos.stride(0),
        sin.stride(0),
        slots.stride(0),
        *query.stride()[:2],
        latent_cache.stride(0),
        BLOCK_HEADS=_next_power_of_2(heads),
        BLOCK_HALF=_next_power_of_2(half),
        BLOCK_LATENT=_next_power_of_2(latent),
        ACC_FP64=acc_fp64,
        ROUND=round_,
        enable_fp_fusion=False,
    )


def rope_tables_reference(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cosine and sine tables ``[rows, half]`` of ``positions``, unfused (float64
    angles, cast to ``dtype``)."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosine and sine tables of :func:`rope_split_write` in one kernel.

    Args:
        positions: ``[rows]`` global positions (any int dtype and stride).
        inv_freq: ``[half]`` inverse frequencies (float64).
        dtype: the tables' dtype (the model's).

    Returns:
        ``cos, sin``: ``[rows, half]`` of ``positions * inv_freq``, computed in float64.
    """
    if positions.dim() != 1 or inv_freq.dim() != 1:
        raise ValueError(
            f"positions {tuple(positions.shape)} and inv_freq {tuple(inv_freq.shape)} "
            "must be one-dimensional"
        )
    if not use_kernels(positions.device):
        return rope_tables_reference(positions, inv_freq, dtype)
    rows, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((rows, half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if rows == 0 or half == 0:
        return cos, sin
    _kernels().rope_tables_kernel[(rows,)](
        positions,
        inv_freq,
        cos,
        sin,
        half,
        positions.stride(0),
        cos.stride(0),
        sin.stride(0),
        BLOCK_HALF=_next_power_of_2(half),
    )
    return cos, sin


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` of ``[rows, width]`` rows in one kernel (the first
    column of the largest value; rows holding NaN are not ranked as torch ranks them).

    ``out``: ``[rows]`` int64 to write into (e.g. a view of a persistent buffer).
    """
    _rows(logits, "logits")
    rows, width = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"out must be [{rows}] int64, got {tuple(out.shape)} {out.dtype}")
    if not use_kernels(logits.device) or width == 0:
        return torch.argmax(logits, dim=-1, out=out)
    if rows == 0:
        return out
    block = min(ARGMAX_BLOCK, _next_power_of_2(width))
    _kernels().argmax_rows_kernel[(rows,)](
        logits,
        out,
        width,
        logits.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=max(1, min(16, block // 1024)),
    )
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[rows, 2 * width]`` rows ``[gate | up]``, unfused."""
    width = gate_up.shape[1] // 2
    return torch.nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU-gated product of a merged projection: ``silu(gate) * up``, ``[rows, width]``.

    ``gate_up``: ``[rows, 2 * width]``, each row ``[gate | up]`` (e.g. ``x @ w_gate_up``
    with ``w_gate_up = cat([w_gate, w_up], dim=1)``; contiguous rows). The activation is
    rounded to the input dtype before the product, as the unfused ops store it.
    """
    _rows(gate_up, "gate_up")
    rows, double = gate_up.shape
    if double % 2:
        raise ValueError(f"gate_up has an odd width {double}")
    if not use_kernels(gate_up.device):
        return silu_mul_reference(gate_up)
    width = double // 2
    out = gate_up.new_empty((rows, width))
    if rows == 0 or width == 0:
        return out
    acc_fp64, round_ = _flags(gate_up.dtype)
    block = min(SILU_BLOCK, _next_power_of_2(width))
    _kernels().silu_mul_kernel[(rows, -(-width // block))](
        gate_up,
        out,
        width,
        gate_up.stride(0),
        out.stride(0),
        BLOCK=block,
        ACC_FP64=acc_fp64,
        ROUND=round_,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


def head_matmul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y[r, h, c] = sum_k x[r, h, k] * weight[h, k, c]`` by torch (``x`` cast to the
    weight's dtype first): ``[rows, heads, cols]``."""
    return torch.einsum("rhk,hkc->rhc", x.to(weight.dtype), weight)


def _check_head_matmul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    """:func:`head_matmul`'s shapes, dtypes and contiguous last dims."""
    if (
        x.dim() != 3
        or weight.dim() != 3
        or weight.shape[0] != x.shape[1]
        or (weight.shape[1] != x.shape[2])
    ):
        raise ValueError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [rows, heads, inner] "
            "and [heads, inner, cols]"
        )
    rows, heads, inner = x.shape
    cols = weight.shape[2]
    if out is not None and (
        tuple(out.shape) != (rows, heads, cols)
        or out.dtype != weight.dtype
        or (cols > 1 and out.stride(2) != 1)
    ):
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must be [{rows}, {heads}, {cols}] of "
            f"{weight.dtype} with a contiguous last dim"
        )
    if inner > 1 and x.stride(2) != 1:
        raise ValueError("x must have a contiguous last dim")


def head_matmul(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One matrix product per head: ``out[r, h, c] = sum_k x[r, h, k] * weight[h, k, c]``.

    MLA's absorbed up-projections are one small product per head (a step's rows times a
    ``[nope, latent]`` or ``[latent, v]`` matrix); as batched GEMMs they need the rows
    transposed to heads-first and back, each a copy (the model runs the value one here).
    Here one kernel reads ``x`` and writes ``out`` in the step's own ``[rows, heads, ...]``
    layout, accumulating in float32 (in float64 for float64, on the torch path) and rounding
    once.

    Args:
        x: ``[rows, heads, inner]`` (contiguous last dim, any other strides; any float dtype:
            cast to the weight's, as ``x.to(weight.dtype)`` would).
        weight: ``[heads, inner, cols]``, any strides (a transposed view of a
            ``[heads, cols, inner]`` weight is read as it lies).
        out: ``[rows, heads, cols]`` of the weight's dtype with a contiguous last dim (a
            view into a wider tensor is fine), or ``None`` for a new one.

    The kernel runs on CUDA (float16, bfloat16, float32 with IEEE dots) and on the CPU under
    Triton's interpreter; elsewhere, and in float64, :func:`head_matmul_reference`.
    """
    _check_head_matmul(x, weight, out)
    rows, heads, inner = x.shape
    cols = weight.shape[2]
    if not use_kernels(x.device) or weight.dtype == torch.float64:
        result = head_matmul_reference(x, weight)
        if out is None:
            return result
        out.copy_(result)
        return out
    if out is None:
        out = weight.new_empty((rows, heads, cols))
    if rows == 0 or heads == 0 or cols == 0:
        return out
    if inner == 0:
        return out.zero_()
    block_r, block_c, block_k = HEAD_MATMUL_BLOCKS
    block_r = max(16, min(block_r, _next_power_of_2(rows)))
    grid = (heads, -(-rows // block_r), -(-cols // block_c))
    _kernels().head_matmul_kernel[grid](
        x,
        weight,
        out,
        rows,
        inner,
        cols,
        x.stride(0),
        x.stride(1),
        *weight.stride(),
        out.stride(0),
        out.stride(1),
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        BLOCK_K=block_k,
        IEEE=weight.dtype == torch.float32,
        num_warps=4,
        num_stages=3,
    )
    return out


__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "argmax",
    "head_matmul",
    "head_matmul_reference",
    "mla_rope_norm_write",
    "mla_rope_norm_write_reference",
    "rms_norm_reference",
    "rope_reference",
    "rope_split_write",
    "rope_split_write_reference",
    "rope_tables",
    "rope_tables_reference",
    "silu_mul",
    "silu_mul_reference",
    "use_kernels",
]
