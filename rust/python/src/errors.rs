//! One Python exception per `CoreError` kind under the `HelixKVError` base, plus
//! `InvalidTypeError` for the binding's own type checks: every class here is one that Rust
//! raises. The match in `From<CoreErr> for PyErr` is exhaustive, so a new core variant cannot
//! ship without a class. The errors only the Python layer raises (the group errors) live in
//! `helix_kv.errors`, subclassing these.

use helix_kv_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

// The one class Rust never raises itself: the base every error here (and every Python-layer
// error in `helix_kv.errors`) derives from, so one `except HelixKVError` catches them all.
create_exception!(
    helix_kv,
    HelixKVError,
    PyException,
    "Base class of every helix_kv error."
);
create_exception!(
    helix_kv,
    ConfigError,
    HelixKVError,
    "A configuration value is out of range or inconsistent."
);
create_exception!(
    helix_kv,
    InvalidArgumentError,
    HelixKVError,
    "An argument is malformed (array lengths, rank, repeated id)."
);
create_exception!(
    helix_kv,
    InvalidLengthError,
    HelixKVError,
    "A length is negative, too large, or moves the wrong way."
);
create_exception!(
    helix_kv,
    UnknownRequestError,
    HelixKVError,
    "The request id is not held (never added, or already freed)."
);
create_exception!(
    helix_kv,
    DuplicateRequestError,
    HelixKVError,
    "The request id is already in use."
);
create_exception!(
    helix_kv,
    RequestTooLargeError,
    HelixKVError,
    "The request can never fit; the message names the limit."
);
create_exception!(
    helix_kv,
    PreemptionDisabledError,
    HelixKVError,
    "KV pressure where preemption is disabled (disaggregated generation)."
);
create_exception!(
    helix_kv,
    DeadlockError,
    HelixKVError,
    "Many consecutive steps with candidates and no progress."
);
create_exception!(
    helix_kv,
    InvalidStateError,
    HelixKVError,
    "A call arrived in the wrong order (e.g. update without schedule)."
);
/// `InvalidTypeError(InvalidArgumentError, TypeError)`: `create_exception!` takes one base,
/// so this class is made by `type(...)` once and kept.
static INVALID_TYPE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn invalid_type_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    INVALID_TYPE_ERROR
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [
                    py.get_type::<InvalidArgumentError>(),
                    py.get_type::<PyTypeError>(),
                ],
            )?;
            let namespace = PyDict::new(py);
            namespace.set_item("__module__", "helix_kv")?;
            namespace.set_item(
                "__doc__",
                "An argument has the wrong type or dtype kind (a float, str, bool or None \
                 where an integer is expected); also a TypeError.",
            )?;
            Ok::<_, PyErr>(
                py.get_type::<PyType>()
                    .call1(("InvalidTypeError", bases, namespace))?
                    .cast_into::<PyType>()?
                    .unbind(),
            )
        })
        .map(|ty| ty.bind(py))
}

/// An `InvalidTypeError` with `message`.
pub fn invalid_type(message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match invalid_type_error(py) {
        Ok(ty) => PyErr::from_type(ty.clone(), message),
        Err(err) => err,
    })
}

/// A `CoreError` on its way to Python (the orphan rule forbids `From<CoreError> for PyErr`).
pub struct CoreErr(pub CoreError);

impl From<CoreError> for CoreErr {
    fn from(err: CoreError) -> Self {
        Self(err)
    }
}

impl From<CoreErr> for PyErr {
    fn from(CoreErr(err): CoreErr) -> Self {
        let message = err.to_string();
        match err {
            CoreError::Config(_) => ConfigError::new_err(message),
            CoreError::InvalidArgument(_) => InvalidArgumentError::new_err(message),
            CoreError::InvalidLength(_) => InvalidLengthError::new_err(message),
            CoreError::UnknownRequest(_) => UnknownRequestError::new_err(message),
            CoreError::DuplicateRequest(_) => DuplicateRequestError::new_err(message),
            CoreError::RequestTooLarge { .. } => RequestTooLargeError::new_err(message),
            CoreError::PreemptionDisabled(_) => PreemptionDisabledError::new_err(message),
            CoreError::Deadlock(_) => DeadlockError::new_err(message),
            CoreError::InvalidState(_) => InvalidStateError::new_err(message),
        }
    }
}

/// `?`-friendly conversion of core results.
pub trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, CoreError> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| CoreErr(e).into())
    }
}

/// Adds `InvalidTypeError`, the one exception class made at run time (the others are
/// exported by the module's export list).
pub fn add_invalid_type_error(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("InvalidTypeError", invalid_type_error(m.py())?)
}
