//! Counters for dashboards and tests. They are derived from rank-invariant events, so
//! they are equal on every rank too.
//!
//! Each record's fields are listed once, in a `*_fields!` macro: the struct here and the
//! Python class (getters, conversions, `to_dict`, `repr`, pickling) in the binding are built
//! from that list.

/// Hands the field list of [`SchedulerMetrics`] to another macro:
/// `scheduler_metrics_fields!(callback! { args })` expands to
/// `callback! { { args } fields... }`, each field its doc comment, name and type.
#[macro_export]
macro_rules! scheduler_metrics_fields {
    ($callback:ident ! { $($args:tt)* }) => {
        $callback! {
            { $($args)* }
            /// Steps run (updated; reverted steps are not counted).
            steps: u64,
            /// Recompute-pauses.
            preemptions: u64,
            /// Suspends to the host tier.
            suspensions: u64,
            /// Resumes from the host tier (in steps that ran; a reverted step's resumes are
            /// undone and not counted).
            resumes: u64,
            /// Superblocks copied out to the host tier by suspends (one page per rank each).
            suspended_superblocks: u64,
            /// Superblocks copied back in by resumes (in steps that ran).
            resumed_superblocks: u64,
            /// Computed KV tokens that suspends kept (a recompute-pause would have thrown
            /// them away and computed them again).
            suspended_tokens: u64,
            /// KV tokens thrown away by recompute-pauses (they are computed again).
            recomputed_tokens: u64,
            /// Context and decode tokens run, recomputation included.
            computed_tokens: u64,
            /// Times a generation request sat out a step (in steps that ran).
            sat_out: u64,
            /// Requests that finished by length or end-of-sequence (aborted ones are not
            /// counted here but in `aborts`).
            finished: u64,
            /// Requests aborted (counted when the abort takes effect; an abort of a request
            /// that had already finished changes nothing and is not counted).
            aborts: u64,
            /// Superblocks held now.
            kv_used_superblocks: u32,
            /// Superblocks in the pool.
            kv_capacity_superblocks: u32,
            /// `kv_used_superblocks / kv_capacity_superblocks`, now.
            kv_utilization: f64,
            /// Highest utilisation seen right after a `schedule()`.
            kv_utilization_peak: f64,
            /// Prefix caching: prompt tokens admissions looked up (in steps that ran;
            /// re-prefills after a recompute-pause are counted apart).
            prefix_cache_queries: u64,
            /// Prefix caching: of those, tokens found cached (not computed).
            prefix_cache_hits: u64,
            /// Prefix caching: tokens re-prefills after a recompute-pause looked up.
            prefix_cache_recompute_queries: u64,
            /// Prefix caching: of those, tokens found cached (the victim's own KV, or a
            /// sharer's, kept while it waited).
            prefix_cache_recompute_hits: u64,
            /// Prefix caching: of the hits (both kinds above), tokens in superblocks an
            /// earlier admission or chunk of the same step computes (same-step sharing:
            /// a burst of requests behind one system prompt computes it once).
            prefix_cache_same_step_hits: u64,
            /// Prefix caching: cached superblocks evicted for allocations (in steps that ran).
            prefix_cache_evictions: u64,
            /// Speculative decoding: decodes that verified at least one draft token (in steps
            /// that ran; vLLM's `spec_decode_num_drafts`).
            spec_decode_num_drafts: u64,
            /// Speculative decoding: draft tokens verified.
            spec_decode_num_draft_tokens: u64,
            /// Speculative decoding: of those, draft tokens accepted.
            spec_decode_num_accepted_tokens: u64,
            /// Speculative decoding: proposed draft tokens a step did not schedule (no free
            /// pages, no token budget left, or past `max_new_tokens`): drafts give way first.
            spec_decode_num_trimmed_tokens: u64,
            /// Speculative decoding: superblocks draft positions took from the free list.
            spec_decode_draft_superblocks: u64,
            /// Speculative decoding: superblocks that only rejected drafts reached, given back
            /// to the pool at the update.
            spec_decode_returned_superblocks: u64,
        }
    };
}

/// Hands the field list of [`RequestMetrics`] to another macro (see
/// [`scheduler_metrics_fields!`](crate::scheduler_metrics_fields)).
#[macro_export]
macro_rules! request_metrics_fields {
    ($callback:ident ! { $($args:tt)* }) => {
        $callback! {
            { $($args)* }
            /// Times chosen as a victim, recompute-pause or suspend (the scheduler's
            /// `preemptions` counts recompute-pauses alone); bounded by
            /// `max_preemptions_per_request`. Named `preemptions` in 0.1.0 (Python keeps
            /// that name as a deprecated alias for one release).
            victim_choices: u32,
            /// KV tokens it lost to recompute-pauses.
            recomputed_tokens: u64,
            /// Steps run while it was live and got no context or generation entry.
            steps_waited: u64,
            /// Tokens sampled for it so far.
            generated_tokens: u64,
        }
    };
}

scheduler_metrics_fields!(define_record! {
    /// Totals over the scheduler's life.
    #[derive(Debug, Clone, Copy, PartialEq, Default)]
    struct SchedulerMetrics
});

request_metrics_fields!(define_record! {
    /// Counters of one request (live, or finished and not yet taken).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    struct RequestMetrics
});
