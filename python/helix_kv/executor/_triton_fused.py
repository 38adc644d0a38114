# Triton ships no type information and its kernels are written in its untyped DSL:
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""The Triton kernels of :mod:`helix_kv.executor.fused` (imported on first use, so that
importing the executor never needs triton).

Each kernel computes in the accumulation dtype (float32 for 16-bit inputs, else the input's)
and rounds to the input dtype wherever the unfused torch ops it replaces store a tensor
(``ROUND``), so that it reproduces them to rounding.
"""

import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    """``x`` rounded to ``dtype`` and back (a torch op's stored result), if ``ROUND``."""
    if ROUND:
        return x.to(dtype).to(x.dtype)
    return x


@triton.jit
def add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    width,
    eps,
    stride_x,
    stride_delta,
    stride_out,
    stride_sum,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC_FP64: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One program per row: ``h = x + delta`` (stored to ``sum_ptr``) and
    ``out = (h * rsqrt(mean(h^2) + eps)) * weight``; without ``HAS_DELTA``, ``h = x``."""
    row = tl.program_id(0)
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    h = x.to(acc_type)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        h = _round(h + delta.to(acc_type), dtype, ROUND)
        tl.store(sum_ptr + row * stride_sum + cols, h.to(dtype), mask=mask)
    mean_square = tl.sum(h * h, axis=0) / width
    normed = _round(h * (1.0 / tl.sqrt(mean_square + eps)), dtype, ROUND)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(acc_type)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(dtype), mask=mask)


@triton.jit
def rope_split_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_heads,
    kv_heads,
    half,
    stride_qkv_row,
    stride_cos_row,
    stride_sin_row,
    stride_slots,
    stride_query_row,
    stride_query_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ACC_FP64: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One program per (row, block of ``BLOCK_HEADS`` heads of the fused q | k | v axis).

    A q head is rotated into ``query``, a k head rotated into the key cache and a v head
    copied into the value cache, both at the row's slot (none where it is ``< 0``).
    Rotate-half RoPE, each product, difference and sum rounded as the unfused ops store it.
    """
    row = tl.program_id(0)
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    j = tl.arange(0, BLOCK_HALF)
    head_dim = 2 * half
    j_mask = j < half
    mask = (h < q_heads + 2 * kv_heads)[:, None] & j_mask[None, :]
    src = qkv_ptr + row * stride_qkv_row + h[:, None] * head_dim + j[None, :]
    first = tl.load(src, mask=mask, other=0.0)
    second = tl.load(src + half, mask=mask, other=0.0)
    dtype = first.dtype
    x1 = first.to(acc_type)
    x2 = second.to(acc_type)
    cos = tl.load(cos_ptr + row * stride_cos_row + j, mask=j_mask, other=0.0).to(acc_type)
    sin = tl.load(sin_ptr + row * stride_sin_row + j, mask=j_mask, other=0.0).to(acc_type)
    cos = cos[None, :]
    sin = sin[None, :]
    # first * cos - second * sin, second * cos + first * sin: each op stored, so rounded
    r1 = _round(x1 * cos, dtype, ROUND) - _round(x2 * sin, dtype, ROUND)
    r2 = _round(x2 * cos, dtype, ROUND) + _round(x1 * sin, dtype, ROUND)
    r1 = r1.to(dtype)
    r2 = r2.to(dtype)
    is_q = mask & (h < q_heads)[:, None]
    q_dst = query_ptr + row * stride_query_row + h[:, None] * stride_query_head + j[None, :]
    tl.store(q_dst, r1, mask=is_q)
    tl.store(q_dst + half, r2, mask=is_q)
    slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
    owned = (tl.zeros([BLOCK_HEADS, BLOCK_HALF], dtype=tl.int64) + slot) >= 0  # block-shaped
    is_k = mask & ((h >= q_heads) & (h < q_heads + kv_heads))[:, None] & owned
    k_dst = k_cache_ptr + slot * stride_k_slot + (h - q_heads)[:, None] * stride_k_head + j[None, :]
    k_type = k_dst.dtype.element_ty
    tl.store(k_dst, r1.to(k_type), mask=is_k)
    tl.store(k_dst + half, r2.to(k_type), mask=is_k)
    is_v = mask & (h >= q_heads + kv_heads)[:, None] & owned
    v_dst = (
        v_cache_ptr
        + slot * stride_v_slot
        + (h - q_heads - kv_heads)[:, None] * stride_v_head
        + j[None, :]
    )
    v_type = v_dst.dtype.element_ty
    tl.store(v_dst, first.to(v_type), mask=is_v)
    tl.store(v_dst + half, second.to(v_type), mask=is_v)


@triton.jit
def silu_mul_kernel(
    x_ptr,
    out_ptr,
    width,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    ACC_FP64: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One program per (row, block of columns): ``out = silu(gate) * up`` of a row
    ``[gate | up]`` (each ``width`` wide); ``silu(g) = g / (1 + exp(-g))``, stored rounded."""
    row = tl.program_id(0)
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(acc_type)
    activated = _round(g / (1.0 + tl.exp(-g)), dtype, ROUND)
    tl.store(out_ptr + row * stride_out + cols, (activated * up.to(acc_type)).to(dtype), mask=mask)


@triton.jit
def rope_tables_kernel(
    positions_ptr,
    inv_freq_ptr,
    cos_ptr,
    sin_ptr,
    half,
    stride_positions,
    stride_cos_row,
    stride_sin_row,
    BLOCK_HALF: tl.constexpr,
):
    """One program per row: ``angle = position * inv_freq`` in float64, its cosine and sine
    stored in the tables' dtype."""
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_HALF)
    mask = j < half
    position = tl.load(positions_ptr + row * stride_positions).to(tl.float64)
    inv_freq = tl.load(inv_freq_ptr + j, mask=mask, other=0.0).to(tl.float64)
    angle = position * inv_freq
    cos_dst = cos_ptr + row * stride_cos_row + j
    sin_dst = sin_ptr + row * stride_sin_row + j
    tl.store(cos_dst, tl.cos(angle).to(cos_dst.dtype.element_ty), mask=mask)
    tl.store(sin_dst, tl.sin(angle).to(sin_dst.dtype.element_ty), mask=mask)


@triton.jit
def argmax_rows_kernel(
    x_ptr,
    out_ptr,
    width,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
):
    """One program per row: the first column of the row's largest value (``torch.argmax``
    on rows without NaN), in blocks of ``BLOCK`` columns."""
    row = tl.program_id(0)
    best = tl.full([], float("-inf"), dtype=tl.float32)
    best_index = tl.zeros([], dtype=tl.int64)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=float("-inf"))
        value, index = tl.max(
            x.to(tl.float32), axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        better = value > best  # strictly: an equal value of a later block is not the first
        best_index = tl.where(better, start + index.to(tl.int64), best_index)
        best = tl.maximum(best, value)
    tl.store(out_ptr + row * stride_out, best_index)


@triton.jit
def mla_rope_norm_write_kernel(
    q_ptr,
    kv_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    norm_ptr,
    query_ptr,
    cache_ptr,
    heads,
    nope,
    latent,
    half,
    eps,
    stride_q_row,
    stride_q_head,
    stride_kv_row,
    stride_cos_row,
    stride_sin_row,
    stride_slots,
    stride_query_row,
    stride_query_head,
    stride_cache_slot,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    ACC_FP64: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One program per row of an MLA decode step: the query heads' RoPE parts rotated into
    ``query[:, :, latent:]``; the latent RMS-normed and the shared RoPE key rotated into the
    row's cache slot (none where it is ``< 0``). Each op rounded as the unfused ones store it."""
    row = tl.program_id(0)
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < half
    cos = tl.load(cos_ptr + row * stride_cos_row + j, mask=j_mask, other=0.0).to(acc_type)
    sin = tl.load(sin_ptr + row * stride_sin_row + j, mask=j_mask, other=0.0).to(acc_type)
    # the query heads' RoPE parts
    h = tl.arange(0, BLOCK_HEADS)
    mask = (h < heads)[:, None] & j_mask[None, :]
    src = q_ptr + row * stride_q_row + h[:, None] * stride_q_head + nope + j[None, :]
    first = tl.load(src, mask=mask, other=0.0)
    second = tl.load(src + half, mask=mask, other=0.0)
    dtype = first.dtype
    x1, x2 = first.to(acc_type), second.to(acc_type)
    r1 = _round(x1 * cos[None, :], dtype, ROUND) - _round(x2 * sin[None, :], dtype, ROUND)
    r2 = _round(x2 * cos[None, :], dtype, ROUND) + _round(x1 * sin[None, :], dtype, ROUND)
    dst = query_ptr + row * stride_query_row + h[:, None] * stride_query_head + latent + j[None, :]
    tl.store(dst, r1.to(dtype), mask=mask)
    tl.store(dst + half, r2.to(dtype), mask=mask)
    slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
    if slot >= 0:
        cache_type = cache_ptr.dtype.element_ty
        # the latent, RMS-normed
        cols = tl.arange(0, BLOCK_LATENT)
        c_mask = cols < latent
        x = tl.load(kv_ptr + row * stride_kv_row + cols, mask=c_mask, other=0.0).to(acc_type)
        mean_square = tl.sum(x * x, axis=0) / latent
        normed = _round(x * (1.0 / tl.sqrt(mean_square + eps)), dtype, ROUND)
        weight = tl.load(norm_ptr + cols, mask=c_mask, other=0.0).to(acc_type)
        out = cache_ptr + slot * stride_cache_slot
        tl.store(out + cols, (normed * weight).to(dtype).to(cache_type), mask=c_mask)
        # the shared RoPE key
        k1 = tl.load(kv_ptr + row * stride_kv_row + latent + j, mask=j_mask, other=0.0)
        k2 = tl.load(kv_ptr + row * stride_kv_row + latent + half + j, mask=j_mask, other=0.0)
        k1, k2 = k1.to(acc_type), k2.to(acc_type)
        s1 = _round(k1 * cos, dtype, ROUND) - _round(k2 * sin, dtype, ROUND)
        s2 = _round(k2 * cos, dtype, ROUND) + _round(k1 * sin, dtype, ROUND)
        tl.store(out + latent + j, s1.to(dtype).to(cache_type), mask=j_mask)
        tl.store(out + latent + half + j, s2.to(dtype).to(cache_type), mask=j_mask)


@triton.jit
def head_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rows,
    inner,
    cols,
    stride_x_row,
    stride_x_head,
    stride_w_head,
    stride_w_inner,
    stride_w_col,
    stride_y_row,
    stride_y_head,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program per head (axis 0) x tile of rows (axis 1) x tile of columns (axis 2):
    ``y[r, h, c] = sum_k x[r, h, k] * w[h, k, c]``, accumulated in float32 (``x`` rounded
    to ``w``'s dtype first, as the unfused ops cast it), rounded to ``y``'s dtype once.
    ``x`` and ``y`` have contiguous last dims; ``w`` any strides (a transposed weight)."""
    head = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_mask = r < rows
    c_mask = c < cols
    x_rows = x_ptr + r[:, None] * stride_x_row + head * stride_x_head
    w_head = w_ptr + head * stride_w_head + c[None, :] * stride_w_col
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(0, inner, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_mask = k < inner
        w = tl.load(
            w_head + k[:, None] * stride_w_inner,
            mask=k_mask[:, None] & c_mask[None, :],
            other=0.0,
        )
        x = tl.load(x_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x.to(w.dtype), w, acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(w.dtype), w, acc=acc)
    tl.store(
        y_ptr + r[:, None] * stride_y_row + head * stride_y_head + c[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=r_mask[:, None] & c_mask[None, :],
    )
