"""The device n-gram drafter (:mod:`helix_kv.executor.ngram_device`) against the host one:
the same proposals, token for token, on CPU tensors (and on CUDA where there is one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helix_kv.executor.drafter import NgramDrafter
from helix_kv.executor.ngram_device import DeviceNgramDrafter

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random_case(seed: int) -> tuple[NgramDrafter, list[list[int]], np.ndarray]:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 7))
    min_n = int(rng.integers(1, 4))
    max_n = int(rng.integers(min_n, 5))
    max_search = None if rng.random() < 0.5 else int(rng.integers(2, 40))
    drafter = NgramDrafter(k, max_n, min_n, max_search)
    vocab = int(rng.integers(2, 8))
    histories = [
        rng.integers(0, vocab, size=int(rng.integers(0, 70))).tolist()
        for _ in range(int(rng.integers(1, 24)))
    ]
    skips = rng.integers(0, 2, size=len(histories))
    return drafter, histories, skips


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(60))
def test_device_drafts_equal_the_host_drafters(device: str, seed: int) -> None:
    drafter, histories, skips = _random_case(seed)
    host_counts, host_tokens = drafter.propose(histories, skips)
    counts, tokens = DeviceNgramDrafter(drafter, torch.device(device)).propose(histories, skips)
    assert counts.dtype == np.int64
    assert tokens.dtype == np.int32
    assert counts.tolist() == host_counts.tolist()
    assert tokens.tolist() == host_tokens.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_device_drafts_of_cycles_and_edge_histories(device: str) -> None:
    drafter = NgramDrafter(3, 3, 1)
    histories = [[1, 2, 3, 4, 1, 2], [5, 6, 7], [], [4], [7, 7], [1, 2, 3, 4, 5, 1, 2]]
    device_drafter = DeviceNgramDrafter(drafter, torch.device(device))
    counts, tokens = device_drafter.propose(histories, [0, 0, 0, 0, 0, 1])
    assert counts.tolist() == [3, 0, 0, 0, 3, 3]
    assert tokens.tolist() == [3, 4, 1, 7, 7, 7, 4, 5, 1]
    empty_counts, empty_tokens = device_drafter.propose([])
    assert empty_counts.size == 0
    assert empty_tokens.size == 0
