"""The fused decode kernels (:mod:`helix_kv.executor.fused`) against their torch references.

On the CPU the kernels run through Triton's interpreter (``conftest.py``) on tiny shapes in
float64 and float32; the ``cuda`` test checks bf16 on a GPU, where the references round each
op as the unfused path does and the kernels must match them to rounding.
"""

from __future__ import annotations

import pytest
import torch

from helix_kv.executor import fused
from helix_kv.executor.fused import (
    add_rms_norm,
    add_rms_norm_reference,
    argmax,
    mla_rope_norm_write,
    mla_rope_norm_write_reference,
    rope_split_write,
    rope_split_write_reference,
    rope_tables,
    rope_tables_reference,
    silu_mul,
    silu_mul_reference,
)

TOL = {torch.float64: 1e-12, torch.float32: 2e-6}
DTYPES = list(TOL)
EPS = 1e-6


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).to(device())


def tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype):
    inv = 10000.0 ** -(torch.arange(head_dim // 2, dtype=torch.float64) * 2.0 / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    return angles.cos().to(dtype).to(device()), angles.sin().to(dtype).to(device())


def test_kernels_run_here():
    assert fused.use_kernels(device())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("width", [48, 64])
def test_add_rms_norm_matches_reference(dtype, with_delta, width):
    x = randn(5, width, dtype=dtype, seed=1)
    delta = randn(5, width, dtype=dtype, seed=2) if with_delta else None
    weight = randn(width, dtype=dtype, seed=3)
    out, total = add_rms_norm(x, delta, weight, EPS)
    ref_out, ref_total = add_rms_norm_reference(x, delta, weight, EPS)
    assert out.shape == x.shape
    assert out.dtype == dtype
    assert relative(out, ref_out) < TOL[dtype]
    assert relative(total, ref_total) < TOL[dtype]
    if not with_delta:
        assert total is x


def test_add_rms_norm_of_strided_rows():
    """Rows of a wider buffer (row stride > width), as a view of a persistent buffer."""
    base = randn(4, 80, dtype=torch.float64, seed=4)
    x, delta = base[:, :40], base[:, 40:]
    weight = randn(40, dtype=torch.float64, seed=5)
    out, total = add_rms_norm(x, delta, weight, EPS)
    ref_out, ref_total = add_rms_norm_reference(x, delta, weight, EPS)
    assert relative(out, ref_out) < 1e-12
    assert relative(total, ref_total) < 1e-12


def test_add_rms_norm_rejects_mismatched_delta():
    x = randn(3, 8, dtype=torch.float64, seed=6)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, x[:, :4].contiguous(), x[0], EPS)


def rope_problem(dtype: torch.dtype, rows: int, q_heads: int, kv_heads: int, head_dim: int):
    qkv = randn(rows, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7)
    positions = torch.tensor([3, 17, 0, 41, 9][:rows])
    cos, sin = tables(positions, head_dim, dtype)
    slots = torch.tensor([5, -1, 0, 11, 2][:rows], dtype=torch.int32, device=device())
    caches = [torch.full((12, kv_heads, head_dim), float("nan"), dtype=dtype, device=device())]
    caches.append(caches[0].clone())
    return qkv, cos, sin, slots, caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "nope", "latent", "rope"), [(4, 16, 24, 8), (3, 8, 20, 6)])
def test_mla_rope_norm_write_matches_reference(dtype, heads, nope, latent, rope):
    """The MLA projection's RoPE, latent norm and write: queries' RoPE parts in place, owned
    rows' latents normed and keys rotated at their slots, nothing else written."""
    rows = 5
    fused_in = randn(rows, heads * (nope + rope) + latent + rope + 3, dtype=dtype, seed=4)
    q = fused_in[:, : heads * (nope + rope)].view(rows, heads, nope + rope)  # strided rows
    kv = fused_in[:, heads * (nope + rope) : heads * (nope + rope) + latent + rope]
    positions = torch.tensor([0, 3, 9, 17, 40])  # tables() moves them
    cos, sin = tables(positions, rope, dtype)
    slots = torch.tensor([2, -1, 7, 0, -1], device=device())
    weight = 1 + randn(latent, dtype=dtype, seed=5) / 10
    caches = [torch.full((10, 1, latent + rope), float("nan"), dtype=dtype, device=device())]
    caches.append(caches[0].clone())
    queries = [torch.full((rows, heads, latent + rope), 7.0, dtype=dtype, device=device())]
    queries.append(queries[0].clone())
    mla_rope_norm_write(q, kv, cos, sin, slots, caches[0], weight, EPS, queries[0])
    mla_rope_norm_write_reference(q, kv, cos, sin, slots, caches[1], weight, EPS, queries[1])
    assert relative(queries[0][..., latent:], queries[1][..., latent:]) < TOL[dtype]
    assert (queries[0][..., :latent] == 7.0).all()  # the latent part is the caller's
    owned = slots[slots >= 0].long()
    assert relative(caches[0][owned], caches[1][owned]) < TOL[dtype]
    untouched = torch.ones(10, dtype=torch.bool, device=device())
    untouched[owned] = False
    assert torch.isnan(caches[0][untouched]).all()
    with pytest.raises(ValueError, match="latent"):
        mla_rope_norm_write(q, kv, cos, sin, slots, caches[0], weight, EPS, queries[0][..., 1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 3, 12)])
def test_rope_split_write_matches_reference(dtype, q_heads, kv_heads, head_dim):
    qkv, cos, sin, slots, (k_cache, v_cache) = rope_problem(dtype, 5, q_heads, kv_heads, head_dim)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    query = rope_split_write(qkv, cos, sin, slots, k_cache, v_cache, q_heads, kv_heads)
    ref_q = rope_split_write_reference(qkv, cos, sin, slots, ref_k, ref_v, q_heads, kv_heads)
    assert query.shape == (5, q_heads, head_dim)
    assert query.is_contiguous()
    assert relative(query, ref_q) < TOL[dtype]
    owned = slots[slots >= 0].long()
    assert relative(k_cache[owned], ref_k[owned]) < TOL[dtype]
    assert torch.equal(v_cache[owned], ref_v[owned])  # a copy
    untouched = torch.ones(12, dtype=torch.bool, device=device())
    untouched[owned] = False
    assert torch.isnan(k_cache[untouched]).all()
    assert torch.isnan(v_cache[untouched]).all()


def test_rope_split_write_casts_to_the_cache_dtype():
    qkv, cos, sin, slots, _ = rope_problem(torch.float64, 4, 4, 2, 16)
    k_cache = torch.zeros(12, 2, 16, dtype=torch.float32, device=device())
    v_cache = torch.zeros_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    rope_split_write(qkv, cos, sin, slots, k_cache, v_cache, 4, 2)
    rope_split_write_reference(qkv, cos, sin, slots, ref_k, ref_v, 4, 2)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


def test_rope_split_write_rejects_a_wrong_width():
    qkv, cos, sin, slots, (k_cache, v_cache) = rope_problem(torch.float64, 3, 4, 2, 16)
    with pytest.raises(ValueError, match="heads"):
        rope_split_write(qkv, cos, sin, slots, k_cache, v_cache, 5, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_tables_match_the_models(dtype):
    from helix_kv.executor.model import TinyConfig, TinyTransformer

    model = TinyTransformer(TinyConfig(head_dim=12), dtype=dtype, device=device())
    positions = torch.tensor([0, 5, 1023, 77, 4096], dtype=torch.int32, device=device())
    cos, sin = rope_tables(positions[::2], model.rope_inv_freq, dtype)  # a strided column
    ref_cos, ref_sin = model._rope_tables(positions[::2])
    assert cos.shape == (3, 6)
    assert cos.dtype == dtype
    assert relative(cos, ref_cos) < TOL[dtype]
    assert relative(sin, ref_sin) < TOL[dtype]
    ref = rope_tables_reference(positions[::2], model.rope_inv_freq, dtype)
    assert relative(cos, ref[0]) < TOL[dtype]
    assert relative(sin, ref[1]) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [24, 1100])
def test_silu_mul_matches_reference(dtype, width):
    gate_up = randn(3, 2 * width, dtype=dtype, seed=8) * 3
    out = silu_mul(gate_up)
    assert out.shape == (3, width)
    assert relative(out, silu_mul_reference(gate_up)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_the_first_largest_column(dtype):
    logits = randn(4, 40000, dtype=dtype, seed=9)  # two blocks of the kernel
    logits[1, 7] = logits[1, 39000] = 100.0  # a tie across blocks: the first
    logits[2, 33000] = logits[2, 33001] = 100.0  # a tie in one block
    logits[3] = float("-inf")
    out = torch.full((6,), -5, dtype=torch.int64, device=device())
    result = argmax(logits, out=out[:4])
    assert torch.equal(result, torch.argmax(logits, dim=-1))
    assert out[:4].tolist() == [int(torch.argmax(logits[0])), 7, 33000, 0]
    assert out[4:].tolist() == [-5, -5]


def test_fallbacks_are_the_references(monkeypatch):
    """Where no kernel runs (CPU tensors without the interpreter), each function is its
    reference."""
    monkeypatch.setattr(fused, "use_kernels", lambda device: False)
    x = torch.randn(3, 8, dtype=torch.float64)
    weight = torch.randn(8, dtype=torch.float64)
    for out, ref in zip(add_rms_norm(x, x, weight, EPS), add_rms_norm_reference(x, x, weight, EPS)):
        assert torch.equal(out, ref)
    gate_up = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(silu_mul(gate_up), silu_mul_reference(gate_up))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_kernels_match_the_unfused_ops_on_cuda():
    """bf16 at the Llama geometry: every output within one bf16 rounding of the unfused ops
    (which round each op), almost all bit for bit."""
    dtype, rows, q_heads, kv_heads, head_dim, width = torch.bfloat16, 64, 32, 8, 128, 4096
    g = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    def close(out: torch.Tensor, ref: torch.Tensor, exact_share: float) -> None:
        assert out.shape == ref.shape
        assert out.dtype == ref.dtype
        diff = (out.float() - ref.float()).abs()
        ulp = ref.float().abs().clamp_min(1e-30) * 2.0**-7  # one bf16 ulp (bound)
        assert bool((diff <= ulp).all())
        assert float((diff == 0).float().mean()) >= exact_share

    x, delta, weight = draw(rows, width), draw(rows, width), draw(width)
    out, total = add_rms_norm(x, delta, weight, EPS)
    ref_out, ref_total = add_rms_norm_reference(x, delta, weight, EPS)
    assert torch.equal(total, ref_total)
    close(out, ref_out, 0.99)

    qkv = draw(rows, (q_heads + 2 * kv_heads) * head_dim)
    cos, sin = tables(torch.randint(0, 4096, (rows,)), head_dim, dtype)
    slots = torch.randperm(2 * rows, device="cuda")[:rows].to(torch.int32)
    slots[::7] = -1
    k_cache = torch.zeros(2 * rows, kv_heads, head_dim, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    query = rope_split_write(qkv, cos, sin, slots, k_cache, v_cache, q_heads, kv_heads)
    ref_q = rope_split_write_reference(qkv, cos, sin, slots, ref_k, ref_v, q_heads, kv_heads)
    assert torch.equal(query, ref_q)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)

    gate_up = draw(rows, 2 * 14336) * 3
    close(silu_mul(gate_up), silu_mul_reference(gate_up), 0.99)

    positions = torch.randint(0, 1 << 17, (rows,), device="cuda", dtype=torch.int32)
    inv_freq = 10000.0 ** -(torch.arange(64, dtype=torch.float64, device="cuda") / 64)
    for out, ref in zip(
        rope_tables(positions, inv_freq, dtype), rope_tables_reference(positions, inv_freq, dtype)
    ):
        close(out, ref, 0.999)


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("transposed", [False, True])
def test_head_matmul_matches_the_per_head_products(rows, transposed):
    # The kernel (interpreter on the CPU, float32) against a float64 product per head: rows
    # past one tile, columns past one tile, an inner dim that is not a tile's multiple, a
    # transposed weight view, an input of another dtype and an output inside a wider tensor.
    heads, inner, cols = 3, 40, 70
    x = randn(rows, heads, inner, dtype=torch.float64, seed=1)
    stored = randn(heads, cols, inner, dtype=torch.float32, seed=2)
    weight = stored.transpose(1, 2) if transposed else stored.transpose(1, 2).contiguous()
    wide = torch.full((rows, heads, cols + 6), 7.0, dtype=torch.float32, device=device())
    out = fused.head_matmul(x, weight, out=wide[..., 3 : 3 + cols])
    expected = torch.stack(
        [x.float().double()[:, h] @ weight.double()[h] for h in range(heads)], dim=1
    )
    assert out.data_ptr() == wide[..., 3:].data_ptr()
    assert relative(out, expected) < TOL[torch.float32]
    assert bool((wide[..., :3] == 7.0).all())
    assert bool((wide[..., 3 + cols :] == 7.0).all())
    fresh = fused.head_matmul(x.float(), weight)
    assert fresh.shape == (rows, heads, cols)
    assert torch.equal(fresh, out)
    reference = fused.head_matmul_reference(x.double(), weight.double())
    assert torch.allclose(fused.head_matmul(x.double(), weight.double()), reference)


def test_head_matmul_refuses_shapes_that_do_not_chain():
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="must be \\[rows, heads, inner\\]"):
        fused.head_matmul(x, torch.zeros(2, 9, 5))
    with pytest.raises(ValueError, match="must be \\[rows, heads, inner\\]"):
        fused.head_matmul(x, torch.zeros(3, 8, 5))
    with pytest.raises(ValueError, match="out"):
        fused.head_matmul(x, torch.zeros(2, 8, 5), out=torch.zeros(4, 2, 6))
    with pytest.raises(ValueError, match="out"):
        fused.head_matmul(x, torch.zeros(2, 8, 5), out=torch.zeros(4, 2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused.head_matmul(torch.zeros(4, 8, 2).transpose(1, 2), torch.zeros(2, 8, 5))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [64, 256])
def test_bf16_head_matmul_matches_cublas_at_the_mla_shapes(rows):
    # DeepSeek-V3's absorbed products at 32 heads: the key up-projection (nope 128 -> latent
    # 512, into a slice of the query) and the value one (latent 512 -> v 128, a transposed
    # weight view, from the float32 combine output), against cuBLAS's batched GEMMs.
    g = torch.Generator(device="cuda").manual_seed(3)
    dtype = torch.bfloat16

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32)

    q = draw(rows, 32, 192).to(dtype)
    w_uk = (draw(32, 128, 512) / 12).to(dtype)
    query = torch.zeros(rows, 32, 576, dtype=dtype, device="cuda")
    fused.head_matmul(q[..., :128], w_uk, out=query[..., :512])
    ref = torch.matmul(q[..., :128].transpose(0, 1), w_uk).transpose(0, 1)
    diff = (query[..., :512].float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2.0**-7 + 1e-3).all())
    assert bool((query[..., 512:] == 0).all())
    latent_out = draw(rows, 32, 512)
    w_uv = (draw(32, 128, 512) / 22).to(dtype)
    out = fused.head_matmul(latent_out, w_uv.transpose(1, 2))
    ref = torch.einsum("thl,hvl->thv", latent_out.to(dtype), w_uv)
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2.0**-7 + 1e-3).all())
