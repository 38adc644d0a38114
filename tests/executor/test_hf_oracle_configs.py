"""Checkpoints transformers reads in ways that are easy to miss, against transformers itself
(CPU, float64, greedy).

Each case edits a tiny checkpoint transformers saved (``hf_oracle.save_tiny_checkpoint``): a
``config.json`` field as real checkpoints write it, or a field left out so that the model
type's default applies. transformers' own ``generate`` runs on the edited directory
(``from_pretrained``, as a user would load it) and the executor on the same directory: the
greedy tokens must agree up to near ties and the logits before any divergence within
``LOGIT_ATOL``, as in ``test_hf_oracle.py``. The EOS cases stop where ``generate`` stops with
the checkpoint's own generation config: any id of a list, ``generation_config.json`` first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import helix_kv

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file

from helix_kv.errors import CheckpointError
from helix_kv.executor import checkpoint
from helix_kv.executor.hf_oracle import (
    CHECKPOINT_EOS,
    TINY_FAMILIES,
    OracleRun,
    first_divergence,
    hf_greedy,
    save_tiny_checkpoint,
)
from helix_kv.executor.runner import ExecutorConfig, RunResult, run_rank

from .devices import run_fast_path

pytestmark = pytest.mark.skipif(
    not hasattr(helix_kv, "Scheduler"), reason="helix_kv.Scheduler binding not built yet"
)

TPB = 4
MAX_NEW = 12
VOCAB = 128
#: transformers' logit gap below which a differing greedy token is a near tie.
TIE_TOLERANCE = 1e-5
#: Largest logit difference from transformers before any divergence (float64 here, float32
#: RoPE tables and norms there).
LOGIT_ATOL = 1e-4

LLAMA3 = dict(TINY_FAMILIES["llama"]["rope_parameters"])
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}

#: (name, family, fields transformers saves the checkpoint with, config.json fields then
#: set, config.json fields then removed).
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    # DeepSeek-V3's q_a_layernorm and kv_a_layernorm: eps 1e-6 whatever rms_norm_eps says
    ("deepseek_latent_norm_eps", "deepseek_v3_lora_yarn", {}, {"rms_norm_eps": 0.05}, ()),
    ("deepseek_kv_norm_eps", "deepseek_v3", {}, {"rms_norm_eps": 0.05}, ()),
    # a top-level original_max_position_embeddings overwrites the RoPE dict's
    ("llama3_top_level_context", "llama", {}, {"original_max_position_embeddings": 16}, ()),
    (
        "yarn_top_level_context",
        "deepseek_v3_lora_yarn",
        {},
        {"original_max_position_embeddings": 16},
        (),
    ),
    # and without either, llama3 / yarn take max_position_embeddings (256)
    (
        "llama3_context_from_max_positions",
        "llama",
        {},
        {"rope_parameters": {k: v for k, v in LLAMA3.items() if "original" not in k}},
        (),
    ),
    # tie_word_embeddings with a distinct lm_head.weight stored: transformers does not tie
    ("tied_config_stored_head", "llama", {}, {"tie_word_embeddings": True}, ()),
    # rope_scaling, when set, replaces rope_parameters
    (
        "rope_scaling_over_rope_parameters",
        "llama",
        {},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        (),
    ),
    # yarn: a null factor is max_position_embeddings / original (256 / 64); falsy betas are
    # 32 and 1; a null truncate does not truncate
    ("yarn_null_factor", "llama", {}, {"rope_parameters": {**YARN, "factor": None}}, ()),
    (
        "yarn_zero_betas",
        "llama",
        {},
        {"rope_parameters": {**YARN, "beta_fast": 0, "beta_slow": 0}},
        (),
    ),
    ("yarn_null_truncate", "llama", {}, {"rope_parameters": {**YARN, "truncate": None}}, ()),
    # Mistral's transformers class has no biases, Qwen2's q/k/v biases only, whatever
    # attention_bias / mlp_bias say
    ("mistral_bias_fields", "mistral", {}, {"attention_bias": True, "mlp_bias": True}, ()),
    ("qwen2_bias_fields", "qwen2", {}, {"attention_bias": True, "mlp_bias": True}, ()),
    # an absent num_key_value_heads: Mistral's default is 8, Qwen2's 32
    (
        "mistral_default_kv_heads",
        "mistral",
        {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 8},
        {},
        ("num_key_value_heads",),
    ),
    (
        "qwen2_default_kv_heads",
        "qwen2",
        {"num_attention_heads": 64, "num_key_value_heads": 32, "head_dim": 4},
        {},
        ("num_key_value_heads",),
    ),
]


def prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(2025)
    lengths = [27, 9, 30, 5, 18, 23]
    return {100 + i: rng.integers(0, VOCAB, size=n).tolist() for i, n in enumerate(lengths)}


def edit_config(directory: Path, drop: tuple[str, ...] = (), **fields: Any) -> None:
    file = directory / "config.json"
    raw = json.loads(file.read_text())
    raw.update(fields)
    for name in drop:
        del raw[name]
    file.write_text(json.dumps(raw))


def executor_config(path: Path, **changes: Any) -> ExecutorConfig:
    return ExecutorConfig(
        tokens_per_block=TPB,
        kv_superblocks=1024 // TPB,
        max_batch_size=8,
        max_num_tokens=24,
        model=str(path),
        dtype="float64",
        record_logits=True,
    ).with_(**changes)


def check_against_oracle(result: RunResult, oracle: OracleRun, logits: bool = True) -> None:
    for rid, expected in oracle.tokens.items():
        ours = result.outputs[rid]
        problem = first_divergence(ours, expected, oracle.logits[rid], TIE_TOLERANCE)
        assert problem is None, f"request {rid}: {problem}"
        if not logits:
            continue
        agree = 0
        while agree < len(ours) and agree < len(expected) and ours[agree] == expected[agree]:
            agree += 1
        np.testing.assert_allclose(
            result.logits[rid][:agree], oracle.logits[rid][:agree].numpy(), rtol=0, atol=LOGIT_ATOL
        )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case's checkpoint, edited after transformers saved it."""
    root = tmp_path_factory.mktemp("hf_configs")
    paths = {}
    for name, family, overrides, fields, dropped in CASES:
        path = save_tiny_checkpoint(family, root / name, seed=11, **overrides)
        edit_config(path, dropped, **fields)
        paths[name] = path
    return paths


@pytest.fixture(scope="module")
def oracle(saved: dict[str, Path]) -> dict[str, OracleRun]:
    return {name: hf_greedy(path, prompts(), MAX_NEW) for name, path in saved.items()}


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_greedy_tokens_and_logits_equal_transformers(saved, oracle, name):
    result = run_rank(prompts(), MAX_NEW, executor_config(saved[name]))
    check_against_oracle(result, oracle[name])


def test_the_fast_path_takes_deepseek_latent_norm_eps(saved, oracle):
    """The MLA fast path (its fused latent norm) with the latent norms' own eps."""
    name = "deepseek_latent_norm_eps"
    job = executor_config(saved[name], decode_kernel=True, record_logits=False)
    (result,) = run_fast_path([(prompts(), MAX_NEW, job)], 1)
    assert result.fast_path_steps > 0
    check_against_oracle(result, oracle[name], logits=False)


def test_a_stored_head_is_read_where_the_config_ties(saved):
    """transformers warns and does not tie: the model runs the stored ``lm_head.weight``."""
    path = saved["tied_config_stored_head"]
    config = checkpoint.read_config(path)
    assert not config.tie_embeddings
    model = checkpoint.load_model(path)
    stored = load_file(path / "model.safetensors")["lm_head.weight"]
    assert np.array_equal(model.lm_head.t().numpy(), stored.numpy())


# -- EOS ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, OracleRun]:
    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("hf_eos") / "llama", seed=11)
    return path, hf_greedy(path, prompts(), MAX_NEW)


def two_eos_ids(run: OracleRun) -> list[int]:
    """``[first, second]``: ``first`` the commonest generated token, ``second`` one some
    request samples before any ``first`` (so only a loader that stops on any id of a list
    stops that request there)."""
    generated = [t for tokens in run.tokens.values() for t in tokens]
    first = int(np.bincount(generated, minlength=VOCAB).argmax())
    for tokens in run.tokens.values():
        before = tokens[: tokens.index(first)] if first in tokens else tokens
        if before[1:]:
            return [first, before[1]]
    raise AssertionError("no request samples another token before the commonest")


def run_with_checkpoint_eos(path: Path) -> tuple[RunResult, OracleRun]:
    eos = checkpoint.eos_token_ids(path)
    result = run_rank(prompts(), MAX_NEW, executor_config(path, eos_token_id=eos or None))
    return result, hf_greedy(path, prompts(), MAX_NEW, eos_token_id=CHECKPOINT_EOS)


def test_an_eos_list_in_config_json_stops_on_any(eos_checkpoint, tmp_path):
    source, free = eos_checkpoint
    path = Path(shutil.copytree(source, tmp_path / "eos_list"))
    ids = two_eos_ids(free)
    edit_config(path, eos_token_id=ids)
    (path / "generation_config.json").unlink()  # transformers then reads config.json's
    assert checkpoint.eos_token_ids(path) == tuple(ids)
    result, theirs = run_with_checkpoint_eos(path)
    ended = [tokens[-1] for tokens in theirs.tokens.values() if len(tokens) < MAX_NEW]
    assert ids[0] in ended  # both ids ended requests
    assert ids[1] in ended
    check_against_oracle(result, theirs)


def test_generation_config_json_comes_first(eos_checkpoint, tmp_path):
    """``generation_config.json`` is what ``generate`` reads: its EOS ids, or none where it
    names none, whatever config.json lists."""
    source, free = eos_checkpoint
    path = Path(shutil.copytree(source, tmp_path / "generation_config"))
    first, second = two_eos_ids(free)
    edit_config(path, eos_token_id=[first, second])
    generation = path / "generation_config.json"
    raw = json.loads(generation.read_text())
    generation.write_text(json.dumps({**raw, "eos_token_id": [second]}))
    assert checkpoint.eos_token_ids(path) == (second,)
    result, theirs = run_with_checkpoint_eos(path)
    assert any(len(tokens) < MAX_NEW for tokens in theirs.tokens.values())
    assert any(first in tokens for tokens in theirs.tokens.values())  # not an EOS there
    check_against_oracle(result, theirs)
    del raw["eos_token_id"]
    generation.write_text(json.dumps(raw))
    assert checkpoint.eos_token_ids(path) == ()
    result, theirs = run_with_checkpoint_eos(path)
    assert all(len(tokens) == MAX_NEW for tokens in theirs.tokens.values())
    check_against_oracle(result, theirs)


@pytest.mark.parametrize("value", ["2", 1.5, [2, -1], [True]])
def test_a_malformed_eos_token_id_is_refused(eos_checkpoint, tmp_path, value):
    source, _ = eos_checkpoint
    path = Path(shutil.copytree(source, tmp_path / "bad_eos"))
    (path / "generation_config.json").unlink()
    edit_config(path, eos_token_id=value)
    with pytest.raises(CheckpointError) as info:
        checkpoint.eos_token_ids(path)
    assert info.value.name == "eos_token_id"
    assert "config.json" in str(info.value)
