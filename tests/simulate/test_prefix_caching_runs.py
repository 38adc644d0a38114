"""``helix-kv simulate --prefix-caching`` over workloads that share prompt content: the report's
figures, ``--compare-policies`` with the run without caching beside, the events, the flags'
errors, and the default run left as it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import helix_kv
from helix_kv.cli import main

from ..helpers.cli import run_json, small_workload, usage_error
from ..helpers.scheduler import needs_scheduler

pytestmark = needs_scheduler

#: 24 requests arriving 0.5 a step, prompts ~96 and outputs ~48 tokens, superblocks of 16.
BASE = small_workload(arrival_rate="0.5")
ROOMY = [*BASE, "--kv-tokens", "65536"]
TIGHT = [*BASE, "--kv-tokens", "1024"]
SHARED = ["--shared-prefix-len", "128"]
PREFIX_KEYS = {
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_hit_rate",
    "prefix_cache_recompute_queries",
    "prefix_cache_recompute_hits",
    "prefix_cache_same_step_hits",
    "prefill_tokens_saved",
    "prefix_cache_evictions",
}


def run_table(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    status = main(["simulate", *argv])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return captured.out


def healthy(report: dict[str, Any]) -> None:
    assert report["requests_finished"] == report["requests_total"]
    assert report["outputs_exact"] is True
    assert report["rank_agreement"] is True


# --- synthetic workloads ---------------------------------------------------------------------


def test_a_shared_system_prompt_hits_and_saves_exactly_its_prefill(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cached = run_json(capsys, *ROOMY, *SHARED, "--prefix-caching")
    plain = run_json(capsys, *ROOMY, *SHARED)
    healthy(cached)
    healthy(plain)
    assert set(cached) >= PREFIX_KEYS
    assert not PREFIX_KEYS & set(plain)  # shown only with caching on
    assert cached["prefix_cache_hits"] > 0
    # 24 requests, all but the first find the 128-token system prompt cached (at least)
    assert cached["prefix_cache_hits"] >= 23 * 128
    assert cached["prefix_cache_hit_rate"] == pytest.approx(
        cached["prefix_cache_hits"] / cached["prefix_cache_queries"]
    )
    assert cached["prefill_tokens_saved"] == (
        cached["prefix_cache_hits"] + cached["prefix_cache_recompute_hits"]
    )
    # nothing preempted: every token the cache saved is one the run without it computed
    assert cached["preemptions"] == plain["preemptions"] == 0
    assert plain["computed_tokens"] - cached["computed_tokens"] == cached["prefill_tokens_saved"]
    assert cached["generated_tokens"] == plain["generated_tokens"]
    workload = cached["config"]["workload"]
    assert (workload["shared_prefix_len"], workload["shared_prefix_share"]) == (128, 1.0)
    assert cached["config"]["scheduler"]["enable_prefix_caching"] is True


def test_the_table_shows_the_cache_rows_only_with_caching(
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = run_table(capsys, *TIGHT, *SHARED, "--prefix-caching")
    for label in (
        "prefix cache hit rate",
        "prefill tokens saved",
        "re-prefill cache hits",
        "prefix cache evictions",
    ):
        assert label in table
    first = table.splitlines()[0]
    assert "prefix_caching" in first
    assert "shared_prefix=128 share=1" in first
    lines = table.splitlines()
    computed = next(i for i, line in enumerate(lines) if "computed tokens" in line)
    assert "prefix cache hit rate" in lines[computed + 1]
    assert "prefix cache" not in run_table(capsys, *TIGHT, *SHARED)


def test_under_pressure_recompute_reuses_the_cache_and_outputs_stay_exact(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *TIGHT, *SHARED, "--prefix-caching")
    healthy(report)
    assert report["preemptions"] > 0
    assert report["prefix_cache_evictions"] > 0
    assert report["prefix_cache_recompute_queries"] > 0
    assert 0 < report["prefix_cache_recompute_hits"] <= report["prefix_cache_recompute_queries"]


def test_conversations_hit_their_history(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*ROOMY, "--turns", "4", "--think-steps", "2"]
    cached = run_json(capsys, *argv, "--prefix-caching")
    plain = run_json(capsys, *argv)
    healthy(cached)
    # 18 of the 24 requests are later turns, each with a history of its earlier turns
    assert cached["prefix_cache_hit_rate"] > 0.4
    assert plain["computed_tokens"] - cached["computed_tokens"] == cached["prefill_tokens_saved"]
    assert cached["config"]["workload"]["turns"] == 4
    assert cached["config"]["workload"]["think_steps"] == 2.0


def test_one_step_ahead_with_caching_gives_the_outputs_of_the_plain_loop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *TIGHT, "--turns", "3", *SHARED, "--prefix-caching", "--overlap")
    healthy(report)
    assert report["outputs_match_plain"] is True
    assert report["prefix_cache_hits"] > 0


def test_procs_feed_every_rank_process_the_same_shared_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch")
    argv = [*TIGHT, *SHARED, "--turns", "2", "--prefix-caching"]
    in_process = run_json(capsys, *argv)
    with_procs = run_json(capsys, *argv, "--procs")
    assert with_procs["rank_agreement"] is True
    for key in ("steps", "computed_tokens", "preemptions", *sorted(PREFIX_KEYS)):
        assert with_procs[key] == in_process[key], key


# --- traces ----------------------------------------------------------------------------------


def _write(path: Path, *records: dict[str, Any]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_trace_token_ids_share_their_common_prefix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    system = list(range(100, 164))  # 64 tokens: 4 superblocks of 16
    trace = _write(
        tmp_path / "t.jsonl",
        *(
            {"id": i, "arrival_step": 5 * i, "output_len": 4, "token_ids": system + [i] * 20}
            for i in range(3)
        ),
    )
    report = run_json(
        capsys, "--trace", trace, "--cp", "2", "--tokens-per-block", "8", "--prefix-caching"
    )
    healthy(report)
    assert report["prefix_cache_hits"] == 2 * 64
    assert report["prefix_cache_queries"] == 3 * 84
    workload = report["config"]["workload"]
    assert workload == {"source": "trace", "path": trace, "requests": 3, "requests_with_content": 3}


def test_trace_hash_ids_share_their_common_blocks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = _write(
        tmp_path / "t.jsonl",
        {"id": 0, "arrival_step": 0, "prompt_len": 64, "output_len": 4, "hash_ids": [7, 8]},
        {"id": 1, "arrival_step": 9, "prompt_len": 50, "output_len": 4, "hash_ids": [7, 9]},
        {"id": 2, "arrival_step": 18, "prompt_len": 40, "output_len": 4},
    )
    argv = ["--trace", trace, "--cp", "2", "--tokens-per-block", "8", "--prefix-caching"]
    report = run_json(capsys, *argv, "--hash-block-tokens", "32")
    healthy(report)
    assert report["prefix_cache_hits"] == 32  # block 7: two superblocks
    workload = report["config"]["workload"]
    assert workload["hash_block_tokens"] == 32
    assert workload["requests_with_content"] == 2
    # in blocks of 512 (the default) the ids do not cover these prompts: a trace error
    assert "takes 1" in usage_error(capsys, *argv)


def test_requests_without_content_share_nothing_even_with_equal_tokens(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Ids VOCAB_SIZE apart get the same prompt tokens; a prompt of its own has a salt of its
    own, so they never hit each other's KV. Given as token_ids, the same tokens do."""
    from helix_kv.simulate.tokens import VOCAB_SIZE, prompt_tokens

    ids = (5, 5 + VOCAB_SIZE)
    own = _write(
        tmp_path / "own.jsonl",
        *({"id": i, "arrival_step": 4 * n, "prompt_len": 64, "output_len": 2}
          for n, i in enumerate(ids)),
    )  # fmt: skip
    argv = ["--cp", "1", "--tokens-per-block", "16", "--prefix-caching"]
    assert run_json(capsys, "--trace", own, *argv)["prefix_cache_hits"] == 0
    given = _write(
        tmp_path / "given.jsonl",
        *({"id": i, "arrival_step": 4 * n, "output_len": 2,
           "token_ids": prompt_tokens(i, 64).tolist()} for n, i in enumerate(ids)),
    )  # fmt: skip
    assert run_json(capsys, "--trace", given, *argv)["prefix_cache_hits"] == 48


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"token_ids": [1, 2], "prompt_len": 3}, "'prompt_len' (3) must be the number of"),
        ({"token_ids": [1, True]}, "'token_ids' entry 1 must be an integer, got true"),
        ({"token_ids": [2**31]}, "'token_ids' entry 0 must be a token id in [0, 2147483647]"),
        ({"token_ids": []}, "'token_ids' must not be empty"),
        ({"token_ids": [1], "hash_ids": [1]}, "not both"),
        ({"hash_ids": [1, "a"], "prompt_len": 600}, "'hash_ids' entry 1 must be an integer"),
    ],
)
def test_a_bad_prompt_content_stops_the_command_naming_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, record: dict[str, Any], reason: str
) -> None:
    good = {"id": 1, "arrival_step": 0, "prompt_len": 8, "output_len": 4}
    trace = _write(
        tmp_path / "t.jsonl", good, {"id": 2, "arrival_step": 0, "output_len": 4, **record}
    )
    line = usage_error(capsys, "--trace", trace)
    assert line.startswith(f"helix-kv simulate: error: trace {trace} line 2: ")
    assert reason in line


# --- --compare-policies ------------------------------------------------------------------------


def test_compare_policies_puts_the_run_without_caching_beside(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *TIGHT, *SHARED, "--prefix-caching", "--compare-policies")
    policies = report["policies"]
    assert list(policies) == [*helix_kv.SchedulerConfig.VICTIM_POLICIES, "no_prefix_cache"]
    baseline = policies.pop("no_prefix_cache")
    assert baseline["config"]["scheduler"]["enable_prefix_caching"] is False
    assert baseline["config"]["scheduler"]["victim_policy"] == "newest_first"
    assert not PREFIX_KEYS & set(baseline)
    healthy(baseline)
    for summary in policies.values():
        healthy(summary)
        assert summary["config"]["scheduler"]["enable_prefix_caching"] is True
        assert summary["prefix_cache_hits"] > 0
        assert summary["computed_tokens"] < baseline["computed_tokens"]

    table = run_table(capsys, *TIGHT, *SHARED, "--prefix-caching", "--compare-policies")
    # the columns come in blocks that fit 100 characters: the last block ends with it
    lines = table.splitlines()
    last = max(at for at, line in enumerate(lines) if line.startswith("  policy "))
    lines = lines[last:]
    assert lines[0].split()[-1] == "no_prefix_cache"
    hit_row = next(line for line in lines if "prefix cache hit rate" in line)
    assert hit_row.endswith(" -")  # the run without caching has no such figure
    computed = next(line for line in lines if "computed tokens" in line)
    assert computed.split()[-1] == str(baseline["computed_tokens"])


def test_compare_policies_without_caching_adds_no_column(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *TIGHT, *SHARED, "--compare-policies")
    assert list(report["policies"]) == list(helix_kv.SchedulerConfig.VICTIM_POLICIES)


def test_compare_policies_with_a_host_tier_and_caching(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    events = tmp_path / "run.jsonl"
    argv = [*TIGHT, *SHARED, "--prefix-caching", "--host-tier-tokens", "2048"]
    report = run_json(capsys, *argv, "--compare-policies", "--events", str(events))
    names = [*helix_kv.SchedulerConfig.VICTIM_POLICIES, *helix_kv.SchedulerConfig.SUSPEND_POLICIES]
    names.remove("suspend_first")  # the newest_first column: the same configuration
    assert list(report["policies"]) == [*names, "no_host_tier", "no_prefix_cache"]
    baseline = report["policies"]["no_prefix_cache"]
    assert baseline["config"]["scheduler"]["host_tier_superblocks"] > 0
    # it is compared with nothing itself: no recompute-only figures of another footing
    assert "recomputed_tokens_avoided" not in baseline
    # the baselines write no events file
    written = sorted(path.name for path in tmp_path.iterdir())
    assert "run.no_prefix_cache.jsonl" not in written
    assert "run.newest_first.jsonl" in written


# --- events ----------------------------------------------------------------------------------


def test_events_count_the_cached_tokens_per_step_and_per_request(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "run.jsonl"
    report = run_json(capsys, *TIGHT, *SHARED, "--prefix-caching", "--events", str(path))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    requests = [r for r in records if r["type"] == "request"]
    saved = report["prefill_tokens_saved"]
    assert saved > 0
    assert sum(s["cached_tokens"] for s in steps) == saved
    assert sum(r["cached_tokens"] for r in requests) == saved
    assert all(s["cached_tokens"] <= s["kv_tokens_read"] for s in steps)
    # without caching the keys are there, at zero
    report = run_json(capsys, *TIGHT, *SHARED, "--events", str(path))
    records = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert {r["cached_tokens"] for r in records} == {0}


# --- flags (their usage errors: tests/test_cli.py) --------------------------------------


def test_a_conversation_too_long_for_the_pool_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = usage_error(capsys, *BASE, "--kv-tokens", "512", "--turns", "8")
    assert "the workload cannot run" in line


# --- the default run -------------------------------------------------------------------------


def test_the_default_report_has_no_new_keys(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys)
    assert not PREFIX_KEYS & set(report)
    assert set(report["config"]["workload"]) == {
        "source", "requests", "seed", "arrival_rate", "prompt_len_mean", "prompt_len_max",
        "output_len_mean", "output_len_max", "length_distribution", "priority_levels",
        "abort_rate",
    }  # fmt: skip
    # the figures the user guide quotes for the default run
    assert (report["steps"], report["computed_tokens"], report["preemptions"]) == (970, 62707, 26)


# --- the user guide's example ------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"


def _guide_section() -> str:
    guide = GUIDE.read_text(encoding="utf-8")
    start = guide.index("### Shared prefixes: `--prefix-caching`")
    return guide[start : guide.index("\n### ", start + 1)]


def _blocks(section: str, info: str) -> list[str]:
    parts = section.split("```" + info + "\n")[1:]
    return [part[: part.index("```")] for part in parts]


def _command(block: str) -> list[str]:
    words = " ".join(line for line in block.splitlines() if not line.startswith("#"))
    argv = words.replace("\\", " ").split()
    assert argv[:2] == ["helix-kv", "simulate"]
    return argv[2:]


def test_the_user_guide_example_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    section = _guide_section()
    shared, burst, turns = map(_command, _blocks(section, "bash"))
    (sample,) = _blocks(section, "text")
    assert run_table(capsys, *shared) == sample
    # the figures the text quotes: the same command without caching, and the conversations
    plain = run_json(capsys, *[arg for arg in shared if arg != "--prefix-caching"])
    assert (plain["computed_tokens"], plain["steps"], plain["first_token_steps_p50"]) == (
        1067823,
        2819,
        622,
    )
    assert f"{100 * plain['kv_utilization_mean']:.1f}% without caching" in section
    compared = run_json(capsys, *turns)["policies"]
    cached, baseline = compared["newest_first"], compared["no_prefix_cache"]
    assert f"{100 * cached['prefix_cache_hit_rate']:.1f}%" == "90.4%"
    assert (cached["computed_tokens"], baseline["computed_tokens"]) == (235775, 1465411)
    for figure in ("90.4%", "235775", "1465411", "1067823", "2819", "622 steps"):
        assert figure in section
    # the burst: its system prompt computed once, in the step that admits it
    shared_burst = run_json(capsys, *burst)
    assert (
        shared_burst["prefix_cache_same_step_hits"],
        shared_burst["computed_tokens"],
        shared_burst["first_token_steps_p50"],
    ) == (47104, 25624, 2)
    assert shared_burst["prefix_cache_same_step_hits"] == 23 * 2048
    unshared = run_json(capsys, *[arg for arg in burst if arg != "--prefix-caching"])
    assert (unshared["computed_tokens"], unshared["first_token_steps_p50"]) == (156787, 10)
    for figure in ("47104 tokens", "25624", "p50 2 steps", "156787", "p50 10 steps"):
        assert figure in section
