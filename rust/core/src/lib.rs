//! The `helix_kv` core: a rank-invariant paged KV ledger and preemptive scheduler for
//! Helix (context-parallel) decoding.
//!
//! Everything here is deterministic in its inputs: no clocks, no per-rank readings, and
//! no hash-map iteration order ever reaches a decision (hash maps are used for lookups
//! only). Two instances fed the same calls are identical, which is what lets every CP
//! rank run its own copy and still agree.
//!
//! Tools hold that line, not just this paragraph: the workspace `clippy.toml` refuses
//! std `HashMap`/`HashSet` (random iteration order per process) and the clocks
//! (`Instant::now`, `SystemTime::now`), and the `iter_over_hash_type` lint refuses a loop
//! over any hash map, so each exception is an `#[expect(..., reason)]` at its site.
#![forbid(unsafe_code)]
// A lint is silenced only where it fires, with its reason: `#[expect]`, never `#[allow]`.
#![warn(clippy::allow_attributes)]

/// Defines a plain record, `pub struct` with `pub` fields, from a field list handed over by
/// one of the `*_fields!` macros (the binding builds its Python class from the same list).
macro_rules! define_record {
    ({ $(#[$attr:meta])* struct $name:ident } $( $(#[doc = $doc:tt])* $field:ident : $ty:ty ),* $(,)?) => {
        $(#[$attr])*
        pub struct $name {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }
    };
}

pub mod digest;
pub mod error;
pub mod ids;
pub mod layout;
pub mod ledger;
pub mod prefix_cache;
pub mod scheduler;
#[cfg(test)]
mod test_rng;

pub use error::{CoreError, Result};
pub use ids::{RequestId, SuperblockId};
pub use layout::Layout;
pub use ledger::{DecodeView, Ledger, RequestKv};
pub use scheduler::{
    decode_row, AdmissionPolicy, CapacityPolicy, ConfigDefault, ConfigField, ConfigValue,
    DecodePlacement, DecodeRowCounts, FieldScope, FieldValue, FinishReason, PreparedPrompt,
    RankPlacement, RequestMetrics, RequestOutput, RequestState, ScheduleOutput, Scheduler,
    SchedulerConfig, SchedulerMetrics, ServingMode, StepMetadata, StepMetadataLayout,
    StepMetadataSection, StepSource, SuspendPolicy, VictimPolicy,
};
