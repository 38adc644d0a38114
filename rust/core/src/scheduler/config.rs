//! Scheduler configuration: plain fields, checked once by [`SchedulerConfig::validate`].
//!
//! The fields are declared once, in [`scheduler_config_fields!`](crate::scheduler_config_fields):
//! name, type, default, range of values, whether it decides, and a one-line doc. The struct,
//! [`SchedulerConfig::new`] (the defaults), the range checks of [`SchedulerConfig::validate`],
//! [`SchedulerConfig::decision_fields`] (and so the fingerprint) and the field table
//! [`SchedulerConfig::FIELDS`] here, and the Python class in the binding (its keywords,
//! getters, `DEFAULTS`, `FIELDS` and signature), are all built from that list. Rules between
//! fields are written by hand in [`SchedulerConfig::validate`].

use std::fmt;
use std::str::FromStr;

use crate::digest::Fnv64;
use crate::error::{CoreError, Result};
use crate::ids::MAX_CAPACITY;
use crate::layout::Layout;

/// The most draft tokens one decode may verify in a step (`num_speculative_tokens`): peers
/// run 1 to 10 (EAGLE, MTP, n-gram); 64 keeps a step's worst case well inside its budget.
pub const MAX_SPECULATIVE_TOKENS: u32 = 64;

/// How KV capacity is promised to requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CapacityPolicy {
    /// Reserve as a request grows; preempt on pressure.
    MaxUtilization,
    /// Reserve prompt + whole output at admission; never preempt.
    GuaranteedNoEvict,
}

/// Where the scheduler runs, which decides what it may do under KV pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServingMode {
    /// Prefill and decode on the same GPUs, KV sharded over a CP group; GPU-only pool,
    /// so recompute-pause is the only way to free pages.
    AggregatedHelix,
    /// A single rank (`cp_size == 1`), optionally with a host tier to suspend to.
    NonHelix,
    /// A disaggregated generation server: preemption is disabled.
    DisaggregatedGeneration,
}

/// Which request gives up its pages when a request ahead of it needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VictimPolicy {
    /// The newest candidate in queue order.
    NewestFirst,
    /// The candidate with the fewest computed KV tokens (the least work to redo); ties
    /// go to the newest.
    LeastComputedFirst,
    /// The candidate with the lowest `priority` value; ties go to the newest.
    Priority,
}

/// The order of the queue, which every phase walks: which waiting request is admitted first,
/// whose decode gets the step's budget first, and who may preempt whom (a victim is always
/// behind its requester).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdmissionPolicy {
    /// Arrival order: first come, first served.
    Fcfs,
    /// Higher `priority` first, ties in arrival order (vLLM's `policy="priority"`, whose
    /// lower value is the more important one).
    Priority,
}

/// Whether a victim with room in the host tier is suspended (its KV copied to host and
/// back) or recompute-paused (its KV thrown away and prefilled again). Every input is
/// rank-invariant: the victim's state, its global token count and superblocks, and the
/// configuration's cost coefficients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SuspendPolicy {
    /// Suspend every victim the host tier has room for; recompute-pause the rest.
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
            pub const fn as_str(self) -> &'static str {
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

        impl From<$ty> for FieldValue {
            fn from(value: $ty) -> Self {
                Self::Name(value.as_str())
            }
        }

        impl ConfigValue for $ty {
            const TYPE: &'static str = stringify!($ty);
            const CHOICES: &'static [&'static str] = Self::NAMES;
        }

        impl FromStr for $ty {
            type Err = CoreError;

            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($name => Ok(Self::$variant),)+
                    _ => Err(CoreError::config($what, format!(
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
snake_case_names!(AdmissionPolicy, "admission_policy",
    Fcfs => "fcfs",
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

impl From<u32> for FieldValue {
    fn from(value: u32) -> Self {
        Self::Int(value.into())
    }
}

impl From<u64> for FieldValue {
    fn from(value: u64) -> Self {
        Self::Int(value)
    }
}

impl From<bool> for FieldValue {
    fn from(value: bool) -> Self {
        Self::Bool(value)
    }
}

/// A type a [`SchedulerConfig`] field may have: a count or size (`u32`, `u64`), a switch
/// (`bool`), an optional count (`Option<u32>`) or an option enum (its `NAMES`).
pub trait ConfigValue: Copy {
    /// The type's name as the field declaration writes it (`ConfigField::ty`).
    const TYPE: &'static str;
    /// The names an option enum accepts, in declaration order; empty for any other type.
    const CHOICES: &'static [&'static str] = &[];
}

impl ConfigValue for u32 {
    const TYPE: &'static str = "u32";
}
impl ConfigValue for u64 {
    const TYPE: &'static str = "u64";
}
impl ConfigValue for bool {
    const TYPE: &'static str = "bool";
}
impl ConfigValue for Option<u32> {
    const TYPE: &'static str = "Option<u32>";
}

/// A field type that can have a range (`#[range(..)]` on any other type does not compile).
trait RangedValue {
    /// The integer type the bounds are written in (an `Option`'s value type).
    type Bound: Into<u64>;
    /// The value the range check reads; `None` for an unset option (nothing to check).
    fn ranged(self) -> Option<u64>;
}

impl RangedValue for u32 {
    type Bound = u32;
    fn ranged(self) -> Option<u64> {
        Some(self.into())
    }
}

impl RangedValue for u64 {
    type Bound = u64;
    fn ranged(self) -> Option<u64> {
        Some(self)
    }
}

impl RangedValue for Option<u32> {
    type Bound = u32;
    fn ranged(self) -> Option<u64> {
        self.map(u64::from)
    }
}

/// The default of a field in [`SchedulerConfig::FIELDS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConfigDefault {
    /// No default: [`SchedulerConfig::new`] takes it (the KV pool, `capacity_superblocks`).
    Required,
    /// An optional field, unset by default (`None`).
    Unset,
    /// The value, as [`SchedulerConfig::decision_fields`] would show it.
    Value(FieldValue),
}

/// One field of [`SchedulerConfig`] as [`scheduler_config_fields!`](crate::scheduler_config_fields)
/// declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConfigField {
    /// The field's name.
    pub name: &'static str,
    /// Its Rust type as written in the declaration (`u32`, `Option<u32>`, `VictimPolicy`...).
    pub ty: &'static str,
    /// Its default.
    pub default: ConfigDefault,
    /// The values an integer field accepts, `min..=max` (for an `Option`, when it is set;
    /// `validate` refuses the rest); `None` for a switch or an option enum.
    pub range: Option<(u64, u64)>,
    /// The names an option enum accepts; empty for any other type.
    pub choices: &'static [&'static str],
    /// Its one-line doc.
    pub doc: &'static str,
}

/// Hands the field list of [`SchedulerConfig`] to another macro:
/// `scheduler_config_fields!(callback! { args })` expands to
/// `callback! { { args } fields... }`.
///
/// Each field is, in this order: its doc comment (one line of meaning; it is also the Python
/// getter's docstring and the `simulate` flag's help, so no Rust links); `#[range(min, max)]`
/// for an integer (the values `validate` accepts; an optional third argument says why `max`
/// is the most, for the error message); `#[decision(none)]` for the one field that never
/// decides (`cp_rank`), or `#[decision(method)]` where `decision_fields` shows the value in
/// effect (`method()`) instead of the field; then `name: type = default`. A default is a
/// literal, `None` (unset), an option's variant name, or `required` (no default:
/// [`SchedulerConfig::new`] takes it; the KV pool). The types and constants used are in scope
/// where the macro is expanded.
///
/// Adding a field here adds it to the struct, `new`, `validate`'s range check,
/// `decision_fields` (and so the fingerprint), `FIELDS`, and the binding's class (keyword,
/// getter, `DEFAULTS`, `FIELDS`, signature). The stub (`_core.pyi`), `EngineConfig`, the
/// `simulate` flags and the tables of `docs/configuration.md` and
/// `docs/internals/scheduler.md` are checked against it by `tests/binding/test_config_fields.py`,
/// which names what is missing.
#[macro_export]
macro_rules! scheduler_config_fields {
    ($callback:ident ! { $($args:tt)* }) => {
        $callback! {
            { $($args)* }
            /// Ranks in the CP group.
            #[range(1, u32::MAX)]
            cp_size: u32 = 1,
            /// This rank (below `cp_size`): it selects the per-rank fields a schedule reports, never a decision.
            #[range(0, u32::MAX)]
            #[decision(none)]
            cp_rank: u32 = 0,
            /// Tokens in one KV page on one rank.
            #[range(1, u32::MAX)]
            tokens_per_block: u32 = 32,
            /// Superblocks in the KV pool, identical on every rank (the group's minimum).
            #[range(1, MAX_CAPACITY, "the most superblocks int32 page ids can name (block tables and slot mappings hand them out as int32); lower the KV budget (kv_superblocks / kv_tokens)")]
            capacity_superblocks: u32 = required,
            /// Entries (context + generation) in one step, and the number of batch slots.
            #[range(1, i32::MAX as u32, "the most batch slots int32 slot numbers can name")]
            max_batch_size: u32 = 256,
            /// Tokens (context chunks + decode tokens) in one step.
            #[range(1, u32::MAX)]
            max_num_tokens: u32 = 8192,
            /// Whether a prompt may be split over several steps.
            enable_chunked_prefill: bool = true,
            /// A chunk that does not complete its prompt is a multiple of it; unset means `tokens_per_block`.
            #[range(1, u32::MAX)]
            #[decision(effective_chunk_unit)]
            chunk_unit: Option<u32> = None,
            /// While other requests are live, the most prompt tokens one request computes in a step (at least one chunk unit); 0 turns the cap off.
            #[range(0, u32::MAX)]
            long_prefill_token_threshold: u32 = 0,
            /// Whether the prefill cap is at least the step's fair share: `max_num_tokens` divided by the live requests.
            long_prefill_token_threshold_adaptive: bool = false,
            /// Longest request (prompt + `max_new_tokens`) accepted.
            #[range(1, u64::MAX)]
            max_seq_len: u64 = 131_072,
            /// How KV capacity is promised: as a request grows (preempting under pressure), or whole at admission.
            capacity_policy: CapacityPolicy = MaxUtilization,
            /// Where the scheduler runs, which decides what it may do under KV pressure.
            serving_mode: ServingMode = AggregatedHelix,
            /// Superblocks of host memory to suspend to, one host page on every rank each (the group's minimum).
            #[range(0, MAX_CAPACITY, "the most superblocks int32 host page ids can name; lower the host KV budget")]
            host_tier_superblocks: u32 = 0,
            /// Whether a victim the host tier has room for is suspended or recompute-paused.
            suspend_policy: SuspendPolicy = SuspendFirst,
            /// Cost (any unit) of copying one token's KV to the host tier and back, for the `cost` suspend policy.
            #[range(0, u32::MAX)]
            suspend_cost_per_token: u32 = 1,
            /// Cost of computing one token again after a recompute-pause, in the same unit.
            #[range(0, u32::MAX)]
            recompute_cost_per_token: u32 = 4,
            /// The queue's order: arrival (fcfs), or higher priority first with ties in arrival order (priority).
            admission_policy: AdmissionPolicy = Fcfs,
            /// Which request gives up its pages when a request ahead of it needs them.
            victim_policy: VictimPolicy = NewestFirst,
            /// A request chosen as a victim this many times is chosen again only by the queue head; 0 turns preemption off.
            #[range(0, u32::MAX)]
            max_preemptions_per_request: u32 = 8,
            /// Whether a step that preempted may still admit waiting requests.
            admit_after_preemption: bool = false,
            /// Consecutive steps without progress (while requests are live) before a deadlock error.
            #[range(1, u32::MAX)]
            deadlock_steps: u32 = 64,
            /// Whether full superblocks of known tokens stay cached for requests with the same prefix (and the same cache salt).
            enable_prefix_caching: bool = false,
            /// Draft tokens a decode may verify in one step (speculative decoding); 0 turns drafts off.
            #[range(0, MAX_SPECULATIVE_TOKENS, "the most draft positions a decode verifies in one step")]
            num_speculative_tokens: u32 = 0,
            /// Consecutive drafted decodes of a request with no draft accepted after which it stops drafting for a while (the draft backoff); 0 turns the backoff off.
            #[range(0, u32::MAX)]
            draft_backoff_misses: u32 = 0,
            /// Tokens a request decodes without drafts once the draft backoff stops it; each further stop without an accepted draft in between doubles it (at most 64x).
            #[range(1, 1 << 24, "the longest first pause of the draft backoff")]
            draft_backoff_tokens: u32 = 16,
        }
    };
}

/// A field's value in [`SchedulerConfig::new`]; `$required` for the field without a default.
macro_rules! default_value {
    ($ty:ty, required, $required:ident) => {
        $required
    };
    ($ty:ty, None, $required:ident) => {
        None
    };
    ($ty:ty, $value:literal, $required:ident) => {
        $value
    };
    ($ty:ty, $variant:ident, $required:ident) => {
        <$ty>::$variant
    };
}

/// A field's default as [`SchedulerConfig::FIELDS`] shows it.
macro_rules! field_default {
    ($ty:ty, required) => {
        ConfigDefault::Required
    };
    ($ty:ty, None) => {
        ConfigDefault::Unset
    };
    ($ty:ty, true) => {
        ConfigDefault::Value(FieldValue::Bool(true))
    };
    ($ty:ty, false) => {
        ConfigDefault::Value(FieldValue::Bool(false))
    };
    ($ty:ty, $value:literal) => {
        ConfigDefault::Value(FieldValue::Int($value))
    };
    ($ty:ty, $variant:ident) => {
        ConfigDefault::Value(FieldValue::Name(<$ty>::$variant.as_str()))
    };
}

/// A field's range in [`SchedulerConfig::FIELDS`] (bounds widened to `u64`).
macro_rules! field_range {
    () => {
        None
    };
    ($min:expr, $max:expr) => {
        Some(($min as u64, $max as u64))
    };
}

/// A field's entry in [`SchedulerConfig::decision_fields`]: the field, the value in effect
/// (`#[decision(method)]`), or none (`#[decision(none)]`).
macro_rules! decision_entry {
    ($config:ident, $name:ident) => {
        Some((stringify!($name), FieldValue::from($config.$name)))
    };
    ($config:ident, $name:ident, none) => {
        None
    };
    ($config:ident, $name:ident, $in_effect:ident) => {
        Some((stringify!($name), FieldValue::from($config.$in_effect())))
    };
}

/// 1 if a field is in [`SchedulerConfig::decision_fields`], else 0.
macro_rules! decision_count {
    () => {
        1
    };
    (none) => {
        0
    };
    ($in_effect:ident) => {
        1
    };
}

macro_rules! define_scheduler_config {
    ({} $(
        $(#[doc = $doc:tt])*
        $(#[range($min:expr, $max:expr $(, $why:literal)?)])?
        $(#[decision($decision:ident)])?
        $name:ident : $ty:ty = $default:tt
    ),* $(,)?) => {
        /// Everything a [`super::Scheduler`] is built from. Every field except `cp_rank` is the
        /// same on every rank of a CP group; `cp_rank` only selects which per-rank fields a
        /// schedule reports and never influences a decision.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct SchedulerConfig {
            $( $(#[doc = $doc])* pub $name: $ty, )*
        }

        /// Fields in [`SchedulerConfig::decision_fields`]: every field but `cp_rank`.
        pub const DECISION_FIELDS: usize = 0 $( + decision_count!($($decision)?) )*;

        impl SchedulerConfig {
            /// Every field, in declaration order, with its type, default, range and doc.
            pub const FIELDS: &'static [ConfigField] = &[$(
                ConfigField {
                    name: stringify!($name),
                    ty: <$ty as ConfigValue>::TYPE,
                    default: field_default!($ty, $default),
                    range: field_range!($($min, $max)?),
                    choices: <$ty as ConfigValue>::CHOICES,
                    doc: concat!($($doc),*).trim_ascii(),
                }
            ),*];

            /// The defaults for a pool of `capacity_superblocks` superblocks.
            pub fn new(capacity_superblocks: u32) -> Self {
                Self {
                    $( $name: default_value!($ty, $default, capacity_superblocks), )*
                }
            }

            /// Checks every field's declared range; the error names the field.
            fn check_ranges(&self) -> Result<()> {
                $( $(
                    check_range(
                        stringify!($name),
                        self.$name,
                        $min,
                        $max,
                        &[$($why)?],
                    )?;
                )? )*
                Ok(())
            }

            /// Every field that can change a decision or a placement, with its value, in
            /// declaration order: all fields but `cp_rank`, which only selects the per-rank
            /// fields a schedule reports. `chunk_unit` is the unit in effect (`None` and
            /// `Some(tokens_per_block)` decide alike). This is the one list both
            /// [`Self::fingerprint`] and the Python layer's mismatch report read; it is built
            /// from the field declaration, so a new field is in it unless declared
            /// `#[decision(none)]`.
            pub fn decision_fields(&self) -> [(&'static str, FieldValue); DECISION_FIELDS] {
                let entries = [$( decision_entry!(self, $name $(, $decision)?) ),*];
                let mut fields = [("", FieldValue::Int(0)); DECISION_FIELDS];
                for (slot, entry) in fields.iter_mut().zip(entries.into_iter().flatten()) {
                    *slot = entry;
                }
                fields
            }
        }
    };
}

scheduler_config_fields!(define_scheduler_config! {});

/// A `Config` error naming `name` when `value` is outside `min..=max` (`why`, empty or one
/// reason, says why `max` is the most); nothing to check for an unset option (`None`).
fn check_range<V: RangedValue>(
    name: &'static str,
    value: V,
    min: V::Bound,
    max: V::Bound,
    why: &[&str],
) -> Result<()> {
    let (min, max) = (min.into(), max.into());
    match value.ranged() {
        Some(v) if v < min => Err(CoreError::config(
            name,
            format!("{name} must be at least {min}"),
        )),
        Some(v) if v > max => Err(CoreError::config(
            name,
            format!(
                "{name} = {v} is more than {max}{}",
                why.first()
                    .map(|why| format!(", {why}"))
                    .unwrap_or_default()
            ),
        )),
        _ => Ok(()),
    }
}

impl SchedulerConfig {
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
            return Err(CoreError::config("kv_tokens", format!(
                "kv_tokens = {kv_tokens} is less than one superblock ({} tokens = tokens_per_block {tokens_per_block} x cp_size {cp_size})",
                layout.tokens_per_superblock()
            )));
        }
        u32::try_from(superblocks).map_err(|_| {
            CoreError::config(
                "kv_tokens",
                format!(
                    "kv_tokens = {kv_tokens} gives more than {} superblocks",
                    u32::MAX
                ),
            )
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

    /// The most prompt tokens one request may compute in a step that starts with `live` live
    /// requests (`long_prefill_token_threshold`), or `None` when nothing caps it: the cap is
    /// off, or the request is alone, with nobody to keep waiting. With
    /// `long_prefill_token_threshold_adaptive` it is at least the step's fair share,
    /// `max_num_tokens / live`; it is never below one chunk unit (a chunk that does not
    /// complete its prompt is a multiple of the unit).
    pub fn prefill_cap(&self, live: usize) -> Option<u64> {
        let threshold = u64::from(self.long_prefill_token_threshold);
        if threshold == 0 || live <= 1 {
            return None;
        }
        let fair_share = if self.long_prefill_token_threshold_adaptive {
            u64::from(self.max_num_tokens) / live as u64
        } else {
            0
        };
        Some(
            threshold
                .max(fair_share)
                .max(u64::from(self.effective_chunk_unit())),
        )
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

    /// A 64-bit fingerprint of [`Self::decision_fields`] (names and values): equal on
    /// every rank of a correctly built group (`cp_rank` is left out), and different for
    /// two configurations that could decide or place differently. The scheduler seeds
    /// every step's `ScheduleOutput::digest` and its `state_digest` with it, so ranks
    /// built from different configurations disagree from the first step on.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv64::new();
        h.bytes(b"helix_kv.SchedulerConfig");
        for (name, value) in self.decision_fields() {
            let off = matches!(
                (name, value),
                (
                    "enable_prefix_caching" | "long_prefill_token_threshold_adaptive",
                    FieldValue::Bool(false)
                ) | (
                    "num_speculative_tokens"
                        | "long_prefill_token_threshold"
                        | "draft_backoff_misses",
                    FieldValue::Int(0)
                ) | ("admission_policy", FieldValue::Name("fcfs"))
            ) || (name == "draft_backoff_tokens" && self.draft_backoff_misses == 0);
            if off {
                // A feature off hashes as if it did not exist, so configurations from
                // before it keep their fingerprint (and every digest its value).
                continue;
            }
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

    /// Checks every field's range (declared with it), then the rules between fields; the
    /// error names the field and what to do.
    pub fn validate(&self) -> Result<()> {
        self.check_ranges()?;
        let fail = |field, msg: String| Err(CoreError::config(field, msg));
        let layout = self.layout()?;
        layout.check_rank(self.cp_rank).map_err(|_| {
            CoreError::config(
                "cp_rank",
                format!(
                    "cp_rank = {} must be below cp_size = {}",
                    self.cp_rank, self.cp_size
                ),
            )
        })?;
        let unit = self.effective_chunk_unit();
        if self.enable_chunked_prefill && self.max_num_tokens < unit {
            return fail("max_num_tokens", format!(
                "max_num_tokens = {} is below chunk_unit = {unit}: no partial chunk could ever be scheduled; raise max_num_tokens or lower chunk_unit",
                self.max_num_tokens
            ));
        }
        if self.long_prefill_token_threshold > 0 && !self.enable_chunked_prefill {
            return fail("long_prefill_token_threshold", format!(
                "long_prefill_token_threshold = {} splits long prompts over several steps, which needs chunked \
                 prefill: enable chunked prefill, or set long_prefill_token_threshold = 0",
                self.long_prefill_token_threshold
            ));
        }
        match self.serving_mode {
            ServingMode::NonHelix if self.cp_size != 1 => {
                return fail("serving_mode", format!(
                    "serving_mode non_helix needs cp_size == 1 (got {}); use aggregated_helix or disaggregated_generation for a CP group",
                    self.cp_size
                ));
            }
            ServingMode::DisaggregatedGeneration if self.host_tier_superblocks > 0 => {
                return fail("host_tier_superblocks", format!(
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
    fn the_field_table_says_what_each_field_takes() {
        let fields = SchedulerConfig::FIELDS;
        let required: Vec<_> = fields
            .iter()
            .filter(|f| f.default == ConfigDefault::Required)
            .map(|f| f.name)
            .collect();
        assert_eq!(required, ["capacity_superblocks"], "what `new` takes");
        for field in fields {
            let name = field.name;
            let integer = matches!(field.ty, "u32" | "u64" | "Option<u32>");
            assert_eq!(
                field.range.is_some(),
                integer,
                "{name}: a #[range] for every integer"
            );
            let option_enum = !integer && field.ty != "bool";
            assert_eq!(!field.choices.is_empty(), option_enum, "{name}: choices");
            let optional = field.ty.starts_with("Option<");
            assert_eq!(field.default == ConfigDefault::Unset, optional, "{name}");
            assert!(
                !field.doc.is_empty() && field.doc == field.doc.trim(),
                "{name}: doc"
            );
            assert!(
                !field.doc.contains("[`"),
                "{name}: a Rust link reaches Python"
            );
            match (field.default, field.range) {
                (ConfigDefault::Value(FieldValue::Int(v)), Some((min, max))) => {
                    assert!((min..=max).contains(&v), "{name}: the default is in range");
                }
                (ConfigDefault::Value(FieldValue::Name(v)), _) => {
                    assert!(field.choices.contains(&v), "{name}");
                }
                _ => {}
            }
        }
        let names: Vec<_> = SchedulerConfig::new(4)
            .decision_fields()
            .iter()
            .map(|&(name, _)| name)
            .collect();
        let all_but_cp_rank: Vec<_> = fields
            .iter()
            .map(|f| f.name)
            .filter(|&name| name != "cp_rank")
            .collect();
        assert_eq!(names, all_but_cp_rank);
    }

    /// A field of the test's config set to `value` (`None` where its type cannot hold it).
    trait SetTo: Sized {
        fn set_to(value: u64) -> Option<Self>;
    }
    impl SetTo for u32 {
        fn set_to(value: u64) -> Option<Self> {
            value.try_into().ok()
        }
    }
    impl SetTo for u64 {
        fn set_to(value: u64) -> Option<Self> {
            Some(value)
        }
    }
    impl SetTo for Option<u32> {
        fn set_to(value: u64) -> Option<Self> {
            value.try_into().ok().map(Some)
        }
    }

    /// `(field, declared range, value, the defaults with the field set to value)` at each end
    /// of every declared range and one past it (where the type holds it).
    macro_rules! range_cases {
        ({} $(
            $(#[doc = $doc:tt])*
            $(#[range $range:tt])?
            $(#[decision $decision:tt])?
            $name:ident : $ty:ty = $default:tt
        ),* $(,)?) => {
            fn range_cases() -> Vec<(&'static str, &'static str, u64, SchedulerConfig)> {
                let mut cases = Vec::new();
                $( $(
                    let field = SchedulerConfig::FIELDS.iter().find(|f| f.name == stringify!($name));
                    let (min, max) = field.and_then(|f| f.range).unwrap();
                    let ends = [min.checked_sub(1), Some(min), Some(max), max.checked_add(1)];
                    for value in ends.into_iter().flatten() {
                        if let Some(set) = <$ty as SetTo>::set_to(value) {
                            let mut config = SchedulerConfig::new(4);
                            config.$name = set;
                            cases.push((stringify!($name), stringify!($range), value, config));
                        }
                    }
                )? )*
                cases
            }
        };
    }

    crate::scheduler_config_fields!(range_cases! {});

    #[test]
    fn every_declared_range_is_checked() {
        let cases = range_cases();
        let ranged = SchedulerConfig::FIELDS.iter().filter(|f| f.range.is_some());
        assert!(cases.len() >= 2 * ranged.count());
        for (name, range, value, config) in cases {
            let field = SchedulerConfig::FIELDS.iter().find(|f| f.name == name);
            let (min, max) = field.and_then(|f| f.range).unwrap();
            match config.check_ranges() {
                Ok(()) => assert!((min..=max).contains(&value), "{name} = {value}, {range}"),
                Err(err) => {
                    assert!(!(min..=max).contains(&value), "{name} = {value}: {err}");
                    assert!(err.to_string().contains(name), "{err}");
                    assert!(matches!(err, CoreError::Config { field, .. } if field == name));
                }
            }
        }
    }

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
        for name in AdmissionPolicy::NAMES {
            assert_eq!(name.parse::<AdmissionPolicy>().unwrap().as_str(), *name);
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
            (changed(|c| c.cp_size = 0), "cp_size", "cp_size"),
            (changed(|c| c.cp_rank = 1), "cp_rank", "cp_rank"),
            (changed(|c| c.tokens_per_block = 0), "tokens_per_block", "tokens_per_block"),
            (
                changed(|c| c.capacity_superblocks = 0),
                "capacity_superblocks",
                "capacity_superblocks",
            ),
            (
                changed(|c| c.capacity_superblocks = MAX_CAPACITY + 1),
                "capacity_superblocks",
                "capacity_superblocks = 2147483648 is more than 2147483647",
            ),
            (
                changed(|c| c.capacity_superblocks = u32::MAX),
                "capacity_superblocks",
                "int32 page ids",
            ),
            (
                changed(|c| c.max_batch_size = 0),
                "max_batch_size",
                "max_batch_size must be at least 1",
            ),
            (
                changed(|c| c.max_batch_size = 1 << 31),
                "max_batch_size",
                "max_batch_size = 2147483648 is more than 2147483647",
            ),
            (changed(|c| c.max_num_tokens = 0), "max_num_tokens", "max_num_tokens"),
            (changed(|c| c.max_num_tokens = 16), "max_num_tokens", "chunk_unit"),
            (changed(|c| c.chunk_unit = Some(0)), "chunk_unit", "chunk_unit"),
            (
                changed(|c| {
                    c.enable_chunked_prefill = false;
                    c.long_prefill_token_threshold = 64;
                }),
                "long_prefill_token_threshold",
                "long_prefill_token_threshold = 64 splits long prompts over several steps, which needs chunked prefill",
            ),
            (changed(|c| c.max_seq_len = 0), "max_seq_len", "max_seq_len"),
            (changed(|c| c.deadlock_steps = 0), "deadlock_steps", "deadlock_steps"),
            (
                changed(|c| {
                    c.serving_mode = ServingMode::NonHelix;
                    c.cp_size = 2;
                }),
                "serving_mode",
                "non_helix needs cp_size == 1",
            ),
            (
                changed(|c| c.host_tier_superblocks = MAX_CAPACITY + 1),
                "host_tier_superblocks",
                "host_tier_superblocks",
            ),
            (
                changed(|c| {
                    c.serving_mode = ServingMode::DisaggregatedGeneration;
                    c.host_tier_superblocks = 2;
                }),
                "host_tier_superblocks",
                "disaggregated",
            ),
        ];
        for (config, named, needle) in cases {
            let err = config.validate().unwrap_err();
            let CoreError::Config { field, .. } = &err else {
                panic!("{err} is not a Config error");
            };
            assert_eq!(*field, named, "{err}");
            assert!(err.to_string().contains(named), "{err} should name {named}");
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
        assert!(matches!(err, CoreError::Config { .. }));
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
    fn the_prefill_cap_applies_while_others_are_live_and_keeps_a_floor() {
        let config = changed(|c| {
            c.tokens_per_block = 16;
            c.max_num_tokens = 1024;
        });
        assert_eq!(config.prefill_cap(5), None, "off by default");
        let capped = SchedulerConfig {
            long_prefill_token_threshold: 100,
            ..config.clone()
        };
        assert_eq!(capped.prefill_cap(0), None);
        assert_eq!(capped.prefill_cap(1), None, "alone: nobody waits");
        assert_eq!(capped.prefill_cap(2), Some(100));
        assert_eq!(capped.prefill_cap(1000), Some(100));
        let adaptive = SchedulerConfig {
            long_prefill_token_threshold_adaptive: true,
            ..capped.clone()
        };
        assert_eq!(adaptive.prefill_cap(1), None);
        assert_eq!(adaptive.prefill_cap(2), Some(512), "the fair share");
        assert_eq!(adaptive.prefill_cap(10), Some(102));
        assert_eq!(adaptive.prefill_cap(11), Some(100), "the threshold");
        let tiny = SchedulerConfig {
            long_prefill_token_threshold: 3,
            ..config.clone()
        };
        assert_eq!(tiny.prefill_cap(2), Some(16), "at least one chunk unit");
        let adaptive_off = SchedulerConfig {
            long_prefill_token_threshold_adaptive: true,
            ..config
        };
        assert_eq!(
            adaptive_off.prefill_cap(2),
            None,
            "adaptive alone caps nothing"
        );
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
