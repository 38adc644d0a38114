//! Argument conversions at the Python edge (rules: docs/errors.md, "Argument rules").
//!
//! Nothing is coerced: an integer argument is a Python `int` or a numpy integer scalar
//! (never a `bool`, float, string or `None`), an integer array is a one-dimensional numpy
//! array of an integer dtype or a list/tuple of such integers, and every value is range
//! checked before the core sees it. The dtype kind is checked before anything is
//! converted, so numpy never gets the chance to truncate a float or parse a string.
//!
//! Errors: a wrong type or dtype kind is an `InvalidTypeError` (an `InvalidArgumentError`
//! and a `TypeError`); a wrong shape, or an id, rank or token out of range, an
//! `InvalidArgumentError`; a length, position or count out of range an
//! `InvalidLengthError`.

use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt, PyList, PySequence, PyString, PyTuple};

use crate::errors::{invalid_type, InvalidArgumentError, InvalidLengthError};

/// Largest length, position or count accepted (`2**63 - 1`: they come back as int64).
pub const MAX_LENGTH: u64 = i64::MAX as u64;

// -- scalars ---------------------------------------------------------------------------

/// `repr(obj)` for an error message (shortened: a hostile argument may be huge).
fn describe(obj: &Bound<'_, PyAny>) -> String {
    let text = obj
        .repr()
        .map_or_else(|_| "<unprintable>".to_string(), |r| r.to_string());
    let type_name = obj
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    let mut short: String = text.chars().take(60).collect();
    if short.len() < text.len() {
        short.push_str("...");
    }
    format!("{short} ({type_name})")
}

/// `obj` as a Python int: an `int` (not a `bool`) or a numpy integer scalar (anything with
/// `__index__`, which floats, strings and numpy bools lack).
fn python_int<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyInt>> {
    let not_an_int = || invalid_type(format!("{what} must be an integer, got {}", describe(obj)));
    if obj.is_instance_of::<PyBool>() {
        return Err(not_an_int());
    }
    if let Ok(int) = obj.cast::<PyInt>() {
        return Ok(int.clone());
    }
    // An object whose attribute lookup itself fails is no integer either.
    if !obj
        .hasattr(pyo3::intern!(obj.py(), "__index__"))
        .unwrap_or(false)
    {
        return Err(not_an_int());
    }
    obj.call_method0(pyo3::intern!(obj.py(), "__index__"))
        .ok()
        .and_then(|value| value.cast_into::<PyInt>().ok())
        .ok_or_else(not_an_int)
}

/// A request id: an integer in `0..=2**64-1`.
pub fn id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let int = python_int(obj, "a request id")?;
    if let Ok(value) = int.extract::<i64>() {
        return request_id(value);
    }
    int.extract::<u64>().map_err(|_| {
        InvalidArgumentError::new_err(format!(
            "request ids must be in 0..=2**64-1, got {}",
            describe(obj)
        ))
    })
}

/// A length, position or count: an integer in `0..=2**63-1`.
pub fn length_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let int = python_int(obj, what)?;
    let value = int.extract::<i64>().map_err(|_| {
        InvalidLengthError::new_err(format!(
            "{what} must be in 0..=2**63-1, got {}",
            describe(obj)
        ))
    })?;
    length(value, what)
}

/// An unsigned integer of the full `u64` range (a step number).
pub fn u64_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let int = python_int(obj, what)?;
    int.extract::<u64>().map_err(|_| {
        InvalidArgumentError::new_err(format!(
            "{what} must be in 0..=2**64-1, got {}",
            describe(obj)
        ))
    })
}

/// An integer that must fit `T`; `out_of_range` builds the error from its message.
pub fn int_arg<T: for<'a, 'py> FromPyObject<'a, 'py>>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    range: &str,
    out_of_range: impl FnOnce(String) -> PyErr,
) -> PyResult<T> {
    let int = python_int(obj, what)?;
    int.extract::<T>().map_err(|_| {
        out_of_range(format!(
            "{what} must be an integer in {range}, got {}",
            describe(obj)
        ))
    })
}

/// A rank: an integer in `0..=2**32-1` (the core checks it against the group).
pub fn rank_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    int_arg(obj, "cp_rank", "0..=2**32-1", |m| {
        InvalidArgumentError::new_err(m)
    })
}

/// A flag: a `bool` or a numpy bool scalar (an int is refused: `0`/`1` is ambiguous with
/// a count).
pub fn flag_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<bool> {
    obj.extract::<bool>()
        .map_err(|_| invalid_type(format!("{what} must be a bool, got {}", describe(obj))))
}

/// The `InvalidTypeError` for `obj` given as `what` where `expected` was wanted.
pub fn invalid_type_of(what: &str, expected: &str, obj: &Bound<'_, PyAny>) -> PyErr {
    invalid_type(format!("{what} must be {expected}, got {}", describe(obj)))
}

/// A string.
pub fn str_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    obj.cast::<PyString>()
        .map_err(|_| invalid_type(format!("{what} must be a str, got {}", describe(obj))))?
        .extract::<String>()
}

// -- arrays ------------------------------------------------------------------------------

/// A value of [`Ints`] for an error message.
fn show(value: i128) -> String {
    match value {
        i128::MIN => "a value below -2**64".to_string(),
        i128::MAX => "a value of 2**64 or more".to_string(),
        v => v.to_string(),
    }
}

/// The integers of an array argument, before range checks: borrowed from numpy where the
/// array already is a contiguous, aligned 64-bit integer one, copied into one where it is
/// another integer array (another width or byte order, strided, misaligned), or read one by
/// one from a list/tuple.
pub enum Ints<'py> {
    Signed(PyReadonlyArray1<'py, i64>),
    Unsigned(PyReadonlyArray1<'py, u64>),
    /// From a Python sequence: values in `-2**63..2**64`, and `i128::MIN`/`i128::MAX` for
    /// anything beyond.
    Wide(Vec<i128>),
}

impl Ints<'_> {
    /// Converts every value with `f`, which refuses (with its value) what is out of range.
    fn map<T>(
        &self,
        f: impl Fn(i128) -> Option<T>,
        bad: impl Fn(i128) -> PyErr,
    ) -> PyResult<Vec<T>> {
        fn convert<V: Copy + Into<i128>, T>(
            values: &[V],
            f: impl Fn(i128) -> Option<T>,
            bad: impl Fn(i128) -> PyErr,
        ) -> PyResult<Vec<T>> {
            let mut out = Vec::with_capacity(values.len());
            for &v in values {
                let v = v.into();
                out.push(f(v).ok_or_else(|| bad(v))?);
            }
            Ok(out)
        }
        match self {
            Self::Signed(array) => convert(array.as_slice()?, f, bad),
            Self::Unsigned(array) => convert(array.as_slice()?, f, bad),
            Self::Wide(values) => convert(values, f, bad),
        }
    }
}

/// The numpy array behind `obj`, if it is one or converts to one without guessing
/// (objects with `__array__`, e.g. CPU tensors); `None` for lists, tuples and other
/// sequences, which are read element by element.
fn as_ndarray<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Option<Bound<'py, PyUntypedArray>>> {
    let py = obj.py();
    let array = if let Ok(array) = obj.cast::<PyUntypedArray>() {
        array.clone()
    } else if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
    {
        return Err(invalid_type(format!(
            "{what} must be a one-dimensional integer array or sequence, got {}",
            describe(obj)
        )));
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return Ok(None);
    } else if obj.hasattr(pyo3::intern!(py, "__array__")).unwrap_or(false) {
        let converted = py
            .import("numpy")?
            .call_method1("asarray", (obj,))
            .map_err(|e| {
                invalid_type(format!(
                    "{what}: {} cannot be read as an array: {e}",
                    describe(obj)
                ))
            })?;
        converted
            .cast_into::<PyUntypedArray>()
            .map_err(|_| invalid_type(format!("{what}: {} is not an array", describe(obj))))?
    } else if obj.cast::<PySequence>().is_ok() {
        return Ok(None);
    } else {
        return Err(invalid_type(format!(
            "{what} must be a one-dimensional integer array or sequence, got {}",
            describe(obj)
        )));
    };
    if array.ndim() != 1 {
        return Err(InvalidArgumentError::new_err(format!(
            "{what} must be one-dimensional, got an array of shape {:?}",
            array.shape()
        )));
    }
    Ok(Some(array))
}

/// Whether a slice can borrow `array`'s memory: contiguous and aligned to its elements.
/// numpy makes misaligned arrays (`np.frombuffer(buf, np.int64, offset=1)`, fields of a
/// packed record), which a Rust slice must not point at.
pub fn is_readable<T: numpy::Element>(array: &Bound<'_, PyArray1<T>>) -> bool {
    array.is_contiguous() && array.is_aligned()
}

/// `array` as a contiguous, aligned array of `T`: borrowed when it already is one, else
/// copied into a fresh one (after the kind check, so the conversion preserves values). A
/// fresh `numpy.array` is asked for outright: `ascontiguousarray` hands a misaligned
/// contiguous array back unchanged.
pub fn readable<'py, T: numpy::Element>(
    array: &Bound<'py, PyUntypedArray>,
) -> PyResult<PyReadonlyArray1<'py, T>> {
    if let Ok(typed) = array.cast::<PyArray1<T>>() {
        if is_readable(typed) {
            return Ok(typed.readonly());
        }
    }
    let py = array.py();
    let converted = py
        .import("numpy")?
        .call_method1("array", (array, T::get_dtype(py)))?;
    Ok(converted
        .cast_into::<PyArray1<T>>()
        .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?
        .readonly())
}

/// A sequence that raises while it is read (a hostile `__iter__`/`__getitem__`) is an
/// `InvalidTypeError` too, with the original error as its cause.
fn unreadable<T>(result: PyResult<T>, what: &str) -> PyResult<T> {
    result.map_err(|err| {
        let wrapped = invalid_type(format!("{what} could not be read: {err}"));
        Python::attach(|py| wrapped.set_cause(py, Some(err)));
        wrapped
    })
}

/// Elements to reserve room for before reading `sequence`: its `len()`, which a hostile
/// `__len__` may make up (`2**62` would overflow the allocation, `2**58` abort the process
/// when it cannot be allocated), so at most `2**16` of them; a longer sequence grows the
/// vector as it is read.
fn capacity_hint(sequence: &Bound<'_, PySequence>) -> usize {
    const MAX_HINT: usize = 1 << 16;
    sequence.len().map_or(0, |len| len.min(MAX_HINT))
}

/// The values of the elements of a list, tuple or other sequence, each a Python int.
fn sequence_ints(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i128>> {
    let sequence = obj
        .cast::<PySequence>()
        .map_err(|_| invalid_type(format!("{what} must be a sequence, got {}", describe(obj))))?;
    let mut out = Vec::with_capacity(capacity_hint(sequence));
    for (i, item) in unreadable(obj.try_iter(), what)?.enumerate() {
        let item = unreadable(item, what)?;
        let element = format!("{what}[{i}]");
        let int = python_int(&item, &element)?;
        let value = if let Ok(v) = int.extract::<i64>() {
            i128::from(v)
        } else if let Ok(v) = int.extract::<u64>() {
            i128::from(v)
        } else if int.lt(0)? {
            // Outside every 64-bit range: out of range for every target, whose own rule
            // then names the error class.
            i128::MIN
        } else {
            i128::MAX
        };
        out.push(value);
    }
    Ok(out)
}

/// The integers of `obj`: a one-dimensional numpy array of an integer dtype (any width,
/// signed or unsigned; an empty array of any dtype), an object with `__array__` giving
/// one, or a list/tuple/sequence of ints. Floats, bools, strings and objects are refused.
pub fn integers<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Ints<'py>> {
    match as_ndarray(obj, what)? {
        Some(array) => array_ints(&array, what),
        None => Ok(Ints::Wide(sequence_ints(obj, what)?)),
    }
}

/// The integers of a one-dimensional numpy array, refused unless its dtype kind is integer.
fn array_ints<'py>(array: &Bound<'py, PyUntypedArray>, what: &str) -> PyResult<Ints<'py>> {
    let dtype = array.dtype();
    match dtype.kind() {
        b'u' if dtype.itemsize() == 8 => Ok(Ints::Unsigned(readable(array)?)),
        b'i' | b'u' => Ok(Ints::Signed(readable(array)?)),
        // `np.array([])` is float64: an empty array holds no value to coerce.
        _ if array.is_empty() => Ok(Ints::Wide(Vec::new())),
        _ => Err(invalid_type(format!(
            "{what} must have an integer dtype, got {}",
            dtype
                .str()
                .map_or_else(|_| "?".to_string(), |s| s.to_string())
        ))),
    }
}

/// Copies `values` into a `u64` vector, refusing negatives (`what` names them in the error).
pub fn non_negative(values: &[i64], what: &str, length: bool) -> PyResult<Vec<u64>> {
    // One branch-free pass finds out whether any value is negative; then a plain
    // (vectorised) copy of the right size. The slow search only names the culprit.
    if values.iter().fold(0, |acc, &v| acc | v) >= 0 {
        #[expect(
            clippy::cast_sign_loss,
            reason = "the fold above found no negative value, and a non-negative i64 fits u64"
        )]
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

/// A non-negative request id from a Python int (see [`id_arg`] for the full `u64` range).
pub fn request_id(value: i64) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| {
        InvalidArgumentError::new_err(format!("request ids must be non-negative, got {value}"))
    })
}

/// Request ids (`length == false`: `0..=2**64-1`, else `InvalidArgumentError`) or
/// lengths/positions/counts (`length == true`: `0..=2**63-1`, else `InvalidLengthError`)
/// from an integer array-like, as `u64`.
pub fn u64_vec(obj: &Bound<'_, PyAny>, what: &str, length: bool) -> PyResult<Vec<u64>> {
    let ints = integers(obj, what)?;
    let max = if length { MAX_LENGTH } else { u64::MAX };
    match &ints {
        // The common cases: an int64 array (or one converted to it), where
        // `non_negative` is the vectorised path, and a uint64 array of ids (a copy).
        Ints::Signed(array) => return non_negative(array.as_slice()?, what, length),
        Ints::Unsigned(array) if !length => return Ok(array.as_slice()?.to_vec()),
        _ => {}
    }
    ints.map(
        |v| u64::try_from(v).ok().filter(|&v| v <= max),
        |v| {
            let message = if length {
                format!("{what} must be in 0..=2**63-1, got {}", show(v))
            } else {
                format!("{what} must be in 0..=2**64-1, got {}", show(v))
            };
            if length {
                InvalidLengthError::new_err(message)
            } else {
                InvalidArgumentError::new_err(message)
            }
        },
    )
}

/// An array argument of `T`s: borrowed when the caller's array already is a contiguous,
/// aligned one of `T`, else the values converted from it.
pub enum ArrayArg<'py, T: numpy::Element> {
    Borrowed(PyReadonlyArray1<'py, T>),
    Converted(Vec<T>),
}

impl<T: numpy::Element> ArrayArg<'_, T> {
    pub fn as_slice(&self) -> PyResult<&[T]> {
        match self {
            Self::Borrowed(array) => Ok(array.as_slice()?),
            Self::Converted(values) => Ok(values),
        }
    }
}

/// Token ids (int32): borrowed when already a contiguous, aligned int32 array, else range
/// checked (numpy's own cast would wrap silently).
pub type TokenIds<'py> = ArrayArg<'py, i32>;

/// Token ids from an integer array-like; each must fit int32 (`InvalidArgumentError`).
pub fn token_ids<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<TokenIds<'py>> {
    if let Ok(array) = obj.cast::<PyArray1<i32>>() {
        if is_readable(array) {
            return Ok(TokenIds::Borrowed(array.readonly()));
        }
    }
    let values = integers(obj, what)?.map(
        |v| i32::try_from(v).ok(),
        |v| InvalidArgumentError::new_err(format!("{what} must fit int32, got {}", show(v))),
    )?;
    Ok(TokenIds::Converted(values))
}

/// Flags: borrowed when already a contiguous bool array, else read from a bool array, an
/// integer array or sequence of `0`/`1`, or a sequence of bools. Floats, strings and
/// objects are refused (numpy's `bool` cast would make `"no"` true).
pub type Flags<'py> = ArrayArg<'py, bool>;

/// See [`Flags`].
pub fn flags<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Flags<'py>> {
    let bit = |v: i128| match v {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    };
    let bad = |v| {
        InvalidArgumentError::new_err(format!("{what} must be bools (or 0/1), got {}", show(v)))
    };
    match as_ndarray(obj, what)? {
        Some(array) if array.dtype().kind() == b'b' => Ok(Flags::Borrowed(readable(&array)?)),
        Some(array) => Ok(Flags::Converted(array_ints(&array, what)?.map(bit, bad)?)),
        None => {
            let sequence = obj.cast::<PySequence>().map_err(|_| {
                invalid_type(format!("{what} must be a sequence, got {}", describe(obj)))
            })?;
            let mut out = Vec::with_capacity(capacity_hint(sequence));
            for (i, item) in unreadable(obj.try_iter(), what)?.enumerate() {
                let item = unreadable(item, what)?;
                if let Ok(flag) = item.extract::<bool>() {
                    out.push(flag);
                    continue;
                }
                let element = format!("{what}[{i}]");
                let value = python_int(&item, &element).map_err(|_| {
                    invalid_type(format!("{element} must be a bool, got {}", describe(&item)))
                })?;
                out.push(
                    value
                        .extract::<i64>()
                        .ok()
                        .and_then(|v| bit(v.into()))
                        .ok_or_else(|| {
                            InvalidArgumentError::new_err(format!(
                                "{element} must be a bool (or 0/1), got {}",
                                describe(&item)
                            ))
                        })?,
                );
            }
            Ok(Flags::Converted(out))
        }
    }
}

/// An empty vector with room for `len` values (`None`: a size past what can be described),
/// and `len`; `InvalidLengthError` naming `what` when it cannot be allocated. Filling it is
/// left to the caller, e.g. with the GIL released.
pub fn try_capacity<T>(len: Option<usize>, what: impl Fn() -> String) -> PyResult<(Vec<T>, usize)> {
    let too_large = || InvalidLengthError::new_err(format!("{} is too large to allocate", what()));
    let len = len.ok_or_else(too_large)?;
    let mut out = Vec::new();
    out.try_reserve_exact(len).map_err(|_| too_large())?;
    Ok((out, len))
}

/// A block table: a two-dimensional numpy integer array, or a list/tuple of equally long
/// integer rows. Returns the entries row-major (as int64; padding is negative) and the
/// width. A wrong type or dtype kind is an `InvalidTypeError`, a wrong shape or a value
/// outside int64 an `InvalidArgumentError`.
pub fn table_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(Vec<i64>, usize)> {
    let to_i64 = |ints: Ints<'_>| {
        ints.map(
            |v| i64::try_from(v).ok(),
            |v| {
                InvalidArgumentError::new_err(format!(
                    "{what} entries must fit int64, got {}",
                    show(v)
                ))
            },
        )
    };
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        if array.ndim() != 2 {
            return Err(InvalidArgumentError::new_err(format!(
                "{what} must be two-dimensional, got an array of shape {:?}",
                array.shape()
            )));
        }
        let width = array.shape()[1];
        let flat = array.call_method0(pyo3::intern!(obj.py(), "ravel"))?;
        return Ok((to_i64(integers(&flat, what)?)?, width));
    }
    if !(obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()) {
        return Err(invalid_type(format!(
            "{what} must be a two-dimensional integer array or a list of integer rows, got {}",
            describe(obj)
        )));
    }
    let mut entries = Vec::new();
    let mut width = None;
    for row in obj.try_iter()? {
        let row = to_i64(integers(&row?, what)?)?;
        if *width.get_or_insert(row.len()) != row.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "the rows of {what} must have the same length"
            )));
        }
        entries.extend(row);
    }
    Ok((entries, width.unwrap_or(0)))
}

/// Clears the `WRITEABLE` flag of an array the binding just made (from a vector): numpy then
/// refuses writes, and as the memory's owner is not a writable buffer, Python cannot set the
/// flag back.
pub fn make_read_only<T: numpy::Element>(array: &Bound<'_, PyArray1<T>>) {
    // A fresh, unshared array: the write borrow cannot fail.
    if let Ok(borrow) = array.try_readwrite() {
        drop(borrow.make_nonwriteable());
    }
}
