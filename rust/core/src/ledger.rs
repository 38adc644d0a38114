//! The superblock page ledger: one pool of superblocks, identical on every rank, and a
//! page table per request. A superblock is one physical page on each rank, and its id is
//! that page's id on every rank, so one table serves the whole CP group.

use rustc_hash::FxHashMap;

use crate::error::{CoreError, Result};
use crate::ids::{page_id, superblock_count, RequestId, SuperblockId, MAX_CAPACITY};
use crate::layout::Layout;
use crate::prefix_cache::{BlockKey, Eviction, PrefixCache};

/// The bits of a superblock id as an int32 word, whatever its value: a page id where the
/// id is held ([`page_id`]); stale cells of a table held in place are masked off after.
#[expect(
    clippy::cast_possible_wrap,
    reason = "bits only: a held id is a page id (see `page_id`), a stale one is masked off"
)]
fn page_id_bits(superblock: SuperblockId) -> i32 {
    superblock as i32
}

/// Writes `pages` into the block-table row `cells` as int32 page ids (what fits), `pad`
/// in the cells past them, and returns `pages`: a table held on the heap, or a row
/// narrower than a table held in place (kept out of the row loop).
#[inline(never)]
pub(crate) fn write_table_cells<'a>(
    cells: &mut [i32],
    pages: &'a [SuperblockId],
    pad: i32,
) -> &'a [SuperblockId] {
    let used = pages.len().min(cells.len());
    let (head, tail) = cells.split_at_mut(used);
    for (cell, &superblock) in head.iter_mut().zip(pages) {
        *cell = page_id(superblock);
    }
    pad_cells(tail, pad);
    pages
}

/// Every cell of `cells` `pad`: eight cells a store while eight remain, then one store of
/// eight ending at the last cell (overlapping the one before) where `cells` holds eight;
/// cell by cell below. A row's padding without a loop per cell or a `memset` call.
#[inline]
fn pad_cells(cells: &mut [i32], pad: i32) {
    const LANES: usize = 8;
    let n = cells.len();
    if n < LANES {
        for cell in cells {
            *cell = pad;
        }
        return;
    }
    let lanes = [pad; LANES];
    let mut at = 0;
    while at + LANES < n {
        cells[at..at + LANES].copy_from_slice(&lanes);
        at += LANES;
    }
    cells[n - LANES..].copy_from_slice(&lanes);
}

/// Where a held request's [`RequestKv`] sits in the ledger's slab: its *ledger entry*.
/// Stable while the request is held, and reused once it is freed. (A KV slot is a token's
/// place in a rank's page pool, a batch slot a row of the executor's batch: other words
/// for other things.)
pub(crate) type EntryIndex = usize;

/// What [`Ledger::extend_decode_most`] gave a decode: `count` draft positions, the length
/// before them, and the superblocks they took from the free list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DraftExtension {
    pub count: u64,
    pub len_before: u64,
    pub grown: u32,
}

impl DraftExtension {
    pub(crate) const NONE: Self = Self {
        count: 0,
        len_before: 0,
        grown: 0,
    };
}

/// Superblocks a [`KvTable`] holds in place before its table moves to the heap: the first
/// ones a request takes cost no allocation and no cache line beyond the table's.
const INLINE_SUPERBLOCKS: usize = 8;

/// `HELD_LANES[n]`: all ones in the first `n` lanes of a table held in place, zero past.
const HELD_LANES: [[i32; INLINE_SUPERBLOCKS]; INLINE_SUPERBLOCKS + 1] = {
    let mut lanes = [[0; INLINE_SUPERBLOCKS]; INLINE_SUPERBLOCKS + 1];
    let mut held = 0;
    while held <= INLINE_SUPERBLOCKS {
        let mut lane = 0;
        while lane < held {
            lanes[held][lane] = -1;
            lane += 1;
        }
        held += 1;
    }
    lanes
};

/// Flag bits of [`KvRecord::flags`].
const HAS_DECODE_STEP: u8 = 1;
const SUSPENDED: u8 = 1 << 1;

/// The counters of one request's KV holdings: everything a decode grow reads and writes
/// (ids, lengths, counters, the step of the last decode and the table's length). Current
/// state only: the undo of a step's changes is the step's (its record keeps their
/// inverses, see [`DecodeInverse`]).
///
/// One cache line (`align(64)`, exactly 64 bytes), so the per-step decode path touches one
/// line per request, and the records of a slab pack densely: the table sits apart, in
/// [`KvTable`] at the same entry of a parallel vector, so neither a prefetch of the
/// adjacent line nor a partly used line brings table bytes the decode path never reads.
#[derive(Clone)]
#[repr(C, align(64))]
struct KvRecord {
    id: RequestId,
    len: u64,
    prompt_len: u64,
    decode_count: u64,
    /// The step of the last decode, if `flags` has `HAS_DECODE_STEP` (drafts follow the
    /// decode of their step; `state_digest` covers it).
    decode_step: u64,
    /// Superblocks held: the table's length.
    held: u32,
    flags: u8,
}

// One line: a record never straddles two, and the slab holds nothing else.
const _: () = assert!(std::mem::size_of::<KvRecord>() == 64);
const _: () = assert!(std::mem::align_of::<KvRecord>() == 64);

/// One request's page table (its first superblocks in place, the rest on the heap; its
/// length is the record's `held`) and the length kept while suspended: what the decode
/// path never needs, apart from [`KvRecord`]. One line (`align(64)`, exactly 64 bytes).
#[derive(Clone)]
#[repr(C, align(64))]
struct KvTable {
    /// The table while it holds at most `INLINE_SUPERBLOCKS` superblocks; stale past `held`.
    inline: [SuperblockId; INLINE_SUPERBLOCKS],
    /// The table once it holds more (empty, capacity kept, otherwise).
    spill: Vec<SuperblockId>,
    /// Length to restore on resume while the KV sits in a lower (host) tier (`SUSPENDED`).
    suspended_len: u64,
}

const _: () = assert!(std::mem::size_of::<KvTable>() == 64);
const _: () = assert!(std::mem::align_of::<KvTable>() == 64);

impl KvRecord {
    /// A record holding nothing: `id` with a prompt of `prompt_len` tokens.
    fn fresh(id: RequestId, prompt_len: u64) -> Self {
        Self {
            id,
            len: 0,
            prompt_len,
            decode_count: 0,
            decode_step: 0,
            held: 0,
            flags: 0,
        }
    }

    fn is_suspended(&self) -> bool {
        self.flags & SUSPENDED != 0
    }
    fn next_decode_position(&self) -> u64 {
        self.prompt_len + self.decode_count
    }
    fn decode_step(&self) -> Option<u64> {
        (self.flags & HAS_DECODE_STEP != 0).then_some(self.decode_step)
    }
    fn set_decode_step(&mut self, step: Option<u64>) {
        match step {
            Some(step) => {
                self.decode_step = step;
                self.flags |= HAS_DECODE_STEP;
            }
            None => self.flags &= !HAS_DECODE_STEP,
        }
    }
}

impl KvTable {
    const EMPTY: Self = Self {
        inline: [0; INLINE_SUPERBLOCKS],
        spill: Vec::new(),
        suspended_len: 0,
    };

    /// The table of a record that holds `held` superblocks.
    #[inline]
    fn pages(&self, held: u32) -> &[SuperblockId] {
        let held = held as usize;
        if held <= INLINE_SUPERBLOCKS {
            &self.inline[..held]
        } else {
            &self.spill
        }
    }

    /// Appends `pages` to the table of `held` superblocks (at most the pool's capacity
    /// in all), updating `held`.
    #[inline]
    fn push_pages(&mut self, held: &mut u32, pages: impl ExactSizeIterator<Item = SuperblockId>) {
        let old = *held as usize;
        let new_held = old + pages.len();
        if new_held <= INLINE_SUPERBLOCKS {
            for (slot, page) in self.inline[old..new_held].iter_mut().zip(pages) {
                *slot = page;
            }
        } else {
            if old <= INLINE_SUPERBLOCKS {
                // Moving to the heap: the table there starts with what is held in place.
                self.spill.clear();
                self.spill.extend_from_slice(&self.inline[..old]);
            }
            self.spill.extend(pages);
        }
        *held = superblock_count(new_held);
    }

    /// Drops the table of `held` superblocks past its first `keep` (`keep <= held`),
    /// updating `held`.
    #[inline]
    fn truncate_pages(&mut self, held: &mut u32, keep: usize) {
        let old = *held as usize;
        debug_assert!(keep <= old);
        if old > INLINE_SUPERBLOCKS {
            if keep <= INLINE_SUPERBLOCKS {
                self.inline[..keep].copy_from_slice(&self.spill[..keep]);
                self.spill.clear();
            } else {
                self.spill.truncate(keep);
            }
        }
        *held = superblock_count(keep);
    }
}

/// One request's KV holdings and the counters that decide where its tokens go, as the
/// ledger hands them out ([`Ledger::request`]): a view of the request's `KvRecord` and
/// `KvTable`, which the ledger keeps apart.
#[derive(Clone, Copy)]
pub struct RequestKv<'a> {
    record: &'a KvRecord,
    table: &'a KvTable,
}

impl PartialEq for RequestKv<'_> {
    /// Equal holdings and counters (whatever stale values the unused storage keeps).
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.record, other.record);
        a.id == b.id
            && a.len == b.len
            && a.prompt_len == b.prompt_len
            && a.decode_count == b.decode_count
            && a.decode_step() == b.decode_step()
            && self.suspended_len() == other.suspended_len()
            && self.table() == other.table()
    }
}

impl Eq for RequestKv<'_> {}

/// The holdings and counters as [`PartialEq`] compares them (not the storage behind them).
impl std::fmt::Debug for RequestKv<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let record = self.record;
        f.debug_struct("RequestKv")
            .field("id", &record.id)
            .field("table", &self.table())
            .field("len", &record.len)
            .field("prompt_len", &record.prompt_len)
            .field("decode_count", &record.decode_count)
            .field("decode_step", &record.decode_step())
            .field("suspended_len", &self.suspended_len())
            .finish_non_exhaustive()
    }
}

impl<'a> RequestKv<'a> {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.record.id
    }
    /// Superblock ids held, in sequence order (also the page ids on every rank).
    pub fn table(&self) -> &'a [SuperblockId] {
        self.table.pages(self.record.held)
    }
    /// Global tokens reserved.
    pub fn len(&self) -> u64 {
        self.record.len
    }
    /// Whether no token is reserved.
    pub fn is_empty(&self) -> bool {
        self.record.len == 0
    }
    /// Prompt length, including generated tokens folded in by recompute.
    pub fn prompt_len(&self) -> u64 {
        self.record.prompt_len
    }
    /// Decode tokens allocated since the last (re-)prefill.
    pub fn decode_count(&self) -> u64 {
        self.record.decode_count
    }
    /// Whether the KV is suspended to a lower tier (holds no superblocks meanwhile).
    pub fn is_suspended(&self) -> bool {
        self.record.is_suspended()
    }
    /// Global tokens to restore on resume, if suspended.
    pub fn suspended_len(&self) -> Option<u64> {
        self.is_suspended().then_some(self.table.suspended_len)
    }
    /// Global position the next decode allocation will take.
    pub fn next_decode_position(&self) -> u64 {
        self.record.next_decode_position()
    }
}

/// The ledger's entries: per entry, its record and its table at the same index of two
/// parallel vectors (always of one length). Compared and printed as the list of
/// [`RequestKv`] views they make.
#[derive(Clone, Default)]
struct Slab {
    records: Vec<KvRecord>,
    tables: Vec<KvTable>,
}

impl Slab {
    fn len(&self) -> usize {
        self.records.len()
    }
    /// A new entry holding nothing for `id`, its index returned. Out of line: steady
    /// admission reuses vacant entries, and this would crowd the loops that inline it.
    #[cold]
    #[inline(never)]
    fn push(&mut self, id: RequestId, prompt_len: u64) -> EntryIndex {
        self.records.push(KvRecord::fresh(id, prompt_len));
        self.tables.push(KvTable::EMPTY);
        self.records.len() - 1
    }
    fn view(&self, entry: EntryIndex) -> RequestKv<'_> {
        RequestKv {
            record: &self.records[entry],
            table: &self.tables[entry],
        }
    }
    fn views(&self) -> impl Iterator<Item = RequestKv<'_>> {
        self.records
            .iter()
            .zip(&self.tables)
            .map(|(record, table)| RequestKv { record, table })
    }
}

impl PartialEq for Slab {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.views().eq(other.views())
    }
}

impl Eq for Slab {}

impl std::fmt::Debug for Slab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.views()).finish()
    }
}

/// The inverse of each request's last [`Ledger::allocate_decode`], by ledger entry, for
/// [`Ledger::revert_decode`]: the one-deep undo of the step-keyed calls a bare ledger's
/// user makes (the scheduler keeps its steps' inverses itself and never fills this). Sized
/// on first use, so a ledger that never takes those calls clears nothing; compared and
/// printed as the undos it holds (an entry past its length holds none).
#[derive(Clone, Default)]
struct LastDecodeUndos(Vec<Option<BareDecodeUndo>>);

/// What [`Ledger::revert_decode`] needs of a bare ledger's decode: the step marker it
/// replaced (any step a caller gave, so not packed as a [`DecodeInverse`]) and whether it
/// added its token to the length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BareDecodeUndo {
    step_before: Option<u64>,
    grew: bool,
}

impl LastDecodeUndos {
    fn get(&self, entry: EntryIndex) -> Option<BareDecodeUndo> {
        self.0.get(entry).copied().flatten()
    }

    fn set(&mut self, entry: EntryIndex, undo: BareDecodeUndo) {
        if self.0.len() <= entry {
            self.0.resize(entry + 1, None);
        }
        self.0[entry] = Some(undo);
    }

    #[inline]
    fn clear(&mut self, entry: EntryIndex) {
        if let Some(undo) = self.0.get_mut(entry) {
            *undo = None;
        }
    }

    fn held(&self) -> impl Iterator<Item = (EntryIndex, BareDecodeUndo)> + '_ {
        self.0
            .iter()
            .enumerate()
            .filter_map(|(entry, undo)| undo.map(|undo| (entry, undo)))
    }
}

impl PartialEq for LastDecodeUndos {
    fn eq(&self, other: &Self) -> bool {
        self.held().eq(other.held())
    }
}

impl Eq for LastDecodeUndos {}

impl std::fmt::Debug for LastDecodeUndos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.held()).finish()
    }
}

/// The exact inverse of one decode grow a scheduler step made ([`Ledger::decode_at`],
/// [`DecodeLane::try_decode_in_place`]), which the step's record keeps (one per
/// generation entry) and hands back to [`Ledger::undo_decode`] when it reverts the step.
/// One word: the step marker the grow replaced and two flags in its top bits (a scheduler
/// counts its steps from 0, one at a time, so a step is below `INVERSE_STEP_LIMIT`;
/// [`Ledger::decode_at`] refuses one that is not). The rest is derived at the undo from
/// the record's own facts: the decode being undone is the record's newest (its step marker
/// is the step's), so its token sat at `prompt_len + decode_count - 1`, and a grow that
/// added that token left the length one past it.
/// Two are equal when they undo alike (the step bits of one without a step are not read).
#[derive(Clone, Copy)]
pub(crate) struct DecodeInverse(u64);

impl PartialEq for DecodeInverse {
    fn eq(&self, other: &Self) -> bool {
        (self.step_before(), self.grew()) == (other.step_before(), other.grew())
    }
}

impl Eq for DecodeInverse {}

/// The record had a decode step before the grow (the low bits hold it).
const INVERSE_HAS_STEP: u64 = 1 << 63;
/// The grow added its token to the length (else a longer reservation covered it).
const INVERSE_GREW: u64 = 1 << 62;
/// Steps at and past this do not fit an inverse's word.
const INVERSE_STEP_LIMIT: u64 = INVERSE_GREW;

/// A scheduler step whose decodes' inverses fit their word ([`DecodeInverse`]): every step
/// a scheduler counts, from 0, one at a time.
pub(crate) fn check_inverse_step(step: u64) -> Result<()> {
    if step >= INVERSE_STEP_LIMIT {
        return Err(CoreError::InvalidState(format!(
            "step {step} is past the last step a decode's inverse can name ({})",
            INVERSE_STEP_LIMIT - 1
        )));
    }
    Ok(())
}

impl DecodeInverse {
    /// A placeholder (the inverse of nothing any ledger made): fills scratch arrays.
    pub(crate) const ZERO: Self = Self(0);

    /// The inverse of a grow (which added its token when `grew`) of a record whose step
    /// marker was `step_before` (with `has_step`, else none; the flag as `HAS_DECODE_STEP`
    /// of its flags).
    #[expect(
        clippy::inline_always,
        reason = "part of the per-request body of the scheduler's decode loop"
    )]
    #[inline(always)]
    fn new(has_step: u8, step_before: u64, grew: bool) -> Self {
        debug_assert!(step_before < INVERSE_STEP_LIMIT || has_step == 0);
        const { assert!(HAS_DECODE_STEP == 1) };
        Self(
            (step_before & (INVERSE_STEP_LIMIT - 1))
                | (u64::from(has_step) << 63)
                | (u64::from(grew) << 62),
        )
    }

    fn step_before(self) -> Option<u64> {
        (self.0 & INVERSE_HAS_STEP != 0).then_some(self.0 & (INVERSE_STEP_LIMIT - 1))
    }

    fn grew(self) -> bool {
        self.0 & INVERSE_GREW != 0
    }
}

impl std::fmt::Debug for DecodeInverse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeInverse")
            .field("step_before", &self.step_before())
            .field("grew", &self.grew())
            .finish()
    }
}

/// Hands the field list of [`DecodeView`] to another macro:
/// `decode_view_fields!(callback! { args })` expands to `callback! { { args } fields... }`.
#[macro_export]
macro_rules! decode_view_fields {
    ($callback:ident ! { $($args:tt)* }) => {
        $callback! {
            { $($args)* }
            /// Global tokens reserved.
            global_len: u64,
            /// Global position of the next decode token.
            next_position: u64,
            /// Rank that owns the next decode token.
            owner_rank: u32,
            /// Whether the viewing rank is not the owner (it attends but appends nothing).
            inactive: bool,
            /// Tokens this rank holds of the reserved length.
            local_len: u64,
            /// Tokens this rank holds before the next decode token.
            past_seen_len: u64,
        }
    };
}

decode_view_fields!(define_record! {
    /// What one rank sees of a request: lengths on that rank and whether it owns the next
    /// decode token. All of it is derived from the ledger's counters and the layout.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct DecodeView
});

/// The superblock ledger. Two ledgers fed the same calls are equal (`==`), hand out the
/// same ids and fail the same calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    layout: Layout,
    capacity: u32,
    /// A stack: the last element is handed out next. Its order depends only on the
    /// sequence of calls, never on addresses or hashing.
    free: Vec<SuperblockId>,
    /// A slab of entries, one per held request: freed entries stay (emptied, table
    /// capacity kept) and are reused from `vacant`, so steady-state admission allocates
    /// nothing.
    requests: Slab,
    /// Stack of vacant entries.
    vacant: Vec<EntryIndex>,
    /// Id -> entry; used for lookups only, never iterated.
    index: IdIndex,
    /// The one-deep undo of `allocate_decode` / `revert_decode` (not the scheduler's).
    last_decode_undos: LastDecodeUndos,
    /// Working space of the batch calls, kept so they allocate nothing in steady state.
    scratch: Scratch,
    /// The prefix cache (references, keys, eviction order), when enabled: then a page
    /// leaves a table through it, and registered pages nobody references stay cached,
    /// off the free list, until an allocation evicts them.
    cache: Option<Box<PrefixCache>>,
}

/// Working space of the batch calls. Not part of the ledger's state: every call empties
/// what it uses first, two are always equal, and a clone starts empty.
#[derive(Default)]
struct Scratch {
    /// The entries a batch call has looked up so far.
    entries: Vec<EntryIndex>,
    /// Per entry, the stamp of the last call that named it (a repeat within a call is
    /// an entry that already bears the call's stamp).
    stamps: Vec<u32>,
    stamp: u32,
}

impl Scratch {
    /// A stamp that none of the first `entries` entries bears yet.
    #[inline]
    fn next_stamp(&mut self, entries: usize) -> u32 {
        if self.stamps.len() < entries {
            self.stamps.resize(entries, 0);
        }
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.stamps.fill(0);
            self.stamp = 1;
        }
        self.stamp
    }
}

impl Clone for Scratch {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl PartialEq for Scratch {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Scratch {}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scratch")
    }
}

impl Ledger {
    /// A ledger of `capacity` superblocks (`1..=MAX_CAPACITY`) for `layout`. A free list
    /// that cannot be allocated is a `Config` error, not an abort.
    pub fn new(layout: Layout, capacity: u32) -> Result<Self> {
        if capacity == 0 {
            return Err(CoreError::config(
                "capacity_superblocks",
                "ledger capacity must be at least one superblock",
            ));
        }
        if capacity > MAX_CAPACITY {
            return Err(CoreError::config("capacity_superblocks", format!(
                "ledger capacity {capacity} exceeds {MAX_CAPACITY} superblocks: page ids are int32 in block tables"
            )));
        }
        let mut free = Vec::new();
        free.try_reserve_exact(capacity as usize).map_err(|_| {
            CoreError::config("capacity_superblocks", format!(
                "a ledger of {capacity} superblocks cannot be allocated (its free list needs {} bytes)",
                u64::from(capacity) * 4
            ))
        })?;
        free.extend((0..capacity).rev());
        Ok(Self {
            layout,
            capacity,
            free,
            requests: Slab::default(),
            vacant: Vec::new(),
            index: IdIndex::default(),
            last_decode_undos: LastDecodeUndos::default(),
            scratch: Scratch::default(),
            cache: None,
        })
    }

    /// Turns prefix caching on (see `prefix_cache.rs`); only before any request is held.
    pub fn enable_prefix_cache(&mut self) -> Result<()> {
        if self.used_superblocks() > 0 || self.cache.is_some() {
            return Err(CoreError::InvalidState(
                "prefix caching is turned on before a ledger holds anything, once".into(),
            ));
        }
        self.cache = Some(Box::new(PrefixCache::new(self.capacity)));
        Ok(())
    }

    /// The prefix cache, if enabled.
    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.cache.as_deref()
    }

    /// Superblocks on the free list (held by no table and caching nothing).
    pub(crate) fn free_list_len(&self) -> u32 {
        superblock_count(self.free.len())
    }

    /// Superblocks `id` alone holds: what a recompute-pause or suspend of it frees (with
    /// the prefix cache, a superblock another table names stays).
    pub fn exclusive_superblocks(&self, id: RequestId) -> Result<u32> {
        let table = self.request(id)?.table();
        Ok(match &self.cache {
            None => superblock_count(table.len()),
            Some(cache) => superblock_count(table.iter().filter(|&&p| cache.refs(p) == 1).count()),
        })
    }

    /// Whether another table names one of `id`'s superblocks.
    pub fn shares_superblocks(&self, id: RequestId) -> Result<bool> {
        let table = self.request(id)?.table();
        Ok(self
            .cache
            .as_ref()
            .is_some_and(|cache| table.iter().any(|&p| cache.refs(p) > 1)))
    }

    /// Gives request `id`, which holds nothing, the cached `pages` (a prefix hit): its
    /// table names them and its length is their tokens.
    pub fn attach_cached(&mut self, id: RequestId, pages: &[SuperblockId]) -> Result<()> {
        self.attach_prefix(id, pages, false)
    }

    /// [`Self::attach_cached`] for a prefix hit of the scheduler's that may also name
    /// superblocks another table holds unkeyed: those an earlier entry of the step being
    /// scheduled computes (same-step sharing). Each page is either cached (keyed) or held
    /// by another table; nothing keys the written ones (the update that ran the step does).
    pub(crate) fn attach_shared(&mut self, id: RequestId, pages: &[SuperblockId]) -> Result<()> {
        self.attach_prefix(id, pages, true)
    }

    fn attach_prefix(
        &mut self,
        id: RequestId,
        pages: &[SuperblockId],
        written_too: bool,
    ) -> Result<()> {
        let entry = self.active_entry_of(id)?;
        let Some(cache) = self.cache.as_mut() else {
            return Err(CoreError::InvalidState("prefix caching is off".into()));
        };
        let (record, table) = (
            &mut self.requests.records[entry],
            &mut self.requests.tables[entry],
        );
        if record.held != 0 || record.len != 0 {
            return Err(CoreError::InvalidState(format!(
                "request {id} holds KV already; cached superblocks attach to an empty table"
            )));
        }
        let attachable =
            |p: SuperblockId| cache.key_of(p).is_some() || (written_too && cache.refs(p) > 0);
        if let Some(&page) = pages.iter().find(|&&p| !attachable(p)) {
            return Err(CoreError::InvalidArgument(format!(
                "superblock {page} caches no prefix"
            )));
        }
        if let Some(repeated) = first_repeat(pages) {
            return Err(CoreError::InvalidArgument(format!(
                "superblock {repeated} appears twice in one table"
            )));
        }
        for &page in pages {
            cache.share(page);
        }
        table.push_pages(&mut record.held, pages.iter().copied());
        record.len = pages.len() as u64 * self.layout.tokens_per_superblock();
        Ok(())
    }

    /// Registers the first `keys.len()` superblocks of `id`'s table under those keys (a
    /// superblock already registered, or a key another superblock has, is left as is; so
    /// is a superblock a pending step copies KV into, whose content is not known yet).
    pub fn register_prefix(&mut self, id: RequestId, keys: &[BlockKey]) -> Result<()> {
        let table = self.request(id)?.table();
        if keys.len() > table.len() {
            return Err(CoreError::InvalidLength(format!(
                "request {id} holds {} superblocks, fewer than the {} keys given",
                table.len(),
                keys.len()
            )));
        }
        let entry = self.entry_of(id)?;
        if let Some(cache) = self.cache.as_mut() {
            let table = self.requests.tables[entry].pages(self.requests.records[entry].held);
            for (&page, &key) in table.iter().zip(keys) {
                cache.register(page, key);
            }
        }
        Ok(())
    }

    /// Moves the evictions made since the last call into `out` (oldest first).
    pub(crate) fn take_evictions(&mut self, out: &mut Vec<Eviction>) {
        if let Some(cache) = self.cache.as_mut() {
            cache.take_evictions(out);
        }
    }

    /// The evictions of a step that ran (its update): their keys are gone for good.
    pub(crate) fn forget_evictions(&mut self, evictions: &[Eviction]) {
        if let Some(cache) = self.cache.as_mut() {
            cache.forget_evictions(evictions);
        }
    }

    /// Puts back what `evictions` (a reverted step's, oldest first) took out of the cache,
    /// newest first: each page leaves the free list and is cached again. Except a page in
    /// `overwritten` (one a reverted copy-in may have overwritten, see
    /// [`Self::set_copy_in`]): it holds neither the evicted prefix for sure nor anything
    /// keyed, so its key is forgotten, as if the step had run, and the page stays free.
    pub(crate) fn restore_evictions(
        &mut self,
        evictions: &[Eviction],
        overwritten: &[SuperblockId],
    ) {
        let Some(cache) = self.cache.as_mut() else {
            return;
        };
        for &eviction in evictions.iter().rev() {
            let Some(at) = self.free.iter().rposition(|&p| p == eviction.page) else {
                debug_assert!(false, "an undone step's evicted page is free again");
                continue;
            };
            if overwritten.contains(&eviction.page) {
                cache.forget_evictions(&[eviction]);
            } else if cache.restore(eviction) {
                self.free.remove(at);
            }
        }
    }

    /// With the prefix cache: a pending step copies KV into `pages` from the host tier
    /// (`on`, as it resumes a request onto them), or that step closed (`!on`: updated or
    /// reverted, after its evictions were settled). While a copy-in is pending the page's
    /// content is not known, so it is never registered (keyed); a reverted step does not
    /// put back a prefix evicted from it (`restore_evictions`).
    pub(crate) fn set_copy_in(&mut self, pages: &[SuperblockId], on: bool) {
        if let Some(cache) = self.cache.as_mut() {
            for &page in pages {
                cache.set_copy_in(page, on);
            }
        }
    }

    /// While `on`, pages released go back to the cache at the stamps they had (undoing a
    /// step's hits) rather than as newly released.
    pub(crate) fn set_restoring(&mut self, on: bool) {
        if let Some(cache) = self.cache.as_mut() {
            cache.set_restoring(on);
        }
    }

    /// Gives back everything of `id` past `new_len` as the undo of this step's work (its
    /// hits go back to their places in the eviction order).
    pub(crate) fn shrink_restoring(&mut self, id: RequestId, new_len: u64) -> Result<()> {
        self.set_restoring(true);
        let shrunk = self.shrink(id, new_len);
        self.set_restoring(false);
        shrunk
    }

    /// Drops every cached superblock no request references (they join the free list, least
    /// recently released first). Returns how many.
    pub fn reset_prefix_cache(&mut self) -> u32 {
        match self.cache.as_mut() {
            Some(cache) => cache.drop_unreferenced(&mut self.free),
            None => 0,
        }
    }

    /// A grow with the prefix cache: evicts what the free list lacks first (least recently
    /// released first), then grows as without; `false` (and nothing evicted) if the free
    /// list and the cache together are short.
    #[cold]
    fn grow_entry_cached(&mut self, entry: EntryIndex, new_len: u64) -> bool {
        let cache = self.cache.as_mut().expect("called with the cache on");
        let (record, table) = (
            &mut self.requests.records[entry],
            &mut self.requests.tables[entry],
        );
        let held = record.held as usize;
        if new_len > held as u64 * self.layout.tokens_per_superblock() {
            let extra = superblocks_needed(self.layout, new_len).saturating_sub(held);
            if extra > self.free.len() + cache.evictable_len() as usize {
                return false;
            }
            while self.free.len() < extra {
                let page = cache.evict_one().expect("counted above");
                self.free.push(page);
            }
        }
        let grown = grow_record(record, table, &mut self.free, self.layout, new_len);
        debug_assert!(grown);
        for &page in &table.pages(record.held)[held..] {
            cache.take_fresh(page);
        }
        grown
    }

    /// After a step's reservations were undone: moves the pages the undo gave back (the top
    /// of the free list, above `free_before_undo`) down to depth `free_after_step` (the
    /// free list's length once the step had taken them), below the pages freed since by
    /// others (the update of an older step, one step ahead). The free list is then as if
    /// the step had never taken its pages, so a revert restores it exactly. Nothing moves
    /// when nothing was freed meanwhile (the usual case), or for depths that do not
    /// describe the list (a step whose victims freed pages).
    pub(crate) fn sink_returned_pages(&mut self, free_after_step: u32, free_before_undo: u32) {
        let (at, from) = (free_after_step as usize, free_before_undo as usize);
        if at < from && from <= self.free.len() {
            let returned = self.free.len() - from;
            self.free[at..].rotate_right(returned);
        }
    }

    /// The token placement the ledger serves.
    pub fn layout(&self) -> Layout {
        self.layout
    }
    /// Total superblocks.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }
    /// Global tokens the whole pool can hold.
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.capacity) * self.layout.tokens_per_superblock()
    }
    /// Superblocks not held by any request: the free list, and with the prefix cache the
    /// cached superblocks nobody references (an allocation evicts them on demand).
    pub fn free_superblocks(&self) -> u32 {
        let cached = self.cache.as_ref().map_or(0, |cache| cache.evictable_len());
        superblock_count(self.free.len()) + cached
    }
    /// Superblocks held by requests.
    pub fn used_superblocks(&self) -> u32 {
        self.capacity - self.free_superblocks()
    }
    /// Live requests.
    pub fn num_requests(&self) -> usize {
        self.index.len()
    }
    /// Whether `id` is held.
    pub fn contains(&self, id: RequestId) -> bool {
        self.index.get(id).is_some()
    }
    /// Whether `n` more superblocks could be handed out now.
    pub fn can_allocate(&self, n: u64) -> bool {
        n <= self.free.len() as u64
    }

    /// The entry that holds `id`; stable while the request is held. The scheduler keeps
    /// it to skip the id lookup on its per-step decode path.
    pub(crate) fn entry_of(&self, id: RequestId) -> Result<EntryIndex> {
        self.index.get(id).ok_or(CoreError::UnknownRequest(id))
    }

    /// The holdings of `id`, looked for at `entry` first (a hint: the scheduler's own index
    /// of the request, which is its ledger entry). The hint is taken only where that entry
    /// holds `id` with tokens reserved (a vacant entry holds none, whatever its id says);
    /// otherwise `id` is looked up, so a stale or wrong hint costs a lookup, never a wrong
    /// answer.
    pub(crate) fn request_hinted(&self, entry: EntryIndex, id: RequestId) -> Result<RequestKv<'_>> {
        match self.request_at(entry, id) {
            Some(request) => {
                debug_assert_eq!(self.index.get(id), Some(entry));
                Ok(request)
            }
            None => self.request(id),
        }
    }

    /// The holdings of `id` where the hint `entry` holds it with tokens reserved (the case
    /// [`Self::request_hinted`] takes without a lookup), else `None`: for a caller whose
    /// loop keeps the lookup out of line.
    pub(crate) fn request_at(&self, entry: EntryIndex, id: RequestId) -> Option<RequestKv<'_>> {
        let Slab { records, tables } = &self.requests;
        // The same length: past the record's check, the table's is known to pass.
        let tables = &tables[..records.len()];
        let record = records.get(entry)?;
        (record.id == id && record.len > 0).then(|| RequestKv {
            record,
            table: &tables[entry],
        })
    }

    /// The id, reserved tokens and superblocks held of the request at `entry` (whatever it
    /// holds, a vacant entry included; `None` past the slab), read from its record alone:
    /// for a caller that checks a row against its hint without a branch per check.
    #[inline]
    pub(crate) fn holding_at(&self, entry: EntryIndex) -> Option<(RequestId, u64, u32)> {
        let record = self.requests.records.get(entry)?;
        Some((record.id, record.len, record.held))
    }

    /// Writes the superblock table held at `entry` (whatever request it holds; none past
    /// the slab) into the block-table row `cells` as int32 page ids, `pad` in the cells past
    /// it, and returns the table: for a caller that checked the request there
    /// ([`Self::holding_at`]) and that the table fits `cells` (what does not fit is not
    /// written). `pad` is passed in (the caller's -1, hidden from the optimizer) so a
    /// row's padding cells are stored inline rather than by a `memset` call each.
    #[expect(
        clippy::inline_always,
        reason = "measured: inlined into the decode-row loop, no call per row"
    )]
    #[inline(always)]
    pub(crate) fn write_table_row_at(
        &self,
        entry: EntryIndex,
        cells: &mut [i32],
        pad: i32,
    ) -> &[SuperblockId] {
        let Slab { records, tables } = &self.requests;
        let (Some(record), Some(table)) = (records.get(entry), tables.get(entry)) else {
            return write_table_cells(cells, &[], pad);
        };
        let held = record.held as usize;
        if held > INLINE_SUPERBLOCKS || cells.len() < INLINE_SUPERBLOCKS {
            return write_table_cells(cells, table.pages(record.held), pad);
        }
        // Padding first, eight cells a store (the last one ending at the row's end), then
        // the inline cells over the first eight: held ones kept by a mask read from a
        // table (a comparison per lane becomes a branch each).
        pad_cells(&mut cells[INLINE_SUPERBLOCKS..], pad);
        let keep = &HELD_LANES[held];
        let mut inline = [0i32; INLINE_SUPERBLOCKS];
        for ((cell, &superblock), &keep) in inline.iter_mut().zip(&table.inline).zip(keep) {
            *cell = (page_id_bits(superblock) & keep) | (pad & !keep);
        }
        cells[..INLINE_SUPERBLOCKS].copy_from_slice(&inline);
        &table.inline[..held]
    }

    /// [`Self::active_entry_of`], taking `hint` without a lookup where it holds `id`.
    #[inline]
    fn active_entry_hinted(&self, hint: EntryIndex, id: RequestId) -> Result<EntryIndex> {
        match self.requests.records.get(hint) {
            Some(record) if record.id == id && record.len > 0 && !record.is_suspended() => Ok(hint),
            _ => self.active_entry_of(id),
        }
    }

    fn active_entry_of(&self, id: RequestId) -> Result<EntryIndex> {
        let entry = self.entry_of(id)?;
        if self.requests.records[entry].is_suspended() {
            return Err(CoreError::InvalidState(format!(
                "request {id} is suspended; resume it first"
            )));
        }
        Ok(entry)
    }

    /// The request's holdings.
    pub fn request(&self, id: RequestId) -> Result<RequestKv<'_>> {
        Ok(self.requests.view(self.entry_of(id)?))
    }

    /// Holdings as `(id, superblocks)`, sorted by id.
    pub fn holdings(&self) -> Vec<(RequestId, u32)> {
        let mut out: Vec<_> = self
            .index
            .entries()
            .map(|entry| {
                let record = &self.requests.records[entry];
                (record.id, record.held)
            })
            .collect();
        out.sort_unstable();
        out
    }

    fn check_prompt_len(&self, id: RequestId, prompt_len: u64) -> Result<()> {
        if prompt_len == 0 {
            return Err(CoreError::InvalidLength(format!(
                "request {id} has an empty prompt; a prompt holds at least one token"
            )));
        }
        self.check_len(prompt_len)
    }

    fn check_len(&self, len: u64) -> Result<()> {
        if len > self.capacity_tokens() {
            return Err(CoreError::InvalidLength(format!(
                "{len} tokens exceed the whole pool ({} tokens in {} superblocks)",
                self.capacity_tokens(),
                self.capacity
            )));
        }
        Ok(())
    }

    /// Starts tracking request `id` with a prompt of `prompt_len >= 1` tokens; it holds
    /// nothing yet.
    pub fn add(&mut self, id: RequestId, prompt_len: u64) -> Result<()> {
        if self.contains(id) {
            return Err(CoreError::DuplicateRequest(id));
        }
        self.check_prompt_len(id, prompt_len)?;
        self.insert_checked(id, prompt_len);
        Ok(())
    }

    /// Inserts a request whose id and length were validated.
    #[inline]
    fn insert_checked(&mut self, id: RequestId, prompt_len: u64) {
        let entry = if let Some(entry) = self.vacant.pop() {
            let kv = &mut self.requests.records[entry];
            // A vacant entry is canonical (see `vacate`) but for its id and prompt.
            kv.id = id;
            kv.prompt_len = prompt_len;
            entry
        } else {
            self.requests.push(id, prompt_len)
        };
        self.index.insert(id, entry);
    }

    /// Batch `add`; validated whole (no repeated or held id, lengths in range) first.
    pub fn add_many(&mut self, ids: &[RequestId], prompt_lens: &[u64]) -> Result<()> {
        if ids.len() != prompt_lens.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} ids but {} prompt lengths",
                ids.len(),
                prompt_lens.len()
            )));
        }
        if let Some(repeated) = first_repeat(ids) {
            return Err(CoreError::InvalidArgument(format!(
                "request {repeated} appears twice in one batch"
            )));
        }
        for (&id, &len) in ids.iter().zip(prompt_lens) {
            if self.contains(id) {
                return Err(CoreError::DuplicateRequest(id));
            }
            self.check_prompt_len(id, len)?;
        }
        for (&id, &len) in ids.iter().zip(prompt_lens) {
            self.insert_checked(id, len);
        }
        Ok(())
    }

    fn check_grow(&self, id: RequestId, new_len: u64) -> Result<EntryIndex> {
        let entry = self.active_entry_of(id)?;
        self.check_grow_entry(entry, new_len)?;
        Ok(entry)
    }

    #[expect(
        clippy::inline_always,
        reason = "measured: inlined into `grow_many`'s validation pass it saves ~1 ns a request"
    )]
    #[inline(always)]
    fn check_grow_entry(&self, entry: EntryIndex, new_len: u64) -> Result<()> {
        let request = &self.requests.records[entry];
        if request.is_suspended() {
            return Err(CoreError::InvalidState(format!(
                "request {} is suspended; resume it first",
                request.id
            )));
        }
        self.check_len(new_len)?;
        if new_len < request.len {
            return Err(CoreError::InvalidLength(format!(
                "grow of request {} to {new_len} tokens is below its {} tokens; use shrink",
                request.id, request.len
            )));
        }
        Ok(())
    }

    /// Applies a validated grow; `false` (and no change) if the pool is short.
    #[expect(
        clippy::inline_always,
        reason = "measured: inlined into `grow_many` it saves ~1 ns a request"
    )]
    #[inline(always)]
    fn grow_entry(&mut self, entry: EntryIndex, new_len: u64) -> bool {
        if self.cache.is_some() {
            // The usual grow (a decode token inside the last superblock) takes no page, so
            // it evicts nothing: settled here, not in the cold path.
            let record = &mut self.requests.records[entry];
            if new_len <= u64::from(record.held) * self.layout.tokens_per_superblock() {
                record.len = new_len;
                return true;
            }
            return self.grow_entry_cached(entry, new_len);
        }
        grow_record(
            &mut self.requests.records[entry],
            &mut self.requests.tables[entry],
            &mut self.free,
            self.layout,
            new_len,
        )
    }

    /// Reserves room for `new_len` global tokens. Returns `false` and changes nothing if
    /// the pool cannot supply every superblock needed.
    pub fn grow(&mut self, id: RequestId, new_len: u64) -> Result<bool> {
        let entry = self.check_grow(id, new_len)?;
        Ok(self.grow_entry(entry, new_len))
    }

    #[inline]
    fn shrink_entry(&mut self, entry: EntryIndex, new_len: u64) {
        // `new_len` is at most the reserved length, so within the pool.
        let keep = if new_len == 0 {
            0 // free, recompute-pause, suspend
        } else {
            superblocks_needed(self.layout, new_len)
        };
        let (record, table) = (
            &mut self.requests.records[entry],
            &mut self.requests.tables[entry],
        );
        if let Some(released) = table.pages(record.held).get(keep..) {
            if let Some(cache) = self.cache.as_mut() {
                // The same order as below: the last superblock is released first, so it
                // is also evicted first.
                for &page in released.iter().rev() {
                    if cache.release(page) {
                        self.free.push(page);
                    }
                }
            } else if let [only] = released {
                self.free.push(*only);
            } else {
                self.free.extend(released.iter().rev());
            }
            table.truncate_pages(&mut record.held, keep);
        }
        record.len = new_len;
    }

    /// Gives back everything past `new_len` global tokens.
    pub fn shrink(&mut self, id: RequestId, new_len: u64) -> Result<()> {
        let entry = self.active_entry_of(id)?;
        let current = self.requests.records[entry].len;
        if new_len > current {
            return Err(CoreError::InvalidLength(format!(
                "shrink of request {id} to {new_len} tokens is above its {current} tokens; use grow"
            )));
        }
        self.shrink_entry(entry, new_len);
        Ok(())
    }

    fn remove_entry(&mut self, entry: EntryIndex) {
        self.shrink_entry(entry, 0);
        self.index.remove(self.requests.records[entry].id);
        self.vacate(entry);
    }

    /// Makes an emptied slab entry reusable (its table keeps its capacity).
    #[inline]
    fn vacate(&mut self, entry: EntryIndex) {
        let kv = &mut self.requests.records[entry];
        debug_assert!(
            kv.held == 0 && self.requests.tables[entry].spill.is_empty() && kv.len == 0,
            "emptied first"
        );
        Self::clear_vacated(kv);
        self.last_decode_undos.clear(entry);
        self.vacant.push(entry);
    }

    /// Canonical contents for an emptied entry, so equality never depends on what a
    /// vacant entry once held (what the cleared flags and `held` mask is never read).
    #[inline]
    fn clear_vacated(kv: &mut KvRecord) {
        kv.id = 0;
        kv.prompt_len = 0;
        kv.decode_count = 0;
        kv.flags = 0;
    }

    /// Frees every superblock of `id` and forgets it.
    pub fn free(&mut self, id: RequestId) -> Result<()> {
        let entry = self.entry_of(id)?;
        self.remove_entry(entry);
        Ok(())
    }

    /// The entries of `ids`, refusing unknown ids and ids repeated within the batch.
    fn unique_entries(&self, ids: &[RequestId]) -> Result<Vec<EntryIndex>> {
        let mut seen = vec![false; self.requests.len()];
        let mut entries = Vec::with_capacity(ids.len());
        for &id in ids {
            let entry = self.entry_of(id)?;
            if std::mem::replace(&mut seen[entry], true) {
                return Err(CoreError::InvalidArgument(format!(
                    "request {id} appears twice in one batch"
                )));
            }
            entries.push(entry);
        }
        Ok(entries)
    }

    /// Batch grow: `ok[i]` says whether `ids[i]` reached `new_lens[i]`. The whole batch is
    /// validated before anything is applied; ids are applied in order, each all or
    /// nothing.
    pub fn grow_many(
        &mut self,
        ids: &[RequestId],
        new_lens: &[u64],
        ok: &mut Vec<bool>,
    ) -> Result<()> {
        if ids.len() != new_lens.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} ids but {} lengths",
                ids.len(),
                new_lens.len()
            )));
        }
        // One validation pass (lookup, repeat, suspension, range) that keeps the entries,
        // then the grows. A refused batch reports what the plain checks, in their order,
        // find first.
        let mut entries = std::mem::take(&mut self.scratch.entries);
        entries.clear();
        let stamp = self.scratch.next_stamp(self.requests.len());
        let capacity_tokens = self.capacity_tokens();
        let mut valid = true;
        for (&id, &len) in ids.iter().zip(new_lens) {
            let Some(entry) = self.index.get(id) else {
                valid = false;
                break;
            };
            let request = &self.requests.records[entry];
            if request.flags & SUSPENDED != 0
                || len < request.len
                || len > capacity_tokens
                || std::mem::replace(&mut self.scratch.stamps[entry], stamp) == stamp
            {
                valid = false;
                break;
            }
            entries.push(entry);
        }
        if !valid {
            self.scratch.entries = entries;
            return Err(self.grow_many_error(ids, new_lens));
        }
        if self.cache.is_some() {
            // Each grow may evict: the one-at-a-time path.
            ok.clear();
            for (&entry, &len) in entries.iter().zip(new_lens) {
                ok.push(self.grow_entry(entry, len));
            }
            self.scratch.entries = entries;
            return Ok(());
        }
        // The grows, with the free list in a local (its length stays in a register). The
        // usual ones (within what is held, or a table that stays in the record) are
        // settled here; `grow_record` takes the rest, with the same result.
        let layout = self.layout;
        let Slab { records, tables } = &mut self.requests;
        // The same length: past the record's bounds check, the table's is known to pass.
        let tables = &mut tables[..records.len()];
        let tokens_per_superblock = layout.tokens_per_superblock();
        let mut free = std::mem::take(&mut self.free);
        ok.clear();
        ok.extend(entries.iter().zip(new_lens).map(|(&entry, &len)| {
            let request = &mut records[entry];
            let held = request.held as usize;
            let room = held as u64 * tokens_per_superblock;
            if len <= room {
                request.len = len;
                return true;
            }
            let needed = superblocks_needed(layout, len);
            if needed <= INLINE_SUPERBLOCKS {
                // `len` is past what is held, so `needed > held`.
                let Some(split) = free.len().checked_sub(needed - held) else {
                    return false;
                };
                // The top of the stack, last first; one superblock, the usual grow, is a
                // plain move.
                let inline = &mut tables[entry].inline;
                if needed - held == 1 {
                    inline[held] = free[split];
                } else {
                    for (slot, &page) in inline[held..needed]
                        .iter_mut()
                        .zip(free[split..].iter().rev())
                    {
                        *slot = page;
                    }
                }
                free.truncate(split);
                request.held = superblock_count(needed);
                request.len = len;
                return true;
            }
            grow_record_cold(request, &mut tables[entry], &mut free, layout, len)
        }));
        self.free = free;
        self.scratch.entries = entries;
        Ok(())
    }

    /// The error of a `grow_many` batch that failed validation: the first unknown or
    /// repeated id, else the first refused grow.
    #[cold]
    fn grow_many_error(&self, ids: &[RequestId], new_lens: &[u64]) -> CoreError {
        match self.unique_entries(ids) {
            Err(err) => err,
            Ok(entries) => entries
                .into_iter()
                .zip(new_lens)
                .find_map(|(entry, &len)| self.check_grow_entry(entry, len).err())
                .expect("a batch that failed validation has an id or a grow to refuse"),
        }
    }

    /// Batch free; validated whole before anything is freed.
    pub fn free_many(&mut self, ids: &[RequestId]) -> Result<()> {
        // One index probe per id: each is taken out of the index straight away. An
        // unknown or repeated id puts back every one taken (the index is looked up,
        // never iterated, so that leaves no trace) and reports what validation finds.
        let mut entries = std::mem::take(&mut self.scratch.entries);
        entries.clear();
        if !self.index.remove_many(ids, &mut entries) {
            for (&id, &entry) in ids.iter().zip(&entries) {
                self.index.insert(id, entry);
            }
            self.scratch.entries = entries;
            return Err(self
                .unique_entries(ids)
                .expect_err("a batch with an unknown or repeated id fails validation"));
        }
        if self.cache.is_some() {
            for &entry in &entries {
                self.shrink_entry(entry, 0);
                Self::clear_vacated(&mut self.requests.records[entry]);
                self.last_decode_undos.clear(entry);
            }
            self.vacant.extend_from_slice(&entries);
            self.scratch.entries = entries;
            return Ok(());
        }
        // `release_entry` of each entry in turn, with the free list and the vacant stack
        // held in locals (their lengths stay in registers, not in the ledger) and the
        // entries made vacant in one copy at the end (the same stack order).
        let mut free = std::mem::take(&mut self.free);
        let Slab { records, tables } = &mut self.requests;
        // The same length: past the record's bounds check, the table's is known to pass.
        let tables = &mut tables[..records.len()];
        for &entry in &entries {
            let (request, table) = (&mut records[entry], &mut tables[entry]);
            let held = request.held as usize;
            if held == 1 {
                free.push(table.inline[0]);
            } else if held <= INLINE_SUPERBLOCKS {
                free.extend(table.inline[..held].iter().rev());
            } else {
                free.extend(table.spill.iter().rev());
                table.spill.clear();
            }
            request.held = 0;
            request.len = 0;
            Self::clear_vacated(request);
        }
        self.free = free;
        if !self.last_decode_undos.0.is_empty() {
            for &entry in &entries {
                self.last_decode_undos.clear(entry);
            }
        }
        self.vacant.extend_from_slice(&entries);
        self.scratch.entries = entries;
        Ok(())
    }

    /// Reserves the next decode token of `id` in scheduler step `step` and returns its
    /// global position, or `None` (nothing changed) if the pool is short. The decode
    /// counter advances only here; a retry in the same step returns the same position.
    pub fn allocate_decode(&mut self, id: RequestId, step: u64) -> Result<Option<u64>> {
        let entry = self.active_entry_of(id)?;
        self.allocate_decode_in(entry, step)
    }

    /// A scheduler step's decode grow of `id` (at `entry`, a hint: the scheduler's own
    /// index of the request, looked up where it does not hold `id`): reserves its next
    /// decode token and returns the token's position with the grow's exact inverse, for
    /// the step's record to keep and hand back to [`Self::undo_decode`] if the step is
    /// reverted; `None` (nothing changed) if the pool is short. The step marker becomes
    /// `step`; a step decodes a request once (a second decode of it in `step` is an
    /// error, not the retry [`Self::allocate_decode`] answers).
    pub(crate) fn decode_at(
        &mut self,
        entry: EntryIndex,
        id: RequestId,
        step: u64,
    ) -> Result<Option<(u64, DecodeInverse)>> {
        let entry = match self.requests.records.get(entry) {
            Some(request) if request.id == id && !request.is_suspended() => {
                debug_assert_eq!(self.index.get(id), Some(entry));
                entry
            }
            _ => self.active_entry_of(id)?,
        };
        if self.requests.records[entry].decode_step() == Some(step) {
            return Err(CoreError::InvalidState(format!(
                "request {id} is decoded twice in step {step}"
            )));
        }
        check_inverse_step(step)?;
        Ok(self.decode_grow(entry, step)?.map(|(pos, undo)| {
            (
                pos,
                DecodeInverse::new(
                    u8::from(undo.step_before.is_some()),
                    undo.step_before.unwrap_or(0),
                    undo.grew,
                ),
            )
        }))
    }

    /// Undoes the decode grow of `id` in `step` whose inverse [`Self::decode_at`] (or
    /// [`DecodeLane::try_decode_in_place`]) returned, the newest of its decodes not undone
    /// yet: the decode counter and step marker go back, and the length too unless a `grow`
    /// or `shrink` changed it since (that call owns it: restoring the old length could
    /// raise it past the superblocks a shrink gave back, or drop a grow). Nothing changes
    /// where `id` holds no decode of `step` (a preemption reset it since).
    pub(crate) fn undo_decode(
        &mut self,
        id: RequestId,
        step: u64,
        inverse: DecodeInverse,
    ) -> Result<()> {
        let entry = self.active_entry_of(id)?;
        if self.requests.records[entry].decode_step() == Some(step) {
            self.undo_newest_decode(entry, inverse.step_before(), inverse.grew());
        }
        Ok(())
    }

    /// Undoes the newest decode grow of the request at `entry` (its step marker is still
    /// the grow's step), which replaced the marker `step_before` and added its token to
    /// the length when `grew`: its token sat at `prompt_len + decode_count - 1` (the last
    /// decode counted), so the grow left the length one past it, and gave it back unless a
    /// `grow` or `shrink` changed it since (that call owns it: restoring the old length
    /// could raise it past the superblocks a shrink gave back, or drop a grow).
    fn undo_newest_decode(&mut self, entry: EntryIndex, step_before: Option<u64>, grew: bool) {
        let request = &mut self.requests.records[entry];
        request.decode_count -= 1;
        request.set_decode_step(step_before);
        let pos = request.next_decode_position();
        if grew && request.len == pos + 1 {
            self.shrink_entry(entry, pos);
        }
    }

    /// The records and what the per-step decode loop needs of the ledger, apart, so the
    /// loop keeps them in registers (see [`DecodeLane`]).
    pub(crate) fn decode_lane(&mut self) -> DecodeLane<'_> {
        DecodeLane {
            requests: &mut self.requests.records,
            tokens_per_superblock: self.layout.tokens_per_superblock(),
        }
    }

    fn allocate_decode_in(&mut self, entry: EntryIndex, step: u64) -> Result<Option<u64>> {
        let request = &self.requests.records[entry];
        let id = request.id;
        if request.decode_step() == Some(step) {
            let pos = request.next_decode_position() - 1;
            if pos >= request.len {
                // A shrink since the allocation gave the token back: the retry cannot
                // hand out a position that is no longer reserved.
                return Err(CoreError::InvalidState(format!(
                    "request {id}'s decode token at position {pos} (step {step}) was given back by a shrink"
                )));
            }
            return Ok(Some(pos));
        }
        let Some((pos, undo)) = self.decode_grow(entry, step)? else {
            return Ok(None);
        };
        self.last_decode_undos.set(entry, undo);
        Ok(Some(pos))
    }

    /// The decode grow of the request at `entry` in `step` (not decoded in `step` yet):
    /// its next decode token's position and what undoes the grow, or `None` (nothing
    /// changed) if the pool is short.
    fn decode_grow(
        &mut self,
        entry: EntryIndex,
        step: u64,
    ) -> Result<Option<(u64, BareDecodeUndo)>> {
        let request = &self.requests.records[entry];
        let id = request.id;
        let pos = request.next_decode_position();
        if request.len < pos {
            return Err(CoreError::InvalidState(format!(
                "request {id} has {} of its {} prompt tokens reserved; its prefill must be allocated before decode",
                request.len, request.prompt_len
            )));
        }
        let len_before = request.len;
        let new_len = len_before.max(pos + 1);
        // The common case, every decode token but one per superblock: the token fits
        // the superblocks already held (so also the pool), nothing to hand out.
        let held_tokens = u64::from(request.held) * self.layout.tokens_per_superblock();
        if new_len > held_tokens {
            self.check_len(pos + 1)?;
            if !self.grow_entry(entry, new_len) {
                return Ok(None);
            }
        }
        let request = &mut self.requests.records[entry];
        let undo = BareDecodeUndo {
            step_before: request.decode_step(),
            grew: new_len != len_before,
        };
        request.len = new_len;
        request.decode_count += 1;
        request.set_decode_step(Some(step));
        Ok(Some((pos, undo)))
    }

    /// Reserves `drafts` speculative positions right after the decode token `id` was
    /// allocated in `step` (so the step verifies `1 + drafts` query tokens for it) and
    /// returns the first draft's position, or `None` (nothing changed) when the free list
    /// lacks the superblocks they reach. Drafts never evict cached superblocks: they are the
    /// first thing to give way under pressure. The record's decode undo is left as the
    /// decode token made it; the caller keeps `len` from before the call and gives it back
    /// to [`Ledger::retract_drafts`] (rejected drafts at `update`, or all of them at a
    /// revert, before the decode token itself is reverted).
    pub fn extend_decode(&mut self, id: RequestId, step: u64, drafts: u64) -> Result<Option<u64>> {
        self.extend_decode_at(EntryIndex::MAX, id, step, drafts)
    }

    /// [`Self::extend_decode`] with `hint`, where the caller expects `id`'s entry (the
    /// scheduler's own index of the request): no lookup when it holds `id`.
    pub(crate) fn extend_decode_at(
        &mut self,
        hint: EntryIndex,
        id: RequestId,
        step: u64,
        drafts: u64,
    ) -> Result<Option<u64>> {
        let (entry, first) = self.draft_start(hint, id, step)?;
        let end = first
            .checked_add(drafts)
            .ok_or_else(|| CoreError::InvalidLength(format!("{drafts} drafts overflow")))?;
        self.check_len(end)?;
        // All of them or none: the free list must hold the superblocks `end` reaches.
        if end > self.draft_reach(entry) {
            return Ok(None);
        }
        self.take_drafts(entry, first, drafts);
        Ok(Some(first))
    }

    /// As many of `most` speculative positions after `id`'s decode in `step` as the free
    /// list has room for (see [`Self::extend_decode`]; `hint` as in
    /// [`Self::extend_decode_at`]), found at once: the most a step's drafts may take.
    pub(crate) fn extend_decode_most(
        &mut self,
        hint: EntryIndex,
        id: RequestId,
        step: u64,
        most: u64,
    ) -> Result<DraftExtension> {
        let (entry, first) = self.draft_start(hint, id, step)?;
        let count = most.min(self.draft_reach(entry).saturating_sub(first));
        if count == 0 {
            return Ok(DraftExtension::NONE);
        }
        Ok(self.take_drafts(entry, first, count))
    }

    /// The entry of `id` (`hint` as in [`Self::extend_decode_at`]) and the position of its
    /// first draft, where `id` has a decode token allocated in `step`: drafts follow it.
    #[inline]
    fn draft_start(&self, hint: EntryIndex, id: RequestId, step: u64) -> Result<(EntryIndex, u64)> {
        let entry = self.active_entry_hinted(hint, id)?;
        let request = &self.requests.records[entry];
        if request.decode_step() != Some(step) {
            return Err(CoreError::InvalidState(format!(
                "request {id} has no decode token allocated in step {step}: drafts follow it"
            )));
        }
        Ok((entry, request.next_decode_position()))
    }

    /// The end of the positions the table of `entry` can reach with the free list alone,
    /// whatever its length: its superblocks plus the free list's.
    #[inline]
    fn draft_reach(&self, entry: EntryIndex) -> u64 {
        let held = u64::from(self.requests.records[entry].held);
        (held + self.free.len() as u64) * self.layout.tokens_per_superblock()
    }

    /// Takes the `count` draft positions from `first` for `entry`, within its
    /// [`Self::draft_reach`] (the caller checked): from the free list alone, so a grow with
    /// the prefix cache evicts nothing. What they took.
    #[inline]
    fn take_drafts(&mut self, entry: EntryIndex, first: u64, count: u64) -> DraftExtension {
        let request = &self.requests.records[entry];
        let (len_before, held) = (request.len, request.held);
        let new_len = len_before.max(first + count);
        if new_len > u64::from(held) * self.layout.tokens_per_superblock() {
            let grown = self.grow_entry(entry, new_len);
            debug_assert!(grown, "the free list has room for the drafts");
        }
        let request = &mut self.requests.records[entry];
        request.len = new_len;
        request.decode_count += count;
        DraftExtension {
            count,
            len_before,
            grown: request.held - held,
        }
    }

    /// Gives back the last `drafts` speculative positions of `id`'s decode in `step` (all
    /// of a reverted step's, or the rejected ones at `update`) and shrinks its length to
    /// `len_to` when it is longer (superblocks only those positions reached go back to the
    /// pool). `len_to` is the length before [`Ledger::extend_decode`], or for accepted drafts
    /// at least the positions kept.
    pub fn retract_drafts(
        &mut self,
        id: RequestId,
        step: u64,
        drafts: u64,
        len_to: u64,
    ) -> Result<()> {
        self.retract_drafts_at(EntryIndex::MAX, id, step, drafts, len_to)
            .map(|_| ())
    }

    /// [`Self::retract_drafts`] with `hint` (see [`Self::extend_decode_at`]); returns how
    /// many superblocks went back to the pool.
    pub(crate) fn retract_drafts_at(
        &mut self,
        hint: EntryIndex,
        id: RequestId,
        step: u64,
        drafts: u64,
        len_to: u64,
    ) -> Result<u32> {
        let entry = self.active_entry_hinted(hint, id)?;
        let request = &self.requests.records[entry];
        if request.decode_step() != Some(step) || drafts >= request.decode_count {
            return Err(CoreError::InvalidState(format!(
                "request {id} has no {drafts} drafts of step {step} to give back"
            )));
        }
        let kept_end = request.next_decode_position() - drafts;
        if len_to < kept_end {
            return Err(CoreError::InvalidLength(format!(
                "request {id} cannot shrink to {len_to} tokens: its positions up to {kept_end} are kept"
            )));
        }
        let request = &mut self.requests.records[entry];
        request.decode_count -= drafts;
        let held = request.held;
        if request.len > len_to {
            // Most retractions stay inside the last superblock: no table to touch (and no
            // division to find what is kept).
            let tps = self.layout.tokens_per_superblock();
            if len_to > u64::from(held.saturating_sub(1)) * tps {
                request.len = len_to;
                return Ok(0);
            }
            self.shrink_entry(entry, len_to);
        }
        Ok(held - self.requests.records[entry].held)
    }

    /// Undoes the decode allocation that `id` made in `step`, if any (a step that was
    /// scheduled but not run). Returns whether there was one. It is an exact undo: the
    /// length and the step marker return to what they were before the allocation (so
    /// `state_digest` does too). The latest allocation can be undone (a request keeps the
    /// undo of its last one); the scheduler, which may plan a step ahead of a pending one,
    /// keeps the inverse of each of its decodes in the step's record instead
    /// ([`Self::decode_at`], [`Self::undo_decode`]), so it can revert both steps in turn.
    ///
    /// If a `grow` or `shrink` changed the length since the allocation, that call owns
    /// the length and it is kept (only the counters go back): restoring the old length
    /// could raise it past the superblocks a shrink gave back, or drop a grow.
    pub fn revert_decode(&mut self, id: RequestId, step: u64) -> Result<bool> {
        let entry = self.active_entry_of(id)?;
        if self.requests.records[entry].decode_step() != Some(step) {
            return Ok(false);
        }
        let Some(undo) = self.last_decode_undos.get(entry) else {
            return Ok(false);
        };
        self.last_decode_undos.clear(entry);
        self.undo_newest_decode(entry, undo.step_before, undo.grew);
        Ok(true)
    }

    /// Recompute-pause: frees every superblock of `id`, folds `generated_tokens` sampled
    /// tokens into its prompt and resets the decode counter, so a re-prefill starts at
    /// position 0 and decoding resumes at the new prompt end.
    pub fn reset_for_recompute(&mut self, id: RequestId, generated_tokens: u64) -> Result<()> {
        let entry = self.entry_of(id)?;
        let request = &self.requests.records[entry];
        let limit = request.decode_count + 1;
        if generated_tokens > limit {
            return Err(CoreError::InvalidLength(format!(
                "request {id} cannot fold {generated_tokens} generated tokens: it decoded {} since its prefill",
                request.decode_count
            )));
        }
        let new_prompt = request.prompt_len + generated_tokens;
        self.check_len(new_prompt)?;
        self.shrink_entry(entry, 0);
        let request = &mut self.requests.records[entry];
        request.prompt_len = new_prompt;
        request.decode_count = 0;
        request.set_decode_step(None);
        request.flags &= !SUSPENDED;
        self.last_decode_undos.clear(entry);
        Ok(())
    }

    /// Suspends `id` to a lower tier: its superblocks return to the pool while its
    /// counters and length are kept for [`Ledger::resume`]. Returns the superblocks freed.
    pub fn suspend(&mut self, id: RequestId) -> Result<u32> {
        let entry = self.active_entry_of(id)?;
        let request = &self.requests.records[entry];
        let (len, held) = (request.len, request.held);
        self.shrink_entry(entry, 0);
        self.requests.tables[entry].suspended_len = len;
        let request = &mut self.requests.records[entry];
        request.flags |= SUSPENDED;
        request.set_decode_step(None);
        self.last_decode_undos.clear(entry);
        Ok(held)
    }

    /// Brings a suspended request back: reserves its length again. `false` (and still
    /// suspended) if the pool is short.
    pub fn resume(&mut self, id: RequestId) -> Result<bool> {
        let entry = self.entry_of(id)?;
        let Some(len) = self.requests.view(entry).suspended_len() else {
            return Err(CoreError::InvalidState(format!(
                "request {id} is not suspended"
            )));
        };
        if !self.grow_entry(entry, len) {
            return Ok(false);
        }
        self.requests.records[entry].flags &= !SUSPENDED;
        Ok(true)
    }

    /// What `rank` sees of `id`.
    pub fn view(&self, id: RequestId, rank: u32) -> Result<DecodeView> {
        self.layout.check_rank(rank)?;
        let request = self.request(id)?;
        let next = request.next_decode_position();
        let owner = self.layout.owner_rank(next);
        Ok(DecodeView {
            global_len: request.len(),
            next_position: next,
            owner_rank: owner,
            inactive: owner != rank,
            local_len: self.layout.local_len(request.len(), rank),
            past_seen_len: self.layout.local_len(next, rank),
        })
    }

    /// Widest table among `ids`.
    pub fn max_table_len(&self, ids: &[RequestId]) -> Result<usize> {
        ids.iter()
            .try_fold(0, |acc, &id| Ok(acc.max(self.request(id)?.table().len())))
    }

    /// Fills `out` (row-major, `ids.len() x width`) with the page tables of `ids`, padded
    /// with -1. Fails if a table is wider than `width`.
    pub fn block_table_into(&self, ids: &[RequestId], width: usize, out: &mut [i32]) -> Result<()> {
        if out.len() != ids.len() * width {
            return Err(CoreError::InvalidArgument(format!(
                "output holds {} entries, expected {} x {width}",
                out.len(),
                ids.len()
            )));
        }
        let entries = ids
            .iter()
            .map(|&id| self.entry_of(id))
            .collect::<Result<Vec<_>>>()?;
        for (i, entry) in entries.into_iter().enumerate() {
            let row = &mut out[i * width..(i + 1) * width];
            let request = self.requests.view(entry);
            let table = request.table();
            if table.len() > width {
                return Err(CoreError::InvalidArgument(format!(
                    "request {} holds {} superblocks, wider than the {width} columns asked for",
                    request.id(),
                    table.len()
                )));
            }
            for (dst, &page) in row.iter_mut().zip(table) {
                *dst = page_id(page);
            }
            row[table.len()..].fill(-1);
        }
        Ok(())
    }

    /// Appends to `out` this rank's KV slot for each new token of each request: request
    /// `ids[i]` writes tokens `starts[i] .. starts[i] + counts[i]`; -1 where another rank
    /// owns the token. Fails (and appends nothing) if a token is not reserved.
    pub fn slot_mapping_into(
        &self,
        ids: &[RequestId],
        starts: &[u64],
        counts: &[u64],
        rank: u32,
        out: &mut Vec<i64>,
    ) -> Result<()> {
        self.layout.check_rank(rank)?;
        if ids.len() != starts.len() || ids.len() != counts.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} ids, {} starts and {} counts must have the same length",
                ids.len(),
                starts.len(),
                counts.len()
            )));
        }
        let mut entries = Vec::with_capacity(ids.len());
        let mut total = 0u64;
        for ((&id, &start), &count) in ids.iter().zip(starts).zip(counts) {
            let entry = self.entry_of(id)?;
            let len = self.requests.records[entry].len;
            if start.checked_add(count).is_none_or(|end| end > len) {
                return Err(CoreError::InvalidLength(format!(
                    "tokens {start}..{start}+{count} of request {id} are not all reserved (it holds {len})"
                )));
            }
            // A request may be named many times: the sum can pass any length one holds.
            total = total.saturating_add(count);
            entries.push(entry);
        }
        reserve_exactly(out, total, "slot mapping")?;
        let layout = self.layout;
        let tpb = u64::from(layout.tokens_per_block());
        for ((entry, &start), &count) in entries.into_iter().zip(starts).zip(counts) {
            let table = self.requests.view(entry).table();
            #[expect(
                clippy::cast_possible_truncation,
                clippy::cast_possible_wrap,
                reason = "reserved positions index the table (checked above), and a page id is below 2^31 and \
                          tpb below 2^32, so page * tpb + offset < 2^63 fits i64"
            )]
            out.extend((start..start + count).map(|pos| {
                if layout.owner_rank(pos) == rank {
                    let page = table[layout.superblock_index(pos) as usize];
                    (u64::from(page) * tpb + pos % tpb) as i64
                } else {
                    -1
                }
            }));
        }
        Ok(())
    }

    /// A 64-bit fingerprint of the whole ledger state (free list order, every table and
    /// counter, in id order). Equal ledgers have equal digests on every platform.
    pub fn state_digest(&self) -> u64 {
        let mut h = crate::digest::Fnv64::new();
        h.u64(u64::from(self.capacity));
        h.u32s(&self.free);
        let mut order: Vec<EntryIndex> = self.index.entries().collect();
        order.sort_unstable_by_key(|&i| self.requests.records[i].id);
        for i in order {
            let r = self.requests.view(i);
            h.u64(r.id());
            h.u64(r.len());
            h.u64(r.prompt_len());
            h.u64(r.decode_count());
            h.u64(r.record.decode_step().map_or(u64::MAX, |s| s));
            h.u64(r.suspended_len().map_or(u64::MAX, |s| s));
            h.u32s(r.table());
        }
        if let Some(cache) = &self.cache {
            cache.digest_into(&mut h);
        }
        h.finish()
    }
}

/// The ledger's records as the scheduler's per-step decode loop uses them
/// ([`Ledger::decode_lane`]): the record slice and tokens per superblock held apart from
/// the ledger, so the loop's stores cannot alias them and it keeps them in registers.
pub(crate) struct DecodeLane<'a> {
    requests: &'a mut [KvRecord],
    tokens_per_superblock: u64,
}

impl DecodeLane<'_> {
    /// The common decode grow of the per-step path, all in the entry's first line:
    /// `entry` holds `id`, active, not yet decoded in `step`, with its prompt reserved
    /// and room for the token in the superblocks it holds. Then it is
    /// [`Ledger::decode_at`] exactly (same position, inverse and state after); otherwise
    /// it returns `None` and changes nothing, and the caller takes the general path.
    #[expect(
        clippy::inline_always,
        reason = "the per-request body of the scheduler's decode loop"
    )]
    #[inline(always)]
    pub(crate) fn try_decode_in_place(
        &mut self,
        entry: EntryIndex,
        id: RequestId,
        step: u64,
    ) -> Option<(u64, DecodeInverse)> {
        let request = self.requests.get_mut(entry)?;
        let stepped = request.flags & HAS_DECODE_STEP != 0 && request.decode_step == step;
        if request.id != id || request.flags & SUSPENDED != 0 || stepped {
            return None;
        }
        let pos = request.prompt_len + request.decode_count;
        let len_before = request.len;
        if len_before < pos {
            return None;
        }
        let new_len = len_before.max(pos + 1);
        if new_len > u64::from(request.held) * self.tokens_per_superblock {
            return None;
        }
        let inverse = DecodeInverse::new(
            request.flags & HAS_DECODE_STEP,
            request.decode_step,
            new_len != len_before,
        );
        request.flags |= HAS_DECODE_STEP;
        request.len = new_len;
        request.decode_count += 1;
        request.decode_step = step;
        Some((pos, inverse))
    }
}

/// Applies a validated grow of `request` to `new_len` tokens, its superblocks taken from
/// the top of `free`; `false` (and no change) if the pool is short. Apart from the ledger
/// so a batch can run it with the free list in a local.
#[expect(
    clippy::inline_always,
    reason = "measured: inlined into `grow_many` it saves ~1 ns a request"
)]
#[inline(always)]
fn grow_record(
    request: &mut KvRecord,
    table: &mut KvTable,
    free: &mut Vec<SuperblockId>,
    layout: Layout,
    new_len: u64,
) -> bool {
    // Most grows (every decode token but one per superblock) stay inside the last
    // superblock: settle those with a multiply instead of a division.
    if new_len <= u64::from(request.held) * layout.tokens_per_superblock() {
        request.len = new_len;
        return true;
    }
    let needed = superblocks_needed(layout, new_len);
    let extra = needed.saturating_sub(request.held as usize);
    if extra > free.len() {
        return false;
    }
    let split = free.len() - extra;
    // The top of the stack, last first (a slice copy: no drain machinery); one
    // superblock, the usual grow, is a plain move.
    if extra == 1 {
        table.push_pages(&mut request.held, std::iter::once(free[split]));
    } else {
        table.push_pages(&mut request.held, free[split..].iter().rev().copied());
    }
    free.truncate(split);
    request.len = new_len;
    true
}

/// Superblocks that `len` tokens occupy, as a table length: for a length within the pool
/// (every caller checked it), so the count is at most the pool's capacity, a u32.
#[expect(
    clippy::inline_always,
    reason = "part of the per-request body of `grow_many`'s loop, where a call per grow would show"
)]
#[expect(
    clippy::cast_possible_truncation,
    reason = "`len` is within the pool, so this is at most its capacity, a u32"
)]
#[inline(always)]
fn superblocks_needed(layout: Layout, len: u64) -> usize {
    layout.superblocks_for(len) as usize
}

/// [`grow_record`] out of line: the grows a batch does not settle in its own loop.
#[inline(never)]
fn grow_record_cold(
    request: &mut KvRecord,
    table: &mut KvTable,
    free: &mut Vec<SuperblockId>,
    layout: Layout,
    new_len: u64,
) -> bool {
    grow_record(request, table, free, layout, new_len)
}

/// Request id -> ledger entry; looked up, never iterated for a decision (its entries come
/// out in an order the callers sort away). Ids below a bound that grows with the number of
/// requests held (the usual small, dense ids) sit in a plain vector, where a lookup is one
/// load; others in a hash map. Which ids go where depends only on the calls made, and
/// equality is that of the mappings, whatever their storage.
#[derive(Debug, Clone, Default)]
struct IdIndex {
    /// Entry of id `i` at `i`, or `NO_ENTRY`.
    dense: Vec<EntryIndex>,
    /// Ids not in `dense` (also ids that were mapped here before `dense` grew past them).
    sparse: FxHashMap<RequestId, EntryIndex>,
    len: usize,
}

const NO_ENTRY: EntryIndex = EntryIndex::MAX;

impl IdIndex {
    /// `dense` covers ids below this many per id held (and at least `DENSE_MIN`), so its
    /// memory stays within a small multiple of the requests held.
    const DENSE_PER_ID: usize = 4;
    const DENSE_MIN: usize = 4096;

    fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn dense_slot(&self, id: RequestId) -> Option<usize> {
        usize::try_from(id).ok().filter(|&i| i < self.dense.len())
    }

    #[inline]
    fn get(&self, id: RequestId) -> Option<EntryIndex> {
        if let Some(i) = self.dense_slot(id) {
            if self.dense[i] != NO_ENTRY {
                return Some(self.dense[i]);
            }
        }
        if self.sparse.is_empty() {
            return None;
        }
        self.get_sparse(id)
    }

    /// The hash-map lookup of [`IdIndex::get`], out of line: the usual ids are dense, and
    /// the probe's code would crowd the batch loops that inline `get`.
    #[inline(never)]
    fn get_sparse(&self, id: RequestId) -> Option<EntryIndex> {
        self.sparse.get(&id).copied()
    }

    /// The hash-map removal of [`IdIndex::remove_many`], out of line (see `get_sparse`).
    #[inline(never)]
    fn remove_sparse(
        sparse: &mut FxHashMap<RequestId, EntryIndex>,
        id: RequestId,
    ) -> Option<EntryIndex> {
        sparse.remove(&id)
    }

    /// Maps `id`, which must not be mapped.
    fn insert(&mut self, id: RequestId, entry: EntryIndex) {
        debug_assert!(self.get(id).is_none() && entry != NO_ENTRY);
        self.len += 1;
        let bound = (self.len * Self::DENSE_PER_ID).max(Self::DENSE_MIN);
        match usize::try_from(id) {
            Ok(i) if i < bound => {
                if i >= self.dense.len() {
                    self.dense
                        .resize((i + 1).next_power_of_two().min(bound), NO_ENTRY);
                }
                self.dense[i] = entry;
            }
            _ => {
                self.sparse.insert(id, entry);
            }
        }
    }

    /// Takes every id of `ids` out, in order, appending its entry to `out`; at the first
    /// id not mapped (unknown, or repeated within `ids`) it stops and returns `false`,
    /// the ids before it taken out (their entries in `out`).
    fn remove_many(&mut self, ids: &[RequestId], out: &mut Vec<EntryIndex>) -> bool {
        out.reserve(ids.len());
        let start = out.len();
        let Self { dense, sparse, len } = self;
        let mut complete = true;
        for &id in ids {
            let slot = usize::try_from(id).ok().and_then(|i| dense.get_mut(i));
            let entry = match slot {
                Some(slot) if *slot != NO_ENTRY => std::mem::replace(slot, NO_ENTRY),
                _ => {
                    let Some(entry) = Self::remove_sparse(sparse, id) else {
                        complete = false;
                        break;
                    };
                    entry
                }
            };
            out.push(entry);
        }
        // One update for the whole batch, not a read-modify-write of `len` per id.
        *len -= out.len() - start;
        complete
    }

    #[inline]
    fn remove(&mut self, id: RequestId) -> Option<EntryIndex> {
        let entry = match self.dense_slot(id) {
            Some(i) if self.dense[i] != NO_ENTRY => std::mem::replace(&mut self.dense[i], NO_ENTRY),
            _ => self.sparse.remove(&id)?,
        };
        self.len -= 1;
        Some(entry)
    }

    /// Every mapped entry, in no particular order.
    fn entries(&self) -> impl Iterator<Item = EntryIndex> + '_ {
        let dense = self.dense.iter().copied().filter(|&e| e != NO_ENTRY);
        dense.chain(self.sparse.values().copied())
    }
}

impl PartialEq for IdIndex {
    fn eq(&self, other: &Self) -> bool {
        let mapped_alike = |a: &Self, b: &Self| {
            let mut dense = a.dense.iter().enumerate().filter(|(_, &e)| e != NO_ENTRY);
            dense.all(|(i, &e)| b.get(i as RequestId) == Some(e))
                && a.sparse.iter().all(|(&id, &e)| b.get(id) == Some(e))
        };
        self.len == other.len && mapped_alike(self, other)
    }
}

impl Eq for IdIndex {}

/// Makes room for `additional` more entries in `out`, or a clear `InvalidLength` error
/// (never an allocation abort) for a size that cannot be served.
pub fn reserve_exactly<T>(out: &mut Vec<T>, additional: u64, what: &str) -> Result<()> {
    usize::try_from(additional)
        .ok()
        .and_then(|n| out.try_reserve_exact(n).ok())
        .ok_or_else(|| {
            CoreError::InvalidLength(format!(
                "a {what} of {additional} entries cannot be allocated"
            ))
        })
}

/// The first value that occurs a second time in `values` (request ids, superblock ids).
fn first_repeat<T: Copy + Eq + std::hash::Hash>(values: &[T]) -> Option<T> {
    let mut seen = rustc_hash::FxHashSet::default();
    seen.reserve(values.len());
    values.iter().copied().find(|&value| !seen.insert(value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::{below, xorshift};

    /// Small, large and huge ids, ids mapped sparse before the dense part grows past them,
    /// removals from both parts: every lookup agrees with a plain map, and two indexes with
    /// the same mapping are equal whatever storage their histories left.
    #[test]
    fn id_index_maps_like_a_hash_map() {
        let mut index = IdIndex::default();
        let mut reference = std::collections::BTreeMap::new();
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        let ids: Vec<RequestId> = (0..64)
            .chain([4095, 4096, 5000, 20_000, 1 << 40, u64::MAX, u64::MAX - 1])
            .chain((0..3000).map(|i| 8000 + i))
            .collect();
        for round in 0..40_000usize {
            let seed = next();
            let id = ids[usize::try_from(seed % ids.len() as u64).unwrap()];
            if let std::collections::btree_map::Entry::Vacant(vacant) = reference.entry(id) {
                index.insert(id, round);
                vacant.insert(round);
            } else if seed & 0x100 == 0 {
                assert_eq!(index.remove(id), reference.remove(&id));
            }
            assert_eq!(index.len(), reference.len());
            assert_eq!(index.get(id), reference.get(&id).copied());
        }
        for &id in &ids {
            assert_eq!(index.get(id), reference.get(&id).copied(), "id {id}");
        }
        let mut entries: Vec<_> = index.entries().collect();
        entries.sort_unstable();
        let mut expected: Vec<_> = reference.values().copied().collect();
        expected.sort_unstable();
        assert_eq!(entries, expected);
        // The same mapping built fresh (other storage) is equal; one entry off is not.
        let mut fresh = IdIndex::default();
        for (&id, &entry) in &reference {
            fresh.insert(id, entry);
        }
        assert_eq!(index, fresh);
        let (&id, &entry) = reference.iter().next().unwrap();
        fresh.remove(id);
        assert_ne!(index, fresh);
        fresh.insert(id, entry + 1);
        assert_ne!(index, fresh);
    }

    /// Two decodes of a request, the second planned ahead of the first (one step ahead,
    /// with and without a new superblock, and over a whole-output reservation): undoing
    /// the second with its inverse, then the first with its own, leaves the ledger as
    /// before both.
    #[test]
    fn two_decodes_undone_newest_first_leave_the_ledger_as_before() {
        let layout = Layout::new(1, 4).unwrap();
        for (prompt, reserved) in [(2, 2), (3, 3), (3, 12)] {
            let mut ledger = Ledger::new(layout, 8).unwrap();
            ledger.add(1, prompt).unwrap();
            assert!(ledger.grow(1, reserved).unwrap());
            let before = ledger.clone();
            let entry = ledger.entry_of(1).unwrap();
            let (first, older) = ledger.decode_at(entry, 1, 0).unwrap().unwrap();
            assert_eq!(first, prompt);
            let (position, newer) = ledger.decode_at(entry, 1, 1).unwrap().unwrap();
            assert_eq!(position, prompt + 1);
            assert_eq!(newer.step_before(), Some(0), "prompt {prompt}");
            assert!(
                ledger.decode_at(entry, 1, 1).is_err(),
                "a step decodes a request once"
            );
            ledger.undo_decode(1, 1, newer).unwrap();
            ledger.undo_decode(1, 0, older).unwrap();
            assert_eq!(ledger, before, "prompt {prompt}, reserved {reserved}");
            assert_eq!(ledger.state_digest(), before.state_digest());
        }
    }

    /// The scheduler's in-place decodes (`DecodeLane`) against the general decode they
    /// stand for, from random states (no step yet, a step, a second decode in the same
    /// step, a grow or not, suspended, shrunk, wrong hints): where the in-place one gives
    /// a position and inverse, the general one gives the same and leaves the same ledger;
    /// where it gives none, nothing changed. Undoing both with the inverse stays equal too.
    #[test]
    fn in_place_decodes_are_the_general_decodes() {
        let layout = Layout::new(2, 4).unwrap();
        let tps = layout.tokens_per_superblock();
        let mut next = below(0x9e37_79b9_7f4a_7c15);
        let mut ledger = Ledger::new(layout, 40).unwrap();
        let (mut placed, mut refused) = (0, 0);
        for round in 0..20_000u64 {
            let id = next(10);
            match next(10) {
                0 | 1 => drop(ledger.add(id, 1 + next(2 * tps))),
                2 => drop(ledger.suspend(id)),
                3 => drop(ledger.resume(id)),
                4 => drop(ledger.shrink(id, next(3 * tps))),
                5 => drop(ledger.free(id)),
                6 | 7 => {
                    let len = ledger.request(id).map_or(0, |r| r.len());
                    drop(ledger.grow(id, len + next(2 * tps)));
                }
                _ => {}
            }
            // Steps advance slowly, so second decodes in the same step and steps planned
            // ahead of a pending one both happen.
            let step = round / 3 + next(2);
            let entry = match ledger.entry_of(id) {
                Ok(entry) if next(8) != 0 => entry,
                _ => usize::try_from(next(14)).unwrap(),
            };
            let before = ledger.clone();
            let got = ledger.decode_lane().try_decode_in_place(entry, id, step);
            let Some((position, inverse)) = got else {
                refused += 1;
                assert_eq!(
                    ledger, before,
                    "round {round}: a refused decode changed nothing"
                );
                continue;
            };
            placed += 1;
            let mut general = before;
            let expected = general.decode_at(entry, id, step);
            assert_eq!(
                expected.unwrap(),
                Some((position, inverse)),
                "round {round}"
            );
            assert_eq!(ledger, general, "round {round}");
            if next(4) == 0 {
                for undo in [step, step.saturating_sub(1)] {
                    let (a, b) = (
                        ledger.undo_decode(id, undo, inverse),
                        general.undo_decode(id, undo, inverse),
                    );
                    assert_eq!(format!("{a:?}"), format!("{b:?}"), "round {round}");
                    assert_eq!(ledger, general, "round {round}");
                }
            }
        }
        assert!(
            placed > 2000 && refused > 2000,
            "{placed} placed, {refused} refused"
        );
    }

    /// The batch calls as they were written first (validate whole, then apply), from the
    /// unchanged single-request steps: `grow_many` gives the same answers, errors and
    /// state, and `free_many` leaves what `free` of each id in turn leaves.
    #[test]
    fn batch_calls_match_their_plain_form() {
        fn plain_grow_many(ledger: &mut Ledger, ids: &[u64], lens: &[u64]) -> Result<Vec<bool>> {
            let entries = ledger.unique_entries(ids)?;
            for (&entry, &len) in entries.iter().zip(lens) {
                ledger.check_grow_entry(entry, len)?;
            }
            Ok(entries
                .into_iter()
                .zip(lens)
                .map(|(entry, &len)| ledger.grow_entry(entry, len))
                .collect())
        }
        let layout = Layout::new(2, 4).unwrap();
        let tps = layout.tokens_per_superblock();
        let mut next = below(0x2545_f491_4f6c_dd1d);
        let mut ledger = Ledger::new(layout, 48).unwrap();
        let mut ok = vec![true; 3];
        for round in 0..4000 {
            // Ids 0..12: some held, some suspended, some unknown; lengths around what
            // they hold, past the pool now and then.
            let id = next(12);
            match next(6) {
                0 => drop(ledger.add(id, 1 + next(3))),
                1 => drop(ledger.suspend(id)),
                2 => drop(ledger.resume(id)),
                3 => drop(ledger.shrink(id, next(2 * tps))),
                _ => {}
            }
            let n = usize::try_from(next(6)).unwrap();
            let ids: Vec<u64> = (0..n).map(|_| next(12)).collect();
            let lens: Vec<u64> = (0..n)
                .map(|_| {
                    if next(40) == 0 {
                        49 * tps
                    } else {
                        next(12 * tps)
                    }
                })
                .collect();
            let mut plain = ledger.clone();
            let expected = plain_grow_many(&mut plain, &ids, &lens).map_err(|e| e.to_string());
            let got = ledger
                .grow_many(&ids, &lens, &mut ok)
                .map(|()| ok.clone())
                .map_err(|e| e.to_string());
            assert_eq!(
                got, expected,
                "round {round}: grow_many {ids:?} to {lens:?}"
            );
            assert_eq!(ledger, plain);
            assert_eq!(ledger.state_digest(), plain.state_digest());
            if next(4) == 0 {
                let mut plain = ledger.clone();
                let expected = plain
                    .unique_entries(&ids)
                    .map(|_| ())
                    .map_err(|e| e.to_string());
                if expected.is_ok() {
                    for &id in &ids {
                        plain.free(id).unwrap();
                    }
                }
                let got = ledger.free_many(&ids).map_err(|e| e.to_string());
                assert_eq!(got, expected, "round {round}: free_many {ids:?}");
                assert_eq!(ledger, plain);
                assert_eq!(ledger.state_digest(), plain.state_digest());
            }
        }
    }

    /// The record keeps its table in place up to `INLINE_SUPERBLOCKS` and on the heap past
    /// it, moving both ways, with the same table and free list as plain vectors would give.
    #[test]
    fn tables_move_between_the_record_and_the_heap() {
        let layout = Layout::new(2, 4).unwrap();
        let tps = layout.tokens_per_superblock();
        let mut ledger = Ledger::new(layout, 40).unwrap();
        ledger.add(7, 1).unwrap();
        let mut expected_free: Vec<u32> = (0..40).rev().collect();
        let mut expected_table: Vec<u32> = Vec::new();
        for superblocks in [1u64, 8, 9, 20, 8, 3, 12, 0, 9] {
            let held = expected_table.len() as u64;
            if superblocks >= held {
                assert!(ledger.grow(7, superblocks * tps).unwrap());
                for _ in held..superblocks {
                    expected_table.push(expected_free.pop().unwrap());
                }
            } else {
                ledger.shrink(7, superblocks * tps).unwrap();
                while expected_table.len() as u64 > superblocks {
                    expected_free.push(expected_table.pop().unwrap());
                }
            }
            assert_eq!(ledger.request(7).unwrap().table(), expected_table);
            assert_eq!(ledger.free_superblocks() as usize, expected_free.len());
        }
        ledger.free(7).unwrap();
        let mut fresh = Ledger::new(layout, 40).unwrap();
        // Same free list order as the same calls on a fresh ledger.
        for superblocks in [1u64, 8, 9, 20, 8, 3, 12, 0, 9] {
            fresh.add(7, 1).ok();
            let len = fresh.request(7).unwrap().len();
            if superblocks * tps >= len {
                assert!(fresh.grow(7, superblocks * tps).unwrap());
            } else {
                fresh.shrink(7, superblocks * tps).unwrap();
            }
        }
        fresh.free(7).unwrap();
        assert_eq!(ledger, fresh);
        assert_eq!(ledger.state_digest(), fresh.state_digest());
    }
}
