//! The preemption ladder's two promises, over random aggregated-Helix workloads run by a
//! simulated CP group (one real scheduler per rank, compared every step):
//!
//! - no futile preemption: every request preempted in a step was preempted for a
//!   requester that is then served in that same step (the harness checks this every
//!   step, see `common::Group::check_structure`);
//! - liveness does not depend on `max_preemptions_per_request`: when every request fits
//!   the pool alone, no bound >= 1 ever ends a run with `DeadlockError`.

mod common;

use common::{assert_matches_reference, Group, Model, RunOptions, Spec};
use helix_kv_core::{CoreError, SchedulerConfig, ServingMode, VictimPolicy};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    config: SchedulerConfig,
    specs: Vec<Spec>,
    revert_per_mille: u64,
}

/// Aggregated Helix under pressure: a pool that holds the largest request (so every
/// request fits alone) plus a small share of the rest, a small preemption bound, any
/// victim policy, chunked prefill on or off.
fn case() -> impl Strategy<Value = Case> {
    (
        (1u32..5, 1u32..9, 0u64..40, 1u32..4, 0usize..3),
        (1u32..12, 8u32..96, any::<bool>(), 1u32..9, any::<bool>()),
        (
            0u64..3,
            prop::collection::vec((1usize..48, 1u32..32, -2i32..3, 0u64..6), 2..12),
        ),
    )
        .prop_map(|(shape, budget, rest)| {
            let (cp, tpb, spare_percent, bound, policy) = shape;
            let (max_batch_size, max_num_tokens, chunked, chunk_unit, admit) = budget;
            let (revert, requests) = rest;
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
            let mut config = SchedulerConfig::new(superblocks as u32);
            config.cp_size = cp;
            config.tokens_per_block = tpb;
            config.serving_mode = ServingMode::AggregatedHelix;
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
            config.deadlock_steps = 8;
            Case {
                config,
                specs,
                revert_per_mille: revert * 100,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every request fits alone, so with any bound >= 1 the group runs to the end: no
    /// `DeadlockError`, every rank identical every step, outputs exact, and every
    /// preemption served its requester in the same step.
    #[test]
    fn no_bound_ever_deadlocks_a_workload_whose_requests_fit_alone(case in case()) {
        let config = &case.config;
        let mut group = Group::new(config, Model::default());
        let options = RunOptions {
            revert_per_mille: case.revert_per_mille,
            seed: case.specs.len() as u64,
            max_steps: 20_000,
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
    }
}
