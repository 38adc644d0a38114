//! A request as the scheduler tracks it. The ledger owns the placement counters; this
//! holds the tokens, progress and bookkeeping that decide what to schedule.

use std::fmt;
use std::ops::{Deref, DerefMut};

use super::metrics::RequestMetrics;
use crate::ids::RequestId;

/// Where a live request sits in `Scheduler::requests`; stable while the request is
/// live, reused once it is retired. It is also the request's entry in the ledger (see
/// `Scheduler::add_request`).
pub(super) type RequestIndex = u32;

/// Where a live request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestState {
    /// Nothing computed: a new request, or one recompute-paused and waiting to re-prefill.
    Waiting,
    /// Part of the prompt computed (`0 < computed < prompt`).
    Prefilling,
    /// Prompt computed; decodes one token per step.
    Decoding,
    /// KV moved to the host tier; holds no GPU superblocks.
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

/// What a step planned one ahead knows of a request's work in the older pending step
/// (`StepBuilder::ahead_marks`, by request index: dense, so the decode path does not touch
/// the request's cold record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct AheadMark {
    /// The step being planned when this was marked (the rest is meaningful only then).
    pub step: u64,
    /// Where its prompt stands once the older step's chunk has run.
    pub computed: u64,
    /// Row of its sampled token in the older step, or -1 if it samples nothing there (a
    /// chunk that does not complete the prompt).
    pub row: i32,
}

impl AheadMark {
    pub const NONE: Self = Self {
        step: NO_STEP,
        computed: 0,
        row: -1,
    };
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

/// Everything a step reads or writes for a decoding request (`schedule` and `update`
/// alike, the finish check and the token append included), in one 64-byte record; the rest
/// (the token vector, prefill, preemption, metrics) is in [`RequestCold`], behind a
/// pointer. So `Scheduler::requests` is dense in what the decode path touches: a request
/// costs the per-step path one line, and the line next to it (which adjacent-line
/// prefetch brings along) is another request's, not this one's cold fields.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[repr(C, align(64))]
pub(super) struct Request {
    pub id: RequestId,
    /// Tokens whose KV has been written since the last (re-)prefill began. For a
    /// `Decoding` request `known_len() == computed + 1`: the last token is the next input.
    pub computed: u64,
    /// Last step that gave it a context or generation entry.
    pub scheduled_step: u64,
    /// Persistent batch slot, if held.
    pub batch_slot: BatchSlot,
    /// The last known token (the next decode input), kept here so the per-step decode
    /// path reads neither the token vector nor the token log.
    pub last_token: i32,
    /// `max_new_tokens - generated()`: the finish check without reading the cold record.
    pub remaining_tokens: u32,
    /// Sampled tokens in its row of the [`TokenLog`] (fewer than [`LOG_ROW`]).
    pub logged: u32,
    pub state: RequestState,
    /// `abort()` was called while a step was pending; it takes effect when that step is
    /// updated or reverted. Here because `update` reads it for every request.
    pub abort_requested: bool,
    /// Its newest full chunk in the [`TokenLog`] ([`NO_CHUNK`] if none), and how many it
    /// has there (each links to the one before).
    pub last_chunk: u32,
    pub chunks: u32,
    /// The fields the per-step decode path does not touch.
    pub cold: Box<RequestCold>,
}

/// The fields of a [`Request`] off the per-step decode path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct RequestCold {
    pub max_new_tokens: u32,
    pub priority: i32,
    /// Times chosen as a victim (recompute-pause or suspend).
    pub victim_choices: u32,
    /// Prompt (with folded tokens), then the tokens sampled before the log last moved
    /// them here; the newer ones wait in the [`TokenLog`] (its chunks, then its row).
    /// A re-prefill reads its chunks straight from this vector (a request that re-prefills
    /// has nothing in the log: it is flushed when recompute-paused). Shared, copy on
    /// write: a request added from a `PreparedPrompt` shares its prompt with every other
    /// request added from it (the ranks of an in-process group), until it changes it.
    pub tokens: std::sync::Arc<Vec<i32>>,
    /// Last step that preempted or suspended it.
    pub victim_step: u64,
    /// Last step that resumed it from the host tier.
    pub resumed_step: u64,
    /// Last step in which it got its decode page by preempting (no victim in that step).
    pub rescued_step: u64,
    /// Length of the prompt as added; `known_len() - original_prompt_len` is the number
    /// of tokens generated so far, across preemptions.
    pub original_prompt_len: u64,
    /// First step this request could take part in (steps scheduled before its add do
    /// not count as waiting).
    pub first_step: u64,
    pub steps_waited: u64,
    pub recomputed_tokens: u64,
    /// The state to return to on resume.
    pub suspended_from: RequestState,
    /// Last step in which it sat out or claimed a batch slot (with `scheduled_step`,
    /// `resumed_step` and `victim_step`: whether a step's records refer to it).
    pub touched_step: u64,
    /// Finished while a newer pending step still refers to it: out of the queue and the
    /// index, its KV and batch slot held until that step closes.
    pub zombie: bool,
    /// With prefix caching: the seed of its key chain (from its cache salt) and the keys
    /// of its full superblocks of known tokens computed so far (`prefix_cache.rs`).
    pub chain_seed: crate::prefix_cache::BlockKey,
    pub block_keys: Vec<crate::prefix_cache::BlockKey>,
}

impl Request {
    #[cfg(test)]
    pub fn new(
        id: RequestId,
        prompt: &[i32],
        max_new_tokens: u32,
        priority: i32,
        first_step: u64,
    ) -> Self {
        let tokens = std::sync::Arc::new(prompt.to_vec());
        Self::with_tokens(id, tokens, max_new_tokens, priority, first_step)
    }

    /// A new request whose prompt is `tokens` (shared until it changes them).
    pub fn with_tokens(
        id: RequestId,
        tokens: std::sync::Arc<Vec<i32>>,
        max_new_tokens: u32,
        priority: i32,
        first_step: u64,
    ) -> Self {
        let last_token = tokens.last().copied().unwrap_or_default();
        let original_prompt_len = tokens.len() as u64;
        Self {
            id,
            state: RequestState::Waiting,
            abort_requested: false,
            last_token,
            logged: 0,
            last_chunk: NO_CHUNK,
            chunks: 0,
            computed: 0,
            remaining_tokens: max_new_tokens,
            batch_slot: BatchSlot::none(),
            scheduled_step: NO_STEP,
            cold: Box::new(RequestCold {
                max_new_tokens,
                priority,
                victim_choices: 0,
                tokens,
                original_prompt_len,
                suspended_from: RequestState::Waiting,
                recomputed_tokens: 0,
                steps_waited: 0,
                first_step,
                victim_step: NO_STEP,
                resumed_step: NO_STEP,
                rescued_step: NO_STEP,
                touched_step: NO_STEP,
                zombie: false,
                chain_seed: 0,
                block_keys: Vec::new(),
            }),
        }
    }

    /// Appends a sampled token straight to `tokens` (for a request that re-prefills, whose
    /// tokens must all be there; it has nothing in the log).
    pub fn push_token_unlogged(&mut self, token: i32) {
        debug_assert_eq!((self.logged, self.chunks), (0, 0));
        std::sync::Arc::make_mut(&mut self.cold.tokens).push(token);
        self.note_token(token);
    }

    /// The hot-line part of taking a sampled token.
    fn note_token(&mut self, token: i32) {
        self.last_token = token;
        self.remaining_tokens = self.remaining_tokens.saturating_sub(1);
    }

    /// Whether it has generated `max_new_tokens` (reads only the hot record).
    pub fn is_complete(&self) -> bool {
        self.remaining_tokens == 0
    }

    /// Tokens of it in the [`TokenLog`].
    pub fn logged_len(&self) -> u64 {
        u64::from(self.chunks) * LOG_ROW as u64 + u64::from(self.logged)
    }

    /// Prompt (with folded tokens) plus every token sampled since, logged ones included.
    pub fn known_len(&self) -> u64 {
        self.cold.tokens.len() as u64 + self.logged_len()
    }

    /// Tokens sampled so far, across preemptions.
    pub fn generated(&self) -> u64 {
        self.known_len() - self.cold.original_prompt_len
    }

    /// Tokens the current (re-)prefill must cover: the prompt plus any folded tokens.
    /// Only meaningful while `Waiting` or `Prefilling` (then nothing is in the log).
    pub fn prefill_len(&self) -> u64 {
        debug_assert_eq!(
            self.logged_len(),
            0,
            "a request that prefills has nothing in the log"
        );
        self.cold.tokens.len() as u64
    }
}

/// Tokens per request row, and per chunk, of the [`TokenLog`].
pub(super) const LOG_ROW: usize = 32;

/// Chunks per page of the [`TokenLog`]'s chunk store (2 MiB pages, see [`LogPage`]).
const CHUNKS_PER_PAGE: usize = 16384;

/// Tokens per page of the [`TokenLog`]'s chunk store.
const PAGE_TOKENS: usize = CHUNKS_PER_PAGE * LOG_ROW;

// A page is one transparent huge page (x86-64 and most arm64 kernels).
const _: () = assert!(PAGE_TOKENS * std::mem::size_of::<i32>() == 2 << 20);

/// A page of the [`TokenLog`]'s chunk store: [`PAGE_TOKENS`] tokens, zero when made.
///
/// It is an anonymous mapping of its own, advised for transparent huge pages on Linux
/// (best effort: the advice fails harmlessly where THP is off or unknown). Nothing is
/// touched when it is made: memory is faulted in as chunks are sealed into it, one fault
/// per 2 MiB where the kernel backs it with a huge page instead of one per 4 KiB. Where
/// the mapping fails it is a zeroed heap slice of the same size instead, so the log never
/// fails or panics because of it; either form reads and writes as `[i32]`.
enum LogPage {
    /// An anonymous mapping (page-aligned, so its bytes view as `i32`s).
    Mapped(memmap2::MmapMut),
    /// The fallback: a zeroed heap slice.
    Heap(Box<[i32]>),
}

impl LogPage {
    /// A zeroed page: mapped if the system gives a mapping, else on the heap.
    fn zeroed() -> Self {
        Self::mapped().unwrap_or_else(Self::heap)
    }

    /// A fresh anonymous mapping, or `None` if the system refuses one.
    fn mapped() -> Option<Self> {
        let map = memmap2::MmapMut::map_anon(PAGE_TOKENS * std::mem::size_of::<i32>()).ok()?;
        #[cfg(target_os = "linux")]
        {
            // Best effort: without THP (or with it set to `never`) the page is still
            // correct, just faulted in 4 KiB at a time.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        // A mapping is page-aligned, so this holds; checked once here so that the
        // views below never fail.
        bytemuck::try_cast_slice::<u8, i32>(&map).ok()?;
        Some(Self::Mapped(map))
    }

    /// A zeroed heap page.
    fn heap() -> Self {
        Self::Heap(vec![0; PAGE_TOKENS].into_boxed_slice())
    }
}

impl Deref for LogPage {
    type Target = [i32];

    fn deref(&self) -> &[i32] {
        match self {
            Self::Mapped(map) => bytemuck::cast_slice(map),
            Self::Heap(tokens) => tokens,
        }
    }
}

impl DerefMut for LogPage {
    fn deref_mut(&mut self) -> &mut [i32] {
        match self {
            Self::Mapped(map) => bytemuck::cast_slice_mut(map),
            Self::Heap(tokens) => tokens,
        }
    }
}

/// A deep copy: a cloned scheduler owns its own log.
impl Clone for LogPage {
    fn clone(&self) -> Self {
        let mut page = match self {
            Self::Mapped(_) => Self::zeroed(),
            Self::Heap(_) => Self::heap(),
        };
        page.copy_from_slice(self);
        page
    }
}

/// Its form only (not 2 MiB of tokens).
impl fmt::Debug for LogPage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Mapped(_) => "LogPage::Mapped",
            Self::Heap(_) => "LogPage::Heap",
        })
    }
}

/// Marks "no chunk" in [`Request::last_chunk`] and the chunk links.
pub(super) const NO_CHUNK: u32 = u32::MAX;

/// The scheduler-wide log of sampled tokens. `update` never appends a token to its
/// request's own vector (a scattered heap line, and often a page, per request per step):
///
/// - each token goes into its request's row, one fixed row of [`LOG_ROW`] tokens per
///   request index (dense like `Scheduler::requests`: a few pages for thousands of
///   requests, so the store stays in cache);
/// - a full row becomes a chunk: copied to the end of the chunk store (sequential writes,
///   step-major: the rows that fill in one step land one after another), or into a chunk
///   freed earlier, linked to the request's previous chunk. The store is made of 2 MiB
///   pages (anonymous mappings advised for transparent huge pages, see [`LogPage`]):
///   memory is touched only as the store grows into it, and while it grows that costs
///   one page fault per 2 MiB (with THP) instead of one per 4 KiB;
/// - whoever reads a request's tokens (its output when it retires, a recompute-pause that
///   folds them into the prompt, the state digest, `tokens()`) walks its chunks, then its
///   row; retiring and folding free its chunks for reuse.
///
/// So the log holds only live requests' tokens: its memory is bounded by what live
/// requests generated (as their vectors were before), freed chunks are reused before the
/// store grows, and no compaction pass is needed. Every rule is a pure function of the
/// sequence of calls (rank-invariant; chunk numbers never reach an output or a digest).
#[derive(Debug, Clone, Default)]
pub(super) struct TokenLog {
    /// `LOG_ROW` tokens per request index.
    rows: Vec<i32>,
    /// `LOG_ROW` tokens per chunk, [`CHUNKS_PER_PAGE`] chunks per 2 MiB page: the store
    /// grows a page at a time and never moves what it holds (no copy of every live token
    /// when it grows, which a single vector's doubling would be). A page is touched only
    /// as chunks are sealed into it (see [`LogPage`]).
    pages: Vec<LogPage>,
    /// Per chunk: the previous chunk of the same request, or [`NO_CHUNK`].
    links: Vec<u32>,
    /// Chunks freed by retired or folded requests, reused last-freed first.
    free: Vec<u32>,
    /// Tests only: new pages take the heap fallback.
    #[cfg(test)]
    heap_pages: bool,
}

impl TokenLog {
    /// Gives every request index below `requests` a row.
    pub fn reserve_rows(&mut self, requests: usize) {
        if self.rows.len() < requests * LOG_ROW {
            self.rows.resize(requests * LOG_ROW, 0);
        }
    }

    /// Takes a sampled token of the request at index `req`.
    #[inline]
    pub fn push(&mut self, req: RequestIndex, request: &mut Request, token: i32) {
        let start = req as usize * LOG_ROW;
        let at = request.logged as usize;
        self.rows[start + at] = token;
        request.note_token(token);
        if at + 1 == LOG_ROW {
            self.seal_row(start, request);
        } else {
            request.logged += 1;
        }
    }

    /// Turns the full row at `start` into the request's newest chunk (once per
    /// [`LOG_ROW`] tokens: kept out of line so `push` stays small enough to inline).
    #[inline(never)]
    fn seal_row(&mut self, start: usize, request: &mut Request) {
        let row = &self.rows[start..start + LOG_ROW];
        let chunk = if let Some(chunk) = self.free.pop() {
            self.links[chunk as usize] = request.last_chunk;
            chunk
        } else {
            if self.links.len() % CHUNKS_PER_PAGE == 0 {
                self.pages.push(self.new_page());
            }
            self.links.push(request.last_chunk);
            #[expect(
                clippy::cast_possible_truncation,
                reason = "2^32 chunks would hold 2^37 live tokens (512 GiB) first"
            )]
            let chunk = (self.links.len() - 1) as u32;
            chunk
        };
        let (page, at) = Self::place(chunk);
        self.pages[page][at..at + LOG_ROW].copy_from_slice(row);
        request.last_chunk = chunk;
        request.chunks += 1;
        request.logged = 0;
    }

    /// A zeroed page for the chunk store.
    #[cfg_attr(
        not(test),
        expect(clippy::unused_self, reason = "only the tests' heap switch reads it")
    )]
    fn new_page(&self) -> LogPage {
        #[cfg(test)]
        if self.heap_pages {
            return LogPage::heap();
        }
        LogPage::zeroed()
    }

    /// The page of a chunk and where in it the chunk starts.
    fn place(chunk: u32) -> (usize, usize) {
        let chunk = chunk as usize;
        (chunk / CHUNKS_PER_PAGE, chunk % CHUNKS_PER_PAGE * LOG_ROW)
    }

    /// The request's chunks, oldest first.
    fn chunk_ids(&self, request: &Request) -> Vec<u32> {
        let mut ids = Vec::with_capacity(request.chunks as usize);
        let mut chunk = request.last_chunk;
        while chunk != NO_CHUNK {
            ids.push(chunk);
            chunk = self.links[chunk as usize];
        }
        debug_assert_eq!(ids.len(), request.chunks as usize);
        ids.reverse();
        ids
    }

    /// Appends the tokens of the request at index `req` that wait in the log, oldest
    /// first, to `out`.
    pub fn append_to(&self, req: RequestIndex, request: &Request, out: &mut Vec<i32>) {
        out.reserve(usize::try_from(request.logged_len()).unwrap_or(0));
        for chunk in self.chunk_ids(request) {
            let (page, at) = Self::place(chunk);
            out.extend_from_slice(&self.pages[page][at..at + LOG_ROW]);
        }
        let start = req as usize * LOG_ROW;
        out.extend_from_slice(&self.rows[start..start + request.logged as usize]);
    }

    /// Moves what the log holds of the request at index `req` to `out` (its token vector
    /// or its output) and frees its chunks.
    pub fn drain_into(&mut self, req: RequestIndex, request: &mut Request, out: &mut Vec<i32>) {
        if request.logged_len() == 0 {
            return;
        }
        self.append_to(req, request, out);
        let mut chunk = request.last_chunk;
        while chunk != NO_CHUNK {
            self.free.push(chunk);
            chunk = self.links[chunk as usize];
        }
        request.last_chunk = NO_CHUNK;
        request.chunks = 0;
        request.logged = 0;
    }

    /// Moves what the log holds of the request at index `req` to its token vector.
    pub fn flush(&mut self, req: RequestIndex, request: &mut Request) {
        if request.logged_len() == 0 {
            return; // nothing to move: a shared prompt stays shared
        }
        let mut tokens = std::mem::take(&mut request.cold.tokens);
        self.drain_into(req, request, std::sync::Arc::make_mut(&mut tokens));
        request.cold.tokens = tokens;
    }
}

// The decode path's record is one line.
const _: () = assert!(std::mem::size_of::<Request>() == 64);

#[cfg(test)]
mod tests {
    use super::{LogPage, Request, RequestIndex, TokenLog, CHUNKS_PER_PAGE, LOG_ROW, PAGE_TOKENS};

    fn index(req: usize) -> RequestIndex {
        RequestIndex::try_from(req).unwrap()
    }

    /// A log with its requests and, per request, the tokens it should read back.
    #[derive(Clone)]
    struct Logged {
        log: TokenLog,
        requests: Vec<Request>,
        oracle: Vec<Vec<i32>>,
    }

    impl Logged {
        /// `log` with rows for `count` requests of the prompt `prompt`, each of which may
        /// take `max_new_tokens`.
        fn new(mut log: TokenLog, count: usize, prompt: &[i32], max_new_tokens: u32) -> Self {
            log.reserve_rows(count);
            let requests = (0..count as u64)
                .map(|id| Request::new(id, prompt, max_new_tokens, 0, 0))
                .collect();
            let oracle = vec![Vec::new(); count];
            Self {
                log,
                requests,
                oracle,
            }
        }

        /// Logs `token` for request `req`.
        fn push(&mut self, req: usize, token: i32) {
            self.log.push(index(req), &mut self.requests[req], token);
            self.oracle[req].push(token);
        }

        /// Logs the next of `tokens` for each request in turn.
        fn push_each(&mut self, tokens: impl IntoIterator<Item = i32>) {
            for (req, token) in (0..self.requests.len()).zip(tokens) {
                self.push(req, token);
            }
        }

        /// Drains request `req` into `out`, which must gain exactly its tokens.
        fn drain(&mut self, req: usize, mut out: Vec<i32>) {
            let before = out.len();
            let request = &mut self.requests[req];
            self.log.drain_into(index(req), request, &mut out);
            assert_eq!(out[before..], std::mem::take(&mut self.oracle[req]));
            assert_eq!(request.logged_len(), 0);
        }

        /// Every request's read (and its logged length) equals its oracle.
        fn assert_reads(&self, what: &str) {
            for (req, request) in self.requests.iter().enumerate() {
                let mut read = Vec::new();
                self.log.append_to(index(req), request, &mut read);
                assert_eq!(read, self.oracle[req], "{what}, request {req}");
                assert_eq!(request.logged_len(), self.oracle[req].len() as u64);
            }
        }
    }

    /// Requests whose tokens interleave step by step; one is drained (retired) each
    /// round: every read equals a per-request vector, and drained chunks are reused, so
    /// the chunk store stays at what the live requests hold.
    #[test]
    fn drained_chunks_are_reused_and_reads_equal_a_per_request_vector() {
        const REQUESTS: usize = 4;
        let mut logged = Logged::new(TokenLog::default(), REQUESTS, &[1, 2], 1_000_000);
        let mut tokens = 0..;
        for round in 0..60 {
            for _ in 0..100 {
                logged.push_each(&mut tokens);
            }
            logged.assert_reads(&format!("round {round}"));
            logged.drain(round % REQUESTS, Vec::new());
        }
        // At most 400 live tokens per request (drained every fourth round), against
        // 24,000 tokens logged in all.
        let log = &logged.log;
        let live_chunks = REQUESTS * 400 / LOG_ROW;
        assert!(
            log.links.len() <= live_chunks + REQUESTS,
            "{} chunks",
            log.links.len()
        );
        assert_eq!(log.pages.len(), log.links.len().div_ceil(CHUNKS_PER_PAGE));
    }

    /// Tokens pushed round-robin to `requests` requests of `log` until its chunk store
    /// holds more than `pages` pages: every request's drain appends its tokens in order,
    /// and every page is of the form `form` accepts.
    fn fill_across_pages(
        log: TokenLog,
        requests: usize,
        pages: usize,
        form: impl Fn(&LogPage) -> bool,
    ) {
        let mut logged = Logged::new(log, requests, &[1], u32::MAX);
        let mut tokens = 0..;
        while logged.log.pages.len() <= pages {
            logged.push_each(&mut tokens);
        }
        for req in 0..requests {
            logged.drain(req, vec![1]);
        }
        let log = &logged.log;
        assert!(log.pages.len() > pages, "{} pages", log.pages.len());
        assert!(log.pages.iter().all(form));
    }

    /// More chunks than a page holds: reads cross pages in order. The pages are
    /// mappings where the system gives them (always, on Linux).
    #[test]
    fn reads_cross_pages_of_the_chunk_store_in_order() {
        fill_across_pages(TokenLog::default(), 3, 3, |page| {
            !cfg!(target_os = "linux") || matches!(page, LogPage::Mapped(_))
        });
    }

    /// The heap fallback (what a page is where no mapping is given) reads and writes
    /// the same, across pages.
    #[test]
    fn heap_pages_read_and_write_like_mapped_ones() {
        let page = LogPage::heap();
        assert_eq!(page.len(), PAGE_TOKENS);
        assert!(page.iter().all(|&token| token == 0));
        let log = TokenLog {
            heap_pages: true,
            ..TokenLog::default()
        };
        fill_across_pages(log, 2, 2, |page| matches!(page, LogPage::Heap(_)));
    }

    /// A cloned log (a cloned scheduler's) owns its pages: chunks written into one after
    /// the clone, fresh or reused, never show in the other. Both page forms.
    #[test]
    fn a_cloned_log_is_independent_of_the_original() {
        for heap_pages in [false, true] {
            let log = TokenLog {
                heap_pages,
                ..TokenLog::default()
            };
            let mut logged = Logged::new(log, 2, &[1], u32::MAX);
            for token in 0..100 {
                logged.push_each([token; 2]);
            }
            let mut twin = logged.clone();
            let pages = |logged: &Logged| format!("{:?}", logged.log.pages);
            assert_eq!(pages(&twin), pages(&logged));
            assert!(format!("{:?}", logged.log.pages[0]).len() < 20);

            // The original goes on: new chunks at the end of its store.
            for token in 1000..1100 {
                logged.push_each([token; 2]);
            }
            // The twin frees request 0's chunks and refills them, then the same fresh
            // chunk numbers as the original, with other tokens.
            twin.drain(0, Vec::new());
            for token in -300..0 {
                twin.push(1, token);
            }

            let what = format!("heap pages {heap_pages}");
            logged.assert_reads(&what);
            twin.assert_reads(&what);
        }
    }
}
