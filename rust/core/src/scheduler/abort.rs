//! Aborting requests: the client disconnected, a deadline passed, a stop string matched.
//!
//! An abort is valid in every state of a live request (waiting, part-prefilled, decoding,
//! recompute-paused, suspended) and for a finished request whose output is untaken (a
//! no-op). Between steps it takes effect at once; while a step is pending it is deferred
//! to the close of that step, because the executor may already be running the request's
//! entries and `revert` must still find the step as it was scheduled.

use super::{CoreError, FinishReason, RequestId, Result, Scheduler};

impl Scheduler {
    /// Aborts one request; see [`Scheduler::abort_many`].
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        self.abort_many(&[id])
    }

    /// Aborts requests, in the given order.
    ///
    /// - A live request with no step pending finishes now with [`FinishReason::Aborted`]:
    ///   its KV superblocks, host-tier share and batch slot are freed, it leaves the
    ///   queue, and `take_output` returns the tokens it generated so far.
    /// - While a step is pending, a live request is only marked: it stays in the step,
    ///   and the abort takes effect when the step closes. `update` drops its token of
    ///   that step and finishes it as aborted; `revert` undoes the step and then aborts
    ///   it. Either returns its id among the finished ones.
    /// - A request that already finished (output not taken yet), or whose abort is
    ///   already pending, is left as it is: its output keeps its own finish reason.
    ///
    /// An abort that takes effect is counted in `metrics().aborts` and resets the
    /// deadlock counter (the freed pages may unblock the queue). Every id is checked
    /// before anything changes: an id the scheduler does not hold (never added, or its
    /// output already taken) fails the whole call with `UnknownRequest`. Repeated ids are
    /// allowed (the repeat is a no-op).
    pub fn abort_many(&mut self, ids: &[RequestId]) -> Result<()> {
        if let Some(&unknown) = ids
            .iter()
            .find(|id| !self.index.contains_key(id) && !self.finished.contains_key(id))
        {
            return Err(CoreError::UnknownRequest(unknown));
        }
        let mut retired = false;
        for &id in ids {
            let Some(&req) = self.index.get(&id) else {
                continue; // finished, output untaken: nothing to do
            };
            let request = &mut self.requests[req as usize];
            if request.abort_requested {
                continue; // already pending
            }
            request.abort_requested = true;
            if self.is_step_pending() {
                self.abort_requests += 1;
            } else {
                self.retire(req, FinishReason::Aborted, None);
                retired = true;
            }
        }
        if retired {
            // With no step pending no other live request is marked, so the marks are
            // exactly the requests just retired (their indices are not reused before this).
            let requests = &self.requests;
            self.queue
                .retain(|&req| !requests[req as usize].abort_requested);
            self.stalled_steps = 0;
        }
        Ok(())
    }

    /// Whether `abort` was called for this live request while a step was pending (it
    /// finishes as aborted when that step closes). `UnknownRequest` if it is not live.
    pub fn is_abort_requested(&self, id: RequestId) -> Result<bool> {
        Ok(self.requests[self.request_index(id)? as usize].abort_requested)
    }

    /// Aborts every marked request, in queue order, after a `revert`; their ids go to
    /// `finished_ids`.
    pub(super) fn apply_requested_aborts(&mut self) {
        let mut kept = 0;
        for read in 0..self.queue.len() {
            let req = self.queue[read];
            if self.requests[req as usize].abort_requested {
                self.retire(req, FinishReason::Aborted, None);
                self.finished_ids.push(self.requests[req as usize].id);
            } else {
                self.queue[kept] = req;
                kept += 1;
            }
        }
        self.queue.truncate(kept);
        self.abort_requests = 0;
        self.stalled_steps = 0;
    }
}
