"""``helix-kv simulate`` end to end: figures, JSON, plot, comparisons, --procs and failures.

Runs ``helix_kv.cli.main([...])`` in-process on small workloads, plus one real subprocess run
of the console script with its defaults.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helix_kv
from helix_kv.cli import main

from .helpers.cli import run_json, small_workload, usage_error
from .helpers.scheduler import needs_scheduler
from .helpers.summary import SUMMARY_KEYS

#: A small workload: 24 requests at once, prompts ~96 and outputs ~48 tokens.
SMALL = small_workload()
TIGHT = [*SMALL, "--kv-tokens", "1024"]
ROOMY = [*SMALL, "--kv-tokens", "65536"]


# --- argument and trace errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--cp", "0"], "argument --cp: must be >= 1, got 0"),
        (["--kv-tokens", "lots"], "argument --kv-tokens: expected an integer, got 'lots'"),
        (["--policy", "oldest"], "argument --policy: invalid choice: 'oldest'"),
        (["--arrival-rate", "-2"], "argument --arrival-rate: must be a finite number >= 0"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--trace", "t.jsonl", "--requests", "5"], "--requests shapes the synthetic workload"),
        (
            ["--trace", "t.jsonl", "--requests", "5", "--seed", "1", "--prompt-len", "9"],
            "--requests, --seed and --prompt-len shape the synthetic workload",
        ),
        (["--compare-policies", "--policy", "priority"], "drop --policy"),
        (["--plot", "/no/such/folder/x.png"], "folder /no/such/folder does not exist"),
        (["--prompt-len", "50", "--prompt-len-max", "10"], "prompt len max (10)"),
        (["--abort-rate", "2"], "argument --abort-rate: must be a fraction in [0, 1], got 2"),
        (["--trace", "t.jsonl", "--abort-rate", "0.1"], "--abort-rate shapes the synthetic"),
        # shared prompt content
        (["--think-steps", "4"], "--think-steps is the gap between turns; give --turns 2 or more"),
        (["--turns", "1", "--think-steps", "4"], "give --turns 2 or more"),
        (["--shared-prefix-share", "0.5"], "--shared-prefix-share needs a --shared-prefix-len"),
        (["--shared-prefix-len", "0", "--shared-prefix-share", "0.5"], "above 0"),
        (["--shared-prefix-share", "2", "--shared-prefix-len", "4"], "must be a fraction in"),
        (["--shared-prefix-len", "-1"], "argument --shared-prefix-len: must be >= 0"),
        (["--turns", "0"], "argument --turns: must be >= 1, got 0"),
        (["--turns", "2", "--think-steps", "-1"], "argument --think-steps: must be a number"),
        (["--turns", "2", "--think-steps", "nan"], "argument --think-steps: must be a number"),
        (["--hash-block-tokens", "16"], "--hash-block-tokens reads the hash_ids of a --trace"),
        (["--trace", "t.jsonl", "--hash-block-tokens", "0"], "--hash-block-tokens: must be >= 1"),
        (["--trace", "t.jsonl", "--turns", "3"], "--turns shapes the synthetic workload"),
        (["--trace", "t.jsonl", "--shared-prefix-len", "3"], "--shared-prefix-len shapes"),
    ],
)  # fmt: skip
def test_bad_arguments_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    line = usage_error(capsys, *argv)
    assert line.startswith("helix-kv simulate: error: ")
    assert reason in line


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert capsys.readouterr().err.strip() == (
        "helix-kv: error: choose a command: simulate or plan (see helix-kv --help)"
    )


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"id": 2, "arrival_step": 0, "prompt_len": 8}', "missing key 'output_len'"),
        ('{"id": 2, "arrival_step": 0, "prompt_len": -3, "output_len": 4}', "'prompt_len' must"),
        ("not json", "not valid JSON"),
        ('{"id": 1, "arrival_step": 1, "prompt_len": 8, "output_len": 4}', "duplicate id 1"),
        (
            '{"id": 2, "arrival_step": 3, "prompt_len": 8, "output_len": 4, "abort_step": 1}',
            "'abort_step' (1) must be >= 'arrival_step' (3)",
        ),
    ],
)
def test_bad_trace_line_names_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, line: str, reason: str
) -> None:
    trace = tmp_path / "trace.jsonl"
    good = '{"id": 1, "arrival_step": 0, "prompt_len": 8, "output_len": 4}'
    trace.write_text(f"{good}\n\n{line}\n")
    message = usage_error(capsys, "--trace", str(trace))
    assert f"trace {trace} line 3: " in message
    assert reason in message


# --- runs -----------------------------------------------------------------------------------


@needs_scheduler
def test_tight_budget_preempts_and_everything_finishes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *TIGHT)
    assert not SUMMARY_KEYS - set(report)
    assert report["requests_finished"] == report["requests_total"] == 24
    assert report["preemptions"] > 0
    assert report["recomputed_tokens"] > 0
    assert 0 < report["recomputed_share"] < 1
    assert report["rank_agreement"] is True
    assert report["outputs_exact"] is True
    assert report["kv_utilization_peak"] <= 1.0
    assert 0 < report["kv_utilization_mean"] <= report["kv_utilization_peak"]
    assert report["waiting_steps_p50"] <= report["waiting_steps_p99"]
    assert report["completion_steps_p50"] <= report["completion_steps_p99"]
    config = report["config"]
    assert config["cp"] == 2
    assert config["kv_tokens"] == 1024
    assert config["scheduler"]["tokens_per_block"] == 8
    assert config["workload"]["requests"] == 24


@needs_scheduler
def test_roomy_budget_never_preempts(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, *ROOMY)
    assert report["requests_finished"] == report["requests_total"]
    assert report["preemptions"] == 0
    assert report["recomputed_tokens"] == 0
    assert report["rank_agreement"] is True
    # the same workload under pressure generates the same tokens, in more steps
    tight = run_json(capsys, *TIGHT)
    assert tight["generated_tokens"] == report["generated_tokens"]
    assert tight["steps"] > report["steps"]


@needs_scheduler
def test_table_shows_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *TIGHT]) == 0
    table = capsys.readouterr().out
    for label in (
        "requests finished / total",
        "steps",
        "generated tokens",
        "recompute-pauses",
        "paused/suspended requests",
        "recomputed tokens",
        "of computed",
        "KV utilisation peak / mean",
        "waiting p50 / p99",
        "completion p50 / p99",
        "rank agreement",
    ):
        assert label in table
    assert "24 / 24" in table
    assert "yes (2 ranks, every step)" in table


@needs_scheduler
def test_one_rank_has_nothing_to_compare(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL[2:], "--cp", "1", "--kv-tokens", "4096"]) == 0
    table = capsys.readouterr().out
    assert "rank agreement              n/a (1 rank: nothing to compare)" in table
    assert "1 ranks" not in table


@needs_scheduler
def test_trace_run_matches_its_requests(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"id": 100 + i, "arrival_step": 2 * i, "prompt_len": 40, "output_len": 10})
        for i in range(6)
    ]
    trace.write_text("\n".join(lines) + "\n")
    report = run_json(capsys, "--trace", str(trace), "--kv-tokens", "4096")
    assert report["requests_finished"] == 6
    assert report["generated_tokens"] == 60
    assert report["config"]["workload"] == {"source": "trace", "path": str(trace), "requests": 6}


@needs_scheduler
def test_abort_rate_aborts_requests_and_the_rest_finish_exactly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *TIGHT, "--abort-rate", "0.5")
    assert report["requests_aborted"] > 0
    assert report["requests_finished"] + report["requests_aborted"] == 24
    assert report["outputs_exact"] is True
    assert report["rank_agreement"] is True
    assert report["config"]["workload"]["abort_rate"] == 0.5
    whole = run_json(capsys, *TIGHT)
    assert report["generated_tokens"] < whole["generated_tokens"]
    assert main(["simulate", *TIGHT, "--abort-rate", "0.5"]) == 0
    assert "requests aborted" in capsys.readouterr().out


@needs_scheduler
def test_trace_abort_steps_abort_those_requests(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    request = {"prompt_len": 40, "output_len": 10}
    lines = [
        json.dumps({"id": i, "arrival_step": i, **request, "abort_step": s})
        for i, s in ((0, 3), (1, None), (2, 2), (3, 90))  # 3 finishes before step 90
    ]
    trace.write_text("\n".join(lines) + "\n")
    report = run_json(capsys, "--trace", str(trace), "--kv-tokens", "4096")
    assert (report["requests_finished"], report["requests_aborted"]) == (2, 2)
    # 0 is aborted before step 3 (3 tokens: steps 0-2), 2 on arrival (none)
    assert report["generated_tokens"] == 10 + 10 + 3
    assert report["outputs_exact"] is True


@needs_scheduler
def test_compare_policies_lists_each_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *TIGHT, "--compare-policies"]) == 0
    # the columns come in blocks that fit 100 characters, each under its own header line
    lines = capsys.readouterr().out.splitlines()
    header = " ".join(line for line in lines if line.startswith("  policy "))
    for policy in ("newest_first", "least_computed_first", "priority"):
        assert policy in header
    report = run_json(capsys, *TIGHT, "--compare-policies")
    assert list(report["policies"]) == ["newest_first", "least_computed_first", "priority"]
    for name, summary in report["policies"].items():
        assert summary["config"]["scheduler"]["victim_policy"] == name
        assert summary["requests_finished"] == 24


@needs_scheduler
def test_request_that_can_never_run_is_rejected_up_front(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = usage_error(capsys, *SMALL, "--kv-tokens", "64", "--prompt-len-max", "400")
    assert "cannot run" in line
    assert "KV pool" in line


@needs_scheduler
def test_bad_scheduler_config_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # the core's ConfigError, with its fields named by the flags that set them
    line = usage_error(capsys, *SMALL, "--mode", "non_helix")
    assert "--mode non_helix needs --cp == 1 (got 2)" in line
    assert "cp_size" not in line
    line = usage_error(capsys, *SMALL, "--kv-tokens", "8")
    assert (
        "--kv-tokens 8 is less than one superblock (16 tokens = --tokens-per-block 8 x --cp 2)"
        in line
    )
    line = usage_error(capsys, *SMALL, "--max-num-tokens", "8", "--chunk-unit", "16")
    assert "--max-num-tokens 8 is below --chunk-unit = 16" in line
    line = usage_error(
        capsys, *SMALL, "--mode", "disaggregated_generation", "--host-tier-tokens", "64"
    )
    assert "--host-tier-tokens (4 superblocks) is rejected for a disaggregated generation" in line
    assert "set --host-tier-tokens in superblocks = 0" in line


@needs_scheduler
def test_disaggregated_generation_under_pressure_fails_with_the_remedy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(["simulate", *TIGHT, "--mode", "disaggregated_generation"])
    err = capsys.readouterr().err
    assert status == 1
    assert "PreemptionDisabledError" in err
    assert "guaranteed_no_evict" in err


@needs_scheduler
def test_guaranteed_no_evict_never_preempts(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, *TIGHT, "--capacity-policy", "guaranteed_no_evict")
    assert report["requests_finished"] == 24
    assert report["preemptions"] == 0


#: The first bytes of each format ``--plot`` is asked for in the tests.
PLOT_MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "svg": b"<?xml", "pdf": b"%PDF-"}


@pytest.mark.parametrize("extension", sorted(PLOT_MAGIC))
@needs_scheduler
def test_plot_format_follows_the_extension(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extension: str
) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / f"run.{extension}"
    assert main(["simulate", *TIGHT, "--plot", str(target)]) == 0
    data = target.read_bytes()
    assert data.startswith(PLOT_MAGIC[extension])
    for other, magic in PLOT_MAGIC.items():
        if other != extension:
            assert not data.startswith(magic)
    if extension == "svg":
        assert b"<svg" in data[:2000]
    assert f"plot written to {target}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("run.xyz", "extension .xyz is not one of .png, .svg"),
        ("run", "has no extension, give one of .png"),
    ],
)
@needs_scheduler
def test_plot_with_an_unknown_extension_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, reason: str
) -> None:
    pytest.importorskip("matplotlib")
    line = usage_error(capsys, *TIGHT, "--plot", str(tmp_path / name))
    assert reason in line
    assert list(tmp_path.iterdir()) == []


@needs_scheduler
def test_procs_with_two_ranks_agree(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    in_process = run_json(capsys, *TIGHT)
    with_procs = run_json(capsys, *TIGHT, "--procs")
    assert with_procs["rank_agreement"] is True
    assert with_procs["config"]["procs"] is True
    for key in ("steps", "preemptions", "recomputed_tokens", "generated_tokens"):
        assert with_procs[key] == in_process[key]


@needs_scheduler
def test_console_script_with_defaults_finishes_and_preempts() -> None:
    script = shutil.which("helix-kv")
    command = [script, "simulate"] if script else [sys.executable, "-m", "helix_kv.cli", "simulate"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert elapsed < 60
    assert "rank agreement" in done.stdout
    preemptions = next(line for line in done.stdout.splitlines() if "recompute-pauses" in line)
    assert int(preemptions.split()[1]) > 0
    assert done.stderr == ""  # not a terminal: no progress line


@pytest.mark.parametrize(
    ("flag", "modules", "message"),
    [
        (["--procs"], ("torch", "torch.distributed"), "--procs needs torch"),
        (["--plot", "x.png"], ("matplotlib",), "--plot needs matplotlib"),
    ],
)
@needs_scheduler
def test_missing_optional_dependency_is_a_clear_usage_error(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flag: list[str],
    modules: tuple[str, ...],
    message: str,
) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    line = usage_error(capsys, *TIGHT, *flag)
    assert message in line
    assert "pip install" in line


@needs_scheduler
def test_aggregated_host_tier_reports_suspends_copies_and_recompute_avoided(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *TIGHT, "--host-tier-tokens", "4096")
    assert report["config"]["scheduler"]["serving_mode"] == "aggregated_helix"
    assert report["suspensions"] > 0
    assert report["resumes"] == report["suspensions"]
    assert report["host_pages_out_per_rank"] == report["host_pages_in_per_rank"] > 0
    tokens_per_superblock = (
        report["config"]["cp"] * report["config"]["scheduler"]["tokens_per_block"]
    )
    assert (
        report["host_tokens_moved"] == 2 * report["host_pages_out_per_rank"] * tokens_per_superblock
    )
    # the same workload without the host tier ran too: what the suspends saved
    assert report["recompute_only_recomputed_tokens"] > report["recomputed_tokens"]
    assert report["recomputed_tokens_avoided"] == (
        report["recompute_only_recomputed_tokens"] - report["recomputed_tokens"]
    )
    assert report["outputs_exact"]
    assert report["rank_agreement"]
    compared = run_json(capsys, *TIGHT, "--host-tier-tokens", "4096", "--compare-policies")
    # suspend_first, the default suspend policy, is the newest_first column: run once
    names = [*helix_kv.SchedulerConfig.VICTIM_POLICIES, *helix_kv.SchedulerConfig.SUSPEND_POLICIES]
    names.remove("suspend_first")
    assert list(compared["policies"]) == [*names, "no_host_tier"]
    assert compared["same_as"] == {"suspend_first": "newest_first"}
    assert compared["policies"]["no_host_tier"]["suspensions"] == 0
    for policy in ("recompute_first", "cost"):
        summary = compared["policies"][policy]
        assert summary["config"]["scheduler"]["suspend_policy"] == policy
        assert summary["recomputed_tokens_avoided"] >= 0
