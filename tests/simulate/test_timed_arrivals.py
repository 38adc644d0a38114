"""Arrivals in time: a workload whose requests carry ``arrival_ms`` runs on the modelled clock.

The schedules below are worked out by hand under a step-time model of exactly 1 ms a step
(``StepTimeModel(1, 0, 0)``): a request is added at the first step starting at or after its
arrival, its first token comes at the end of its prefill step, an idle group jumps to the next
arrival, and an abort lands before the first step starting at or after its time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from helix_kv import SchedulerConfig, SimulatedCPGroup
from helix_kv.errors import SimulationSetupError, TraceError
from helix_kv.simulate.report import summarize
from helix_kv.simulate.step_loop import outputs_match, run_simulation
from helix_kv.simulate.timing import StepTimeModel
from helix_kv.simulate.workload import (
    RequestSpec,
    WorkloadSpec,
    is_timed,
    parse_trace,
    read_trace,
    synthetic_workload,
    write_trace,
)
from tests.helpers.cli import run_json, usage_error

ONE_MS = StepTimeModel(1.0, 0.0, 0.0)


def group(cp_size: int = 1, kv_tokens: int = 4096, **config: object) -> SimulatedCPGroup:
    tokens_per_block = 8
    return SimulatedCPGroup(
        SchedulerConfig(
            cp_size=cp_size,
            tokens_per_block=tokens_per_block,
            kv_tokens=kv_tokens,
            **config,
        )
    )


def timed(
    request_id: int, arrival_ms: float, prompt: int, output: int, **more: object
) -> RequestSpec:
    return RequestSpec(request_id, 0, prompt, output, arrival_ms=arrival_ms, **more)  # type: ignore[arg-type]


def by_id(result) -> dict:  # type: ignore[no-untyped-def]
    return {outcome.request_id: outcome for outcome in result.outcomes}


def test_hand_computed_schedule_with_the_idle_jump() -> None:
    # A at 0 ms: steps 0, 1, 2 (prefill + first token, then two decodes), done at 3 ms.
    # B at 2.5 ms: the step starting at 3 ms adds it; first token at 4 ms, done at 5 ms.
    # C at 100 ms: the group is idle from 5 ms, the clock jumps to 100; done at 102 ms.
    workload = [timed(0, 0.0, 4, 3), timed(1, 2.5, 4, 2), timed(2, 100.0, 4, 2)]
    result = run_simulation(group(), workload, step_time=ONE_MS, cp_size=1)
    outcomes = by_id(result)
    assert [(o.arrival_ms, o.first_token_ms, o.finish_ms) for o in outcomes.values()] == [
        (0.0, 1.0, 3.0),
        (2.5, 4.0, 5.0),
        (100.0, 101.0, 102.0),
    ]
    # the clock counts the steps run: the idle gap is no step
    assert result.series.clock == list(range(7))
    assert [outcomes[i].arrival_step for i in range(3)] == [0, 3, 5]
    assert result.modelled_time_ms == 102.0
    assert result.outputs_exact
    assert result.rank_agreement
    summary = summarize(result)
    assert summary["ttft_ms_p50"] == 1.0  # TTFTs 1, 1.5 and 1 ms
    # queueing: A and C are scheduled as they arrive, B 0.5 ms after
    assert [outcomes[i].first_scheduled_ms for i in range(3)] == [0.0, 3.0, 100.0]
    assert summary["queue_ms_p99"] == 0.5


def test_arrivals_inside_a_long_step_wait_for_its_end() -> None:
    # 10 ms per step plus 1 ms per token: A's prefill of 8 tokens takes 18 ms; B and C arrive
    # during it and are added together at 18 ms, in queue order.
    model = StepTimeModel(10.0, 1.0, 0.0)
    workload = [timed(0, 0.0, 8, 2), timed(1, 3.0, 8, 1), timed(2, 17.9, 8, 1)]
    result = run_simulation(group(), workload, step_time=model, cp_size=1)
    outcomes = by_id(result)
    assert outcomes[0].first_token_ms == 18.0
    # step 2 at 18 ms: A's decode (1 token) + B's and C's prefills (16 tokens) = 27 ms
    assert outcomes[1].first_token_ms == outcomes[2].first_token_ms == 18.0 + 27.0
    assert outcomes[1].arrival_step == outcomes[2].arrival_step == 1


def test_abort_in_time_lands_before_the_first_step_at_or_after_it() -> None:
    workload = [timed(0, 0.0, 4, 10, abort_ms=2.5), timed(1, 0.0, 4, 3)]
    result = run_simulation(group(), workload, step_time=ONE_MS, cp_size=1)
    outcomes = by_id(result)
    assert outcomes[0].finish_reason == "aborted"
    assert outcomes[0].generated_tokens == 3  # steps 0, 1, 2 ran before 3 ms
    assert outcomes[0].finish_ms == 3.0
    assert outcomes[0].output_exact
    assert outcomes[1].finish_reason == "length"


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_overlap_gives_the_plain_outputs_in_time(cp_size: int) -> None:
    spec = WorkloadSpec(
        num_requests=40, request_rate=2000.0, prompt_len_mean=48, output_len_mean=24
    )
    workload = synthetic_workload(spec)
    model = StepTimeModel(2.0, 0.01, 1e-4)
    plain = run_simulation(group(cp_size, 1024), workload, step_time=model, cp_size=cp_size)
    ahead = run_simulation(
        group(cp_size, 1024), workload, step_time=model, cp_size=cp_size, overlap=True
    )
    assert plain.final_metrics.preemptions > 0  # the pool is tight
    assert plain.outputs_exact
    assert ahead.outputs_exact
    assert outputs_match(ahead, plain)
    assert plain.rank_agreement
    assert ahead.rank_agreement


def test_a_timed_workload_needs_a_step_time_model() -> None:
    with pytest.raises(SimulationSetupError, match="step-time model"):
        run_simulation(group(), [timed(0, 0.0, 4, 2)], cp_size=1)


def test_a_workload_of_steps_and_times_is_refused() -> None:
    mixed = [RequestSpec(0, 0, 4, 2), timed(1, 1.0, 4, 2)]
    with pytest.raises(ValueError, match="arrives in steps or in time"):
        is_timed(mixed)
    with pytest.raises(SimulationSetupError, match="request 1 arrives by arrival_ms"):
        run_simulation(group(), mixed, step_time=ONE_MS, cp_size=1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"arrival_ms": -1.0}, "arrival_ms must be in"),
        ({"arrival_ms": math.nan}, "arrival_ms must be in"),
        ({"arrival_ms": 5.0, "abort_ms": 4.0}, "abort_ms"),
        ({"abort_ms": 4.0}, "abort_ms needs an arrival_ms"),
        ({"arrival_ms": 1.0, "arrival_step": 3}, "no arrival_step"),
        ({"arrival_ms": True}, "arrival_ms must be a number, got True"),
        ({"arrival_ms": 1.0, "abort_ms": "2"}, "abort_ms must be a number, got '2'"),
    ],
)
def test_bad_timed_request_specs_are_refused(fields: dict, message: str) -> None:
    arguments = {"request_id": 7, "arrival_step": 0, "prompt_len": 4, "output_len": 2, **fields}
    with pytest.raises(ValueError, match=message):
        RequestSpec(**arguments)


def test_trace_arrivals_in_ms_and_s_are_read_and_sorted() -> None:
    lines = [
        '{"id": 0, "arrival_s": 1.5, "prompt_len": 4, "output_len": 2}',
        '{"id": 1, "arrival_ms": 250, "prompt_len": 4, "output_len": 2, "abort_s": 1}',
        '{"id": 2, "arrival_ms": 1500.0, "prompt_len": 4, "output_len": 2}',
    ]
    workload = parse_trace(lines)
    assert is_timed(workload)
    assert [(r.request_id, r.arrival_ms, r.abort_ms) for r in workload] == [
        (1, 250.0, 1000.0),
        (0, 1500.0, None),
        (2, 1500.0, None),  # a tie keeps line order
    ]


def line(**fields: object) -> str:
    """A trace line: ``fields`` after id 0, then prompt_len 4 and output_len 2."""
    return json.dumps({"id": 0, **fields, "prompt_len": 4, "output_len": 2})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (line(arrival_ms=-1), "'arrival_ms' must be"),
        (line(arrival_ms=math.nan), "'arrival_ms' must be"),
        (line(arrival_s="1"), "must be a number"),
        (line(arrival_s=True), "must be a number"),
        (line(arrival_ms=1, arrival_s=1), "not both"),
        (line(arrival_ms=1, arrival_step=1), "not both"),
        (line(arrival_ms=5, abort_ms=4), "at or after"),
        (line(arrival_ms=5, abort_step=9), "'abort_step' is a step line's"),
        (line(arrival_step=5, abort_ms=9), "'abort_ms' is a timed line's"),
        (
            line(),
            "missing key 'arrival_step' (the arrival may be in time instead: 'arrival_ms' or "
            "'arrival_s')",
        ),
    ],
)
def test_bad_timed_trace_lines_name_the_line(text: str, message: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace(['{"id": 9, "arrival_ms": 0, "prompt_len": 4, "output_len": 2}', text])
    assert message in str(caught.value)
    assert caught.value.line_number == 2


def test_a_trace_mixing_steps_and_times_names_both_lines() -> None:
    lines = [
        "",
        '{"id": 0, "arrival_step": 0, "prompt_len": 4, "output_len": 2}',
        '{"id": 1, "arrival_ms": 3, "prompt_len": 4, "output_len": 2}',
    ]
    with pytest.raises(TraceError) as caught:
        parse_trace(lines, "t.jsonl")
    assert caught.value.line_number == 3
    assert "line 2 by 'arrival_step'" in str(caught.value)


def test_a_timed_trace_round_trips(tmp_path: Path) -> None:
    spec = WorkloadSpec(num_requests=30, request_rate=7.0, abort_rate=0.3, shared_prefix_len=16)
    workload = synthetic_workload(spec)
    path = tmp_path / "t.jsonl"
    write_trace(workload, path)
    assert read_trace(path) == workload
    assert any(request.abort_ms is not None for request in workload)


def test_request_rate_draws_a_poisson_process_in_ms_and_keeps_the_other_draws() -> None:
    by_step = synthetic_workload(WorkloadSpec(num_requests=4000, seed=5, abort_rate=0.2))
    in_time = synthetic_workload(
        WorkloadSpec(num_requests=4000, seed=5, abort_rate=0.2, request_rate=50.0)
    )
    assert is_timed(in_time)
    assert not is_timed(by_step)
    arrivals = np.array([request.arrival_ms for request in in_time])
    assert arrivals[0] == 0.0
    assert np.all(np.diff(arrivals) >= 0)
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(20.0, rel=0.05)  # 1000 ms / 50
    assert gaps.std() == pytest.approx(20.0, rel=0.1)  # exponential: std = mean
    # the lengths, priorities and who is aborted come from their own streams
    key = lambda r: (r.request_id, r.prompt_len, r.output_len, r.priority)  # noqa: E731
    assert list(map(key, by_step)) == list(map(key, in_time))
    assert [r.abort_step is not None for r in by_step] == [r.abort_ms is not None for r in in_time]


def test_request_rate_with_turns_spaces_turns_by_think_time() -> None:
    spec = WorkloadSpec(num_requests=600, request_rate=1.0, turns=3, think_s=5.0, seed=2)
    workload = synthetic_workload(spec)
    arrival = {request.request_id: request.arrival_ms for request in workload}
    assert [request.request_id for request in workload] == list(range(600))  # arrival order
    # a later turn's prompt starts with the previous turn's prompt and answer
    followers = [r for r in workload if len(r.content.segments) > 1]  # type: ignore[union-attr]
    gaps = []
    for request in followers:
        answer = request.content.segments[-2]  # type: ignore[union-attr]
        gaps.append(arrival[request.request_id] - arrival[answer.source])
    assert len(gaps) == 400
    assert min(gaps) >= 0
    assert np.mean(gaps) == pytest.approx(5000.0, rel=0.1)


# The CLI: every mode with arrivals in time (the ranks are compared every step).
TIMED = [
    "--cp", "2", "--tokens-per-block", "8", "--requests", "32", "--request-rate", "300",
    "--prompt-len", "64", "--output-len", "32", "--seed", "4", "--kv-tokens", "1024",
]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--overlap"],
        ["--host-tier-tokens", "2048"],
        ["--abort-rate", "0.3"],
        ["--spec-tokens", "2"],
        [
            "--prefix-caching",
            "--shared-prefix-len",
            "32",
            "--turns",
            "2",
            "--think-s",
            "0.05",
        ],
        ["--cp", "4", "--step-time", "2,0.01,0.0001"],
    ],
    ids=["plain", "overlap", "host_tier", "abort", "drafts", "prefix_cache", "cp4"],
)
def test_cli_runs_every_mode_in_time(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    report = run_json(capsys, *TIMED, *extra)
    assert report["rank_agreement"] is True
    assert report["outputs_exact"] is True
    assert report["config"]["workload"]["request_rate"] == 300.0
    assert "step_time_model" in report["config"]
    assert report["modelled_time_ms"] > 0
    assert report["ttft_ms_p99"] >= report["ttft_ms_p50"] > 0


def test_cli_procs_in_time_agrees_with_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    in_process = run_json(capsys, *TIMED)
    with_procs = run_json(capsys, *TIMED, "--procs")
    for key in ("steps", "preemptions", "generated_tokens", "modelled_time_ms", "ttft_ms_p99"):
        assert with_procs[key] == in_process[key]


def test_cli_timed_trace_uses_the_default_step_time_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "timed.jsonl"
    lines = [
        {"id": 0, "arrival_ms": 0, "prompt_len": 16, "output_len": 4},
        {"id": 1, "arrival_s": 2.0, "prompt_len": 16, "output_len": 4},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = run_json(capsys, "--trace", str(trace), "--cp", "2")
    assert report["config"]["workload"]["arrivals"] == "ms"
    assert report["config"]["step_time_model"]["source"] == "default"
    # the second request arrives after the first is done: the run ends one request later
    assert report["modelled_time_ms"] > 2000.0
    assert report["steps"] == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--request-rate", "5", "--arrival-rate", "1"], "give one"),
        (["--request-rate", "0"], "--request-rate: must be a number of requests per second"),
        (["--request-rate", "nan"], "--request-rate: must be"),
        (["--think-s", "3", "--turns", "2"], "--think-s is the gap between turns in time"),
        (["--request-rate", "5", "--think-s", "3"], "--think-s is the gap between turns in time"),
        (["--request-rate", "5", "--turns", "2", "--think-steps", "3"], "give --think-s"),
    ],
)
def test_cli_timed_flag_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in usage_error(capsys, *argv)
