"""``helix-kv simulate --spec-tokens K --acceptance P``: speculative decoding in the simulator.

Each step the loop proposes drafts to every rank, verifies what the step scheduled against the
tokens it samples and gives ``update`` the accepted counts. The outputs must stay exactly those
without drafts (the run checks them token for token), the ranks must agree every step, and the
figures must follow the acceptance model: per-token coins of probability P, a step accepting
its leading successes.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import helix_kv
from helix_kv.cli import main
from helix_kv.errors import SimulationSetupError
from helix_kv.simulate.drafts import DraftModel, verify
from helix_kv.simulate.events import EventLog
from helix_kv.simulate.report import format_table, summarize
from helix_kv.simulate.step_loop import outputs_match, run_simulation
from helix_kv.simulate.timing import StepTimeModel, kv_tokens_read
from helix_kv.simulate.tokens import sampled_tokens
from helix_kv.simulate.workload import WorkloadSpec, synthetic_workload

#: KV pressure, every request at step 0: prompts ~96 and outputs ~48 tokens.
PRESSURE = [
    "--tokens-per-block", "8", "--requests", "24", "--arrival-rate", "0",
    "--prompt-len", "96", "--output-len", "48", "--seed", "3", "--kv-tokens", "1024",
]  # fmt: skip
#: No pressure: the pool holds everything, so no draft is ever trimmed.
AMPLE = [
    "--tokens-per-block", "8", "--requests", "40", "--prompt-len", "96", "--output-len", "48",
    "--kv-tokens", "65536",
]  # fmt: skip
SPEC_KEYS = {
    "decode_steps",
    "spec_decode_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "spec_decode_acceptance_rate",
    "spec_decode_accepted_per_position",
    "spec_decode_acceptance_per_position",
    "tokens_per_decode_step",
    "spec_decode_trimmed_tokens",
    "spec_decode_draft_superblocks",
    "spec_decode_returned_superblocks",
}


def simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["simulate", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    status, out, err = simulate(capsys, *argv, "--json")
    assert status == 0, err
    result: dict = json.loads(out)
    assert result["rank_agreement"] is True
    assert result["outputs_exact"] is True
    return result


# -- flags --------------------------------------------------------------------------------------


def test_spec_tokens_and_acceptance_reach_the_config_and_the_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = report(capsys, *PRESSURE, "--spec-tokens", "3", "--acceptance", "0.6")
    assert result["config"]["scheduler"]["num_speculative_tokens"] == 3
    assert result["config"]["drafts"] == {"acceptance": 0.6, "seed": 3}
    assert result.keys() >= SPEC_KEYS
    assert len(result["spec_decode_accepted_per_position"]) == 3
    default = report(capsys, *PRESSURE, "--spec-tokens", "2")
    assert default["config"]["drafts"]["acceptance"] == 0.7

    status, out, _ = simulate(capsys, *PRESSURE, "--spec-tokens", "3", "--acceptance", "0.6")
    assert status == 0
    assert "spec_tokens=3 acceptance=0.6" in out.splitlines()[0]
    for label in (
        "decodes with drafts",
        "draft tokens accepted",
        "accepted per position",
        "tokens per decode step",
        "drafts trimmed",
        "draft KV taken / returned",
    ):
        assert f"  {label}  " in out, label


def test_without_drafts_the_report_has_no_draft_figures(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ([], ["--spec-tokens", "0"]):
        result = report(capsys, *PRESSURE, *extra)
        assert not SPEC_KEYS & result.keys()
        assert "drafts" not in result["config"]
        assert result["config"]["scheduler"]["num_speculative_tokens"] == 0
        status, out, _ = simulate(capsys, *PRESSURE, *extra)
        assert status == 0
        assert "draft" not in out
        assert "spec_tokens" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--spec-tokens", "2", "--acceptance", "1.5"],
            "--acceptance: must be a fraction in [0, 1]",
        ),
        (["--spec-tokens", "2", "--acceptance", "-0.1"], "--acceptance: must be a fraction"),
        (["--spec-tokens", "2", "--acceptance", "nan"], "--acceptance: must be a fraction"),
        (["--spec-tokens", "2", "--acceptance", "high"], "--acceptance: expected a number"),
        (["--acceptance", "0.5"], "--acceptance is the chance that a draft token is accepted"),
        (["--spec-tokens", "0", "--acceptance", "0.5"], "--spec-tokens 0 proposes none"),
        (["--spec-tokens", "65"], "--spec-tokens: must be at most 64"),
        (["--spec-tokens", "-1"], "--spec-tokens: must be >= 0"),
    ],
)
def test_bad_draft_flags_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = simulate(capsys, *argv)
    assert status == 2
    assert message in err, err
    assert len(err.strip().splitlines()) == 1
    assert out == ""


# -- the acceptance model ---------------------------------------------------------------------


def test_verification_accepts_the_leading_drafts_that_match() -> None:
    # three entries: 2 drafts (first right, second wrong), none, 3 drafts (all right)
    counts = np.array([2, 0, 3])
    sampled = np.array([10, 11, 12, 20, 30, 31, 32, 33], dtype=np.int32)
    drafts = np.array([10, 99, 30, 31, 32], dtype=np.int32)
    assert verify(counts, drafts, sampled).tolist() == [1, 0, 3]
    wrong_first = np.array([9, 11, 30, 31, 0], dtype=np.int32)
    assert verify(counts, wrong_first, sampled).tolist() == [0, 0, 2]


def test_drafts_are_the_next_tokens_where_the_coins_come_up() -> None:
    model = DraftModel(4, acceptance=0.5, seed=11)
    # request 7 has 10 tokens left after 5: 4 drafts; request 8 has 2 left: 1; 9 has 1: none;
    # request 10 has not sampled yet: none
    proposal = model.propose([(7, 5, 15), (8, 3, 5), (9, 4, 5), (10, 0, 40)])
    assert proposal.request_ids.tolist() == [7, 8]
    assert proposal.counts.tolist() == [4, 1]
    ids = np.array([7, 7, 7, 7, 8], dtype=np.uint64)
    indices = np.array([5, 6, 7, 8, 3], dtype=np.uint64)
    right = sampled_tokens(ids, indices)
    coins = model.coins(ids, indices)
    assert np.array_equal(proposal.tokens == right, coins)
    # pure functions of (seed, request, index): the same again, other ones for another seed
    assert np.array_equal(model.propose([(7, 5, 15), (8, 3, 5)]).tokens, proposal.tokens)
    many = np.arange(4000, dtype=np.uint64)
    first = model.coins(np.full(4000, 7, dtype=np.uint64), many)
    other = DraftModel(4, acceptance=0.5, seed=12).coins(np.full(4000, 7, dtype=np.uint64), many)
    assert not np.array_equal(first, other)
    assert abs(first.mean() - 0.5) < 0.03
    assert DraftModel(4, acceptance=1.0).coins(ids, indices).all()
    assert not DraftModel(4, acceptance=0.0).coins(ids, indices).any()


def test_acceptance_per_position_follows_the_leading_successes_of_coins(
    capsys: pytest.CaptureFixture[str],
) -> None:
    p = 0.6
    result = report(capsys, *AMPLE, "--requests", "80", "--spec-tokens", "3", "--acceptance", "0.6")
    assert result["spec_decode_trimmed_tokens"] == 0
    drafted = result["spec_decode_drafts"]
    per_position = result["spec_decode_accepted_per_position"]
    rates = result["spec_decode_acceptance_per_position"]
    assert rates == [count / drafted for count in per_position]
    # position j is accepted when coins 0..j all come up: P^(j+1) (the last few tokens of an
    # output cap the drafts, which lowers the deep positions a little)
    for j, rate in enumerate(rates):
        assert abs(rate - p ** (j + 1)) < 0.04, (j, rate)
    assert per_position[0] >= per_position[1] >= per_position[2]
    assert result["spec_decode_accepted_tokens"] == sum(per_position)
    assert result["spec_decode_acceptance_rate"] == pytest.approx(
        result["spec_decode_accepted_tokens"] / result["spec_decode_draft_tokens"]
    )
    assert result["tokens_per_decode_step"] == pytest.approx(
        1 + result["spec_decode_accepted_tokens"] / result["decode_steps"]
    )
    # every token but each request's first (its prefill samples it) comes from a decode step
    assert result["decode_steps"] + result["spec_decode_accepted_tokens"] == (
        result["generated_tokens"] - result["requests_total"]
    )


def test_every_draft_accepted_gives_one_plus_k_tokens_a_step_in_fewer_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    k = 4
    plain = report(capsys, *AMPLE)
    result = report(capsys, *AMPLE, "--spec-tokens", str(k), "--acceptance", "1")
    assert result["spec_decode_accepted_tokens"] == result["spec_decode_draft_tokens"] > 0
    assert result["spec_decode_acceptance_rate"] == 1.0
    assert result["spec_decode_acceptance_per_position"][0] == 1.0
    # only the end of each output caps the drafts
    assert k + 1 - 0.5 < result["tokens_per_decode_step"] <= k + 1
    assert result["spec_decode_returned_superblocks"] == 0  # nothing to give back
    assert result["generated_tokens"] == plain["generated_tokens"]
    assert result["steps"] < plain["steps"] / 2


def test_every_draft_rejected_gives_back_every_draft_superblock(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = report(capsys, *PRESSURE)
    result = report(capsys, *PRESSURE, "--spec-tokens", "4", "--acceptance", "0")
    assert result["spec_decode_draft_tokens"] > 0
    assert result["spec_decode_accepted_tokens"] == 0
    assert result["spec_decode_accepted_per_position"] == [0, 0, 0, 0]
    assert result["tokens_per_decode_step"] == 1.0
    assert result["spec_decode_draft_superblocks"] > 0
    assert result["spec_decode_returned_superblocks"] == result["spec_decode_draft_superblocks"]
    # one token a decode: every token but those the (re-)prefills sampled
    assert result["decode_steps"] == (
        result["generated_tokens"] - result["requests_total"] - result["preemptions"]
    )
    # drafts come last from free pages and are all given back at the update: the schedule is
    # the one without drafts, step for step
    for key in ("steps", "generated_tokens", "computed_tokens", "preemptions", "sat_out"):
        assert result[key] == plain[key], key
    assert result["spec_decode_trimmed_tokens"] > 0  # under pressure some did not even fit


# -- determinism and rank invariance ------------------------------------------------------


def test_the_same_seed_gives_the_same_run(capsys: pytest.CaptureFixture[str]) -> None:
    first = report(capsys, *PRESSURE, "--spec-tokens", "3")
    second = report(capsys, *PRESSURE, "--spec-tokens", "3")
    assert first == second
    reseeded = report(capsys, *PRESSURE, "--spec-tokens", "3", "--seed", "4")
    assert reseeded["spec_decode_accepted_tokens"] != first["spec_decode_accepted_tokens"]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_agree_under_pressure(capsys: pytest.CaptureFixture[str], cp: int) -> None:
    result = report(capsys, *PRESSURE, "--cp", str(cp), "--spec-tokens", "4")
    assert result["spec_decode_trimmed_tokens"] > 0  # drafts gave way
    assert result["spec_decode_returned_superblocks"] > 0


def test_cp_sizes_agree_on_the_drafts_without_pressure(capsys: pytest.CaptureFixture[str]) -> None:
    # the coins belong to the request's tokens, not to the schedule: without trimming every
    # group size accepts the same drafts in the same decode steps
    figures = [
        report(capsys, *AMPLE, "--cp", str(cp), "--spec-tokens", "3", "--acceptance", "0.5")
        for cp in (1, 2, 4)
    ]
    keys = ["decode_steps", "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "steps"]
    assert len({tuple(f[key] for key in keys) for f in figures}) == 1
    assert {tuple(f["spec_decode_accepted_per_position"]) for f in figures} == {
        tuple(figures[0]["spec_decode_accepted_per_position"])
    }


def test_the_group_reads_acceptance_per_position_from_every_rank() -> None:
    config = helix_kv.SchedulerConfig(
        cp_size=2, tokens_per_block=4, kv_tokens=4096, num_speculative_tokens=2
    )
    workload = synthetic_workload(
        WorkloadSpec(num_requests=8, seed=2, prompt_len_mean=40, output_len_mean=20)
    )
    group = helix_kv.SimulatedCPGroup(config)
    result = run_simulation(group, workload, drafts=DraftModel(2, acceptance=0.8, seed=5))
    counts = group.spec_decode_accepted_per_position()
    assert counts.dtype == np.uint64
    assert result.accepted_per_position == counts.tolist()
    for scheduler in group.schedulers:
        assert scheduler.spec_decode_accepted_per_position().tolist() == counts.tolist()
    assert sum(counts.tolist()) == result.final_metrics.spec_decode_num_accepted_tokens > 0


def test_a_draft_model_beyond_the_schedulers_limit_is_refused() -> None:
    config = helix_kv.SchedulerConfig(cp_size=1, kv_tokens=4096, num_speculative_tokens=2)
    workload = synthetic_workload(WorkloadSpec(num_requests=2))
    with pytest.raises(SimulationSetupError, match="num_speculative_tokens = 2"):
        run_simulation(helix_kv.SimulatedCPGroup(config), workload, drafts=DraftModel(3))


# -- with the other modes ---------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_one_step_ahead_gives_the_plain_outputs(cp: int) -> None:
    workload = synthetic_workload(
        WorkloadSpec(num_requests=30, seed=cp, prompt_len_mean=60, output_len_mean=30,
                     abort_rate=0.2)
    )  # fmt: skip
    config = helix_kv.SchedulerConfig(
        cp_size=cp, tokens_per_block=4, kv_tokens=1024, max_num_tokens=256, chunk_unit=16,
        num_speculative_tokens=3,
    )  # fmt: skip
    drafts = DraftModel(3, acceptance=0.7, seed=1)
    plain = run_simulation(helix_kv.SimulatedCPGroup(config), workload, drafts=drafts)
    ahead = run_simulation(helix_kv.SimulatedCPGroup(config), workload, overlap=True, drafts=drafts)
    for result in (plain, ahead):
        assert result.outputs_exact
        assert result.final_metrics.spec_decode_num_accepted_tokens > 0
        assert result.final_metrics.spec_decode_returned_superblocks > 0
    assert ahead.final_metrics.preemptions > 0
    assert ahead.requests_aborted > 0
    assert outputs_match(ahead, plain)


def test_one_step_ahead_decodes_a_drafted_request_every_other_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*AMPLE, "--arrival-rate", "0", "--spec-tokens", "3", "--acceptance", "0.5"]
    plain = report(capsys, *argv)
    ahead = report(capsys, *argv, "--overlap")
    assert ahead["outputs_match_plain"] is True
    assert ahead["config"]["overlap"] is True
    # the same drafts are accepted (the coins follow the tokens, nothing is trimmed) ...
    for key in ("decode_steps", "spec_decode_draft_tokens", "spec_decode_accepted_tokens"):
        assert ahead[key] == plain[key], key
    # ... but a step planned ahead skips a request whose pending decode carries drafts
    assert ahead["steps"] > 1.5 * plain["steps"]


def test_host_tier_suspends_and_resumes_with_drafts(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ([], ["--overlap"], ["--cp", "1", "--mode", "non_helix"]):
        result = report(
            capsys, *PRESSURE, "--host-tier-tokens", "2048", "--spec-tokens", "4", *extra
        )
        assert result["suspensions"] > 0
        assert result["resumes"] == result["suspensions"]
        assert result["spec_decode_accepted_tokens"] > 0
        assert result["spec_decode_trimmed_tokens"] > 0
        assert "recompute_only_steps" in result


def test_prefix_caching_with_drafts_keeps_outputs_exact(capsys: pytest.CaptureFixture[str]) -> None:
    # conversations: each turn reads back its history (the previous answer included), which
    # must be the accepted tokens only
    argv = [
        "--cp", "2", "--tokens-per-block", "8", "--kv-tokens", "8192", "--requests", "30",
        "--prompt-len", "64", "--output-len", "48", "--turns", "3", "--think-steps", "2",
        "--shared-prefix-len", "128", "--prefix-caching", "--spec-tokens", "3",
    ]  # fmt: skip
    for extra in ([], ["--overlap"]):
        result = report(capsys, *argv, *extra)
        assert result["prefix_cache_hit_rate"] > 0.3
        assert result["spec_decode_accepted_tokens"] > 0


def test_compare_policies_shows_the_draft_rows_for_every_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = simulate(capsys, *PRESSURE, "--spec-tokens", "2", "--compare-policies")
    assert status == 0, err
    assert "draft tokens accepted" in out
    assert "tokens per decode step" in out
    status, out, err = simulate(
        capsys, *PRESSURE, "--spec-tokens", "2", "--compare-policies", "--json"
    )
    assert status == 0, err
    for summary in json.loads(out)["policies"].values():
        assert summary.keys() >= SPEC_KEYS
        assert summary["outputs_exact"] is True


def test_a_trace_replays_with_drafts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        {"id": 0, "arrival_step": 0, "prompt_len": 300, "output_len": 50},
        {"id": 1, "arrival_step": 2, "prompt_len": 100, "output_len": 80, "abort_step": 30},
        {"id": 2, "arrival_step": 3, "output_len": 20, "token_ids": [1, 2, 3, 4, 5]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    result = report(capsys, "--trace", str(trace), "--spec-tokens", "3", "--acceptance", "0.5")
    assert result["config"]["drafts"] == {"acceptance": 0.5, "seed": 0}
    assert result["requests_aborted"] == 1
    assert result["spec_decode_accepted_tokens"] > 0


# -- events and step time ----------------------------------------------------------------------


def test_events_carry_the_drafts_of_every_step(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    events = tmp_path / "run.jsonl"
    result = report(capsys, *PRESSURE, "--spec-tokens", "3", "--events", str(events))
    records = [json.loads(line) for line in events.read_text(encoding="utf-8").splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == result["steps"]
    assert sum(s["drafts"] for s in steps) == result["spec_decode_drafts"]
    assert sum(s["draft_tokens"] for s in steps) == result["spec_decode_draft_tokens"]
    assert sum(s["accepted_tokens"] for s in steps) == result["spec_decode_accepted_tokens"]
    for step in steps:
        assert step["scheduled_tokens"] == (
            step["context_tokens"] + step["decode_tokens"] + step["draft_tokens"]
        )
        assert step["samples"] >= step["decode_tokens"] + step["draft_tokens"]
        assert 0 <= step["accepted_tokens"] <= step["draft_tokens"]
    report(capsys, *PRESSURE, "--events", str(events))
    plain = [json.loads(line) for line in events.read_text(encoding="utf-8").splitlines()]
    assert not any("draft_tokens" in record for record in plain)


def test_drafts_cost_tokens_and_kv_reads_in_the_step_time_model() -> None:
    config = helix_kv.SchedulerConfig(
        cp_size=2, tokens_per_block=4, kv_tokens=4096, num_speculative_tokens=3
    )
    scheduler = helix_kv.Scheduler(config)
    scheduler.add_request(1, np.arange(10, dtype=np.int32), 20)
    scheduler.add_request(2, np.arange(30, dtype=np.int32), 20)
    first = scheduler.schedule()
    scheduler.update(np.zeros(first.num_samples, dtype=np.int32))
    scheduler.propose_drafts(np.array([1, 2]), np.array([3, 1]), np.arange(4, dtype=np.int32))
    step = scheduler.schedule()
    assert step.generation_draft_counts.tolist() == [3, 1]
    assert step.num_tokens == 2 + 4
    # request 1 decodes at 10 and verifies 3 drafts: 14 tokens; request 2: 30 + 1 + 1
    assert kv_tokens_read(step) == (10 + 1 + 3) + (30 + 1 + 1)

    workload = synthetic_workload(WorkloadSpec(num_requests=6, seed=1, output_len_mean=30))
    model = StepTimeModel(1.0, 0.5, 0.0)
    log = EventLog()
    run_simulation(
        helix_kv.SimulatedCPGroup(config),
        workload,
        events=log,
        step_time=model,
        cp_size=2,
        drafts=DraftModel(3),
    )
    drafted = [s for s in log.steps if s.draft_tokens]
    assert drafted
    for event in drafted:
        assert event.duration_ms == pytest.approx(1.0 + 0.5 * event.scheduled_tokens)
        assert event.scheduled_tokens > event.context_tokens + event.decode_tokens


def test_the_table_reads_the_draft_figures() -> None:
    config = helix_kv.SchedulerConfig(
        cp_size=2, tokens_per_block=4, kv_tokens=4096, num_speculative_tokens=2
    )
    workload = synthetic_workload(WorkloadSpec(num_requests=6, seed=1, output_len_mean=30))
    result = run_simulation(
        helix_kv.SimulatedCPGroup(config),
        workload,
        config={"cp": 2, "scheduler": dict(config.to_dict()), "drafts": {"acceptance": 1.0}},
        drafts=DraftModel(2, acceptance=1.0),
    )
    summary = summarize(result)
    table = format_table(summary)
    drafts = summary["spec_decode_draft_tokens"]
    assert f"draft tokens accepted       {drafts} / {drafts} (100.0%)" in table
    assert "accepted per position       100.0% " in table
    assert "spec_tokens=2 acceptance=1" in table


def test_rank_processes_propose_and_accept_the_same_drafts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch")
    argv = [*PRESSURE, "--requests", "12", "--spec-tokens", "3"]
    in_process = report(capsys, *argv)
    with_procs = report(capsys, *argv, "--procs")
    assert with_procs["config"]["procs"] is True
    for key in ("steps", "generated_tokens", "preemptions", *sorted(SPEC_KEYS)):
        assert with_procs[key] == in_process[key], key


def test_the_user_guide_example_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text("utf-8")
    section = guide[guide.index("### Capacity planning with drafts") :]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    command = next(code for info, code in blocks if info == "bash")
    sample = next(code for info, code in blocks if info == "text")
    lines = [line for line in command.splitlines() if not line.startswith("#")]
    argv = shlex.split(" ".join(line.rstrip("\\") for line in lines))
    assert argv[:2] == ["helix-kv", "simulate"]
    status, out, _ = simulate(capsys, *argv[2:])
    assert status == 0
    assert out == sample
