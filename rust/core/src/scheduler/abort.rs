//! Aborting requests: the client disconnected, a deadline passed, a stop string matched.
//!
//! An abort is valid in every state of a live request (waiting, part-prefilled, decoding,
//! recompute-paused, suspended); for an id with no live request (finished, or never added)
//! it is a no-op that answers `false`. Between steps it takes effect at once; while a step
//! is pending it is deferred to the close of that step, because the executor may already be
//! running the request's entries and `revert` must still find the step as it was scheduled.

use super::{FinishReason, Result, Scheduler};
use crate::ids::RequestId;

impl Scheduler {
    /// Aborts one request; see [`Scheduler::abort_many`]. Returns whether it was live.
    pub fn abort(&mut self, id: RequestId) -> Result<bool> {
        Ok(self.abort_many(&[id])?[0])
    }

    /// Aborts requests and returns for each id whether it was live when the call was made
    /// (`true`) or not (`false`: a no-op). Between steps they retire in queue order, as
    /// the aborts a step's close applies do, whatever the order of `ids`.
    ///
    /// - A live request with no step pending finishes now with [`FinishReason::Aborted`]:
    ///   its KV superblocks, host-tier share and batch slot are freed, it leaves the
    ///   queue, and `take_output` returns the tokens it generated so far.
    /// - While a step is pending, a live request is only marked: it stays in the step,
    ///   and the abort takes effect when the step closes. `update` drops its token of
    ///   that step and finishes it as aborted; `revert` undoes the step and then aborts
    ///   it. Either returns its id among the finished ones. A live request whose abort is
    ///   already pending is left as it is, and is `true`.
    /// - An id the scheduler holds no live request for is left alone and is `false`: one
    ///   that finished (its output keeps its own finish reason, taken or not), or was never
    ///   added. Engines abort on client disconnects, which race with completion, so this
    ///   is no error (as vLLM's `finish_requests` ignores unknown ids). The answer reads
    ///   only the scheduler's own state, identical on every rank.
    ///
    /// An abort that takes effect is counted in `metrics().aborts` and resets the
    /// deadlock counter (the freed pages may unblock the queue). It never fails today;
    /// the `Result` keeps a future refusal a typed error.
    pub fn abort_many(&mut self, ids: &[RequestId]) -> Result<Vec<bool>> {
        let mut live = Vec::with_capacity(ids.len());
        let mut marked = false;
        for &id in ids {
            let Some(&req) = self.index.get(&id) else {
                live.push(false); // finished (output taken or not) or never added
                continue;
            };
            live.push(true);
            let request = &mut self.requests[req as usize];
            if request.abort_requested {
                continue; // already pending, or a repeat
            }
            request.abort_requested = true;
            if self.is_step_pending() {
                self.abort_requests += 1;
            } else {
                marked = true;
            }
        }
        if marked {
            // With no step pending no other live request is marked: the marks are exactly
            // this call's. They retire in queue order, as the aborts a step's close applies
            // do, so the pages and entries come back in one order whatever the call's.
            self.retire_marked(false);
        }
        Ok(live)
    }

    /// Whether `abort` was called for this live request while a step was pending (it
    /// finishes as aborted when that step closes). `UnknownRequest` if it is not live.
    pub fn is_abort_requested(&self, id: RequestId) -> Result<bool> {
        Ok(self.requests[self.request_index(id)? as usize].abort_requested)
    }

    /// Aborts every marked request, in queue order, after a `revert`; their ids go to
    /// `finished_ids`.
    pub(super) fn apply_requested_aborts(&mut self) {
        self.retire_marked(true);
    }

    /// Retires every marked request in queue order (their ids to `finished_ids` if
    /// `report`), and resets the no-progress count: the freed pages may unblock the queue.
    fn retire_marked(&mut self, report: bool) {
        let mut kept = 0;
        for read in 0..self.queue.len() {
            let req = self.queue[read];
            if self.requests[req as usize].abort_requested {
                self.retire(req, FinishReason::Aborted, None);
                if report {
                    self.finished_ids.push(self.requests[req as usize].id);
                }
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
