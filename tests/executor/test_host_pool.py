"""The per-rank host KV tier: a step's suspended pages go to their host pages and resumed pages
come back from them into their new pages, keys and values of every layer, in the step's order
(copy-out before copy-in, so a resume may reuse a page a suspend of the same step freed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helix_kv.executor import HostKVPool, KVPool, RankPlacement

TPB = 4


def step(suspended=(), host_out=(), resumed=(), host_in=()) -> SimpleNamespace:
    """The four copy fields of a ``ScheduleOutput``."""

    def ids(values):
        return np.asarray(values, dtype=np.int32)

    return SimpleNamespace(
        suspended_block_ids=ids(suspended),
        suspended_host_block_ids=ids(host_out),
        resumed_block_ids=ids(resumed),
        resumed_host_block_ids=ids(host_in),
    )


def pools(device: str) -> tuple[KVPool, HostKVPool]:
    pool = KVPool(2, 3, 5, RankPlacement(2, TPB, 1), 8, torch.float64, device)
    generator = torch.Generator().manual_seed(3)
    pool.key_cache.copy_(torch.randn(pool.key_cache.shape, generator=generator))
    pool.value_cache.copy_(torch.randn(pool.value_cache.shape, generator=generator))
    return pool, HostKVPool(pool, 6)


def page(cache: torch.Tensor, p: int) -> torch.Tensor:
    return cache[:, p * TPB : (p + 1) * TPB].cpu().clone()


def check_round_trip(device: str) -> None:
    pool, host = pools(device)
    before = {p: (page(pool.key_cache, p), page(pool.value_cache, p)) for p in (1, 2, 5)}
    # step 1: pages 1, 2, 5 of two requests go to host pages 0, 1 and 4 (two runs)
    host.copy_step(step(suspended=[1, 2, 5], host_out=[0, 1, 4]))
    # step 2: another request is written into those pages (the pool reused them)
    for cache in (pool.key_cache, pool.value_cache):
        for p in (1, 2, 5):
            cache[:, p * TPB : (p + 1) * TPB] = -1.0
    # step 3: page 7 is suspended to host page 2 while the first request resumes from host
    # pages 0 and 1 into pages 7 and 3: page 7 is read out before it is overwritten
    page7 = (page(pool.key_cache, 7), page(pool.value_cache, 7))
    host.copy_step(step(suspended=[7], host_out=[2], resumed=[7, 3], host_in=[0, 1]))
    if device == "cuda":
        torch.cuda.synchronize()
    for new, old in ((7, 1), (3, 2)):
        assert torch.equal(page(pool.key_cache, new), before[old][0])
        assert torch.equal(page(pool.value_cache, new), before[old][1])
    assert torch.equal(host.pages[2, 0], page7[0])
    assert torch.equal(host.pages[2, 1], page7[1])
    assert torch.equal(host.pages[4, 0], before[5][0])
    assert (host.pages_out, host.pages_in) == (4, 2)
    assert host.bytes_out == 4 * host.page_bytes == 4 * 2 * 2 * TPB * 3 * 5 * 8


def test_pages_go_out_and_come_back_on_cpu() -> None:
    check_round_trip("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pages_go_out_and_come_back_on_a_side_stream() -> None:
    check_round_trip("cuda")
    _, host = pools("cuda")
    assert host.pages.is_pinned()


def test_a_step_without_copies_changes_nothing() -> None:
    pool, host = pools("cpu")
    keys = pool.key_cache.clone()
    host.copy_step(step())
    assert torch.equal(pool.key_cache, keys)
    assert (host.pages_out, host.pages_in) == (0, 0)
    with pytest.raises(ValueError, match="at least one page"):
        HostKVPool(pool, 0)
