"""Dense, scheduler-free reference for the tiny transformer (for tests).

The same network as :class:`~helix_kv.executor.model.TinyTransformer` written without a pool,
a plan or a process group: plain causal attention over the whole sequence, recomputed from
scratch for every generated token. Whatever the executor does with chunking, sharding and
preemption, its greedy tokens must equal :func:`greedy_generate`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helix_kv.executor.model import LlamaConfig, TinyTransformer


@torch.no_grad()
def dense_logits(model: TinyTransformer, tokens: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of every position, causal attention, no KV cache."""
    c = model.config
    if not isinstance(c, LlamaConfig):
        raise TypeError("dense_logits runs the Llama family (transformers is the MLA oracle)")
    n = len(tokens)
    dtype, device = model.dtype, model.device
    half = c.head_dim // 2
    angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * model.rope_inv_freq
    cos = (angles.cos() * model.rope_factor).to(dtype=dtype)[:, None]
    sin = (angles.sin() * model.rope_factor).to(dtype=dtype)[:, None]

    def linear(x: torch.Tensor, w: dict[str, torch.Tensor], weight: str, bias: str) -> torch.Tensor:
        return x @ w[weight] + w[bias] if bias in w else x @ w[weight]

    def rope(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_eps) * weight

    hidden = model.embedding[torch.as_tensor(list(tokens), device=device)]
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    repeat = c.num_heads // c.num_kv_heads
    for w in model.layers:
        x = norm(hidden, w["attn_norm"])
        q = rope(linear(x, w, "wq", "bq").view(n, c.num_heads, c.head_dim))
        k = rope(linear(x, w, "wk", "bk").view(n, c.num_kv_heads, c.head_dim))
        k = k.repeat_interleave(repeat, 1)
        v = linear(x, w, "wv", "bv").view(n, c.num_kv_heads, c.head_dim)
        v = v.repeat_interleave(repeat, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim**0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attended = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        hidden = hidden + linear(attended, w, "wo", "bo")
        x = norm(hidden, w["mlp_norm"])
        gate = torch.nn.functional.silu(linear(x, w, "w_gate", "b_gate"))
        hidden = hidden + linear(gate * linear(x, w, "w_up", "b_up"), w, "w_down", "b_down")
    return norm(hidden, model.final_norm) @ model.lm_head


def greedy_generate(
    model: TinyTransformer, prompt: Sequence[int], max_new_tokens: int
) -> list[int]:
    """Greedy tokens after ``prompt``, recomputing the whole sequence for every token."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(dense_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
