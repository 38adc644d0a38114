"""Goodput under SLOs (``--slo-ttft-ms``, ``--slo-tpot-ms``): a hand count on a tiny trace
under a known step-time model, the rule for aborted and one-token requests, the default model
when none is given, and the flags' errors (real subprocesses)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import helix_kv
from helix_kv.cli import main
from helix_kv.simulate.report import ServiceLevels, summarize
from helix_kv.simulate.step_loop import RequestOutcome, SimulationResult, StepSeries
from helix_kv.simulate.timing import DEFAULT_STEP_TIME
from helix_kv.simulate.workload import RequestSpec, write_trace

from ..helpers.cli import one_usage_line, run_command
from ..helpers.scheduler import needs_scheduler

#: Under ``--step-time 0,1,0`` (a step lasts its scheduled tokens in ms), cp 1, a roomy pool:
#:
#: - clock 0: request 0 prefills 4 tokens: 4 ms (ends at 4; its first token);
#: - clock 1: requests 1-3 arrive at 4 ms; request 0 decodes 1, requests 1, 2, 3 prefill 8, 2
#:   and 4: 15 ms (ends at 19; the first token of 1, 2 and 3; request 2 finishes, one token);
#: - clock 2: requests 0, 1 and 3 decode: 3 ms (ends at 22; 0 and 1 finish);
#: - clock 3: request 3 is aborted (at 22 ms); nothing is left: the run lasts 22 ms.
#:
#: TTFT: 4, 15, 15 (request 3 aborted); TPOT: request 0 (22 - 4) / 2 = 9, request 1
#: (22 - 19) / 1 = 3, request 2 none (one token).
HAND_TRACE = [
    RequestSpec(request_id=0, arrival_step=0, prompt_len=4, output_len=3),
    RequestSpec(request_id=1, arrival_step=1, prompt_len=8, output_len=2),
    RequestSpec(request_id=2, arrival_step=1, prompt_len=2, output_len=1),
    RequestSpec(request_id=3, arrival_step=1, prompt_len=4, output_len=4, abort_step=3),
]
HAND_FLAGS = ["--cp", "1", "--tokens-per-block", "4", "--kv-tokens", "1024"]
HAND_MODEL = ["--step-time", "0,1,0"]


@pytest.fixture
def hand_trace(tmp_path: Path) -> Path:
    path = tmp_path / "hand.jsonl"
    write_trace(HAND_TRACE, path)
    return path


def _report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["simulate", *argv, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@needs_scheduler
@pytest.mark.parametrize(
    ("slo", "met"),
    [
        (["--slo-ttft-ms", "10"], 1),  # request 0 alone (TTFT 4)
        (["--slo-ttft-ms", "15"], 3),  # at most: 15 meets 15
        (["--slo-ttft-ms", "14.9"], 1),
        (["--slo-tpot-ms", "10"], 3),  # every finished one; the aborted one never
        (["--slo-tpot-ms", "3"], 2),  # requests 1 (TPOT 3) and 2 (one token: any TPOT)
        (["--slo-ttft-ms", "20", "--slo-tpot-ms", "5"], 2),  # request 0's TPOT is 9
        (["--slo-ttft-ms", "1", "--slo-tpot-ms", "100"], 0),
    ],
)
def test_goodput_is_the_hand_count(
    capsys: pytest.CaptureFixture[str], hand_trace: Path, slo: list[str], met: int
) -> None:
    report = _report(capsys, "--trace", str(hand_trace), *HAND_FLAGS, *HAND_MODEL, *slo)
    assert report["modelled_time_ms"] == 22.0
    assert report["requests_aborted"] == 1
    assert report["goodput_requests"] == met
    assert report["goodput_share"] == met / 4
    assert report["goodput_rate_per_s"] == pytest.approx(met / 0.022)
    targets = dict(zip(slo[::2], map(float, slo[1::2])))
    assert report["slo_ttft_ms"] == targets.get("--slo-ttft-ms")
    assert report["slo_tpot_ms"] == targets.get("--slo-tpot-ms")


@needs_scheduler
def test_percentiles_of_the_hand_run(capsys: pytest.CaptureFixture[str], hand_trace: Path) -> None:
    report = _report(capsys, "--trace", str(hand_trace), *HAND_FLAGS, *HAND_MODEL)
    # nearest rank over the finished requests: TTFT 4, 15, 15; TPOT 3, 9
    assert (report["ttft_ms_p50"], report["ttft_ms_p90"], report["ttft_ms_p99"]) == (15, 15, 15)
    assert (report["tpot_ms_p50"], report["tpot_ms_p90"], report["tpot_ms_p99"]) == (3, 9, 9)
    assert "goodput_share" not in report  # no SLO given: the report is as before


@needs_scheduler
def test_the_table_shows_the_targets_and_goodput(
    capsys: pytest.CaptureFixture[str], hand_trace: Path
) -> None:
    argv = ["--trace", str(hand_trace), *HAND_FLAGS, *HAND_MODEL, "--slo-tpot-ms", "10"]
    assert main(["simulate", *argv]) == 0
    rows = {line[2:33].strip(): line[33:].strip() for line in capsys.readouterr().out.splitlines()}
    assert rows["SLO targets"] == "TPOT <= 10 ms"
    assert rows["goodput (modelled)"] == "75.0% of requests (3 / 4), 136.36 req/s"
    assert rows["TTFT p50 / p90 / p99 (modelled)"] == "15.0 / 15.0 / 15.0 ms"


@needs_scheduler
def test_steps_the_run_did_not_reach_miss_the_slo(
    capsys: pytest.CaptureFixture[str], hand_trace: Path
) -> None:
    # one step: request 0 has its first token but has not finished; nobody meets the SLO
    argv = ["--trace", str(hand_trace), *HAND_FLAGS, *HAND_MODEL, "--max-steps", "1"]
    report = _report(capsys, *argv, "--slo-ttft-ms", "100")
    assert report["goodput_requests"] == 0
    assert report["goodput_share"] == 0.0
    assert report["modelled_time_ms"] == 4.0


@needs_scheduler
def test_slos_without_a_model_use_the_default_one(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--requests", "8", "--prompt-len", "32", "--output-len", "8", "--seed", "1"]
    report = _report(capsys, *small, "--slo-ttft-ms", "50")
    assert report["config"]["step_time_model"] == DEFAULT_STEP_TIME.to_dict()
    assert 0 <= report["goodput_share"] <= 1
    assert main(["simulate", *small, "--slo-ttft-ms", "50"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1].startswith("  ms figures are modelled, not measured: step = 5 ms")
    assert table[-1].endswith("(default model, illustrative)")
    # the same figures as the model given outright
    assert _report(capsys, *small, "--slo-ttft-ms", "50", "--step-time", "default") == report


def _outcome(**fields: Any) -> RequestOutcome:
    base: dict[str, Any] = dict(
        request_id=0,
        arrival_step=0,
        first_token_step=0,
        finish_step=2,
        generated_tokens=3,
        victim_choices=0,
        recomputed_tokens=0,
        steps_waited=0,
        output_exact=True,
        arrival_ms=0.0,
        first_token_ms=10.0,
        finish_ms=30.0,  # TTFT 10, TPOT 10
    )
    return RequestOutcome(**{**base, **fields})


def test_met_by_follows_the_documented_rule() -> None:
    slo = ServiceLevels(ttft_ms=10.0, tpot_ms=10.0)
    assert slo.met_by(_outcome())
    assert not slo.met_by(_outcome(first_token_ms=10.5))
    assert not slo.met_by(_outcome(finish_ms=30.5))
    assert not slo.met_by(_outcome(finish_reason="aborted"))  # even within the targets
    assert not slo.met_by(_outcome(first_token_step=None, first_token_ms=None))
    # one token: no TPOT, any TPOT target is met
    assert slo.met_by(_outcome(generated_tokens=1, finish_ms=1e9))
    assert ServiceLevels(ttft_ms=10.0).met_by(_outcome(finish_ms=1e9))
    assert ServiceLevels(tpot_ms=10.0).met_by(_outcome(first_token_ms=5.0, finish_ms=25.0))
    with pytest.raises(ValueError, match="give a TTFT or a TPOT target"):
        ServiceLevels()
    with pytest.raises(ValueError, match="finite number > 0"):
        ServiceLevels(ttft_ms=0.0)


def test_summarize_without_a_model_has_no_goodput() -> None:
    metrics = helix_kv.SchedulerMetrics(
        **{**dict.fromkeys(helix_kv.SchedulerMetrics.FIELDS, 0), "kv_capacity_superblocks": 1}
    )
    result = SimulationResult(
        requests_total=1,
        outcomes=[_outcome()],
        series=StepSeries(),
        final_metrics=metrics,
        generated_tokens=3,
        clock=3,
        rank_agreement=True,
    )
    assert "goodput_share" not in summarize(result, ServiceLevels(ttft_ms=10.0))
    result.modelled_time_ms = 30.0
    figures = summarize(result, ServiceLevels(ttft_ms=10.0))
    assert (figures["goodput_requests"], figures["goodput_share"]) == (1, 1.0)
    assert figures["goodput_rate_per_s"] == pytest.approx(1 / 0.03)


@needs_scheduler
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slo-ttft-ms", "0"], "argument --slo-ttft-ms: must be a finite number of ms > 0"),
        (["--slo-tpot-ms", "nan"], "argument --slo-tpot-ms: must be a finite number of ms > 0"),
        (["--slo-tpot-ms", "-5"], "argument --slo-tpot-ms: must be a finite number of ms > 0"),
        (["--slo-ttft-ms", "fast"], "argument --slo-ttft-ms: expected a number, got 'fast'"),
    ],
)
def test_bad_targets_exit_2_in_a_subprocess(argv: list[str], message: str) -> None:
    line = one_usage_line(run_command("simulate", *argv))
    assert message in line


@needs_scheduler
def test_goodput_in_a_subprocess_json(hand_trace: Path) -> None:
    done = run_command(
        "simulate", "--trace", str(hand_trace), *HAND_FLAGS, *HAND_MODEL, "--slo-ttft-ms", "15",
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["goodput_requests"], report["goodput_share"]) == (3, 0.75)


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"


@needs_scheduler
def test_user_guide_goodput_sample_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    guide = GUIDE.read_text("utf-8")
    section = guide[guide.index("### Goodput: `--slo-ttft-ms`, `--slo-tpot-ms`") :]
    command = re.search(r"^```bash\nhelix-kv (.*)\n```", section, re.MULTILINE)
    sample = re.search(r"^```text\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert command is not None
    assert sample is not None
    assert main(command.group(1).split()) == 0
    assert sample.group(1) in capsys.readouterr().out
