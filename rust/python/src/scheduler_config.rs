//! `SchedulerConfig`: the scheduler's configuration, built from keyword arguments and
//! validated once (every rule error is a `ConfigError` naming the field, with its value).
//!
//! The class is built from the core's one field list
//! (`helix_kv_core::scheduler_config_fields!`): its stored fields and their getters (with the
//! core's docs), the reading of each keyword, `to_dict`, and, from the core's table
//! (`SchedulerConfig::FIELDS`), `DEFAULTS`, `FIELDS` and the constructor's signature. The one
//! core field without a default, the KV pool (`capacity_superblocks`), is given as
//! `kv_superblocks` or `kv_tokens`.

use helix_kv_core::{
    AdmissionPolicy, CapacityPolicy, ConfigDefault, ConfigField, FieldValue, SchedulerConfig,
    ServingMode, SuspendPolicy, VictimPolicy,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString, PyTuple};

use crate::arrays::{flag_arg, str_arg};
use crate::errors::{config_error, int_setting, with_config_value, IntoPyResult};
use crate::layout::PyLayout;
use crate::records::{reduce_by_keywords, repr_of};

/// The keyword that gives the KV pool in superblocks (the core's `capacity_superblocks`).
const KV_SUPERBLOCKS: &str = "kv_superblocks";
/// The keyword that gives the KV pool in global tokens, rounded down to superblocks.
const KV_TOKENS: &str = "kv_tokens";

/// How a core field type crosses the binding: read from a keyword argument (every refusal a
/// typed error naming the keyword) and shown to Python.
pub trait Setting: Sized + Copy {
    /// The value of keyword `name`.
    fn read(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Self>;
    /// The value as Python sees it (an option by its name).
    fn object(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>>;
}

/// A non-negative integer setting that must fit `u32` (a `ConfigError` about it if not;
/// an `InvalidTypeError` for a float, bool, str or `None`).
fn u32_setting(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u32> {
    int_setting(value, name, "0..=2**32-1")
}

/// A non-negative integer setting (`0..=2**63-1`, like every length).
fn u64_setting(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    int_setting::<i64>(value, name, "0..=2**63-1").and_then(|v| {
        u64::try_from(v).map_err(|_| {
            let message = format!("{name} must be non-negative, got {v}");
            config_error(message, Some(name), Some(value))
        })
    })
}

impl Setting for u32 {
    fn read(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        u32_setting(value, name)
    }
    fn object(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(self.into_pyobject(py)?.into_any())
    }
}

impl Setting for u64 {
    fn read(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        u64_setting(value, name)
    }
    fn object(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(self.into_pyobject(py)?.into_any())
    }
}

impl Setting for bool {
    fn read(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        flag_arg(value, name)
    }
    fn object(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(PyBool::new(py, self).to_owned().into_any())
    }
}

/// An optional count: `None` (unset) or what a `u32` setting accepts.
impl Setting for Option<u32> {
    fn read(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        if value.is_none() {
            Ok(None)
        } else {
            u32_setting(value, name).map(Some)
        }
    }
    fn object(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(self.into_pyobject(py)?.into_any())
    }
}

/// Option enums: a `str`, one of the enum's `NAMES` (a `ConfigError` listing them if not).
macro_rules! option_settings {
    ($($ty:ty),* $(,)?) => {$(
        impl Setting for $ty {
            fn read(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
                str_arg(value, name)?.parse::<Self>().py().map_err(|err| {
                    with_config_value(err, value.py(), |_| Ok(Some(value.clone())))
                })
            }
            fn object(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
                Ok(PyString::new(py, self.as_str()).into_any())
            }
        }
    )*};
}

option_settings!(
    CapacityPolicy,
    ServingMode,
    AdmissionPolicy,
    VictimPolicy,
    SuspendPolicy
);

/// A core field as the class stores it; its getter (`#[pyo3(get)]`) shows it through
/// [`Setting::object`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Field<T>(T);

impl<'py, T: Setting> IntoPyObject<'py> for &Field<T> {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.0.object(py)
    }
}

/// The keyword a core field is given by: its name, or `kv_superblocks` for the KV pool (the
/// field without a default), which may also be given as `kv_tokens`.
macro_rules! keyword {
    ($name:ident, required) => {
        KV_SUPERBLOCKS
    };
    ($name:ident, $default:tt) => {
        stringify!($name)
    };
}

/// Reads one keyword into `config` if it was given (else the core's default stays); the KV
/// pool from `kv_superblocks` or `kv_tokens`, with the `cp_size` and `tokens_per_block`
/// read before it (the core declares them first).
macro_rules! read_keyword {
    ($py:ident, $kwargs:ident, $config:ident, $name:ident : $ty:ty = required) => {
        $config.$name = read_pool($py, $kwargs, &$config)?;
    };
    ($py:ident, $kwargs:ident, $config:ident, $name:ident : $ty:ty = $default:tt) => {
        if let Some(value) = given($kwargs, stringify!($name))? {
            $config.$name = <$ty as Setting>::read(&value, stringify!($name))?;
        }
    };
}

macro_rules! define_py_scheduler_config {
    ({} $(
        $(#[doc = $doc:tt])*
        $(#[range $range:tt])?
        $(#[decision $decision:tt])?
        $name:ident : $ty:ty = $default:tt
    ),* $(,)?) => {
        /// The scheduler configuration (frozen). Give the KV pool as `kv_superblocks` (the
        /// group's agreed minimum) or as `kv_tokens` (global tokens, rounded down to whole
        /// superblocks).
        #[pyclass(frozen, eq, hash, module = "helix_kv._core", name = "SchedulerConfig")]
        #[derive(Clone, PartialEq, Eq, Hash)]
        pub struct PySchedulerConfig {
            $( $(#[doc = $doc])* #[pyo3(get)] $name: Field<$ty>, )*
        }

        impl From<SchedulerConfig> for PySchedulerConfig {
            fn from(config: SchedulerConfig) -> Self {
                Self { $( $name: Field(config.$name), )* }
            }
        }

        impl PySchedulerConfig {
            /// The core configuration.
            pub fn config(&self) -> SchedulerConfig {
                SchedulerConfig { $( $name: self.$name.0, )* }
            }
        }

        /// The core's defaults with every keyword given in `kwargs` read over them, in the
        /// core's field order (not yet validated).
        fn read_keywords(
            py: Python<'_>,
            kwargs: Option<&Bound<'_, PyDict>>,
        ) -> PyResult<SchedulerConfig> {
            let mut config = SchedulerConfig::new(0);
            $( read_keyword!(py, kwargs, config, $name : $ty = $default); )*
            Ok(config)
        }

        /// The keyword arguments that rebuild `config`, in signature order (the pool as
        /// `kv_superblocks`).
        fn keywords<'py>(py: Python<'py>, config: &SchedulerConfig) -> PyResult<Bound<'py, PyDict>> {
            let dict = PyDict::new(py);
            $( dict.set_item(keyword!($name, $default), Setting::object(config.$name, py)?)?; )*
            Ok(dict)
        }
    };
}

helix_kv_core::scheduler_config_fields!(define_py_scheduler_config! {});

/// Keyword `name` of `kwargs`, if given.
fn given<'py>(
    kwargs: Option<&Bound<'py, PyDict>>,
    name: &str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    kwargs.map_or(Ok(None), |kwargs| kwargs.get_item(name))
}

/// The KV pool in superblocks, from exactly one of `kv_superblocks` and `kv_tokens` (`None`
/// counts as not given), the tokens rounded down by `config`'s layout.
fn read_pool(
    py: Python<'_>,
    kwargs: Option<&Bound<'_, PyDict>>,
    config: &SchedulerConfig,
) -> PyResult<u32> {
    let optional = |name: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(given(kwargs, name)?.filter(|value| !value.is_none()))
    };
    let superblocks = optional(KV_SUPERBLOCKS)?
        .map(|v| u32_setting(&v, KV_SUPERBLOCKS))
        .transpose()?;
    let tokens_given = optional(KV_TOKENS)?;
    let tokens = tokens_given
        .as_ref()
        .map(|v| u64_setting(v, KV_TOKENS))
        .transpose()?;
    match (superblocks, tokens) {
        (Some(superblocks), None) => Ok(superblocks),
        (None, Some(tokens)) => SchedulerConfig::superblocks_for_kv_tokens(
            config.cp_size,
            config.tokens_per_block,
            tokens,
        )
        .py()
        .map_err(|err| {
            with_config_value(err, py, |field| match field {
                KV_TOKENS => Ok(tokens_given.clone()),
                _ => setting_value(py, config, field),
            })
        }),
        _ => Err(config_error(
            "give the KV pool as exactly one of kv_superblocks (superblocks, the group's \
             agreed minimum) or kv_tokens (global tokens)",
            Some(KV_SUPERBLOCKS),
            None,
        )),
    }
}

/// The value `config` holds for `field` (a core field, or the keyword that gives it), as
/// Python sees it.
fn setting_value<'py>(
    py: Python<'py>,
    config: &SchedulerConfig,
    field: &str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let keyword = if field == "capacity_superblocks" {
        KV_SUPERBLOCKS
    } else {
        field
    };
    keywords(py, config)?.get_item(keyword)
}

/// `config` once the core has validated it; its `ConfigError` with the value of the field
/// it names.
fn validated(py: Python<'_>, config: SchedulerConfig) -> PyResult<SchedulerConfig> {
    config
        .validate()
        .py()
        .map_err(|err| with_config_value(err, py, |field| setting_value(py, &config, field)))?;
    Ok(config)
}

/// Every keyword the constructor takes, in signature order, with its default (`None` for
/// the pool's two keywords, which have none): the core's fields, the pool as
/// `kv_superblocks` and `kv_tokens`.
fn signature_keywords() -> impl Iterator<Item = (&'static str, ConfigDefault)> {
    SchedulerConfig::FIELDS.iter().flat_map(|field| {
        let keywords: &[_] = match field.default {
            ConfigDefault::Required => &[KV_SUPERBLOCKS, KV_TOKENS],
            _ => std::slice::from_ref(&field.name),
        };
        keywords.iter().map(|&keyword| (keyword, field.default))
    })
}

/// A field value as Python sees it.
fn value_object(py: Python<'_>, value: FieldValue) -> PyResult<Bound<'_, PyAny>> {
    Ok(match value {
        FieldValue::Int(v) => v.into_pyobject(py)?.into_any(),
        FieldValue::Bool(v) => PyBool::new(py, v).to_owned().into_any(),
        FieldValue::Name(v) => PyString::new(py, v).into_any(),
    })
}

/// A default as Python sees it: the value, or `None` (an unset option, or no default).
fn default_object(py: Python<'_>, default: ConfigDefault) -> PyResult<Bound<'_, PyAny>> {
    match default {
        ConfigDefault::Value(value) => value_object(py, value),
        ConfigDefault::Unset | ConfigDefault::Required => Ok(py.None().into_bound(py)),
    }
}

#[pymethods]
impl PySchedulerConfig {
    /// Every setting by keyword (`DEFAULTS`, `FIELDS`); an unknown keyword is a `TypeError`,
    /// as for any Python function.
    #[new]
    #[pyo3(signature = (**kwargs))]
    fn new(py: Python<'_>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        if let Some(kwargs) = kwargs {
            for key in kwargs.keys() {
                let known = key
                    .extract::<String>()
                    .is_ok_and(|key| signature_keywords().any(|(keyword, _)| keyword == key));
                if !known {
                    return Err(PyTypeError::new_err(format!(
                        "SchedulerConfig.__new__() got an unexpected keyword argument {}",
                        key.repr()?
                    )));
                }
            }
        }
        let config = read_keywords(py, kwargs)?;
        validated(py, config).map(Self::from)
    }

    /// The constructor's keyword-only parameters with their defaults, from the core's field
    /// table (`inspect.signature` reads it; the pool's two keywords default to `None`).
    #[classattr]
    fn __signature__(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let inspect = py.import("inspect")?;
        let parameter = inspect.getattr("Parameter")?;
        let keyword_only = parameter.getattr("KEYWORD_ONLY")?;
        let parameters = signature_keywords()
            .map(|(keyword, default)| {
                let kwargs = PyDict::new(py);
                kwargs.set_item("default", default_object(py, default)?)?;
                parameter.call((keyword, &keyword_only), Some(&kwargs))
            })
            .collect::<PyResult<Vec<_>>>()?;
        inspect.getattr("Signature")?.call1((parameters,))
    }

    /// The same configuration for rank `cp_rank` of the group.
    fn with_rank(&self, cp_rank: &Bound<'_, PyAny>) -> PyResult<Self> {
        let config = self.config().with_rank(u32_setting(cp_rank, "cp_rank")?);
        validated(cp_rank.py(), config).map(Self::from)
    }

    /// The keyword arguments that rebuild this configuration (`kv_superblocks`, and the
    /// chunk unit as given), e.g. for reports: `SchedulerConfig(**c.to_dict()) == c`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        keywords(py, &self.config())
    }

    /// The default of every keyword argument but the KV pool (`kv_superblocks` or
    /// `kv_tokens`, which has none), read-only: the core's, from `FIELDS`.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn DEFAULTS(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let defaults = PyDict::new(py);
        for field in SchedulerConfig::FIELDS {
            if field.default != ConfigDefault::Required {
                defaults.set_item(field.name, default_object(py, field.default)?)?;
            }
        }
        py.import("types")?
            .getattr("MappingProxyType")?
            .call1((defaults,))
    }
    /// Every field as the core declares it (`ConfigField`: name, type, default, range,
    /// choices, doc), in declaration order.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn FIELDS(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(
            py,
            SchedulerConfig::FIELDS
                .iter()
                .map(|&field| PyConfigField { field }),
        )
    }
    /// The accepted `admission_policy` names, in declaration order.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn ADMISSION_POLICIES(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(py, AdmissionPolicy::NAMES)
    }
    /// The accepted `victim_policy` names, in declaration order.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn VICTIM_POLICIES(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(py, VictimPolicy::NAMES)
    }
    /// The accepted `suspend_policy` names, in declaration order.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn SUSPEND_POLICIES(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(py, SuspendPolicy::NAMES)
    }
    /// The accepted `serving_mode` names, in declaration order.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn SERVING_MODES(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(py, ServingMode::NAMES)
    }
    /// The accepted `capacity_policy` names, in declaration order.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn CAPACITY_POLICIES(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(py, CapacityPolicy::NAMES)
    }

    /// Pickles as `functools.partial(SchedulerConfig, **to_dict())`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        reduce_by_keywords(slf, &slf.get().to_dict(slf.py())?)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        repr_of("SchedulerConfig", &self.to_dict(py)?)
    }

    /// Superblocks in the KV pool (the keyword's name for `capacity_superblocks`).
    #[getter]
    fn kv_superblocks(&self) -> u32 {
        self.capacity_superblocks.0
    }
    /// Global tokens the KV pool holds (`kv_superblocks * tokens_per_block * cp_size`).
    #[getter]
    fn kv_tokens(&self) -> u64 {
        self.config().capacity_tokens()
    }
    /// Global tokens the KV pool holds (the core's name for `kv_tokens`).
    #[getter]
    fn capacity_tokens(&self) -> u64 {
        self.config().capacity_tokens()
    }
    /// The group's token placement (`Layout(cp_size, tokens_per_block)`).
    #[getter]
    fn layout(&self) -> PyResult<PyLayout> {
        Ok(PyLayout {
            inner: self.config().layout().py()?,
        })
    }

    /// 64-bit fingerprint of `decision_fields()`: equal on every rank of a group built
    /// from one configuration (`cp_rank` is left out). It seeds every step's
    /// `ScheduleOutput.digest` and the scheduler's `state_digest()`.
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.config().fingerprint()
    }

    /// Every field that can change a decision or a placement, as ordered `(name, value)`
    /// pairs: all fields but `cp_rank`, `chunk_unit` as the unit in effect, the capacity as
    /// `capacity_superblocks`, policies and modes by name.
    fn decision_fields<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(&'static str, Bound<'py, PyAny>)>> {
        self.config()
            .decision_fields()
            .into_iter()
            .map(|(name, value)| Ok((name, value_object(py, value)?)))
            .collect()
    }
}

/// One `SchedulerConfig` field as the core declares it (`SchedulerConfig.FIELDS`).
#[pyclass(frozen, module = "helix_kv._core", name = "ConfigField")]
pub struct PyConfigField {
    field: ConfigField,
}

#[pymethods]
impl PyConfigField {
    /// The core field's name (the KV pool's is `capacity_superblocks`, given as
    /// `kv_superblocks` or `kv_tokens`).
    #[getter]
    fn name(&self) -> &'static str {
        self.field.name
    }
    /// Its Rust type as declared: `u32`, `u64`, `bool`, `Option<u32>` (an optional count)
    /// or an option enum's name.
    #[getter]
    #[pyo3(name = "type")]
    fn ty(&self) -> &'static str {
        self.field.ty
    }
    /// Its default (`None`: unset, or none at all when `required`).
    #[getter]
    fn default<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        default_object(py, self.field.default)
    }
    /// Whether it has no default (the KV pool).
    #[getter]
    fn required(&self) -> bool {
        self.field.default == ConfigDefault::Required
    }
    /// The smallest value an integer field accepts (`None` for a flag or an option).
    #[getter]
    fn minimum(&self) -> Option<u64> {
        self.field.range.map(|(min, _)| min)
    }
    /// The largest value an integer field accepts (`None` for a flag or an option).
    #[getter]
    fn maximum(&self) -> Option<u64> {
        self.field.range.map(|(_, max)| max)
    }
    /// The names an option accepts, in declaration order (empty for the others).
    #[getter]
    fn choices<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.field.choices)
    }
    /// Its one-line doc.
    #[getter]
    fn doc(&self) -> &'static str {
        self.field.doc
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let dict = PyDict::new(py);
        dict.set_item("name", self.name())?;
        dict.set_item("type", self.ty())?;
        dict.set_item("default", self.default(py)?)?;
        dict.set_item("required", self.required())?;
        dict.set_item("minimum", self.minimum())?;
        dict.set_item("maximum", self.maximum())?;
        dict.set_item("choices", self.choices(py)?)?;
        dict.set_item("doc", self.doc())?;
        repr_of("ConfigField", &dict)
    }
}
