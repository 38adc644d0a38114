"""One rank's view of the Helix token placement (``docs/user-guide.md``, "The ledger on its
own"), for the executor.

The layout math itself is ``helix_kv.Layout`` (Rust, numpy batch forms); this binds it to a
rank so the executor's per-step arrays are built without a per-request Python loop. Pages of
``tokens_per_block`` tokens are dealt round-robin over the ``cp_size`` ranks; superblock id ==
physical page id on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt

from helix_kv import Layout
from helix_kv._renamed import Renamed, renamed_fields

IntArray = npt.NDArray[np.int64]


@renamed_fields
@dataclass(frozen=True)
class RankPlacement:
    """Where rank ``cp_rank`` of a CP group of ``cp_size`` ranks holds its tokens, with
    ``tokens_per_block`` tokens per page.

    ``cp`` and ``rank`` are the deprecated names of ``cp_size`` and ``cp_rank`` (as keywords
    and attributes, kept for one release; they warn).
    """

    cp_size: int
    tokens_per_block: int
    cp_rank: int

    cp = Renamed[int]("cp_size")
    rank = Renamed[int]("cp_rank")

    def __post_init__(self) -> None:
        if self.cp_size < 1 or self.tokens_per_block < 1:
            raise ValueError(
                f"cp_size ({self.cp_size}) and tokens_per_block ({self.tokens_per_block}) "
                "must be at least 1"
            )
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(
                f"cp_rank {self.cp_rank} is outside the CP group of {self.cp_size} ranks"
            )

    @property
    def layout(self) -> Layout:
        """The group's ``helix_kv.Layout`` (cached; the placement itself stays picklable)."""
        return _layout(self.cp_size, self.tokens_per_block)

    @property
    def tokens_per_superblock(self) -> int:
        """Global tokens covered by one superblock (one page on every rank)."""
        return int(self.layout.tokens_per_superblock)

    def local_lens(self, lengths: npt.ArrayLike) -> IntArray:
        """Tokens this rank holds of sequences of the given global lengths (closed form)."""
        n = np.asarray(lengths, dtype=np.int64)
        return self.layout.local_lens(n.ravel(), self.cp_rank).reshape(n.shape)

    def owner_ranks(self, positions: npt.ArrayLike) -> IntArray:
        """The rank holding each global position: ``(pos // tpb) % cp_size``."""
        pos = np.asarray(positions, dtype=np.int64)
        return self.layout.owner_ranks(pos.ravel()).astype(np.int64).reshape(pos.shape)

    def superblocks_for(self, lengths: npt.ArrayLike) -> IntArray:
        """Superblocks a sequence of each global length occupies."""
        n = np.asarray(lengths, dtype=np.int64)
        return self.layout.superblocks_for_many(n.ravel()).reshape(n.shape)

    def global_positions(self, local_indices: npt.ArrayLike) -> IntArray:
        """Global position of this rank's ``j``-th local token."""
        j = np.asarray(local_indices, dtype=np.int64)
        return self.layout.global_positions(self.cp_rank, j.ravel()).reshape(j.shape)

    def slot_mapping(
        self, block_table: npt.ArrayLike, rows: npt.ArrayLike, positions: npt.ArrayLike
    ) -> IntArray:
        """Physical slot of each global position on this rank, ``-1`` where another rank owns it.

        ``block_table[rows[i]]`` is the superblock table of the request of token ``i``
        (``-1`` padded). The same result as the scheduler's ``slot_mapping``, computed by the
        core (``Layout.slot_mapping``); used where no scheduler runs.
        """
        pos = np.asarray(positions, dtype=np.int64)
        rows_arr = np.asarray(rows, dtype=np.int64).ravel()
        table = np.asarray(block_table, dtype=np.int64)
        slots = self.layout.slot_mapping(table, rows_arr, pos.ravel(), self.cp_rank)
        return slots.reshape(pos.shape)


@cache
def _layout(cp_size: int, tokens_per_block: int) -> Layout:
    return Layout(cp_size, tokens_per_block)
