"""The prompt-lookup (n-gram) drafter on the device: the same drafts as
:meth:`NgramDrafter.propose <helix_kv.executor.drafter.NgramDrafter.propose>`, token for
token, computed by a fixed number of tensor operations over every request at once.

The histories are right-aligned in one ``[requests, width]`` int32 tensor (their tails in its
last column, padding ``-1``, which matches no token), as the host drafter lays them out; each
n-gram size is one elementwise comparison of the grid with its tail column, and the most
recent match per row is one ``argmax`` over the reversed columns, so the device time does not
grow with a kernel per request (as vLLM's GPU n-gram drafter: unfold and compare, every
request in one batch). On the host the numpy drafter stays: it does the same passes in numpy.

Rank invariance is the host drafter's: the grid holds only the requests' own tokens, which
are identical on every rank, and the computation is exact integer work.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import numpy.typing as npt
import torch

from helix_kv.executor.drafter import NgramDrafter


def ngram_propose(
    grid: torch.Tensor,
    lengths: torch.Tensor,
    skips: torch.Tensor,
    num_speculative_tokens: int,
    max_ngram: int,
    min_ngram: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts for the rows of ``grid`` (int32 ``[requests, width]``, each history
    right-aligned, ``-1`` before it; ``lengths[i]`` its tokens, ``skips[i]`` the proposed
    tokens to drop first, both int64): each row's draft count (``num_speculative_tokens``
    where an n-gram of its tail occurred before, else 0; int64 ``[requests]``) and its drafts
    (int32 ``[requests, num_speculative_tokens]``, meaningful where the count is nonzero).

    The rule is :meth:`~helix_kv.executor.drafter.NgramDrafter.draft`'s: the longest ``n``
    from ``max_ngram`` down to ``min_ngram`` whose last ``n`` tokens occurred earlier wins,
    of its matches the most recent; the drafts continue what followed it with the period
    between the match and the tail. No host synchronisation: every step is a tensor op.
    """
    count, width = grid.shape
    k = num_speculative_tokens
    device = grid.device
    if count == 0 or width < 2:
        return (
            torch.zeros(count, dtype=torch.int64, device=device),
            torch.zeros((count, k), dtype=torch.int32, device=device),
        )
    ends = torch.arange(width - 1, device=device)  # a window ends at column e <= width - 2
    first = width - lengths  # each row's first real column
    match = torch.ones((count, width - 1), dtype=torch.bool, device=device)
    best_end = torch.full((count,), -1, dtype=torch.int64, device=device)
    reversed_ends = width - 2 - ends  # column of each position of a reversed row
    for n in range(1, max_ngram + 1):
        back = n - 1
        if back >= width - 1:
            break
        shifted = torch.zeros((count, width - 1), dtype=torch.bool, device=device)
        shifted[:, back:] = grid[:, : width - 1 - back] == grid[:, width - 1 - back, None]
        match &= shifted
        if n < min_ngram:
            continue
        # the window lies in the history (not the padding) and the tail has n tokens
        valid = match & (ends[None, :] - back >= first[:, None])
        found = valid.any(dim=1) & (lengths > n)
        # the most recent match: the first True of the reversed row (argmax of int8 picks
        # the first maximum)
        last = reversed_ends[torch.argmax(valid.flip(1).to(torch.int8), dim=1)]
        best_end = torch.where(found, last, best_end)
    drafted = best_end >= 0
    counts = torch.where(drafted, k, 0).to(torch.int64)
    period = torch.where(drafted, width - 1 - best_end, 1)[:, None]
    wanted = width + skips[:, None] + torch.arange(k, device=device)[None, :]
    source = wanted - period * (torch.div(wanted - width, period, rounding_mode="floor") + 1)
    source = torch.where(drafted[:, None], source, width - 1)
    tokens = torch.gather(grid, 1, source)
    return counts, tokens


class DeviceNgramDrafter:
    """:class:`~helix_kv.executor.drafter.NgramDrafter`'s :meth:`propose` with the search on
    ``device``: the grid goes up in one copy, the search runs there (on its own CUDA stream,
    so it waits for no step in flight), and the counts and drafts come back in one copy.
    The same proposals as the host drafter, token for token."""

    def __init__(self, drafter: NgramDrafter, device: torch.device) -> None:
        self.drafter = drafter
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def num_speculative_tokens(self) -> int:
        return self.drafter.num_speculative_tokens

    def propose(
        self, histories: Sequence[npt.ArrayLike], skips: npt.ArrayLike | int = 0
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """What :meth:`NgramDrafter.propose` returns: the counts (int64, one per history)
        and the drafts of the rows with a nonzero count, concatenated (int32)."""
        count = len(histories)
        if not count:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        grid, lengths = self.drafter.grid(histories)
        skip = np.ascontiguousarray(np.broadcast_to(np.asarray(skips, dtype=np.int64), (count,)))
        host = np.concatenate([lengths, skip])
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            grid_d = torch.from_numpy(grid).to(self.device, non_blocking=True)
            host_d = torch.from_numpy(host).to(self.device, non_blocking=True)
            d = self.drafter
            counts_d, tokens_d = ngram_propose(
                grid_d, host_d[:count], host_d[count:], d.num_speculative_tokens,
                d.max_ngram, d.min_ngram,
            )  # fmt: skip
            packed = torch.cat([counts_d.to(torch.int32)[:, None], tokens_d], dim=1).cpu()
        counts = packed[:, 0].numpy().astype(np.int64)
        tokens: npt.NDArray[np.int32] = np.ascontiguousarray(packed[counts > 0, 1:].numpy())
        return counts, tokens.ravel()


__all__ = ["DeviceNgramDrafter", "ngram_propose"]
