"""``helix-kv plan``: the pick is the smallest candidate that passes (checked against
``helix-kv simulate`` run on every value), on a synthetic workload and on a trace; the default
ladders; parallel and serial runs agree; failed candidates are rows; exit statuses, ``--json``,
progress and ``--plot`` (real subprocesses)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helix_kv.cli import main
from helix_kv.simulate.plan import LADDER_POINTS, Candidate, default_values, refined_values
from helix_kv.simulate.workload import RequestSpec, WorkloadSpec, synthetic_workload, write_trace

from ..helpers.cli import run_command
from ..helpers.scheduler import needs_scheduler

#: 16 requests arriving about one a step, prompts ~48 and outputs ~16 tokens, 8-token pages.
WORKLOAD = [
    "--tokens-per-block", "8", "--requests", "16", "--arrival-rate", "1", "--prompt-len", "48",
    "--output-len", "16", "--seed", "4",
]  # fmt: skip
SLO = ["--slo-ttft-ms", "60", "--slo-tpot-ms", "8"]
SHARE = 0.9
KV_VALUES = "160,256,384,512,1024"


def _plan(capsys: pytest.CaptureFixture[str], *argv: str, status: int = 0) -> dict[str, Any]:
    """``helix-kv plan ... --json`` in this process, serially (``--jobs 1``: no process to
    start; the pool is checked against it below); returns the plan object."""
    assert main(["plan", *argv, "--json", "--no-progress", "--jobs", "1"]) == status
    captured = capsys.readouterr()
    assert captured.err.count("\n") <= 1, captured.err  # at most the "no value passes" line
    plan: dict[str, Any] = json.loads(captured.out)
    return plan


def _simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """``helix-kv simulate ... --json``; returns the report."""
    assert main(["simulate", *argv, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def _check_against_simulate(
    capsys: pytest.CaptureFixture[str], plan: dict[str, Any], flag: str, *argv: str
) -> None:
    """Every candidate's figures are simulate's own on that value, and the pick is the
    smallest value whose goodput share reaches the SLO share."""
    passing = []
    for candidate in plan["candidates"]:
        report = _simulate(capsys, *argv, flag, str(candidate["value"]))
        assert candidate["goodput_share"] == report["goodput_share"]
        assert candidate["ttft_ms_p99"] == report["ttft_ms_p99"]
        assert candidate["preemptions"] == report["preemptions"]
        verdict = "pass" if report["goodput_share"] >= plan["slo_share"] else "fail"
        assert candidate["status"] == verdict
        if verdict == "pass":
            passing.append(candidate["value"])
    assert plan["pick"] == min(passing, default=None)


@needs_scheduler
def test_kv_tokens_pick_is_the_smallest_passing_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*WORKLOAD, *SLO]
    plan = _plan(capsys, "--vary", "kv-tokens", *argv, "--slo-share", str(SHARE))
    assert plan["vary"] == "kv-tokens"
    assert (plan["slo_ttft_ms"], plan["slo_tpot_ms"], plan["slo_share"]) == (60.0, 8.0, SHARE)
    values = [candidate["value"] for candidate in plan["candidates"]]
    assert values == sorted(values)
    assert len(values) > 2
    statuses = {candidate["status"] for candidate in plan["candidates"]}
    assert statuses == {"pass", "fail"}, plan  # the ladder brackets the answer
    _check_against_simulate(capsys, plan, "--kv-tokens", *argv, "--cp", "2")


@needs_scheduler
def test_cp_pick_on_a_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    requests = synthetic_workload(
        WorkloadSpec(
            num_requests=12, seed=2, arrival_rate=2.0, prompt_len_mean=256, output_len_mean=8
        )
    )
    write_trace(requests, trace)
    # a TTFT target the long prefills meet only spread over enough ranks
    argv = ["--trace", str(trace), "--tokens-per-block", "8", "--kv-tokens", "8192"]
    model = ["--step-time", "1,0,0.2"]
    plan = _plan(capsys, "--vary", "cp", *argv, *model, "--slo-ttft-ms", "140")
    assert [c["value"] for c in plan["candidates"]] == [1, 2, 4, 8]
    assert {c["status"] for c in plan["candidates"]} == {"pass", "fail"}, plan
    assert plan["workload"]["source"] == "trace"
    _check_against_simulate(capsys, plan, "--cp", *argv, *model, "--slo-ttft-ms", "140")


@needs_scheduler
def test_kv_tokens_pick_with_arrivals_in_time(capsys: pytest.CaptureFixture[str]) -> None:
    """A workload timed in modelled seconds (--request-rate): the same rule."""
    argv = [
        "--tokens-per-block", "8", "--requests", "16", "--request-rate", "20",
        "--prompt-len", "48", "--output-len", "16", "--seed", "4", *SLO,
    ]  # fmt: skip
    plan = _plan(capsys, "--vary", "kv-tokens", *argv, "--values", KV_VALUES)
    assert {c["status"] for c in plan["candidates"]} == {"pass", "fail"}, plan
    _check_against_simulate(capsys, plan, "--kv-tokens", *argv)


@needs_scheduler
def test_parallel_and_serial_give_the_same_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--vary", "kv-tokens", *WORKLOAD, *SLO, "--values", KV_VALUES]
    tables = []
    for jobs in ("1", "3"):
        main([*argv, "--jobs", jobs, "--no-progress"])
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1]
    assert tables[0].count("\n") >= 5


@needs_scheduler
def test_failed_candidates_are_rows_with_their_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 8 tokens: less than one superblock; 64: smaller than the largest request
    plan = _plan(capsys, "--vary", "kv-tokens", *WORKLOAD, *SLO, "--values", "1024,8,64")
    first, second, third = plan["candidates"]
    assert [first["value"], second["value"], third["value"]] == [8, 64, 1024]
    assert first["status"] == second["status"] == "error"
    assert "less than one superblock" in first["error"]["message"]
    assert "more than the whole KV pool" in second["error"]["message"]
    assert first["goodput_share"] is None
    assert first["report"] is None
    assert third["status"] == "pass"
    assert third["error"] is None
    assert plan["pick"] == 1024

    main(["plan", "--vary", "kv-tokens", *WORKLOAD, *SLO, "--values", "1024,8", "--no-progress"])
    table = capsys.readouterr().out.splitlines()
    (row,) = [line for line in table if line.split()[:1] == ["8"]]
    assert "error: invalid configuration: --kv-tokens 8 is less than one superblock" in row
    assert table[-2] == "  pick: --kv-tokens 1024 (the smallest value that passes)"


@needs_scheduler
def test_no_value_passes_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(
        capsys, "--vary", "kv-tokens", *WORKLOAD, "--slo-ttft-ms", "0.5", "--values", "256,1024",
        status=1,
    )  # fmt: skip
    assert plan["pick"] is None
    assert [c["status"] for c in plan["candidates"]] == ["fail", "fail"]


def test_default_ladders() -> None:
    workload = [
        RequestSpec(request_id=i, arrival_step=0, prompt_len=100 * (i + 1), output_len=20)
        for i in range(10)
    ]
    # largest need 1020 -> 1024, total 5500 + 200 = 5700 -> 5712 (superblocks of 16)
    ladder = default_values("kv-tokens", workload, 16, 8)
    assert ladder[0] == 1024
    assert ladder[-1] == 5712
    assert len(ladder) == LADDER_POINTS
    assert ladder == sorted(set(ladder))
    assert all(value % 16 == 0 for value in ladder)
    ratios = [b / a for a, b in zip(ladder, ladder[1:])]
    assert max(ratios) - min(ratios) < 0.05  # geometric
    assert default_values("kv-tokens", workload[:1], 16, 8) == [128]  # one request: one point
    assert default_values("cp", workload, 16, 8) == [1, 2, 4, 8]
    assert default_values("cp", workload, 16, 6) == [1, 2, 4]
    assert default_values("cp", workload, 16, 1) == [1]


@needs_scheduler
def test_max_cp_bounds_the_default_cp_ladder(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(capsys, "--vary", "cp", *WORKLOAD, *SLO, "--max-cp", "2")
    assert [c["value"] for c in plan["candidates"]] == [1, 2]


@needs_scheduler
@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        ([], "a plan needs a target: give --slo-ttft-ms, --slo-tpot-ms or both"),
        (["--slo-ttft-ms", "1", "--kv-tokens", "4096"], "--vary kv-tokens tries the --kv-tokens"),
        (["--slo-ttft-ms", "1", "--compare-policies"], "does not take --compare-policies"),
        (["--slo-ttft-ms", "1", "--procs"], "does not take --procs"),
        (["--slo-ttft-ms", "1", "--events", "e.jsonl"], "does not take --events"),
        (["--slo-ttft-ms", "1", "--overlap"], "does not take --overlap"),
        (["--slo-ttft-ms", "1", "--max-cp", "4"], "--max-cp bounds the default --vary cp"),
        (["--slo-ttft-ms", "1", "--values", "1,x"], "argument --values: expected comma-separated"),
        (["--slo-ttft-ms", "1", "--values", "0,4"], "argument --values: every value must be >= 1"),
        (["--slo-ttft-ms", "1", "--slo-share", "1.5"], "argument --slo-share: must be a fraction"),
        (["--slo-ttft-ms", "1", "--jobs", "0"], "argument --jobs: must be >= 1"),
        (["--slo-ttft-ms", "1", "--requests", "5", "--trace", "t.jsonl"], "--requests shapes"),
        (["--slo-ttft-ms", "1", "--plot", "run.txt"], "--plot run.txt: extension .txt"),
    ],
)  # fmt: skip
def test_bad_plan_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    assert main(["plan", "--vary", "kv-tokens", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("helix-kv plan: error: ")
    assert reason in line


@needs_scheduler
@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--vary", "cp", "--cp", "2"], "--vary cp tries the --cp values itself; drop --cp"),
        (["--vary", "cp", "--values", "1,300"], "--values: --cp takes at most 256, got 300"),
        (["--vary", "cp", "--refine", "2"], "--refine searches between the default --vary kv"),
        (["--vary", "kv-tokens", "--values", "512,1024", "--refine", "1"], "without --values"),
        (["--vary", "kv-tokens", "--refine", "9"], "argument --refine: must be at most 8, got 9"),
    ],
)
def test_bad_cp_plan_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    assert main(["plan", *argv, "--slo-ttft-ms", "1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert reason in line


def test_vary_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--slo-ttft-ms", "1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("helix-kv plan: error: the following arguments are required: --vary")


# --- real subprocesses -----------------------------------------------------------------------


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_command("plan", *argv, cwd=cwd)


@needs_scheduler
def test_subprocess_json_progress_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "plan.png"
    argv = ["--vary", "kv-tokens", *WORKLOAD, *SLO, "--values", KV_VALUES, "--jobs", "2"]
    done = _run(*argv, "--json", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)  # stdout is one JSON object
    assert plan["pick"] in {c["value"] for c in plan["candidates"]}
    # one progress line per candidate, then nothing else (--json: no "plot written" line)
    lines = done.stderr.splitlines()
    assert len(lines) == 5, done.stderr
    assert all(line.startswith("helix-kv plan: [") for line in lines)
    assert plot.stat().st_size > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"

    table = _run(*argv, "--no-progress", "--plot", str(tmp_path / "plan.svg"))
    assert table.returncode == 0, table.stderr
    assert table.stderr == f"plot written to {tmp_path / 'plan.svg'}\n"
    assert f"pick: --kv-tokens {plan['pick']} (the smallest value that passes)" in table.stdout
    assert (tmp_path / "plan.svg").read_text().lstrip().startswith("<?xml")


@needs_scheduler
def test_subprocess_exit_statuses() -> None:
    argv = ["--vary", "kv-tokens", *WORKLOAD, "--values", "256", "--no-progress"]
    none_pass = _run(*argv, "--slo-ttft-ms", "0.5", "--json")
    assert none_pass.returncode == 1, none_pass.stderr
    assert json.loads(none_pass.stdout)["pick"] is None
    assert none_pass.stderr == "helix-kv plan: no value of --kv-tokens passes\n"

    usage = _run(*argv, "--json")  # no target
    assert usage.returncode == 2
    error = json.loads(usage.stdout)["error"]
    assert error["type"] == "UsageError"
    assert error["exit_status"] == 2
    assert usage.stderr.startswith("helix-kv plan: error: a plan needs a target")

    table = _run(*argv, "--slo-ttft-ms", "1000")
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("helix-kv plan: --kv-tokens over 1 value; SLO TTFT <= 1000 ms")


@needs_scheduler
def test_user_guide_plan_sample_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text("utf-8")
    section = guide[guide.index("## Planning against SLOs") :]
    command = re.search(r"^```bash\nhelix-kv (.*)\n```", section, re.MULTILINE)
    sample = re.search(r"^```text\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert command is not None
    assert sample is not None
    assert main([*command.group(1).split(), "--no-progress"]) == 0
    assert capsys.readouterr().out == sample.group(1)


@needs_scheduler
@pytest.mark.skipif(sys.platform == "win32", reason="process groups and SIGINT are POSIX")
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_stops_every_candidate_and_exits_130(jobs: str) -> None:
    """SIGINT to the whole process group, as a terminal sends it, while the candidates run
    (long ones: 100,000 requests each, minutes of work, so none can finish first however fast
    the machine): 130, one line, and no worker outlives the command."""
    argv = ["--vary", "kv-tokens", "--requests", "100000", "--slo-ttft-ms", "1000"]
    process = subprocess.Popen(
        [sys.executable, "-m", "helix_kv", "plan", *argv, "--values", "4096,8192", "--jobs", jobs],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    time.sleep(4)  # started, and the workers (or the first run) busy
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stdout == ""
    assert stderr == "helix-kv plan: interrupted\n"
    deadline = time.monotonic() + 15
    while True:  # every process of the group has exited
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a worker outlived the command"
        time.sleep(0.1)


def test_help_gives_simulates_defaults_of_the_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--cp N CP ranks (default: 2; not with --vary cp)" in text
    assert "(default: 16384; not with --vary kv-tokens)" in text
    assert "--slo-ttft-ms MS" in text


def _row(value: int, status: str) -> Candidate:
    return Candidate(value, status)  # type: ignore[arg-type]


def test_refined_values_search_the_gap_below_the_pick() -> None:
    # superblocks of 32 tokens: 8672 failed (271 superblocks), 12896 passed (403)
    rows = [_row(5824, "fail"), _row(8672, "fail"), _row(12896, "pass"), _row(19168, "pass")]
    values = refined_values(rows, 32)
    # seven budgets evenly inside (271, 403), whole superblocks
    assert values == [b * 32 for b in (288, 304, 320, 337, 353, 369, 385)]
    # a gap of fewer superblocks than points: every one of them
    assert refined_values([_row(320, "error"), _row(480, "pass")], 32) == [352, 384, 416, 448]
    # a budget already tried is not tried again; nothing between adjacent superblocks
    assert refined_values([_row(320, "fail"), _row(352, "pass")], 32) == []
    assert refined_values([_row(320, "fail"), _row(384, "pass")], 32, points=3) == [352]
    # nothing to refine: the smallest passes, or none does
    assert refined_values([_row(320, "pass"), _row(640, "pass")], 32) == []
    assert refined_values([_row(320, "fail"), _row(640, "error")], 32) == []


@needs_scheduler
def test_the_refining_round_narrows_the_pick(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--vary", "kv-tokens", *WORKLOAD, *SLO, "--slo-share", str(SHARE)]
    ladder = _plan(capsys, *argv, "--refine", "0")
    refined = _plan(capsys, *argv)
    ladder_values = [c["value"] for c in ladder["candidates"]]
    values = [c["value"] for c in refined["candidates"]]
    added = sorted(set(values) - set(ladder_values))
    assert set(ladder_values) <= set(values)
    assert 0 < len(added) <= 7
    # the added budgets lie between the ladder's largest failure below its pick and its pick
    below = max(v for v in ladder_values if v < ladder["pick"])
    assert all(below < value < ladder["pick"] for value in added)
    assert refined["pick"] <= ladder["pick"]
    _check_against_simulate(capsys, refined, "--kv-tokens", *WORKLOAD, *SLO, "--cp", "2")
