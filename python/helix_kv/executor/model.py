"""A tiny deterministic decoder-only transformer that attends through the Helix KV pool.

Weights are drawn from a seeded ``torch.Generator`` in float64 on the CPU and then cast, so
every rank, device and dtype starts from the same numbers; nothing is downloaded. The model
is replicated on every rank of the CP group: activations are identical everywhere and only
the KV is sharded, so attention is the one place the ranks exchange data (one all-gather per
layer, see :func:`~helix_kv.executor.attention.all_gather_combine`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from helix_kv.executor import fused
from helix_kv.executor.attention import (
    PartialAttention,
    all_gather_combine,
    partial_attention,
)
from helix_kv.executor.kv_pool import KVPool, StepBatch
from helix_kv.executor.paged_attention import (
    DecodeWorkspace,
    paged_decode_attention,
)
from helix_kv.executor.placement import RankPlacement

#: Turns this rank's partial attention into the CP group's combined attention.
Combine = Callable[[PartialAttention], PartialAttention]


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
class TinyConfig:
    """Geometry and seed of the reference model."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")

    def to_dict(self) -> dict[str, object]:
        """Plain-dict form (picklable, printable)."""
        return asdict(self)


class TinyTransformer:
    """Decoder-only transformer: RMSNorm, RoPE on global positions, GQA, SiLU-gated MLP.

    Args:
        config: geometry and seed.
        dtype, device: where the weights live and the forward runs.
    """

    def __init__(
        self,
        config: TinyConfig,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
        decode_kernel: bool = False,
    ) -> None:
        self.config = config
        #: :meth:`forward` attends decode entries with the Triton paged kernel
        #: (:func:`~helix_kv.executor.paged_attention.paged_decode_attention`) instead of the
        #: reference gather + dense masked attention; context chunks always take the reference.
        self.decode_kernel = decode_kernel
        self.dtype = dtype
        self.device = torch.device(device)
        generator = torch.Generator().manual_seed(config.seed)
        c = config

        def draw(*shape: int, std: float) -> torch.Tensor:
            values = torch.randn(*shape, generator=generator, dtype=torch.float64) * std
            return values.to(dtype=dtype, device=self.device)

        def ones(size: int) -> torch.Tensor:
            return torch.ones(size, dtype=dtype, device=self.device)

        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embedding = draw(c.vocab_size, c.hidden_size, std=1.0)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "attn_norm": ones(c.hidden_size),
                    "wq": draw(c.hidden_size, q_width, std=c.hidden_size**-0.5),
                    "wk": draw(c.hidden_size, kv_width, std=c.hidden_size**-0.5),
                    "wv": draw(c.hidden_size, kv_width, std=c.hidden_size**-0.5),
                    "wo": draw(q_width, c.hidden_size, std=q_width**-0.5),
                    "mlp_norm": ones(c.hidden_size),
                    "w_gate": draw(c.hidden_size, c.intermediate_size, std=c.hidden_size**-0.5),
                    "w_up": draw(c.hidden_size, c.intermediate_size, std=c.hidden_size**-0.5),
                    "w_down": draw(
                        c.intermediate_size, c.hidden_size, std=c.intermediate_size**-0.5
                    ),
                }
            )
        for weights in self.layers:  # one projection for q, k and v (same numbers)
            weights["wqkv"] = torch.cat([weights["wq"], weights["wk"], weights["wv"]], dim=1)
            # and one for the MLP's gate and up (forward_decode: fused.silu_mul)
            weights["w_gate_up"] = torch.cat([weights["w_gate"], weights["w_up"]], dim=1)
        self.final_norm = ones(c.hidden_size)
        if c.tie_embeddings:
            self.lm_head = self.embedding.t()
        else:
            self.lm_head = draw(c.hidden_size, c.vocab_size, std=c.hidden_size**-0.5)
        half = c.head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) * 2.0 / c.head_dim
        self._inv_freq = (c.rope_theta**-exponents).to(self.device)

    def new_kv_pool(
        self,
        placement: RankPlacement,
        capacity_superblocks: int,
        kv_dtype: torch.dtype | None = None,
    ) -> KVPool:
        """A KV pool shaped for this model on its device."""
        return KVPool(
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            placement,
            capacity_superblocks,
            kv_dtype or self.dtype,
            self.device,
        )

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
        for layer, weights in enumerate(self.layers):
            attn_in = _rms_norm(hidden, weights["attn_norm"], self.config.rms_eps)
            hidden = hidden + self._attention(
                layer, weights, attn_in, cos, sin, batch, pool, combine
            )
            mlp_in = _rms_norm(hidden, weights["mlp_norm"], self.config.rms_eps)
            gate = torch.nn.functional.silu(mlp_in @ weights["w_gate"])
            hidden = hidden + (gate * (mlp_in @ weights["w_up"])) @ weights["w_down"]
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
        step as :meth:`forward` with ``decode_kernel=True``, to rounding: the norms, RoPE with
        the KV write and the MLP activation run fused (:mod:`helix_kv.executor.fused`).
        ``workspace``: the split-K scratch every layer reuses (without one, a step that
        splits allocates its scratch).

        Speculative decoding: a request verifying ``k`` drafts has ``1 + k`` consecutive rows
        (``Scheduler.write_decode_rows``: its decode token, then each draft, each row's local
        length up to and including its position, so the causal mask inside the draft is the
        lengths'). Every row's KV is written before any row attends. ``rows_per_request``
        (the most rows one request may have, ``1 + K``) above 1 attends a request's rows in
        one kernel program (each key block loaded once for all of them).
        """
        combine = combine or all_gather_combine
        c = self.config
        tpb = pool.placement.tokens_per_block
        hidden = self.embedding[rows.token_ids]
        cos, sin = fused.rope_tables(rows.positions, self._inv_freq, self.dtype)
        # Fused (helix_kv.executor.fused): each residual add with the norm after it, the
        # QKV split with RoPE and the KV write, the MLP activation with its product.
        delta = None  # what the next norm adds to the residual stream first
        for layer, weights in enumerate(self.layers):
            attn_in, hidden = fused.add_rms_norm(hidden, delta, weights["attn_norm"], c.rms_eps)
            key_cache, value_cache = pool.key_cache[layer], pool.value_cache[layer]
            query = fused.rope_split_write(
                attn_in @ weights["wqkv"],
                cos,
                sin,
                rows.slots,
                key_cache,
                value_cache,
                c.num_heads,
                c.num_kv_heads,
            )
            part = paged_decode_attention(
                query,
                key_cache,
                value_cache,
                rows.block_table,
                rows.local_lens,
                tpb,
                workspace=workspace,
                positions=rows.positions,
                rows_per_request=rows_per_request,
                tokens_per_superblock=pool.placement.tokens_per_superblock,
                # one rank: the output feeds wo as it is (no combine, no cast)
                out_dtype=self.dtype if pool.placement.cp_size == 1 else None,
            )
            combined = combine(part)
            delta = combined.output.to(hidden.dtype).reshape(hidden.shape[0], -1) @ weights["wo"]
            mlp_in, hidden = fused.add_rms_norm(hidden, delta, weights["mlp_norm"], c.rms_eps)
            delta = fused.silu_mul(mlp_in @ weights["w_gate_up"]) @ weights["w_down"]
        return fused.add_rms_norm(hidden, delta, self.final_norm, c.rms_eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits of the given hidden rows."""
        return hidden @ self.lm_head

    def _qkv(
        self,
        weights: dict[str, torch.Tensor],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query ``[tokens, heads, dim]``, key / value ``[tokens, kv_heads, dim]``; RoPE applied."""
        c = self.config
        tokens = x.shape[0]
        qkv = (x @ weights["wqkv"]).view(tokens, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        rotated = _apply_rope(qkv[:, : c.num_heads + c.num_kv_heads], cos, sin)
        query, key = rotated[:, : c.num_heads], rotated[:, c.num_heads :]
        return query, key, qkv[:, c.num_heads + c.num_kv_heads :]

    def _attention(
        self,
        layer: int,
        weights: dict[str, torch.Tensor],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: StepBatch,
        pool: KVPool,
        combine: Combine,
    ) -> torch.Tensor:
        c = self.config
        tokens = x.shape[0]
        query, key, value = self._qkv(weights, x, cos, sin)
        pool.write(layer, batch, key, value)
        outputs, lses = [], []
        for index, group in enumerate(batch.groups):
            plan = batch.plan
            if (
                self.decode_kernel
                and index == 0
                and plan.num_generation
                and not plan.num_draft_tokens
            ):
                # the decode group (entries [0, num_generation), one query each): paged kernel.
                # Drafted entries (1 + k queries each) take the reference below on this path,
                # exact with the causal mask on global positions; a decode-only drafted step
                # runs the kernel on the fast path (one row per query token).
                part = paged_decode_attention(
                    query[group.query_index[:, 0]],
                    pool.key_cache[layer],
                    pool.value_cache[layer],
                    group.pages,
                    batch.local_lens,
                    pool.placement.tokens_per_block,
                )
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
            )
            output = part.output.reshape(-1, c.num_heads, c.head_dim)
            lse = part.lse.reshape(-1, c.num_heads)
            if group.unpad_index is not None:
                output, lse = output[group.unpad_index], lse[group.unpad_index]
            outputs.append(output)
            lses.append(lse)
        combined = combine(PartialAttention(torch.cat(outputs), torch.cat(lses)))
        return combined.output.to(x.dtype).reshape(tokens, -1) @ weights["wo"]

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; ``x``: ``[tokens, heads, head_dim]``, tables ``[tokens, head_dim/2]``."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def group_combine(group: dist.ProcessGroup | None) -> Combine:
    """The :data:`Combine` of a CP process group (``None``: the default group)."""
    return lambda partial: all_gather_combine(partial, group)


__all__ = ["Combine", "DecodeRows", "TinyConfig", "TinyTransformer", "group_combine"]
