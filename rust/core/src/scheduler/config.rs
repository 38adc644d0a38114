//! Scheduler configuration: plain fields with the defaults of
//! `docs/internals/scheduler.md`, checked once by [`SchedulerConfig::validate`].

use std::fmt;
use std::str::FromStr;

use crate::digest::Fnv64;
use crate::error::{CoreError, Result};
use crate::layout::Layout;
use crate::ledger::MAX_CAPACITY;

/// How KV capacity is promised to requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CapacityPolicy {
    /// Reserve as a request grows; preempt on pressure.
    #[default]
    MaxUtilization,
    /// Reserve prompt + whole output at admission; never preempt.
    GuaranteedNoEvict,
}

/// Where the scheduler runs, which decides what it may do under KV pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ServingMode {
    /// Prefill and decode on the same GPUs, KV sharded over a CP group; GPU-only pool,
    /// so recompute-pause is the only way to free pages.
    #[default]
    AggregatedHelix,
    /// A single rank (`cp_size == 1`), optionally with a host tier to suspend to.
    NonHelix,
    /// A disaggregated generation server: preemption is disabled.
    DisaggregatedGeneration,
}

/// Which request gives up its pages when a request ahead of it needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum VictimPolicy {
    /// The newest candidate in queue order.
    #[default]
    NewestFirst,
    /// The candidate with the fewest computed KV tokens (the least work to redo); ties
    /// go to the newest.
    LeastComputedFirst,
    /// The candidate with the lowest `priority` value; ties go to the newest.
    Priority,
}

/// Whether a victim with room in the host tier is suspended (its KV copied to host and
/// back) or recompute-paused (its KV thrown away and prefilled again). Every input is
/// rank-invariant: the victim's state, its global token count and superblocks, and the
/// configuration's cost coefficients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SuspendPolicy {
    /// Suspend every victim the host tier has room for; recompute-pause the rest.
    #[default]
    SuspendFirst,
    /// Recompute-pause a victim that is still prefilling (nothing generated is lost and
    /// its prompt prefix is cheap to redo); suspend a decoding one when the host tier
    /// has room.
    RecomputeFirst,
    /// Suspend when the copy costs less than the recompute: the victim's superblocks x
    /// `tokens_per_block x cp_size` x `suspend_cost_per_token` (the copy out and back in
    /// of every page it holds) against its computed tokens x `recompute_cost_per_token`.
    Cost,
}

macro_rules! snake_case_names {
    ($ty:ty, $what:literal, $($variant:ident => $name:literal),+ $(,)?) => {
        impl $ty {
            /// Every accepted name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            /// The `snake_case` name used by the Python surface and in messages.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name),+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $ty {
            type Err = CoreError;

            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($name => Ok(Self::$variant),)+
                    _ => Err(CoreError::Config(format!(
                        "unknown {} {s:?}; expected one of {}",
                        $what,
                        Self::NAMES.join(", ")
                    ))),
                }
            }
        }
    };
}

snake_case_names!(CapacityPolicy, "capacity_policy",
    MaxUtilization => "max_utilization",
    GuaranteedNoEvict => "guaranteed_no_evict",
);
snake_case_names!(ServingMode, "serving_mode",
    AggregatedHelix => "aggregated_helix",
    NonHelix => "non_helix",
    DisaggregatedGeneration => "disaggregated_generation",
);
snake_case_names!(VictimPolicy, "victim_policy",
    NewestFirst => "newest_first",
    LeastComputedFirst => "least_computed_first",
    Priority => "priority",
);
snake_case_names!(SuspendPolicy, "suspend_policy",
    SuspendFirst => "suspend_first",
    RecomputeFirst => "recompute_first",
    Cost => "cost",
);

/// The value of one field in [`SchedulerConfig::decision_fields`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FieldValue {
    /// A count or size.
    Int(u64),
    /// A switch.
    Bool(bool),
    /// A policy or mode, by its `snake_case` name.
    Name(&'static str),
}

/// Fields in [`SchedulerConfig::decision_fields`]: every field but `cp_rank`.
pub const DECISION_FIELDS: usize = 18;

/// Everything a [`super::Scheduler`] is built from. Every field except `cp_rank` is the
/// same on every rank of a CP group; `cp_rank` only selects which per-rank fields a
/// schedule reports and never influences a decision.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SchedulerConfig {
    /// Ranks in the CP group (`>= 1`).
    pub cp_size: u32,
    /// This rank (`< cp_size`).
    pub cp_rank: u32,
    /// Tokens in one physical page on one rank.
    pub tokens_per_block: u32,
    /// Superblocks in the KV pool, identical on every rank (the group's minimum).
    pub capacity_superblocks: u32,
    /// Entries (context + generation) in one step; also the number of batch slots.
    pub max_batch_size: u32,
    /// Tokens (context chunks + decode tokens) in one step.
    pub max_num_tokens: u32,
    /// Whether a prompt may be split over several steps.
    pub enable_chunked_prefill: bool,
    /// Granularity of a chunk that does not complete its prompt; `None` means
    /// `tokens_per_block`.
    pub chunk_unit: Option<u32>,
    /// Longest request (prompt + `max_new_tokens`) accepted.
    pub max_seq_len: u64,
    /// How capacity is promised.
    pub capacity_policy: CapacityPolicy,
    /// Where the scheduler runs.
    pub serving_mode: ServingMode,
    /// Superblocks of host memory to suspend to (`NonHelix` and `AggregatedHelix`): one
    /// host page on every rank per superblock, the group's minimum.
    pub host_tier_superblocks: u32,
    /// Suspend or recompute-pause a victim when the host tier has room.
    pub suspend_policy: SuspendPolicy,
    /// Cost of copying one global token's KV to the host tier and back (any unit; only the
    /// ratio to `recompute_cost_per_token` matters), for `SuspendPolicy::Cost`.
    pub suspend_cost_per_token: u32,
    /// Cost of computing one token again after a recompute-pause, in the same unit.
    pub recompute_cost_per_token: u32,
    /// Who gives up pages under pressure.
    pub victim_policy: VictimPolicy,
    /// A request chosen as a victim this many times is no longer chosen, except by the
    /// queue head when nothing under the bound frees enough (so no bound >= 1 deadlocks);
    /// 0 turns preemption off.
    pub max_preemptions_per_request: u32,
    /// Whether a step that preempted may still admit waiting requests.
    pub admit_after_preemption: bool,
    /// Consecutive steps without progress (while requests are live) before
    /// [`CoreError::Deadlock`].
    pub deadlock_steps: u32,
}

impl SchedulerConfig {
    /// The documented defaults for a pool of `capacity_superblocks` superblocks.
    pub fn new(capacity_superblocks: u32) -> Self {
        Self {
            cp_size: 1,
            cp_rank: 0,
            tokens_per_block: 32,
            capacity_superblocks,
            max_batch_size: 256,
            max_num_tokens: 8192,
            enable_chunked_prefill: true,
            chunk_unit: None,
            max_seq_len: 131_072,
            capacity_policy: CapacityPolicy::default(),
            serving_mode: ServingMode::default(),
            host_tier_superblocks: 0,
            suspend_policy: SuspendPolicy::default(),
            suspend_cost_per_token: 1,
            recompute_cost_per_token: 4,
            victim_policy: VictimPolicy::default(),
            max_preemptions_per_request: 8,
            admit_after_preemption: false,
            deadlock_steps: 64,
        }
    }

    /// The same configuration for another rank of the group.
    #[must_use]
    pub fn with_rank(&self, cp_rank: u32) -> Self {
        Self {
            cp_rank,
            ..self.clone()
        }
    }

    /// Superblocks that hold `kv_tokens` global tokens, rounded down: how a KV budget
    /// given in tokens becomes a pool size.
    pub fn superblocks_for_kv_tokens(
        cp_size: u32,
        tokens_per_block: u32,
        kv_tokens: u64,
    ) -> Result<u32> {
        let layout = Layout::new(cp_size, tokens_per_block)?;
        let superblocks = kv_tokens / layout.tokens_per_superblock();
        if superblocks == 0 {
            return Err(CoreError::Config(format!(
                "kv_tokens = {kv_tokens} is less than one superblock ({} tokens = tokens_per_block {tokens_per_block} x cp_size {cp_size})",
                layout.tokens_per_superblock()
            )));
        }
        u32::try_from(superblocks).map_err(|_| {
            CoreError::Config(format!(
                "kv_tokens = {kv_tokens} gives more than {} superblocks",
                u32::MAX
            ))
        })
    }

    /// Global tokens the KV pool holds: `capacity_superblocks` superblocks of
    /// `tokens_per_block * cp_size` tokens.
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.capacity_superblocks)
            .saturating_mul(u64::from(self.tokens_per_block))
            .saturating_mul(u64::from(self.cp_size))
    }

    /// The chunk unit in effect.
    pub fn effective_chunk_unit(&self) -> u32 {
        self.chunk_unit.unwrap_or(self.tokens_per_block)
    }

    /// The token placement of this group.
    pub fn layout(&self) -> Result<Layout> {
        Layout::new(self.cp_size, self.tokens_per_block)
    }

    /// Whether this configuration can ever recompute-pause or suspend a request.
    pub fn may_preempt(&self) -> bool {
        self.capacity_policy == CapacityPolicy::MaxUtilization
            && self.serving_mode != ServingMode::DisaggregatedGeneration
    }

    /// Every field that can change a decision or a placement, with its value, in
    /// declaration order: all fields but `cp_rank`, which only selects the per-rank fields
    /// a schedule reports. `chunk_unit` is the unit in effect (`None` and
    /// `Some(tokens_per_block)` decide alike). This is the one list both
    /// [`Self::fingerprint`] and the Python layer's mismatch report read, so a new field
    /// cannot be left out of either (the destructuring below stops compiling).
    pub fn decision_fields(&self) -> [(&'static str, FieldValue); DECISION_FIELDS] {
        use FieldValue::{Bool, Int, Name};
        let Self {
            cp_size,
            cp_rank: _,
            tokens_per_block,
            capacity_superblocks,
            max_batch_size,
            max_num_tokens,
            enable_chunked_prefill,
            chunk_unit: _,
            max_seq_len,
            capacity_policy,
            serving_mode,
            host_tier_superblocks,
            suspend_policy,
            suspend_cost_per_token,
            recompute_cost_per_token,
            victim_policy,
            max_preemptions_per_request,
            admit_after_preemption,
            deadlock_steps,
        } = *self;
        [
            ("cp_size", Int(cp_size.into())),
            ("tokens_per_block", Int(tokens_per_block.into())),
            ("capacity_superblocks", Int(capacity_superblocks.into())),
            ("max_batch_size", Int(max_batch_size.into())),
            ("max_num_tokens", Int(max_num_tokens.into())),
            ("enable_chunked_prefill", Bool(enable_chunked_prefill)),
            ("chunk_unit", Int(self.effective_chunk_unit().into())),
            ("max_seq_len", Int(max_seq_len)),
            ("capacity_policy", Name(capacity_policy.as_str())),
            ("serving_mode", Name(serving_mode.as_str())),
            ("host_tier_superblocks", Int(host_tier_superblocks.into())),
            ("suspend_policy", Name(suspend_policy.as_str())),
            ("suspend_cost_per_token", Int(suspend_cost_per_token.into())),
            (
                "recompute_cost_per_token",
                Int(recompute_cost_per_token.into()),
            ),
            ("victim_policy", Name(victim_policy.as_str())),
            (
                "max_preemptions_per_request",
                Int(max_preemptions_per_request.into()),
            ),
            ("admit_after_preemption", Bool(admit_after_preemption)),
            ("deadlock_steps", Int(deadlock_steps.into())),
        ]
    }

    /// A 64-bit fingerprint of [`Self::decision_fields`] (names and values): equal on
    /// every rank of a correctly built group (`cp_rank` is left out), and different for
    /// two configurations that could decide or place differently. The scheduler seeds
    /// every step's `ScheduleOutput::digest` and its `state_digest` with it, so ranks
    /// built from different configurations disagree from the first step on.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv64::new();
        h.bytes(b"helix_kv.SchedulerConfig");
        for (name, value) in self.decision_fields() {
            h.u64(name.len() as u64);
            h.bytes(name.as_bytes());
            match value {
                FieldValue::Int(v) => {
                    h.u64(0);
                    h.u64(v);
                }
                FieldValue::Bool(v) => {
                    h.u64(1);
                    h.u64(u64::from(v));
                }
                FieldValue::Name(v) => {
                    h.u64(2);
                    h.u64(v.len() as u64);
                    h.bytes(v.as_bytes());
                }
            }
        }
        h.finish()
    }

    /// Checks every rule; the error names the field and what to do.
    pub fn validate(&self) -> Result<()> {
        let fail = |msg: String| Err(CoreError::Config(msg));
        let layout = self.layout()?;
        layout.check_rank(self.cp_rank).map_err(|_| {
            CoreError::Config(format!(
                "cp_rank = {} must be below cp_size = {}",
                self.cp_rank, self.cp_size
            ))
        })?;
        if self.capacity_superblocks == 0 {
            return fail(
                "capacity_superblocks must be at least 1 (the KV budget holds no superblock)"
                    .into(),
            );
        }
        if self.capacity_superblocks > MAX_CAPACITY {
            // The ledger refuses such a pool too; saying so here names the field early.
            return fail(format!(
                "capacity_superblocks = {} is more than {MAX_CAPACITY}, the most superblocks int32 page ids \
                 can name (block tables and slot mappings hand them out as int32); lower the KV budget \
                 (kv_superblocks / kv_tokens)",
                self.capacity_superblocks
            ));
        }
        if self.max_batch_size == 0 || self.max_batch_size > i32::MAX as u32 {
            return fail(format!(
                "max_batch_size = {} must be in 1..={} (batch slots are int32)",
                self.max_batch_size,
                i32::MAX
            ));
        }
        if self.max_num_tokens == 0 {
            return fail("max_num_tokens must be at least 1".into());
        }
        let unit = self.effective_chunk_unit();
        if unit == 0 {
            return fail("chunk_unit must be at least 1".into());
        }
        if self.enable_chunked_prefill && self.max_num_tokens < unit {
            return fail(format!(
                "max_num_tokens = {} is below chunk_unit = {unit}: no partial chunk could ever be scheduled; raise max_num_tokens or lower chunk_unit",
                self.max_num_tokens
            ));
        }
        if self.max_seq_len == 0 {
            return fail("max_seq_len must be at least 1".into());
        }
        if self.deadlock_steps == 0 {
            return fail("deadlock_steps must be at least 1".into());
        }
        if self.host_tier_superblocks > MAX_CAPACITY {
            return fail(format!(
                "host_tier_superblocks = {} is more than {MAX_CAPACITY}, the most superblocks int32 host page \
                 ids can name; lower the host KV budget",
                self.host_tier_superblocks
            ));
        }
        match self.serving_mode {
            ServingMode::NonHelix if self.cp_size != 1 => {
                return fail(format!(
                    "serving_mode non_helix needs cp_size == 1 (got {}); use aggregated_helix or disaggregated_generation for a CP group",
                    self.cp_size
                ));
            }
            ServingMode::DisaggregatedGeneration if self.host_tier_superblocks > 0 => {
                return fail(format!(
                    "host_tier_superblocks = {} is rejected for a disaggregated generation server, which never suspends \
                     or preempts; set host_tier_superblocks = 0 and size the GPU KV budget for the load",
                    self.host_tier_superblocks
                ));
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in VictimPolicy::NAMES {
            assert_eq!(name.parse::<VictimPolicy>().unwrap().as_str(), *name);
        }
        for name in ServingMode::NAMES {
            assert_eq!(name.parse::<ServingMode>().unwrap().as_str(), *name);
        }
        for name in CapacityPolicy::NAMES {
            assert_eq!(name.parse::<CapacityPolicy>().unwrap().as_str(), *name);
        }
        for name in SuspendPolicy::NAMES {
            assert_eq!(name.parse::<SuspendPolicy>().unwrap().as_str(), *name);
        }
        let err = "oldest".parse::<VictimPolicy>().unwrap_err().to_string();
        assert!(err.contains("newest_first"), "{err}");
    }

    fn changed(edit: impl FnOnce(&mut SchedulerConfig)) -> SchedulerConfig {
        let mut config = SchedulerConfig::new(4);
        edit(&mut config);
        config
    }

    #[test]
    fn validation_names_the_field() {
        SchedulerConfig::new(4).validate().unwrap();
        let cases = [
            (changed(|c| c.cp_size = 0), "cp_size"),
            (changed(|c| c.cp_rank = 1), "cp_rank"),
            (changed(|c| c.tokens_per_block = 0), "tokens_per_block"),
            (
                changed(|c| c.capacity_superblocks = 0),
                "capacity_superblocks",
            ),
            (
                changed(|c| c.capacity_superblocks = MAX_CAPACITY + 1),
                "capacity_superblocks = 2147483648 is more than 2147483647",
            ),
            (
                changed(|c| c.capacity_superblocks = u32::MAX),
                "int32 page ids",
            ),
            (changed(|c| c.max_batch_size = 0), "max_batch_size"),
            (changed(|c| c.max_num_tokens = 0), "max_num_tokens"),
            (changed(|c| c.max_num_tokens = 16), "chunk_unit"),
            (changed(|c| c.chunk_unit = Some(0)), "chunk_unit"),
            (changed(|c| c.max_seq_len = 0), "max_seq_len"),
            (changed(|c| c.deadlock_steps = 0), "deadlock_steps"),
            (
                changed(|c| {
                    c.serving_mode = ServingMode::NonHelix;
                    c.cp_size = 2;
                }),
                "non_helix needs cp_size == 1",
            ),
            (
                changed(|c| c.host_tier_superblocks = MAX_CAPACITY + 1),
                "host_tier_superblocks",
            ),
            (
                changed(|c| {
                    c.serving_mode = ServingMode::DisaggregatedGeneration;
                    c.host_tier_superblocks = 2;
                }),
                "disaggregated",
            ),
        ];
        for (config, needle) in cases {
            let err = config.validate().unwrap_err();
            assert!(matches!(err, CoreError::Config(_)));
            assert!(
                err.to_string().contains(needle),
                "{err} should mention {needle}"
            );
        }
    }

    #[test]
    fn the_largest_pool_int32_page_ids_can_name_is_accepted() {
        // Validation only: building a scheduler this large would allocate its free list.
        changed(|c| c.capacity_superblocks = MAX_CAPACITY)
            .validate()
            .unwrap();
        assert_eq!(i64::from(MAX_CAPACITY), i64::from(i32::MAX));
    }

    #[test]
    fn a_scheduler_past_the_int32_page_ids_is_refused_by_its_config() {
        let err = super::super::Scheduler::new(changed(|c| c.capacity_superblocks = u32::MAX))
            .unwrap_err();
        assert!(matches!(err, CoreError::Config(_)));
        assert!(
            err.to_string()
                .contains("capacity_superblocks = 4294967295 is more than 2147483647"),
            "{err}"
        );
    }

    #[test]
    fn host_tier_and_unchunked_configs_are_accepted() {
        changed(|c| {
            c.serving_mode = ServingMode::NonHelix;
            c.host_tier_superblocks = 2;
        })
        .validate()
        .unwrap();
        changed(|c| {
            c.cp_size = 4;
            c.host_tier_superblocks = 2;
        })
        .validate()
        .unwrap();
        changed(|c| {
            c.enable_chunked_prefill = false;
            c.max_num_tokens = 16;
        })
        .validate()
        .unwrap();
    }

    #[test]
    fn kv_tokens_round_down_to_superblocks() {
        assert_eq!(
            SchedulerConfig::superblocks_for_kv_tokens(2, 16, 100).unwrap(),
            3
        );
        let mut config = SchedulerConfig::new(3);
        config.cp_size = 2;
        config.tokens_per_block = 16;
        assert_eq!(config.capacity_tokens(), 96);
        assert_eq!(
            config.capacity_tokens(),
            config.layout().unwrap().tokens_per_superblock() * 3
        );
        let err = SchedulerConfig::superblocks_for_kv_tokens(2, 16, 31).unwrap_err();
        assert!(
            err.to_string().contains("less than one superblock"),
            "{err}"
        );
    }
}
