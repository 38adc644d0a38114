"""The Helix token placement as vectorised numpy/torch formulas (DESIGN.md section 2).

The Rust core (``helix_kv.Layout``) is the source of truth; these are the same closed forms
for arrays the executor builds per step, so that no step needs a per-request Python loop and
device tensors never round-trip through the host. Pages of ``tokens_per_block`` (tpb) tokens
are dealt round-robin over the ``cp`` ranks; superblock id == physical page id on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank's tokens sit: ``cp`` ranks, ``tokens_per_block`` tokens per page."""

    cp: int
    tokens_per_block: int
    rank: int

    def __post_init__(self) -> None:
        if self.cp < 1 or self.tokens_per_block < 1:
            raise ValueError(
                f"cp ({self.cp}) and tokens_per_block ({self.tokens_per_block}) must be at least 1"
            )
        if not 0 <= self.rank < self.cp:
            raise ValueError(f"rank {self.rank} is outside the CP group of {self.cp} ranks")

    @property
    def tokens_per_superblock(self) -> int:
        """Global tokens covered by one superblock (one page on every rank)."""
        return self.cp * self.tokens_per_block

    def local_lens(self, lengths: npt.ArrayLike) -> IntArray:
        """Tokens this rank holds of sequences of the given global lengths (closed form)."""
        n = np.asarray(lengths, dtype=np.int64)
        tpb = self.tokens_per_block
        full, rem = np.divmod(n, self.tokens_per_superblock)
        return full * tpb + np.clip(rem - self.rank * tpb, 0, tpb)

    def owner_ranks(self, positions: npt.ArrayLike) -> IntArray:
        """The rank holding each global position: ``(pos // tpb) % cp``."""
        return (np.asarray(positions, dtype=np.int64) // self.tokens_per_block) % self.cp

    def superblocks_for(self, lengths: npt.ArrayLike) -> IntArray:
        """Superblocks a sequence of each global length occupies."""
        n = np.asarray(lengths, dtype=np.int64)
        return -(-n // self.tokens_per_superblock)

    def global_positions(self, local_indices: npt.ArrayLike) -> IntArray:
        """Global position of this rank's ``j``-th local token."""
        j = np.asarray(local_indices, dtype=np.int64)
        tpb = self.tokens_per_block
        return (j // tpb) * self.tokens_per_superblock + self.rank * tpb + j % tpb

    def slot_mapping(
        self, block_table: npt.ArrayLike, rows: npt.ArrayLike, positions: npt.ArrayLike
    ) -> IntArray:
        """Physical slot of each global position on this rank, ``-1`` where another rank owns it.

        ``block_table[rows[i]]`` is the superblock table of the request of token ``i``.
        The same result as the scheduler's ``slot_mapping``; used where no scheduler runs.
        """
        table = np.asarray(block_table, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        tpb = self.tokens_per_block
        pages = table[np.asarray(rows, dtype=np.int64), pos // self.tokens_per_superblock]
        mine = self.owner_ranks(pos) == self.rank
        return np.where(mine, pages * tpb + pos % tpb, -1)
