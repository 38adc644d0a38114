"""Deterministic token ids for the simulator.

No model runs here: prompts and "sampled" tokens are pure functions of the request id and
the token's index, so every rank (and every process of ``--procs``) feeds the schedulers
exactly the same tokens, and a preempted request's output can be checked against what it
would have been without the preemption. Content that requests share (a shared system prompt,
a conversation's turns, a trace's hash blocks) is a pure function of its source in the same
way (the functions at the end).
"""

from __future__ import annotations

import numpy as np

#: Size of the pretend vocabulary; token ids are in ``[0, VOCAB_SIZE)``.
VOCAB_SIZE = 32_000

_ID_MULTIPLIER = 1_000_003
_INDEX_MULTIPLIER = 7_919
_PROMPT_OFFSET = 104_729


def prompt_tokens(request_id: int, prompt_len: int) -> np.ndarray:
    """The prompt of ``request_id``: ``prompt_len`` int32 token ids."""
    base = (request_id % VOCAB_SIZE) * _ID_MULTIPLIER + _PROMPT_OFFSET
    indices = np.arange(prompt_len, dtype=np.int64)
    return ((base + indices * _INDEX_MULTIPLIER) % VOCAB_SIZE).astype(np.int32)


# as uint64 scalars once: sampled_tokens runs every step
_VOCAB_U64 = np.uint64(VOCAB_SIZE)
_ID_MULTIPLIER_U64 = np.uint64(_ID_MULTIPLIER)
_INDEX_MULTIPLIER_U64 = np.uint64(_INDEX_MULTIPLIER)
_ONE_U64 = np.uint64(1)


def sampled_tokens(request_ids: np.ndarray, output_indices: np.ndarray) -> np.ndarray:
    """The token each request samples as its ``output_indices``-th output (0-based), int32."""
    ids = np.asarray(request_ids, dtype=np.uint64) % _VOCAB_U64
    indices = np.asarray(output_indices, dtype=np.uint64)
    mixed = ids * _ID_MULTIPLIER_U64 + (indices + _ONE_U64) * _INDEX_MULTIPLIER_U64
    return (mixed % _VOCAB_U64).astype(np.int32)


def expected_output(request_id: int, output_len: int) -> np.ndarray:
    """Everything ``request_id`` generates when it runs ``output_len`` tokens."""
    return sampled_tokens(
        np.full(output_len, request_id, dtype=np.uint64), np.arange(output_len, dtype=np.uint64)
    )


# --- prompt content that requests share -----------------------------------------------------
#
# Shared system prompts, the new user tokens of a conversation's turn, and the blocks a trace's
# ``hash_ids`` name are pseudo-random token ids from a counter-based mix (splitmix64's
# finalizer) of a domain, a source (the prefix id, the request id, the hash id) and the
# token's index: the same source always gives the same tokens, on every rank and in every
# process, and two sources share a run of k tokens with probability 1 / VOCAB_SIZE**k (nil
# for a superblock of any size worth simulating). Unlike :func:`prompt_tokens`, whose
# sequences repeat for ids VOCAB_SIZE apart, no two request ids share their user tokens.

_U64 = np.uint64
_DOMAIN_SHARED = 0x5348415245445F50  # "SHARED_P"
_DOMAIN_USER = 0x555345525F544F4B  # "USER_TOK"
_DOMAIN_HASH_BLOCK = 0x484153485F424C4B  # "HASH_BLK"


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic); ``values`` is left
    as it was."""
    z = values + _U64(0x9E3779B97F4A7C15)
    # in place from here on: a prompt's worth of uint64 is mixed per request
    z ^= z >> _U64(30)
    z *= _U64(0xBF58476D1CE4E5B9)
    z ^= z >> _U64(27)
    z *= _U64(0x94D049BB133111EB)
    z ^= z >> _U64(31)
    return z


def _seeds(domain: int, sources: np.ndarray) -> np.ndarray:
    """The seed of each source in ``domain`` (uint64)."""
    return _mix(np.asarray(sources, dtype=np.uint64) ^ _U64(domain))


def _tokens_of_seeds(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Token ``indices[k]`` of the source seeded ``seeds[k]`` (or of one seed, a scalar), as
    int32."""
    mixed = _mix(seeds + np.asarray(indices, dtype=np.uint64))
    mixed %= _U64(VOCAB_SIZE)
    return mixed.astype(np.int32)


def _source_tokens(domain: int, source: int, length: int) -> np.ndarray:
    """Tokens ``0 .. length - 1`` of one source in ``domain``, its seed mixed once."""
    (seed,) = _seeds(domain, np.array([source], dtype=np.uint64))
    return _tokens_of_seeds(seed, np.arange(length, dtype=np.uint64))


def shared_prefix_tokens(prefix_id: int, length: int) -> np.ndarray:
    """The shared system prompt ``prefix_id``: ``length`` int32 token ids."""
    return _source_tokens(_DOMAIN_SHARED, prefix_id, length)


def user_tokens(request_id: int, length: int) -> np.ndarray:
    """The new user tokens of ``request_id`` (a turn of a conversation, or what follows a
    shared system prompt): ``length`` int32 token ids, its own."""
    return _source_tokens(_DOMAIN_USER, request_id, length)


def hash_block_tokens(hash_ids: np.ndarray, block_tokens: int, length: int) -> np.ndarray:
    """A trace's ``hash_ids`` as a prompt of ``length`` tokens: block ``i`` is the
    ``block_tokens`` tokens of hash id ``hash_ids[i]`` (the same wherever the id appears), the
    last block cut so the prompt has ``length`` tokens."""
    seeds = _seeds(_DOMAIN_HASH_BLOCK, np.asarray(hash_ids, dtype=np.uint64))
    per_token = np.repeat(seeds, block_tokens)[:length]
    indices = np.tile(np.arange(block_tokens, dtype=np.uint64), len(seeds))[:length]
    return _tokens_of_seeds(per_token, indices)
