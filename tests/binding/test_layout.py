"""Helix layout through the binding: closed forms against brute-force placement."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import helix_kv


def brute_force_owner(pos: int, cp: int, tpb: int) -> int:
    return (pos // tpb) % cp


@given(cp=st.integers(1, 8), tpb=st.integers(1, 64), n=st.integers(0, 3000))
def test_local_lens_sum_to_global_length_and_match_brute_force(cp: int, tpb: int, n: int) -> None:
    layout = helix_kv.Layout(cp, tpb)
    owners = [brute_force_owner(p, cp, tpb) for p in range(n)]
    per_rank = [layout.local_len(n, r) for r in range(cp)]
    assert per_rank == [owners.count(r) for r in range(cp)]
    assert sum(per_rank) == n
    assert layout.superblocks_for(n) == -(-n // (cp * tpb))


@given(cp=st.integers(1, 8), tpb=st.integers(1, 32), n=st.integers(1, 2000))
def test_exactly_one_rank_owns_each_decode_position(cp: int, tpb: int, n: int) -> None:
    layout = helix_kv.Layout(cp, tpb)
    pos = n - 1
    # The owner is the only rank whose local length grows when the token at `pos` is appended.
    growing = [r for r in range(cp) if layout.local_len(n, r) == layout.local_len(pos, r) + 1]
    assert growing == [layout.owner_rank(pos)] == [(pos // tpb) % cp]


def test_batch_forms_match_scalar_forms_with_numpy_dtypes() -> None:
    layout = helix_kv.Layout(4, 16)
    positions = np.arange(0, 1000, 7, dtype=np.int64)
    owners = layout.owner_ranks(positions)
    assert owners.dtype == np.int32
    assert owners.shape == positions.shape
    assert owners.tolist() == [layout.owner_rank(int(p)) for p in positions]
    for rank in range(4):
        lens = layout.local_lens(positions, rank)
        assert lens.dtype == np.int64
        assert lens.tolist() == [layout.local_len(int(p), rank) for p in positions]
        idx = np.arange(50, dtype=np.int32)  # other integer dtypes are converted
        glob = layout.global_positions(rank, idx)
        assert glob.dtype == np.int64
        assert [layout.owner_rank(int(g)) for g in glob] == [rank] * 50
        assert [layout.local_index(int(g)) for g in glob] == idx.tolist()
    sbs = layout.superblocks_for_many([0, 1, 64, 65])
    assert sbs.dtype == np.int64
    assert sbs.tolist() == [0, 1, 1, 2]


def test_cp_one_is_the_plain_paged_layout() -> None:
    layout = helix_kv.Layout(1, 8)
    assert layout.owner_ranks(np.arange(100)).tolist() == [0] * 100
    assert layout.local_len(77, 0) == 77
    assert layout.superblocks_for(17) == 3


def test_bad_layouts_and_arguments_raise_typed_errors() -> None:
    with pytest.raises(helix_kv.ConfigError, match="cp_size must be at least 1"):
        helix_kv.Layout(0, 16)
    with pytest.raises(helix_kv.ConfigError, match="tokens_per_block"):
        helix_kv.Layout(2, 0)
    layout = helix_kv.Layout(2, 16)
    with pytest.raises(helix_kv.InvalidArgumentError, match="rank 2 is outside"):
        layout.local_len(10, 2)
    with pytest.raises(helix_kv.InvalidLengthError, match="non-negative"):
        layout.local_lens(np.array([3, -1]), 0)
    with pytest.raises(helix_kv.InvalidLengthError):
        layout.owner_rank(-5)
    assert issubclass(helix_kv.ConfigError, helix_kv.HelixKVError)


def test_layout_is_a_frozen_hashable_value() -> None:
    assert helix_kv.Layout(2, 16) == helix_kv.Layout(2, 16)
    assert len({helix_kv.Layout(2, 16), helix_kv.Layout(2, 16), helix_kv.Layout(4, 16)}) == 2
    with pytest.raises(AttributeError):
        helix_kv.Layout(2, 16).cp = 3  # type: ignore[misc]
    assert repr(helix_kv.Layout(2, 16)) == "Layout(cp_size=2, tokens_per_block=16)"


def test_cp_size_is_the_name_and_cp_a_deprecated_alias() -> None:
    """``cp_size`` / ``cp_rank`` everywhere in the public API; ``Layout(cp=...)`` and
    ``Layout.cp`` still work for one release, with a DeprecationWarning."""
    layout = helix_kv.Layout(cp_size=4, tokens_per_block=8)
    assert (layout.cp_size, layout.tokens_per_block) == (4, 8)
    assert layout.local_len(100, cp_rank=1) == layout.local_len(100, 1)
    with pytest.warns(DeprecationWarning, match="cp_size"):
        assert helix_kv.Layout(cp=4, tokens_per_block=8) == layout
    with pytest.warns(DeprecationWarning, match=r"Layout\.cp_size"):
        assert layout.cp == 4
    with pytest.raises(helix_kv.ConfigError, match="both cp_size and"):
        helix_kv.Layout(4, 8, cp=4)
    with pytest.raises(helix_kv.InvalidTypeError, match="needs tokens_per_block"):
        helix_kv.Layout(4)
    with pytest.raises(helix_kv.InvalidTypeError, match="needs cp_size"):
        helix_kv.Layout(tokens_per_block=8)
