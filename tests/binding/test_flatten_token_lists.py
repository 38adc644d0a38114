"""``helix_kv._core.flatten_token_lists``: an engine's token lists (one list of ints per
request) as arrays in one call, every token checked like any token argument."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helix_kv import InvalidArgumentError, InvalidTypeError
from helix_kv._core import flatten_token_lists

TOKENS = st.integers(-(2**31), 2**31 - 1)


@given(st.lists(st.lists(TOKENS, max_size=6), max_size=20), st.booleans())
def test_the_tokens_one_list_after_another_and_each_length(
    lists: list[list[int]], tuples: bool
) -> None:
    given_lists = tuple(tuple(row) for row in lists) if tuples else lists
    tokens, counts = flatten_token_lists(given_lists)
    assert (tokens.dtype, counts.dtype) == (np.int32, np.int64)
    assert tokens.tolist() == [t for row in lists for t in row]
    assert counts.tolist() == [len(row) for row in lists]


def test_numpy_integer_scalars_are_tokens() -> None:
    tokens, counts = flatten_token_lists([[np.int64(5), np.uint8(7)], []])
    assert (tokens.tolist(), counts.tolist()) == ([5, 7], [2, 0])


def test_a_form_met_midway_is_read_whole_again() -> None:
    """Plain lists of ints are read by a fast path that gives up at anything else (a numpy
    scalar, a tuple row) after some rows: what it read must not be kept twice."""
    tokens, counts = flatten_token_lists([[1, 2], [3], [np.int64(4)], (5, 6), []])
    assert tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert counts.tolist() == [2, 1, 1, 2, 0]


@pytest.mark.parametrize("token", [2**31, -(2**31) - 1, 2**70])
def test_a_token_beyond_int32_is_refused_naming_its_place(token: int) -> None:
    with pytest.raises(InvalidArgumentError, match=r"lists\[1\]\[0\] must fit int32"):
        flatten_token_lists([[1], [token]])


@pytest.mark.parametrize(
    "lists",
    [
        [[True]],
        [[1.0]],
        [["1"]],
        [[None]],
        [1, 2],
        "ab",
        [{1, 2}],
        np.zeros((2, 2), np.int32),
    ],
)
def test_anything_but_lists_of_integers_is_a_type_error(lists: object) -> None:
    with pytest.raises(InvalidTypeError):
        flatten_token_lists(lists)  # type: ignore[arg-type]
