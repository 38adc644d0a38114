//! Rules of the host tier under aggregated Helix: what each suspend policy suspends, a
//! resume keeps its queue place against a new admission in the same step, the mirrored
//! host ledger's page ids (none handed to a suspend while a resume of the same step reads
//! them; the same pages again after a revert), and aborts of suspended requests.

mod common;

use std::collections::BTreeMap;

use common::{assert_matches_reference, config, prompt, step, Group, Model, Rng, RunOptions, Spec};
use helix_kv_core::{RequestId, RequestState, Scheduler, SchedulerConfig, SuspendPolicy};

/// Aggregated Helix at `cp` ranks, `tokens_per_block` 2, a pool of `superblocks` and a host
/// tier of `host` superblocks.
fn aggregated(cp: u32, superblocks: u32, host: u32, policy: SuspendPolicy) -> SchedulerConfig {
    let mut config = config(cp, 2, superblocks);
    config.host_tier_superblocks = host;
    config.suspend_policy = policy;
    config
}

/// A pressured random workload with chunked prefill (so victims are both prefilling and
/// decoding).
fn workload(seed: u64) -> Vec<Spec> {
    let mut rng = Rng::new(seed);
    (0..rng.range(8, 14))
        .map(|id| {
            Spec::new(
                id,
                usize::try_from(rng.range(4, 40)).unwrap(),
                u32::try_from(rng.range(4, 20)).unwrap(),
            )
            .at(rng.range(0, 6))
        })
        .collect()
}

/// Runs `specs` on one scheduler (feeding token 1), calling `check` with each step's
/// schedule, the state and KV length of every live request before it, and the scheduler.
fn run_checking(
    config: SchedulerConfig,
    specs: &[Spec],
    mut check: impl FnMut(
        &helix_kv_core::ScheduleOutput,
        &BTreeMap<RequestId, (RequestState, u64)>,
        &Scheduler,
    ),
) -> Scheduler {
    let mut s = Scheduler::new(config).unwrap();
    let mut next = 0;
    for n in 0..5_000u64 {
        while next < specs.len() && specs[next].arrival_step <= n {
            let spec = &specs[next];
            s.add_request(spec.id, &spec.prompt, spec.max_new_tokens, 0)
                .unwrap();
            next += 1;
        }
        if next == specs.len() && !s.has_unfinished() {
            break;
        }
        let before: BTreeMap<_, _> = s
            .queue_ids()
            .into_iter()
            .map(|id| {
                let len = s.ledger().request(id).unwrap().len();
                (id, (s.request_state(id).unwrap(), len))
            })
            .collect();
        let out = step(&mut s, 1);
        check(&out, &before, &s);
    }
    assert!(!s.has_unfinished());
    assert_eq!(s.host_used_superblocks(), 0);
    s
}

fn sorted_by_arrival(mut specs: Vec<Spec>) -> Vec<Spec> {
    specs.sort_by_key(|s| s.arrival_step);
    specs
}

#[test]
fn suspend_first_suspends_every_victim_the_host_tier_has_room_for() {
    let mut suspensions = 0;
    for seed in 0..8 {
        let specs = sorted_by_arrival(workload(seed));
        let config = aggregated(2, 24, 1_000, SuspendPolicy::SuspendFirst);
        let s = run_checking(config, &specs, |out, _, _| {
            assert!(out.preempted_ids.is_empty(), "{}", out.summary());
        });
        suspensions += s.metrics().suspensions;
    }
    assert!(suspensions > 0);
}

#[test]
fn recompute_first_recomputes_prefilling_victims_and_suspends_decoding_ones() {
    let (mut suspended, mut preempted) = (0, 0);
    for seed in 0..8 {
        let specs = sorted_by_arrival(workload(seed));
        let mut config = aggregated(2, 24, 1_000, SuspendPolicy::RecomputeFirst);
        config.max_num_tokens = 16;
        config.chunk_unit = Some(4);
        run_checking(config, &specs, |out, before, _| {
            for id in &out.suspended_ids {
                assert_eq!(before[id].0, RequestState::Decoding, "{}", out.summary());
                suspended += 1;
            }
            for id in &out.preempted_ids {
                assert_eq!(before[id].0, RequestState::Prefilling, "{}", out.summary());
                preempted += 1;
            }
        });
    }
    assert!(suspended > 0 && preempted > 0, "{suspended} / {preempted}");
}

#[test]
fn cost_suspends_when_the_copy_costs_less_than_the_recompute() {
    let (mut suspended, mut preempted) = (0, 0);
    for seed in 0..8 {
        let specs = sorted_by_arrival(workload(seed));
        // Copying a token costs 3, recomputing one 4: a victim whose pages are mostly
        // full is suspended, one with a nearly empty last superblock is recomputed.
        let mut config = aggregated(2, 24, 1_000, SuspendPolicy::Cost);
        config.suspend_cost_per_token = 3;
        config.recompute_cost_per_token = 4;
        let tokens_per_superblock = 4;
        run_checking(config, &specs, |out, before, _| {
            for (i, id) in out.suspended_ids.iter().enumerate() {
                let copied = out.suspended_block_counts[i] * tokens_per_superblock;
                assert!(copied * 3 < before[id].1 * 4, "{}", out.summary());
                suspended += 1;
            }
            for id in &out.preempted_ids {
                // Its pages at preemption hold at least its KV length before the step.
                let at_least = before[id].1.div_ceil(tokens_per_superblock) * tokens_per_superblock;
                assert!(at_least * 3 >= before[id].1 * 4, "{}", out.summary());
                preempted += 1;
            }
        });
    }
    assert!(suspended > 0 && preempted > 0, "{suspended} / {preempted}");
    // Equal costs: a copy never costs less than the recompute, nothing is suspended.
    let mut config = aggregated(2, 24, 1_000, SuspendPolicy::Cost);
    config.recompute_cost_per_token = 1;
    let s = run_checking(config, &sorted_by_arrival(workload(1)), |_, _, _| {});
    assert_eq!(s.metrics().suspensions, 0);
    assert!(s.metrics().preemptions > 0);
}

/// Request 1 is suspended for request 0 and resumes when 0 has finished, while two newer
/// requests wait for the two batch slots (aggregated Helix, cp 2).
#[test]
fn a_resume_keeps_its_queue_place_against_a_new_admission_in_the_same_step() {
    // cp 2, tpb 2 (4 tokens a superblock): prompt 16 -> 4 superblocks, 6 -> 2, 4 -> 1.
    let mut config = aggregated(2, 6, 8, SuspendPolicy::SuspendFirst);
    config.max_batch_size = 2;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(16), 2, 0).unwrap();
    s.add_request(1, &prompt(6), 5, 0).unwrap();
    s.add_request(2, &prompt(4), 3, 0).unwrap();
    s.add_request(3, &prompt(4), 3, 0).unwrap();
    let first = step(&mut s, 1);
    assert_eq!(first.context_ids, vec![0, 1], "2 and 3 wait for a slot");
    let mut resume = None;
    for _ in 0..8 {
        let out = step(&mut s, 1);
        if !out.suspended_ids.is_empty() {
            assert_eq!(out.suspended_ids, vec![1], "{}", out.summary());
            assert_eq!(out.suspended_host_block_ids, vec![0, 1]);
        }
        if !out.resumed_ids.is_empty() {
            resume = Some(out);
            break;
        }
    }
    let resume = resume.expect("1 resumes");
    assert_eq!(resume.resumed_ids, vec![1]);
    assert_eq!(resume.resumed_host_block_ids, vec![0, 1]);
    assert_eq!(resume.resumed_block_counts, vec![2]);
    // Its slot was claimed before the context phase admitted: one slot was left for
    // the two newer requests, and 3 still waits.
    assert_eq!(resume.context_ids, vec![2], "{}", resume.summary());
    // The host pages were freed by the update of the resuming step.
    assert_eq!(s.host_used_superblocks(), 0);
    let next = step(&mut s, 1);
    assert_eq!(next.generation_ids, vec![1, 2], "{}", next.summary());
}

#[test]
fn a_reverted_resume_keeps_its_host_pages_and_resumes_from_them_again() {
    let mut config = aggregated(2, 6, 8, SuspendPolicy::SuspendFirst);
    config.max_batch_size = 2;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(16), 4, 0).unwrap();
    s.add_request(1, &prompt(6), 5, 0).unwrap();
    step(&mut s, 1);
    loop {
        let before = (s.state_digest(), s.ledger().state_digest());
        let out = s.schedule().unwrap().clone();
        if out.resumed_ids.is_empty() {
            s.update(&vec![1; out.num_samples()], None).unwrap();
            continue;
        }
        assert_eq!(
            s.host_pages(1).unwrap(),
            [0, 1],
            "held while the step is pending"
        );
        assert_eq!(s.host_used_superblocks(), 2);
        s.revert().unwrap();
        assert_eq!(s.request_state(1).unwrap(), RequestState::Suspended);
        assert_eq!(s.host_pages(1).unwrap(), [0, 1]);
        assert_eq!((s.state_digest(), s.ledger().state_digest()), before);
        let again = step(&mut s, 1);
        assert_eq!(again.resumed_host_block_ids, out.resumed_host_block_ids);
        assert_eq!(again.resumed_block_ids, out.resumed_block_ids);
        assert_eq!(s.host_used_superblocks(), 0);
        break;
    }
}

#[test]
fn an_abort_while_a_resume_is_pending_frees_both_tiers() {
    let mut config = aggregated(2, 6, 8, SuspendPolicy::SuspendFirst);
    config.max_batch_size = 2;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(16), 4, 0).unwrap();
    s.add_request(1, &prompt(6), 5, 0).unwrap();
    step(&mut s, 1);
    loop {
        let out = s.schedule().unwrap().clone();
        if out.resumed_ids.is_empty() {
            s.update(&vec![1; out.num_samples()], None).unwrap();
            continue;
        }
        s.abort(1).unwrap();
        let finished = s.update(&vec![1; out.num_samples()], None).unwrap();
        assert!(finished.contains(&1));
        assert_eq!(s.host_used_superblocks(), 0);
        assert!(s.ledger().request(1).is_err());
        break;
    }
}

/// Random aggregated workloads at cp 1, 2, 4 with a small host tier: the group harness
/// checks that no suspend is given a host page a resume of the same step still reads, and
/// that ranks agree; some steps must both resume and suspend.
#[test]
fn suspends_never_overwrite_host_pages_a_resume_of_the_same_step_reads() {
    let mut both = 0;
    for cp in [1u32, 2, 4] {
        for seed in 0..12 {
            let specs = workload(seed + 100);
            let mut config = aggregated(cp, 48 / cp, 24 / cp, SuspendPolicy::SuspendFirst);
            config.max_num_tokens = 24;
            config.chunk_unit = Some(4);
            let mut group = Group::new(&config, Model::default());
            let mut specs_sorted = specs.clone();
            specs_sorted.sort_by_key(|s| s.arrival_step);
            let options = RunOptions {
                revert_per_mille: 150,
                seed,
                max_steps: 0,
                ..RunOptions::default()
            };
            let result = group.run(&specs_sorted, options).unwrap();
            assert_matches_reference(&specs_sorted, Model::default(), &result);
            both += u64::from(result.suspensions > 0 && result.resumes > 0);
        }
    }
    assert!(both > 0);
}
