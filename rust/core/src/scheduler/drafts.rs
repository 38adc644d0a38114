//! Speculative decoding (docs/internals/speculative-decoding.md): draft tokens proposed
//! before `schedule()`, given room last in a step, verified in one forward and rolled
//! back exactly at `update`.
//!
//! - **Proposals** ([`Scheduler::propose_drafts`]) are inputs like the prompts: identical
//!   on every rank (a drafter that reads only the token history, or an MTP head after the
//!   exact cross-rank combine). They hold for the next successful `schedule()` only.
//! - **Drafts give way first.** A step allocates every decode token, resume and prefill
//!   chunk as it would without drafts; only then, in queue order, does it extend each
//!   decode with its drafts, from the free list alone (no eviction, no preemption, no
//!   suspend) and within the token budget left, and never past `max_new_tokens`. So under
//!   pressure the last in queue order lose their drafts first (the newest; under priority
//!   admission the least important: the order every other decision follows) and a request whose drafts were trimmed still
//!   decodes its one token.
//! - **Update** takes `1 + drafts` sampled rows per generation entry and how many drafts
//!   were accepted; the accepted prefix (cut at an end-of-sequence) is appended and the
//!   rest is retracted from the ledger, so a superblock only rejected drafts reached goes
//!   back to the pool. Only accepted tokens are ever computed, hashed or counted.
//! - **One step ahead.** A request whose decode in the pending step carries drafts is not
//!   decoded (nor chosen as a victim) by a step planned ahead of it: its next position
//!   depends on how many drafts that step accepts. It decodes again in the step after that
//!   update. Every other request is planned ahead as usual, drafts included.

use super::config::SchedulerConfig;
use super::draft_backoff::DraftBackoff;
use super::metrics::SchedulerMetrics;
use super::pending::{DraftEntry, JournalEntry};
use super::request::{RequestIndex, NO_STEP};
use super::Scheduler;
use crate::error::{CoreError, Result};
use crate::ids::RequestId;
use crate::ledger::DraftExtension;

/// Draft proposals for the next `schedule()`, by request index, and the acceptance counts
/// per draft position.
#[derive(Debug, Clone, Default)]
pub(super) struct Drafts {
    /// By request index: the `epoch` its proposal was made in (valid while that is the
    /// current one), where its tokens start in `tokens`, and how many.
    epochs: Vec<u64>,
    offsets: Vec<u32>,
    counts: Vec<u32>,
    tokens: Vec<i32>,
    /// Bumped by every proposal and every successful `schedule()`, which invalidates the
    /// proposals before it.
    epoch: u64,
    /// Whether the current epoch has a proposal (so a step without any skips the walk).
    any: bool,
    /// Times draft position `j` (0-based after the decode token) was accepted.
    pub accepted_per_position: Vec<u64>,
    /// Scratch of `propose_drafts`: the request indices given, and by request index the
    /// call that last named it (`calls`), which finds an id given twice without a sort.
    given: Vec<RequestIndex>,
    named_by: Vec<u64>,
    calls: u64,
    /// By request index: the pending step whose decode of it carries drafts ([`NO_STEP`] if
    /// none; dense, off the request's cold record). Its next position depends on how many
    /// that step accepts, so a step planned ahead neither decodes it nor takes it as a
    /// victim.
    pending_step: Vec<u64>,
    /// Which requests the draft backoff keeps from drafting (`draft_backoff.rs`), and how
    /// many times it stopped one (in steps that ran).
    pub backoff: DraftBackoff,
    pub backoffs: u64,
}

impl Drafts {
    /// Whether `req`'s decode in a pending step carries drafts.
    pub fn pending(&self, req: RequestIndex) -> bool {
        self.pending_step
            .get(req as usize)
            .is_some_and(|&step| step != NO_STEP)
    }

    /// Drops the proposal of `req` (retired: its index may be handed to a new request).
    pub fn forget(&mut self, req: RequestIndex) {
        if let Some(epoch) = self.epochs.get_mut(req as usize) {
            *epoch = u64::MAX;
        }
        self.backoff.forget(req);
    }

    /// Drops every proposal (a step was scheduled with them).
    pub fn consumed(&mut self) {
        self.epoch += 1;
        self.any = false;
        self.tokens.clear();
    }
}

impl Scheduler {
    /// Proposes draft tokens for the next `schedule()` (speculative decoding): `counts[i]`
    /// drafts for request `ids[i]`, their tokens concatenated in `tokens`. Replaces every
    /// earlier proposal; a successful `schedule()` uses them and drops them. A request that
    /// does not decode in that step (prefilling, suspended, preempted, out of budget)
    /// ignores its drafts; one that decodes verifies as many as fit (see the module docs).
    ///
    /// Refused, with nothing changed: `UnknownRequest` for an id that is not live;
    /// `InvalidArgument` for arrays of different lengths, an id given twice, a count above
    /// `num_speculative_tokens`, or `tokens` not holding `sum(counts)` tokens.
    pub fn propose_drafts(
        &mut self,
        ids: &[RequestId],
        counts: &[u32],
        tokens: &[i32],
    ) -> Result<()> {
        if ids.len() != counts.len() {
            return Err(CoreError::InvalidArgument(format!(
                "propose_drafts() got {} ids and {} counts",
                ids.len(),
                counts.len()
            )));
        }
        let most = self.config.num_speculative_tokens;
        if let Some((&id, &count)) = ids.iter().zip(counts).find(|(_, &count)| count > most) {
            return Err(CoreError::InvalidArgument(format!(
                "request {id} was given {count} drafts, more than num_speculative_tokens = {most}"
            )));
        }
        let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        if total != tokens.len() as u64 {
            return Err(CoreError::InvalidArgument(format!(
                "propose_drafts() got {} draft tokens for counts that add up to {total}",
                tokens.len()
            )));
        }
        let mut reqs = std::mem::take(&mut self.drafts.given);
        reqs.clear();
        let found = ids.iter().try_for_each(|&id| {
            reqs.push(self.request_index(id)?);
            Ok(())
        });
        let drafts = &mut self.drafts;
        if drafts.named_by.len() < self.requests.len() {
            drafts.named_by.resize(self.requests.len(), 0);
        }
        drafts.calls += 1;
        let twice = found.and_then(|()| {
            let call = drafts.calls;
            match reqs
                .iter()
                .find(|&&req| std::mem::replace(&mut drafts.named_by[req as usize], call) == call)
            {
                Some(&req) => Err(CoreError::InvalidArgument(format!(
                    "propose_drafts() was given request {} twice",
                    self.requests[req as usize].id
                ))),
                None => Ok(()),
            }
        });
        if let Err(err) = twice {
            drafts.given = reqs;
            return Err(err);
        }
        drafts.consumed();
        if drafts.epochs.len() < self.requests.len() {
            drafts.epochs.resize(self.requests.len(), u64::MAX);
            drafts.offsets.resize(self.requests.len(), 0);
            drafts.counts.resize(self.requests.len(), 0);
        }
        drafts.tokens.extend_from_slice(tokens);
        let mut offset = 0u32;
        for (&req, &count) in reqs.iter().zip(counts) {
            let r = req as usize;
            drafts.epochs[r] = drafts.epoch;
            drafts.offsets[r] = offset;
            drafts.counts[r] = count;
            drafts.any |= count > 0;
            // At most `tokens.len()` in all, which fits: checked against the counts above.
            offset = offset.saturating_add(count);
        }
        drafts.given = reqs;
        Ok(())
    }

    /// How many times each draft position (0 the first draft after the decode token, up
    /// to `num_speculative_tokens - 1`) was accepted, over the steps that ran: vLLM's
    /// per-position acceptance (`spec_decode_num_accepted_tokens_per_pos`).
    pub fn spec_decode_accepted_per_position(&self) -> Vec<u64> {
        let mut counts = self.drafts.accepted_per_position.clone();
        counts.resize(self.config.num_speculative_tokens as usize, 0);
        counts
    }

    /// Times the draft backoff stopped a request's drafting (`draft_backoff_misses` drafted
    /// decodes in a row with no draft accepted), over the steps that ran.
    pub fn spec_decode_backoffs(&self) -> u64 {
        self.drafts.backoffs
    }

    /// Whether the draft backoff keeps live request `id` from drafting in the next
    /// `schedule()` (its proposals would be ignored; a drafter may skip it). One step ahead
    /// this reads the state before the pending step's update, as the step planned next does.
    ///
    /// Refused: `UnknownRequest` for an id that is not live.
    pub fn draft_paused(&self, id: RequestId) -> Result<bool> {
        let req = self.request_index(id)?;
        let computed = self.requests[req as usize].computed;
        Ok(self.drafts.backoff.paused(req, computed))
    }

    /// The last phase of a step: gives each generation entry the drafts proposed for it
    /// that fit, in entry (queue) order, from the free list alone and within the token
    /// budget left, never past `max_new_tokens`. Fills the output's draft columns (a count
    /// per entry) and the record's draft entries and journal.
    pub(super) fn draft_phase(&mut self, step: u64) {
        let entries = self.builder.out.generation_ids.len();
        self.builder.out.generation_draft_counts.resize(entries, 0);
        if !self.drafts.any {
            return;
        }
        // Split borrows, so the loop reads each proposal once and asks no question twice.
        let Drafts {
            epochs,
            offsets,
            counts,
            tokens: proposed_tokens,
            epoch,
            backoff,
            pending_step,
            ..
        } = &mut self.drafts;
        if pending_step.len() < self.requests.len() {
            pending_step.resize(self.requests.len(), NO_STEP);
        }
        let requests = &self.requests[..];
        let ledger = &mut self.ledger;
        let out = &mut self.builder.out;
        let record = &mut self.builder.record;
        let mut budget = u64::from(self.config.max_num_tokens).saturating_sub(self.builder.tokens);
        let mut taken = 0u64;
        for (entry, &req) in record.generation_reqs[..entries].iter().enumerate() {
            let r = req as usize;
            if epochs.get(r) != Some(&*epoch) || counts[r] == 0 {
                continue;
            }
            let proposed = u64::from(counts[r]);
            let request = &requests[r];
            if backoff.paused(req, request.computed) {
                // Backed off: the proposal is ignored, as for a request that does not decode.
                continue;
            }
            // A decode on a token in flight (planned ahead) follows that token, which
            // `remaining_tokens` does not count yet.
            let in_flight = u32::from(out.generation_input_refs[entry] >= 0);
            let room = request.remaining_tokens.saturating_sub(1 + in_flight);
            let most = proposed.min(u64::from(room)).min(budget);
            let extended = if most == 0 {
                DraftExtension::NONE
            } else {
                ledger
                    .extend_decode_most(r, request.id, step, most)
                    .expect("a decode of this step takes drafts after its token")
            };
            let count = extended.count;
            record.drafts_trimmed += proposed - count;
            if count == 0 {
                continue;
            }
            record.draft_superblocks += u64::from(extended.grown);
            #[expect(
                clippy::cast_possible_truncation,
                reason = "at most num_speculative_tokens (a u32) drafts"
            )]
            let count32 = count as u32;
            let start = offsets[r] as usize;
            out.generation_draft_counts[entry] = count;
            out.generation_draft_tokens
                .extend_from_slice(&proposed_tokens[start..start + count32 as usize]);
            budget -= count;
            taken += count;
            #[expect(
                clippy::cast_possible_truncation,
                reason = "entries of one step are counted in u32 (batch slots)"
            )]
            let entry32 = entry as u32;
            record.drafts.push(DraftEntry {
                entry: entry32,
                count: count32,
                len_before: extended.len_before,
            });
            pending_step[r] = step;
        }
        self.builder.tokens += taken;
        // One journal entry for every draft of the step (they come after every other change,
        // so a revert undoes them first, in any order among themselves).
        let record = &mut self.builder.record;
        if !record.drafts.is_empty() {
            record.journal.push(JournalEntry::Drafts);
        }
    }

    /// Undoes drafts of the step being reverted (all of them).
    pub(super) fn undo_drafts(&mut self, step: u64, req: RequestIndex, drafts: DraftEntry) {
        let id = self.requests[req as usize].id;
        self.ledger
            .retract_drafts(id, step, u64::from(drafts.count), drafts.len_before)
            .expect("the ledger takes back the drafts it gave in this step");
    }

    /// The closed step's drafted requests have no drafts pending any more.
    pub(super) fn close_drafts(
        &mut self,
        step: u64,
        generation: &[RequestIndex],
        drafts: &[DraftEntry],
    ) {
        let pending = &mut self.drafts.pending_step;
        for d in drafts {
            let marked = &mut pending[generation[d.entry as usize] as usize];
            if *marked == step {
                *marked = NO_STEP;
            }
        }
    }

    /// Applies a verified decode at `update`: of `rows` (its `1 + drafts` sampled rows, the
    /// first `accepted + 1` of them kept), the tokens up to the first end-of-sequence
    /// (`eos[j]` for row `j`) are appended and computed; the drafts past them are retracted.
    /// Returns whether it hit end-of-sequence.
    pub(super) fn apply_verified(
        &mut self,
        step: u64,
        req: RequestIndex,
        drafts: DraftEntry,
        rows: &[i32],
        eos: Option<&[bool]>,
        accepted: u32,
    ) -> bool {
        let request = &mut self.requests[req as usize];
        let position = request.computed;
        let mut taken = 0u32;
        let mut ended = false;
        for (j, &token) in rows[..=accepted as usize].iter().enumerate() {
            self.token_log.push(req, request, token);
            taken += 1;
            if eos.is_some_and(|flags| flags[j]) {
                ended = true;
                break;
            }
        }
        request.computed += u64::from(taken);
        let computed = request.computed;
        let rejected = drafts.count + 1 - taken;
        let id = request.id;
        if rejected > 0 {
            let held = self.ledger.request(id).map_or(0, |kv| kv.table().len());
            let kept_end = position + u64::from(taken);
            self.ledger
                .retract_drafts(
                    id,
                    step,
                    u64::from(rejected),
                    drafts.len_before.max(kept_end),
                )
                .expect("the ledger takes back the rejected drafts of this step");
            let held_after = self.ledger.request(id).map_or(held, |kv| kv.table().len());
            self.metrics.spec_decode_returned_superblocks += (held - held_after) as u64;
        }
        let verified = Verified {
            req,
            drafts: drafts.count,
            accepted,
            computed,
        };
        count_verified(&mut self.metrics, &mut self.drafts, &self.config, verified);
        ended
    }
}

/// A drafted decode as `update` verified it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Verified {
    pub req: RequestIndex,
    /// Its drafts in the step, and how many were accepted.
    pub drafts: u32,
    pub accepted: u32,
    /// Its `computed` length after the tokens it kept.
    pub computed: u64,
}

/// Counts a verified decode (in steps that ran: at `update`) and feeds the draft backoff.
#[inline]
pub(super) fn count_verified(
    metrics: &mut SchedulerMetrics,
    state: &mut Drafts,
    config: &SchedulerConfig,
    verified: Verified,
) {
    let Verified {
        req,
        drafts,
        accepted,
        computed,
    } = verified;
    if state.backoff.verified(config, req, accepted, computed) {
        state.backoffs += 1;
    }
    let per_position = &mut state.accepted_per_position;
    metrics.spec_decode_num_drafts += 1;
    metrics.spec_decode_num_draft_tokens += u64::from(drafts);
    metrics.spec_decode_num_accepted_tokens += u64::from(accepted);
    if per_position.len() < accepted as usize {
        per_position.resize(accepted as usize, 0);
    }
    for count in &mut per_position[..accepted as usize] {
        *count += 1;
    }
}
