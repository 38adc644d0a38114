//! Counters for dashboards and tests. They are derived from rank-invariant events, so
//! they are equal on every rank too.

/// Totals over the scheduler's life.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SchedulerMetrics {
    /// Steps run (updated; reverted steps are not counted).
    pub steps: u64,
    /// Recompute-pauses.
    pub preemptions: u64,
    /// Suspends to the host tier.
    pub suspensions: u64,
    /// KV tokens thrown away by recompute-pauses (they are computed again).
    pub recomputed_tokens: u64,
    /// Context and decode tokens run, recomputation included.
    pub computed_tokens: u64,
    /// Times a generation request sat out a step (in steps that ran).
    pub sat_out: u64,
    /// Requests that finished by length or end-of-sequence (aborted ones are not counted
    /// here but in `aborts`).
    pub finished: u64,
    /// Requests aborted (counted when the abort takes effect; an abort of a request that
    /// had already finished changes nothing and is not counted).
    pub aborts: u64,
    /// Superblocks held now.
    pub kv_used_superblocks: u32,
    /// Superblocks in the pool.
    pub kv_capacity_superblocks: u32,
    /// `kv_used_superblocks / kv_capacity_superblocks`, now.
    pub kv_utilization: f64,
    /// Highest utilisation seen right after a `schedule()`.
    pub kv_utilization_peak: f64,
}

/// Counters of one request (live, or finished and not yet taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RequestMetrics {
    /// Times chosen as a victim (recompute-pause or suspend); bounded by
    /// `max_preemptions_per_request`.
    pub preemptions: u32,
    /// KV tokens it lost to recompute-pauses.
    pub recomputed_tokens: u64,
    /// Steps run while it was live and got no context or generation entry.
    pub steps_waited: u64,
    /// Tokens sampled for it so far.
    pub generated_tokens: u64,
}
