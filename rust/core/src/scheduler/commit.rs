//! Closing a step: `update` (it ran) or `revert` (it did not).

use super::{
    CoreError, FinishReason, JournalEntry, RequestId, RequestIndex, RequestMetrics, RequestOutput,
    RequestState, Result, Scheduler,
};

impl Scheduler {
    /// Applies the step that ran: one sampled token per `sample_ids` entry (same order),
    /// and optionally an end-of-sequence flag per entry. Returns the ids of requests
    /// that finished, in queue order; their outputs wait for `take_output`. The input is
    /// validated whole before anything changes.
    ///
    /// A request whose abort was requested while this step was pending finishes here
    /// with [`FinishReason::Aborted`]: its token of this step is dropped (the client is
    /// gone), its KV and batch slot are freed, and its id is among those returned.
    pub fn update(&mut self, tokens: &[i32], eos: Option<&[bool]>) -> Result<&[RequestId]> {
        if !self.pending {
            return Err(CoreError::InvalidState(
                "update() without a pending step: call schedule() first (and update or revert each step once)".into(),
            ));
        }
        let samples = self.pending_samples;
        if tokens.len() != samples {
            return Err(CoreError::InvalidArgument(format!(
                "update() got {} tokens for the {samples} entries of sample_ids of step {}",
                tokens.len(),
                self.pending_step
            )));
        }
        if let Some(eos) = eos {
            if eos.len() != samples {
                return Err(CoreError::InvalidArgument(format!(
                    "update() got {} eos flags for the {samples} entries of sample_ids of step {}",
                    eos.len(),
                    self.pending_step
                )));
            }
        }
        self.apply_step(tokens, eos);
        self.pending = false;
        Ok(&self.finished_ids)
    }

    /// One order-preserving pass over the queue (generation and context entries are in
    /// queue order too): appends sampled tokens, advances progress, counts waited steps,
    /// and retires finished and abort-requested requests, freeing their KV and batch slots.
    fn apply_step(&mut self, tokens: &[i32], eos: Option<&[bool]>) {
        let step = self.pending_step;
        let ends = |sample: usize| eos.is_some_and(|flags| flags[sample]);
        // Taken for the pass (retiring needs `self`), put back to keep the allocation.
        let generation = std::mem::take(&mut self.generation_reqs);
        let (mut next_generation, mut next_context) = (0, 0);
        let mut next_context_sample = generation.len();
        let mut computed_tokens = generation.len() as u64;
        self.finished_ids.clear();
        let mut kept = 0;
        for read in 0..self.queue.len() {
            let req = self.queue[read];
            let request = &mut self.requests[req as usize];
            // Read from the hot line; an aborted request's token is dropped below.
            let aborted = request.abort_requested;
            let mut finished = None;
            if generation.get(next_generation) == Some(&req) {
                if !aborted {
                    request.push_token(tokens[next_generation]);
                    request.computed += 1;
                    finished = finish_reason(request.is_complete(), ends(next_generation));
                }
                next_generation += 1;
            } else if aborted {
                // Its context entry (if any) ran and is counted; the rest is freed below.
                if let Some(entry) = self.context.get(next_context).filter(|e| e.req == req) {
                    computed_tokens += entry.len;
                    next_context_sample += usize::from(entry.completes);
                    next_context += 1;
                }
            } else if self
                .context
                .get(next_context)
                .is_some_and(|entry| entry.req == req)
            {
                let len = self.context[next_context].len;
                request.computed += len;
                computed_tokens += len;
                let new_state = if self.context[next_context].completes {
                    request.push_token(tokens[next_context_sample]);
                    finished = finish_reason(request.is_complete(), ends(next_context_sample));
                    next_context_sample += 1;
                    RequestState::Decoding
                } else {
                    RequestState::Prefilling
                };
                let old_state = std::mem::replace(&mut request.state, new_state);
                self.state_counts[old_state.index()] -= 1;
                self.state_counts[new_state.index()] += 1;
                next_context += 1;
            } else if request.first_step <= step {
                request.steps_waited += 1;
            }
            if aborted {
                self.retire(req, FinishReason::Aborted);
                self.finished_ids.push(self.requests[req as usize].id);
            } else if let Some(reason) = finished {
                self.retire(req, reason);
                self.finished_ids.push(self.requests[req as usize].id);
            } else {
                self.queue[kept] = req;
                kept += 1;
            }
        }
        debug_assert_eq!(
            (next_generation, next_context),
            (generation.len(), self.context.len())
        );
        self.queue.truncate(kept);
        self.generation_reqs = generation;
        if std::mem::take(&mut self.abort_requests) > 0 {
            self.stalled_steps = 0; // freed pages may unblock the queue
        }
        self.metrics.computed_tokens += computed_tokens;
        self.metrics.steps += 1;
        self.metrics.sat_out += self.sat_out_reqs.len() as u64;
        self.metrics.resumes += self
            .journal
            .iter()
            .filter(|entry| matches!(entry, JournalEntry::Resume(_)))
            .count() as u64;
        self.release_resumed_host_pages();
    }

    /// Frees a finished (or aborted) request's KV, host-tier share and batch slot, and keeps
    /// its output for `take_output`. The caller removes it from the queue.
    pub(super) fn retire(&mut self, req: RequestIndex, reason: FinishReason) {
        let request = &mut self.requests[req as usize];
        let id = request.id;
        if let Some(slot) = request.batch_slot.take() {
            self.batch_slots.release(slot);
        }
        // Only a suspended (or just resumed) request holds host-tier superblocks.
        self.release_host_pages(req);
        let request = &mut self.requests[req as usize];
        let metrics = RequestMetrics {
            preemptions: request.preemptions,
            recomputed_tokens: request.recomputed_tokens,
            steps_waited: request.steps_waited,
            generated_tokens: request.generated(),
        };
        #[expect(
            clippy::cast_possible_truncation,
            reason = "the original prompt length was a slice length"
        )]
        let generated = request
            .tokens
            .split_off(request.original_prompt_len as usize);
        self.state_counts[request.state.index()] -= 1;
        self.ledger
            .free(id)
            .expect("a live request is held by the ledger");
        self.index.remove(&id);
        self.vacant.push(req);
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

    /// Undoes the scheduled step that did not run: its decode and prompt reservations,
    /// resumes, new batch slots and sit-outs, so the ledger is as before `schedule()`.
    /// Preemptions and suspends made by the step stay applied (every rank applied the
    /// same ones; the victims re-prefill or resume later). The step number stays used.
    ///
    /// Requests whose abort was requested while the step was pending are aborted right
    /// after the undo (in queue order); their ids are returned, as `update` would.
    pub fn revert(&mut self) -> Result<&[RequestId]> {
        if !self.pending {
            return Err(CoreError::InvalidState(
                "revert() without a pending step: call schedule() first (and update or revert each step once)".into(),
            ));
        }
        self.undo_step(self.pending_step);
        self.stalled_steps = self.stalled_steps_before;
        self.pending = false;
        self.finished_ids.clear();
        if self.abort_requests > 0 {
            self.apply_requested_aborts();
        }
        Ok(&self.finished_ids)
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
