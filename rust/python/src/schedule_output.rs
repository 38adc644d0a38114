//! `ScheduleOutput`: one step's schedule as numpy arrays. The core's vectors are moved in
//! (no copy) and each becomes a numpy array, also without a copy, the first time Python
//! reads it; fields never read cost nothing.

use std::sync::Mutex;

use helix_kv_core::ScheduleOutput;
use numpy::{Element, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// A core element type exposed as numpy dtype `N` (ids as uint64, lengths and positions
/// as int64, ranks as int32), with the exact conversions both ways.
pub trait Exposed<N: Element + Copy>: Sized + Copy + Send + Clone {
    fn to_numpy(self) -> N;
    fn from_numpy(value: N) -> Self;
}

/// Request ids: the whole `u64` range, as uint64.
impl Exposed<u64> for u64 {
    fn to_numpy(self) -> u64 {
        self
    }
    fn from_numpy(value: u64) -> Self {
        value
    }
}

/// Lengths and positions (below `2**63` by the ledger's bounds), as int64.
impl Exposed<i64> for u64 {
    fn to_numpy(self) -> i64 {
        self as i64
    }
    fn from_numpy(value: i64) -> Self {
        value as u64
    }
}

impl Exposed<i32> for u32 {
    fn to_numpy(self) -> i32 {
        self as i32
    }
    fn from_numpy(value: i32) -> Self {
        value as u32
    }
}

impl Exposed<i32> for i32 {
    fn to_numpy(self) -> i32 {
        self
    }
    fn from_numpy(value: i32) -> Self {
        value
    }
}

impl Exposed<bool> for bool {
    fn to_numpy(self) -> bool {
        self
    }
    fn from_numpy(value: bool) -> Self {
        value
    }
}

/// One output array: the core's vector until Python first reads it, then a cached numpy
/// array that owns the same buffer (same-size element conversions reuse the allocation).
pub struct LazyArray<T: Exposed<N>, N: Element + Copy> {
    vector: Mutex<Option<Vec<T>>>,
    array: PyOnceLock<Py<PyArray1<N>>>,
}

impl<T: Exposed<N>, N: Element + Copy> LazyArray<T, N> {
    fn new(vector: Vec<T>) -> Self {
        Self {
            vector: Mutex::new(Some(vector)),
            array: PyOnceLock::new(),
        }
    }

    fn take_vector(&self) -> Vec<T> {
        self.vector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .unwrap_or_default()
    }

    /// The numpy array (created on first use).
    pub fn get<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<N>> {
        self.array
            .get_or_init(py, || {
                let converted: Vec<N> = self.take_vector().into_iter().map(T::to_numpy).collect();
                PyArray1::from_vec(py, converted).unbind()
            })
            .bind(py)
            .clone()
    }

    /// The values, wherever they live now.
    fn values(&self, py: Python<'_>) -> Vec<T> {
        if let Some(array) = self.array.get(py) {
            return array
                .bind(py)
                .to_vec()
                .unwrap_or_default()
                .into_iter()
                .map(T::from_numpy)
                .collect();
        }
        self.vector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .unwrap_or_default()
    }

    /// Number of values, without creating the array.
    fn len(&self, py: Python<'_>) -> usize {
        if let Some(array) = self.array.get(py) {
            return PyUntypedArrayMethods::len(array.bind(py));
        }
        self.vector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map_or(0, Vec::len)
    }
}

/// The schedule of one step (frozen). Arrays: request ids are uint64; starts, lengths and
/// positions int64; owner ranks, batch slots, token and block ids int32; flags bool. Every field is
/// identical on every rank except `generation_active`, `generation_local_lens` and
/// `generation_past_seen_lens`.
#[pyclass(frozen, module = "helix_kv._core", name = "ScheduleOutput")]
pub struct PyScheduleOutput {
    step: u64,
    num_tokens: u64,
    digest: u64,
    context_ids: LazyArray<u64, u64>,
    context_starts: LazyArray<u64, i64>,
    context_lens: LazyArray<u64, i64>,
    context_completes: LazyArray<bool, bool>,
    context_batch_slots: LazyArray<i32, i32>,
    context_token_ids: LazyArray<i32, i32>,
    generation_ids: LazyArray<u64, u64>,
    generation_positions: LazyArray<u64, i64>,
    generation_owner_ranks: LazyArray<u32, i32>,
    generation_input_tokens: LazyArray<i32, i32>,
    generation_batch_slots: LazyArray<i32, i32>,
    generation_active: LazyArray<bool, bool>,
    generation_local_lens: LazyArray<u64, i64>,
    generation_past_seen_lens: LazyArray<u64, i64>,
    preempted_ids: LazyArray<u64, u64>,
    preempted_requester_ids: LazyArray<u64, u64>,
    suspended_ids: LazyArray<u64, u64>,
    suspended_requester_ids: LazyArray<u64, u64>,
    suspended_block_ids: LazyArray<i32, i32>,
    suspended_block_counts: LazyArray<u64, i64>,
    resumed_ids: LazyArray<u64, u64>,
    sat_out_ids: LazyArray<u64, u64>,
    sample_ids: LazyArray<u64, u64>,
}

impl From<ScheduleOutput> for PyScheduleOutput {
    fn from(out: ScheduleOutput) -> Self {
        Self {
            step: out.step,
            num_tokens: out.num_tokens,
            digest: out.digest,
            context_ids: LazyArray::new(out.context_ids),
            context_starts: LazyArray::new(out.context_starts),
            context_lens: LazyArray::new(out.context_lens),
            context_completes: LazyArray::new(out.context_completes),
            context_batch_slots: LazyArray::new(out.context_batch_slots),
            context_token_ids: LazyArray::new(out.context_token_ids),
            generation_ids: LazyArray::new(out.generation_ids),
            generation_positions: LazyArray::new(out.generation_positions),
            generation_owner_ranks: LazyArray::new(out.generation_owner_ranks),
            generation_input_tokens: LazyArray::new(out.generation_input_tokens),
            generation_batch_slots: LazyArray::new(out.generation_batch_slots),
            generation_active: LazyArray::new(out.generation_active),
            generation_local_lens: LazyArray::new(out.generation_local_lens),
            generation_past_seen_lens: LazyArray::new(out.generation_past_seen_lens),
            preempted_ids: LazyArray::new(out.preempted_ids),
            preempted_requester_ids: LazyArray::new(out.preempted_requester_ids),
            suspended_ids: LazyArray::new(out.suspended_ids),
            suspended_requester_ids: LazyArray::new(out.suspended_requester_ids),
            suspended_block_ids: LazyArray::new(out.suspended_block_ids),
            suspended_block_counts: LazyArray::new(out.suspended_block_counts),
            resumed_ids: LazyArray::new(out.resumed_ids),
            sat_out_ids: LazyArray::new(out.sat_out_ids),
            sample_ids: LazyArray::new(out.sample_ids),
        }
    }
}

impl PyScheduleOutput {
    /// The core output again (for the summary), from the arrays as they are now.
    fn to_core(&self, py: Python<'_>) -> ScheduleOutput {
        ScheduleOutput {
            step: self.step,
            context_ids: self.context_ids.values(py),
            context_starts: self.context_starts.values(py),
            context_lens: self.context_lens.values(py),
            context_completes: self.context_completes.values(py),
            context_batch_slots: self.context_batch_slots.values(py),
            context_token_ids: self.context_token_ids.values(py),
            generation_ids: self.generation_ids.values(py),
            generation_positions: self.generation_positions.values(py),
            generation_owner_ranks: self.generation_owner_ranks.values(py),
            generation_input_tokens: self.generation_input_tokens.values(py),
            generation_batch_slots: self.generation_batch_slots.values(py),
            generation_active: self.generation_active.values(py),
            generation_local_lens: self.generation_local_lens.values(py),
            generation_past_seen_lens: self.generation_past_seen_lens.values(py),
            preempted_ids: self.preempted_ids.values(py),
            preempted_requester_ids: self.preempted_requester_ids.values(py),
            suspended_ids: self.suspended_ids.values(py),
            suspended_requester_ids: self.suspended_requester_ids.values(py),
            suspended_block_ids: self.suspended_block_ids.values(py),
            suspended_block_counts: self.suspended_block_counts.values(py),
            resumed_ids: self.resumed_ids.values(py),
            sat_out_ids: self.sat_out_ids.values(py),
            sample_ids: self.sample_ids.values(py),
            num_tokens: self.num_tokens,
            digest: self.digest,
        }
    }
}

type Array<'py, T> = Bound<'py, PyArray1<T>>;

#[pymethods]
impl PyScheduleOutput {
    /// Step number (every successful `schedule()` takes a new one).
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }
    /// Context tokens plus decode tokens scheduled.
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.num_tokens
    }
    /// 64-bit fingerprint of every rank-invariant field (unsigned).
    #[getter]
    fn digest(&self) -> u64 {
        self.digest
    }
    /// Requests with a prompt chunk, in queue order (uint64).
    #[getter]
    fn context_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.context_ids.get(py)
    }
    /// Global position of each chunk's first token (int64).
    #[getter]
    fn context_starts<'py>(&self, py: Python<'py>) -> Array<'py, i64> {
        self.context_starts.get(py)
    }
    /// Tokens in each chunk (int64).
    #[getter]
    fn context_lens<'py>(&self, py: Python<'py>) -> Array<'py, i64> {
        self.context_lens.get(py)
    }
    /// Whether each chunk completes its prompt (bool).
    #[getter]
    fn context_completes<'py>(&self, py: Python<'py>) -> Array<'py, bool> {
        self.context_completes.get(py)
    }
    /// Batch slot of each context entry (int32).
    #[getter]
    fn context_batch_slots<'py>(&self, py: Python<'py>) -> Array<'py, i32> {
        self.context_batch_slots.get(py)
    }
    /// The chunks' tokens, concatenated in entry order (int32).
    #[getter]
    fn context_token_ids<'py>(&self, py: Python<'py>) -> Array<'py, i32> {
        self.context_token_ids.get(py)
    }
    /// Requests decoding one token, in queue order (uint64).
    #[getter]
    fn generation_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.generation_ids.get(py)
    }
    /// Global position of the token being written (int64).
    #[getter]
    fn generation_positions<'py>(&self, py: Python<'py>) -> Array<'py, i64> {
        self.generation_positions.get(py)
    }
    /// Rank that appends each decode token (int32).
    #[getter]
    fn generation_owner_ranks<'py>(&self, py: Python<'py>) -> Array<'py, i32> {
        self.generation_owner_ranks.get(py)
    }
    /// Token fed at each position: the request's last token (int32).
    #[getter]
    fn generation_input_tokens<'py>(&self, py: Python<'py>) -> Array<'py, i32> {
        self.generation_input_tokens.get(py)
    }
    /// Batch slot of each generation entry (int32).
    #[getter]
    fn generation_batch_slots<'py>(&self, py: Python<'py>) -> Array<'py, i32> {
        self.generation_batch_slots.get(py)
    }
    /// Per rank: whether this rank appends the token (bool).
    #[getter]
    fn generation_active<'py>(&self, py: Python<'py>) -> Array<'py, bool> {
        self.generation_active.get(py)
    }
    /// Per rank: tokens this rank holds after the append (int64).
    #[getter]
    fn generation_local_lens<'py>(&self, py: Python<'py>) -> Array<'py, i64> {
        self.generation_local_lens.get(py)
    }
    /// Per rank: tokens this rank holds before the append (int64).
    #[getter]
    fn generation_past_seen_lens<'py>(&self, py: Python<'py>) -> Array<'py, i64> {
        self.generation_past_seen_lens.get(py)
    }
    /// Requests recompute-paused this step, in the order chosen (uint64).
    #[getter]
    fn preempted_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.preempted_ids.get(py)
    }
    /// For each preempted request, the request that needed its pages (uint64).
    #[getter]
    fn preempted_requester_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.preempted_requester_ids.get(py)
    }
    /// Requests suspended to the host tier this step (uint64).
    #[getter]
    fn suspended_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.suspended_ids.get(py)
    }
    /// For each suspended request, the request that needed its pages (uint64).
    #[getter]
    fn suspended_requester_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.suspended_requester_ids.get(py)
    }
    /// Pages the suspended requests held, concatenated (int32): copy them out first.
    #[getter]
    fn suspended_block_ids<'py>(&self, py: Python<'py>) -> Array<'py, i32> {
        self.suspended_block_ids.get(py)
    }
    /// How many of `suspended_block_ids` each suspended request held (int64).
    #[getter]
    fn suspended_block_counts<'py>(&self, py: Python<'py>) -> Array<'py, i64> {
        self.suspended_block_counts.get(py)
    }
    /// Requests brought back from the host tier (uint64).
    #[getter]
    fn resumed_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.resumed_ids.get(py)
    }
    /// Generation requests that found neither pages nor a victim (uint64).
    #[getter]
    fn sat_out_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.sat_out_ids.get(py)
    }
    /// Generation ids, then completing context ids: the order `update` takes tokens (uint64).
    #[getter]
    fn sample_ids<'py>(&self, py: Python<'py>) -> Array<'py, u64> {
        self.sample_ids.get(py)
    }
    /// Tokens `update` expects (`len(sample_ids)`), without building the array.
    #[getter]
    fn num_samples(&self, py: Python<'_>) -> usize {
        self.sample_ids.len(py)
    }
    /// One `name: value` line per rank-invariant field, stable text to diff two ranks'.
    fn summary(&self, py: Python<'_>) -> String {
        self.to_core(py).summary()
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ScheduleOutput(step={}, context={}, generation={}, preempted={}, suspended={}, \
             sat_out={}, num_tokens={}, digest=0x{:016x})",
            self.step,
            self.context_ids.len(py),
            self.generation_ids.len(py),
            self.preempted_ids.len(py),
            self.suspended_ids.len(py),
            self.sat_out_ids.len(py),
            self.num_tokens,
            self.digest
        )
    }
}
