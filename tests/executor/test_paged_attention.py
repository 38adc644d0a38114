"""The Triton decode fast path against the readable reference (CPU: Triton's interpreter).

Without a GPU these run the kernels in Triton's CPU interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1``), in float64 and float32; on a GPU machine they run the compiled kernels
on CUDA tensors (float32, and bf16 against float64 at a looser tolerance).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import helix_kv
from helix_kv.executor.attention import PAD_KEY_POSITION, PartialAttention, partial_attention
from helix_kv.executor.decode_step import (
    DecodeLayout,
    DecodeMetadata,
    DecodeStep,
    StagingBufferBusy,
    default_buckets,
)
from helix_kv.executor.model import TinyConfig, TinyTransformer
from helix_kv.executor.paged_attention import (
    DECODE_FULL_PROGRAMS,
    DECODE_MAX_SPLITS,
    DECODE_MIN_SPLIT_KEYS,
    DECODE_TARGET_PROGRAMS,
    DecodeAttentionPlan,
    DecodeWorkspace,
    decode_splits,
    interpreted,
    paged_decode_attention,
    write_paged_kv,
)
from helix_kv.executor.placement import RankPlacement
from helix_kv.executor.runner import ExecutorConfig, run_group, run_rank
from helix_kv.executor.step_plan import StepPlan

pytest.importorskip("triton", reason="the paged kernels need triton")
if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
    DTYPES = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
elif interpreted():
    DEVICE = torch.device("cpu")
    DTYPES = {torch.float64: 1e-12, torch.float32: 1e-5}
else:  # a CPU-only process that imported triton before conftest could switch the interpreter on
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

needs_scheduler = pytest.mark.skipif(
    not hasattr(helix_kv, "Scheduler"), reason="helix_kv.Scheduler binding not built yet"
)


def paged_problem(
    seed: int,
    local_lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    tpb: int,
    dtype: torch.dtype,
) -> dict:
    """Random caches, a scattered block table (padding -1 past each request's pages)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // tpb) for n in local_lens))
    pages = width * len(local_lens) + 3
    table = torch.randperm(pages, generator=gen)[: width * len(local_lens)].view(-1, width)
    for row, n in enumerate(local_lens):
        table[row, -(-n // tpb) :] = -1
    shape = (pages * tpb, kv_heads, head_dim)
    return {
        "query": torch.randn(len(local_lens), kv_heads * group, head_dim, generator=gen),
        "key_cache": torch.randn(shape, generator=gen, dtype=torch.float64),
        "value_cache": torch.randn(shape, generator=gen, dtype=torch.float64),
        "block_table": table,
        "local_lens": torch.tensor(local_lens),
        "tpb": tpb,
        "dtype": dtype,
    }


def reference_partial(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable path in float64: gather whole pages, dense masked attention."""
    table, lens, tpb = p["block_table"], p["local_lens"], p["tpb"]
    slots = (table.clamp(min=0)[:, :, None] * tpb + torch.arange(tpb)).view(len(lens), -1)
    local = torch.arange(slots.shape[1]).expand(len(lens), -1)
    key_positions = torch.where(local < lens[:, None], local, PAD_KEY_POSITION)
    query_positions = torch.full((len(lens), 1), 1 << 40)
    cast = p["dtype"]  # the inputs the kernel sees, rounded to its dtype
    part = partial_attention(
        p["query"].to(cast).double()[:, None],
        p["key_cache"].to(cast).double()[slots],
        p["value_cache"].to(cast).double()[slots],
        query_positions,
        key_positions,
    )
    return part.output[:, 0], part.lse[:, 0]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    ("local_lens", "kv_heads", "group", "head_dim", "tpb"),
    [
        ([1, 7, 33, 12], 2, 2, 16, 4),  # several pages, partial pages
        ([0, 5, 0, 64], 1, 3, 24, 8),  # empty shards; group and head_dim not powers of two
        ([70, 31, 32, 33], 4, 1, 8, 32),  # blocks of keys spanning page boundaries
        ([3], 2, 4, 16, 3),  # odd tokens per block
    ],
)
def test_kernel_matches_reference(dtype, local_lens, kv_heads, group, head_dim, tpb):
    p = paged_problem(1, local_lens, kv_heads, group, head_dim, tpb, dtype)
    expected_out, expected_lse = reference_partial(p)
    part = paged_decode_attention(
        p["query"].to(DEVICE, dtype),
        p["key_cache"].to(DEVICE, dtype),
        p["value_cache"].to(DEVICE, dtype),
        p["block_table"].to(DEVICE, torch.int32),
        p["local_lens"].to(DEVICE),
        tpb,
    )
    atol = DTYPES[dtype]
    empty = torch.tensor(local_lens) == 0
    assert torch.equal(
        part.lse.cpu()[empty].isneginf(), torch.ones_like(part.lse.cpu()[empty], dtype=torch.bool)
    )
    assert not part.output.cpu()[empty].any()
    torch.testing.assert_close(part.output.cpu().double(), expected_out, atol=atol, rtol=0)
    torch.testing.assert_close(part.lse.cpu().double(), expected_lse, atol=atol, rtol=0)


def run_kernel(p: dict, **options: object) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = p["dtype"]
    part = paged_decode_attention(
        p["query"].to(DEVICE, dtype),
        p["key_cache"].to(DEVICE, dtype),
        p["value_cache"].to(DEVICE, dtype),
        p["block_table"].to(DEVICE, torch.int32),
        p["local_lens"].to(DEVICE),
        p["tpb"],
        **options,  # type: ignore[arg-type]
    )
    return part.output.cpu().double(), part.lse.cpu().double()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    ("local_lens", "kv_heads", "group", "head_dim", "tpb", "splits"),
    [
        ([1, 7, 33, 12], 2, 2, 16, 4, 2),  # short requests: their later splits are empty
        ([0, 5, 0, 64], 1, 3, 24, 8, 3),  # empty rows; odd group and head_dim
        ([70, 31, 32, 33], 4, 1, 8, 32, 3),  # a split per page, blocks spanning pages
        ([45, 3], 2, 4, 16, 3, 5),  # odd page size, splits ending mid-block
        ([40, 17], 1, 2, 16, 4, 10),  # one page per split (the width: 10 pages)
        ([40, 17], 1, 2, 16, 4, 64),  # more splits asked than pages: capped at the width
    ],
)
def test_split_kernel_matches_reference(dtype, local_lens, kv_heads, group, head_dim, tpb, splits):
    """Split-K (partials in scratch, then the LSE combine kernel) against the dense path."""
    p = paged_problem(4, local_lens, kv_heads, group, head_dim, tpb, dtype)
    expected_out, expected_lse = reference_partial(p)
    out, lse = run_kernel(p, num_splits=splits)
    empty = torch.tensor(local_lens) == 0
    assert lse[empty].isneginf().all()
    assert not out[empty].any()
    torch.testing.assert_close(out, expected_out, atol=DTYPES[dtype], rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=DTYPES[dtype], rtol=0)
    one_out, one_lse = run_kernel(p, num_splits=1)
    torch.testing.assert_close(out, one_out, atol=DTYPES[dtype], rtol=0)
    torch.testing.assert_close(lse, one_lse, atol=DTYPES[dtype], rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
def test_output_dtype_is_the_accumulation_output_rounded_once(splits):
    """``out_dtype``: the output stored in that dtype (one rounding of the accumulation-dtype
    result, as a cast of it), the LSE still in the accumulation dtype."""
    dtype = next(iter(DTYPES))  # float64 on the CPU, float32 on a GPU
    narrow = torch.float32 if dtype == torch.float64 else torch.bfloat16
    p = paged_problem(9, [40, 0, 17, 33], 2, 2, 16, 4, dtype)
    args = [p[k].to(DEVICE, dtype) for k in ("query", "key_cache", "value_cache")]
    table, lens = p["block_table"].to(DEVICE, torch.int32), p["local_lens"].to(DEVICE)
    wide = paged_decode_attention(*args, table, lens, 4, num_splits=splits)
    part = paged_decode_attention(*args, table, lens, 4, num_splits=splits, out_dtype=narrow)
    assert part.output.dtype == narrow
    assert part.lse.dtype == wide.lse.dtype
    assert torch.equal(part.output, wide.output.to(narrow))
    assert torch.equal(part.lse, wide.lse)


def test_split_kernel_overwrites_reused_scratch():
    """A workspace larger than the call and full of NaN, used twice: every split the combine
    reads is written by this call (empty splits too: LSE -inf, output 0), nothing past it."""
    dtype = next(iter(DTYPES))
    workspace = DecodeWorkspace.allocate(6, 4, 16, 8, dtype, DEVICE)
    workspace.output_scratch.fill_(float("nan"))
    workspace.lse_scratch.fill_(float("nan"))
    for seed, lens in ((5, [0, 13, 2]), (6, [16, 0, 1])):
        p = paged_problem(seed, lens, 2, 2, 16, 4, dtype)  # width 4 pages: 4 splits of one
        expected_out, expected_lse = reference_partial(p)
        out, lse = run_kernel(p, num_splits=4, workspace=workspace)
        torch.testing.assert_close(out, expected_out, atol=DTYPES[dtype], rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=DTYPES[dtype], rtol=0)
        part_out, part_lse = (t.cpu() for t in workspace.views(len(lens), 4))
        # split s of a request holds keys [4 s, 4 s + 4): empty past its length
        lens_t = torch.tensor(lens)
        empty = (torch.arange(4)[None, :] * 4 >= lens_t[:, None])[:, None, :].expand_as(part_lse)
        assert part_lse[empty].isneginf().all()
        assert part_lse[~empty].isfinite().all()
        assert not part_out[empty].any()
    used = 3 * 4  # (request, split) pairs
    assert workspace.lse_scratch[used * 4 :].isnan().all()  # nothing past the call's pairs
    assert workspace.output_scratch[used * 4 * 16 :].isnan().all()


def test_split_workspace_must_fit():
    dtype = next(iter(DTYPES))
    p = paged_problem(7, [9, 4], 2, 2, 16, 4, dtype)
    small = DecodeWorkspace.allocate(2, 4, 16, 2, dtype, DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        run_kernel(p, num_splits=3, workspace=small)
    with pytest.raises(ValueError, match="at least 1"):
        run_kernel(p, num_splits=0)
    with pytest.raises(ValueError, match="positive"):
        DecodeWorkspace.allocate(0, 4, 16, 2, dtype, DEVICE)
    assert small.fits(2, 4, 16, 2, dtype)
    assert small.fits(4, 4, 16, 1, dtype)  # the same pairs: more rows, fewer splits
    assert not small.fits(3, 4, 16, 2, dtype)
    assert not small.fits(1, 8, 16, 1, dtype)
    assert not small.fits(1, 4, 8, 1, dtype)
    other = torch.float32 if dtype == torch.float64 else torch.float64
    assert not small.fits(1, 4, 16, 1, other)


def test_workspace_for_decode_fits_every_bucket():
    """Sized once for an executor, it serves every default call up to its max rows."""
    from helix_kv.executor.paged_attention import _resolve_splits

    dtype = next(iter(DTYPES))
    for kv_heads, width, tpb in ((4, 66, 32), (1, 512, 32), (2, 3, 16)):
        workspace = DecodeWorkspace.for_decode(
            64, 4 * kv_heads, kv_heads, 8, width, tpb, dtype, "cpu"
        )
        needed = [
            rows * _resolve_splits(rows, kv_heads, width, tpb, None)[0] for rows in range(1, 65)
        ]
        assert workspace.row_splits == max(needed)
        for rows in range(1, 65):
            splits = _resolve_splits(rows, kv_heads, width, tpb, None)[0]
            assert workspace.fits(rows, 4 * kv_heads, 8, splits, dtype)


def test_split_rule():
    """Deterministic, from static sizes: one split once the grid is full or the table short;
    otherwise enough to reach the target, of whole pages, none wholly past the width."""
    assert decode_splits(256, 4, 66, 32) == 1  # 1024 programs: full already
    assert decode_splits(DECODE_TARGET_PROGRAMS, 1, 1000, 32) == 1
    assert decode_splits(DECODE_FULL_PROGRAMS, 1, 1000, 32) == 1  # about every SM's fill
    assert decode_splits(64, 8, 18, 32) == 1  # 512 programs
    assert decode_splits(DECODE_FULL_PROGRAMS - 1, 1, 1000, 32) == 2  # up to the target
    assert decode_splits(1, 1, 1, 4096) == 1  # one page: nothing to split
    assert decode_splits(8, 2, 64, 4) == 1  # 256 keys: shorter than two minimum splits
    by_length = -(-(66 * 32) // DECODE_MIN_SPLIT_KEYS)
    assert decode_splits(64, 4, 66, 32) == min(by_length, -(-DECODE_TARGET_PROGRAMS // 256))
    assert decode_splits(1, 1, 100_000, 32) == DECODE_MAX_SPLITS
    assert decode_splits(1, 1, 100_000, 32, max_splits=4) == 4
    for requests in (1, 3, 16, 64):
        for width in (2, 5, 10, 33, 130):
            splits = decode_splits(requests, 4, width, 32)
            per = -(-width // splits)
            assert 1 <= splits <= width
            assert (splits - 1) * per < width <= splits * per  # whole pages, none empty
            assert decode_splits(requests, 4, width, 32) == splits


def test_split_count_from_environment(monkeypatch):
    from helix_kv.executor import paged_attention

    try:
        for raw, expected in (("auto", None), ("", None), ("off", 1), ("3", 3)):
            monkeypatch.setenv("HELIX_KV_DECODE_SPLITS", raw)
            paged_attention._splits_override.cache_clear()
            assert paged_attention._splits_override() == expected
        monkeypatch.setenv("HELIX_KV_DECODE_SPLITS", "0")
        paged_attention._splits_override.cache_clear()
        with pytest.raises(ValueError, match="HELIX_KV_DECODE_SPLITS"):
            paged_attention._splits_override()
    finally:
        monkeypatch.undo()
        paged_attention._splits_override.cache_clear()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="allocation counts need a CUDA device")
def test_split_kernel_with_workspace_allocates_only_its_results():
    p = paged_problem(8, [300, 17, 0, 256], 2, 4, 64, 16, torch.float32)
    args = [p[k].to(DEVICE, torch.float32) for k in ("query", "key_cache", "value_cache")]
    table, lens = p["block_table"].to(DEVICE, torch.int32), p["local_lens"].to(DEVICE)
    workspace = DecodeWorkspace.allocate(4, 8, 64, 8, torch.float32, DEVICE)
    workspace.lse_scratch.fill_(float("nan"))
    paged_decode_attention(*args, table, lens, 16, num_splits=8, workspace=workspace)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    paged_decode_attention(*args, table, lens, 16, num_splits=8, workspace=workspace)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == 2  # output, lse


def test_kernel_reads_strided_metadata_columns():
    """The fast path hands the kernel columns of one packed int32 buffer (row stride > 1)."""
    dtype = next(iter(DTYPES))
    p = paged_problem(2, [9, 4, 17], 2, 2, 16, 4, dtype)
    packed = torch.zeros(3, 1 + p["block_table"].shape[1], dtype=torch.int32)
    packed[:, 0] = p["local_lens"]
    packed[:, 1:] = p["block_table"]
    packed = packed.to(DEVICE)
    args = [p["query"].to(DEVICE, dtype)] + [
        p[k].to(DEVICE, dtype) for k in ("key_cache", "value_cache")
    ]
    strided = paged_decode_attention(*args, packed[:, 1:], packed[:, 0], 4)
    dense = paged_decode_attention(
        *args, p["block_table"].to(DEVICE), p["local_lens"].to(DEVICE), 4
    )
    assert torch.equal(strided.output, dense.output)
    assert torch.equal(strided.lse, dense.lse)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_plan_made_once_runs_every_layer_as_one_call_does(monkeypatch, splits):
    """Planned once for the step's metadata (the split count resolved once), run per layer
    with only that layer's query and caches: each run equals the one-call form."""
    from helix_kv.executor import paged_attention

    dtype = next(iter(DTYPES))
    layers = [paged_problem(20 + layer, [40, 0, 17, 33], 2, 2, 16, 4, dtype) for layer in (0, 1)]
    table = layers[0]["block_table"].to(DEVICE, torch.int32)  # every layer's: the same rows
    lens = layers[0]["local_lens"].to(DEVICE)
    resolved = []
    resolve = paged_attention._resolve_splits
    monkeypatch.setattr(
        paged_attention,
        "_resolve_splits",
        lambda *args, **kw: resolved.append(args) or resolve(*args, **kw),
    )
    plan = DecodeAttentionPlan(
        table, lens, 4, q_heads=4, kv_heads=2, head_dim=16, dtype=dtype, num_splits=splits
    )
    assert len(resolved) == 1
    for p in layers:
        args = [p[k].to(DEVICE, dtype) for k in ("query", "key_cache", "value_cache")]
        part = plan.run(*args)
        one_call = paged_decode_attention(*args, table, lens, 4, num_splits=splits)
        assert torch.equal(part.output, one_call.output)
        assert torch.equal(part.lse, one_call.lse)
    assert len(resolved) == 1 + len(layers)  # the one-call forms' plans only


def test_a_plan_refuses_a_layer_it_was_not_made_for():
    dtype = next(iter(DTYPES))
    p = paged_problem(3, [9, 4], 2, 2, 16, 4, dtype)
    table, lens = p["block_table"].to(DEVICE, torch.int32), p["local_lens"].to(DEVICE)
    query, key, value = (p[k].to(DEVICE, dtype) for k in ("query", "key_cache", "value_cache"))
    plan = DecodeAttentionPlan(table, lens, 4, q_heads=4, kv_heads=2, head_dim=16, dtype=dtype)
    plan.run(query, key, value)
    with pytest.raises(ValueError, match=r"query \(1, 4, 16\) must be \[2, 4, 16\]"):
        plan.run(query[:1], key, value)
    with pytest.raises(ValueError, match=r"key_cache .* must be \[\*, 2, 16\]"):
        plan.run(query, key[:, :1], value)
    with pytest.raises(ValueError, match="contiguous last dim"):
        plan.run(query, key, torch.cat([value, value], dim=-1)[..., ::2])
    other = torch.float32 if dtype == torch.float64 else torch.bfloat16
    with pytest.raises(ValueError, match="the plan's of"):
        plan.run(query.to(other), key, value)
    with pytest.raises(ValueError, match="multiple"):
        DecodeAttentionPlan(table, lens, 4, q_heads=3, kv_heads=2, head_dim=16, dtype=dtype)
    with pytest.raises(ValueError, match="do not cover the same rows"):
        DecodeAttentionPlan(table, lens[:1], 4, q_heads=4, kv_heads=2, head_dim=16, dtype=dtype)


def test_the_model_plans_once_a_step_and_runs_the_plan_per_layer(monkeypatch):
    """forward_decode and forward (with the kernel) plan the step's attention once, before
    the layers, and run it in each."""
    from helix_kv.executor import model as model_module

    made, runs = [], []

    class Counted(DecodeAttentionPlan):
        def __init__(self, *args: object, **kwargs: object) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

        def run(self, *args: torch.Tensor) -> PartialAttention:
            runs.append(1)
            return super().run(*args)

    monkeypatch.setattr(model_module, "DecodeAttentionPlan", Counted)
    model, pool, decode = prefilled()
    model.decode_kernel = True
    model.forward(pool.prepare(decode), pool)
    assert (len(made), len(runs)) == (1, MODEL.num_layers)
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    rows = metadata.fill(*decode_columns(decode))
    model.forward_decode(metadata.rows(metadata.upload(rows)), pool, lambda part: part)
    assert (len(made), len(runs)) == (2, 2 * MODEL.num_layers)


def test_write_stores_owned_tokens_only():
    dtype = next(iter(DTYPES))
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(5, 2, 8, generator=gen).to(DEVICE, dtype)
    value = torch.randn(5, 2, 8, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([3, -1, 0, 7, -1], device=DEVICE, dtype=torch.int32)
    key_cache = torch.zeros(8, 2, 8, device=DEVICE, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    write_paged_kv(key, value, slots, key_cache, value_cache)
    expected_k, expected_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    owned = slots >= 0
    expected_k[slots[owned].long()] = key[owned]
    expected_v[slots[owned].long()] = value[owned]
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_default_buckets():
    assert default_buckets(1) == (1,)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_buckets(48) == (1, 2, 4, 8, 16, 32, 48)


def test_metadata_pads_rows_up_to_the_bucket():
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=3), DEVICE)
    rows = metadata.fill(
        [5, 6, 7], [10, 11, 12], [1, -1, 9], [3, 4, 5], [2, 4, 4], [[0, 1], [2, -1], [4, 5]]
    )
    assert rows == 3
    assert metadata.upload(rows) == 4
    on_device = metadata.device_buffer[:4].cpu().numpy()
    lay = metadata.layout
    fixed = [lay.TOKEN_ID, lay.POSITION, lay.SLOT, lay.LOCAL_LEN, lay.PAST_SEEN_LEN]
    assert on_device[:3, fixed].tolist() == [
        [5, 10, 1, 3, 2],
        [6, 11, -1, 4, 4],
        [7, 12, 9, 5, 4],
    ]
    assert on_device[:3, lay.INPUT_REF].tolist() == [-1, -1, -1]  # nothing in flight
    assert on_device[3, : lay.BLOCK_TABLE].tolist() == list(lay.padding_row)
    table = on_device[:3, lay.BLOCK_TABLE :]
    assert table.tolist() == [[0, 1, -1], [2, -1, -1], [4, 5, -1]]
    with pytest.raises(ValueError, match="do not fit"):
        metadata.fill([0] * 9, [0] * 9, [0] * 9, [0] * 9, [0] * 9, np.zeros((9, 1)))
    with pytest.raises(ValueError, match="do not fit"):
        metadata.fill([0], [0], [0], [0], [0], np.zeros((1, 4)))


MODEL = TinyConfig(num_layers=2, seed=7)
TPB = 4


def model_dtype() -> torch.dtype:
    return torch.float64 if DEVICE.type == "cpu" else torch.float32


def prefilled(cp_rank: int = 0, cp: int = 1) -> tuple[TinyTransformer, object, StepPlan]:
    """A model and a pool holding three prompts, plus the plan of their next decode token."""
    model = TinyTransformer(MODEL, dtype=model_dtype(), device=DEVICE)
    placement = RankPlacement(cp, TPB, cp_rank)
    pool = model.new_kv_pool(placement, capacity_superblocks=16)
    rng = np.random.default_rng(0)
    lengths = [9, 4, 14]
    table = np.array([[0, 1, 2, 3], [4, 5, -1, -1], [6, 7, 8, 9]])
    prompts = [rng.integers(0, MODEL.vocab_size, size=n) for n in lengths]
    prefill = StepPlan.from_arrays(placement, [0, 1, 2], [0, 0, 0], prompts, table)
    model.forward(pool.prepare(prefill), pool)
    decode = StepPlan.from_arrays(
        placement, [0, 1, 2], lengths, [[1], [2], [3]], table, num_generation=3
    )
    return model, pool, decode


def test_model_decode_kernel_matches_reference_forward():
    model, pool, decode = prefilled()
    reference = model.logits(model.forward(pool.prepare(decode), pool))
    model.decode_kernel = True
    kernel = model.logits(model.forward(pool.prepare(decode), pool))
    torch.testing.assert_close(kernel, reference, atol=DTYPES[model_dtype()] * 10, rtol=0)


def test_decode_step_with_padding_rows_matches_reference_forward():
    model, pool, decode = prefilled()
    reference = model.logits(model.forward(pool.prepare(decode), pool))
    model2, pool2, _ = prefilled()
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    rows = metadata.fill(
        decode.token_ids,
        decode.positions(),
        decode.slot_mapping,
        decode.local_lens,
        decode.past_seen_lens,
        decode.block_table,
    )
    step = DecodeStep(model2, pool2, lambda part: part, metadata)
    bucket = metadata.upload(rows)
    assert bucket == 4  # one padding row, which must write no KV
    step.run(bucket)
    torch.testing.assert_close(
        step.logits[:rows], reference, atol=DTYPES[model_dtype()] * 10, rtol=0
    )
    assert torch.equal(step.tokens[:rows], reference.argmax(-1))
    # same KV where the reference wrote (layer 1 to rounding), none where it did not
    for fast, ref in ((pool2.key_cache, pool.key_cache), (pool2.value_cache, pool.value_cache)):
        torch.testing.assert_close(fast, ref, atol=DTYPES[model_dtype()] * 10, rtol=0)
        assert torch.equal(fast == 0, ref == 0)


def executor_config(cp: int, kv_tokens: int, **options: object) -> ExecutorConfig:
    return ExecutorConfig(
        cp_size=cp,
        tokens_per_block=TPB,
        kv_superblocks=kv_tokens // (TPB * cp),
        max_batch_size=8,
        max_num_tokens=24,
        model=MODEL,
        device=DEVICE.type,
        dtype="float64" if DEVICE.type == "cpu" else "float32",
        **options,  # type: ignore[arg-type]
    )


def e2e_prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(2024)
    return {
        100 + i: rng.integers(0, MODEL.vocab_size, size=n).tolist()
        for i, n in enumerate([27, 9, 30, 5])
    }


@needs_scheduler
@pytest.mark.parametrize("cp", [1, 2])
def test_fast_path_greedy_tokens_equal_reference_path(cp):
    """Roomy and tight (recompute-pausing) pools: every decode-only step on the fast path,
    the other steps on the general path with the kernel for their decode entries."""
    if cp > 1 and DEVICE.type == "cuda" and torch.cuda.device_count() < cp:
        pytest.skip("needs 2 GPUs")
    jobs = []
    for kv_tokens in (1024, 48):
        for fast in (False, True):
            jobs.append((e2e_prompts(), 8, executor_config(cp, kv_tokens, decode_kernel=fast)))
    if cp == 1:
        results = [run_rank(*job) for job in jobs]
    else:
        backend = "nccl" if DEVICE.type == "cuda" else "gloo"
        results = [ranks[0] for ranks in run_group(jobs, cp, backend=backend, timeout_s=240)]
    roomy_ref, roomy_fast, tight_ref, tight_fast = results
    assert roomy_fast.outputs == roomy_ref.outputs
    assert tight_fast.outputs == tight_ref.outputs
    assert tight_fast.preemptions >= 1
    assert roomy_ref.fast_path_steps == 0
    assert roomy_fast.fast_path_steps == roomy_fast.decode_steps > 0
    assert tight_fast.fast_path_steps > 0


@needs_scheduler
@pytest.mark.parametrize("cp", [1, 2])
def test_fast_path_one_step_ahead_equals_reference_path(cp, monkeypatch):
    """Overlap mode on the fast path: decode-only steps scheduled one step ahead run there,
    their inputs in flight gathered on the device from the previous step's samples (a fast
    step's own buffer, or a general step's tokens copied in); the greedy tokens equal the
    plain reference path's, roomy and tight (recompute-pausing) pools."""
    if cp > 1 and DEVICE.type == "cuda" and torch.cuda.device_count() < cp:
        pytest.skip("needs 2 GPUs")
    taken = []
    original = DecodeStep.take_previous

    def counting(self, tokens):
        taken.append(int(tokens.shape[0]))
        original(self, tokens)

    monkeypatch.setattr(DecodeStep, "take_previous", counting)
    jobs = []
    for kv_tokens in (1024, 48):
        jobs.append((e2e_prompts(), 8, executor_config(cp, kv_tokens)))
        jobs.append(
            (e2e_prompts(), 8, executor_config(cp, kv_tokens, decode_kernel=True, overlap=True))
        )
    if cp == 1:
        results = [run_rank(*job) for job in jobs]
    else:
        backend = "nccl" if DEVICE.type == "cuda" else "gloo"
        results = [ranks[0] for ranks in run_group(jobs, cp, backend=backend, timeout_s=240)]
    roomy_ref, roomy_fast, tight_ref, tight_fast = results
    assert roomy_fast.outputs == roomy_ref.outputs
    assert tight_fast.outputs == tight_ref.outputs
    assert tight_fast.preemptions >= 1
    assert roomy_fast.fast_path_steps == roomy_fast.decode_steps > 0
    assert tight_fast.fast_path_steps > 0
    # One step ahead the fast path gathered inputs in flight.
    assert roomy_fast.fast_path_inputs_in_flight > 0
    assert tight_fast.fast_path_inputs_in_flight > 0
    if cp == 1:  # the spawned ranks do not see this process's patch
        assert taken, "no fast step followed a general step with inputs in flight"


def test_decode_step_gathers_inputs_in_flight_from_the_previous_samples():
    """A row with ``input_ref r >= 0`` runs on token ``r`` of :attr:`DecodeStep.tokens`,
    whatever its ``token_id`` column holds; a row with -1 runs on its own token."""
    model, pool, decode = prefilled()
    reference = model.logits(model.forward(pool.prepare(decode), pool))
    model2, pool2, _ = prefilled()
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    step = DecodeStep(model2, pool2, lambda part: part, metadata)
    # The previous step's samples: the decode tokens in another order (rows 2, 0, 1).
    step.take_previous(torch.as_tensor(decode.token_ids[[1, 2, 0]], device=DEVICE))
    rows = metadata.fill(
        [-1, decode.token_ids[1], -1],  # rows 0 and 2 in flight
        decode.positions(),
        decode.slot_mapping,
        decode.local_lens,
        decode.past_seen_lens,
        decode.block_table,
        input_refs=[2, -1, 1],
    )
    step.run(metadata.upload(rows))
    torch.testing.assert_close(
        step.logits[:rows], reference, atol=DTYPES[model_dtype()] * 10, rtol=0
    )
    assert step.start_readback(rows).wait().tolist() == reference.argmax(-1).tolist()
    with pytest.raises(ValueError, match="exceed"):
        step.take_previous(torch.zeros(9, dtype=torch.int64, device=DEVICE))


@needs_scheduler
def test_fill_from_schedule_is_one_core_call_with_padding_and_refs():
    """The staging rows of a step equal the core's rows; a refused step leaves the current
    staging buffer and its rows as they were."""
    import helix_kv

    cfg = helix_kv.SchedulerConfig(
        cp_size=1, tokens_per_block=TPB, kv_superblocks=32, max_batch_size=8, max_num_tokens=64
    )
    s = helix_kv.Scheduler(cfg)
    for i in range(3):
        s.add_request(i, np.arange(1, 10, dtype=np.int32), 6)
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    prefill = s.schedule()
    with pytest.raises(helix_kv.InvalidArgumentError, match="context chunks"):
        metadata.fill_from_schedule(s, prefill)
    before = metadata.host.clone()
    decode = s.schedule()  # one step ahead: every input in flight
    s.update(np.full(prefill.num_samples, 5, dtype=np.int32))
    counts = metadata.fill_from_schedule(s, decode)
    assert (counts.rows, counts.padded_to, counts.in_flight) == (3, 4, 3)
    host = metadata.host.numpy()
    lay = metadata.layout
    assert host[:3, lay.INPUT_REF].tolist() == decode.generation_input_refs.tolist()
    assert host[:3, lay.TOKEN_ID].tolist() == [-1, -1, -1]
    assert host[3, : lay.BLOCK_TABLE].tolist() == list(lay.padding_row)
    expected = np.full((4, lay.width), -99, dtype=np.int32)
    s.write_decode_rows(decode, expected, 4)
    np.testing.assert_array_equal(host[:3], expected[:3])
    assert torch.equal(metadata._staging[0], before)  # the other buffer: untouched
    assert metadata.upload(counts.rows) == 4


@needs_scheduler
def test_fill_if_fits_gives_up_only_on_the_layout_and_raises_the_rest():
    """``None`` (nothing written, the general path) for a step with more rows or a request
    with more pages than the layout holds; any other error of the fill propagates (it was
    once hidden with the layout's: an error of ``write_decode_rows`` of any kind)."""
    import helix_kv

    def decoding_scheduler() -> tuple[helix_kv.Scheduler, helix_kv.ScheduleOutput]:
        cfg = helix_kv.SchedulerConfig(
            cp_size=1, tokens_per_block=TPB, kv_superblocks=32, max_batch_size=8
        )
        s = helix_kv.Scheduler(cfg)
        for i in range(3):
            s.add_request(i, np.arange(1, 10, dtype=np.int32), 6)  # 9 tokens: 3 pages of 4
        s.update(np.full(s.schedule().num_samples, 5, dtype=np.int32))
        return s, s.schedule()

    s, decode = decoding_scheduler()
    fits = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    counts = fits.fill_if_fits(s, decode)
    assert counts is not None
    assert counts.rows == 3
    for layout in (DecodeLayout(max_batch=2, max_pages=4), DecodeLayout(max_batch=8, max_pages=2)):
        narrow = DecodeMetadata(layout, DEVICE)
        before = [buffer.clone() for buffer in narrow._staging]
        assert narrow.fill_if_fits(s, decode) is None
        assert all(torch.equal(b, a) for b, a in zip(before, narrow._staging))
    other, _ = decoding_scheduler()
    other.update(np.full(decode.num_samples, 7, dtype=np.int32))  # its step, not `decode`
    with pytest.raises(helix_kv.InvalidStateError, match="no step is pending"):
        fits.fill_if_fits(other, decode)  # not this scheduler's pending step


def decode_columns(decode: StepPlan) -> tuple:
    return (
        decode.token_ids,
        decode.positions(),
        decode.slot_mapping,
        decode.local_lens,
        decode.past_seen_lens,
        decode.block_table,
    )


def test_a_fill_never_overwrites_a_staging_buffer_a_launched_copy_may_read():
    """Graphed steps record no event: a staging buffer read by a launched step's copy is
    written again only after that step is released (its readback waited); a fill that would
    overwrite it raises and changes nothing."""
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=3), "cpu")
    row = ([5], [10], [1], [3], [2], [[0, 1]])
    metadata.fill(*row)
    assert metadata.launched() == 0  # step 0 reads buffer 1
    metadata.fill(*row)
    assert metadata.launched() == 1  # step 1 reads buffer 0
    current, before = metadata.current, metadata.host.clone()
    with pytest.raises(StagingBufferBusy, match="launched step 0"):
        metadata.fill([7], [11], [2], [4], [3], [[2, -1]])
    assert metadata.current == current  # nothing turned, nothing written
    assert metadata._staging[current ^ 1][0, metadata.layout.TOKEN_ID] == 5  # step 0's row
    assert torch.equal(metadata.host, before)
    metadata.release(0)
    metadata.fill([7], [11], [2], [4], [3], [[2, -1]])  # step 0 finished: its buffer is free
    assert metadata.host[0, metadata.layout.TOKEN_ID] == 7
    metadata.launched()  # step 2
    with pytest.raises(StagingBufferBusy, match="launched step 1"):
        metadata.fill(*row)
    metadata.release_all()
    metadata.fill(*row)
    metadata.fill(*row)  # nothing launched since: both buffers free


def test_waiting_a_readback_releases_the_steps_staging_buffer():
    """The runner's rule, checked: step t's readback is waited before step t + 2 fills the
    buffer step t's copy read (one step ahead), and waiting it is what releases it."""
    model, pool, decode = prefilled()
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    step = DecodeStep(model, pool, lambda part: part, metadata)
    columns = decode_columns(decode)
    launched = []
    for _ in range(2):  # steps 0 and 1 in flight, as graphed steps leave them
        rows = metadata.fill(*columns)
        step.run(metadata.upload(rows))
        metadata.launched()
        launched.append(step.start_readback(rows))
    with pytest.raises(StagingBufferBusy):
        metadata.fill(*columns)
    first = launched[0].wait()  # close step 0
    rows = metadata.fill(*columns)  # step 2 reuses step 0's buffer
    assert launched[1].wait().tolist() == first.tolist()


def test_eager_launch_uploads_then_runs():
    model, pool, decode = prefilled()
    reference = model.logits(model.forward(pool.prepare(decode), pool))
    model2, pool2, _ = prefilled()
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    step = DecodeStep(model2, pool2, lambda part: part, metadata)
    rows = metadata.fill(*decode_columns(decode))
    assert step.launch(rows) == 4
    assert step.read_tokens(rows).tolist() == reference.argmax(-1).tolist()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_graphed_steps_with_the_copy_inside_equal_eager_steps():
    """Each graph copies its staging buffer's rows first: steps launched one after another
    (alternating buffers, nothing uploaded outside the graph) give the eager tokens."""
    model, pool, decode = prefilled()
    eager_model, eager_pool, _ = prefilled()
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    step = DecodeStep(model, pool, lambda part: part, metadata, cuda_graphs=True)
    eager_metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    eager = DecodeStep(eager_model, eager_pool, lambda part: part, eager_metadata)
    columns = decode_columns(decode)
    pending = []
    for index in range(4):
        # one step ahead: step index + 1 is launched before step index is read back
        rows = metadata.fill(*columns)
        assert step.launch(rows) == 4
        pending.append(step.start_readback(rows))
        if len(pending) == 2:
            graphed = pending.pop(0).wait()
            eager_rows = eager_metadata.fill(*columns)
            eager.launch(eager_rows)
            assert graphed.tolist() == eager.read_tokens(eager_rows).tolist(), index
    torch.testing.assert_close(step.logits[:3], eager.logits[:3])
    assert metadata.launches == 4


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_graphed_decode_steps_allocate_nothing():
    model, pool, decode = prefilled()
    metadata = DecodeMetadata(DecodeLayout(max_batch=8, max_pages=4), DEVICE)
    step = DecodeStep(model, pool, lambda part: part, metadata, cuda_graphs=True)
    assert step.graphed
    columns = decode_columns(decode)

    def one_step() -> np.ndarray:
        rows = metadata.fill(*columns)
        step.launch(rows)  # one replay: the copy of the rows is its first node
        return step.start_readback(rows).wait()

    first = one_step()
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]  # cumulative count
    for _ in range(5):
        assert np.array_equal(one_step(), first)  # the same step again: the same tokens
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations


@needs_scheduler
@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("overlap", [False, True])
def test_graphed_fast_path_equals_reference_path(overlap):
    jobs = []
    for kv_tokens in (1024, 48):
        jobs.append((e2e_prompts(), 8, executor_config(1, kv_tokens)))
        jobs.append(
            (
                e2e_prompts(),
                8,
                executor_config(
                    1, kv_tokens, cuda_graphs=True, decode_kernel=True, overlap=overlap
                ),
            )
        )
    roomy_ref, roomy_graphs, tight_ref, tight_graphs = [run_rank(*job) for job in jobs]
    assert roomy_graphs.outputs == roomy_ref.outputs
    assert tight_graphs.outputs == tight_ref.outputs
    assert roomy_graphs.fast_path_steps == roomy_graphs.decode_steps > 0


@needs_scheduler
def test_steps_wider_than_the_layout_take_the_general_path():
    """A request that outgrows ``max_pages_per_request`` sends its steps to the general path."""
    reference = run_rank(e2e_prompts(), 8, executor_config(1, 1024))
    narrow = run_rank(
        e2e_prompts(), 8, executor_config(1, 1024, decode_kernel=True, max_pages_per_request=9)
    )
    assert narrow.outputs == reference.outputs
    assert 0 < narrow.fast_path_steps < narrow.decode_steps
