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

from helix_kv._core import affine_tokens, mixed_tokens, splitmix64

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


def sampled_tokens(request_ids: np.ndarray, output_indices: np.ndarray) -> np.ndarray:
    """The token each request samples as its ``output_indices``-th output (0-based), int32:
    ``((id % VOCAB_SIZE) * _ID_MULTIPLIER + (index + 1) * _INDEX_MULTIPLIER) % VOCAB_SIZE``
    (uint64, wrapping), in one pass (it runs every step)."""
    return affine_tokens(request_ids, output_indices, VOCAB_SIZE, _ID_MULTIPLIER, _INDEX_MULTIPLIER)


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
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic), as a new array
    (``values`` is left as it was)."""
    return splitmix64(values)


def _seeds(domain: int, sources: np.ndarray) -> np.ndarray:
    """The seed of each source in ``domain`` (uint64)."""
    return _mix(np.asarray(sources, dtype=np.uint64) ^ _U64(domain))


def _source_tokens(domain: int, source: int, length: int) -> np.ndarray:
    """Tokens ``0 .. length - 1`` of one source in ``domain`` (token ``i`` is
    ``_mix(seed + i) % VOCAB_SIZE``, int32), its seed mixed once."""
    return mixed_tokens(
        _seeds(domain, np.array([source], dtype=np.uint64)), max(length, 1), length, VOCAB_SIZE
    )


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
    return mixed_tokens(seeds, block_tokens, length, VOCAB_SIZE)
