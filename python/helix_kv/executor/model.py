"""The decoder-only model families of the reference executor, attending through the Helix KV pool.

One model class, :class:`Transformer`, runs two attention families behind one interface:

- :class:`LlamaConfig` — the Llama family (Llama, Mistral, Qwen2): RMSNorm, RoPE (default,
  ``linear``, ``llama3`` or ``yarn`` scaling), grouped-query attention, SwiGLU, optional tied
  embeddings and projection biases. A token's KV is a key and a value per KV head.
- :class:`MLAConfig` — DeepSeek-V3-style multi-head latent attention: a token's KV is one
  compressed latent (``kv_lora_rank``) plus its shared RoPE key part (``qk_rope_head_dim``),
  one "head" of ``kv_lora_rank + qk_rope_head_dim`` per token and no separate value (the
  value is the latent). Attention runs in the absorbed form over the latent: the query's
  no-RoPE part is multiplied into the latent space by the key up-projection, and the output
  latent is expanded by the value up-projection after the cross-rank combine (the combine is
  linear, so it is exact on latents). Dense MLP layers only.

Weights come from a seeded ``torch.Generator`` (drawn in float64 on the CPU and then cast,
so every rank, device and dtype starts from the same numbers) or from a Hugging Face
checkpoint (:mod:`helix_kv.executor.checkpoint`). The model is replicated on every rank of the
CP group: activations are identical everywhere and only the KV is sharded, so attention is the
one place the ranks exchange data (one all-gather per layer, see
:func:`~helix_kv.executor.attention.all_gather_combine`).

``TinyConfig`` / ``TinyTransformer`` are the Llama config and the model class under their
historical names (the small test model is a Llama config with tiny defaults).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple, Union

import torch
import torch.distributed as dist

from helix_kv.executor import fused
from helix_kv.executor.attention import (
    PartialAttention,
    all_gather_combine,
    partial_attention,
)

# The unfused norm and RoPE are the fused kernels' references (one definition of each; the
# module names stay: benches time the parts by them).
from helix_kv.executor.fused import rms_norm_reference as _rms_norm
from helix_kv.executor.fused import rope_reference as _apply_rope
from helix_kv.executor.kv_pool import KVPool, StepBatch
from helix_kv.executor.paged_attention import (
    DecodeAttentionPlan,
    DecodeWorkspace,
    MLADecodeAttentionPlan,
)
from helix_kv.executor.placement import RankPlacement

#: Turns this rank's partial attention into the CP group's combined attention.
Combine = Callable[[PartialAttention], PartialAttention]
#: A step's paged decode attention of either family, planned once and run per layer.
DecodeAttention = Union[DecodeAttentionPlan, MLADecodeAttentionPlan]

#: The RoPE scaling types :class:`RopeScaling` computes (Hugging Face's ``rope_type`` names).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class DecodeRows(NamedTuple):
    """Device inputs of a decode-only step, one row per request (views of persistent buffers).

    ``token_ids``, ``positions``, ``slots`` (``-1``: another rank owns the token, or a padding
    row), ``local_lens`` (``0`` for a padding row): ``[rows]``; ``block_table``:
    ``[rows, max_pages]``. Any int dtype and row stride.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    local_lens: torch.Tensor
    block_table: torch.Tensor


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face configs write it (``rope_scaling`` /
    ``rope_parameters``), for the types of :data:`ROPE_TYPES`.

    ``factor``: the context extension (``linear``: positions divided by it; ``llama3`` and
    ``yarn``: long wavelengths). ``llama3``: ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``. ``yarn``: ``original_max_position_embeddings``,
    ``beta_fast`` / ``beta_slow`` (32 / 1 by default), ``mscale`` / ``mscale_all_dim`` (the
    attention factor on cos / sin and, for MLA, the softmax scale; 0: not given, as
    transformers reads a missing one), ``attention_factor``, ``truncate``.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_TYPES)})"
            )
        if self.rope_type != "default" and not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """Inverse frequencies ``[dim / 2]`` (float64) of a rotary dim of ``dim``."""
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        base = theta**-exponents
        if self.rope_type == "default":
            return base
        if self.rope_type == "linear":
            return base / self.factor
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / base
            scaled = torch.where(wavelen > low_wavelen, base / self.factor, base)
            smooth = (old / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        # yarn: interpolate long wavelengths, extrapolate short ones, ramp in between
        old = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no singularity
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (base / self.factor) * (1 - extrapolation) + base * extrapolation

    def cos_sin_factor(self) -> float:
        """The factor on cos and sin (yarn's attention factor; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor, 1.0)

    def softmax_scale_factor(self) -> float:
        """The factor on an MLA model's softmax scale (yarn's ``mscale_all_dim`` squared)."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class LlamaConfig:
    """Geometry and seed of a Llama-family model (the tiny defaults are the test model).

    ``head_dim``: per attention head (queries, keys and values). ``qkv_bias``: biases on the
    query, key and value projections (Qwen2; Llama's ``attention_bias`` sets it and
    ``o_bias``); ``mlp_bias``: on the gate, up and down projections. ``rope_scaling``:
    ``None`` for plain RoPE. ``seed``: the generator of random weights (unused for weights
    loaded from a checkpoint).
    """

    vocab_size: int = 96
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    seed: int = 0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        _check_positive(
            self,
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")

    @property
    def cache_heads(self) -> int:
        """KV heads the pool stores per token and layer."""
        return self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """Elements of one cached head."""
        return self.head_dim

    @property
    def kv_factor(self) -> int:
        """Cached tensors per head: 2 (a key and a value)."""
        return 2

    def to_dict(self) -> dict[str, object]:
        """Plain-dict form (picklable, printable)."""
        return asdict(self)


@dataclass(frozen=True)
class MLAConfig:
    """Geometry and seed of a DeepSeek-V3-style multi-head latent attention model (dense MLP).

    ``q_lora_rank``: the query's low-rank bottleneck (``None``: one query projection);
    ``kv_lora_rank``: the cached latent; ``qk_nope_head_dim`` / ``qk_rope_head_dim``: the
    query-key dims without and with RoPE; ``v_head_dim``: per head value dim.
    ``attention_bias``: biases on ``q_a``/``kv_a``/``o`` projections (as transformers').
    ``rms_eps``: the layer and final norms' epsilon; ``latent_norm_eps``: the epsilon of the
    norms on the query bottleneck and the KV latent (``q_a_layernorm`` / ``kv_a_layernorm``),
    which transformers (and DeepSeek's own code) build with 1e-6 whatever ``rms_norm_eps``
    says.
    """

    vocab_size: int = 96
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    seed: int = 0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    mlp_bias: bool = field(default=False, repr=False)
    latent_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_positive(
            self,
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "intermediate_size",
        )
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even for RoPE")
        if self.mlp_bias:
            raise ValueError("MLA models have no MLP biases")

    @property
    def cache_heads(self) -> int:
        """KV heads the pool stores per token and layer: one latent."""
        return 1

    @property
    def cache_head_dim(self) -> int:
        """Elements of the cached latent: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_factor(self) -> int:
        """Cached tensors per head: 1 (the value is the latent)."""
        return 1

    @property
    def softmax_scale(self) -> float:
        """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times yarn's mscale squared."""
        scale: float = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5  # as transformers
        return scale * (self.rope_scaling.softmax_scale_factor() if self.rope_scaling else 1.0)

    def to_dict(self) -> dict[str, object]:
        """Plain-dict form (picklable, printable)."""
        return asdict(self)


#: A model family's config.
ModelConfig = Union[LlamaConfig, MLAConfig]
#: Historical name of :class:`LlamaConfig` (the tiny test model is its defaults).
TinyConfig = LlamaConfig


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


#: One layer's weights: ``[in, out]`` matrices (``x @ w``), vectors, ``None`` where absent.
LayerWeights = dict[str, torch.Tensor]


class Transformer:
    """Decoder-only transformer of either family (see the module docs), attending through a
    :class:`KVPool`.

    Args:
        config: a :class:`LlamaConfig` or :class:`MLAConfig`.
        dtype, device: where the weights live and the forward runs.
        decode_kernel: :meth:`forward` attends decode entries with the Triton paged kernel
            instead of the reference gather + dense masked attention (context chunks always
            take the reference).
        weights: ``None`` for seeded random weights; else the named tensors of
            :func:`weight_shapes` (from :func:`helix_kv.executor.checkpoint.load_weights`).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
        decode_kernel: bool = False,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        self.decode_kernel = decode_kernel
        self.dtype = dtype
        self.device = torch.device(device)
        self.mla = isinstance(config, MLAConfig)
        shapes = weight_shapes(config)
        source = dict(weights) if weights is not None else _random_weights(config, shapes)
        missing = sorted(set(shapes) - set(source))
        if missing:
            raise ValueError(f"weights missing: {', '.join(missing[:5])}")

        def take(name: str) -> torch.Tensor:
            tensor = source[name]
            if tuple(tensor.shape) != shapes[name]:
                raise ValueError(
                    f"weight {name} has shape {tuple(tensor.shape)}, not {shapes[name]}"
                )
            return tensor.to(dtype=dtype, device=self.device)

        c = config
        self.embedding = take("embedding")
        self.layers: list[LayerWeights] = []
        for layer in range(c.num_layers):
            prefix = f"layers.{layer}."
            weights_of = {
                name[len(prefix) :]: take(name) for name in shapes if name.startswith(prefix)
            }
            self.layers.append(_fuse(c, weights_of))
        self.final_norm = take("final_norm")
        self.lm_head = self.embedding.t() if c.tie_embeddings else take("lm_head")
        rope_dim = c.qk_rope_head_dim if isinstance(c, MLAConfig) else c.head_dim
        scaling = c.rope_scaling or RopeScaling()
        #: Inverse RoPE frequencies ``[rope_dim / 2]`` (float64) and the factor on cos / sin.
        self.rope_inv_freq = scaling.inv_freq(rope_dim, c.rope_theta).to(self.device)
        self.rope_factor = scaling.cos_sin_factor()

    # -- pool and workspace --------------------------------------------------------------

    def new_kv_pool(
        self,
        placement: RankPlacement,
        capacity_superblocks: int,
        kv_dtype: torch.dtype | None = None,
    ) -> KVPool:
        """A KV pool shaped for this model on its device (MLA: one latent per token)."""
        c = self.config
        return KVPool(
            c.num_layers,
            c.cache_heads,
            c.cache_head_dim,
            placement,
            capacity_superblocks,
            kv_dtype or self.dtype,
            self.device,
            latent_dim=c.kv_lora_rank if isinstance(c, MLAConfig) else None,
        )

    def decode_workspace(
        self, max_rows: int, max_pages: int, tokens_per_block: int, rows_per_request: int = 1
    ) -> DecodeWorkspace:
        """Split-K scratch for :meth:`forward_decode` on up to ``max_rows`` rows of a block
        table ``max_pages`` wide (shared by every layer)."""
        c = self.config
        if isinstance(c, MLAConfig):
            return DecodeWorkspace.for_mla_decode(
                max_rows,
                c.num_heads,
                c.kv_lora_rank,
                max_pages,
                tokens_per_block,
                self.dtype,
                self.device,
            )
        return DecodeWorkspace.for_decode(
            max_rows,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            max_pages,
            tokens_per_block,
            self.dtype,
            self.device,
            rows_per_request,
        )

    # -- forward passes ------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self, batch: StepBatch, pool: KVPool, combine: Combine | None = None
    ) -> torch.Tensor:
        """Run the step's tokens, writing their KV to ``pool``; final hidden states ``[tokens, H]``.

        ``combine`` merges this rank's partial attention with its peers' (default: all-gather
        over the default process group, or the local combine without one).
        """
        combine = combine or all_gather_combine
        hidden = self.embedding[batch.token_ids]
        cos, sin = self._rope_tables(batch.positions)
        decode = self._plan_batch_decode(batch, pool)
        for layer, weights in enumerate(self.layers):
            attn_in = _rms_norm(hidden, weights["attn_norm"], self.config.rms_eps)
            query, key, value = self._project(weights, attn_in, cos, sin)
            pool.write(layer, batch, key, value)
            part = self._attend_batch(layer, query, batch, pool, decode)
            hidden = hidden + self._attention_output(weights, combine(part))
            hidden = hidden + self._mlp(weights, hidden)
        return _rms_norm(hidden, self.final_norm, self.config.rms_eps)

    @torch.no_grad()
    def forward_decode(
        self,
        rows: DecodeRows,
        pool: KVPool,
        combine: Combine | None = None,
        workspace: DecodeWorkspace | None = None,
        rows_per_request: int = 1,
    ) -> torch.Tensor:
        """One query token per row, through the Triton paged kernels; hidden states ``[rows, H]``.

        The fast path of a decode-only step: no host work, no sync and no shape that depends on
        the data, so it can be captured in a CUDA graph (padding rows carry slot ``-1`` and
        local length ``0``: they write nothing and attend to nothing). Numerically the same
        step as :meth:`forward` with ``decode_kernel=True``, to rounding: the norms, the Llama
        family's RoPE with its KV write and the MLP activation run fused
        (:mod:`helix_kv.executor.fused`). ``workspace``: the split-K scratch every layer
        reuses (:meth:`decode_workspace`; without one, a step that splits allocates its
        scratch).

        Speculative decoding: a request verifying ``k`` drafts has ``1 + k`` consecutive rows
        (``Scheduler.write_decode_rows``: its decode token, then each draft, each row's local
        length up to and including its position, so the causal mask inside the draft is the
        lengths'). Every row's KV is written before any row attends. ``rows_per_request``
        (the most rows one request may have, ``1 + K``) above 1 attends a request's rows in
        one kernel program (each key block loaded once for all of them; Llama family only).
        """
        combine = combine or all_gather_combine
        c = self.config
        hidden = self.embedding[rows.token_ids]
        if self.rope_factor == 1.0:
            cos, sin = fused.rope_tables(rows.positions, self.rope_inv_freq, self.dtype)
        else:  # yarn's attention factor on the tables
            cos, sin = self._rope_tables(rows.positions)
        # one rank: the attention output feeds the output projection as it is (no combine,
        # no cast)
        out_dtype = self.dtype if pool.placement.cp_size == 1 and not self.mla else None
        # the paged kernel planned once for the step's rows (splits, scratch, tiles)
        attention = self.plan_decode_attention(
            rows.block_table,
            rows.local_lens,
            pool,
            workspace,
            rows.positions,
            rows_per_request,
            out_dtype,
        )
        # Fused (helix_kv.executor.fused): each residual add with the norm after it, the
        # Llama QKV split with RoPE and the KV write, the MLP activation with its product.
        delta = None  # what the next norm adds to the residual stream first
        for layer, weights in enumerate(self.layers):
            attn_in, hidden = fused.add_rms_norm(hidden, delta, weights["attn_norm"], c.rms_eps)
            key_cache, value_cache = pool.key_cache[layer], pool.value_cache[layer]
            if isinstance(c, LlamaConfig):
                query = fused.rope_split_write(
                    _linear(attn_in, weights["wqkv"], weights.get("bqkv")),
                    cos,
                    sin,
                    rows.slots,
                    key_cache,
                    value_cache,
                    c.num_heads,
                    c.num_kv_heads,
                )
            else:
                query = self._mla_decode_project(weights, attn_in, cos, sin, rows.slots, key_cache)
            part = self._attend_decode(attention, query, pool, layer)
            delta = self._attention_output(weights, combine(part))
            mlp_in, hidden = fused.add_rms_norm(hidden, delta, weights["mlp_norm"], c.rms_eps)
            gate_up = _linear(mlp_in, weights["w_gate_up"], weights.get("b_gate_up"))
            delta = _linear(fused.silu_mul(gate_up), weights["w_down"], weights.get("b_down"))
        return fused.add_rms_norm(hidden, delta, self.final_norm, c.rms_eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits of the given hidden rows."""
        return hidden @ self.lm_head

    # -- the parts -----------------------------------------------------------------------

    def _project(
        self, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(query, key, value)`` of the normed input, RoPE applied.

        Llama: query ``[tokens, heads, head_dim]``, key / value ``[tokens, kv_heads,
        head_dim]``. MLA: the absorbed query ``[tokens, heads, kv_lora_rank + rope]`` and
        the cached latent ``[tokens, 1, kv_lora_rank + rope]`` as the key; no value.
        """
        c = self.config
        tokens = x.shape[0]
        if isinstance(c, LlamaConfig):
            qkv = _linear(x, w["wqkv"], w.get("bqkv"))
            qkv = qkv.view(tokens, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
            rotated = _apply_rope(qkv[:, : c.num_heads + c.num_kv_heads], cos, sin)
            return rotated[:, : c.num_heads], rotated[:, c.num_heads :], qkv[:, -c.num_kv_heads :]
        q_width = (
            c.q_lora_rank
            if c.q_lora_rank is not None
            else c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        )
        fused = _linear(x, w["w_in"], w.get("b_in"))  # [q or q_a | kv_a]
        q_part, kv_part = fused[:, :q_width], fused[:, q_width:]
        if c.q_lora_rank is not None:
            q_part = _linear(_rms_norm(q_part, w["q_a_norm"], c.latent_norm_eps), w["wq_b"], None)
        q = q_part.view(tokens, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        latent = _rms_norm(kv_part[:, : c.kv_lora_rank], w["kv_a_norm"], c.latent_norm_eps)
        k_rope = _apply_rope(kv_part[:, None, c.kv_lora_rank :], cos, sin)
        # absorbed query: q_nope through the key up-projection, into the latent space
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w["w_uk"])
        query = torch.cat([q_latent, _apply_rope(q_rope, cos, sin)], dim=-1)
        key = torch.cat([latent[:, None, :], k_rope], dim=-1)
        return query, key, None

    def _mla_decode_project(
        self,
        w: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        latent_cache: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`_project` of an MLA model on the fast path, the latent written at ``slots``:
        the RoPE of the query and the key, the latent's norm and the write in one kernel
        (:func:`~helix_kv.executor.fused.mla_rope_norm_write`); the absorbed query."""
        c = self.config
        assert isinstance(c, MLAConfig)
        tokens = x.shape[0]
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        q_width = c.q_lora_rank if c.q_lora_rank is not None else c.num_heads * qk
        fused_in = _linear(x, w["w_in"], w.get("b_in"))
        q_part, kv_part = fused_in[:, :q_width], fused_in[:, q_width:]
        if c.q_lora_rank is not None:
            q_normed = fused.add_rms_norm(q_part, None, w["q_a_norm"], c.latent_norm_eps)[0]
            q_part = _linear(q_normed, w["wq_b"], None)
        q = q_part.view(tokens, c.num_heads, qk)
        query = x.new_empty((tokens, c.num_heads, c.cache_head_dim))
        # cuBLAS's batched GEMM on the heads-first views is as fast as fused.head_matmul here
        # (3.3 us a layer at 64 rows, 5.8 against 6.4 at 256: benches/gpu_decode_gemms.py)
        torch.matmul(
            q[..., : c.qk_nope_head_dim].transpose(0, 1),
            w["w_uk"],
            out=query[..., : c.kv_lora_rank].transpose(0, 1),
        )
        fused.mla_rope_norm_write(
            q, kv_part, cos, sin, slots, latent_cache, w["kv_a_norm"], c.latent_norm_eps, query
        )
        return query

    def _attention_output(self, w: LayerWeights, combined: PartialAttention) -> torch.Tensor:
        """The combined attention through the output projection: ``[tokens, hidden]``."""
        if self.mla:
            # The value up-projection of the output latent, per head, in one kernel that
            # writes [rows, heads, v] as wo reads it (an einsum wrote it heads-first, and the
            # reshape copied it: 16.1 against 8.7 us a layer at 256 rows).
            out = fused.head_matmul(combined.output, w["w_uv"].transpose(1, 2))
        else:
            out = combined.output.to(self.dtype)
        return _linear(out.reshape(out.shape[0], -1), w["wo"], w.get("bo"))

    def _mlp(self, w: LayerWeights, hidden: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(hidden, w["mlp_norm"], self.config.rms_eps)
        gate = torch.nn.functional.silu(_linear(x, w["w_gate"], w.get("b_gate")))
        return _linear(gate * _linear(x, w["w_up"], w.get("b_up")), w["w_down"], w.get("b_down"))

    def plan_decode_attention(
        self,
        block_table: torch.Tensor,
        local_lens: torch.Tensor,
        pool: KVPool,
        workspace: DecodeWorkspace | None = None,
        positions: torch.Tensor | None = None,
        rows_per_request: int = 1,
        out_dtype: torch.dtype | None = None,
    ) -> DecodeAttention:
        """The paged kernel of the family planned once for a step's rows (every layer runs
        it: :meth:`_attend_decode`); ``out_dtype``: the Llama kernel's output dtype,
        ``None`` for the accumulation's."""
        c = self.config
        tpb = pool.placement.tokens_per_block
        if isinstance(c, MLAConfig):
            return MLADecodeAttentionPlan(
                block_table,
                local_lens,
                tpb,
                heads=c.num_heads,
                head_dim=c.cache_head_dim,
                latent_dim=c.kv_lora_rank,
                dtype=self.dtype,
                scale=c.softmax_scale,
                kv_dtype=pool.key_cache.dtype,
                workspace=workspace,
            )
        return DecodeAttentionPlan(
            block_table,
            local_lens,
            tpb,
            q_heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=self.dtype,
            workspace=workspace,
            positions=positions,
            rows_per_request=rows_per_request,
            tokens_per_superblock=pool.placement.tokens_per_superblock,
            out_dtype=out_dtype,
        )

    @staticmethod
    def _attend_decode(
        plan: DecodeAttention, query: torch.Tensor, pool: KVPool, layer: int
    ) -> PartialAttention:
        """One layer's run of a step's :meth:`plan_decode_attention`."""
        if isinstance(plan, MLADecodeAttentionPlan):
            return plan.run(query, pool.key_cache[layer])
        return plan.run(query, pool.key_cache[layer], pool.value_cache[layer])

    def _plan_batch_decode(self, batch: StepBatch, pool: KVPool) -> DecodeAttention | None:
        """The paged kernel of the step's decode group (entries ``[0, num_generation)``,
        one query each), planned once for every layer, with ``decode_kernel``; ``None``:
        every group takes the reference. Drafted entries (``1 + k`` queries each) take the
        reference on this path, exact with the causal mask on global positions; a
        decode-only drafted step runs the kernel on the fast path (one row per query token)."""
        plan = batch.plan
        if not (self.decode_kernel and plan.num_generation and not plan.num_draft_tokens):
            return None
        return self.plan_decode_attention(batch.groups[0].pages, batch.local_lens, pool)

    def _attend_batch(
        self,
        layer: int,
        query: torch.Tensor,
        batch: StepBatch,
        pool: KVPool,
        decode: DecodeAttention | None = None,
    ) -> PartialAttention:
        """This rank's partial attention of every query of the step (general path): the
        first group through ``decode`` where the step planned it, the others (and every
        group without it) through the reference gather and dense attention."""
        outputs, lses = [], []
        scale = self.config.softmax_scale if isinstance(self.config, MLAConfig) else None
        for index, group in enumerate(batch.groups):
            if decode is not None and index == 0:
                part = self._attend_decode(decode, query[group.query_index[:, 0]], pool, layer)
                outputs.append(part.output)
                lses.append(part.lse)
                continue
            keys, values = pool.gather(layer, group)
            part = partial_attention(
                query[group.query_index],
                keys.to(query.dtype),
                values.to(query.dtype),
                group.query_positions,
                group.key_positions,
                scale,
            )
            output = part.output.reshape(-1, *part.output.shape[2:])
            lse = part.lse.reshape(-1, part.lse.shape[-1])
            if group.unpad_index is not None:
                output, lse = output[group.unpad_index], lse[group.unpad_index]
            outputs.append(output)
            lses.append(lse)
        return PartialAttention(torch.cat(outputs), torch.cat(lses))

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self.rope_inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        return cos.to(self.dtype), sin.to(self.dtype)


#: Historical name of :class:`Transformer` (the tiny test model is a Llama config).
TinyTransformer = Transformer


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model of ``config`` takes, by helix_kv's name, with its shape.

    Matrices are ``[in, out]`` (``x @ w``); ``lm_head`` is absent with tied embeddings.
    Names: ``embedding``, ``final_norm``, ``lm_head`` and ``layers.{i}.{name}`` with Llama
    ``attn_norm wq wk wv wo [bq bk bv] [bo] mlp_norm w_gate w_up w_down [b_gate b_up
    b_down]`` or MLA ``attn_norm (wq | wq_a q_a_norm wq_b) wkv_a kv_a_norm wkv_b wo [bq_a
    bkv_a bo] mlp_norm w_gate w_up w_down``.
    """
    c = config
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embedding": (c.vocab_size, h), "final_norm": (h,)}
    if not c.tie_embeddings:
        shapes["lm_head"] = (h, c.vocab_size)
    for layer in range(c.num_layers):
        p = f"layers.{layer}."
        shapes[p + "attn_norm"] = (h,)
        if isinstance(c, LlamaConfig):
            q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            shapes.update({p + "wq": (h, q_width), p + "wk": (h, kv_width)})
            shapes.update({p + "wv": (h, kv_width), p + "wo": (q_width, h)})
            if c.qkv_bias:
                shapes.update({p + "bq": (q_width,), p + "bk": (kv_width,), p + "bv": (kv_width,)})
            if c.o_bias:
                shapes[p + "bo"] = (h,)
        else:
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            if c.q_lora_rank is None:
                shapes[p + "wq"] = (h, c.num_heads * qk)
            else:
                shapes[p + "wq_a"] = (h, c.q_lora_rank)
                shapes[p + "q_a_norm"] = (c.q_lora_rank,)
                shapes[p + "wq_b"] = (c.q_lora_rank, c.num_heads * qk)
            shapes[p + "wkv_a"] = (h, c.kv_lora_rank + c.qk_rope_head_dim)
            shapes[p + "kv_a_norm"] = (c.kv_lora_rank,)
            shapes[p + "wkv_b"] = (
                c.kv_lora_rank,
                c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
            )
            shapes[p + "wo"] = (c.num_heads * c.v_head_dim, h)
            if c.attention_bias:
                if c.q_lora_rank is not None:
                    shapes[p + "bq_a"] = (c.q_lora_rank,)
                shapes[p + "bkv_a"] = (c.kv_lora_rank + c.qk_rope_head_dim,)
                shapes[p + "bo"] = (h,)
        shapes[p + "mlp_norm"] = (h,)
        shapes[p + "w_gate"] = (h, c.intermediate_size)
        shapes[p + "w_up"] = (h, c.intermediate_size)
        shapes[p + "w_down"] = (c.intermediate_size, h)
        if c.mlp_bias:
            shapes.update(
                {p + "b_gate": (c.intermediate_size,), p + "b_up": (c.intermediate_size,)}
            )
            shapes[p + "b_down"] = (h,)
    return shapes


def _random_weights(
    config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Seeded float64 weights: norms 1 (``*_norm``), biases ``N(0, 0.1)``, matrices
    ``N(0, 1 / in)`` (the embedding ``N(0, 1)``), drawn in :func:`weight_shapes` order with
    ``lm_head`` last."""
    generator = torch.Generator().manual_seed(config.seed)
    weights = {}
    # lm_head last: the draw order of the original tiny model, whose seeds the tests pin
    for name in sorted(shapes, key=lambda n: n == "lm_head"):
        shape = shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            weights[name] = torch.ones(shape, dtype=torch.float64)
            continue
        if leaf.startswith("b"):
            std = 0.1
        elif name == "embedding":
            std = 1.0
        else:
            std = shape[0] ** -0.5
        weights[name] = torch.randn(*shape, generator=generator, dtype=torch.float64) * std
    return weights


def _fuse(config: ModelConfig, w: LayerWeights) -> LayerWeights:
    """A layer's weights plus the fused forms the forward reads: ``w_gate_up`` (and
    ``b_gate_up``); Llama ``wqkv`` (and ``bqkv``); MLA ``w_in`` (the query or ``q_a``
    projection beside ``kv_a``, one GEMM), ``b_in``, and the up-projection split per head,
    ``w_uk`` ``[heads, nope, latent]`` and ``w_uv`` ``[heads, v, latent]``."""
    # the MLP's gate and up in one GEMM (forward_decode: fused.silu_mul)
    w["w_gate_up"] = torch.cat([w["w_gate"], w["w_up"]], dim=1)
    if config.mlp_bias:
        w["b_gate_up"] = torch.cat([w["b_gate"], w["b_up"]])
    if isinstance(config, LlamaConfig):
        w["wqkv"] = torch.cat([w["wq"], w["wk"], w["wv"]], dim=1)
        if config.qkv_bias:
            w["bqkv"] = torch.cat([w["bq"], w["bk"], w["bv"]])
        return w
    c = config
    q_weight = w["wq"] if c.q_lora_rank is None else w["wq_a"]
    w["w_in"] = torch.cat([q_weight, w["wkv_a"]], dim=1)
    if c.attention_bias:
        q_bias = (
            w["bq_a"]
            if c.q_lora_rank is not None
            else torch.zeros(q_weight.shape[1], dtype=q_weight.dtype, device=q_weight.device)
        )
        w["b_in"] = torch.cat([q_bias, w["bkv_a"]])
    # wkv_b: [latent, heads * (nope + v)] -> per head [nope + v, latent]
    per_head = w["wkv_b"].t().reshape(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
    w["w_uk"] = per_head[:, : c.qk_nope_head_dim].contiguous()
    w["w_uv"] = per_head[:, c.qk_nope_head_dim :].contiguous()
    return w


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x @ weight
    return out if bias is None else out + bias


def group_combine(group: dist.ProcessGroup | None) -> Combine:
    """The :data:`Combine` of a CP process group (``None``: the default group)."""
    return lambda partial: all_gather_combine(partial, group)


__all__ = [
    "ROPE_TYPES",
    "Combine",
    "DecodeRows",
    "LlamaConfig",
    "MLAConfig",
    "ModelConfig",
    "RopeScaling",
    "TinyConfig",
    "TinyTransformer",
    "Transformer",
    "group_combine",
    "weight_shapes",
]
