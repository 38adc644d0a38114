//! `Ledger`: the superblock page ledger with numpy batch forms.

use helix_kv_core::ids::{page_id, superblock_count};
use helix_kv_core::{DecodeView, Ledger, RequestKv};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use pyo3::marker::Ungil;
use pyo3::prelude::*;

use crate::arrays::{
    id_arg, invalid_type_of, is_readable, length_arg, rank_arg, try_capacity, u64_arg, u64_vec,
    MAX_LENGTH,
};
use crate::errors::{int_setting, with_config_value, IntoPyResult, InvalidArgumentError};
use crate::layout::PyLayout;

/// The superblock ledger: a fixed pool of superblocks, identical on every rank, and a page
/// table per request. Two ledgers fed the same calls hand out the same page ids.
#[pyclass(module = "helix_kv._core", name = "Ledger")]
pub struct PyLedger {
    pub inner: Ledger,
    /// The batch calls' converted arguments and results, kept between calls so a call
    /// allocates none of them in steady state (no part of the ledger's state).
    buffers: Buffers,
}

#[derive(Default)]
struct Buffers {
    ids: Vec<u64>,
    lens: Vec<u64>,
    ok: Vec<bool>,
}

impl Buffers {
    /// Entries a buffer keeps between calls (512 KiB of ids): a larger batch's storage
    /// is given back after its call rather than held for the ledger's lifetime.
    const KEEP_UP_TO: usize = 1 << 16;

    fn trim(&mut self) {
        fn trim<T>(buffer: &mut Vec<T>) {
            if buffer.capacity() > Buffers::KEEP_UP_TO {
                *buffer = Vec::new();
            }
        }
        trim(&mut self.ids);
        trim(&mut self.lens);
        trim(&mut self.ok);
    }
}

/// [`u64_vec`] into `out`, whose storage is reused; returns the values or'ed together
/// (at least the largest, below twice it). A contiguous, aligned int64 or uint64 array whose
/// values are all in range (the usual argument) is copied straight in, its range checked
/// on the copy's bits in the same pass; anything else goes through `u64_vec`, with its
/// errors.
fn u64_vec_into(
    obj: &Bound<'_, PyAny>,
    what: &str,
    length: bool,
    out: &mut Vec<u64>,
) -> PyResult<u64> {
    let max = if length { MAX_LENGTH } else { u64::MAX };
    let mut bits = 0;
    if let Ok(array) = obj.cast::<PyArray1<i64>>() {
        if is_readable(array) {
            let array = array.readonly();
            out.clear();
            out.extend(array.as_slice()?.iter().map(|&v| {
                #[expect(
                    clippy::cast_sign_loss,
                    reason = "the bits are kept: a negative value sets the top one, refused below"
                )]
                let v = v as u64;
                bits |= v;
                v
            }));
            // Non-negative, so also within `MAX_LENGTH` (= i64::MAX).
            if bits <= MAX_LENGTH {
                return Ok(bits);
            }
        }
    } else if let Ok(array) = obj.cast::<PyArray1<u64>>() {
        if is_readable(array) {
            let array = array.readonly();
            out.clear();
            out.extend(array.as_slice()?.iter().map(|&v| {
                bits |= v;
                v
            }));
            // Every value fits when their bits or'ed together do (`max` is all ones).
            if bits <= max {
                return Ok(bits);
            }
        }
    }
    *out = u64_vec(obj, what, length)?;
    Ok(out.iter().fold(0, |acc, &v| acc | v))
}

/// Units of work (ids plus superblocks moved, each some nanoseconds) up to which a batch
/// call keeps the GIL: a few microseconds, about what handing it over and back costs. A
/// larger call releases it, so other Python threads run meanwhile.
const KEEP_GIL_UP_TO: u64 = 1 << 12;

/// Runs `work` with the GIL held when `units` (an upper bound on its work) is small,
/// released otherwise.
fn run_sized<T: Send>(py: Python<'_>, units: u64, work: impl Ungil + FnOnce() -> T) -> T {
    if units <= KEEP_GIL_UP_TO {
        work()
    } else {
        py.detach(work)
    }
}

helix_kv_core::decode_view_fields!(value_record! {
    /// One rank's view of a request (see `Ledger.view`; frozen, picklable).
    PyDecodeView as "DecodeView" from DecodeView
});

value_record! {
    {
        /// A request's holdings and counters (see `Ledger.request`; frozen, picklable).
        PyRequestHoldings as "RequestHoldings"
    }
    /// The request id.
    request_id: u64,
    /// Global tokens reserved.
    length: u64,
    /// Prompt length, generated tokens folded in by recompute included.
    prompt_len: u64,
    /// Decode tokens allocated since the last (re-)prefill.
    decode_count: u64,
    /// Superblocks held.
    superblocks: u32,
    /// Whether the KV is suspended to a lower tier.
    suspended: bool,
}

impl From<RequestKv<'_>> for PyRequestHoldings {
    fn from(r: RequestKv<'_>) -> Self {
        Self {
            request_id: r.id(),
            length: r.len(),
            prompt_len: r.prompt_len(),
            decode_count: r.decode_count(),
            superblocks: superblock_count(r.table().len()),
            suspended: r.is_suspended(),
        }
    }
}

/// Shared by `Ledger` and `Scheduler`: the padded block table of `ids`; `width` is
/// `None` or a non-negative int, and a table too large to allocate is an
/// `InvalidLengthError`.
pub fn block_table<'py>(
    py: Python<'py>,
    ledger: &Ledger,
    ids: &Bound<'py, PyAny>,
    width: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let ids = u64_vec(ids, "request ids", false)?;
    let width = match width.filter(|w| !w.is_none()) {
        // `usize` is 64-bit on every supported platform, so this never saturates there.
        Some(w) => usize::try_from(length_arg(w, "width")?).unwrap_or(usize::MAX),
        None => ledger.max_table_len(&ids).py()?,
    };
    // A row's stride (`width * 4` bytes) must fit numpy's `intp` even with no rows, or
    // numpy is handed strides that overflow.
    let entries = ids
        .len()
        .max(1)
        .checked_mul(width)
        .filter(|&n| n <= isize::MAX as usize / std::mem::size_of::<i32>())
        .map(|_| ids.len() * width);
    let (mut out, len) = try_capacity(entries, || {
        format!("a block table of {} x {width} entries", ids.len())
    })?;
    // Filling a large table is the long part: do it with the GIL released too.
    py.detach(|| {
        out.resize(len, 0i32);
        ledger.block_table_into(&ids, width, &mut out)
    })
    .py()?;
    let table = Array2::from_shape_vec((ids.len(), width), out)
        .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?;
    Ok(table.into_pyarray(py))
}

/// Shared by `Ledger` and `Scheduler`: this rank's slots for the new tokens.
pub fn slot_mapping<'py>(
    py: Python<'py>,
    ledger: &Ledger,
    ids: &Bound<'py, PyAny>,
    starts: &Bound<'py, PyAny>,
    counts: &Bound<'py, PyAny>,
    rank: u32,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let ids = u64_vec(ids, "request ids", false)?;
    let starts = u64_vec(starts, "starts", true)?;
    let counts = u64_vec(counts, "counts", true)?;
    let mut out = Vec::new();
    py.detach(|| ledger.slot_mapping_into(&ids, &starts, &counts, rank, &mut out))
        .py()?;
    Ok(PyArray1::from_vec(py, out))
}

#[pymethods]
impl PyLedger {
    #[new]
    #[pyo3(signature = (layout, capacity_superblocks))]
    fn new(layout: &Bound<'_, PyAny>, capacity_superblocks: &Bound<'_, PyAny>) -> PyResult<Self> {
        let layout = layout
            .cast::<PyLayout>()
            .map_err(|_| invalid_type_of("layout", "a Layout", layout))?
            .get()
            .inner;
        let capacity =
            int_setting::<u32>(capacity_superblocks, "capacity_superblocks", "1..=2**32-1")?;
        let inner = Ledger::new(layout, capacity).py().map_err(|err| {
            with_config_value(err, capacity_superblocks.py(), |_| {
                Ok(Some(capacity_superblocks.clone()))
            })
        })?;
        Ok(Self {
            inner,
            buffers: Buffers::default(),
        })
    }

    /// The token placement.
    #[getter]
    fn layout(&self) -> PyLayout {
        PyLayout {
            inner: self.inner.layout(),
        }
    }
    /// Total superblocks.
    #[getter]
    fn capacity(&self) -> u32 {
        self.inner.capacity()
    }
    /// Global tokens the whole pool holds.
    #[getter]
    fn capacity_tokens(&self) -> u64 {
        self.inner.capacity_tokens()
    }
    /// Superblocks not held by any request.
    #[getter]
    fn free_superblocks(&self) -> u32 {
        self.inner.free_superblocks()
    }
    /// Superblocks held by requests.
    #[getter]
    fn used_superblocks(&self) -> u32 {
        self.inner.used_superblocks()
    }
    fn __len__(&self) -> usize {
        self.inner.num_requests()
    }
    /// Whether the request is held; an int outside the id range is never held, anything
    /// but an int is an `InvalidTypeError`.
    fn __contains__(&self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        match id_arg(request_id) {
            Ok(id) => Ok(self.inner.contains(id)),
            Err(err) if err.is_instance_of::<pyo3::exceptions::PyTypeError>(request_id.py()) => {
                Err(err)
            }
            Err(_) => Ok(false),
        }
    }

    /// Starts tracking a request; it holds nothing yet.
    fn add(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        prompt_len: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = id_arg(request_id)?;
        self.inner
            .add(id, length_arg(prompt_len, "prompt_len")?)
            .py()
    }
    /// Reserves room for `new_len` global tokens; False (nothing changed) if the pool is short.
    fn grow(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        new_len: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let id = id_arg(request_id)?;
        self.inner.grow(id, length_arg(new_len, "new_len")?).py()
    }
    /// Gives back everything past `new_len` global tokens.
    fn shrink(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        new_len: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = id_arg(request_id)?;
        self.inner.shrink(id, length_arg(new_len, "new_len")?).py()
    }
    /// Frees every superblock of the request and forgets it.
    fn free(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.free(id_arg(request_id)?).py()
    }
    /// Batch add. Validated whole before anything is added.
    fn add_many(
        &mut self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
        prompt_lens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = u64_vec(request_ids, "request ids", false)?;
        let lens = u64_vec(prompt_lens, "prompt lengths", true)?;
        let ledger = &mut self.inner;
        py.detach(|| ledger.add_many(&ids, &lens)).py()
    }
    /// Batch grow: a bool per request. Validated whole before anything is applied. A
    /// small batch (ids plus superblocks it can take up to 4096, a few microseconds)
    /// keeps the GIL; a larger one releases it.
    fn grow_many<'py>(
        &mut self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        new_lens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let Buffers { ids, lens, ok } = &mut self.buffers;
        // The lengths or'ed together bound the widest (below twice it).
        let converted = u64_vec_into(request_ids, "request ids", false, ids)
            .and_then(|_| u64_vec_into(new_lens, "lengths", true, lens));
        let widest = match converted {
            Ok(widest) => widest,
            Err(err) => {
                self.buffers.trim();
                return Err(err);
            }
        };
        let ledger = &mut self.inner;
        // At most every id's widest length's superblocks, and never more than the pool has.
        let superblocks = ledger.layout().superblocks_for(widest);
        let moved = superblocks
            .saturating_mul(ids.len() as u64)
            .min(u64::from(ledger.free_superblocks()));
        let grown = run_sized(py, ids.len() as u64 + moved, || {
            ledger.grow_many(ids, lens, ok)
        })
        .py()
        .map(|()| PyArray1::from_slice(py, ok));
        self.buffers.trim();
        grown
    }
    /// Batch free. Validated whole before anything is freed. A small batch (ids plus
    /// superblocks held up to 4096) keeps the GIL; a larger one releases it.
    fn free_many(&mut self, py: Python<'_>, request_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = &mut self.buffers.ids;
        if let Err(err) = u64_vec_into(request_ids, "request ids", false, ids) {
            self.buffers.trim();
            return Err(err);
        }
        let ledger = &mut self.inner;
        // At most every id plus every superblock held.
        let units = ids.len() as u64 + u64::from(ledger.used_superblocks());
        let freed = run_sized(py, units, || ledger.free_many(ids)).py();
        self.buffers.trim();
        freed
    }
    /// Reserves the next decode token in `step`; its global position, or None if the pool is short.
    fn allocate_decode(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        step: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u64>> {
        let id = id_arg(request_id)?;
        self.inner.allocate_decode(id, u64_arg(step, "step")?).py()
    }
    /// Undoes the decode allocation made in `step`, if any.
    fn revert_decode(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        step: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let id = id_arg(request_id)?;
        self.inner.revert_decode(id, u64_arg(step, "step")?).py()
    }
    /// Reserves `drafts` speculative positions right after the decode token allocated in
    /// `step`, from free superblocks alone (never evicting cached ones); the first draft's
    /// position, or None (nothing changed) if they do not fit.
    fn extend_decode(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        step: &Bound<'_, PyAny>,
        drafts: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u64>> {
        let id = id_arg(request_id)?;
        let step = u64_arg(step, "step")?;
        self.inner
            .extend_decode(id, step, length_arg(drafts, "drafts")?)
            .py()
    }
    /// Gives back the last `drafts` speculative positions of the decode in `step` (rejected
    /// or reverted) and shrinks the length to `len_to` when longer.
    fn retract_drafts(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        step: &Bound<'_, PyAny>,
        drafts: &Bound<'_, PyAny>,
        len_to: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = id_arg(request_id)?;
        let step = u64_arg(step, "step")?;
        let drafts = length_arg(drafts, "drafts")?;
        self.inner
            .retract_drafts(id, step, drafts, length_arg(len_to, "len_to")?)
            .py()
    }
    /// Recompute-pause: frees the pages, folds generated tokens into the prompt, resets the decode counter.
    fn reset_for_recompute(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        generated_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = id_arg(request_id)?;
        self.inner
            .reset_for_recompute(id, length_arg(generated_tokens, "generated_tokens")?)
            .py()
    }
    /// Suspends the request to a lower tier; returns the superblocks freed.
    fn suspend(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.inner.suspend(id_arg(request_id)?).py()
    }
    /// Reserves a suspended request's length again; False (still suspended) if the pool is short.
    fn resume(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.inner.resume(id_arg(request_id)?).py()
    }
    /// What `cp_rank` sees of the request.
    fn view(
        &self,
        request_id: &Bound<'_, PyAny>,
        cp_rank: &Bound<'_, PyAny>,
    ) -> PyResult<PyDecodeView> {
        let id = id_arg(request_id)?;
        Ok(self.inner.view(id, rank_arg(cp_rank)?).py()?.into())
    }
    /// The request's holdings and counters.
    fn request(&self, request_id: &Bound<'_, PyAny>) -> PyResult<PyRequestHoldings> {
        Ok(self.inner.request(id_arg(request_id)?).py()?.into())
    }
    /// Superblock ids of the request in sequence order (int32).
    fn table<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let request = self.inner.request(id_arg(request_id)?).py()?;
        Ok(PyArray1::from_vec(
            py,
            request.table().iter().map(|&p| page_id(p)).collect(),
        ))
    }
    /// `(request_ids uint64, superblocks int32)`, sorted by id.
    fn holdings<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<i32>>) {
        let (ids, counts): (Vec<u64>, Vec<i32>) = self
            .inner
            .holdings()
            .into_iter()
            // A count is at most the pool's capacity, which `Ledger::new` caps at i32::MAX.
            .map(|(id, n)| (id, i32::try_from(n).unwrap_or(i32::MAX)))
            .unzip();
        (PyArray1::from_vec(py, ids), PyArray1::from_vec(py, counts))
    }
    /// Page-table rows of `request_ids` (int32, `[len(ids), width]`, -1 padded); width
    /// defaults to the widest table.
    #[pyo3(signature = (request_ids, width=None))]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        width: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        block_table(py, &self.inner, request_ids, width)
    }
    /// This rank's slot per new token (int64; -1 where another rank owns the token).
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        starts: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
        cp_rank: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let rank = rank_arg(cp_rank)?;
        slot_mapping(py, &self.inner, request_ids, starts, counts, rank)
    }
    /// 64-bit fingerprint of the whole ledger state; equal ledgers, equal digests.
    fn state_digest(&self) -> u64 {
        self.inner.state_digest()
    }
    fn __repr__(&self) -> String {
        format!(
            "Ledger(cp={}, tokens_per_block={}, capacity={}, free={}, requests={})",
            self.inner.layout().cp(),
            self.inner.layout().tokens_per_block(),
            self.inner.capacity(),
            self.inner.free_superblocks(),
            self.inner.num_requests()
        )
    }
}
