"""transformers as the executor's oracle: tiny random checkpoints of every supported family and
transformers' own greedy ``generate`` on them.

The oracle is an implementation nobody here wrote: :func:`save_tiny_checkpoint` has
transformers build a small model of a family (:data:`TINY_FAMILIES`) with seeded weights and
save it (``config.json`` + ``model.safetensors``); the executor loads that directory
(:mod:`helix_kv.executor.checkpoint`) and its greedy tokens must equal
:func:`hf_greedy`'s, which runs ``model.generate(do_sample=False)`` one prompt at a time.

Near ties: transformers computes RoPE tables and RMSNorm in float32 whatever the model
dtype, so even a float64 run differs from it by about 1e-7 relative; :func:`first_divergence`
accepts a differing token only where transformers' own logits put the two tokens within a
stated tolerance, and stops comparing that request there (the sequences part ways).

Needs ``transformers`` (``pip install helix_kv[hf]``); imported on first use.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Tiny configs of each family transformers builds (``config.json`` fields), by name: the
#: Llama family with llama3 RoPE scaling, Mistral with its own head_dim, Qwen2 with QKV
#: biases and tied embeddings; DeepSeek-V3 MLA without and with the query bottleneck (the
#: latter with yarn RoPE and mscale), dense MLPs.
TINY_FAMILIES: Mapping[str, Mapping[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
    },
    "mistral": {
        "model_type": "mistral",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 24,
        "max_position_embeddings": 256,
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "first_k_dense_replace": 2,
        "n_routed_experts": 4,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True,
        "tie_word_embeddings": False,
    },
    "deepseek_v3_lora_yarn": {
        "model_type": "deepseek_v3",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 40,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "first_k_dense_replace": 2,
        "n_routed_experts": 4,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rope_interleave": True,
        "tie_word_embeddings": False,
    },
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # the optional extra
        raise RuntimeError(f"the oracle needs transformers (helix_kv[hf]): {exc}") from exc
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    return transformers


def tiny_config(family: str, **overrides: Any) -> Any:
    """transformers' config object of a :data:`TINY_FAMILIES` entry (fields overridable)."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(TINY_FAMILIES)})")
    fields = copy.deepcopy({**TINY_FAMILIES[family], **overrides})  # transformers edits them
    return _transformers().AutoConfig.for_model(**fields)


@torch.no_grad()
def save_tiny_checkpoint(
    family: str, directory: str | Path, seed: int = 0, **overrides: Any
) -> Path:
    """Build a :data:`TINY_FAMILIES` model with transformers, seeded weights, and save it to
    ``directory`` (float32 safetensors); returns the directory.

    transformers' own initialisation (std 0.02) gives near-constant logits, which would test
    little: every matrix is redrawn ``N(0, 1 / fan_in)``, the embedding ``N(0, 1)``, norm
    weights ``1 + N(0, 0.1)`` and biases ``N(0, 0.1)``, from ``torch.Generator(seed)`` in the
    module's parameter order. With tied embeddings the output and down projections are
    drawn 10x larger (else the input token's own embedding dominates its logits and every
    greedy sequence repeats its last prompt token).
    """
    transformers = _transformers()
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    gain = 10.0 if config.tie_word_embeddings else 1.0
    for name, parameter in model.named_parameters():
        shape = parameter.shape
        if "norm" in name:
            value = 1 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith(".bias"):
            value = 0.1 * torch.randn(shape, generator=generator)
        elif "embed_tokens" in name:
            value = torch.randn(shape, generator=generator)
        else:
            value = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                value = value * gain
        parameter.copy_(value)
    path = Path(directory)
    model.save_pretrained(path, safe_serialization=True)
    return path


@dataclass(frozen=True)
class OracleRun:
    """transformers' greedy tokens (after the prompt) and the logits of each generated step."""

    tokens: dict[int, list[int]]
    logits: dict[int, torch.Tensor]  # [generated, vocab], float64 on the CPU


#: ``hf_greedy(eos_token_id=CHECKPOINT_EOS)``: stop where ``generate`` stops by default, at
#: the EOS ids of the checkpoint's own generation config.
CHECKPOINT_EOS = "checkpoint"


@torch.no_grad()
def hf_greedy(
    directory: str | Path,
    prompts: Mapping[int, Sequence[int]],
    max_new_tokens: int | Mapping[int, int],
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    eos_token_id: int | Sequence[int] | str | None = None,
) -> OracleRun:
    """transformers' ``generate(do_sample=False)`` of each prompt alone (no padding), from
    the checkpoint ``directory``; stops at ``eos_token_id`` (an id or a list, any of them;
    kept; :data:`CHECKPOINT_EOS`: the checkpoint's own) or ``max_new_tokens``."""
    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model = model.to(device).eval()
    if eos_token_id == CHECKPOINT_EOS:
        eos = None  # unset here: generate() takes the model's generation config's
    else:
        # generate() fills what its config leaves unset from the model's own (DeepSeek's
        # and Llama's configs name EOS ids 1 and 2): no EOS means none there either
        eos = None if eos_token_id is None else list(_ids(eos_token_id))
        model.generation_config.eos_token_id = eos
    tokens: dict[int, list[int]] = {}
    logits: dict[int, torch.Tensor] = {}
    for rid, prompt in prompts.items():
        budget = max_new_tokens if isinstance(max_new_tokens, int) else max_new_tokens[rid]
        generation = transformers.GenerationConfig(
            do_sample=False,
            max_new_tokens=budget,
            min_new_tokens=0,
            eos_token_id=eos,
            pad_token_id=0,  # one prompt at a time: nothing is padded
            return_dict_in_generate=True,
            output_logits=True,
        )
        ids = torch.tensor([list(prompt)], dtype=torch.int64, device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation)
        tokens[rid] = out.sequences[0, len(prompt) :].tolist()
        logits[rid] = torch.stack([step[0] for step in out.logits]).double().cpu()
    return OracleRun(tokens, logits)


def _ids(eos_token_id: int | Sequence[int] | str) -> tuple[int, ...]:
    if isinstance(eos_token_id, str):
        raise ValueError(f"eos_token_id {eos_token_id!r}: an id, ids or {CHECKPOINT_EOS!r}")
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def first_divergence(
    ours: Sequence[int], oracle: Sequence[int], oracle_logits: torch.Tensor, tolerance: float
) -> str | None:
    """Why ``ours`` is not the oracle's greedy sequence, or ``None`` when it is, up to near
    ties: at the first differing step, transformers' logit of our token must be within
    ``tolerance`` of its own choice's (then the rest is not compared: the sequences part)."""
    for step, (mine, theirs) in enumerate(zip(ours, oracle)):
        if mine == theirs:
            continue
        gap = float(oracle_logits[step, theirs] - oracle_logits[step, mine])
        if gap <= tolerance:
            return None
        return f"step {step}: token {mine} != {theirs} (transformers' logit gap {gap:.3g})"
    if len(ours) != len(oracle):
        return f"{len(ours)} tokens != transformers' {len(oracle)}"
    return None


__all__ = [
    "CHECKPOINT_EOS",
    "TINY_FAMILIES",
    "OracleRun",
    "first_divergence",
    "hf_greedy",
    "save_tiny_checkpoint",
    "tiny_config",
]
