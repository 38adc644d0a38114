# Triton ships no type information and its kernels are written in its untyped DSL:
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""The Triton kernels of :mod:`helix_kv.executor.paged_attention` (imported on first use, so
that importing the executor never needs triton)."""

import triton
import triton.language as tl


@triton.jit
def _block_slots(table_row_ptr, start, end, tokens_per_block, BLOCK_N: tl.constexpr):
    """The cache slots of local keys ``[start, start + BLOCK_N)`` of one row (its block table
    row at ``table_row_ptr``) and which of them are below ``end``; a key at or past ``end``
    gets slot 0 (its table entry is not read)."""
    j = start + tl.arange(0, BLOCK_N)
    j_mask = j < end
    page = tl.load(table_row_ptr + j // tokens_per_block, mask=j_mask, other=0)
    return page.to(tl.int64) * tokens_per_block + (j % tokens_per_block), j_mask


@triton.jit
def _online_softmax_step(
    scores, values, m_i, l_i, acc, USE_DOT: tl.constexpr, GUARD_EMPTY: tl.constexpr
):
    """One key block of the online softmax shared by the attention kernels: ``scores``
    ``[M, N]`` (keys a query slot does not see at ``-inf``), ``values`` ``[N, D]``; returns
    the running max, sum and output ``[M, D]`` (unnormalised) with the block added.

    ``USE_DOT``: ``p @ values`` on tensor cores, the probabilities rounded to the values'
    dtype first (as flash attention does); otherwise a broadcast product in the
    accumulator's dtype. ``GUARD_EMPTY``: a query slot may see no key of the block (its max
    stays ``-inf``): it is kept at 0 instead of turning to NaN; without it every slot must
    see a key of every block (the decode kernels' blocks: one row, keys below its length).
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # without GUARD_EMPTY the max is finite: the block has a visible key
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if GUARD_EMPTY else m_new
    alpha = tl.exp(m_i - m_ref)  # exp(-inf) = 0 on the first block
    p = tl.exp(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(values.dtype), values, input_precision="ieee", out_dtype=acc.dtype)
    else:
        pv = tl.sum(p[:, :, None] * values.to(acc.dtype)[None, :, :], axis=1)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _partial_result(acc, l_i, m_i):
    """A partial attention's output, normalised over the keys seen, and its LSE; a query
    slot that saw no key gets output 0 and LSE ``-inf``. (The kernels compute their store
    addresses after this: made before, a ``[M, D]`` tile of pointers would be live across
    the division, which spilled registers of the MLA kernel.)"""
    seen = l_i > 0
    safe_l = tl.where(seen, l_i, 1.0)
    return acc / safe_l[:, None], tl.where(seen, m_i + tl.log(safe_l), float("-inf"))


@triton.jit
def _split_range(split, keys_per_split, length):
    """Split ``split``'s local keys of a row of ``length`` keys: ``[first, end)`` (empty past
    the row's end)."""
    first = split * keys_per_split
    return first, tl.minimum(length, first + keys_per_split)


@triton.jit
def _softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC_FP64: tl.constexpr):
    """The online softmax's running max, sum and output of ``BLOCK_M`` query slots, before
    any key."""
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc_type)
    l_i = tl.zeros([BLOCK_M], dtype=acc_type)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_type)
    return m_i, l_i, acc


@triton.jit
def _load_query(
    q_ptr,
    q_rows,
    heads,
    d,
    q_mask,
    stride_q_head,
    scale,
    ACC_FP64: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """The query slots of a program (``q_rows``: each slot's row offset), ``[M, D]``; without
    dots already scaled, in the accumulator's dtype."""
    q = tl.load(
        q_ptr + q_rows + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0
    )
    if not USE_DOT:
        q = q.to(tl.float64 if ACC_FP64 else tl.float32) * scale
    return q


@triton.jit
def _scores_and_values(
    q,
    k_cache_ptr,
    v_cache_ptr,
    slot,
    kv_mask,
    kv_head,
    d,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    scale,
    ACC_FP64: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """One key block of a kv head: the scores ``[M, N]`` of the query slots against its keys
    (scaled; not yet masked) and its values ``[N, D]``."""
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    k = tl.load(
        k_cache_ptr + slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr + slot[:, None] * stride_v_slot + kv_head * stride_v_head + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if USE_DOT:
        scores = (
            tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee", out_dtype=acc_type) * scale
        )
    else:
        scores = tl.sum(q[:, None, :] * k.to(acc_type)[None, :, :], axis=2)  # [M, N]
    return scores, v


@triton.jit
def _store_partial(
    out_ptr,
    lse_ptr,
    rows,
    split,
    heads,
    cols,
    out,
    lse,
    out_mask,
    lse_mask,
    stride_out_row,
    stride_out_head,
    stride_out_split,
    stride_lse_row,
    stride_lse_head,
    stride_lse_split,
    ROW_PER_SLOT: tl.constexpr,
):
    """Stores a program's partial output ``[M, D]`` and LSE ``[M]`` at its split: ``rows``
    the program's row, or (``ROW_PER_SLOT``) each query slot's ``[M]``. (Each address is
    made where it is stored, after the division of :func:`_partial_result`.)"""
    out_rows = rows[:, None] * stride_out_row if ROW_PER_SLOT else rows * stride_out_row
    tl.store(
        out_ptr
        + out_rows
        + split * stride_out_split
        + heads[:, None] * stride_out_head
        + cols[None, :],
        out,
        mask=out_mask,
    )
    tl.store(
        lse_ptr + rows * stride_lse_row + split * stride_lse_split + heads * stride_lse_head,
        lse,
        mask=lse_mask,
    )


@triton.jit
def _latent_scores(
    q_lat, q_rope, c_lat, c_rope, scale, ACC_FP64: tl.constexpr, USE_DOT: tl.constexpr
):
    """The MLA scores ``[H, N]`` of a block of cache rows: the latent and the RoPE parts,
    each over its own tile (with dots, then scaled; without, the queries came scaled)."""
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    if USE_DOT:
        scores = tl.dot(
            q_lat.to(c_lat.dtype), tl.trans(c_lat), input_precision="ieee", out_dtype=acc_type
        )
        scores = tl.dot(
            q_rope.to(c_rope.dtype),
            tl.trans(c_rope),
            acc=scores,
            input_precision="ieee",
            out_dtype=acc_type,
        )
        scores = scores * scale
    else:
        scores = tl.sum(q_lat[:, None, :] * c_lat.to(acc_type)[None, :, :], axis=2)
        scores += tl.sum(q_rope[:, None, :] * c_rope.to(acc_type)[None, :, :], axis=2)
    return scores


@triton.jit
def decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    tokens_per_block,
    keys_per_split,
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
    stride_out_split,
    stride_lse_row,
    stride_lse_head,
    stride_lse_split,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC_FP64: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """One program: one request (axis 0) x one kv head (axis 1) x one split (axis 2) of the
    request's local keys, all the kv head's query heads.

    Split ``s`` attends to local keys ``[s * keys_per_split, (s + 1) * keys_per_split)`` that
    are below the request's length (an empty range, e.g. past a short request's end, gives
    output 0 and LSE ``-inf``) and stores its output, normalised over those keys, and their
    LSE at ``split * stride_*_split``. With one split (``keys_per_split`` at least the
    longest length, split strides 0) this is the whole single-pass attention, stored straight
    into the result; with more, :func:`combine_splits_kernel` merges the partials.

    Online softmax over the range in blocks of ``BLOCK_N`` keys (any block size: each key's
    page is looked up on its own, so a block may span pages). ``USE_DOT``: scores and values
    through ``tl.dot`` (tensor cores; ``BLOCK_G``, ``BLOCK_N`` and ``BLOCK_D`` at least 16,
    the probabilities rounded to the cache dtype before ``p @ v`` as flash attention does);
    otherwise broadcast products in the accumulation dtype (float64 on a GPU).
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < head_dim
    heads = kv_head * group + g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = _load_query(
        q_ptr, row * stride_q_row, heads, d, q_mask, stride_q_head, scale, ACC_FP64, USE_DOT
    )
    length = tl.load(lens_ptr + row * stride_lens).to(tl.int32)
    first, end = _split_range(split, keys_per_split, length)
    m_i, l_i, acc = _softmax_start(BLOCK_G, BLOCK_D, ACC_FP64)
    for start in range(first, end, BLOCK_N):
        slot, j_mask = _block_slots(
            table_ptr + row * stride_table_row, start, end, tokens_per_block, BLOCK_N
        )
        scores, v = _scores_and_values(
            q,
            k_cache_ptr,
            v_cache_ptr,
            slot,
            j_mask[:, None] & d_mask[None, :],
            kv_head,
            d,
            stride_k_slot,
            stride_k_head,
            stride_v_slot,
            stride_v_head,
            scale,
            ACC_FP64,
            USE_DOT,
        )
        scores = tl.where(j_mask[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, USE_DOT, False)
    out, lse = _partial_result(acc, l_i, m_i)
    _store_partial(
        out_ptr,
        lse_ptr,
        row,
        split,
        heads,
        d,
        out,
        lse,
        q_mask,
        g_mask,
        stride_out_row,
        stride_out_head,
        stride_out_split,
        stride_lse_row,
        stride_lse_head,
        stride_lse_split,
        False,
    )


@triton.jit
def verify_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    lens_ptr,
    pos_ptr,
    out_ptr,
    lse_ptr,
    scale,
    tokens_per_block,
    tokens_per_superblock,
    keys_per_split,
    group,
    head_dim,
    num_rows,
    table_width,
    stride_q_row,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_table_row,
    stride_lens,
    stride_pos,
    stride_out_row,
    stride_out_head,
    stride_out_split,
    stride_lse_row,
    stride_lse_head,
    stride_lse_split,
    ROWS: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC_FP64: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """:func:`decode_attention_kernel` for rows that verify drafts: a request's ``1 + k``
    query rows (consecutive rows, consecutive positions, one block table) in one program, so
    each key and value block is loaded once for all of them.

    One program per (row, kv head, split). A row continuing the row before it (position one
    more, and the same superblock id at its position's superblock: a superblock a step writes
    belongs to one request alone) is not a group's first and does nothing; the first row of a
    group attends for the group's rows (up to ``ROWS``, that continue it the same way), all
    the kv head's query heads of each: the ``ROWS * BLOCK_GROUP`` query slots of one ``tl.dot``,
    each masked at its own row's local length (the causal mask inside the draft). Padding
    rows (local length 0, position 0) are groups of their own that see nothing.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pos_row = tl.load(pos_ptr + row * stride_pos).to(tl.int64)
    sb_row = pos_row // tokens_per_superblock
    if row > 0:
        pos_prev = tl.load(pos_ptr + (row - 1) * stride_pos).to(tl.int64)
        in_table = (sb_row >= 0) & (sb_row < table_width)
        page_prev = tl.load(
            table_ptr + (row - 1) * stride_table_row + sb_row, mask=in_table, other=-2
        )
        page_row = tl.load(table_ptr + row * stride_table_row + sb_row, mask=in_table, other=-3)
        if (pos_prev + 1 == pos_row) & (page_prev == page_row):
            return  # the group's first row attends for this one
    m = tl.arange(0, ROWS * BLOCK_GROUP)
    r = m // BLOCK_GROUP
    g = m % BLOCK_GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    rows_m = row + r
    in_rows = rows_m < num_rows
    pos_m = tl.load(pos_ptr + rows_m * stride_pos, mask=in_rows, other=-1).to(tl.int64)
    sb_m = pos_m // tokens_per_superblock
    in_table_m = in_rows & (pos_m >= 0) & (sb_m < table_width)
    page_self = tl.load(table_ptr + row * stride_table_row + sb_m, mask=in_table_m, other=-2)
    page_m = tl.load(table_ptr + rows_m * stride_table_row + sb_m, mask=in_table_m, other=-3)
    member = in_rows & (pos_m == pos_row + r) & ((r == 0) | (page_self == page_m))
    slot_mask = member & (g < group)
    heads = kv_head * group + g
    q_mask = slot_mask[:, None] & d_mask[None, :]
    q = _load_query(
        q_ptr,
        rows_m[:, None] * stride_q_row,
        heads,
        d,
        q_mask,
        stride_q_head,
        scale,
        ACC_FP64,
        USE_DOT,
    )
    lens_m = tl.load(lens_ptr + rows_m * stride_lens, mask=slot_mask, other=0).to(tl.int32)
    length = tl.max(lens_m, axis=0)
    first, end = _split_range(split, keys_per_split, length)
    m_i, l_i, acc = _softmax_start(ROWS * BLOCK_GROUP, BLOCK_D, ACC_FP64)
    for start in range(first, end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        slot, j_mask = _block_slots(
            table_ptr + row * stride_table_row, start, end, tokens_per_block, BLOCK_N
        )
        scores, v = _scores_and_values(
            q,
            k_cache_ptr,
            v_cache_ptr,
            slot,
            j_mask[:, None] & d_mask[None, :],
            kv_head,
            d,
            stride_k_slot,
            stride_k_head,
            stride_v_slot,
            stride_v_head,
            scale,
            ACC_FP64,
            USE_DOT,
        )
        visible = j_mask[None, :] & (j[None, :] < lens_m[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # a query slot may see no key of this block (its row ends earlier): guarded
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, USE_DOT, True)
    out, lse = _partial_result(acc, l_i, m_i)
    _store_partial(
        out_ptr,
        lse_ptr,
        rows_m,
        split,
        heads,
        d,
        out,
        lse,
        q_mask,
        slot_mask,
        stride_out_row,
        stride_out_head,
        stride_out_split,
        stride_lse_row,
        stride_lse_head,
        stride_lse_split,
        True,
    )


@triton.jit
def mla_decode_attention_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale_hi,
    scale_lo,
    tokens_per_block,
    keys_per_split,
    num_heads,
    latent_dim,
    rope_dim,
    stride_q_row,
    stride_q_head,
    stride_cache_slot,
    stride_table_row,
    stride_lens,
    stride_out_row,
    stride_out_head,
    stride_out_split,
    stride_lse_row,
    stride_lse_head,
    stride_lse_split,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ACC_FP64: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Multi-head latent attention (absorbed form): one program per request (axis 0) x tile
    of ``BLOCK_H`` query heads (axis 1) x split (axis 2) of the request's local keys.

    Every head reads the one latent head of the cache: a slot holds the compressed KV latent
    (``latent_dim``) followed by its RoPE key (``rope_dim``). The score of a head and a key is
    ``scale * (q[:latent] . c[:latent] + q[latent:] . c[latent:])``, the two dots taken over
    their own tiles (``BLOCK_L``, ``BLOCK_R``: powers of two, masked) rather than one padded
    tile; the value of a key is its latent, the same tile the score read (loaded once per key
    block, used by both dots). Splits, masks, the online softmax, ``USE_DOT`` and the stores
    are those of :func:`decode_attention_kernel` (``heads`` in place of a kv head's group).
    The scale comes in two float32 scalars (a float argument is passed as float32),
    ``scale_hi + scale_lo``, so that float64 runs take it to about 48 bits.

    ``PREFETCH``: each block's slots are looked up one block ahead (loop-carried), so that
    the cache rows' addresses depend on no load of the same iteration; Triton's pipeliner
    then keeps ``num_stages - 1`` key blocks in flight while a block computes (seen in the
    compiled kernel: two or three shared-memory buffers). Without it the block's page
    lookup feeds its own copy, the pipeliner keeps one buffer and each block waits for its
    copy before it computes.
    """
    row = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    # float64: [BLOCK_H, 1], hi and lo added in float64
    scale = (
        (tl.zeros([BLOCK_H, 1], dtype=tl.float64) + scale_hi) + scale_lo if ACC_FP64 else scale_hi
    )
    h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    h_mask = h < num_heads
    l_mask = dl < latent_dim
    r_mask = dr < rope_dim
    q_rows = q_ptr + row * stride_q_row + h[:, None] * stride_q_head
    ql_mask = h_mask[:, None] & l_mask[None, :]
    q_lat = tl.load(q_rows + dl[None, :], mask=ql_mask, other=0.0)
    q_rope = tl.load(
        q_rows + latent_dim + dr[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0
    )
    if not USE_DOT:
        q_lat = q_lat.to(acc_type) * scale
        q_rope = q_rope.to(acc_type) * scale
    length = tl.load(lens_ptr + row * stride_lens).to(tl.int32)
    first, end = _split_range(split, keys_per_split, length)
    m_i, l_i, acc = _softmax_start(BLOCK_H, BLOCK_L, ACC_FP64)
    table_row = table_ptr + row * stride_table_row
    if PREFETCH:
        slot_next, mask_next = _block_slots(table_row, first, end, tokens_per_block, BLOCK_N)
    for start in range(first, end, BLOCK_N):
        if PREFETCH:
            slot, j_mask = slot_next, mask_next
        else:
            slot, j_mask = _block_slots(table_row, start, end, tokens_per_block, BLOCK_N)
        c_rows = cache_ptr + slot[:, None] * stride_cache_slot
        c_lat = tl.load(c_rows + dl[None, :], mask=j_mask[:, None] & l_mask[None, :], other=0.0)
        c_rope = tl.load(
            c_rows + latent_dim + dr[None, :], mask=j_mask[:, None] & r_mask[None, :], other=0.0
        )
        if PREFETCH:  # the next block's slots, looked up while this block computes
            slot_next, mask_next = _block_slots(
                table_row, start + BLOCK_N, end, tokens_per_block, BLOCK_N
            )
        scores = _latent_scores(q_lat, q_rope, c_lat, c_rope, scale, ACC_FP64, USE_DOT)
        scores = tl.where(j_mask[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, c_lat, m_i, l_i, acc, USE_DOT, False)
    out, lse = _partial_result(acc, l_i, m_i)
    _store_partial(
        out_ptr,
        lse_ptr,
        row,
        split,
        h,
        dl,
        out,
        lse,
        ql_mask,
        h_mask,
        stride_out_row,
        stride_out_head,
        stride_out_split,
        stride_lse_row,
        stride_lse_head,
        stride_lse_split,
        False,
    )


@triton.jit
def combine_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    head_dim,
    stride_part_out_row,
    stride_part_out_head,
    stride_part_out_split,
    stride_part_lse_row,
    stride_part_lse_head,
    stride_part_lse_split,
    stride_out_row,
    stride_out_head,
    stride_lse_row,
    stride_lse_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC_FP64: tl.constexpr,
):
    """One program per (request, query head, chunk of ``BLOCK_D`` of the head dim: axis 2,
    one chunk where the grid has no third axis): the exact LSE combine of its split partials.

    ``lse = log(sum_s exp(lse_s))`` and ``out = sum_s exp(lse_s - lse) * out_s``; splits with
    LSE ``-inf`` (no key) weigh 0, and a request no split saw gives output 0 and LSE ``-inf``.
    Wide heads (an MLA latent) in chunks keep the ``[BLOCK_S, BLOCK_D]`` tile in registers.
    """
    row = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    s = tl.arange(0, BLOCK_S)
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_dim
    lses = tl.load(
        part_lse_ptr
        + row * stride_part_lse_row
        + head * stride_part_lse_head
        + s * stride_part_lse_split,
        mask=s_mask,
        other=float("-inf"),
    ).to(acc_type)
    m = tl.max(lses, axis=0)
    seen = m > float("-inf")
    m_safe = tl.where(seen, m, 0.0)
    weights = tl.exp(lses - m_safe)  # exp(-inf) = 0 for an empty split
    total = tl.sum(weights, axis=0)
    safe_total = tl.where(seen, total, 1.0)
    parts = tl.load(
        part_out_ptr
        + row * stride_part_out_row
        + head * stride_part_out_head
        + s[:, None] * stride_part_out_split
        + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(acc_type)
    out = tl.sum(weights[:, None] * parts, axis=0) / safe_total
    lse = tl.where(seen, m_safe + tl.log(safe_total), float("-inf"))
    tl.store(out_ptr + row * stride_out_row + head * stride_out_head + d, out, mask=d_mask)
    if chunk == 0:
        tl.store(lse_ptr + row * stride_lse_row + head * stride_lse_head, lse)


@triton.jit
def write_kv_kernel(
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
    HAS_VALUE: tl.constexpr,
):
    """One program per token: store its KV at its slot, or nothing where the slot is < 0.

    Without ``HAS_VALUE`` only the key is stored (multi-head latent attention: the latent and
    its RoPE key are one cache); the value pointers are then not read."""
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
    k_dst = k_cache_ptr + slot * stride_k_slot + h[:, None] * stride_k_head + d[None, :]
    tl.store(k_dst, key.to(k_dst.dtype.element_ty), mask=mask)
    if HAS_VALUE:
        value = tl.load(
            value_ptr + row * stride_value_row + h[:, None] * stride_value_head + d[None, :],
            mask=mask,
            other=0.0,
        )
        v_dst = v_cache_ptr + slot * stride_v_slot + h[:, None] * stride_v_head + d[None, :]
        tl.store(v_dst, value.to(v_dst.dtype.element_ty), mask=mask)
