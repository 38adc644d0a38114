//! `SchedulerConfig`: the scheduler's configuration, built from keyword arguments and
//! validated once (every rule error is a `ConfigError` naming the field).

use helix_kv_core::{
    CapacityPolicy, FieldValue, SchedulerConfig, ServingMode, SuspendPolicy, VictimPolicy,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString, PyTuple};

use crate::arrays::{flag_arg, int_arg, str_arg};
use crate::errors::{ConfigError, IntoPyResult};
use crate::layout::PyLayout;
use crate::records::{reduce_by_keywords, repr_of};

/// A keyword argument as given, or `Absent` (its default applies). Taking the object
/// itself lets every setting be checked here, naming it, instead of by `PyO3`'s extraction
/// (whose errors are plain `TypeError`/`OverflowError`).
pub enum Given<'py> {
    Absent,
    Value(Bound<'py, PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Given<'py> {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self::Value(obj.to_owned()))
    }
}

impl<'py> Given<'py> {
    /// `default` if absent, else `convert` of the value.
    fn map_or<T>(
        self,
        default: PyResult<T>,
        convert: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> PyResult<T> {
        match self {
            Self::Absent => default,
            Self::Value(value) => convert(&value),
        }
    }
}

/// A `u32` setting, `default` if absent.
fn setting_u32(value: Given<'_>, name: &str, default: u32) -> PyResult<u32> {
    match value {
        Given::Absent => Ok(default),
        Given::Value(value) => int_setting(&value, name),
    }
}

/// A non-negative integer setting that must fit `u32` (a `ConfigError` naming it if not;
/// an `InvalidTypeError` for a float, bool, str or `None`).
fn int_setting(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u32> {
    int_arg(value, name, "0..=2**32-1", ConfigError::new_err)
}

/// A non-negative integer setting (`0..=2**63-1`, like every length).
fn u64_setting(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    int_arg::<i64>(value, name, "0..=2**63-1", ConfigError::new_err).and_then(|v| {
        u64::try_from(v)
            .map_err(|_| ConfigError::new_err(format!("{name} must be non-negative, got {v}")))
    })
}

/// An optional setting: `None` or what `convert` accepts.
fn optional<'py, T>(
    value: Option<&Bound<'py, PyAny>>,
    convert: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
) -> PyResult<Option<T>> {
    value.filter(|v| !v.is_none()).map(convert).transpose()
}

/// The scheduler configuration (frozen). Give the KV pool as `kv_superblocks` (the group's
/// agreed minimum) or as `kv_tokens` (global tokens, rounded down to whole superblocks).
#[pyclass(frozen, eq, hash, module = "helix_kv._core", name = "SchedulerConfig")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PySchedulerConfig {
    pub inner: SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (
        *,
        cp_size = Given::Absent,
        cp_rank = Given::Absent,
        tokens_per_block = Given::Absent,
        kv_superblocks = None,
        kv_tokens = None,
        max_batch_size = Given::Absent,
        max_num_tokens = Given::Absent,
        enable_chunked_prefill = Given::Absent,
        chunk_unit = None,
        max_seq_len = Given::Absent,
        capacity_policy = Given::Absent,
        serving_mode = Given::Absent,
        host_tier_superblocks = Given::Absent,
        suspend_policy = Given::Absent,
        suspend_cost_per_token = Given::Absent,
        recompute_cost_per_token = Given::Absent,
        victim_policy = Given::Absent,
        max_preemptions_per_request = Given::Absent,
        admit_after_preemption = Given::Absent,
        deadlock_steps = Given::Absent,
    ), text_signature = "(*, cp_size=1, cp_rank=0, tokens_per_block=32, kv_superblocks=None, \
        kv_tokens=None, max_batch_size=256, max_num_tokens=8192, enable_chunked_prefill=True, \
        chunk_unit=None, max_seq_len=131072, capacity_policy=\"max_utilization\", \
        serving_mode=\"aggregated_helix\", host_tier_superblocks=0, \
        suspend_policy=\"suspend_first\", suspend_cost_per_token=1, recompute_cost_per_token=4, \
        victim_policy=\"newest_first\", max_preemptions_per_request=8, \
        admit_after_preemption=False, deadlock_steps=64)")]
    #[expect(
        clippy::too_many_arguments,
        reason = "the Python keyword surface, one per field"
    )]
    fn new(
        cp_size: Given<'_>,
        cp_rank: Given<'_>,
        tokens_per_block: Given<'_>,
        kv_superblocks: Option<&Bound<'_, PyAny>>,
        kv_tokens: Option<&Bound<'_, PyAny>>,
        max_batch_size: Given<'_>,
        max_num_tokens: Given<'_>,
        enable_chunked_prefill: Given<'_>,
        chunk_unit: Option<&Bound<'_, PyAny>>,
        max_seq_len: Given<'_>,
        capacity_policy: Given<'_>,
        serving_mode: Given<'_>,
        host_tier_superblocks: Given<'_>,
        suspend_policy: Given<'_>,
        suspend_cost_per_token: Given<'_>,
        recompute_cost_per_token: Given<'_>,
        victim_policy: Given<'_>,
        max_preemptions_per_request: Given<'_>,
        admit_after_preemption: Given<'_>,
        deadlock_steps: Given<'_>,
    ) -> PyResult<Self> {
        // Every default is the core's (`SchedulerConfig::new`); `DEFAULTS` shows them.
        let defaults = SchedulerConfig::new(1);
        let cp_size = setting_u32(cp_size, "cp_size", defaults.cp_size)?;
        let tokens_per_block = setting_u32(
            tokens_per_block,
            "tokens_per_block",
            defaults.tokens_per_block,
        )?;
        let kv_superblocks = optional(kv_superblocks, |v| int_setting(v, "kv_superblocks"))?;
        let kv_tokens = optional(kv_tokens, |v| u64_setting(v, "kv_tokens"))?;
        let capacity =
            match (kv_superblocks, kv_tokens) {
                (Some(superblocks), None) => superblocks,
                (None, Some(tokens)) => {
                    SchedulerConfig::superblocks_for_kv_tokens(cp_size, tokens_per_block, tokens)
                        .py()?
                }
                _ => return Err(ConfigError::new_err(
                    "give the KV pool as exactly one of kv_superblocks (superblocks, the group's \
                     agreed minimum) or kv_tokens (global tokens)",
                )),
            };
        let mut config = SchedulerConfig {
            capacity_superblocks: capacity,
            cp_size,
            tokens_per_block,
            ..defaults
        };
        config.cp_rank = setting_u32(cp_rank, "cp_rank", config.cp_rank)?;
        config.max_batch_size =
            setting_u32(max_batch_size, "max_batch_size", config.max_batch_size)?;
        config.max_num_tokens =
            setting_u32(max_num_tokens, "max_num_tokens", config.max_num_tokens)?;
        config.enable_chunked_prefill = enable_chunked_prefill
            .map_or(Ok(config.enable_chunked_prefill), |v| {
                flag_arg(v, "enable_chunked_prefill")
            })?;
        config.chunk_unit = optional(chunk_unit, |unit| int_setting(unit, "chunk_unit"))?;
        config.max_seq_len =
            max_seq_len.map_or(Ok(config.max_seq_len), |v| u64_setting(v, "max_seq_len"))?;
        config.capacity_policy = capacity_policy.map_or(Ok(config.capacity_policy), |v| {
            str_arg(v, "capacity_policy")?
                .parse::<CapacityPolicy>()
                .py()
        })?;
        config.serving_mode = serving_mode.map_or(Ok(config.serving_mode), |v| {
            str_arg(v, "serving_mode")?.parse::<ServingMode>().py()
        })?;
        config.host_tier_superblocks = setting_u32(
            host_tier_superblocks,
            "host_tier_superblocks",
            config.host_tier_superblocks,
        )?;
        config.suspend_policy = suspend_policy.map_or(Ok(config.suspend_policy), |v| {
            str_arg(v, "suspend_policy")?.parse::<SuspendPolicy>().py()
        })?;
        config.suspend_cost_per_token = setting_u32(
            suspend_cost_per_token,
            "suspend_cost_per_token",
            config.suspend_cost_per_token,
        )?;
        config.recompute_cost_per_token = setting_u32(
            recompute_cost_per_token,
            "recompute_cost_per_token",
            config.recompute_cost_per_token,
        )?;
        config.victim_policy = victim_policy.map_or(Ok(config.victim_policy), |v| {
            str_arg(v, "victim_policy")?.parse::<VictimPolicy>().py()
        })?;
        config.max_preemptions_per_request = setting_u32(
            max_preemptions_per_request,
            "max_preemptions_per_request",
            config.max_preemptions_per_request,
        )?;
        config.admit_after_preemption = admit_after_preemption
            .map_or(Ok(config.admit_after_preemption), |v| {
                flag_arg(v, "admit_after_preemption")
            })?;
        config.deadlock_steps =
            setting_u32(deadlock_steps, "deadlock_steps", config.deadlock_steps)?;
        config.validate().py()?;
        Ok(Self { inner: config })
    }

    /// The same configuration for rank `cp_rank` of the group.
    fn with_rank(&self, cp_rank: &Bound<'_, PyAny>) -> PyResult<Self> {
        let config = self.inner.with_rank(int_setting(cp_rank, "cp_rank")?);
        config.validate().py()?;
        Ok(Self { inner: config })
    }

    /// The keyword arguments that rebuild this configuration (`kv_superblocks`, and the
    /// chunk unit in effect), e.g. for reports: `SchedulerConfig(**c.to_dict()) == c`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        keywords(py, &self.inner)
    }

    /// The default of every keyword argument but the KV pool (`kv_superblocks` or
    /// `kv_tokens`, which has none): the core's defaults, read-only.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn DEFAULTS(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let defaults = keywords(py, &SchedulerConfig::new(1))?;
        defaults.del_item("kv_superblocks")?;
        // `chunk_unit`'s default is "unset" (the unit is then `tokens_per_block`).
        defaults.set_item("chunk_unit", py.None())?;
        py.import("types")?
            .getattr("MappingProxyType")?
            .call1((defaults,))
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

    /// Ranks in the CP group.
    #[getter]
    fn cp_size(&self) -> u32 {
        self.inner.cp_size
    }
    /// This rank (selects the per-rank output fields only).
    #[getter]
    fn cp_rank(&self) -> u32 {
        self.inner.cp_rank
    }
    /// Tokens in one physical page on one rank.
    #[getter]
    fn tokens_per_block(&self) -> u32 {
        self.inner.tokens_per_block
    }
    /// Superblocks in the KV pool.
    #[getter]
    fn kv_superblocks(&self) -> u32 {
        self.inner.capacity_superblocks
    }
    /// Superblocks in the KV pool (the core's name for `kv_superblocks`).
    #[getter]
    fn capacity_superblocks(&self) -> u32 {
        self.inner.capacity_superblocks
    }
    /// Global tokens the KV pool holds (`kv_superblocks * tokens_per_block * cp_size`).
    #[getter]
    fn kv_tokens(&self) -> u64 {
        self.inner.capacity_tokens()
    }
    /// Global tokens the KV pool holds (the core's name for `kv_tokens`).
    #[getter]
    fn capacity_tokens(&self) -> u64 {
        self.inner.capacity_tokens()
    }
    /// The group's token placement (`Layout(cp_size, tokens_per_block)`).
    #[getter]
    fn layout(&self) -> PyResult<PyLayout> {
        Ok(PyLayout {
            inner: self.inner.layout().py()?,
        })
    }
    /// Entries (and batch slots) per step.
    #[getter]
    fn max_batch_size(&self) -> u32 {
        self.inner.max_batch_size
    }
    /// Tokens per step.
    #[getter]
    fn max_num_tokens(&self) -> u32 {
        self.inner.max_num_tokens
    }
    /// Whether prompts may be split over steps.
    #[getter]
    fn enable_chunked_prefill(&self) -> bool {
        self.inner.enable_chunked_prefill
    }
    /// Granularity of a chunk that does not complete its prompt (given, or `None` for
    /// `tokens_per_block`).
    #[getter]
    fn chunk_unit(&self) -> Option<u32> {
        self.inner.chunk_unit
    }
    /// Longest request accepted (prompt + `max_new_tokens`).
    #[getter]
    fn max_seq_len(&self) -> u64 {
        self.inner.max_seq_len
    }
    /// `"max_utilization"` or `"guaranteed_no_evict"`.
    #[getter]
    fn capacity_policy(&self) -> &'static str {
        self.inner.capacity_policy.as_str()
    }
    /// `"aggregated_helix"`, `"non_helix"` or `"disaggregated_generation"`.
    #[getter]
    fn serving_mode(&self) -> &'static str {
        self.inner.serving_mode.as_str()
    }
    /// Host-tier superblocks (`non_helix` and `aggregated_helix`): one host page per rank
    /// each.
    #[getter]
    fn host_tier_superblocks(&self) -> u32 {
        self.inner.host_tier_superblocks
    }
    /// `"suspend_first"`, `"recompute_first"` or `"cost"`.
    #[getter]
    fn suspend_policy(&self) -> &'static str {
        self.inner.suspend_policy.as_str()
    }
    /// Cost of copying one token's KV to the host tier and back (`suspend_policy="cost"`).
    #[getter]
    fn suspend_cost_per_token(&self) -> u32 {
        self.inner.suspend_cost_per_token
    }
    /// Cost of computing one token again after a recompute-pause, in the same unit.
    #[getter]
    fn recompute_cost_per_token(&self) -> u32 {
        self.inner.recompute_cost_per_token
    }
    /// `"newest_first"`, `"least_computed_first"` or `"priority"`.
    #[getter]
    fn victim_policy(&self) -> &'static str {
        self.inner.victim_policy.as_str()
    }
    /// A request chosen as a victim this many times is no longer chosen, except by the
    /// oldest live request; 0 turns preemption off.
    #[getter]
    fn max_preemptions_per_request(&self) -> u32 {
        self.inner.max_preemptions_per_request
    }
    /// Whether a step that preempted may admit waiting requests.
    #[getter]
    fn admit_after_preemption(&self) -> bool {
        self.inner.admit_after_preemption
    }
    /// Steps without progress before `DeadlockError`.
    #[getter]
    fn deadlock_steps(&self) -> u32 {
        self.inner.deadlock_steps
    }

    /// 64-bit fingerprint of `decision_fields()`: equal on every rank of a group built
    /// from one configuration (`cp_rank` is left out). It seeds every step's
    /// `ScheduleOutput.digest` and the scheduler's `state_digest()`.
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }

    /// Every field that can change a decision or a placement, as ordered `(name, value)`
    /// pairs: all fields but `cp_rank`, `chunk_unit` as the unit in effect, the capacity as
    /// `capacity_superblocks`, policies and modes by name.
    fn decision_fields<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(&'static str, Bound<'py, PyAny>)>> {
        self.inner
            .decision_fields()
            .into_iter()
            .map(|(name, value)| {
                let value = match value {
                    FieldValue::Int(v) => v.into_pyobject(py)?.into_any(),
                    FieldValue::Bool(v) => PyBool::new(py, v).to_owned().into_any(),
                    FieldValue::Name(v) => PyString::new(py, v).into_any(),
                };
                Ok((name, value))
            })
            .collect()
    }
}

/// The keyword arguments that rebuild `config`, in signature order.
fn keywords<'py>(py: Python<'py>, config: &SchedulerConfig) -> PyResult<Bound<'py, PyDict>> {
    let c = config;
    let d = PyDict::new(py);
    d.set_item("cp_size", c.cp_size)?;
    d.set_item("cp_rank", c.cp_rank)?;
    d.set_item("tokens_per_block", c.tokens_per_block)?;
    d.set_item("kv_superblocks", c.capacity_superblocks)?;
    d.set_item("max_batch_size", c.max_batch_size)?;
    d.set_item("max_num_tokens", c.max_num_tokens)?;
    d.set_item("enable_chunked_prefill", c.enable_chunked_prefill)?;
    d.set_item("chunk_unit", c.chunk_unit)?;
    d.set_item("max_seq_len", c.max_seq_len)?;
    d.set_item("capacity_policy", c.capacity_policy.as_str())?;
    d.set_item("serving_mode", c.serving_mode.as_str())?;
    d.set_item("host_tier_superblocks", c.host_tier_superblocks)?;
    d.set_item("suspend_policy", c.suspend_policy.as_str())?;
    d.set_item("suspend_cost_per_token", c.suspend_cost_per_token)?;
    d.set_item("recompute_cost_per_token", c.recompute_cost_per_token)?;
    d.set_item("victim_policy", c.victim_policy.as_str())?;
    d.set_item("max_preemptions_per_request", c.max_preemptions_per_request)?;
    d.set_item("admit_after_preemption", c.admit_after_preemption)?;
    d.set_item("deadlock_steps", c.deadlock_steps)?;
    Ok(d)
}
