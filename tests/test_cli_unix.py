"""``helix-kv`` as a Unix tool, run as a real subprocess: a closed pipe, Ctrl-C, absurd
numbers, ``--json`` on failure, ``python -m helix_kv``. Every case ends with its documented
exit status (docs/user-guide.md), at most one line on stderr and never a traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helix_kv
from helix_kv.cli import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED

from .helpers.scheduler import needs_scheduler

#: ``python -m helix_kv``: the same entry point as the console script, found without PATH.
HELIX_KV = [sys.executable, "-m", "helix_kv"]
SMALL = [
    "--cp", "2", "--tokens-per-block", "8", "--requests", "24", "--arrival-rate", "0",
    "--prompt-len", "96", "--output-len", "48", "--seed", "3", "--kv-tokens", "1024",
]  # fmt: skip
#: Long enough (about ten seconds here) that no run ends before the Ctrl-C a test sends it.
LONG = ["--requests", "30000", "--progress"]


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HELIX_KV, *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


def assert_one_clean_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# --- python -m helix_kv --------------------------------------------------------------------


def test_python_m_helix_kv_is_the_cli() -> None:
    done = run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"helix-kv {helix_kv.__version__}"
    done = run()
    assert done.returncode == 2
    assert assert_one_clean_line(done.stderr) == (
        "helix-kv: error: choose a command: simulate or plan (see helix-kv --help)"
    )


# --- numbers too large to hold: refused while parsing, before anything is allocated ---------


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (
            ["--kv-tokens", "99999999999999999999999"],
            "argument --kv-tokens: must be at most 9223372036854775807",
        ),
        (["--requests", "99999999999"], "argument --requests: must be at most 1000000"),
        (["--prompt-len", "3000000000"], "argument --prompt-len: must be at most 1048576"),
        (["--cp", "5000000000"], "argument --cp: must be at most 256"),
        (
            ["--kv-tokens", "68719476704"],
            "--kv-tokens 68719476704 is 2147483647 superblocks of 32 tokens; "
            "the simulator holds at most 4194304",
        ),
        (  # past the core's int32 page ids too: still the simulator's limit, said once
            ["--kv-tokens", "137438953440"],
            "--kv-tokens 137438953440 is 4294967295 superblocks of 32 tokens; "
            "the simulator holds at most 4194304",
        ),
    ],
)
@needs_scheduler
def test_absurd_numbers_are_one_usage_line(argv: list[str], reason: str) -> None:
    started = time.monotonic()
    done = run("simulate", *argv)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    line = assert_one_clean_line(done.stderr)
    assert line.startswith("helix-kv simulate: error: ")
    assert reason in line
    assert time.monotonic() - started < 30  # refused, not attempted


# --- --json: one JSON object on stdout whatever happens -------------------------------------


@needs_scheduler
def test_json_on_a_failed_run_prints_an_error_object() -> None:
    done = run("simulate", *SMALL, "--mode", "disaggregated_generation", "--json")
    assert done.returncode == 1
    line = assert_one_clean_line(done.stderr)
    assert line.startswith("helix-kv simulate: PreemptionDisabledError in step ")
    error = json.loads(done.stdout)["error"]
    assert error["type"] == "PreemptionDisabledError"
    assert error["exit_status"] == 1
    assert "--capacity-policy guaranteed_no_evict" in error["message"]


@pytest.mark.parametrize(
    "argv",
    [["--cp", "0", "--json"], ["--json", "--requests", "99999999999"], ["--js", "--bogus"]],
)
def test_json_on_a_usage_error_prints_an_error_object(argv: list[str]) -> None:
    done = run("simulate", *argv)
    assert done.returncode == 2
    line = assert_one_clean_line(done.stderr)
    error = json.loads(done.stdout)["error"]
    assert error == {"type": "UsageError", "message": error["message"], "exit_status": 2}
    assert line.endswith(error["message"])


# --- stdout closed early (helix-kv simulate | head -1) --------------------------------------


@pytest.mark.parametrize("extra", [[], ["--json"], ["--compare-policies"]])
@needs_scheduler
def test_closed_stdout_ends_quietly_with_141(extra: list[str]) -> None:
    """The reader is gone before anything is written (``head`` that has read its line), so
    every write fails: Python's SIGPIPE recipe, no traceback, the documented status."""
    process = subprocess.Popen(
        [*HELIX_KV, "simulate", *SMALL, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_BROKEN_PIPE == 141
    assert stderr == ""


@needs_scheduler
def test_head_of_a_shell_pipeline_gets_the_first_line() -> None:
    """The real pipeline: the first line arrives and the command ends without a word, with
    0 (all written before head left) or 141 (head left first)."""
    command = [*HELIX_KV, "simulate", *SMALL, "--compare-policies"]
    script = " ".join(f"'{part}'" for part in command) + ' | head -1; echo "${PIPESTATUS[0]}"'
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    first, status = done.stdout.splitlines()
    assert first.startswith("helix-kv simulate --compare-policies: ")
    assert status in {"0", "141"}
    assert done.stderr == ""


# --- Ctrl-C: the report of the steps so far, then 130 ---------------------------------------


def _interrupt(argv: list[str], ready: str, times: int = 1) -> tuple[int, str, str]:
    """Start ``helix-kv simulate argv`` in its own process group, wait until stderr shows
    ``ready`` (a progress line), press Ctrl-C ``times`` (SIGINT to the whole group, as a
    terminal does) and return the exit status, stdout and stderr."""
    process = subprocess.Popen(
        [*HELIX_KV, "simulate", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stderr is not None
    os.set_blocking(process.stderr.fileno(), False)
    seen = b""
    deadline = time.monotonic() + 120
    while ready.encode() not in seen:
        assert process.poll() is None, seen.decode()
        assert time.monotonic() < deadline, seen.decode()
        seen += process.stderr.read() or b""
        time.sleep(0.05)
    for _ in range(times):
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(0.05)
    os.set_blocking(process.stderr.fileno(), True)
    stdout, stderr = process.communicate(timeout=120)
    _assert_group_gone(process.pid)
    return process.returncode, stdout.decode(), (seen + stderr).decode()


def _assert_group_gone(group: int) -> None:
    """Every process of the group (the rank processes of --procs included) has exited."""
    deadline = time.monotonic() + 15
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, "a process of the run outlived it"
        time.sleep(0.1)


def _last_line(stderr: str) -> str:
    # the progress line redraws itself with carriage returns; what follows it is one line
    tail = stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert "Traceback" not in stderr
    assert "Warning" not in stderr
    return tail


def _interrupted_steps(line: str) -> int:
    assert line.startswith("helix-kv simulate: interrupted after "), line
    assert line.endswith(" steps; the report covers those"), line
    return int(line.split()[4])


@needs_scheduler
def test_ctrl_c_prints_the_report_so_far_and_exits_130() -> None:
    status, stdout, stderr = _interrupt(LONG, ready="step")
    assert status == EXIT_INTERRUPTED == 130
    steps = _interrupted_steps(_last_line(stderr))
    assert stdout.startswith("helix-kv simulate: ")
    assert f"  steps                       {steps}\n" in stdout
    assert f"interrupted after {steps} steps: the figures cover those only" in stdout
    finished = next(line for line in stdout.splitlines() if "requests finished" in line)
    assert finished.split()[-1] == LONG[1]
    assert int(finished.split()[-3]) < int(LONG[1])


@needs_scheduler
def test_ctrl_c_with_json_prints_the_partial_report() -> None:
    status, stdout, stderr = _interrupt([*LONG, "--json"], ready="step")
    assert status == 130
    report = json.loads(stdout)
    assert report["interrupted"] is True
    assert report["steps"] == _interrupted_steps(_last_line(stderr))
    assert report["requests_finished"] < report["requests_total"] == int(LONG[1])
    assert report["rank_agreement"] is True


@needs_scheduler
def test_ctrl_c_with_procs_stops_every_rank_quietly() -> None:
    pytest.importorskip("torch")
    status, stdout, stderr = _interrupt([*LONG, "--procs"], ready="rank 0 [")
    assert status == 130
    steps = _interrupted_steps(_last_line(stderr))
    assert f"interrupted after {steps} steps" in stdout
    assert "yes (2 rank processes, every step)" in stdout
    assert stderr.count("helix-kv simulate:") == 1


@needs_scheduler
def test_ctrl_c_twice_with_procs_ends_the_ranks_at_once() -> None:
    pytest.importorskip("torch")
    status, stdout, stderr = _interrupt([*LONG, "--procs"], ready="rank 0 [", times=2)
    assert status == 130
    assert stdout == ""
    # rank 0's progress line may be cut short by SIGTERM: the message ends that line
    assert _last_line(stderr).endswith("helix-kv simulate: interrupted")


# --- wording ------------------------------------------------------------------------------


@needs_scheduler
def test_procs_with_one_rank_runs_without_a_warning() -> None:
    pytest.importorskip("torch")
    done = run("simulate", "--procs", "--cp", "1", "--requests", "4", "--kv-tokens", "4096")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "rank agreement              n/a (1 rank process: nothing to compare)" in done.stdout


@pytest.mark.parametrize(
    ("cp", "header"),
    [
        ("2", "kv_tokens=16384,"),  # 512 superblocks of 32 tokens: all of it
        ("3", "kv_tokens=16368 (16384 asked),"),  # 341 superblocks of 48 tokens
    ],
)
@needs_scheduler
def test_header_states_the_usable_capacity(cp: str, header: str) -> None:
    done = run("simulate", "--cp", cp, "--requests", "2")
    assert done.returncode == 0, done.stderr
    assert header in done.stdout.splitlines()[0]


# --- "-" for stdin and stdout ---------------------------------------------------------------

TRACE_LINE = '{"id": 0, "arrival_step": 0, "prompt_len": 50, "output_len": 5}\n'


@needs_scheduler
def test_trace_dash_reads_stdin_and_events_dash_writes_stdout() -> None:
    done = subprocess.run(
        [*HELIX_KV, "simulate", "--trace", "-", "--events", "-", "--json"],
        input=TRACE_LINE,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records[0]["type"] == "meta"
    assert {record["type"] for record in records[1:]} == {"step", "request"}
    report = json.loads(done.stderr)  # the report goes to stderr: stdout is the events'
    assert report["config"]["workload"]["path"] == "<stdin>"
    assert report["requests_finished"] == 1


def test_a_bad_trace_on_stdin_is_named_stdin() -> None:
    done = subprocess.run(
        [*HELIX_KV, "simulate", "--trace", "-"],
        input='{"id": 0}\n',
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert assert_one_clean_line(done.stderr).startswith(
        "helix-kv simulate: error: trace <stdin> line 1: missing keys"
    )


def test_events_dash_with_compare_policies_is_a_usage_error() -> None:
    done = run("simulate", "--events", "-", "--compare-policies")
    assert done.returncode == 2
    assert "--events - writes one run's events to stdout" in assert_one_clean_line(done.stderr)


def test_per_policy_events_files_put_the_policy_before_the_extension(tmp_path: Path) -> None:
    """``--events run.log --compare-policies``: ``run.<policy>.log`` per policy (the name
    goes before the extension, whatever it is), as ``--help`` says."""
    done = run("simulate", *SMALL, "--compare-policies", "--events", str(tmp_path / "run.log"))
    assert done.returncode == 0, done.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["run.least_computed_first.log", "run.newest_first.log", "run.priority.log"]
    helped = run("simulate", "--help")
    assert "run.jsonl -> run.newest_first.jsonl" in " ".join(helped.stdout.split())


@pytest.mark.parametrize("kv_tokens", ["100000000000000", "40000000000", "134217760"])
def test_a_pool_past_the_limit_gets_the_real_limit_the_first_time(kv_tokens: str) -> None:
    """Whatever the size (past the core's 2**32 or 2**31 superblocks, or just past the
    simulator's own limit), one message: the simulator's limit and the largest --kv-tokens."""
    done = run("simulate", "--kv-tokens", kv_tokens, "--requests", "2")
    assert done.returncode == 2
    line = assert_one_clean_line(done.stderr)
    assert "the simulator holds at most 4194304 superblocks (--kv-tokens 134217728" in line
    assert "4294967295" not in line
    assert "2147483647" not in line


# --- a value that starts with "-" -----------------------------------------------------------


@pytest.mark.parametrize("argv", [["--step-time", "-1,0,0"], ["--step-time=-1,0,0"]])
def test_a_negative_step_time_gets_the_real_reason(argv: list[str]) -> None:
    done = run("simulate", *argv)
    assert done.returncode == 2
    assert assert_one_clean_line(done.stderr).startswith(
        "helix-kv simulate: error: argument --step-time: fixed_ms must be a finite number >= 0"
    )


# --- a trace key the reader does not know ---------------------------------------------------


@needs_scheduler
def test_an_unknown_trace_key_is_named_once_on_stderr(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    line = '{{"id": {0}, "arrival_step": 0, "prompt_len": 50, "output_len": 5, "prio": 3}}\n'
    trace.write_text(line.format(0) + line.format(1), encoding="utf-8")
    done = run("simulate", "--trace", str(trace), "--json")
    assert done.returncode == 0, done.stderr
    warning = assert_one_clean_line(done.stderr)
    assert warning.startswith(
        f'helix-kv simulate: warning: trace {trace}: unknown key "prio" (first on line 1) '
        "is ignored; the keys read are id, arrival_step, prompt_len, output_len, priority,"
    )
    assert json.loads(done.stdout)["requests_finished"] == 2


# --- a trace line past the simulator's limits -----------------------------------------------


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ('"prompt_len": 2000000, "output_len": 5', "'prompt_len' must be in [1, 1048576], got"),
        ('"prompt_len": 5, "output_len": 2000000', "'output_len' must be in [1, 1048576], got"),
    ],
)
def test_a_trace_line_past_the_length_limit_names_its_line(
    tmp_path: Path, fields: str, reason: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"id": 0, "arrival_step": 0, "prompt_len": 50, "output_len": 5}\n'
        f'{{"id": 1, "arrival_step": 0, {fields}}}\n',
        encoding="utf-8",
    )
    done = run("simulate", "--trace", str(trace))
    assert done.returncode == 2
    line = assert_one_clean_line(done.stderr)
    assert line.startswith(f"helix-kv simulate: error: trace {trace} line 2: {reason}")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            '{"id": 1, "arrival_step": 0, "prompt_len": 5, "output_len": 5\n',
            "not valid JSON (Expecting ',' delimiter at column 62, the end of the line)",
        ),
        (
            '{"id": 1 "arrival_step": 0}\r\n',
            "not valid JSON (Expecting ',' delimiter at column 10)",
        ),
    ],
)
def test_a_json_error_names_its_column_on_the_line(tmp_path: Path, text: str, reason: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(
        b'{"id": 0, "arrival_step": 0, "prompt_len": 50, "output_len": 5}\n' + text.encode()
    )
    done = run("simulate", "--trace", str(trace))
    assert done.returncode == 2
    line = assert_one_clean_line(done.stderr)
    assert line == f"helix-kv simulate: error: trace {trace} line 2: {reason}"


# --- the subpackages that need torch, without torch -----------------------------------------


@pytest.mark.parametrize("package", ["helix_kv.executor", "helix_kv.distributed"])
def test_a_torch_subpackage_without_torch_names_the_extra(package: str) -> None:
    no_torch = "import sys\nsys.modules['torch'] = None  # an import of torch raises\n"
    check = (
        f"try:\n    import {package}\nexcept ImportError as err:\n"
        "    print(type(err).__name__, err.name, err, sep='|')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", no_torch + check],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"ModuleNotFoundError|torch|{package} needs torch, which is not installed; "
        "install it with: pip install 'helix_kv[torch]'"
    )


# --- what stderr holds at exit status 0 -----------------------------------------------------


@needs_scheduler
def test_plot_line_on_stderr_at_exit_0_is_in_the_exit_status_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "run.png"
    done = run("simulate", *SMALL, "--kv-tokens", "65536", "--plot", str(target))
    assert done.returncode == 0, done.stderr
    assert assert_one_clean_line(done.stderr) == f"plot written to {target}"
    guide = (Path(__file__).resolve().parents[1] / "docs" / "user-guide.md").read_text("utf-8")
    table = guide[guide.index("## Exit status and scripting") :]
    row_0 = next(line for line in table.splitlines() if line.startswith("| `0` |"))
    assert "`plot written to FILE` for each plot of `--plot`" in row_0.split("|")[4]


# --- --help ---------------------------------------------------------------------------------


def test_help_of_trace_lists_every_key_the_reader_takes() -> None:
    from helix_kv.simulate.workload import TRACE_KEYS

    done = run("simulate", "--help")
    assert done.returncode == 0, done.stderr
    section = done.stdout[done.stdout.index("  --trace FILE") :]
    section = " ".join(section[: section.index("\n  --", 1)].split())
    named = set(re.findall(r"\b[a-z]+(?:_[a-z]+)*\b", section))
    assert set(TRACE_KEYS) <= named, sorted(set(TRACE_KEYS) - named)


# --- the events file's floats ----------------------------------------------------------------


@needs_scheduler
def test_events_floats_carry_no_float_noise(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE_LINE, encoding="utf-8")
    events = tmp_path / "run.jsonl"
    argv = ["--trace", str(trace), "--step-time", "default", "--events", str(events)]
    done = run("simulate", *argv, "--json")
    assert done.returncode == 0, done.stderr
    lines = events.read_text(encoding="utf-8").splitlines()
    steps = [json.loads(line) for line in lines if '"type": "step"' in line]
    assert steps[1]["duration_ms"] == 5.02102  # the sum itself is 5.021019999999999
    for record in map(json.loads, lines[1:]):
        for value in record.values():
            if isinstance(value, float):
                assert value == float(f"{value:.10g}"), record


# --- the report's rows --------------------------------------------------------------------


@needs_scheduler
def test_host_tier_report_rows_cannot_read_as_a_contradiction() -> None:
    done = run("simulate", *SMALL, "--kv-tokens", "768", "--host-tier-tokens", "4096")
    assert done.returncode == 0, done.stderr
    rows = {
        line[:29].strip(): line[29:].strip()
        for line in done.stdout.splitlines()
        if line.startswith("  ")
    }
    assert rows["recompute-pauses"] == "0"  # every victim went to the host tier
    assert int(rows["suspensions"]) > 0
    assert rows["paused/suspended requests"].endswith("x)")
    assert int(rows["paused/suspended requests"].split()[0]) > 0
    assert "preemptions" not in rows
    assert "preempted requests" not in rows
