//! Whole-group runs under KV pressure at cp = 1, 2, 4: every rank decides identically,
//! replay is exact, and outputs equal a run without pressure.

mod common;

use common::{
    assert_matches_reference, assert_matches_reference_with_aborts, Group, Model, RunOptions, Spec,
};
use helix_kv_core::{SchedulerConfig, ServingMode, SuspendPolicy, VictimPolicy};

const CPS: [u32; 3] = [1, 2, 4];

/// A config with `kv_tokens` global tokens of KV (rounded down to superblocks).
fn config(cp: u32, tpb: u32, kv_tokens: u64) -> SchedulerConfig {
    let mut config = SchedulerConfig::new(
        SchedulerConfig::superblocks_for_kv_tokens(cp, tpb, kv_tokens).unwrap(),
    );
    config.cp_size = cp;
    config.tokens_per_block = tpb;
    config
}

fn run(
    config: &SchedulerConfig,
    specs: &[Spec],
    model: Model,
    options: RunOptions,
) -> common::RunResult {
    let mut group = Group::new(config, model);
    let result = group.run(specs, options).expect("run");
    assert_matches_reference(specs, model, &result);
    assert!(
        result.max_request_victim_choices <= config.max_preemptions_per_request
            || result.preemptions_past_bound > 0
    );
    result
}

#[test]
fn decode_pressure_preempts_identically_and_replays_exactly() {
    let specs: Vec<Spec> = (0..8).map(|i| Spec::new(i, 10, 30)).collect();
    for cp in CPS {
        let config = config(cp, 4, 160);
        let result = run(&config, &specs, Model::default(), RunOptions::default());
        assert!(result.preemptions > 0, "cp={cp}: the workload must preempt");
    }
}

#[test]
fn chunked_prefill_pressure() {
    let specs: Vec<Spec> = (0..6usize)
        .map(|i| Spec::new(i as u64, 40 + 9 * i, 12))
        .collect();
    for cp in CPS {
        let mut config = config(cp, 4, 192);
        config.max_num_tokens = 32;
        config.chunk_unit = Some(8);
        let result = run(&config, &specs, Model::default(), RunOptions::default());
        assert!(result.preemptions > 0, "cp={cp}: the workload must preempt");
    }
}

#[test]
fn staggered_arrivals_with_mixed_sizes() {
    let specs: Vec<Spec> = (0..12)
        .map(|i: u8| {
            Spec::new(
                u64::from(i),
                5 + usize::from(i * 13 % 40),
                8 + u32::from(i * 7 % 25),
            )
            .at(u64::from(i * 3 % 17))
        })
        .collect();
    for cp in CPS {
        let mut config = config(cp, 2, 128);
        config.max_num_tokens = 48;
        config.chunk_unit = Some(4);
        let result = run(&config, &specs, Model::default(), RunOptions::default());
        assert!(result.preemptions > 0, "cp={cp}: the workload must preempt");
    }
}

#[test]
fn without_chunked_prefill_prompts_are_scheduled_whole() {
    let specs: Vec<Spec> = (0..6)
        .map(|i| Spec::new(i as u64, 12 + i, 16).at(i as u64))
        .collect();
    for cp in CPS {
        let mut config = config(cp, 4, 128);
        config.enable_chunked_prefill = false;
        config.max_num_tokens = 40;
        let result = run(&config, &specs, Model::default(), RunOptions::default());
        assert!(result.preemptions > 0, "cp={cp}: the workload must preempt");
    }
}

#[test]
fn every_victim_policy_stays_consistent_under_pressure() {
    let specs: Vec<Spec> = (0..10u8)
        .map(|i| {
            Spec::new(u64::from(i), 6 + usize::from(i * 5 % 17), 20)
                .priority(i32::from(i * 7 % 5) - 2)
                .at(u64::from(i / 3))
        })
        .collect();
    for policy in [
        VictimPolicy::NewestFirst,
        VictimPolicy::LeastComputedFirst,
        VictimPolicy::Priority,
    ] {
        for cp in CPS {
            let mut config = config(cp, 4, 160);
            config.victim_policy = policy;
            let result = run(&config, &specs, Model::default(), RunOptions::default());
            assert!(
                result.preemptions > 0,
                "{policy:?} cp={cp}: the workload must preempt"
            );
        }
    }
}

#[test]
fn reverted_steps_restore_state_and_change_no_output() {
    let specs: Vec<Spec> = (0..8)
        .map(|i| Spec::new(i as u64, 9 + i, 24).at(i as u64 / 2))
        .collect();
    for cp in CPS {
        let mut config = config(cp, 4, 160);
        config.max_num_tokens = 40;
        config.chunk_unit = Some(8);
        let options = RunOptions {
            revert_per_mille: 250,
            seed: u64::from(cp),
            max_steps: 0,
            ..RunOptions::default()
        };
        let result = run(&config, &specs, Model::default(), options);
        assert!(
            result.reverted_steps > 0 && result.preemptions > 0,
            "cp={cp}"
        );
    }
}

#[test]
fn eos_ends_requests_early_and_frees_their_pages() {
    let model = Model {
        vocab: 16,
        eos: Some(3),
    };
    let specs: Vec<Spec> = (0..10).map(|i| Spec::new(i, 8, 40)).collect();
    for cp in CPS {
        let result = run(&config(cp, 4, 160), &specs, model, RunOptions::default());
        let early = result.outputs.values().filter(|o| o.len() < 40).count();
        assert!(early > 0, "some request must hit eos");
    }
}

#[test]
fn bound_on_preemptions_gives_way_only_to_the_queue_head() {
    let specs: Vec<Spec> = (0..12).map(|i| Spec::new(i, 6, 40)).collect();
    let mut past_bound = 0;
    for cp in CPS {
        let mut config = config(cp, 2, 96);
        config.max_preemptions_per_request = 2;
        config.deadlock_steps = 16;
        let mut group = Group::new(&config, Model::default());
        // Every request fits alone, so a tight bound never wedges the group: the oldest
        // live request may take requests at their bound (the harness checks that each
        // preemption past the bound is for the queue head).
        let result = group.run(&specs, RunOptions::default()).expect("run");
        assert_matches_reference(&specs, Model::default(), &result);
        assert!(result.max_request_victim_choices <= 2 || result.preemptions_past_bound > 0);
        past_bound += result.preemptions_past_bound;
    }
    assert!(
        past_bound > 0,
        "the workload must push a request past its bound"
    );
}

/// Runs `specs` with their aborts, then the survivors alone (no aborts) under the same
/// configuration: the survivors' outputs must be the same tokens.
fn run_with_aborts(
    config: &SchedulerConfig,
    specs: &[Spec],
    options: RunOptions,
) -> common::RunResult {
    let mut group = Group::new(config, Model::default());
    let result = group.run(specs, options).expect("run with aborts");
    assert_matches_reference_with_aborts(specs, Model::default(), &result);
    let survivors: Vec<Spec> = specs
        .iter()
        .filter(|s| !result.aborted.contains_key(&s.id))
        .cloned()
        .map(|mut s| {
            s.abort = None;
            s
        })
        .collect();
    let mut alone = Group::new(config, Model::default());
    let without = alone
        .run(&survivors, options)
        .expect("run without the aborted");
    assert_eq!(
        result.outputs, without.outputs,
        "aborts changed the output of a surviving request"
    );
    result
}

#[test]
fn aborts_in_every_state_leave_the_survivors_unchanged() {
    // Under pressure with chunked prefill: aborts land on waiting, part-prefilled,
    // decoding and recompute-paused requests, between steps and while a step is
    // pending, with reverted steps mixed in.
    let specs: Vec<Spec> = (0..16)
        .map(|i| {
            let spec = Spec::new(i, 10 + usize::try_from(i * 7 % 30).unwrap(), 24).at(i / 3);
            match i {
                1 => spec.abort_in_state("prefilling", false),
                2 => spec.abort_in_state("decoding", true),
                3 => spec.abort_in_state("waiting", false),
                5 | 8 | 12 => spec.abort_in_state("recompute-paused", false),
                6 | 9 | 10 | 15 => spec.abort_in_state("recompute-paused", true),
                7 => spec.abort_in_state("prefilling", true),
                11 => spec.abort_in_state("decoding", false),
                13 => spec.abort_in_state("waiting", true),
                14 => spec.abort_at(40), // a fixed step, whatever its state then
                _ => spec,
            }
        })
        .collect();
    for cp in CPS {
        let mut config = config(cp, 4, 192);
        config.max_num_tokens = 24;
        config.chunk_unit = Some(8);
        for revert_per_mille in [0, 200] {
            let options = RunOptions {
                revert_per_mille,
                seed: u64::from(cp),
                max_steps: 0,
                ..RunOptions::default()
            };
            let result = run_with_aborts(&config, &specs, options);
            assert!(result.preemptions > 0, "cp={cp}: the workload must preempt");
            assert!(result.aborted.len() >= 8, "cp={cp}: {:?}", result.aborted);
            for state in [
                "waiting",
                "prefilling",
                "decoding",
                "recompute-paused",
                "waiting while pending",
                "prefilling while pending",
                "decoding while pending",
                "recompute-paused while pending",
            ] {
                assert!(
                    result.abort_states.contains(state),
                    "cp={cp}: no abort of a {state} request: {:?}",
                    result.abort_states
                );
            }
        }
    }
}

#[test]
fn aborts_of_suspended_requests_release_the_host_tier() {
    let specs: Vec<Spec> = (0..8)
        .map(|i| match i {
            2 => Spec::new(i, 10, 30).abort_at(18),
            6 | 7 => Spec::new(i, 10, 30).abort_in_state("suspended", false),
            4 | 5 => Spec::new(i, 10, 30).abort_in_state("suspended", true),
            _ => Spec::new(i, 10, 30),
        })
        .collect();
    let mut config = config(1, 4, 160);
    config.serving_mode = ServingMode::NonHelix;
    config.host_tier_superblocks = 6;
    for revert_per_mille in [0, 200] {
        let options = RunOptions {
            revert_per_mille,
            seed: 5,
            max_steps: 0,
            ..RunOptions::default()
        };
        let result = run_with_aborts(&config, &specs, options);
        assert!(result.suspensions > 0);
        for state in ["suspended", "suspended while pending"] {
            assert!(
                result.abort_states.contains(state),
                "no abort of a {state} request: {:?}",
                result.abort_states
            );
        }
    }
}

/// Aggregated Helix with a host tier of `host` superblocks and `policy`.
fn with_host_tier(
    mut config: SchedulerConfig,
    host: u32,
    policy: SuspendPolicy,
) -> SchedulerConfig {
    config.host_tier_superblocks = host;
    config.suspend_policy = policy;
    config
}

const SUSPEND_POLICIES: [SuspendPolicy; 3] = [
    SuspendPolicy::SuspendFirst,
    SuspendPolicy::RecomputeFirst,
    SuspendPolicy::Cost,
];

#[test]
fn aggregated_helix_suspends_to_the_host_tier_under_decode_pressure() {
    let specs: Vec<Spec> = (0..8).map(|i| Spec::new(i, 10, 30)).collect();
    for cp in CPS {
        let recompute_only = run(
            &config(cp, 4, 160),
            &specs,
            Model::default(),
            RunOptions::default(),
        );
        for policy in SUSPEND_POLICIES {
            let config = with_host_tier(config(cp, 4, 160), 64, policy);
            let result = run(&config, &specs, Model::default(), RunOptions::default());
            // Every victim decodes here, so each policy suspends (cost: a decoding victim
            // of 10+ computed tokens costs more to recompute than its pages to copy).
            assert!(
                result.suspensions > 0 && result.resumes > 0,
                "{policy:?} cp={cp}: the workload must suspend and resume"
            );
            assert!(
                result.recomputed_tokens < recompute_only.recomputed_tokens,
                "{policy:?} cp={cp}: suspends must save recomputation ({} vs {})",
                result.recomputed_tokens,
                recompute_only.recomputed_tokens
            );
        }
    }
}

#[test]
fn aggregated_helix_suspends_under_chunked_prefill_pressure() {
    let specs: Vec<Spec> = (0..6usize)
        .map(|i| Spec::new(i as u64, 40 + 9 * i, 12))
        .collect();
    for cp in CPS {
        for policy in SUSPEND_POLICIES {
            let mut config = with_host_tier(config(cp, 4, 192), 48, policy);
            config.max_num_tokens = 32;
            config.chunk_unit = Some(8);
            let result = run(&config, &specs, Model::default(), RunOptions::default());
            assert!(
                result.preemptions + result.suspensions > 0,
                "{policy:?} cp={cp}: the workload must preempt"
            );
            if policy != SuspendPolicy::RecomputeFirst {
                assert!(result.suspensions > 0, "{policy:?} cp={cp}: must suspend");
            }
        }
    }
}

#[test]
fn a_full_host_tier_falls_back_to_recompute() {
    let specs: Vec<Spec> = (0..10).map(|i| Spec::new(i, 10, 30)).collect();
    for cp in CPS {
        // Room for a victim or two: the others are recompute-paused.
        let config = with_host_tier(config(cp, 4, 160), 12 / cp, SuspendPolicy::SuspendFirst);
        let result = run(&config, &specs, Model::default(), RunOptions::default());
        assert!(
            result.suspensions > 0 && result.preemptions > 0,
            "cp={cp}: both suspends and recompute-pauses ({} / {})",
            result.suspensions,
            result.preemptions
        );
    }
}

#[test]
fn aggregated_host_tier_with_reverts_staggered_arrivals_and_aborts() {
    let specs: Vec<Spec> = (0..14)
        .map(|i| {
            let spec = Spec::new(i, 6 + usize::try_from(i * 11 % 30).unwrap(), 24).at(i / 2);
            match i {
                4 | 9 => spec.abort_in_state("suspended", false),
                6 | 11 => spec.abort_in_state("suspended", true),
                13 => spec.abort_at(30),
                _ => spec,
            }
        })
        .collect();
    for cp in CPS {
        for policy in SUSPEND_POLICIES {
            let mut config = with_host_tier(config(cp, 4, 160), 24, policy);
            config.max_num_tokens = 40;
            config.chunk_unit = Some(8);
            for revert_per_mille in [0, 250] {
                let options = RunOptions {
                    revert_per_mille,
                    seed: u64::from(cp) + 7,
                    max_steps: 0,
                    ..RunOptions::default()
                };
                let result = run_with_aborts(&config, &specs, options);
                assert!(result.suspensions > 0, "{policy:?} cp={cp}: must suspend");
                if policy == SuspendPolicy::SuspendFirst {
                    assert!(
                        result.abort_states.contains("suspended"),
                        "cp={cp}: {:?}",
                        result.abort_states
                    );
                }
            }
        }
    }
}
