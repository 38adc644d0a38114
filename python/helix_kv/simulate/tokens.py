"""Deterministic token ids for the simulator.

No model runs here: prompts and "sampled" tokens are pure functions of the request id and
the token's index, so every rank (and every process of ``--procs``) feeds the schedulers
exactly the same tokens, and a preempted request's output can be checked against what it
would have been without the preemption.
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


def sampled_tokens(request_ids: np.ndarray, output_indices: np.ndarray) -> np.ndarray:
    """The token each request samples as its ``output_indices``-th output (0-based), int32."""
    ids = np.asarray(request_ids, dtype=np.uint64) % np.uint64(VOCAB_SIZE)
    indices = np.asarray(output_indices, dtype=np.uint64)
    mixed = ids * np.uint64(_ID_MULTIPLIER) + (indices + np.uint64(1)) * np.uint64(
        _INDEX_MULTIPLIER
    )
    return (mixed % np.uint64(VOCAB_SIZE)).astype(np.int32)


def expected_output(request_id: int, output_len: int) -> np.ndarray:
    """Everything ``request_id`` generates when it runs ``output_len`` tokens."""
    return sampled_tokens(
        np.full(output_len, request_id, dtype=np.uint64), np.arange(output_len, dtype=np.uint64)
    )
