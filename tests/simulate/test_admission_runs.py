"""``helix-kv simulate --admission-policy`` and ``--long-prefill-token-threshold``: the flags
reach the scheduler, the report shows them only when set (a run without them reports as it did
before they existed), and runs with them are exact and agree on every rank, plain and one step
ahead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helix_kv.cli import build_parser
from helix_kv.simulate.arguments import simulation_options

from ..helpers.cli import run_json, small_workload, usage_error
from ..helpers.scheduler import needs_scheduler

pytestmark = needs_scheduler

NEW_FIELDS = (
    "admission_policy",
    "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive",
)
#: 24 requests at once, prompts ~96 tokens, roomy.
AT_ONCE = [*small_workload(), "--kv-tokens", "65536"]
#: 24 requests arriving 0.5 a step into a tight pool: preemptions.
TIGHT = [*small_workload(arrival_rate="0.5"), "--kv-tokens", "1024"]


def healthy(report: dict[str, Any]) -> None:
    assert report["requests_finished"] == report["requests_total"]
    assert report["outputs_exact"] is True
    assert report["rank_agreement"] is True


def test_the_flags_set_their_fields() -> None:
    args = build_parser().parse_args(
        [
            "simulate", "--admission-policy", "priority", "--long-prefill-token-threshold", "64",
            "--long-prefill-token-threshold-adaptive",
        ]
    )  # fmt: skip
    assert simulation_options(args).scheduler == {
        "tokens_per_block": 16,
        "long_prefill_token_threshold": 64,
        "long_prefill_token_threshold_adaptive": True,
        "admission_policy": "priority",
    }


def test_the_report_shows_them_only_when_set(capsys: pytest.CaptureFixture[str]) -> None:
    default = run_json(capsys, *TIGHT)
    assert not set(NEW_FIELDS) & set(default["config"]["scheduler"])
    given = run_json(
        capsys, *TIGHT, "--admission-policy", "priority", "--long-prefill-token-threshold", "32"
    )
    scheduler = given["config"]["scheduler"]
    assert scheduler["admission_policy"] == "priority"
    assert scheduler["long_prefill_token_threshold"] == 32
    assert "long_prefill_token_threshold_adaptive" not in scheduler  # left at its default
    # the defaults given by hand decide alike and report alike
    explicit = run_json(
        capsys, *TIGHT, "--admission-policy", "fcfs", "--long-prefill-token-threshold", "0"
    )
    assert explicit == default


@pytest.mark.parametrize("overlap", [[], ["--overlap"]], ids=["plain", "overlap"])
def test_priority_admission_under_pressure_is_exact(
    capsys: pytest.CaptureFixture[str], overlap: list[str]
) -> None:
    fcfs = run_json(capsys, *TIGHT, *overlap)
    priority = run_json(capsys, *TIGHT, *overlap, "--admission-policy", "priority")
    healthy(fcfs)
    healthy(priority)
    assert priority["preemptions"] > 0
    assert (priority["waiting_steps_p50"], priority["recomputed_tokens"]) != (
        fcfs["waiting_steps_p50"],
        fcfs["recomputed_tokens"],
    ), "the priorities (--priority-levels 3) change the order"


def test_the_prefill_cap_spreads_the_first_step_over_every_request(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def first_step(*flags: str) -> dict[str, Any]:
        events = tmp_path / "events.jsonl"
        healthy(run_json(capsys, *AT_ONCE, "--events", str(events), *flags))
        steps = [json.loads(line) for line in events.read_text().splitlines()]
        return next(s for s in steps if s["type"] == "step")

    uncapped = first_step()
    capped = first_step("--long-prefill-token-threshold", "32")
    # every request prefills at once without the cap; with it, at most 32 tokens each
    assert uncapped["context_tokens"] > 24 * 32
    assert 24 * 16 <= capped["context_tokens"] <= 24 * 32


def test_a_cap_without_chunked_prefill_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = usage_error(
        capsys, *TIGHT, "--no-chunked-prefill", "--long-prefill-token-threshold", "32"
    )
    assert "--long-prefill-token-threshold" in line, line
