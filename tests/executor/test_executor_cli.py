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
from helix_kv.executor.hf_oracle import OracleRun, first_divergence, hf_greedy, save_tiny_checkpoint

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
