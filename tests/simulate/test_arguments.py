"""Flags of ``helix-kv simulate`` -> options and workload (no scheduler needed)."""

from __future__ import annotations

import argparse

import pytest

from helix_kv.cli import build_parser
from helix_kv.simulate.arguments import (
    UsageError,
    add_simulate_arguments,
    simulation_options,
    workload_spec,
)
from helix_kv.simulate.workload import LengthDistribution, WorkloadSpec


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["simulate", *argv])


def test_defaults_leave_scheduler_defaults_to_the_core() -> None:
    options = simulation_options(parse())
    assert options.cp_size == 2
    assert options.kv_tokens == 16_384
    assert options.scheduler == {"tokens_per_block": 16}
    assert not options.procs
    assert workload_spec(parse()) == WorkloadSpec()


def test_every_scheduler_flag_maps_to_its_field() -> None:
    args = parse(
        "--cp", "1", "--tokens-per-block", "8", "--max-batch-size", "4",
        "--max-num-tokens", "512", "--chunk-unit", "16", "--no-chunked-prefill",
        "--max-seq-len", "9000", "--capacity-policy", "guaranteed_no_evict",
        "--mode", "non_helix", "--host-tier-tokens", "100", "--policy", "priority",
        "--max-preemptions", "0", "--admit-after-preemption", "--deadlock-steps", "9",
    )  # fmt: skip
    assert simulation_options(args).scheduler == {
        "tokens_per_block": 8,
        "max_batch_size": 4,
        "max_num_tokens": 512,
        "chunk_unit": 16,
        "enable_chunked_prefill": False,
        "max_seq_len": 9000,
        "capacity_policy": "guaranteed_no_evict",
        "serving_mode": "non_helix",
        "host_tier_superblocks": 12,  # 100 // (8 * 1)
        "victim_policy": "priority",
        "max_preemptions_per_request": 0,
        "admit_after_preemption": True,
        "deadlock_steps": 9,
    }


def test_host_tier_below_one_superblock_is_refused() -> None:
    with pytest.raises(UsageError, match="less than one superblock"):
        simulation_options(parse("--host-tier-tokens", "5"))


def test_workload_flags() -> None:
    spec = workload_spec(
        parse(
            "--requests",
            "7",
            "--seed",
            "4",
            "--arrival-rate",
            "0",
            "--prompt-len",
            "1000",
            "--output-len",
            "20",
            "--output-len-max",
            "30",
            "--length-dist",
            "fixed",
            "--priority-levels",
            "1",
            "--abort-rate",
            "0.2",
        )
    )
    assert spec == WorkloadSpec(
        num_requests=7,
        seed=4,
        arrival_rate=0.0,
        prompt_len_mean=1000,
        prompt_len_max=4000,  # default max follows a larger mean
        output_len_mean=20,
        output_len_max=30,
        length_distribution=LengthDistribution.FIXED,
        priority_levels=1,
        abort_rate=0.2,
    )


def test_options_switch_policy_without_touching_the_rest() -> None:
    options = simulation_options(parse("--max-batch-size", "3"))
    other = options.with_victim_policy("least_computed_first")
    assert other.scheduler == {
        "tokens_per_block": 16,
        "max_batch_size": 3,
        "victim_policy": "least_computed_first",
    }
    assert options.scheduler == {"tokens_per_block": 16, "max_batch_size": 3}


# --- limits: every integer flag is bounded while parsing, naming the flag ------------------


@pytest.mark.parametrize(
    ("flag", "largest"),
    [
        ("--cp", "256"),
        ("--tokens-per-block", str(2**32 - 1)),
        ("--kv-tokens", str(2**63 - 1)),
        ("--max-batch-size", str(2**31 - 1)),
        ("--max-num-tokens", str(2**32 - 1)),
        ("--chunk-unit", str(2**32 - 1)),
        ("--max-seq-len", str(2**63 - 1)),
        ("--host-tier-tokens", str(2**63 - 1)),
        ("--max-preemptions", str(2**32 - 1)),
        ("--deadlock-steps", str(2**32 - 1)),
        ("--requests", "1000000"),
        ("--seed", str(2**64 - 1)),
        ("--prompt-len", str(2**20)),
        ("--prompt-len-max", str(2**20)),
        ("--output-len", str(2**20)),
        ("--output-len-max", str(2**20)),
        ("--priority-levels", str(2**31 - 1)),
        ("--max-steps", str(2**63 - 1)),
    ],
)
def test_integer_flags_take_their_largest_value_and_refuse_one_more(
    flag: str, largest: str
) -> None:
    simulate = argparse.ArgumentParser()
    add_simulate_arguments(simulate)
    dest = simulate._option_string_actions[flag].dest  # a scheduler flag's is its field
    assert getattr(parse(flag, largest), dest) == int(largest)
    with pytest.raises(UsageError) as caught:
        parse(flag, str(int(largest) + 1))
    message = str(caught.value)
    assert message.startswith(f"argument {flag}: must be at most {largest}, got ")
    assert "\n" not in message


@pytest.mark.parametrize(("rate", "ok"), [("0", True), ("1e-6", True), ("1e-7", False)])
def test_arrival_rate_is_zero_or_not_vanishingly_small(rate: str, ok: bool) -> None:
    if ok:
        assert parse("--arrival-rate", rate).arrival_rate == float(rate)
    else:
        with pytest.raises(UsageError, match="--arrival-rate: must be 0 or at least 1e-06"):
            parse("--arrival-rate", rate)


def test_default_longest_lengths_stay_within_the_limit() -> None:
    spec = workload_spec(parse("--prompt-len", str(2**20), "--output-len", str(2**19)))
    assert spec.prompt_len_max == 2**20
    assert spec.output_len_max == 2**20


def test_procs_takes_fewer_ranks() -> None:
    assert simulation_options(parse("--cp", "256")).cp_size == 256
    with pytest.raises(UsageError, match="--procs runs at most 64"):
        simulation_options(parse("--cp", "65", "--procs"))


def test_host_tier_beyond_the_core_field_is_refused() -> None:
    with pytest.raises(UsageError, match=r"--host-tier-tokens .* is more than 4294967295"):
        simulation_options(parse("--cp", "1", "--host-tier-tokens", str(2**40)))
