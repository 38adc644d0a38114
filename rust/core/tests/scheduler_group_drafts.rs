//! Whole-group runs with random drafts (speculative decoding) at cp = 1, 2, 4: the
//! harness proposes drafts (some the model's continuation, some wrong), verifies them from
//! the KV it reads back and accepts the confirmed prefix; outputs equal the reference (one
//! token at a time, no pressure) in plain and one-step-ahead mode, under pressure, with
//! reverts, aborts, a host tier, prefix caching and EOS.

mod common;

use common::{
    assert_matches_reference, assert_matches_reference_with_aborts, Group, Model, RunMode,
    RunOptions, RunResult, Spec,
};
use helix_kv_core::{CapacityPolicy, SchedulerConfig, SuspendPolicy};

const CPS: [u32; 3] = [1, 2, 4];

/// A config with `kv_tokens` global tokens of KV and `k` speculative tokens.
fn config(cp: u32, tpb: u32, kv_tokens: u64, k: u32) -> SchedulerConfig {
    let mut config = SchedulerConfig::new(
        SchedulerConfig::superblocks_for_kv_tokens(cp, tpb, kv_tokens).unwrap(),
    );
    config.cp_size = cp;
    config.tokens_per_block = tpb;
    config.num_speculative_tokens = k;
    config
}

fn drafts(seed: u64) -> RunOptions {
    RunOptions {
        seed,
        draft_per_mille: 600,
        draft_true_per_mille: 700,
        ..RunOptions::default()
    }
}

/// Runs plain and one step ahead (each checked against the reference, and against each
/// other); returns both results.
fn run_both(
    config: &SchedulerConfig,
    specs: &[Spec],
    model: Model,
    options: RunOptions,
) -> (RunResult, RunResult) {
    let mut results = Vec::new();
    for mode in [RunMode::Plain, RunMode::Overlap] {
        let mut group = Group::new(config, model);
        let result = group
            .run(specs, RunOptions { mode, ..options })
            .unwrap_or_else(|err| panic!("{mode:?}: {err}"));
        if specs.iter().any(|s| s.abort.is_some()) {
            assert_matches_reference_with_aborts(specs, model, &result);
        } else {
            assert_matches_reference(specs, model, &result);
        }
        // Drafts were verified, some accepted and some rejected.
        assert!(result.drafts_verified > 0, "{mode:?}: no drafts verified");
        assert!(result.spec_accepted > 0, "{mode:?}: no draft accepted");
        assert!(
            result.drafts_accepted < result.drafts_verified,
            "{mode:?}: no draft rejected"
        );
        results.push(result);
    }
    let overlap = results.pop().unwrap();
    let plain = results.pop().unwrap();
    common::assert_same_outputs(&plain, &overlap);
    (plain, overlap)
}

#[test]
fn drafts_under_decode_pressure_replay_exactly() {
    let specs: Vec<Spec> = (0..8).map(|i| Spec::new(i, 10, 30)).collect();
    for cp in CPS {
        let config = config(cp, 4, 160, 4);
        let (plain, overlap) = run_both(&config, &specs, Model::default(), drafts(cp.into()));
        assert!(plain.preemptions > 0, "cp={cp}: the workload must preempt");
        assert!(plain.spec_trimmed > 0, "cp={cp}: drafts must be trimmed");
        assert!(overlap.inputs_in_flight > 0);
        assert!(
            overlap.ahead_drafted_decodes > 0,
            "cp={cp}: a step ahead decodes with drafts"
        );
        // Drafts make decoding take fewer steps.
        assert!(plain.steps < 8 * 30, "cp={cp}");
    }
}

#[test]
fn drafts_with_chunked_prefill_and_small_blocks() {
    let specs: Vec<Spec> = (0..10)
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
        let mut config = config(cp, 2, 128, 6);
        config.max_num_tokens = 40;
        config.chunk_unit = Some(4);
        run_both(&config, &specs, Model::default(), drafts(7 + u64::from(cp)));
    }
}

#[test]
fn drafts_with_reverts() {
    let specs: Vec<Spec> = (0..8)
        .map(|i| Spec::new(i, 6 + usize::try_from(i).unwrap(), 20))
        .collect();
    for cp in CPS {
        let config = config(cp, 2, 120, 5);
        let options = RunOptions {
            revert_per_mille: 250,
            ..drafts(11 * u64::from(cp))
        };
        let (plain, overlap) = run_both(&config, &specs, Model::default(), options);
        assert!(plain.reverted_steps > 0 && overlap.reverted_steps > 0);
    }
}

#[test]
fn drafts_with_eos_inside_accepted_rows() {
    let model = Model {
        vocab: 16,
        eos: Some(3),
    };
    let specs: Vec<Spec> = (0..10).map(|i| Spec::new(i, 8, 40)).collect();
    for cp in CPS {
        let (plain, _) = run_both(
            &config(cp, 4, 160, 6),
            &specs,
            model,
            drafts(3 + u64::from(cp)),
        );
        let early = plain.outputs.values().filter(|o| o.len() < 40).count();
        assert!(early > 0, "some request must hit eos");
    }
}

#[test]
fn drafts_with_aborts() {
    let specs: Vec<Spec> = (0..8)
        .map(|i| {
            let spec = Spec::new(i, 6 + usize::try_from(i).unwrap(), 24);
            match i % 4 {
                0 => spec.abort_while_pending(3 + i),
                1 => spec.abort_at(5 + i),
                2 => spec.abort_in_state("decoding", true),
                _ => spec,
            }
        })
        .collect();
    for cp in CPS {
        let config = config(cp, 2, 120, 4);
        let (plain, _) = run_both(&config, &specs, Model::default(), drafts(5 * u64::from(cp)));
        assert!(!plain.aborted.is_empty());
    }
}

#[test]
fn drafts_with_a_host_tier() {
    let specs: Vec<Spec> = (0..8).map(|i| Spec::new(i, 10, 30)).collect();
    for cp in CPS {
        for policy in [SuspendPolicy::SuspendFirst, SuspendPolicy::Cost] {
            let mut config = config(cp, 4, 160, 4);
            config.host_tier_superblocks = 12;
            config.suspend_policy = policy;
            let options = RunOptions {
                revert_per_mille: 100,
                ..drafts(13 + u64::from(cp))
            };
            let (plain, overlap) = run_both(&config, &specs, Model::default(), options);
            assert!(
                plain.suspensions > 0 && overlap.suspensions > 0,
                "cp={cp} {policy:?}: the workload must suspend"
            );
        }
    }
}

#[test]
fn drafts_with_prefix_caching_and_shared_prompts() {
    // Every prompt starts with the same system prompt; later requests repeat earlier
    // ones (a prompt and its first generated tokens would be a second turn).
    let system: Vec<i32> = (500..524).collect();
    let specs: Vec<Spec> = (0..10u64)
        .map(|i| {
            let mut spec = Spec::new(i % 4, 3 + (i % 4) as usize * 5, 12).at(i * 4);
            spec.id = i;
            spec.prompt = system.iter().copied().chain(spec.prompt).collect();
            spec
        })
        .collect();
    for cp in CPS {
        let mut config = config(cp, 2, 200, 5);
        config.enable_prefix_caching = true;
        let options = RunOptions {
            revert_per_mille: 100,
            reset_cache_per_mille: 20,
            ..drafts(17 + u64::from(cp))
        };
        let (plain, overlap) = run_both(&config, &specs, Model::default(), options);
        assert!(
            plain.cached_tokens > 0 && overlap.cached_tokens > 0,
            "cp={cp}"
        );
    }
}

#[test]
fn drafts_with_one_token_blocks_change_owner_every_position() {
    let specs: Vec<Spec> = (0..6)
        .map(|i| Spec::new(i, 3 + 2 * usize::try_from(i).unwrap(), 18))
        .collect();
    for cp in CPS {
        let config = config(cp, 1, 90, 7);
        let (plain, _) = run_both(
            &config,
            &specs,
            Model::default(),
            drafts(19 + u64::from(cp)),
        );
        // Drafts reached new superblocks, and rejected ones gave some back.
        assert!(plain.spec_draft_superblocks > 0, "cp={cp}");
        assert!(plain.spec_returned_superblocks > 0, "cp={cp}");
    }
}

#[test]
fn drafts_within_a_guaranteed_reservation_take_no_superblocks() {
    let specs: Vec<Spec> = (0..8).map(|i| Spec::new(i, 10, 30).at(i)).collect();
    for cp in CPS {
        let mut config = config(cp, 4, 160, 4);
        config.capacity_policy = CapacityPolicy::GuaranteedNoEvict;
        let (plain, overlap) = run_both(
            &config,
            &specs,
            Model::default(),
            drafts(23 + u64::from(cp)),
        );
        for result in [&plain, &overlap] {
            assert_eq!(result.preemptions + result.suspensions, 0);
            // Every draft lies inside the request's reservation.
            assert_eq!(
                (
                    result.spec_draft_superblocks,
                    result.spec_returned_superblocks
                ),
                (0, 0),
                "cp={cp}"
            );
        }
    }
}
