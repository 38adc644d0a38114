"""Synthetic workloads, deterministic tokens and the JSONL trace reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helix_kv.simulate.tokens import VOCAB_SIZE, expected_output, prompt_tokens, sampled_tokens
from helix_kv.simulate.workload import (
    LengthDistribution,
    RequestSpec,
    TraceError,
    WorkloadSpec,
    parse_trace,
    read_trace,
    synthetic_workload,
    write_trace,
)


def test_same_seed_same_workload_other_seed_differs() -> None:
    spec = WorkloadSpec(num_requests=50, seed=7)
    assert synthetic_workload(spec) == synthetic_workload(spec)
    assert synthetic_workload(spec) != synthetic_workload(WorkloadSpec(num_requests=50, seed=8))


def test_synthetic_shape_and_bounds() -> None:
    spec = WorkloadSpec(num_requests=500, seed=1, prompt_len_max=900, output_len_max=300)
    workload = synthetic_workload(spec)
    assert [r.request_id for r in workload] == list(range(500))
    arrivals = [r.arrival_step for r in workload]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] == 0
    assert all(1 <= r.prompt_len <= 900 for r in workload)
    assert all(1 <= r.output_len <= 300 for r in workload)
    assert {r.priority for r in workload} <= {0, 1, 2}


def test_lognormal_mean_is_near_the_requested_mean() -> None:
    workload = synthetic_workload(WorkloadSpec(num_requests=4000, seed=3, prompt_len_max=100_000))
    mean = np.mean([r.prompt_len for r in workload])
    assert abs(mean - WorkloadSpec().prompt_len_mean) / WorkloadSpec().prompt_len_mean < 0.05


def test_arrival_rate_sets_the_span_and_zero_means_all_at_once() -> None:
    fast = synthetic_workload(WorkloadSpec(num_requests=400, arrival_rate=2.0))
    assert 150 <= fast[-1].arrival_step <= 250
    burst = synthetic_workload(WorkloadSpec(num_requests=20, arrival_rate=0))
    assert {r.arrival_step for r in burst} == {0}


def test_fixed_and_uniform_distributions() -> None:
    fixed = synthetic_workload(
        WorkloadSpec(num_requests=10, length_distribution=LengthDistribution.FIXED)
    )
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(384, 192)}
    uniform = synthetic_workload(
        WorkloadSpec(
            num_requests=300, prompt_len_mean=10, length_distribution=LengthDistribution.UNIFORM
        )
    )
    assert {r.prompt_len for r in uniform} <= set(range(1, 20))


def test_knobs_draw_from_independent_streams() -> None:
    base = synthetic_workload(WorkloadSpec(num_requests=30, seed=5))
    longer = synthetic_workload(WorkloadSpec(num_requests=30, seed=5, output_len_mean=400))
    assert [r.prompt_len for r in base] == [r.prompt_len for r in longer]
    assert [r.arrival_step for r in base] == [r.arrival_step for r in longer]
    assert [r.output_len for r in base] != [r.output_len for r in longer]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_requests": 0}, "requests must be >= 1"),
        ({"arrival_rate": -1.0}, "arrival rate"),
        ({"arrival_rate": float("inf")}, "arrival rate"),
        ({"prompt_len_mean": 0}, "prompt len mean"),
        ({"output_len_mean": 50, "output_len_max": 10}, "output len max (10)"),
        ({"priority_levels": 0}, "priority levels"),
        ({"abort_rate": 1.5}, "abort rate must be in .0, 1., got 1.5"),
        ({"abort_rate": float("nan")}, "abort rate"),
    ],
)
def test_bad_workload_spec(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WorkloadSpec(**change).validate()


def test_abort_rate_aborts_a_seeded_share_before_each_could_finish() -> None:
    plain = synthetic_workload(WorkloadSpec(num_requests=2000, seed=4))
    spec = WorkloadSpec(num_requests=2000, seed=4, abort_rate=0.25)
    workload = synthetic_workload(spec)
    assert workload == synthetic_workload(spec)
    assert all(r.abort_step is None for r in plain)
    aborted = [r for r in workload if r.abort_step is not None]
    assert abs(len(aborted) / 2000 - 0.25) < 0.04
    # every abort lands between arrival and the earliest step the request could finish
    assert all(r.arrival_step <= r.abort_step < r.arrival_step + r.output_len for r in aborted)
    assert len({r.abort_step - r.arrival_step for r in aborted}) > 10
    # the other knobs' streams are untouched
    strip = [RequestSpec(r.request_id, r.arrival_step, r.prompt_len, r.output_len, r.priority)
             for r in workload]  # fmt: skip
    assert strip == plain
    every = synthetic_workload(WorkloadSpec(num_requests=50, seed=4, abort_rate=1.0))
    assert all(r.abort_step is not None for r in every)
    assert WorkloadSpec(abort_rate=0.1).to_dict()["abort_rate"] == 0.1


def test_trace_abort_step_is_optional_and_round_trips(tmp_path: Path) -> None:
    lines = _lines(
        {**GOOD, "abort_step": 3},
        {**GOOD, "id": 2, "abort_step": None},
        {**GOOD, "id": 3, "arrival_step": 2, "abort_step": 2},
    )
    requests = parse_trace(lines)
    assert [r.abort_step for r in requests] == [3, None, 2]
    workload = synthetic_workload(WorkloadSpec(num_requests=40, seed=2, abort_rate=0.5))
    path = tmp_path / "trace.jsonl"
    write_trace(workload, path)
    assert read_trace(path) == workload
    records = [json.loads(line) for line in path.read_text().splitlines()]
    # only requests that are aborted carry the key
    assert [("abort_step" in r) for r in records] == [w.abort_step is not None for w in workload]


def test_tokens_are_deterministic_and_in_vocabulary() -> None:
    prompt = prompt_tokens(12, 100)
    assert prompt.dtype == np.int32
    assert len(prompt) == 100
    assert np.array_equal(prompt, prompt_tokens(12, 100))
    assert ((prompt >= 0) & (prompt < VOCAB_SIZE)).all()
    assert not np.array_equal(prompt, prompt_tokens(13, 100))
    out = expected_output(2**63 + 5, 20)
    assert out.dtype == np.int32
    assert np.array_equal(out[3:5], sampled_tokens(np.array([2**63 + 5] * 2, np.uint64), [3, 4]))


def _lines(*records: object) -> list[str]:
    return [r if isinstance(r, str) else json.dumps(r) for r in records]


def test_trace_round_trip(tmp_path: Path) -> None:
    workload = synthetic_workload(WorkloadSpec(num_requests=25, seed=2))
    path = tmp_path / "trace.jsonl"
    write_trace(workload, path)
    assert read_trace(path) == workload


def test_trace_orders_by_arrival_then_line_and_ignores_extra_keys() -> None:
    lines = _lines(
        {"id": 9, "arrival_step": 5, "prompt_len": 3, "output_len": 1},
        "",
        {"id": 4, "arrival_step": 0, "prompt_len": 8, "output_len": 2, "model": "x"},
        {"id": 7, "arrival_step": 5, "prompt_len": 1, "output_len": 9, "priority": -2},
    )
    requests = parse_trace(lines)
    assert [r.request_id for r in requests] == [4, 9, 7]
    assert requests[2] == RequestSpec(7, 5, 1, 9, -2)


GOOD = {"id": 1, "arrival_step": 0, "prompt_len": 4, "output_len": 2}


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ({"id": 2, "arrival_step": 0, "output_len": 2}, "missing key 'prompt_len'"),
        ({"id": 2}, "missing keys 'arrival_step', 'prompt_len', 'output_len'"),
        ({**GOOD, "id": 2, "prompt_len": 0}, "'prompt_len' must be in [1,"),
        ({**GOOD, "id": 2, "output_len": "5"}, "'output_len' must be an integer, got \"5\""),
        ({**GOOD, "id": 2, "arrival_step": 1.5}, "'arrival_step' must be an integer, got 1.5"),
        ({**GOOD, "id": -1}, "'id' must be in [0,"),
        ({**GOOD, "id": True}, "'id' must be an integer, got true"),
        ({**GOOD, "id": 2, "priority": 2**40}, "'priority' must fit in 32 bits"),
        (
            {**GOOD, "id": 2, "arrival_step": 5, "abort_step": 4},
            "'abort_step' (4) must be >= 'arrival_step' (5)",
        ),
        ({**GOOD, "id": 2, "abort_step": "3"}, "'abort_step' must be an integer, got \"3\""),
        ({**GOOD, "id": 1}, "duplicate id 1 (first used on line 1)"),
    ],
)
def test_bad_trace_line_names_line_and_reason(bad: object, reason: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace(_lines(GOOD, "   ", bad), "t.jsonl")
    message = str(caught.value)
    assert message.startswith("trace t.jsonl line 3: ")
    assert reason in message
    assert caught.value.line_number == 3
    assert "\n" not in message


def test_empty_and_missing_trace(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(empty)
    with pytest.raises(TraceError, match="cannot read it"):
        read_trace(tmp_path / "absent.jsonl")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="not UTF-8"):
        read_trace(binary)
