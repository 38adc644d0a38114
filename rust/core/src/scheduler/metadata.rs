//! Step metadata written once, by Rust: everything an attention kernel needs for this rank's
//! share of a scheduled step, packed into one caller-owned buffer of int32 words (pinned host
//! memory, copied to the device in one transfer).
//!
//! The buffer is cut into sections at fixed offsets that depend only on the capacities
//! (tokens and entries per step, table width), never on the step: a caller views each
//! section once and reuses the views (and their device twins) every step. Each step fills
//! the front of each section and reports the counts in the header; what lies past the
//! counts is left as the buffer held it.
//!
//! Entries are ordered generation entries first, then context chunks (the order of
//! `sample_ids`: the sampled rows are `0..num_generation`, then the last token of each chunk
//! that completes its prompt), and the flat token order follows the entries.
//!
//! A decode-only step can also be written as the rows a decode kernel reads
//! ([`Scheduler::write_decode_rows`]): one int32 row per generation entry, its columns fixed
//! by [`decode_row`] (`token_id, position, slot, local_len, past_seen_len, input_ref`, then
//! the block table), in a caller-owned `[rows, width]` buffer.
//!
//! The writers are functions of what they read, a [`WriterView`]: the ledger, the newest
//! pending step's record, the layout and the rank. They never see the scheduler (its
//! public entry points, `Scheduler::write_step_metadata` and the others, build the view
//! and call them), so a writer cannot touch the queue, the phases or a request's state.

use super::output::ScheduleOutput;
use super::pending::{ContextEntry, StepRecord};
use super::placement::{DecodePlacement, Divisor, Placement};
use super::request::RequestIndex;
use crate::error::{CoreError, Result};
use crate::ids::{page_id, RequestId, SuperblockId};
use crate::layout::Layout;
use crate::ledger::{write_table_cells, Ledger};
#[cfg(doc)]
use crate::Scheduler;

/// How many elements a section holds, in terms of the capacities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Per {
    /// [`HEADER_WORDS`] words.
    Header,
    /// One element per token of the step.
    Token,
    /// One element per entry (request) of the step.
    Entry,
    /// One element per entry, plus one (offsets).
    EntryBoundary,
    /// `table_width` elements per entry (row-major rows).
    TableCell,
}

/// The sections in buffer order: name, whether an element is an int64 (two words, at an
/// even word offset) and what it holds one element per. Adding a section is one line here
/// plus its index constant and the code that fills it.
const SECTIONS: [(&str, bool, Per); SECTION_COUNT] = [
    ("header", false, Per::Header),
    ("token_ids", false, Per::Token),
    ("positions", false, Per::Token),
    ("slot_mapping", true, Per::Token),
    ("query_start", false, Per::EntryBoundary),
    ("local_lens", false, Per::Entry),
    ("past_seen_lens", false, Per::Entry),
    ("batch_slots", false, Per::Entry),
    ("sample_rows", false, Per::Entry),
    ("block_table", false, Per::TableCell),
];
const SECTION_COUNT: usize = 10;
const HEADER: usize = 0;
const TOKEN_IDS: usize = 1;
const POSITIONS: usize = 2;
const SLOT_MAPPING: usize = 3;
const QUERY_START: usize = 4;
const LOCAL_LENS: usize = 5;
const PAST_SEEN_LENS: usize = 6;
const BATCH_SLOTS: usize = 7;
const SAMPLE_ROWS: usize = 8;
const BLOCK_TABLE: usize = 9;

/// Words of the header: `step` (an int64, words 0-1), then `num_tokens`, `num_entries`,
/// `num_generation`, `num_samples`, `table_width_used` and `num_draft_tokens` (0 without
/// speculative decoding).
pub const HEADER_WORDS: usize = 8;

/// One section of the packed buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepMetadataSection {
    /// The section's name (`"token_ids"`, `"slot_mapping"`, ...).
    pub name: &'static str,
    /// Offset of its first element, in int32 words from the start of the buffer (even for
    /// an int64 section).
    pub offset_words: usize,
    /// Elements it holds (its capacity).
    pub len: usize,
    /// Whether an element is an int64 (two words) rather than an int32.
    pub int64: bool,
}

/// Where each section of the packed step metadata lies, for given capacities. It depends
/// on the capacities only, so one layout (and one buffer) serves every step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepMetadataLayout {
    max_tokens: usize,
    max_entries: usize,
    table_width: usize,
    sections: [StepMetadataSection; SECTION_COUNT],
    total_words: usize,
}

impl StepMetadataLayout {
    /// The layout for steps of at most `max_tokens` tokens and `max_entries` entries, with
    /// block-table rows of `table_width` superblocks. Fails (`InvalidLength`) when the
    /// buffer would not be addressable (more than `2**31 - 1` words).
    pub fn new(max_tokens: u32, max_entries: u32, table_width: u32) -> Result<Self> {
        let (tokens, entries, width) = (
            u64::from(max_tokens),
            u64::from(max_entries),
            u64::from(table_width),
        );
        let mut offset = 0u64;
        let mut sections = [StepMetadataSection {
            name: "",
            offset_words: 0,
            len: 0,
            int64: false,
        }; SECTION_COUNT];
        for (section, &(name, int64, per)) in sections.iter_mut().zip(&SECTIONS) {
            let len = match per {
                Per::Header => HEADER_WORDS as u64,
                Per::Token => tokens,
                Per::Entry => entries,
                Per::EntryBoundary => entries + 1,
                Per::TableCell => entries.saturating_mul(width),
            };
            if int64 {
                offset = offset.saturating_add(offset % 2);
            }
            // Saturating: a sum past `i32::MAX` words is refused below anyway.
            let words = if int64 { len.saturating_mul(2) } else { len };
            *section = StepMetadataSection {
                name,
                offset_words: to_usize(offset),
                len: to_usize(len),
                int64,
            };
            offset = offset.saturating_add(words);
        }
        if offset > i32::MAX as u64 {
            return Err(CoreError::InvalidLength(format!(
                "step metadata for {max_tokens} tokens, {max_entries} entries and a table width of \
                 {table_width} needs {offset} words, more than 2**31 - 1"
            )));
        }
        Ok(Self {
            max_tokens: to_usize(tokens),
            max_entries: to_usize(entries),
            table_width: to_usize(width),
            sections,
            total_words: to_usize(offset),
        })
    }

    /// Tokens one step may hold.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }
    /// Entries one step may hold.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }
    /// Superblocks per block-table row.
    pub fn table_width(&self) -> usize {
        self.table_width
    }
    /// Words the buffer must hold at least.
    pub fn total_words(&self) -> usize {
        self.total_words
    }
    /// Every section, in buffer order.
    pub fn sections(&self) -> &[StepMetadataSection] {
        &self.sections
    }
}

/// Converts a count that fits the platform (checked against `i32::MAX` words before it is
/// used to index anything).
fn to_usize(value: u64) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

/// The counts of one written step (also in the header section).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepMetadata {
    /// The step written.
    pub step: u64,
    /// Tokens written (generation inputs, then context tokens).
    pub num_tokens: usize,
    /// Entries written (generation entries, then context chunks).
    pub num_entries: usize,
    /// Generation entries: entries `0..num_generation`, tokens
    /// `0..num_generation + num_draft_tokens` (each entry's input token, then its drafts).
    pub num_generation: usize,
    /// Draft tokens the generation entries verify (speculative decoding; 0 without).
    pub num_draft_tokens: usize,
    /// Sampled rows (the length of `sample_ids`). Without drafts, the rows of `sample_rows`
    /// written; with drafts, `sample_rows` holds each generation entry's first row (its
    /// `1 + drafts` rows are all sampled) and then each completing chunk's last row.
    pub num_samples: usize,
    /// The widest table among the entries, in superblocks (columns past it are -1).
    pub table_width_used: usize,
}

/// The fields of a [`ScheduleOutput`] that the metadata is made of, borrowed (the Python
/// binding lends them without copying the arrays it holds). The per-rank fields are not
/// among them: the writers compute this rank's owner and lengths from the positions.
#[derive(Debug, Clone, Copy)]
pub struct StepSource<'a> {
    pub step: u64,
    /// The output's digest: the step must be this scheduler's own (another scheduler's,
    /// or another configuration's, output of the same step number is refused).
    pub digest: u64,
    pub context_ids: &'a [RequestId],
    pub context_starts: &'a [u64],
    pub context_lens: &'a [u64],
    pub context_completes: &'a [bool],
    pub context_batch_slots: &'a [i32],
    pub context_token_ids: &'a [i32],
    pub generation_ids: &'a [RequestId],
    pub generation_positions: &'a [u64],
    pub generation_input_tokens: &'a [i32],
    pub generation_input_refs: &'a [i32],
    pub generation_batch_slots: &'a [i32],
    /// Drafts per generation entry (empty: none), and their tokens in entry order.
    pub generation_draft_counts: &'a [u64],
    pub generation_draft_tokens: &'a [i32],
}

impl<'a> From<&'a ScheduleOutput> for StepSource<'a> {
    fn from(out: &'a ScheduleOutput) -> Self {
        Self {
            step: out.step,
            digest: out.digest,
            context_ids: &out.context_ids,
            context_starts: &out.context_starts,
            context_lens: &out.context_lens,
            context_completes: &out.context_completes,
            context_batch_slots: &out.context_batch_slots,
            context_token_ids: &out.context_token_ids,
            generation_ids: &out.generation_ids,
            generation_positions: &out.generation_positions,
            generation_input_tokens: &out.generation_input_tokens,
            generation_input_refs: &out.generation_input_refs,
            generation_batch_slots: &out.generation_batch_slots,
            generation_draft_counts: &out.generation_draft_counts,
            generation_draft_tokens: &out.generation_draft_tokens,
        }
    }
}

/// `value` as an int32 word; callers checked the bound (`< 2**31`).
#[expect(
    clippy::cast_possible_truncation,
    reason = "every value written is checked against i32::MAX first (`check_word`)"
)]
fn word(value: u64) -> i32 {
    debug_assert!(i32::try_from(value).is_ok());
    value as i32
}

/// An int64 written as two native-endian int32 words, so an int64 view of them reads `value`.
fn wide_words(value: i64) -> [i32; 2] {
    let b = value.to_ne_bytes();
    [
        i32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
        i32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
    ]
}

fn check_word(value: u64, what: &str) -> Result<()> {
    if value > i32::MAX as u64 {
        return Err(CoreError::InvalidLength(format!(
            "{what} {value} does not fit the int32 words of the step metadata"
        )));
    }
    Ok(())
}

#[cold]
fn unreserved(id: RequestId, start: u64, end: u64, len: u64) -> CoreError {
    CoreError::InvalidLength(format!(
        "tokens {start}..{end} of request {id} are not all reserved (it holds {len})"
    ))
}

/// Fails unless each of `lens` (the lengths of the `group` arrays) is `expected`.
fn lengths_agree(expected: usize, lens: &[usize], group: &str) -> Result<()> {
    if lens.iter().any(|&n| n != expected) {
        return Err(CoreError::InvalidArgument(format!(
            "the {group} arrays of the schedule output differ in length"
        )));
    }
    Ok(())
}

/// The number of decode entries of `source`; fails unless its generation arrays other than
/// the batch slots have that length (the input references too: `write_step_metadata` does
/// not read them, but an output whose arrays disagree is refused by both forms alike).
fn generation_len(source: &StepSource<'_>) -> Result<usize> {
    let g = source.generation_ids.len();
    let lens = [
        source.generation_positions.len(),
        source.generation_input_tokens.len(),
        source.generation_input_refs.len(),
    ];
    lengths_agree(g, &lens, "generation")?;
    Ok(g)
}

/// Fails unless the arrays of `source` fit together and the step, with its `draft_tokens`
/// (0 without drafts; their counts checked by [`checked_draft_total`]), fits `layout` and
/// a buffer of `buffer_words` words.
fn check_shapes(
    source: &StepSource<'_>,
    layout: &StepMetadataLayout,
    buffer_words: usize,
    draft_tokens: usize,
) -> Result<()> {
    if buffer_words < layout.total_words {
        return Err(CoreError::InvalidLength(format!(
            "the buffer holds {buffer_words} words; the layout needs {}",
            layout.total_words
        )));
    }
    let g = generation_len(source)?;
    lengths_agree(g, &[source.generation_batch_slots.len()], "generation")?;
    let c = source.context_ids.len();
    let lens = [
        source.context_starts.len(),
        source.context_lens.len(),
        source.context_completes.len(),
        source.context_batch_slots.len(),
    ];
    lengths_agree(c, &lens, "context")?;
    let context_tokens = source
        .context_lens
        .iter()
        .try_fold(0u64, |acc, &n| acc.checked_add(n));
    if context_tokens != Some(source.context_token_ids.len() as u64) {
        return Err(CoreError::InvalidArgument(
            "the context lengths do not add up to the context tokens".into(),
        ));
    }
    let num_tokens = g + draft_tokens + source.context_token_ids.len();
    if num_tokens > layout.max_tokens || g + c > layout.max_entries {
        return Err(CoreError::InvalidLength(format!(
            "step {} has {num_tokens} tokens in {} entries; the layout holds {} tokens in {} entries",
            source.step,
            g + c,
            layout.max_tokens,
            layout.max_entries
        )));
    }
    Ok(())
}

/// What the step-metadata and decode-row writers read, and all they read: the ledger (each
/// entry's superblocks), the newest pending step's record (the only step whose metadata
/// may be written, and each entry's ledger entry, where the writers look for its holdings
/// first), the token layout with its prepared divisors, and the rank written for. Built by
/// the scheduler for each call; read-only.
#[derive(Debug, Clone, Copy)]
pub(super) struct WriterView<'a> {
    pub ledger: &'a Ledger,
    pub newest: Option<&'a StepRecord>,
    pub layout: Layout,
    pub placement: &'a Placement,
    pub rank: u32,
}

impl<'a> WriterView<'a> {
    /// [`Scheduler::write_step_metadata`]: this rank's metadata of the pending step
    /// `source`, checked whole before the first word of `buffer` is written.
    pub fn write_step_metadata(
        &self,
        source: StepSource<'_>,
        layout: &StepMetadataLayout,
        buffer: &mut [i32],
    ) -> Result<StepMetadata> {
        if has_drafts(&source) {
            return self.write_drafted_step_metadata(&source, layout, buffer);
        }
        let (tables, table_width_used) = self.check_step_source(&source, layout, buffer.len())?;
        let num_generation = source.generation_ids.len();
        let num_tokens = num_generation + source.context_token_ids.len();
        let num_samples = num_generation + source.context_completes.iter().filter(|&&c| c).count();
        let metadata = StepMetadata {
            step: source.step,
            num_tokens,
            num_entries: tables.len(),
            num_generation,
            num_draft_tokens: 0,
            num_samples,
            table_width_used,
        };
        let mut writer = Writer {
            layout,
            buffer,
            placement: self.layout,
            rank: self.rank,
        };
        writer.header(&metadata);
        writer.tokens(&source);
        writer.entries(&source);
        writer.slot_mapping(&source, &tables);
        writer.block_table(&tables);
        Ok(metadata)
    }

    /// Every check of [`Self::write_step_metadata`]; the superblock table of each entry, in
    /// entry order, and the widest one's length.
    fn check_step_source(
        &self,
        source: &StepSource<'_>,
        layout: &StepMetadataLayout,
        buffer_words: usize,
    ) -> Result<(Vec<&'a [SuperblockId]>, usize)> {
        self.check_pending(source)?;
        check_shapes(source, layout, buffer_words, 0)?;
        let (g, c) = (source.generation_ids.len(), source.context_ids.len());
        // Each entry's holdings, found through the scheduler's own index of the request
        // (its ledger entry) where that still names it: no id lookup on the common path.
        // The generation entries at once, their checks folded into one flag; where one
        // fails (or a hint misses), every entry is checked in order below, which names it.
        let bounds = RowBounds {
            columns: layout.table_width,
            tokens_per_superblock: self.layout.tokens_per_superblock(),
        };
        let hinted = hinted_row_tables(
            self.ledger,
            source.generation_ids,
            self.generation_hints(),
            source.generation_positions,
            bounds,
        );
        let (requests, furthest, widest, checked) = match hinted {
            Some(rows) => {
                let mut tables = rows.tables;
                tables.reserve_exact(c);
                // `furthest` is an end: one past the furthest position.
                let end = if g > 0 { rows.furthest + 1 } else { 0 };
                (tables, end, rows.widest, g)
            }
            None => (Vec::with_capacity(g + c), 0, 0, 0),
        };
        // The entries not checked yet (the rest of the generation entries, then the chunks).
        let entries = source.generation_ids[checked..]
            .iter()
            .zip(&source.generation_positions[checked..])
            .map(|(&id, &pos)| (id, pos, 1));
        let checked = EntryTables {
            tables: requests,
            furthest,
            widest,
        };
        self.entry_tables(source, entries, checked, layout.table_width)
    }

    /// `checked` (the tables of the entries checked so far, in entry order), then the table
    /// of each of the rest of the entries of `source`: the generation entries `entries`
    /// (the last ones, as `(id, first position, tokens)`), then the context chunks. Each is
    /// looked up at its hint (its ledger entry) or by id, and must hold its tokens
    /// reserved; then the furthest end must fit a word and the widest table the layout's
    /// `columns`. Every entry's table, in entry order, and the widest one's length; the
    /// first failure is the error, naming its request.
    fn entry_tables(
        &self,
        source: &StepSource<'_>,
        generation: impl ExactSizeIterator<Item = (RequestId, u64, u64)>,
        checked: EntryTables<'a>,
        columns: usize,
    ) -> Result<(Vec<&'a [SuperblockId]>, usize)> {
        let EntryTables {
            tables: mut requests,
            mut furthest,
            mut widest,
        } = checked;
        let g = source.generation_ids.len();
        let generation_hints = self.generation_hints().get(g - generation.len()..);
        let generation_hints = generation_hints.unwrap_or_default().iter();
        let generation_hints = generation_hints.map(|&r| r as usize);
        let context_hints = self.context_hints().iter().map(|c| c.req as usize);
        let entries = generation
            .zip(generation_hints.chain(std::iter::repeat(usize::MAX)))
            .map(|((id, pos, count), hint)| (id, pos, count, hint))
            .chain(
                source
                    .context_ids
                    .iter()
                    .zip(source.context_starts)
                    .zip(source.context_lens)
                    .zip(context_hints.chain(std::iter::repeat(usize::MAX)))
                    .map(|(((&id, &start), &len), hint)| (id, start, len, hint)),
            );
        let ledger = self.ledger;
        for (id, start, count, hint) in entries {
            let request = ledger.request_hinted(hint, id)?;
            let end = start.saturating_add(count);
            if end > request.len() {
                return Err(unreserved(id, start, end, request.len()));
            }
            furthest = furthest.max(end);
            widest = widest.max(request.table().len());
            requests.push(request.table());
        }
        check_word(furthest, "position")?;
        if widest > columns {
            let id = source
                .generation_ids
                .iter()
                .chain(source.context_ids)
                .zip(&requests)
                .find(|(_, table)| table.len() == widest)
                .map_or(0, |(&id, _)| id);
            return Err(CoreError::InvalidLength(format!(
                "request {id} holds {widest} superblocks, wider than the layout's {columns} columns"
            )));
        }
        // The local and past-seen lengths are this rank's, computed from the positions as
        // they are written (see `Writer::entries`): at most one past the furthest position,
        // checked above.
        Ok((requests, widest))
    }

    /// Fails unless `source` is the pending step, as this scheduler made it (its digest).
    fn check_pending(&self, source: &StepSource<'_>) -> Result<()> {
        let step = source.step;
        let newest = self.newest;
        match newest {
            Some(newest) if newest.step == step && source.digest != newest.digest => {
                Err(CoreError::InvalidState(format!(
                    "the output of step {step} given is not this scheduler's (its digest is \
                     0x{:016x}, this scheduler's output of step {step} has 0x{:016x}): write the \
                     output of this scheduler's own schedule()",
                    source.digest, newest.digest
                )))
            }
            Some(newest) if newest.step == step => Ok(()),
            _ => Err(CoreError::InvalidState(format!(
                "the metadata of step {} was asked for, but {}",
                step,
                newest.map_or_else(
                    || "no step is pending".to_string(),
                    |newest| format!("step {} is the pending one", newest.step)
                )
            ))),
        }
    }

    /// The request index (its ledger entry) of each generation entry of the newest pending
    /// step: where the writers look for each entry's holdings first.
    fn generation_hints(&self) -> &'a [RequestIndex] {
        self.newest.map_or(&[], |newest| &newest.generation_reqs)
    }

    /// The context entries of the newest pending step (their requests' indices are the
    /// hints of the chunks).
    fn context_hints(&self) -> &'a [ContextEntry] {
        self.newest.map_or(&[], |newest| &newest.context)
    }
}

/// The tables of a step's entries checked so far, in entry order (see
/// [`WriterView::entry_tables`]): the furthest end and the widest table among them.
struct EntryTables<'a> {
    tables: Vec<&'a [SuperblockId]>,
    furthest: u64,
    widest: usize,
}

/// Writes the sections of one step (everything checked before).
struct Writer<'a> {
    layout: &'a StepMetadataLayout,
    buffer: &'a mut [i32],
    placement: Layout,
    rank: u32,
}

impl Writer<'_> {
    /// The first `len` words of int32 section `index`.
    fn section(&mut self, index: usize, len: usize) -> &mut [i32] {
        let offset = self.layout.sections[index].offset_words;
        &mut self.buffer[offset..offset + len]
    }

    fn header(&mut self, m: &StepMetadata) {
        let [low, high] = wide_words(i64::from_ne_bytes(m.step.to_ne_bytes()));
        let counts = [
            m.num_tokens,
            m.num_entries,
            m.num_generation,
            m.num_samples,
            m.table_width_used,
            m.num_draft_tokens,
        ];
        let header = self.section(HEADER, HEADER_WORDS);
        header[0] = low;
        header[1] = high;
        for (dst, &count) in header[2..].iter_mut().zip(&counts) {
            *dst = word(count as u64);
        }
    }

    /// Token ids and positions: generation inputs, then the context chunks.
    fn tokens(&mut self, s: &StepSource<'_>) {
        let g = s.generation_ids.len();
        let n = g + s.context_token_ids.len();
        let ids = self.section(TOKEN_IDS, n);
        ids[..g].copy_from_slice(s.generation_input_tokens);
        ids[g..].copy_from_slice(s.context_token_ids);
        let positions = self.section(POSITIONS, n);
        for (dst, &pos) in positions.iter_mut().zip(s.generation_positions) {
            *dst = word(pos);
        }
        let mut rest = positions[g..].iter_mut();
        for (&start, &len) in s.context_starts.iter().zip(s.context_lens) {
            // The range first: `zip` stops on it without taking one more from `rest`.
            for (pos, dst) in (start..start + len).zip(rest.by_ref()) {
                *dst = word(pos);
            }
        }
    }

    /// Query starts, local and past-seen lengths, batch slots and sample rows.
    fn entries(&mut self, s: &StepSource<'_>) {
        let g = s.generation_ids.len();
        let e = g + s.context_ids.len();
        let placement = self.placement;
        let rank = self.rank;
        let starts = self.section(QUERY_START, e + 1);
        for (i, dst) in starts[..=g].iter_mut().enumerate() {
            *dst = word(i as u64);
        }
        let mut offset = g as u64;
        for (dst, &len) in starts[g + 1..].iter_mut().zip(s.context_lens) {
            offset += len;
            *dst = word(offset);
        }
        // A generation entry's lengths are this rank's, from its position (not the output's
        // per-rank arrays: an output of another rank has the same step and digest), both
        // sections in one pass.
        let (local_at, past_at) = (
            self.layout.sections[LOCAL_LENS].offset_words,
            self.layout.sections[PAST_SEEN_LENS].offset_words,
        );
        debug_assert!(local_at + e <= past_at);
        let (front, back) = self.buffer.split_at_mut(past_at);
        generation_lengths(
            &mut front[local_at..local_at + g],
            &mut back[..g],
            s.generation_positions,
            placement,
            rank,
        );
        let local = self.section(LOCAL_LENS, e);
        for ((dst, &start), &len) in local[g..]
            .iter_mut()
            .zip(s.context_starts)
            .zip(s.context_lens)
        {
            *dst = word(placement.local_len(start + len, rank));
        }
        let past = self.section(PAST_SEEN_LENS, e);
        for (dst, &start) in past[g..].iter_mut().zip(s.context_starts) {
            *dst = word(placement.local_len(start, rank));
        }
        let slots = self.section(BATCH_SLOTS, e);
        slots[..g].copy_from_slice(s.generation_batch_slots);
        slots[g..].copy_from_slice(s.context_batch_slots);
        let samples = self.section(SAMPLE_ROWS, e);
        for (i, dst) in samples[..g].iter_mut().enumerate() {
            *dst = word(i as u64);
        }
        let mut row = g as u64;
        let mut next = samples[g..].iter_mut();
        for (&len, &completes) in s.context_lens.iter().zip(s.context_completes) {
            row += len;
            if completes {
                if let Some(dst) = next.next() {
                    *dst = word(row - 1);
                }
            }
        }
    }

    /// This rank's KV slot of every token (int64), -1 where another rank owns it.
    fn slot_mapping(&mut self, s: &StepSource<'_>, tables: &[&[SuperblockId]]) {
        let placement = self.placement;
        let rank = self.rank;
        let tpb = u64::from(placement.tokens_per_block());
        let per_block = Divisor::new(tpb);
        let per_superblock = Divisor::new(placement.tokens_per_superblock());
        let cp = Divisor::new(u64::from(placement.cp()));
        let g = s.generation_ids.len();
        let n = g + s.context_token_ids.len();
        let offset = self.layout.sections[SLOT_MAPPING].offset_words;
        let out = &mut self.buffer[offset..offset + 2 * n];
        let slot = |table: &[u32], pos: u64| -> i64 {
            let page = page_id(table[to_usize(per_superblock.div(pos))]);
            i64::from(page) * i64::from(placement.tokens_per_block())
                + i64::from(word(per_block.rem(pos)))
        };
        let (gen_out, ctx_out) = out.split_at_mut(2 * g);
        let positions = s.generation_positions;
        if let Some(split) = SplitByShifts::of(placement) {
            generation_slots(gen_out, positions, tables, tpb, split, rank);
        } else {
            let split = SplitByDivisions::of(placement);
            generation_slots(gen_out, positions, tables, tpb, split, rank);
        }
        let mut rest = ctx_out.chunks_exact_mut(2);
        for ((&start, &len), &table) in s
            .context_starts
            .iter()
            .zip(s.context_lens)
            .zip(&tables[g..])
        {
            let mut pos = start;
            let end = start + len;
            // Block by block: one owner test per page, not per token.
            while pos < end {
                let block_end = (per_block.div(pos) + 1) * tpb;
                let run = block_end.min(end) - pos;
                let owned = cp.rem(per_block.div(pos)) == u64::from(rank);
                let mut next = if owned { slot(table, pos) } else { -1 };
                for dst in rest.by_ref().take(to_usize(run)) {
                    dst.copy_from_slice(&wide_words(next));
                    if owned {
                        next += 1;
                    }
                }
                pos += run;
            }
        }
    }

    /// One row per entry: its superblocks (= page ids), -1 padded to the layout's width.
    fn block_table(&mut self, tables: &[&[SuperblockId]]) {
        let width = self.layout.table_width;
        let table = self.section(BLOCK_TABLE, tables.len() * width);
        if width == 0 {
            return;
        }
        // One fill of the whole table, then each row's pages over it: a fill per row is a
        // `memset` call per row, which cost more than the rows themselves.
        table.fill(-1);
        for (row, &held) in table.chunks_exact_mut(width).zip(tables) {
            copy_pages(&mut row[..held.len()], held);
        }
    }
}

/// This rank's local and past-seen lengths of the generation entries at `positions`, as
/// the scheduler's decode path computed them.
fn generation_lengths(
    local: &mut [i32],
    past: &mut [i32],
    positions: &[u64],
    layout: Layout,
    rank: u32,
) {
    fn fill<S: PositionSplit>(
        local: &mut [i32],
        past: &mut [i32],
        positions: &[u64],
        split: S,
        rank: u32,
    ) {
        for ((local, past), &pos) in local.iter_mut().zip(past).zip(positions) {
            let placed = split.place(pos, rank);
            *local = word(placed.local_len);
            *past = word(placed.past_seen_len);
        }
    }
    if let Some(split) = SplitByShifts::of(layout) {
        fill(local, past, positions, split, rank);
    } else {
        fill(local, past, positions, SplitByDivisions::of(layout), rank);
    }
}

/// The int64 KV slots (two words each) of the generation entries at `positions`, whose
/// superblock tables are `tables`: -1 where another rank than `rank` owns the token
/// (everything checked).
fn generation_slots<S: PositionSplit>(
    out: &mut [i32],
    positions: &[u64],
    tables: &[&[SuperblockId]],
    tokens_per_block: u64,
    split: S,
    rank: u32,
) {
    let tpb = i64::from(word(tokens_per_block));
    for ((dst, &pos), table) in out.chunks_exact_mut(2).zip(positions).zip(tables) {
        let value = if split.place(pos, rank).owner == rank {
            i64::from(page_id(table[split.superblock(pos)])) * tpb
                + i64::from(split.block_offset(pos))
        } else {
            -1
        };
        dst.copy_from_slice(&wide_words(value));
    }
}

/// The per-row layout of decode-only step metadata ([`Scheduler::write_decode_rows`]): one
/// int32 row per generation entry, the columns below in this order, then the block table
/// (superblock = page ids, -1 padded to the row's width). Row `i` is the `i`-th generation
/// entry of the step, which is also its sample row; with drafts, each entry has `1 + drafts`
/// consecutive rows (its decode token, then each draft), which are its sample rows. The column order is written here once;
/// the Python binding exposes it (`helix_kv._core.DECODE_ROW_COLUMNS`) and the executor's
/// `DecodeLayout` reads its column indices from there.
pub mod decode_row {
    /// The input token, or -1 while it is still in flight (then `INPUT_REF` says where).
    pub const TOKEN_ID: usize = 0;
    /// The global position of the token.
    pub const POSITION: usize = 1;
    /// This rank's KV slot of the token (`page * tokens_per_block + offset`), -1 where
    /// another rank owns it.
    pub const SLOT: usize = 2;
    /// Tokens this rank holds of the request after the step.
    pub const LOCAL_LEN: usize = 3;
    /// Tokens this rank held before the step.
    pub const PAST_SEEN_LEN: usize = 4;
    /// `generation_input_refs`: the previous step's sample row whose token is this row's
    /// input (a step planned one step ahead), -1 when the token is known.
    pub const INPUT_REF: usize = 5;
    /// The first block-table column (the columns before it are the fixed ones).
    pub const BLOCK_TABLE: usize = 6;
    /// The fixed columns' names, in column order (the block table follows them).
    pub const NAMES: [&str; BLOCK_TABLE] = [
        "token_id",
        "position",
        "slot",
        "local_len",
        "past_seen_len",
        "input_ref",
    ];
    /// A padding row's fixed columns: no token, no KV write, nothing to attend to, nothing
    /// in flight.
    pub const PADDING: [i32; BLOCK_TABLE] = [0, 0, -1, 0, 0, -1];
}

/// The counts of one decode-only step written by [`Scheduler::write_decode_rows`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeRowCounts {
    /// The step written.
    pub step: u64,
    /// Rows written: the generation entries, `0..rows` (with drafts, one row per query
    /// token: each entry's decode token, then its drafts).
    pub rows: usize,
    /// Rows written up to: `rows..padded_to` are padding rows ([`decode_row::PADDING`]).
    pub padded_to: usize,
    /// Rows whose input token is still in flight (`INPUT_REF >= 0`).
    pub in_flight: usize,
    /// The widest table among the rows, in superblocks (block-table columns past it are -1).
    pub table_width_used: usize,
}

/// The checks of [`Scheduler::write_decode_rows`] that need no ledger: a decode-only step
/// whose arrays fit together, rows with the fixed columns, a buffer of whole rows holding
/// the step and its padding, input references of -1 or more. Returns the inputs in flight.
fn check_decode_shapes(
    source: &StepSource<'_>,
    buffer_words: usize,
    width: usize,
    pad_to: usize,
) -> Result<usize> {
    if !source.context_ids.is_empty() {
        return Err(CoreError::InvalidArgument(format!(
            "step {} has {} context chunks: decode rows take decode-only steps",
            source.step,
            source.context_ids.len()
        )));
    }
    if width < decode_row::BLOCK_TABLE {
        return Err(CoreError::InvalidArgument(format!(
            "a decode row of {width} columns lacks the {} fixed ones",
            decode_row::BLOCK_TABLE
        )));
    }
    if buffer_words % width != 0 {
        return Err(CoreError::InvalidLength(format!(
            "a buffer of {buffer_words} words is not whole rows of {width}"
        )));
    }
    let g = generation_len(source)?;
    let capacity = buffer_words / width;
    if g.max(pad_to) > capacity {
        return Err(CoreError::InvalidLength(format!(
            "step {} has {g} decode rows (padded to {pad_to}); the buffer holds {capacity}",
            source.step
        )));
    }
    // Two plain folds, vectorized on the baseline x86-64 (a 32-bit `min` is not): whether
    // any reference is below -1 (the error names the lowest), and those in flight.
    let refs = source.generation_input_refs;
    if refs.iter().fold(0u32, |acc, &r| acc | u32::from(r < -1)) != 0 {
        let lowest = refs.iter().fold(-1, |low, &r| low.min(r));
        return Err(CoreError::InvalidArgument(format!(
            "input reference {lowest} is neither a sample row nor -1"
        )));
    }
    Ok(refs.iter().filter(|&&r| r >= 0).count())
}

/// `dst[i] = page_id(table[i])` for tables of the same length, inline: a decode row holds a
/// few superblocks, and a `memcpy` call per row (what a plain loop becomes) costs more than
/// the copy.
fn copy_pages(dst: &mut [i32], table: &[SuperblockId]) {
    let mut from = table.chunks_exact(4);
    let mut to = dst.chunks_exact_mut(4);
    for (d, s) in (&mut to).zip(&mut from) {
        d.copy_from_slice(&[page_id(s[0]), page_id(s[1]), page_id(s[2]), page_id(s[3])]);
    }
    match (to.into_remainder(), from.remainder()) {
        ([d0], [s0]) => *d0 = page_id(*s0),
        ([d0, d1], [s0, s1]) => [*d0, *d1] = [page_id(*s0), page_id(*s1)],
        ([d0, d1, d2], [s0, s1, s2]) => {
            [*d0, *d1, *d2] = [page_id(*s0), page_id(*s1), page_id(*s2)];
        }
        _ => {}
    }
}

/// What [`Scheduler::write_decode_rows`] checked: the rows, where their superblock tables
/// are, and the counts.
struct CheckedRows<'s> {
    rows: usize,
    /// Each row's table where the rows were looked up by id; `None` where every row's
    /// request sits at its hint (the table is read there again as the row is written).
    tables: Option<Vec<&'s [SuperblockId]>>,
    in_flight: usize,
    table_width_used: usize,
}

/// The superblock tables of the rows of a decode step (checked as
/// [`Scheduler::write_decode_rows`] says), the widest one's length, and the furthest
/// position.
struct RowTables<'s> {
    tables: Vec<&'s [SuperblockId]>,
    widest: usize,
    furthest: u64,
}

/// What the row checks read besides the rows: the row's columns for superblocks and
/// tokens per superblock. A row's superblock must be held whichever rank owns its token:
/// every rank holds the same superblocks (the group's ledgers are mirrored), and a
/// reserved position always lies in one (so a request reserved up to the position passes
/// on every rank alike).
#[derive(Clone, Copy)]
struct RowBounds {
    columns: usize,
    tokens_per_superblock: u64,
}

/// [`RowTables`] of the rows `ids` (positions `positions`) taken at the
/// ledger entries `hints` (the scheduler's own index of each request), every row's checks
/// folded into one flag rather than a branch each. `None` where a hint is missing or does
/// not hold its request, or a row fails a check: [`WriterView::row_tables_in_order`] then
/// looks the requests up and names the first failure. Kept out of line, so the loop holds
/// its values in registers.
#[inline(never)]
fn hinted_row_tables<'s>(
    ledger: &'s crate::ledger::Ledger,
    ids: &[RequestId],
    hints: &[u32],
    positions: &[u64],
    bounds: RowBounds,
) -> Option<RowTables<'s>> {
    let g = ids.len();
    let (hints, positions) = (hints.get(..g)?, positions.get(..g)?);
    let (mut failed, mut furthest, mut widest) = (false, 0u64, 0usize);
    // One element per row from an iterator of known length: no capacity test per row.
    let mut tables = Vec::with_capacity(g);
    tables.extend((0..g).map(|i| {
        // A hint that does not hold its request counts as no tokens reserved: it fails.
        let (reserved, table) = ledger
            .request_at(hints[i] as usize, ids[i])
            .map_or((0, &[][..]), |request| (request.len(), request.table()));
        let pos = positions[i];
        // `pos / tokens_per_superblock >= held`, as a product (no division).
        let held_tokens = (table.len() as u64).saturating_mul(bounds.tokens_per_superblock);
        #[expect(
            clippy::needless_bitwise_bool,
            reason = "every check of the row, without a branch each"
        )]
        let row_failed = (pos >= reserved) | (table.len() > bounds.columns) | (pos >= held_tokens);
        failed |= row_failed;
        furthest = furthest.max(pos);
        widest = widest.max(table.len());
        table
    }));
    (!failed).then_some(RowTables {
        tables,
        widest,
        furthest,
    })
}

/// The widest table of the rows `ids` (positions `positions`) whose requests sit at the
/// ledger entries `hints`, and a position at least the furthest one (the furthest itself
/// where a word might not hold it), checked as [`hinted_row_tables`] checks them but
/// reading each request's record alone (its table is read as the row is written, through
/// [`Hinted`]): no table collected, no allocation. `superblock` is a position's superblock
/// (its index in the table). `None` where [`hinted_row_tables`] would give `None`. Kept out
/// of line, so the loop holds its values in registers.
#[inline(never)]
fn hinted_row_check(
    ledger: &crate::ledger::Ledger,
    ids: &[RequestId],
    hints: &[u32],
    positions: &[u64],
    columns: usize,
    superblock: impl Fn(u64) -> u64,
) -> Option<(usize, u64)> {
    let g = ids.len();
    let (hints, positions) = (hints.get(..g)?, positions.get(..g)?);
    let (mut failed, mut any_bits, mut widest) = (false, 0u64, 0u32);
    for ((&id, &hint), &pos) in ids.iter().zip(hints).zip(positions) {
        // A vacant entry holds no tokens (and whatever id): its row fails.
        let (held_id, reserved, held) = ledger.holding_at(hint as usize)?;
        #[expect(
            clippy::needless_bitwise_bool,
            reason = "every check of the row, without a branch each"
        )]
        let row_failed = (held_id != id) | (pos >= reserved) | (superblock(pos) >= u64::from(held));
        failed |= row_failed;
        any_bits |= pos;
        widest = widest.max(held);
    }
    let widest = widest as usize;
    // The positions ORed together are at least the furthest and below twice it: under
    // 2^30 every position and local length fits a word (what the bound is checked for),
    // else the furthest is taken exactly.
    let furthest = if any_bits < 1 << 30 {
        any_bits
    } else {
        positions.iter().copied().max().unwrap_or(0)
    };
    (!failed && widest <= columns).then_some((widest, furthest))
}

/// The superblock tables of the decode rows, as [`write_rows`] writes them: each row's
/// found from its key.
trait TableSource<'s>: Copy {
    type Key: Copy + 's;
    /// Each row's key, in row order.
    fn keys(self) -> &'s [Self::Key];
    /// Writes the table of the row keyed `key` into its block-table cells `cells` (which
    /// it fits: checked), -1 (`pad`) in the cells past it, and returns the table.
    fn write_cells(self, key: Self::Key, cells: &mut [i32], pad: i32) -> &'s [SuperblockId];
}

/// The tables the rows were checked with, collected: each row's key is its table.
#[derive(Clone, Copy)]
struct Collected<'s>(&'s [&'s [SuperblockId]]);

impl<'s> TableSource<'s> for Collected<'s> {
    type Key = &'s [SuperblockId];
    fn keys(self) -> &'s [Self::Key] {
        self.0
    }
    #[inline]
    fn write_cells(self, table: Self::Key, cells: &mut [i32], pad: i32) -> &'s [SuperblockId] {
        write_table_cells(cells, table, pad)
    }
}

/// The tables at the rows' ledger entries: each row's key is its hint (every row's request
/// found there: checked).
#[derive(Clone, Copy)]
struct Hinted<'s> {
    ledger: &'s crate::ledger::Ledger,
    hints: &'s [u32],
}

impl<'s> TableSource<'s> for Hinted<'s> {
    type Key = u32;
    fn keys(self) -> &'s [u32] {
        self.hints
    }
    #[expect(
        clippy::inline_always,
        reason = "measured: a call per row (what `#[inline]` gives) costs ~0.4 ns a row"
    )]
    #[inline(always)]
    fn write_cells(self, hint: u32, cells: &mut [i32], pad: i32) -> &'s [SuperblockId] {
        self.ledger.write_table_row_at(hint as usize, cells, pad)
    }
}

/// Where a position lies: its superblock (index in the request's table), its offset in
/// its block, and its decode placement seen from a rank (owner, local and past-seen
/// lengths: [`Placement::decode`], as the scheduler's decode path computed them).
trait PositionSplit: Copy {
    fn superblock(self, pos: u64) -> usize;
    fn block_offset(self, pos: u64) -> i32;
    fn place(self, pos: u64, rank: u32) -> DecodePlacement;
}

/// [`PositionSplit`] by shifts and a mask: tokens per block and per superblock powers of
/// two (the usual layouts).
#[derive(Clone, Copy)]
struct SplitByShifts {
    superblock_shift: u32,
    block_shift: u32,
    block_mask: u64,
}

impl SplitByShifts {
    /// The split of `layout`'s positions, if its block and superblock are powers of two.
    fn of(layout: Layout) -> Option<Self> {
        let (tpb, tps) = (layout.tokens_per_block(), layout.tokens_per_superblock());
        (tpb.is_power_of_two() && tps.is_power_of_two()).then(|| Self {
            superblock_shift: tps.trailing_zeros(),
            block_shift: tpb.trailing_zeros(),
            block_mask: u64::from(tpb - 1),
        })
    }
}

impl PositionSplit for SplitByShifts {
    fn superblock(self, pos: u64) -> usize {
        to_usize(pos >> self.superblock_shift)
    }
    fn block_offset(self, pos: u64) -> i32 {
        word(pos & self.block_mask)
    }
    fn place(self, pos: u64, rank: u32) -> DecodePlacement {
        Placement::decode_shifted(self.block_shift, self.superblock_shift, pos, rank)
    }
}

/// [`PositionSplit`] by divisions, for any layout.
#[derive(Clone, Copy)]
struct SplitByDivisions {
    per_superblock: Divisor,
    per_block: Divisor,
    placement: Placement,
}

impl SplitByDivisions {
    fn of(layout: Layout) -> Self {
        Self {
            per_superblock: Divisor::new(layout.tokens_per_superblock()),
            per_block: Divisor::new(layout.tokens_per_block().into()),
            placement: Placement::new(layout),
        }
    }
}

impl PositionSplit for SplitByDivisions {
    fn superblock(self, pos: u64) -> usize {
        to_usize(self.per_superblock.div(pos))
    }
    fn block_offset(self, pos: u64) -> i32 {
        word(self.per_block.rem(pos))
    }
    fn place(self, pos: u64, rank: u32) -> DecodePlacement {
        self.placement.decode_general(pos, rank)
    }
}

/// Writes the decode rows `written` (`width` words each) of the generation entries of
/// `source` (everything checked), this rank being `rank`, each cell once: row `i`'s
/// block-table cells (its table's pages, then -1) by `tables` from its key, then its
/// fixed columns. Kept out of line, so the loop holds its values in registers.
#[inline(never)]
fn write_rows<'s, S: PositionSplit, T: TableSource<'s>>(
    written: &mut [i32],
    width: usize,
    tables: T,
    source: &StepSource<'_>,
    tokens_per_block: i32,
    split: S,
    rank: u32,
) {
    // -1, unknown to the optimizer: a fill of a row's few unused block-table columns with
    // a known value becomes a `memset` call per row, which costs more than the stores.
    let pad = std::hint::black_box(-1);
    let rows = written
        .chunks_exact_mut(width)
        .zip(tables.keys())
        .zip(source.generation_input_tokens)
        .zip(source.generation_positions)
        .zip(source.generation_input_refs);
    for ((((row, &key), &token), &pos), &input_ref) in rows {
        let (fixed, cells) = row.split_at_mut(decode_row::BLOCK_TABLE);
        // The owner and lengths are this rank's, from the position, as the scheduler's
        // decode path computed them (not the output's per-rank arrays: an output of
        // another rank has the same step and digest).
        let placed = split.place(pos, rank);
        // The columns known before the table is read, stored first: fewer values held
        // across the table's write.
        fixed[decode_row::TOKEN_ID] = token;
        fixed[decode_row::POSITION] = word(pos);
        fixed[decode_row::LOCAL_LEN] = word(placed.local_len);
        fixed[decode_row::PAST_SEEN_LEN] = word(placed.past_seen_len);
        fixed[decode_row::INPUT_REF] = input_ref;
        let table = tables.write_cells(key, cells, pad);
        // Checked: a row this rank owns holds the superblock of its position, and every
        // slot of the pool fits an int32 word.
        fixed[decode_row::SLOT] = match table.get(split.superblock(pos)) {
            Some(&superblock) if placed.owner == rank => {
                page_id(superblock) * tokens_per_block + split.block_offset(pos)
            }
            _ => -1,
        };
    }
}

impl<'a> WriterView<'a> {
    /// [`Scheduler::write_decode_rows`]: this rank's decode rows of the pending decode-only
    /// step `source`, checked whole before the first word of `buffer` is written.
    pub fn write_decode_rows(
        &self,
        source: StepSource<'_>,
        buffer: &mut [i32],
        width: usize,
        pad_to: usize,
    ) -> Result<DecodeRowCounts> {
        if has_drafts(&source) {
            // One row per query token: the decode token, then each draft, each row with its
            // own position, slot and local length (the causal mask inside the draft).
            let rows = DraftRows::of(&source)?;
            return self.write_decode_rows(rows.source(&source), buffer, width, pad_to);
        }
        let checked = self.check_decode_source(&source, buffer.len(), width, pad_to)?;
        let rows = checked.rows;
        let (written, padding) = buffer.split_at_mut(rows * width);
        let tpb = word(self.layout.tokens_per_block().into());
        let rank = self.rank;
        let hinted = Hinted {
            ledger: self.ledger,
            hints: self.generation_hints(),
        };
        match (SplitByShifts::of(self.layout), checked.tables.as_deref()) {
            (Some(split), None) => write_rows(written, width, hinted, &source, tpb, split, rank),
            (Some(split), Some(tables)) => {
                let tables = Collected(tables);
                write_rows(written, width, tables, &source, tpb, split, rank);
            }
            (None, None) => {
                let split = SplitByDivisions::of(self.layout);
                write_rows(written, width, hinted, &source, tpb, split, rank);
            }
            (None, Some(tables)) => {
                let split = SplitByDivisions::of(self.layout);
                write_rows(written, width, Collected(tables), &source, tpb, split, rank);
            }
        }
        let padded_to = pad_to.max(rows);
        for row in padding[..(padded_to - rows) * width].chunks_exact_mut(width) {
            row[..decode_row::BLOCK_TABLE].copy_from_slice(&decode_row::PADDING);
        }
        Ok(DecodeRowCounts {
            step: source.step,
            rows,
            padded_to,
            in_flight: checked.in_flight,
            table_width_used: checked.table_width_used,
        })
    }

    /// Every check of [`Self::write_decode_rows`]; the superblock table of each row, and the
    /// counts.
    fn check_decode_source(
        &self,
        source: &StepSource<'_>,
        buffer_words: usize,
        width: usize,
        pad_to: usize,
    ) -> Result<CheckedRows<'a>> {
        self.check_pending(source)?;
        let in_flight = check_decode_shapes(source, buffer_words, width, pad_to)?;
        // Every slot of the pool fits an int32 word, or none is written.
        let slots = u64::from(self.ledger.capacity()) * u64::from(self.layout.tokens_per_block());
        check_word(slots.saturating_sub(1), "KV slot")?;
        let bounds = RowBounds {
            columns: width - decode_row::BLOCK_TABLE,
            tokens_per_superblock: self.layout.tokens_per_superblock(),
        };
        // Each row's holdings, found through the scheduler's own index of the request (its
        // ledger entry) where that still names it: no id lookup on the common path.
        // Where every row's request sits at its hint, its table is read there again as
        // the row is written: nothing collected.
        let per_superblock = Divisor::new(bounds.tokens_per_superblock);
        let hinted = hinted_row_check(
            self.ledger,
            source.generation_ids,
            self.generation_hints(),
            source.generation_positions,
            bounds.columns,
            |pos| per_superblock.div(pos),
        );
        let (tables, widest, furthest) = if let Some((widest, furthest_bound)) = hinted {
            (None, widest, furthest_bound)
        } else {
            let rows = self.row_tables_in_order(source, bounds)?;
            (Some(rows.tables), rows.widest, rows.furthest)
        };
        // The rows' local and past-seen lengths are this rank's, computed from the
        // positions as they are written (see `write_rows`). A local length counts the
        // rank's tokens up to its position, so it grows with the position: the furthest
        // row's is the largest, and a past-seen length is at most its row's local one.
        // (Where the rows were checked at their hints, `furthest` may be a bound above
        // the furthest position that fits a word with its local length: the check passes
        // as it would for the furthest.)
        let longest = self.placement.decode(furthest, self.rank).local_len;
        check_word(longest.max(furthest), "position or local length")?;
        Ok(CheckedRows {
            rows: source.generation_ids.len(),
            tables,
            in_flight,
            table_width_used: widest,
        })
    }

    /// [`RowTables`] of the rows of `source`, checked one by one in row order: the first
    /// failure is the error (an unknown request, a position not reserved, a table wider than
    /// the row's columns, or the superblock of an owned position not held). For rows whose
    /// hints do not all hold their requests, or that failed [`hinted_row_tables`].
    #[cold]
    fn row_tables_in_order(
        &self,
        source: &StepSource<'_>,
        bounds: RowBounds,
    ) -> Result<RowTables<'a>> {
        let per_superblock = Divisor::new(bounds.tokens_per_superblock);
        let hints = self
            .generation_hints()
            .iter()
            .map(|&r| r as usize)
            .chain(std::iter::repeat(usize::MAX));
        let ledger = self.ledger;
        let mut tables = Vec::with_capacity(source.generation_ids.len());
        let (mut furthest, mut widest) = (0u64, 0usize);
        let entries = source
            .generation_ids
            .iter()
            .zip(hints)
            .zip(source.generation_positions);
        for ((&id, hint), &pos) in entries {
            let request = ledger.request_hinted(hint, id)?;
            if pos >= request.len() {
                return Err(unreserved(id, pos, pos + 1, request.len()));
            }
            let table = request.table();
            if table.len() > bounds.columns {
                return Err(CoreError::InvalidLength(format!(
                    "request {id} holds {} superblocks, wider than the row's {} columns",
                    table.len(),
                    bounds.columns
                )));
            }
            // The slot is computed while the row is written (where the table is read for
            // its cells anyway); here only that its superblock is held.
            if to_usize(per_superblock.div(pos)) >= table.len() {
                return Err(unreserved(id, pos, pos + 1, request.len()));
            }
            furthest = furthest.max(pos);
            widest = widest.max(table.len());
            tables.push(table);
        }
        Ok(RowTables {
            tables,
            widest,
            furthest,
        })
    }
}

/// Whether a step's generation entries verify drafts.
fn has_drafts(source: &StepSource<'_>) -> bool {
    source
        .generation_draft_counts
        .iter()
        .any(|&count| count != 0)
}

/// The draft counts of `source` checked against its entries and tokens; the total.
fn checked_draft_total(source: &StepSource<'_>) -> Result<usize> {
    let g = source.generation_ids.len();
    if source.generation_draft_counts.len() != g {
        return Err(CoreError::InvalidArgument(
            "the generation arrays of the schedule output differ in length".into(),
        ));
    }
    let total = source
        .generation_draft_counts
        .iter()
        .try_fold(0u64, |acc, &n| acc.checked_add(n));
    if total != Some(source.generation_draft_tokens.len() as u64) {
        return Err(CoreError::InvalidArgument(
            "the draft counts do not add up to the draft tokens".into(),
        ));
    }
    Ok(source.generation_draft_tokens.len())
}

/// The generation entries of a step with drafts as one decode row per query token (ids,
/// positions, input tokens, input references and batch slots repeated or stepped), for
/// [`Scheduler::write_decode_rows`].
struct DraftRows {
    ids: Vec<RequestId>,
    positions: Vec<u64>,
    tokens: Vec<i32>,
    refs: Vec<i32>,
    slots: Vec<i32>,
}

impl DraftRows {
    fn of(source: &StepSource<'_>) -> Result<Self> {
        let g = generation_len(source)?;
        lengths_agree(g, &[source.generation_batch_slots.len()], "generation")?;
        let n = g + checked_draft_total(source)?;
        let mut rows = Self {
            ids: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            refs: Vec::with_capacity(n),
            slots: Vec::with_capacity(n),
        };
        let mut drafts = source.generation_draft_tokens.iter();
        for i in 0..g {
            let count = source.generation_draft_counts[i];
            let pos = source.generation_positions[i];
            let end = pos.checked_add(count).ok_or_else(|| {
                CoreError::InvalidLength(format!("position {pos} + {count} drafts overflow"))
            })?;
            rows.ids.push(source.generation_ids[i]);
            rows.positions.push(pos);
            rows.tokens.push(source.generation_input_tokens[i]);
            rows.refs.push(source.generation_input_refs[i]);
            rows.slots.push(source.generation_batch_slots[i]);
            for (draft_pos, &token) in (pos + 1..=end).zip(drafts.by_ref()) {
                rows.ids.push(source.generation_ids[i]);
                rows.positions.push(draft_pos);
                rows.tokens.push(token);
                rows.refs.push(-1);
                rows.slots.push(source.generation_batch_slots[i]);
            }
        }
        Ok(rows)
    }

    /// The rows as a step source without drafts (the step and digest of `source`).
    fn source<'a>(&'a self, source: &StepSource<'a>) -> StepSource<'a> {
        StepSource {
            generation_ids: &self.ids,
            generation_positions: &self.positions,
            generation_input_tokens: &self.tokens,
            generation_input_refs: &self.refs,
            generation_batch_slots: &self.slots,
            generation_draft_counts: &[],
            generation_draft_tokens: &[],
            ..*source
        }
    }
}

impl WriterView<'_> {
    /// [`Self::write_step_metadata`] of a step whose generation entries verify drafts: a
    /// generation entry is then `1 + drafts` query tokens (its input token, then its
    /// drafts, at consecutive positions) with its query start, this rank's KV slot of each,
    /// its local length after the last and its past-seen length before the first (the
    /// causal mask inside the draft is the positions'), and all its tokens are sampled.
    /// Checked whole before the first word is written, as the plain form is.
    #[expect(
        clippy::too_many_lines,
        reason = "one straight pass per section, in buffer order; the plain form splits them for speed"
    )]
    fn write_drafted_step_metadata(
        &self,
        source: &StepSource<'_>,
        layout: &StepMetadataLayout,
        buffer: &mut [i32],
    ) -> Result<StepMetadata> {
        self.check_pending(source)?;
        let drafts = checked_draft_total(source)?;
        check_shapes(source, layout, buffer.len(), drafts)?;
        let g = source.generation_ids.len();
        let num_tokens = g + drafts + source.context_token_ids.len();
        // Every entry as (id, first position, tokens), generation entries first.
        let generation = source
            .generation_ids
            .iter()
            .zip(source.generation_positions)
            .zip(source.generation_draft_counts)
            .map(|((&id, &pos), &count)| (id, pos, 1 + count));
        let checked = EntryTables {
            tables: Vec::with_capacity(g + source.context_ids.len()),
            furthest: 0,
            widest: 0,
        };
        let (tables, widest) =
            self.entry_tables(source, generation.clone(), checked, layout.table_width)?;
        let entries: Vec<(RequestId, u64, u64)> = generation
            .chain(
                source
                    .context_ids
                    .iter()
                    .zip(source.context_starts)
                    .zip(source.context_lens)
                    .map(|((&id, &start), &len)| (id, start, len)),
            )
            .collect();
        let completes = source.context_completes.iter().filter(|&&c| c).count();
        let metadata = StepMetadata {
            step: source.step,
            num_tokens,
            num_entries: entries.len(),
            num_generation: g,
            num_draft_tokens: drafts,
            num_samples: g + drafts + completes,
            table_width_used: widest,
        };
        let placement = self.layout;
        let rank = self.rank;
        let mut writer = Writer {
            layout,
            buffer,
            placement,
            rank,
        };
        writer.header(&metadata);
        // Tokens, positions and slots, entry after entry.
        let mut token_ids = Vec::with_capacity(num_tokens);
        let mut drafts_left = source.generation_draft_tokens.iter();
        for (i, &count) in source.generation_draft_counts.iter().enumerate() {
            token_ids.push(source.generation_input_tokens[i]);
            token_ids.extend(drafts_left.by_ref().take(to_usize(count)));
        }
        token_ids.extend_from_slice(source.context_token_ids);
        writer
            .section(TOKEN_IDS, num_tokens)
            .copy_from_slice(&token_ids);
        let positions = entries
            .iter()
            .flat_map(|&(_, start, count)| start..start + count);
        for (dst, pos) in writer
            .section(POSITIONS, num_tokens)
            .iter_mut()
            .zip(positions)
        {
            *dst = word(pos);
        }
        let tpb = u64::from(placement.tokens_per_block());
        let per_superblock = placement.tokens_per_superblock();
        let offset = layout.sections[SLOT_MAPPING].offset_words;
        let mut slots = writer.buffer[offset..offset + 2 * num_tokens].chunks_exact_mut(2);
        for (&(_, start, count), table) in entries.iter().zip(&tables) {
            for pos in start..start + count {
                let value = if placement.owner_rank(pos) == rank {
                    let page = page_id(table[to_usize(pos / per_superblock)]);
                    i64::from(page) * i64::from(placement.tokens_per_block())
                        + i64::from(word(pos % tpb))
                } else {
                    -1
                };
                if let Some(dst) = slots.next() {
                    dst.copy_from_slice(&wide_words(value));
                }
            }
        }
        // Query starts, lengths, batch slots and sample rows, entry after entry.
        let e = entries.len();
        let starts = writer.section(QUERY_START, e + 1);
        let mut at = 0u64;
        starts[0] = 0;
        for (dst, &(_, _, count)) in starts[1..].iter_mut().zip(&entries) {
            at += count;
            *dst = word(at);
        }
        let local = writer.section(LOCAL_LENS, e);
        for (dst, &(_, start, count)) in local.iter_mut().zip(&entries) {
            *dst = word(placement.local_len(start + count, rank));
        }
        let past = writer.section(PAST_SEEN_LENS, e);
        for (dst, &(_, start, _)) in past.iter_mut().zip(&entries) {
            *dst = word(placement.local_len(start, rank));
        }
        let batch = writer.section(BATCH_SLOTS, e);
        batch[..g].copy_from_slice(source.generation_batch_slots);
        batch[g..].copy_from_slice(source.context_batch_slots);
        // One per generation entry, its first row (its `1 + drafts` rows are all sampled),
        // then the last row of each chunk that completes its prompt.
        let samples = writer.section(SAMPLE_ROWS, g + completes);
        let mut row = 0u64;
        for (dst, &(_, _, count)) in samples[..g].iter_mut().zip(&entries) {
            *dst = word(row);
            row += count;
        }
        let mut next = samples[g..].iter_mut();
        for (&len, &done) in source.context_lens.iter().zip(source.context_completes) {
            row += len;
            if done {
                if let Some(dst) = next.next() {
                    *dst = word(row - 1);
                }
            }
        }
        writer.block_table(&tables);
        Ok(metadata)
    }
}
