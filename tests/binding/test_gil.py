"""The binding releases the GIL around long batch work, so another Python thread (an engine's
model or I/O thread, a metrics scrape) keeps running while a rank maps a step's slots or grows
its tables.

How it is seen: a second thread stamps the clock in a loop, handing the GIL back after each
stamp. The switch interval is raised far above the test's length, so the calling thread never
gives the GIL up between bytecodes: the other thread can stamp inside a call only if the call
itself let the GIL go. A call that keeps it leaves no stamp inside, however busy the machine
(see the last test); one that lets it go needs the OS to run the other thread at least once
while it works, so the call is sized to take ``MIN_CALL_S`` and tried ``ATTEMPTS`` times.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

import numpy as np
import pytest

import helix_kv

#: No forced GIL switch while the test runs (restored after).
SWITCH_INTERVAL_S = 30.0
#: The time a call is sized to take (its work doubled from a small start) ...
MIN_CALL_S = 0.02
#: ... up to this many tokens (the slot mapping's output is 8 bytes a token).
MAX_TOKENS = 1 << 24
ATTEMPTS = 20
REQUESTS = 64


def ledger_slot_mapping(tokens: int) -> Callable[[], object]:
    per_request = tokens // REQUESTS
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 16), tokens // 32 + REQUESTS)
    ids = np.arange(REQUESTS, dtype=np.uint64)
    ledger.add_many(ids, np.ones(REQUESTS, dtype=np.int64))
    assert ledger.grow_many(ids, np.full(REQUESTS, per_request, dtype=np.int64)).all()
    starts = np.zeros(REQUESTS, dtype=np.int64)
    counts = np.full(REQUESTS, per_request, dtype=np.int64)
    return lambda: ledger.slot_mapping(ids, starts, counts, 1)


def ledger_grow_many(tokens: int) -> Callable[[], object]:
    """Grows 64 requests to ``tokens`` superblocks in all, frees them and adds them back."""
    ledger = helix_kv.Ledger(helix_kv.Layout(1, 1), tokens + REQUESTS)
    ids = np.arange(REQUESTS, dtype=np.uint64)
    ones = np.ones(REQUESTS, dtype=np.int64)
    lengths = np.full(REQUESTS, tokens // REQUESTS, dtype=np.int64)
    ledger.add_many(ids, ones)

    def call() -> None:
        assert ledger.grow_many(ids, lengths).all()
        ledger.free_many(ids)
        ledger.add_many(ids, ones)

    return call


def scheduler_slot_mapping(tokens: int) -> Callable[[], object]:
    config = helix_kv.SchedulerConfig(
        cp_size=2,
        tokens_per_block=16,
        kv_superblocks=tokens // 32 + 1,
        max_num_tokens=tokens,
        max_seq_len=tokens + 1,
    )
    scheduler = helix_kv.Scheduler(config)
    scheduler.add_request(0, np.zeros(tokens, dtype=np.int32), 1)
    assert scheduler.schedule().context_lens.tolist() == [tokens]  # the whole prompt reserved
    return lambda: scheduler.slot_mapping([0], [0], [tokens])


def scheduler_write_step_metadata(tokens: int) -> Callable[[], object]:
    """A prefill of ``tokens`` tokens in one step, packed (past the size the call keeps
    the GIL for)."""
    config = helix_kv.SchedulerConfig(
        cp_size=2,
        tokens_per_block=16,
        kv_superblocks=tokens // 32 + 1,
        max_num_tokens=tokens,
        max_seq_len=tokens + 1,
    )
    scheduler = helix_kv.Scheduler(config)
    scheduler.add_request(0, np.zeros(tokens, dtype=np.int32), 1)
    out = scheduler.schedule()
    layout = scheduler.step_metadata_layout()
    buffer = helix_kv.new_step_metadata_buffer(layout)
    return lambda: scheduler.write_step_metadata(out, buffer, layout)


def layout_owner_ranks(tokens: int) -> Callable[[], object]:
    layout = helix_kv.Layout(4, 16)
    positions = np.arange(tokens, dtype=np.int64)
    return lambda: layout.owner_ranks(positions)


def ledger_block_table(tokens: int) -> Callable[[], object]:
    """A wide, mostly padded table: filling it is the work."""
    ledger = helix_kv.Ledger(helix_kv.Layout(1, 1), REQUESTS)
    ids = np.arange(REQUESTS, dtype=np.uint64)
    ledger.add_many(ids, np.ones(REQUESTS, dtype=np.int64))
    return lambda: ledger.block_table(ids, tokens // 4)


CALLS = {
    "Layout.owner_ranks": layout_owner_ranks,
    "Ledger.block_table": ledger_block_table,
    "Ledger.slot_mapping": ledger_slot_mapping,
    "Ledger.grow_many": ledger_grow_many,
    "Scheduler.slot_mapping": scheduler_slot_mapping,
    "Scheduler.write_step_metadata": scheduler_write_step_metadata,
}


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def long_call(build: Callable[[int], Callable[[], object]]) -> tuple[Callable[[], object], float]:
    """``build(tokens)``'s call with the work doubled until it takes ``MIN_CALL_S`` (or
    ``MAX_TOKENS`` is reached), and its time alone (the best of three)."""
    tokens = 1 << 16
    while True:
        call = build(tokens)
        alone = min(timed(call) for _ in range(3))
        if alone >= MIN_CALL_S or tokens >= MAX_TOKENS:
            return call, alone
        tokens *= 2


def stamps_inside(call: Callable[[], object], attempts: int) -> int:
    """Runs ``call`` up to ``attempts`` times (until one has stamps inside) while another
    thread stamps the clock; the most stamps one run had strictly inside it."""
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0)  # hands the GIL back: the caller never waits for a forced switch

    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    most = 0
    try:
        while not stamps:
            time.sleep(0.001)
        for _ in range(attempts):
            stamps.clear()
            started = time.perf_counter()
            call()
            ended = time.perf_counter()
            most = max(most, sum(started < stamp < ended for stamp in stamps))
            if most:
                break
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    return most


@pytest.mark.parametrize("name", sorted(CALLS))
def test_another_thread_runs_while_a_batch_call_works(name: str) -> None:
    call, alone = long_call(CALLS[name])
    assert stamps_inside(call, ATTEMPTS) > 0, f"{name} ({alone:.3f}s alone) kept the GIL"


@pytest.mark.skipif(
    not getattr(sys, "_is_gil_enabled", lambda: True)(), reason="a free-threaded build: no GIL"
)
def test_a_call_that_keeps_the_gil_is_seen_to() -> None:
    """The check can fail: a C call that keeps the GIL (sorting a list of ints) leaves no
    stamp inside itself."""
    values = np.random.default_rng(0).permutation(1 << 21).tolist()
    call, _ = long_call(lambda n: lambda: sorted(values[:n]))
    assert stamps_inside(call, attempts=3) == 0
