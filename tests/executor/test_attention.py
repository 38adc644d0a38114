"""Partial attention over shards + exact combine == full attention (float64)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helix_kv.distributed.launch import spawn_group
from helix_kv.executor.attention import (
    PAD_KEY_POSITION,
    PAD_QUERY_POSITION,
    PartialAttention,
    all_gather_combine,
    combine_partial_list,
    partial_attention,
    reference_attention,
)
from tests.helpers import examples

TOL = 1e-12


def make_problem(
    seed: int,
    batch: int,
    q_len: int,
    k_lens: Sequence[int],
    kv_heads: int,
    group: int,
    head_dim: int,
) -> dict:
    """Random float64 queries/keys with global positions; keys padded per request."""
    gen = torch.Generator().manual_seed(seed)
    k_len = max(k_lens, default=0)
    query = torch.randn(
        batch, q_len, kv_heads * group, head_dim, generator=gen, dtype=torch.float64
    )
    key = torch.randn(batch, k_len, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    value = torch.randn(batch, k_len, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    key_pos = torch.full((batch, k_len), PAD_KEY_POSITION, dtype=torch.int64)
    query_pos = torch.empty(batch, q_len, dtype=torch.int64)
    for b, n in enumerate(k_lens):
        # keys at scattered global positions, queries anywhere around them (some padded)
        key_pos[b, :n] = torch.randperm(3 * n + 1, generator=gen)[:n]
        query_pos[b] = torch.randint(-1, 3 * n + 2, (q_len,), generator=gen)
    return {
        "query": query,
        "key": key,
        "value": value,
        "query_positions": query_pos,
        "key_positions": key_pos,
    }


def shard(problem: dict, owner: torch.Tensor, rank: int) -> dict:
    """The keys that ``owner`` assigns to ``rank``, re-padded per request."""
    mine = (owner == rank) & (problem["key_positions"] != PAD_KEY_POSITION)
    counts = mine.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    batch, _, heads, dim = problem["key"].shape
    key = torch.zeros(batch, width, heads, dim, dtype=torch.float64)
    value = torch.zeros_like(key)
    pos = torch.full((batch, width), PAD_KEY_POSITION, dtype=torch.int64)
    for b in range(batch):
        idx = mine[b].nonzero().flatten()
        key[b, : idx.numel()] = problem["key"][b, idx]
        value[b, : idx.numel()] = problem["value"][b, idx]
        pos[b, : idx.numel()] = problem["key_positions"][b, idx]
    return {
        "query": problem["query"],
        "key": key,
        "value": value,
        "query_positions": problem["query_positions"],
        "key_positions": pos,
    }


def expected(problem: dict) -> tuple[torch.Tensor, torch.Tensor]:
    out = reference_attention(**problem)
    q, k = problem["query"], problem["key"]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bqhk", q, k) / math.sqrt(q.shape[-1])
    visible = problem["key_positions"][:, None, :] <= problem["query_positions"][:, :, None]
    lse = torch.logsumexp(scores.masked_fill(~visible[:, :, None], -math.inf), dim=-1)
    return out, lse


def combine_in_order(
    problem: dict, owner: torch.Tensor, ranks: int, order: Sequence[int]
) -> PartialAttention:
    partials: list[PartialAttention] = [
        partial_attention(**shard(problem, owner, r)) for r in range(ranks)
    ]
    return combine_partial_list([partials[r] for r in order])


def assert_matches(got: PartialAttention, problem: dict) -> None:
    out, lse = expected(problem)
    assert not torch.isnan(got.output).any()
    assert not torch.isnan(got.lse).any()
    torch.testing.assert_close(got.output, out, atol=TOL, rtol=TOL)
    assert torch.equal(torch.isinf(got.lse), torch.isinf(lse))
    finite = torch.isfinite(lse)
    torch.testing.assert_close(got.lse[finite], lse[finite], atol=TOL, rtol=TOL)


@settings(max_examples=examples(60), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    q_len=st.integers(1, 4),
    k_lens=st.lists(st.integers(0, 12), min_size=3, max_size=3),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4, 8]),
    ranks=st.integers(1, 5),
    data=st.data(),
)
def test_partial_plus_combine_equals_full_attention(
    seed, batch, q_len, k_lens, kv_heads, group, head_dim, ranks, data
):
    problem = make_problem(seed, batch, q_len, k_lens[:batch], kv_heads, group, head_dim)
    k_len = problem["key"].shape[1]
    owner = torch.tensor(
        data.draw(
            st.lists(st.integers(0, ranks - 1), min_size=batch * k_len, max_size=batch * k_len)
        ),
        dtype=torch.int64,
    ).view(batch, k_len)
    order = data.draw(st.permutations(range(ranks)))
    assert_matches(combine_in_order(problem, owner, ranks, order), problem)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_uneven_and_empty_shards_in_every_rank_order(order):
    # 9 keys: rank 0 holds 6, rank 1 holds 0, rank 2 holds 1, rank 3 holds 2
    problem = make_problem(7, batch=2, q_len=3, k_lens=[9, 4], kv_heads=2, group=2, head_dim=8)
    owner = torch.tensor([[0, 0, 0, 2, 0, 3, 0, 3, 0], [3, 3, 0, 0, 0, 0, 0, 0, 0]])
    assert_matches(combine_in_order(problem, owner, 4, order), problem)


def test_helix_page_placement_matches_full_attention():
    """Keys dealt to ranks by the Helix rule (pages of tpb round-robin), causal queries."""
    tpb, cp, n = 4, 3, 23
    problem = make_problem(3, batch=1, q_len=n, k_lens=[n], kv_heads=1, group=4, head_dim=8)
    problem["key_positions"] = torch.arange(n)[None]
    problem["query_positions"] = torch.arange(n)[None]
    owner = (problem["key_positions"] // tpb) % cp
    assert_matches(combine_in_order(problem, owner, cp, range(cp)), problem)


def test_empty_everything_gives_zero_and_minus_inf():
    problem = make_problem(1, batch=2, q_len=2, k_lens=[0, 0], kv_heads=1, group=2, head_dim=4)
    part = partial_attention(**problem)
    assert part.output.shape == (2, 2, 2, 4)
    assert torch.equal(part.output, torch.zeros_like(part.output))
    assert torch.isneginf(part.lse).all()
    combined = combine_partial_list([part, part])
    assert torch.equal(combined.output, torch.zeros_like(part.output))
    assert torch.isneginf(combined.lse).all()


def test_padded_query_rows_see_nothing():
    problem = make_problem(2, batch=1, q_len=3, k_lens=[5], kv_heads=1, group=1, head_dim=4)
    problem["query_positions"] = torch.tensor([[PAD_QUERY_POSITION, 10, PAD_QUERY_POSITION]])
    part = partial_attention(**problem)
    assert torch.isneginf(part.lse[0, [0, 2]]).all()
    assert torch.equal(part.output[0, [0, 2]], torch.zeros_like(part.output[0, [0, 2]]))
    assert torch.isfinite(part.lse[0, 1]).all()


def test_bfloat16_inputs_accumulate_in_float32():
    problem = make_problem(4, batch=2, q_len=2, k_lens=[6, 3], kv_heads=2, group=2, head_dim=8)
    low = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in problem.items()}
    part = partial_attention(**low)
    assert part.output.dtype == torch.float32
    assert part.lse.dtype == torch.float32
    out, _ = expected(problem)
    torch.testing.assert_close(part.output.double(), out, atol=3e-2, rtol=3e-2)


def _gloo_combine_worker(rank: int, world_size: int) -> float:
    problem = make_problem(11, batch=2, q_len=3, k_lens=[10, 5], kv_heads=2, group=2, head_dim=4)
    # uneven: rank 0 gets most keys, the last rank none at all
    owner = torch.tensor([[0, 0, 1, 0, 0, 1, 0, 0, 0, 1], [1, 0, 0, 0, 1, 0, 0, 0, 0, 0]])
    combined = all_gather_combine(partial_attention(**shard(problem, owner, rank)))
    out, lse = expected(problem)
    assert not torch.isnan(combined.output).any()
    lse_error = (combined.lse - lse).nan_to_num(0.0).abs().max()  # -inf - -inf rows: 0
    return max(float((combined.output - out).abs().max()), float(lse_error))


def test_all_gather_combine_over_gloo_matches_full_attention():
    errors = spawn_group(_gloo_combine_worker, world_size=3, timeout_s=60)
    assert max(errors) < TOL, errors
    assert np.all(np.isfinite(errors))
