"""``helix-kv simulate`` run in-process (``helix_kv.cli.main``) from the tests: a small
workload's flags and the runners that check the exit status."""

from __future__ import annotations

import json
from typing import Any

import pytest

from helix_kv.cli import main


def small_workload(arrival_rate: str = "0") -> list[str]:
    """24 requests (all at once by default), prompts ~96 and outputs ~48 tokens, on 2 ranks of
    8-token pages (superblocks of 16 tokens); no KV budget given."""
    return [
        "--cp", "2", "--tokens-per-block", "8", "--requests", "24",
        "--arrival-rate", arrival_rate, "--prompt-len", "96", "--output-len", "48", "--seed", "3",
    ]  # fmt: skip


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """Run with ``--json``, expect exit status 0; return the report."""
    status = main(["simulate", *argv, "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    report: dict[str, Any] = json.loads(captured.out)
    return report


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run, expect exit status 2 and exactly one line on stderr; return that line."""
    status = main(["simulate", *argv])
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]
