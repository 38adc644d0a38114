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
        let samples = self.output.sample_ids.len();
        if tokens.len() != samples {
            return Err(CoreError::InvalidArgument(format!(
                "update() got {} tokens for the {samples} entries of sample_ids of step {}",
                tokens.len(),
                self.output.step
            )));
        }
        if let Some(eos) = eos {
            if eos.len() != samples {
                return Err(CoreError::InvalidArgument(format!(
                    "update() got {} eos flags for the {samples} entries of sample_ids of step {}",
                    eos.len(),
                    self.output.step
                )));
            }
        }
        let step = self.output.step;
        let ends = |sample: usize| eos.is_some_and(|flags| flags[sample]);
        let mut sample = 0;
        for &req in &self.generation_reqs {
            let request = &mut self.requests[req as usize];
            request.tokens.push(tokens[sample]);
            request.computed += 1;
            request.finished =
                request.generated() >= u64::from(request.max_new_tokens) || ends(sample);
            sample += 1;
        }
        let mut computed_tokens = self.generation_reqs.len() as u64;
        for (i, entry) in self.context.iter().enumerate() {
            let request = &mut self.requests[entry.req as usize];
            request.computed += entry.len;
            computed_tokens += entry.len;
            let new_state = if self.output.context_completes[i] {
                request.tokens.push(tokens[sample]);
                request.finished =
                    request.generated() >= u64::from(request.max_new_tokens) || ends(sample);
                sample += 1;
                RequestState::Decoding
            } else {
                RequestState::Prefilling
            };
            let old_state = std::mem::replace(&mut request.state, new_state);
            self.state_counts[old_state.index()] -= 1;
            self.state_counts[new_state.index()] += 1;
        }
        self.metrics.computed_tokens += computed_tokens;
        self.metrics.steps += 1;
        self.metrics.sat_out += self.sat_out_reqs.len() as u64;
        self.retire_finished(step);
        self.pending = false;
        Ok(&self.finished_ids)
    }

    /// One order-preserving pass over the queue: drops finished requests (freeing their
    /// KV and slots) and counts a waited step for every live request the step left out.
    fn retire_finished(&mut self, step: u64) {
        self.finished_ids.clear();
        let mut kept = 0;
        for read in 0..self.queue.len() {
            let req = self.queue[read];
            let request = &mut self.requests[req as usize];
            if !request.finished {
                if request.scheduled_step != step && request.first_step <= step {
                    request.steps_waited += 1;
                }
                self.queue[kept] = req;
                kept += 1;
                continue;
            }
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
        self.queue.truncate(kept);
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
        self.undo_step(self.output.step);
        self.stalled_steps = self.stalled_steps_before;
        self.pending = false;
        Ok(())
    }
}
