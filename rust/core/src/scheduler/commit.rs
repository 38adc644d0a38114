//! Closing a step: `update` (it ran) or `revert` (it did not).

use super::{
    CoreError, FinishedRequest, RequestId, RequestMetrics, RequestState, Result, Scheduler,
};

impl Scheduler {
    /// Applies the step that ran: one sampled token per `sample_ids` entry (same order),
    /// and optionally an end-of-sequence flag per entry. Returns the ids of requests
    /// that finished, in queue order; their outputs wait for `take_output`. The input is
    /// validated whole before anything changes.
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
    /// and retires finished requests, freeing their KV and slots.
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
            let mut finished = false;
            if generation.get(next_generation) == Some(&req) {
                request.push_token(tokens[next_generation]);
                request.computed += 1;
                finished = request.is_complete() || ends(next_generation);
                next_generation += 1;
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
                    finished = request.is_complete() || ends(next_context_sample);
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
            if finished {
                self.retire(req);
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
        self.metrics.computed_tokens += computed_tokens;
        self.metrics.steps += 1;
        self.metrics.sat_out += self.sat_out_reqs.len() as u64;
    }

    /// Frees a finished request's KV and slot and keeps its output for `take_output`.
    fn retire(&mut self, req: super::ReqSlot) {
        let request = &mut self.requests[req as usize];
        let id = request.id;
        if let Some(slot) = request.batch_slot.take() {
            self.batch_slots.release(slot);
        }
        let metrics = RequestMetrics {
            preemptions: request.preemptions,
            recomputed_tokens: request.recomputed_tokens,
            steps_waited: request.steps_waited,
            generated_tokens: request.generated(),
        };
        let generated = request
            .tokens
            .split_off(request.original_prompt_len as usize);
        self.state_counts[request.state.index()] -= 1;
        self.ledger
            .free(id)
            .expect("a live request is held by the ledger");
        self.index.remove(&id);
        self.free_request_slots.push(req);
        self.finished
            .insert(id, FinishedRequest { generated, metrics });
        self.finished_ids.push(id);
        self.metrics.finished += 1;
    }

    /// Undoes the scheduled step that did not run: its decode and prompt reservations,
    /// resumes, new batch slots and sit-outs, so the ledger is as before `schedule()`.
    /// Preemptions and suspends made by the step stay applied (every rank applied the
    /// same ones; the victims re-prefill or resume later). The step number stays used.
    pub fn revert(&mut self) -> Result<()> {
        if !self.pending {
            return Err(CoreError::InvalidState(
                "revert() without a pending step: call schedule() first (and update or revert each step once)".into(),
            ));
        }
        self.undo_step(self.pending_step);
        self.stalled_steps = self.stalled_steps_before;
        self.pending = false;
        Ok(())
    }
}
