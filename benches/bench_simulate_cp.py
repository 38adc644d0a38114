"""Capacity planning at a large CP group: ``helix-kv simulate`` on the user guide's workload.

The workload is the one of docs/user-guide.md (Capacity planning): 2,000 requests arriving
4 per step, prompts around 8,000 tokens and outputs around 1,000, 32-token pages, 1M global
tokens of KV and 256 batch slots, here at ``--cp 64`` (and 16), with the default rank
verification (``sample`` above 8 ranks: the first and the last rank run a real scheduler,
compared every step).

Target at cp = 64: <= 30 s wall and <= 2 GB peak resident memory for the whole command,
interpreter start-up included. Each run is a fresh process (``python -m helix_kv``), so the
peak is the command's own (``ru_maxrss`` of that process), not the test session's. The targets
are asserted only when benchmarking is enabled (``python -m pytest
benches/bench_simulate_cp.py --benchmark-enable -s``); under ``--benchmark-disable`` (CI) the
same command runs once on a 20-request workload, untimed, to keep it working.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

#: The user guide's capacity-planning command, less ``--cp``.
GUIDE_WORKLOAD = [
    "--tokens-per-block", "32", "--kv-tokens", "1048576", "--max-batch-size", "256",
    "--requests", "2000", "--arrival-rate", "4", "--prompt-len", "8000", "--output-len", "1000",
]  # fmt: skip
#: The same shape, small: what CI runs once, untimed.
SMOKE_WORKLOAD = [
    "--tokens-per-block", "32", "--kv-tokens", "1048576", "--max-batch-size", "256",
    "--requests", "20", "--arrival-rate", "4", "--prompt-len", "800", "--output-len", "100",
]  # fmt: skip

BUDGET_SECONDS = 30.0
BUDGET_BYTES = 2 * 10**9  # 2 GB

#: Runs the command in a fresh interpreter and prints its exit status, peak RSS and user CPU
#: time as JSON on the last stderr line (``ru_maxrss`` is in KiB on Linux).
_CHILD = """
import json, resource, sys
from helix_kv.cli import main
status = main(sys.argv[1:])
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"status": status, "peak_rss_bytes": usage.ru_maxrss * 1024,
                  "user_s": usage.ru_utime}), file=sys.stderr)
"""


def simulate(argv: list[str]) -> dict:
    """Run ``helix-kv simulate ARGV --json`` in a fresh process; its wall time, user CPU time
    (what a loaded machine inflates least), peak memory and report."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, "simulate", *argv, "--json", "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    child = json.loads(done.stderr.strip().splitlines()[-1])
    assert child["status"] == 0, done.stderr
    return {
        "wall_s": wall,
        "user_s": child["user_s"],
        "peak_rss_bytes": child["peak_rss_bytes"],
        "report": done.stdout,
    }


@pytest.mark.parametrize("cp", [16, 64])
def test_bench_capacity_planning_at_large_cp(benchmark, cp: int) -> None:
    full = not benchmark.disabled
    argv = ["--cp", str(cp), *(GUIDE_WORKLOAD if full else SMOKE_WORKLOAD)]
    runs: list[dict] = []
    benchmark.pedantic(lambda: runs.append(simulate(argv)), rounds=1, iterations=1)

    (run,) = runs
    report = json.loads(run["report"])
    assert report["rank_agreement"]
    assert report["outputs_exact"]
    assert report["requests_finished"] == report["requests_total"]
    assert report["config"]["verified_ranks"] == [0, cp - 1]
    if not full:
        return
    peak_gb = run["peak_rss_bytes"] / 1e9
    benchmark.extra_info["wall_s"] = round(run["wall_s"], 2)
    benchmark.extra_info["peak_rss_gb"] = round(peak_gb, 3)
    benchmark.extra_info["steps"] = report["steps"]
    print(
        f"\nsimulate --cp {cp}, user guide workload: {run['wall_s']:.1f} s wall, "
        f"{peak_gb:.2f} GB peak RSS, {report['steps']} steps "
        f"(target <= {BUDGET_SECONDS:.0f} s, <= {BUDGET_BYTES / 1e9:.0f} GB)"
    )
    assert run["wall_s"] <= BUDGET_SECONDS
    assert run["peak_rss_bytes"] <= BUDGET_BYTES
