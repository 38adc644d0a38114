"""``python -m helix_kv.executor`` (``helix_kv.executor.cli``) on a tiny Llama checkpoint that
transformers saved, on the CPU in float64.

``OUT.jsonl`` has one ``{"id", "token_ids"}`` per request of ``IN.jsonl``, in input order, and
the tokens are transformers' own greedy ``generate`` (``hf_oracle.hf_greedy``): with a roomy
pool, under KV pressure (recompute-pause), with the host tier one step ahead, and under
``torchrun`` with two ranks on gloo. Bad input exits 2 with a message on stderr naming the
problem, and writes no output file.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import helix_kv

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helix_kv.executor.cli import main
from helix_kv.executor.hf_oracle import (
    CHECKPOINT_EOS,
    OracleRun,
    first_divergence,
    hf_greedy,
    save_tiny_checkpoint,
)

pytestmark = pytest.mark.skipif(
    not hasattr(helix_kv, "Scheduler"), reason="helix_kv.Scheduler binding not built yet"
)

VOCAB = 128
#: (id, prompt length, max_new_tokens): ids out of order, lengths 1 to 25.
REQUESTS = ((7, 25, 10), (3, 3, 14), (11, 18, 6), (0, 1, 12), (5, 10, 9))
#: transformers' logit gap below which a differing greedy token is a near tie (as in
#: test_hf_oracle: float64 here, float32 RoPE tables and norms in transformers).
TIE_TOLERANCE = 1e-5
BASE = ("--device", "cpu", "--dtype", "float64", "--eos-token-id", "none")
#: 4-token blocks, a 40-token pool (the largest request needs 35) and 16-token steps:
#: requests are admitted together and some must give their KV back.
PRESSURE = ("--tokens-per-block", "4", "--kv-tokens", "40", "--max-num-tokens", "16")


def prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(7)
    return {rid: rng.integers(0, VOCAB, size=n).tolist() for rid, n, _ in REQUESTS}


BUDGETS = {rid: budget for rid, _, budget in REQUESTS}


def request_lines() -> list[str]:
    return [
        json.dumps({"id": rid, "token_ids": tokens, "max_new_tokens": BUDGETS[rid]})
        for rid, tokens in prompts().items()
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("cli") / "llama", seed=3)


@pytest.fixture(scope="module")
def oracle(model: Path) -> OracleRun:
    return hf_greedy(model, prompts(), BUDGETS)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "in.jsonl"
    path.write_text("\n".join(request_lines()) + "\n")
    return path


@pytest.fixture(autouse=True)
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process runs are one rank, whatever the environment says."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def run_cli(model: Path, prompts_path: Path, output: Path, *options: str) -> int:
    argv = ["--model", str(model), "--prompts", str(prompts_path), "--output", str(output)]
    return main([*argv, *BASE, *options])


def read_output(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_output(path: Path, oracle: OracleRun) -> None:
    records = read_output(path)
    assert [r["id"] for r in records] == [rid for rid, _, _ in REQUESTS]  # input order
    for record in records:
        assert set(record) == {"id", "token_ids"}
        rid = record["id"]
        assert isinstance(rid, int)
        tokens = record["token_ids"]
        assert isinstance(tokens, list)
        assert len(tokens) == BUDGETS[rid]  # no EOS: every request runs its budget
        problem = first_divergence(tokens, oracle.tokens[rid], oracle.logits[rid], TIE_TOLERANCE)
        assert problem is None, f"request {rid}: {problem}"


def counts(summary: str) -> dict[str, int]:
    return {
        name: int(n) for n, name in re.findall(r"(\d+) (preemptions|suspensions|resumes)", summary)
    }


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("roomy", ()),
        ("roomy_overlap", ("--overlap",)),
        ("pressure", PRESSURE),
        ("pressure_host_tier_overlap", (*PRESSURE, "--host-tier-tokens", "256", "--overlap")),
    ],
)
def test_output_equals_transformers_greedy(
    model: Path,
    oracle: OracleRun,
    prompt_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mode: str,
    options: tuple[str, ...],
) -> None:
    output = tmp_path / "out.jsonl"
    assert run_cli(model, prompt_file, output, *options) == 0
    check_output(output, oracle)
    summary = capsys.readouterr().out
    assert f"cp 1: {len(REQUESTS)} requests" in summary
    ran = counts(summary)
    assert ran.keys() == {"preemptions", "suspensions", "resumes"}, summary
    if mode == "pressure":
        assert ran["preemptions"] > 0, summary
        assert ran["suspensions"] == 0, summary
    elif mode == "pressure_host_tier_overlap":
        assert ran["suspensions"] > 0, summary
        assert ran["resumes"] == ran["suspensions"], summary
    else:
        assert ran == {"preemptions": 0, "suspensions": 0, "resumes": 0}, summary


# -- bad input ----------------------------------------------------------------------------


@pytest.fixture
def refused(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """Run with ``lines`` as IN.jsonl (or ``prompts_path``), check exit 2, no OUT.jsonl and
    an error on stderr containing each fragment; returns the message."""

    def check(
        *fragments: str,
        lines: list[str] | None = None,
        options: tuple[str, ...] = (),
        model_dir: Path | None = None,
        prompts_path: Path | None = None,
    ) -> str:
        if prompts_path is None:
            prompts_path = tmp_path / "in.jsonl"
            prompts_path.write_text("\n".join(request_lines() if lines is None else lines))
        output = tmp_path / "out.jsonl"
        status = run_cli(model_dir or model, prompts_path, output, *options)
        captured = capsys.readouterr()
        assert status == 2, captured
        assert not output.exists()
        assert captured.out == ""
        message = captured.err
        assert message.startswith("python -m helix_kv.executor: error: "), message
        assert message.count("\n") == 1, message  # one line
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        return message

    return check


def test_prompt_line_not_json(refused: Callable[..., str]) -> None:
    lines = request_lines()
    lines[2] = '{"id": 11, "token_ids": [1, 2'
    refused("in.jsonl line 3", "not JSON", lines=lines)


def test_prompt_line_missing_key(refused: Callable[..., str]) -> None:
    lines = request_lines()
    lines[1] = json.dumps({"id": 3, "token_ids": [1, 2]})
    refused("line 2", '{"id", "token_ids", "max_new_tokens"}', lines=lines)


def test_prompt_line_not_an_object(refused: Callable[..., str]) -> None:
    refused("line 1", '{"id", "token_ids", "max_new_tokens"}', lines=["[1, 2, 3]"])


def test_token_id_out_of_vocab(refused: Callable[..., str]) -> None:
    lines = request_lines()
    lines[4] = json.dumps({"id": 5, "token_ids": [1, VOCAB], "max_new_tokens": 2})
    refused("line 5", f"vocab_size = {VOCAB}", lines=lines)


def test_duplicate_id(refused: Callable[..., str]) -> None:
    lines = request_lines()
    lines[3] = json.dumps({"id": 7, "token_ids": [1], "max_new_tokens": 2})
    refused("line 4", "id 7 given twice", lines=lines)


def test_max_new_tokens_zero(refused: Callable[..., str]) -> None:
    lines = request_lines()
    lines[0] = json.dumps({"id": 7, "token_ids": [1], "max_new_tokens": 0})
    refused("line 1", "max_new_tokens must be a positive integer, got 0", lines=lines)


def test_empty_prompt_file(refused: Callable[..., str]) -> None:
    refused("in.jsonl", "no requests", lines=[])
    refused("no requests", lines=["", "  "])


def test_prompt_file_missing(refused: Callable[..., str], tmp_path: Path) -> None:
    refused("absent.jsonl", "cannot read", prompts_path=tmp_path / "absent.jsonl")


def test_bad_model_directory(refused: Callable[..., str], tmp_path: Path) -> None:
    refused("checkpoint", "not a directory", model_dir=tmp_path / "no-such-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused("checkpoint", "config.json: missing", model_dir=empty)


def test_model_with_a_missing_tensor(
    refused: Callable[..., str], model: Path, tmp_path: Path
) -> None:
    """A config that reads but weights that do not load: the loader's error, exit 2."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model / "config.json").read_text())
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    refused("model.layers.1.mlp.up_proj.weight", "tensor missing", model_dir=broken)


def test_kv_tokens_below_one_superblock(refused: Callable[..., str]) -> None:
    refused("--kv-tokens 8 is below one superblock (16 tokens)", options=("--kv-tokens", "8"))


def test_kv_tokens_below_the_largest_request(refused: Callable[..., str]) -> None:
    refused(
        "request 7 can never be scheduled",
        options=("--tokens-per-block", "4", "--kv-tokens", "16"),
    )


def test_cuda_graphs_on_the_cpu(refused: Callable[..., str]) -> None:
    refused("--cuda-graphs needs --device cuda", options=("--cuda-graphs",))


def test_bad_eos_token_id(refused: Callable[..., str]) -> None:
    # BASE's "none" comes first; the last --eos-token-id wins
    refused(
        "--eos-token-id must be auto, none or non-negative integers",
        options=("--eos-token-id", "x"),
    )
    refused("got '-1'", options=("--eos-token-id", "-1"))


def test_output_path_checked_before_the_run(
    model: Path, prompt_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "no-such-dir" / "out.jsonl"
    assert run_cli(model, prompt_file, output) == 2
    err = capsys.readouterr().err
    assert "--output" in err
    assert "not a file in an existing directory" in err
    assert not output.parent.exists()


# -- torchrun -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_torchrun_two_ranks_equal_one_process(
    model: Path, oracle: OracleRun, prompt_file: Path, tmp_path: Path
) -> None:
    single = tmp_path / "single.jsonl"
    assert run_cli(model, prompt_file, single) == 0
    grouped = tmp_path / "cp2.jsonl"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "helix_kv.executor",
        "--model",
        str(model),
        "--prompts",
        str(prompt_file),
        "--output",
        str(grouped),
        *BASE,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "cp 2: 5 requests" in done.stdout
    assert done.stdout.count("cp 2:") == 1  # rank 0 alone reports
    assert grouped.read_text() == single.read_text()
    check_output(grouped, oracle)


def test_random_weights_build_the_config_without_its_weights(
    model: Path, prompt_file: Path, tmp_path: Path
) -> None:
    """``--random-weights SEED``: config.json alone (no safetensors read) with seeded
    weights: the tokens of the same config and seed run through the Python API."""
    import dataclasses

    from helix_kv.executor.checkpoint import read_config
    from helix_kv.executor.runner import ExecutorConfig, run_rank

    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((model / "config.json").read_text())
    output = tmp_path / "out.jsonl"
    assert run_cli(config_only, prompt_file, output, "--random-weights", "9") == 0
    seeded = dataclasses.replace(read_config(model), seed=9)
    expected = run_rank(
        prompts(),
        BUDGETS,
        ExecutorConfig(
            tokens_per_block=16,
            kv_superblocks=64,
            max_batch_size=64,
            max_num_tokens=2048,
            model=seeded,
        ),
    )
    records = read_output(output)
    assert {r["id"]: r["token_ids"] for r in records} == expected.outputs
    # and other seeds give other weights: not the checkpoint's tokens
    assert run_cli(config_only, prompt_file, output, "--random-weights", "10") == 0
    assert {r["id"]: r["token_ids"] for r in read_output(output)} != expected.outputs


# -- prefix caching, drafts, the summary, EOS ----------------------------------------------

#: Prompts sharing a 24-token prefix (six 4-token blocks), each with its own tail.
SHARED_PREFIX = np.random.default_rng(11).integers(0, VOCAB, size=24).tolist()


@pytest.fixture(scope="module")
def shared_prefix_prompts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    rng = np.random.default_rng(12)
    tokens = {
        rid: SHARED_PREFIX + rng.integers(0, VOCAB, size=3 + rid).tolist() for rid in range(4)
    }
    path = tmp_path_factory.mktemp("shared") / "in.jsonl"
    lines = [json.dumps({"id": r, "token_ids": t, "max_new_tokens": 8}) for r, t in tokens.items()]
    path.write_text("\n".join(lines) + "\n")
    return path, tokens


def check_tokens(path: Path, oracle: OracleRun) -> dict[int, list[int]]:
    outputs = {int(r["id"]): list(r["token_ids"]) for r in read_output(path)}  # type: ignore[arg-type]
    for rid, tokens in oracle.tokens.items():
        problem = first_divergence(outputs[rid], tokens, oracle.logits[rid], TIE_TOLERANCE)
        assert problem is None, f"request {rid}: {problem}"
    return outputs


def test_prefix_caching_reuses_the_shared_prefix(
    model: Path, shared_prefix_prompts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--prefix-caching``: the requests after the first find the shared prefix cached (one
    request at a time: ``--max-batch-size 1``); tokens as transformers'; the summary line
    counts the hits."""
    prompt_path, tokens = shared_prefix_prompts
    expected = hf_greedy(model, tokens, 8)
    options = ("--tokens-per-block", "4", "--max-batch-size", "1")
    output = tmp_path / "out.jsonl"
    assert run_cli(model, prompt_path, output, *options, "--prefix-caching") == 0
    check_tokens(output, expected)
    line = capsys.readouterr().out
    found = re.search(r"prefix cache (\d+) of (\d+) prompt tokens hit \((\d+\.\d)%\)", line)
    assert found, line
    hits, queries = int(found[1]), int(found[2])
    assert queries == sum(len(t) for t in tokens.values())
    assert hits >= 3 * 24  # the three requests after the first: the whole shared prefix
    assert found[3] == f"{100 * hits / queries:.1f}"
    assert run_cli(model, prompt_path, output, *options) == 0  # off: no such counters
    assert "prefix cache" not in capsys.readouterr().out


def test_drafts_are_counted_in_the_summary(
    model: Path, oracle: OracleRun, prompt_file: Path, tmp_path: Path, capsys
) -> None:
    output = tmp_path / "out.jsonl"
    assert run_cli(model, prompt_file, output, "--spec-tokens", "3") == 0
    check_output(output, oracle)
    line = capsys.readouterr().out
    found = re.search(r"drafts (\d+) of (\d+) accepted \((\d+\.\d)%\) in (\d+) steps", line)
    assert found, line
    accepted, drafted, steps = int(found[1]), int(found[2]), int(found[4])
    assert drafted > 0
    assert steps > 0
    assert 0 <= accepted <= drafted
    assert found[3] == f"{100 * accepted / drafted:.1f}"


def test_json_summary(
    model: Path, shared_prefix_prompts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json``: one JSON object on stdout and nothing else, the counters of the run."""
    prompt_path, tokens = shared_prefix_prompts
    output = tmp_path / "out.jsonl"
    options = ("--tokens-per-block", "4", "--max-batch-size", "1", "--prefix-caching")
    assert run_cli(model, prompt_path, output, *options, "--spec-tokens", "2", "--json") == 0
    stdout = capsys.readouterr().out
    assert stdout.count("\n") == 1
    summary = json.loads(stdout)
    outputs = {r["id"]: r["token_ids"] for r in read_output(output)}
    assert summary["cp_size"] == 1
    assert summary["requests"] == len(tokens)
    assert summary["generated_tokens"] == sum(len(t) for t in outputs.values()) == 4 * 8
    assert summary["total_s"] > 0
    assert summary["tokens_per_s"] == pytest.approx(32 / summary["total_s"])
    assert summary["steps"] > 0
    assert summary["preemptions"] == summary["suspensions"] == summary["resumes"] == 0
    prefix = summary["prefix_cache"]
    assert prefix["enabled"]
    assert prefix["queries"] == sum(len(t) for t in tokens.values())
    assert prefix["hits"] >= 3 * 24
    assert prefix["hit_rate"] == pytest.approx(prefix["hits"] / prefix["queries"])
    assert {"recompute_queries", "recompute_hits", "evictions"} <= prefix.keys()
    assert prefix["same_step_hits"] == 0  # a batch of one: one admission a step
    spec = summary["spec_decode"]
    assert spec["num_speculative_tokens"] == 2
    assert spec["drafted"] > 0
    assert spec["draft_steps"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
    # and the same run without --json prints the line instead, the same outputs
    again = tmp_path / "again.jsonl"
    assert run_cli(model, prompt_path, again, *options, "--spec-tokens", "2") == 0
    assert capsys.readouterr().out.startswith("cp 1: 4 requests, 32 tokens generated")
    assert again.read_text() == output.read_text()


def test_auto_eos_stops_on_any_id_of_config_json(
    model: Path, oracle: OracleRun, prompt_file: Path, tmp_path: Path
) -> None:
    """``--eos-token-id auto`` with a list in config.json (no generation_config.json): a
    request ends at any of them, as transformers' ``generate`` does; ``2,7``-style ids
    give the same."""
    generated = [t for tokens in oracle.tokens.values() for t in tokens]
    first = int(np.bincount(generated, minlength=VOCAB).argmax())
    # and a token some request samples second, before any `first`
    second = [t[1] for t in oracle.tokens.values() if first not in t[:2] and t[1:]]
    ids = [first, *second[:1]]
    assert len(ids) == 2
    listed = tmp_path / "listed"
    listed.mkdir()
    raw = json.loads((model / "config.json").read_text())
    (listed / "config.json").write_text(json.dumps({**raw, "eos_token_id": ids}))
    (listed / "model.safetensors").symlink_to(model / "model.safetensors")
    expected = hf_greedy(listed, prompts(), BUDGETS, eos_token_id=CHECKPOINT_EOS)
    ended = [tokens[-1] for rid, tokens in expected.tokens.items() if len(tokens) < BUDGETS[rid]]
    assert set(ids) <= set(ended), (ids, ended)  # each id ended a request
    auto, explicit = tmp_path / "auto.jsonl", tmp_path / "explicit.jsonl"
    assert main(["--model", str(listed), "--prompts", str(prompt_file), "--output", str(auto),
                 "--device", "cpu", "--dtype", "float64"]) == 0  # fmt: skip
    check_tokens(auto, expected)
    assert {r["id"]: r["token_ids"] for r in read_output(auto)} == expected.tokens
    option = ",".join(map(str, ids))
    assert run_cli(listed, prompt_file, explicit, "--eos-token-id", option) == 0
    assert explicit.read_text() == auto.read_text()
