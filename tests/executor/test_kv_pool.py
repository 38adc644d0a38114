"""Placement formulas, step plans and device key indices agree with the Rust layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import helix_kv
from helix_kv.executor import PAD_KEY_POSITION, KVPool, RankPlacement, StepPlan


@pytest.mark.parametrize(("cp", "tpb"), [(1, 1), (1, 4), (2, 3), (3, 4), (4, 2)])
def test_placement_matches_rust_layout(cp, tpb):
    layout = helix_kv.Layout(cp, tpb)
    lengths = np.arange(0, 5 * cp * tpb + 3, dtype=np.int64)
    for rank in range(cp):
        placement = RankPlacement(cp, tpb, rank)
        np.testing.assert_array_equal(
            placement.local_lens(lengths), layout.local_lens(lengths, rank)
        )
        np.testing.assert_array_equal(
            placement.global_positions(lengths), layout.global_positions(rank, lengths)
        )
        np.testing.assert_array_equal(placement.owner_ranks(lengths), layout.owner_ranks(lengths))
    assert sum(RankPlacement(cp, tpb, r).local_lens([41])[0] for r in range(cp)) == 41


@pytest.mark.parametrize(("cp", "tpb", "rank"), [(1, 4, 0), (2, 3, 1), (4, 2, 3), (3, 4, 0)])
def test_plan_slots_and_device_keys(cp, tpb, rank):
    placement = RankPlacement(cp, tpb, rank)
    table = np.array([[5, 1, 7, -1], [2, 0, 3, 6]])
    starts, lengths = [3, 0], [9, 2 * cp * tpb + 5]
    tokens = [np.arange(n) for n in lengths]
    plan = StepPlan.from_arrays(placement, [10, 11], starts, tokens, table)

    # every new token: owner rank writes page * tpb + offset, the others -1
    positions = plan.positions()
    rows = np.repeat([0, 1], lengths)
    for pos, row, slot in zip(positions, rows, plan.slot_mapping):
        owner = (pos // tpb) % cp
        want = table[row, pos // (cp * tpb)] * tpb + pos % tpb if owner == rank else -1
        assert slot == want

    pool = KVPool(1, 1, 1, placement, capacity_superblocks=8, dtype=torch.float64)
    pool.key_cache[0, :, 0, 0] = torch.arange(pool.num_slots, dtype=torch.float64)  # key = slot
    batch = pool.prepare(plan)
    (group,) = batch.groups  # no decode entries: one context group
    want_local = placement.local_lens(np.add(starts, lengths))
    np.testing.assert_array_equal(batch.local_lens.numpy(), want_local)
    keys, _ = pool.gather(0, group)
    for row in range(2):
        n = want_local[row]
        j = np.arange(n)
        slots = table[row, j // tpb] * tpb + j % tpb
        np.testing.assert_array_equal(keys[row, :n, 0, 0].numpy(), slots)
        np.testing.assert_array_equal(
            group.key_positions[row, :n].numpy(), placement.global_positions(j)
        )
        assert (group.key_positions[row, n:] == PAD_KEY_POSITION).all()
    # the owned tokens are exactly those written
    np.testing.assert_array_equal(
        batch.write_slots.numpy(), plan.slot_mapping[plan.slot_mapping >= 0]
    )


def test_write_only_touches_owned_slots():
    placement = RankPlacement(2, 2, 1)
    plan = StepPlan.from_arrays(placement, [1], [0], [np.arange(8)], np.array([[3, 0]]))
    pool = KVPool(1, 1, 1, placement, capacity_superblocks=4, dtype=torch.float64)
    batch = pool.prepare(plan)
    key = torch.arange(1.0, 9.0, dtype=torch.float64).view(8, 1, 1)
    pool.write(0, batch, key, -key)
    # rank 1 owns positions 2,3 (page 3) and 6,7 (page 0)
    cache = pool.key_cache[0, :, 0, 0]
    assert cache[[6, 7, 0, 1]].tolist() == [3.0, 4.0, 7.0, 8.0]
    assert int((cache != 0).sum()) == 4


def test_superblocks_for_bytes():
    per_page = 2 * 3 * 16 * 2 * 8 * 4  # k+v, layers, tpb, heads, dim, float32
    assert KVPool.superblocks_for_bytes(10 * per_page + 5, 3, 2, 8, 16, torch.float32) == 10


def test_placement_rejects_bad_rank():
    with pytest.raises(ValueError, match="outside"):
        RankPlacement(2, 4, 2)
