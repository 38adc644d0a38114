"""Loading Hugging Face checkpoint directories (``helix_kv.executor.checkpoint``).

What the loader cannot run as transformers runs it is refused with a
:class:`~helix_kv.errors.CheckpointError` (a ``ValueError``) whose ``.name`` is the
``config.json`` field, file or tensor at fault: each test below breaks one thing in a tiny
checkpoint transformers saved (``hf_oracle.save_tiny_checkpoint``, built once per module and
copied per test) and checks the type, the name and a telling part of the message. What it
accepts must map to the configs transformers builds: each family's fields, and the RoPE
tables (``inv_freq``, the cos / sin factor, MLA's softmax scale) equal transformers' own
functions on the same config.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from helix_kv.errors import CheckpointError
from helix_kv.executor.checkpoint import ARCHITECTURES, load_model, load_weights, read_config
from helix_kv.executor.hf_oracle import TINY_FAMILIES, save_tiny_checkpoint
from helix_kv.executor.hf_oracle import tiny_config as _tiny_config
from helix_kv.executor.model import LlamaConfig, MLAConfig, RopeScaling

SUPPORTED = ", ".join(ARCHITECTURES)
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny checkpoint, saved once (tests copy it before changing it)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: save_tiny_checkpoint(f, root / f, seed=5) for f in TINY_FAMILIES}


@pytest.fixture
def copy(tiny: dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    """A fresh copy of a family's checkpoint, to break."""

    def make(family: str) -> Path:
        return Path(shutil.copytree(tiny[family], tmp_path / family))

    return make


def edit_config(directory: Path, drop: tuple[str, ...] = (), **fields: Any) -> None:
    """Rewrite ``config.json`` with ``fields`` set and the ``drop`` fields removed."""
    file = directory / "config.json"
    raw = json.loads(file.read_text())
    raw.update(fields)
    for name in drop:
        del raw[name]
    file.write_text(json.dumps(raw))


def tiny_config(family: str, **overrides: Any) -> Any:
    """transformers' config of a tiny family, from copies: transformers writes defaults into
    the nested ``rope_parameters`` dict it is given (``partial_rotary_factor`` among them),
    which would otherwise change ``TINY_FAMILIES`` for later tests."""
    fields = deepcopy({**TINY_FAMILIES[family], **overrides})
    return _tiny_config(family, **fields)


def save_their_config(config: Any, directory: Path) -> None:
    """Write transformers' ``config`` object as ``directory``'s config.json."""
    config.architectures = [_ARCH[config.model_type]]
    config.save_pretrained(directory)


_ARCH = {a.removesuffix("ForCausalLM").lower(): a for a in ARCHITECTURES}
_ARCH["deepseek_v3"] = "DeepseekV3ForCausalLM"


def config_of(directory: Path) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return raw


def edit_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite ``model.safetensors`` after ``edit`` changed its tensors in place."""
    tensors = load_file(directory / WEIGHTS)
    edit(tensors)
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})


def drop(tensors: dict[str, torch.Tensor], name: str) -> None:
    del tensors[name]


def refused(
    directory: Path, name: str | None, *fragments: str, weights: bool = False
) -> CheckpointError:
    """The CheckpointError that reading (``weights``: loading) ``directory`` raises, checked
    to name ``name``, the directory and each of ``fragments``."""

    def read() -> object:
        config = read_config(directory)
        return load_weights(directory, config) if weights else config

    with pytest.raises(CheckpointError) as info:
        read()
    error = info.value
    assert isinstance(error, ValueError)
    assert error.name == name, str(error)
    assert error.path == str(directory)
    message = str(error)
    assert str(directory) in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return error


# -- the directory and config.json --------------------------------------------------------


def test_not_a_directory(tmp_path: Path) -> None:
    refused(tmp_path / "absent", None, "not a directory")
    file = tmp_path / "file"
    file.write_text("{}")
    refused(file, None, "not a directory")


def test_no_config_json(tmp_path: Path) -> None:
    refused(tmp_path, "config.json", "missing")


def test_config_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ')
    refused(tmp_path, "config.json", "not readable JSON")


def test_config_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('["LlamaForCausalLM"]')
    refused(tmp_path, "config.json", "not a JSON object")


def test_unsupported_architecture(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    refused(path, "architectures", "'GPT2LMHeadModel' is not supported", SUPPORTED)


def test_missing_architectures(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(path, drop=("architectures",))
    refused(path, "architectures", "None is not supported", SUPPORTED)
    edit_config(path, architectures=[])
    refused(path, "architectures", "None is not supported", SUPPORTED)


@pytest.mark.parametrize(
    ("family", "field"),
    [
        ("llama", "hidden_size"),
        ("llama", "vocab_size"),
        ("qwen2", "num_hidden_layers"),
        ("deepseek_v3", "kv_lora_rank"),
        ("deepseek_v3_lora_yarn", "qk_rope_head_dim"),
    ],
)
def test_missing_required_field(copy: Callable[[str], Path], family: str, field: str) -> None:
    path = copy(family)
    edit_config(path, drop=(field,))
    refused(path, field, "missing")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 0),
        ("num_attention_heads", -4),
        ("intermediate_size", 96.0),
        ("vocab_size", "128"),
        ("num_hidden_layers", True),
    ],
)
def test_non_positive_or_non_integer_field(
    copy: Callable[[str], Path], field: str, value: object
) -> None:
    path = copy("llama")
    edit_config(path, **{field: value})
    refused(path, field, "must be a positive integer", repr(value))


@pytest.mark.parametrize("eps", [0, -1e-6, "1e-6", True])
def test_rms_norm_eps_must_be_a_positive_number(copy: Callable[[str], Path], eps: object) -> None:
    path = copy("llama")
    edit_config(path, rms_norm_eps=eps)
    refused(path, "rms_norm_eps", "must be a positive number", repr(eps))


def test_null_num_key_value_heads_means_one_per_head(copy: Callable[[str], Path]) -> None:
    """transformers reads ``num_key_value_heads: null`` as ``num_attention_heads``."""
    path = copy("llama")
    edit_config(path, num_key_value_heads=None)
    config = read_config(path)
    assert isinstance(config, LlamaConfig)
    assert config.num_kv_heads == config.num_heads == 4
    assert tiny_config("llama", num_key_value_heads=None).num_key_value_heads == 4


@pytest.mark.parametrize(
    ("family", "heads", "expected"),
    [("llama", 4, 4), ("mistral", 16, 8), ("qwen2", 64, 32), ("deepseek_v3", 4, 128)],
)
def test_absent_num_key_value_heads_is_the_model_types_default(
    copy: Callable[[str], Path], family: str, heads: int, expected: int
) -> None:
    """transformers' default where config.json has no ``num_key_value_heads``: Llama one per
    head, Mistral 8, Qwen2 32, DeepSeek-V3 128 (its MLA reads none of them)."""
    path = copy(family)
    edit_config(path, drop=("num_key_value_heads",), num_attention_heads=heads, head_dim=4)
    assert AutoConfig.from_pretrained(path).num_key_value_heads == expected
    if family == "deepseek_v3":
        assert isinstance(read_config(path), MLAConfig)
        return
    config = read_config(path)
    assert isinstance(config, LlamaConfig)
    assert config.num_kv_heads == expected


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "deepseek_v3"])
def test_absent_fields_take_the_installed_transformers_defaults(
    copy: Callable[[str], Path], family: str
) -> None:
    """``tie_word_embeddings``, ``rms_norm_eps`` and ``max_position_embeddings`` left out:
    the loader's defaults are those of the transformers installed here (its config class)."""
    path = copy(family)
    fields = ("tie_word_embeddings", "rms_norm_eps", "max_position_embeddings")
    edit_config(path, drop=tuple(f for f in fields if f in config_of(path)))
    theirs = AutoConfig.from_pretrained(path)
    config = read_config(path)
    assert config.tie_embeddings == theirs.tie_word_embeddings
    assert config.rms_eps == theirs.rms_norm_eps
    rope = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}
    edit_config(path, rope_parameters=rope)  # yarn's null factor reads max_position_embeddings
    scaling = read_config(path).rope_scaling
    assert scaling is not None
    assert scaling.factor == theirs.max_position_embeddings / 64


def test_deepseek_with_fewer_kv_heads_than_heads_is_refused(copy: Callable[[str], Path]) -> None:
    """transformers' DeepSeek-V3 attention repeats its expanded heads
    ``num_attention_heads // num_key_value_heads`` times: it fails on such a config."""
    path = copy("deepseek_v3")
    edit_config(path, num_key_value_heads=2)
    refused(path, "num_key_value_heads", "2 < num_attention_heads = 4")


def test_a_model_type_other_than_the_architectures_is_refused(
    copy: Callable[[str], Path],
) -> None:
    """transformers builds the class of ``model_type`` (here Qwen2's, with q/k/v biases)."""
    path = copy("llama")
    edit_config(path, model_type="qwen2")
    refused(path, "model_type", "'qwen2' is not LlamaForCausalLM's 'llama'")
    edit_config(path, drop=("model_type",))
    assert isinstance(read_config(path), LlamaConfig)


def test_inconsistent_geometry_names_config_json(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(path, num_key_value_heads=3)
    refused(path, "config.json", "num_heads must be a multiple of num_kv_heads")


# -- RoPE ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_type(copy: Callable[[str], Path], rope_type: str) -> None:
    path = copy("llama")
    edit_config(path, rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0})
    refused(
        path, "rope_parameters", f"rope_type {rope_type!r} is not supported", "linear, llama3, yarn"
    )


def test_legacy_rope_scaling_linear_is_accepted(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(
        path,
        drop=("rope_parameters",),
        rope_scaling={"type": "linear", "factor": 2},
        rope_theta=5000.0,
    )
    config = read_config(path)
    assert config.rope_theta == 5000.0
    assert config.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    # transformers reads the same fields the same way
    theirs = tiny_config("llama", rope_parameters=None, **config_of(path))
    assert theirs.rope_parameters["rope_type"] == "linear"
    assert theirs.rope_parameters["rope_theta"] == 5000.0
    load_model(path)  # and the weights still load


def test_legacy_rope_scaling_unsupported_names_rope_scaling(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(path, drop=("rope_parameters",), rope_scaling={"type": "dynamic", "factor": 2})
    refused(path, "rope_scaling", "'dynamic' is not supported")


def test_llama3_context_as_transformers_takes_it(copy: Callable[[str], Path]) -> None:
    """``original_max_position_embeddings``: a top-level one first (transformers overwrites
    the RoPE dict's with it), then the RoPE dict's, then ``max_position_embeddings``."""
    path = copy("llama")
    rope = dict(config_of(path)["rope_parameters"])
    del rope["original_max_position_embeddings"]
    for fields, expected in (
        ({"rope_parameters": rope}, 256),  # max_position_embeddings
        ({"rope_parameters": rope, "max_position_embeddings": 512}, 512),
        ({"rope_parameters": {**rope, "original_max_position_embeddings": 48}}, 48),
        (
            {
                "rope_parameters": {**rope, "original_max_position_embeddings": 48},
                "original_max_position_embeddings": 32,
            },
            32,
        ),
    ):
        edit_config(path, **fields)
        scaling = read_config(path).rope_scaling
        assert scaling is not None
        assert scaling.original_max_position_embeddings == expected, fields
        theirs = tiny_config("llama", **config_of(path))
        theirs.standardize_rope_params()  # as transformers' llama3 RoPE does at model build
        assert theirs.rope_parameters["original_max_position_embeddings"] == expected


def test_llama_without_max_position_embeddings_takes_the_model_types_default(
    copy: Callable[[str], Path],
) -> None:
    path = copy("llama")
    rope = dict(config_of(path)["rope_parameters"])
    del rope["original_max_position_embeddings"]
    edit_config(path, drop=("max_position_embeddings",), rope_parameters=rope)
    scaling = read_config(path).rope_scaling
    assert scaling is not None
    assert scaling.original_max_position_embeddings == 2048  # LlamaConfig's default


@pytest.mark.parametrize(
    ("rope", "missing"),
    [
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        (
            {"rope_type": "llama3", "factor": None, "low_freq_factor": 1, "high_freq_factor": 4},
            "factor",
        ),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "factor"),
    ],
)
def test_rope_without_a_field_transformers_needs(
    copy: Callable[[str], Path], rope: dict[str, Any], missing: str
) -> None:
    path = copy("llama")
    edit_config(path, rope_parameters={**rope, "rope_theta": 10000.0})
    refused(path, "rope_parameters", f"{rope['rope_type']} needs {missing}")


def test_rope_scaling_replaces_rope_parameters(copy: Callable[[str], Path]) -> None:
    """transformers takes ``rope_scaling`` when it is set, whatever ``rope_parameters`` say."""
    path = copy("llama")
    edit_config(path, rope_scaling={"rope_type": "linear", "factor": 2.0})
    config = read_config(path)
    assert config.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert tiny_config("llama", **config_of(path)).rope_parameters["rope_type"] == "linear"
    edit_config(path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    refused(path, "rope_scaling", "'dynamic' is not supported")


@pytest.mark.parametrize("theta", [0, -1.0, "1e4", True])
def test_non_positive_rope_theta_is_refused(copy: Callable[[str], Path], theta: object) -> None:
    path = copy("mistral")
    edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": theta})
    refused(path, "rope_parameters", "rope_theta must be a positive number", repr(theta))


def test_rope_parameters_per_layer_type_are_refused(copy: Callable[[str], Path]) -> None:
    path = copy("qwen2")
    edit_config(path, rope_parameters={"full_attention": {"rope_type": "default"}})
    refused(path, "rope_parameters", "only one flat dict of RoPE parameters")


def test_invalid_llama3_parameters_name_rope_parameters(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    rope = {**config_of(path)["rope_parameters"], "high_freq_factor": 0.5}
    edit_config(path, rope_parameters=rope)
    refused(path, "rope_parameters", "high_freq_factor > low_freq_factor")


# -- what the forward does not implement ---------------------------------------------------


def test_gelu_is_refused(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(path, hidden_act="gelu")
    refused(path, "hidden_act", "only silu")


def test_mistral_sliding_window_is_refused(copy: Callable[[str], Path]) -> None:
    path = copy("mistral")
    edit_config(path, sliding_window=16)
    refused(path, "sliding_window", "sliding-window attention is not supported")


def test_mistral_without_sliding_window_field_is_refused(copy: Callable[[str], Path]) -> None:
    """transformers' Mistral default is a 4096-token window when the field is absent."""
    path = copy("mistral")
    edit_config(path, drop=("sliding_window",))
    assert tiny_config("mistral", **{**config_of(path), "sliding_window": 4096}).sliding_window
    refused(path, "sliding_window", "sliding-window attention is not supported")


def test_qwen2_sliding_window_is_refused(copy: Callable[[str], Path]) -> None:
    path = copy("qwen2")
    edit_config(
        path, drop=("layer_types",), use_sliding_window=True, sliding_window=16, max_window_layers=0
    )
    theirs = tiny_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert "sliding_attention" in theirs.layer_types  # transformers would slide
    refused(path, "sliding_window", "sliding-window attention is not supported")


def test_qwen2_sliding_window_off_is_accepted(copy: Callable[[str], Path]) -> None:
    """Qwen2 configs carry a ``sliding_window`` that ``use_sliding_window: false`` disables."""
    path = copy("qwen2")
    edit_config(path, use_sliding_window=False, sliding_window=4096)
    assert isinstance(read_config(path), LlamaConfig)


def test_sliding_attention_layer_types_are_refused(copy: Callable[[str], Path]) -> None:
    path = copy("qwen2")
    edit_config(path, layer_types=["full_attention", "sliding_attention"])
    refused(path, "layer_types", "only full attention")


def test_partial_rotary_factor_is_refused(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(path, partial_rotary_factor=0.5)
    refused(path, "partial_rotary_factor", "partial rotary dims are not supported")


def test_partial_rotary_factor_as_transformers_saves_it_is_refused(
    copy: Callable[[str], Path],
) -> None:
    """Where transformers saves ``partial_rotary_factor``: recent 5.x releases (5.24) move it
    into ``rope_parameters``, earlier ones (5.17) keep it at the top; refused either way."""
    path = copy("llama")
    save_their_config(tiny_config("llama", partial_rotary_factor=0.5), path)
    raw = config_of(path)
    if "partial_rotary_factor" in raw:
        assert raw["partial_rotary_factor"] == 0.5
        refused(path, "partial_rotary_factor", "partial rotary dims are not supported")
    else:
        assert raw["rope_parameters"]["partial_rotary_factor"] == 0.5
        refused(path, "rope_parameters", "partial_rotary_factor", "not supported")


def test_deepseek_moe_layers_are_refused(copy: Callable[[str], Path]) -> None:
    path = copy("deepseek_v3")
    edit_config(path, first_k_dense_replace=1)
    refused(path, "first_k_dense_replace", "1 < num_hidden_layers = 2", "mixture-of-experts")
    # transformers builds MoE layers from first_k_dense_replace on whatever n_routed_experts
    # says: refused with none routed too
    edit_config(path, first_k_dense_replace=1, n_routed_experts=0)
    refused(path, "first_k_dense_replace", "mixture-of-experts")


def test_deepseek_dense_layers_are_accepted(copy: Callable[[str], Path]) -> None:
    """Absent, ``first_k_dense_replace`` is 3 (transformers' default): two layers are dense."""
    path = copy("deepseek_v3")
    edit_config(path, drop=("first_k_dense_replace",))
    config = read_config(path)
    assert isinstance(config, MLAConfig)
    assert config.num_layers == 2
    edit_config(path, first_k_dense_replace=2, n_routed_experts=0)
    assert read_config(path).num_layers == 2


# -- weights ------------------------------------------------------------------------------


def test_no_safetensors(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    (path / WEIGHTS).unlink()
    refused(path, "*.safetensors", "no *.safetensors weights", weights=True)


def test_missing_tensor(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    name = "model.layers.1.mlp.up_proj.weight"
    edit_weights(path, lambda tensors: drop(tensors, name))
    refused(path, name, "tensor missing", weights=True)


def test_tensor_of_the_wrong_shape(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    name = "model.layers.0.self_attn.k_proj.weight"  # [2 kv heads * 16, 64]

    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:16].clone()

    edit_weights(path, shrink)
    refused(path, name, "shape (16, 64) does not match the config's (32, 64)", weights=True)


def test_tensor_of_an_integer_dtype(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    name = "model.layers.0.self_attn.q_proj.weight"

    def quantise(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = (tensors[name] * 64).round().to(torch.int8)

    edit_weights(path, quantise)
    refused(path, name, "dtype torch.int8 is not supported", weights=True)


def test_unreadable_safetensors_file(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    (path / WEIGHTS).write_bytes(b"\x00" * 16)
    refused(path, WEIGHTS, "cannot read", weights=True)


def shard(directory: Path) -> list[str]:
    """Split ``model.safetensors`` into two shards with an index; returns the shard names."""
    tensors = load_file(directory / WEIGHTS)
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for file, half in zip(files, halves):
        save_file({n: tensors[n] for n in half}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(half, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / WEIGHTS).unlink()
    return files


def test_sharded_checkpoint_with_a_missing_shard(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    files = shard(path)
    (path / files[1]).unlink()
    refused(path, files[1], "listed by the index is missing", weights=True)


def test_sharded_index_without_weight_map(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    shard(path)
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    refused(path, "model.safetensors.index.json", "no weight_map", weights=True)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3_lora_yarn"])
def test_sharded_checkpoint_loads_the_same_weights(
    tiny: dict[str, Path], copy: Callable[[str], Path], family: str
) -> None:
    path = copy(family)
    shard(path)
    config = read_config(path)
    sharded = load_weights(path, config)
    single = load_weights(tiny[family], config)
    assert sharded.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name


def test_tied_embeddings_without_lm_head_load(tiny: dict[str, Path]) -> None:
    path = tiny["qwen2"]  # tied: transformers saves no lm_head.weight
    assert "lm_head.weight" not in load_file(path / WEIGHTS)
    config = read_config(path)
    assert config.tie_embeddings
    weights = load_weights(path, config)
    assert "lm_head" not in weights
    model = load_model(path, dtype=torch.float64)
    assert torch.equal(model.lm_head, model.embedding.t())


@pytest.mark.parametrize("sharded", [False, True])
def test_tied_config_with_a_stored_head_unties(copy: Callable[[str], Path], sharded: bool) -> None:
    """transformers does not tie where ``lm_head.weight`` is stored (it warns): neither does
    the loader, from the file's header or the shards' index."""
    path = copy("llama")
    edit_config(path, tie_word_embeddings=True)
    if sharded:
        shard(path)
    config = read_config(path)
    assert not config.tie_embeddings
    assert "lm_head" in load_weights(path, config)
    alone = path.parent / "config_only"
    alone.mkdir()
    shutil.copy(path / "config.json", alone / "config.json")
    assert read_config(alone).tie_embeddings  # no weights to look at: as the config says


def test_tied_config_with_an_unreadable_header_is_refused(copy: Callable[[str], Path]) -> None:
    path = copy("qwen2")
    (path / WEIGHTS).write_bytes((2**40).to_bytes(8, "little") + b"{}")
    refused(path, WEIGHTS, "cannot read", "no safetensors header")
    (path / WEIGHTS).write_bytes((4).to_bytes(8, "little") + b"{ x ")
    refused(path, WEIGHTS, "cannot read")


def test_untied_embeddings_without_lm_head_are_refused(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_weights(path, lambda tensors: drop(tensors, "lm_head.weight"))
    refused(path, "lm_head.weight", "tensor missing", weights=True)
    path = copy("qwen2")
    edit_config(path, tie_word_embeddings=False)
    refused(path, "lm_head.weight", "tensor missing", weights=True)


# -- what read_config gives for each family ---------------------------------------------------

LLAMA3 = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
YARN = RopeScaling(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)
#: The config each TINY_FAMILIES checkpoint reads as.
EXPECTED: dict[str, LlamaConfig | MLAConfig] = {
    "llama": LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        rope_theta=10000.0,
        rms_eps=1e-6,
        tie_embeddings=False,
        rope_scaling=LLAMA3,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
    ),
    "mistral": LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=24,
        intermediate_size=96,
        rope_theta=1000.0,
        tie_embeddings=False,
        rope_scaling=None,
    ),
    "qwen2": LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        rope_theta=10000.0,
        tie_embeddings=True,
        rope_scaling=None,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
    ),
    "deepseek_v3": MLAConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        intermediate_size=96,
        rope_theta=10000.0,
        tie_embeddings=False,
        rope_scaling=None,
        attention_bias=False,
    ),
    "deepseek_v3_lora_yarn": MLAConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        q_lora_rank=40,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        intermediate_size=96,
        rope_theta=10000.0,
        tie_embeddings=False,
        rope_scaling=YARN,
        attention_bias=False,
    ),
}


def test_every_family_has_an_expected_config() -> None:
    assert EXPECTED.keys() == TINY_FAMILIES.keys()


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_read_config_maps_the_family(tiny: dict[str, Path], family: str) -> None:
    config = read_config(tiny[family])
    assert config == EXPECTED[family]
    # the weights the config asks for are exactly there, and a model builds from them
    model = load_model(tiny[family], dtype=torch.float64)
    assert model.config == config


@pytest.mark.parametrize(
    ("family", "qkv", "o", "mlp"), [("mistral", False, False, False), ("qwen2", True, False, False)]
)
def test_bias_fields_as_each_class_builds_them(
    copy: Callable[[str], Path], family: str, qkv: bool, o: bool, mlp: bool
) -> None:
    """Mistral's transformers class has no biases and Qwen2's only q/k/v biases, whatever
    ``attention_bias`` and ``mlp_bias`` say (tests/executor/test_hf_oracle_configs.py runs
    them against transformers)."""
    path = copy(family)
    edit_config(path, attention_bias=True, mlp_bias=True)
    config = read_config(path)
    assert isinstance(config, LlamaConfig)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (qkv, o, mlp)
    load_model(path)  # the tensors the class has are all there


def test_mla_latent_norms_keep_eps_1e_6(copy: Callable[[str], Path]) -> None:
    path = copy("deepseek_v3_lora_yarn")
    edit_config(path, rms_norm_eps=0.05)
    config = read_config(path)
    assert isinstance(config, MLAConfig)
    assert (config.rms_eps, config.latent_norm_eps) == (0.05, 1e-6)
    attention = DeepseekV3Attention(tiny_config("deepseek_v3_lora_yarn", rms_norm_eps=0.05), 0)
    assert attention.q_a_layernorm.variance_epsilon == 1e-6
    assert attention.kv_a_layernorm.variance_epsilon == 1e-6


def test_llama_attention_bias_sets_qkv_and_o_bias(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(path, attention_bias=True, mlp_bias=True)
    config = read_config(path)
    assert isinstance(config, LlamaConfig)
    assert config.qkv_bias
    assert config.o_bias
    assert config.mlp_bias


# -- CheckpointError ----------------------------------------------------------------------


def test_checkpoint_error_pickles(copy: Callable[[str], Path]) -> None:
    path = copy("llama")
    edit_config(path, hidden_act="gelu")
    error = refused(path, "hidden_act", "silu")
    for original in (error, CheckpointError("/some/dir", "not a directory")):
        clone = pickle.loads(pickle.dumps(original))
        assert type(clone) is CheckpointError
        assert (clone.path, clone.name, clone.reason) == (
            original.path,
            original.name,
            original.reason,
        )
        assert str(clone) == str(original)


# -- RoPE tables against transformers' -------------------------------------------------------

#: (name, transformers family, config overrides) of RoPE scalings to compare: the tiny
#: families' own, published ones (Llama 3.1, DeepSeek-V3) and yarn's optional fields.
ROPE_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("llama3_tiny", "llama", {}),
    (
        "llama3_llama31",
        "llama",
        {
            "hidden_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    ("linear", "llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.5}}),
    (
        "yarn_llama",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("yarn_tiny", "deepseek_v3_lora_yarn", {}),
    (
        "yarn_deepseek_v3",
        "deepseek_v3_lora_yarn",
        {
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 163840,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
    ),
    (
        "yarn_mscale_all_dim_only",
        "deepseek_v3_lora_yarn",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale_all_dim": 0.707,
            }
        },
    ),
    (
        "yarn_mscale_only",
        "deepseek_v3_lora_yarn",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.8,
            }
        },
    ),
    (
        "yarn_attention_factor_untruncated",
        "deepseek_v3_lora_yarn",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16,
                "beta_slow": 2,
                "attention_factor": 1.25,
                "truncate": False,
            }
        },
    ),
]


def read_their_config(config: Any, directory: Path) -> LlamaConfig | MLAConfig:
    """Save transformers' ``config`` as a checkpoint's config.json and read it back."""
    save_their_config(config, directory)
    return read_config(directory)


@pytest.mark.parametrize(
    ("family", "overrides"), [c[1:] for c in ROPE_CASES], ids=[c[0] for c in ROPE_CASES]
)
def test_rope_tables_equal_transformers(
    tmp_path: Path, family: str, overrides: dict[str, Any]
) -> None:
    theirs_config = tiny_config(family, **overrides)
    ours = read_their_config(theirs_config, tmp_path)
    scaling = ours.rope_scaling
    assert scaling is not None
    rope_type = theirs_config.rope_parameters["rope_type"]
    assert scaling.rope_type == rope_type
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](theirs_config)
    dim = ours.qk_rope_head_dim if isinstance(ours, MLAConfig) else ours.head_dim
    mine = scaling.inv_freq(dim, ours.rope_theta)
    assert mine.dtype == torch.float64
    assert mine.shape == inv_freq.shape
    torch.testing.assert_close(mine, inv_freq.double(), rtol=1e-6, atol=0)
    assert math.isclose(scaling.cos_sin_factor(), attention_factor, rel_tol=1e-12)
    if isinstance(ours, MLAConfig):
        attention = DeepseekV3Attention(theirs_config, layer_idx=0)
        assert math.isclose(ours.softmax_scale, attention.scaling, rel_tol=1e-12)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_lora_yarn"])
def test_mla_softmax_scale_equals_transformers(tiny: dict[str, Path], family: str) -> None:
    attention = DeepseekV3Attention(tiny_config(family), layer_idx=0)
    config = read_config(tiny[family])
    assert isinstance(config, MLAConfig)
    assert math.isclose(config.softmax_scale, attention.scaling, rel_tol=1e-12)
    if family == "deepseek_v3_lora_yarn":  # the yarn mscale is in it
        assert config.softmax_scale != pytest.approx((16 + 16) ** -0.5)
