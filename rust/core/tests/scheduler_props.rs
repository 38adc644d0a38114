//! Random configurations and workloads through the simulated CP group: whatever the
//! configuration, ranks agree every step, replay is exact, outputs equal a run without
//! pressure, nothing leaks, and the only ways a run may stop early are the documented
//! ones (a preemption bound that ran out, or a disaggregated server out of pages).

mod common;

use common::{
    assert_matches_reference, assert_matches_reference_with_aborts, gate_config, Group, Model,
    RevertedCopyIns, Rng, RunOptions, Spec,
};
use helix_kv_core::{
    AdmissionPolicy, CapacityPolicy, CoreError, RequestId, RequestOutput, ScheduleOutput,
    Scheduler, SchedulerConfig, ServingMode, SuspendPolicy, VictimPolicy,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    config: SchedulerConfig,
    specs: Vec<Spec>,
    model: Model,
    revert_per_mille: u64,
    /// One step ahead: steps that fail on the device (both pending steps reverted).
    fail_per_mille: u64,
    reverted_copy_ins: RevertedCopyIns,
}

impl Case {
    /// The run options of the case (`seed`), its reverts and failures included.
    fn options(&self, seed: u64) -> RunOptions {
        RunOptions {
            revert_per_mille: self.revert_per_mille,
            fail_per_mille: self.fail_per_mille,
            reverted_copy_ins: self.reverted_copy_ins,
            seed,
            max_steps: 5_000,
            reset_cache_per_mille: if self.config.enable_prefix_caching {
                40
            } else {
                0
            },
            ..RunOptions::default()
        }
    }
}

fn mode() -> impl Strategy<Value = (ServingMode, u32)> {
    prop_oneof![
        3 => Just((ServingMode::AggregatedHelix, 0)),
        2 => (1u32..10).prop_map(|host| (ServingMode::AggregatedHelix, host)),
        2 => (0u32..8).prop_map(|host| (ServingMode::NonHelix, host)),
        1 => Just((ServingMode::DisaggregatedGeneration, 0)),
    ]
}

/// The queue's order and the prefill cap of a drawn configuration.
#[derive(Debug, Clone, Copy)]
struct Admission {
    priority: bool,
    threshold: u32,
    adaptive: bool,
}

impl Admission {
    /// Sets them on `config` (the cap only with chunked prefill, which it needs).
    fn apply(self, config: &mut SchedulerConfig) {
        config.admission_policy = if self.priority {
            AdmissionPolicy::Priority
        } else {
            AdmissionPolicy::Fcfs
        };
        if config.enable_chunked_prefill {
            config.long_prefill_token_threshold = self.threshold;
            config.long_prefill_token_threshold_adaptive = self.adaptive;
        }
    }
}

/// Priority admission in half the cases, a prefill cap (adaptive or not) in a third.
fn admission() -> impl Strategy<Value = Admission> {
    (
        any::<bool>(),
        prop_oneof![2 => Just(0u32), 1 => 1u32..24],
        any::<bool>(),
    )
        .prop_map(|(priority, threshold, adaptive)| Admission {
            priority,
            threshold,
            adaptive,
        })
}

fn spec() -> impl Strategy<Value = (usize, u32, i32, u64)> {
    (1usize..40, 1u32..24, -3i32..4, 0u64..4)
}

/// What a reverted step's copy-ins did, by index.
const COPY_INS: [RevertedCopyIns; 3] = [
    RevertedCopyIns::Either,
    RevertedCopyIns::Done,
    RevertedCopyIns::NotDone,
];

/// The requests of a case: with prefix caching, every prompt starts with `shared` common
/// tokens (so requests hit each other's superblocks, not only their own); a salt of 0 is
/// none, another one of two tenants.
fn workload(requests: &[(usize, u32, i32, u64)], shared: Option<usize>, salts: &[u8]) -> Vec<Spec> {
    requests
        .iter()
        .enumerate()
        .map(|(i, &(prompt, max_new, priority, at))| {
            let mut spec = Spec::new(i as u64 + 1, prompt, max_new)
                .priority(priority)
                .at(at);
            if let Some(shared) = shared {
                let common = (500..).take(shared);
                spec.prompt = common.chain(spec.prompt).collect();
            }
            match salts[i] {
                0 => spec,
                tenant => spec.salt(&[b't', tenant]),
            }
        })
        .collect()
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
        // Prefix caching (on in about half the cases), and a shared start of every
        // prompt so requests hit each other's superblocks, not only their own.
        (any::<bool>(), 0usize..40),
        // Drawn last, so the cases persisted before they were added draw the same
        // configurations and workloads: steps that fail one step ahead, what a reverted
        // copy-in did, and each request's cache salt (none, or one of two tenants); then
        // priority admission and the prefill cap.
        (
            0u64..4,
            0usize..3,
            prop::collection::vec(prop::sample::select(vec![0u8, 0, 1, 2]), 10),
        ),
        admission(),
    )
        .prop_map(
            |(shape, budget, rules, requests, (caching, shared), failures, admission)| {
                let (fail, copy_ins, salts) = failures;
                let (cp, tpb, (serving_mode, host_tier), no_evict, policy) = shape;
                let (spare_percent, max_batch_size, max_num_tokens, chunked, chunk_unit) = budget;
                let (bound, admit_after_preemption, eos, revert, suspend_policy) = rules;
                let cp = if serving_mode == ServingMode::NonHelix {
                    1
                } else {
                    cp
                };
                let specs = workload(&requests, caching.then_some(shared), &salts);
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
                config.enable_prefix_caching = caching;
                admission.apply(&mut config);
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
                    fail_per_mille: fail * 60,
                    reverted_copy_ins: COPY_INS[copy_ins],
                }
            },
        )
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
        let options = case.options(specs.len() as u64);
        match group.run(&specs, options) {
            Ok(result) => {
                assert_matches_reference(&specs, case.model, &result);
                // Past the bound only for the queue head (the harness checks each one).
                prop_assert!(result.max_request_victim_choices <= config.max_preemptions_per_request || result.preemptions_past_bound > 0);
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
                let bound_hit = group.result.max_request_victim_choices >= config.max_preemptions_per_request;
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

proptest! {
    #![proptest_config(gate_config(150))]

    /// Random drafts (speculative decoding) and acceptance in every configuration, plain
    /// and one step ahead (compared), with reverts, aborts, host tiers, pressure, prefix
    /// caching and EOS: outputs equal the reference decoded one token at a time.
    #[test]
    fn random_drafts_keep_every_invariant(
        case in case_with_aborts(),
        k in 1u32..9,
        draft_per_mille in 100u64..1001,
        draft_true_per_mille in 0u64..1001,
    ) {
        let mut config = case.config.clone();
        config.num_speculative_tokens = k;
        let config = &config;
        let specs = accepted(config, &case.specs);
        prop_assume!(!specs.is_empty());
        let mut group = Group::new(config, case.model);
        let options = RunOptions {
            draft_per_mille,
            draft_true_per_mille,
            ..case.options(specs.len() as u64)
        };
        let result = match group.run(&specs, options) {
            Ok(result) => result,
            Err(err) => return check_early_stop(config, &group, &err),
        };
        assert_matches_reference_with_aborts(&specs, case.model, &result);
        prop_assert!(result.spec_accepted <= result.drafts_accepted);
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

/// A case of the combination issue 39's defect hid in: prefix caching on, a host tier as
/// large as the pool (victims that share no superblock are suspended and resumed), pressure
/// that preempts, one step ahead with steps failing on the device (both pending steps
/// reverted) besides plain reverts, aborts, EOS, and drafts (`num_speculative_tokens`, 0
/// for none) proposed with the returned probability in 1/1000.
fn caching_host_tier_case() -> impl Strategy<Value = (Case, u64)> {
    (case_with_aborts(), 0u32..4, 1u64..6, 100u64..1001).prop_map(
        |(mut case, k, fail, draft_per_mille)| {
            let config = &mut case.config;
            config.enable_prefix_caching = true;
            if config.serving_mode == ServingMode::DisaggregatedGeneration {
                config.serving_mode = ServingMode::AggregatedHelix;
            }
            config.capacity_policy = CapacityPolicy::MaxUtilization;
            config.host_tier_superblocks = config.capacity_superblocks;
            config.max_preemptions_per_request = config.max_preemptions_per_request.max(1);
            config.num_speculative_tokens = k;
            case.fail_per_mille = fail * 80;
            (case, if k == 0 { 0 } else { draft_per_mille })
        },
    )
}

proptest! {
    #![proptest_config(gate_config(150))]

    /// Every prefix-cache hit and every attention read finds the KV it needs (the group's
    /// KV-content model), under prefix caching with a host tier, one step ahead with failing
    /// steps, reverts (a reverted step's copy-ins done, not done, or either), aborts, EOS and
    /// drafts, and the outputs equal the reference decoded without pressure.
    #[test]
    fn caching_with_a_host_tier_reads_only_kv_that_was_written(
        (case, draft_per_mille) in caching_host_tier_case(),
        draft_true_per_mille in 0u64..1001,
    ) {
        let config = &case.config;
        let specs = accepted(config, &case.specs);
        prop_assume!(!specs.is_empty());
        let mut group = Group::new(config, case.model);
        let options = RunOptions {
            draft_per_mille,
            draft_true_per_mille,
            ..case.options(specs.len() as u64)
        };
        let result = match group.run(&specs, options) {
            Ok(result) => result,
            Err(err) => return check_early_stop(config, &group, &err),
        };
        assert_matches_reference_with_aborts(&specs, case.model, &result);
    }
}

/// A case of bursts behind one prompt (same-step sharing): prefix caching on, and each
/// request after the first takes, with probability 2/5, the prompt, cache salt and arrival
/// step of the one before it, so identical prompts (every full superblock but the last
/// shared) arrive in one step, besides the shared start of every prompt that cases with
/// caching draw. Requests the pool is then too small for are refused at add (`accepted`).
fn burst_case() -> impl Strategy<Value = Case> {
    (
        case_with_aborts(),
        prop::collection::vec(prop::bool::weighted(0.4), 10),
    )
        .prop_map(|(mut case, twins)| {
            case.config.enable_prefix_caching = true;
            let twins = twins.iter().enumerate().take(case.specs.len()).skip(1);
            for (i, _) in twins.filter(|&(_, &twin)| twin) {
                let before = case.specs[i - 1].clone();
                let spec = &mut case.specs[i];
                spec.prompt = before.prompt;
                spec.salt = before.salt;
                spec.arrival_step = before.arrival_step;
            }
            case
        })
}

proptest! {
    #![proptest_config(gate_config(100))]

    /// Bursts of identical and shared-prefix prompts arriving in one step share what an
    /// earlier entry of that step computes: every hit and attention read finds the KV it
    /// needs (a hit may read only KV of steps that ran and of the step's earlier context
    /// entries), plain and one step ahead with failing steps, reverts, aborts, EOS, host
    /// tiers and drafts, and the outputs equal the reference decoded without pressure.
    #[test]
    fn bursts_share_their_prompts_and_read_only_kv_that_was_written(
        case in burst_case(),
        k in 0u32..4,
        draft_per_mille in 100u64..1001,
    ) {
        let mut config = case.config.clone();
        config.num_speculative_tokens = k;
        let config = &config;
        let specs = accepted(config, &case.specs);
        prop_assume!(!specs.is_empty());
        let mut group = Group::new(config, case.model);
        let options = RunOptions {
            draft_per_mille: if k == 0 { 0 } else { draft_per_mille },
            draft_true_per_mille: 500,
            ..case.options(specs.len() as u64)
        };
        let result = match group.run(&specs, options) {
            Ok(result) => result,
            Err(err) => return check_early_stop(config, &group, &err),
        };
        assert_matches_reference_with_aborts(&specs, case.model, &result);
        prop_assert!(result.same_step_cached_tokens <= result.cached_tokens);
    }

    /// Reverting a step of a burst (the newest pending step, or both) undoes its same-step
    /// sharing exactly: the state digest as before (when the reverted steps chose no
    /// victim), and every later step as a twin that never scheduled them makes it.
    #[test]
    fn reverts_of_bursts_restore_the_state_and_every_later_step(
        case in burst_case(),
        ahead in any::<bool>(),
        both in any::<bool>(),
        probe_at in 0u64..12,
    ) {
        check_reverts(case, ahead, both, probe_at, None)?;
    }
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
                group.result.max_request_victim_choices == config.max_preemptions_per_request;
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
        let options = case.options(specs.len() as u64);
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

/// The fields of a step that do not depend on its number (a scheduler that reverted steps
/// numbers later ones on; the digest hashes the number).
fn decisions(out: &ScheduleOutput) -> String {
    let mut out = out.clone();
    out.step = 0;
    out.digest = 0;
    format!("{out:?}")
}

/// Whether `id` has an entry, a sit-out, a preemption, a suspend or a resume in `out`.
fn mentions(out: &ScheduleOutput, id: RequestId) -> bool {
    [
        &out.generation_ids,
        &out.context_ids,
        &out.sat_out_ids,
        &out.preempted_ids,
        &out.suspended_ids,
        &out.resumed_ids,
    ]
    .iter()
    .any(|ids| ids.contains(&id))
}

fn chose_victims(out: &ScheduleOutput) -> bool {
    !out.preempted_ids.is_empty() || !out.suspended_ids.is_empty()
}

/// The superblocks caching a prefix (none without prefix caching).
fn cached_pages(s: &Scheduler) -> BTreeSet<u32> {
    s.ledger()
        .prefix_cache()
        .map_or_else(BTreeSet::new, |cache| {
            (0..s.ledger().capacity())
                .filter(|&page| cache.key_of(page).is_some())
                .collect()
        })
}

/// The tokens and EOS flags `update` is given for one step, the requests it finished, and
/// the drafts accepted per generation entry.
type Samples = (Vec<i32>, Vec<bool>, Vec<RequestId>, Vec<u32>);

/// One scheduler driven plain or one step ahead, and, once set, a twin fed the same calls
/// whose every step and output must be the same (but for step numbers).
struct Driver {
    model: Model,
    ahead: bool,
    s: Scheduler,
    twin: Option<Scheduler>,
    /// Scheduled and not yet updated, oldest first.
    pending: VecDeque<ScheduleOutput>,
    /// Samples each request has been given so far: its next token is a function of this
    /// and its id, so it does not depend on step numbers.
    sampled: BTreeMap<RequestId, u32>,
    /// Speculative decoding: each live request gets drafts before a schedule with this
    /// probability in 1/1000 (0: never), drawn from `rng`.
    draft_per_mille: u64,
    rng: Rng,
}

impl Driver {
    fn samples(&mut self, out: &ScheduleOutput) -> (Vec<i32>, Vec<bool>, Vec<u32>) {
        let (tokens, eos) = out
            .sample_ids()
            .map(|id| {
                let n = self.sampled.entry(id).or_default();
                *n += 1;
                let token = self.model.next_token(id, &[i32::try_from(*n).unwrap()]);
                (token, Some(token) == self.model.eos)
            })
            .unzip();
        // Accepted drafts: a function of the request and its samples, like its tokens.
        let accepted = out
            .generation_ids
            .iter()
            .zip(&out.generation_draft_counts)
            .map(|(&id, &k)| {
                let n = self.sampled[&id];
                let h = self
                    .model
                    .next_token(id ^ 0x5eed, &[i32::try_from(n).unwrap()]);
                u32::try_from(u64::try_from(h).unwrap() % (k + 1)).unwrap()
            })
            .collect();
        (tokens, eos, accepted)
    }

    /// Proposes random drafts for the next schedule (on both): up to the configuration's
    /// `num_speculative_tokens`, for live requests, decoding or not.
    fn propose(&mut self) -> Result<(), TestCaseError> {
        let most = self.s.config().num_speculative_tokens;
        if self.draft_per_mille == 0 || most == 0 {
            return Ok(());
        }
        let (mut ids, mut counts, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
        for id in self.s.queue_ids() {
            if self.rng.below(1000) < self.draft_per_mille {
                let k = u32::try_from(self.rng.range(1, u64::from(most))).unwrap();
                ids.push(id);
                counts.push(k);
                tokens.extend((0..k).map(|_| i32::try_from(self.rng.below(1000)).unwrap()));
            }
        }
        self.both(|s| s.propose_drafts(&ids, &counts, &tokens))?
            .unwrap();
        Ok(())
    }

    /// Calls `f` on the scheduler and on the twin (if any), checking they answer alike.
    fn both<T: PartialEq + std::fmt::Debug>(
        &mut self,
        mut f: impl FnMut(&mut Scheduler) -> T,
    ) -> Result<T, TestCaseError> {
        let answer = f(&mut self.s);
        if let Some(twin) = self.twin.as_mut() {
            prop_assert_eq!(&answer, &f(twin));
        }
        Ok(answer)
    }

    /// Takes every finished output (on both).
    fn collect(&mut self) -> Result<Vec<RequestOutput>, TestCaseError> {
        let mut outputs = Vec::new();
        for id in self.both(|s| s.untaken_outputs())? {
            outputs.push(self.both(|s| s.take_output(id).unwrap())?);
        }
        Ok(outputs)
    }

    /// Updates the oldest pending step; returns what it was given.
    fn update(&mut self) -> Result<Samples, TestCaseError> {
        let oldest = self.pending.pop_front().unwrap();
        let (tokens, eos, accepted) = self.samples(&oldest);
        let finished = self.both(|s| {
            s.update_accepted(&tokens, Some(&eos), Some(&accepted))
                .unwrap()
                .to_vec()
        })?;
        self.collect()?;
        Ok((tokens, eos, finished, accepted))
    }

    /// Schedules a step (on both, comparing them) and, with as many steps pending as the mode
    /// allows, updates the oldest.
    fn step(&mut self) -> Result<Stepped, TestCaseError> {
        self.propose()?;
        let out = self.both(|s| s.schedule().map(decisions))?;
        if out.is_err() {
            return Ok(Stepped::Ended);
        }
        self.pending.push_back(self.s.last_output().clone());
        if self.pending.len() < if self.ahead { 2 } else { 1 } {
            return Ok(Stepped::Scheduled);
        }
        self.update().map(Stepped::Updated)
    }
}

/// What `Driver::step` did.
enum Stepped {
    /// The run ended with one of the documented errors.
    Ended,
    Scheduled,
    /// Scheduled, then updated the oldest pending step with these samples.
    Updated(Samples),
}

proptest! {
    #![proptest_config(gate_config(150))]

    /// Reverting the newest pending step, or both, restores the state digest exactly (when
    /// the reverted steps chose no victim: victims stay applied), and every later step and
    /// output is the one a twin that never scheduled them makes: plain and one step ahead,
    /// host tiers, aborts (between steps, deferred while a step is pending) and EOS.
    #[test]
    fn reverts_restore_the_state_and_every_later_step(
        case in case_with_aborts(),
        ahead in any::<bool>(),
        both in any::<bool>(),
        probe_at in 0u64..40,
    ) {
        check_reverts(case, ahead, both, probe_at, None)?;
    }

    /// The same with random drafts: the reverted steps and the ones around them verify
    /// drafts (up to `k` per decode, proposed for a request with probability `per_mille`
    /// in 1/1000), and accept a number of them that depends on the request's samples only.
    #[test]
    fn reverts_with_drafts_restore_the_state_and_every_later_step(
        case in case_with_aborts(),
        ahead in any::<bool>(),
        both in any::<bool>(),
        probe_at in 0u64..40,
        k in 1u32..9,
        per_mille in 100u64..1001,
    ) {
        check_reverts(case, ahead, both, probe_at, Some((k, per_mille)))?;
    }
}

/// The body of the revert properties (`drafts`: `num_speculative_tokens` and how often a
/// request gets drafts, in 1/1000).
#[expect(
    clippy::too_many_lines,
    clippy::similar_names,
    reason = "one scenario: the probe, the reverts and the twin's comparison read in order \
              (what was aborted here and there)"
)]
fn check_reverts(
    case: Case,
    ahead: bool,
    both: bool,
    probe_at: u64,
    drafts: Option<(u32, u64)>,
) -> Result<(), TestCaseError> {
    {
        let mut case = case;
        if let Some((k, _)) = drafts {
            case.config.num_speculative_tokens = k;
        }
        let config = &case.config;
        let specs = accepted(config, &case.specs);
        prop_assume!(!specs.is_empty());
        let last_arrival = specs.iter().map(|s| s.arrival_step).max().unwrap();
        let mut d = Driver {
            model: case.model,
            ahead,
            s: Scheduler::new(config.clone()).unwrap(),
            twin: None,
            pending: VecDeque::new(),
            sampled: BTreeMap::new(),
            draft_per_mille: drafts.map_or(0, |(_, per_mille)| per_mille),
            rng: Rng::new(probe_at ^ specs.len() as u64),
        };
        // The state before the previous schedule, and the update that followed it.
        let mut before_previous: Option<(Scheduler, Option<Samples>)> = None;
        for step in 0..3_000u64 {
            // At the probe, the twin to be: this state or (both, one step ahead) the state
            // before the pending step was scheduled, given the update that followed that
            // schedule; it takes this step's arrivals and aborts (an abort the scheduler
            // defers to the pending step's close is immediate there).
            let mut expected = None;
            if step == probe_at {
                expected = Some(if both && ahead {
                    let Some((mut older, update)) = before_previous.clone() else {
                        return Ok(());
                    };
                    if let Some((tokens, eos, _, accepted)) = update {
                        older
                            .update_accepted(&tokens, Some(&eos), Some(&accepted))
                            .unwrap();
                        for id in older.untaken_outputs() {
                            older.take_output(id).unwrap();
                        }
                    }
                    older
                } else {
                    d.s.clone()
                });
            }
            let due: Vec<RequestId> = specs
                .iter()
                .filter(|spec| spec.abort.is_some_and(|at| at.step == step))
                .map(|spec| spec.id)
                .collect();
            let mut aborted_there = BTreeMap::new();
            if let Some(expected) = expected.as_mut() {
                for spec in specs.iter().filter(|spec| spec.arrival_step == step) {
                    expected
                        .add_request_salted(
                            spec.id,
                            &spec.prompt,
                            spec.max_new_tokens,
                            spec.priority,
                            &spec.salt,
                        )
                        .unwrap();
                }
                let due: Vec<RequestId> = due
                    .iter()
                    .copied()
                    .filter(|&id| expected.is_abort_requested(id) == Ok(false))
                    .collect();
                expected.abort_many(&due).unwrap();
                for id in expected.untaken_outputs() {
                    aborted_there.insert(id, expected.take_output(id).unwrap());
                }
            }
            for spec in specs.iter().filter(|spec| spec.arrival_step == step) {
                d.both(|s| {
                    s.add_request_salted(
                        spec.id,
                        &spec.prompt,
                        spec.max_new_tokens,
                        spec.priority,
                        &spec.salt,
                    )
                })?
                .unwrap();
            }
            let due: Vec<RequestId> = due
                .into_iter()
                .filter(|&id| d.s.is_abort_requested(id) == Ok(false))
                .collect();
            d.both(|s| s.abort_many(&due))?.unwrap();
            let mut aborted_here = d.collect()?;
            if !d.s.has_unfinished() && step > last_arrival {
                while !d.pending.is_empty() {
                    d.update()?;
                }
                prop_assert_eq!(d.s.ledger().free_superblocks(), d.s.ledger().capacity());
                prop_assert_eq!(d.s.host_used_superblocks(), 0);
                return Ok(());
            }
            if let Some(expected) = expected {
                // The steps reverted verify drafts too (proposals are no state: the twin
                // has none, and a schedule uses them up).
                d.propose()?;
                let Ok(newest) = d.s.schedule().cloned() else {
                    return Ok(());
                };
                // A prefix a reverted step evicted from a page it resumed a request onto
                // is not put back (the copy-in may have overwritten the page): the
                // documented inexact undo, like victims.
                let cached = cached_pages(&expected);
                let inexact = |out: &ScheduleOutput| {
                    chose_victims(out)
                        || out
                            .resumed_block_ids
                            .iter()
                            .any(|&page| cached.contains(&u32::try_from(page).unwrap()))
                };
                let mut victims = inexact(&newest);
                if both && !ahead {
                    d.propose()?;
                    let Ok(second) = d.s.schedule().cloned() else {
                        return Ok(());
                    };
                    victims |= inexact(&second);
                    d.s.revert().unwrap();
                }
                d.s.revert().unwrap();
                if both && ahead {
                    if let Some(older) = d.pending.pop_back() {
                        victims |= inexact(&older);
                        // A request the older step refers to that the update between the
                        // two schedules finished was held until that step closed (its KV
                        // in use by the step): its pages and ledger entry come back later
                        // than in the twin, so only their order differs (documented in
                        // docs/internals/scheduler.md).
                        let finished = before_previous
                            .as_ref()
                            .and_then(|(_, u)| u.as_ref())
                            .map_or(&[][..], |u| &u.2[..]);
                        if finished.iter().any(|&id| mentions(&older, id)) {
                            return Ok(());
                        }
                        d.s.revert().unwrap();
                    }
                }
                if victims {
                    return Ok(()); // victims stay applied: nothing to compare with
                }
                // Aborts deferred to the reverted step closed with it, as they did at once
                // in the twin.
                for id in d.s.untaken_outputs() {
                    aborted_here.push(d.s.take_output(id).unwrap());
                }
                aborted_here.sort_by_key(|output| output.request_id);
                prop_assert_eq!(
                    aborted_here,
                    aborted_there.into_values().collect::<Vec<_>>()
                );
                prop_assert_eq!(d.s.pending_steps(), expected.pending_steps());
                prop_assert_eq!(
                    d.s.ledger().state_digest(),
                    expected.ledger().state_digest()
                );
                prop_assert_eq!(
                    d.s.state_digest(),
                    expected.state_digest(),
                    "state after the reverts"
                );
                d.twin = Some(expected);
            }
            let snapshot = d.s.clone();
            let update = match d.step()? {
                Stepped::Ended => return Ok(()),
                Stepped::Scheduled => None,
                Stepped::Updated(samples) => Some(samples),
            };
            before_previous = Some((snapshot, update));
        }
        prop_assert!(false, "run did not finish in 3000 steps");
    }
    Ok(())
}
