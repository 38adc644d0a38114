//! Value records: small frozen classes (`SchedulerMetrics`, `RequestMetrics`, `DecodeView`,
//! `RequestHoldings`) built by [`value_record!`] from one field list, most of them the core's
//! own (`helix_kv_core::scheduler_metrics_fields!` and friends). From that list come the
//! class, its getters (with the fields' doc comments), the conversions from (and back to)
//! the core record, a keyword-only constructor, `FIELDS`, `to_dict`, `__repr__` and
//! `__reduce__` (pickling), so a field added to the core list shows up everywhere.

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
    ({ $(#[doc = $class_doc:tt])* $name:ident as $py:tt $(from $core:ty)?, default = $default:tt }
     $($fields:tt)*) => {
        value_record!(@signature { $(#[doc = $class_doc])* $name $py [$($core)?] } [$default] $($fields)*);
    };
    ({ $(#[doc = $class_doc:tt])* $name:ident as $py:tt $(from $core:ty)? } $($fields:tt)*) => {
        value_record!(@signature { $(#[doc = $class_doc])* $name $py [$($core)?] } [] $($fields)*);
    };
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
    (@define { $(#[doc = $class_doc:tt])* $name:ident $py:tt [$($core:ty)?] } $signature:tt
     $( $(#[doc = $doc:tt])* $field:ident : $ty:ty ),*) => {
        $(#[doc = $class_doc])*
        #[pyo3::pyclass(frozen, get_all, eq, module = "helix_kv._core", name = $py)]
        #[derive(Clone, PartialEq)]
        pub struct $name {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        value_record!(@convert $name [$($core)?] $($field),*);

        #[pyo3::pymethods]
        impl $name {
            /// Builds the record from its fields, given by keyword (what unpickling calls).
            #[new]
            #[pyo3(signature = $signature)]
            // An `allow`: only the records of more than seven fields trip the lint.
            #[allow(clippy::too_many_arguments, reason = "one keyword per field")]
            fn py_new($($field: $ty),*) -> Self {
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
        }
    };
}

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

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

/// `name(key=repr(value), ...)` over `fields` in order.
pub fn repr_of(name: &str, fields: &Bound<'_, PyDict>) -> PyResult<String> {
    let mut parts = Vec::with_capacity(fields.len());
    for (key, value) in fields.iter() {
        parts.push(format!("{key}={}", value.repr()?));
    }
    Ok(format!("{name}({})", parts.join(", ")))
}
