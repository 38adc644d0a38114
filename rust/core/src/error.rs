//! The one error type of the core. Every variant maps to one Python exception class
//! (see the binding crate), so adding a variant is a compile error there until it is
//! given a class.

use crate::ids::RequestId;

/// Why a call into the core was refused. A call that returns an error has changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A configuration value is out of range or inconsistent with another. `field` is the
    /// setting at fault (a `SchedulerConfig` field, or an argument such as `kv_tokens`), the
    /// one the message leads with, as data: a caller maps it without reading the message.
    #[error("invalid configuration: {message}")]
    Config {
        field: &'static str,
        message: String,
    },
    /// An argument is malformed: mismatched array lengths, a rank outside the group,
    /// a repeated id inside one batch.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A length is negative, larger than allowed, or moves the wrong way.
    #[error("invalid length: {0}")]
    InvalidLength(String),
    /// The request id is not held (never added, or already freed).
    #[error("unknown request {0}: not held by the ledger (never added, or already freed)")]
    UnknownRequest(RequestId),
    /// The request id is already held.
    #[error("duplicate request {0}: the id is already in use")]
    DuplicateRequest(RequestId),
    /// A request can never fit: it is longer than `max_seq_len` or than the whole pool.
    #[error("request {id} can never be scheduled: {reason}")]
    RequestTooLarge { id: RequestId, reason: String },
    /// KV pressure where the configuration forbids preemption (disaggregated generation).
    #[error("out of KV pages: {0}")]
    PreemptionDisabled(String),
    /// Many consecutive steps with candidates and no progress.
    #[error("scheduler deadlock: {0}")]
    Deadlock(String),
    /// A call arrived in the wrong order (update without schedule, revert twice...).
    #[error("invalid state: {0}")]
    InvalidState(String),
}

impl CoreError {
    /// A [`CoreError::Config`] about `field`.
    pub fn config(field: &'static str, message: impl Into<String>) -> Self {
        Self::Config {
            field,
            message: message.into(),
        }
    }
}

/// Shorthand for results of the core.
pub type Result<T> = std::result::Result<T, CoreError>;
