"""Hugging Face checkpoints of the executor's model families, from a local directory.

A checkpoint directory holds ``config.json`` and its weights as ``*.safetensors`` (one file,
or shards listed by ``model.safetensors.index.json``); nothing is downloaded. Supported
architectures (:data:`ARCHITECTURES`):

- ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` -> :class:`LlamaConfig`;
- ``DeepseekV3ForCausalLM`` (multi-head latent attention, dense MLP layers only) ->
  :class:`MLAConfig`.

``config.json`` is read as transformers reads it: the defaults of the model type's config
class, the biases each class really builds, the priority of its RoPE fields (``rope_scaling``
over ``rope_parameters``, a top-level ``original_max_position_embeddings`` first), a stored
``lm_head.weight`` that transformers runs although ``tie_word_embeddings`` is set, DeepSeek's
latent norms at eps 1e-6; :func:`eos_token_ids` gives the ids its ``generate`` stops at. What
cannot be run as transformers runs it is refused with a :class:`CheckpointError` that names
the field or tensor at fault: an architecture not listed (or a ``model_type`` not its own), a
RoPE type other than ``default``, ``linear``, ``llama3`` or ``yarn``, an activation other than
SiLU, sliding-window attention, partial rotary dims, mixture-of-experts layers
(``first_k_dense_replace`` below ``num_hidden_layers``), a missing shard or tensor, a tensor of
the wrong shape or of a non-float dtype (e.g. FP8 with block scales). ``docs/executor.md``
lists the fields.

Loading reads the safetensors files with the ``safetensors`` library (``pip install
helix_kv[hf]``). DeepSeek's interleaved RoPE (``rope_interleave``) is folded into the
weights at load time (the RoPE output columns reordered even-first), so the forward runs one
RoPE convention.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from helix_kv.errors import CheckpointError
from helix_kv.executor.model import (
    ROPE_TYPES,
    LlamaConfig,
    MLAConfig,
    ModelConfig,
    RopeScaling,
    Transformer,
    weight_shapes,
)

#: ``architectures[0]`` of a supported ``config.json`` -> the family it loads as.
ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "DeepseekV3ForCausalLM": "mla",
}

#: transformers' ``model_type`` of each architecture (``AutoModelForCausalLM`` builds the
#: class of ``config.json``'s ``model_type``).
MODEL_TYPES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

#: transformers' defaults (its config classes) of the fields a ``config.json`` may leave out
#: whose default differs between model types (``None``: ``num_attention_heads``).
_DEFAULTS: Mapping[str, Mapping[str, int | None]] = {
    "llama": {"num_key_value_heads": None, "max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "deepseek_v3": {"num_key_value_heads": 128, "max_position_embeddings": 4096},
}

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def read_config(path: str | Path) -> ModelConfig:
    """The model config of the checkpoint directory ``path`` (its ``config.json``), read as
    transformers reads it (its defaults per ``model_type``, the priority of its RoPE fields,
    a stored ``lm_head.weight`` with ``tie_word_embeddings``: see ``docs/executor.md``)."""
    directory = Path(path)
    raw = _read_json(directory, directory / "config.json")
    architectures = raw.get("architectures") or []
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
    family = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if family is None or arch is None:
        raise CheckpointError(
            directory,
            f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})",
            "architectures",
        )
    fields = _Fields(directory, raw)
    model_type = MODEL_TYPES[arch]
    if raw.get("model_type", model_type) != model_type:
        # AutoModelForCausalLM builds the class of config.json's model_type, not of
        # architectures: another family's defaults and biases
        raise fields.error(
            "model_type",
            f"{raw['model_type']!r} is not {arch}'s {model_type!r} (transformers would build "
            "the model_type's class)",
        )
    _refuse_unsupported(fields, arch)
    defaults = _DEFAULTS[model_type]
    max_positions = fields.get("max_position_embeddings", defaults["max_position_embeddings"])
    theta, scaling = _rope(fields, max_positions)
    common: dict[str, Any] = {
        "vocab_size": fields.int("vocab_size"),
        "hidden_size": fields.int("hidden_size"),
        "num_layers": fields.int("num_hidden_layers"),
        "num_heads": fields.int("num_attention_heads"),
        "intermediate_size": fields.int("intermediate_size"),
        "rope_theta": theta,
        "rms_eps": _positive_number(fields, "rms_norm_eps", fields.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": _ties_embeddings(directory, fields),
        "rope_scaling": scaling,
    }
    # null: one KV head per head; absent: transformers' default of the model_type
    kv_heads = raw.get("num_key_value_heads", defaults["num_key_value_heads"])
    if kv_heads is None:
        kv_heads = common["num_heads"]
    try:
        if family == "llama":
            return _llama_config(fields, arch, common, kv_heads)
        return _mla_config(fields, common, kv_heads)
    except ValueError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(directory, str(exc), "config.json") from exc


def _refuse_unsupported(fields: _Fields, arch: str) -> None:
    """Refuse what the forward does not implement: another activation, partial rotary dims,
    sliding-window attention."""
    if fields.get("hidden_act", "silu") != "silu":
        raise fields.error("hidden_act", "only silu (SwiGLU) MLPs are supported")
    if fields.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise fields.error("partial_rotary_factor", "partial rotary dims are not supported")
    layer_types = fields.get("layer_types")
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        raise fields.error("layer_types", "only full attention layers are supported")
    # transformers' Mistral slides over 4096 tokens where config.json has no sliding_window
    window = fields.raw.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
    if window is not None and (
        arch != "Qwen2ForCausalLM" or fields.get("use_sliding_window", False)
    ):
        raise fields.error("sliding_window", "sliding-window attention is not supported")


def _llama_config(fields: _Fields, arch: str, common: dict[str, Any], kv_heads: Any) -> LlamaConfig:
    """The Llama family's config: the biases each transformers class really builds (Llama's
    from ``attention_bias`` / ``mlp_bias``; Mistral none; Qwen2 q/k/v only, whatever those
    fields say)."""
    heads = common["num_heads"]
    head_dim = fields.get("head_dim") or common["hidden_size"] // heads
    if arch == "LlamaForCausalLM":
        qkv_bias = o_bias = bool(fields.get("attention_bias", False))
        mlp_bias = bool(fields.get("mlp_bias", False))
    else:
        qkv_bias, o_bias, mlp_bias = arch == "Qwen2ForCausalLM", False, False
    return LlamaConfig(
        **common,
        num_kv_heads=_positive(fields, "num_key_value_heads", kv_heads),
        head_dim=int(head_dim),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
    )


def _mla_config(fields: _Fields, common: dict[str, Any], kv_heads: Any) -> MLAConfig:
    """DeepSeek-V3's config (dense MLP layers only)."""
    # transformers' DeepSeek-V3 builds a mixture-of-experts MLP in every layer from
    # first_k_dense_replace (3 when absent) on, whatever n_routed_experts says
    dense = fields.get("first_k_dense_replace", 3)
    layers = common["num_layers"]
    if not _is_int(dense) or dense < layers:
        raise fields.error(
            "first_k_dense_replace",
            f"{dense!r} < num_hidden_layers = {layers}: mixture-of-experts layers are not "
            "supported (dense MLP layers only)",
        )
    # its attention repeats the expanded heads num_attention_heads // num_key_value_heads
    # times: with fewer KV heads than heads it does not run
    if _positive(fields, "num_key_value_heads", kv_heads) < common["num_heads"]:
        raise fields.error(
            "num_key_value_heads",
            f"{kv_heads} < num_attention_heads = {common['num_heads']}: transformers' "
            "DeepSeek-V3 attention does not run with fewer KV heads than heads",
        )
    q_lora = fields.get("q_lora_rank")
    return MLAConfig(
        **common,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=fields.int("kv_lora_rank"),
        qk_nope_head_dim=fields.int("qk_nope_head_dim"),
        qk_rope_head_dim=fields.int("qk_rope_head_dim"),
        v_head_dim=fields.int("v_head_dim"),
        attention_bias=bool(fields.get("attention_bias", False)),
        latent_norm_eps=1e-6,  # transformers' q_a_layernorm and kv_a_layernorm
    )


def load_weights(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights of the checkpoint directory ``path`` under helix_kv's names
    (:func:`~helix_kv.executor.model.weight_shapes`), as stored (dtype and CPU); the tensors
    the model of ``config`` has no use for are not read."""
    directory = Path(path)
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise CheckpointError(
            directory, "reading safetensors needs the safetensors package (helix_kv[hf])"
        ) from exc
    files = _weight_files(directory)
    located: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    located.setdefault(name, file)
        except Exception as exc:  # a truncated or foreign file: the library's own error
            raise CheckpointError(directory, f"cannot read {file.name}: {exc}", file.name) from exc
    interleave = isinstance(config, MLAConfig) and _rope_interleave(directory)
    names = _hf_names(config)
    shapes = weight_shapes(config)
    by_file: dict[Path, list[str]] = {}
    for hf_name in names.values():
        holder = located.get(hf_name)
        if holder is None:
            raise CheckpointError(directory, "tensor missing from the checkpoint", hf_name)
        by_file.setdefault(holder, []).append(hf_name)
    tensors: dict[str, torch.Tensor] = {}
    for file, wanted in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for hf_name in wanted:
                tensors[hf_name] = handle.get_tensor(hf_name)
    weights: dict[str, torch.Tensor] = {}
    for ours, hf_name in names.items():
        tensor = tensors[hf_name]
        if tensor.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                directory,
                f"dtype {tensor.dtype} is not supported (float16, bfloat16, float32, float64; "
                "quantised checkpoints are not)",
                hf_name,
            )
        expected = shapes[ours]
        linear = len(expected) == 2 and ours != "embedding"  # stored [out, in]
        hf_shape = expected[::-1] if linear else expected
        if tuple(tensor.shape) != hf_shape:
            raise CheckpointError(
                directory,
                f"shape {tuple(tensor.shape)} does not match the config's {hf_shape}",
                hf_name,
            )
        weights[ours] = tensor.t() if linear else tensor
    if interleave:
        assert isinstance(config, MLAConfig)
        _deinterleave_rope(config, weights)
    return weights


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    decode_kernel: bool = False,
) -> Transformer:
    """The model of the checkpoint directory ``path`` (:func:`read_config` +
    :func:`load_weights`), its weights cast to ``dtype`` on ``device``."""
    config = read_config(path)
    return Transformer(config, dtype, device, decode_kernel, load_weights(path, config))


def eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids transformers' ``generate`` stops at for the checkpoint
    directory ``path``: ``generation_config.json``'s ``eos_token_id`` where that file exists
    (transformers then reads it alone: a file without one means no EOS), else
    ``config.json``'s; an id or a list (any of them ends a request); ``()`` for none."""
    directory = Path(path)
    file = directory / "generation_config.json"
    if not file.is_file():
        file = directory / "config.json"
    raw = _read_json(directory, file).get("eos_token_id")
    ids = raw if isinstance(raw, list) else [] if raw is None else [raw]
    if not all(_is_int(token) and token >= 0 for token in ids):
        raise CheckpointError(
            directory,
            f"{file.name}: must be a non-negative integer or a list of them, got {raw!r}",
            "eos_token_id",
        )
    return tuple(dict.fromkeys(ids))


# -- config.json -------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_number(fields: _Fields, name: str, value: Any) -> float:
    """``value`` (read from the field ``name``) as a positive float, else an error naming it."""
    if not _is_number(value) or not value > 0:
        raise fields.error(name, f"must be a positive number, got {value!r}")
    return float(value)


def _positive(fields: _Fields, name: str, value: Any) -> int:
    """``value`` (read from the field ``name``) as a positive integer, else an error naming it."""
    if not _is_int(value) or value < 1:
        raise fields.error(name, f"must be a positive integer, got {value!r}")
    return int(value)


class _Fields:
    """``config.json``'s fields, with errors that name the file and the field."""

    def __init__(self, directory: Path, raw: Mapping[str, Any]) -> None:
        self.directory = directory
        self.raw = raw

    def get(self, name: str, default: Any = None) -> Any:
        value = self.raw.get(name, default)
        return default if value is None else value

    def int(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)  # null: the default, as transformers reads it
        if value is None:
            raise self.error(name, "missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(name, f"must be a positive integer, got {value!r}")
        return value

    def error(self, name: str, reason: str) -> CheckpointError:
        return CheckpointError(self.directory, reason, name)


#: RoPE fields each scaling type needs (transformers fails without them).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}


def _rope(fields: _Fields, max_positions: Any) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` as transformers reads them: ``rope_scaling`` when set (it
    replaces ``rope_parameters``), else ``rope_parameters`` (transformers 5); ``rope_theta``
    from there, else the top level, else 10000."""
    params, name = fields.get("rope_scaling"), "rope_scaling"
    if not params:
        params, name = fields.get("rope_parameters"), "rope_parameters"
    if params and (
        not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values())
    ):
        raise fields.error(name, "only one flat dict of RoPE parameters is supported")
    params = dict(params or {})
    theta = params.get("rope_theta")
    if theta is None:
        theta = fields.get("rope_theta", 10000.0)
    if not _is_number(theta) or not theta > 0:
        raise fields.error(name, f"rope_theta must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise fields.error(
            name,
            f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})",
        )
    # transformers 5 saves partial_rotary_factor here rather than at the top level
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise fields.error(
            name,
            f"partial_rotary_factor {params['partial_rotary_factor']!r}: "
            "partial rotary dims are not supported",
        )
    if rope_type == "default":
        return float(theta), None
    for key in _ROPE_REQUIRED[rope_type]:
        if key not in params or (params[key] is None and rope_type != "yarn"):
            raise fields.error(name, f"{rope_type} needs {key}")
    values = {k: v for k, v in params.items() if k in _ROPE_FIELDS and v is not None}
    if rope_type in ("llama3", "yarn"):
        values["original_max_position_embeddings"] = _original_max_positions(
            fields, params, name, max_positions
        )
    if rope_type == "yarn":
        for key in ("beta_fast", "beta_slow"):  # transformers: `or 32`, `or 1`
            if not values.get(key, 1):
                del values[key]
        if "truncate" in params:  # read as a truth value (null: no truncation)
            values["truncate"] = bool(params["truncate"])
        if params["factor"] is None:  # transformers: the ratio of the context lengths
            longest = _positive(fields, "max_position_embeddings", max_positions)
            values["factor"] = longest / values["original_max_position_embeddings"]
    try:
        return float(theta), RopeScaling(rope_type=rope_type, **values)
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise fields.error(name, str(exc)) from exc


_ROPE_FIELDS = frozenset(
    {
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
    }
)


def _original_max_positions(
    fields: _Fields, params: Mapping[str, Any], rope_name: str, max_positions: Any
) -> int:
    """llama3's and yarn's pretraining context as transformers takes it: a top-level
    ``original_max_position_embeddings`` first (it overwrites the RoPE dict's), then the
    RoPE dict's, then ``max_position_embeddings``."""
    top = fields.get("original_max_position_embeddings")
    if top is not None:
        return _positive(fields, "original_max_position_embeddings", top)
    inner = params.get("original_max_position_embeddings")
    if inner is not None:
        return _positive(fields, rope_name, inner)
    return _positive(fields, "max_position_embeddings", max_positions)


def _ties_embeddings(directory: Path, fields: _Fields) -> bool:
    """``tie_word_embeddings`` as transformers applies it: with a ``lm_head.weight`` stored
    in the checkpoint it does not tie (it warns) and runs the stored head."""
    if not fields.get("tie_word_embeddings", False):
        return False
    names = _stored_tensor_names(directory)
    return names is None or "lm_head.weight" not in names


def _rope_interleave(directory: Path) -> bool:
    return bool(_read_json(directory, directory / "config.json").get("rope_interleave", True))


def _read_json(directory: Path, file: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(directory, "not a directory")
    if not file.is_file():
        raise CheckpointError(directory, "missing", file.name)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(directory, f"not readable JSON: {exc}", file.name) from exc
    if not isinstance(raw, dict):
        raise CheckpointError(directory, "not a JSON object", file.name)
    return raw


# -- weights -----------------------------------------------------------------------------


def _stored_tensor_names(directory: Path) -> set[str] | None:
    """The tensor names the checkpoint stores (the index's, else each file's header), or
    ``None`` where it has no weights (a config alone, e.g. for ``--random-weights``)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(directory, index).get("weight_map")
        return set(weight_map) if isinstance(weight_map, dict) else None
    names: set[str] = set()
    files = sorted(directory.glob("*.safetensors"))
    for file in files:
        try:  # the header: its length (u64, little-endian), then JSON keyed by tensor name
            with file.open("rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(size)) if 2 <= size <= 100_000_000 else None
        except (OSError, ValueError) as exc:
            raise CheckpointError(directory, f"cannot read {file.name}: {exc}", file.name) from exc
        if not isinstance(header, dict):
            raise CheckpointError(
                directory, f"cannot read {file.name}: no safetensors header", file.name
            )
        names.update(header)
    return names if files else None


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files: the index's shards (each must exist), else every file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(directory, index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(directory, "no weight_map", index.name)
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (directory / shard).is_file():
                raise CheckpointError(
                    directory, f"shard {shard} listed by the index is missing", shard
                )
        return [directory / shard for shard in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(directory, "no *.safetensors weights", "*.safetensors")
    return files


def _hf_names(config: ModelConfig) -> dict[str, str]:
    """helix_kv weight name -> the checkpoint's tensor name, for every weight the model takes."""
    names = {"embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
    if not config.tie_embeddings:
        names["lm_head"] = "lm_head.weight"
    llama = {
        "attn_norm": "input_layernorm.weight",
        "mlp_norm": "post_attention_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "bq": "self_attn.q_proj.bias",
        "bk": "self_attn.k_proj.bias",
        "bv": "self_attn.v_proj.bias",
        "bo": "self_attn.o_proj.bias",
        "w_gate": "mlp.gate_proj.weight",
        "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight",
        "b_gate": "mlp.gate_proj.bias",
        "b_up": "mlp.up_proj.bias",
        "b_down": "mlp.down_proj.bias",
        # MLA
        "wq_a": "self_attn.q_a_proj.weight",
        "bq_a": "self_attn.q_a_proj.bias",
        "q_a_norm": "self_attn.q_a_layernorm.weight",
        "wq_b": "self_attn.q_b_proj.weight",
        "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
        "bkv_a": "self_attn.kv_a_proj_with_mqa.bias",
        "kv_a_norm": "self_attn.kv_a_layernorm.weight",
        "wkv_b": "self_attn.kv_b_proj.weight",
    }
    for ours in weight_shapes(config):
        if ours.startswith("layers."):
            _, layer, leaf = ours.split(".", 2)
            names[ours] = f"model.layers.{layer}.{llama[leaf]}"
    return names


def _deinterleave_rope(config: MLAConfig, weights: dict[str, torch.Tensor]) -> None:
    """Reorder the RoPE output columns of the query and ``kv_a`` projections from DeepSeek's
    interleaved pairs ``(x0, x1), (x2, x3)...`` to halves ``x0 x2 ... | x1 x3 ...``, on which
    rotate-half RoPE computes what transformers' interleaved RoPE does."""
    rope = config.qk_rope_head_dim
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    qk = config.qk_nope_head_dim + rope
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        q_name = p + ("wq" if config.q_lora_rank is None else "wq_b")
        q = weights[q_name]
        per_head = q.reshape(q.shape[0], config.num_heads, qk)
        nope, rot = (
            per_head[..., : config.qk_nope_head_dim],
            per_head[..., config.qk_nope_head_dim :],
        )
        weights[q_name] = torch.cat([nope, rot[..., order]], dim=-1).reshape(q.shape)
        latent = config.kv_lora_rank
        kv = weights[p + "wkv_a"]
        weights[p + "wkv_a"] = torch.cat([kv[:, :latent], kv[:, latent:][:, order]], dim=1)
        if p + "bkv_a" in weights:
            bias = weights[p + "bkv_a"]
            weights[p + "bkv_a"] = torch.cat([bias[:latent], bias[latent:][order]])


__all__ = [
    "ARCHITECTURES",
    "MODEL_TYPES",
    "CheckpointError",
    "eos_token_ids",
    "load_model",
    "load_weights",
    "read_config",
]
