//! Prefix caching: sharing, the eviction order, the ladder with shared victims, hits on
//! recompute, exact reverts, aborts of sharers, a brute-force oracle of the longest cached
//! prefix, and whole-group runs in every mode with outputs equal to caching off.

// Test data: token ids and lengths are small numbers.
#![expect(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    reason = "test data: small token ids and lengths"
)]

mod common;

use std::collections::BTreeMap;

use common::{
    assert_matches_reference, assert_matches_reference_with_aborts, Group, Model, RunMode,
    RunOptions, Spec,
};
use helix_kv_core::prefix_cache::{chain_keys, chain_seed};
use helix_kv_core::{
    CoreError, PreparedPrompt, RequestId, RequestState, ScheduleOutput, Scheduler, SchedulerConfig,
    ServingMode,
};

/// `cp` ranks, 4 tokens a page (`4 * cp` a superblock), `superblocks` of them, caching on.
fn cached(cp: u32, superblocks: u32) -> SchedulerConfig {
    let mut config = common::config(cp, 4, superblocks);
    config.enable_prefix_caching = true;
    config
}

/// Runs steps until nothing is live, feeding token 7 for every sample.
fn drain(s: &mut Scheduler) {
    for _ in 0..1000 {
        if s.queue_ids().is_empty() {
            return;
        }
        common::step(s, 7);
    }
    panic!("did not drain");
}

fn table(s: &Scheduler, id: RequestId) -> Vec<u32> {
    s.ledger().request(id).unwrap().table().to_vec()
}

/// A prompt of `shared` common tokens, then `own` tokens of request `id`.
fn prompt(shared: usize, own: usize, id: i32) -> Vec<i32> {
    (0..shared as i32)
        .map(|t| 100 + t)
        .chain((0..own as i32).map(|t| 10_000 * id + t))
        .collect()
}

#[test]
fn a_second_request_shares_the_cached_superblocks_of_its_prefix() {
    let mut s = Scheduler::new(cached(2, 32)).unwrap();
    // 8 tokens a superblock: 20 shared tokens = 2 full superblocks and 4 more.
    s.add_request(1, &prompt(20, 5, 1), 4, 0).unwrap();
    common::step(&mut s, 7); // request 1's prompt runs and completes
    s.add_request(2, &prompt(20, 9, 2), 4, 0).unwrap();
    let out = common::step(&mut s, 7);
    assert_eq!(out.context_ids, vec![2]);
    assert_eq!(
        out.context_starts,
        vec![16],
        "the first two superblocks are cached"
    );
    assert_eq!(out.context_lens, vec![13]);
    assert_eq!(
        table(&s, 2)[..2],
        table(&s, 1)[..2],
        "the tables name the same pages"
    );
    assert_ne!(table(&s, 2)[2], table(&s, 1)[2]);
    let m = s.metrics();
    assert_eq!((m.prefix_cache_queries, m.prefix_cache_hits), (25 + 29, 16));
    // Shared superblocks are counted once.
    assert_eq!(
        m.kv_used_superblocks,
        u32::try_from(table(&s, 1).len() + table(&s, 2).len() - 2).unwrap()
    );
    drain(&mut s);
    assert_eq!(
        s.ledger().free_superblocks(),
        32,
        "cached ones count as free"
    );
}

#[test]
fn the_last_token_is_always_computed() {
    let mut s = Scheduler::new(cached(1, 32)).unwrap();
    let p = prompt(16, 0, 0); // exactly four superblocks of 4 tokens
    s.add_request(1, &p, 1, 0).unwrap();
    drain(&mut s);
    s.add_request(2, &p, 1, 0).unwrap();
    let out = common::step(&mut s, 7);
    assert_eq!((out.context_starts[0], out.context_lens[0]), (12, 4));
}

#[test]
fn salts_keep_tenants_apart() {
    let mut s = Scheduler::new(cached(1, 32)).unwrap();
    let p = prompt(12, 3, 0);
    s.add_request_salted(1, &p, 2, 0, b"tenant-a").unwrap();
    drain(&mut s);
    s.add_request_salted(2, &p, 2, 0, b"tenant-b").unwrap();
    assert_eq!(common::step(&mut s, 7).context_starts, vec![0]);
    s.add_request_salted(3, &p, 2, 0, b"tenant-a").unwrap();
    assert_eq!(common::step(&mut s, 7).context_starts, vec![12]);
}

#[test]
fn a_prepared_prompt_is_added_as_add_request_salted_adds_it_whatever_the_superblock_size() {
    // One prepared prompt (keyed once, for the first scheduler's superblock size) added to
    // schedulers of three superblock sizes and one with caching off; each must run exactly
    // as a twin that was given the prompt by `add_request_salted`: the same hits, the same
    // state every step.
    let configs = [
        cached(2, 64),
        cached(2, 64),
        cached(1, 64),
        cached(4, 64),
        common::config(2, 4, 64),
    ];
    let mut prepared_side: Vec<Scheduler> = configs
        .iter()
        .map(|c| Scheduler::new(c.clone()).unwrap())
        .collect();
    let mut salted_side: Vec<Scheduler> = configs
        .iter()
        .map(|c| Scheduler::new(c.clone()).unwrap())
        .collect();
    let first = prompt(40, 3, 1);
    let second = prompt(40, 7, 2);
    let prepared = [
        PreparedPrompt::new(&first, b"t"),
        PreparedPrompt::new(&second, b"t"),
    ];
    assert_eq!(prepared[0].tokens(), first.as_slice());
    for (id, (tokens, prepared)) in [&first, &second].into_iter().zip(&prepared).enumerate() {
        let id = id as u64 + 1;
        for (a, b) in prepared_side.iter_mut().zip(salted_side.iter_mut()) {
            a.add_prepared(id, prepared, 3, 0).unwrap();
            b.add_request_salted(id, tokens, 3, 0, b"t").unwrap();
            assert_eq!(a.state_digest(), b.state_digest());
            let (out_a, out_b) = (common::step(a, 7), common::step(b, 7));
            assert_eq!(out_a.context_starts, out_b.context_starts);
            assert_eq!(a.state_digest(), b.state_digest());
        }
    }
    // The second prompt hit the first one's superblocks wherever caching is on.
    for (a, config) in prepared_side.iter().zip(&configs) {
        let hits = a.metrics().prefix_cache_hits;
        assert_eq!(hits > 0, config.enable_prefix_caching, "{config:?}");
    }
    // Refusals are `add_request_salted`'s, and change nothing.
    let mut s = Scheduler::new(cached(2, 64)).unwrap();
    let before = s.state_digest();
    let empty = PreparedPrompt::new(&[], b"");
    assert!(matches!(
        s.add_prepared(1, &empty, 3, 0),
        Err(CoreError::InvalidLength(_))
    ));
    assert!(matches!(
        s.add_prepared(1, &prepared[0], 0, 0),
        Err(CoreError::InvalidLength(_))
    ));
    assert_eq!(s.state_digest(), before);
}

#[test]
fn requests_added_from_one_prepared_prompt_share_it_until_they_change_it() {
    // Two schedulers take each request from one prepared prompt (sharing its tokens), in a
    // pool tight enough that requests are recompute-paused (their generated tokens folded
    // into their prompt, a write to the shared tokens); a third, the twin, is given its own
    // copies. Every step and every output is the twin's, on both, and the prompt is as made.
    let config = || {
        let mut config = cached(1, 12);
        config.max_preemptions_per_request = 1000;
        config
    };
    let mut shared: Vec<Scheduler> = (0..2).map(|_| Scheduler::new(config()).unwrap()).collect();
    let mut twin = Scheduler::new(config()).unwrap();
    let prompts: Vec<Vec<i32>> = (1..=3).map(|id| prompt(8, 2, id)).collect();
    let prepared: Vec<PreparedPrompt> = prompts
        .iter()
        .map(|p| PreparedPrompt::new(p, b""))
        .collect();
    for (id, (tokens, prepared)) in prompts.iter().zip(&prepared).enumerate() {
        let id = id as u64 + 1;
        for s in &mut shared {
            s.add_prepared(id, prepared, 20, 0).unwrap();
        }
        twin.add_request_salted(id, tokens, 20, 0, b"").unwrap();
    }
    let mut finished = Vec::new();
    for step in 0..1000u32 {
        if twin.queue_ids().is_empty() {
            break;
        }
        let expected = twin.schedule().unwrap().clone();
        let tokens: Vec<i32> = (0..expected.num_samples() as i32)
            .map(|i| i + step as i32)
            .collect();
        let done = twin.update(&tokens, None).unwrap().to_vec();
        for s in &mut shared {
            assert_eq!(s.schedule().unwrap(), &expected, "step {step}");
            assert_eq!(s.update(&tokens, None).unwrap(), done.as_slice());
            assert_eq!(s.state_digest(), twin.state_digest());
        }
        for id in done {
            let output = twin.take_output(id).unwrap();
            for s in &mut shared {
                assert_eq!(s.take_output(id).unwrap(), output);
            }
            finished.push(id);
        }
    }
    finished.sort_unstable();
    assert_eq!(finished, vec![1, 2, 3]);
    assert!(
        twin.metrics().preemptions > 0,
        "the pool made no recompute-pause"
    );
    for (prepared, tokens) in prepared.iter().zip(&prompts) {
        assert_eq!(prepared.tokens(), tokens.as_slice());
    }
}

#[test]
fn eviction_takes_the_least_recently_released_and_a_request_tail_first() {
    let mut s = Scheduler::new(cached(1, 6)).unwrap();
    // Request 1: 3 full superblocks of prompt, then request 2: 2 more, both finish.
    s.add_request(1, &prompt(0, 12, 1), 1, 0).unwrap();
    drain(&mut s);
    let first = {
        // Its pages are cached now: request 3 with its prompt finds them.
        s.add_request(3, &prompt(0, 12, 1), 1, 0).unwrap();
        let out = s.schedule().unwrap().clone();
        assert_eq!(out.context_starts, vec![8]);
        let t = table(&s, 3);
        s.revert().unwrap();
        s.abort(3).unwrap();
        t
    };
    s.add_request(2, &prompt(0, 8, 2), 1, 0).unwrap();
    drain(&mut s);
    // 6 pages: request 1's 3 (+ its decode page) and request 2's cached. A request that
    // needs 3 fresh pages takes the free ones, then evicts the oldest release: request 1's
    // tail (its last superblock first).
    let free_before = s.ledger().free_superblocks();
    assert_eq!(free_before, 6);
    s.add_request(4, &prompt(0, 20, 4), 1, 0).unwrap();
    common::step(&mut s, 7);
    let m = s.metrics();
    assert!(m.prefix_cache_evictions > 0);
    // Request 1's first superblock outlived its last one.
    s.add_request(5, &prompt(0, 12, 1), 1, 0).unwrap();
    let out = s.schedule().unwrap().clone();
    let evicted_tail = out.context_starts[0] < 8;
    assert!(evicted_tail, "request 1's tail was evicted first");
    if out.context_starts[0] > 0 {
        assert_eq!(table(&s, 5)[0], first[0], "its head stayed cached");
    }
}

#[test]
fn revert_after_hits_and_evictions_restores_the_cache_exactly() {
    for ahead in [false, true] {
        let mut s = Scheduler::new(cached(2, 10)).unwrap();
        for id in 1..=3 {
            s.add_request(id, &prompt(16, 8 * id as usize, id as i32), 2, 0)
                .unwrap();
            drain(&mut s);
        }
        if ahead {
            s.add_request(9, &prompt(0, 3, 9), 6, 0).unwrap();
            s.schedule().unwrap();
        }
        // Hits (the shared 16 tokens) and evictions (a long own part).
        s.add_request(4, &prompt(16, 40, 4), 2, 0).unwrap();
        let before = (
            s.state_digest(),
            s.ledger().state_digest(),
            s.ledger().clone(),
        );
        let out = s.schedule().unwrap().clone();
        assert!(out.context_ids.contains(&4), "ahead={ahead}: {out:?}");
        assert_ne!(s.ledger().state_digest(), before.1);
        s.revert().unwrap();
        assert_eq!(s.ledger(), &before.2, "ahead={ahead}");
        assert_eq!(
            (s.state_digest(), s.ledger().state_digest()),
            (before.0, before.1)
        );
    }
}

#[test]
fn a_victim_frees_only_what_it_alone_references() {
    // Requests 1 and 2 share 2 superblocks; a third needs pages. Victim 2 frees only its
    // own superblocks, and it is recompute-paused, not suspended (a shared superblock is
    // never copied out from under request 1), even with a host tier.
    let mut config = cached(1, 12);
    config.host_tier_superblocks = 12;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(8, 3, 1), 30, 0).unwrap();
    common::step(&mut s, 7);
    s.add_request(2, &prompt(8, 3, 2), 30, 0).unwrap();
    common::step(&mut s, 7);
    assert_eq!(table(&s, 1)[..2], table(&s, 2)[..2]);
    assert_eq!(s.ledger().exclusive_superblocks(2).unwrap(), 1);
    let mut preempted = Vec::new();
    for _ in 0..200 {
        let out = common::step(&mut s, 7);
        preempted.extend(out.preempted_ids.iter().copied());
        assert!(out.suspended_ids.is_empty(), "a sharer was suspended");
        if !preempted.is_empty() {
            break;
        }
    }
    assert_eq!(preempted, vec![2]);
    // Its re-prefill finds its prefix (request 1 still holds it): a recompute hit.
    for _ in 0..200 {
        common::step(&mut s, 7);
        if s.metrics().prefix_cache_recompute_hits > 0 {
            break;
        }
    }
    assert!(s.metrics().prefix_cache_recompute_hits >= 8);
}

#[test]
fn aborting_a_sharer_keeps_the_superblocks_of_the_other() {
    let mut s = Scheduler::new(cached(1, 16)).unwrap();
    s.add_request(1, &prompt(8, 2, 1), 10, 0).unwrap();
    common::step(&mut s, 7);
    s.add_request(2, &prompt(8, 2, 2), 10, 0).unwrap();
    common::step(&mut s, 7);
    let shared = table(&s, 1)[..2].to_vec();
    assert!(s.abort(1).unwrap());
    assert_eq!(table(&s, 2)[..2], shared[..]);
    for &page in &shared {
        assert_eq!(s.ledger().prefix_cache().unwrap().refs(page), 1);
    }
    drain(&mut s);
}

#[test]
fn reset_drops_unreferenced_keys_and_is_refused_while_a_step_is_pending() {
    let mut s = Scheduler::new(cached(1, 16)).unwrap();
    s.add_request(1, &prompt(12, 1, 1), 1, 0).unwrap();
    drain(&mut s);
    s.add_request(2, &prompt(12, 1, 2), 1, 0).unwrap();
    s.schedule().unwrap();
    let before = common::observable(&s);
    assert!(matches!(
        s.reset_prefix_cache(),
        Err(CoreError::InvalidState(_))
    ));
    assert_eq!(common::observable(&s), before);
    s.revert().unwrap();
    assert!(s.reset_prefix_cache().unwrap() > 0);
    assert_eq!(
        common::step(&mut s, 7).context_starts,
        vec![0],
        "nothing cached now"
    );
    // Request 2 finished in that step: its 3 full superblocks are cached, then dropped.
    assert_eq!(s.reset_prefix_cache().unwrap(), 3);
    assert_eq!(s.reset_prefix_cache().unwrap(), 0);
    assert_eq!(s.ledger().free_superblocks(), 16);
}

#[test]
fn caching_off_is_the_scheduler_without_it() {
    // The same calls: equal schedules and no cache in the ledger. The prompts share no
    // full superblock (10 common tokens would be one, shared by the burst in its first step).
    let mut off = Scheduler::new(common::config(2, 4, 12)).unwrap();
    let mut on = Scheduler::new(cached(2, 12)).unwrap();
    for id in 0..6 {
        let p = prompt(7, 6, i32::try_from(id).unwrap());
        off.add_request(id, &p, 8, 0).unwrap();
        on.add_request(id, &p, 8, 0).unwrap();
    }
    assert!(off.ledger().prefix_cache().is_none());
    for _ in 0..60 {
        if off.queue_ids().is_empty() {
            break;
        }
        let a = common::step(&mut off, 7);
        let b = common::step(&mut on, 7);
        assert_eq!(a.generation_ids, b.generation_ids);
    }
}

/// The longest cached prefix, computed naively: the superblocks of every prefix some
/// request computed, by content, minus those evicted since (replayed from the ledger's
/// eviction counter is not possible from outside, so the oracle checks the scheduler's
/// hit against what could be cached: never longer, and equal when nothing was evicted).
#[test]
fn the_longest_cached_prefix_matches_a_brute_force_oracle() {
    let mut rng = common::Rng::new(11);
    for case in 0..40u64 {
        let per = 8usize; // cp 2 x 4 tokens
        let mut s = Scheduler::new(cached(2, 64)).unwrap();
        // Prompts over a tiny alphabet of superblocks, so prefixes repeat.
        let pieces: Vec<Vec<i32>> = (0..3)
            .map(|p| (0..per as i32).map(|t| 1000 * p + t).collect())
            .collect();
        let mut computed: Vec<Vec<i32>> = Vec::new();
        for id in 0..12u64 {
            let blocks = 1 + rng.below(4) as usize;
            let mut p: Vec<i32> = (0..blocks)
                .flat_map(|_| pieces[rng.below(3) as usize].clone())
                .collect();
            p.extend((0..rng.below(6) as i32).map(|t| 7000 + t));
            s.add_request(id, &p, 1, 0).unwrap();
            let out = s.schedule().unwrap().clone();
            let tokens = vec![7; out.num_samples()];
            s.update(&tokens, None).unwrap();
            // Oracle: the longest run of full superblocks some earlier request computed
            // (every earlier prompt ran whole and nothing was evicted: 64 superblocks).
            let mut expect = 0;
            while expect + per < p.len()
                && computed
                    .iter()
                    .any(|q| q.len() >= expect + per && q[..expect + per] == p[..expect + per])
            {
                expect += per;
            }
            assert_eq!(s.metrics().prefix_cache_evictions, 0);
            assert_eq!(
                out.context_starts,
                vec![expect as u64],
                "case {case} request {id}"
            );
            computed.push(p);
            drain(&mut s);
        }
    }
}

fn shared_specs(n: u64, shared: usize) -> Vec<Spec> {
    (0..n)
        .map(|i| {
            let mut spec = Spec::new(i, 6 + (i as usize * 5) % 11, 14);
            spec.prompt = (0..shared as i32)
                .map(|t| 300 + t)
                .chain(spec.prompt)
                .collect();
            spec.at(i / 2)
        })
        .collect()
}

fn group_run(config: &SchedulerConfig, specs: &[Spec], options: RunOptions) -> common::RunResult {
    let mut group = Group::new(config, Model::default());
    let result = group.run(specs, options).expect("run");
    assert_matches_reference(specs, Model::default(), &result);
    result
}

#[test]
fn group_runs_with_caching_equal_the_reference_in_every_mode() {
    let mut hits = BTreeMap::new();
    let mut same_step = BTreeMap::new();
    for cp in [1u32, 2, 4] {
        for mode in [RunMode::Plain, RunMode::Overlap] {
            for host in [0u32, 16] {
                for (revert, seed) in [(0u64, 1u64), (150, 2)] {
                    let mut config = cached(cp, 0);
                    let per = u64::from(4 * cp);
                    config.capacity_superblocks = u32::try_from(200_u64.div_ceil(per)).unwrap();
                    config.host_tier_superblocks = host;
                    config.max_num_tokens = 48;
                    config.chunk_unit = Some(4);
                    let specs = shared_specs(10, 24);
                    let options = RunOptions {
                        revert_per_mille: revert,
                        seed,
                        max_steps: 5000,
                        mode,
                        reset_cache_per_mille: 20,
                        ..RunOptions::default()
                    };
                    let result = group_run(&config, &specs, options);
                    *hits.entry(cp).or_insert(0) += result.cached_tokens;
                    *same_step.entry(cp).or_insert(0) += result.same_step_cached_tokens;
                    assert!(
                        result.preemptions + result.suspensions > 0,
                        "cp {cp}: no pressure"
                    );
                }
            }
        }
    }
    assert!(hits.values().all(|&h| h > 0), "{hits:?}");
    // Two requests arrive a step: the second shares the first's system prompt in it.
    assert!(same_step.values().all(|&h| h > 0), "{same_step:?}");
}

#[test]
fn group_runs_with_caching_and_aborts_and_eos() {
    for cp in [1u32, 2, 4] {
        for mode in [RunMode::Plain, RunMode::Overlap] {
            let mut config = cached(cp, 0);
            config.capacity_superblocks =
                u32::try_from(240_u64.div_ceil(u64::from(4 * cp))).unwrap();
            config.host_tier_superblocks = 8;
            let model = Model {
                vocab: 24,
                eos: Some(5),
            };
            let specs: Vec<Spec> = shared_specs(10, 16)
                .into_iter()
                .enumerate()
                .map(|(i, s)| match i % 3 {
                    0 => s.clone().abort_at(s.arrival_step + 3),
                    1 => s.clone().abort_while_pending(s.arrival_step + 5),
                    _ => s,
                })
                .collect();
            let mut group = Group::new(&config, model);
            let options = RunOptions {
                revert_per_mille: 100,
                seed: 3,
                max_steps: 5000,
                mode,
                reset_cache_per_mille: 150,
                ..RunOptions::default()
            };
            let result = group.run(&specs, options).expect("run");
            assert!(mode == RunMode::Overlap || result.cache_resets > 0);
            assert_matches_reference_with_aborts(&specs, model, &result);
        }
    }
}

#[test]
fn disaggregated_and_non_helix_servers_cache_too() {
    for (mode, cp) in [
        (ServingMode::NonHelix, 1u32),
        (ServingMode::DisaggregatedGeneration, 2),
    ] {
        let mut config = cached(cp, 0);
        config.serving_mode = mode;
        config.capacity_superblocks = 120;
        let specs = shared_specs(6, 16);
        let result = group_run(
            &config,
            &specs,
            RunOptions {
                max_steps: 5000,
                ..RunOptions::default()
            },
        );
        assert!(result.cached_tokens > 0, "{mode:?}");
    }
}

#[test]
fn attaching_pages_that_are_not_cached_is_refused_unchanged() {
    let mut s = Scheduler::new(cached(1, 8)).unwrap();
    s.add_request(1, &prompt(8, 1, 1), 1, 0).unwrap();
    drain(&mut s);
    let mut ledger = s.ledger().clone();
    ledger.add(5, 8).unwrap();
    let cached_page = (0..8)
        .find(|&p| ledger.prefix_cache().unwrap().key_of(p).is_some())
        .unwrap();
    let before = ledger.clone();
    for pages in [vec![99], vec![u32::MAX], vec![cached_page, cached_page]] {
        assert!(matches!(
            ledger.attach_cached(5, &pages),
            Err(CoreError::InvalidArgument(_))
        ));
        assert_eq!(ledger, before);
    }
    assert_eq!(ledger.prefix_cache().unwrap().refs(u32::MAX), 0);
    ledger.attach_cached(5, &[cached_page]).unwrap();
    assert_eq!(ledger.prefix_cache().unwrap().refs(cached_page), 1);
}

/// The configuration of the issue-39 scenarios: one rank, 2 tokens a superblock, 4
/// superblocks, a host tier of 4, prefix caching on.
fn tiny_tiered() -> SchedulerConfig {
    let mut config = common::config(1, 2, 4);
    config.enable_prefix_caching = true;
    config.host_tier_superblocks = 4;
    config
}

/// Runs steps 0 and 1 of the issue-39 scenario on `s`: B (id 2) and R (id 3) decode, A
/// (id 1) finishes in step 1 and leaves its first superblock cached; R was suspended in
/// step 1 (for B), and its first superblock (keyed then) was evicted by A. Returns the
/// page caching A's prefix.
fn a_cached_and_r_suspended(s: &mut Scheduler) -> u32 {
    s.add_request(2, &[20, 21], 6, 0).unwrap();
    s.add_request(1, &[10, 11], 2, 0).unwrap();
    s.add_request(3, &[30, 31, 32], 5, 0).unwrap();
    common::step(s, 7); // every prompt completes
    let out = common::step(s, 7);
    assert_eq!(out.suspended_ids, vec![3], "R is suspended for B");
    assert!(s.take_output(1).is_ok(), "A finished");
    let cache = s.ledger().prefix_cache().unwrap();
    let cached: Vec<u32> = (0..4)
        .filter(|&p| cache.key_of(p).is_some() && cache.refs(p) == 0)
        .collect();
    assert_eq!(
        cached.len(),
        1,
        "A's first superblock is cached, unreferenced"
    );
    cached[0]
}

/// Issue 39: a request resumed in step t onto a page that still held another request's
/// cached KV, recompute-paused by step t+1 (planned while t is pending), then both steps
/// reverted. Neither step ran, so the page never held the resumed request's KV (and a
/// copy-in that did happen overwrote the other request's): nothing may be served from
/// it as a hit, neither to the paused request's re-prefill nor to one with A's prefix.
#[test]
fn a_resume_reverted_under_a_recompute_pause_keys_nothing_it_did_not_copy_in() {
    let mut s = Scheduler::new(tiny_tiered()).unwrap();
    let a_page = a_cached_and_r_suspended(&mut s);
    let t = s.schedule().unwrap().clone();
    assert_eq!(t.resumed_ids, vec![3]);
    assert!(
        t.resumed_block_ids.contains(&(a_page as i32)),
        "R resumes onto A's page"
    );
    let ahead = s.schedule().unwrap().clone();
    assert_eq!(ahead.preempted_ids, vec![3], "step t+1 recompute-pauses R");
    s.revert().unwrap();
    s.revert().unwrap();
    // A request with A's prefix: A's page may hold R's KV now (a copy-in that ran), or
    // still A's (one that did not). No hit is right in this workload: nobody else has
    // R's tokens, and A's page is not known to hold A's KV any more.
    s.add_request(4, &[10, 11, 12], 2, 0).unwrap();
    let mut admitted = Vec::new();
    for _ in 0..100 {
        if s.queue_ids().is_empty() {
            break;
        }
        let out = common::step(&mut s, 7);
        for (i, &id) in out.context_ids.iter().enumerate() {
            assert_eq!(
                out.context_cached_lens[i], 0,
                "request {id} hits a superblock whose KV was never written: {out:?}"
            );
            admitted.push(id);
        }
    }
    assert!(
        admitted.contains(&3) && admitted.contains(&4),
        "{admitted:?}"
    );
}

/// The same scenario: once both steps are reverted, the recompute-paused request
/// re-prefills and nothing will read its host copy (the resume that would have was
/// reverted): its host pages are free again, not held until it retires.
#[test]
fn a_resume_reverted_under_a_recompute_pause_frees_its_host_pages() {
    let mut s = Scheduler::new(tiny_tiered()).unwrap();
    a_cached_and_r_suspended(&mut s);
    assert_eq!(s.host_used_superblocks(), 2);
    s.schedule().unwrap();
    let ahead = s.schedule().unwrap().clone();
    assert_eq!(ahead.preempted_ids, vec![3]);
    s.revert().unwrap();
    assert_eq!(
        s.host_used_superblocks(),
        2,
        "step t's copy-in may still read them"
    );
    s.revert().unwrap();
    assert_eq!(s.request_state(3).unwrap(), RequestState::Waiting);
    assert_eq!(
        s.host_used_superblocks(),
        0,
        "R re-prefills: its host copy is free"
    );
    assert_eq!(
        s.metrics().resumed_superblocks,
        0,
        "nothing was copied back in"
    );
    drain(&mut s);
    assert_eq!(s.host_used_superblocks(), 0);
}

/// The abort scenario of issue 39 (one step ahead): R (id 3), suspended in step 1, is
/// resumed by step 4, planned ahead of step 3 (F finished at step 2's update and made room);
/// its abort is requested while both are pending, and step 3's update retires it, held for
/// step 4 (still pending). Returns step 4.
fn r_resumed_ahead_then_retired(s: &mut Scheduler) -> ScheduleOutput {
    s.add_request(1, &[40, 41], 3, 0).unwrap(); // F: finishes at step 2's update
    s.add_request(2, &[20, 21, 22], 5, 0).unwrap(); // H
    s.add_request(3, &[30, 31], 5, 0).unwrap(); // R
    common::step(s, 7);
    let out = common::step(s, 7);
    assert_eq!(out.suspended_ids, vec![3], "R is suspended for F");
    let older = s.schedule().unwrap().clone(); // step 2: F's last token; H sits out
    assert!(older.resumed_ids.is_empty(), "no room for R yet: {older:?}");
    let ahead = s.schedule().unwrap().clone(); // step 3, planned ahead of step 2
    assert!(ahead.resumed_ids.is_empty(), "{ahead:?}");
    s.update(&vec![7; older.num_samples()], None).unwrap(); // F finishes: room
    s.take_output(1).unwrap();
    let resuming = s.schedule().unwrap().clone(); // step 4, planned ahead of step 3
    assert_eq!(resuming.resumed_ids, vec![3], "{resuming:?}");
    s.abort(3).unwrap();
    s.update(&vec![7; ahead.num_samples()], None).unwrap(); // retires R, held for step 4
    assert!(s.take_output(3).is_ok());
    resuming
}

/// Issue 39, the same class through another path: a request resumed by the step planned
/// ahead and aborted while it is pending is retired by the older step's update (held for
/// the newer step). What it computed is kept cached as it retires, but its pages hold its
/// KV only once the newer step's copy-in ran: reverted, they may hold anything.
#[test]
fn an_abort_retiring_a_request_whose_resume_is_pending_keys_nothing_of_it() {
    let mut s = Scheduler::new(tiny_tiered()).unwrap();
    let resuming = r_resumed_ahead_then_retired(&mut s);
    // Step 4 did not run: R's copy-in may or may not have. Nothing is cached under R's
    // prefix (its own superblock was evicted by F in step 1), and the page its resume
    // copied into caches nothing: it may hold R's KV or F's.
    s.revert().unwrap();
    let cache = s.ledger().prefix_cache().unwrap();
    let mut r_keys = Vec::new();
    chain_keys(chain_seed(b""), &[30, 31], 2, &mut r_keys);
    assert_eq!(
        cache.lookup(r_keys[0]),
        None,
        "R's reverted copy-in is keyed"
    );
    for &page in &resuming.resumed_block_ids {
        assert_eq!(
            cache.key_of(u32::try_from(page).unwrap()),
            None,
            "page {page} may hold R's KV or F's"
        );
    }
}

/// The same scenario, the host tier: the retired request's host copy is what step 4's
/// copy-in reads, so it stays taken until step 4 closes (no suspend planned meanwhile may
/// be given its host pages), and it counts as copied back in only if step 4 runs.
#[test]
fn a_request_retired_while_its_resume_is_pending_keeps_its_host_copy_until_the_resume_closes() {
    for runs in [false, true] {
        let mut s = Scheduler::new(tiny_tiered()).unwrap();
        let resuming = r_resumed_ahead_then_retired(&mut s);
        assert_eq!(s.host_used_superblocks(), 1, "step 4's copy-in reads it");
        assert_eq!(s.metrics().resumed_superblocks, 0);
        if runs {
            s.update(&vec![7; resuming.num_samples()], None).unwrap();
        } else {
            s.revert().unwrap();
        }
        assert_eq!(s.host_used_superblocks(), 0, "runs={runs}");
        assert_eq!(
            s.metrics().resumed_superblocks,
            u64::from(runs),
            "copied back in only by a step that ran (runs={runs})"
        );
    }
}

/// Issue 39, one step ahead: the older step evicts a cached prefix from page P for a decode;
/// the step planned ahead frees P (its victim) and resumes a request onto it. Both are
/// reverted: the newer step's copy-in may have overwritten P, so the older step's revert
/// must not give P its evicted prefix back either.
#[test]
fn reverting_both_steps_puts_no_prefix_back_on_a_page_the_newer_step_copied_into() {
    let mut config = tiny_tiered();
    config.victim_policy = helix_kv_core::VictimPolicy::Priority;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &[50], 6, 0).unwrap(); // H: stops on EOS at step 1
    s.add_request(2, &[60, 61, 62], 5, -1).unwrap(); // R: the victim of choice
    s.add_request(3, &[70], 6, 0).unwrap(); // X
    common::step(&mut s, 7); // every prompt completes; R's first superblock is keyed
    let older_of_all = s.schedule().unwrap().clone(); // step 1: H's token is EOS
    let t = s.schedule().unwrap().clone(); // step 2: H suspends R, X evicts R's cached page
    assert_eq!(t.suspended_ids, vec![2], "{t:?}");
    let eos: Vec<bool> = older_of_all.sample_ids().map(|id| id == 1).collect();
    s.update(&vec![7; older_of_all.num_samples()], Some(&eos))
        .unwrap();
    s.take_output(1).unwrap();
    let ahead = s.schedule().unwrap().clone(); // step 3: R (now the head) resumes over X
    assert_eq!(ahead.resumed_ids, vec![2], "{ahead:?}");
    let mut r_keys = Vec::new();
    chain_keys(chain_seed(b""), &[60, 61], 2, &mut r_keys);
    s.revert().unwrap();
    s.revert().unwrap();
    let cache = s.ledger().prefix_cache().unwrap();
    for &page in &ahead.resumed_block_ids {
        assert_eq!(
            cache.key_of(u32::try_from(page).unwrap()),
            None,
            "page {page} may hold R's resumed KV: {t:?} {ahead:?}"
        );
    }
    if let Some(page) = cache.lookup(r_keys[0]) {
        assert!(!ahead.resumed_block_ids.contains(&(page as i32)));
    }
}

/// Issue 39, the copy-in rule alone (plain): a step resumes a request onto a page caching
/// another request's prefix, evicting it, and is reverted. Whether its copy-in ran or not
/// is the executor's (docs/internals/scheduler.md): the page may hold either KV, so the
/// revert does not put the evicted prefix back (every other eviction it does).
#[test]
fn a_reverted_resume_does_not_put_back_the_prefix_it_evicted_from_its_pages() {
    let mut s = Scheduler::new(tiny_tiered()).unwrap();
    let a_page = a_cached_and_r_suspended(&mut s);
    let mut a_keys = Vec::new();
    chain_keys(chain_seed(b""), &[10, 11], 2, &mut a_keys);
    assert_eq!(
        s.ledger().prefix_cache().unwrap().lookup(a_keys[0]),
        Some(a_page)
    );
    let out = s.schedule().unwrap().clone();
    assert!(out.resumed_block_ids.contains(&(a_page as i32)), "{out:?}");
    let pending = s.ledger().prefix_cache().unwrap();
    assert!(
        pending.copies_in(a_page),
        "marked while the copy-in is pending"
    );
    s.revert().unwrap();
    let cache = s.ledger().prefix_cache().unwrap();
    assert!(!cache.copies_in(a_page), "the mark ends with the step");
    assert_eq!(
        cache.lookup(a_keys[0]),
        None,
        "A's prefix is served from a page R's copy-in may have overwritten"
    );
    assert_eq!(cache.key_of(a_page), None);
    assert_eq!(
        s.ledger().free_superblocks(),
        2,
        "the page is free, as a page nobody caches"
    );
    // A request with A's prompt computes it again (and caches it again).
    s.add_request(4, &[10, 11, 12], 1, 0).unwrap();
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.context_cached_lens.iter().sum::<u64>(), 0, "{out:?}");
}

// Same-step sharing: requests admitted in one step share the full superblocks an earlier
// context entry of that step computes.

/// Updates the oldest pending step (its output `out`), feeding `token` for every sample.
fn update(s: &mut Scheduler, out: &ScheduleOutput, token: i32) -> Vec<RequestId> {
    s.update(&vec![token; out.num_samples()], None)
        .unwrap()
        .to_vec()
}

#[test]
fn a_burst_with_one_prompt_computes_it_once_in_its_first_step() {
    for cp in [1u32, 2, 4] {
        let per = 4 * cp as usize;
        let mut s = Scheduler::new(cached(cp, 64)).unwrap();
        // Four full superblocks and two tokens, three times, in one step.
        let p = prompt(4 * per + 2, 0, 0);
        for id in 1..=3 {
            s.add_request(id, &p, 3, 0).unwrap();
        }
        let out = s.schedule().unwrap().clone();
        assert_eq!(out.context_ids, vec![1, 2, 3]);
        let shared = 4 * per as u64;
        assert_eq!(out.context_starts, vec![0, shared, shared], "cp {cp}");
        assert_eq!(out.context_cached_lens, vec![0, shared, shared]);
        assert_eq!(out.context_lens, vec![shared + 2, 2, 2]);
        assert_eq!(out.num_tokens, shared + 6, "the prompt is computed once");
        // Every full superblock but the last is the first request's page; the tails differ.
        let first = table(&s, 1);
        for id in [2, 3] {
            assert_eq!(table(&s, id)[..4], first[..4]);
            assert_ne!(table(&s, id)[4], first[4]);
        }
        assert_eq!(s.ledger().used_superblocks(), 5 + 2);
        let cache = s.ledger().prefix_cache().unwrap();
        assert!(
            first.iter().all(|&page| cache.key_of(page).is_none()),
            "nothing is keyed before the step ran"
        );
        update(&mut s, &out, 7);
        let m = s.metrics();
        assert_eq!(m.prefix_cache_queries, 3 * (shared + 2));
        assert_eq!(m.prefix_cache_hits, 2 * shared);
        assert_eq!(m.prefix_cache_same_step_hits, 2 * shared);
        let cache = s.ledger().prefix_cache().unwrap();
        assert!(first[..4].iter().all(|&page| cache.key_of(page).is_some()));
        // A later request hits the same pages through the cache: no same-step hit.
        s.add_request(4, &p, 3, 0).unwrap();
        let out = common::step(&mut s, 7);
        assert_eq!(out.context_cached_lens, vec![shared]);
        assert_eq!(table(&s, 4)[..4], first[..4]);
        assert_eq!(s.metrics().prefix_cache_same_step_hits, 2 * shared);
        drain(&mut s);
        assert_eq!(s.ledger().free_superblocks(), 64);
    }
}

#[test]
fn a_prompt_of_whole_superblocks_shares_all_but_its_last() {
    let mut s = Scheduler::new(cached(1, 32)).unwrap();
    let p = prompt(16, 0, 0); // four superblocks of 4 tokens
    s.add_request(1, &p, 1, 0).unwrap();
    s.add_request(2, &p, 1, 0).unwrap();
    let out = common::step(&mut s, 7);
    assert_eq!(out.context_starts, vec![0, 12]);
    assert_eq!(out.context_lens, vec![16, 4]);
}

#[test]
fn shared_prefixes_share_their_common_superblocks_and_salts_keep_tenants_apart() {
    let mut s = Scheduler::new(cached(1, 64)).unwrap();
    // 10 common tokens: two full superblocks; request 3 has another salt.
    s.add_request(1, &prompt(10, 7, 1), 2, 0).unwrap();
    s.add_request(2, &prompt(10, 3, 2), 2, 0).unwrap();
    s.add_request_salted(3, &prompt(10, 5, 3), 2, 0, b"tenant")
        .unwrap();
    s.add_request_salted(4, &prompt(10, 2, 4), 2, 0, b"tenant")
        .unwrap();
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.context_starts, vec![0, 8, 0, 8]);
    assert_eq!(table(&s, 2)[..2], table(&s, 1)[..2]);
    assert_eq!(table(&s, 4)[..2], table(&s, 3)[..2]);
    assert_ne!(table(&s, 3)[0], table(&s, 1)[0]);
    update(&mut s, &out, 7);
    assert_eq!(s.metrics().prefix_cache_same_step_hits, 16);
}

#[test]
fn a_chunk_shares_only_the_superblocks_its_writer_completes_in_the_step() {
    // Per request at most 8 tokens a step while others are live: the first request's
    // chunk completes two superblocks (0..8), the second shares them and computes 8..16
    // itself; the next step the first goes on (8..16 its own) and nothing else is shared.
    let mut config = cached(1, 32);
    config.chunk_unit = Some(4);
    config.long_prefill_token_threshold = 8;
    let mut s = Scheduler::new(config).unwrap();
    let p = prompt(18, 0, 0);
    s.add_request(1, &p, 2, 0).unwrap();
    s.add_request(2, &p, 2, 0).unwrap();
    let out = common::step(&mut s, 7);
    assert_eq!(out.context_starts, vec![0, 8]);
    assert_eq!(out.context_lens, vec![8, 8]);
    assert_eq!(out.context_cached_lens, vec![0, 8]);
    assert_eq!(table(&s, 1).len(), 2);
    assert_eq!(table(&s, 2)[..2], table(&s, 1)[..2]);
    assert_eq!(s.metrics().prefix_cache_same_step_hits, 8);
    // Superblocks 2 and 3 were computed by both (request 2 keyed them first).
    let out = common::step(&mut s, 7);
    assert_eq!(out.context_starts, vec![8, 16]);
    assert_eq!(s.metrics().prefix_cache_same_step_hits, 8);
    drain(&mut s);
}

#[test]
fn a_superblock_a_chunk_completes_is_shared_whoever_computed_its_start() {
    // cp 2 with 4-token pages: 8-token superblocks, chunks of 4-token units. The first
    // request's first chunk ends inside superblock 1 (0..12); its second (12..20, with the
    // second request admitted) completes it: the second request shares superblocks 0 and 1.
    let mut config = cached(2, 32);
    config.chunk_unit = Some(4);
    config.max_num_tokens = 14;
    let mut s = Scheduler::new(config).unwrap();
    let p = prompt(21, 0, 0);
    s.add_request(1, &p, 2, 0).unwrap();
    let out = common::step(&mut s, 7);
    assert_eq!((out.context_starts[0], out.context_lens[0]), (0, 12));
    s.add_request(2, &p, 2, 0).unwrap();
    let out = common::step(&mut s, 7);
    assert_eq!(out.context_ids, vec![1, 2]);
    // Superblock 0 was keyed at the first update; superblock 1 is this step's.
    assert_eq!(out.context_starts, vec![12, 16]);
    assert_eq!(out.context_lens, vec![9, 5]);
    assert_eq!(table(&s, 2)[..2], table(&s, 1)[..2]);
    assert_eq!(s.metrics().prefix_cache_same_step_hits, 8);
    assert_eq!(s.metrics().prefix_cache_hits, 16);
}

#[test]
fn reverting_a_burst_undoes_its_sharing_exactly() {
    for ahead in [false, true] {
        let mut s = Scheduler::new(cached(2, 24)).unwrap();
        // Something cached (hit by the burst, its release stamps kept) and, one step
        // ahead, an older pending step.
        s.add_request(8, &prompt(16, 1, 8), 1, 0).unwrap();
        drain(&mut s);
        if ahead {
            s.add_request(9, &prompt(0, 3, 9), 6, 0).unwrap();
            s.schedule().unwrap();
        }
        for id in 1..=3 {
            s.add_request(id, &prompt(16, 30, 0), 2, 0).unwrap();
        }
        let before = (
            s.state_digest(),
            s.ledger().state_digest(),
            s.ledger().clone(),
        );
        let older = s.last_output().clone();
        let out = s.schedule().unwrap().clone();
        assert_eq!(out.context_ids, vec![1, 2, 3], "ahead={ahead}");
        assert_eq!(out.context_cached_lens, vec![16, 40, 40]);
        assert_eq!(table(&s, 2)[..5], table(&s, 1)[..5]);
        s.revert().unwrap();
        assert_eq!(s.ledger(), &before.2, "ahead={ahead}");
        assert_eq!(
            (s.state_digest(), s.ledger().state_digest()),
            (before.0, before.1)
        );
        // Scheduled again: the same decisions.
        let again = s.schedule().unwrap().clone();
        assert_eq!(again.context_starts, out.context_starts);
        assert_eq!(again.context_cached_lens, out.context_cached_lens);
        if ahead {
            update(&mut s, &older, 7);
        }
        update(&mut s, &again, 7);
        assert_eq!(s.metrics().prefix_cache_same_step_hits, 2 * 24);
        drain(&mut s);
    }
}

#[test]
fn a_step_planned_ahead_does_not_share_what_the_pending_step_computes() {
    let mut s = Scheduler::new(cached(1, 32)).unwrap();
    let p = prompt(13, 0, 0);
    s.add_request(1, &p, 4, 0).unwrap();
    let older = s.schedule().unwrap().clone();
    assert_eq!(older.context_lens, vec![13]);
    // Planned while request 1's prompt is in flight: its superblocks are not keyed yet,
    // and they are no KV of this step. Requests 2 and 3 share with each other instead.
    s.add_request(2, &p, 4, 0).unwrap();
    s.add_request(3, &p, 4, 0).unwrap();
    let newer = s.schedule().unwrap().clone();
    assert_eq!(newer.context_ids, vec![2, 3]);
    assert_eq!(newer.context_starts, vec![0, 12]);
    assert_ne!(table(&s, 2)[0], table(&s, 1)[0]);
    assert_eq!(table(&s, 3)[..3], table(&s, 2)[..3]);
    update(&mut s, &older, 7);
    update(&mut s, &newer, 7);
    // Once the older step ran its keys are cached: the first request's pages, the second's
    // left unkeyed (the key was taken).
    s.add_request(4, &p, 4, 0).unwrap();
    common::step(&mut s, 7);
    assert_eq!(table(&s, 4)[..3], table(&s, 1)[..3]);
    drain(&mut s);
    assert_eq!(s.ledger().free_superblocks(), 32);
}

#[test]
fn a_writer_aborted_or_finished_in_its_step_leaves_the_shared_superblocks_keyed() {
    for abort in [false, true] {
        let mut s = Scheduler::new(cached(1, 32)).unwrap();
        let p = prompt(13, 0, 0);
        // The writer stops at its first token (length) or is aborted while pending.
        s.add_request(1, &p, 1, 0).unwrap();
        s.add_request(2, &p, 4, 0).unwrap();
        let out = s.schedule().unwrap().clone();
        assert_eq!(out.context_cached_lens, vec![0, 12]);
        let shared = table(&s, 2)[..3].to_vec();
        if abort {
            s.abort(1).unwrap();
        }
        let finished = update(&mut s, &out, 7);
        assert_eq!(finished, vec![1]);
        assert!(!s.ledger().contains(1));
        // The sharer holds them, and they are keyed (the writer's chunk ran).
        let cache = s.ledger().prefix_cache().unwrap();
        for &page in &shared {
            assert_eq!(cache.refs(page), 1);
            assert!(cache.key_of(page).is_some(), "abort={abort}");
        }
        s.add_request(3, &p, 4, 0).unwrap();
        let out = common::step(&mut s, 7);
        assert_eq!(out.context_cached_lens, vec![12]);
        assert_eq!(table(&s, 3)[..3], shared[..]);
        drain(&mut s);
        assert_eq!(s.ledger().free_superblocks(), 32);
    }
}

#[test]
fn an_aborted_sharer_gives_back_only_its_references() {
    let mut s = Scheduler::new(cached(1, 32)).unwrap();
    let p = prompt(13, 0, 0);
    s.add_request(1, &p, 4, 0).unwrap();
    s.add_request(2, &p, 4, 0).unwrap();
    let out = s.schedule().unwrap().clone();
    s.abort(2).unwrap();
    assert_eq!(update(&mut s, &out, 7), vec![2]);
    let first = table(&s, 1);
    let cache = s.ledger().prefix_cache().unwrap();
    assert!(first[..3].iter().all(|&page| cache.refs(page) == 1));
    assert_eq!(
        s.metrics().prefix_cache_same_step_hits,
        0,
        "an aborted entry counts no hit"
    );
    drain(&mut s);
    assert_eq!(s.ledger().free_superblocks(), 32);
}

#[test]
fn a_sharer_is_charged_its_tail_and_references_not_pages() {
    // The step's budget fits one prompt and the tails of the others; the pool fits one
    // prompt's pages and a page per sharer: without same-step sharing only one would run.
    let mut config = cached(1, 8);
    config.max_num_tokens = 20;
    let mut s = Scheduler::new(config).unwrap();
    let p = prompt(14, 0, 0);
    for id in 1..=4 {
        s.add_request(id, &p, 1, 0).unwrap();
    }
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.context_ids, vec![1, 2, 3, 4]);
    assert_eq!(out.context_lens, vec![14, 2, 2, 2]);
    assert_eq!(out.num_tokens, 20);
    assert_eq!(s.ledger().used_superblocks(), 4 + 3);
    assert!(out.preempted_ids.is_empty());
}
