//! Value records: small frozen classes (`SchedulerMetrics`, `RequestMetrics`, `DecodeView`,
//! `RequestHoldings`) built by [`value_record!`] from one field list, most of them the core's
//! own (`helix_kv_core::scheduler_metrics_fields!` and friends). From that list come the
//! class, its getters (with the fields' doc comments), the conversions from (and back to)
//! the core record, a keyword-only constructor, `FIELDS`, `to_dict`, `__repr__` and
//! `__reduce__` (pickling), so a field added to the core list shows up everywhere. The
//! constructor checks each keyword like every other argument ([`RecordField`]).

/// Defines a value record class from a field list (see the module doc). Used as the
/// callback of a core `*_fields!` macro, or directly with the list written out:
///
/// ```ignore
/// helix_kv_core::request_metrics_fields!(value_record! {
///     /// Class docstring.
///     PyRequestMetrics as "RequestMetrics" from helix_kv_core::RequestMetrics, default = 0
/// });
/// ```
///
/// `from CoreType` adds `From<CoreType>` and `From<&Self> for CoreType` (field for field);
/// `default = 0` gives every constructor keyword that default (else they are required).
macro_rules! value_record {
    ({ $(#[doc = $class_doc:tt])* $name:ident as $py:tt $(from $core:ty)?, default = $default:tt
       $(, renamed { $($old:ident => $new:ident),* $(,)? })? }
     $($fields:tt)*) => {
        value_record!(@signature
            { $(#[doc = $class_doc])* $name $py [$($core)?] [$($($old => $new),*)?] }
            [$default] $($fields)*);
    };
    ({ $(#[doc = $class_doc:tt])* $name:ident as $py:tt $(from $core:ty)?
       $(, renamed { $($old:ident => $new:ident),* $(,)? })? }
     $($fields:tt)*) => {
        value_record!(@signature
            { $(#[doc = $class_doc])* $name $py [$($core)?] [$($($old => $new),*)?] }
            [] $($fields)*);
    };
    // Each keyword is read by `from_py_with = field_arg::<T, Record, I>` (`I`: its index in
    // the field list, found at compile time), so its errors name the record and the field.
    (@signature $head:tt [$default:tt] $( $(#[doc = $doc:tt])* $field:ident : $ty:ty ),* $(,)?) => {
        value_record!(@define $head (*, $($field = $default),*) $( $(#[doc = $doc])* $field : $ty ),*);
    };
    (@signature $head:tt [] $( $(#[doc = $doc:tt])* $field:ident : $ty:ty ),* $(,)?) => {
        value_record!(@define $head (*, $($field),*) $( $(#[doc = $doc])* $field : $ty ),*);
    };
    (@convert $name:ident [$core:ty] $($field:ident),*) => {
        impl From<$core> for $name {
            fn from(value: $core) -> Self {
                Self { $($field: value.$field),* }
            }
        }

        impl From<&$name> for $core {
            fn from(value: &$name) -> Self {
                Self { $($field: value.$field),* }
            }
        }
    };
    (@convert $name:ident [] $($field:ident),*) => {};
    (@define { $(#[doc = $class_doc:tt])* $name:ident $py:tt [$($core:ty)?]
               [$($old:ident => $new:ident),*] } $signature:tt
     $( $(#[doc = $doc:tt])* $field:ident : $ty:ty ),*) => {
        $(#[doc = $class_doc])*
        #[pyo3::pyclass(frozen, get_all, eq, module = "helix_kv._core", name = $py)]
        #[derive(Clone, PartialEq)]
        pub struct $name {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        value_record!(@convert $name [$($core)?] $($field),*);

        impl $crate::records::RecordNames for $name {
            const NAME: &'static str = $py;
            const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];
        }

        #[pyo3::pymethods]
        impl $name {
            /// Builds the record from its fields, given by keyword (what unpickling calls);
            /// each is checked like every argument (a bool is no integer, a value outside
            /// the field's type is refused).
            #[new]
            #[pyo3(signature = $signature)]
            // An `allow`: only the records of more than seven fields trip the lint.
            #[allow(clippy::too_many_arguments, reason = "one keyword per field")]
            fn py_new(
                $(
                    #[pyo3(from_py_with = $crate::records::field_arg::<
                        $ty,
                        $name,
                        { $crate::records::index_of(
                            <$name as $crate::records::RecordNames>::FIELDS,
                            stringify!($field),
                        ) },
                    >)]
                    $field: $ty
                ),*
            ) -> Self {
                Self { $($field),* }
            }

            /// The field names, in order.
            #[classattr]
            #[expect(non_snake_case, reason = "a Python class constant")]
            fn FIELDS(py: pyo3::Python<'_>) -> pyo3::PyResult<pyo3::Bound<'_, pyo3::types::PyTuple>> {
                pyo3::types::PyTuple::new(py, [$(stringify!($field)),*])
            }

            /// The fields as a dict, in order.
            fn to_dict<'py>(
                &self,
                py: pyo3::Python<'py>,
            ) -> pyo3::PyResult<pyo3::Bound<'py, pyo3::types::PyDict>> {
                use pyo3::types::PyDictMethods as _;
                let dict = pyo3::types::PyDict::new(py);
                $( dict.set_item(stringify!($field), self.$field)?; )*
                Ok(dict)
            }

            /// Pickles as `functools.partial(cls, **to_dict())`.
            fn __reduce__<'py>(
                slf: &pyo3::Bound<'py, Self>,
            ) -> pyo3::PyResult<pyo3::Bound<'py, pyo3::types::PyTuple>> {
                $crate::records::reduce_by_keywords(slf, &slf.get().to_dict(slf.py())?)
            }

            /// `Name(field=value, ...)`, each value as Python shows it.
            pub(crate) fn __repr__(&self, py: pyo3::Python<'_>) -> pyo3::PyResult<String> {
                let dict = self.to_dict(py)?;
                $crate::records::repr_of($py, &dict)
            }

            $(
                /// Deprecated name of a renamed field (kept for one release; warns).
                #[getter]
                fn $old(&self, py: pyo3::Python<'_>) -> pyo3::PyResult<u64> {
                    $crate::records::renamed_field(py, $py, stringify!($old), stringify!($new))?;
                    Ok(u64::from(self.$new))
                }
            )*
        }
    };
}

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyTuple};

use crate::arrays::{flag_arg, int_arg, invalid_type_of};
use crate::errors::InvalidArgumentError;

/// The names a record's constructor reports its errors with.
pub trait RecordNames {
    /// The Python class name.
    const NAME: &'static str;
    /// The field names, in order.
    const FIELDS: &'static [&'static str];
}

/// The value of a field of a value record, given to its constructor: checked like every
/// argument (docs/errors.md, "Argument rules"), so a wrong type is an `InvalidTypeError`
/// and a value the field cannot hold an `InvalidArgumentError`.
pub trait RecordField: Sized {
    /// `obj` as the field `what` (`Record.field`, for the error).
    fn from_keyword(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self>;
}

/// Integers: a Python int or numpy integer scalar (never a bool, float or string) that fits.
macro_rules! integer_field {
    ($($ty:ty => $range:expr),* $(,)?) => {$(
        impl RecordField for $ty {
            fn from_keyword(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
                int_arg::<$ty>(obj, what, $range, InvalidArgumentError::new_err)
            }
        }
    )*};
}

integer_field! {
    u32 => "0..=2**32-1",
    u64 => "0..=2**64-1",
    usize => if usize::BITS == 64 { "0..=2**64-1" } else { "0..=2**32-1" },
}

/// Flags: a bool or numpy bool (an int is refused, as for every flag).
impl RecordField for bool {
    fn from_keyword(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        flag_arg(obj, what)
    }
}

/// Fractions (the utilisations): a float (numpy float64 included) in `0..=1` (so never NaN),
/// or the int 0 or 1; never a bool or string.
impl RecordField for f64 {
    fn from_keyword(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let out_of_range = || {
            let shown = obj
                .repr()
                .map_or_else(|_| "?".to_string(), |r| r.to_string());
            InvalidArgumentError::new_err(format!("{what} must be in 0..=1, got {shown}"))
        };
        let value = if let Ok(float) = obj.cast::<PyFloat>() {
            float.value()
        } else if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
            match obj.extract::<u8>() {
                Ok(int @ 0..=1) => f64::from(int),
                _ => return Err(out_of_range()),
            }
        } else {
            return Err(invalid_type_of(what, "a float in 0..=1", obj));
        };
        if (0.0..=1.0).contains(&value) {
            Ok(value)
        } else {
            Err(out_of_range())
        }
    }
}

/// Field `I` of record `R` from its keyword (`#[pyo3(from_py_with = ...)]` of the
/// constructor).
pub fn field_arg<T: RecordField, R: RecordNames, const I: usize>(
    obj: &Bound<'_, PyAny>,
) -> PyResult<T> {
    T::from_keyword(obj, &format!("{}.{}", R::NAME, R::FIELDS[I]))
}

/// The index of `name` in `names`, at compile time (the constructor's `I` of [`field_arg`]).
///
/// # Panics
///
/// When `name` is not in `names`, which stops the compilation (it is only evaluated in
/// constants).
pub const fn index_of(names: &[&str], name: &str) -> usize {
    let mut i = 0;
    while i < names.len() {
        let (a, b) = (names[i].as_bytes(), name.as_bytes());
        let mut same = a.len() == b.len();
        let mut j = 0;
        while same && j < a.len() {
            same = a[j] == b[j];
            j += 1;
        }
        if same {
            return i;
        }
        i += 1;
    }
    panic!("a field name not in the record's field list");
}

/// `(functools.partial(type(obj), **fields), ())`: pickling by keyword construction.
pub fn reduce_by_keywords<'py, T: pyo3::PyClass>(
    obj: &Bound<'py, T>,
    fields: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = obj.py();
    let rebuild = py
        .import("functools")?
        .getattr("partial")?
        .call((py.get_type::<T>(),), Some(fields))?;
    PyTuple::new(py, [rebuild, PyTuple::empty(py).into_any()])
}

/// Warns that `Record.old` is the deprecated name of `Record.new` (a `DeprecationWarning`
/// pointing at the caller).
pub fn renamed_field(py: Python<'_>, record: &str, old: &str, new: &str) -> PyResult<()> {
    let message = std::ffi::CString::new(format!(
        "{record}.{old} is deprecated (it is removed in the next release): read {record}.{new}"
    ))
    .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyDeprecationWarning>(),
        &message,
        1,
    )
}

/// `name(key=repr(value), ...)` over `fields` in order.
pub fn repr_of(name: &str, fields: &Bound<'_, PyDict>) -> PyResult<String> {
    let mut parts = Vec::with_capacity(fields.len());
    for (key, value) in fields.iter() {
        parts.push(format!("{key}={}", value.repr()?));
    }
    Ok(format!("{name}({})", parts.join(", ")))
}

// The scheduler's records, here rather than with the classes that return them, so the
// classes that hold one (`RequestOutput`) and the scheduler both import them from below.
helix_kv_core::scheduler_metrics_fields!(value_record! {
    /// Scheduler totals (frozen; equal on every rank; picklable).
    PySchedulerMetrics as "SchedulerMetrics" from helix_kv_core::SchedulerMetrics
});

helix_kv_core::request_metrics_fields!(value_record! {
    /// Counters of one request (frozen; picklable).
    PyRequestMetrics as "RequestMetrics" from helix_kv_core::RequestMetrics, default = 0,
    renamed { preemptions => victim_choices }
});
