//! Division-free Helix placement for the per-step hot path. The layout's closed forms
//! divide by `tokens_per_block` and by `tokens_per_block * cp`; a step needs them for
//! every decode request, and a 64-bit division costs more than the rest of the
//! per-request work, so the divisors are prepared once.

use crate::error::Result;
use crate::layout::Layout;

/// Division by a divisor fixed in advance: a shift for powers of two, otherwise a
/// multiply by `ceil(2^64 / d)`, exact for every dividend below 2^32 (Lemire, Kaser and
/// Kurz, "Faster remainder by direct computation", 2019); larger dividends divide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Divisor {
    value: u64,
    shift: Option<u32>,
    magic: u64,
}

impl Divisor {
    pub fn new(divisor: u64) -> Self {
        debug_assert!(divisor >= 1 && u32::try_from(divisor).is_ok());
        if divisor.is_power_of_two() {
            Self {
                value: divisor,
                shift: Some(divisor.trailing_zeros()),
                magic: 0,
            }
        } else {
            Self {
                value: divisor,
                shift: None,
                magic: u64::MAX / divisor + 1,
            }
        }
    }

    pub fn div(self, n: u64) -> u64 {
        match self.shift {
            Some(shift) => n >> shift,
            None if u32::try_from(n).is_ok() => {
                ((u128::from(self.magic) * u128::from(n)) >> 64) as u64
            }
            None => n / self.value,
        }
    }

    /// `n % divisor`.
    pub fn rem(self, n: u64) -> u64 {
        match self.shift {
            Some(_) => n & (self.value - 1),
            None => n - self.div(n) * self.value,
        }
    }
}

/// Where a decode token goes and what one rank holds around it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlacement {
    /// Rank that appends the token.
    pub owner: u32,
    /// Tokens the viewing rank holds before the token.
    pub past_seen_len: u64,
    /// Tokens the viewing rank holds after it.
    pub local_len: u64,
}

/// The layout's closed forms with prepared divisors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Placement {
    tokens_per_block: u64,
    per_block: Divisor,
    per_superblock: Divisor,
}

impl Placement {
    pub fn new(layout: Layout) -> Self {
        Self {
            tokens_per_block: u64::from(layout.tokens_per_block()),
            per_block: Divisor::new(u64::from(layout.tokens_per_block())),
            per_superblock: Divisor::new(layout.tokens_per_superblock()),
        }
    }

    /// The decode token at global position `position`, seen from `rank`.
    #[inline]
    pub fn decode(self, position: u64, rank: u32) -> DecodePlacement {
        if let (Some(block), Some(superblock)) = (self.per_block.shift, self.per_superblock.shift) {
            return Self::decode_shifted(block, superblock, position, rank);
        }
        self.decode_general(position, rank)
    }

    /// [`Self::decode`] where `tokens_per_block` is `2^block` and `tokens_per_superblock`
    /// is `2^superblock` (the usual layouts): shifts and masks alone.
    #[inline]
    pub fn decode_shifted(
        block: u32,
        superblock: u32,
        position: u64,
        rank: u32,
    ) -> DecodePlacement {
        let tokens_per_block = 1u64 << block;
        let full = position >> superblock;
        let into_superblock = position & ((1u64 << superblock) - 1);
        #[expect(
            clippy::cast_possible_truncation,
            reason = "`into_superblock < tpb * cp`, so the block inside the superblock is below cp, a u32"
        )]
        let owner = (into_superblock >> block) as u32;
        let before_rank = u64::from(rank) << block;
        let past_seen_len = (full << block)
            + into_superblock
                .saturating_sub(before_rank)
                .min(tokens_per_block);
        DecodePlacement {
            owner,
            past_seen_len,
            local_len: past_seen_len + u64::from(owner == rank),
        }
    }

    /// [`Self::decode`] for any layout (divisions).
    pub fn decode_general(self, position: u64, rank: u32) -> DecodePlacement {
        let full = self.per_superblock.div(position);
        let into_superblock = position - full * self.per_superblock.value;
        #[expect(
            clippy::cast_possible_truncation,
            reason = "`into_superblock < tpb * cp`, so the block inside the superblock is below cp, a u32"
        )]
        let owner = self.per_block.div(into_superblock) as u32;
        let before_rank = u64::from(rank) * self.tokens_per_block;
        let past_seen_len = full * self.tokens_per_block
            + into_superblock
                .saturating_sub(before_rank)
                .min(self.tokens_per_block);
        DecodePlacement {
            owner,
            past_seen_len,
            local_len: past_seen_len + u64::from(owner == rank),
        }
    }
}

/// One rank's place in its CP group's layout, as a
/// [`ScheduleOutput`](super::ScheduleOutput) carries it: what the output's computed columns
/// ([`ScheduleOutput::COMPUTED_FIELDS`](super::ScheduleOutput::COMPUTED_FIELDS): the
/// owner ranks and this rank's share) are computed from, with the positions. Equal for two ranks only when they are the same rank
/// of the same layout.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RankPlacement {
    layout: Layout,
    cp_rank: u32,
    /// `layout`'s closed forms with prepared divisors (a function of `layout`).
    placement: Placement,
}

impl RankPlacement {
    /// Rank `cp_rank` of `layout`; fails (`InvalidArgument`) unless it is a rank of the
    /// group.
    pub fn new(layout: Layout, cp_rank: u32) -> Result<Self> {
        layout.check_rank(cp_rank)?;
        Ok(Self {
            layout,
            cp_rank,
            placement: Placement::new(layout),
        })
    }

    /// The rank.
    pub fn cp_rank(self) -> u32 {
        self.cp_rank
    }

    /// Ranks in the group.
    pub fn cp_size(self) -> u32 {
        self.layout.cp()
    }

    /// Tokens in one page on one rank.
    pub fn tokens_per_block(self) -> u32 {
        self.layout.tokens_per_block()
    }

    /// The group's layout.
    pub fn layout(self) -> Layout {
        self.layout
    }

    /// Each decode token's placement seen from this rank (owner, local and past-seen
    /// lengths), for the columns below.
    fn placed(self, positions: &[u64]) -> impl ExactSizeIterator<Item = DecodePlacement> + '_ {
        positions
            .iter()
            .map(move |&p| self.placement.decode(p, self.cp_rank))
    }

    /// The decode token at `position` seen from this rank: what the columns below give for
    /// it, one row at a time.
    pub fn decode_at(self, position: u64) -> DecodePlacement {
        self.placement.decode(position, self.cp_rank)
    }

    /// For each decode token at `positions`: the rank that appends it (its owner,
    /// `(position / tokens_per_block) % cp_size`; the same for every rank).
    pub fn owner_ranks(self, positions: &[u64]) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.placed(positions).map(|placed| placed.owner)
    }

    /// For each decode token at `positions`: whether this rank appends it (is its owner).
    pub fn active(self, positions: &[u64]) -> impl ExactSizeIterator<Item = bool> + '_ {
        self.placed(positions)
            .map(move |placed| placed.owner == self.cp_rank)
    }

    /// For each decode token at `positions`: tokens this rank holds after its append.
    pub fn local_lens(self, positions: &[u64]) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.placed(positions).map(|placed| placed.local_len)
    }

    /// For each decode token at `positions`: tokens this rank holds before its append.
    pub fn past_seen_lens(self, positions: &[u64]) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.placed(positions).map(|placed| placed.past_seen_len)
    }
}

/// Rank 0 of the plain layout (`cp_size` 1, one token per page): what an output not made
/// by a scheduler carries.
impl Default for RankPlacement {
    fn default() -> Self {
        let layout = Layout::new(1, 1).expect("the plain layout is valid");
        Self::new(layout, 0).expect("rank 0 is in every group")
    }
}

/// The rank and the layout (the prepared divisors are left out).
impl std::fmt::Debug for RankPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankPlacement")
            .field("cp_rank", &self.cp_rank)
            .field("cp_size", &self.cp_size())
            .field("tokens_per_block", &self.tokens_per_block())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::xorshift;

    #[test]
    fn matches_the_layout_closed_forms() {
        for cp in [1, 2, 3, 4, 6, 8] {
            for tpb in [1, 2, 3, 5, 16, 32, 48] {
                let layout = Layout::new(cp, tpb).unwrap();
                let placement = Placement::new(layout);
                let span = u64::from(cp * tpb);
                let probes = (0..4 * span + 3).chain([
                    u64::from(u32::MAX) - 1,
                    u64::from(u32::MAX),
                    1 << 33,
                    (1 << 40) + 7,
                ]);
                for pos in probes {
                    for rank in 0..cp {
                        let got = placement.decode(pos, rank);
                        assert_eq!(
                            got.owner,
                            layout.owner_rank(pos),
                            "cp={cp} tpb={tpb} pos={pos}"
                        );
                        assert_eq!(got.past_seen_len, layout.local_len(pos, rank));
                        assert_eq!(got.local_len, layout.local_len(pos + 1, rank));
                    }
                }
            }
        }
    }

    #[test]
    fn divides_and_takes_remainders_exactly_below_and_above_two_to_the_32() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for divisor in [1u64, 3, 7, 96, 1000, 65_537, (1 << 24) - 1, 1 << 24] {
            let prepared = Divisor::new(divisor);
            for _ in 0..20_000 {
                let seed = next();
                let n = if seed & 1 == 0 {
                    seed >> 32
                } else {
                    seed >> 20
                };
                assert_eq!(prepared.div(n), n / divisor, "{n} / {divisor}");
                assert_eq!(prepared.rem(n), n % divisor, "{n} % {divisor}");
            }
            assert_eq!(
                prepared.div(u64::from(u32::MAX)),
                u64::from(u32::MAX) / divisor
            );
        }
    }
}
