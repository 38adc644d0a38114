//! Targeted rules of the scheduler: victim policies, modes and their ladders, deadlock
//! detection, revert, batch slots, admission after preemption, and bad input.

mod common;

use common::{
    assert_matches_reference, config, observable, prompt, step, Group, Model, Rng, RunOptions, Spec,
};
use helix_kv_core::{
    AdmissionPolicy, CapacityPolicy, CoreError, RequestState, ScheduleOutput, Scheduler,
    SchedulerConfig, ServingMode, VictimPolicy,
};

/// Requests 0..=4 all prefilled and decoding in a pool that is then exactly full, so the
/// next decode of request 0 must preempt one of 1..=4.
fn full_pool_with_candidates(policy: VictimPolicy) -> Scheduler {
    // tpb 4, cp 1: prompt lengths 4, 8, 4, 12, 8 -> 1, 2, 1, 3, 2 superblocks = 9.
    let mut config = config(1, 4, 9);
    config.victim_policy = policy;
    let mut s = Scheduler::new(config).unwrap();
    let sizes = [4, 8, 4, 12, 8];
    let priorities = [0, -3, 0, -3, 1];
    for (id, (&len, &priority)) in sizes.iter().zip(&priorities).enumerate() {
        s.add_request(id as u64, &prompt(len), 10, priority)
            .unwrap();
    }
    let out = step(&mut s, 7);
    assert_eq!(out.context_ids, vec![0, 1, 2, 3, 4]);
    assert_eq!(s.ledger().free_superblocks(), 0);
    s
}

#[test]
fn each_victim_policy_picks_what_it_promises() {
    for (policy, expected) in [
        (VictimPolicy::NewestFirst, 4),        // the last in queue order
        (VictimPolicy::LeastComputedFirst, 2), // 4 computed tokens, fewest
        (VictimPolicy::Priority, 3),           // priority -3 ties 1 and 3: the newer
    ] {
        let mut s = full_pool_with_candidates(policy);
        let out = s.schedule().unwrap().clone();
        assert_eq!(out.preempted_ids[0], expected, "{policy:?}");
        assert_eq!(out.preempted_requester_ids[0], 0, "{policy:?}");
        assert_eq!(
            out.generation_ids[0], 0,
            "the requester decodes after the preemption"
        );
        assert_eq!(s.request_state(expected).unwrap(), RequestState::Waiting);
        assert_eq!(s.request_metrics(expected).unwrap().victim_choices, 1);
        assert!(!out.generation_ids.contains(&expected));
    }
}

#[test]
fn a_request_never_preempts_one_ahead_of_it() {
    // Request 0 holds most of the pool; request 1 arrives later and cannot fit: it waits
    // (no victim behind it), it never takes request 0's pages.
    let mut s = Scheduler::new(config(2, 2, 4)).unwrap();
    s.add_request(0, &prompt(12), 4, 0).unwrap(); // 3 of 4 superblocks
    step(&mut s, 1);
    s.add_request(1, &prompt(8), 4, 100).unwrap();
    for _ in 0..3 {
        let out = step(&mut s, 1);
        assert!(out.preempted_ids.is_empty() && out.suspended_ids.is_empty());
        assert!(!out.context_ids.contains(&1));
    }
    // Request 0 finishes, then 1 runs.
    while s.has_unfinished() {
        step(&mut s, 1);
    }
    assert_eq!(s.metrics().preemptions, 0);
}

/// Two decoding requests that outgrow the pool while nobody may be a victim (bound 0):
/// both sit out once the pool is full, and the group stalls.
fn stalling_pair(cp: u32, mode: ServingMode) -> Scheduler {
    // tpb 2: prompts of 2 superblocks each, 8 new tokens; 8 (cp 1) or 6 (cp 2)
    // superblocks cannot hold both at full length.
    let mut config = config(cp, 2, if cp == 1 { 8 } else { 6 });
    config.serving_mode = mode;
    config.max_preemptions_per_request = 0;
    config.deadlock_steps = 3;
    let mut s = Scheduler::new(config).unwrap();
    let per = 4 * cp as usize;
    s.add_request(0, &prompt(per), 8, 0).unwrap();
    s.add_request(1, &prompt(per), 8, 0).unwrap();
    s
}

#[test]
fn generation_request_without_pages_or_victim_sits_out_and_releases_its_slot() {
    let mut s = stalling_pair(1, ServingMode::AggregatedHelix);
    let first = step(&mut s, 1);
    assert_eq!(first.context_batch_slots, vec![0, 1]);
    let out = loop {
        let out = step(&mut s, 1);
        if !out.sat_out_ids.is_empty() {
            break out;
        }
        assert_eq!(out.generation_batch_slots, vec![0, 1]);
    };
    assert_eq!(out.generation_ids, Vec::<u64>::new());
    assert_eq!(out.sat_out_ids, vec![0, 1]);
    assert!(
        out.summary().contains("sat_out: 0 1\n"),
        "{}",
        out.summary()
    );
    assert_eq!(s.metrics().sat_out, 2);
    // They keep their pages and stay decoding; only their batch slots went back.
    assert_eq!(s.request_state(0).unwrap(), RequestState::Decoding);
    assert_eq!(s.ledger().free_superblocks(), 0);
}

#[test]
fn deadlock_fires_with_a_remedy_that_fits_the_mode() {
    for (cp, mode) in [
        (2, ServingMode::AggregatedHelix),
        (1, ServingMode::AggregatedHelix),
        (1, ServingMode::NonHelix),
    ] {
        let mut s = stalling_pair(cp, mode);
        let mut stalled = 0;
        let err = loop {
            let before = s.state_digest();
            match s.schedule() {
                Ok(out) => {
                    stalled = if out.num_tokens == 0 { stalled + 1 } else { 0 };
                    let n = out.num_samples();
                    s.update(&vec![1; n], None).unwrap();
                }
                Err(err) => {
                    assert_eq!(s.state_digest(), before, "a deadlock error changes nothing");
                    break err;
                }
            }
        };
        assert_eq!(stalled, 3, "after exactly deadlock_steps stalled steps");
        let CoreError::Deadlock(msg) = &err else {
            panic!("expected a deadlock, got {err}")
        };
        assert!(
            msg.contains("3 consecutive steps") && msg.contains("max_preemptions_per_request"),
            "{msg}"
        );
        assert!(msg.contains("kv_superblocks"), "{msg}");
        match mode {
            ServingMode::AggregatedHelix => {
                assert!(!msg.contains("host"), "never advise a host tier: {msg}");
            }
            _ => assert!(msg.contains("host_tier_superblocks"), "{msg}"),
        }
        assert_eq!(s.schedule().unwrap_err(), err);
    }
}

#[test]
fn disaggregated_generation_refuses_to_preempt_and_changes_nothing() {
    let mut config = config(2, 2, 4);
    config.serving_mode = ServingMode::DisaggregatedGeneration;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(8), 8, 0).unwrap();
    s.add_request(1, &prompt(8), 8, 0).unwrap();
    // Prefill fills the pool (2 + 2 superblocks); the first decode token of each still
    // fits the prompt's last superblock? 8 tokens = exactly 2 superblocks, so no.
    step(&mut s, 5);
    let last = s.last_output().clone();
    let (state, ledger) = (s.state_digest(), s.ledger().state_digest());
    let err = s.schedule().unwrap_err();
    let CoreError::PreemptionDisabled(msg) = &err else {
        panic!("expected PreemptionDisabled, got {err}")
    };
    for needle in [
        "kv_superblocks",
        "max_batch_size",
        "guaranteed_no_evict",
        "aggregated_helix",
        "rolled back",
    ] {
        assert!(
            msg.contains(needle),
            "remedy should mention {needle}: {msg}"
        );
    }
    assert_eq!(
        (s.state_digest(), s.ledger().state_digest()),
        (state, ledger)
    );
    assert_eq!(s.last_output(), &last, "the previous output stays");
    assert!(!s.is_step_pending());
    assert_eq!(
        s.schedule().unwrap_err(),
        err,
        "still unchanged: same answer"
    );
}

#[test]
fn disaggregated_context_requests_wait_for_pages_instead_of_failing() {
    let mut config = config(1, 4, 4);
    config.serving_mode = ServingMode::DisaggregatedGeneration;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(8), 4, 0).unwrap(); // 8 + 3 decode tokens: 3 superblocks
    step(&mut s, 1);
    s.add_request(1, &prompt(8), 4, 0).unwrap(); // cannot fit until 0 finishes
    let mut waited = 0;
    while s.has_unfinished() {
        let out = step(&mut s, 1);
        waited += usize::from(
            out.context_ids.is_empty()
                && s.request_state(1)
                    .is_ok_and(|st| st == RequestState::Waiting),
        );
    }
    assert!(waited > 0);
    assert_eq!(s.metrics().finished, 2);
}

#[test]
fn guaranteed_no_evict_reserves_at_admission_and_never_preempts() {
    let specs: Vec<Spec> = (0..8).map(|i| Spec::new(i, 10, 30).at(i / 3)).collect();
    for cp in [1, 2, 4] {
        let tokens = 160 / (4 * u64::from(cp));
        let mut config = config(cp, 4, u32::try_from(tokens).unwrap());
        config.capacity_policy = CapacityPolicy::GuaranteedNoEvict;
        let mut group = Group::new(&config, Model::default());
        let options = RunOptions {
            revert_per_mille: 150,
            seed: 9,
            max_steps: 0,
            ..RunOptions::default()
        };
        let result = group.run(&specs, options).unwrap();
        assert_matches_reference(&specs, Model::default(), &result);
        assert_eq!(result.preemptions + result.suspensions, 0);
        assert!(result.reverted_steps > 0);
    }
    let mut config = config(1, 4, 16);
    config.capacity_policy = CapacityPolicy::GuaranteedNoEvict;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(10), 30, 0).unwrap();
    s.schedule().unwrap();
    assert_eq!(
        s.ledger().request(0).unwrap().len(),
        40,
        "prompt + whole output at admission"
    );
    s.revert().unwrap();
    assert_eq!(
        s.ledger().request(0).unwrap().len(),
        0,
        "revert undoes the admission entirely"
    );
    step(&mut s, 3);
    let out = s.schedule().unwrap().clone();
    s.revert().unwrap();
    assert_eq!(out.generation_positions, vec![10]);
    assert_eq!(
        s.ledger().request(0).unwrap().len(),
        40,
        "a reverted decode keeps the reservation"
    );
}

#[test]
fn non_helix_suspends_to_the_host_tier_first_then_recomputes() {
    let specs: Vec<Spec> = (0..8).map(|i| Spec::new(i, 10, 30)).collect();
    let mut config = config(1, 4, 40);
    config.serving_mode = ServingMode::NonHelix;
    config.host_tier_superblocks = 6;
    for revert_per_mille in [0, 200] {
        let mut group = Group::new(&config, Model::default());
        let options = RunOptions {
            revert_per_mille,
            seed: 3,
            max_steps: 0,
            ..RunOptions::default()
        };
        let result = group.run(&specs, options).unwrap();
        assert_matches_reference(&specs, Model::default(), &result);
        assert!(result.suspensions > 0, "the host tier is used first");
        assert!(result.preemptions > 0, "and recompute when it is full");
    }

    // The first victim of the first pressured step is suspended, not recomputed.
    let mut s = Scheduler::new(config).unwrap();
    for spec in &specs {
        s.add_request(spec.id, &spec.prompt, spec.max_new_tokens, 0)
            .unwrap();
    }
    loop {
        let out = step(&mut s, 1);
        if !out.suspended_ids.is_empty() || !out.preempted_ids.is_empty() {
            assert!(
                !out.suspended_ids.is_empty(),
                "suspend comes first: {}",
                out.summary()
            );
            assert_eq!(
                s.request_state(out.suspended_ids[0]).unwrap(),
                RequestState::Suspended
            );
            assert_eq!(s.num_suspended(), out.suspended_ids.len());
            break;
        }
    }
}

#[test]
fn resumes_are_counted_in_steps_that_ran_only() {
    let specs: Vec<Spec> = (0..8).map(|i| Spec::new(i, 10, 30)).collect();
    let mut config = config(1, 4, 40);
    config.serving_mode = ServingMode::NonHelix;
    config.host_tier_superblocks = 6;
    let mut s = Scheduler::new(config).unwrap();
    for spec in &specs {
        s.add_request(spec.id, &spec.prompt, spec.max_new_tokens, 0)
            .unwrap();
    }
    let (mut resumed_in_updates, mut resumed_in_reverts) = (0u64, 0u64);
    let mut n = 0u64;
    while s.has_unfinished() {
        let out = s.schedule().unwrap().clone();
        let resumed = out.resumed_ids.len() as u64;
        n += 1;
        // Revert every other step that resumed something: its resumes are undone.
        if resumed > 0 && n % 2 == 0 {
            s.revert().unwrap();
            resumed_in_reverts += resumed;
        } else {
            s.update(&vec![1; out.num_samples()], None).unwrap();
            resumed_in_updates += resumed;
        }
        assert_eq!(s.metrics().resumes, resumed_in_updates);
    }
    assert!(
        resumed_in_updates > 0 && resumed_in_reverts > 0,
        "{resumed_in_updates} resumed in updated steps, {resumed_in_reverts} in reverted ones"
    );
}

/// Request 1 is suspended for request 0 at step 1 and resumed at step 2, when request 0
/// has finished and two newer requests wait for batch slots (`max_batch_size` 2).
fn resumed_request_and_two_newer_ones_waiting() -> Scheduler {
    // cp 1, tpb 2: prompt 8 -> 4 superblocks, prompt 3 -> 2, prompt 2 -> 1; pool of 6.
    let mut config = config(1, 2, 6);
    config.serving_mode = ServingMode::NonHelix;
    config.host_tier_superblocks = 8;
    config.max_batch_size = 2;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(8), 2, 0).unwrap();
    s.add_request(1, &prompt(3), 5, 0).unwrap();
    s.add_request(2, &prompt(2), 3, 0).unwrap();
    s.add_request(3, &prompt(2), 3, 0).unwrap();
    let first = step(&mut s, 1);
    assert_eq!(first.context_ids, vec![0, 1], "2 and 3 wait for a slot");
    let second = step(&mut s, 1);
    assert_eq!(second.suspended_ids, vec![1], "0's decode page suspends 1");
    assert_eq!(second.generation_ids, vec![0]);
    assert_eq!(s.request_state(0), Err(CoreError::UnknownRequest(0)));
    s
}

#[test]
fn a_resumed_request_keeps_its_queue_place_for_a_batch_slot() {
    let mut s = resumed_request_and_two_newer_ones_waiting();
    let resume = step(&mut s, 1);
    let next = step(&mut s, 1);
    assert_eq!(resume.resumed_ids, vec![1]);
    // The step after its resume, 1 decodes ahead of the newer 2 (token budget is plenty).
    assert_eq!(
        s.request_state(1).unwrap(),
        RequestState::Decoding,
        "1 holds its KV"
    );
    assert_eq!(next.generation_ids, vec![1, 2], "{}", next.summary());
    // Because 1 resumed ahead of 2 and 3, its slot was taken before the context phase
    // admitted: only one of the two slots was left for them, and 3 still waits.
    assert_eq!(resume.context_ids, vec![2]);
    assert_eq!(resume.context_batch_slots, vec![1]);
    assert_eq!(next.generation_batch_slots, vec![0, 1]);
    assert!(next.context_ids.is_empty());
    run_to_end(&mut s);
}

#[test]
fn revert_of_a_resuming_step_gives_the_resumed_request_slot_back() {
    let mut s = resumed_request_and_two_newer_ones_waiting();
    let before = (s.state_digest(), s.ledger().state_digest());
    let resume = s.schedule().unwrap().clone();
    assert_eq!(resume.resumed_ids, vec![1]);
    s.revert().unwrap();
    assert_eq!(s.request_state(1).unwrap(), RequestState::Suspended);
    // The slot handed out at the resume is free again (the state digest covers slots).
    assert_eq!((s.state_digest(), s.ledger().state_digest()), before);
    let again = step(&mut s, 1);
    assert_eq!(
        (again.resumed_ids.clone(), again.context_ids.clone()),
        (vec![1], vec![2])
    );
    assert_eq!(again.context_batch_slots, vec![1]);
    assert_eq!(step(&mut s, 1).generation_ids, vec![1, 2]);
}

/// The workload shape of the report: `non_helix` at cp 1, `tokens_per_block` 2, 4 batch
/// slots, 7 tokens a step, a host tier of 8 superblocks. Before resumes claimed their
/// batch slot, most of these seeds had a request resume into a step whose context phase
/// gave every free slot to newer requests; `Group::check_slot_order` fails on that.
#[test]
fn resumed_requests_keep_their_queue_place_in_random_non_helix_workloads() {
    let mut config = config(1, 2, 10);
    config.serving_mode = ServingMode::NonHelix;
    config.host_tier_superblocks = 8;
    config.max_batch_size = 4;
    config.max_num_tokens = 7;
    let mut resumes = 0;
    for seed in 0..32 {
        let mut rng = Rng::new(seed);
        let specs: Vec<Spec> = (0..rng.range(6, 16))
            .map(|id| {
                let (prompt, max_new) = (rng.range(1, 8), rng.range(1, 10));
                Spec::new(
                    id,
                    usize::try_from(prompt).unwrap(),
                    u32::try_from(max_new).unwrap(),
                )
                .at(rng.range(0, 12))
            })
            .collect();
        for revert_per_mille in [0, 200] {
            let mut group = Group::new(&config, Model::default());
            let options = RunOptions {
                revert_per_mille,
                seed,
                max_steps: 0,
                ..RunOptions::default()
            };
            let result = group.run(&specs, options).unwrap();
            assert_matches_reference(&specs, Model::default(), &result);
            resumes += group.ranks[0].metrics().resumes;
        }
    }
    assert!(resumes > 0, "the workloads resume requests");
}

/// A decoding request without a batch slot that finds none free at its turn claims the
/// next one freed later in the step, so nobody behind it can take that one first.
#[test]
fn a_decoding_request_without_a_slot_claims_the_next_one_freed() {
    // A relay of suspends (found by a search over random workloads): 3 suspends 5 and 6
    // in turn, 4 is admitted behind them, 3 finishes, and 5 and 6 resume together.
    let mut config = config(1, 2, 7);
    config.serving_mode = ServingMode::NonHelix;
    config.host_tier_superblocks = 8;
    config.max_batch_size = 2;
    config.max_num_tokens = 4;
    let mut s = Scheduler::new(config).unwrap();
    // (id, prompt length, max_new_tokens, added before step)
    let specs = [
        (1, 1, 10, 2),
        (3, 4, 9, 2),
        (5, 2, 6, 2),
        (6, 3, 5, 2),
        (4, 4, 3, 5),
    ];
    let mut out = ScheduleOutput::default();
    for at in 0..=17 {
        for &(id, len, max_new, _) in specs.iter().filter(|spec| spec.3 == at) {
            s.add_request(id, &prompt(len), max_new, 0).unwrap();
        }
        out = step(&mut s, 7);
    }
    // Step 17: one slot free (4 holds the other); 5 takes it, 6 is left without.
    assert_eq!(out.resumed_ids, vec![5, 6]);
    assert_eq!(s.queue_ids(), vec![5, 6, 4]);
    let slots = |s: &Scheduler| [5, 6, 4].map(|id| s.batch_slot(id).unwrap());
    assert_eq!(slots(&s), [Some(0), None, Some(1)]);
    // Step 18: no slot is free at 6's turn; 4, behind it, then sits out and frees one,
    // which goes to 6 (it decodes from the next step) and to nobody behind it. A revert
    // gives the claimed slot back and 4 its own.
    let digest = s.state_digest();
    s.schedule().unwrap();
    s.revert().unwrap();
    assert_eq!(s.state_digest(), digest);
    assert_eq!(slots(&s), [Some(0), None, Some(1)]);
    let out = step(&mut s, 7);
    assert_eq!(
        (out.generation_ids.clone(), out.sat_out_ids.clone()),
        (vec![5], vec![4])
    );
    assert_eq!(slots(&s), [Some(0), Some(1), None]);
    assert!(step(&mut s, 7).generation_ids.contains(&6));
    run_to_end(&mut s);
}

#[test]
fn no_admission_in_a_step_that_preempted_unless_configured() {
    for admit in [false, true] {
        let mut config = config(1, 4, 3);
        config.admit_after_preemption = admit;
        let mut s = Scheduler::new(config).unwrap();
        s.add_request(0, &prompt(4), 6, 0).unwrap(); // 1 superblock, then grows
        s.add_request(1, &prompt(8), 4, 0).unwrap(); // 2 superblocks: pool full
        step(&mut s, 1);
        s.add_request(2, &prompt(2), 1, 0).unwrap();
        let out = step(&mut s, 1);
        assert_eq!(out.preempted_ids, vec![1]);
        assert!(
            !out.context_ids.contains(&1),
            "a victim is never re-admitted in its step"
        );
        assert_eq!(
            out.context_ids.contains(&2),
            admit,
            "admit_after_preemption = {admit}"
        );
    }
}

#[test]
fn partial_chunks_are_whole_units_and_respect_the_token_budget() {
    let mut config = config(2, 2, 64);
    config.max_num_tokens = 10;
    config.chunk_unit = Some(4);
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(21), 2, 0).unwrap();
    s.add_request(1, &prompt(3), 2, 0).unwrap();
    let first = step(&mut s, 1);
    assert_eq!(
        (first.context_ids.clone(), first.context_lens.clone()),
        (vec![0], vec![8])
    );
    assert_eq!(first.context_completes, vec![false]);
    assert!(
        first
            .summary()
            .contains("context: 0:0+8!\nincomplete_prompts: 0\n"),
        "{}",
        first.summary()
    );
    let second = step(&mut s, 1);
    assert_eq!(
        (second.context_starts.clone(), second.context_lens.clone()),
        (vec![8], vec![8])
    );
    let third = step(&mut s, 1);
    assert_eq!(third.context_ids, vec![0, 1]);
    assert_eq!(
        (third.context_starts.clone(), third.context_lens.clone()),
        (vec![16, 0], vec![5, 3])
    );
    assert_eq!(third.context_completes, vec![true, true]);
    assert_eq!(third.sample_ids().collect::<Vec<_>>(), [0, 1]);
    assert_eq!(
        third.context_token_ids,
        [&prompt(21)[16..], &prompt(3)[..]].concat()
    );
    let fourth = step(&mut s, 1);
    assert_eq!(fourth.generation_ids, vec![0, 1]);
    assert_eq!(fourth.generation_positions, vec![21, 3]);
    assert_eq!(
        fourth.generation_owner_ranks().collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(s.request_metrics(1).unwrap().steps_waited, 2);
}

#[test]
fn batch_slots_are_lowest_free_first_and_bound_the_running_set() {
    let mut config = config(1, 4, 64);
    config.max_batch_size = 2;
    let mut s = Scheduler::new(config).unwrap();
    for id in 0..3u32 {
        s.add_request(u64::from(id), &prompt(4), 2 + id, 0).unwrap();
    }
    let first = step(&mut s, 1);
    assert_eq!(
        (first.context_ids.clone(), first.context_batch_slots.clone()),
        (vec![0, 1], vec![0, 1])
    );
    let second = step(&mut s, 1); // 0 finishes (2 tokens); 2 waits for a slot meanwhile
    assert_eq!(
        (
            second.generation_ids.clone(),
            second.generation_batch_slots.clone()
        ),
        (vec![0, 1], vec![0, 1])
    );
    assert!(second.context_ids.is_empty());
    let third = step(&mut s, 1);
    assert_eq!(
        (
            third.generation_ids.clone(),
            third.generation_batch_slots.clone()
        ),
        (vec![1], vec![1])
    );
    assert_eq!(
        (third.context_ids.clone(), third.context_batch_slots.clone()),
        (vec![2], vec![0])
    );
    assert!(
        third.summary().contains("batch_slots: 2=0 1=1\n"),
        "{}",
        third.summary()
    );
}

#[test]
fn revert_of_a_preempting_step_keeps_the_preemption_only() {
    let mut s = full_pool_with_candidates(VictimPolicy::NewestFirst);
    let holdings = s.ledger().holdings();
    let out = s.schedule().unwrap().clone();
    assert!(!out.preempted_ids.is_empty());
    s.revert().unwrap();
    for (id, held) in holdings {
        let now = u32::try_from(s.ledger().request(id).unwrap().table().len()).unwrap();
        let expected = if out.preempted_ids.contains(&id) {
            0
        } else {
            held
        };
        assert_eq!(now, expected, "request {id}");
    }
    for id in &out.preempted_ids {
        assert_eq!(s.request_state(*id).unwrap(), RequestState::Waiting);
    }
    assert_eq!(s.metrics().preemptions, out.preempted_ids.len() as u64);
    let again = s.schedule().unwrap();
    assert!(again.step > out.step, "step numbers are not reused");
}

fn assert_unchanged(
    s: &mut Scheduler,
    call: impl FnOnce(&mut Scheduler) -> CoreError,
    needle: &str,
) {
    let before = observable(s);
    let err = call(s);
    assert!(
        err.to_string().contains(needle),
        "{err} should mention {needle}"
    );
    assert_eq!(observable(s), before);
}

#[test]
fn bad_input_is_refused_with_a_typed_error_and_changes_nothing() {
    let mut config = config(2, 4, 8); // 64 tokens of KV
    config.max_seq_len = 60;
    config.enable_chunked_prefill = false;
    config.max_num_tokens = 32;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(8), 4, 0).unwrap();
    let p = prompt(8);
    assert_unchanged(
        &mut s,
        |s| s.add_request(1, &p, 4, 0).unwrap_err(),
        "duplicate request 1",
    );
    assert_unchanged(
        &mut s,
        |s| s.add_request(2, &[], 4, 0).unwrap_err(),
        "empty prompt",
    );
    assert_unchanged(
        &mut s,
        |s| s.add_request(2, &p, 0, 0).unwrap_err(),
        "max_new_tokens = 0",
    );
    let long = prompt(50);
    assert_unchanged(
        &mut s,
        |s| s.add_request(2, &long, 20, 0).unwrap_err(),
        "max_seq_len = 60",
    );
    assert_unchanged(
        &mut s,
        |s| s.add_request(2, &prompt(30), 6, 0).unwrap_err(),
        "max_num_tokens = 32",
    );
    assert!(matches!(
        s.add_request(2, &long, 2, 0),
        Err(CoreError::RequestTooLarge { id: 2, .. })
    ));
    assert_unchanged(&mut s, |s| s.tokens(9).unwrap_err(), "unknown request 9");
    assert_unchanged(
        &mut s,
        |s| s.request_metrics(9).unwrap_err(),
        "unknown request 9",
    );
    assert_unchanged(
        &mut s,
        |s| s.take_output(9).unwrap_err(),
        "unknown request 9",
    );
    assert_unchanged(&mut s, |s| s.take_output(1).unwrap_err(), "not finished");
    assert_unchanged(
        &mut s,
        |s| s.update(&[], None).unwrap_err(),
        "call schedule() first",
    );
    assert_unchanged(&mut s, |s| s.revert().unwrap_err(), "call schedule() first");
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.sample_ids().collect::<Vec<_>>(), [1]);
    // One step ahead is allowed; a third pending step is not.
    s.schedule().unwrap();
    assert_eq!(s.pending_steps(), 2);
    assert_unchanged(
        &mut s,
        |s| s.schedule().unwrap_err(),
        "scheduled at most one ahead",
    );
    s.revert().unwrap();
    assert_eq!(s.pending_steps(), 1);
    assert_unchanged(
        &mut s,
        |s| s.update(&[1, 2], None).unwrap_err(),
        "got 2 tokens for the 1 entries",
    );
    assert_unchanged(
        &mut s,
        |s| s.update(&[1], Some(&[])).unwrap_err(),
        "got 0 eos flags",
    );
    s.update(&[3], Some(&[true])).unwrap();
    assert_eq!(
        s.take_output(1).unwrap().token_ids,
        vec![3],
        "eos ends it after one token"
    );
    assert!(matches!(
        s.take_output(1),
        Err(CoreError::UnknownRequest(1))
    ));
    s.add_request(1, &p, 4, 0).unwrap(); // the id is free again once its output is taken
}

#[test]
fn pool_limit_is_named_when_a_request_can_never_fit() {
    let mut s = Scheduler::new(config(4, 4, 2)).unwrap(); // 2 superblocks of 16 tokens
    let err = s.add_request(1, &prompt(30), 3, 0).unwrap_err();
    assert!(
        err.to_string()
            .contains("3 superblocks, more than the whole KV pool (2 superblocks = 32 tokens)"),
        "{err}"
    );
}

#[test]
fn metrics_count_what_ran() {
    let specs: Vec<Spec> = (0..6).map(|i| Spec::new(i, 10, 20)).collect();
    let mut config = config(2, 4, 10);
    config.max_num_tokens = 64;
    let mut group = Group::new(&config, Model::default());
    let result = group.run(&specs, RunOptions::default()).unwrap();
    let m = group.ranks[0].metrics();
    assert_eq!(m.finished, 6);
    assert_eq!(m.steps, result.steps);
    assert!(m.preemptions > 0 && m.recomputed_tokens > 0);
    // Every token computed at least once; recomputation on top.
    let minimum: u64 = specs
        .iter()
        .map(|s| s.prompt.len() as u64 + u64::from(s.max_new_tokens) - 1)
        .sum();
    assert_eq!(m.computed_tokens, minimum + m.recomputed_tokens);
    assert!(m.kv_utilization_peak > 0.9 && m.kv_utilization == 0.0);
    assert_eq!(m.kv_capacity_superblocks, 10);
}

#[test]
fn the_output_can_be_moved_out_and_the_step_still_closes() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(3, &prompt(5), 2, 0).unwrap();
    let expected = s.schedule().unwrap().clone();
    let taken = s.take_last_output();
    assert_eq!(taken, expected);
    // Empty, still for this rank: the next step's output carries the rank's placement.
    assert_eq!(
        s.last_output(),
        &ScheduleOutput {
            rank_placement: taken.rank_placement,
            ..ScheduleOutput::default()
        }
    );
    assert_ne!(
        taken.rank_placement,
        ScheduleOutput::default().rank_placement
    );
    s.update(&[9], None).unwrap();
    let second = s.schedule().unwrap().clone();
    assert_eq!(second.rank_placement, taken.rank_placement);
    assert_eq!(
        (second.generation_ids, second.generation_positions),
        (vec![3], vec![5])
    );
    s.revert().unwrap();
}

/// A schedule handed back with `recycle_output` lends its buffers only: whatever it holds
/// (another rank's placement, stale entries of every kind) never shows in a later step,
/// which is exactly what a scheduler that never got one back schedules.
#[test]
fn a_recycled_output_lends_its_buffers_and_nothing_else() {
    let run = |recycle: bool| {
        let mut s = Scheduler::new(config(2, 4, 6)).unwrap();
        for (r, (len, max_new)) in [(3, 12), (4, 15), (5, 18), (6, 21), (7, 24)]
            .into_iter()
            .enumerate()
        {
            s.add_request(r as u64, &prompt(len), max_new, 0).unwrap();
        }
        let mut outputs = Vec::new();
        for _ in 0..40 {
            let out = s.schedule().unwrap().clone();
            let samples = out.num_samples();
            let mut taken = s.take_last_output();
            assert_eq!(taken, out);
            s.update(&vec![4; samples], None).unwrap();
            if recycle {
                // Stale contents everywhere, and another rank's placement.
                taken.generation_ids.extend([77, 78]);
                taken.context_token_ids.extend(0..50);
                taken.preempted_ids.push(99);
                taken.context_completes.push(true);
                taken.num_tokens = 1234;
                taken.digest = 5;
                taken.rank_placement = ScheduleOutput::default().rank_placement;
                s.recycle_output(taken);
            }
            outputs.push(out);
        }
        outputs
    };
    let fresh = run(false);
    assert!(fresh.iter().any(|o| !o.preempted_ids.is_empty()));
    assert_eq!(run(true), fresh);
}

/// Steps until every request has finished, checking each step that every preemption
/// served its requester in that step.
fn run_to_end(s: &mut Scheduler) {
    for _ in 0..1_000 {
        if !s.has_unfinished() {
            return;
        }
        let out = step(s, 1);
        for requester in &out.preempted_requester_ids {
            assert!(
                out.generation_ids.contains(requester) || out.context_ids.contains(requester),
                "step {}: futile preemption for {requester}",
                out.step
            );
        }
    }
    panic!("did not finish");
}

#[test]
fn a_request_preempts_nobody_when_the_victims_behind_it_cannot_free_enough() {
    // tpb 4, cp 1, 7 superblocks: 0 and 1 hold 3 each, 2 holds 1; the pool is full.
    let mut config = config(1, 4, 7);
    config.victim_policy = VictimPolicy::Priority;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(12), 8, 5).unwrap();
    s.add_request(1, &prompt(12), 8, -1).unwrap();
    s.add_request(2, &prompt(4), 8, 5).unwrap();
    step(&mut s, 1);
    assert_eq!(s.ledger().free_superblocks(), 0);
    // 0's first decode token needs a fourth superblock: 1 (lowest priority) frees 3.
    let out = step(&mut s, 1);
    assert_eq!(
        (out.preempted_ids, out.preempted_requester_ids),
        (vec![1], vec![0])
    );
    assert_eq!(out.generation_ids, vec![0, 2]);
    assert_eq!(s.ledger().free_superblocks(), 1);
    // 1 must re-prefill 13 tokens (4 superblocks). Behind it only 2 is a candidate, and
    // its 2 superblocks plus the 1 free make 3: preempting 2 would not serve 1, so nobody
    // is preempted and 1 waits.
    assert_eq!(s.ledger().request(2).unwrap().table().len(), 2);
    let out = step(&mut s, 1);
    assert!(out.preempted_ids.is_empty(), "{}", out.summary());
    assert!(out.context_ids.is_empty());
    assert_eq!(out.generation_ids, vec![0, 2]);
    assert_eq!(s.request_state(1).unwrap(), RequestState::Waiting);
    assert_eq!(s.request_metrics(2).unwrap().victim_choices, 0);
    assert_eq!(s.metrics().preemptions, 1);
    run_to_end(&mut s);
}

#[test]
fn a_request_served_by_preempting_is_no_victim_later_in_that_step() {
    // tpb 1, cp 1, 25 superblocks. 0 prefills a 24-token prompt in chunks of 8 while 1
    // and 2 (3 and 4 tokens) decode behind it, one superblock per token.
    let mut config = config(1, 1, 25);
    config.max_num_tokens = 15;
    config.chunk_unit = Some(8);
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(24), 1, 0).unwrap();
    s.add_request(1, &prompt(3), 20, 0).unwrap();
    s.add_request(2, &prompt(4), 20, 0).unwrap();
    let out = step(&mut s, 1);
    assert_eq!(out.context_lens, vec![8, 3, 4]);
    let out = step(&mut s, 1);
    assert_eq!((out.context_ids, out.context_lens), (vec![0], vec![8]));
    assert_eq!(s.ledger().free_superblocks(), 0);
    // Step 2: 1 needs a superblock and preempts 2 (5 superblocks), leaving 4 free. 0's
    // last chunk needs 8: 1's 5 superblocks would cover it, but taking them would make
    // 2's preemption futile. 0 waits; 1 decodes.
    let out = step(&mut s, 1);
    assert_eq!(
        (&out.preempted_ids, &out.preempted_requester_ids),
        (&vec![2], &vec![1])
    );
    assert_eq!(out.generation_ids, vec![1]);
    assert!(out.context_ids.is_empty(), "{}", out.summary());
    // The next step 0 may take 1's pages.
    let out = step(&mut s, 1);
    assert_eq!(
        (out.preempted_ids, out.preempted_requester_ids),
        (vec![1], vec![0])
    );
    assert_eq!(out.context_ids, vec![0]);
    run_to_end(&mut s);
}

#[test]
fn the_queue_head_may_preempt_past_the_bound_so_a_small_bound_cannot_deadlock() {
    // tpb 1, cp 1, 19 superblocks, bound 1, 8 tokens a step: 0 (19 tokens) and 1 (17
    // tokens, a step later) each fit alone. 0 preempts 1 once, which puts 1 at its bound;
    // 1 re-prefills in chunks. When 0 (the oldest live request) next runs out of pages,
    // it may still take 1's, instead of both sitting out until DeadlockError.
    let mut config = config(1, 1, 19);
    config.max_preemptions_per_request = 1;
    config.max_batch_size = 3;
    config.max_num_tokens = 8;
    config.chunk_unit = Some(1);
    config.deadlock_steps = 8;
    let specs = vec![Spec::new(0, 1, 18), Spec::new(1, 1, 16).at(1)];
    let mut group = Group::new(&config, Model::default());
    let result = group
        .run(&specs, RunOptions::default())
        .expect("no deadlock");
    assert_matches_reference(&specs, Model::default(), &result);
    assert!(result.preemptions_past_bound > 0);
    assert!(result.max_request_victim_choices > 1);
    assert!(result
        .victims
        .iter()
        .all(|&(victim, requester)| (victim, requester) == (1, 0)));
}

#[test]
fn only_the_queue_head_takes_a_victim_at_its_bound() {
    // tpb 1, cp 1, bound 1, 12 superblocks: 0 (4 tokens), 1 and 2 (3 tokens each)
    // decode, one superblock per token.
    let mut config = config(1, 1, 12);
    config.max_preemptions_per_request = 1;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(4), 8, 0).unwrap();
    s.add_request(1, &prompt(3), 8, 0).unwrap();
    s.add_request(2, &prompt(3), 8, 0).unwrap();
    loop {
        let out = step(&mut s, 1);
        if !out.preempted_ids.is_empty() {
            // 0 needed a page first: the newest, 2, goes and reaches its bound.
            assert_eq!(
                (out.preempted_ids, out.preempted_requester_ids),
                (vec![2], vec![0])
            );
            break;
        }
    }
    assert_eq!(s.request_metrics(2).unwrap().victim_choices, 1);
    // Whenever 2 is preempted again, it is for the queue head; 1 sits out instead.
    let mut past_bound = 0;
    for _ in 0..200 {
        if !s.has_unfinished() {
            break;
        }
        let head = s.queue_ids()[0];
        let out = step(&mut s, 1);
        for (&victim, &requester) in out.preempted_ids.iter().zip(&out.preempted_requester_ids) {
            if s.request_metrics(victim).unwrap().victim_choices > 1 {
                assert_eq!(requester, head, "step {}", out.step);
                past_bound += 1;
            }
        }
    }
    assert!(!s.has_unfinished());
    assert!(past_bound > 0, "the workload must push 2 past its bound");
    assert!(
        s.metrics().sat_out > 0,
        "1 must have sat out rather than take 2"
    );
}

// -- Priority admission (`admission_policy`) ---------------------------------------------

/// A scheduler of `config` with `admission` and requests `0..` of the given prompt lengths
/// and priorities (each `max_new` tokens), added in id order.
fn admitted_in(
    mut config: SchedulerConfig,
    admission: AdmissionPolicy,
    requests: &[(usize, i32)],
    max_new: u32,
) -> Scheduler {
    config.admission_policy = admission;
    let mut s = Scheduler::new(config).unwrap();
    for (id, &(len, priority)) in requests.iter().enumerate() {
        s.add_request(id as u64, &prompt(len), max_new, priority)
            .unwrap();
    }
    s
}

#[test]
fn priority_admission_admits_the_most_important_waiting_request_first() {
    // One prompt per step (a budget of one prompt, unchunked); each finishes at once.
    let mut one_at_a_time = config(1, 4, 16);
    one_at_a_time.max_num_tokens = 8;
    one_at_a_time.enable_chunked_prefill = false;
    let priorities = [0, 5, 1, 5, -2, 1];
    let requests: Vec<(usize, i32)> = priorities.iter().map(|&p| (8, p)).collect();
    for (admission, order) in [
        (AdmissionPolicy::Fcfs, vec![0, 1, 2, 3, 4, 5]),
        // Higher first, ties in arrival order.
        (AdmissionPolicy::Priority, vec![1, 3, 2, 5, 0, 4]),
    ] {
        let mut s = admitted_in(one_at_a_time.clone(), admission, &requests, 1);
        assert_eq!(s.queue_ids(), order, "{admission:?}");
        let admitted: Vec<u64> = (0..6).flat_map(|_| step(&mut s, 1).context_ids).collect();
        assert_eq!(admitted, order, "{admission:?}");
        assert!(!s.has_unfinished());
    }
}

#[test]
fn priority_admission_orders_extreme_priorities_and_keeps_arrival_order_within_one() {
    let priorities = [0, i32::MIN, i32::MAX, 0, i32::MIN, i32::MAX, -1, 1];
    let requests: Vec<(usize, i32)> = priorities.iter().map(|&p| (4, p)).collect();
    let s = admitted_in(config(1, 4, 16), AdmissionPolicy::Priority, &requests, 1);
    assert_eq!(s.queue_ids(), vec![2, 5, 7, 0, 3, 6, 1, 4]);
}

#[test]
fn under_priority_admission_a_more_important_arrival_preempts_and_a_less_important_one_waits() {
    // Pool of 4 superblocks (4 tokens each): request 0 takes 3, the newcomer needs 2.
    for (first, newcomer, preempts) in [(0, 5, true), (5, 0, false), (3, 3, false)] {
        let mut config = config(1, 4, 4);
        config.admission_policy = AdmissionPolicy::Priority;
        let mut s = Scheduler::new(config).unwrap();
        s.add_request(0, &prompt(12), 4, first).unwrap();
        step(&mut s, 1);
        s.add_request(1, &prompt(8), 4, newcomer).unwrap();
        let out = step(&mut s, 1);
        if preempts {
            assert_eq!(s.queue_ids(), vec![1, 0], "the newcomer is the queue head");
            assert_eq!(out.preempted_ids, vec![0]);
            assert_eq!(out.preempted_requester_ids, vec![1]);
            assert_eq!(out.context_ids, vec![1]);
        } else {
            // As under fcfs: nothing behind it to take pages from.
            assert_eq!(s.queue_ids(), vec![0, 1], "priorities {first}, {newcomer}");
            assert!(out.preempted_ids.is_empty() && out.suspended_ids.is_empty());
            assert!(!out.context_ids.contains(&1));
        }
        run_to_end(&mut s);
    }
    // Under fcfs the same newcomer waits (it is behind request 0 in arrival order).
    let mut s = Scheduler::new(config(1, 4, 4)).unwrap();
    s.add_request(0, &prompt(12), 4, 0).unwrap();
    step(&mut s, 1);
    s.add_request(1, &prompt(8), 4, 5).unwrap();
    assert!(step(&mut s, 1).preempted_ids.is_empty());
}

#[test]
fn under_priority_admission_a_victim_is_never_more_important_than_its_requester() {
    // Prompts that fill whole superblocks in a pool they fill exactly: every first decode
    // needs a superblock, so the queue head (the most important) must preempt.
    // Priorities of 0..=4: 0, -3, 0, -3, 1 -> queue 4, 0, 2, 1, 3.
    let requests = [(4, 0), (8, -3), (4, 0), (12, -3), (8, 1)];
    for (policy, victim) in [
        // vLLM's choice under policy="priority": the least important, newest among equals.
        (VictimPolicy::NewestFirst, 3),
        (VictimPolicy::Priority, 3),
        // The fewest computed tokens behind the head: 0 and 2 (4 each), the newer.
        (VictimPolicy::LeastComputedFirst, 2),
    ] {
        let mut config = config(1, 4, 9);
        config.victim_policy = policy;
        let mut s = admitted_in(config, AdmissionPolicy::Priority, &requests, 10);
        assert_eq!(s.queue_ids(), vec![4, 0, 2, 1, 3]);
        assert_eq!(step(&mut s, 7).context_ids, vec![4, 0, 2, 1, 3]);
        let out = s.schedule().unwrap().clone();
        assert_eq!(out.preempted_ids.first(), Some(&victim), "{policy:?}");
        assert_eq!(out.preempted_requester_ids.first(), Some(&4), "{policy:?}");
        let priority = |id: u64| requests[usize::try_from(id).unwrap()].1;
        for (v, r) in out.preempted_ids.iter().zip(&out.preempted_requester_ids) {
            assert!(priority(*v) <= priority(*r), "{policy:?}: {v} for {r}");
        }
        // The victim keeps its place for its re-prefill.
        assert_eq!(s.queue_ids(), vec![4, 0, 2, 1, 3], "{policy:?}");
        let n = out.num_samples();
        s.update(&vec![1; n], None).unwrap();
        run_to_end(&mut s);
    }
}

#[test]
fn under_priority_admission_the_most_important_waiting_request_holds_the_line() {
    // Request 0 (most important) holds 3 of 4 superblocks; request 1 (priority 1, needs one)
    // arrives before request 2 (priority 5, needs two). Under fcfs request 1 is admitted into
    // the free superblock; under priority request 2 goes first, cannot get its pages (no
    // victim behind it holds any) and nothing behind it may take them.
    for (admission, admitted) in [
        (AdmissionPolicy::Fcfs, true),
        (AdmissionPolicy::Priority, false),
    ] {
        let mut config = config(1, 4, 4);
        config.admission_policy = admission;
        let mut s = Scheduler::new(config).unwrap();
        s.add_request(0, &prompt(12), 1, 10).unwrap();
        s.add_request(1, &prompt(4), 1, 1).unwrap();
        s.add_request(2, &prompt(8), 1, 5).unwrap();
        s.schedule().unwrap();
        let out = s.last_output().clone();
        assert_eq!(out.context_ids[0], 0, "{admission:?}");
        assert_eq!(out.context_ids.contains(&1), admitted, "{admission:?}");
        assert!(!out.context_ids.contains(&2), "{admission:?}");
        assert!(out.preempted_ids.is_empty(), "{admission:?}");
        let n = out.num_samples();
        s.update(&vec![1; n], None).unwrap();
        run_to_end(&mut s);
    }
}

#[test]
fn under_priority_admission_a_held_admission_lets_the_prompts_admitted_behind_it_go_on() {
    // Request 0 prefills in chunks of 12 and holds pages request 1, more important, queued
    // ahead of it, needs: under guaranteed_no_evict it reserved the whole pool; with
    // preemption off (bound 0) it holds 12 of 18 and request 1 needs 7. Neither configuration
    // preempts, so request 0 goes on (waiting for it would wait for good), then request 1 is
    // admitted.
    for (capacity_policy, bound, newcomer) in [
        (CapacityPolicy::GuaranteedNoEvict, 8, 1),
        (CapacityPolicy::MaxUtilization, 0, 7),
    ] {
        let mut config = config(1, 1, 18);
        config.admission_policy = AdmissionPolicy::Priority;
        config.capacity_policy = capacity_policy;
        config.max_preemptions_per_request = bound;
        config.max_num_tokens = 12;
        config.chunk_unit = Some(1);
        config.deadlock_steps = 3;
        let mut s = Scheduler::new(config).unwrap();
        s.add_request(0, &prompt(17), 1, 0).unwrap();
        assert_eq!(chunks(&mut s), [(0, 0, 12)]);
        s.add_request(1, &prompt(newcomer), 1, 1).unwrap();
        assert_eq!(s.queue_ids(), vec![1, 0]);
        assert_eq!(chunks(&mut s), [(0, 12, 5)], "{capacity_policy:?}");
        assert_eq!(chunks(&mut s)[0].0, 1, "{capacity_policy:?}");
        run_to_end(&mut s);
    }
}

#[test]
fn priority_admission_keeps_every_step_exact_when_a_request_cuts_in_while_a_step_is_pending() {
    // Added between two schedules of one step ahead, the newcomer goes ahead of the queue:
    // the pending step's update still finds its entries, and the newcomer is first admitted in
    // the next step.
    let mut config = config(1, 4, 32);
    config.admission_policy = AdmissionPolicy::Priority;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(6), 3, 0).unwrap();
    s.add_request(1, &prompt(6), 3, 0).unwrap();
    let first = s.schedule().unwrap().clone();
    assert_eq!(first.context_ids, vec![0, 1]);
    s.add_request(2, &prompt(5), 2, 9).unwrap();
    assert_eq!(s.queue_ids(), vec![2, 0, 1]);
    let ahead = s.schedule().unwrap().clone();
    assert_eq!(ahead.generation_ids, vec![0, 1]);
    assert_eq!(ahead.context_ids, vec![2], "admitted at its place, first");
    assert!(s.update(&[7, 8], None).unwrap().is_empty());
    assert_eq!(s.tokens(0).unwrap(), [prompt(6), vec![7]].concat());
    assert_eq!(s.tokens(1).unwrap(), [prompt(6), vec![8]].concat());
    s.update(&[1, 2, 3], None).unwrap();
    assert_eq!(s.tokens(2).unwrap(), [prompt(5), vec![3]].concat());
    run_to_end(&mut s);
}

// -- The prefill cap (`long_prefill_token_threshold`) --------------------------------------

/// The context entries of the next step as `(id, start, len)`.
fn chunks(s: &mut Scheduler) -> Vec<(u64, u64, u64)> {
    let out = step(s, 1);
    (0..out.context_ids.len())
        .map(|i| {
            (
                out.context_ids[i],
                out.context_starts[i],
                out.context_lens[i],
            )
        })
        .collect()
}

/// cp 1, 4 tokens per block (the chunk unit), a roomy pool, 64 tokens a step.
fn capped(threshold: u32, adaptive: bool) -> SchedulerConfig {
    let mut config = config(1, 4, 64);
    config.max_num_tokens = 64;
    config.long_prefill_token_threshold = threshold;
    config.long_prefill_token_threshold_adaptive = adaptive;
    config
}

#[test]
fn the_prefill_cap_shares_the_budget_while_others_are_live() {
    let mut s = Scheduler::new(capped(16, false)).unwrap();
    s.add_request(0, &prompt(40), 2, 0).unwrap();
    s.add_request(1, &prompt(40), 2, 0).unwrap();
    assert_eq!(chunks(&mut s), [(0, 0, 16), (1, 0, 16)]);
    assert_eq!(chunks(&mut s), [(0, 16, 16), (1, 16, 16)]);
    // A rest within the cap completes in one chunk.
    assert_eq!(chunks(&mut s), [(0, 32, 8), (1, 32, 8)]);
    run_to_end(&mut s);
    // Without the cap the first takes the budget.
    let mut s = Scheduler::new(capped(0, false)).unwrap();
    s.add_request(0, &prompt(40), 2, 0).unwrap();
    s.add_request(1, &prompt(40), 2, 0).unwrap();
    assert_eq!(chunks(&mut s), [(0, 0, 40), (1, 0, 24)]);
}

#[test]
fn a_request_alone_is_not_capped() {
    let mut s = Scheduler::new(capped(16, false)).unwrap();
    s.add_request(0, &prompt(60), 2, 0).unwrap();
    assert_eq!(chunks(&mut s), [(0, 0, 60)]);
    // A decoding request counts as another live one.
    s.add_request(1, &prompt(60), 2, 0).unwrap();
    assert_eq!(chunks(&mut s), [(1, 0, 16)]);
}

#[test]
fn the_prefill_cap_rounds_a_partial_chunk_to_whole_units_and_has_a_floor_of_one() {
    // Threshold 18, unit 4: a rest of 18 completes, a rest of 19 gets 16.
    let mut s = Scheduler::new(capped(18, false)).unwrap();
    s.add_request(0, &prompt(18), 2, 0).unwrap();
    s.add_request(1, &prompt(19), 2, 0).unwrap();
    assert_eq!(chunks(&mut s), [(0, 0, 18), (1, 0, 16)]);
    // A threshold below the unit counts as one unit.
    let mut s = Scheduler::new(capped(3, false)).unwrap();
    s.add_request(0, &prompt(10), 2, 0).unwrap();
    s.add_request(1, &prompt(2), 2, 0).unwrap();
    assert_eq!(chunks(&mut s), [(0, 0, 4), (1, 0, 2)]);
    assert_eq!(chunks(&mut s), [(0, 4, 4)]);
}

#[test]
fn the_adaptive_prefill_cap_is_at_least_the_fair_share() {
    for (live, cap) in [(2u64, 32), (4, 16), (16, 8)] {
        let mut s = Scheduler::new(capped(8, true)).unwrap();
        for id in 0..live {
            s.add_request(id, &prompt(40), 2, 0).unwrap();
        }
        let first = chunks(&mut s);
        assert_eq!(first[0], (0, 0, cap), "{live} live");
        assert!(first.iter().all(|&(_, _, len)| len <= cap));
    }
}

#[test]
fn the_prefill_cap_caps_a_re_prefill_too() {
    // Request 0 decodes long in a pool of 8 superblocks and recompute-pauses request 1, which
    // then re-prefills its prompt and generated tokens in chunks of at most the cap while
    // request 0 is live.
    let mut config = capped(4, false);
    config.capacity_superblocks = 8;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(4), 20, 0).unwrap();
    s.add_request(1, &prompt(8), 16, 0).unwrap();
    let mut preempted = false;
    let mut refill = Vec::new();
    for _ in 0..200 {
        if !s.has_unfinished() {
            break;
        }
        let live = s.num_live();
        let out = step(&mut s, 1);
        for (i, &id) in out.context_ids.iter().enumerate() {
            if id == 1 && preempted && live > 1 {
                refill.push((out.context_starts[i], out.context_lens[i]));
            }
        }
        preempted |= out.preempted_ids.contains(&1);
    }
    assert!(!s.has_unfinished());
    assert!(preempted);
    assert!(refill.iter().all(|&(_, len)| len <= 4), "{refill:?}");
    assert!(
        refill.iter().any(|&(start, _)| start >= 8),
        "the re-prefill covers generated tokens: {refill:?}"
    );
}

#[test]
fn a_prefill_cap_without_chunked_prefill_is_refused() {
    let mut config = capped(16, false);
    config.enable_chunked_prefill = false;
    let err = Scheduler::new(config).unwrap_err();
    assert!(matches!(err, CoreError::Config { .. }), "{err}");
    assert!(
        err.to_string().contains("long_prefill_token_threshold"),
        "{err}"
    );
}
