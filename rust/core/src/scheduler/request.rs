//! A request as the scheduler tracks it. The ledger owns the placement counters; this
//! holds the tokens, progress and bookkeeping that decide what to schedule.

use super::metrics::RequestMetrics;
use crate::RequestId;

/// Where a live request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestState {
    /// Nothing computed: a new request, or one recompute-paused and waiting to re-prefill.
    Waiting,
    /// Part of the prompt computed (`0 < computed < prompt`).
    Prefilling,
    /// Prompt computed; decodes one token per step.
    Decoding,
    /// KV moved to the host tier (`NonHelix` only); holds no superblocks.
    Suspended,
}

impl RequestState {
    /// Number of states, for per-state counters.
    pub(super) const COUNT: usize = 4;

    /// Dense index for per-state counters.
    pub(super) fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name, as used by the Python surface.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Prefilling => "prefilling",
            Self::Decoding => "decoding",
            Self::Suspended => "suspended",
        }
    }
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// It generated `max_new_tokens`.
    Length,
    /// `update()` flagged its last token as end-of-sequence (this wins over `Length`
    /// when both hold: the model ended it).
    Eos,
    /// `abort()` / `abort_many()` ended it.
    Aborted,
}

impl FinishReason {
    /// Lower-case name, as used by the Python surface.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Eos => "eos",
            Self::Aborted => "aborted",
        }
    }
}

/// What `take_output` hands over for a finished request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestOutput {
    pub request_id: RequestId,
    /// Tokens generated before it finished (for an aborted request, before the abort
    /// took effect), across preemptions.
    pub token_ids: Vec<i32>,
    pub finish_reason: FinishReason,
    /// Its counters when it finished.
    pub metrics: RequestMetrics,
}

/// Marks "not in any step"; steps are numbered from 0.
pub(super) const NO_STEP: u64 = u64::MAX;

/// A batch slot or none in four bytes (slots are below `max_batch_size` <= 2^31 - 1, so
/// `u32::MAX` never is one), to keep a decoding request's hot fields on one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct BatchSlot(u32);

impl BatchSlot {
    const NONE: u32 = u32::MAX;

    pub const fn none() -> Self {
        Self(Self::NONE)
    }
    pub fn get(self) -> Option<u32> {
        (self.0 != Self::NONE).then_some(self.0)
    }
    pub fn is_none(self) -> bool {
        self.0 == Self::NONE
    }
    pub fn set(&mut self, slot: u32) {
        debug_assert_ne!(slot, Self::NONE);
        self.0 = slot;
    }
    pub fn take(&mut self) -> Option<u32> {
        std::mem::replace(self, Self::none()).get()
    }
}

/// Fields in declaration order (`repr(C)`): everything a step reads or writes for a
/// decoding request (`schedule` and `update` alike, the finish check included) comes
/// first and shares one 64-byte line; the rest (prefill, preemption, metrics) follow.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[repr(C, align(64))]
pub(super) struct Request {
    /// Prompt, then every sampled token; folded tokens stay here, so a re-prefill reads
    /// its chunks straight from this vector.
    pub tokens: Vec<i32>,
    pub id: RequestId,
    /// Tokens whose KV has been written since the last (re-)prefill began. For a
    /// `Decoding` request `tokens.len() == computed + 1`: the last token is the next input.
    pub computed: u64,
    /// Last step that gave it a context or generation entry.
    pub scheduled_step: u64,
    /// Persistent batch slot, if held.
    pub batch_slot: BatchSlot,
    /// `tokens.last()`, kept here so the per-step decode path does not touch the token
    /// buffer (a cache miss per request).
    pub last_token: i32,
    /// `max_new_tokens - generated()`: the finish check without reading the cold line.
    pub remaining_tokens: u32,
    pub state: RequestState,
    /// `abort()` was called while a step was pending; it takes effect when that step is
    /// updated or reverted. On the hot line because `update` reads it for every request.
    pub abort_requested: bool,

    /// Last step that preempted or suspended it.
    pub victim_step: u64,
    /// Last step that resumed it from the host tier.
    pub resumed_step: u64,
    /// Last step in which it got its decode page by preempting (no victim in that step).
    pub rescued_step: u64,
    /// Length of the prompt as added; `tokens.len() - original_prompt_len` is the number
    /// of tokens generated so far, across preemptions.
    pub original_prompt_len: u64,
    /// First step this request could take part in (steps scheduled before its add do
    /// not count as waiting).
    pub first_step: u64,
    pub steps_waited: u64,
    pub max_new_tokens: u32,
    pub priority: i32,
    /// Times chosen as a victim (recompute-pause or suspend).
    pub preemptions: u32,
    /// Host-tier superblocks held while suspended.
    pub host_superblocks: u32,

    pub recomputed_tokens: u64,
    /// The batch slot it gave up by sitting out, restored if that step is reverted.
    pub sat_out_slot: Option<u32>,
    /// The state to return to on resume.
    pub suspended_from: RequestState,

    /// Step planned one ahead in which this request's work in the older pending step
    /// was marked (`ahead_*` are meaningful only while this equals that step).
    pub ahead_step: u64,
    /// Row of its sampled token in the older pending step, or -1 if it samples nothing
    /// there (a chunk that does not complete the prompt).
    pub ahead_row: i32,
    /// Where its prompt stands once the older pending step's chunk has run.
    pub ahead_computed: u64,
    /// Last step in which it sat out or claimed a batch slot (with `scheduled_step`,
    /// `resumed_step` and `victim_step`: whether a step's records refer to it).
    pub touched_step: u64,
    /// Finished while a newer pending step still refers to it: out of the queue and the
    /// index, its KV and batch slot held until that step closes.
    pub zombie: bool,
}

impl Request {
    pub fn new(
        id: RequestId,
        prompt: &[i32],
        max_new_tokens: u32,
        priority: i32,
        first_step: u64,
    ) -> Self {
        // Room for a modest output up front; a long one grows by doubling as usual.
        let mut tokens = Vec::with_capacity(prompt.len() + max_new_tokens.min(256) as usize);
        tokens.extend_from_slice(prompt);
        Self {
            id,
            state: RequestState::Waiting,
            abort_requested: false,
            last_token: prompt.last().copied().unwrap_or_default(),
            tokens,
            original_prompt_len: prompt.len() as u64,
            computed: 0,
            max_new_tokens,
            remaining_tokens: max_new_tokens,
            priority,
            batch_slot: BatchSlot::none(),
            host_superblocks: 0,
            suspended_from: RequestState::Waiting,
            preemptions: 0,
            recomputed_tokens: 0,
            steps_waited: 0,
            first_step,
            scheduled_step: NO_STEP,
            victim_step: NO_STEP,
            resumed_step: NO_STEP,
            rescued_step: NO_STEP,
            sat_out_slot: None,
            ahead_step: NO_STEP,
            ahead_row: -1,
            ahead_computed: 0,
            touched_step: NO_STEP,
            zombie: false,
        }
    }

    /// Appends a sampled token.
    pub fn push_token(&mut self, token: i32) {
        self.tokens.push(token);
        self.last_token = token;
        self.remaining_tokens = self.remaining_tokens.saturating_sub(1);
    }

    /// Whether it has generated `max_new_tokens` (reads only the hot line).
    pub fn is_complete(&self) -> bool {
        self.remaining_tokens == 0
    }

    /// Tokens sampled so far, across preemptions.
    pub fn generated(&self) -> u64 {
        self.tokens.len() as u64 - self.original_prompt_len
    }

    /// Tokens the current (re-)prefill must cover: the prompt plus any folded tokens.
    /// Only meaningful while `Waiting` or `Prefilling`.
    pub fn prefill_len(&self) -> u64 {
        self.tokens.len() as u64
    }
}

// The decode path's fields must stay on the first line.
const _: () = assert!(std::mem::offset_of!(Request, state) < 64);
const _: () = assert!(std::mem::offset_of!(Request, abort_requested) < 64);
const _: () = assert!(std::mem::offset_of!(Request, victim_step) == 64);
