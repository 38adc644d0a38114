//! Random configurations and workloads through the simulated CP group: whatever the
//! configuration, ranks agree every step, replay is exact, outputs equal a run without
//! pressure, nothing leaks, and the only ways a run may stop early are the documented
//! ones (a preemption bound that ran out, or a disaggregated server out of pages).

mod common;

use common::{
    assert_matches_reference, assert_matches_reference_with_aborts, gate_config, Group, Model,
    RunOptions, Spec,
};
use helix_kv_core::{
    CapacityPolicy, CoreError, Scheduler, SchedulerConfig, ServingMode, SuspendPolicy, VictimPolicy,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    config: SchedulerConfig,
    specs: Vec<Spec>,
    model: Model,
    revert_per_mille: u64,
}

fn mode() -> impl Strategy<Value = (ServingMode, u32)> {
    prop_oneof![
        3 => Just((ServingMode::AggregatedHelix, 0)),
        2 => (1u32..10).prop_map(|host| (ServingMode::AggregatedHelix, host)),
        2 => (0u32..8).prop_map(|host| (ServingMode::NonHelix, host)),
        1 => Just((ServingMode::DisaggregatedGeneration, 0)),
    ]
}

fn spec() -> impl Strategy<Value = (usize, u32, i32, u64)> {
    (1usize..40, 1u32..24, -3i32..4, 0u64..4)
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            prop::sample::select(vec![1u32, 2, 4]),
            1u32..5,
            mode(),
            prop::bool::weighted(0.2),
            0u32..4,
        ),
        (0u64..60, 1u32..16, 8u32..64, any::<bool>(), 1u32..9),
        (0u32..12, any::<bool>(), any::<bool>(), 0u64..3, 0usize..3),
        prop::collection::vec(spec(), 1..10),
    )
        .prop_map(|(shape, budget, rules, requests)| {
            let (cp, tpb, (serving_mode, host_tier), no_evict, policy) = shape;
            let (spare_percent, max_batch_size, max_num_tokens, chunked, chunk_unit) = budget;
            let (bound, admit_after_preemption, eos, revert, suspend_policy) = rules;
            let cp = if serving_mode == ServingMode::NonHelix {
                1
            } else {
                cp
            };
            let specs: Vec<Spec> = requests
                .iter()
                .enumerate()
                .map(|(i, &(prompt, max_new, priority, at))| {
                    Spec::new(i as u64 + 1, prompt, max_new)
                        .priority(priority)
                        .at(at)
                })
                .collect();
            // A pool that holds the largest request (so every request can run) plus a
            // share of the rest: mostly under pressure.
            let per_superblock = u64::from(cp * tpb);
            let sizes = specs
                .iter()
                .map(|s| s.prompt.len() as u64 + u64::from(s.max_new_tokens));
            let largest = sizes.clone().max().unwrap();
            let rest = sizes.sum::<u64>() - largest;
            let superblocks = (largest + rest * spare_percent / 100).div_ceil(per_superblock);
            let mut config = SchedulerConfig::new(u32::try_from(superblocks).unwrap());
            config.cp_size = cp;
            config.tokens_per_block = tpb;
            config.serving_mode = serving_mode;
            config.host_tier_superblocks = host_tier;
            config.suspend_policy = [
                SuspendPolicy::SuspendFirst,
                SuspendPolicy::RecomputeFirst,
                SuspendPolicy::Cost,
            ][suspend_policy];
            config.capacity_policy = if no_evict {
                CapacityPolicy::GuaranteedNoEvict
            } else {
                CapacityPolicy::MaxUtilization
            };
            config.victim_policy = [
                VictimPolicy::NewestFirst,
                VictimPolicy::LeastComputedFirst,
                VictimPolicy::Priority,
                VictimPolicy::NewestFirst,
            ][policy as usize];
            config.max_batch_size = max_batch_size;
            config.enable_chunked_prefill = chunked;
            config.chunk_unit = Some(chunk_unit);
            config.max_num_tokens = max_num_tokens.max(chunk_unit);
            config.max_preemptions_per_request = if bound >= 6 { 1000 } else { bound };
            config.admit_after_preemption = admit_after_preemption;
            config.deadlock_steps = 12;
            let model = if eos {
                Model {
                    vocab: 24,
                    eos: Some(5),
                }
            } else {
                Model::default()
            };
            Case {
                config,
                specs,
                model,
                revert_per_mille: revert * 120,
            }
        })
}

/// Keeps the requests the configuration accepts (the others are refused at add, which
/// the unit tests cover), checking that refusals change nothing.
fn accepted(config: &SchedulerConfig, specs: &[Spec]) -> Vec<Spec> {
    let mut probe = Scheduler::new(config.clone()).unwrap();
    specs
        .iter()
        .filter(|s| {
            let before = probe.state_digest();
            match probe.add_request(s.id, &s.prompt, s.max_new_tokens, s.priority) {
                Ok(()) => true,
                Err(CoreError::RequestTooLarge { .. }) => {
                    assert_eq!(probe.state_digest(), before);
                    false
                }
                Err(other) => panic!("unexpected refusal {other}"),
            }
        })
        .cloned()
        .collect()
}

proptest! {
    #![proptest_config(gate_config(200))]

    #[test]
    fn random_configs_and_workloads_keep_every_invariant(case in case()) {
        let config = &case.config;
        let specs = accepted(config, &case.specs);
        prop_assume!(!specs.is_empty());
        let mut group = Group::new(config, case.model);
        let options = RunOptions { revert_per_mille: case.revert_per_mille, seed: specs.len() as u64, max_steps: 5_000, ..RunOptions::default() };
        match group.run(&specs, options) {
            Ok(result) => {
                assert_matches_reference(&specs, case.model, &result);
                // Past the bound only for the queue head (the harness checks each one).
                prop_assert!(result.max_request_preemptions <= config.max_preemptions_per_request || result.preemptions_past_bound > 0);
                if !config.may_preempt() {
                    prop_assert_eq!(result.preemptions + result.suspensions, 0);
                }
                if config.host_tier_superblocks == 0 {
                    prop_assert_eq!(result.suspensions, 0);
                }
            }
            Err(CoreError::Deadlock(msg)) => {
                // Only a preemption bound that ran out, or a server that may not preempt,
                // can wedge a group whose every request fits the pool.
                let bound_hit = group.result.max_request_preemptions >= config.max_preemptions_per_request;
                let no_preemption = config.serving_mode == ServingMode::DisaggregatedGeneration;
                prop_assert!(bound_hit || no_preemption, "unexpected deadlock: {}", msg);
                if config.serving_mode == ServingMode::AggregatedHelix {
                    prop_assert!(!msg.contains("host"), "{}", msg);
                }
            }
            Err(CoreError::PreemptionDisabled(msg)) => {
                prop_assert_eq!(config.serving_mode, ServingMode::DisaggregatedGeneration, "{}", msg);
            }
            Err(other) => prop_assert!(false, "unexpected error {}", other),
        }
    }
}

/// A case whose requests are aborted at random: `None` or (steps after arrival, while a
/// step is pending).
fn case_with_aborts() -> impl Strategy<Value = Case> {
    (
        case(),
        prop::collection::vec(prop::option::weighted(0.4, (0u64..30, any::<bool>())), 10),
    )
        .prop_map(|(mut case, aborts)| {
            for (spec, abort) in case.specs.iter_mut().zip(aborts) {
                if let Some((after, while_pending)) = abort {
                    let step = spec.arrival_step + after;
                    *spec = if while_pending {
                        spec.clone().abort_while_pending(step)
                    } else {
                        spec.clone().abort_at(step)
                    };
                }
            }
            case
        })
}

/// The errors a run may end with (see the test above).
fn check_early_stop(
    config: &SchedulerConfig,
    group: &Group,
    err: &CoreError,
) -> Result<(), TestCaseError> {
    match err {
        CoreError::Deadlock(msg) => {
            let bound_hit =
                group.result.max_request_preemptions == config.max_preemptions_per_request;
            let no_preemption = config.serving_mode == ServingMode::DisaggregatedGeneration;
            prop_assert!(bound_hit || no_preemption, "unexpected deadlock: {}", msg);
        }
        CoreError::PreemptionDisabled(msg) => {
            prop_assert_eq!(
                config.serving_mode,
                ServingMode::DisaggregatedGeneration,
                "{}",
                msg
            );
        }
        other => prop_assert!(false, "unexpected error {}", other),
    }
    Ok(())
}

proptest! {
    #![proptest_config(gate_config(150))]

    /// Random aborts (between steps and while a step is pending, with reverts mixed in):
    /// ranks stay identical, nothing leaks (the harness checks pages, slots and the host
    /// tier every step), every aborted output is a prefix of its full output, and the
    /// survivors generate the same tokens as a run without the aborted requests.
    #[test]
    fn random_aborts_keep_every_invariant(case in case_with_aborts()) {
        let config = &case.config;
        let specs = accepted(config, &case.specs);
        prop_assume!(!specs.is_empty());
        let mut group = Group::new(config, case.model);
        let options = RunOptions { revert_per_mille: case.revert_per_mille, seed: specs.len() as u64, max_steps: 5_000, ..RunOptions::default() };
        let result = match group.run(&specs, options) {
            Ok(result) => result,
            Err(err) => return check_early_stop(config, &group, &err),
        };
        assert_matches_reference_with_aborts(&specs, case.model, &result);
        prop_assert_eq!(
            group.ranks[0].metrics().aborts,
            result.aborted.len() as u64
        );
        // The same configuration without the aborted requests: the survivors' tokens
        // are the same (only their timing may differ, as the pressure changed).
        let survivors: Vec<Spec> = specs
            .iter()
            .filter(|s| !result.aborted.contains_key(&s.id))
            .map(|s| Spec { abort: None, ..s.clone() })
            .collect();
        if survivors.is_empty() {
            return Ok(());
        }
        let mut alone = Group::new(config, case.model);
        match alone.run(&survivors, options) {
            Ok(without) => prop_assert_eq!(&result.outputs, &without.outputs),
            Err(err) => check_early_stop(config, &alone, &err)?,
        }
    }
}
