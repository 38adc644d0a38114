"""``helix-kv simulate --overlap``: the simulated group scheduled one step ahead (step t+1
planned while step t is pending, its inputs in flight resolved by the loop from step t's
tokens). The report says "outputs exact" only when every output equals that of the same
workload run without overlap; otherwise it says they differ and the command exits 1."""

from __future__ import annotations

import json

import pytest

import helix_kv
from helix_kv.cli import main
from helix_kv.simulate import command
from helix_kv.simulate.report import format_table, summarize
from helix_kv.simulate.step_loop import outputs_match, run_simulation
from helix_kv.simulate.workload import WorkloadSpec, synthetic_workload

#: Under KV pressure, with aborts: 24 requests at once, prompts ~96 and outputs ~48 tokens.
SMALL = [
    "--tokens-per-block", "8", "--requests", "24", "--arrival-rate", "0",
    "--prompt-len", "96", "--output-len", "48", "--seed", "3", "--kv-tokens", "2048",
    "--abort-rate", "0.2",
]  # fmt: skip


def simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(["simulate", *argv])
    return status, capsys.readouterr().out


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_loop_one_step_ahead_gives_the_plain_outputs(cp: int) -> None:
    workload = synthetic_workload(
        WorkloadSpec(num_requests=30, seed=cp, prompt_len_mean=60, output_len_mean=30,
                     abort_rate=0.2)
    )  # fmt: skip
    config = helix_kv.SchedulerConfig(
        cp_size=cp, tokens_per_block=4, kv_tokens=1024, max_num_tokens=256, chunk_unit=16
    )
    plain = run_simulation(helix_kv.SimulatedCPGroup(config), workload)
    overlap = run_simulation(helix_kv.SimulatedCPGroup(config), workload, overlap=True)
    assert overlap.overlap
    assert overlap.final_metrics.preemptions > 0
    assert overlap.requests_aborted > 0
    assert overlap.outputs_exact
    assert plain.outputs_exact
    assert outputs_match(overlap, plain)


def test_simulate_overlap_reports_exact_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = simulate(capsys, *SMALL, "--overlap", "--json")
    assert status == 0, out
    report = json.loads(out)
    assert report["outputs_exact"] is True
    assert report["outputs_match_plain"] is True
    assert report["config"]["overlap"] is True
    assert report["preemptions"] > 0
    status, out = simulate(capsys, *SMALL, "--overlap")
    assert status == 0
    assert ", overlap, " in out.splitlines()[0]
    assert "outputs exact               yes" in out


def test_outputs_that_differ_from_the_plain_run_fail_the_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "outputs_match", lambda overlap, plain: False)
    status, out = simulate(capsys, *SMALL, "--overlap")
    assert status == 1
    assert (
        "outputs exact               NO (the outputs differ from the run without --overlap)" in out
    )
    status, out = simulate(capsys, *SMALL, "--overlap", "--json")
    assert status == 1
    report = json.loads(out)
    assert (report["outputs_exact"], report["outputs_match_plain"]) == (False, False)


def test_outputs_match_compares_every_request() -> None:
    workload = synthetic_workload(WorkloadSpec(num_requests=6, seed=1))
    config = helix_kv.SchedulerConfig(cp_size=2, tokens_per_block=4, kv_tokens=4096)
    first = run_simulation(helix_kv.SimulatedCPGroup(config), workload)
    second = run_simulation(helix_kv.SimulatedCPGroup(config), workload, overlap=True)
    assert outputs_match(second, first)
    finished = next(i for i, o in enumerate(second.outcomes) if not o.aborted)
    second.outcomes[finished].output_crc ^= 1
    assert not outputs_match(second, first)
    second.outputs_match_plain = False
    assert not second.outputs_exact
    assert "differ from the run without --overlap" in format_table(summarize(second))


def test_overlap_and_procs_do_not_combine(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["simulate", "--overlap", "--procs"])
    assert status == 2
    assert "drop --procs" in capsys.readouterr().err


def test_the_default_report_does_not_mention_overlap(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = simulate(capsys, *SMALL, "--json")
    assert status == 0
    report = json.loads(out)
    assert "outputs_match_plain" not in report
    assert "overlap" not in report["config"]
