//! `Scheduler` (one rank's preemptive, rank-invariant scheduler) and its metrics. One
//! crossing per `schedule()` and per `update()`; arrays in and out are numpy.

use helix_kv_core::ids::{page_id, superblock_count};
use helix_kv_core::{PreparedPrompt, Scheduler};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use crate::arrays::{flags, id_arg, int_arg, invalid_type_of, token_ids, u64_vec, Flags, TokenIds};
use crate::errors::{IntoPyResult, InvalidArgumentError, InvalidLengthError};
use crate::ledger::{block_table, slot_mapping};
use crate::records::{PyRequestMetrics, PySchedulerMetrics};
use crate::request_output::PyRequestOutput;
use crate::schedule_output::{PyScheduleOutput, SpareOutput};
use crate::scheduler_config::PySchedulerConfig;
use crate::step_metadata::{self, PyDecodeRowCounts, PyStepMetadata, PyStepMetadataLayout};

/// A request priority (int32), checked like every other integer argument (a keyword with
/// a default cannot be taken as a `Bound`, so it is its own type).
#[derive(Clone, Copy, Default)]
pub struct Priority(i32);

impl<'a, 'py> FromPyObject<'a, 'py> for Priority {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        int_arg::<i32>(
            &obj,
            "priority",
            "-2**31..=2**31-1",
            InvalidArgumentError::new_err,
        )
        .map(Self)
    }
}

/// `add_request`'s arguments, checked (in the order `add_request` checks them) and the
/// prompt prepared once, so an in-process group adds it to every rank's scheduler
/// ([`crate::rank_group::add_request_ranks`]) without checking or keying it again.
pub struct NewRequest {
    id: u64,
    prompt: PreparedPrompt,
    max_new_tokens: u32,
    priority: i32,
}

impl NewRequest {
    pub fn parse(
        request_id: &Bound<'_, PyAny>,
        prompt: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
        priority: Priority,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let salt = salt_arg(cache_salt)?;
        let id = id_arg(request_id)?;
        let prompt = token_ids(prompt, "prompt tokens")?;
        let max_new_tokens = int_arg::<u32>(
            max_new_tokens,
            "max_new_tokens",
            "1..=2**32-1",
            InvalidLengthError::new_err,
        )?;
        let Priority(priority) = priority;
        Ok(Self {
            id,
            prompt: PreparedPrompt::new(prompt.as_slice()?, &salt),
            max_new_tokens,
            priority,
        })
    }
}

/// Request ids out: uint64, the whole id range (an id is never shown as a negative int64).
pub fn ids_to_numpy(py: Python<'_>, ids: Vec<u64>) -> Bound<'_, PyArray1<u64>> {
    PyArray1::from_vec(py, ids)
}

/// One rank's scheduler. Every rank of a CP group builds one from the same configuration
/// (`config.with_rank(r)`) and feeds it the same calls; all decisions then agree.
#[pyclass(module = "helix_kv._core", name = "Scheduler")]
pub struct PyScheduler {
    inner: Scheduler,
    config: Py<PySchedulerConfig>,
    /// `config.fingerprint`, the seed of every digest, which each output carries.
    fingerprint: u64,
    /// Where this scheduler's outputs leave their buffers when Python drops them, for the
    /// next `schedule()` to build in (see [`SpareOutput`]).
    spare: SpareOutput,
}

#[pymethods]
impl PyScheduler {
    #[new]
    fn new(config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let config = config
            .cast::<PySchedulerConfig>()
            .map_err(|_| invalid_type_of("config", "a SchedulerConfig", config))?
            .clone();
        let inner = Scheduler::new(config.get().config()).py()?;
        Ok(Self {
            fingerprint: inner.config().fingerprint(),
            inner,
            config: config.unbind(),
            spare: SpareOutput::default(),
        })
    }

    /// The configuration.
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PySchedulerConfig> {
        self.config.clone_ref(py)
    }

    /// Queues a request behind every live one (its place in the queue is kept forever).
    /// `cache_salt` (a `str` or `bytes`, at most 4096 bytes): with prefix caching, the
    /// request shares cached KV only with requests of the same salt (a tenant, an adapter).
    #[pyo3(
        signature = (request_id, prompt, max_new_tokens, priority = Priority::default(), *, cache_salt = None),
        text_signature = "($self, request_id, prompt, max_new_tokens, priority=0, *, cache_salt=None)"
    )]
    fn add_request(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        prompt: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
        priority: Priority,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let request = NewRequest::parse(request_id, prompt, max_new_tokens, priority, cache_salt)?;
        self.add_new(&request)
    }

    /// Drops every cached superblock no request references (identically on every rank);
    /// returns how many. `InvalidStateError` while a step is pending. 0 without prefix
    /// caching.
    fn reset_prefix_cache(&mut self) -> PyResult<u32> {
        self.inner.reset_prefix_cache().py()
    }

    /// Decides the next step; allowed while one step is pending (one step ahead), not two.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyScheduleOutput> {
        self.schedule_step(py)
    }

    /// Applies the step that ran: one token per `sample_ids` entry (int32) and optional
    /// end-of-sequence flags (bools, or 0/1), one per token. With drafts (speculative
    /// decoding) a generation entry has `1 + drafts` rows, and `accepted` (one count per
    /// generation entry, `0..=drafts`; default none) says how many of its drafts were
    /// accepted: it keeps its first `accepted + 1` tokens, up to the first end-of-sequence.
    /// Returns the ids of requests that finished (uint64).
    #[pyo3(signature = (tokens, eos = None, accepted = None))]
    fn update<'py>(
        &mut self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        eos: Option<&Bound<'py, PyAny>>,
        accepted: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let (tokens, eos, accepted) = update_args(tokens, eos, accepted)?;
        let eos = eos.as_ref().map(|eos| eos.as_slice()).transpose()?;
        let finished = self.update_step(py, tokens.as_slice()?, eos, accepted.as_deref())?;
        Ok(ids_to_numpy(py, finished))
    }

    /// Proposes draft tokens for the next `schedule()` (speculative decoding): `counts[i]`
    /// drafts (at most `num_speculative_tokens`) for request `request_ids[i]`, their tokens
    /// concatenated in `tokens` (int32). Replaces earlier proposals; the next successful
    /// `schedule()` uses them (as many as fit: drafts give way first) and drops them.
    /// Identical on every rank, like every input. `UnknownRequestError` for an id that is not
    /// live, `InvalidArgumentError` for arrays that do not fit together, an id given twice
    /// or a count out of range; nothing changed.
    fn propose_drafts(
        &mut self,
        request_ids: &Bound<'_, PyAny>,
        counts: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = u64_vec(request_ids, "request ids", false)?;
        let counts = draft_counts(counts, "draft counts")?;
        let tokens = token_ids(tokens, "draft tokens")?;
        self.inner
            .propose_drafts(&ids, &counts, tokens.as_slice()?)
            .py()
    }

    /// How many times each draft position was accepted (uint64, `num_speculative_tokens`
    /// long; index 0 is the first draft after the decode token), over the steps that ran.
    fn spec_decode_accepted_per_position<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner
            .spec_decode_accepted_per_position()
            .into_pyarray(py)
    }

    /// Times the draft backoff (`draft_backoff_misses`) stopped a request's drafting, over
    /// the steps that ran.
    fn spec_decode_backoffs(&self) -> u64 {
        self.inner.spec_decode_backoffs()
    }

    /// Per id, whether the draft backoff keeps that live request from drafting in the next
    /// `schedule()` (bool array): its proposals would be ignored, so a drafter may skip it.
    /// `UnknownRequestError` for an id that is not live.
    fn drafts_paused<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let ids = u64_vec(request_ids, "request ids", false)?;
        let paused = ids
            .iter()
            .map(|&id| self.inner.draft_paused(id))
            .collect::<helix_kv_core::Result<Vec<bool>>>()
            .py()?;
        Ok(paused.into_pyarray(py))
    }

    /// Undoes the scheduled step that did not run (preemptions stay applied), then
    /// applies the aborts requested while it was pending. Returns their ids (uint64).
    fn revert<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let finished = self.inner.revert().map(<[u64]>::to_vec).py()?;
        Ok(ids_to_numpy(py, finished))
    }

    /// Aborts a request (valid in every state); returns whether it was live. An id with no
    /// live request (finished, or never added) is a no-op that returns False. While a step
    /// is pending the abort takes effect when it closes.
    fn abort(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.inner.abort(id_arg(request_id)?).py()
    }

    /// Aborts several requests (see `abort`); returns, per id, whether it was live when the
    /// call was made (bool array). Between steps they retire in queue order.
    fn abort_many<'py>(
        &mut self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let ids = u64_vec(request_ids, "request ids", false)?;
        let inner = &mut self.inner;
        let live = py.detach(|| inner.abort_many(&ids)).py()?;
        Ok(live.into_pyarray(py))
    }

    /// Whether an abort of this live request waits for the pending step to close.
    fn is_abort_requested(&self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.inner.is_abort_requested(id_arg(request_id)?).py()
    }

    /// The output of a finished request (tokens, finish reason, counters); each output
    /// is taken once.
    fn take_output(
        &mut self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<PyRequestOutput> {
        let output = self.inner.take_output(id_arg(request_id)?).py()?;
        Ok(PyRequestOutput::new(py, output))
    }

    /// Prompt (with folded tokens) plus generated tokens of a live request (int32).
    fn tokens<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let tokens = self.inner.tokens(id_arg(request_id)?).py()?;
        Ok(PyArray1::from_vec(py, tokens))
    }

    /// `"waiting"`, `"prefilling"`, `"decoding"` or `"suspended"`.
    fn request_state(&self, request_id: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        Ok(self.inner.request_state(id_arg(request_id)?).py()?.as_str())
    }

    /// Page-table rows of `request_ids` (int32, `[len(ids), width]`, -1 padded).
    #[pyo3(signature = (request_ids, width = None))]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        width: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        block_table(py, self.inner.ledger(), request_ids, width)
    }

    /// The tails of the page tables of `request_ids` past `starts` (one crossing for a
    /// whole step, for an engine that keeps each request's table and appends to it, as
    /// vLLM's model runner does): returns `(pages, counts)`, where `counts[i]` (int64) is
    /// `held - starts[i]` for request `request_ids[i]` holding `held` superblocks, and
    /// `pages` (int32) concatenates, in order, the superblocks `starts[i]..held` of each
    /// request with a positive count. A negative count says the table is shorter than
    /// `starts[i]` (rejected drafts gave a superblock back, or the request let go of its
    /// KV): the pages past its new end are no longer its own. `UnknownRequestError` for an
    /// id the ledger does not hold, `InvalidArgumentError` for arrays of different
    /// lengths; nothing is read before every id is checked.
    fn block_table_tails<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        starts: &Bound<'py, PyAny>,
    ) -> PyResult<TableTails<'py>> {
        let ids = u64_vec(request_ids, "request ids", false)?;
        let starts = u64_vec(starts, "starts", true)?;
        if ids.len() != starts.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "block_table_tails() got {} request ids and {} starts",
                ids.len(),
                starts.len()
            )));
        }
        let ledger = self.inner.ledger();
        let tables = ids
            .iter()
            .map(|&id| ledger.request(id).map(|request| request.table()))
            .collect::<helix_kv_core::Result<Vec<_>>>()
            .py()?;
        let mut counts = Vec::with_capacity(ids.len());
        let mut pages = Vec::new();
        for (table, &start) in tables.iter().zip(&starts) {
            counts.push(table_tail_count(table.len(), start));
            if let Some(tail) = usize::try_from(start).ok().and_then(|s| table.get(s..)) {
                pages.extend(tail.iter().map(|&page| page_id(page)));
            }
        }
        Ok((
            PyArray1::from_vec(py, pages),
            PyArray1::from_vec(py, counts),
        ))
    }

    /// The pages the tables of `request_ids` gained past what a reader holds, the reader's
    /// counts brought up to date in the same pass (an engine that keeps each request's
    /// table and appends to it, as vLLM's model runner does, crossing once a step):
    /// `held[id]` (int64, indexed by request id, writeable) is how many superblocks of
    /// request `id`'s table the reader holds. Returns `(pages, rows, counts)`: `rows`
    /// (int64) the positions in `request_ids` whose tables grew, `counts` (int64) by how
    /// many superblocks, `pages` (int32) the new superblocks of those rows one row after
    /// another; each grown `held[id]` becomes its table's length. Returns None, with
    /// nothing written, when some table is shorter than `held` says (rejected drafts gave
    /// a superblock back, or the request let go of its KV): `block_table_tails` tells
    /// then. `UnknownRequestError` for an id the ledger does not hold,
    /// `InvalidArgumentError` for an id past `held`'s end, a negative count, or a `held`
    /// that is not a writeable C-contiguous int64 array; nothing written then.
    fn grow_block_tables<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        held: &Bound<'py, PyAny>,
    ) -> PyResult<Option<TableGrowth<'py>>> {
        let ids = u64_vec(request_ids, "request ids", false)?;
        let held = held
            .cast::<PyArray1<i64>>()
            .map_err(|_| invalid_type_of("held", "an int64 numpy array", held))?;
        let mut held = held.try_readwrite().map_err(|_| {
            InvalidArgumentError::new_err("held must be writeable and not borrowed elsewhere")
        })?;
        let held = held
            .as_slice_mut()
            .map_err(|_| InvalidArgumentError::new_err("held must be C-contiguous"))?;
        let ledger = self.inner.ledger();
        let mut tables = Vec::with_capacity(ids.len());
        for &id in &ids {
            let table = ledger.request(id).py()?.table();
            let at = usize::try_from(id)
                .ok()
                .filter(|&at| at < held.len())
                .ok_or_else(|| {
                    InvalidArgumentError::new_err(format!(
                        "grow_block_tables() got request id {id}, past held's {} entries",
                        held.len()
                    ))
                })?;
            let known = usize::try_from(held[at]).map_err(|_| {
                InvalidArgumentError::new_err(format!(
                    "grow_block_tables() got held[{id}] = {}, a negative count",
                    held[at]
                ))
            })?;
            tables.push((at, known, table));
        }
        if tables.iter().any(|&(_, known, table)| table.len() < known) {
            return Ok(None);
        }
        let mut pages = Vec::new();
        let mut rows = Vec::new();
        let mut counts = Vec::new();
        for (row, &(at, known, table)) in tables.iter().enumerate() {
            if table.len() > known {
                pages.extend(table[known..].iter().map(|&page| page_id(page)));
                rows.push(i64::try_from(row).unwrap_or(i64::MAX));
                counts.push(table_tail_count(table.len(), known as u64));
                held[at] = i64::try_from(table.len()).unwrap_or(i64::MAX);
            }
        }
        Ok(Some((
            PyArray1::from_vec(py, pages),
            PyArray1::from_vec(py, rows),
            PyArray1::from_vec(py, counts),
        )))
    }

    /// This rank's slot per new token (int64; -1 where another rank owns it).
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        starts: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let rank = self.inner.config().cp_rank;
        slot_mapping(py, self.inner.ledger(), request_ids, starts, counts, rank)
    }

    /// The layout of the packed step metadata for this scheduler's capacities
    /// (`max_num_tokens` tokens and `max_batch_size` entries a step) and block-table rows
    /// of `table_width` superblocks (default: a `max_seq_len` request's, capped by the pool).
    #[pyo3(signature = (table_width = None))]
    fn step_metadata_layout(
        &self,
        table_width: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepMetadataLayout> {
        step_metadata::layout(&self.inner, table_width)
    }

    /// Writes this rank's metadata of the pending step (`schedule_output`, the last
    /// `schedule()`'s) into `buffer` (a writeable, C-contiguous, 8-byte aligned int32 array
    /// of at least `layout.total_words` words), cut as `layout` says. Everything is checked
    /// before a word is written: an error leaves the buffer and the scheduler unchanged. An
    /// output that is not the pending step's (a closed or reverted step's, or another
    /// scheduler's: its digest is not the one this scheduler made) is an `InvalidStateError`.
    /// A decode-sized step keeps the GIL (microseconds); a long one releases it. A decode
    /// input still in flight (a step planned one ahead) is written as token -1: gather it from
    /// `generation_input_refs`. The per-rank values (slots, local and past-seen lengths) are
    /// this scheduler's rank's, from the positions; the output's per-rank arrays are not read.
    fn write_step_metadata(
        &self,
        py: Python<'_>,
        schedule_output: &Bound<'_, PyAny>,
        buffer: &Bound<'_, PyAny>,
        layout: &Bound<'_, PyAny>,
    ) -> PyResult<PyStepMetadata> {
        step_metadata::write(py, &self.inner, schedule_output, buffer, layout)
    }

    /// Writes this rank's metadata of the pending decode-only step (`schedule_output`, the
    /// last `schedule()`'s) as the rows a decode kernel reads: `buffer` is a writeable,
    /// C-contiguous int32 array `[rows, width]`, and row `i` becomes generation entry `i`,
    /// its columns as `DECODE_ROW_COLUMNS` names them (`token_id`, `position`, `slot`,
    /// `local_len`, `past_seen_len`, `input_ref`, then the block table, -1 padded to
    /// `width`). `input_ref` is `generation_input_refs`: a token still in flight (a step
    /// planned one ahead) is written as -1 and gathered on the device from that row of the
    /// previous step's samples. `slot`, `local_len` and `past_seen_len` are this scheduler's
    /// rank's, from the positions (the output's per-rank arrays are not read). Rows
    /// `[rows, pad_to)` get `DECODE_ROW_PADDING` in their
    /// fixed columns. Everything is checked before a word is written: an error (a step with
    /// context chunks, a buffer too small, a request wider than the row, an output that is
    /// not the pending step's, another scheduler's included, ...) leaves the buffer and the
    /// scheduler unchanged. Decode-sized rows keep the GIL (microseconds);
    /// many or wide rows (past 2**16 words) release it.
    #[pyo3(signature = (schedule_output, buffer, pad_to = None))]
    fn write_decode_rows(
        &self,
        py: Python<'_>,
        schedule_output: &Bound<'_, PyAny>,
        buffer: &Bound<'_, PyAny>,
        pad_to: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyDecodeRowCounts> {
        step_metadata::write_rows(py, &self.inner, schedule_output, buffer, pad_to)
    }

    /// Totals, with KV use as of now.
    fn metrics(&self) -> PySchedulerMetrics {
        self.inner.metrics().into()
    }

    /// Counters of a live request, or of a finished one whose output is not taken yet.
    fn request_metrics(&self, request_id: &Bound<'_, PyAny>) -> PyResult<PyRequestMetrics> {
        Ok(self.inner.request_metrics(id_arg(request_id)?).py()?.into())
    }

    /// Live requests.
    #[getter]
    fn num_live(&self) -> usize {
        self.inner.num_live()
    }
    /// Live requests with nothing computed (new or recompute-paused).
    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }
    /// Live requests holding KV (prefilling or decoding).
    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }
    /// Live requests suspended to the host tier.
    #[getter]
    fn num_suspended(&self) -> usize {
        self.inner.num_suspended()
    }
    /// Host-tier superblocks held by suspended requests.
    #[getter]
    fn host_used_superblocks(&self) -> u32 {
        self.inner.host_used_superblocks()
    }
    /// Whether a schedule awaits `update` or `revert`.
    #[getter]
    fn step_pending(&self) -> bool {
        self.inner.is_step_pending()
    }
    /// How many schedules await `update` or `revert`: 0, 1, or 2 (one step scheduled
    /// ahead of the pending one).
    fn pending_steps(&self) -> u32 {
        self.inner.pending_steps()
    }
    /// Whether any request is live.
    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }
    /// Ids of live requests in queue order (uint64).
    fn queue_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        ids_to_numpy(py, self.inner.queue_ids())
    }
    /// The live requests in queue order with what each holds, in one crossing:
    /// `(ids, superblocks, abort_requested)` (uint64, int64, bool). A request holds
    /// superblocks from the step that admits it (while that step is still pending too)
    /// until it finishes or is recompute-paused; `abort_requested` marks an abort waiting
    /// for the pending step to close. An engine reads its running and waiting requests off
    /// these (vLLM's `running`: holding superblocks, no abort requested).
    fn queue_holdings<'py>(&self, py: Python<'py>) -> PyResult<QueueHoldings<'py>> {
        let ids = self.inner.queue_ids();
        let ledger = self.inner.ledger();
        let mut held = Vec::with_capacity(ids.len());
        let mut aborting = Vec::with_capacity(ids.len());
        for &id in &ids {
            held.push(i64::from(superblock_count(
                ledger.request(id).py()?.table().len(),
            )));
            aborting.push(self.inner.is_abort_requested(id).py()?);
        }
        Ok((
            ids_to_numpy(py, ids),
            PyArray1::from_vec(py, held),
            PyArray1::from_vec(py, aborting),
        ))
    }
    /// Fingerprint of everything that drives decisions (equal on every rank fed the
    /// same calls; unchanged by a schedule + revert that preempted nothing).
    fn state_digest(&self) -> u64 {
        self.inner.state_digest()
    }
    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Scheduler(cp_size={}, cp_rank={}, live={}, waiting={}, running={}, suspended={}, \
             free_superblocks={}/{})",
            c.cp_size,
            c.cp_rank,
            self.inner.num_live(),
            self.inner.num_waiting(),
            self.inner.num_running(),
            self.inner.num_suspended(),
            self.inner.ledger().free_superblocks(),
            self.inner.ledger().capacity()
        )
    }
}

/// The calls the in-process CP group makes on every rank at once (see
/// [`crate::rank_group`]), shared with the methods above.
impl PyScheduler {
    /// `add_request()` of checked arguments.
    pub fn add_new(&mut self, request: &NewRequest) -> PyResult<()> {
        self.inner
            .add_prepared(
                request.id,
                &request.prompt,
                request.max_new_tokens,
                request.priority,
            )
            .py()
    }

    /// `schedule()`: decides the next step, with the GIL released.
    pub fn schedule_step(&mut self, py: Python<'_>) -> PyResult<PyScheduleOutput> {
        let inner = &mut self.inner;
        let spare = self.spare.take();
        let output = py
            .detach(|| {
                if let Some(spare) = spare {
                    inner.recycle_output(spare);
                }
                inner.schedule()?;
                Ok(inner.take_last_output())
            })
            .py()?;
        Ok(PyScheduleOutput::recycled_into(
            output,
            self.fingerprint,
            &self.spare,
        ))
    }

    /// `update()` with its arguments read: the ids of the requests that finished.
    pub fn update_step(
        &mut self,
        py: Python<'_>,
        tokens: &[i32],
        eos: Option<&[bool]>,
        accepted: Option<&[u32]>,
    ) -> PyResult<Vec<u64>> {
        let inner = &mut self.inner;
        py.detach(|| {
            inner
                .update_accepted(tokens, eos, accepted)
                .map(<[u64]>::to_vec)
        })
        .py()
    }
}

/// `update()`'s arguments read, as every rank reads them: the sampled tokens, the optional
/// end-of-sequence flags and accepted draft counts.
pub fn update_args<'py>(
    tokens: &Bound<'py, PyAny>,
    eos: Option<&Bound<'py, PyAny>>,
    accepted: Option<&Bound<'py, PyAny>>,
) -> PyResult<(TokenIds<'py>, Option<Flags<'py>>, Option<Vec<u32>>)> {
    let tokens = token_ids(tokens, "sampled tokens")?;
    let eos = eos.map(|eos| flags(eos, "eos")).transpose()?;
    let accepted = accepted
        .map(|counts| draft_counts(counts, "accepted counts"))
        .transpose()?;
    Ok((tokens, eos, accepted))
}

/// `block_table_tails()`'s result: the pages past each start, concatenated, and each
/// request's count past its start.
type TableTails<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i64>>);

/// `grow_block_tables()`'s result: the new pages, the rows that grew and by how much.
type TableGrowth<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
);

/// `queue_holdings()`'s result: the live ids in queue order, the superblocks each holds and
/// whether its abort waits for the pending step.
type QueueHoldings<'py> = (
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<bool>>,
);

/// `held - start` for a table of `held` superblocks (at most 2**31-1, the pool's bound) and
/// a start of at most 2**63-1 (a length argument): both fit i64, so the difference does.
#[expect(
    clippy::cast_possible_wrap,
    reason = "both values are at most 2**63-1 (a table length, a length argument)"
)]
fn table_tail_count(held: usize, start: u64) -> i64 {
    held as i64 - start as i64
}

/// The longest cache salt accepted, in bytes (a tenant or adapter name, not a payload).
const MAX_CACHE_SALT: usize = 4096;

/// `cache_salt` of `add_request`: `None`, a `str` (its UTF-8 bytes) or `bytes`.
fn salt_arg(salt: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u8>> {
    use pyo3::types::{PyBytes, PyString};
    let Some(salt) = salt.filter(|s| !s.is_none()) else {
        return Ok(Vec::new());
    };
    let bytes = if let Ok(text) = salt.cast::<PyString>() {
        // A str that is not valid Unicode (a lone surrogate) has no UTF-8 bytes.
        text.to_cow()
            .map_err(|_| {
                InvalidArgumentError::new_err(
                    "cache_salt must be valid Unicode (no lone surrogates)",
                )
            })?
            .as_bytes()
            .to_vec()
    } else if let Ok(bytes) = salt.cast::<PyBytes>() {
        bytes.as_bytes().to_vec()
    } else {
        return Err(invalid_type_of("cache_salt", "a str, bytes or None", salt));
    };
    if bytes.len() > MAX_CACHE_SALT {
        return Err(InvalidArgumentError::new_err(format!(
            "cache_salt has {} bytes, more than {MAX_CACHE_SALT}",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// Per-entry draft counts (drafts proposed, or accepted) from an integer array-like: each in
/// `0..=2**32-1` (`InvalidArgumentError`; the scheduler then bounds them by the step).
fn draft_counts(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    u64_vec(obj, what, false)?
        .into_iter()
        .map(|count| {
            u32::try_from(count).map_err(|_| {
                InvalidArgumentError::new_err(format!("{what} must be in 0..=2**32-1, got {count}"))
            })
        })
        .collect()
}
