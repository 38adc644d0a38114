"""Reading the public traces: a 30 MB Azure CSV (the 2024 form, about 700k rows) and a
BurstGPT CSV of the same size, whole, and with ``--trace-limit`` (every row is still checked)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helix_kv.simulate.trace_formats import TraceSelection, read_trace_file

TARGET_BYTES = 30_000_000
SMOKE_BYTES = 200_000


def azure_2024_csv(path: Path, size: int) -> int:
    """Write an Azure 2024 CSV of about ``size`` bytes (seeded); return its rows."""
    rng = np.random.default_rng(0)
    rows = size // 42
    us = np.cumsum(rng.integers(0, 50_000, size=rows))  # a week's worth at most
    stamps = np.datetime64("2024-05-10T00:00:00", "us") + us
    prompts = rng.integers(1, 8000, size=rows)
    outputs = rng.integers(0, 500, size=rows)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for stamp, prompt, output in zip(stamps.astype(str), prompts, outputs):
            handle.write(f"{stamp.replace('T', ' ')}+00:00,{prompt},{output}\n")
    return rows


def burstgpt_csv(path: Path, size: int) -> int:
    """Write a BurstGPT CSV of about ``size`` bytes (seeded); return its rows."""
    rng = np.random.default_rng(1)
    rows = size // 40
    seconds = np.cumsum(rng.integers(0, 3, size=rows))
    prompts = rng.integers(0, 2000, size=rows)
    outputs = rng.integers(0, 400, size=rows)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
        for second, prompt, output in zip(seconds, prompts, outputs):
            handle.write(f"{second},ChatGPT,{prompt},{output},{prompt + output},Conversation log\n")
    return rows


@pytest.mark.parametrize("limit", [None, 1000])
@pytest.mark.parametrize("writer", [azure_2024_csv, burstgpt_csv], ids=["azure", "burstgpt"])
def test_bench_read_a_30mb_trace(benchmark, report_figure, tmp_path: Path, writer, limit) -> None:
    """Target (issue 26): a 30 MB CSV reads in a few seconds (<= 3 s whole, on one core)."""
    path = tmp_path / "trace.csv"
    rows = writer(path, SMOKE_BYTES if benchmark.disabled else TARGET_BYTES)
    selection = TraceSelection(limit=limit)
    reads: list = []
    benchmark.pedantic(
        lambda: reads.append(read_trace_file(path, selection=selection)), rounds=3, iterations=1
    )
    read = reads[-1]
    assert read.rows == rows
    assert len(read.requests) == (limit or rows - sum(read.skipped.values()))
    report_figure(
        benchmark,
        f"{writer.__name__} {path.stat().st_size / 1e6:.0f} MB, limit {limit}",
        rows,
        "row",
        "<= 3 s per 30 MB",
    )
