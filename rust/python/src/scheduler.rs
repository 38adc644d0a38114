//! `Scheduler` (one rank's preemptive, rank-invariant scheduler) and its metrics. One
//! crossing per `schedule()` and per `update()`; arrays in and out are numpy.

use helix_kv_core::{RequestMetrics, Scheduler, SchedulerMetrics};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::arrays::{int64_array, request_id, u64_vec};
use crate::errors::{IntoPyResult, InvalidArgumentError, InvalidLengthError};
use crate::ledger::{block_table, slot_mapping};
use crate::request_output::PyRequestOutput;
use crate::schedule_output::PyScheduleOutput;
use crate::scheduler_config::PySchedulerConfig;

/// Scheduler totals (frozen; equal on every rank).
#[pyclass(
    frozen,
    get_all,
    eq,
    module = "helix_kv._core",
    name = "SchedulerMetrics"
)]
#[derive(PartialEq)]
pub struct PySchedulerMetrics {
    /// Steps run (updated).
    steps: u64,
    /// Recompute-pauses.
    preemptions: u64,
    /// Suspends to the host tier.
    suspensions: u64,
    /// KV tokens thrown away by recompute-pauses.
    recomputed_tokens: u64,
    /// Context and decode tokens run, recomputation included.
    computed_tokens: u64,
    /// Times a generation request sat out a step.
    sat_out: u64,
    /// Requests that finished by length or eos.
    finished: u64,
    /// Requests aborted.
    aborts: u64,
    /// Superblocks held now.
    kv_used_superblocks: u32,
    /// Superblocks in the pool.
    kv_capacity_superblocks: u32,
    /// Used / capacity, now.
    kv_utilization: f64,
    /// Highest utilisation seen right after a `schedule()`.
    kv_utilization_peak: f64,
}

impl From<SchedulerMetrics> for PySchedulerMetrics {
    fn from(m: SchedulerMetrics) -> Self {
        Self {
            steps: m.steps,
            preemptions: m.preemptions,
            suspensions: m.suspensions,
            recomputed_tokens: m.recomputed_tokens,
            computed_tokens: m.computed_tokens,
            sat_out: m.sat_out,
            finished: m.finished,
            aborts: m.aborts,
            kv_used_superblocks: m.kv_used_superblocks,
            kv_capacity_superblocks: m.kv_capacity_superblocks,
            kv_utilization: m.kv_utilization,
            kv_utilization_peak: m.kv_utilization_peak,
        }
    }
}

#[pymethods]
impl PySchedulerMetrics {
    /// The counters as a dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("steps", self.steps)?;
        d.set_item("preemptions", self.preemptions)?;
        d.set_item("suspensions", self.suspensions)?;
        d.set_item("recomputed_tokens", self.recomputed_tokens)?;
        d.set_item("computed_tokens", self.computed_tokens)?;
        d.set_item("sat_out", self.sat_out)?;
        d.set_item("finished", self.finished)?;
        d.set_item("aborts", self.aborts)?;
        d.set_item("kv_used_superblocks", self.kv_used_superblocks)?;
        d.set_item("kv_capacity_superblocks", self.kv_capacity_superblocks)?;
        d.set_item("kv_utilization", self.kv_utilization)?;
        d.set_item("kv_utilization_peak", self.kv_utilization_peak)?;
        Ok(d)
    }
    fn __repr__(&self) -> String {
        format!(
            "SchedulerMetrics(steps={}, preemptions={}, suspensions={}, recomputed_tokens={}, \
             computed_tokens={}, sat_out={}, finished={}, aborts={}, kv_used_superblocks={}, \
             kv_capacity_superblocks={}, kv_utilization={}, kv_utilization_peak={})",
            self.steps,
            self.preemptions,
            self.suspensions,
            self.recomputed_tokens,
            self.computed_tokens,
            self.sat_out,
            self.finished,
            self.aborts,
            self.kv_used_superblocks,
            self.kv_capacity_superblocks,
            self.kv_utilization,
            self.kv_utilization_peak
        )
    }
}

/// Counters of one request (frozen).
#[pyclass(
    frozen,
    get_all,
    eq,
    module = "helix_kv._core",
    name = "RequestMetrics"
)]
#[derive(PartialEq, Eq)]
pub struct PyRequestMetrics {
    /// Times chosen as a victim (recompute-pause or suspend).
    preemptions: u32,
    /// KV tokens it lost to recompute-pauses.
    recomputed_tokens: u64,
    /// Steps run while it was live and got no entry.
    steps_waited: u64,
    /// Tokens sampled for it so far.
    generated_tokens: u64,
}

impl From<RequestMetrics> for PyRequestMetrics {
    fn from(m: RequestMetrics) -> Self {
        Self {
            preemptions: m.preemptions,
            recomputed_tokens: m.recomputed_tokens,
            steps_waited: m.steps_waited,
            generated_tokens: m.generated_tokens,
        }
    }
}

impl From<&PyRequestMetrics> for RequestMetrics {
    fn from(m: &PyRequestMetrics) -> Self {
        Self {
            preemptions: m.preemptions,
            recomputed_tokens: m.recomputed_tokens,
            steps_waited: m.steps_waited,
            generated_tokens: m.generated_tokens,
        }
    }
}

#[pymethods]
impl PyRequestMetrics {
    /// Builds counters (what unpickling a `RequestOutput` calls).
    #[new]
    #[pyo3(signature = (*, preemptions = 0, recomputed_tokens = 0, steps_waited = 0, generated_tokens = 0))]
    fn py_new(
        preemptions: u32,
        recomputed_tokens: u64,
        steps_waited: u64,
        generated_tokens: u64,
    ) -> Self {
        Self {
            preemptions,
            recomputed_tokens,
            steps_waited,
            generated_tokens,
        }
    }

    /// Pickles as `functools.partial(RequestMetrics, **to_dict())`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let rebuild = py
            .import("functools")?
            .getattr("partial")?
            .call((py.get_type::<Self>(),), Some(&slf.get().to_dict(py)?))?;
        PyTuple::new(py, [rebuild, PyTuple::empty(py).into_any()])
    }

    /// The counters as a dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("preemptions", self.preemptions)?;
        d.set_item("recomputed_tokens", self.recomputed_tokens)?;
        d.set_item("steps_waited", self.steps_waited)?;
        d.set_item("generated_tokens", self.generated_tokens)?;
        Ok(d)
    }
    pub(crate) fn __repr__(&self) -> String {
        format!(
            "RequestMetrics(preemptions={}, recomputed_tokens={}, steps_waited={}, generated_tokens={})",
            self.preemptions, self.recomputed_tokens, self.steps_waited, self.generated_tokens
        )
    }
}

/// Token ids: borrowed when already a contiguous int32 array, else converted with a range
/// check (numpy's own cast would wrap silently).
enum TokenIds<'py> {
    Borrowed(PyReadonlyArray1<'py, i32>),
    Converted(Vec<i32>),
}

impl TokenIds<'_> {
    fn as_slice(&self) -> PyResult<&[i32]> {
        match self {
            Self::Borrowed(array) => Ok(array.as_slice()?),
            Self::Converted(values) => Ok(values),
        }
    }
}

fn token_ids<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<TokenIds<'py>> {
    if let Ok(array) = obj.cast::<PyArray1<i32>>() {
        if array.is_contiguous() {
            return Ok(TokenIds::Borrowed(array.readonly()));
        }
    }
    let wide = int64_array(obj)?;
    let values = wide
        .as_slice()?
        .iter()
        .map(|&v| {
            i32::try_from(v).map_err(|_| {
                InvalidArgumentError::new_err(format!("{what} must fit int32, got {v}"))
            })
        })
        .collect::<PyResult<Vec<i32>>>()?;
    Ok(TokenIds::Converted(values))
}

/// End-of-sequence flags: borrowed when already a contiguous bool array.
fn flags<'py>(obj: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArray1<'py, bool>> {
    if let Ok(array) = obj.cast::<PyArray1<bool>>() {
        if array.is_contiguous() {
            return Ok(array.readonly());
        }
    }
    let numpy = obj.py().import("numpy")?;
    let converted = numpy.call_method1("ascontiguousarray", (obj, "bool"))?;
    Ok(converted
        .cast_into::<PyArray1<bool>>()
        .map_err(|_| InvalidArgumentError::new_err("eos must be a one-dimensional bool array"))?
        .readonly())
}

fn ids_to_numpy(py: Python<'_>, ids: Vec<u64>) -> Bound<'_, PyArray1<i64>> {
    PyArray1::from_vec(py, ids.into_iter().map(|id| id as i64).collect())
}

/// One rank's scheduler. Every rank of a CP group builds one from the same configuration
/// (`config.with_rank(r)`) and feeds it the same calls; all decisions then agree.
#[pyclass(module = "helix_kv._core", name = "Scheduler")]
pub struct PyScheduler {
    inner: Scheduler,
    config: Py<PySchedulerConfig>,
}

#[pymethods]
impl PyScheduler {
    #[new]
    fn new(config: Bound<'_, PySchedulerConfig>) -> PyResult<Self> {
        Ok(Self {
            inner: Scheduler::new(config.get().inner.clone()).py()?,
            config: config.unbind(),
        })
    }

    /// The configuration.
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PySchedulerConfig> {
        self.config.clone_ref(py)
    }

    /// Queues a request behind every live one (its place in the queue is kept forever).
    #[pyo3(signature = (request_id, prompt, max_new_tokens, priority = 0))]
    fn add_request(
        &mut self,
        request_id: i64,
        prompt: &Bound<'_, PyAny>,
        max_new_tokens: i64,
        priority: i64,
    ) -> PyResult<()> {
        let id = self::request_id(request_id)?;
        let prompt = token_ids(prompt, "prompt tokens")?;
        let max_new = u32::try_from(max_new_tokens).map_err(|_| {
            InvalidLengthError::new_err(format!(
                "max_new_tokens must be in 1..={}, got {max_new_tokens}",
                u32::MAX
            ))
        })?;
        let priority = i32::try_from(priority).map_err(|_| {
            InvalidArgumentError::new_err(format!("priority must fit int32, got {priority}"))
        })?;
        self.inner
            .add_request(id, prompt.as_slice()?, max_new, priority)
            .py()
    }

    /// Decides the next step.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyScheduleOutput> {
        let inner = &mut self.inner;
        let output = py
            .detach(|| {
                inner.schedule()?;
                Ok(inner.take_last_output())
            })
            .py()?;
        Ok(output.into())
    }

    /// Applies the step that ran: one token per `sample_ids` entry (int32) and optional
    /// end-of-sequence flags. Returns the ids of requests that finished (int64).
    #[pyo3(signature = (tokens, eos = None))]
    fn update<'py>(
        &mut self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        eos: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let tokens = token_ids(tokens, "sampled tokens")?;
        let eos = eos.map(flags).transpose()?;
        let tokens = tokens.as_slice()?;
        let eos = eos.as_ref().map(PyReadonlyArray1::as_slice).transpose()?;
        let inner = &mut self.inner;
        let finished = py
            .detach(|| inner.update(tokens, eos).map(<[u64]>::to_vec))
            .py()?;
        Ok(ids_to_numpy(py, finished))
    }

    /// Undoes the scheduled step that did not run (preemptions stay applied), then
    /// applies the aborts requested while it was pending. Returns their ids (int64).
    fn revert<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let finished = self.inner.revert().map(<[u64]>::to_vec).py()?;
        Ok(ids_to_numpy(py, finished))
    }

    /// Aborts a request (valid in every state; a finished, untaken one is left as it
    /// is). While a step is pending the abort takes effect when it closes.
    fn abort(&mut self, request_id: i64) -> PyResult<()> {
        self.inner.abort(self::request_id(request_id)?).py()
    }

    /// Aborts several requests in order; every id is checked first (all or nothing).
    fn abort_many(&mut self, py: Python<'_>, request_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = u64_vec(request_ids, "request ids", false)?;
        let inner = &mut self.inner;
        py.detach(|| inner.abort_many(&ids)).py()
    }

    /// Whether an abort of this live request waits for the pending step to close.
    fn is_abort_requested(&self, request_id: i64) -> PyResult<bool> {
        self.inner
            .is_abort_requested(self::request_id(request_id)?)
            .py()
    }

    /// The output of a finished request (tokens, finish reason, counters); each output
    /// is taken once.
    fn take_output(&mut self, py: Python<'_>, request_id: i64) -> PyResult<PyRequestOutput> {
        let output = self.inner.take_output(self::request_id(request_id)?).py()?;
        PyRequestOutput::new(py, output)
    }

    /// Prompt (with folded tokens) plus generated tokens of a live request (int32).
    fn tokens<'py>(&self, py: Python<'py>, request_id: i64) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let tokens = self.inner.tokens(self::request_id(request_id)?).py()?;
        Ok(PyArray1::from_slice(py, tokens))
    }

    /// `"waiting"`, `"prefilling"`, `"decoding"` or `"suspended"`.
    fn request_state(&self, request_id: i64) -> PyResult<&'static str> {
        Ok(self
            .inner
            .request_state(self::request_id(request_id)?)
            .py()?
            .as_str())
    }

    /// Page-table rows of `request_ids` (int32, `[len(ids), width]`, -1 padded).
    #[pyo3(signature = (request_ids, width = None))]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        width: Option<usize>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = u64_vec(request_ids, "request ids", false)?;
        block_table(py, self.inner.ledger(), &ids, width)
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

    /// Totals, with KV use as of now.
    fn metrics(&self) -> PySchedulerMetrics {
        self.inner.metrics().into()
    }

    /// Counters of a live request, or of a finished one whose output is not taken yet.
    fn request_metrics(&self, request_id: i64) -> PyResult<PyRequestMetrics> {
        Ok(self
            .inner
            .request_metrics(self::request_id(request_id)?)
            .py()?
            .into())
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
    /// Whether any request is live.
    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }
    /// Ids of live requests in queue order (int64).
    fn queue_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        ids_to_numpy(py, self.inner.queue_ids())
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    crate::scheduler_config::register(m)?;
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyScheduleOutput>()?;
    m.add_class::<PySchedulerMetrics>()?;
    m.add_class::<PyRequestMetrics>()?;
    crate::request_output::register(m)?;
    Ok(())
}
