//! Pending steps as values: what `update` and `revert` need of a scheduled step (a
//! [`StepRecord`]), the ring of at most two of them the scheduler keeps
//! ([`PendingSteps`]: `schedule()` pushes, `update()` pops the oldest, `revert()` the
//! newest), and the scratch `schedule()` builds a step in ([`StepBuilder`]), which it
//! turns into a record on success.
//!
//! A leaf of the scheduler's module graph: it knows the request index, the output, the
//! victim search and the ledger's decode inverse, and nothing of the scheduler's state.

use super::config::VictimPolicy;
use super::output::ScheduleOutput;
use super::request::{AheadMark, RequestIndex};
use super::victim::VictimFinder;
use rustc_hash::FxHashMap;

use crate::ids::SuperblockId;
use crate::ledger::DecodeInverse;
use crate::prefix_cache::{BlockKey, Eviction};

/// A context entry of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct ContextEntry {
    pub req: RequestIndex,
    pub start: u64,
    pub len: u64,
    pub completes: bool,
    /// Tokens of an admission found in the prefix cache (0 for a later chunk, or without
    /// caching): the chunk starts after them.
    pub cached: u64,
    /// Of `cached`: tokens in superblocks an earlier context entry of the same step
    /// computes (same-step sharing, see `StepBuilder::step_keys`).
    pub shared: u64,
    /// Of an admission with prefix caching: the tokens it looked up (its prefill length),
    /// and whether it re-prefills after a recompute-pause (counted apart).
    pub queried: u64,
    pub recompute: bool,
}

/// A ledger change made by a step, undone (newest first) by `revert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum JournalEntry {
    /// The decode of the request `req`, made as the step's generation entry `entry` (its
    /// position when it was made, which is also its place in `decode_undos`).
    Decode {
        req: RequestIndex,
        entry: u32,
    },
    /// The decodes of generation entries `from..to` (positions in `generation_reqs`), as
    /// one `Decode` each in that order: the decode loops record a run of entries at once
    /// instead of an entry per request. Dropping generation entries (preempted after they
    /// were made) would move the positions, so it first turns these back into `Decode`s.
    Decodes {
        from: u32,
        to: u32,
    },
    Reserve {
        req: RequestIndex,
        len_before: u64,
    },
    Resume(RequestIndex),
    /// Every draft of the step (`StepRecord::drafts`), made after every other change of the
    /// step, so undone first.
    Drafts,
}

/// The drafts one generation entry of a step verifies (speculative decoding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct DraftEntry {
    /// The generation entry (its position in `generation_reqs`).
    pub entry: u32,
    /// Draft positions allocated after its decode token.
    pub count: u32,
    /// The request's ledger length before the drafts: a revert shrinks back to it, an
    /// update to it or the positions kept, whichever is longer.
    pub len_before: u64,
}

/// A request that sat out of a step, with the batch slot it gave up (restored if that step
/// is reverted). Kept by the step, not the request: a request may sit out of both pending
/// steps (the newer one finds it without a slot), and reverting both must restore the slot
/// the older one took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SatOut {
    pub req: RequestIndex,
    pub slot: Option<u32>,
}

/// Everything `update` and `revert` need of one pending step, kept apart from its output
/// (which may have been moved out; the digest tells this scheduler's output of the step
/// from another's).
///
/// The record owns the undo of its step's decodes: each decode grow's exact inverse
/// (`decode_undos`, one per generation entry, plain step or planned ahead alike), handed
/// back to `Ledger::undo_decode` newest first when the step is reverted; the ledger's
/// record of the request keeps only its current state. So a step planned ahead and the
/// pending step before it are reverted in turn, each with its own inverses.
#[derive(Debug, Clone, Default)]
pub(super) struct StepRecord {
    pub step: u64,
    pub digest: u64,
    /// Sampled tokens `update` takes (`ScheduleOutput::num_samples`).
    pub samples: usize,
    /// The no-progress count before the step, restored by its revert.
    pub stalled_steps_before: u32,
    /// The ledger's free superblocks once the step had taken its pages: pages freed after
    /// that (by the update of the step before it, one step ahead) lie above this depth of
    /// the free list, and a revert puts the step's pages back below them, where they were.
    pub free_len: u32,
    pub context: Vec<ContextEntry>,
    /// Request of each generation entry, in output order.
    pub generation_reqs: Vec<RequestIndex>,
    /// The step's ledger changes, oldest first.
    pub journal: Vec<JournalEntry>,
    /// For each generation entry, by its position when it was made, the exact inverse of
    /// its decode grow (what the revert of this step hands back to the ledger).
    pub decode_undos: Vec<DecodeInverse>,
    /// Requests that took a new batch slot in the step.
    pub new_slot_reqs: Vec<RequestIndex>,
    pub sat_out: Vec<SatOut>,
    /// Requests that finished (or were aborted) while this step still referred to them,
    /// in the order they finished: their output can be taken already, but their KV, batch
    /// slot and index stay held until this step is updated or reverted.
    pub zombies: Vec<RequestIndex>,
    /// Cached superblocks the step's allocations evicted, oldest first (put back by its
    /// revert, except those its resumes copy into).
    pub evictions: Vec<Eviction>,
    /// The pages the step's resumes copy KV into from the host tier, marked in the ledger
    /// while the step is pending (`Ledger::set_copy_in`): nothing keys them, and a revert
    /// does not put back a prefix evicted from them, since a reverted copy-in may or may
    /// not have overwritten them.
    pub copy_in_pages: Vec<SuperblockId>,
    /// The pages a step planned ahead of this one copied into before it was reverted: its
    /// copy-ins may have overwritten them too, so this step's revert does not put back a
    /// prefix it evicted from them either.
    pub newer_copy_in_pages: Vec<SuperblockId>,
    /// The generation entries that verify drafts, in entry order (empty without drafts).
    pub drafts: Vec<DraftEntry>,
    /// Draft tokens proposed for the step's decodes that it did not schedule (the pool,
    /// the token budget or `max_new_tokens` had no room for them).
    pub drafts_trimmed: u64,
    /// Superblocks the drafts took from the free list.
    pub draft_superblocks: u64,
}

impl StepRecord {
    /// Empties the record for the next step, keeping its allocations.
    fn clear(&mut self) {
        self.context.clear();
        self.generation_reqs.clear();
        self.journal.clear();
        self.decode_undos.clear();
        self.new_slot_reqs.clear();
        self.sat_out.clear();
        self.evictions.clear();
        self.copy_in_pages.clear();
        self.newer_copy_in_pages.clear();
        self.drafts.clear();
        self.drafts_trimmed = 0;
        self.draft_superblocks = 0;
        debug_assert!(
            self.zombies.is_empty(),
            "a closed step released its zombies"
        );
        self.zombies.clear();
    }
}

/// The pending steps, oldest first: none, one, or two (the newer scheduled one step
/// ahead while the older was still pending). Records are boxed, so pushing, taking out and
/// recycling one moves a pointer, not the record.
#[derive(Debug, Clone, Default)]
pub(super) struct PendingSteps {
    /// Oldest first; at most two.
    #[expect(
        clippy::vec_box,
        reason = "a record moves between the ring and the builder by its pointer, not its ~200 bytes"
    )]
    records: Vec<Box<StepRecord>>,
}

impl PendingSteps {
    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    pub fn is_full(&self) -> bool {
        self.records.len() == 2
    }

    pub fn oldest(&self) -> Option<&StepRecord> {
        self.records.first().map(|record| &**record)
    }

    pub fn newest(&self) -> Option<&StepRecord> {
        self.records.last().map(|record| &**record)
    }

    pub fn newest_mut(&mut self) -> Option<&mut StepRecord> {
        self.records.last_mut().map(|record| &mut **record)
    }

    /// The pending steps, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &StepRecord> {
        self.records.iter().map(|record| &**record)
    }

    /// Adds a newly scheduled step; at most two are pending.
    pub fn push(&mut self, record: Box<StepRecord>) {
        debug_assert!(!self.is_full(), "at most two steps are pending");
        self.records.push(record);
    }

    /// Takes out the oldest pending step (the one `update` closes).
    pub fn pop_oldest(&mut self) -> Option<Box<StepRecord>> {
        (!self.records.is_empty()).then(|| self.records.remove(0))
    }

    /// Takes out the newest pending step (the one `revert` undoes).
    pub fn pop_newest(&mut self) -> Option<Box<StepRecord>> {
        self.records.pop()
    }

    /// Holds `req` (finished while pending step `step` refers to it) until that step
    /// closes; `step` is the newest pending one.
    pub fn hold_zombie(&mut self, step: u64, req: RequestIndex) {
        let newest = self
            .newest_mut()
            .expect("a zombie is held by a pending step");
        debug_assert_eq!(newest.step, step, "zombies are held by the newest step");
        newest.zombies.push(req);
    }

    /// Whether a pending step holds zombies.
    pub fn has_zombies(&self) -> bool {
        self.iter().any(|record| !record.zombies.is_empty())
    }
}

/// The scratch of the step `schedule()` is building, kept to reuse its allocations: the
/// output and the record it fills, and what it needs only while it plans (the victim
/// searches, the ladder's plan, the token budget and slot counts, and the marks of the
/// older step's work for a step planned ahead). Nothing here outlives a `schedule()` but
/// the allocations.
#[derive(Debug, Clone)]
pub(super) struct StepBuilder {
    /// The schedule being built; it becomes the scheduler's output on success.
    pub out: ScheduleOutput,
    /// The record being built; pushed to the pending steps on success.
    pub record: Box<StepRecord>,
    /// A closed step's record, the next one to build in.
    spare: Option<Box<StepRecord>>,
    /// Generation entries whose request had no batch slot yet.
    pub generation_needing_slots: Vec<usize>,
    /// Whether a request was preempted after its generation entry was made.
    pub generation_removed: bool,
    /// Candidates below the preemption bound, for every requester.
    pub victims: VictimFinder,
    /// Candidates at the bound, only for the queue head (see `preempt_for`).
    pub head_victims: VictimFinder,
    /// Queue positions of the victims the ladder chose for one requester.
    pub plan: Vec<usize>,
    /// Tokens scheduled so far.
    pub tokens: u64,
    /// Entries of this step that still need a new batch slot (assigned at the end).
    pub new_slots: u32,
    /// `Decoding` requests without a batch slot that get no decode entry in this step
    /// (resumed in it, or not scheduled), in queue order: each claims a slot ahead of
    /// everything after it in the step (handed out at the end, see `finish_step`).
    pub slot_claims: Vec<RequestIndex>,
    /// Whether the step has preempted.
    pub preempted: bool,
    /// By request index: its work in the older pending step, for a step planned ahead
    /// (dense, so the decode path does not touch the request's cold record). A mark is
    /// meaningful only while the step it names is planned (older marks are stale).
    pub ahead_marks: Vec<AheadMark>,
    /// With prefix caching: the key of each full superblock whose last token a context
    /// entry of this step computes, and its page (the first entry's, in queue order). A
    /// later admission of the same step attaches them as it attaches cached superblocks
    /// (same-step sharing): the executor writes each layer's KV of the step before that
    /// layer's attention, so the later entry reads what the earlier one writes. Nothing is
    /// keyed in the cache before the step is updated; looked up, never iterated.
    pub step_keys: FxHashMap<BlockKey, SuperblockId>,
}

impl StepBuilder {
    pub fn new(policy: VictimPolicy, out: ScheduleOutput) -> Self {
        Self {
            out,
            record: Box::default(),
            spare: None,
            generation_needing_slots: Vec::new(),
            generation_removed: false,
            victims: VictimFinder::new(policy),
            head_victims: VictimFinder::new(policy),
            plan: Vec::new(),
            tokens: 0,
            new_slots: 0,
            slot_claims: Vec::new(),
            preempted: false,
            ahead_marks: Vec::new(),
            step_keys: FxHashMap::default(),
        }
    }

    /// Starts building step `step` over a queue of `queue_len` requests, `decoding` of
    /// them `Decoding` (the output's generation columns are sized for them once).
    pub fn begin(&mut self, step: u64, queue_len: usize, decoding: usize) {
        self.out.clear(step);
        // The previous output may have been moved out (`take_last_output`): size the
        // buffers once instead of growing them push by push.
        let out = &mut self.out;
        out.generation_ids.reserve(decoding);
        out.generation_positions.reserve(decoding);
        out.generation_input_tokens.reserve(decoding);
        out.generation_batch_slots.reserve(decoding);
        self.record.clear();
        self.record.step = step;
        self.generation_needing_slots.clear();
        self.generation_removed = false;
        self.victims.begin_step(queue_len);
        self.head_victims.begin_step(queue_len);
        self.tokens = 0;
        self.new_slots = 0;
        self.slot_claims.clear();
        self.preempted = false;
        if !self.step_keys.is_empty() {
            self.step_keys.clear();
        }
    }

    /// The record of the step just built (its output's digest and samples, the free list's
    /// length `free_len` once it took its pages); the builder goes on in the spare record
    /// (a new one while none was recycled yet: the first steps only).
    pub fn seal(&mut self, free_len: u32) -> Box<StepRecord> {
        let next = self.spare.take().unwrap_or_default();
        let mut record = std::mem::replace(&mut self.record, next);
        debug_assert_eq!(record.step, self.out.step);
        record.digest = self.out.digest;
        record.samples = self.out.num_samples();
        record.free_len = free_len;
        record
    }

    /// Takes out the record being built (for undoing a step that failed, which needs the
    /// scheduler whole); [`Self::put_back`] returns it.
    pub fn take_record(&mut self) -> Box<StepRecord> {
        let spare = self.spare.take().unwrap_or_default();
        std::mem::replace(&mut self.record, spare)
    }

    /// Returns the record [`Self::take_record`] took.
    pub fn put_back(&mut self, record: Box<StepRecord>) {
        let spare = std::mem::replace(&mut self.record, record);
        self.spare = Some(spare);
    }

    /// Hands back a closed step's record, to build a later step in its buffers.
    pub fn recycle(&mut self, mut record: Box<StepRecord>) {
        if self.spare.is_none() {
            record.zombies.clear();
            self.spare = Some(record);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{PendingSteps, StepRecord};

    fn record(step: u64) -> Box<StepRecord> {
        Box::new(StepRecord {
            step,
            ..StepRecord::default()
        })
    }

    #[test]
    fn the_ring_pops_the_oldest_for_update_and_the_newest_for_revert() {
        let mut pending = PendingSteps::default();
        assert!(pending.is_empty());
        assert!(pending.pop_oldest().is_none() && pending.pop_newest().is_none());
        pending.push(record(4));
        pending.push(record(5));
        assert!(pending.is_full());
        assert_eq!(pending.oldest().map(|r| r.step), Some(4));
        assert_eq!(pending.newest().map(|r| r.step), Some(5));
        assert_eq!(pending.pop_oldest().map(|r| r.step), Some(4));
        assert_eq!(
            (pending.len(), pending.oldest().map(|r| r.step)),
            (1, Some(5))
        );
        pending.push(record(6));
        assert_eq!(pending.pop_newest().map(|r| r.step), Some(6));
        assert_eq!(pending.pop_newest().map(|r| r.step), Some(5));
        assert!(pending.is_empty());
    }

    #[test]
    fn zombies_are_held_by_the_newest_step() {
        let mut pending = PendingSteps::default();
        pending.push(record(1));
        pending.push(record(2));
        assert!(!pending.has_zombies());
        pending.hold_zombie(2, 7);
        assert!(pending.has_zombies());
        assert_eq!(pending.pop_newest().map(|r| r.zombies), Some(vec![7]));
        assert!(!pending.has_zombies());
    }
}
