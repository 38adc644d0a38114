"""The step-time model: its arithmetic on a hand-computed run, the TTFT/TPOT percentiles in
modelled ms, the report with and without a model, and its flags' errors (real subprocesses)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import helix_kv
from helix_kv.cli import main
from helix_kv.errors import SimulationSetupError
from helix_kv.simulate.events import EventLog
from helix_kv.simulate.report import format_table, modelled_figures, summarize
from helix_kv.simulate.step_loop import RequestOutcome, SimulationResult, StepSeries, run_simulation
from helix_kv.simulate.timing import (
    DEFAULT_STEP_TIME,
    MAX_COEFFICIENT_MS,
    PROFILE_KEYS,
    StepTimeModel,
    fit_step_time,
    kv_tokens_read,
    load_profile,
    save_profile,
)
from helix_kv.simulate.workload import RequestSpec

from ..helpers.cli import one_usage_line, run_command
from ..helpers.scheduler import needs_scheduler

SMALL = [
    "--cp", "2", "--tokens-per-block", "8", "--requests", "24", "--arrival-rate", "0",
    "--prompt-len", "96", "--output-len", "48", "--seed", "3", "--kv-tokens", "1024",
]  # fmt: skip
MODELLED_KEYS = {
    "modelled_time_ms",
    "queue_ms_p50",
    "queue_ms_p90",
    "queue_ms_p99",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p90",
    "tpot_ms_p99",
    "tpot_steps_p50",
    "tpot_steps_p90",
    "tpot_steps_p99",
}


def test_step_ms_is_the_documented_formula() -> None:
    model = StepTimeModel(fixed_ms=2.0, per_token_ms=0.5, per_kv_token_ms=0.01)
    # 2 + 0.5 * 10 + 0.01 * 1000 / 2
    assert model.step_ms(10, 1000, 2) == pytest.approx(12.0)
    assert model.step_ms(0, 0, 4) == 2.0
    assert model.idle_step_ms == 2.0


@needs_scheduler
def test_kv_tokens_read_counts_what_each_entry_attends_to() -> None:
    config = helix_kv.SchedulerConfig(cp_size=1, cp_rank=0, tokens_per_block=4, kv_tokens=1024)
    scheduler = helix_kv.Scheduler(config)
    scheduler.add_request(0, list(range(1, 11)), 4)  # 10 prompt tokens
    first = scheduler.schedule()
    assert kv_tokens_read(first) == 10  # one chunk: start 0 + length 10
    scheduler.update([5])
    scheduler.add_request(1, list(range(1, 7)), 4)  # 6 prompt tokens
    second = scheduler.schedule()
    # request 0 decodes at position 10 (11 tokens with it), request 1 prefills 6
    assert list(second.generation_positions) == [10]
    assert kv_tokens_read(second) == 11 + 6


#: Request 0 arrives at clock step 2 (8 prompt tokens, 3 output), request 1 at 10 (4 and 1).
HAND_WORKLOAD = [
    RequestSpec(request_id=0, arrival_step=2, prompt_len=8, output_len=3),
    RequestSpec(request_id=1, arrival_step=10, prompt_len=4, output_len=1),
]


@needs_scheduler
@pytest.mark.parametrize("cp", [1, 2])
def test_modelled_times_on_a_hand_computed_run(cp: int) -> None:
    """fixed 1 ms, 0.5 ms per token, 0.25 ms per KV token read per rank (0.25 * cp per
    global KV token, so the timeline is the same at any cp):

    idle clock 0-1 -> 2 ms; clock 2: prefill 8, reads 8 -> 1 + 4 + 2 = 7 (ends 9, request 0's
    first token); clock 3: decode at 8, reads 9 -> 3.75 (ends 12.75); clock 4: reads 10 -> 4
    (ends 16.75, request 0 done); idle clock 5-9 -> 5 ms (21.75, request 1 arrives); clock 10:
    prefill 4, reads 4 -> 4 (ends 25.75, request 1 done).
    """
    model = StepTimeModel(fixed_ms=1.0, per_token_ms=0.5, per_kv_token_ms=0.25 * cp)
    config = helix_kv.SchedulerConfig(cp_size=cp, cp_rank=0, tokens_per_block=4, kv_tokens=1024)
    log = EventLog()
    result = run_simulation(
        helix_kv.SimulatedCPGroup(config),
        HAND_WORKLOAD,
        events=log,
        step_time=model,
        config={"cp": cp},  # the model's cp comes from the config when not given
    )
    assert [e.clock for e in log.steps] == [2, 3, 4, 10]
    assert [e.kv_tokens_read for e in log.steps] == [8, 9, 10, 4]
    assert [e.start_ms for e in log.steps] == [2.0, 9.0, 12.75, 21.75]
    assert [e.duration_ms for e in log.steps] == [7.0, 3.75, 4.0, 4.0]
    assert result.modelled_time_ms == 25.75

    first, second = sorted(result.outcomes, key=lambda o: o.request_id)
    assert (first.arrival_ms, first.first_token_ms, first.finish_ms) == (2.0, 9.0, 16.75)
    assert (second.arrival_ms, second.first_token_ms, second.finish_ms) == (21.75, 25.75, 25.75)
    summary = summarize(result)
    assert summary["ttft_ms_p50"] == 4.0  # request 1: 25.75 - 21.75
    assert summary["ttft_ms_p99"] == 7.0  # request 0: 9 - 2
    # TPOT only for requests with two tokens or more: request 0, (16.75 - 9) / 2
    assert summary["tpot_ms_p50"] == summary["tpot_ms_p99"] == 3.875
    assert summary["tpot_steps_p50"] == 1.0  # (4 - 2) / 2
    assert summary["modelled_time_ms"] == 25.75


def _outcome(request_id: int, ttft: float, tpot: float, tokens: int) -> RequestOutcome:
    return RequestOutcome(
        request_id=request_id,
        arrival_step=0,
        first_token_step=0,
        finish_step=tokens - 1,
        generated_tokens=tokens,
        victim_choices=0,
        recomputed_tokens=0,
        steps_waited=0,
        output_exact=True,
        arrival_ms=100.0,
        first_token_ms=100.0 + ttft,
        finish_ms=100.0 + ttft + tpot * (tokens - 1),
    )


def test_percentiles_are_nearest_rank_over_finished_requests() -> None:
    outcomes = [_outcome(i, ttft=float(i), tpot=0.5 * i, tokens=3) for i in range(1, 101)]
    outcomes.append(_outcome(101, ttft=1e6, tpot=1e6, tokens=1))  # one token: no TPOT
    aborted = _outcome(102, ttft=1e6, tpot=1e6, tokens=5)
    outcomes.append(
        RequestOutcome(**{**aborted.__dict__, "finish_reason": "aborted"})  # not counted
    )
    result = SimulationResult(
        requests_total=len(outcomes),
        outcomes=outcomes,
        series=StepSeries(),
        final_metrics=helix_kv.SchedulerMetrics(
            **{
                **dict.fromkeys(helix_kv.SchedulerMetrics.FIELDS, 0),
                "kv_capacity_superblocks": 1,
            }
        ),
        generated_tokens=0,
        clock=0,
        rank_agreement=True,
        modelled_time_ms=1234.5,
    )
    figures = modelled_figures(result)
    assert set(figures) == MODELLED_KEYS
    # TTFT over 101 finished requests: 1..100 and 1e6; p50 is the 51st, p99 the 100th
    assert figures["ttft_ms_p50"] == 51.0
    assert figures["ttft_ms_p90"] == 91.0
    assert figures["ttft_ms_p99"] == 100.0
    # TPOT over the 100 with three tokens: 0.5..50
    assert figures["tpot_ms_p50"] == 25.0
    assert figures["tpot_ms_p90"] == 45.0
    assert figures["tpot_ms_p99"] == 49.5
    assert figures["tpot_steps_p50"] == 1.0  # finish_step 2, first 0, 2 tokens after the first
    assert figures["modelled_time_ms"] == 1234.5
    result.modelled_time_ms = None
    assert modelled_figures(result) == {}


@needs_scheduler
def test_without_a_model_the_report_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not MODELLED_KEYS & set(report)
    assert "step_time_model" not in report["config"]
    assert main(["simulate", *SMALL]) == 0
    table = capsys.readouterr().out
    assert "modelled" not in table
    assert " ms" not in table


@needs_scheduler
def test_with_a_model_the_report_labels_modelled_ms(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL, "--step-time", "default", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= MODELLED_KEYS
    assert report["config"]["step_time_model"] == DEFAULT_STEP_TIME.to_dict()
    assert 0 < report["ttft_ms_p50"] <= report["ttft_ms_p99"] < report["modelled_time_ms"]
    assert 0 < report["tpot_ms_p50"] <= report["tpot_ms_p99"]
    assert report["tpot_steps_p50"] >= 1.0

    assert main(["simulate", *SMALL, "--step-time", "default"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1:] == format_table(report).splitlines()[1:]
    rows = {line[2:33].strip(): line[33:].strip() for line in table[1:] if line[2:3] != " "}
    assert rows["TTFT p50 / p90 / p99 (modelled)"] == (
        f"{report['ttft_ms_p50']:.1f} / {report['ttft_ms_p90']:.1f} / "
        f"{report['ttft_ms_p99']:.1f} ms"
    )
    assert rows["TPOT p50 / p90 / p99 (modelled)"].endswith(
        f"({report['tpot_steps_p50']:.2f} / {report['tpot_steps_p90']:.2f} / "
        f"{report['tpot_steps_p99']:.2f} steps)"
    )
    assert table[-1].startswith("  ms figures are modelled, not measured: step = 5 ms")
    assert "illustrative" in table[-1]


@needs_scheduler
def test_compare_policies_shows_the_modelled_rows_for_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", *SMALL, "--compare-policies", "--step-time", "1,0.01,0.001"]) == 0
    table = capsys.readouterr().out.splitlines()
    # one cell per policy, in the blocks of columns that fit 100 characters
    assert sum(line.count(" ms") for line in table if "TTFT" in line) == 3
    assert table[-1].endswith("(--step-time model)")


@needs_scheduler
def test_profile_file_gives_the_same_figures_as_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    profile = tmp_path / "h200.json"
    profile.write_text(
        json.dumps(
            {
                "fixed_ms": 3,
                "per_token_ms": 0.01,
                "per_kv_token_ms": 0.0001,
                "description": "fitted on our engine",
            }
        )
    )
    assert main(["simulate", *SMALL, "--step-time-profile", str(profile), "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main(["simulate", *SMALL, "--step-time", "3,0.01,0.0001", "--json"]) == 0
    from_flag = json.loads(capsys.readouterr().out)
    for key in MODELLED_KEYS:
        assert from_file[key] == from_flag[key]
    assert from_file["config"]["step_time_model"] == {
        "fixed_ms": 3.0,
        "per_token_ms": 0.01,
        "per_kv_token_ms": 0.0001,
        "source": str(profile),
        "description": "fitted on our engine",
    }
    assert load_profile(profile) == StepTimeModel(
        3, 0.01, 0.0001, source=str(profile), description="fitted on our engine"
    )


@pytest.mark.parametrize(
    "values",
    [(-1, 0, 0), (0, float("nan"), 0), (0, 0, float("inf")), (True, 0, 0), ("1", 0, 0)],
)
def test_model_refuses_bad_coefficients(values: tuple[object, object, object]) -> None:
    with pytest.raises(SimulationSetupError):
        StepTimeModel(*values)  # type: ignore[arg-type]


def test_model_refuses_coefficients_past_the_limit() -> None:
    assert StepTimeModel(MAX_COEFFICIENT_MS, 0, 0).fixed_ms == MAX_COEFFICIENT_MS
    with pytest.raises(SimulationSetupError, match="at most"):
        StepTimeModel(MAX_COEFFICIENT_MS * 2, 0, 0)


@needs_scheduler
def test_a_model_without_cp_is_refused() -> None:
    config = helix_kv.SchedulerConfig(cp_size=1, cp_rank=0, tokens_per_block=4, kv_tokens=1024)
    with pytest.raises(SimulationSetupError, match="cp_size=N"):
        run_simulation(helix_kv.Scheduler(config), HAND_WORKLOAD, step_time=DEFAULT_STEP_TIME)


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--step-time", "1,2"], "argument --step-time: expected 'default' or FIXED_MS,"),
        (["--step-time", "a,b,c"], "argument --step-time: expected three numbers"),
        (["--step-time=-1,0,0"], "argument --step-time: fixed_ms must be a finite number >= 0"),
        (["--step-time", "0,nan,0"], "argument --step-time: per_token_ms must be a finite"),
        (["--step-time", "0,0,inf"], "argument --step-time: per_kv_token_ms must be a finite"),
        (["--step-time", "0,0,1e9"], "argument --step-time: per_kv_token_ms must be at most"),
        (
            ["--step-time", "default", "--step-time-profile", "{tmp}/p.json"],
            "--step-time and --step-time-profile each give a step-time model; give one",
        ),
        (["--step-time-profile", "{tmp}/missing.json"], "cannot read it (No such file"),
        (["--step-time-profile", "{bad_json}"], "not JSON ("),
        (["--step-time-profile", "{a_list}"], "expected a JSON object, got list"),
        (["--step-time-profile", "{unknown_key}"], "unknown key 'fixed'"),
        (["--step-time-profile", "{missing_key}"], "missing key 'per_kv_token_ms'"),
        (["--step-time-profile", "{negative}"], "per_token_ms must be a finite number >= 0"),
        (["--step-time-profile", "{string}"], "fixed_ms must be a number, got '5'"),
        (["--step-time-profile", "{huge}"], "per_kv_token_ms must be a finite number >= 0"),
    ],
)
def test_bad_step_time_flags_are_one_usage_line(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    files = {
        "tmp": str(tmp_path),
        "bad_json": _write(tmp_path / "bad.json", "{fixed_ms: 1}"),
        "a_list": _write(tmp_path / "list.json", "[1, 2, 3]"),
        "unknown_key": _write(
            tmp_path / "unknown.json",
            '{"fixed": 1, "fixed_ms": 1, "per_token_ms": 0, "per_kv_token_ms": 0}',
        ),
        "missing_key": _write(tmp_path / "partial.json", '{"fixed_ms": 1, "per_token_ms": 0}'),
        "negative": _write(
            tmp_path / "neg.json", '{"fixed_ms": 1, "per_token_ms": -2, "per_kv_token_ms": 0}'
        ),
        "huge": _write(
            tmp_path / "huge.json",
            '{"fixed_ms": 1, "per_token_ms": 0, "per_kv_token_ms": 1' + "0" * 400 + "}",
        ),
        "string": _write(
            tmp_path / "str.json", '{"fixed_ms": "5", "per_token_ms": 0, "per_kv_token_ms": 0}'
        ),
    }
    argv = [arg.format(**files) for arg in argv]
    line = one_usage_line(run_command("simulate", *argv))
    assert message in line
    if "--step-time-profile" in argv and "--step-time" not in argv:
        assert line.startswith(f"helix-kv simulate: error: --step-time-profile {argv[-1]}: ")


@needs_scheduler
def test_user_guide_modelled_sample_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text("utf-8")
    section = guide[guide.index("### Modelled step time") :]
    samples = re.findall(r"^```text\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    sample = samples[1]  # the first is the formula
    assert main(["simulate", "--step-time", "default"]) == 0
    printed = capsys.readouterr().out
    assert printed.endswith(sample)


def test_fit_recovers_exact_coefficients_and_round_trips(tmp_path: Path) -> None:
    """Steps made by a model are fitted back to it; the profile written reads back equal."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, 4096, size=60)
    kv = rng.integers(0, 400_000, size=60)
    truth = StepTimeModel(2.5, 0.012, 3e-5)
    fitted = fit_step_time(tokens, kv, truth.predict_ms(tokens, kv), description="exact")
    for name in ("fixed_ms", "per_token_ms", "per_kv_token_ms"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-9)
    path = tmp_path / "fitted.json"
    save_profile(fitted, path)
    back = load_profile(path)
    assert (back.fixed_ms, back.per_token_ms, back.per_kv_token_ms) == (
        fitted.fixed_ms,
        fitted.per_token_ms,
        fitted.per_kv_token_ms,
    )
    assert back.description == "exact"
    assert json.loads(path.read_text()).keys() == {*PROFILE_KEYS, "description"}


def test_fit_counts_kv_per_rank_and_weighs_relative_error() -> None:
    """The KV term is per rank (``cp_size``); a relative fit keeps small steps' errors small
    where an absolute one would give them away to the large steps."""
    tokens = np.array([1, 1, 1, 2048, 2048])
    kv = np.array([1000, 2000, 4000, 2048, 8192])
    cp2 = fit_step_time(tokens, kv, StepTimeModel(1, 0.01, 1e-4).predict_ms(tokens, kv, 2), 2)
    assert cp2.per_kv_token_ms == pytest.approx(1e-4)
    # a small step (0.5 ms) next to large ones (100 ms) that a line cannot fit exactly
    measured = np.array([0.5, 0.6, 0.7, 100.0, 140.0])
    fitted = fit_step_time(tokens, kv, measured)
    relative = np.abs(fitted.predict_ms(tokens, kv) - measured) / measured
    assert relative[:3].max() < 0.5


def test_fit_keeps_coefficients_non_negative() -> None:
    """Times that fall as tokens grow would fit a negative per-token cost: it is 0 instead,
    and the rest is the best fit of what remains."""
    tokens = np.array([10, 100, 1000])
    kv = np.zeros(3)
    fitted = fit_step_time(tokens, kv, [5.0, 4.0, 3.0])
    assert fitted.per_token_ms == 0
    assert fitted.per_kv_token_ms == 0
    assert fitted.fixed_ms > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([], [], []), "at least one"),
        (([1, 2], [1], [1, 2]), "as many"),
        (([1], [1], [0.0]), "finite numbers > 0"),
        (([1], [1], [float("nan")]), "finite numbers > 0"),
        (([-1], [1], [1.0]), "counts must be finite and >= 0"),
    ],
)
def test_fit_refuses_bad_input(args: tuple[list[float], ...], message: str) -> None:
    with pytest.raises(SimulationSetupError, match=message):
        fit_step_time(*args)
    with pytest.raises(SimulationSetupError, match="cp_size"):
        fit_step_time([1], [1], [1.0], cp_size=0)
