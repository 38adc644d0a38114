//! The preemptive, rank-invariant scheduler (docs/internals/scheduler.md).
//!
//! Every rank of a CP group runs its own [`Scheduler`] over its own copy of the
//! [`Ledger`]. A decision reads only the queue (arrival order, or priority then arrival), request sizes in global
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
mod draft_backoff;
mod drafts;
mod host;
mod metadata;
mod metrics;
mod output;
mod pending;
mod placement;
mod request;
mod slots;
mod step;
mod victim;

use rustc_hash::FxHashMap;

pub use config::{
    AdmissionPolicy, CapacityPolicy, ConfigDefault, ConfigField, ConfigValue, FieldValue,
    SchedulerConfig, ServingMode, SuspendPolicy, VictimPolicy, DECISION_FIELDS,
    MAX_SPECULATIVE_TOKENS,
};
use metadata::WriterView;
pub use metadata::{
    decode_row, DecodeRowCounts, StepMetadata, StepMetadataLayout, StepMetadataSection, StepSource,
};
pub use metrics::{RequestMetrics, SchedulerMetrics};
pub use output::{FieldScope, ScheduleOutput};
pub use placement::{DecodePlacement, RankPlacement};
pub use request::{FinishReason, RequestOutput, RequestState};

use crate::digest::{bits, Fnv64};
use crate::error::{CoreError, Result};
use crate::ids::RequestId;
use crate::layout::Layout;
use crate::ledger::Ledger;
use host::HostTier;
use pending::{PendingSteps, StepBuilder};
use placement::Placement;
use request::{Request, RequestIndex, TokenLog};
use slots::BatchSlots;

/// A prompt and its cache salt, prepared once to be added to several schedulers
/// ([`Scheduler::add_prepared`]), as an in-process CP group adds a request to every rank's.
///
/// Its prefix-cache keys are a pure function of the tokens, the salt and the superblock
/// size (BLAKE3, no per-process state; see [`crate::prefix_cache`]), so the keys the first
/// scheduler computes are every rank's: they are computed once, on first use, and kept for
/// that superblock size (a scheduler of another size computes its own). A rank in its own
/// process prepares its own prompt and computes the same keys.
#[derive(Debug, Clone)]
pub struct PreparedPrompt {
    /// Shared with every request added from it (on every rank of an in-process group): a
    /// request copies its tokens only if it must change them (`RequestCold::tokens`).
    tokens: std::sync::Arc<Vec<i32>>,
    chain_seed: crate::prefix_cache::BlockKey,
    /// The keys of the full superblocks and the superblock size they were computed for.
    keys: std::cell::OnceCell<(u64, Vec<crate::prefix_cache::BlockKey>)>,
}

impl PreparedPrompt {
    /// Prepares `prompt` with `cache_salt` (empty for none). Checks nothing: the scheduler
    /// checks a request when it is added.
    pub fn new(prompt: &[i32], cache_salt: &[u8]) -> Self {
        Self {
            tokens: std::sync::Arc::new(prompt.to_vec()),
            chain_seed: crate::prefix_cache::chain_seed(cache_salt),
            keys: std::cell::OnceCell::new(),
        }
    }

    /// The prompt's token ids.
    pub fn tokens(&self) -> &[i32] {
        &self.tokens
    }

    /// The keys of the prompt's full superblocks of `tokens_per_superblock` tokens: the kept
    /// ones if they are of that size, else computed (and kept if none were).
    fn block_keys(
        &self,
        tokens_per_superblock: u64,
    ) -> std::borrow::Cow<'_, [crate::prefix_cache::BlockKey]> {
        let compute = || {
            let mut keys = Vec::new();
            crate::prefix_cache::chain_keys(
                self.chain_seed,
                &self.tokens,
                tokens_per_superblock,
                &mut keys,
            );
            keys
        };
        let (per, keys) = self.keys.get_or_init(|| (tokens_per_superblock, compute()));
        if *per == tokens_per_superblock {
            std::borrow::Cow::Borrowed(keys.as_slice())
        } else {
            std::borrow::Cow::Owned(compute())
        }
    }
}

/// The scheduler of one rank. See the module docs.
///
/// Its state is the queue and the requests, the ledger and the host tier, the batch
/// slots, the finished outputs and the counters, and the pending steps: each a
/// `StepRecord` (everything `update` and `revert` need of it, the requests it holds
/// after they finished included) in a ring of at most two (`PendingSteps`, see
/// `pending.rs`). What `schedule()` needs only while it builds a step is apart, in a
/// `StepBuilder`.
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
    /// Live requests in queue order, which every decision walks: arrival order, or
    /// descending priority then arrival order (`admission_policy`; see `enqueue`).
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
    /// Consecutive scheduled steps that had live requests and made no progress.
    stalled_steps: u32,
    /// Steps scheduled and not yet updated or reverted, oldest first.
    pending: PendingSteps,
    metrics: SchedulerMetrics,
    /// The last successful schedule.
    output: ScheduleOutput,
    /// Ids the last `update` or `revert` finished (the slice they return).
    finished_ids: Vec<RequestId>,
    /// The step being built (per-step scratch, kept to reuse the allocations).
    builder: StepBuilder,
    /// Draft proposals for the next step, and acceptance per draft position.
    drafts: drafts::Drafts,
}

impl Scheduler {
    /// A scheduler with an empty queue and a fresh ledger of
    /// `config.capacity_superblocks` superblocks.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let layout = config.layout()?;
        let mut ledger = Ledger::new(layout, config.capacity_superblocks)?;
        if config.enable_prefix_caching {
            ledger.enable_prefix_cache()?;
        }
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
            stalled_steps: 0,
            pending: PendingSteps::default(),
            metrics: SchedulerMetrics {
                kv_capacity_superblocks: config.capacity_superblocks,
                ..SchedulerMetrics::default()
            },
            builder: StepBuilder::new(config.victim_policy, output.clone()),
            output,
            finished_ids: Vec::new(),
            drafts: drafts::Drafts::default(),
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
        self.add_request_salted(id, prompt, max_new_tokens, priority, b"")
    }

    /// [`Self::add_request`] with a cache salt: with prefix caching, a request shares
    /// cached KV only with requests of the same salt (a tenant, an adapter; empty for
    /// none). Salts are hashed into the key chain's seed, so any bytes do.
    pub fn add_request_salted(
        &mut self,
        id: RequestId,
        prompt: &[i32],
        max_new_tokens: u32,
        priority: i32,
        cache_salt: &[u8],
    ) -> Result<()> {
        self.add_prepared(
            id,
            &PreparedPrompt::new(prompt, cache_salt),
            max_new_tokens,
            priority,
        )
    }

    /// [`Self::add_request_salted`] with a prompt prepared once for several schedulers: the
    /// schedulers of every rank of a group in one process share its prefix-cache keys, which
    /// it computes for the first one that needs them (see [`PreparedPrompt`]). The same
    /// checks and errors, in the same order.
    pub fn add_prepared(
        &mut self,
        id: RequestId,
        prepared: &PreparedPrompt,
        max_new_tokens: u32,
        priority: i32,
    ) -> Result<()> {
        let prompt = prepared.tokens();
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
        let mut request = Request::with_tokens(
            id,
            std::sync::Arc::clone(&prepared.tokens),
            max_new_tokens,
            priority,
            self.first_step_for_new_request(),
        );
        if self.config.enable_prefix_caching {
            request.cold.chain_seed = prepared.chain_seed;
            request.cold.block_keys = prepared
                .block_keys(self.layout.tokens_per_superblock())
                .to_vec();
        }
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
        self.enqueue(req, priority);
        self.state_counts[RequestState::Waiting.index()] += 1;
        Ok(())
    }

    /// Puts the request at `req` in the queue at its place for its whole life: behind every
    /// live request (`fcfs`), or behind every live request at least as important
    /// (`priority`: the queue is kept in descending priority, arrival order within one). A
    /// place is found by a binary search over a queue already in order, never a sort; the
    /// common case (no more important than the last) appends.
    fn enqueue(&mut self, req: RequestIndex, priority: i32) {
        let at = match self.config.admission_policy {
            AdmissionPolicy::Fcfs => self.queue.len(),
            AdmissionPolicy::Priority => {
                let requests = &self.requests;
                let priority_of = |r: RequestIndex| requests[r as usize].cold.priority;
                match self.queue.last() {
                    Some(&last) if priority_of(last) < priority => {
                        self.queue.partition_point(|&r| priority_of(r) >= priority)
                    }
                    _ => self.queue.len(),
                }
            }
        };
        self.queue.insert(at, req);
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

    /// Decides the next step. It may run while one step is pending (one step ahead: the
    /// new step assumes every decode of the pending one yields a token and refers to the
    /// tokens still in flight through `generation_input_refs`). Fails with `InvalidState`
    /// while two steps are pending, with `Deadlock` after `deadlock_steps` steps without progress,
    /// and with `PreemptionDisabled` when a disaggregated generation server runs out of
    /// pages for a decode token; each failure leaves the scheduler unchanged.
    ///
    /// The returned output lives in the scheduler and is reused by the next step (no
    /// per-step allocation); clone it to keep it. It is built in a spare buffer that
    /// becomes the current output only on success, so a failure leaves the previous one.
    pub fn schedule(&mut self) -> Result<&ScheduleOutput> {
        if let (true, Some(older), Some(newer)) = (
            self.pending.is_full(),
            self.pending.oldest(),
            self.pending.newest(),
        ) {
            return Err(CoreError::InvalidState(format!(
                "steps {} and {} are pending; a step may be scheduled at most one ahead: update() the older \
                 one (or revert() the newer) first",
                older.step, newer.step
            )));
        }
        if self.stalled_steps >= self.config.deadlock_steps {
            return Err(CoreError::Deadlock(self.deadlock_message()));
        }
        let step = self.next_step;
        // With one step pending, this one is planned ahead of it (`step.rs`).
        let ahead = !self.pending.is_empty();
        self.begin_step(step);
        let planned = if ahead {
            self.mark_older_step_work(step);
            self.generation_phase_ahead(step)
                .and_then(|()| self.context_phase(step, true))
        } else {
            self.generation_phase(step)
                .and_then(|()| self.context_phase(step, false))
        };
        if let Err(err) = planned {
            self.abandon_step();
            return Err(err);
        }
        self.finish_step(step);
        self.ledger
            .take_evictions(&mut self.builder.record.evictions);
        let record = self.builder.seal(self.ledger.free_list_len());
        self.pending.push(record);
        std::mem::swap(&mut self.output, &mut self.builder.out);
        self.next_step += 1;
        self.drafts.consumed();
        Ok(&self.output)
    }

    /// Applies the step that ran: one sampled token per `sample_ids` entry (same order),
    /// and optionally an end-of-sequence flag per entry. Returns the ids of requests
    /// that finished, in queue order; their outputs wait for `take_output`. The input is
    /// validated whole before anything changes.
    ///
    /// With two steps pending (the newer scheduled one step ahead) it closes the older one:
    /// `tokens` follow that step's `sample_ids`. A request that finishes there while the
    /// newer step refers to it loses its work in the newer step and is held (its KV and
    /// batch slot) until that step closes.
    ///
    /// A request whose abort was requested while this step was pending finishes here
    /// with [`FinishReason::Aborted`]: its token of this step is dropped (the client is
    /// gone), its KV and batch slot are freed, and its id is among those returned.
    pub fn update(&mut self, tokens: &[i32], eos: Option<&[bool]>) -> Result<&[RequestId]> {
        self.update_accepted(tokens, eos, None)
    }

    /// [`Self::update`] of a step whose decodes verified drafts (speculative decoding):
    /// `tokens` (and `eos`) hold one row per `sample_ids` entry, so `1 + drafts` rows per
    /// generation entry (the tokens sampled at its decode position and at each draft
    /// position), and `accepted[i]` says how many drafts of generation entry `i` were
    /// accepted (`0..=drafts`; `None`: none). Entry `i` keeps its first `accepted[i] + 1`
    /// rows, up to the first end-of-sequence among them (the tokens after it are dropped);
    /// its other draft positions are rolled back, and a superblock only they reached goes
    /// back to the pool. Refused (nothing changed) for the wrong number of rows, of flags
    /// or of accepted counts, or an accepted count above the entry's drafts.
    #[expect(
        clippy::missing_panics_doc,
        reason = "the step taken out is the one checked first: it is there"
    )]
    pub fn update_accepted(
        &mut self,
        tokens: &[i32],
        eos: Option<&[bool]>,
        accepted: Option<&[u32]>,
    ) -> Result<&[RequestId]> {
        // The oldest pending step closes.
        let Some(oldest) = self.pending.oldest() else {
            return Err(CoreError::InvalidState(
                "update() without a pending step: call schedule() first (and update or revert each step once)".into(),
            ));
        };
        let (step, samples) = (oldest.step, oldest.samples);
        if tokens.len() != samples {
            return Err(CoreError::InvalidArgument(format!(
                "update() got {} tokens for the {samples} entries of sample_ids of step {step}",
                tokens.len(),
            )));
        }
        if let Some(eos) = eos {
            if eos.len() != samples {
                return Err(CoreError::InvalidArgument(format!(
                    "update() got {} eos flags for the {samples} entries of sample_ids of step {step}",
                    eos.len(),
                )));
            }
        }
        if let Some(accepted) = accepted {
            let entries = oldest.generation_reqs.len();
            if accepted.len() != entries {
                return Err(CoreError::InvalidArgument(format!(
                    "update() got {} accepted counts for the {entries} generation entries of step {step}",
                    accepted.len(),
                )));
            }
            let mut drafts = oldest.drafts.iter().peekable();
            for (entry, &count) in accepted.iter().enumerate() {
                let verified = match drafts.peek() {
                    Some(d) if d.entry as usize == entry => drafts.next().map_or(0, |d| d.count),
                    _ => 0,
                };
                if count > verified {
                    let id = self.requests[oldest.generation_reqs[entry] as usize].id;
                    return Err(CoreError::InvalidArgument(format!(
                        "update() got {count} accepted drafts for generation entry {entry} (request {id}) \
                         of step {step}, which verified {verified}"
                    )));
                }
            }
        }
        let record = self.pending.pop_oldest().expect("a step is pending");
        self.apply_step(&record, tokens, eos, accepted);
        self.builder.recycle(record);
        Ok(&self.finished_ids)
    }

    /// Undoes the scheduled step that did not run: its decode and prompt reservations,
    /// resumes, new batch slots and sit-outs, so the ledger is as before `schedule()`.
    /// Preemptions and suspends made by the step stay applied (every rank applied the
    /// same ones; the victims re-prefill or resume later). The step number stays used.
    ///
    /// With two steps pending it undoes the newer one only; the older one stays pending
    /// (and may then be updated or reverted), and requested aborts wait for its close.
    ///
    /// Requests whose abort was requested while the step was pending are aborted right
    /// after the undo (in queue order); their ids are returned, as `update` would.
    pub fn revert(&mut self) -> Result<&[RequestId]> {
        let Some(record) = self.pending.pop_newest() else {
            return Err(CoreError::InvalidState(
                "revert() without a pending step: call schedule() first (and update or revert each step once)".into(),
            ));
        };
        self.revert_step(&record);
        self.builder.recycle(record);
        // With the older step still pending, aborts wait for its close.
        if self.pending.is_empty() && self.abort_requests > 0 {
            self.apply_requested_aborts();
        }
        Ok(&self.finished_ids)
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
        let mut tokens = request.cold.tokens.to_vec();
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
        let building = &mut self.builder.out;
        if spare.capacity() > building.capacity() {
            let placement = building.rank_placement;
            *building = spare;
            building.rank_placement = placement;
        }
    }
    /// Whether a schedule awaits `update` or `revert`.
    pub fn is_step_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// How many schedules await `update` or `revert`: 0, 1, or 2 (a step scheduled one
    /// step ahead while the previous one was still pending).
    pub fn pending_steps(&self) -> u32 {
        #[expect(
            clippy::cast_possible_truncation,
            reason = "at most two steps are pending"
        )]
        let pending = self.pending.len() as u32;
        pending
    }

    /// Drops every cached superblock no request references, identically on every rank
    /// (they join the free list, least recently released first); referenced ones keep
    /// their keys. Returns how many were dropped (0 without prefix caching). Refused
    /// (`InvalidState`, nothing changed) while a step is pending: its revert would put
    /// back what it evicted.
    pub fn reset_prefix_cache(&mut self) -> Result<u32> {
        if let Some(pending) = self.pending.oldest() {
            return Err(CoreError::InvalidState(format!(
                "reset_prefix_cache() while step {} is pending: update() or revert() it first",
                pending.step
            )));
        }
        Ok(self.ledger.reset_prefix_cache())
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
                victim_choices: r.cold.victim_choices,
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
        h.u64(self.pending.len() as u64);
        let zombies = || self.pending.iter().flat_map(|record| &record.zombies);
        h.u64(zombies().count() as u64);
        for &req in zombies() {
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
            h.u64(u64::from(r.cold.victim_choices));
            h.u64(u64::from(r.abort_requested));
        }
        h.u64(self.finished.len() as u64);
        h.finish()
    }
}

/// The step-metadata and decode-row writers (`metadata.rs`): each call hands them a
/// [`WriterView`] of what they read (the ledger, the newest pending step's record, the
/// layout and the rank), never the scheduler.
impl Scheduler {
    /// The metadata layout for this scheduler's capacities: `max_num_tokens` tokens and
    /// `max_batch_size` entries a step, and rows of `table_width` superblocks (default: the
    /// superblocks of a `max_seq_len` request, capped by the pool).
    pub fn step_metadata_layout(&self, table_width: Option<u32>) -> Result<StepMetadataLayout> {
        let width = table_width.unwrap_or_else(|| {
            let needed = self.layout.superblocks_for(self.config.max_seq_len);
            u32::try_from(needed)
                .unwrap_or(u32::MAX)
                .min(self.config.capacity_superblocks)
        });
        StepMetadataLayout::new(
            self.config.max_num_tokens,
            self.config.max_batch_size,
            width,
        )
    }

    /// [`Scheduler::write_step_metadata`] for the output the scheduler still holds (one not
    /// moved out with `take_last_output`).
    pub fn write_last_step_metadata(
        &self,
        layout: &StepMetadataLayout,
        buffer: &mut [i32],
    ) -> Result<StepMetadata> {
        self.write_step_metadata(StepSource::from(&self.output), layout, buffer)
    }

    /// Writes this rank's metadata of the pending step `source` (the fields of its
    /// [`ScheduleOutput`]) into `buffer`, cut as `layout` says. Everything is checked before
    /// the first word is written, so an error (`InvalidState` for an output that is not the
    /// pending step's, `InvalidLength` for a step or table past the layout's capacities or a
    /// buffer shorter than it, `InvalidArgument` for arrays that do not fit together,
    /// `UnknownRequest`) leaves the buffer as it was. The scheduler is only read. A decode
    /// input still in flight (a step planned one ahead) is written as token -1: the layout has
    /// no section for `generation_input_refs` (the decode rows of
    /// [`Scheduler::write_decode_rows`] have a column for it). The per-rank values (which
    /// tokens this rank writes, its local and past-seen lengths) are this scheduler's rank's,
    /// computed from the positions as the schedule computed them; the output's per-rank
    /// arrays are not read (another rank's output of the step writes this rank's metadata).
    pub fn write_step_metadata(
        &self,
        source: StepSource<'_>,
        layout: &StepMetadataLayout,
        buffer: &mut [i32],
    ) -> Result<StepMetadata> {
        self.writer_view()
            .write_step_metadata(source, layout, buffer)
    }

    /// [`Scheduler::write_decode_rows`] for the output the scheduler still holds.
    pub fn write_last_decode_rows(
        &self,
        buffer: &mut [i32],
        width: usize,
        pad_to: usize,
    ) -> Result<DecodeRowCounts> {
        self.write_decode_rows(StepSource::from(&self.output), buffer, width, pad_to)
    }

    /// Writes this rank's metadata of the pending decode-only step `source` as rows of
    /// `width` int32 words (`buffer` holds `buffer.len() / width` rows, row-major), laid out
    /// as [`decode_row`] says: row `i` is generation entry `i`, its block table -1 padded to
    /// `width - decode_row::BLOCK_TABLE` columns. Rows `rows..pad_to` get the padding
    /// columns ([`decode_row::PADDING`]; their block-table cells are left as they were, a
    /// padding row attends to nothing); rows past `max(rows, pad_to)` are left as they were.
    /// The slot, local and past-seen columns are this scheduler's rank's, computed from the
    /// positions (the output's per-rank arrays are not read), as in
    /// [`Scheduler::write_step_metadata`].
    ///
    /// Everything is checked before the first word is written, so an error leaves the buffer
    /// as it was: `InvalidState` for an output that is not the pending step's;
    /// `InvalidArgument` for a step with context chunks, arrays that do not fit together,
    /// a width without the fixed columns or an input reference below -1; `InvalidLength` for
    /// a buffer that is not whole rows, more rows (or `pad_to`) than it holds, a request
    /// holding more superblocks than the row has columns, a value past `i32::MAX` or a
    /// position not reserved; `UnknownRequest`. The scheduler is only read.
    pub fn write_decode_rows(
        &self,
        source: StepSource<'_>,
        buffer: &mut [i32],
        width: usize,
        pad_to: usize,
    ) -> Result<DecodeRowCounts> {
        self.writer_view()
            .write_decode_rows(source, buffer, width, pad_to)
    }

    /// What the writers read of this scheduler.
    fn writer_view(&self) -> WriterView<'_> {
        WriterView {
            ledger: &self.ledger,
            newest: self.pending.newest(),
            layout: self.layout,
            placement: &self.placement,
            rank: self.config.cp_rank,
        }
    }
}
