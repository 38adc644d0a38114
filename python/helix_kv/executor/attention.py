"""Helix attention: partial attention of one rank over the KV it holds, and the exact combine.

Every rank of a context-parallel (CP) group holds a disjoint slice of every request's keys and
values. Each rank attends over its slice and returns, per query and head, the normalised
partial output ``o_i`` and its log-sum-exp ``LSE_i``; the partials combine exactly
(``docs/executor.md``, "Attention across ranks")::

    m_i = max z,  l_i = sum exp(z - m_i),  o_i = sum exp(z - m_i) v / l_i,  LSE_i = m_i + log l_i
    LSE = logsumexp_i LSE_i,  o = sum_i exp(LSE_i - LSE) o_i

A rank that holds no allowed key for a query (an empty shard, a padding row) reports
``LSE_i = -inf`` and ``o_i = 0``: weight zero in the combine, never NaN.

Masks use **global** positions: key ``k`` is visible to query ``q`` iff ``pos(k) <= pos(q)``.
Padding follows one convention everywhere: padded keys carry position
:data:`PAD_KEY_POSITION` (visible to nobody), padded queries carry position
:data:`PAD_QUERY_POSITION` (see nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

#: Position given to padded keys: greater than every query position, so never visible.
PAD_KEY_POSITION = torch.iinfo(torch.int64).max
#: Position given to padded queries: smaller than every key position, so sees nothing.
PAD_QUERY_POSITION = -1


class PartialAttention(NamedTuple):
    """One rank's attention over the keys it holds.

    ``output``: ``[..., heads, value_dim]`` (``value_dim`` is ``head_dim``, except in
    multi-head latent attention, where it is the latent dim), normalised over this rank's
    keys (zero where the rank holds no visible key). ``lse``: ``[..., heads]``, log-sum-exp
    of the scaled scores over this rank's keys (``-inf`` where it holds none).
    """

    output: torch.Tensor
    lse: torch.Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, partial outputs and LSEs are computed in: float32 for 16-bit inputs."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def partial_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None = None,
) -> PartialAttention:
    """Attention of a padded batch of queries over one rank's keys, with output and LSE.

    Args:
        query: ``[batch, q_len, q_heads, head_dim]``.
        key: ``[batch, k_len, kv_heads, head_dim]``; ``q_heads`` must be a multiple of
            ``kv_heads`` (grouped-query attention: query head ``h`` reads kv head
            ``h // (q_heads // kv_heads)``).
        value: ``[batch, k_len, kv_heads, value_dim]``; ``value_dim`` may differ from
            ``head_dim`` (multi-head latent attention: the keys are the latent and its RoPE
            part, the values the latent alone).
        query_positions: ``[batch, q_len]`` global positions (int64), padding
            :data:`PAD_QUERY_POSITION`.
        key_positions: ``[batch, k_len]`` global positions (int64), padding
            :data:`PAD_KEY_POSITION`.
        scale: score scale, ``1 / sqrt(head_dim)`` by default.

    Returns:
        :class:`PartialAttention` with ``output`` ``[batch, q_len, q_heads, value_dim]`` and
        ``lse`` ``[batch, q_len, q_heads]``, both in :func:`accumulation_dtype` of the query.
    """
    batch, q_len, q_heads, head_dim = query.shape
    if (
        key.dim() != 4
        or value.dim() != 4
        or key.shape[:3] != value.shape[:3]
        or key.shape[0] != batch
        or key.shape[3] != head_dim
    ):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match "
            f"query {tuple(query.shape)}"
        )
    k_len, kv_heads, value_dim = key.shape[1], key.shape[2], value.shape[3]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    group = q_heads // kv_heads
    compute_dtype = accumulation_dtype(query.dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if k_len == 0:
        return PartialAttention(
            query.new_zeros((batch, q_len, q_heads, value_dim), dtype=compute_dtype),
            query.new_full((batch, q_len, q_heads), -math.inf, dtype=compute_dtype),
        )

    # [batch, kv_heads, group * q_len, head_dim]: queries of one kv head side by side.
    q = (
        query.to(compute_dtype)
        .view(batch, q_len, kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(batch, kv_heads, group * q_len, head_dim)
    )
    k = key.to(compute_dtype).transpose(1, 2)  # [batch, kv_heads, k_len, head_dim]
    v = value.to(compute_dtype).transpose(1, 2)

    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores = scores.view(batch, kv_heads, group, q_len, k_len)
    visible = key_positions[:, None, :] <= query_positions[:, :, None]  # [batch, q_len, k_len]
    scores.masked_fill_(~visible[:, None, None], -math.inf)

    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 for masked keys
    denom = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights.view(batch, kv_heads, group * q_len, k_len), v)
    out = out.view(batch, kv_heads, group, q_len, value_dim)
    out = out / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (row_max + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows

    output = out.permute(0, 3, 1, 2, 4).reshape(batch, q_len, q_heads, value_dim)
    return PartialAttention(output, lse.permute(0, 3, 1, 2).reshape(batch, q_len, q_heads))


def combine_partials(outputs: torch.Tensor, lses: torch.Tensor) -> PartialAttention:
    """Exact combine of stacked partials along dim 0 (one entry per rank, any order).

    Args:
        outputs: ``[ranks, ..., value_dim]`` partial outputs.
        lses: ``[ranks, ...]`` their log-sum-exps (``-inf`` for empty shards).

    Returns:
        The combined output ``[..., value_dim]`` and LSE ``[...]``; rows that no rank could
        see give output 0 and LSE ``-inf``.
    """
    lse = torch.logsumexp(lses, dim=0)
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(lses - finite_lse)  # exp(-inf) = 0 for empty shards
    output = (weights.unsqueeze(-1) * outputs).sum(dim=0)
    return PartialAttention(output, lse)


def combine_partial_list(partials: Sequence[PartialAttention]) -> PartialAttention:
    """:func:`combine_partials` over a sequence of same-shaped partials."""
    if not partials:
        raise ValueError("combine_partial_list needs at least one partial")
    return combine_partials(
        torch.stack([p.output for p in partials]), torch.stack([p.lse for p in partials])
    )


def all_gather_combine(
    partial: PartialAttention, group: dist.ProcessGroup | None = None
) -> PartialAttention:
    """Combine this rank's partial with its CP peers' over ``group`` (one collective).

    Every rank passes partials for the **same** queries (activations are replicated across
    the CP group; only the KV is sharded). Output and LSE are packed into one tensor and
    exchanged with a single all-gather (``dist.all_gather`` on gloo, its flat-buffer form
    ``all_gather_into_tensor`` on NCCL).
    The gathered list is in rank order on every rank, so every rank computes bit-identical
    combined outputs. Without an initialised process group, or in a group of one, this is
    the local combine, which returns ``partial`` itself (one partial combines to itself).
    """
    if not dist.is_available() or not dist.is_initialized():
        world = 1
    else:
        world = dist.get_world_size(group)
    if world == 1:
        # the combine of one partial is the partial (weight exp(0) = 1; an empty row's
        # output is already 0): no kernels
        return partial
    packed = torch.cat([partial.output, partial.lse.unsqueeze(-1)], dim=-1).contiguous()
    if dist.get_backend(group) == dist.Backend.NCCL:
        # one flat receive buffer, no per-rank copies: ranks stacked along dim 0
        stacked = packed.new_empty((world * packed.shape[0], *packed.shape[1:]))
        dist.all_gather_into_tensor(stacked, packed, group=group)
        stacked = stacked.view(world, *packed.shape)
    else:
        gathered = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(gathered, packed, group=group)
        stacked = torch.stack(gathered)
    return combine_partials(stacked[..., :-1], stacked[..., -1])


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain softmax attention with the same shapes and mask rules (for tests).

    As in :func:`partial_attention`, ``value`` may have its own last dim ``value_dim``: the
    output is ``[batch, q_len, q_heads, value_dim]``. Rows that see no key give zeros.
    """
    group = query.shape[2] // key.shape[2]
    compute_dtype = accumulation_dtype(query.dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    k = key.to(compute_dtype).repeat_interleave(group, dim=2)
    v = value.to(compute_dtype).repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", query.to(compute_dtype), k) * scale
    visible = key_positions[:, None, :] <= query_positions[:, :, None]
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)
