//! One Python exception per `CoreError` kind under the `HelixKVError` base, plus
//! `InvalidTypeError` for the binding's own type checks: every class here is one that Rust
//! raises. The match in `From<CoreErr> for PyErr` is exhaustive, so a new core variant cannot
//! ship without a class. The errors only the Python layer raises (the group errors) live in
//! `helix_kv.errors`, subclassing these.
//!
//! Two classes are made at run time, once, rather than by `create_exception!`, which gives a
//! class one base and no constructor of its own (and `abi3` rules out a `#[pyclass]`
//! exception): `InvalidTypeError` (two bases) and `ConfigError` (its `field` and `value`
//! keywords and attributes).

use helix_kv_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use std::ffi::CStr;

use crate::arrays::int_arg;

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

/// `ConfigError(HelixKVError)`: the one core error with structured attributes, `field` (the
/// setting at fault, by the name the message gives it) and `value` (its value where the
/// raiser has it), set by its constructor's keywords (as `helix_kv.errors` declares its
/// own errors' attributes), so it is written in Python, run once and kept.
static CONFIG_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

const CONFIG_ERROR_CLASS: &CStr = c"
class ConfigError(HelixKVError):
    '''A configuration value is out of range or inconsistent with another.

    Attributes:
        field: the setting at fault, as the message names it (a ``SchedulerConfig`` field
            such as ``max_num_tokens``, a keyword such as ``kv_tokens``, an argument such
            as the ``cp_size`` of ``Layout``); ``None`` where no one setting is.
        value: the value of that setting (as given, or as the configuration holds it);
            ``None`` where the raiser does not have it.
    '''

    def __init__(self, message='', *, field=None, value=None):
        super().__init__(message)
        self.field = field
        self.value = value
";

fn config_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    CONFIG_ERROR
        .get_or_try_init(py, || {
            let namespace = PyDict::new(py);
            namespace.set_item("__name__", "helix_kv")?;
            namespace.set_item("HelixKVError", py.get_type::<HelixKVError>())?;
            py.run(CONFIG_ERROR_CLASS, Some(&namespace), None)?;
            Ok::<_, PyErr>(
                namespace
                    .get_item("ConfigError")?
                    .ok_or_else(|| PyTypeError::new_err("the ConfigError class was not made"))?
                    .cast_into::<PyType>()?
                    .unbind(),
            )
        })
        .map(|ty| ty.bind(py))
}

/// A `ConfigError` with `message` about `field` (with its `value` where given).
pub fn config_error(
    message: impl Into<String>,
    field: Option<&str>,
    value: Option<&Bound<'_, PyAny>>,
) -> PyErr {
    let message = message.into();
    Python::attach(|py| {
        let made = config_error_type(py).and_then(|ty| {
            let keywords = PyDict::new(py);
            keywords.set_item("field", field)?;
            keywords.set_item("value", value)?;
            ty.call((message,), Some(&keywords))
        });
        match made {
            Ok(error) => PyErr::from_value(error),
            Err(err) => err,
        }
    })
}

/// An integer setting `name` that must fit `T` (`range` says what fits): a `ConfigError`
/// about `name` with the object given as its `value` when it does not; an
/// `InvalidTypeError` when it is no integer.
pub fn int_setting<T: for<'a, 'py> FromPyObject<'a, 'py>>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    range: &str,
) -> PyResult<T> {
    int_arg(obj, name, range, |message| {
        config_error(message, Some(name), Some(obj))
    })
}

/// `err` with the value `value_of` gives for its field, when it is a `ConfigError` about a
/// field and without a value yet (a core `ConfigError` names its field only; the binding
/// knows what was given).
pub fn with_config_value<'py>(
    err: PyErr,
    py: Python<'py>,
    value_of: impl FnOnce(&str) -> PyResult<Option<Bound<'py, PyAny>>>,
) -> PyErr {
    let attach = || -> PyResult<()> {
        let error = err.value(py);
        if !error.is_instance(config_error_type(py)?)? || !error.getattr("value")?.is_none() {
            return Ok(());
        }
        let field = error.getattr("field")?;
        if field.is_none() {
            return Ok(());
        }
        if let Some(value) = value_of(&field.extract::<String>()?)? {
            error.setattr("value", value)?;
        }
        Ok(())
    };
    match attach() {
        Ok(()) => err,
        Err(failed) => failed,
    }
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
            CoreError::Config { field, .. } => config_error(message, Some(field), None),
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

/// Adds `ConfigError` and `InvalidTypeError`, the exception classes made at run time (the
/// others are exported by the module's export list).
pub fn add_run_time_errors(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ConfigError", config_error_type(m.py())?)?;
    m.add("InvalidTypeError", invalid_type_error(m.py())?)
}
