//! Building one step: the generation phase, the context phase, the preemption ladder
//! and the output arrays.

use super::config::{AdmissionPolicy, CapacityPolicy, ServingMode, SuspendPolicy, VictimPolicy};
use super::output::ScheduleOutput;
use super::pending::{ContextEntry, JournalEntry, SatOut, StepRecord};
use super::request::{AheadMark, Request, RequestIndex, RequestState, NO_STEP};
use super::slots::{entry_id, row_id, slot_id};
use super::victim::VictimKey;
use super::Scheduler;
use crate::error::{CoreError, Result};
use crate::ids::{page_id, superblock_count, RequestId, SuperblockId};
use crate::ledger::{check_inverse_step, DecodeInverse};
use crate::prefix_cache::{chain_keys, extend_keys};

impl Scheduler {
    /// The pending step that the step being planned ahead is planned ahead of.
    fn older_step(&self) -> &StepRecord {
        self.pending
            .newest()
            .expect("a step planned ahead has an older pending step")
    }

    /// Before planning `step` one ahead: marks every request with work in the older
    /// pending step with where that work leaves it (its sampled token's row, its prompt's
    /// progress), which the phases read instead of progress not yet recorded.
    pub(super) fn mark_older_step_work(&mut self, step: u64) {
        let marks = &mut self.builder.ahead_marks;
        if marks.len() < self.requests.len() {
            marks.resize(self.requests.len(), AheadMark::NONE);
        }
        let older = self
            .pending
            .newest()
            .expect("a step planned ahead has an older pending step");
        // Each generation entry has `1 + drafts` rows. One with drafts samples no row this
        // step can take as its input: how many of its drafts are accepted decides its next
        // position, so it waits for the older step's update (marked as sampling nothing).
        let mut drafts = older.drafts.iter().peekable();
        let mut row = 0;
        for (entry, &req) in older.generation_reqs.iter().enumerate() {
            let count = match drafts.peek() {
                Some(d) if d.entry as usize == entry => drafts.next().map_or(0, |d| d.count),
                _ => 0,
            };
            marks[req as usize] = AheadMark {
                step,
                computed: 0, // a decode: not read
                row: if count == 0 { row_id(row) } else { -1 },
            };
            row += 1 + count as usize;
        }
        for entry in &older.context {
            let sampled = if entry.completes {
                row += 1;
                row_id(row - 1)
            } else {
                -1
            };
            marks[entry.req as usize] = AheadMark {
                step,
                computed: entry.start + entry.len,
                row: sampled,
            };
        }
    }

    /// The mark of `req` if it has work in the older pending step (while planning `step`).
    fn ahead_mark(&self, step: u64, req: RequestIndex) -> Option<AheadMark> {
        self.builder
            .ahead_marks
            .get(req as usize)
            .filter(|mark| mark.step == step)
            .copied()
    }

    /// Whether a request marked by [`Self::mark_older_step_work`] was preempted or
    /// suspended after the older step (by a newer step, since reverted): its work there
    /// is in flight and it waits for that step's update before anything else.
    fn preempted_after_older_step(&self, req: RequestIndex) -> bool {
        let victim_step = self.requests[req as usize].cold.victim_step;
        victim_step != NO_STEP && victim_step > self.older_step().step
    }

    /// The generation phase of a step planned while the older step is pending: a request
    /// decoding there (or completing its prompt there) decodes here on the token it is
    /// sampling, given as that token's row, unless it is known to finish there
    /// (`max_new_tokens`) or its abort is pending.
    pub(super) fn generation_phase_ahead(&mut self, step: u64) -> Result<()> {
        self.decode_run::<AheadRun>(step)
    }

    /// The step planned ahead's generation work for the request at `queue_pos` (the
    /// general path of [`Self::generation_phase_ahead`]).
    fn generation_ahead_one(
        &mut self,
        step: u64,
        queue_pos: usize,
        req: RequestIndex,
    ) -> Result<()> {
        let request = &self.requests[req as usize];
        if request.abort_requested {
            return Ok(()); // retired when the older step closes
        }
        if let Some(mark) = self.ahead_mark(step, req) {
            // A decode of the older step is still `Decoding` unless a step planned ahead
            // (since reverted) preempted it; a completing prompt is not yet.
            if request.state != RequestState::Decoding && self.preempted_after_older_step(req) {
                return Ok(());
            }
            // A chunk that does not complete the prompt continues in the context
            // phase; a token that is the request's last finishes it.
            if mark.row >= 0 && request.remaining_tokens > 1 {
                self.schedule_decode::<true>(step, queue_pos, req, mark.row)?;
            }
            return Ok(());
        }
        match request.state {
            RequestState::Decoding => {
                self.schedule_decode::<true>(step, queue_pos, req, -1)?;
            }
            RequestState::Suspended if request.cold.victim_step != step => {
                self.try_resume(step, queue_pos, req)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Appends a chunk of decodes gathered by [`Self::decode_run`]: the output columns
    /// both modes fill alike, the requests, each decode's inverse and their journal
    /// entries.
    #[inline]
    fn append_decode_chunk(
        &mut self,
        ids: &[RequestId],
        positions: &[u64],
        slots: &[i32],
        reqs: &[RequestIndex],
        inverses: &[DecodeInverse],
    ) {
        let out = &mut self.builder.out;
        out.generation_ids.extend_from_slice(ids);
        out.generation_positions.extend_from_slice(positions);
        out.generation_batch_slots.extend_from_slice(slots);
        let record = &mut self.builder.record;
        let from = entry_id(record.generation_reqs.len());
        record.generation_reqs.extend_from_slice(reqs);
        record.decode_undos.extend_from_slice(inverses);
        let to = entry_id(record.generation_reqs.len());
        if from == to {
            return;
        }
        // One journal entry for the run: the chunk before it, if it was the last change,
        // extends to cover this one.
        match record.journal.last_mut() {
            Some(JournalEntry::Decodes { to: end, .. }) if *end == from => *end = to,
            _ => record.journal.push(JournalEntry::Decodes { from, to }),
        }
    }

    /// Starts building `step` in the builder.
    pub(super) fn begin_step(&mut self, step: u64) {
        let decoding = self.state_counts[RequestState::Decoding.index()];
        self.builder.begin(step, self.queue.len(), decoding);
    }

    /// Undoes what the phases of a step that failed did (see [`Self::undo_step`]); the
    /// builder keeps its buffers.
    pub(super) fn abandon_step(&mut self) {
        let mut record = self.builder.take_record();
        self.ledger.take_evictions(&mut record.evictions);
        self.undo_step_restoring(&record);
        // No executor saw the step: its copy-ins never ran, so every eviction is undone.
        self.ledger.set_copy_in(&record.copy_in_pages, false);
        self.ledger.restore_evictions(&record.evictions, &[]);
        self.builder.put_back(record);
    }

    /// [`Self::undo_step`] with the ledger's releases restoring the prefix cache (a hit's
    /// superblock goes back where it was in the eviction order).
    pub(super) fn undo_step_restoring(&mut self, record: &StepRecord) {
        self.ledger.set_restoring(true);
        self.undo_step(record);
        self.ledger.set_restoring(false);
    }

    /// With prefix caching: the superblocks that hold the start of `req`'s prefill (the
    /// longest run of its chain's keys found), at most all but its last token (which is
    /// always computed, for its logits), and how many of them an earlier context entry of
    /// this step computes. A key is found cached (KV of a step that ran), else among the
    /// superblocks this step's earlier entries complete (`StepBuilder::step_keys`: same-step
    /// sharing). Extends the request's key chain over its known tokens first (a re-prefill
    /// has folded its generated tokens into its prompt).
    fn prefix_hits(&mut self, req: RequestIndex) -> (Vec<SuperblockId>, u64) {
        let per = self.layout.tokens_per_superblock();
        let request = &mut self.requests[req as usize];
        let cold = &mut *request.cold;
        let prefill = cold.tokens.len() as u64;
        chain_keys(cold.chain_seed, &cold.tokens, per, &mut cold.block_keys);
        let Some(cache) = self.ledger.prefix_cache() else {
            return (Vec::new(), 0);
        };
        #[expect(
            clippy::cast_possible_truncation,
            reason = "at most the superblocks of its tokens, a slice length"
        )]
        let most = ((prefill - 1) / per) as usize;
        let step_keys = &self.builder.step_keys;
        let mut written = 0;
        let hits = cold.block_keys[..most.min(cold.block_keys.len())]
            .iter()
            .map_while(|key| {
                cache.lookup(*key).or_else(|| {
                    let page = step_keys.get(key).copied();
                    written += u64::from(page.is_some());
                    page
                })
            })
            .collect();
        (hits, written)
    }

    /// With prefix caching: notes the full superblocks whose last token the context entry
    /// of `req` just made computes (its chunk `start..end`), for later admissions of this
    /// step to share (`StepBuilder::step_keys`). A superblock started before the chunk holds
    /// KV of earlier steps (one that ran, or the older pending step, which the executor
    /// runs first and which is reverted only after this one), and this step writes the rest.
    fn note_step_writes(&mut self, req: RequestIndex, start: u64, end: u64) {
        let per = self.layout.tokens_per_superblock();
        #[expect(
            clippy::cast_possible_truncation,
            reason = "superblocks of the request's tokens, within a slice length"
        )]
        let (first, last) = ((start / per) as usize, (end / per) as usize);
        if first >= last {
            return;
        }
        let request = &mut self.requests[req as usize];
        let cold = &mut *request.cold;
        chain_keys(cold.chain_seed, &cold.tokens, per, &mut cold.block_keys);
        let table = self
            .ledger
            .request(request.id)
            .expect("a request with a context entry is held by the ledger")
            .table();
        debug_assert!(last <= table.len() && last <= cold.block_keys.len());
        for (&key, &page) in cold.block_keys[first..last].iter().zip(&table[first..last]) {
            self.builder.step_keys.entry(key).or_insert(page);
        }
    }

    /// With prefix caching: registers the full superblocks `req` has computed under its
    /// chain's keys (before they leave its table, or as a prefill completes them), so
    /// requests with the same prefix find them.
    pub(super) fn register_computed(&mut self, req: RequestIndex) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let per = self.layout.tokens_per_superblock();
        let request = &self.requests[req as usize];
        #[expect(
            clippy::cast_possible_truncation,
            reason = "at most the superblocks of its tokens, a slice length"
        )]
        let full = (request.computed / per) as usize;
        if full == 0 {
            return;
        }
        let keyed = request.cold.block_keys.len();
        if keyed < full {
            // Only the tokens past the keyed superblocks, not a copy of the whole prompt
            // (every request retires through here, on every rank).
            #[expect(
                clippy::cast_possible_truncation,
                reason = "keyed superblocks of its tokens, within a slice length"
            )]
            let start = keyed * per as usize;
            let known = &request.cold.tokens;
            let mut tail = known[start.min(known.len())..].to_vec();
            if start > known.len() {
                let mut logged = Vec::new();
                self.token_log.append_to(req, request, &mut logged);
                tail.extend_from_slice(&logged[(start - known.len()).min(logged.len())..]);
            } else {
                self.token_log.append_to(req, request, &mut tail);
            }
            let cold = &mut *self.requests[req as usize].cold;
            extend_keys(cold.chain_seed, &tail, per, &mut cold.block_keys);
            #[cfg(debug_assertions)]
            {
                // The oracle: the chain over every token the request knows, from the seed.
                let request = &self.requests[req as usize];
                let mut all = request.cold.tokens.to_vec();
                self.token_log.append_to(req, request, &mut all);
                let mut oracle = Vec::new();
                chain_keys(request.cold.chain_seed, &all, per, &mut oracle);
                debug_assert_eq!(request.cold.block_keys, oracle);
            }
        }
        let request = &self.requests[req as usize];
        // A suspended request holds nothing here (its KV is in the host tier).
        let held = self
            .ledger
            .request(request.id)
            .map_or(0, |kv| kv.table().len());
        let keys = &request.cold.block_keys[..full.min(request.cold.block_keys.len()).min(held)];
        self.ledger
            .register_prefix(request.id, keys)
            .expect("a request holds the superblocks it computed");
    }

    /// Batch slots still free for entries of this step: what is free less what this
    /// step's entries and slot claims have counted. A claim counts even when no slot is
    /// free (the next one a victim or a sit-out frees later in the step is its), so the
    /// claims may exceed the free slots.
    fn free_slots_now(&self) -> u32 {
        #[expect(
            clippy::cast_possible_truncation,
            reason = "claims are live requests, whose indices are u32"
        )]
        let claims = self.builder.slot_claims.len() as u32;
        (self.batch_slots.free_count() - self.builder.new_slots).saturating_sub(claims)
    }

    pub(super) fn generation_phase(&mut self, step: u64) -> Result<()> {
        self.decode_run::<PlainRun>(step)
    }

    /// The general path of a plain step's generation phase, for the request `req` at
    /// `queue_pos` that the decode run stopped at.
    fn generation_one(&mut self, step: u64, queue_pos: usize, req: RequestIndex) -> Result<()> {
        let request = &self.requests[req as usize];
        match request.state {
            RequestState::Decoding => self.schedule_decode::<false>(step, queue_pos, req, -1),
            RequestState::Suspended if request.cold.victim_step != step => {
                self.try_resume(step, queue_pos, req)
            }
            _ => Ok(()),
        }
    }

    /// The generation phase in mode `M` ([`PlainRun`] for a plain step, [`AheadRun`] for a
    /// step planned ahead), over the whole queue. Its common case runs inline: requests
    /// that decode with the batch slot they hold, within the token budget, on a token that
    /// fits the superblocks they hold, and those with nothing to do in this phase (which
    /// `M` tells apart from those that need the general path). Each such decode is exactly
    /// what [`Self::schedule_decode`] would make of it. A request that needs more (a slot,
    /// a superblock, a resume, a preemption, the budget's end) goes to the mode's general
    /// path ([`DecodeRunMode::general`]), and the run goes on behind it.
    ///
    /// Entries are gathered a chunk at a time in local arrays (which nothing else can
    /// alias, so the loop keeps its state in registers) and appended to the output in
    /// bulk. The arrays live for the whole phase: a request for the general path (one per
    /// superblock a request fills) flushes the chunk and the run resumes with the same
    /// arrays, instead of setting up (and zeroing) new ones. Kept out of line: its chunk
    /// arrays would weigh on every caller's frame. Each mode is compiled apart
    /// (monomorphised), with its own filter and column inlined.
    #[inline(never)]
    fn decode_run<M: DecodeRunMode>(&mut self, step: u64) -> Result<()> {
        // Each decode's inverse names this step (see `DecodeInverse`).
        check_inverse_step(step)?;
        let mut ids = [0; CHUNK];
        let mut positions = [0; CHUNK];
        let mut slots = [0; CHUNK];
        let mut reqs = [0; CHUNK];
        // The mode's own column: each entry's input token, or its row (see `M::input`).
        let mut inputs = [0; CHUNK];
        // Each decode's inverse, for the step's record (see `append_decode_chunk`).
        let mut inverses = [DecodeInverse::ZERO; CHUNK];
        let mut queue_pos = 0;
        loop {
            // The general path may have scheduled tokens: the budget is read afresh.
            let budget = u64::from(self.config.max_num_tokens).saturating_sub(self.builder.tokens);
            let (count, end) = {
                let queue = &self.queue[..];
                let requests = &mut self.requests[..];
                let mut lane = self.ledger.decode_lane();
                let marks = &self.builder.ahead_marks[..];
                let room = usize::try_from(budget).unwrap_or(usize::MAX).min(CHUNK);
                let mut count = 0;
                let mut pos = queue_pos;
                while count < room {
                    let Some(&req) = queue.get(pos) else {
                        break;
                    };
                    let request = &mut requests[req as usize];
                    let row = match M::admit(marks, step, req, request) {
                        Admit::Decode(row) => row,
                        Admit::Skip => {
                            pos += 1;
                            continue;
                        }
                        Admit::Stop => break,
                    };
                    let Some(slot) = request.batch_slot.get() else {
                        break;
                    };
                    // The request's index is also its ledger entry (see `add_request`).
                    let Some((position, inverse)) =
                        lane.try_decode_in_place(req as usize, request.id, step)
                    else {
                        break;
                    };
                    inverses[count] = inverse;
                    request.scheduled_step = step;
                    ids[count] = request.id;
                    positions[count] = position;
                    slots[count] = slot_id(slot);
                    reqs[count] = req;
                    inputs[count] = M::input(request, row);
                    count += 1;
                    pos += 1;
                }
                (count, pos)
            };
            self.append_decode_chunk(
                &ids[..count],
                &positions[..count],
                &slots[..count],
                &reqs[..count],
                &inverses[..count],
            );
            M::flush(&inputs[..count], &mut self.builder.out);
            self.builder.tokens += count as u64;
            queue_pos = end;
            // A full chunk goes on; a shorter one stopped at the queue's end, or at a
            // request for the general path (one that needs more, or the budget's end).
            if count == CHUNK {
                continue;
            }
            let Some(&req) = self.queue.get(queue_pos) else {
                return Ok(());
            };
            M::general(self, step, queue_pos, req)?;
            queue_pos += 1;
        }
    }

    /// `input_row` is the row of the older pending step's sampled tokens that holds the
    /// input token, or -1 when the token is known (the request's last token). `AHEAD`: the
    /// step is planned while the older one is pending (the plain path is compiled apart).
    fn schedule_decode<const AHEAD: bool>(
        &mut self,
        step: u64,
        queue_pos: usize,
        req: RequestIndex,
        input_row: i32,
    ) -> Result<()> {
        let request = &self.requests[req as usize];
        let needs_slot = request.batch_slot.is_none();
        if self.builder.tokens >= u64::from(self.config.max_num_tokens)
            || (needs_slot && self.free_slots_now() == 0)
        {
            // Out of budget: not scheduled, keeps its batch slot; not a sit-out. One
            // without a slot claims one, so nothing behind it takes the next one freed.
            if needs_slot {
                self.requests[req as usize].cold.touched_step = step;
                self.builder.slot_claims.push(req);
            }
            return Ok(());
        }
        let id = request.id;
        let mut preempted = false;
        loop {
            // The request's index is also its ledger entry (see `add_request`).
            if let Some((position, inverse)) = self.ledger.decode_at(req as usize, id, step)? {
                self.push_generation_entry::<AHEAD>(step, req, position, input_row, inverse);
                if preempted {
                    self.mark_served_by_preempting(step, queue_pos, req);
                }
                return Ok(());
            }
            if self.config.serving_mode == ServingMode::DisaggregatedGeneration {
                return Err(CoreError::PreemptionDisabled(
                    self.decode_pressure_message(id),
                ));
            }
            let kv = self.ledger.request(id)?;
            let new_len = kv.len().max(kv.next_decode_position() + 1);
            if !self.preempt_for(step, queue_pos, id, new_len)? {
                break;
            }
            preempted = true;
        }
        // Neither pages nor a victim: sit out, and give the batch slot up so a one-step-ahead
        // executor cannot read it as still belonging to this request.
        let request = &mut self.requests[req as usize];
        request.cold.touched_step = step;
        let slot = request.batch_slot.take();
        if let Some(slot) = slot {
            self.batch_slots.release(slot);
        }
        self.builder.record.sat_out.push(SatOut { req, slot });
        self.builder.out.sat_out_ids.push(request.id);
        Ok(())
    }

    /// Records a scheduled decode straight into the output being built (the common case
    /// touches each request once per step); a victim's entry is dropped in
    /// `finish_step`, a missing batch slot is filled in there (and, for a plain step, the
    /// input refs: all -1). Owner ranks are not stored: the output computes them from the
    /// positions ([`ScheduleOutput::generation_owner_ranks`]). `inverse`: the decode
    /// grow's inverse, kept for a revert of the step.
    fn push_generation_entry<const AHEAD: bool>(
        &mut self,
        step: u64,
        req: RequestIndex,
        position: u64,
        input_row: i32,
        inverse: DecodeInverse,
    ) {
        let request = &mut self.requests[req as usize];
        debug_assert!(input_row >= 0 || position == request.computed);
        let entry = self.builder.out.generation_ids.len();
        request.scheduled_step = step;
        let slot = if let Some(slot) = request.batch_slot.get() {
            slot_id(slot)
        } else {
            self.builder.new_slots += 1;
            self.builder.generation_needing_slots.push(entry);
            -1
        };
        let out = &mut self.builder.out;
        out.generation_ids.push(request.id);
        out.generation_positions.push(position);
        if AHEAD {
            // A token still in flight is never given as a (stale) value.
            let known = input_row < 0;
            out.generation_input_tokens
                .push(if known { request.last_token } else { -1 });
            out.generation_input_refs.push(input_row);
        } else {
            out.generation_input_tokens.push(request.last_token);
        }
        out.generation_batch_slots.push(slot);
        let record = &mut self.builder.record;
        record.generation_reqs.push(req);
        record.decode_undos.push(inverse);
        record.journal.push(JournalEntry::Decode {
            req,
            entry: entry_id(entry),
        });
        self.builder.tokens += 1;
    }

    /// Brings a suspended request back when the pool has room for it. The queue head
    /// does not wait for room: like any other head it may take pages from requests
    /// behind it (see `preempt_for`), so a small preemption bound cannot stall it.
    fn try_resume(&mut self, step: u64, queue_pos: usize, req: RequestIndex) -> Result<()> {
        let id = self.requests[req as usize].id;
        let mut resumed = self.ledger.resume(id)?;
        if !resumed && queue_pos == 0 {
            let len = self.ledger.request(id)?.suspended_len().unwrap_or_default();
            resumed = self.preempt_for(step, queue_pos, id, len)? && self.ledger.resume(id)?;
        }
        if resumed {
            let request = &mut self.requests[req as usize];
            request.cold.resumed_step = step;
            let back_to = request.cold.suspended_from;
            if back_to == RequestState::Decoding {
                // It decodes from the next step: claim its batch slot now, at its place
                // in queue order, before the context phase admits newer requests into
                // the free ones (a resumed prefill gets one in that phase, in order).
                request.cold.touched_step = step;
                self.builder.slot_claims.push(req);
            }
            self.set_state(req, back_to);
            self.builder.record.journal.push(JournalEntry::Resume(req));
            // Its host pages stay taken until this step is updated (see `host.rs`).
            let table = self.ledger.request(id)?.table();
            let host_pages = self.host.pages(req);
            debug_assert_eq!(table.len(), host_pages.len());
            let out = &mut self.builder.out;
            out.resumed_ids.push(id);
            out.resumed_block_ids
                .extend(table.iter().copied().map(page_id));
            out.resumed_host_block_ids
                .extend(host_pages.iter().copied().map(page_id));
            out.resumed_block_counts.push(table.len() as u64);
            // Its pages hold its KV only once this step's copy-in has run: until the step
            // is updated nothing keys them (a recompute-pause by the step planned ahead, an
            // abort), and its revert does not give them back a prefix they were evicted of.
            let record = &mut self.builder.record;
            let from = record.copy_in_pages.len();
            record.copy_in_pages.extend_from_slice(table);
            self.ledger
                .set_copy_in(&self.builder.record.copy_in_pages[from..], true);
        }
        Ok(())
    }

    /// `ahead`: the step is planned while the older one is pending, whose chunks and
    /// completions (marked by `mark_older_step_work`) count as done. Kept out of line:
    /// inlined into `schedule()` (where it has two callers) its queue walk took about two
    /// instructions more a request (cachegrind, `scheduler_step` under pressure).
    #[inline(never)]
    pub(super) fn context_phase(&mut self, step: u64, ahead: bool) -> Result<()> {
        let candidates = self.state_counts[RequestState::Waiting.index()]
            + self.state_counts[RequestState::Prefilling.index()];
        if candidates == 0 {
            return Ok(()); // steady decode: no need to walk the queue again
        }
        let unit = u64::from(self.config.effective_chunk_unit());
        let max_tokens = u64::from(self.config.max_num_tokens);
        // The most prompt tokens one request takes while others are live (none: uncapped).
        let cap = self
            .config
            .prefill_cap(self.queue.len())
            .unwrap_or(u64::MAX);
        // Under priority admission an admission that found no pages holds back the
        // admissions behind it, not the prompts already admitted (see the stop below).
        let admitted_go_on = self.config.admission_policy == AdmissionPolicy::Priority;
        let mut admissions_held = false;
        for queue_pos in 0..self.queue.len() {
            let req = self.queue[queue_pos];
            let request = &self.requests[req as usize];
            let mut admitting = match request.state {
                RequestState::Waiting => true,
                RequestState::Prefilling => false,
                RequestState::Decoding | RequestState::Suspended => continue,
            };
            let mut start = request.computed;
            if ahead {
                if request.abort_requested {
                    continue;
                }
                if let Some(mark) = self.ahead_mark(step, req) {
                    // Completing in the older step (it decodes), or preempted after it
                    // with its work in flight: nothing to prefill now.
                    if mark.row >= 0 || self.preempted_after_older_step(req) {
                        continue;
                    }
                    start = mark.computed;
                    admitting = false;
                }
            }
            if request.cold.victim_step == step
                || (admitting
                    && (admissions_held
                        || (self.builder.preempted && !self.config.admit_after_preemption)))
            {
                continue;
            }
            let needs_slot = request.batch_slot.is_none();
            if needs_slot && self.free_slots_now() == 0 {
                continue;
            }
            let (hits, written_hits) = if admitting && self.config.enable_prefix_caching {
                self.prefix_hits(req)
            } else {
                (Vec::new(), 0)
            };
            let request = &self.requests[req as usize];
            let cached = hits.len() as u64 * self.layout.tokens_per_superblock();
            start += cached;
            let remaining = request.prefill_len() - start;
            // The cap is at least one unit (and needs chunked prefill), so only the step's
            // budget can leave a request no chunk.
            let allowed = (max_tokens - self.builder.tokens).min(cap);
            let chunk = if remaining <= allowed {
                remaining
            } else if self.config.enable_chunked_prefill {
                allowed - allowed % unit
            } else {
                0
            };
            if chunk == 0 {
                break; // head of line (below)
            }
            let id = request.id;
            if !hits.is_empty() {
                self.ledger.attach_shared(id, &hits)?;
            }
            if !self.reserve_prefill(step, queue_pos, req, start, start + chunk, cached > 0)? {
                if !hits.is_empty() {
                    // Not admitted after all: its hits go back where they were.
                    self.ledger.shrink_restoring(id, 0)?;
                }
                // Head of line: nothing behind may take budget or pages this one could not.
                // Under priority admission a request may be queued ahead of prompts already
                // admitted, which hold pages: they go on (a capacity policy or mode that never
                // preempts would otherwise wait on them for good), only admissions wait.
                if admitting && admitted_go_on {
                    admissions_held = true;
                    continue;
                }
                break;
            }
            self.push_context_entry(step, req, start, chunk);
            if self.config.enable_prefix_caching {
                self.note_step_writes(req, start, start + chunk);
            }
            if admitting && self.config.enable_prefix_caching {
                let request = &self.requests[req as usize];
                let entry = self.builder.record.context.last_mut().expect("just pushed");
                entry.cached = cached;
                entry.shared = written_hits * self.layout.tokens_per_superblock();
                entry.queried = request.prefill_len();
                entry.recompute = request.cold.recomputed_tokens > 0;
                if let Some(last) = self.builder.out.context_cached_lens.last_mut() {
                    *last = cached;
                }
            }
            self.builder.new_slots += u32::from(needs_slot);
        }
        Ok(())
    }

    fn push_context_entry(&mut self, step: u64, req: RequestIndex, start: u64, len: u64) {
        let request = &mut self.requests[req as usize];
        request.scheduled_step = step;
        let end = start + len;
        let out = &mut self.builder.out;
        out.context_ids.push(request.id);
        out.context_starts.push(start);
        out.context_lens.push(len);
        out.context_cached_lens.push(0);
        out.context_completes.push(end == request.prefill_len());
        out.context_batch_slots
            .push(request.batch_slot.get().map_or(-1, slot_id));
        #[expect(
            clippy::cast_possible_truncation,
            reason = "a chunk lies inside `tokens`: `end <= prefill_len() == tokens.len()`"
        )]
        out.context_token_ids
            .extend_from_slice(&request.cold.tokens[start as usize..end as usize]);
        self.builder.record.context.push(ContextEntry {
            req,
            start,
            len,
            completes: end == request.prefill_len(),
            cached: 0,
            shared: 0,
            queried: 0,
            recompute: false,
        });
        self.builder.tokens += len;
    }

    /// Reserves KV up to `target` tokens for a prompt chunk, preempting requests behind
    /// it if needed. `false` (nothing reserved) if that is not possible this step.
    fn reserve_prefill(
        &mut self,
        step: u64,
        queue_pos: usize,
        req: RequestIndex,
        start: u64,
        target: u64,
        hit: bool,
    ) -> Result<bool> {
        let request = &self.requests[req as usize];
        let id = request.id;
        // An admission with cached superblocks is undone down to nothing (its hits too).
        let undo_floor = |len_before: u64| if hit { 0 } else { len_before };
        let (reserve_to, len_before) = match self.config.capacity_policy {
            CapacityPolicy::MaxUtilization => (target, undo_floor(start)),
            CapacityPolicy::GuaranteedNoEvict => {
                let held = self.ledger.request(id)?.len();
                if held >= target {
                    return Ok(true);
                }
                // Admission: the whole remaining output at once, so decode never fails.
                let remaining_output = u64::from(request.cold.max_new_tokens) - request.generated();
                (request.prefill_len() + remaining_output, undo_floor(held))
            }
        };
        loop {
            if self.ledger.grow(id, reserve_to)? {
                self.builder
                    .record
                    .journal
                    .push(JournalEntry::Reserve { req, len_before });
                return Ok(true);
            }
            if !self.preempt_for(step, queue_pos, id, reserve_to)? {
                return Ok(false);
            }
        }
    }

    /// A decode request that got its page by preempting is no victim for the rest of the
    /// step: an older context request taking its pages would make the preemption it
    /// paid for futile.
    fn mark_served_by_preempting(&mut self, step: u64, queue_pos: usize, req: RequestIndex) {
        self.requests[req as usize].cold.rescued_step = step;
        self.builder.victims.remove(queue_pos);
        self.builder.head_victims.remove(queue_pos);
    }

    /// The ladder for the requester at queue position `requester_pos`, which needs its KV
    /// to reach `new_len` global tokens: decide first, then act. It takes candidates
    /// strictly behind the requester in policy order (below the preemption bound; the
    /// queue head then also those at the bound) until they and the free pool cover what
    /// the requester lacks, and only then suspends or recompute-pauses them. If they
    /// cannot, nothing is preempted and it returns `false`: the requester sits out or
    /// waits. A suspend frees the same pages as a recompute-pause (the host tier is not
    /// part of the pool), so the count is the same either way; whether each victim is
    /// suspended or recompute-paused is decided when it is preempted (`suspends`).
    fn preempt_for(
        &mut self,
        step: u64,
        requester_pos: usize,
        requester: RequestId,
        new_len: u64,
    ) -> Result<bool> {
        if !self.config.may_preempt() {
            return Ok(false);
        }
        let held = self.ledger.request(requester)?.table().len() as u64;
        let need = self.layout.superblocks_for(new_len).saturating_sub(held);
        let mut covered = u64::from(self.ledger.free_superblocks());
        debug_assert!(covered < need, "the allocation failed, so pages are short");
        let bound = self.config.max_preemptions_per_request;
        let policy = self.config.victim_policy;
        let checkpoints = (
            self.builder.victims.checkpoint(),
            self.builder.head_victims.checkpoint(),
        );
        self.builder.plan.clear();
        // The queue head may also take requests at their bound: a bound limits thrash
        // and must never stop the oldest live request, which everything else waits
        // behind. A bound of 0 turns preemption off altogether.
        let tiers: &[bool] = if requester_pos == 0 && bound > 0 {
            &[false, true]
        } else {
            &[false]
        };
        'tiers: for &at_bound in tiers {
            let (requests, queue, drafts) = (&self.requests, &self.queue, &self.drafts);
            let key = |queue_pos: usize| -> VictimKey {
                let r = &requests[queue[queue_pos] as usize];
                let holds_pages =
                    matches!(r.state, RequestState::Prefilling | RequestState::Decoding);
                if !holds_pages
                    || (r.cold.victim_choices >= bound) != at_bound
                    || r.cold.resumed_step == step
                    || r.cold.victim_step == step
                    || r.cold.rescued_step == step
                    || drafts.pending(queue[queue_pos])
                {
                    return None;
                }
                Some(match policy {
                    VictimPolicy::NewestFirst => 0,
                    VictimPolicy::LeastComputedFirst => r.computed,
                    // The priority shifted to `0..2^32`, order kept.
                    VictimPolicy::Priority => {
                        i64::from(r.cold.priority).abs_diff(i64::from(i32::MIN))
                    }
                })
            };
            let finder = if at_bound {
                &mut self.builder.head_victims
            } else {
                &mut self.builder.victims
            };
            while covered < need {
                let Some(queue_pos) = finder.find(requester_pos, key) else {
                    continue 'tiers;
                };
                finder.remove(queue_pos);
                let id = self.requests[self.queue[queue_pos] as usize].id;
                // With prefix caching a victim frees only what it alone references.
                covered += u64::from(self.ledger.exclusive_superblocks(id)?);
                self.builder.plan.push(queue_pos);
            }
            break;
        }
        if covered < need {
            self.builder.victims.rollback(checkpoints.0);
            self.builder.head_victims.rollback(checkpoints.1);
            return Ok(false);
        }
        for i in 0..self.builder.plan.len() {
            let victim = self.queue[self.builder.plan[i]];
            self.preempt(step, victim, requester)?;
        }
        Ok(true)
    }

    fn preempt(&mut self, step: u64, victim: RequestIndex, requester: RequestId) -> Result<()> {
        let request = &self.requests[victim as usize];
        let id = request.id;
        // Victims are behind their requester, so one scheduled in this step has a
        // generation entry (its context turn is yet to come); one planned ahead may
        // still be `Prefilling`, completing its prompt in the older pending step.
        if request.scheduled_step == step {
            // Scheduled earlier in this step: undo its decode token and give its budget
            // back; its entry is dropped when the output is built.
            let record = &self.builder.record;
            if let Some(entry) = record.generation_reqs.iter().rposition(|&g| g == victim) {
                self.ledger
                    .undo_decode(id, step, record.decode_undos[entry])?;
            }
            self.builder.tokens -= 1;
            self.builder.new_slots -= u32::from(request.batch_slot.is_none());
            self.builder.generation_removed = true;
        }
        let held = superblock_count(self.ledger.request(id)?.table().len());
        let suspend = self.suspends(victim, held)?;
        // Its computed superblocks stay cached: its re-prefill (or another request with
        // the same prefix) may find them.
        self.register_computed(victim);
        let request = &mut self.requests[victim as usize];
        request.scheduled_step = NO_STEP;
        request.cold.victim_step = step;
        request.cold.victim_choices += 1;
        if let Some(slot) = request.batch_slot.take() {
            self.batch_slots.release(slot);
        }
        self.builder.preempted = true;
        if suspend {
            let table = self.ledger.request(id)?.table();
            let host_pages = self.host.take(victim, held);
            let out = &mut self.builder.out;
            out.suspended_block_ids
                .extend(table.iter().copied().map(page_id));
            out.suspended_host_block_ids
                .extend(host_pages.iter().copied().map(page_id));
            out.suspended_block_counts.push(table.len() as u64);
            out.suspended_ids.push(id);
            out.suspended_requester_ids.push(requester);
            self.ledger.suspend(id)?;
            let request = &mut self.requests[victim as usize];
            request.cold.suspended_from = request.state;
            self.metrics.suspensions += 1;
            self.metrics.suspended_superblocks += u64::from(held);
            self.metrics.suspended_tokens += request.computed;
            self.set_state(victim, RequestState::Suspended);
        } else {
            self.flush_tokens(victim);
            let folded = self.requests[victim as usize].cold.tokens.len() as u64
                - self.ledger.request(id)?.prompt_len();
            self.ledger.reset_for_recompute(id, folded)?;
            let request = &mut self.requests[victim as usize];
            let lost = std::mem::take(&mut request.computed);
            request.cold.recomputed_tokens += lost;
            self.metrics.recomputed_tokens += lost;
            self.metrics.preemptions += 1;
            self.set_state(victim, RequestState::Waiting);
            self.builder.out.preempted_ids.push(id);
            self.builder.out.preempted_requester_ids.push(requester);
        }
        Ok(())
    }

    /// Whether a victim holding `held` superblocks is suspended rather than
    /// recompute-paused: the host tier has room for it and the configured policy picks
    /// it. Every input is mirrored state (the host ledger, the victim's state and global
    /// sizes, the configuration).
    fn suspends(&self, victim: RequestIndex, held: u32) -> Result<bool> {
        let config = &self.config;
        // A superblock another request references is never copied out from under it:
        // a victim sharing one is recompute-paused, and its re-prefill finds it cached.
        if self
            .ledger
            .shares_superblocks(self.requests[victim as usize].id)?
        {
            return Ok(false);
        }
        if !matches!(
            config.serving_mode,
            ServingMode::NonHelix | ServingMode::AggregatedHelix
        ) || held == 0
            || held > self.host.free_count()
            // Resumed by the older pending step (one step ahead): its host pages are still
            // read by that step's copy-in until its update, so it cannot go back to the host
            // now; it is recompute-paused instead.
            || !self.host.pages(victim).is_empty()
        {
            return Ok(false);
        }
        let request = &self.requests[victim as usize];
        Ok(match config.suspend_policy {
            SuspendPolicy::SuspendFirst => true,
            SuspendPolicy::RecomputeFirst => request.state == RequestState::Decoding,
            SuspendPolicy::Cost => {
                let copied = u64::from(held) * self.layout.tokens_per_superblock();
                copied.saturating_mul(u64::from(config.suspend_cost_per_token))
                    < request
                        .computed
                        .saturating_mul(u64::from(config.recompute_cost_per_token))
            }
        })
    }

    /// Completes the output being built: hands out batch slots (generation entries, slot
    /// claims, then context entries, lowest free first), drops entries of requests
    /// preempted after they were scheduled, and digests it.
    pub(super) fn finish_step(&mut self, step: u64) {
        let record = &self.builder.record;
        debug_assert_eq!(
            record.decode_undos.len(),
            record.generation_reqs.len(),
            "a step keeps one inverse per generation entry"
        );
        for &entry in &self.builder.generation_needing_slots {
            let req = self.builder.record.generation_reqs[entry];
            let request = &mut self.requests[req as usize];
            if request.scheduled_step != step {
                continue; // preempted after it was scheduled
            }
            let slot = self
                .batch_slots
                .take_lowest()
                .expect("a free batch slot was counted for this entry");
            request.batch_slot.set(slot);
            self.builder.record.new_slot_reqs.push(req);
            self.builder.out.generation_batch_slots[entry] = slot_id(slot);
        }
        // Slot claims, in queue order, between generation and context entries: every
        // generation entry was counted with room left after the claims made before it,
        // every context entry with room after all claims, so the claims take only what
        // no entry counted on. A claim that found no slot free and none freed later in
        // the step goes without, and claims again at its place in the next step.
        for &req in &self.builder.slot_claims {
            let request = &mut self.requests[req as usize];
            if request.state != RequestState::Decoding {
                // Preempted later in the step (a resumed request never is): its claim
                // kept a slot free for the rest of the step, which only delays others.
                continue;
            }
            let Some(slot) = self.batch_slots.take_lowest() else {
                break;
            };
            request.batch_slot.set(slot);
            self.builder.record.new_slot_reqs.push(req);
        }
        for (i, entry) in self.builder.record.context.iter().enumerate() {
            let request = &mut self.requests[entry.req as usize];
            if request.batch_slot.is_none() {
                let slot = self
                    .batch_slots
                    .take_lowest()
                    .expect("a free batch slot was counted for this entry");
                request.batch_slot.set(slot);
                self.builder.record.new_slot_reqs.push(entry.req);
                self.builder.out.context_batch_slots[i] = slot_id(slot);
            }
        }
        if self.builder.generation_removed {
            self.drop_preempted_generation_entries(step);
        }
        // A plain step's inputs are all known: its refs are filled in one go.
        let entries = self.builder.out.generation_ids.len();
        self.builder.out.generation_input_refs.resize(entries, -1);
        // Drafts last: they take only what every other decision of the step left.
        self.draft_phase(step);
        // `sample_ids` is not built: the output computes it (generation ids, then the
        // completing context ids) when asked for.
        let out = &mut self.builder.out;
        out.num_tokens = self.builder.tokens;
        out.digest = out.compute_digest(self.fingerprint);

        // A step planned ahead of one with entries is no stall: requests waiting on that
        // step's tokens (known to finish, or preempted with a token in flight) move on
        // when it closes.
        let progress = !out.generation_ids.is_empty()
            || !out.context_ids.is_empty()
            || !out.resumed_ids.is_empty()
            || self.pending.newest().is_some_and(|older| {
                !(older.generation_reqs.is_empty() && older.context.is_empty())
            });
        self.builder.record.stalled_steps_before = self.stalled_steps;
        self.stalled_steps = if progress || self.queue.is_empty() {
            0
        } else {
            self.stalled_steps + 1
        };
        let utilization =
            f64::from(self.ledger.used_superblocks()) / f64::from(self.config.capacity_superblocks);
        self.metrics.kv_utilization_peak = self.metrics.kv_utilization_peak.max(utilization);
    }

    /// One order-preserving pass over the generation entries, keeping those whose
    /// request was not preempted after being scheduled.
    fn drop_preempted_generation_entries(&mut self, step: u64) {
        // The runs of decodes name entries by position, which the drop moves: each
        // becomes its `Decode`s again (the journal then reads as it always did).
        let record = &mut self.builder.record;
        if record
            .journal
            .iter()
            .any(|entry| matches!(entry, JournalEntry::Decodes { .. }))
        {
            let mut journal =
                Vec::with_capacity(record.journal.len() + record.generation_reqs.len());
            for &change in &record.journal {
                match change {
                    JournalEntry::Decodes { from, to } => {
                        journal.extend((from..to).map(|entry| JournalEntry::Decode {
                            req: record.generation_reqs[entry as usize],
                            entry,
                        }));
                    }
                    _ => journal.push(change),
                }
            }
            record.journal = journal;
        }
        let generation = &mut record.generation_reqs;
        let out = &mut self.builder.out;
        // Only a step planned ahead has its refs yet (a plain one fills them in after).
        let refs = !out.generation_input_refs.is_empty();
        let mut kept = 0;
        for i in 0..generation.len() {
            let req = generation[i];
            if self.requests[req as usize].scheduled_step != step {
                continue;
            }
            generation[kept] = req;
            out.generation_ids[kept] = out.generation_ids[i];
            out.generation_positions[kept] = out.generation_positions[i];
            out.generation_input_tokens[kept] = out.generation_input_tokens[i];
            if refs {
                out.generation_input_refs[kept] = out.generation_input_refs[i];
            }
            out.generation_batch_slots[kept] = out.generation_batch_slots[i];
            kept += 1;
        }
        generation.truncate(kept);
        out.generation_ids.truncate(kept);
        out.generation_positions.truncate(kept);
        out.generation_input_tokens.truncate(kept);
        if refs {
            out.generation_input_refs.truncate(kept);
        }
        out.generation_batch_slots.truncate(kept);
    }

    /// Undoes the reservations (newest first), resumes, new batch slots and sit-outs of
    /// the step of `record` (a pending one, or the one being built). Preemptions and
    /// suspends stay applied: they are identical on every rank, and their victims simply
    /// re-prefill or resume later.
    pub(super) fn undo_step(&mut self, record: &StepRecord) {
        let step = record.step;
        let generation = &record.generation_reqs;
        let inverse = |entry: u32| Some(record.decode_undos[entry as usize]);
        for &change in record.journal.iter().rev() {
            match change {
                JournalEntry::Decodes { from, to } => {
                    for entry in (from..to).rev() {
                        let req = generation[entry as usize];
                        self.undo_change(step, req, change, inverse(entry));
                    }
                }
                JournalEntry::Decode { req, entry } => {
                    self.undo_change(step, req, change, inverse(entry));
                }
                JournalEntry::Reserve { req, .. } | JournalEntry::Resume(req) => {
                    self.undo_change(step, req, change, None);
                }
                JournalEntry::Drafts => {
                    for &drafts in record.drafts.iter().rev() {
                        self.undo_drafts(step, generation[drafts.entry as usize], drafts);
                    }
                }
            }
        }
        for &req in &record.new_slot_reqs {
            if let Some(slot) = self.requests[req as usize].batch_slot.take() {
                self.batch_slots.release(slot);
            }
        }
        for &SatOut { req, slot } in &record.sat_out {
            let request = &mut self.requests[req as usize];
            // A victim since (of this step or of one planned ahead) holds no slot: its
            // preemption stays applied.
            let victim = request.cold.victim_step != NO_STEP && request.cold.victim_step >= step;
            if request.cold.zombie || victim {
                continue;
            }
            if let Some(slot) = slot {
                self.batch_slots.take(slot);
                request.batch_slot.set(slot);
            }
        }
    }

    /// Undoes one change of the step, the request `req`'s (`entry` is its journal entry;
    /// a decode of a `Decodes` run is undone as its own `Decode`, with its `inverse`).
    fn undo_change(
        &mut self,
        step: u64,
        req: RequestIndex,
        entry: JournalEntry,
        inverse: Option<DecodeInverse>,
    ) {
        let request = &self.requests[req as usize];
        // A zombie finished meanwhile (the older step's update retired it): what it holds
        // is freed after this undo, but its ledger change is undone first, so the pages the
        // step took go back to the free list in reverse order, as if it never ran (its
        // state is that of a retired request: nothing else to restore).
        let zombie = request.cold.zombie;
        if request.cold.victim_step != NO_STEP && request.cold.victim_step >= step {
            // Its reservations went with the preemption. One suspended by a step
            // planned ahead (since reverted) took this step's work to the host tier:
            // that work never ran, so it re-prefills what it has instead.
            if !zombie && request.cold.victim_step > step {
                let resume = matches!(entry, JournalEntry::Resume(_));
                if request.state == RequestState::Suspended && !resume {
                    self.recompute_instead_of_resume(req);
                } else if resume && request.state == RequestState::Waiting {
                    // Resumed by this step, recompute-paused by the one planned ahead:
                    // it re-prefills, and no copy-in will read its host copy any more
                    // (none counts as resumed: this step did not run).
                    self.host.release(req);
                }
            }
            return;
        }
        let id = request.id;
        let undone = match entry {
            JournalEntry::Decode { .. } | JournalEntry::Decodes { .. } => {
                let inverse = inverse.expect("a decode is undone with its inverse");
                self.ledger.undo_decode(id, step, inverse)
            }
            JournalEntry::Reserve { len_before, .. } => self.ledger.shrink(id, len_before),
            JournalEntry::Drafts => unreachable!("drafts are undone by `undo_drafts`"),
            // Its host pages were kept (they are released when a step is updated).
            JournalEntry::Resume(_) => self.ledger.suspend(id).map(|_| {
                if !zombie {
                    self.set_state(req, RequestState::Suspended);
                }
            }),
        };
        undone.expect("the ledger accepts undoing a change it made in this step");
    }

    /// A request suspended by a later step whose work in the step being reverted went
    /// to the host tier with it: it is recompute-paused instead (its host share freed,
    /// every known token folded into its prompt), so no KV of a step that never ran is
    /// ever resumed.
    fn recompute_instead_of_resume(&mut self, req: RequestIndex) {
        self.release_host_pages(req);
        self.flush_tokens(req);
        let request = &mut self.requests[req as usize];
        request.computed = 0;
        let (id, known) = (request.id, request.cold.tokens.len() as u64);
        let folded = known
            - self
                .ledger
                .request(id)
                .expect("a live request is held by the ledger")
                .prompt_len();
        self.ledger
            .reset_for_recompute(id, folded)
            .expect("a suspended request folds its known tokens");
        self.set_state(req, RequestState::Waiting);
    }

    fn decode_pressure_message(&self, id: RequestId) -> String {
        format!(
            "request {id} needs a KV page for its next decode token and the pool is full ({} of {} superblocks \
             used), but a disaggregated generation server may not recompute-pause or suspend requests. Raise the \
             KV budget (kv_superblocks / kv_tokens), lower max_batch_size or max_num_tokens, use \
             capacity_policy=\"guaranteed_no_evict\" so each request reserves its whole output at admission, or \
             serve aggregated (serving_mode=\"aggregated_helix\") so requests can be recompute-paused. The step \
             was rolled back.",
            self.ledger.used_superblocks(),
            self.ledger.capacity()
        )
    }

    pub(super) fn deadlock_message(&self) -> String {
        let config = &self.config;
        let remedy = match (config.serving_mode, config.capacity_policy) {
            (ServingMode::DisaggregatedGeneration, _) => {
                "raise the KV budget (kv_superblocks / kv_tokens), lower max_batch_size or max_num_tokens, use \
                 capacity_policy=\"guaranteed_no_evict\", or serve aggregated (serving_mode=\"aggregated_helix\") \
                 so requests can be recompute-paused"
                    .to_string()
            }
            (_, CapacityPolicy::GuaranteedNoEvict) => {
                "raise the KV budget (kv_superblocks / kv_tokens) or lower max_batch_size".to_string()
            }
            (ServingMode::NonHelix, CapacityPolicy::MaxUtilization) => format!(
                "raise the KV budget (kv_superblocks / kv_tokens), lower max_batch_size or max_num_tokens, raise \
                 max_preemptions_per_request (now {}), or give the scheduler a larger host tier \
                 (host_tier_superblocks, now {})",
                config.max_preemptions_per_request, config.host_tier_superblocks
            ),
            (ServingMode::AggregatedHelix, CapacityPolicy::MaxUtilization) => format!(
                "raise the KV budget (kv_superblocks / kv_tokens), lower max_batch_size or max_num_tokens, or raise \
                 max_preemptions_per_request (now {}) so more requests can be recompute-paused",
                config.max_preemptions_per_request
            ),
        };
        format!(
            "{} consecutive steps made no progress with {} live requests ({} waiting, {} prefilling, {} decoding, \
             {} suspended) and {} of {} KV superblocks in use; {remedy}",
            self.stalled_steps,
            self.queue.len(),
            self.state_counts[RequestState::Waiting.index()],
            self.state_counts[RequestState::Prefilling.index()],
            self.state_counts[RequestState::Decoding.index()],
            self.state_counts[RequestState::Suspended.index()],
            self.ledger.used_superblocks(),
            self.ledger.capacity(),
        )
    }
}

/// Entries a decode run gathers before it appends them to the output.
const CHUNK: usize = 64;

/// What a decode run does with the request it reached.
enum Admit {
    /// Nothing to do in this phase: passed over.
    Skip,
    /// Needs the general path: the run stops here, the request untouched.
    Stop,
    /// Decodes, if its slot and superblocks allow, on the token in this row of the older
    /// pending step's sampled tokens (-1: the token is known).
    Decode(i32),
}

/// What differs between [`Scheduler::decode_run`]'s modes: which requests it decodes,
/// the one column it keeps per entry besides those both fill alike, and its general path
/// (the ledger's decode grow and the inverse the record keeps are the same in both). A
/// mode has no state: its functions are inlined into the run, which is compiled apart per
/// mode.
trait DecodeRunMode {
    /// Whether the request `req` at the run's position decodes, is passed over or stops
    /// the run. `marks` are the older pending step's marks (read only one step ahead).
    fn admit(marks: &[AheadMark], step: u64, req: RequestIndex, request: &Request) -> Admit;
    /// The mode's column for a decoding entry, from its request and the row [`Self::admit`]
    /// gave.
    fn input(request: &Request, row: i32) -> i32;
    /// Appends a chunk's values of the mode's column (`inputs`) to `out`.
    fn flush(inputs: &[i32], out: &mut ScheduleOutput);
    /// The general path for the request `req` at `queue_pos`, where the run stopped.
    fn general(
        scheduler: &mut Scheduler,
        step: u64,
        queue_pos: usize,
        req: RequestIndex,
    ) -> Result<()>;
}

/// A plain step's decode run: `Decoding` requests decode on their last token, `Waiting`
/// and `Prefilling` ones are passed over, a `Suspended` one needs the general path (a
/// resume).
struct PlainRun;

impl DecodeRunMode for PlainRun {
    #[inline]
    fn admit(_: &[AheadMark], _: u64, _: RequestIndex, request: &Request) -> Admit {
        match request.state {
            RequestState::Decoding => Admit::Decode(-1),
            RequestState::Waiting | RequestState::Prefilling => Admit::Skip,
            RequestState::Suspended => Admit::Stop,
        }
    }

    /// The input token: the request's last token.
    #[inline]
    fn input(request: &Request, _: i32) -> i32 {
        request.last_token
    }

    fn general(
        scheduler: &mut Scheduler,
        step: u64,
        queue_pos: usize,
        req: RequestIndex,
    ) -> Result<()> {
        scheduler.generation_one(step, queue_pos, req)
    }

    #[inline]
    fn flush(tokens: &[i32], out: &mut ScheduleOutput) {
        out.generation_input_tokens.extend_from_slice(tokens);
    }
}

/// The decode run of a step planned ahead: the requests decoding in the older step that
/// decode again here on the token they are sampling there (given as its row), and those
/// with nothing to do in this phase (an abort pending, `Waiting` or `Prefilling` with no
/// work in the older step, `Decoding` with its last token sampled there). Anything else
/// needs the general path.
struct AheadRun;

impl DecodeRunMode for AheadRun {
    #[inline]
    fn admit(marks: &[AheadMark], step: u64, req: RequestIndex, request: &Request) -> Admit {
        if request.abort_requested {
            return Admit::Skip;
        }
        match marks.get(req as usize) {
            Some(mark) if mark.step == step => {
                if request.state != RequestState::Decoding {
                    Admit::Stop
                } else if mark.row < 0 || request.remaining_tokens <= 1 {
                    Admit::Skip
                } else {
                    Admit::Decode(mark.row)
                }
            }
            _ => match request.state {
                RequestState::Waiting | RequestState::Prefilling => Admit::Skip,
                RequestState::Decoding | RequestState::Suspended => Admit::Stop,
            },
        }
    }

    /// The row of the older step's sampled tokens that holds the input.
    #[inline]
    fn input(_: &Request, row: i32) -> i32 {
        row
    }

    fn general(
        scheduler: &mut Scheduler,
        step: u64,
        queue_pos: usize,
        req: RequestIndex,
    ) -> Result<()> {
        scheduler.generation_ahead_one(step, queue_pos, req)
    }

    #[inline]
    fn flush(rows: &[i32], out: &mut ScheduleOutput) {
        // A token still in flight is never given as a (stale) value.
        out.generation_input_tokens
            .resize(out.generation_input_tokens.len() + rows.len(), -1);
        out.generation_input_refs.extend_from_slice(rows);
    }
}
