//! The Helix token placement: pages of `tokens_per_block` tokens dealt round-robin over
//! the `cp` ranks. `cp = 1` is the plain paged layout.

use crate::error::{CoreError, Result};

/// Largest `cp * tokens_per_block`: keeps every product below in `u64` for any
/// sequence length the ledger can describe.
const MAX_TOKENS_PER_SUPERBLOCK: u64 = 1 << 24;

/// Token placement for a CP group of `cp` ranks with pages of `tokens_per_block` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    cp: u32,
    tokens_per_block: u32,
}

impl Layout {
    /// A layout for `cp >= 1` ranks and pages of `tokens_per_block >= 1` tokens.
    pub fn new(cp: u32, tokens_per_block: u32) -> Result<Self> {
        if cp == 0 {
            return Err(CoreError::config("cp_size", "cp_size must be at least 1"));
        }
        if tokens_per_block == 0 {
            return Err(CoreError::config(
                "tokens_per_block",
                "tokens_per_block must be at least 1",
            ));
        }
        if u64::from(cp) * u64::from(tokens_per_block) > MAX_TOKENS_PER_SUPERBLOCK {
            // the page size is the setting to lower: the group's size is given
            return Err(CoreError::config(
                "tokens_per_block",
                format!(
                    "cp_size * tokens_per_block = {} exceeds {MAX_TOKENS_PER_SUPERBLOCK}",
                    u64::from(cp) * u64::from(tokens_per_block)
                ),
            ));
        }
        Ok(Self {
            cp,
            tokens_per_block,
        })
    }

    /// Ranks in the CP group.
    pub fn cp(self) -> u32 {
        self.cp
    }

    /// Tokens in one physical page on one rank.
    pub fn tokens_per_block(self) -> u32 {
        self.tokens_per_block
    }

    /// Global tokens covered by one superblock (one page on each rank).
    pub fn tokens_per_superblock(self) -> u64 {
        u64::from(self.cp) * u64::from(self.tokens_per_block)
    }

    /// Fails unless `rank` is a rank of the group.
    pub fn check_rank(self, rank: u32) -> Result<()> {
        if rank < self.cp {
            Ok(())
        } else {
            Err(CoreError::InvalidArgument(format!(
                "rank {rank} is outside the CP group of {} ranks",
                self.cp
            )))
        }
    }

    /// The rank that holds global position `pos`: `(pos // tpb) % cp`.
    #[expect(
        clippy::cast_possible_truncation,
        reason = "a remainder modulo cp, a u32"
    )]
    pub fn owner_rank(self, pos: u64) -> u32 {
        ((pos / u64::from(self.tokens_per_block)) % u64::from(self.cp)) as u32
    }

    /// Tokens of a length-`n` sequence held by `rank` (closed form; `rank < cp`).
    pub fn local_len(self, n: u64, rank: u32) -> u64 {
        let tpb = u64::from(self.tokens_per_block);
        let full = n / self.tokens_per_superblock();
        let rem = n % self.tokens_per_superblock();
        let offset = u64::from(rank) * tpb;
        full * tpb + rem.saturating_sub(offset).min(tpb)
    }

    /// Superblocks a length-`n` sequence occupies: `ceil(n / (tpb * cp))`.
    pub fn superblocks_for(self, n: u64) -> u64 {
        let per = self.tokens_per_superblock();
        if per.is_power_of_two() {
            // The usual layouts (powers of two for both factors): a shift, not a division.
            (n >> per.trailing_zeros()) + u64::from(n & (per - 1) != 0)
        } else {
            n.div_ceil(per)
        }
    }

    /// Index of superblock that holds global position `pos`.
    pub fn superblock_index(self, pos: u64) -> u64 {
        pos / self.tokens_per_superblock()
    }

    /// Position of `pos` inside its owner's local sequence.
    pub fn local_index(self, pos: u64) -> u64 {
        let tpb = u64::from(self.tokens_per_block);
        self.superblock_index(pos) * tpb + pos % tpb
    }

    /// The global position of the `local_index`-th token held by `rank` (inverse of
    /// [`Layout::local_index`] on that rank). Needs `rank < cp` and a result that fits
    /// `u64` (any local index of a sequence the ledger can hold does); see
    /// [`Layout::checked_global_position`] for arbitrary inputs.
    pub fn global_position(self, rank: u32, local_index: u64) -> u64 {
        let tpb = u64::from(self.tokens_per_block);
        (local_index / tpb) * self.tokens_per_superblock()
            + u64::from(rank) * tpb
            + local_index % tpb
    }

    /// [`Layout::global_position`], or `None` where the position would not fit `u64`.
    pub fn checked_global_position(self, rank: u32, local_index: u64) -> Option<u64> {
        let tpb = u64::from(self.tokens_per_block);
        (local_index / tpb)
            .checked_mul(self.tokens_per_superblock())?
            .checked_add(u64::from(rank) * tpb + local_index % tpb)
    }

    /// KV slot (cell of its owner rank's page pool) of global position `pos`, given the
    /// request's superblock table (superblock id == physical page id on every rank).
    /// `None` if the table does not reach `pos`.
    pub fn slot(self, pos: u64, table: &[crate::ids::SuperblockId]) -> Option<u64> {
        let tpb = u64::from(self.tokens_per_block);
        let page = *table.get(usize::try_from(self.superblock_index(pos)).ok()?)?;
        Some(u64::from(page) * tpb + pos % tpb)
    }

    /// The batch slot mapping of a step run without a scheduler: for each token `i`, the
    /// slot on `rank` of global position `positions[i]` of the request whose superblock
    /// table is row `rows[i]` of `table` (row-major, `width` entries a row, padded with
    /// negative ids), or -1 where another rank owns the position. Appends to `out`.
    ///
    /// Every argument is checked before anything is appended: `rank` in the group, as many
    /// rows as positions, every row in the table, and every position inside its row's
    /// table at a page id in `0..=u32::MAX`, whichever rank owns it (so every rank accepts
    /// or refuses the same batch).
    pub fn slot_mapping_into(
        self,
        table: &[i64],
        width: usize,
        rows: &[u64],
        positions: &[u64],
        rank: u32,
        out: &mut Vec<i64>,
    ) -> Result<()> {
        self.check_rank(rank)?;
        if rows.len() != positions.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} rows and {} positions must have the same length",
                rows.len(),
                positions.len()
            )));
        }
        let num_rows = table.len().checked_div(width).unwrap_or(0);
        let page_of = |row: u64, pos: u64| -> Result<u32> {
            let row = usize::try_from(row)
                .ok()
                .filter(|&row| row < num_rows)
                .ok_or_else(|| {
                    CoreError::InvalidArgument(format!(
                        "row {row} is outside the block table ({num_rows} rows)"
                    ))
                })?;
            let index = usize::try_from(self.superblock_index(pos))
                .ok()
                .filter(|&index| index < width)
                .ok_or_else(|| {
                    CoreError::InvalidArgument(format!(
                        "position {pos} is past row {row} of the block table ({width} \
                         superblocks of {} tokens)",
                        self.tokens_per_superblock()
                    ))
                })?;
            let page = table[row * width + index];
            u32::try_from(page).map_err(|_| {
                CoreError::InvalidArgument(format!(
                    "position {pos} of row {row} falls on page id {page}, not a page \
                     (0..=2**32-1)"
                ))
            })
        };
        for (&row, &pos) in rows.iter().zip(positions) {
            page_of(row, pos)?;
        }
        let tpb = u64::from(self.tokens_per_block);
        out.reserve(positions.len());
        for (&row, &pos) in rows.iter().zip(positions) {
            out.push(if self.owner_rank(pos) == rank {
                let page = page_of(row, pos)?;
                let slot = u64::from(page) * tpb + pos % tpb;
                i64::try_from(slot).map_err(|_| {
                    CoreError::InvalidArgument(format!(
                        "position {pos} of row {row} maps to KV slot {slot}, past 2**63-1"
                    ))
                })?
            } else {
                -1
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Place tokens one by one, the way the design states it, and count.
    fn brute_force(layout: Layout, n: u64) -> Vec<Vec<u64>> {
        let mut held = vec![Vec::new(); layout.cp() as usize];
        for pos in 0..n {
            let owner = usize::try_from(layout.owner_rank(pos)).unwrap();
            held[owner].push(pos);
        }
        held
    }

    #[test]
    fn closed_forms_match_brute_force_placement() {
        for cp in 1..=5 {
            for tpb in [1, 2, 3, 4, 7, 16] {
                let layout = Layout::new(cp, tpb).unwrap();
                for n in 0..(3 * u64::from(cp * tpb) + 5) {
                    let held = brute_force(layout, n);
                    let mut total = 0;
                    for rank in 0..cp {
                        let mine = &held[rank as usize];
                        assert_eq!(
                            layout.local_len(n, rank),
                            mine.len() as u64,
                            "cp={cp} tpb={tpb} n={n} r={rank}"
                        );
                        for (i, &pos) in mine.iter().enumerate() {
                            assert_eq!(layout.owner_rank(pos), rank);
                            assert_eq!(layout.local_index(pos), i as u64);
                            assert_eq!(layout.global_position(rank, i as u64), pos);
                        }
                        total += layout.local_len(n, rank);
                    }
                    assert_eq!(total, n);
                    let per_rank_pages: Vec<u64> = held
                        .iter()
                        .map(|h| (h.len() as u64).div_ceil(u64::from(tpb)))
                        .collect();
                    assert_eq!(
                        layout.superblocks_for(n),
                        per_rank_pages.iter().copied().max().unwrap_or(0)
                    );
                }
            }
        }
    }

    #[test]
    fn slot_uses_the_owner_page_of_the_superblock() {
        let layout = Layout::new(2, 4).unwrap();
        let table = [7, 3];
        // pos 9: superblock 1 (page 3), offset 1 -> slot 13, owner rank 0.
        assert_eq!(layout.slot(9, &table), Some(13));
        assert_eq!(layout.owner_rank(9), 0);
        assert_eq!(layout.slot(5, &table), Some(29));
        assert_eq!(layout.slot(16, &table), None);
    }

    #[test]
    fn batch_slot_mapping_matches_slot_and_checks_everything_first() {
        let layout = Layout::new(2, 4).unwrap();
        // Two rows of two superblocks; row 1 holds one superblock (padded with -1).
        let table = [7, 3, 5, -1];
        let rows = [0, 0, 0, 1, 1];
        let positions = [0, 5, 9, 2, 6];
        for rank in 0..2 {
            let mut out = Vec::new();
            layout
                .slot_mapping_into(&table, 2, &rows, &positions, rank, &mut out)
                .unwrap();
            let expected: Vec<i64> = rows
                .iter()
                .zip(&positions)
                .map(|(&row, &pos)| {
                    let pages: Vec<u32> = table[usize::try_from(row).unwrap() * 2..][..2]
                        .iter()
                        .filter(|&&p| p >= 0)
                        .map(|&p| u32::try_from(p).unwrap())
                        .collect();
                    if layout.owner_rank(pos) == rank {
                        i64::try_from(layout.slot(pos, &pages).unwrap()).unwrap()
                    } else {
                        -1
                    }
                })
                .collect();
            assert_eq!(out, expected, "rank {rank}");
        }
        let mut out = vec![42];
        for (rows, positions, rank) in [
            (&[0, 2][..], &[0, 0][..], 0),  // row outside the table
            (&[0, 1][..], &[0, 9][..], 0),  // row 1's second superblock is padding
            (&[0, 1][..], &[0, 17][..], 0), // past the table's width
            (&[0][..], &[0, 1][..], 0),     // lengths differ
            (&[0][..], &[0][..], 2),        // rank outside the group
        ] {
            let err = layout
                .slot_mapping_into(&table, 2, rows, positions, rank, &mut out)
                .unwrap_err();
            assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
        }
        assert_eq!(out, [42]);
    }

    #[test]
    fn checked_global_position_refuses_what_does_not_fit() {
        let layout = Layout::new(2, 4).unwrap();
        assert_eq!(layout.checked_global_position(1, 5), Some(13));
        assert_eq!(
            layout.checked_global_position(1, 5),
            Some(layout.global_position(1, 5))
        );
        assert_eq!(
            layout.checked_global_position(1, 1 << 62),
            Some((1 << 63) + 4)
        );
        assert_eq!(layout.checked_global_position(1, 1 << 63), None);
        assert_eq!(layout.checked_global_position(0, u64::MAX), None);
        let plain = Layout::new(1, 1).unwrap();
        assert_eq!(plain.checked_global_position(0, u64::MAX), Some(u64::MAX));
    }

    #[test]
    fn rejects_degenerate_layouts() {
        assert!(matches!(Layout::new(0, 4), Err(CoreError::Config { .. })));
        assert!(matches!(Layout::new(2, 0), Err(CoreError::Config { .. })));
        assert!(matches!(
            Layout::new(1 << 16, 1 << 16),
            Err(CoreError::Config { .. })
        ));
        assert!(Layout::new(2, 4).unwrap().check_rank(2).is_err());
    }
}
