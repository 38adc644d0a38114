"""Ledger hot paths from Python: batched grow + free, and block-table rows."""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv

BATCH = 1024


@pytest.mark.parametrize("superblocks_each", [1, 4, 16])
def test_bench_batched_grow_and_free(benchmark, report_figure, superblocks_each: int) -> None:
    """Target (issue 13): <= 15 ns per superblock at batch 1024 for grow_many + free_many
    (requests are registered with add_many in the untimed setup)."""
    cp, tpb = 4, 32
    ledger = helix_kv.Ledger(helix_kv.Layout(cp, tpb), BATCH * superblocks_each)
    ids = np.arange(BATCH, dtype=np.int64)
    prompts = np.ones(BATCH, dtype=np.int64)  # a prompt holds at least one token
    lens = np.full(BATCH, superblocks_each * cp * tpb, dtype=np.int64)

    def register() -> tuple:
        ledger.add_many(ids, prompts)
        return (), {}

    def grow_and_free() -> None:
        ledger.grow_many(ids, lens)
        ledger.free_many(ids)

    benchmark.pedantic(grow_and_free, setup=register, rounds=500, warmup_rounds=10)
    assert ledger.free_superblocks == ledger.capacity
    report_figure(
        benchmark,
        f"grow_many+free_many batch {BATCH} x {superblocks_each} superblocks",
        BATCH * superblocks_each,
        "superblock",
        "<= 15 ns",
    )


def test_bench_add_many(benchmark, report_figure) -> None:
    """Registration cost, reported beside the target (not part of it)."""
    ledger = helix_kv.Ledger(helix_kv.Layout(4, 32), BATCH)
    ids = np.arange(BATCH, dtype=np.int64)
    prompts = np.ones(BATCH, dtype=np.int64)

    def clear() -> tuple:
        ledger.free_many(ids[: len(ledger)])
        return (), {}

    benchmark.pedantic(lambda: ledger.add_many(ids, prompts), setup=clear, rounds=500)
    report_figure(benchmark, f"add_many batch {BATCH}", BATCH, "request", "n/a")


def test_bench_block_table_1024_by_64(benchmark, report_figure) -> None:
    """Target: <= 50 us for 1024 requests x 64 superblocks."""
    cp, tpb, width = 2, 16, 64
    ledger = helix_kv.Ledger(helix_kv.Layout(cp, tpb), BATCH * width)
    ids = np.arange(BATCH, dtype=np.int64)
    ledger.add_many(ids, np.ones(BATCH, dtype=np.int64))
    assert ledger.grow_many(ids, np.full(BATCH, width * cp * tpb, dtype=np.int64)).all()
    table = benchmark(ledger.block_table, ids, width)
    assert table.shape == (BATCH, width)
    assert table.dtype == np.int32
    report_figure(benchmark, "block_table 1024 x 64", 1, "call", "<= 50 us")
