"""``helix-kv simulate`` run in-process (``helix_kv.cli.main``) or as a real subprocess from
the tests: a small workload's flags and the runners that check the exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
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


def run_command(
    *argv: str,
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``python -m helix_kv ARGV`` (``simulate ...``, ``plan ...``) in a fresh interpreter; its
    exit status and text output, whatever the status."""
    return subprocess.run(
        [sys.executable, "-m", "helix_kv", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
        cwd=cwd,
    )


def one_usage_line(done: subprocess.CompletedProcess[str], prog: str = "helix-kv simulate") -> str:
    """A subprocess that exited 2 with nothing on stdout and one ``PROG: error: ...`` line on
    stderr; returns that line."""
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"{prog}: error: ")
    return line
