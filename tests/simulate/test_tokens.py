"""The simulator's token kernels (``helix_kv._core.splitmix64``, ``mixed_tokens``,
``affine_tokens``) against the plain numpy definitions they replaced: the tokens a workload
feeds are the same as before, so runs (and their fingerprints) are too."""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv
from helix_kv._core import affine_tokens, mixed_tokens, splitmix64
from helix_kv.simulate import tokens as T

U = np.uint64


def _mix_numpy(values: np.ndarray) -> np.ndarray:
    z = np.asarray(values, dtype=U) + U(0x9E3779B97F4A7C15)
    z ^= z >> U(30)
    z *= U(0xBF58476D1CE4E5B9)
    z ^= z >> U(27)
    z *= U(0x94D049BB133111EB)
    z ^= z >> U(31)
    return z


def _tokens_numpy(seeds: np.ndarray, block: int, length: int) -> np.ndarray:
    per_token = np.repeat(np.asarray(seeds, dtype=U), block)[:length]
    indices = np.tile(np.arange(block, dtype=U), len(seeds))[:length]
    mixed = _mix_numpy(per_token + indices) % U(T.VOCAB_SIZE)
    return mixed.astype(np.int32)


def _sampled_numpy(ids: np.ndarray, indices: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, dtype=U) % U(T.VOCAB_SIZE)
    mixed = ids * U(1_000_003) + (np.asarray(indices, dtype=U) + U(1)) * U(7_919)
    return (mixed % U(T.VOCAB_SIZE)).astype(np.int32)


def test_splitmix64_is_the_finalizer_with_wrapping_arithmetic() -> None:
    rng = np.random.default_rng(1)
    values = np.concatenate(
        [np.array([0, 1, 2**63, 2**64 - 1], dtype=U), rng.integers(0, 2**64 - 1, 500, dtype=U)]
    )
    kept = values.copy()
    assert np.array_equal(splitmix64(values), _mix_numpy(values))
    assert np.array_equal(values, kept), "the input is left as it was"
    # The published first output of splitmix64 seeded 0 (the finalizer of the golden gamma).
    assert int(splitmix64(np.array([0], dtype=U))[0]) == 0xE220A8397B1DCDAF
    assert splitmix64(np.zeros(0, dtype=U)).dtype == U


@pytest.mark.parametrize("block", [1, 7, 512])
def test_mixed_tokens_are_each_blocks_seed_mixed_with_the_index(block: int) -> None:
    rng = np.random.default_rng(block)
    seeds = rng.integers(0, 2**64 - 1, 9, dtype=U)
    for length in (1, block, 8 * block + 1, 9 * block):
        got = mixed_tokens(seeds, block, length, T.VOCAB_SIZE)
        assert got.dtype == np.int32
        assert got.shape == (length,)
        assert np.array_equal(got, _tokens_numpy(seeds, block, length))


def test_workload_tokens_are_the_numpy_definitions() -> None:
    for source in (0, 1, 12345, 2**64 - 1):
        for length in (0, 1, 4500):
            (seed,) = _mix_numpy(np.array([source], dtype=U) ^ U(T._DOMAIN_USER))
            assert np.array_equal(
                T.user_tokens(source, length), _tokens_numpy(np.array([seed]), length, length)
            )
    ids = np.array([3, 2**40, 7], dtype=U)
    seeds = _mix_numpy(ids ^ U(T._DOMAIN_HASH_BLOCK))
    assert np.array_equal(T.hash_block_tokens(ids, 16, 40), _tokens_numpy(seeds, 16, 40))
    rng = np.random.default_rng(2)
    request_ids = rng.integers(0, 2**64 - 1, 300, dtype=U)
    indices = rng.integers(0, 2**64 - 1, 300, dtype=U)
    assert np.array_equal(
        T.sampled_tokens(request_ids, indices), _sampled_numpy(request_ids, indices)
    )
    assert np.array_equal(
        T.sampled_tokens(np.arange(5, dtype=np.int64), np.arange(5, dtype=U)),
        _sampled_numpy(np.arange(5), np.arange(5)),
    )
    assert np.array_equal(
        T.expected_output(77, 300), _sampled_numpy(np.full(300, 77), np.arange(300))
    )


def test_bad_arguments_are_typed_errors() -> None:
    seeds = np.array([1, 2], dtype=U)
    with pytest.raises(helix_kv.InvalidArgumentError, match="cannot make 21 tokens"):
        mixed_tokens(seeds, 10, 21, T.VOCAB_SIZE)
    with pytest.raises(helix_kv.InvalidArgumentError, match="block_tokens must be >= 1"):
        mixed_tokens(seeds, 0, 0, T.VOCAB_SIZE)
    for vocab in (0, 2**31 + 1):
        with pytest.raises(helix_kv.InvalidArgumentError, match="vocab must be in"):
            mixed_tokens(seeds, 1, 1, vocab)
        with pytest.raises(helix_kv.InvalidArgumentError, match="vocab must be in"):
            affine_tokens([1], [1], vocab, 3, 5)
    with pytest.raises(helix_kv.InvalidArgumentError, match="2 request ids but 1 output"):
        affine_tokens([1, 2], [1], T.VOCAB_SIZE, 3, 5)
    with pytest.raises(helix_kv.InvalidArgumentError):
        splitmix64(np.array([-1], dtype=np.int64))
    with pytest.raises(helix_kv.InvalidTypeError):
        splitmix64(np.array([1.5]))
    with pytest.raises(helix_kv.InvalidArgumentError, match="vocab"):
        mixed_tokens(seeds, 1, 1, -5)
    with pytest.raises(helix_kv.InvalidTypeError):
        mixed_tokens(seeds, 1, 1, 3.0)
    with pytest.raises(helix_kv.InvalidArgumentError, match="id_multiplier"):
        affine_tokens([1], [1], T.VOCAB_SIZE, -1, 5)
    with pytest.raises(helix_kv.InvalidLengthError, match="too large"):
        mixed_tokens(np.array([1], dtype=U), 2**62, 2**62, T.VOCAB_SIZE)
    with pytest.raises(helix_kv.InvalidLengthError):
        mixed_tokens(seeds, 1, -1, T.VOCAB_SIZE)
