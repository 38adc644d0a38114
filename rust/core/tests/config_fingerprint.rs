//! The configuration fingerprint: every decision field changes it, and with it the digest of
//! every step from the first and the scheduler's state digest; `cp_rank` does not.

use helix_kv_core::{
    AdmissionPolicy, CapacityPolicy, FieldValue, Scheduler, SchedulerConfig, ServingMode,
    SuspendPolicy, VictimPolicy,
};

/// A small CP-2 group configuration every single-field change below keeps valid.
fn base() -> SchedulerConfig {
    let mut config = SchedulerConfig::new(16);
    config.cp_size = 2;
    config.tokens_per_block = 4;
    config.max_batch_size = 8;
    config.max_num_tokens = 64;
    config.max_seq_len = 256;
    config
}

fn changed(from: &SchedulerConfig, edit: impl FnOnce(&mut SchedulerConfig)) -> SchedulerConfig {
    let mut config = from.clone();
    edit(&mut config);
    config.validate().unwrap();
    config
}

/// `(field, config, the same config with only that field changed)`, one per decision field.
#[expect(clippy::too_many_lines, reason = "one case per decision field")]
fn single_field_changes() -> Vec<(&'static str, SchedulerConfig, SchedulerConfig)> {
    let b = base();
    let non_helix = changed(&b, |c| {
        c.cp_size = 1;
        c.serving_mode = ServingMode::NonHelix;
    });
    let pinned = changed(&b, |c| c.chunk_unit = Some(4));
    let backoff = changed(&b, |c| c.draft_backoff_misses = 2);
    vec![
        ("cp_size", b.clone(), changed(&b, |c| c.cp_size = 4)),
        // With the chunk unit pinned: the unit in effect follows tokens_per_block otherwise.
        (
            "tokens_per_block",
            pinned.clone(),
            changed(&pinned, |c| c.tokens_per_block = 8),
        ),
        (
            "capacity_superblocks",
            b.clone(),
            changed(&b, |c| c.capacity_superblocks = 17),
        ),
        (
            "max_batch_size",
            b.clone(),
            changed(&b, |c| c.max_batch_size = 9),
        ),
        (
            "max_num_tokens",
            b.clone(),
            changed(&b, |c| c.max_num_tokens = 65),
        ),
        (
            "enable_chunked_prefill",
            b.clone(),
            changed(&b, |c| c.enable_chunked_prefill = false),
        ),
        (
            "chunk_unit",
            b.clone(),
            changed(&b, |c| c.chunk_unit = Some(8)),
        ),
        (
            "long_prefill_token_threshold",
            b.clone(),
            changed(&b, |c| c.long_prefill_token_threshold = 8),
        ),
        (
            "long_prefill_token_threshold_adaptive",
            b.clone(),
            changed(&b, |c| c.long_prefill_token_threshold_adaptive = true),
        ),
        (
            "max_seq_len",
            b.clone(),
            changed(&b, |c| c.max_seq_len = 257),
        ),
        (
            "capacity_policy",
            b.clone(),
            changed(&b, |c| {
                c.capacity_policy = CapacityPolicy::GuaranteedNoEvict;
            }),
        ),
        (
            "serving_mode",
            b.clone(),
            changed(&b, |c| {
                c.serving_mode = ServingMode::DisaggregatedGeneration;
            }),
        ),
        (
            "host_tier_superblocks",
            non_helix.clone(),
            changed(&non_helix, |c| c.host_tier_superblocks = 2),
        ),
        (
            "suspend_policy",
            b.clone(),
            changed(&b, |c| c.suspend_policy = SuspendPolicy::Cost),
        ),
        (
            "suspend_cost_per_token",
            b.clone(),
            changed(&b, |c| c.suspend_cost_per_token = 3),
        ),
        (
            "recompute_cost_per_token",
            b.clone(),
            changed(&b, |c| c.recompute_cost_per_token = 7),
        ),
        (
            "admission_policy",
            b.clone(),
            changed(&b, |c| c.admission_policy = AdmissionPolicy::Priority),
        ),
        (
            "victim_policy",
            b.clone(),
            changed(&b, |c| c.victim_policy = VictimPolicy::Priority),
        ),
        (
            "max_preemptions_per_request",
            b.clone(),
            changed(&b, |c| c.max_preemptions_per_request = 9),
        ),
        (
            "admit_after_preemption",
            b.clone(),
            changed(&b, |c| c.admit_after_preemption = true),
        ),
        (
            "deadlock_steps",
            b.clone(),
            changed(&b, |c| c.deadlock_steps = 65),
        ),
        (
            "enable_prefix_caching",
            b.clone(),
            changed(&b, |c| c.enable_prefix_caching = true),
        ),
        (
            "num_speculative_tokens",
            b.clone(),
            changed(&b, |c| c.num_speculative_tokens = 3),
        ),
        (
            "draft_backoff_misses",
            b.clone(),
            changed(&b, |c| c.draft_backoff_misses = 2),
        ),
        // With the backoff on: its pause length is not a decision field while it is off.
        (
            "draft_backoff_tokens",
            backoff.clone(),
            changed(&backoff, |c| c.draft_backoff_tokens = 8),
        ),
    ]
}

/// A scheduler of `config` with the same two requests queued.
fn loaded(config: SchedulerConfig) -> Scheduler {
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &[5; 10], 5, 0).unwrap();
    s.add_request(1, &[6; 7], 5, 0).unwrap();
    s
}

/// Digests of the first `steps` steps (every sample fed token 9).
fn digests(s: &mut Scheduler, steps: usize) -> Vec<u64> {
    (0..steps)
        .map(|_| {
            let out = s.schedule().unwrap();
            let (digest, samples) = (out.digest, out.num_samples());
            s.update(&vec![9; samples], None).unwrap();
            digest
        })
        .collect()
}

#[test]
fn every_decision_field_is_covered_once() {
    let names: Vec<&str> = base().decision_fields().iter().map(|(n, _)| *n).collect();
    let cases: Vec<&str> = single_field_changes().iter().map(|(n, _, _)| *n).collect();
    assert_eq!(
        cases, names,
        "one single-field case per decision field, in order"
    );
    assert!(!names.contains(&"cp_rank"));
}

#[test]
fn each_decision_field_changes_the_digest_from_the_first_step() {
    for (field, from, to) in single_field_changes() {
        let differing: Vec<&str> = from
            .decision_fields()
            .iter()
            .zip(to.decision_fields())
            .filter(|(a, b)| **a != *b)
            .map(|(a, _)| a.0)
            .collect();
        assert_eq!(differing, [field], "the case changes {field} only");
        assert_ne!(from.fingerprint(), to.fingerprint(), "{field}: fingerprint");
        let (mut a, mut b) = (loaded(from), loaded(to));
        assert_ne!(a.state_digest(), b.state_digest(), "{field}: state digest");
        let (da, db) = (digests(&mut a, 3), digests(&mut b, 3));
        for step in 0..3 {
            assert_ne!(da[step], db[step], "{field}: digest of step {step}");
        }
    }
}

#[test]
fn cp_rank_and_an_explicit_default_chunk_unit_leave_every_digest_alone() {
    let config = base();
    for same in [
        config.with_rank(1),
        changed(&config, |c| c.chunk_unit = Some(c.tokens_per_block)),
    ] {
        assert_eq!(same.fingerprint(), config.fingerprint());
        let (mut a, mut b) = (loaded(config.clone()), loaded(same));
        assert_eq!(a.state_digest(), b.state_digest());
        assert_eq!(digests(&mut a, 6), digests(&mut b, 6));
        assert_eq!(a.state_digest(), b.state_digest());
    }
}

#[test]
fn block_sizes_that_misplace_tokens_are_caught_at_step_zero() {
    // The pair: the same global budget, 2 vs 4 tokens per block. Their decode owners
    // disagree while every schedule field would otherwise agree.
    let config = |rank: u32, tpb: u32| {
        let mut c = base();
        c.cp_rank = rank;
        c.tokens_per_block = tpb;
        c.capacity_superblocks = SchedulerConfig::superblocks_for_kv_tokens(2, tpb, 64).unwrap();
        c
    };
    let mut a = loaded(config(0, 2));
    let mut b = loaded(config(1, 4));
    let (da, db) = (digests(&mut a, 8), digests(&mut b, 8));
    for (step, (x, y)) in da.iter().zip(&db).enumerate() {
        assert_ne!(x, y, "step {step}");
    }
}

#[test]
fn field_values_name_policies_and_the_unit_in_effect() {
    let fields = base().decision_fields();
    let get = |name: &str| fields.iter().find(|(n, _)| *n == name).unwrap().1;
    assert_eq!(get("chunk_unit"), FieldValue::Int(4));
    assert_eq!(get("victim_policy"), FieldValue::Name("newest_first"));
    assert_eq!(get("enable_chunked_prefill"), FieldValue::Bool(true));
    assert_eq!(get("capacity_superblocks"), FieldValue::Int(16));
}
