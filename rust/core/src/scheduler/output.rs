//! What one step decided: flat arrays, ready to hand to numpy without a per-request
//! loop, plus a digest, a summary as `(entry, value)` pairs and a field-by-field comparison
//! for cross-rank checks.
//!
//! The fields are listed once, in [`schedule_output_fields!`](crate::schedule_output_fields):
//! the struct, [`ScheduleOutput::FIELDS`], `clear` and [`ScheduleOutput::differing_fields`]
//! here, and the Python class with its getters and field lists in the binding, are all built
//! from that list, so adding a field is one edit there (plus its place in the digest, which
//! [`ScheduleOutput::compute_digest`] makes a compile error to forget).
//!
//! The owner rank of each decode token and this rank's share of the decodes (whether it
//! appends each token, what it holds before and after) are not stored: they are functions of
//! the positions, the rank and the layout, so the output carries the rank's
//! [`RankPlacement`] and computes those columns on demand. Nor is `sample_ids`, the order of
//! the tokens `update` takes: the generation ids, then the completing context ids
//! ([`ScheduleOutput::sample_ids`]; [`ScheduleOutput::num_samples`] counts them). All of
//! them are listed in [`ScheduleOutput::COMPUTED_FIELDS`].

use std::fmt::Write as _;

use crate::digest::{bits, LaneDigest};
use crate::error::{CoreError, Result};
use crate::ids::RequestId;

use super::placement::RankPlacement;

/// Hands the field list of [`ScheduleOutput`] to another macro:
/// `schedule_output_fields!(callback! { args })` expands to
/// `callback! { { args } fields... }`.
///
/// Each field is its doc comment, its scope (`invariant`: identical on every rank of a CP
/// group; `rank`: this rank's share, different by design), its name and its type: `[T]` for
/// an array (a `Vec<T>`), a bare type for a scalar. Element types are `RequestId`, `u64`
/// (lengths, positions, counts), `u32` (ranks), `i32` (batch slots, token and block ids) and
/// `bool`; the caller has them in scope.
#[macro_export]
macro_rules! schedule_output_fields {
    ($callback:ident ! { $($args:tt)* }) => {
        $callback! {
            { $($args)* }
            /// Step number; every successful `schedule()` takes a new one, reverted or not.
            invariant step: u64,
            /// Requests with a prompt chunk this step, in queue order.
            invariant context_ids: [RequestId],
            /// Global position of each chunk's first token.
            invariant context_starts: [u64],
            /// Tokens in each chunk.
            invariant context_lens: [u64],
            /// Tokens of each chunk's request found in the prefix cache as it was admitted (0
            /// for a later chunk, or without prefix caching): the chunk starts right after
            /// them, and its block table names their (shared) pages first.
            invariant context_cached_lens: [u64],
            /// Whether the chunk completes the prompt (its last logits are sampled).
            invariant context_completes: [bool],
            /// Batch slot of each context entry.
            invariant context_batch_slots: [i32],
            /// The chunks' tokens concatenated in entry order (re-prefills include the folded
            /// generated tokens).
            invariant context_token_ids: [i32],
            /// Requests decoding one token this step, in queue order.
            invariant generation_ids: [RequestId],
            /// Global position of the token being written.
            invariant generation_positions: [u64],
            /// The token fed at that position (the request's last token), or -1 while that
            /// token is still in flight (see `generation_input_refs`).
            invariant generation_input_tokens: [i32],
            /// Where each entry's input token is: -1 when it is known and given in
            /// `generation_input_tokens`; `r >= 0` when it is still being sampled by the
            /// previous step (this step was scheduled one step ahead): row `r` of that
            /// step's sampled tokens (its `sample_ids` order), which the executor gathers
            /// on the device.
            invariant generation_input_refs: [i32],
            /// Batch slot of each generation entry.
            invariant generation_batch_slots: [i32],
            /// Draft tokens each generation entry verifies after its decode token (speculative
            /// decoding; 0 for none, and every entry 0 without drafts): the entry's query tokens
            /// are its input token then its drafts, at positions `position ..= position + count`,
            /// and `update` takes `1 + count` sampled tokens for it.
            invariant generation_draft_counts: [u64],
            /// The draft tokens, concatenated in generation entry order.
            invariant generation_draft_tokens: [i32],
            /// Requests recompute-paused this step, in the order chosen.
            invariant preempted_ids: [RequestId],
            /// For each preempted request, the request that needed its pages (always ahead
            /// of it in queue order).
            invariant preempted_requester_ids: [RequestId],
            /// Requests suspended to the host tier this step, in the order chosen.
            invariant suspended_ids: [RequestId],
            /// For each suspended request, the request that needed its pages.
            invariant suspended_requester_ids: [RequestId],
            /// The pages (superblock ids, the same on every rank) each suspended request
            /// held, concatenated in `suspended_ids` order. The executor copies them to the
            /// host tier before anything else writes KV, whether the step then runs or is
            /// reverted: the pool may hand them out again in this very step.
            invariant suspended_block_ids: [i32],
            /// How many of `suspended_block_ids` belong to each suspended request.
            invariant suspended_block_counts: [u64],
            /// The host page (host superblock id, the same on every rank) each page of
            /// `suspended_block_ids` is copied to, in the same order.
            invariant suspended_host_block_ids: [i32],
            /// Requests brought back from the host tier this step (they decode from the
            /// next). The executor copies their KV back in after copying this step's
            /// suspended pages out (a resume may reuse those pages) and before the step's
            /// attention reads them.
            invariant resumed_ids: [RequestId],
            /// The new pages (superblock ids) of each resumed request, concatenated in
            /// `resumed_ids` order: where its KV is copied back in.
            invariant resumed_block_ids: [i32],
            /// The host page each page of `resumed_block_ids` is copied from, in the same
            /// order. These host pages stay taken until the step is updated, so no suspend of
            /// the same step can overwrite them before the copy-in read them.
            invariant resumed_host_block_ids: [i32],
            /// How many of `resumed_block_ids` belong to each resumed request.
            invariant resumed_block_counts: [u64],
            /// Generation requests that found neither pages nor a victim; their batch slots
            /// were released. A request that sat out may later in the same step be preempted
            /// by an older context request and then also appears in `preempted_ids`.
            invariant sat_out_ids: [RequestId],
            /// Context tokens plus decode tokens scheduled.
            invariant num_tokens: u64,
            /// Fingerprint of every rank-invariant field, seeded with the configuration's
            /// fingerprint: equal on every rank that scheduled alike.
            invariant digest: u64,
        }
    };
}

/// Whether a field of a [`ScheduleOutput`] is the same on every rank of a CP group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FieldScope {
    /// Identical on every rank that scheduled alike.
    RankInvariant,
    /// This rank's share of the step (whether it appends, its local lengths). No stored
    /// field has it today: the per-rank columns are computed from the positions (see
    /// [`ScheduleOutput::COMPUTED_FIELDS`]).
    PerRank,
}

macro_rules! field_scope {
    (invariant) => {
        FieldScope::RankInvariant
    };
    (rank) => {
        FieldScope::PerRank
    };
}

macro_rules! field_type {
    ([$element:ty]) => { Vec<$element> };
    ($scalar:ty) => { $scalar };
}

macro_rules! clear_field {
    ($field:expr, [$element:ty]) => {
        $field.clear()
    };
    ($field:expr, $scalar:ty) => {
        $field = <$scalar>::default()
    };
}

macro_rules! field_capacity {
    ($field:expr, [$element:ty]) => {
        $field.capacity()
    };
    ($field:expr, $scalar:ty) => {
        0
    };
}

macro_rules! define_schedule_output {
    ({} $( $(#[doc = $doc:tt])* $scope:ident $name:ident : $kind:tt ),* $(,)?) => {
        /// The schedule of one step. Every field is identical on every rank of a CP group
        /// except the per-rank ones (see [`ScheduleOutput::FIELDS`]) and `rank_placement`;
        /// the owner ranks and this rank's share of the decodes are computed from the
        /// positions and `rank_placement`, `sample_ids` from the generation and context
        /// entries (see [`ScheduleOutput::COMPUTED_FIELDS`]). Two ranks' outputs of the
        /// same step are equal only if they are the same rank.
        #[derive(Debug, Clone, PartialEq, Eq, Default)]
        pub struct ScheduleOutput {
            $( $(#[doc = $doc])* pub $name: field_type!($kind), )*
            /// The rank this output is for and its group's layout: what the computed columns
            /// are computed from. Set when the scheduler is built (and kept by every step);
            /// rank 0 of the plain layout in a default output. Not digested.
            pub rank_placement: RankPlacement,
        }

        impl ScheduleOutput {
            /// Every stored field, in declaration order, with its scope (`rank_placement`
            /// and the computed columns are not listed: [`Self::all_fields`] has those).
            pub const FIELDS: &'static [(&'static str, FieldScope)] =
                &[$( (stringify!($name), field_scope!($scope)) ),*];

            /// Empties every field, keeping the allocations (and `rank_placement`) for the
            /// next step.
            pub(super) fn clear(&mut self, step: u64) {
                $( clear_field!(self.$name, $kind); )*
                self.step = step;
            }

            /// Elements the array fields have room for, all together: which of two
            /// buffers to build the next step in (see `Scheduler::recycle_output`).
            pub(super) fn capacity(&self) -> usize {
                0 $( + field_capacity!(self.$name, $kind) )*
            }

            /// The rank-invariant fields in which `other` differs from `self`, in the
            /// order of [`Self::all_fields`] (the digest among them when it differs; the
            /// computed owner ranks and `sample_ids` compared as computed): what two ranks
            /// that disagree disagree on.
            pub fn differing_fields(&self, other: &Self) -> Vec<&'static str> {
                let mut names = Vec::new();
                $(
                    if field_scope!($scope) == FieldScope::RankInvariant
                        && self.$name != other.$name
                    {
                        names.push(stringify!($name));
                    }
                    self.push_differing_computed(other, stringify!($name), &mut names);
                )*
                names
            }
        }
    };
}

schedule_output_fields!(define_schedule_output! {});

/// The draft columns into `h`. Without drafts both hash as absent: the digests of steps
/// without speculative decoding are those of before it.
fn digest_drafts(h: &mut LaneDigest, counts: &[u64], tokens: &[i32]) {
    if counts.iter().all(|&count| count == 0) {
        return;
    }
    h.words(counts);
    h.word(tokens.len() as u64);
    h.stream(
        tokens
            .chunks(2)
            .map(|pair| pack(pair[0], pair.get(1).copied().unwrap_or(0))),
    );
}

/// Two 32-bit values in one digest word.
fn pack(low: i32, high: i32) -> u64 {
    bits(low) | (bits(high) << 32)
}

impl ScheduleOutput {
    /// The columns computed from stored fields when asked for: not stored, and not
    /// digested (the fields they come from are). Each with its scope and the stored field
    /// it is listed after in [`Self::all_fields`] (where it was once stored, for those that
    /// were), in that order:
    /// - [`Self::generation_owner_ranks`], one value per generation entry, the same on
    ///   every rank: from `generation_positions` and `rank_placement` (after the positions);
    /// - [`Self::sample_ids`], the same on every rank: the generation ids, then the ids of
    ///   the context entries that complete their prompt (after `sat_out_ids`);
    /// - this rank's share of the decodes, one value per generation entry, different by
    ///   rank by design, from `generation_positions` and `rank_placement`:
    ///   [`Self::generation_active`], [`Self::generation_local_lens`] and
    ///   [`Self::generation_past_seen_lens`] (listed last).
    pub const COMPUTED_FIELDS: &'static [(&'static str, FieldScope, &'static str)] = &[
        (
            "generation_owner_ranks",
            FieldScope::RankInvariant,
            "generation_positions",
        ),
        ("sample_ids", FieldScope::RankInvariant, "sat_out_ids"),
        ("generation_active", FieldScope::PerRank, "digest"),
        ("generation_local_lens", FieldScope::PerRank, "digest"),
        ("generation_past_seen_lens", FieldScope::PerRank, "digest"),
    ];

    /// Every field, stored and computed, with its scope: the stored fields of
    /// [`Self::FIELDS`] in declaration order, each followed by the
    /// [`Self::COMPUTED_FIELDS`] listed after it (in that list's order).
    pub fn all_fields() -> impl Iterator<Item = (&'static str, FieldScope)> {
        Self::FIELDS.iter().flat_map(|&(stored, scope)| {
            let computed = Self::COMPUTED_FIELDS
                .iter()
                .filter(move |(_, _, after)| *after == stored)
                .map(|&(name, scope, _)| (name, scope));
            std::iter::once((stored, scope)).chain(computed)
        })
    }

    /// The names with `scope`, in the order of [`Self::all_fields`] (stored and computed).
    pub fn fields_with_scope(scope: FieldScope) -> impl Iterator<Item = &'static str> {
        Self::all_fields()
            .filter(move |(_, s)| *s == scope)
            .map(|(name, _)| name)
    }

    /// Adds to `names` the rank-invariant computed columns listed after the stored field
    /// `after` whose values differ between `self` and `other` (see
    /// [`Self::differing_fields`]).
    fn push_differing_computed(&self, other: &Self, after: &str, names: &mut Vec<&'static str>) {
        for &(name, scope, listed_after) in Self::COMPUTED_FIELDS {
            if scope != FieldScope::RankInvariant || listed_after != after {
                continue;
            }
            let differs = match name {
                "generation_owner_ranks" => self
                    .generation_owner_ranks()
                    .ne(other.generation_owner_ranks()),
                "sample_ids" => self.sample_ids().ne(other.sample_ids()),
                _ => unreachable!("{name} is no rank-invariant computed column"),
            };
            if differs {
                names.push(name);
            }
        }
    }

    /// The rank that appends each generation entry's token (the same on every rank):
    /// `(position // tokens_per_block) % cp_size`. Computed from `generation_positions`
    /// and `rank_placement` (not stored, not digested: a function of the positions).
    pub fn generation_owner_ranks(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.rank_placement.owner_ranks(&self.generation_positions)
    }

    /// The requests whose tokens `update` takes, in the order it takes them: the
    /// generation ids, then the ids of the context entries whose chunk completes the prompt
    /// (`context_completes`), each group in entry order. Row `r` of a step's sampled tokens
    /// is the token of the `r`-th; [`Self::num_samples`] of them. Computed from the
    /// entries (not stored, not digested: a function of the fields that are).
    pub fn sample_ids(&self) -> impl ExactSizeIterator<Item = RequestId> + '_ {
        Self::sample_ids_of(
            &self.generation_ids,
            &self.generation_draft_counts,
            &self.context_ids,
            &self.context_completes,
        )
    }

    /// [`Self::sample_ids`] from the fields it is made of (for the binding, which lends
    /// them where they lie): each of `generation_ids` `1 + draft count` times (an empty
    /// `generation_draft_counts` is no drafts), then each of `context_ids` whose entry of
    /// `context_completes` is set.
    pub fn sample_ids_of<'a>(
        generation_ids: &'a [RequestId],
        generation_draft_counts: &'a [u64],
        context_ids: &'a [RequestId],
        context_completes: &'a [bool],
    ) -> impl ExactSizeIterator<Item = RequestId> + 'a {
        let counts =
            &generation_draft_counts[..generation_ids.len().min(generation_draft_counts.len())];
        let drafts: u64 = counts.iter().sum();
        SampleIds {
            generation: generation_ids,
            draft_counts: counts,
            entry: 0,
            repeats: 0,
            context: context_ids.iter().zip(context_completes),
            left: Self::num_samples_of(
                generation_ids.len(),
                usize::try_from(drafts).unwrap_or(usize::MAX),
                &context_completes[..context_ids.len().min(context_completes.len())],
            ),
        }
    }

    /// How many tokens `update` takes for this step: the generation entries plus the
    /// context entries that complete their prompt (the length of [`Self::sample_ids`],
    /// counted without making it).
    pub fn num_samples(&self) -> usize {
        Self::num_samples_of(
            self.generation_ids.len(),
            self.generation_draft_tokens.len(),
            &self.context_completes,
        )
    }

    /// How many samples a step of `generation_entries` generation entries verifying
    /// `draft_tokens` drafts in all, and these context flags, has: `1 + drafts` rows per
    /// generation entry, then one per context entry whose chunk completes. The one count
    /// behind [`Self::num_samples`], [`Self::sample_ids_of`] and the binding's `num_samples`.
    pub fn num_samples_of(
        generation_entries: usize,
        draft_tokens: usize,
        context_completes: &[bool],
    ) -> usize {
        generation_entries + draft_tokens + context_completes.iter().filter(|&&c| c).count()
    }

    /// This rank's share, for each generation entry: whether this rank is the owner of
    /// the token (appends its KV). Computed from `generation_positions` and
    /// `rank_placement` (not stored, not digested).
    pub fn generation_active(&self) -> impl ExactSizeIterator<Item = bool> + '_ {
        self.rank_placement.active(&self.generation_positions)
    }

    /// This rank's share, for each generation entry: tokens this rank holds after the
    /// append. Computed from `generation_positions` and `rank_placement` (not stored, not
    /// digested).
    pub fn generation_local_lens(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.rank_placement.local_lens(&self.generation_positions)
    }

    /// This rank's share, for each generation entry: tokens this rank holds before the
    /// append. Computed from `generation_positions` and `rank_placement` (not stored, not
    /// digested).
    pub fn generation_past_seen_lens(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.rank_placement
            .past_seen_lens(&self.generation_positions)
    }

    /// The summary's entries in order, each with the fields its value shows. A difference
    /// in a shown field always changes that entry's text; fields no entry shows (tokens,
    /// suspended pages, the computed `sample_ids`) are compared by
    /// [`Self::differing_fields`] only.
    pub const SUMMARY_ENTRIES: &'static [(&'static str, &'static [&'static str])] = &[
        ("step", &["step"]),
        ("num_tokens", &["num_tokens"]),
        (
            "context",
            &[
                "context_ids",
                "context_starts",
                "context_lens",
                "context_completes",
            ],
        ),
        ("incomplete_prompts", &["context_completes"]),
        (
            "generation",
            &[
                "generation_ids",
                "generation_positions",
                "generation_owner_ranks",
            ],
        ),
        ("preempted", &["preempted_ids", "preempted_requester_ids"]),
        ("suspended", &["suspended_ids", "suspended_requester_ids"]),
        ("resumed", &["resumed_ids"]),
        ("sat_out", &["sat_out_ids"]),
        (
            "batch_slots",
            &["context_batch_slots", "generation_batch_slots"],
        ),
        ("digest", &["digest"]),
    ];

    /// The fingerprint of every rank-invariant field, array by array (each with its
    /// length), seeded with the scheduler's configuration fingerprint
    /// ([`super::SchedulerConfig::fingerprint`]): two ranks built from different
    /// configurations get different digests even for a step whose fields agree. The
    /// computed columns ([`Self::COMPUTED_FIELDS`]) are not fields: they are covered
    /// through the fields they come from (the owner ranks through the positions,
    /// `sample_ids` through the generation ids and the completing context ids; its length,
    /// [`Self::num_samples`], ends the digest as it did when it was stored). A generation
    /// entry's four values (id, position, input token, batch slot) share one word
    /// (`id * odd ^ position ^ (token, slot) * odd'`: still any single-field difference
    /// changes it).
    pub fn compute_digest(&self, config_fingerprint: u64) -> u64 {
        // Every field is named here, so a new one cannot be left out of the digest by
        // accident: the destructuring stops compiling until it is hashed or skipped.
        let Self {
            step,
            context_ids,
            context_starts,
            context_lens,
            context_cached_lens,
            context_completes,
            context_batch_slots,
            context_token_ids,
            generation_ids,
            generation_positions,
            generation_input_tokens,
            generation_input_refs,
            generation_batch_slots,
            generation_draft_counts,
            generation_draft_tokens,
            preempted_ids,
            preempted_requester_ids,
            suspended_ids,
            suspended_requester_ids,
            suspended_block_ids,
            suspended_block_counts,
            suspended_host_block_ids,
            resumed_ids,
            resumed_block_ids,
            resumed_host_block_ids,
            resumed_block_counts,
            sat_out_ids,
            num_tokens,
            digest: _,
            rank_placement: _, // per rank (the layout is in the configuration's fingerprint)
        } = self;
        let mut h = LaneDigest::new();
        h.word(config_fingerprint);
        h.word(*step);
        h.word(*num_tokens);
        h.words(context_ids);
        h.words(context_starts);
        h.words(context_lens);
        if context_cached_lens.iter().any(|&cached| cached != 0) {
            // Without a hit the column hashes as absent: the digests of steps without prefix
            // caching are those of before it.
            h.words(context_cached_lens);
        }
        h.flags(context_completes);
        h.stream(context_batch_slots.iter().map(|&v| bits(v)));
        let tokens = context_token_ids
            .chunks(2)
            .map(|pair| pack(pair[0], pair.get(1).copied().unwrap_or(0)));
        h.word(context_token_ids.len() as u64);
        h.stream(tokens);
        // The generation arrays have one value per entry (as `check_lengths` requires);
        // an output that breaks that is digested over the shortest, as before.
        // One word per entry, of its four values: a chain step per entry instead of one per
        // pair of values halves the digest's time (its chains are what it waits on). The id
        // and the token with batch slot are multiplied by different odd constants (outside
        // the chains), so a difference in any one field changes the word. The arrays have one
        // value per entry (as `check_lengths` requires); an output that breaks that is
        // digested over the shortest.
        let entries = generation_ids
            .len()
            .min(generation_positions.len())
            .min(generation_input_tokens.len())
            .min(generation_batch_slots.len());
        let ids = &generation_ids[..entries];
        let positions = &generation_positions[..entries];
        let tokens = &generation_input_tokens[..entries];
        let slots = &generation_batch_slots[..entries];
        h.stream_indexed(entries, |i| {
            ids[i].wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ positions[i]
                ^ pack(tokens[i], slots[i]).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        });
        // Without a step planned ahead every row is -1: one word says so (the count is the
        // generation entries', hashed above). Otherwise two rows a word. The test is a fold
        // without an early exit (`!row` is 0 only for -1), which the compiler vectorises: a
        // scalar `all` was a fifth of the digest's time at N=1024.
        if generation_input_refs.iter().fold(0, |acc, &row| acc | !row) == 0 {
            h.word(0);
        } else {
            let rows = generation_input_refs
                .chunks(2)
                .map(|pair| pack(pair[0], pair.get(1).copied().unwrap_or(0)));
            h.stream(rows);
        }
        digest_drafts(&mut h, generation_draft_counts, generation_draft_tokens);
        for ids in [
            preempted_ids,
            preempted_requester_ids,
            suspended_ids,
            suspended_requester_ids,
            suspended_block_counts,
            resumed_ids,
            resumed_block_counts,
            sat_out_ids,
        ] {
            h.words(ids);
        }
        for pages in [
            suspended_block_ids,
            suspended_host_block_ids,
            resumed_block_ids,
            resumed_host_block_ids,
        ] {
            h.stream(pages.iter().map(|&v| bits(v)));
        }
        h.word(self.num_samples() as u64);
        h.finish()
    }

    /// Fails (`InvalidArgument`) unless `digest` is what [`Self::compute_digest`] gives for
    /// the fields under `config_fingerprint` (the seed the scheduler used): an output whose
    /// fields were changed after it was scheduled, its digest kept, is refused. The binding
    /// checks an output rebuilt from Python (unpickled) with it, after [`Self::check_lengths`].
    pub fn check_digest(&self, config_fingerprint: u64) -> Result<()> {
        let computed = self.compute_digest(config_fingerprint);
        if computed == self.digest {
            return Ok(());
        }
        Err(CoreError::InvalidArgument(format!(
            "the digest of step {} (0x{:016x}) is not the digest of its fields under configuration \
             fingerprint 0x{config_fingerprint:016x} (0x{computed:016x}): the output was changed \
             after it was scheduled",
            self.step, self.digest
        )))
    }

    /// Fails (`InvalidArgument`) unless the arrays fit together the way a schedule makes
    /// them: one value per entry in each of the context, generation, preempted and
    /// suspended groups, `suspended_block_counts` adding up to the suspended pages,
    /// `context_lens` to the context tokens, and `generation_draft_counts` (one per
    /// generation entry, or none: no drafts) to the draft tokens (`sample_ids`, computed,
    /// fits by construction). [`Self::summary`] relies on it; the binding checks an output rebuilt
    /// from Python (unpickled) with it.
    pub fn check_lengths(&self) -> Result<()> {
        let groups: [(&str, &[usize]); 6] = [
            (
                "context",
                &[
                    self.context_ids.len(),
                    self.context_starts.len(),
                    self.context_lens.len(),
                    self.context_cached_lens.len(),
                    self.context_completes.len(),
                    self.context_batch_slots.len(),
                ],
            ),
            (
                "generation",
                &[
                    self.generation_ids.len(),
                    self.generation_positions.len(),
                    self.generation_input_tokens.len(),
                    self.generation_input_refs.len(),
                    self.generation_batch_slots.len(),
                ],
            ),
            (
                "preempted",
                &[self.preempted_ids.len(), self.preempted_requester_ids.len()],
            ),
            (
                "suspended",
                &[
                    self.suspended_ids.len(),
                    self.suspended_requester_ids.len(),
                    self.suspended_block_counts.len(),
                ],
            ),
            (
                "resumed",
                &[self.resumed_ids.len(), self.resumed_block_counts.len()],
            ),
            (
                "copied page",
                &[
                    self.suspended_block_ids.len(),
                    self.suspended_host_block_ids.len(),
                ],
            ),
        ];
        for (group, lengths) in groups {
            if lengths.iter().any(|&len| len != lengths[0]) {
                return Err(CoreError::InvalidArgument(format!(
                    "the {group} arrays of a schedule must have one value per entry, got lengths {lengths:?}"
                )));
            }
        }
        self.check_draft_lengths()?;
        let total = |values: &[u64]| values.iter().try_fold(0u64, |sum, &v| sum.checked_add(v));
        let sums = [
            (
                "suspended_block_counts",
                total(&self.suspended_block_counts),
                "suspended_block_ids",
                self.suspended_block_ids.len(),
            ),
            (
                "resumed_block_counts",
                total(&self.resumed_block_counts),
                "resumed_block_ids",
                self.resumed_block_ids.len(),
            ),
            (
                "resumed_block_counts",
                total(&self.resumed_block_counts),
                "resumed_host_block_ids",
                self.resumed_host_block_ids.len(),
            ),
            (
                "context_lens",
                total(&self.context_lens),
                "context_token_ids",
                self.context_token_ids.len(),
            ),
        ];
        for (counts, sum, values, len) in sums {
            if sum != Some(len as u64) {
                return Err(CoreError::InvalidArgument(format!(
                    "{counts} must add up to the {len} values of {values}"
                )));
            }
        }
        Ok(())
    }

    /// The draft columns of [`Self::check_lengths`]: `generation_draft_counts` holds one
    /// value per generation entry (or none: no drafts) and adds up to the draft tokens.
    fn check_draft_lengths(&self) -> Result<()> {
        let (entries, counts) = (
            self.generation_ids.len(),
            self.generation_draft_counts.len(),
        );
        if counts != 0 && counts != entries {
            return Err(CoreError::InvalidArgument(format!(
                "generation_draft_counts must have one value per generation entry (or none: no \
                 drafts), got {counts} for {entries} entries"
            )));
        }
        let total = self
            .generation_draft_counts
            .iter()
            .try_fold(0u64, |sum, &v| sum.checked_add(v));
        let tokens = self.generation_draft_tokens.len();
        if total != Some(tokens as u64) {
            return Err(CoreError::InvalidArgument(format!(
                "generation_draft_counts must add up to the {tokens} values of generation_draft_tokens"
            )));
        }
        Ok(())
    }

    /// Ids of context entries whose chunk does not complete the prompt.
    pub fn incomplete_prompt_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.context_ids
            .iter()
            .zip(&self.context_completes)
            .filter(|(_, &completes)| !completes)
            .map(|(&id, _)| id)
    }

    /// The summary as `(entry, value)` pairs, the entries of [`Self::SUMMARY_ENTRIES`] in
    /// order; rank-dependent fields are left out. Values are stable text (items separated
    /// by one space), so two ranks' entries compare as strings.
    pub fn summary_fields(&self) -> Vec<(&'static str, String)> {
        fn ids(ids: impl IntoIterator<Item = RequestId>) -> String {
            let mut out = Words::default();
            for id in ids {
                out.push(format_args!("{id}"));
            }
            out.0
        }
        fn victims(victims: &[RequestId], requesters: &[RequestId]) -> String {
            let mut out = Words::default();
            for (victim, requester) in victims.iter().zip(requesters) {
                out.push(format_args!("{victim}(for {requester})"));
            }
            out.0
        }
        let mut context = Words::default();
        for i in 0..self.context_ids.len() {
            let marker = if self.context_completes[i] { "" } else { "!" };
            context.push(format_args!(
                "{}:{}+{}{marker}",
                self.context_ids[i], self.context_starts[i], self.context_lens[i]
            ));
        }
        let mut generation = Words::default();
        let entries = self.generation_ids.iter().zip(&self.generation_positions);
        for ((id, position), owner) in entries.zip(self.generation_owner_ranks()) {
            generation.push(format_args!("{id}@{position}/r{owner}"));
        }
        let mut batch_slots = Words::default();
        let slots = self.context_ids.iter().zip(&self.context_batch_slots);
        for (id, slot) in slots.chain(self.generation_ids.iter().zip(&self.generation_batch_slots))
        {
            batch_slots.push(format_args!("{id}={slot}"));
        }
        vec![
            ("step", self.step.to_string()),
            ("num_tokens", self.num_tokens.to_string()),
            ("context", context.0),
            ("incomplete_prompts", ids(self.incomplete_prompt_ids())),
            ("generation", generation.0),
            (
                "preempted",
                victims(&self.preempted_ids, &self.preempted_requester_ids),
            ),
            (
                "suspended",
                victims(&self.suspended_ids, &self.suspended_requester_ids),
            ),
            ("resumed", ids(self.resumed_ids.iter().copied())),
            ("sat_out", ids(self.sat_out_ids.iter().copied())),
            ("batch_slots", batch_slots.0),
            ("digest", format!("{:016x}", self.digest)),
        ]
    }

    /// One `name: value` line per entry of [`Self::summary_fields`] (`name:` alone for an
    /// empty value), stable text so two ranks' summaries can be diffed line by line.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for (name, value) in self.summary_fields() {
            out.push_str(name);
            out.push(':');
            if !value.is_empty() {
                out.push(' ');
                out.push_str(&value);
            }
            out.push('\n');
        }
        out
    }
}

/// [`ScheduleOutput::sample_ids`]: the generation ids, then the completing context ids.
struct SampleIds<'a> {
    generation: &'a [RequestId],
    /// One per generation entry, or fewer (the rest have none).
    draft_counts: &'a [u64],
    /// The generation entry being given, and how many more times after this one.
    entry: usize,
    repeats: u64,
    context: std::iter::Zip<std::slice::Iter<'a, RequestId>, std::slice::Iter<'a, bool>>,
    /// Ids not yet given.
    left: usize,
}

impl Iterator for SampleIds<'_> {
    type Item = RequestId;

    fn next(&mut self) -> Option<RequestId> {
        if self.left == 0 {
            return None;
        }
        let id = if let Some(&id) = self.generation.get(self.entry) {
            if self.repeats == 0 {
                // Its first row: its drafts follow it.
                self.repeats = self.draft_counts.get(self.entry).copied().unwrap_or(0) + 1;
            }
            self.repeats -= 1;
            if self.repeats == 0 {
                self.entry += 1;
            }
            id
        } else {
            *self.context.find(|(_, &completes)| completes)?.0
        };
        self.left -= 1;
        Some(id)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for SampleIds<'_> {}

/// Space-separated items.
#[derive(Default)]
struct Words(String);

impl Words {
    fn push(&mut self, item: std::fmt::Arguments<'_>) {
        if !self.0.is_empty() {
            self.0.push(' ');
        }
        let _ = self.0.write_fmt(item);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Layout;
    use crate::test_rng::below;

    fn placement(cp: u32, tokens_per_block: u32, rank: u32) -> RankPlacement {
        RankPlacement::new(Layout::new(cp, tokens_per_block).unwrap(), rank).unwrap()
    }

    fn sample() -> ScheduleOutput {
        let mut out = ScheduleOutput {
            step: 3,
            context_ids: vec![4, 5],
            context_starts: vec![0, 16],
            context_lens: vec![8, 4],
            context_cached_lens: vec![0, 0],
            context_completes: vec![false, true],
            context_batch_slots: vec![0, 1],
            context_token_ids: (0..12).collect(),
            generation_ids: vec![1],
            generation_positions: vec![9],
            generation_input_tokens: vec![7],
            generation_input_refs: vec![-1],
            generation_batch_slots: vec![2],
            rank_placement: placement(2, 4, 0),
            preempted_ids: vec![6],
            preempted_requester_ids: vec![4],
            num_tokens: 13,
            ..ScheduleOutput::default()
        };
        out.digest = out.compute_digest(11);
        out
    }

    #[test]
    fn field_lists_cover_the_struct() {
        let names: Vec<_> = ScheduleOutput::FIELDS.iter().map(|(n, _)| *n).collect();
        let shown = format!("{:?}", ScheduleOutput::default());
        for (i, name) in names.iter().enumerate() {
            assert!(!names[..i].contains(name), "{name} listed twice");
            assert!(shown.contains(&format!(" {name}: ")), "{name} is no field");
        }
        // Every field is listed, but `rank_placement` (its three values shown inside it).
        let placement = format!("{:?}", RankPlacement::default());
        assert_eq!(
            placement,
            "RankPlacement { cp_rank: 0, cp_size: 1, tokens_per_block: 1, .. }"
        );
        assert!(shown.ends_with(&format!(", rank_placement: {placement} }}")));
        assert_eq!(shown.matches(": ").count(), names.len() + 1 + 3);
        // The computed columns: none stored, each listed after a stored field; every
        // stored field is rank-invariant, the per-rank names are computed columns.
        let computed: Vec<_> = ScheduleOutput::COMPUTED_FIELDS
            .iter()
            .map(|(n, _, _)| *n)
            .collect();
        assert_eq!(
            computed,
            [
                "generation_owner_ranks",
                "sample_ids",
                "generation_active",
                "generation_local_lens",
                "generation_past_seen_lens"
            ]
        );
        for (name, _, after) in ScheduleOutput::COMPUTED_FIELDS {
            assert!(!names.contains(name), "{name} is stored");
            assert!(names.contains(after), "{name} is listed after no field");
        }
        assert!(ScheduleOutput::FIELDS
            .iter()
            .all(|(_, scope)| *scope == FieldScope::RankInvariant));
        // Every field in order: the owner ranks and `sample_ids` where they were stored
        // (after the positions, after `sat_out_ids`), the per-rank ones last.
        let all: Vec<_> = ScheduleOutput::all_fields().map(|(n, _)| n).collect();
        let after = |name: &str| names.iter().position(|n| *n == name).unwrap() + 1;
        let mut invariant = names.clone();
        invariant.insert(after("sat_out_ids"), "sample_ids");
        invariant.insert(after("generation_positions"), "generation_owner_ranks");
        assert_eq!(
            invariant[invariant.len() - 4..],
            ["sat_out_ids", "sample_ids", "num_tokens", "digest"]
        );
        let mut expected = invariant.clone();
        expected.extend(&computed[2..]);
        assert_eq!(all, expected);
        let per_rank: Vec<_> = ScheduleOutput::fields_with_scope(FieldScope::PerRank).collect();
        assert_eq!(per_rank, computed[2..]);
        assert_eq!(
            ScheduleOutput::fields_with_scope(FieldScope::RankInvariant).collect::<Vec<_>>(),
            invariant
        );
        for (entry, shown) in ScheduleOutput::SUMMARY_ENTRIES {
            for field in *shown {
                assert!(
                    invariant.contains(field),
                    "{entry} shows unknown or per-rank field {field}"
                );
            }
        }
    }

    #[test]
    fn summary_pairs_follow_the_entries_and_make_the_text() {
        let out = sample();
        let pairs = out.summary_fields();
        let names: Vec<_> = pairs.iter().map(|(n, _)| *n).collect();
        let entries: Vec<_> = ScheduleOutput::SUMMARY_ENTRIES
            .iter()
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(names, entries);
        let text = out.summary();
        assert!(text.starts_with("step: 3\nnum_tokens: 13\ncontext: 4:0+8! 5:16+4\n"));
        assert!(text.contains("\nincomplete_prompts: 4\ngeneration: 1@9/r0\n"));
        assert!(text.contains("\npreempted: 6(for 4)\nsuspended:\nresumed:\n"));
        assert!(text.contains("\nbatch_slots: 4=0 5=1 1=2\n"));
        assert!(text.ends_with(&format!("digest: {:016x}\n", out.digest)));
    }

    /// The summary of an output with several decodes over two superblocks, as the stored
    /// owner ranks made it: each entry's owner is `(position // tpb) % cp`, whatever the
    /// rank the output is for.
    #[test]
    fn the_summary_shows_each_decodes_owner_as_before() {
        let mut out = ScheduleOutput {
            step: 7,
            generation_ids: vec![3, 1, 8, 2, 5],
            generation_positions: vec![0, 5, 11, 12, 23],
            generation_input_tokens: vec![1; 5],
            generation_input_refs: vec![-1, 0, -1, 2, -1],
            generation_batch_slots: vec![0, 1, 2, 3, 4],
            num_tokens: 5,
            preempted_ids: vec![9],
            preempted_requester_ids: vec![3],
            ..ScheduleOutput::default()
        };
        // cp 3, tpb 4: pages 0, 1, 2, 3, 5 of positions 0, 5, 11, 12, 23.
        let mut texts = Vec::new();
        for rank in 0..3 {
            out.rank_placement = placement(3, 4, rank);
            out.digest = out.compute_digest(1);
            texts.push(out.summary());
        }
        let expected = format!(
            "step: 7\nnum_tokens: 5\ncontext:\nincomplete_prompts:\n\
             generation: 3@0/r0 1@5/r1 8@11/r2 2@12/r0 5@23/r2\n\
             preempted: 9(for 3)\nsuspended:\nresumed:\nsat_out:\n\
             batch_slots: 3=0 1=1 8=2 2=3 5=4\ndigest: {:016x}\n",
            out.digest
        );
        for text in &texts {
            assert_eq!(text, &expected);
        }
        // Another layout, the same positions: other owners, the rest of the text alike.
        out.rank_placement = placement(2, 3, 1);
        let generation = out.summary_fields()[4].1.clone();
        assert_eq!(generation, "3@0/r0 1@5/r1 8@11/r1 2@12/r0 5@23/r1");
    }

    /// The owner ranks are compared as computed: two outputs with the same positions
    /// under different layouts differ in them (listed where the stored field was, after
    /// the positions); other positions that give the same owners differ in the positions
    /// alone.
    #[test]
    fn differing_fields_compare_the_computed_owner_ranks() {
        let out = sample();
        let mut other = out.clone();
        other.rank_placement = placement(3, 4, 1);
        assert_eq!(
            out.generation_owner_ranks().collect::<Vec<_>>(),
            [0] // position 9: page 2 of two ranks
        );
        assert_eq!(
            other.generation_owner_ranks().collect::<Vec<_>>(),
            [2] // page 2 of three ranks
        );
        assert_eq!(out.differing_fields(&other), ["generation_owner_ranks"]);
        assert_eq!(other.differing_fields(&out), ["generation_owner_ranks"]);
        other.generation_positions = vec![8];
        other.context_ids = vec![7, 5]; // the incomplete chunk: the same samples
        assert_eq!(
            out.differing_fields(&other),
            [
                "context_ids",
                "generation_positions",
                "generation_owner_ranks"
            ]
        );
        // Position 1 has owner 0 under (2, 4) too: the positions alone differ.
        let mut other = out.clone();
        other.generation_positions = vec![1];
        assert_eq!(out.differing_fields(&other), ["generation_positions"]);
        // Two ranks' outputs of one layout: the same owners.
        other = out.clone();
        other.rank_placement = placement(2, 4, 1);
        assert!(out.differing_fields(&other).is_empty());
    }

    #[test]
    fn lengths_that_do_not_fit_together_are_refused() {
        sample().check_lengths().unwrap();
        ScheduleOutput::default().check_lengths().unwrap();
        let broken: [fn(&mut ScheduleOutput); 5] = [
            |o| o.context_lens.push(1),
            |o| o.generation_batch_slots.clear(),
            |o| o.preempted_requester_ids.push(1),
            |o| o.context_token_ids.truncate(3),
            |o| o.suspended_host_block_ids.push(9),
        ];
        for edit in broken {
            let mut out = sample();
            edit(&mut out);
            assert!(matches!(
                out.check_lengths(),
                Err(CoreError::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn clear_empties_every_field_but_the_step() {
        let mut out = sample();
        out.clear(9);
        assert_eq!(
            out,
            ScheduleOutput {
                step: 9,
                rank_placement: placement(2, 4, 0),
                ..ScheduleOutput::default()
            }
        );
    }

    #[test]
    fn differing_fields_name_rank_invariant_fields_only() {
        let out = sample();
        let mut other = out.clone();
        assert!(out.differing_fields(&other).is_empty());
        // Another rank's output of the step: equal fields, unequal outputs.
        other.rank_placement = placement(2, 4, 1);
        assert!(out.differing_fields(&other).is_empty());
        assert_ne!(out, other);
        assert_eq!(out.compute_digest(11), other.compute_digest(11));
        assert_ne!(
            out.generation_local_lens().collect::<Vec<_>>(),
            other.generation_local_lens().collect::<Vec<_>>()
        );
        other.context_token_ids[3] = 99;
        other.digest = other.compute_digest(11);
        assert_eq!(
            out.differing_fields(&other),
            ["context_token_ids", "digest"]
        );
        // A shown field changes its summary entry.
        other = out.clone();
        other.preempted_requester_ids = vec![5];
        assert_eq!(out.differing_fields(&other), ["preempted_requester_ids"]);
        let changed: Vec<_> = out
            .summary_fields()
            .into_iter()
            .zip(other.summary_fields())
            .filter(|(a, b)| a != b)
            .map(|(a, _)| a.0)
            .collect();
        assert_eq!(changed, ["preempted"]);
    }

    #[test]
    fn check_digest_refuses_a_changed_field_or_another_fingerprint() {
        let mut out = sample();
        assert_eq!(out.digest, out.compute_digest(11));
        assert_eq!(out.check_digest(11), Ok(()));
        assert!(matches!(
            out.check_digest(12),
            Err(CoreError::InvalidArgument(_))
        ));
        out.context_token_ids[1] += 1;
        let Err(CoreError::InvalidArgument(message)) = out.check_digest(11) else {
            panic!("a changed token passed the digest check");
        };
        assert!(
            message.contains("changed after it was scheduled"),
            "{message}"
        );
        out.digest = out.compute_digest(11);
        assert_eq!(out.check_digest(11), Ok(()));
    }

    /// A generation entry's four values share one digest word: a change of any bit of any
    /// one of them, at any entry, changes the digest, and so does swapping two entries.
    #[test]
    fn any_single_generation_value_changes_the_digest() {
        /// Flips bit `bit` of one value of entry `at`.
        type Flip = fn(&mut ScheduleOutput, usize, u32);
        let entries = 13;
        let out = ScheduleOutput {
            generation_ids: (0..entries).map(|i| 40 + 3 * i).collect(),
            generation_positions: (0..entries).map(|i| 100 + 7 * i).collect(),
            generation_input_tokens: (0..13).map(|i| 1000 - i).collect(),
            generation_input_refs: vec![-1; 13],
            generation_batch_slots: (0..13).collect(),
            num_tokens: entries,
            ..ScheduleOutput::default()
        };
        let reference = out.compute_digest(5);
        let check = |changed: &ScheduleOutput, what: String| {
            assert_ne!(changed.compute_digest(5), reference, "{what}");
        };
        let flips: [(&str, Flip, &[u32]); 4] = [
            (
                "id",
                |o, at, bit| o.generation_ids[at] ^= 1 << bit,
                &[0, 1, 17, 31, 40, 63],
            ),
            (
                "position",
                |o, at, bit| o.generation_positions[at] ^= 1 << bit,
                &[0, 1, 17, 31, 40, 63],
            ),
            (
                "token",
                |o, at, bit| o.generation_input_tokens[at] ^= 1 << bit,
                &[0, 1, 17, 31],
            ),
            (
                "slot",
                |o, at, bit| o.generation_batch_slots[at] ^= 1 << bit,
                &[0, 1, 17, 31],
            ),
        ];
        for at in [0, 1, 5, 11, 12] {
            for (name, flip, bits) in &flips {
                for &bit in *bits {
                    let mut changed = out.clone();
                    flip(&mut changed, at, bit);
                    check(&changed, format!("{name} bit {bit} at {at}"));
                }
            }
        }
        let mut swapped = out.clone();
        swapped.generation_ids.swap(2, 3);
        swapped.generation_positions.swap(2, 3);
        swapped.generation_input_tokens.swap(2, 3);
        swapped.generation_batch_slots.swap(2, 3);
        check(&swapped, "entries 2 and 3 swapped".into());
    }

    /// The all-unknown test on the input refs (one word when every ref is -1) is told
    /// apart from any ref that is not -1, wherever it lies and whatever its value.
    #[test]
    fn any_input_ref_other_than_minus_one_changes_the_digest() {
        let entries = 37;
        let mut out = ScheduleOutput {
            generation_ids: (0..entries).collect(),
            generation_positions: (0..entries).map(|i| 100 + i).collect(),
            generation_input_tokens: vec![7; 37],
            generation_input_refs: vec![-1; 37],
            generation_batch_slots: (0..37).collect(),
            num_tokens: entries,
            ..ScheduleOutput::default()
        };
        let all_known = out.compute_digest(5);
        let mut seen = vec![all_known];
        for at in [0, 1, 17, 35, 36] {
            for row in [0, 1, 36, i32::MAX, -2, i32::MIN] {
                out.generation_input_refs[at] = row;
                let digest = out.compute_digest(5);
                assert!(!seen.contains(&digest), "ref {row} at {at}");
                seen.push(digest);
                out.generation_input_refs[at] = -1;
            }
        }
        assert_eq!(out.compute_digest(5), all_known);
    }

    /// `sample_ids` and `num_samples` against a brute-force construction (every generation
    /// id, then every context id whose chunk completes), over random outputs; its length
    /// ends the digest, so a completing chunk more or less changes it.
    #[test]
    fn sample_ids_match_a_brute_force_construction() {
        let mut next = below(0x9e37_79b9_7f4a_7c15u64);
        for _ in 0..500 {
            let generation = usize::try_from(next(40)).unwrap();
            let context = usize::try_from(next(12)).unwrap();
            let out = ScheduleOutput {
                generation_ids: (0..generation).map(|_| next(1 << 50)).collect(),
                context_ids: (0..context).map(|_| next(u64::MAX)).collect(),
                context_completes: (0..context).map(|_| next(3) != 0).collect(),
                ..ScheduleOutput::default()
            };
            let mut brute = out.generation_ids.clone();
            for i in 0..context {
                if out.context_completes[i] {
                    brute.push(out.context_ids[i]);
                }
            }
            let ids = out.sample_ids();
            assert_eq!(ids.len(), brute.len());
            assert_eq!(out.num_samples(), brute.len());
            assert_eq!(ids.collect::<Vec<_>>(), brute);
            // The iterator's length stays exact as it is consumed.
            let mut ids = out.sample_ids();
            for left in (0..brute.len()).rev() {
                ids.next().unwrap();
                assert_eq!(ids.len(), left);
            }
            assert_eq!(ids.next(), None);
        }
        let out = sample();
        assert_eq!(out.sample_ids().collect::<Vec<_>>(), [1, 5]);
        let mut more = out.clone();
        more.context_completes[0] = true;
        assert_eq!(more.sample_ids().collect::<Vec<_>>(), [1, 4, 5]);
        assert_ne!(more.compute_digest(11), out.digest);
    }

    /// `sample_ids` is compared as computed, where it was stored (after `sat_out_ids`):
    /// a chunk that completes on one side and not the other differs in both.
    #[test]
    fn differing_fields_compare_the_computed_sample_ids() {
        let out = sample();
        let mut other = out.clone();
        other.context_completes = vec![true, true];
        other.sat_out_ids = vec![2];
        assert_eq!(
            out.differing_fields(&other),
            ["context_completes", "sat_out_ids", "sample_ids"]
        );
        // The same samples from other entries: no difference in them.
        let mut other = out.clone();
        other.context_ids = vec![9, 5];
        assert_eq!(out.differing_fields(&other), ["context_ids"]);
        other.generation_ids = vec![2];
        assert_eq!(
            out.differing_fields(&other),
            ["context_ids", "generation_ids", "sample_ids"]
        );
    }

    /// `held[n]`: what `rank` holds of the first `n` tokens (`n <= end`), counted token by
    /// token, each token's owner being its page's number modulo `cp`.
    fn held(cp: u32, tokens_per_block: u32, rank: u32, end: u64) -> Vec<u64> {
        let mut held = vec![0];
        for p in 0..end {
            let owner = (p / u64::from(tokens_per_block)) % u64::from(cp);
            held.push(held[held.len() - 1] + u64::from(owner == u64::from(rank)));
        }
        held
    }

    #[test]
    fn computed_columns_match_a_brute_force_oracle() {
        let mut next = below(0x2545_f491_4f6c_dd1du64);
        for cp in [1, 2, 3, 4, 8] {
            for tokens_per_block in [1, 2, 3, 5, 7, 8, 12, 16, 32, 48, 64, 100] {
                let layout = Layout::new(cp, tokens_per_block).unwrap();
                let span = layout.tokens_per_superblock();
                // Small positions (every one near the start), random ones counted token by
                // token, and large ones (past 2^32) against the layout's closed forms.
                let mut small: Vec<u64> = (0..2 * span + 2).collect();
                small.extend((0..64).map(|_| next(4000)));
                let large: Vec<u64> = (0..16)
                    .map(|_| next(1 << 40))
                    .chain([u64::from(u32::MAX), u64::from(u32::MAX) + 1, 1 << 33])
                    .collect();
                let end = small.iter().max().unwrap() + 1;
                for rank in 0..cp {
                    let held = held(cp, tokens_per_block, rank, end);
                    let out = ScheduleOutput {
                        generation_positions: small.clone(),
                        rank_placement: RankPlacement::new(layout, rank).unwrap(),
                        ..ScheduleOutput::default()
                    };
                    let owners: Vec<u32> = out.generation_owner_ranks().collect();
                    let active: Vec<bool> = out.generation_active().collect();
                    let local: Vec<u64> = out.generation_local_lens().collect();
                    let past: Vec<u64> = out.generation_past_seen_lens().collect();
                    assert_eq!(active.len(), small.len());
                    for (i, &p) in small.iter().enumerate() {
                        let n = usize::try_from(p).unwrap();
                        let what = format!("cp={cp} tpb={tokens_per_block} rank={rank} pos={p}");
                        let owner = (p / u64::from(tokens_per_block)) % u64::from(cp);
                        assert_eq!(u64::from(owners[i]), owner, "{what}");
                        assert_eq!(active[i], held[n + 1] > held[n], "{what}");
                        assert_eq!(past[i], held[n], "{what}");
                        assert_eq!(local[i], held[n + 1], "{what}");
                    }
                    let out = ScheduleOutput {
                        generation_positions: large.clone(),
                        ..out
                    };
                    let columns = out
                        .generation_active()
                        .zip(out.generation_local_lens())
                        .zip(out.generation_past_seen_lens());
                    let owners = out.generation_owner_ranks();
                    assert_eq!(owners.len(), large.len());
                    for (&p, owner) in large.iter().zip(owners) {
                        let brute = (p / u64::from(tokens_per_block)) % u64::from(cp);
                        assert_eq!(
                            u64::from(owner),
                            brute,
                            "cp={cp} tpb={tokens_per_block} {p}"
                        );
                        assert_eq!(owner, layout.owner_rank(p));
                    }
                    for (&p, ((active, local), past)) in large.iter().zip(columns) {
                        assert_eq!(active, layout.owner_rank(p) == rank);
                        assert_eq!(local, layout.local_len(p + 1, rank));
                        assert_eq!(past, layout.local_len(p, rank));
                    }
                }
                assert!(RankPlacement::new(layout, cp).is_err());
            }
        }
    }
}
