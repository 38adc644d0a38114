"""Packed step metadata from Python: ``write_step_metadata`` after ``schedule()`` with N
decoding requests at cp = 4, against the separate calls it replaces; and the decode rows the
fast path uploads (``write_decode_rows`` into the ``[max_batch, width]`` staging rows, padded
to the bucket), at N = 64 ... 4096, against the numpy column fill it replaced.

Target (issue 13): <= 10 us on the host at N = 1024 decodes. Run with
``python -m pytest benches/bench_step_metadata.py --benchmark-enable -s``.
"""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv

CP, TPB, PROMPT = 4, 32, 100
ROUNDS = 300
WARMUP = 20
#: Block-table columns: enough for PROMPT + max_new tokens (a caller sizes its rows to the
#: longest request it serves; every row is written -1 padded to this width).
WIDTH = 8


class Decoding:
    """``n`` requests past their prefill; each round schedules one decode step (untimed)."""

    def __init__(self, n: int) -> None:
        max_new = 2 * (ROUNDS + WARMUP) + 100
        config = helix_kv.SchedulerConfig(
            cp_size=CP,
            tokens_per_block=TPB,
            kv_superblocks=n * WIDTH,
            max_batch_size=n,
            max_num_tokens=n * PROMPT,
            max_seq_len=WIDTH * CP * TPB,
        )
        self.s = helix_kv.Scheduler(config)
        prompt = np.arange(PROMPT, dtype=np.int32)
        for i in range(n):
            self.s.add_request(i, prompt, max_new)
        self.tokens = np.full(n, 7, dtype=np.int32)
        self.layout = self.s.step_metadata_layout(WIDTH)
        self.buffer = helix_kv.new_step_metadata_buffer(self.layout)
        self.out = self.s.schedule()  # the prefill step
        self.next_step()
        assert self.out.generation_ids.size == n

    def next_step(self) -> tuple:
        self.s.update(self.tokens[: self.out.num_samples])
        self.out = self.s.schedule()
        return (), {}


@pytest.mark.parametrize("n", [64, 256, 1024, 4096])
def test_bench_write_step_metadata(benchmark, report_figure, n: int) -> None:
    d = Decoding(n)

    def write() -> None:
        d.s.write_step_metadata(d.out, d.buffer, d.layout)

    benchmark.pedantic(write, setup=d.next_step, rounds=ROUNDS, warmup_rounds=WARMUP)
    views = helix_kv.step_metadata_views(d.buffer, d.layout)
    np.testing.assert_array_equal(views.positions[:n], d.out.generation_positions)
    report_figure(
        benchmark, f"write_step_metadata, {n} decoding, cp={CP}", 1, "call", "<= 10 us at N = 1024"
    )


@pytest.mark.parametrize("n", [64, 256, 1024, 4096])
def test_bench_write_decode_rows(benchmark, report_figure, n: int) -> None:
    """One call fills the rows of the fast path's staging buffer (padded to ``n``)."""
    d = Decoding(n)
    columns = helix_kv.DECODE_ROW_COLUMNS
    rows = np.zeros((n, columns.index("block_table") + WIDTH), dtype=np.int32)

    def write() -> None:
        d.s.write_decode_rows(d.out, rows, n)

    benchmark.pedantic(write, setup=d.next_step, rounds=ROUNDS, warmup_rounds=WARMUP)
    np.testing.assert_array_equal(rows[:, columns.index("position")], d.out.generation_positions)
    report_figure(
        benchmark, f"write_decode_rows, {n} decoding, cp={CP}", 1, "call", "<= 10 us at N = 1024"
    )


@pytest.mark.parametrize("n", [64, 1024])
def test_bench_decode_rows_by_columns(benchmark, report_figure, n: int) -> None:
    """What the row writer replaces: the fast path's former fill, ``block_table`` +
    ``slot_mapping`` and one numpy write per column."""
    d = Decoding(n)
    column = {name: i for i, name in enumerate(helix_kv.DECODE_ROW_COLUMNS)}
    fixed = column["block_table"]
    rows = np.zeros((n, fixed + WIDTH), dtype=np.int32)
    ones = np.ones(n, dtype=np.int64)

    def by_columns() -> None:
        out = d.out
        ids = np.asarray(out.generation_ids, dtype=np.int64)
        positions = np.asarray(out.generation_positions, dtype=np.int64)
        table = d.s.block_table(ids, WIDTH)
        slots = d.s.slot_mapping(ids, positions, ones[: ids.size])
        rows[:n, column["token_id"]] = out.generation_input_tokens
        rows[:n, column["position"]] = positions
        rows[:n, column["slot"]] = slots
        rows[:n, column["local_len"]] = out.generation_local_lens
        rows[:n, column["past_seen_len"]] = out.generation_past_seen_lens
        rows[:n, column["input_ref"]] = out.generation_input_refs
        rows[:n, fixed:] = table

    benchmark.pedantic(by_columns, setup=d.next_step, rounds=ROUNDS, warmup_rounds=WARMUP)
    report_figure(benchmark, f"decode rows by numpy columns, {n} decoding", 1, "call", "n/a")


def test_bench_separate_calls(benchmark, report_figure) -> None:
    """What the packed buffer replaces: ``block_table`` + ``slot_mapping`` at N = 1024."""
    n = 1024
    d = Decoding(n)
    ones = np.ones(n, dtype=np.int64)

    def separate() -> None:
        ids = d.out.generation_ids
        d.s.block_table(ids, WIDTH)
        d.s.slot_mapping(ids, d.out.generation_positions, ones)

    benchmark.pedantic(separate, setup=d.next_step, rounds=ROUNDS, warmup_rounds=WARMUP)
    report_figure(benchmark, f"block_table + slot_mapping, {n} decoding", 1, "call", "n/a")
