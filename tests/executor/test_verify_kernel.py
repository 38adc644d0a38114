"""The paged decode kernel verifying drafts: one program per request's ``1 + k`` rows
(``rows_per_request > 1``) against one program per row and the dense reference.

Rows are laid out as ``Scheduler.write_decode_rows`` writes a drafted step: each request's
decode row then its draft rows, at consecutive positions with one block table, each row's
local length the keys this rank holds up to and including its position; padding rows
(position 0, local length 0, stale block tables) at the end. CPU: Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from helix_kv.executor.attention import PAD_KEY_POSITION, partial_attention
from helix_kv.executor.paged_attention import interpreted, paged_decode_attention
from helix_kv.executor.placement import RankPlacement

pytest.importorskip("triton", reason="the paged kernels need triton")
if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
    DTYPES = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
elif interpreted():
    DEVICE = torch.device("cpu")
    DTYPES = {torch.float64: 1e-12, torch.float32: 1e-5}
else:
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def drafted_rows(
    seed: int,
    counts: list[int],
    cp: int,
    rank: int,
    tpb: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    padding: int,
    share_first: bool = False,
) -> dict:
    """Random caches and the rows of requests verifying ``counts[i] - 1`` drafts each."""
    gen = torch.Generator().manual_seed(seed)
    placement = RankPlacement(cp, tpb, rank)
    tps = tpb * cp
    starts = [int(x) for x in torch.randint(1, 60, (len(counts),), generator=gen)]
    if share_first and len(counts) > 1:
        # request 1 decodes right after request 0's last row, both name one cached first
        # superblock: still two groups (their pages at their own positions differ)
        # (a superblock a step writes is never a shared one: both start past the first)
        starts[0] = max(starts[0], tps)
        starts[1] = starts[0] + counts[0]
    width = max(-(-(s + c) // tps) for s, c in zip(starts, counts)) + 1
    pages = width * len(counts) + 4
    table = torch.randperm(pages, generator=gen)[: width * len(counts)].view(-1, width)
    if share_first and len(counts) > 1:
        table[1, 0] = table[0, 0]
    positions, lens, rows_table = [], [], []
    for request, (start, count) in enumerate(zip(starts, counts)):
        for pos in range(start, start + count):
            positions.append(pos)
            lens.append(int(placement.local_lens(pos + 1)))
            rows_table.append(table[request])
    for _ in range(padding):  # stale tables, as a reused staging buffer holds
        positions.append(0)
        lens.append(0)
        rows_table.append(torch.randperm(pages, generator=gen)[:width])
    rows = len(positions)
    shape = (pages * tpb, kv_heads, head_dim)
    return {
        "query": torch.randn(rows, kv_heads * group, head_dim, generator=gen),
        "key_cache": torch.randn(shape, generator=gen, dtype=torch.float64),
        "value_cache": torch.randn(shape, generator=gen, dtype=torch.float64),
        "block_table": torch.stack(rows_table),
        "local_lens": torch.tensor(lens),
        "positions": torch.tensor(positions),
        "tpb": tpb,
        "tps": tps,
    }


def reference(p: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    table, lens, tpb = p["block_table"], p["local_lens"], p["tpb"]
    slots = (table.clamp(min=0)[:, :, None] * tpb + torch.arange(tpb)).view(len(lens), -1)
    local = torch.arange(slots.shape[1]).expand(len(lens), -1)
    key_positions = torch.where(local < lens[:, None], local, PAD_KEY_POSITION)
    part = partial_attention(
        p["query"].to(dtype).double()[:, None],
        p["key_cache"].to(dtype).double()[slots],
        p["value_cache"].to(dtype).double()[slots],
        torch.full((len(lens), 1), 1 << 40),
        key_positions,
    )
    return part.output[:, 0], part.lse[:, 0]


def run(p: dict, dtype: torch.dtype, rows_per_request: int, splits: int | None = None):
    return paged_decode_attention(
        p["query"].to(DEVICE, dtype),
        p["key_cache"].to(DEVICE, dtype),
        p["value_cache"].to(DEVICE, dtype),
        p["block_table"].to(DEVICE, torch.int32),
        p["local_lens"].to(DEVICE, torch.int32),
        p["tpb"],
        num_splits=splits,
        positions=p["positions"].to(DEVICE, torch.int32),
        rows_per_request=rows_per_request,
        tokens_per_superblock=p["tps"],
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    ("counts", "cp", "rank", "tpb", "kv_heads", "group", "head_dim", "splits", "share"),
    [
        ([5, 1, 3, 5], 1, 0, 4, 2, 2, 16, None, False),  # k = 4, 0, 2, 4
        ([5, 5, 2], 2, 1, 4, 1, 4, 16, None, False),  # drafts crossing to the other rank
        ([3, 4, 1, 2], 4, 2, 2, 2, 3, 24, 3, False),  # split-K; group, dim not powers of 2
        ([4, 2], 2, 0, 4, 2, 2, 16, None, True),  # adjacent requests sharing a first page
        ([1, 1, 1], 1, 0, 8, 2, 2, 16, None, False),  # no drafts at all
        ([9, 2], 1, 0, 4, 2, 4, 16, None, False),  # 16 x 4 query slots: one program per row
    ],
)
def test_verify_kernel_matches_per_row_kernel_and_reference(
    dtype, counts, cp, rank, tpb, kv_heads, group, head_dim, splits, share
):
    p = drafted_rows(3, counts, cp, rank, tpb, kv_heads, group, head_dim, 3, share)
    want_out, want_lse = reference(p, dtype)
    grouped = run(p, dtype, max(2, max(counts)), splits)
    per_row = run(p, dtype, 1, splits)
    atol = DTYPES[dtype]
    finite = torch.isfinite(want_lse)
    for part in (grouped, per_row):
        out, lse = part.output.cpu().double(), part.lse.cpu().double()
        torch.testing.assert_close(out, want_out, atol=atol, rtol=atol)
        torch.testing.assert_close(lse[finite], want_lse[finite], atol=atol, rtol=atol)
        assert torch.isneginf(lse[~finite]).all()
    # padding rows see nothing: output 0, LSE -inf
    assert torch.isneginf(grouped.lse[-3:]).all()
    assert (grouped.output[-3:] == 0).all()


def test_verify_kernel_needs_positions():
    p = drafted_rows(0, [2], 1, 0, 4, 1, 2, 16, 0)
    with pytest.raises(ValueError, match="positions"):
        paged_decode_attention(
            p["query"].to(DEVICE),
            p["key_cache"].to(DEVICE, torch.float32),
            p["value_cache"].to(DEVICE, torch.float32),
            p["block_table"].to(DEVICE),
            p["local_lens"].to(DEVICE),
            4,
            rows_per_request=2,
        )
