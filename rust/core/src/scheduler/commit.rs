//! Closing a step: `update` (it ran) or `revert` (it did not).

use super::drafts::Drafts;
use super::metrics::RequestMetrics;
use super::pending::{ContextEntry, DraftEntry, JournalEntry, StepRecord};
use super::request::{FinishReason, RequestIndex, RequestOutput, RequestState, NO_STEP};
use super::Scheduler;

impl Scheduler {
    /// Applies the step of `record` (taken out of the pending steps) for `update`: one
    /// order-preserving pass over the queue (generation and context entries are in
    /// queue order too) that appends sampled tokens, advances progress, counts waited steps,
    /// and retires finished and abort-requested requests, freeing their KV and batch slots.
    /// A request that the step scheduled one ahead of this one (still pending) refers to
    /// and that finishes here is held until that step closes (see `retire`).
    #[expect(
        clippy::too_many_lines,
        reason = "one pass that reads each request's hot record once; its rare cases are helpers already"
    )]
    pub(super) fn apply_step(
        &mut self,
        record: &StepRecord,
        tokens: &[i32],
        eos: Option<&[bool]>,
        accepted: Option<&[u32]>,
    ) {
        let step = record.step;
        let newer = self.pending.newest().map(|newer| newer.step);
        let ends = |sample: usize| eos.is_some_and(|flags| flags[sample]);
        let (generation, context) = (&record.generation_reqs[..], &record.context[..]);
        let draft_rows: usize = record.drafts.iter().map(|d| d.count as usize).sum();
        let mut at = Cursors {
            generation: 0,
            generation_row: 0,
            draft: 0,
            context: 0,
            context_sample: generation.len() + draft_rows,
            computed_tokens: generation.len() as u64,
        };
        // The fast path reads one row per entry: a step with drafts takes the general one.
        let plain_rows = record.drafts.is_empty();
        // The step ran: what it evicted is gone, and its copy-ins wrote the resumed KV
        // (both before this update registers anything, so a superblock the step computed
        // again may take an evicted key, and a resumed one may be keyed).
        self.ledger.forget_evictions(&record.evictions);
        self.ledger.set_copy_in(&record.copy_in_pages, false);
        // Only this step holds requests that finished while it was pending: a newer one
        // gets its first ones in this pass.
        debug_assert!(!self.pending.has_zombies());
        let has_zombies = !record.zombies.is_empty();
        self.finished_ids.clear();
        let mut kept = 0;
        let mut read = 0;
        while read < self.queue.len() {
            if !has_zombies {
                // The steady state first: a run of plain decodes that neither finish
                // nor were aborted (the general body below, minus its cases); with drafts,
                // of decodes that keep their accepted tokens and go on.
                let run = if plain_rows {
                    let run =
                        self.apply_decode_run(generation, tokens, eos, read, at.generation, kept);
                    at.generation += run;
                    at.generation_row += run;
                    run
                } else {
                    let rows = Rows {
                        tokens,
                        eos,
                        accepted,
                    };
                    self.apply_verified_run(record, rows, read, kept, &mut at)
                };
                read += run;
                kept += run;
                if read == self.queue.len() {
                    break;
                }
            }
            if has_zombies {
                self.skip_held_entries(record, context, &mut at);
            }
            let req = self.queue[read];
            let request = &mut self.requests[req as usize];
            // Read from the hot record; an aborted request's token is dropped below.
            let aborted = request.abort_requested;
            let mut finished = None;
            if generation.get(at.generation) == Some(&req) {
                let row = at.generation_row;
                let drafts = at.drafts_of(record);
                if !aborted {
                    if let Some(drafts) = drafts {
                        // Never a victim while its drafts are pending: still decoding.
                        debug_assert_eq!(request.state, RequestState::Decoding);
                        let rows = &tokens[row..=row + drafts.count as usize];
                        let flags = eos.map(|flags| &flags[row..=row + drafts.count as usize]);
                        let count = accepted.map_or(0, |a| a[at.generation]);
                        let ended = self.apply_verified(step, req, drafts, rows, flags, count);
                        at.computed_tokens += u64::from(count);
                        let complete = self.requests[req as usize].is_complete();
                        finished = finish_reason(complete, ended);
                    } else if request.state == RequestState::Decoding {
                        let token = tokens[row];
                        self.token_log.push(req, request, token);
                        request.computed += 1;
                        finished = finish_reason(request.is_complete(), ends(row));
                    } else {
                        let token = tokens[row];
                        let complete = self.record_after_preemption(req, 1, Some(token), true);
                        finished = finish_reason(complete, ends(row));
                    }
                }
                at.pass_generation(drafts);
            } else if aborted {
                // Its context entry (if any) ran and is counted; the rest is freed below.
                if let Some(entry) = context.get(at.context).filter(|e| e.req == req) {
                    at.pass_context(entry);
                }
            } else if context
                .get(at.context)
                .is_some_and(|entry| entry.req == req)
            {
                let entry = context[at.context];
                let ContextEntry { len, completes, .. } = entry;
                let token = completes.then(|| tokens[at.context_sample]);
                if request.cold.victim_step != NO_STEP && request.cold.victim_step > step {
                    // Preempted by the step planned ahead while this chunk ran (a
                    // suspended one keeps its cached start: its KV went to the host).
                    if request.state == RequestState::Suspended {
                        request.computed = request.computed.max(entry.start);
                    }
                    let complete = self.record_after_preemption(req, len, token, false);
                    if completes {
                        finished = finish_reason(complete, ends(at.context_sample));
                    }
                } else {
                    // The chunk starts where it left off, or after the tokens an admission
                    // found in the prefix cache.
                    debug_assert!(request.computed == entry.start || entry.cached > 0);
                    request.computed = entry.start + len;
                    let new_state = if let Some(token) = token {
                        self.token_log.push(req, request, token);
                        finished = finish_reason(request.is_complete(), ends(at.context_sample));
                        RequestState::Decoding
                    } else {
                        RequestState::Prefilling
                    };
                    let old_state = std::mem::replace(&mut request.state, new_state);
                    self.state_counts[old_state.index()] -= 1;
                    self.state_counts[new_state.index()] += 1;
                    self.register_computed(req);
                }
                self.count_prefix_lookup(entry);
                at.pass_context(&entry);
            } else if request.cold.first_step <= step {
                request.cold.steps_waited += 1;
            }
            if let Some(reason) = aborted.then_some(FinishReason::Aborted).or(finished) {
                let hold = newer.filter(|&newer| self.refers_to(newer, req));
                self.retire(req, reason, hold);
                self.finished_ids.push(self.requests[req as usize].id);
            } else {
                self.queue[kept] = req;
                kept += 1;
            }
            read += 1;
        }
        if has_zombies {
            self.skip_held_entries(record, context, &mut at);
        }
        debug_assert_eq!(
            (at.generation, at.context),
            (generation.len(), context.len())
        );
        self.queue.truncate(kept);
        if std::mem::take(&mut self.abort_requests) > 0 {
            self.stalled_steps = 0; // freed pages may unblock the queue
            if let Some(newer) = self.pending.newest_mut() {
                // The step planned ahead counted on from before this reset; reverting it
                // restores the count of a scheduler that never planned it, which was
                // reset here too.
                newer.stalled_steps_before = 0;
            }
        }
        if has_zombies {
            self.release_zombies(&record.zombies, true);
        }
        self.metrics.prefix_cache_evictions += record.evictions.len() as u64;
        self.close_drafts(step, generation, &record.drafts);
        self.count_step(record, at.computed_tokens);
    }

    /// Counts an admission's prefix-cache lookup (in tokens), a re-prefill's apart.
    fn count_prefix_lookup(&mut self, entry: ContextEntry) {
        let m = &mut self.metrics;
        m.prefix_cache_same_step_hits += entry.shared;
        if entry.recompute {
            m.prefix_cache_recompute_queries += entry.queried;
            m.prefix_cache_recompute_hits += entry.cached;
        } else {
            m.prefix_cache_queries += entry.queried;
            m.prefix_cache_hits += entry.cached;
        }
    }

    /// The common case of [`Self::apply_step`] for the queue from position `read` on: each
    /// request is the next generation entry (`next_generation`), `Decoding`, not aborted,
    /// and its token is neither end-of-sequence nor its last (`remaining_tokens > 1`), so
    /// it takes the token and stays. Stops, untouched, at the first request that needs
    /// more and returns how many it took (moved down to `kept` on, as the general path
    /// would). Only without held (zombie) entries, which the general path skips.
    #[inline(never)]
    fn apply_decode_run(
        &mut self,
        generation: &[RequestIndex],
        tokens: &[i32],
        eos: Option<&[bool]>,
        read: usize,
        next_generation: usize,
        kept: usize,
    ) -> usize {
        // One copy of the loop per case, so neither question is asked per request: whether
        // end-of-sequence flags came with the tokens, and whether anything was retired
        // before the run (`kept != read`: the queue moves down as it goes). The copy is
        // picked once per run.
        let run = match (eos.is_some(), kept != read) {
            (false, false) => Self::apply_decode_run_with::<false, false>,
            (false, true) => Self::apply_decode_run_with::<false, true>,
            (true, false) => Self::apply_decode_run_with::<true, false>,
            (true, true) => Self::apply_decode_run_with::<true, true>,
        };
        run(
            self,
            generation,
            tokens,
            eos.unwrap_or_default(),
            read,
            next_generation,
            kept,
        )
    }

    /// [`Self::apply_decode_run`] with `EOS`: `eos` holds the flags (else it is empty and
    /// unread), and `MOVE`: `kept != read`. Each of the four copies is its own function,
    /// called once per run.
    fn apply_decode_run_with<const EOS: bool, const MOVE: bool>(
        &mut self,
        generation: &[RequestIndex],
        tokens: &[i32],
        eos: &[bool],
        read: usize,
        next_generation: usize,
        kept: usize,
    ) -> usize {
        // `update` checked one flag per sample; the generation entries come first.
        debug_assert!(!EOS || eos.len() >= generation.len());
        let queue = &mut self.queue[..];
        let requests = &mut self.requests[..];
        let token_log = &mut self.token_log;
        let pending = generation.get(next_generation..).unwrap_or_default();
        let mut run = 0;
        while let (Some(&entry), Some(&queued)) = (pending.get(run), queue.get(read + run)) {
            let request = &mut requests[queued as usize];
            if entry != queued
                || request.abort_requested
                || request.state != RequestState::Decoding
                || request.remaining_tokens <= 1
                || (EOS && eos[next_generation + run])
            {
                break;
            }
            token_log.push(queued, request, tokens[next_generation + run]);
            request.computed += 1;
            if MOVE {
                queue[kept + run] = queued;
            }
            run += 1;
        }
        run
    }

    /// [`Self::apply_decode_run`] of a step with drafts: from the queue position `read` on,
    /// each request that is the next generation entry, `Decoding`, not aborted, with no
    /// end-of-sequence among the tokens it keeps and not finishing with them, keeps its
    /// first `accepted + 1` rows (its rejected drafts retracted, its drafts counted) and
    /// stays (moved down to `kept` on). Stops, untouched, at the first that needs more;
    /// returns how many it took, the cursors past them.
    fn apply_verified_run(
        &mut self,
        record: &StepRecord,
        rows: Rows<'_>,
        read: usize,
        kept: usize,
        at: &mut Cursors,
    ) -> usize {
        let step = record.step;
        let queue = &mut self.queue[..];
        let requests = &mut self.requests[..];
        let token_log = &mut self.token_log;
        let ledger = &mut self.ledger;
        let metrics = &mut self.metrics;
        let Drafts {
            backoff,
            backoffs,
            accepted_per_position,
            ..
        } = &mut self.drafts;
        let config = &self.config;
        // What `count_verified` adds per drafted decode, summed over the run and added once.
        // No decode accepts more than `num_speculative_tokens` (checked by `update`).
        let most = config.num_speculative_tokens as usize;
        if accepted_per_position.len() < most {
            accepted_per_position.resize(most, 0);
        }
        let (mut drafted, mut draft_tokens, mut accepted_tokens) = (0u64, 0u64, 0u64);
        let mut run = 0;
        while let (Some(&entry), Some(&queued)) = (
            record.generation_reqs.get(at.generation),
            queue.get(read + run),
        ) {
            let request = &mut requests[queued as usize];
            if entry != queued || request.abort_requested || request.state != RequestState::Decoding
            {
                break;
            }
            let drafts = at.drafts_of(record);
            let accepted = match (drafts, rows.accepted) {
                (Some(_), Some(accepted)) => accepted[at.generation],
                _ => 0,
            };
            let keep = accepted as usize + 1;
            let row = at.generation_row;
            if request.remaining_tokens as usize <= keep
                || rows
                    .eos
                    .is_some_and(|flags| flags[row..row + keep].contains(&true))
            {
                break;
            }
            let position = request.computed;
            for &token in &rows.tokens[row..row + keep] {
                token_log.push(queued, request, token);
            }
            request.computed += keep as u64;
            if let Some(d) = drafts {
                let rejected = d.count - accepted;
                if rejected > 0 {
                    let len_to = d.len_before.max(position + keep as u64);
                    let returned = ledger
                        .retract_drafts_at(
                            queued as usize,
                            request.id,
                            step,
                            rejected.into(),
                            len_to,
                        )
                        .expect("the ledger takes back the rejected drafts of this step");
                    metrics.spec_decode_returned_superblocks += u64::from(returned);
                }
                if backoff.verified(config, queued, accepted, request.computed) {
                    *backoffs += 1;
                }
                for count in &mut accepted_per_position[..accepted as usize] {
                    *count += 1;
                }
                drafted += 1;
                draft_tokens += u64::from(d.count);
                accepted_tokens += u64::from(accepted);
            }
            queue[kept + run] = queued;
            at.pass_generation(drafts);
            run += 1;
        }
        at.computed_tokens += accepted_tokens;
        metrics.spec_decode_num_drafts += drafted;
        metrics.spec_decode_num_draft_tokens += draft_tokens;
        metrics.spec_decode_num_accepted_tokens += accepted_tokens;
        run
    }

    /// Entries of requests that finished while this step was pending (held for it, out
    /// of the queue): their work ran and is discarded. Moves the cursors past them.
    fn skip_held_entries(&self, record: &StepRecord, context: &[ContextEntry], at: &mut Cursors) {
        while record
            .generation_reqs
            .get(at.generation)
            .is_some_and(|&g| self.requests[g as usize].cold.zombie)
        {
            let drafts = at.drafts_of(record);
            at.pass_generation(drafts);
        }
        while let Some(entry) = context
            .get(at.context)
            .filter(|e| self.requests[e.req as usize].cold.zombie)
        {
            at.pass_context(entry);
        }
    }

    /// Adds the closed step to the totals.
    fn count_step(&mut self, record: &StepRecord, computed_tokens: u64) {
        self.metrics.computed_tokens += computed_tokens;
        self.metrics.steps += 1;
        self.metrics.sat_out += record.sat_out.len() as u64;
        self.metrics.spec_decode_num_trimmed_tokens += record.drafts_trimmed;
        self.metrics.spec_decode_draft_superblocks += record.draft_superblocks;
        if self.has_host_tier() {
            self.metrics.resumes += record
                .journal
                .iter()
                .filter(|entry| matches!(entry, JournalEntry::Resume(_)))
                .count() as u64;
        }
        self.release_resumed_host_pages(record);
    }

    /// Records work of the step being closed for a request that the step planned one
    /// ahead preempted meanwhile (`len` tokens computed, `token` sampled if any).
    /// Suspended: its KV went to the host tier with this work in it, so its progress
    /// counts. Recompute-paused: the work is lost, and a sampled token joins the prompt
    /// it re-prefills (it was not scheduled again before this token was known). Returns
    /// whether it has generated all its tokens.
    fn record_after_preemption(
        &mut self,
        req: RequestIndex,
        len: u64,
        token: Option<i32>,
        decode: bool,
    ) -> bool {
        let request = &mut self.requests[req as usize];
        if request.state == RequestState::Suspended {
            request.computed += len;
            if !decode {
                request.cold.suspended_from = if token.is_some() {
                    RequestState::Decoding
                } else {
                    RequestState::Prefilling
                };
            }
            if let Some(token) = token {
                self.token_log.push(req, request, token);
            }
        } else if let Some(token) = token {
            debug_assert_eq!(request.state, RequestState::Waiting);
            // Flushed when it was preempted: it re-prefills from its token vector.
            request.push_token_unlogged(token);
            let id = request.id;
            self.ledger
                .reset_for_recompute(id, 1)
                .expect("a recompute-paused request holds nothing and folds its one new token");
        }
        self.requests[req as usize].is_complete()
    }

    /// Whether the records of pending step `step` refer to the request: an entry, a
    /// resume, a preemption, a sit-out or a slot claim.
    fn refers_to(&self, step: u64, req: RequestIndex) -> bool {
        let r = &self.requests[req as usize];
        r.scheduled_step == step
            || r.cold.resumed_step == step
            || r.cold.victim_step == step
            || r.cold.touched_step == step
    }

    /// Frees what the requests a closed step held (its `zombies`, see `retire`) kept
    /// until it closed, in the order they finished; `ran`: the step was updated (so a
    /// zombie it resumed was copied in), else reverted.
    fn release_zombies(&mut self, zombies: &[RequestIndex], ran: bool) {
        for &req in zombies {
            if ran {
                self.release_host_pages(req);
            } else {
                self.host.release(req);
            }
            let request = &mut self.requests[req as usize];
            request.cold.zombie = false;
            if let Some(slot) = request.batch_slot.take() {
                self.batch_slots.release(slot);
            }
            let id = request.id;
            self.ledger
                .free(id)
                .expect("a held request is held by the ledger");
            self.vacant.push(req);
        }
    }

    /// Frees a finished (or aborted) request's KV, host-tier share and batch slot, and keeps
    /// its output for `take_output`. The caller removes it from the queue.
    ///
    /// `hold`: a pending step (scheduled one ahead) still refers to the request. Then its
    /// output is ready now but its KV, batch slot and index stay held until that step is
    /// updated or reverted (`release_zombies`), so nothing reuses them while the executor
    /// may still run its entries; its id cannot be added again until then.
    pub(super) fn retire(&mut self, req: RequestIndex, reason: FinishReason, hold: Option<u64>) {
        self.drafts.forget(req);
        let request = &mut self.requests[req as usize];
        let id = request.id;
        if hold.is_none() {
            if let Some(slot) = request.batch_slot.take() {
                self.batch_slots.release(slot);
            }
        }
        // Only a suspended (or just resumed) request holds host-tier superblocks. One
        // resumed by the pending step it is held for keeps them until that step closes:
        // its copy-in reads them (and counts only if it runs).
        if hold.is_none_or(|step| request.cold.resumed_step != step) {
            self.release_host_pages(req);
        }
        // What it computed stays cached for the next request with its prefix (a turn of
        // the same conversation).
        self.register_computed(req);
        let request = &mut self.requests[req as usize];
        let metrics = RequestMetrics {
            victim_choices: request.cold.victim_choices,
            recomputed_tokens: request.cold.recomputed_tokens,
            steps_waited: request.cold.steps_waited,
            generated_tokens: request.generated(),
        };
        #[expect(
            clippy::cast_possible_truncation,
            reason = "the original prompt length was a slice length"
        )]
        let prompt_len = request.cold.original_prompt_len as usize;
        // A prompt still shared holds no generated token (a request copies it before it
        // adds one): nothing to split off, and nothing to copy.
        let mut generated = if request.cold.tokens.len() > prompt_len {
            std::sync::Arc::make_mut(&mut request.cold.tokens).split_off(prompt_len)
        } else {
            Vec::new()
        };
        self.token_log.drain_into(req, request, &mut generated);
        self.state_counts[request.state.index()] -= 1;
        self.index.remove(&id);
        if let Some(step) = hold {
            request.cold.zombie = true;
            self.pending.hold_zombie(step, req);
        } else {
            self.ledger
                .free(id)
                .expect("a live request is held by the ledger");
            self.vacant.push(req);
        }
        self.finished.insert(
            id,
            RequestOutput {
                request_id: id,
                token_ids: generated,
                finish_reason: reason,
                metrics,
            },
        );
        if reason == FinishReason::Aborted {
            self.metrics.aborts += 1;
        } else {
            self.metrics.finished += 1;
        }
    }

    /// Undoes the step of `record` (taken out of the pending steps) for `revert`: its
    /// ledger changes, resumes, new batch slots and sit-outs, then the no-progress count
    /// and the requests it held; `finished_ids` is emptied.
    pub(super) fn revert_step(&mut self, record: &StepRecord) {
        let free_before_undo = self.ledger.free_list_len();
        self.undo_step_restoring(record);
        self.ledger
            .sink_returned_pages(record.free_len, free_before_undo);
        // A reverted copy-in may or may not have run: a prefix evicted from a page it copies
        // into (by this step, or by the older pending step: told below) is not put back.
        if record.newer_copy_in_pages.is_empty() {
            self.ledger
                .restore_evictions(&record.evictions, &record.copy_in_pages);
        } else {
            let mut overwritten = record.newer_copy_in_pages.clone();
            overwritten.extend_from_slice(&record.copy_in_pages);
            self.ledger
                .restore_evictions(&record.evictions, &overwritten);
        }
        self.ledger.set_copy_in(&record.copy_in_pages, false);
        if let Some(older) = self.pending.newest_mut() {
            older
                .newer_copy_in_pages
                .extend_from_slice(&record.copy_in_pages);
        }
        self.stalled_steps = record.stalled_steps_before;
        self.close_drafts(record.step, &record.generation_reqs, &record.drafts);
        self.finished_ids.clear();
        self.release_zombies(&record.zombies, false);
    }
}

/// How a request that just sampled a token finishes, if it does: end-of-sequence wins
/// over length when both hold.
fn finish_reason(complete: bool, eos: bool) -> Option<FinishReason> {
    if eos {
        Some(FinishReason::Eos)
    } else if complete {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// The sampled rows `update` was given for a step with drafts: a token (and maybe an
/// end-of-sequence flag) per row, and per generation entry its accepted drafts.
#[derive(Clone, Copy)]
struct Rows<'a> {
    tokens: &'a [i32],
    eos: Option<&'a [bool]>,
    accepted: Option<&'a [u32]>,
}

/// Where `apply_step` stands in the closed step: the next generation entry, context
/// entry and context sample to read, and the tokens counted as computed so far. One
/// value, so the passes that move them (held entries, aborted chunks) take it whole.
struct Cursors {
    generation: usize,
    /// The first sampled row of the next generation entry (`1 + drafts` rows each).
    generation_row: usize,
    /// The next of the step's draft entries (they are in generation entry order).
    draft: usize,
    context: usize,
    context_sample: usize,
    computed_tokens: u64,
}

impl Cursors {
    /// The drafts of the next generation entry, if it has any.
    fn drafts_of(&self, record: &StepRecord) -> Option<DraftEntry> {
        record
            .drafts
            .get(self.draft)
            .filter(|d| d.entry as usize == self.generation)
            .copied()
    }

    /// Moves past the next generation entry (with its `drafts`, from [`Self::drafts_of`]).
    fn pass_generation(&mut self, drafts: Option<DraftEntry>) {
        self.generation += 1;
        self.generation_row += 1;
        if let Some(d) = drafts {
            self.generation_row += d.count as usize;
            self.draft += 1;
        }
    }

    /// Moves past a context entry whose chunk ran: its tokens count as computed, and its
    /// sample (if it completed its prefill) is passed.
    fn pass_context(&mut self, entry: &ContextEntry) {
        self.computed_tokens += entry.len;
        self.context_sample += usize::from(entry.completes);
        self.context += 1;
    }
}
