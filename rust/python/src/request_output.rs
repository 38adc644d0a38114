//! `RequestOutput`: what `Scheduler.take_output` hands over for a finished request.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use helix_kv_core::{FinishReason, RequestMetrics, RequestOutput};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::arrays::{id_arg, invalid_type_of, make_read_only, str_arg, token_ids as token_ids_arg};
use crate::errors::InvalidArgumentError;
use crate::records::PyRequestMetrics;

/// Tokens shown by `repr` before it elides the rest.
const REPR_TOKENS: usize = 16;

fn parse_finish_reason(text: &str) -> PyResult<FinishReason> {
    match text {
        "length" => Ok(FinishReason::Length),
        "eos" => Ok(FinishReason::Eos),
        "aborted" => Ok(FinishReason::Aborted),
        other => Err(InvalidArgumentError::new_err(format!(
            "finish_reason must be 'length', 'eos' or 'aborted', got {other:?}"
        ))),
    }
}

/// A read-only int32 array owning `tokens` (no copy): the record is frozen, so its
/// array must not be writable either.
fn frozen_tokens(py: Python<'_>, tokens: Vec<i32>) -> Py<PyArray1<i32>> {
    let array = PyArray1::from_vec(py, tokens);
    make_read_only(&array);
    array.unbind()
}

/// The output of a finished request (frozen): its id, the tokens it generated, why it
/// finished (`"length"`, `"eos"` or `"aborted"`) and its counters at the end.
#[pyclass(frozen, module = "helix_kv._core", name = "RequestOutput")]
pub struct PyRequestOutput {
    id: u64,
    token_ids: Py<PyArray1<i32>>,
    finish_reason: FinishReason,
    metrics: RequestMetrics,
}

impl PyRequestOutput {
    pub fn new(py: Python<'_>, output: RequestOutput) -> Self {
        Self {
            id: output.request_id,
            token_ids: frozen_tokens(py, output.token_ids),
            finish_reason: output.finish_reason,
            metrics: output.metrics,
        }
    }

    fn tokens<'a>(&'a self, py: Python<'a>) -> PyResult<Vec<i32>> {
        Ok(self.token_ids.bind(py).readonly().as_slice()?.to_vec())
    }
}

#[pymethods]
impl PyRequestOutput {
    /// Rebuilds an output (what unpickling calls): a request id, token ids that fit int32,
    /// a finish reason (a str: `"length"`, `"eos"` or `"aborted"`) and a `RequestMetrics`;
    /// each checked like every argument.
    #[new]
    fn py_new(
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        finish_reason: &Bound<'_, PyAny>,
        metrics: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let id = id_arg(request_id)?;
        let tokens = token_ids_arg(token_ids, "token_ids")?.as_slice()?.to_vec();
        let finish_reason = parse_finish_reason(&str_arg(finish_reason, "finish_reason")?)?;
        let metrics = metrics
            .cast::<PyRequestMetrics>()
            .map_err(|_| invalid_type_of("metrics", "a RequestMetrics", metrics))?;
        Ok(Self {
            id,
            token_ids: frozen_tokens(py, tokens),
            finish_reason,
            metrics: RequestMetrics::from(metrics.get()),
        })
    }

    /// The request's id.
    #[getter]
    fn request_id(&self) -> u64 {
        self.id
    }

    /// Tokens generated before it finished (int32, read-only), across preemptions; for
    /// an aborted request, those generated before the abort took effect.
    #[getter]
    fn token_ids(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.token_ids.clone_ref(py)
    }

    /// `"length"` (`max_new_tokens` reached), `"eos"` (flagged end-of-sequence) or
    /// `"aborted"`.
    #[getter]
    fn finish_reason(&self) -> &'static str {
        self.finish_reason.as_str()
    }

    /// Its counters when it finished.
    #[getter]
    fn metrics(&self) -> PyRequestMetrics {
        self.metrics.into()
    }

    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, Self>) -> PyResult<bool> {
        let other = other.get();
        Ok(self.id == other.id
            && self.finish_reason == other.finish_reason
            && self.metrics == other.metrics
            && self.tokens(py)? == other.tokens(py)?)
    }

    fn __hash__(&self, py: Python<'_>) -> PyResult<u64> {
        let mut hasher = DefaultHasher::new();
        (self.id, self.finish_reason, self.metrics, self.tokens(py)?).hash(&mut hasher);
        Ok(hasher.finish())
    }

    /// Pickles as `RequestOutput(request_id, token_ids, finish_reason, metrics)`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let this = slf.get();
        let args = (
            this.id,
            this.token_ids.clone_ref(py),
            this.finish_reason.as_str(),
            PyRequestMetrics::from(this.metrics),
        )
            .into_pyobject(py)?;
        PyTuple::new(py, [py.get_type::<Self>().into_any(), args.into_any()])
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let tokens = self.tokens(py)?;
        let mut shown: Vec<String> = tokens
            .iter()
            .take(REPR_TOKENS)
            .map(ToString::to_string)
            .collect();
        if tokens.len() > REPR_TOKENS {
            shown.push(format!("... ({} tokens)", tokens.len()));
        }
        Ok(format!(
            "RequestOutput(request_id={}, token_ids=[{}], finish_reason='{}', metrics={})",
            self.id,
            shown.join(", "),
            self.finish_reason.as_str(),
            PyRequestMetrics::from(self.metrics).__repr__(py)?
        ))
    }
}
