//! `SchedulerConfig`: the scheduler's configuration, built from keyword arguments and
//! validated once (every rule error is a `ConfigError` naming the field).

use helix_kv_core::{CapacityPolicy, SchedulerConfig, ServingMode, VictimPolicy};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::{ConfigError, IntoPyResult};

/// A non-negative integer setting that must fit `u32`.
fn setting_u32(value: i64, name: &str) -> PyResult<u32> {
    u32::try_from(value).map_err(|_| {
        ConfigError::new_err(format!(
            "{name} must be an integer in 0..={}, got {value}",
            u32::MAX
        ))
    })
}

/// A non-negative integer setting.
fn setting_u64(value: i64, name: &str) -> PyResult<u64> {
    u64::try_from(value)
        .map_err(|_| ConfigError::new_err(format!("{name} must be non-negative, got {value}")))
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
        cp_size = 1,
        cp_rank = 0,
        tokens_per_block = 32,
        kv_superblocks = None,
        kv_tokens = None,
        max_batch_size = 256,
        max_num_tokens = 8192,
        enable_chunked_prefill = true,
        chunk_unit = None,
        max_seq_len = 131_072,
        capacity_policy = "max_utilization",
        serving_mode = "aggregated_helix",
        host_tier_superblocks = 0,
        victim_policy = "newest_first",
        max_preemptions_per_request = 8,
        admit_after_preemption = false,
        deadlock_steps = 64,
    ))]
    #[allow(clippy::too_many_arguments)] // the Python keyword surface, one per field
    fn new(
        cp_size: i64,
        cp_rank: i64,
        tokens_per_block: i64,
        kv_superblocks: Option<i64>,
        kv_tokens: Option<i64>,
        max_batch_size: i64,
        max_num_tokens: i64,
        enable_chunked_prefill: bool,
        chunk_unit: Option<i64>,
        max_seq_len: i64,
        capacity_policy: &str,
        serving_mode: &str,
        host_tier_superblocks: i64,
        victim_policy: &str,
        max_preemptions_per_request: i64,
        admit_after_preemption: bool,
        deadlock_steps: i64,
    ) -> PyResult<Self> {
        let cp_size = setting_u32(cp_size, "cp_size")?;
        let tokens_per_block = setting_u32(tokens_per_block, "tokens_per_block")?;
        let capacity =
            match (kv_superblocks, kv_tokens) {
                (Some(superblocks), None) => setting_u32(superblocks, "kv_superblocks")?,
                (None, Some(tokens)) => SchedulerConfig::superblocks_for_kv_tokens(
                    cp_size,
                    tokens_per_block,
                    setting_u64(tokens, "kv_tokens")?,
                )
                .py()?,
                _ => return Err(ConfigError::new_err(
                    "give the KV pool as exactly one of kv_superblocks (superblocks, the group's \
                     agreed minimum) or kv_tokens (global tokens)",
                )),
            };
        let mut config = SchedulerConfig::new(capacity);
        config.cp_size = cp_size;
        config.cp_rank = setting_u32(cp_rank, "cp_rank")?;
        config.tokens_per_block = tokens_per_block;
        config.max_batch_size = setting_u32(max_batch_size, "max_batch_size")?;
        config.max_num_tokens = setting_u32(max_num_tokens, "max_num_tokens")?;
        config.enable_chunked_prefill = enable_chunked_prefill;
        config.chunk_unit = chunk_unit
            .map(|unit| setting_u32(unit, "chunk_unit"))
            .transpose()?;
        config.max_seq_len = setting_u64(max_seq_len, "max_seq_len")?;
        config.capacity_policy = capacity_policy.parse::<CapacityPolicy>().py()?;
        config.serving_mode = serving_mode.parse::<ServingMode>().py()?;
        config.host_tier_superblocks = setting_u32(host_tier_superblocks, "host_tier_superblocks")?;
        config.victim_policy = victim_policy.parse::<VictimPolicy>().py()?;
        config.max_preemptions_per_request =
            setting_u32(max_preemptions_per_request, "max_preemptions_per_request")?;
        config.admit_after_preemption = admit_after_preemption;
        config.deadlock_steps = setting_u32(deadlock_steps, "deadlock_steps")?;
        config.validate().py()?;
        Ok(Self { inner: config })
    }

    /// The same configuration for rank `cp_rank` of the group.
    fn with_rank(&self, cp_rank: i64) -> PyResult<Self> {
        let config = self.inner.with_rank(setting_u32(cp_rank, "cp_rank")?);
        config.validate().py()?;
        Ok(Self { inner: config })
    }

    /// The keyword arguments that rebuild this configuration (`kv_superblocks`, and the
    /// chunk unit in effect), e.g. for reports: `SchedulerConfig(**c.to_dict()) == c`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
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
        d.set_item("victim_policy", c.victim_policy.as_str())?;
        d.set_item("max_preemptions_per_request", c.max_preemptions_per_request)?;
        d.set_item("admit_after_preemption", c.admit_after_preemption)?;
        d.set_item("deadlock_steps", c.deadlock_steps)?;
        Ok(d)
    }

    /// Pickles as `functools.partial(SchedulerConfig, **to_dict())`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let rebuild = py
            .import("functools")?
            .getattr("partial")?
            .call((py.get_type::<Self>(),), Some(&slf.get().to_dict(py)?))?;
        PyTuple::new(py, [rebuild, PyTuple::empty(py).into_any()])
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(cp_size={}, cp_rank={}, tokens_per_block={}, kv_superblocks={}, \
             max_batch_size={}, max_num_tokens={}, enable_chunked_prefill={}, chunk_unit={}, \
             max_seq_len={}, capacity_policy='{}', serving_mode='{}', host_tier_superblocks={}, \
             victim_policy='{}', max_preemptions_per_request={}, admit_after_preemption={}, \
             deadlock_steps={})",
            c.cp_size,
            c.cp_rank,
            c.tokens_per_block,
            c.capacity_superblocks,
            c.max_batch_size,
            c.max_num_tokens,
            if c.enable_chunked_prefill {
                "True"
            } else {
                "False"
            },
            c.chunk_unit
                .map_or_else(|| "None".to_string(), |u| u.to_string()),
            c.max_seq_len,
            c.capacity_policy,
            c.serving_mode,
            c.host_tier_superblocks,
            c.victim_policy,
            c.max_preemptions_per_request,
            if c.admit_after_preemption {
                "True"
            } else {
                "False"
            },
            c.deadlock_steps,
        )
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
        u64::from(self.inner.capacity_superblocks)
            * u64::from(self.inner.tokens_per_block)
            * u64::from(self.inner.cp_size)
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
    /// Host-tier superblocks (`non_helix` only).
    #[getter]
    fn host_tier_superblocks(&self) -> u32 {
        self.inner.host_tier_superblocks
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
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySchedulerConfig>()
}
