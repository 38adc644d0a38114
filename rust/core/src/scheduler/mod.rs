//! The preemptive, rank-invariant scheduler (docs/internals/scheduler.md).
//!
//! Every rank of a CP group runs its own [`Scheduler`] over its own copy of the
//! [`Ledger`]. A decision reads only the queue (arrival order), request sizes in global
//! tokens, priorities, the configuration and the ledger, all identical on every rank by
//! construction, so every rank schedules, preempts and places tokens identically
//! without talking to the others. `cp_rank` selects which per-rank fields a schedule
//! reports and nothing else.
//!
//! A step is `schedule()` followed by either `update()` (it ran) or `revert()` (it did
//! not). Every call that returns an error has changed nothing.

mod abort;
mod commit;
mod config;
mod host;
mod metadata;
mod metrics;
mod output;
mod placement;
mod request;
mod slots;
mod step;
mod victim;

use rustc_hash::FxHashMap;

pub use config::{
    CapacityPolicy, ConfigDefault, ConfigField, ConfigValue, FieldValue, SchedulerConfig,
    ServingMode, SuspendPolicy, VictimPolicy, DECISION_FIELDS,
};
pub use metadata::{
    decode_row, DecodeRowCounts, StepMetadata, StepMetadataLayout, StepMetadataSection, StepSource,
};
pub use metrics::{RequestMetrics, SchedulerMetrics};
pub use output::{FieldScope, ScheduleOutput};
pub use placement::RankPlacement;
pub use request::{FinishReason, RequestOutput, RequestState};

use crate::digest::{bits, Fnv64};
use crate::error::{CoreError, Result};
use crate::layout::Layout;
use crate::ledger::Ledger;
use crate::RequestId;
use host::HostTier;
use placement::Placement;
use request::{Request, TokenLog};
use slots::BatchSlots;
use victim::VictimFinder;

/// Where a live request sits in [`Scheduler::requests`]; stable while the request is
/// live, reused once it is retired. It is also the request's entry in the ledger (see
/// `add_request`).
type RequestIndex = u32;

/// A context entry of the step being built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ContextEntry {
    req: RequestIndex,
    start: u64,
    len: u64,
    completes: bool,
}

/// A ledger change made by the step being built, undone (newest first) by `revert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum JournalEntry {
    Decode(RequestIndex),
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
}

/// What `update` and `revert` need of a pending step (kept apart from the output, which
/// may have been moved out). The scheduler keeps the newest pending step in its own
/// fields and, while a second one is pending, the older one here (swapped in to close it).
#[derive(Debug, Clone, Default)]
struct StepRecord {
    step: u64,
    digest: u64,
    samples: usize,
    stalled_steps_before: u32,
    context: Vec<ContextEntry>,
    generation_reqs: Vec<RequestIndex>,
    journal: Vec<JournalEntry>,
    new_slot_reqs: Vec<RequestIndex>,
    sat_out_reqs: Vec<SatOut>,
    /// The ledger's free superblocks once the step had taken its pages (see `revert`).
    free_len: u32,
}

/// A request that sat out of a step, with the batch slot it gave up (restored if that step
/// is reverted). Kept by the step, not the request: a request may sit out of both pending
/// steps (the newer one finds it without a slot), and reverting both must restore the slot
/// the older one took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SatOut {
    req: RequestIndex,
    slot: Option<u32>,
}

/// The scheduler of one rank. See the module docs.
#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    /// `config.fingerprint()`, the seed of every digest (computed once).
    fingerprint: u64,
    layout: Layout,
    placement: Placement,
    ledger: Ledger,
    /// Dense request storage; `index` maps ids to their indices here (lookups only).
    requests: Vec<Request>,
    /// Sampled tokens not yet appended to their request's vector, a row per request
    /// index (see [`TokenLog`]).
    token_log: TokenLog,
    /// Stack of vacant indices in `requests`, in step with the ledger's vacant entries.
    vacant: Vec<RequestIndex>,
    index: FxHashMap<RequestId, RequestIndex>,
    /// Live requests in arrival order: the queue order every decision walks.
    queue: Vec<RequestIndex>,
    state_counts: [usize; RequestState::COUNT],
    /// Finished requests whose output has not been taken yet.
    finished: FxHashMap<RequestId, RequestOutput>,
    /// Live requests whose abort waits for the pending step to close.
    abort_requests: usize,
    batch_slots: BatchSlots,
    /// The mirrored host-tier ledger (empty without a host tier).
    host: HostTier,
    /// Number the next `schedule()` takes.
    next_step: u64,
    /// Steps scheduled and not yet updated or reverted: 0, 1, or 2 (one-step-ahead).
    pending_steps: u8,
    /// Step number, digest and sample count of the newest schedule (kept apart from the
    /// output, which may have been moved out; the digest tells this scheduler's output of
    /// the step from another's).
    pending_step: u64,
    pending_digest: u64,
    pending_samples: usize,
    /// The ledger's free superblocks once the newest pending step had taken its pages:
    /// pages freed after that (by the update of the step before it, one step ahead) lie
    /// above this depth of the free list, and a revert puts the step's pages back below
    /// them, where they were.
    pending_free_len: u32,
    /// Consecutive scheduled steps that had live requests and made no progress.
    stalled_steps: u32,
    stalled_steps_before: u32,
    /// The older pending step while two are pending (see [`StepRecord`]).
    older: StepRecord,
    /// Requests that finished (or were aborted) while a newer pending step still holds
    /// them, with that step: their output is taken already possible, but their KV, batch
    /// slot and index stay held until that step is updated or reverted.
    zombies: Vec<(RequestIndex, u64)>,
    /// By request index: its work in the older pending step, for a step planned ahead.
    ahead_marks: Vec<request::AheadMark>,
    metrics: SchedulerMetrics,

    // Per-step scratch, kept to reuse the allocations.
    /// The last successful schedule.
    output: ScheduleOutput,
    /// The schedule being built; swapped with `output` on success.
    building: ScheduleOutput,
    context: Vec<ContextEntry>,
    /// Request of each generation entry, in output order (for `update`).
    generation_reqs: Vec<RequestIndex>,
    /// Generation entries whose request had no batch slot yet.
    generation_needing_slots: Vec<usize>,
    /// Whether a request was preempted after its generation entry was made.
    generation_removed: bool,
    journal: Vec<JournalEntry>,
    new_slot_reqs: Vec<RequestIndex>,
    sat_out_reqs: Vec<SatOut>,
    finished_ids: Vec<RequestId>,
    /// Candidates below the preemption bound, for every requester.
    victims: VictimFinder,
    /// Candidates at the bound, only for the queue head (see `preempt_for`).
    head_victims: VictimFinder,
    /// Queue positions of the victims the ladder chose for one requester.
    plan: Vec<usize>,
    step_tokens: u64,
    /// Entries of this step that still need a new batch slot (assigned at the end).
    step_new_slots: u32,
    /// `Decoding` requests without a batch slot that get no decode entry in this step
    /// (resumed in it, or not scheduled), in queue order: each claims a slot ahead of
    /// everything after it in the step (handed out at the end, see `finish_step`).
    slot_claims: Vec<RequestIndex>,
    step_preempted: bool,
}

impl Scheduler {
    /// A scheduler with an empty queue and a fresh ledger of
    /// `config.capacity_superblocks` superblocks.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let layout = config.layout()?;
        let ledger = Ledger::new(layout, config.capacity_superblocks)?;
        let output = ScheduleOutput {
            rank_placement: RankPlacement::new(layout, config.cp_rank)?,
            ..ScheduleOutput::default()
        };
        Ok(Self {
            layout,
            placement: Placement::new(layout),
            ledger,
            requests: Vec::new(),
            token_log: TokenLog::default(),
            vacant: Vec::new(),
            index: FxHashMap::default(),
            queue: Vec::new(),
            state_counts: [0; RequestState::COUNT],
            finished: FxHashMap::default(),
            abort_requests: 0,
            batch_slots: BatchSlots::new(config.max_batch_size),
            host: HostTier::new(config.host_tier_superblocks),
            next_step: 0,
            pending_steps: 0,
            older: StepRecord::default(),
            zombies: Vec::new(),
            ahead_marks: Vec::new(),
            pending_step: 0,
            pending_digest: 0,
            pending_samples: 0,
            pending_free_len: 0,
            stalled_steps: 0,
            stalled_steps_before: 0,
            metrics: SchedulerMetrics {
                kv_capacity_superblocks: config.capacity_superblocks,
                ..SchedulerMetrics::default()
            },
            building: output.clone(),
            output,
            context: Vec::new(),
            generation_reqs: Vec::new(),
            generation_needing_slots: Vec::new(),
            generation_removed: false,
            journal: Vec::new(),
            new_slot_reqs: Vec::new(),
            sat_out_reqs: Vec::new(),
            finished_ids: Vec::new(),
            victims: VictimFinder::new(config.victim_policy),
            head_victims: VictimFinder::new(config.victim_policy),
            plan: Vec::new(),
            step_tokens: 0,
            step_new_slots: 0,
            slot_claims: Vec::new(),
            step_preempted: false,
            fingerprint: config.fingerprint(),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The token placement.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The ledger (read-only: the scheduler is the only writer).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Queues a request behind every live one. Rejected (nothing changed) for a
    /// duplicate id, an empty prompt, `max_new_tokens == 0`, or a request that could
    /// never be scheduled (the error names the limit). An id that finished while a step
    /// planned ahead still refers to it is held until that step closes: adding it again
    /// before then is `DuplicateRequest`, even once its output was taken.
    pub fn add_request(
        &mut self,
        id: RequestId,
        prompt: &[i32],
        max_new_tokens: u32,
        priority: i32,
    ) -> Result<()> {
        if self.index.contains_key(&id) || self.finished.contains_key(&id) {
            return Err(CoreError::DuplicateRequest(id));
        }
        if prompt.is_empty() {
            return Err(CoreError::InvalidLength(format!(
                "request {id} has an empty prompt"
            )));
        }
        if max_new_tokens == 0 {
            return Err(CoreError::InvalidLength(format!(
                "request {id} asks for max_new_tokens = 0; it must generate at least one token"
            )));
        }
        self.check_fits(id, prompt.len() as u64, u64::from(max_new_tokens))?;
        self.ledger.add(id, prompt.len() as u64)?;
        let request = Request::new(
            id,
            prompt,
            max_new_tokens,
            priority,
            self.first_step_for_new_request(),
        );
        let req = if let Some(req) = self.vacant.pop() {
            self.requests[req as usize] = request;
            req
        } else {
            self.requests.push(request);
            self.token_log.reserve_rows(self.requests.len());
            #[expect(
                clippy::cast_possible_truncation,
                reason = "2^32 live requests would take at least 256 GiB of request records (64 bytes each) first"
            )]
            let req = (self.requests.len() - 1) as RequestIndex;
            req
        };
        // The ledger's slab and `requests` take and give back indices in step, so a
        // request's index is also its ledger entry (the decode path's lookup hint).
        debug_assert_eq!(self.ledger.entry_of(id).ok(), Some(req as usize));
        self.index.insert(id, req);
        self.queue.push(req);
        self.state_counts[RequestState::Waiting.index()] += 1;
        Ok(())
    }

    /// A request added while a step is pending did not take part in it.
    fn first_step_for_new_request(&self) -> u64 {
        self.next_step
    }

    fn check_fits(&self, id: RequestId, prompt: u64, max_new: u64) -> Result<()> {
        let too_large = |reason: String| Err(CoreError::RequestTooLarge { id, reason });
        let total = prompt + max_new;
        if total > self.config.max_seq_len {
            return too_large(format!(
                "prompt ({prompt}) + max_new_tokens ({max_new}) = {total} tokens exceed max_seq_len = {}",
                self.config.max_seq_len
            ));
        }
        let needed = self.layout.superblocks_for(total);
        if needed > u64::from(self.config.capacity_superblocks) {
            return too_large(format!(
                "prompt + max_new_tokens = {total} tokens need {needed} superblocks, more than the whole KV pool \
                 ({} superblocks = {} tokens)",
                self.config.capacity_superblocks,
                self.ledger.capacity_tokens()
            ));
        }
        if !self.config.enable_chunked_prefill {
            // A recompute-paused request re-prefills everything it has, up to the
            // prompt and all but its last token, in one step.
            let (longest, what) = if self.config.may_preempt() {
                (
                    total - 1,
                    "a re-prefill after preemption (prompt + max_new_tokens - 1)",
                )
            } else {
                (prompt, "the prompt")
            };
            if longest > u64::from(self.config.max_num_tokens) {
                return too_large(format!(
                    "without chunked prefill {what} takes {longest} tokens in one step, more than \
                     max_num_tokens = {}; enable chunked prefill or raise max_num_tokens",
                    self.config.max_num_tokens
                ));
            }
        }
        Ok(())
    }

    fn request_index(&self, id: RequestId) -> Result<RequestIndex> {
        self.index
            .get(&id)
            .copied()
            .ok_or(CoreError::UnknownRequest(id))
    }

    fn set_state(&mut self, req: RequestIndex, state: RequestState) {
        let request = &mut self.requests[req as usize];
        self.state_counts[request.state.index()] -= 1;
        self.state_counts[state.index()] += 1;
        request.state = state;
    }

    /// Exchanges the newest pending step's record (the scheduler's own fields) with the
    /// older one's: to build a step one ahead, and to close the older step.
    fn swap_step_records(&mut self) {
        let older = &mut self.older;
        std::mem::swap(&mut self.pending_step, &mut older.step);
        std::mem::swap(&mut self.pending_digest, &mut older.digest);
        std::mem::swap(&mut self.pending_samples, &mut older.samples);
        std::mem::swap(&mut self.pending_free_len, &mut older.free_len);
        std::mem::swap(
            &mut self.stalled_steps_before,
            &mut older.stalled_steps_before,
        );
        std::mem::swap(&mut self.context, &mut older.context);
        std::mem::swap(&mut self.generation_reqs, &mut older.generation_reqs);
        std::mem::swap(&mut self.journal, &mut older.journal);
        std::mem::swap(&mut self.new_slot_reqs, &mut older.new_slot_reqs);
        std::mem::swap(&mut self.sat_out_reqs, &mut older.sat_out_reqs);
    }

    /// The state of a live request.
    pub fn request_state(&self, id: RequestId) -> Result<RequestState> {
        Ok(self.requests[self.request_index(id)? as usize].state)
    }

    /// The batch slot a live request holds, if any. A request may hold one without an
    /// entry in the last schedule: out of token budget, or claimed for its next decode
    /// (after a resume, or when none was free at its turn).
    pub fn batch_slot(&self, id: RequestId) -> Result<Option<u32>> {
        Ok(self.requests[self.request_index(id)? as usize]
            .batch_slot
            .get())
    }

    /// Prompt (with any folded tokens) plus generated tokens of a live request (a copy:
    /// the latest ones are gathered from the token log).
    pub fn tokens(&self, id: RequestId) -> Result<Vec<i32>> {
        let req = self.request_index(id)?;
        let request = &self.requests[req as usize];
        let mut tokens = request.cold.tokens.clone();
        self.token_log.append_to(req, request, &mut tokens);
        Ok(tokens)
    }

    /// Moves the tokens waiting in the log for the request at `req` to its token vector
    /// (before it re-prefills from that vector).
    fn flush_tokens(&mut self, req: RequestIndex) {
        self.token_log.flush(req, &mut self.requests[req as usize]);
    }

    /// The output of a finished request: its generated tokens, why it finished and its
    /// counters. Each output can be taken once, after which its id may be used again.
    pub fn take_output(&mut self, id: RequestId) -> Result<RequestOutput> {
        if self.index.contains_key(&id) {
            return Err(CoreError::InvalidState(format!(
                "request {id} has not finished yet"
            )));
        }
        self.finished
            .remove(&id)
            .ok_or(CoreError::UnknownRequest(id))
    }

    /// Ids of finished requests whose output has not been taken, ascending.
    pub fn untaken_outputs(&self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.finished.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Live requests.
    pub fn num_live(&self) -> usize {
        self.queue.len()
    }
    /// Live requests with nothing computed (new, or recompute-paused).
    pub fn num_waiting(&self) -> usize {
        self.state_counts[RequestState::Waiting.index()]
    }
    /// Live requests holding KV in the GPU pool (prefilling or decoding).
    pub fn num_running(&self) -> usize {
        self.state_counts[RequestState::Prefilling.index()]
            + self.state_counts[RequestState::Decoding.index()]
    }
    /// Live requests suspended to the host tier.
    pub fn num_suspended(&self) -> usize {
        self.state_counts[RequestState::Suspended.index()]
    }
    /// Host-tier superblocks held by suspended requests.
    pub fn host_used_superblocks(&self) -> u32 {
        self.host.used()
    }
    /// Host-tier superblocks held by a live request: its host pages while suspended, and
    /// until the step that resumed it is updated (empty otherwise).
    pub fn host_pages(&self, id: RequestId) -> Result<&[u32]> {
        Ok(self.host.pages(self.request_index(id)?))
    }
    /// Whether any request is live.
    pub fn has_unfinished(&self) -> bool {
        !self.queue.is_empty()
    }
    /// Ids of live requests in queue order.
    pub fn queue_ids(&self) -> Vec<RequestId> {
        self.queue
            .iter()
            .map(|&r| self.requests[r as usize].id)
            .collect()
    }
    /// The schedule of the last successful `schedule()` (empty before the first).
    pub fn last_output(&self) -> &ScheduleOutput {
        &self.output
    }
    /// Moves the last schedule out of the scheduler (a zero-copy handoff, e.g. to numpy
    /// arrays); `last_output()` is empty afterwards (its `rank_placement` kept). `update`
    /// and `revert` do not need it.
    pub fn take_last_output(&mut self) -> ScheduleOutput {
        let empty = ScheduleOutput {
            rank_placement: self.output.rank_placement,
            ..ScheduleOutput::default()
        };
        std::mem::replace(&mut self.output, empty)
    }
    /// Hands back a schedule taken with [`Self::take_last_output`] (or any other) once its
    /// caller is done with it, so that a later `schedule()` builds in its buffers instead
    /// of allocating new ones: each taken output leaves the scheduler without buffers of
    /// its own. Only its allocations are kept (its contents are cleared before use, and
    /// this scheduler's placement stays); it is dropped if the scheduler's own buffer has
    /// at least as much room. Nothing a step decides depends on it.
    pub fn recycle_output(&mut self, spare: ScheduleOutput) {
        if spare.capacity() > self.building.capacity() {
            let placement = self.building.rank_placement;
            self.building = spare;
            self.building.rank_placement = placement;
        }
    }
    /// Whether a schedule awaits `update` or `revert`.
    pub fn is_step_pending(&self) -> bool {
        self.pending_steps > 0
    }

    /// How many schedules await `update` or `revert`: 0, 1, or 2 (a step scheduled one
    /// step ahead while the previous one was still pending).
    pub fn pending_steps(&self) -> u32 {
        u32::from(self.pending_steps)
    }

    /// Totals, with KV use as of now.
    pub fn metrics(&self) -> SchedulerMetrics {
        let used = self.ledger.used_superblocks();
        SchedulerMetrics {
            kv_used_superblocks: used,
            kv_utilization: f64::from(used) / f64::from(self.config.capacity_superblocks),
            ..self.metrics
        }
    }

    /// Counters of a live request, or of a finished one whose output is not taken yet.
    pub fn request_metrics(&self, id: RequestId) -> Result<RequestMetrics> {
        if let Some(&req) = self.index.get(&id) {
            let r = &self.requests[req as usize];
            return Ok(RequestMetrics {
                preemptions: r.cold.preemptions,
                recomputed_tokens: r.cold.recomputed_tokens,
                steps_waited: r.cold.steps_waited,
                generated_tokens: r.generated(),
            });
        }
        self.finished
            .get(&id)
            .map(|f| f.metrics)
            .ok_or(CoreError::UnknownRequest(id))
    }

    /// Block tables of `ids` (superblock ids == page ids on every rank), row-major
    /// `ids.len() x width`, padded with -1; `width` defaults to the widest table.
    pub fn block_table(
        &self,
        ids: &[RequestId],
        width: Option<usize>,
    ) -> Result<(Vec<i32>, usize)> {
        let width = match width {
            Some(width) => width,
            None => self.ledger.max_table_len(ids)?,
        };
        let mut out = vec![-1; ids.len() * width];
        self.ledger.block_table_into(ids, width, &mut out)?;
        Ok((out, width))
    }

    /// This rank's KV slot for each new token (`starts[i] .. starts[i] + counts[i]` of
    /// `ids[i]`), -1 where another rank owns the token.
    pub fn slot_mapping(
        &self,
        ids: &[RequestId],
        starts: &[u64],
        counts: &[u64],
    ) -> Result<Vec<i64>> {
        let mut out = Vec::new();
        self.ledger
            .slot_mapping_into(ids, starts, counts, self.config.cp_rank, &mut out)?;
        Ok(out)
    }

    /// A fingerprint of everything that drives decisions: the configuration
    /// ([`SchedulerConfig::fingerprint`]), the ledger, the queue and every live request's
    /// progress, batch slots and counters. Equal on every rank of a group that was built from
    /// one configuration and fed the same calls (`cp_rank` is left out), and unchanged by
    /// a `schedule()` + `revert()` that preempted nothing (step numbers are left out).
    pub fn state_digest(&self) -> u64 {
        let mut h = Fnv64::new();
        h.u64(self.fingerprint);
        h.u64(self.ledger.state_digest());
        h.u64(u64::from(self.pending_steps));
        h.u64(self.zombies.len() as u64);
        for &(req, _) in &self.zombies {
            h.u64(self.requests[req as usize].id);
        }
        h.u64(u64::from(self.stalled_steps));
        self.host.digest_into(&mut h, &self.queue);
        h.u64(self.queue.len() as u64);
        for &req in &self.queue {
            let r = &self.requests[req as usize];
            h.u64(r.id);
            h.u64(r.state.index() as u64);
            h.u64(r.computed);
            h.u64(r.known_len());
            let mut logged = Vec::new();
            self.token_log.append_to(req, r, &mut logged);
            for &token in r.cold.tokens.iter().chain(&logged) {
                h.word(bits(token));
            }
            h.u64(r.batch_slot.get().map_or(u64::MAX, u64::from));
            h.u64(u64::from(r.cold.preemptions));
            h.u64(u64::from(r.abort_requested));
        }
        h.u64(self.finished.len() as u64);
        h.finish()
    }
}
