"""``--verify-ranks``: which ranks of a simulated group run a real scheduler and are compared.

``all`` runs one scheduler per rank; ``sample`` the first and the last rank; ``none`` rank 0
alone. The figures must not depend on the mode (every rank decides alike by construction), a
diverging rank must be caught whenever it is run, and the report must say what was verified.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

import helix_kv
from helix_kv.cli import build_parser, main
from helix_kv.simulate.arguments import UsageError, simulation_options
from helix_kv.simulate.options import (
    VERIFY_ALL_UP_TO_CP,
    SimulationOptions,
    verified_ranks,
)
from helix_kv.simulate.report import format_table, summarize
from helix_kv.simulate.step_loop import run_simulation
from helix_kv.simulate.workload import WorkloadSpec, synthetic_workload

#: Small and under KV pressure: 24 requests at once, prompts ~96 and outputs ~48 tokens.
SMALL = [
    "--tokens-per-block", "8", "--requests", "24", "--arrival-rate", "0",
    "--prompt-len", "96", "--output-len", "48", "--seed", "3", "--kv-tokens", "2048",
]  # fmt: skip


def parse(*argv: str) -> SimulationOptions:
    return simulation_options(build_parser().parse_args(["simulate", *argv]))


def simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(["simulate", *argv])
    captured = capsys.readouterr()
    return status, captured.out


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    status, out = simulate(capsys, *argv, "--json")
    assert status == 0, out
    return json.loads(out)


def config(cp: int, tpb: int = 4, kv_tokens: int = 1024) -> helix_kv.SchedulerConfig:
    return helix_kv.SchedulerConfig(cp_size=cp, tokens_per_block=tpb, kv_tokens=kv_tokens)


# --- flags and the default rule ------------------------------------------------------------


def test_default_verifies_every_rank_up_to_the_threshold_and_samples_above() -> None:
    assert VERIFY_ALL_UP_TO_CP == 8
    assert parse().verify_ranks is None
    assert parse().verify_mode == "all"
    assert parse("--cp", "8").verified_ranks() == tuple(range(8))
    assert parse("--cp", "9").verify_mode == "sample"
    assert parse("--cp", "9").verified_ranks() == (0, 8)
    assert parse("--cp", "64").verified_ranks() == (0, 63)
    # every rank is its own process under --procs: all of them are checked
    assert parse("--cp", "16", "--procs").verify_mode == "all"


@pytest.mark.parametrize("mode", ["all", "sample", "none"])
def test_an_explicit_mode_wins_over_the_default(mode: str) -> None:
    assert parse("--cp", "4", "--verify-ranks", mode).verify_mode == mode
    assert parse("--cp", "64", "--verify-ranks", mode).verify_mode == mode


def test_the_modes_name_their_ranks() -> None:
    assert verified_ranks("all", 4) == (0, 1, 2, 3)
    assert verified_ranks("sample", 4) == (0, 3)
    assert verified_ranks("sample", 2) == (0, 1)
    assert verified_ranks("sample", 1) == (0,)
    assert verified_ranks("none", 64) == (0,)
    with pytest.raises(ValueError, match="verify_ranks must be one of"):
        verified_ranks("some", 4)  # type: ignore[arg-type]


def test_procs_refuses_a_partial_verification(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="--procs runs every rank as its own process"):
        parse("--procs", "--verify-ranks", "sample")
    assert parse("--procs", "--verify-ranks", "all").verify_mode == "all"
    status = main(["simulate", "--verify-ranks", "most"])
    assert status == 2
    assert "argument --verify-ranks: invalid choice: 'most'" in capsys.readouterr().err


def test_the_report_config_names_the_mode_and_the_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *SMALL, "--cp", "4", "--verify-ranks", "sample")
    assert report["config"]["verify_ranks"] == "sample"
    assert report["config"]["verified_ranks"] == [0, 3]
    report = run_json(capsys, *SMALL, "--cp", "2")
    assert report["config"]["verify_ranks"] == "all"
    assert report["config"]["verified_ranks"] == [0, 1]


# --- the figures do not depend on the mode -------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_mode_gives_the_same_figures(capsys: pytest.CaptureFixture[str], cp: int) -> None:
    reports = {
        mode: run_json(capsys, *SMALL, "--cp", str(cp), "--verify-ranks", mode)
        for mode in ("all", "sample", "none")
    }
    assert reports["all"]["preemptions"] > 0  # the workload is under pressure
    for report in reports.values():
        del report["config"]["verify_ranks"], report["config"]["verified_ranks"]
    assert reports["sample"] == reports["all"]
    assert reports["none"] == reports["all"]


# --- a diverging rank is caught when it runs -----------------------------------------------


def started_group(cp: int, ranks: tuple[int, ...] | None) -> helix_kv.SimulatedCPGroup:
    """A group one step in, with a request decoding."""
    group = helix_kv.SimulatedCPGroup(config(cp), ranks=ranks)
    group.add_request(1, np.arange(6, dtype=np.int32), 4)
    group.update(np.zeros(group.schedule().num_samples, dtype=np.int32))
    return group


def test_every_rank_mode_catches_any_diverging_rank() -> None:
    group = started_group(8, None)
    group.schedulers[5].add_request(99, np.arange(3, dtype=np.int32), 2)  # only rank 5
    with pytest.raises(helix_kv.ScheduleMismatchError) as info:
        group.schedule()
    assert info.value.ranks == [5]
    assert "rank(s) 5 differ from rank(s) 0, 1, 2, 3, 4, 6, 7" in str(info.value)


def test_sampled_mode_catches_a_diverging_sampled_rank_by_its_rank_number() -> None:
    group = started_group(8, (0, 7))
    assert group.ranks == (0, 7)
    assert len(group.schedulers) == 2
    group.schedulers[1].add_request(99, np.arange(3, dtype=np.int32), 2)  # rank 7 only
    with pytest.raises(helix_kv.ScheduleMismatchError) as info:
        group.schedule()
    error = info.value
    assert error.ranks == [7]
    assert set(error.summaries) == {0, 7}
    assert "rank(s) 7 differ from rank(s) 0 in context_ids" in str(error)
    assert "rank 0: (none) | rank 7: 99:0+3" in str(error)


def test_sampled_mode_names_ranks_when_a_call_ends_differently() -> None:
    group = helix_kv.SimulatedCPGroup(config(8), ranks=(0, 7))
    group.schedulers[1].add_request(5, np.arange(3, dtype=np.int32), 2)
    with pytest.raises(helix_kv.ScheduleMismatchError) as info:
        group.add_request(5, np.arange(3, dtype=np.int32), 2)
    assert "rank 0: ok; rank 7: DuplicateRequestError" in str(info.value)
    assert info.value.ranks == [7]
    with pytest.raises(helix_kv.ScheduleMismatchError) as info:
        group._agree("update", [np.array([1, 2]), np.array([1])], "finished_ids")
    assert "update(): ranks [7] differ from rank 0 in finished_ids: rank 0: 1 2; rank 7: 1" in str(
        info.value
    )


def test_a_run_stops_at_a_diverging_sampled_rank_and_the_report_says_no() -> None:
    group = helix_kv.SimulatedCPGroup(config(4, kv_tokens=4096), ranks=(0, 3))
    group.schedulers[1].add_request(10_000, np.arange(3, dtype=np.int32), 2)  # rank 3 only
    workload = synthetic_workload(WorkloadSpec(num_requests=4, prompt_len_mean=20, seed=1))
    result = run_simulation(group, workload, config={"cp": 4, "verified_ranks": [0, 3]})
    assert not result.rank_agreement
    assert result.mismatch is not None
    assert "rank(s) 3 differ from rank(s) 0" in result.mismatch
    assert "rank agreement              NO (stopped at step 0)" in format_table(summarize(result))


def fake_output(active: bool, local_len: int, past_seen: int) -> types.SimpleNamespace:
    """Rank fields of one decode at position 5 (block 1 of tokens_per_block 4: rank 1's)."""
    return types.SimpleNamespace(
        step=3,
        generation_positions=np.array([5]),
        generation_owner_ranks=np.array([1], dtype=np.int32),
        generation_active=np.array([active]),
        generation_local_lens=np.array([local_len], dtype=np.int64),
        generation_past_seen_lens=np.array([past_seen], dtype=np.int64),
        summary=lambda: "step: 3\n",
    )


def test_sampled_ranks_hold_exactly_the_layouts_lengths() -> None:
    group = helix_kv.SimulatedCPGroup(config(4), ranks=(0, 1))
    layout = group.config.layout
    assert [layout.local_len(6, r) for r in (0, 1)] == [4, 2]
    # what the layout gives: rank 0 holds 4 of 6 tokens, rank 1 (the owner) 2, one of them new
    group._check_rank_fields([fake_output(False, 4, 4), fake_output(True, 2, 1)])
    with pytest.raises(helix_kv.ScheduleMismatchError) as info:
        group._check_rank_fields([fake_output(False, 4, 4), fake_output(True, 3, 2)])
    message = str(info.value)
    assert "rank 1: generation_local_lens are not the layout's lengths" in message
    assert "rank 1: generation_past_seen_lens are not the layout's lengths" in message
    assert "rank 0:" not in message
    assert info.value.ranks == [0, 1]
    with pytest.raises(helix_kv.ScheduleMismatchError, match="rank 0: generation_active"):
        group._check_rank_fields([fake_output(True, 4, 4), fake_output(True, 2, 1)])


# --- the group's ranks argument ------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "reason"),
    [
        ([], "at least one rank"),
        ([0, 4], r"must be in \[0, 4\)"),
        ([-1], r"must be in \[0, 4\)"),
        ([2, 1], "strictly increasing"),
        ([1, 1], "strictly increasing"),
    ],
)
def test_bad_ranks_are_a_config_error(ranks: list[int], reason: str) -> None:
    with pytest.raises(helix_kv.ConfigError, match=reason):
        helix_kv.SimulatedCPGroup(config(4), ranks=ranks)


def test_a_subset_group_reports_its_ranks() -> None:
    group = helix_kv.SimulatedCPGroup(config(4), ranks=[0, 3])
    assert not group.runs_every_rank
    assert len(group) == 4  # the group's size, not the ranks run
    assert repr(group).startswith("SimulatedCPGroup(cp_size=4, ranks=[0, 3], schedulers=")
    assert [s.config.cp_rank for s in group.schedulers] == [0, 3]
    whole = helix_kv.SimulatedCPGroup(config(4))
    assert whole.runs_every_rank
    assert whole.ranks == (0, 1, 2, 3)
    assert "ranks=" not in repr(whole)


# --- the report's wording ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--cp", "4"], "yes (4 ranks, every step)"),
        (["--cp", "4", "--verify-ranks", "all"], "yes (4 ranks, every step)"),
        (["--cp", "4", "--verify-ranks", "sample"], "yes (ranks 0 and 3 of 4, every step)"),
        (["--cp", "2", "--verify-ranks", "sample"], "yes (2 ranks, every step)"),
        (
            ["--cp", "4", "--verify-ranks", "none"],
            "not checked (rank 0 of 4 run alone: --verify-ranks none)",
        ),
        (["--cp", "16"], "yes (ranks 0 and 15 of 16, every step)"),
        (["--cp", "1", "--verify-ranks", "none"], "n/a (1 rank: nothing to compare)"),
    ],
)
def test_the_report_says_what_was_verified(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    status, out = simulate(capsys, *SMALL, "--kv-tokens", "65536", *argv)
    assert status == 0
    assert f"  rank agreement              {line}\n" in out
