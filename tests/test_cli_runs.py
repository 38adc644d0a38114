"""``helix-kv simulate`` run as a real subprocess: a comparison with a host tier (each column
against its own run without the host tier, every line within 100 characters, one configuration
shown once), a run a scheduler error ends mid-way (its step, the flags, the report so far) and
a plot with a host tier."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

import helix_kv

from .helpers.cli import run_command, small_workload
from .helpers.scheduler import needs_scheduler

pytestmark = needs_scheduler

#: 24 requests at once on 2 ranks of 8-token pages, 1024 tokens of KV: it preempts.
TIGHT = [*small_workload(), "--kv-tokens", "1024"]
HOST_TIER = [*TIGHT, "--host-tier-tokens", "256"]
#: No request may be preempted, and 768 tokens of KV: the scheduler deadlocks (in step 106).
NO_PREEMPTIONS = [*TIGHT, "--kv-tokens", "768", "--max-preemptions", "0"]
#: A disaggregated generation server may not preempt: it runs out of pages.
GENERATION_SERVER = [*TIGHT, "--mode", "disaggregated_generation"]
#: Core field names that must not reach the user: each has a flag.
FIELD_NAMES = (
    "kv_superblocks", "max_preemptions_per_request", "capacity_policy=", "max_batch_size",
)  # fmt: skip


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    """The command with ``argv``; not a terminal, whatever the ``COLUMNS`` of the tests."""
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    return run_command("simulate", *argv, env=env)


def report(*argv: str) -> dict[str, Any]:
    done = run(*argv, "--json")
    assert done.returncode == 0, done.stderr
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


# --- --compare-policies with a host tier ----------------------------------------------------


def test_each_column_is_compared_with_its_own_run_without_the_host_tier() -> None:
    compared = report(*HOST_TIER, "--compare-policies")
    policies = compared["policies"]
    # suspend_first, the default suspend policy, is the newest_first column: run once
    assert list(policies) == [
        "newest_first", "least_computed_first", "priority", "recompute_first", "cost",
        "no_host_tier",
    ]  # fmt: skip
    assert compared["same_as"] == {"suspend_first": "newest_first"}
    baselines = {}
    for policy in helix_kv.SchedulerConfig.VICTIM_POLICIES:
        # the oracle: the same victim policy without the host tier, run on its own
        alone = report(*TIGHT, "--policy", policy)
        baselines[policy] = alone["recomputed_tokens"]
        summary = policies[policy]
        assert summary["recompute_only_recomputed_tokens"] == alone["recomputed_tokens"]
        assert summary["recompute_only_steps"] == alone["steps"]
        assert summary["recomputed_tokens_avoided"] == (
            alone["recomputed_tokens"] - summary["recomputed_tokens"]
        )
        # and a single run of that policy with the host tier reports the same baseline
        single = report(*HOST_TIER, "--policy", policy)
        assert single["recompute_only_recomputed_tokens"] == alone["recomputed_tokens"]
    assert len(set(baselines.values())) > 1  # the policies differ here: the test can tell
    for policy in ("recompute_first", "cost"):  # under the default victim policy
        assert policies[policy]["recompute_only_recomputed_tokens"] == baselines["newest_first"]
    assert policies["no_host_tier"]["recomputed_tokens"] == baselines["newest_first"]


def test_the_comparison_fits_100_columns_and_shows_a_configuration_once() -> None:
    done = run(*HOST_TIER, "--compare-policies")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    headers = [line.split()[1:] for line in lines if line.startswith("  policy ")]
    assert len(headers) > 1  # in blocks of columns
    columns = [name for header in headers for name in header]
    assert columns == [
        "newest_first", "least_computed_first", "priority", "recompute_first", "cost",
        "no_host_tier",
    ]  # fmt: skip
    assert "  suspend_first: the same configuration as newest_first, run once" in done.stdout
    # every block has every row
    rows = [line for line in lines if line.startswith("  recomputed w/o host tier ")]
    assert len(rows) == len(headers)
    # each victim policy's cell names its own baseline
    compared = report(*HOST_TIER, "--compare-policies")["policies"]
    cells = " ".join(rows)
    for policy in helix_kv.SchedulerConfig.VICTIM_POLICIES:
        summary = compared[policy]
        cell = (
            f"{summary['recompute_only_recomputed_tokens']} in {summary['recompute_only_steps']} "
            f"steps ({summary['recomputed_tokens_avoided']} avoided)"
        )
        assert cell in cells


def test_a_terminal_width_widens_nothing_off_a_terminal() -> None:
    # COLUMNS is a terminal's setting: piped, the comparison keeps its 100 characters
    env = {**os.environ, "COLUMNS": "300"}
    done = run_command("simulate", *HOST_TIER, "--compare-policies", env=env)
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 100


# --- a run a scheduler error ends mid-way ----------------------------------------------------


def _failure_line(stderr: str, error: str) -> tuple[int, str]:
    """The one line on stderr: its step and its message."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    prefix = f"helix-kv simulate: {error} in step "
    assert lines[0].startswith(prefix), lines[0]
    step, message = lines[0][len(prefix) :].split(": ", 1)
    return int(step), message


def test_a_deadlock_prints_its_step_the_flags_and_the_report_so_far() -> None:
    done = run(*NO_PREEMPTIONS)
    assert done.returncode == 1
    step, message = _failure_line(done.stderr, "DeadlockError")
    assert "raise --max-preemptions (now 0)" in message
    assert "raise the KV budget (--kv-tokens), lower --max-batch-size or --max-num-tokens" in (
        message
    )
    for name in FIELD_NAMES:
        assert name not in message
    table = done.stdout
    assert table.startswith("helix-kv simulate: cp=2, ")
    assert f"  steps                       {step}\n" in table
    assert f"  failed in step {step} (DeadlockError): the figures cover the {step} steps run" in (
        table
    )
    # the oracle: the same run stopped before that step has the same figures
    failed = json.loads(run(*NO_PREEMPTIONS, "--json").stdout)["report"]
    stopped = report(*NO_PREEMPTIONS, "--max-steps", str(step))
    assert stopped["steps"] == failed["steps"] == step
    for key in ("requests_finished", "generated_tokens", "computed_tokens", "sat_out"):
        assert failed[key] == stopped[key], key
    assert failed["requests_finished"] < failed["requests_total"]


def test_json_of_a_failed_run_is_the_error_and_the_partial_report() -> None:
    done = run(*GENERATION_SERVER, "--json")
    assert done.returncode == 1
    step, message = _failure_line(done.stderr, "PreemptionDisabledError")
    assert "use --capacity-policy guaranteed_no_evict" in message
    assert "serve aggregated (--mode aggregated_helix)" in message
    for name in (*FIELD_NAMES, "serving_mode="):
        assert name not in message
    output = json.loads(done.stdout)
    assert set(output) == {"error", "report"}
    assert output["error"] == {
        "type": "PreemptionDisabledError",
        "message": message,
        "exit_status": 1,
        "step": step,
    }
    partial = output["report"]
    assert partial["steps"] == step > 0
    assert partial["failed"] == {"type": "PreemptionDisabledError", "step": step}
    assert partial["requests_finished"] < partial["requests_total"] == 24
    assert partial["rank_agreement"] is True


def test_a_comparison_that_fails_names_the_run_and_keeps_its_columns() -> None:
    done = run(*NO_PREEMPTIONS, "--compare-policies", "--json")
    assert done.returncode == 1
    step, message = _failure_line(done.stderr, "[newest_first] DeadlockError")
    output = json.loads(done.stdout)
    assert output["error"]["run"] == "newest_first"
    assert output["error"]["step"] == step
    assert output["error"]["message"] == f"[newest_first] {message}"
    # the runs after it are not made: the report covers the failed one's steps
    assert list(output["policies"]) == ["newest_first"]
    assert output["policies"]["newest_first"]["steps"] == step


def test_a_failed_procs_run_brings_the_report_so_far_back() -> None:
    pytest.importorskip("torch")
    done = run(*GENERATION_SERVER, "--procs")
    assert done.returncode == 1
    step, message = _failure_line(done.stderr, "PreemptionDisabledError")
    assert message.startswith("rank 0: ")
    assert f"  failed in step {step} (PreemptionDisabledError)" in done.stdout
    assert "yes (2 rank processes, every step)" in done.stdout


# --- --plot with a host tier -----------------------------------------------------------------


def test_plot_of_a_host_tier_run_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "run.png"
    done = run(*HOST_TIER, "--plot", str(target))
    assert done.returncode == 0, done.stderr
    assert target.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert done.stderr == f"plot written to {target}\n"


def test_a_failed_run_still_plots_its_steps(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "run.svg"
    done = run(*NO_PREEMPTIONS, "--plot", str(target))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == f"plot written to {target}"
    assert lines[1].startswith("helix-kv simulate: DeadlockError in step ")
    assert target.read_bytes().startswith(b"<?xml")
