//! Array and integer conversions at the Python edge. Negative values are refused here with
//! typed errors so the core only ever sees valid unsigned quantities.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::{InvalidArgumentError, InvalidLengthError};

/// A contiguous read-only `int64` view of `obj` (any integer array or sequence); converts
/// only when `obj` is not already a contiguous `int64` array.
pub fn int64_array<'py>(obj: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArray1<'py, i64>> {
    if let Ok(array) = obj.cast::<PyArray1<i64>>() {
        if array.is_contiguous() {
            return Ok(array.readonly());
        }
    }
    let numpy = obj.py().import("numpy")?;
    let converted = numpy.call_method1("ascontiguousarray", (obj, "int64"))?;
    let array = converted
        .cast_into::<PyArray1<i64>>()
        .map_err(|_| InvalidArgumentError::new_err("expected a one-dimensional integer array"))?;
    Ok(array.readonly())
}

/// Copies `values` into a `u64` vector, refusing negatives (`what` names them in the error).
pub fn non_negative(values: &[i64], what: &str, length: bool) -> PyResult<Vec<u64>> {
    // One branch-free pass finds out whether any value is negative; then a plain
    // (vectorised) copy of the right size. The slow search only names the culprit.
    if values.iter().fold(0, |acc, &v| acc | v) >= 0 {
        return Ok(values.iter().map(|&v| v as u64).collect());
    }
    let v = values.iter().copied().find(|&v| v < 0).unwrap_or_default();
    let message = format!("{what} must be non-negative, got {v}");
    Err(if length {
        InvalidLengthError::new_err(message)
    } else {
        InvalidArgumentError::new_err(message)
    })
}

/// A non-negative length from a Python int.
pub fn length(value: i64, what: &str) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| {
        InvalidLengthError::new_err(format!("{what} must be non-negative, got {value}"))
    })
}

/// A non-negative request id from a Python int.
pub fn request_id(value: i64) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| {
        InvalidArgumentError::new_err(format!("request ids must be non-negative, got {value}"))
    })
}

/// `int64` ids/lengths from an array-like, as `u64`.
pub fn u64_vec(obj: &Bound<'_, PyAny>, what: &str, length: bool) -> PyResult<Vec<u64>> {
    let array = int64_array(obj)?;
    non_negative(array.as_slice()?, what, length)
}
