"""The MLA (multi-head latent attention) paged decode kernel against the readable reference.

Without a GPU the kernels run in Triton's CPU interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1``), in float64 and float32 on tiny shapes; on a GPU machine they run
compiled on CUDA tensors (float64 without tensor-core dots, float32, bf16), and the
``cuda``-marked test runs DeepSeek-V3's sizes (latent 512 + RoPE 64) and a CUDA graph.

The reference gathers each row's keys by its block table and runs
:func:`~helix_kv.executor.attention.partial_attention` with one kv head: key = the cache rows
(latent and RoPE key), value = their latents.
"""

from __future__ import annotations

import math

import pytest
import torch

from helix_kv.executor import paged_attention
from helix_kv.executor import paged_mla_decode_attention as exported
from helix_kv.executor.attention import (
    PAD_KEY_POSITION,
    PAD_QUERY_POSITION,
    combine_partials,
    partial_attention,
    reference_attention,
)
from helix_kv.executor.paged_attention import (
    DECODE_FULL_PROGRAMS,
    DECODE_TARGET_PROGRAMS,
    MLA_TILINGS,
    DecodeWorkspace,
    MLADecodeAttentionPlan,
    MLATiling,
    _mla_block_heads,
    _mla_head_tiles,
    _mla_splits,
    decode_splits,
    interpreted,
    mla_tiling,
    paged_mla_decode_attention,
    parse_mla_tiling_table,
    write_paged_kv,
)

pytest.importorskip("triton", reason="the paged kernels need triton")
if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
    DTYPES = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}
elif interpreted():
    DEVICE = torch.device("cpu")
    DTYPES = {torch.float64: 1e-12, torch.float32: 1e-5}
else:  # a CPU-only process that imported triton before conftest could switch the interpreter on
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def mla_problem(
    seed: int,
    local_lens: list[int],
    heads: int,
    latent: int,
    rope: int,
    tpb: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict:
    """Random absorbed queries and latent cache, a scattered block table (-1 past the pages)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = max(1, max(-(-n // tpb) for n in local_lens))
    pages = width * len(local_lens) + 3
    table = torch.randperm(pages, generator=gen, device=device)[: width * len(local_lens)]
    table = table.view(-1, width)
    for row, n in enumerate(local_lens):
        table[row, -(-n // tpb) :] = -1
    dim = latent + rope
    return {
        "query": torch.randn(len(local_lens), heads, dim, generator=gen, device=device),
        "cache": torch.randn(pages * tpb, 1, dim, generator=gen, device=device).double(),
        "block_table": table,
        "local_lens": torch.tensor(local_lens, device=device),
        "tpb": tpb,
        "latent": latent,
        "scale": 1.0 / math.sqrt(dim),
        "dtype": dtype,
    }


def gather_keys(p: dict, table: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row's cache rows (float64, rounded to the kernel's dtype first) and positions."""
    tpb = p["tpb"]
    device = table.device
    slots = (table.clamp(min=0)[:, :, None] * tpb + torch.arange(tpb, device=device)).view(
        len(lens), -1
    )
    local = torch.arange(slots.shape[1], device=device).expand(len(lens), -1)
    key_positions = torch.where(local < lens[:, None], local, PAD_KEY_POSITION)
    keys = p["cache"].to(p["dtype"]).double()[slots]  # [rows, keys, 1, dim]
    return keys, key_positions


def reference_partial(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable path in float64: gathered pages, dense masked attention, one kv head."""
    table, lens = p["block_table"], p["local_lens"]
    keys, key_positions = gather_keys(p, table, lens)
    query_positions = torch.full((len(lens), 1), 1 << 40, device=table.device)
    part = partial_attention(
        p["query"].to(p["dtype"]).double()[:, None],
        keys,
        keys[..., : p["latent"]],
        query_positions,
        key_positions,
        scale=p["scale"],
    )
    return part.output[:, 0], part.lse[:, 0]


def run_kernel(p: dict, **options: object) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = p["dtype"]
    part = paged_mla_decode_attention(
        p["query"].to(DEVICE, dtype),
        p["cache"].to(DEVICE, dtype),
        p["block_table"].to(DEVICE, torch.int32),
        p["local_lens"].to(DEVICE),
        p["tpb"],
        p["latent"],
        p["scale"],
        **options,  # type: ignore[arg-type]
    )
    return part.output.cpu().double(), part.lse.cpu().double()


def use_tilings(monkeypatch, *entries: tuple[int, MLATiling]) -> None:
    """Make the kernel take these tilings (``(min_heads, tiling)``, as the table's entries),
    registered under their names for the test."""
    for _, tiling in entries:
        monkeypatch.setitem(paged_attention.MLA_TILINGS, tiling.name, tiling)
    table = tuple((heads, tiling.name) for heads, tiling in entries)
    monkeypatch.setattr(paged_attention, "MLA_TILING_TABLE", table)


#: The loops and blocks the interpreter checks: 16 and 32 keys a block (16: several blocks a
#: split, the online softmax rescaling across them), the loop that looks each block's slots
#: up in its own iteration and the one that looks them up a block ahead.
LOOPS = {
    "k16": MLATiling(32, 16, 4, 2, prefetch=False),
    "k16-pf": MLATiling(32, 16, 4, 3, prefetch=True),
    "k32-pf": MLATiling(32, 32, 4, 3, prefetch=True),
}

SHAPES = [
    # local_lens, heads, latent, rope, tokens per block
    ([1, 7, 33, 12], 4, 32, 16, 4),  # several pages, partial pages
    ([0, 5, 0, 64], 5, 24, 8, 8),  # empty rows; heads, latent and RoPE not powers of two
    ([70, 31], 21, 24, 8, 32),  # two head tiles (16 + 5 heads), blocks spanning pages
    ([3, 20], 1, 17, 3, 3),  # one head, odd page size and dims
]


@pytest.mark.parametrize("loop", [*LOOPS, None])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("local_lens", "heads", "latent", "rope", "tpb"), SHAPES)
def test_kernel_matches_reference(monkeypatch, dtype, local_lens, heads, latent, rope, tpb, loop):
    """One split, three splits in scratch allocated per call and in a workspace: all equal
    the dense path (and the empty rows give output 0, LSE -inf), with the default tiling and
    with the loops of :data:`LOOPS` (blocks of 16 keys: what a GPU's float64 path always
    takes; slots looked up a block ahead)."""
    if loop is not None:
        use_tilings(monkeypatch, (1, LOOPS[loop]))
    p = mla_problem(1, local_lens, heads, latent, rope, tpb, dtype)
    expected_out, expected_lse = reference_partial(p)
    atol = DTYPES[dtype]
    empty = torch.tensor(local_lens) == 0
    width = p["block_table"].shape[1]
    workspace = DecodeWorkspace.allocate(len(local_lens), heads, latent, 3, dtype, DEVICE)
    workspace.output_scratch.fill_(float("nan"))
    workspace.lse_scratch.fill_(float("nan"))
    results = [
        run_kernel(p, num_splits=1),
        run_kernel(p, num_splits=3),
        run_kernel(p, num_splits=3, workspace=workspace),
    ]
    for out, lse in results:
        assert out.shape == (len(local_lens), heads, latent)
        assert lse.shape == (len(local_lens), heads)
        assert lse[empty].isneginf().all()
        assert not out[empty].any()
        torch.testing.assert_close(out, expected_out, atol=atol, rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=atol, rtol=0)
    if width >= 3:  # three splits really ran: the scratch holds finite partials
        assert workspace.lse_scratch[: len(local_lens) * 3 * heads].isnan().sum() == 0


@pytest.mark.parametrize("loop", ["k16-pf", None])
def test_128_heads(monkeypatch, loop):
    """DeepSeek-V3's 128 heads on a Helix rank (four tiles of 32), ragged pages, an empty row:
    one split and two equal the dense path."""
    if loop is not None:
        use_tilings(monkeypatch, (1, LOOPS[loop]))
    dtype = next(iter(DTYPES))
    p = mla_problem(9, [37, 0, 50], 128, 16, 8, 8, dtype)
    expected_out, expected_lse = reference_partial(p)
    for splits in (1, 2):
        out, lse = run_kernel(p, num_splits=splits)
        assert lse[1].isneginf().all()
        assert not out[1].any()
        torch.testing.assert_close(out, expected_out, atol=DTYPES[dtype], rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=DTYPES[dtype], rtol=0)


def test_default_splits_and_exported():
    """The default split count (rows x head tiles as programs) gives the same result."""
    assert exported is paged_mla_decode_attention
    dtype = next(iter(DTYPES))
    p = mla_problem(2, [300, 17, 0], 3, 16, 16, 8, dtype)
    assert _mla_splits(3, 3, 16, True, p["block_table"].shape[1], 8, None)[0] > 1
    out, lse = run_kernel(p)
    expected_out, expected_lse = reference_partial(p)
    torch.testing.assert_close(out, expected_out, atol=DTYPES[dtype], rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=DTYPES[dtype], rtol=0)


def test_split_combine_in_latent_chunks(monkeypatch):
    """A combine tile smaller than splits x latent: the latent combined in chunks (3 of 16
    for a latent of 40), the same result."""
    from helix_kv.executor import paged_attention

    dtype = next(iter(DTYPES))
    p = mla_problem(8, [40, 0, 13], 3, 40, 8, 4, dtype)
    expected_out, expected_lse = reference_partial(p)
    monkeypatch.setattr(paged_attention, "MLA_COMBINE_ELEMENTS", 4 * 16)
    out, lse = run_kernel(p, num_splits=4)
    torch.testing.assert_close(out, expected_out, atol=DTYPES[dtype], rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=DTYPES[dtype], rtol=0)


@pytest.mark.parametrize("block_heads", [16, 32, 64])
def test_wider_head_tiles_give_the_same_result(monkeypatch, block_heads):
    """A tiling's ``block_heads``: every head of a row in fewer programs, the same result
    (one split and three)."""
    dtype = next(iter(DTYPES))
    p = mla_problem(3, [50, 0, 21], 40, 24, 8, 4, dtype)
    expected_out, expected_lse = reference_partial(p)
    use_tilings(monkeypatch, (1, MLATiling(block_heads, 16, 4, 3, prefetch=True)))
    assert _mla_head_tiles(40, 24, True) == -(-40 // block_heads)
    for splits in (1, 3):
        out, lse = run_kernel(p, num_splits=splits)
        torch.testing.assert_close(out, expected_out, atol=DTYPES[dtype], rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=DTYPES[dtype], rtol=0)


@pytest.mark.parametrize("wide", [True, False])
def test_table_picks_wide_tiles_by_head_count(monkeypatch, wide):
    """A table of 32-head tiles from one head and 64-head tiles from 64: a request of 70
    heads runs two tiles of 64 (the second of 6 heads and 58 masked), or, with the 32-head
    entry alone, three of 32; the same result, one split and the default rule's."""
    dtype = next(iter(DTYPES))
    p = mla_problem(4, [40, 9, 0], 70, 24, 8, 4, dtype)
    expected_out, expected_lse = reference_partial(p)
    narrow = (1, MLATiling(32, 16, 4, 2, prefetch=False))
    entries = [narrow, (64, MLATiling(64, 16, 8, 3, prefetch=True))] if wide else [narrow]
    use_tilings(monkeypatch, *entries)
    assert _mla_head_tiles(70, 24, True) == (2 if wide else 3)
    for splits in (1, None):
        out, lse = run_kernel(p, num_splits=splits)
        torch.testing.assert_close(out, expected_out, atol=DTYPES[dtype], rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=DTYPES[dtype], rtol=0)


def test_head_tiles(monkeypatch):
    """DeepSeek-V3's 512 latent: up to the tiling's heads a program, a request of fewer heads
    one tile of its heads padded to a power of two (at least the dot's 16); with a 64-head
    entry from 64 heads, a request of 64 heads or more in tiles of 64."""
    # (heads, latent, use_dot) -> heads a tile, with a table of 32-head tiles
    narrow = {
        (32, 512, True): 32,
        (20, 512, True): 32,  # one tile: 20 heads padded to 32
        (16, 512, True): 16,  # a TP-8 shard of 128: no padded heads
        (5, 512, True): 16,  # padded up for the dot
        (3, 24, True): 16,
        (128, 512, False): 2,  # no dots: [2, 16, 512] products (the tiling does not apply)
        (3, 24, False): 4,
    }
    monkeypatch.setattr(paged_attention, "MLA_TILING_TABLE", ((1, "h32-k32-w4-s2"),))
    for args, block in narrow.items():
        assert _mla_block_heads(*args) == block, args
    assert _mla_head_tiles(32, 512, True) == 1
    assert _mla_block_heads(128, 512, True) == 32
    assert _mla_head_tiles(128, 512, True) == 4
    assert _mla_block_heads(70, 24, True) == 32
    assert _mla_head_tiles(70, 24, True) == 3
    monkeypatch.setattr(
        paged_attention, "MLA_TILING_TABLE", ((1, "h32-k32-w4-s2"), (64, "h64-k32-w8-s2"))
    )
    for args, block in narrow.items():  # fewer than 64 heads, or no dots: as they were
        assert _mla_block_heads(*args) == block, args
    assert _mla_block_heads(128, 512, True) == 64
    assert _mla_head_tiles(128, 512, True) == 2
    assert _mla_block_heads(64, 512, True) == 64
    assert _mla_block_heads(63, 512, True) == 32  # no wide tile of padded heads
    assert _mla_head_tiles(63, 512, True) == 2
    assert _mla_block_heads(70, 24, True) == 64
    assert _mla_head_tiles(70, 24, True) == 2
    monkeypatch.setattr(paged_attention, "MLA_TILING_TABLE", ((1, "h16-k32-w4-s3-pf"),))
    assert _mla_block_heads(128, 512, True) == 16
    assert _mla_head_tiles(128, 512, True) == 8


def test_tiling_table_and_names(monkeypatch):
    """Every named tiling is valid and named by its fields; a table entry applies from its
    head count on (the first below it); bad tables and tilings are refused."""
    for name, tiling in MLA_TILINGS.items():
        assert tiling.name == name
        assert name.startswith(f"h{tiling.block_heads}-k{tiling.block_keys}-")
        assert ("-pf" in name) == tiling.prefetch
    assert MLATiling(32, 32, 4, 3, True, 264, 264).name == "h32-k32-w4-s3-pf-t264-f264"
    table = parse_mla_tiling_table("4:h32-k32-w4-s2, 64:h64-k32-w8-s3-pf")
    assert table == ((4, "h32-k32-w4-s2"), (64, "h64-k32-w8-s3-pf"))
    assert parse_mla_tiling_table("h16-k32-w4-s3-pf") == ((1, "h16-k32-w4-s3-pf"),)
    monkeypatch.setattr(paged_attention, "MLA_TILING_TABLE", table)
    assert mla_tiling(1).name == "h32-k32-w4-s2"  # below the first entry: the first
    assert mla_tiling(63).name == "h32-k32-w4-s2"
    assert mla_tiling(64).name == "h64-k32-w8-s3-pf"
    assert mla_tiling(128).name == "h64-k32-w8-s3-pf"
    custom = MLATiling.from_name("h16-k64-w2-s5-pf-t100-f50")
    assert custom == MLATiling(16, 64, 2, 5, True, 100, 50)
    assert MLATiling.from_name("h64-k16-w8-s1") == MLATiling(64, 16, 8, 1, False)
    assert parse_mla_tiling_table("2:h16-k64-w2-s5-pf") == ((2, "h16-k64-w2-s5-pf"),)
    monkeypatch.setattr(paged_attention, "MLA_TILING_TABLE", ((1, custom.name),))
    assert mla_tiling(8) == custom  # a name not in MLA_TILINGS: the tiling it describes
    monkeypatch.setattr(paged_attention, "MLA_TILING_TABLE", table)
    bad_tables = ("nope", "h32-k32-w4", "h24-k32-w4-s2", "0:h32-k32-w4-s2", "x:h32-k32-w4-s2")
    for bad in (*bad_tables, "64:h32-k32-w4-s2,1:h32-k32-w4-s2"):
        with pytest.raises(ValueError, match=r"MLA tiling|must be"):
            parse_mla_tiling_table(bad)
    for fields in ((24, 32, 4, 2), (32, 8, 4, 2), (32, 32, 3, 2), (32, 32, 4, 0)):
        with pytest.raises(ValueError, match="must be"):
            MLATiling(*fields, prefetch=False)
    with pytest.raises(ValueError, match="at least 1"):
        MLATiling(32, 32, 4, 2, False, target_programs=0)


def test_tiling_override_from_the_environment(monkeypatch):
    """``HELIX_KV_MLA_TILINGS`` replaces the table for the process (read once)."""
    paged_attention._tiling_override.cache_clear()
    monkeypatch.setenv("HELIX_KV_MLA_TILINGS", "1:h16-k32-w4-s3-pf,64:h64-k16-w8-s4-pf")
    try:
        assert mla_tiling(32).name == "h16-k32-w4-s3-pf"
        assert mla_tiling(128).name == "h64-k16-w8-s4-pf"
    finally:
        paged_attention._tiling_override.cache_clear()
    monkeypatch.delenv("HELIX_KV_MLA_TILINGS")
    assert mla_tiling(128).name == paged_attention.MLA_TILING_TABLE[-1][1]
    paged_attention._tiling_override.cache_clear()


def test_mla_split_rule_takes_the_tilings_targets(monkeypatch):
    """A tiling's ``target_programs`` / ``full_programs`` (the decode kernel's by default):
    enough splits for rows x head tiles to reach the target, as long as the keys allow, and
    one split at the full count; the decode kernel's rule is untouched."""
    use_tilings(monkeypatch, (1, MLATiling(32, 32, 4, 2, prefetch=False)))
    assert mla_tiling(32).target_programs == DECODE_TARGET_PROGRAMS
    assert mla_tiling(32).full_programs == DECODE_FULL_PROGRAMS
    assert _mla_splits(64, 32, 512, True, 66, 32, None)[0] == decode_splits(64, 1, 66, 32)
    use_tilings(monkeypatch, (1, MLATiling(32, 32, 4, 3, True, 256, 256)))
    assert _mla_splits(64, 32, 512, True, 66, 32, None)[0] == 4  # 64 rows x 4 = 256 programs
    assert _mla_splits(256, 32, 512, True, 66, 32, None)[0] == 1  # full already
    assert _mla_splits(255, 32, 512, True, 66, 32, None)[0] == 2
    assert _mla_splits(16, 128, 512, True, 66, 32, None)[0] == 4  # 16 rows x 4 tiles x 4
    assert _mla_splits(8, 32, 512, True, 18, 32, None)[0] == 3  # 576 keys: 3 splits of 256
    assert decode_splits(64, 1, 66, 32) == -(-DECODE_TARGET_PROGRAMS // 64)


def test_workspace_for_mla_decode_fits_every_default_call():
    dtype = next(iter(DTYPES))
    for heads, latent, width, tpb in ((16, 512, 66, 32), (128, 512, 512, 32), (5, 24, 3, 16)):
        workspace = DecodeWorkspace.for_mla_decode(64, heads, latent, width, tpb, dtype, DEVICE)
        use_dot = not (dtype == torch.float64 and DEVICE.type == "cuda")
        needed = [
            rows * _mla_splits(rows, heads, latent, use_dot, width, tpb, None)[0]
            for rows in range(1, 65)
        ]
        assert workspace.row_splits == max(needed)
        for rows in range(1, 65):
            splits = _mla_splits(rows, heads, latent, use_dot, width, tpb, None)[0]
            assert workspace.fits(rows, heads, latent, splits, dtype)


def test_lse_combine_over_two_ranks_equals_one_rank():
    """One request's pages dealt round robin to two "ranks" (their own block tables and local
    lengths); the exact combine of their partials equals one rank holding every key."""
    dtype = next(iter(DTYPES))
    tpb, heads, latent = 4, 6, 24
    lens = [21, 3, 8]  # the second request's keys all on rank 0
    p = mla_problem(3, lens, heads, latent, 8, tpb, dtype)
    whole = run_kernel(p)
    table = p["block_table"]
    parts = []
    for rank in range(2):
        sub_table = torch.full_like(table, -1)
        sub_lens = []
        for row, n in enumerate(lens):
            pages = list(range(rank, -(-n // tpb), 2))
            sub_table[row, : len(pages)] = table[row, pages]
            sub_lens.append(sum(min(tpb, n - page * tpb) for page in pages))
        q = dict(p, block_table=sub_table, local_lens=torch.tensor(sub_lens))
        parts.append(run_kernel(q, num_splits=2))
    assert parts[1][1][1].isneginf().all()  # rank 1 holds none of request 1
    combined = combine_partials(
        torch.stack([part[0] for part in parts]), torch.stack([part[1] for part in parts])
    )
    torch.testing.assert_close(combined.output, whole[0], atol=DTYPES[dtype], rtol=0)
    torch.testing.assert_close(combined.lse, whole[1], atol=DTYPES[dtype], rtol=0)


def test_kernel_reads_strided_metadata_columns():
    """Lens and table as columns of one packed int32 buffer (row stride > 1)."""
    dtype = next(iter(DTYPES))
    p = mla_problem(4, [9, 4, 17], 3, 16, 16, 4, dtype)
    packed = torch.zeros(3, 1 + p["block_table"].shape[1], dtype=torch.int32)
    packed[:, 0] = p["local_lens"]
    packed[:, 1:] = p["block_table"]
    packed = packed.to(DEVICE)
    args = (p["query"].to(DEVICE, dtype), p["cache"].to(DEVICE, dtype))
    strided = paged_mla_decode_attention(*args, packed[:, 1:], packed[:, 0], 4, 16, p["scale"])
    dense = run_kernel(p)
    assert torch.equal(strided.output.cpu().double(), dense[0])
    assert torch.equal(strided.lse.cpu().double(), dense[1])


@pytest.mark.parametrize("splits", [1, 2])
def test_a_plan_made_once_runs_every_layer_as_one_call_does(splits):
    """The step's metadata planned once (splits, scratch, tiles), each layer's query and
    cache run through it: the one-call form's result, layer by layer; a layer of another
    shape or dtype than the plan's is refused."""
    dtype = next(iter(DTYPES))
    layers = [mla_problem(30 + layer, [9, 0, 17], 4, 16, 8, 4, dtype) for layer in (0, 1)]
    table = layers[0]["block_table"].to(DEVICE, torch.int32)
    lens = layers[0]["local_lens"].to(DEVICE)
    scale = layers[0]["scale"]
    plan = MLADecodeAttentionPlan(
        table,
        lens,
        4,
        heads=4,
        head_dim=24,
        latent_dim=16,
        dtype=dtype,
        scale=scale,
        num_splits=splits,
    )
    assert plan.splits.count == splits
    for p in layers:
        query, cache = p["query"].to(DEVICE, dtype), p["cache"].to(DEVICE, dtype)
        part = plan.run(query, cache)
        one_call = paged_mla_decode_attention(
            query, cache, table, lens, 4, 16, scale, num_splits=splits
        )
        assert torch.equal(part.output, one_call.output)
        assert torch.equal(part.lse, one_call.lse)
    with pytest.raises(ValueError, match=r"latent_cache .* must be \[\*, 1, 24\]"):
        plan.run(query, cache[..., :20])
    other = torch.float32 if dtype == torch.float64 else torch.bfloat16
    with pytest.raises(ValueError, match="the plan's of"):
        plan.run(query, cache.to(other))


def test_shape_errors():
    dtype = next(iter(DTYPES))
    query = torch.zeros(2, 4, 24, dtype=dtype, device=DEVICE)
    cache = torch.zeros(16, 1, 24, dtype=dtype, device=DEVICE)
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)

    def call(**changes: object) -> None:
        args: dict[str, object] = {
            "query": query,
            "latent_cache": cache,
            "block_table": table,
            "local_lens": lens,
            "tokens_per_block": 4,
            "latent_dim": 16,
            "scale": 0.1,
        }
        args.update(changes)
        paged_mla_decode_attention(**args)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"\[slots, 1, 24\]"):
        call(latent_cache=torch.zeros(16, 2, 24, dtype=dtype, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[slots, 1, 24\]"):
        call(latent_cache=torch.zeros(16, 1, 20, dtype=dtype, device=DEVICE))
    with pytest.raises(ValueError, match="must be"):
        call(query=query[0])
    for latent in (0, 24, 30):
        with pytest.raises(ValueError, match="latent_dim"):
            call(latent_dim=latent)
    with pytest.raises(ValueError, match="do not cover"):
        call(block_table=table[:1])
    with pytest.raises(ValueError, match="do not cover"):
        call(local_lens=lens[:1])
    with pytest.raises(ValueError, match="contiguous last dim"):
        call(query=torch.zeros(2, 4, 48, dtype=dtype, device=DEVICE)[..., ::2])
    with pytest.raises(ValueError, match="at least 1"):
        call(num_splits=0)
    small = DecodeWorkspace.allocate(2, 4, 8, 2, dtype, DEVICE)  # head_dim 8, not 16
    with pytest.raises(ValueError, match="does not fit"):
        call(num_splits=2, workspace=small)
    empty = paged_mla_decode_attention(query[:0], cache, table, lens, 4, 16, 0.1)
    assert empty.output.shape == (0, 4, 16)
    assert empty.lse.shape == (0, 4)


def test_partial_attention_value_dim_differs_from_key_dim():
    """Values of their own width: a direct softmax per (batch, query, head), and the LSE."""
    gen = torch.Generator().manual_seed(5)
    batch, q_len, q_heads, k_len, kv_heads, dim, value_dim = 2, 3, 4, 5, 2, 8, 6
    query = torch.randn(batch, q_len, q_heads, dim, generator=gen, dtype=torch.float64)
    key = torch.randn(batch, k_len, kv_heads, dim, generator=gen, dtype=torch.float64)
    value = torch.randn(batch, k_len, kv_heads, value_dim, generator=gen, dtype=torch.float64)
    key_positions = torch.tensor([[0, 1, 2, 3, PAD_KEY_POSITION], [4, 5, 6, 7, 8]])
    query_positions = torch.tensor([[1, 3, PAD_QUERY_POSITION], [6, 8, 3]])
    scale = 0.3
    part = partial_attention(query, key, value, query_positions, key_positions, scale=scale)
    assert part.output.shape == (batch, q_len, q_heads, value_dim)
    for b in range(batch):
        for q in range(q_len):
            visible = key_positions[b] <= query_positions[b, q]
            for h in range(q_heads):
                kv = h // (q_heads // kv_heads)
                if not visible.any():
                    assert part.lse[b, q, h].isneginf()
                    assert not part.output[b, q, h].any()
                    continue
                z = scale * (key[b, visible, kv] @ query[b, q, h])
                w = torch.softmax(z, dim=0)
                torch.testing.assert_close(
                    part.output[b, q, h], w @ value[b, visible, kv], atol=1e-12, rtol=0
                )
                torch.testing.assert_close(
                    part.lse[b, q, h], torch.logsumexp(z, dim=0), atol=1e-12, rtol=0
                )
    dense = reference_attention(query, key, value, query_positions, key_positions, scale=scale)
    torch.testing.assert_close(dense, part.output, atol=1e-12, rtol=0)
    nothing = partial_attention(
        query, key[:, :0], value[:, :0], query_positions, key_positions[:, :0]
    )
    assert nothing.output.shape == (batch, q_len, q_heads, value_dim)
    assert not nothing.output.any()
    assert nothing.lse.isneginf().all()
    with pytest.raises(ValueError, match="do not match"):
        partial_attention(query, key, value[:, :4], query_positions, key_positions)
    with pytest.raises(ValueError, match="do not match"):
        partial_attention(query, key, value[:, :, :1], query_positions, key_positions)


def test_write_keys_only():
    """``value=None, value_cache=None``: each owned token's latent row lands in its slot,
    nothing else changes."""
    dtype = next(iter(DTYPES))
    gen = torch.Generator().manual_seed(6)
    latent = torch.randn(4, 1, 40, generator=gen).to(DEVICE, dtype)
    cache = torch.full((12, 1, 40), 7.0, dtype=dtype, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 11], device=DEVICE)
    write_paged_kv(latent, None, slots, cache, None)
    expected = torch.full((12, 1, 40), 7.0, dtype=dtype)
    expected[[3, 0, 11]] = latent.cpu()[[0, 2, 3]]
    assert torch.equal(cache.cpu(), expected)
    with pytest.raises(ValueError, match="both"):
        write_paged_kv(latent, latent, slots, cache, None)
    with pytest.raises(ValueError, match="both"):
        write_paged_kv(latent, None, slots, cache, cache)
    with pytest.raises(ValueError, match="does not match"):
        write_paged_kv(latent, None, slots, cache[:, :, :32], None)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


#: (dtype, heads, tiling) of the GPU test: 16 heads (a TP-8 shard of 128) with the default
#: tiling, 128 heads (DeepSeek-V3's on a Helix rank) in every named tiling in bf16, and float32
#: (16 keys a block, at most two buffers) in the tilings of the most shared memory.
CUDA_CASES = [
    (torch.bfloat16, 16, None),
    (torch.float32, 16, None),
    *[(torch.bfloat16, 128, name) for name in MLA_TILINGS],
    *[
        (torch.float32, 128, name)
        for name in ("h32-k32-w4-s2", "h32-k32-w4-s3-pf", "h64-k32-w8-s3-pf", "h64-k64-w8-s2-pf")
    ],
]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(("dtype", "heads", "tiling"), CUDA_CASES)
def test_deepseek_v3_sizes_on_cuda(monkeypatch, dtype, heads, tiling):
    """Latent 512 + RoPE 64, 32 tokens a page, rows of about 1000 keys (and an empty row):
    default splits and one split equal the float64 reference (and within 1e-2 of it
    relative to its norm in bf16); a CUDA graph of the call replays to the eager result;
    the split scratch is poisoned with NaN first."""
    if tiling is not None:
        monkeypatch.setattr(paged_attention, "MLA_TILING_TABLE", ((1, tiling),))
    device = torch.device("cuda")
    lens = [1000, 1024, 0, 777]
    p = mla_problem(7, lens, heads, 512, 64, 32, dtype, device)
    p["scale"] = 1.0 / math.sqrt(192)  # DeepSeek-V3's qk head dim (128 + 64)
    expected_out, expected_lse = (t.cpu() for t in reference_partial(p))
    atol = {torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
    query = p["query"].to(dtype)
    cache = p["cache"].to(dtype)
    table = p["block_table"].to(torch.int32)
    lens_t = p["local_lens"].to(torch.int32)
    width = table.shape[1]
    workspace = DecodeWorkspace.for_mla_decode(len(lens), heads, 512, width, 32, dtype, device)

    def call(**options: object) -> tuple[torch.Tensor, torch.Tensor]:
        part = paged_mla_decode_attention(
            query,
            cache,
            table,
            lens_t,
            32,
            512,
            p["scale"],
            **options,  # type: ignore[arg-type]
        )
        return part.output, part.lse

    splits = _mla_splits(len(lens), heads, 512, True, width, 32, None)[0]
    assert splits > 1
    for options in ({}, {"workspace": workspace}, {"num_splits": 1}):
        workspace.output_scratch.fill_(float("nan"))
        workspace.lse_scratch.fill_(float("nan"))
        out, lse = call(**options)
        assert lse[2].isneginf().all()
        assert not out[2].any()
        out64 = out.cpu().double()
        torch.testing.assert_close(out64, expected_out, atol=atol, rtol=0)
        torch.testing.assert_close(lse.cpu().double(), expected_lse, atol=atol, rtol=0)
        assert float((out64 - expected_out).norm() / expected_out.norm()) < 1e-2
    eager = call(workspace=workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = call(workspace=workspace)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed[0], eager[0])
    assert torch.equal(graphed[1], eager[1])
