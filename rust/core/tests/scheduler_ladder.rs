//! The preemption ladder's two promises, over random aggregated-Helix workloads run by a
//! simulated CP group (one real scheduler per rank, compared every step):
//!
//! - no futile preemption: every request preempted in a step was preempted for a
//!   requester that is then served in that same step (the harness checks this every
//!   step, see `common::Group::check_ladder`);
//! - liveness does not depend on `max_preemptions_per_request`: when every request fits
//!   the pool alone, no bound >= 1 ever ends a run with `DeadlockError` (aggregated Helix,
//!   and `non_helix` with a host tier, where a suspended queue head may preempt to resume).

mod common;

use common::{assert_matches_reference, gate_config, Group, Model, RunOptions, Spec};
use helix_kv_core::{AdmissionPolicy, CoreError, SchedulerConfig, ServingMode, VictimPolicy};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    config: SchedulerConfig,
    specs: Vec<Spec>,
    revert_per_mille: u64,
}

/// Under pressure: a pool that holds the largest request (so every request fits alone)
/// plus a small share of the rest, a small preemption bound, any victim policy, chunked
/// prefill on or off, either admission policy, a prefill cap or none. `host_tiers` empty: aggregated Helix at cp 1..4; otherwise
/// `non_helix` (cp 1) with one of these host tiers.
fn case(host_tiers: &'static [u32]) -> impl Strategy<Value = Case> {
    let max_cp = if host_tiers.is_empty() { 5 } else { 2 };
    (
        (1u32..max_cp, 1u32..9, 0u64..40, 1u32..4, 0usize..3),
        (1u32..12, 8u32..96, any::<bool>(), 1u32..9, any::<bool>()),
        (
            0u64..3,
            prop::collection::vec((1usize..48, 1u32..32, -2i32..3, 0u64..6), 2..12),
            0usize..host_tiers.len().max(1),
        ),
        // Priority admission (a new head may arrive at any time) and the prefill cap, drawn
        // last so the draws above keep their values.
        (
            any::<bool>(),
            prop_oneof![2 => Just(0u32), 1 => 1u32..32],
            any::<bool>(),
        ),
    )
        .prop_map(move |(shape, budget, rest, admission)| {
            let (cp, tpb, spare_percent, bound, policy) = shape;
            let (max_batch_size, max_num_tokens, chunked, chunk_unit, admit) = budget;
            let (revert, requests, host_tier) = rest;
            let specs: Vec<Spec> = requests
                .iter()
                .enumerate()
                .map(|(i, &(prompt, max_new, priority, at))| {
                    Spec::new(i as u64 + 1, prompt, max_new)
                        .priority(priority)
                        .at(at)
                })
                .collect();
            let sizes = specs
                .iter()
                .map(|s| s.prompt.len() as u64 + u64::from(s.max_new_tokens));
            let largest = sizes.clone().max().unwrap();
            let rest = sizes.clone().sum::<u64>() - largest;
            let per_superblock = u64::from(cp * tpb);
            let superblocks = (largest + rest * spare_percent / 100).div_ceil(per_superblock);
            let mut config = SchedulerConfig::new(u32::try_from(superblocks).unwrap());
            config.cp_size = cp;
            config.tokens_per_block = tpb;
            if let Some(&superblocks) = host_tiers.get(host_tier) {
                config.serving_mode = ServingMode::NonHelix;
                config.host_tier_superblocks = superblocks;
            }
            config.victim_policy = [
                VictimPolicy::NewestFirst,
                VictimPolicy::LeastComputedFirst,
                VictimPolicy::Priority,
            ][policy];
            config.max_batch_size = max_batch_size;
            config.chunk_unit = Some(chunk_unit);
            config.max_num_tokens = max_num_tokens.max(chunk_unit);
            // Without chunked prefill a re-prefill (prompt + all but the last output
            // token) must fit one step; fall back to chunks where it would not.
            let longest_reprefill = sizes.max().unwrap() - 1;
            config.enable_chunked_prefill =
                chunked || longest_reprefill > u64::from(config.max_num_tokens);
            config.max_preemptions_per_request = bound;
            config.admit_after_preemption = admit;
            let (priority, threshold, adaptive) = admission;
            if priority {
                config.admission_policy = AdmissionPolicy::Priority;
            }
            if config.enable_chunked_prefill {
                config.long_prefill_token_threshold = threshold;
                config.long_prefill_token_threshold_adaptive = adaptive;
            }
            config.deadlock_steps = 8;
            Case {
                config,
                specs,
                revert_per_mille: revert * 100,
            }
        })
}

fn run_to_the_end(case: &Case) -> Result<(), TestCaseError> {
    let config = &case.config;
    let mut group = Group::new(config, Model::default());
    let options = RunOptions {
        revert_per_mille: case.revert_per_mille,
        // One step ahead, some steps also fail on the device (both pending steps are
        // reverted): no progress, and no deadlock either.
        fail_per_mille: case.revert_per_mille / 2,
        seed: case.specs.len() as u64,
        max_steps: 20_000,
        ..RunOptions::default()
    };
    match group.run(&case.specs, options) {
        Ok(result) => assert_matches_reference(&case.specs, Model::default(), &result),
        Err(CoreError::Deadlock(msg)) => prop_assert!(
            false,
            "bound {} deadlocked: {}",
            config.max_preemptions_per_request,
            msg
        ),
        Err(other) => prop_assert!(false, "unexpected error {}", other),
    }
    Ok(())
}

proptest! {
    #![proptest_config(gate_config(256))]

    /// Aggregated Helix, every request fits alone: with any bound >= 1 the group runs to
    /// the end: no `DeadlockError`, every rank identical every step, outputs exact, and
    /// every preemption served its requester in the same step.
    #[test]
    fn no_bound_ever_deadlocks_a_workload_whose_requests_fit_alone(case in case(&[])) {
        run_to_the_end(&case)?;
    }

    /// The same on one `non_helix` rank with a host tier, where victims are suspended
    /// while it has room and a suspended queue head may preempt to resume.
    #[test]
    fn no_bound_ever_deadlocks_a_non_helix_rank_with_a_host_tier(case in case(&[2, 8, 1000])) {
        run_to_the_end(&case)?;
    }
}
