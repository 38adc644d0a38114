"""The checks made before a simulation starts: core errors in the flags' terms, the pool and
request-length limits (checked before anything large is allocated), the usable capacity."""

from __future__ import annotations

import pytest

import helix_kv
from helix_kv.simulate.options import (
    MAX_KV_SUPERBLOCKS,
    MAX_REQUEST_TOKENS,
    SimulationOptions,
    SimulationSetupError,
    check_config,
    in_flag_terms,
    preflight,
)
from helix_kv.simulate.workload import RequestSpec

from ..helpers.scheduler import needs_scheduler

pytestmark = needs_scheduler


@pytest.mark.parametrize(
    ("core", "cli"),
    [
        (
            helix_kv.ConfigError(
                "serving_mode non_helix needs cp_size == 1 (got 2)",
                field="serving_mode",
                value="non_helix",
            ),
            "--mode non_helix needs --cp == 1 (got 2)",
        ),
        (
            helix_kv.ConfigError(
                "kv_tokens = 8 is less than one superblock (16 tokens = tokens_per_block 8 x "
                "cp_size 2)",
                field="kv_tokens",
                value=8,
            ),
            "--kv-tokens 8 is less than one superblock (16 tokens = --tokens-per-block 8 x --cp 2)",
        ),
        (
            helix_kv.ConfigError(
                "cp_size * tokens_per_block = 33554432 exceeds 16777216",
                field="tokens_per_block",
                value=2**23,
            ),
            "--cp * --tokens-per-block = 33554432 exceeds 16777216",
        ),
        (
            # the field at fault by its value, a count of superblocks beside its tokens flag
            helix_kv.ConfigError(
                "host_tier_superblocks = 4 is rejected; set host_tier_superblocks = 0",
                field="host_tier_superblocks",
                value=4,
            ),
            "--host-tier-tokens (4 superblocks) is rejected; set --host-tier-tokens in "
            "superblocks = 0",
        ),
        (
            helix_kv.ConfigError(
                "max_num_tokens = 8 is below chunk_unit = 16", field="max_num_tokens", value=8
            ),
            "--max-num-tokens 8 is below --chunk-unit = 16",
        ),
        # a scheduler error's remedy: every setting by its flag, the superblocks said
        (
            helix_kv.DeadlockError(
                "raise the KV budget (kv_superblocks / kv_tokens) or max_preemptions_per_request "
                '(now 2), a larger host tier (host_tier_superblocks, now 4) or capacity_policy="x"'
            ),
            "raise the KV budget (--kv-tokens) or --max-preemptions (now 2), a larger host tier "
            "(--host-tier-tokens in superblocks, now 4) or --capacity-policy x",
        ),
        (helix_kv.ConfigError("max_num_tokens_x stays"), "max_num_tokens_x stays"),  # names only
        (helix_kv.ConfigError("a\n  b"), "a b"),  # one line
    ],
)
def test_core_messages_read_in_flags(core: helix_kv.HelixKVError, cli: str) -> None:
    assert in_flag_terms(core) == cli


def test_config_errors_name_flags_not_fields() -> None:
    with pytest.raises(SimulationSetupError) as caught:
        check_config(SimulationOptions(cp_size=4, scheduler={"tokens_per_block": 2**23}))
    message = str(caught.value)
    assert "--cp * --tokens-per-block" in message
    assert "cp_size" not in message


def test_pool_beyond_the_limit_is_refused_before_a_ledger_exists() -> None:
    superblock = 2 * 16
    pages = {"tokens_per_block": 16}
    check_config(
        SimulationOptions(cp_size=2, kv_tokens=MAX_KV_SUPERBLOCKS * superblock, scheduler=pages)
    )
    too_many = (MAX_KV_SUPERBLOCKS + 1) * superblock
    with pytest.raises(SimulationSetupError) as caught:
        check_config(SimulationOptions(cp_size=2, kv_tokens=too_many, scheduler=pages))
    assert str(caught.value) == (
        f"--kv-tokens {(MAX_KV_SUPERBLOCKS + 1) * superblock} is {MAX_KV_SUPERBLOCKS + 1} "
        f"superblocks of 32 tokens; the simulator holds at most {MAX_KV_SUPERBLOCKS} "
        f"superblocks (--kv-tokens {MAX_KV_SUPERBLOCKS * superblock} with this --cp and "
        "--tokens-per-block)"
    )


def test_a_trace_request_beyond_the_length_limit_is_refused_before_its_prompt_is_built() -> None:
    options = SimulationOptions(cp_size=2, kv_tokens=4096, scheduler={"max_seq_len": 2**62})
    huge = RequestSpec(request_id=7, arrival_step=0, prompt_len=2**31 - 1, output_len=4)
    with pytest.raises(SimulationSetupError, match=f"request 7 .* at most {MAX_REQUEST_TOKENS}"):
        preflight(options, [huge])


def test_resolved_config_reports_the_usable_capacity_from_the_core() -> None:
    resolved = SimulationOptions(cp_size=3, scheduler={"tokens_per_block": 16}).resolved({})
    assert resolved["kv_tokens"] == 16_384
    config = helix_kv.SchedulerConfig(cp_size=3, tokens_per_block=16, kv_tokens=16_384)
    assert resolved["kv_tokens_effective"] == config.kv_tokens == 16_368
