//! The token log: `update` writes sampled tokens into a scheduler-wide log and a request's
//! token vector takes them in batches. Whatever reads a request's tokens (its output, a
//! re-prefill after a recompute-pause, a resume from the host tier, an abort, the state
//! digest, `tokens()`) must see exactly what a plain per-request vector holds, at every
//! step and across the log's batch boundaries (outputs longer than a log row, here up to
//! about four rows).

mod common;

use std::collections::BTreeMap;

use common::{
    assert_matches_reference, assert_matches_reference_with_aborts, config, prompt, Group, Model,
    Rng, RunOptions, Spec,
};
use helix_kv_core::{
    CoreError, FinishReason, RequestId, Scheduler, SchedulerConfig, ServingMode, SuspendPolicy,
};

/// A pressured workload of long outputs (past several log rows), arriving over time.
fn long_workload(rng: &mut Rng, aborts: bool) -> Vec<Spec> {
    (0..rng.range(6, 12))
        .map(|id| {
            let spec = Spec::new(
                id,
                usize::try_from(rng.range(3, 30)).unwrap(),
                u32::try_from(rng.range(20, 130)).unwrap(),
            )
            .at(rng.range(0, 40));
            match (aborts, rng.below(4)) {
                (true, 0) => {
                    let at = spec.arrival_step + rng.range(0, 120);
                    spec.abort_at(at)
                }
                (true, 1) => {
                    let at = spec.arrival_step + rng.range(0, 120);
                    spec.abort_while_pending(at)
                }
                _ => spec,
            }
        })
        .collect()
}

/// A configuration that preempts: recompute-pauses, suspends to a host tier, or both.
fn pressured(rng: &mut Rng, specs: &[Spec]) -> SchedulerConfig {
    let cp = [1, 2, 4][usize::try_from(rng.below(3)).unwrap()];
    let tpb = u32::try_from(rng.range(1, 4)).unwrap();
    let largest = specs
        .iter()
        .map(|s| s.prompt.len() as u64 + u64::from(s.max_new_tokens))
        .max()
        .unwrap();
    // The largest request plus a little: most others wait, are paused or suspended.
    let superblocks = (largest + rng.range(0, 80)).div_ceil(u64::from(cp * tpb));
    let mut config = config(cp, tpb, u32::try_from(superblocks).unwrap());
    config.max_batch_size = u32::try_from(rng.range(2, 8)).unwrap();
    config.max_num_tokens = 64;
    config.enable_chunked_prefill = rng.below(2) == 0;
    config.max_preemptions_per_request = 1000;
    if rng.below(3) > 0 {
        config.host_tier_superblocks = u32::try_from(rng.range(2, 40)).unwrap();
        config.suspend_policy = [
            SuspendPolicy::SuspendFirst,
            SuspendPolicy::RecomputeFirst,
            SuspendPolicy::Cost,
        ][usize::try_from(rng.below(3)).unwrap()];
        if rng.below(3) == 0 {
            config.serving_mode = ServingMode::NonHelix;
            config.cp_size = 1;
        }
    }
    config
}

/// Keeps the requests the configuration accepts.
fn accepted(config: &SchedulerConfig, specs: Vec<Spec>) -> Vec<Spec> {
    let mut probe = Scheduler::new(config.clone()).unwrap();
    specs
        .into_iter()
        .filter(
            |s| match probe.add_request(s.id, &s.prompt, s.max_new_tokens, s.priority) {
                Ok(()) => true,
                Err(CoreError::RequestTooLarge { .. }) => false,
                Err(other) => panic!("unexpected refusal {other}"),
            },
        )
        .collect()
}

#[test]
fn long_outputs_under_pressure_equal_a_run_without_pressure_plain_and_one_step_ahead() {
    let mut preemptions = 0;
    let mut suspensions = 0;
    for seed in 0..24 {
        let mut rng = Rng::new(seed);
        let specs = long_workload(&mut rng, false);
        let config = pressured(&mut rng, &specs);
        let specs = accepted(&config, specs);
        let model = if seed % 3 == 0 {
            Model {
                vocab: 40,
                eos: Some(3),
            }
        } else {
            Model::default()
        };
        let options = RunOptions {
            revert_per_mille: if seed % 2 == 0 { 0 } else { 150 },
            seed,
            ..RunOptions::default()
        };
        // Both modes; the harness checks every live request's tokens after each update.
        let result = Group::new(&config, model).run(&specs, options).unwrap();
        assert_matches_reference(&specs, model, &result);
        preemptions += result.preemptions;
        suspensions += result.suspensions;
    }
    assert!(
        preemptions > 0 && suspensions > 0,
        "the workloads must preempt and suspend"
    );
}

#[test]
fn long_outputs_aborted_in_any_state_keep_exactly_what_they_generated() {
    for seed in 100..116 {
        let mut rng = Rng::new(seed);
        let specs = long_workload(&mut rng, true);
        let config = pressured(&mut rng, &specs);
        let specs = accepted(&config, specs);
        let model = Model::default();
        let options = RunOptions {
            revert_per_mille: if seed % 2 == 0 { 0 } else { 150 },
            seed,
            ..RunOptions::default()
        };
        let result = Group::new(&config, model).run(&specs, options).unwrap();
        assert_matches_reference_with_aborts(&specs, model, &result);
    }
}

/// A single scheduler against a per-request vector oracle, checked every step: each sampled
/// token is distinct, so a token out of place or lost shows.
#[test]
fn tokens_outputs_and_counters_equal_a_per_request_vector_every_step() {
    // Room for the largest request and a little more: the rest wait or are recompute-paused.
    let mut s = Scheduler::new(config(2, 4, 24)).unwrap();
    let mut oracle: BTreeMap<RequestId, Vec<i32>> = BTreeMap::new();
    let mut prompts: BTreeMap<RequestId, usize> = BTreeMap::new();
    // Output lengths around the log's row boundaries.
    let lengths = [1u32, 2, 31, 32, 33, 63, 64, 65, 97, 130];
    for (id, &max_new) in lengths.iter().enumerate() {
        let id = id as RequestId;
        let p = prompt(5 + usize::try_from(id).unwrap());
        s.add_request(id, &p, max_new, 0).unwrap();
        prompts.insert(id, p.len());
        oracle.insert(id, p);
    }
    let mut outputs = BTreeMap::new();
    let mut next_token = 1000;
    for _ in 0..5_000 {
        if !s.has_unfinished() {
            break;
        }
        let out = s.schedule().unwrap().clone();
        let tokens: Vec<i32> = (0..out.num_samples())
            .map(|i| next_token + i32::try_from(i).unwrap())
            .collect();
        next_token += 1000;
        let finished = s.update(&tokens, None).unwrap().to_vec();
        for (i, id) in out.sample_ids().enumerate() {
            oracle.get_mut(&id).unwrap().push(tokens[i]);
        }
        for id in finished {
            let output = s.take_output(id).unwrap();
            assert_eq!(output.finish_reason, FinishReason::Length);
            let all = oracle.remove(&id).unwrap();
            assert_eq!(output.token_ids, all[prompts[&id]..], "output of {id}");
            assert_eq!(
                output.metrics.generated_tokens,
                output.token_ids.len() as u64
            );
            outputs.insert(id, output.token_ids);
        }
        for (id, all) in &oracle {
            assert_eq!(&s.tokens(*id).unwrap(), all, "tokens of {id}");
            assert_eq!(
                s.request_metrics(*id).unwrap().generated_tokens,
                (all.len() - prompts[id]) as u64
            );
        }
    }
    assert!(s.metrics().preemptions > 0, "the run must recompute-pause");
    for (id, &max_new) in lengths.iter().enumerate() {
        assert_eq!(outputs[&(id as RequestId)].len(), max_new as usize);
    }
}

/// Aborts at every count of tokens waiting in the log (0 to a row and more): the output is
/// exactly the tokens sampled before the abort.
#[test]
fn an_abort_returns_every_token_sampled_before_it() {
    for after in [0usize, 1, 5, 31, 32, 33, 40, 64, 65, 70] {
        let mut s = Scheduler::new(config(1, 4, 100)).unwrap();
        s.add_request(1, &prompt(3), 200, 0).unwrap();
        let mut generated = Vec::new();
        let mut token = 7;
        while generated.len() < after {
            let rows = s.schedule().unwrap().num_samples();
            let tokens = vec![token; rows];
            s.update(&tokens, None).unwrap();
            generated.extend_from_slice(&tokens);
            token += 1;
        }
        s.abort(1).unwrap();
        let output = s.take_output(1).unwrap();
        assert_eq!(output.finish_reason, FinishReason::Aborted);
        assert_eq!(output.token_ids, generated, "abort after {after} tokens");
        assert_eq!(output.metrics.generated_tokens, after as u64);
    }
}

/// The state digest covers the tokens still in the log: two schedulers that differ only
/// in the last sampled token differ, and equal calls give equal digests whatever the
/// log holds.
#[test]
fn the_state_digest_covers_tokens_in_the_log() {
    for steps in [1usize, 10, 31, 32, 33, 50] {
        let run = |last: i32| {
            let mut s = Scheduler::new(config(2, 4, 100)).unwrap();
            s.add_request(1, &prompt(4), 100, 0).unwrap();
            for n in 0..steps {
                let samples = s.schedule().unwrap().num_samples();
                let token = if n + 1 == steps { last } else { 5 };
                s.update(&vec![token; samples], None).unwrap();
            }
            s.state_digest()
        };
        assert_eq!(run(9), run(9));
        assert_ne!(run(9), run(8), "after {steps} steps");
    }
}

/// A long run whose requests come and go (indices and log rows reused): every output
/// equals the oracle's, over many more tokens than the log holds.
#[test]
fn a_long_run_with_requests_coming_and_going_keeps_every_output() {
    let mut s = Scheduler::new(config(4, 2, 400)).unwrap();
    let mut rng = Rng::new(7);
    let mut oracle: BTreeMap<RequestId, Vec<i32>> = BTreeMap::new();
    let mut next_id = 0;
    let mut produced = 0usize;
    for n in 0..3_000i32 {
        while oracle.len() < 12 {
            let max_new = u32::try_from(rng.range(1, 90)).unwrap();
            s.add_request(next_id, &prompt(6), max_new, 0).unwrap();
            oracle.insert(next_id, Vec::new());
            next_id += 1;
        }
        let ids: Vec<_> = s.schedule().unwrap().sample_ids().collect();
        let tokens: Vec<i32> = (0..ids.len())
            .map(|i| n * 64 + i32::try_from(i).unwrap())
            .collect();
        let finished = s.update(&tokens, None).unwrap().to_vec();
        for (id, &t) in ids.iter().zip(&tokens) {
            oracle.get_mut(id).unwrap().push(t);
        }
        for id in finished {
            let output = s.take_output(id).unwrap();
            let want = oracle.remove(&id).unwrap();
            produced += want.len();
            assert_eq!(output.token_ids, want, "output of {id}");
        }
    }
    assert!(produced > 10_000, "{produced} tokens");
}
