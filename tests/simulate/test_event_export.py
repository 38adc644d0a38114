"""``helix-kv simulate --events FILE`` and the ``events=`` hook of ``run_simulation``.

The file's schema (every line, every key and its type), one record per request, contiguous
steps, figures that add up to the report's, the hook seeing exactly what the file holds, the
suspended count against the scheduler's own, and ``--events`` with ``--compare-policies``,
``--procs`` and ``--max-steps``.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import helix_kv
from helix_kv.cli import main
from helix_kv.simulate.events import (
    EVENTS_SCHEMA,
    EVENTS_SCHEMA_VERSION,
    EventLog,
    EventSink,
    JsonlEventWriter,
    RequestEvent,
    StepEvent,
)
from helix_kv.simulate.report import summarize
from helix_kv.simulate.step_loop import run_simulation
from helix_kv.simulate.timing import DEFAULT_STEP_TIME
from helix_kv.simulate.workload import WorkloadSpec, synthetic_workload

from ..helpers.scheduler import needs_scheduler

pytestmark = needs_scheduler

#: 24 requests at once under a tight budget: preemptions, and with --abort-rate, aborts.
TIGHT = [
    "--cp", "2", "--tokens-per-block", "8", "--requests", "24", "--arrival-rate", "0",
    "--prompt-len", "96", "--output-len", "48", "--seed", "3", "--kv-tokens", "1024",
]  # fmt: skip
ABORTING = [*TIGHT, "--abort-rate", "0.3"]
#: One rank suspending to a host tier (non_helix mode).
SUSPENDING = [
    "--cp", "1", "--mode", "non_helix", "--host-tier-tokens", "4096", "--kv-tokens", "1024",
    "--tokens-per-block", "8", "--requests", "24", "--arrival-rate", "2", "--prompt-len", "96",
    "--output-len", "48", "--seed", "5",
]  # fmt: skip

STEP_TYPES: dict[str, type | tuple[type, ...]] = {
    "type": str,
    "step": int,
    "clock": int,
    "running": int,
    "waiting": int,
    "suspended": int,
    "kv_used_superblocks": int,
    "kv_utilization": float,
    "scheduled_tokens": int,
    "context_tokens": int,
    "decode_tokens": int,
    "kv_tokens_read": int,
    "samples": int,
    "preemptions": int,
    "suspensions": int,
    "resumes": int,
    "sat_out": int,
    "aborted": int,
    "finished": int,
    "start_ms": (float, type(None)),
    "duration_ms": (float, type(None)),
    "cached_tokens": int,
}
REQUEST_TYPES: dict[str, type | tuple[type, ...]] = {
    "type": str,
    "request_id": int,
    "prompt_tokens": int,
    "finish_reason": str,
    "arrival_step": int,
    "first_token_step": (int, type(None)),
    "finish_step": int,
    "generated_tokens": int,
    "victim_choices": int,
    "recomputed_tokens": int,
    "steps_waited": int,
    "output_exact": bool,
    "arrival_ms": (float, type(None)),
    "first_token_ms": (float, type(None)),
    "finish_ms": (float, type(None)),
    "cached_tokens": int,
}
META_KEYS = {"type", "schema", "version", "step_time_model", "config"}


def run_with_events(
    capsys: pytest.CaptureFixture[str], path: Path, *argv: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run with ``--events path --json``; return the report and the parsed lines."""
    status = main(["simulate", *argv, "--events", str(path), "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return json.loads(captured.out), read_events(path)


def read_events(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines, "the events file is empty"
    return [json.loads(line) for line in lines]  # every line is one JSON object


def nearest_rank(values: list[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least q% of them at or below."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]


def check_types(record: dict[str, Any], types: dict[str, type | tuple[type, ...]]) -> None:
    assert set(record) == set(types), set(record) ^ set(types)
    for key, expected in types.items():
        value = record[key]
        # bool is an int in Python: an int field must not hold a bool, nor a float an int
        if expected is int or expected == (int, type(None)):
            assert not isinstance(value, bool), (key, value)
        assert isinstance(value, expected), (key, value)


def split(records: list[dict[str, Any]]) -> tuple[dict, list[dict], list[dict]]:
    meta, *rest = records
    assert meta["type"] == "meta"
    steps = [r for r in rest if r["type"] == "step"]
    requests = [r for r in rest if r["type"] == "request"]
    assert len(steps) + len(requests) == len(rest), "a line of another type"
    return meta, steps, requests


@pytest.mark.parametrize("model", [False, True], ids=["steps", "modelled"])
def test_events_file_schema_and_figures_match_the_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: bool
) -> None:
    path = tmp_path / "run.jsonl"
    argv = [*ABORTING, *(["--step-time", "default"] if model else [])]
    report, records = run_with_events(capsys, path, *argv)
    meta, steps, requests = split(records)

    assert set(meta) == META_KEYS
    assert meta["schema"] == EVENTS_SCHEMA
    assert meta["version"] == EVENTS_SCHEMA_VERSION
    assert meta["config"] == report["config"]
    assert meta["step_time_model"] == (DEFAULT_STEP_TIME.to_dict() if model else None)
    for step in steps:
        check_types(step, STEP_TYPES)
    for request in requests:
        check_types(request, REQUEST_TYPES)
        assert request["finish_reason"] in ("length", "aborted")

    # steps: contiguous from 0, one per scheduler step, on a rising clock
    assert [s["step"] for s in steps] == list(range(report["steps"]))
    clocks = [s["clock"] for s in steps]
    assert all(b > a for a, b in zip(clocks, clocks[1:]))
    # one record per request, each id once
    assert report["requests_finished"] == report["requests_total"] - report["requests_aborted"]
    assert sorted(r["request_id"] for r in requests) == list(range(report["requests_total"]))
    assert report["preemptions"] > 0  # the run puts the figures to the test
    assert report["requests_aborted"] > 0

    def total(records: list[dict], key: str) -> int:
        return sum(r[key] for r in records)

    assert total(steps, "preemptions") == report["preemptions"]
    assert total(steps, "suspensions") == report["suspensions"] == 0
    assert total(steps, "sat_out") == report["sat_out"]
    assert total(steps, "scheduled_tokens") == report["computed_tokens"]
    assert total(steps, "samples") == report["generated_tokens"]
    assert total(steps, "finished") == report["requests_finished"]
    # aborts applied after the last step appear only as request records
    assert total(steps, "aborted") <= report["requests_aborted"]
    assert total(requests, "generated_tokens") == report["generated_tokens"]
    assert total(requests, "recomputed_tokens") == report["recomputed_tokens"]
    # every victim choice is a recompute-pause or a suspend
    assert total(requests, "victim_choices") == report["preemptions"] + report["suspensions"]
    assert sum(r["finish_reason"] == "aborted" for r in requests) == report["requests_aborted"]
    assert sum(r["victim_choices"] > 0 for r in requests) == report["preempted_requests"]
    assert all(r["output_exact"] for r in requests)
    assert report["outputs_exact"]
    for step in steps:
        assert step["scheduled_tokens"] == step["context_tokens"] + step["decode_tokens"]
        assert step["kv_tokens_read"] >= step["scheduled_tokens"]  # each token reads itself
    utilization = [s["kv_utilization"] for s in steps]
    assert max(utilization) == report["kv_utilization_peak"]
    assert float(np.mean(utilization)) == report["kv_utilization_mean"]
    completed = [r for r in requests if r["finish_reason"] == "length"]
    waited = [r["steps_waited"] for r in completed]
    assert nearest_rank(waited, 50) == report["waiting_steps_p50"]
    assert nearest_rank(waited, 99) == report["waiting_steps_p99"]
    for request in requests:
        assert request["arrival_step"] <= request["finish_step"]
        if request["finish_reason"] == "length":
            assert request["first_token_step"] is not None
            assert request["first_token_step"] <= request["finish_step"]

    timed = [s["start_ms"] for s in steps] + [r["finish_ms"] for r in requests]
    if not model:
        assert all(value is None for value in timed)
        assert "ttft_ms_p50" not in report
        return
    # modelled: each step starts where the last ended, plus the fixed cost of idle clock steps
    fixed = DEFAULT_STEP_TIME.fixed_ms
    for before, after in zip(steps, steps[1:]):
        idle = after["clock"] - before["clock"] - 1
        expected = before["start_ms"] + before["duration_ms"] + idle * fixed
        assert after["start_ms"] == pytest.approx(expected)
    end = steps[-1]["start_ms"] + steps[-1]["duration_ms"]
    assert report["modelled_time_ms"] == pytest.approx(end)
    by_step = {s["clock"]: s for s in steps}
    for request in completed:
        first = by_step[request["first_token_step"]]
        assert request["first_token_ms"] == pytest.approx(first["start_ms"] + first["duration_ms"])
        last = by_step[request["finish_step"]]
        assert request["finish_ms"] == pytest.approx(last["start_ms"] + last["duration_ms"])
    ttft = [r["first_token_ms"] - r["arrival_ms"] for r in completed]
    # the file's floats are cut to FLOAT_DIGITS significant digits, the report's are whole
    assert report["ttft_ms_p50"] == pytest.approx(nearest_rank(ttft, 50))
    assert report["ttft_ms_p99"] == pytest.approx(nearest_rank(ttft, 99))
    tpot = [
        (r["finish_ms"] - r["first_token_ms"]) / (r["generated_tokens"] - 1)
        for r in completed
        if r["generated_tokens"] >= 2
    ]
    assert report["tpot_ms_p50"] == pytest.approx(nearest_rank(tpot, 50))
    assert report["tpot_ms_p99"] == pytest.approx(nearest_rank(tpot, 99))


def test_the_hook_gets_what_the_file_holds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The library's ``events=`` hook, given the same run, sees every record of the file."""
    path = tmp_path / "run.jsonl"
    report, records = run_with_events(capsys, path, *TIGHT, "--step-time", "default")
    _, steps, requests = split(records)

    spec = WorkloadSpec(
        num_requests=24, seed=3, arrival_rate=0.0, prompt_len_mean=96, output_len_mean=48
    )
    config = helix_kv.SchedulerConfig(cp_size=2, cp_rank=0, tokens_per_block=8, kv_tokens=1024)
    log = EventLog()
    assert isinstance(log, EventSink)
    result = run_simulation(
        helix_kv.SimulatedCPGroup(config),
        synthetic_workload(spec),
        events=log,
        step_time=DEFAULT_STEP_TIME,
        cp_size=2,
    )
    assert all(isinstance(event, StepEvent) for event in log.steps)
    assert all(isinstance(event, RequestEvent) for event in log.requests)
    # the file holds the records, their floats cut to FLOAT_DIGITS significant digits
    assert [pytest.approx(event.to_record()) for event in log.steps] == steps
    assert [pytest.approx(event.to_record()) for event in log.requests] == requests
    assert summarize(result)["ttft_ms_p99"] == report["ttft_ms_p99"]


def test_a_step_record_precedes_the_requests_it_finished(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "run.jsonl"
    _, records = run_with_events(capsys, path, *TIGHT)
    last_step: dict[str, Any] | None = None
    finished_in_step = 0
    for record in records[1:]:
        if record["type"] == "step":
            if last_step is not None:
                assert finished_in_step == last_step["finished"]
            last_step, finished_in_step = record, 0
        else:
            assert last_step is not None
            assert record["finish_step"] == last_step["clock"]
            finished_in_step += 1
    assert last_step is not None
    assert finished_in_step == last_step["finished"]


class _SuspendedCheck:
    """A sink that compares each step's counts with the scheduler's own, read at the end of
    the step (when the sink is called)."""

    def __init__(self, scheduler: helix_kv.Scheduler) -> None:
        self.scheduler = scheduler
        self.steps = 0
        self.suspended_seen = 0

    def on_step(self, event: StepEvent) -> None:
        assert event.suspended == self.scheduler.num_suspended
        assert event.running == self.scheduler.num_running
        assert event.waiting == self.scheduler.num_waiting
        self.steps += 1
        self.suspended_seen = max(self.suspended_seen, event.suspended)

    def on_request(self, event: RequestEvent) -> None:
        pass


def test_suspended_counts_are_the_schedulers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "run.jsonl"
    report, records = run_with_events(capsys, path, *SUSPENDING)
    _, steps, _ = split(records)
    assert report["suspensions"] > 0
    assert sum(s["suspensions"] for s in steps) == report["suspensions"]
    assert sum(s["resumes"] for s in steps) == report["suspensions"]  # every one came back
    assert max(s["suspended"] for s in steps) > 0
    assert steps[-1]["suspended"] == 0

    # the same run on one bare Scheduler (it satisfies the contract), read by the sink
    config = helix_kv.SchedulerConfig(
        cp_size=1,
        cp_rank=0,
        tokens_per_block=8,
        kv_tokens=1024,
        serving_mode="non_helix",
        host_tier_superblocks=512,
    )
    scheduler = helix_kv.Scheduler(config)
    check = _SuspendedCheck(scheduler)
    spec = WorkloadSpec(
        num_requests=24, seed=5, arrival_rate=2.0, prompt_len_mean=96, output_len_mean=48
    )
    run_simulation(scheduler, synthetic_workload(spec), events=check)
    assert check.steps == len(steps)
    assert check.suspended_seen == max(s["suspended"] for s in steps)


def test_compare_policies_writes_one_file_per_policy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "run.jsonl"
    status = main(["simulate", *TIGHT, "--compare-policies", "--events", str(path), "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    reports = json.loads(captured.out)["policies"]
    assert not path.exists()
    for policy, report in reports.items():
        meta, steps, requests = split(read_events(tmp_path / f"run.{policy}.jsonl"))
        assert meta["config"]["scheduler"]["victim_policy"] == policy
        assert len(steps) == report["steps"]
        assert sum(s["preemptions"] for s in steps) == report["preemptions"]
        assert len(requests) == report["requests_total"]


def test_max_steps_writes_the_steps_run_and_the_requests_done(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "run.jsonl"
    report, records = run_with_events(capsys, path, *TIGHT, "--max-steps", "40")
    _, steps, requests = split(records)
    assert len(steps) == 40 == report["steps"]
    assert len(requests) == report["requests_finished"] + report["requests_aborted"]
    assert len(requests) < report["requests_total"]


def test_procs_writes_the_same_events_as_one_process(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Under --procs rank 0's process writes the file: the events are rank-invariant, so they
    are those of the in-process run."""
    pytest.importorskip("torch.distributed")
    small = [*TIGHT, "--requests", "8", "--step-time", "default"]
    _, in_process = run_with_events(capsys, tmp_path / "one.jsonl", *small)
    _, procs = run_with_events(capsys, tmp_path / "procs.jsonl", *small, "--procs")
    assert procs[0]["config"]["procs"] is True
    assert procs[1:] == in_process[1:]


def test_events_into_a_missing_folder_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "nowhere" / "run.jsonl"
    assert main(["simulate", *TIGHT, "--events", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"helix-kv simulate: error: --events {target}: folder {target.parent} does not exist"
    ]


def test_events_onto_a_folder_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["simulate", *TIGHT, "--events", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"helix-kv simulate: error: --events {tmp_path}: cannot write it")
    assert json.loads(captured.out)["error"]["type"] == "UsageError"


def test_writer_on_an_open_file_leaves_it_open() -> None:
    handle = io.StringIO()
    with JsonlEventWriter(handle, {"cp": 1}) as writer:
        writer.on_request(
            RequestEvent(
                request_id=7,
                prompt_tokens=3,
                finish_reason="aborted",
                arrival_step=0,
                first_token_step=None,
                finish_step=2,
                generated_tokens=0,
                victim_choices=0,
                recomputed_tokens=0,
                steps_waited=2,
                output_exact=True,
            )
        )
    assert not handle.closed
    meta, request = (json.loads(line) for line in handle.getvalue().splitlines())
    assert meta["config"] == {"cp": 1}
    assert meta["step_time_model"] is None
    assert request["type"] == "request"
    assert request["first_token_step"] is None


def test_events_onto_the_trace_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    text = '{"id": 0, "arrival_step": 0, "prompt_len": 8, "output_len": 4}\n'
    trace.write_text(text, encoding="utf-8")
    assert main(["simulate", "--trace", str(trace), "--events", str(trace)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"helix-kv simulate: error: --events {trace} is the --trace file; give another"
    assert trace.read_text(encoding="utf-8") == text  # left alone
