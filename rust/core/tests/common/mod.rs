//! A simulated CP group for scheduler tests: one scheduler per rank fed the same calls,
//! per-rank physical KV pools written through the ledger's slot mappings and read back
//! through its block tables, and a deterministic "model" whose next token depends on the
//! whole context it reads back. A schedule that feeds a wrong token, position or page
//! changes every later token, so comparing outputs with a run without pressure checks
//! replay end to end.
//!
//! The pools are a **KV-content model**: every slot of every rank (and of every rank's host
//! tier) holds what the executor would have written there ([`KvCell`]): the request, the
//! position and the token whose KV it is, and a digest of what that KV depends on (the
//! request's cache salt and its tokens up to the position, drafts included), or `Unknown`
//! where a reverted step's copy-in may or may not have overwritten it. Writes go through the
//! slot mappings of steps that ran (a step that is reverted ran nothing: only its copy-outs
//! happen, and its copy-ins as [`RevertedCopyIns`] says: done, not done, or either), copies
//! to and from the host tier copy cells, and the KV of a draft the verifier rejected is
//! marked not valid when its step is updated. Every prefix-cache hit (the cached tokens of an
//! admission) and every attention read (each context chunk's and decode's tokens read their
//! context back through the block table) is checked against what is there: a cell holds the
//! reader's token at that position, valid, computed over the same salt and tokens before it
//! (any request's with prefix caching, only the reader's own without). A step's writes land
//! entry by entry, context entries first, each hit checked just before its own entry's
//! writes: a hit may read KV of steps that ran or of an earlier context entry of the same
//! step (same-step sharing: the executor writes each layer's KV before that layer's
//! attention), never of its own entry, a later one or a decode of the step.
//!
//! Every step it checks: identical rank-invariant outputs, digests and state digests on
//! every rank; per-rank fields consistent with the Helix layout; victims strictly
//! behind their requesters; no futile preemption (each requester is served in the step
//! that preempted for it); preemption bound (past it only for the queue head); batch
//! slots in queue order (persistent, and nobody takes a new one while a decoding request
//! ahead of it is left without); replay (re-prefill tokens == prompt + tokens generated
//! so far; decode positions continue from the new prompt end).
//!
//! `Group::run` runs every workload in both modes: plain (schedule, run, update) and
//! one-step-ahead (overlap: step t+1 is scheduled and run before step t is updated), and
//! checks that they produce the same outputs token for token. In overlap mode the harness
//! acts as the executor: it resolves `generation_input_refs` from the previous step's
//! sampled tokens. In both modes it keeps a per-batch-slot "device" array, poisoned when a
//! slot is freed (sit-out, victim, finish, abort), and checks no decode reads a slot that
//! is poisoned or holds another request.
//!
//! With random drafts (`RunOptions::draft_per_mille`, speculative decoding) the harness is
//! also the drafter and the verifier: before each `schedule()` it proposes drafts for some
//! requests (a mix of the model's true continuation and wrong tokens, identical on every
//! rank), writes the KV of every query position of a drafted decode through the slot
//! mapping, samples the model at each of them from the context read back (the drafts
//! before it included), accepts the longest prefix of drafts the samples confirm and
//! calls `update_accepted` with every row. Outputs must still equal the reference.
#![allow(
    dead_code,
    reason = "each test crate uses its own part of these shared helpers"
)]

use std::collections::{BTreeMap, BTreeSet};

use helix_kv_core::{
    AdmissionPolicy, CoreError, FinishReason, RankPlacement, RequestId, RequestOutput,
    RequestState, ScheduleOutput, Scheduler, SchedulerConfig, ServingMode,
};

/// The property tests' configuration: a gate that fails only on a change, never on the
/// draw. By default every property test draws from one fixed seed (`GATE_SEED`), plus
/// every case persisted in its `*.proptest-regressions` file, with `default_cases` cases
/// (`PROPTEST_CASES` overrides the count). Exploring is a separate command
/// (`docs/internals/testing.md`): `HELIX_KV_EXPLORE=1` draws a random seed and twenty times
/// the cases, and a failure it finds is persisted to the regressions file, to commit;
/// `PROPTEST_RNG_SEED=N` replays one draw.
pub fn gate_config(default_cases: u32) -> proptest::test_runner::Config {
    use proptest::test_runner::{Config, RngSeed};
    /// The fixed seed CI draws from (any value: fixed is what matters).
    const GATE_SEED: u64 = 0x6865_6c69_785f_6b76;
    let explore = std::env::var_os("HELIX_KV_EXPLORE").is_some_and(|v| !v.is_empty() && v != "0");
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(if explore {
            default_cases * 20
        } else {
            default_cases
        });
    // `Config::default()` reads the `PROPTEST_*` variables (a given seed among them).
    let given = Config::default();
    let rng_seed = if explore || std::env::var_os("PROPTEST_RNG_SEED").is_some() {
        given.rng_seed
    } else {
        RngSeed::Fixed(GATE_SEED)
    };
    Config {
        cases,
        rng_seed,
        // Rejected draws (a workload the configuration refuses whole) scale with the cases.
        max_global_rejects: given.max_global_rejects.max(cases),
        ..given
    }
}

/// A small deterministic generator (xorshift64*), so tests need no randomness crate.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn range(&mut self, lo: u64, hi_inclusive: u64) -> u64 {
        lo + self.below(hi_inclusive - lo + 1)
    }
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub id: RequestId,
    pub prompt: Vec<i32>,
    pub max_new_tokens: u32,
    pub priority: i32,
    /// Step before which the request is added (0: before the first step).
    pub arrival_step: u64,
    /// When the client aborts it, if it does (and it is still live then).
    pub abort: Option<AbortAt>,
    /// Its cache salt (prefix caching shares KV only between requests of the same salt).
    pub salt: Vec<u8>,
}

/// When a request is aborted: before step `step` is scheduled, or while it is pending
/// (after `schedule`, before `update`/`revert`); with `in_state`, only once it is seen in
/// that state (a label of `Group::state_label`, e.g. "recompute-paused").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbortAt {
    pub step: u64,
    pub while_pending: bool,
    pub in_state: Option<&'static str>,
}

impl Spec {
    pub fn new(id: RequestId, prompt_len: usize, max_new_tokens: u32) -> Self {
        let prompt = (0..prompt_len as u64)
            .map(|i| i32::try_from((id * 7919 + i * 31) % 997).unwrap())
            .collect();
        Self {
            id,
            prompt,
            max_new_tokens,
            priority: 0,
            arrival_step: 0,
            abort: None,
            salt: Vec::new(),
        }
    }
    /// Aborted before step `step` is scheduled.
    pub fn abort_at(mut self, step: u64) -> Self {
        self.abort = Some(AbortAt {
            step,
            while_pending: false,
            in_state: None,
        });
        self
    }
    /// Aborted the first time it is seen in `state` (between steps, or while a step is
    /// pending).
    pub fn abort_in_state(mut self, state: &'static str, while_pending: bool) -> Self {
        self.abort = Some(AbortAt {
            step: 0,
            while_pending,
            in_state: Some(state),
        });
        self
    }
    /// Aborted while step `step` is pending.
    pub fn abort_while_pending(mut self, step: u64) -> Self {
        self.abort = Some(AbortAt {
            step,
            while_pending: true,
            in_state: None,
        });
        self
    }
    pub fn at(mut self, step: u64) -> Self {
        self.arrival_step = step;
        self
    }
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
    pub fn salt(mut self, salt: &[u8]) -> Self {
        self.salt = salt.to_vec();
        self
    }
}

/// The deterministic model: the next token is a hash of the request id and every token
/// of the context read back from the KV pools.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    pub vocab: u64,
    /// A token that ends a request early, if any.
    pub eos: Option<i32>,
}

impl Default for Model {
    fn default() -> Self {
        Self {
            vocab: 50_000,
            eos: None,
        }
    }
}

impl Model {
    pub fn next_token(&self, id: RequestId, context: &[i32]) -> i32 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ id;
        for &t in context {
            #[expect(clippy::cast_sign_loss, reason = "hashes the token's bits")]
            let bits = u64::from(t as u32);
            h = (h ^ bits).wrapping_mul(0x0100_0000_01b3);
            h ^= h >> 29;
        }
        i32::try_from(h % self.vocab).unwrap()
    }
}

/// What a finished run produced.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    /// Outputs of requests that finished by length or eos.
    pub outputs: BTreeMap<RequestId, Vec<i32>>,
    /// Outputs of aborted requests (what they generated before the abort).
    pub aborted: BTreeMap<RequestId, Vec<i32>>,
    /// The states aborted requests were in when aborted ("decoding", "suspended",
    /// "recompute-paused"...; "... while pending" when a step was pending).
    pub abort_states: BTreeSet<String>,
    pub steps: u64,
    pub preemptions: u64,
    pub suspensions: u64,
    pub resumes: u64,
    /// Tokens recomputed after recompute-pauses.
    pub recomputed_tokens: u64,
    pub sat_out: u64,
    pub reverted_steps: u64,
    /// Every victim seen, `(victim, requester)`.
    pub victims: Vec<(RequestId, RequestId)>,
    pub max_request_victim_choices: u32,
    /// Preemptions that took a request past `max_preemptions_per_request` (each one for
    /// the oldest live request, which the harness checks).
    pub preemptions_past_bound: u64,
    /// Decode inputs given as a row of the step in flight (overlap mode).
    pub inputs_in_flight: u64,
    /// Prompt tokens admissions found in the prefix cache (their chunks started after).
    pub cached_tokens: u64,
    /// Of those, tokens in superblocks that did not hold the reader's KV before the step
    /// and did once the step's earlier context entries wrote theirs (same-step sharing).
    pub same_step_cached_tokens: u64,
    /// KV tokens read back and checked against the KV-content model (hits and attention).
    pub kv_reads: u64,
    /// Steps that failed on the device one step ahead: their copies made, their KV writes
    /// not, the step planned ahead of them reverted, then they (`RunOptions::fail_per_mille`).
    pub failed_steps: u64,
    /// Pool cells a reverted step's copy-in left `Unknown` (or wrote, or left alone).
    pub reverted_copy_ins: u64,
    /// Draft KV cells marked not valid when their drafts were rejected.
    pub rejected_draft_cells: u64,
    /// `reset_prefix_cache()` calls that took effect (between steps).
    pub cache_resets: u64,
    /// Draft tokens proposed, verified in steps that ran, and accepted by the harness's
    /// verifier there (speculative decoding).
    pub drafts_proposed: u64,
    pub drafts_verified: u64,
    pub drafts_accepted: u64,
    /// The scheduler's `spec_decode_num_accepted_tokens` and `_trimmed_tokens`, and the
    /// superblocks drafts took and gave back (`spec_decode_draft_superblocks`,
    /// `_returned_superblocks`), rank 0's.
    pub spec_accepted: u64,
    pub spec_trimmed: u64,
    pub spec_draft_superblocks: u64,
    pub spec_returned_superblocks: u64,
    /// Decodes of a step planned ahead that verified drafts (overlap mode).
    pub ahead_drafted_decodes: u64,
}

/// Options of a run beyond the configuration.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Revert a step (and schedule again) with this probability in 1/1000. In overlap
    /// mode the newest step is reverted while the older one stays pending.
    pub revert_per_mille: u64,
    pub seed: u64,
    pub max_steps: u64,
    pub mode: RunMode,
    /// With prefix caching: between steps, call `reset_prefix_cache()` on every rank with
    /// this probability in 1/1000 (the ranks must drop the same count; while a step is in
    /// flight, one step ahead, it must be refused and change nothing).
    pub reset_cache_per_mille: u64,
    /// Speculative decoding (needs `num_speculative_tokens > 0`): before each `schedule()`,
    /// each live request gets a proposal of `1..=num_speculative_tokens` drafts with this
    /// probability in 1/1000 (decoding or not: the others ignore theirs).
    pub draft_per_mille: u64,
    /// Each draft token is the model's true continuation with this probability in 1/1000
    /// (else a wrong token), so some drafts are accepted and some rejected.
    pub draft_true_per_mille: u64,
    /// One step ahead: a step fails on the device with this probability in 1/1000. Its
    /// copies to and from the host tier were made (copy-ins as `reverted_copy_ins` says), its
    /// KV writes were not; the step planned ahead of it is scheduled, then reverted, then it
    /// is (so both pending steps are reverted, newest first). Plain runs ignore it.
    pub fail_per_mille: u64,
    /// What a reverted step's copy-ins did to their destination pages.
    pub reverted_copy_ins: RevertedCopyIns,
}

/// What the copy-ins of a reverted step did to the pages they copy into: the contract lets
/// an executor do either (docs/internals/scheduler.md), so the scheduler may count on
/// neither the old content nor the copied one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RevertedCopyIns {
    /// Either: the cells become `Unknown`, and any read of one fails.
    #[default]
    Either,
    /// They ran: the pages hold the resumed KV.
    Done,
    /// They did not: the pages hold what they held.
    NotDone,
}

/// How `Group::run` drives the schedulers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RunMode {
    /// Plain, then overlap on a fresh group; the outputs must agree (the plain result is
    /// returned).
    #[default]
    Both,
    /// schedule, run, update: one step pending at a time.
    Plain,
    /// One step ahead: step t+1 is scheduled and run while step t is pending, then step t
    /// is updated.
    Overlap,
}

/// One rank's state before a `schedule()`, to compare after a `revert()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSnapshot {
    state_digest: u64,
    ledger_digest: u64,
    holdings: Vec<(RequestId, u32)>,
    /// Superblocks caching a prefix (prefix caching).
    cached: BTreeSet<u32>,
}

/// A slot of a simulated per-rank KV pool (see the module doc: the KV-content model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCell {
    /// Never written.
    Empty,
    /// The KV the executor wrote.
    Kv(Kv),
    /// A reverted step's copy-in may or may not have overwritten it (the old KV or the
    /// copied one): nothing may read it.
    Unknown { step: u64 },
}

/// The KV of one token: whose (`request`), where (`position`), of which `token`, computed
/// over `prefix` (a digest of the request's cache salt and its tokens `0..=position` as
/// the step saw them, drafts included); `valid` is false once the token was a rejected
/// draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kv {
    pub request: RequestId,
    pub position: u64,
    pub token: i32,
    pub prefix: u64,
    pub valid: bool,
}

/// The digest of each prefix of `seq` under `salt`: entry `i` covers `seq[..=i]` (what the
/// KV of position `i` depends on; two requests share it only with the same salt and tokens).
pub fn prefix_digests(salt: &[u8], seq: &[i32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325_u64 ^ salt.len() as u64;
    for &byte in salt {
        h = (h ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3);
    }
    seq.iter()
        .map(|&token| {
            h = (h ^ u64::from(u32::from_le_bytes(token.to_le_bytes())))
                .wrapping_mul(0x100_0000_01b3);
            h ^= h >> 29;
            h
        })
        .collect()
}

/// A CP group of schedulers, one per rank, plus their simulated KV pools.
pub struct Group {
    pub ranks: Vec<Scheduler>,
    pub config: SchedulerConfig,
    pub model: Model,
    pools: Vec<Vec<KvCell>>,
    /// Each rank's host KV pool (`host_tier_superblocks` pages), written and read only
    /// through the host page ids of the schedules.
    host_pools: Vec<Vec<KvCell>>,
    /// The host pages each suspended (or just resumed) request holds, in table order.
    host: BTreeMap<RequestId, Vec<i32>>,
    /// Which request holds each host page: a copy-out onto a held page is a race.
    host_owner: BTreeMap<i32, RequestId>,
    /// Superblocks the executor copied out to the host tier and back in, to check the
    /// scheduler's `suspended_superblocks` / `resumed_superblocks` against.
    copied_out: u64,
    copied_in: u64,
    /// Queue order of every request ever added: `(0, arrival)`, or under priority admission
    /// `(-priority, arrival)`.
    arrival: BTreeMap<RequestId, (i64, usize)>,
    /// What the harness knows each live request holds: prompt + tokens it sampled.
    known: BTreeMap<RequestId, Vec<i32>>,
    /// Tokens a request's current (re-)prefill has been fed so far.
    prefill_progress: BTreeMap<RequestId, u64>,
    /// Requests aborted while the pending step runs: their token of it is dropped.
    aborting: BTreeSet<RequestId>,
    /// Overlap mode: the step that ran on the "device" and is not updated yet, and its
    /// sampled tokens (which the next step's `generation_input_refs` point into).
    in_flight: Option<Flight>,
    /// The device's per-batch-slot state: the request whose state it holds, or `None`
    /// (poisoned) once the slot was freed.
    device_slots: Vec<Option<RequestId>>,
    /// The batch slot each request's state was last written to on the device.
    slot_of: BTreeMap<RequestId, usize>,
    /// Each request's original prompt length and `max_new_tokens`.
    limits: BTreeMap<RequestId, (usize, u32)>,
    /// The drafts proposed for the next `schedule()`, by request.
    proposed: BTreeMap<RequestId, Vec<i32>>,
    /// Each request's cache salt.
    salts: BTreeMap<RequestId, Vec<u8>>,
    /// Overlap mode: the step that failed on the device (`RunOptions::fail_per_mille`),
    /// pending until the step planned ahead of it is reverted, then it.
    failed: Option<ScheduleOutput>,
    /// What a reverted step's copy-ins do (`RunOptions::reverted_copy_ins`).
    reverted_copy_ins: RevertedCopyIns,
    /// KV tokens read back and checked (`RunResult::kv_reads`).
    kv_reads: std::cell::Cell<u64>,
    pub result: RunResult,
}

/// A step that ran and awaits its update (overlap mode).
#[derive(Debug, Clone)]
struct Flight {
    out: ScheduleOutput,
    tokens: Vec<i32>,
    eos: Vec<bool>,
    /// Drafts accepted per generation entry.
    accepted: Vec<u32>,
    /// The tokens the step appends to each request it samples for (its accepted rows, up
    /// to an end-of-sequence), in `sample_ids` order.
    appended: Vec<(RequestId, Vec<i32>)>,
    /// The cells the step wrote a draft's KV into: (request, position, rank, slot).
    draft_cells: Vec<(RequestId, u64, usize, usize)>,
}

impl Flight {
    /// What the step appends to `id`, if it samples for it.
    fn appended_to(&self, id: RequestId) -> Option<&[i32]> {
        self.appended
            .iter()
            .find(|(of, _)| *of == id)
            .map(|(_, tokens)| tokens.as_slice())
    }

    /// Whether the step's decode of `id` verifies drafts.
    fn drafted(&self, id: RequestId) -> bool {
        self.out
            .generation_ids
            .iter()
            .zip(&self.out.generation_draft_counts)
            .any(|(&of, &count)| of == id && count > 0)
    }
}

impl Group {
    pub fn new(config: &SchedulerConfig, model: Model) -> Self {
        let cp = config.cp_size;
        let ranks: Vec<Scheduler> = (0..cp)
            .map(|r| Scheduler::new(config.with_rank(r)).expect("valid config"))
            .collect();
        let slots = config.capacity_superblocks as usize * config.tokens_per_block as usize;
        Self {
            ranks,
            config: config.clone(),
            model,
            pools: vec![vec![KvCell::Empty; slots]; cp as usize],
            host_pools: vec![
                vec![
                    KvCell::Empty;
                    config.host_tier_superblocks as usize
                        * config.tokens_per_block as usize
                ];
                cp as usize
            ],
            host: BTreeMap::new(),
            host_owner: BTreeMap::new(),
            copied_out: 0,
            copied_in: 0,
            arrival: BTreeMap::new(),
            known: BTreeMap::new(),
            prefill_progress: BTreeMap::new(),
            aborting: BTreeSet::new(),
            in_flight: None,
            device_slots: Vec::new(),
            slot_of: BTreeMap::new(),
            limits: BTreeMap::new(),
            proposed: BTreeMap::new(),
            salts: BTreeMap::new(),
            failed: None,
            reverted_copy_ins: RevertedCopyIns::default(),
            kv_reads: std::cell::Cell::new(0),
            result: RunResult::default(),
        }
    }

    /// What the device knows of a request's tokens: what the harness knows plus its token
    /// of the step in flight, if any.
    fn view(&self, id: RequestId) -> Vec<i32> {
        let mut tokens = self.known[&id].clone();
        if let Some(flight) = &self.in_flight {
            if let Some(appended) = flight.appended_to(id) {
                tokens.extend_from_slice(appended);
            }
        }
        tokens
    }

    /// Frees a request's batch slot on the device: whatever it held is poison now.
    fn poison_slot(&mut self, id: RequestId) {
        if let Some(slot) = self.slot_of.remove(&id) {
            self.device_slots[slot] = None;
        }
    }

    /// The device side of the batch slots: freed slots are poisoned, a context entry (or a
    /// decode in a slot new to its request) writes the request's state into its slot, and
    /// a decode in the slot its request already had reads it, which must still be that
    /// request's.
    fn check_device_slots(&mut self, out: &ScheduleOutput) {
        for id in out
            .sat_out_ids
            .iter()
            .chain(&out.preempted_ids)
            .chain(&out.suspended_ids)
        {
            self.poison_slot(*id);
        }
        for (id, &slot) in out.context_ids.iter().zip(&out.context_batch_slots) {
            let slot = usize::try_from(slot).unwrap();
            if slot >= self.device_slots.len() {
                self.device_slots.resize(slot + 1, None);
            }
            if let Some(old) = self.slot_of.insert(*id, slot) {
                assert_eq!(old, slot, "step {}: {id} moved batch slots", out.step);
            }
            self.device_slots[slot] = Some(*id);
        }
        for (id, &slot) in out.generation_ids.iter().zip(&out.generation_batch_slots) {
            let slot = usize::try_from(slot).unwrap();
            if slot >= self.device_slots.len() {
                self.device_slots.resize(slot + 1, None);
            }
            if let Some(&held) = self.slot_of.get(id) {
                assert_eq!(held, slot, "step {}: {id} moved batch slots", out.step);
                assert_eq!(
                    self.device_slots[slot],
                    Some(*id),
                    "step {}: the decode of {id} reads batch slot {slot}, which was freed or given away",
                    out.step
                );
            } else {
                self.slot_of.insert(*id, slot);
                self.device_slots[slot] = Some(*id);
            }
        }
    }

    /// Adds a request on every rank; all ranks must agree on the outcome.
    pub fn add(&mut self, spec: &Spec) -> Result<(), CoreError> {
        let results: Vec<_> = self
            .ranks
            .iter_mut()
            .map(|s| {
                s.add_request_salted(
                    spec.id,
                    &spec.prompt,
                    spec.max_new_tokens,
                    spec.priority,
                    &spec.salt,
                )
            })
            .collect();
        assert!(
            results.windows(2).all(|w| w[0] == w[1]),
            "ranks disagree on add: {results:?}"
        );
        results[0].clone()?;
        let next = self.arrival.len();
        let rank = match self.config.admission_policy {
            AdmissionPolicy::Fcfs => 0,
            AdmissionPolicy::Priority => -i64::from(spec.priority),
        };
        self.arrival.insert(spec.id, (rank, next));
        let queue = self.ranks[0].queue_ids();
        assert!(
            queue
                .windows(2)
                .all(|w| self.arrival[&w[0]] < self.arrival[&w[1]]),
            "the queue is out of admission order after adding {}: {queue:?}",
            spec.id
        );
        self.known.insert(spec.id, spec.prompt.clone());
        self.limits
            .insert(spec.id, (spec.prompt.len(), spec.max_new_tokens));
        self.prefill_progress.insert(spec.id, 0);
        self.salts.insert(spec.id, spec.salt.clone());
        Ok(())
    }

    /// Proposes random drafts on every rank (the same on each) for the next `schedule()`:
    /// each live request with probability `draft_per_mille`, `1..=num_speculative_tokens`
    /// tokens, each the model's continuation of what the device knows (the request's
    /// tokens, its token in flight included, and the drafts before it) with probability
    /// `draft_true_per_mille`, else a wrong one.
    fn propose_random(&mut self, rng: &mut Rng, options: RunOptions) {
        self.proposed.clear();
        let most = self.config.num_speculative_tokens;
        if options.draft_per_mille == 0 || most == 0 {
            return;
        }
        let (mut ids, mut counts, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
        for id in self.ranks[0].queue_ids() {
            if rng.below(1000) >= options.draft_per_mille {
                continue;
            }
            let k = u32::try_from(rng.range(1, u64::from(most))).unwrap();
            let mut seq = self.view(id);
            let mut drafts = Vec::new();
            for _ in 0..k {
                let truth = self.model.next_token(id, &seq);
                let token = if rng.below(1000) < options.draft_true_per_mille {
                    truth
                } else {
                    let wrong =
                        (u64::try_from(truth).unwrap() + 1 + rng.below(self.model.vocab - 1))
                            % self.model.vocab;
                    i32::try_from(wrong).unwrap()
                };
                seq.push(token);
                drafts.push(token);
            }
            ids.push(id);
            counts.push(k);
            tokens.extend(&drafts);
            self.result.drafts_proposed += u64::from(k);
            self.proposed.insert(id, drafts);
        }
        for s in &mut self.ranks {
            s.propose_drafts(&ids, &counts, &tokens)
                .expect("proposals for live requests");
        }
    }

    /// Schedules on every rank and checks agreement; all ranks must fail alike.
    pub fn schedule(&mut self) -> Result<Vec<ScheduleOutput>, CoreError> {
        let slots_before = self.batch_slots();
        let live = self.ranks[0].num_live();
        let outs: Vec<Result<ScheduleOutput, CoreError>> = self
            .ranks
            .iter_mut()
            .map(|s| s.schedule().cloned())
            .collect();
        if outs.iter().any(Result::is_err) {
            assert!(
                outs.windows(2).all(|w| w[0] == w[1]),
                "ranks disagree on a failed schedule: {outs:?}"
            );
            return Err(outs.into_iter().next().unwrap().unwrap_err());
        }
        let outs: Vec<ScheduleOutput> = outs.into_iter().map(Result::unwrap).collect();
        self.check_agreement(&outs);
        self.check_ladder(&outs[0]);
        self.check_slot_order(&slots_before, &outs[0]);
        self.check_prefill_cap(live, &outs[0]);
        Ok(outs)
    }

    /// With `long_prefill_token_threshold`, no prompt chunk of a step scheduled while more
    /// than `live == 1` requests were live is longer than the cap: the threshold, raised to
    /// `max_num_tokens / live` when adaptive, and to one chunk unit.
    fn check_prefill_cap(&self, live: usize, out: &ScheduleOutput) {
        let c = &self.config;
        if c.long_prefill_token_threshold == 0 || live <= 1 {
            return;
        }
        let mut cap = u64::from(c.long_prefill_token_threshold);
        if c.long_prefill_token_threshold_adaptive {
            cap = cap.max(u64::from(c.max_num_tokens) / live as u64);
        }
        cap = cap.max(u64::from(c.effective_chunk_unit()));
        for (id, &len) in out.context_ids.iter().zip(&out.context_lens) {
            assert!(
                len <= cap,
                "step {}: a chunk of {len} tokens for request {id}, past the prefill cap {cap}",
                out.step
            );
        }
    }

    /// The batch slot of every live request (rank 0; `check_agreement` compares the
    /// ranks' state digests, which cover the slots).
    fn batch_slots(&self) -> BTreeMap<RequestId, Option<u32>> {
        let s = &self.ranks[0];
        s.queue_ids()
            .into_iter()
            .map(|id| (id, s.batch_slot(id).unwrap()))
            .collect()
    }

    /// Batch slots are persistent, entries use the one their request holds, and they go
    /// in queue order: a `Decoding` request the step leaves without a slot (one that
    /// neither decodes nor sits out, e.g. resumed while every slot was taken) is passed
    /// over by nobody behind it: no request behind it got a new slot in the step. One
    /// whose abort is pending does not count: it finishes when the older pending step
    /// closes and never decodes again, so a step planned ahead gives it no claim.
    fn check_slot_order(&self, before: &BTreeMap<RequestId, Option<u32>>, out: &ScheduleOutput) {
        let s = &self.ranks[0];
        let entries = out
            .context_ids
            .iter()
            .zip(&out.context_batch_slots)
            .chain(out.generation_ids.iter().zip(&out.generation_batch_slots));
        for (id, &slot) in entries {
            assert_eq!(
                s.batch_slot(*id).unwrap(),
                Some(u32::try_from(slot).unwrap()),
                "step {}: the entry of {id} is not in the slot it holds",
                out.step
            );
        }
        let mut left_without: Option<RequestId> = None;
        for id in s.queue_ids() {
            let (was, now) = (
                before.get(&id).copied().flatten(),
                s.batch_slot(id).unwrap(),
            );
            if let (Some(was), Some(now)) = (was, now) {
                assert_eq!(
                    was, now,
                    "step {}: request {id} changed batch slot",
                    out.step
                );
            }
            if let (Some(older), None, Some(now)) = (left_without, was, now) {
                panic!(
                    "step {}: request {id} took batch slot {now} while {older}, ahead of it, \
                     decodes without one\n{}",
                    out.step,
                    out.summary()
                );
            }
            if now.is_none()
                && s.request_state(id).unwrap() == RequestState::Decoding
                && !out.sat_out_ids.contains(&id)
                && !s.is_abort_requested(id).unwrap()
            {
                left_without.get_or_insert(id);
            }
        }
    }

    /// No futile preemption: every request that preempted or suspended a victim in this
    /// step is served in it. A victim goes past the preemption bound only for the queue
    /// head (the oldest live request).
    fn check_ladder(&mut self, out: &ScheduleOutput) {
        // A suspended queue head that preempted to come back is served by its resume.
        let served = |id: &RequestId| {
            out.generation_ids.contains(id)
                || out.context_ids.contains(id)
                || out.resumed_ids.contains(id)
        };
        let head = self.known.keys().min_by_key(|id| self.arrival[id]).copied();
        let bound = self.config.max_preemptions_per_request;
        for (victims, requesters) in [
            (&out.preempted_ids, &out.preempted_requester_ids),
            (&out.suspended_ids, &out.suspended_requester_ids),
        ] {
            for (victim, requester) in victims.iter().zip(requesters) {
                assert!(
                    served(requester),
                    "step {}: request {victim} was preempted for request {requester}, which is not served in that step",
                    out.step
                );
                let preemptions = self.ranks[0]
                    .request_metrics(*victim)
                    .unwrap()
                    .victim_choices;
                if preemptions > bound {
                    assert_eq!(
                        Some(*requester),
                        head,
                        "step {}: request {victim} preempted {preemptions} times (bound {bound}) for a request that is not the queue head",
                        out.step
                    );
                    self.result.preemptions_past_bound += 1;
                }
            }
        }
    }

    fn check_agreement(&self, outs: &[ScheduleOutput]) {
        let invariant = |o: &ScheduleOutput| ScheduleOutput {
            rank_placement: RankPlacement::default(),
            ..o.clone()
        };
        let first = invariant(&outs[0]);
        for (rank, out) in outs.iter().enumerate() {
            assert_eq!(
                invariant(out),
                first,
                "rank {rank} schedules differently from rank 0"
            );
            assert_eq!(out.digest, outs[0].digest, "rank {rank} digest differs");
            assert_eq!(
                out.summary(),
                outs[0].summary(),
                "rank {rank} summary differs"
            );
            let fingerprint = self.ranks[rank].config().fingerprint();
            assert_eq!(out.digest, out.compute_digest(fingerprint));
            assert!(out.differing_fields(&outs[0]).is_empty());
            out.check_lengths().unwrap();
        }
        let digests: Vec<u64> = self.ranks.iter().map(Scheduler::state_digest).collect();
        assert!(
            digests.windows(2).all(|w| w[0] == w[1]),
            "scheduler states differ: {digests:x?}"
        );
        self.check_rank_fields(outs);
        self.check_structure(&outs[0]);
    }

    /// Exactly the owner appends each decode token; per-rank lengths add up.
    fn check_rank_fields(&self, outs: &[ScheduleOutput]) {
        let cp = u64::from(self.config.cp_size);
        let tpb = u64::from(self.config.tokens_per_block);
        let gen = &outs[0];
        for (rank, out) in outs.iter().enumerate() {
            let placement = out.rank_placement;
            assert_eq!(usize::try_from(placement.cp_rank()).unwrap(), rank);
            assert_eq!(u64::from(placement.cp_size()), cp);
            assert_eq!(u64::from(placement.tokens_per_block()), tpb);
        }
        let active: Vec<Vec<bool>> = outs
            .iter()
            .map(|o| o.generation_active().collect())
            .collect();
        let local: Vec<Vec<u64>> = outs
            .iter()
            .map(|o| o.generation_local_lens().collect())
            .collect();
        let past: Vec<Vec<u64>> = outs
            .iter()
            .map(|o| o.generation_past_seen_lens().collect())
            .collect();
        let owners: Vec<Vec<u32>> = outs
            .iter()
            .map(|o| o.generation_owner_ranks().collect())
            .collect();
        for i in 0..gen.generation_ids.len() {
            let pos = gen.generation_positions[i];
            let owner = (pos / tpb) % cp;
            for (rank, owners) in owners.iter().enumerate() {
                assert_eq!(
                    u64::from(owners[i]),
                    owner,
                    "owner of position {pos} on rank {rank}"
                );
            }
            let active: Vec<usize> = (0..outs.len()).filter(|&r| active[r][i]).collect();
            assert_eq!(
                active,
                vec![usize::try_from(owner).unwrap()],
                "exactly the owner is active for position {pos}"
            );
            let after: u64 = local.iter().map(|l| l[i]).sum();
            let before: u64 = past.iter().map(|p| p[i]).sum();
            assert_eq!(
                (after, before),
                (pos + 1, pos),
                "local lens must sum to the global length"
            );
            for rank in 0..outs.len() {
                let grew = local[rank][i] - past[rank][i];
                assert_eq!(grew, u64::from(rank as u64 == owner));
            }
        }
    }

    /// Every id at most once among entries; slots distinct and in range; budgets kept;
    /// victims behind their requesters; partial chunks in whole units; no leak.
    fn check_structure(&self, gen: &ScheduleOutput) {
        let mut seen = std::collections::BTreeSet::new();
        let mut slots = std::collections::BTreeSet::new();
        for (id, slot) in gen
            .context_ids
            .iter()
            .zip(&gen.context_batch_slots)
            .chain(gen.generation_ids.iter().zip(&gen.generation_batch_slots))
        {
            assert!(
                seen.insert(*id),
                "request {id} has two entries in step {}",
                gen.step
            );
            assert!(
                slots.insert(*slot),
                "batch slot {slot} used twice in step {}",
                gen.step
            );
            assert!(u32::try_from(*slot).is_ok_and(|slot| slot < self.config.max_batch_size));
        }
        assert!(seen.len() <= self.config.max_batch_size as usize);
        assert!(gen.num_tokens <= u64::from(self.config.max_num_tokens));
        let ctx_tokens: u64 = gen.context_lens.iter().sum();
        let draft_tokens: u64 = gen.generation_draft_counts.iter().sum();
        assert_eq!(
            gen.num_tokens,
            ctx_tokens + gen.generation_ids.len() as u64 + draft_tokens
        );
        self.check_drafts(gen);
        assert_eq!(gen.context_token_ids.len() as u64, ctx_tokens);
        // Victims strictly behind the request that needed their pages.
        for (victims, requesters) in [
            (&gen.preempted_ids, &gen.preempted_requester_ids),
            (&gen.suspended_ids, &gen.suspended_requester_ids),
        ] {
            assert_eq!(victims.len(), requesters.len());
            for (v, r) in victims.iter().zip(requesters.iter()) {
                assert!(
                    self.arrival[v] > self.arrival[r],
                    "victim {v} is not behind requester {r}"
                );
                assert!(
                    !gen.generation_ids.contains(v),
                    "victim {v} still has a generation entry"
                );
            }
        }
        // Chunks: a chunk that does not complete its prompt is a multiple of the unit.
        let unit = u64::from(self.config.effective_chunk_unit());
        for i in 0..gen.context_ids.len() {
            if !gen.context_completes[i] {
                assert!(self.config.enable_chunked_prefill);
                assert_eq!(
                    gen.context_lens[i] % unit,
                    0,
                    "partial chunk not a multiple of chunk_unit"
                );
            }
        }
        for s in &self.ranks {
            let ledger = s.ledger();
            let holdings = ledger.holdings();
            let held: u32 = holdings.iter().map(|&(_, n)| n).sum();
            // Tables may name the same superblock only with prefix caching.
            let distinct: BTreeSet<u32> = holdings
                .iter()
                .flat_map(|&(id, _)| ledger.request(id).unwrap().table().to_vec())
                .collect();
            if !self.config.enable_prefix_caching {
                assert_eq!(held as usize, distinct.len(), "tables share superblocks");
            }
            assert_eq!(
                u32::try_from(distinct.len()).unwrap() + ledger.free_superblocks(),
                ledger.capacity(),
                "superblocks leaked"
            );
        }
    }

    /// The drafts a step verifies: a prefix of each request's proposal, never past its
    /// `max_new_tokens` (its sampled row and its drafts fit what it may still generate,
    /// its token in flight counted); one step ahead, no request whose decode in the step
    /// in flight verifies drafts is decoded or chosen as a victim.
    fn check_drafts(&self, out: &ScheduleOutput) {
        assert_eq!(
            out.generation_draft_counts.len(),
            out.generation_ids.len(),
            "one draft count per generation entry"
        );
        let mut tokens = out.generation_draft_tokens.iter();
        for (i, &id) in out.generation_ids.iter().enumerate() {
            let count = usize::try_from(out.generation_draft_counts[i]).unwrap();
            let drafts: Vec<i32> = tokens.by_ref().take(count).copied().collect();
            assert_eq!(drafts.len(), count, "draft tokens of step {}", out.step);
            if count == 0 {
                continue;
            }
            let proposed = self.proposed.get(&id).map_or(&[][..], Vec::as_slice);
            assert_eq!(
                &proposed[..count.min(proposed.len())],
                &drafts[..],
                "step {}: drafts of {id} are not its proposal's first {count}",
                out.step
            );
            let (prompt_len, max_new) = self.limits[&id];
            let generated = self.view(id).len() - prompt_len;
            assert!(
                generated + 1 + count <= max_new as usize,
                "step {}: {id} verifies {count} drafts with {} tokens left",
                out.step,
                max_new as usize - generated
            );
        }
        assert!(tokens.next().is_none(), "draft tokens past the counts");
        let older = self
            .in_flight
            .as_ref()
            .map(|flight| &flight.out)
            .or(self.failed.as_ref());
        if let Some(older) = older {
            let drafted = |id: RequestId| {
                older
                    .generation_ids
                    .iter()
                    .zip(&older.generation_draft_counts)
                    .any(|(&of, &count)| of == id && count > 0)
            };
            for &id in out
                .generation_ids
                .iter()
                .chain(&out.preempted_ids)
                .chain(&out.suspended_ids)
            {
                assert!(
                    !drafted(id),
                    "step {} (planned ahead) decodes or preempts {id}, whose decode in flight verifies drafts",
                    out.step
                );
            }
        }
    }

    /// Copies suspended requests' pages to their host pages, as an executor must before
    /// anything else writes KV (each rank its own share of every page). A host page still
    /// held by another request (e.g. one a resume of this step reads) is a race.
    fn copy_out_suspended(&mut self, out: &ScheduleOutput) {
        let tpb = self.config.tokens_per_block as usize;
        assert_eq!(
            out.suspended_block_ids.len(),
            out.suspended_host_block_ids.len()
        );
        let mut offset = 0;
        for (i, id) in out.suspended_ids.iter().enumerate() {
            let count = usize::try_from(out.suspended_block_counts[i]).unwrap();
            let pages = &out.suspended_block_ids[offset..offset + count];
            let host_pages = &out.suspended_host_block_ids[offset..offset + count];
            offset += count;
            self.copied_out += count as u64;
            for (&page, &host_page) in pages.iter().zip(host_pages) {
                if let Some(holder) = self.host_owner.insert(host_page, *id) {
                    panic!(
                        "step {}: {id} is copied out onto host page {host_page}, held by {holder}",
                        out.step
                    );
                }
                let (src, dst) = (
                    usize::try_from(page).unwrap() * tpb,
                    usize::try_from(host_page).unwrap() * tpb,
                );
                for (pool, host_pool) in self.pools.iter().zip(&mut self.host_pools) {
                    host_pool[dst..dst + tpb].copy_from_slice(&pool[src..src + tpb]);
                }
            }
            assert!(
                self.host.insert(*id, host_pages.to_vec()).is_none(),
                "{id} suspended twice"
            );
        }
        assert_eq!(offset, out.suspended_block_ids.len());
    }

    /// Copies resumed requests' KV back from their host pages into their new pages, in a
    /// step that runs (`reverted`: `None`), or as a reverted step's copy-ins did
    /// ([`RevertedCopyIns`]).
    fn copy_in_resumed(&mut self, out: &ScheduleOutput, reverted: Option<RevertedCopyIns>) {
        let tpb = self.config.tokens_per_block as usize;
        assert_eq!(
            out.resumed_block_ids.len(),
            out.resumed_host_block_ids.len()
        );
        let mut offset = 0;
        for (i, id) in out.resumed_ids.iter().enumerate() {
            let count = usize::try_from(out.resumed_block_counts[i]).unwrap();
            let pages = &out.resumed_block_ids[offset..offset + count];
            let host_pages = &out.resumed_host_block_ids[offset..offset + count];
            offset += count;
            assert_eq!(
                self.host.get(id).map(Vec::as_slice),
                Some(host_pages),
                "{id} resumes from the host pages it was suspended to"
            );
            if reverted.is_none() {
                // A resumed prefill may also take a chunk (and more pages) in this step. A
                // reverted step's tables are gone (or, one step ahead, changed) by now.
                let (table, _) = self.ranks[0].block_table(&[*id], None).unwrap();
                assert_eq!(&table[..count], pages, "{id} resumes into its first pages");
                self.copied_in += count as u64;
            } else {
                self.result.reverted_copy_ins += (count * tpb * self.pools.len()) as u64;
            }
            for (&page, &host_page) in pages.iter().zip(host_pages) {
                let (src, dst) = (
                    usize::try_from(host_page).unwrap() * tpb,
                    usize::try_from(page).unwrap() * tpb,
                );
                for (pool, host_pool) in self.pools.iter_mut().zip(&self.host_pools) {
                    match reverted {
                        None | Some(RevertedCopyIns::Done) => {
                            pool[dst..dst + tpb].copy_from_slice(&host_pool[src..src + tpb]);
                        }
                        Some(RevertedCopyIns::NotDone) => {}
                        Some(RevertedCopyIns::Either) => {
                            pool[dst..dst + tpb].fill(KvCell::Unknown { step: out.step });
                        }
                    }
                }
            }
        }
        assert_eq!(offset, out.resumed_block_ids.len());
    }

    /// Forgets the host pages of `id` (the scheduler freed them).
    fn release_host(&mut self, id: RequestId) {
        for page in self.host.remove(&id).unwrap_or_default() {
            assert_eq!(self.host_owner.remove(&page), Some(id));
        }
    }

    /// Runs the step's copies, checks its prefix-cache hits, writes its KV into each rank's
    /// pool (as the owner rank would) and checks what each chunk reads back; decodes read
    /// theirs when they are sampled. Decode inputs still in flight are gathered from the
    /// step in flight's sampled tokens. Returns the cells it wrote drafts' KV into.
    fn execute(&mut self, outs: &[ScheduleOutput]) -> Vec<(RequestId, u64, usize, usize)> {
        let out = &outs[0];
        self.copy_out_suspended(out);
        self.copy_in_resumed(out, None);
        self.check_device_slots(out);
        let hits = self.check_context_entries(out);
        let inputs = self.decode_inputs(out);
        let (seqs, values) = self.query_tokens(out, &inputs);
        let draft_cells = self.write_kv(out, &seqs, &values, &hits);
        // Attention: each chunk's tokens read the context before them, its own included
        // (a completing chunk's last token reads everything again when it is sampled).
        let chunks = out.context_ids.iter().zip(&seqs).enumerate();
        for (i, (&id, seq)) in chunks.filter(|&(i, _)| !out.context_completes[i]) {
            let end = out.context_starts[i] + out.context_lens[i];
            self.read_context(id, end - 1, seq);
        }
        draft_cells
    }

    /// Replay checks of the step's context entries against what the harness knows (each
    /// chunk continues its prefill with the request's tokens). Returns each context entry's
    /// prefix-cache hit (tokens, 0 for none), which `write_kv` reads back just before the
    /// entry's own writes; counts the superblocks of each hit that do not hold the reader's
    /// KV before the step (only the step's earlier entries can have written them).
    fn check_context_entries(&mut self, out: &ScheduleOutput) -> Vec<u64> {
        let cp = u64::from(self.config.cp_size);
        let tpb = u64::from(self.config.tokens_per_block);
        let per = tpb * cp;
        let mut offset = 0usize;
        let mut hits = Vec::with_capacity(out.context_ids.len());
        for i in 0..out.context_ids.len() {
            let id = out.context_ids[i];
            let (start, len) = (out.context_starts[i], out.context_lens[i]);
            let (from, to) = (
                usize::try_from(start).unwrap(),
                usize::try_from(start + len).unwrap(),
            );
            let tokens = &out.context_token_ids[offset..offset + (to - from)];
            offset += to - from;
            let known = self.view(id);
            let progress = self.prefill_progress[&id];
            let cached = out.context_cached_lens[i];
            assert_eq!(
                cached > 0,
                self.config.enable_prefix_caching && progress == 0 && start > 0,
                "step {}: {id} starts at {start} (fed {progress}), {cached} cached",
                out.step
            );
            if cached > 0 {
                // An admission that found its first superblocks cached: they must hold the
                // KV this request would compute there (its own tokens at the same positions
                // under its salt), whoever wrote it (checked in `write_kv`).
                assert_eq!(start, cached, "{id}'s chunk starts after its hit");
                assert_eq!(start % per, 0, "a hit of {id} ends inside a superblock");
                assert!(
                    start < known.len() as u64,
                    "{id}'s last token is always computed"
                );
                let missing: BTreeSet<u64> = self
                    .context_errors(id, start - 1, &known)
                    .into_iter()
                    .map(|pos| pos / per)
                    .collect();
                self.result.same_step_cached_tokens += missing.len() as u64 * per;
                self.result.cached_tokens += start;
            } else {
                assert_eq!(
                    start, progress,
                    "chunk of {id} does not continue its prefill"
                );
            }
            hits.push(cached);
            assert_eq!(tokens, &known[from..to], "re-prefill tokens of {id}");
            let end = start + len;
            assert_eq!(out.context_completes[i], end == known.len() as u64);
        }
        hits
    }

    /// Each decode's input token (one still in flight gathered from the step in flight's
    /// sampled tokens), checked against what the harness knows.
    fn decode_inputs(&mut self, out: &ScheduleOutput) -> Vec<i32> {
        let mut inputs = Vec::with_capacity(out.generation_ids.len());
        for i in 0..out.generation_ids.len() {
            let id = out.generation_ids[i];
            let known = self.view(id);
            assert_eq!(
                out.generation_positions[i],
                known.len() as u64 - 1,
                "decode position of {id}"
            );
            let input = if let Ok(row) = usize::try_from(out.generation_input_refs[i]) {
                let flight = self
                    .in_flight
                    .as_ref()
                    .expect("an input token in flight needs a step in flight");
                let sampled = flight.out.sample_ids().nth(row);
                assert_eq!(sampled, Some(id), "input row of {id}");
                assert_eq!(
                    out.generation_input_tokens[i], -1,
                    "an input in flight is not given as a value"
                );
                self.result.inputs_in_flight += 1;
                flight.tokens[row]
            } else {
                assert_eq!(out.generation_input_refs[i], -1);
                out.generation_input_tokens[i]
            };
            assert_eq!(input, *known.last().unwrap(), "decode input of {id}");
            inputs.push(input);
        }
        inputs
    }

    /// Writes the step's KV into each rank's pool through its slot mapping, as the owner
    /// rank would: the KV of each entry's tokens (`seqs`: what it depends on; `values`:
    /// every query token in entry order). Entry by entry, context entries first: each
    /// context entry's prefix-cache hit (`hits`) is read back just before its own writes,
    /// so it sees what steps that ran and the step's earlier context entries wrote, and
    /// nothing of its own entry, a later one or a decode of the step. Returns the cells it
    /// wrote drafts' KV into.
    fn write_kv(
        &mut self,
        out: &ScheduleOutput,
        seqs: &[Vec<i32>],
        values: &[i32],
        hits: &[u64],
    ) -> Vec<(RequestId, u64, usize, usize)> {
        let cp = self.config.cp_size as usize;
        let tpb = u64::from(self.config.tokens_per_block);
        let digests: Vec<Vec<u64>> = out
            .context_ids
            .iter()
            .chain(&out.generation_ids)
            .zip(seqs)
            .map(|(id, seq)| prefix_digests(&self.salts[id], seq))
            .collect();
        let first_draft = out.context_ids.len();
        let mut ids = out.context_ids.clone();
        let mut starts = out.context_starts.clone();
        let mut counts = out.context_lens.clone();
        ids.extend(&out.generation_ids);
        starts.extend(&out.generation_positions);
        counts.extend(out.generation_draft_counts.iter().map(|&k| 1 + k));
        let slots: Vec<Vec<i64>> = self
            .ranks
            .iter()
            .map(|sched| {
                sched
                    .slot_mapping(&ids, &starts, &counts)
                    .expect("slot mapping")
            })
            .collect();
        let mut draft_cells = Vec::new();
        let mut first = 0;
        for i in 0..ids.len() {
            if let Some(&cached) = hits.get(i).filter(|&&cached| cached > 0) {
                self.read_context(ids[i], cached - 1, &seqs[i]);
            }
            for (rank, slots) in slots.iter().enumerate() {
                for (k, pos) in (first..).zip(starts[i]..starts[i] + counts[i]) {
                    let owner = usize::try_from(pos / tpb).unwrap() % cp;
                    assert_eq!(
                        slots[k] >= 0,
                        owner == rank,
                        "slot of {} pos {pos} on rank {rank}",
                        ids[i]
                    );
                    let at = usize::try_from(pos).unwrap();
                    assert_eq!(values[k], seqs[i][at], "the token of {} at {pos}", ids[i]);
                    if slots[k] >= 0 {
                        let slot = usize::try_from(slots[k]).unwrap();
                        self.pools[rank][slot] = KvCell::Kv(Kv {
                            request: ids[i],
                            position: pos,
                            token: values[k],
                            prefix: digests[i][at],
                            valid: true,
                        });
                        if i >= first_draft && pos > starts[i] {
                            draft_cells.push((ids[i], pos, rank, slot));
                        }
                    }
                }
            }
            first += usize::try_from(counts[i]).unwrap();
        }
        draft_cells
    }

    /// Each entry's query tokens in entry order (context chunks, then each decode's input
    /// and drafts), and per entry the tokens its KV depends on (what the device knows of
    /// the request, then a decode's drafts).
    fn query_tokens(&self, out: &ScheduleOutput, inputs: &[i32]) -> (Vec<Vec<i32>>, Vec<i32>) {
        let mut seqs: Vec<Vec<i32>> = out.context_ids.iter().map(|&id| self.view(id)).collect();
        let mut values = out.context_token_ids.clone();
        let mut drafts = out.generation_draft_tokens.iter();
        for (i, &id) in out.generation_ids.iter().enumerate() {
            let count = usize::try_from(out.generation_draft_counts[i]).unwrap();
            let mut seq = self.view(id);
            values.push(inputs[i]);
            for &draft in drafts.by_ref().take(count) {
                seq.push(draft);
                values.push(draft);
            }
            seqs.push(seq);
        }
        (seqs, values)
    }

    /// Reads the context `0..=last` of `id` back from the pools through its block table, as
    /// attention would, and checks every cell against the KV-content model: the KV of the
    /// token `seq` has at that position, valid, computed over the same salt and tokens
    /// before it (`seq`: the request's tokens as the step sees them, drafts included).
    /// Without prefix caching the cell must also be the request's own.
    fn read_context(&self, id: RequestId, last: u64, seq: &[i32]) -> Vec<i32> {
        self.kv_reads.set(self.kv_reads.get() + last + 1);
        self.context_cells(id, last, seq)
            .into_iter()
            .enumerate()
            .map(|(at, read)| match read {
                Ok(token) => token,
                Err(message) => panic!(
                    "KV of {id} at {at} (token {}) is not there: {message}",
                    seq[at]
                ),
            })
            .collect()
    }

    /// The positions of `0..=last` of `id` whose cells [`Self::read_context`] would reject.
    fn context_errors(&self, id: RequestId, last: u64, seq: &[i32]) -> Vec<u64> {
        (0..)
            .zip(self.context_cells(id, last, seq))
            .filter_map(|(pos, read)| read.is_err().then_some(pos))
            .collect()
    }

    /// Each cell of the context `0..=last` of `id` read back through its block table: the
    /// token whose KV it holds if it is the one [`Self::read_context`] expects, else what it
    /// holds instead.
    fn context_cells(
        &self,
        id: RequestId,
        last: u64,
        seq: &[i32],
    ) -> Vec<std::result::Result<i32, String>> {
        let cp = u64::from(self.config.cp_size);
        let tpb = u64::from(self.config.tokens_per_block);
        let (table, _) = self.ranks[0].block_table(&[id], None).expect("block table");
        for s in &self.ranks[1..] {
            assert_eq!(
                s.block_table(&[id], None).unwrap().0,
                table,
                "ranks hold different tables"
            );
        }
        let upto = usize::try_from(last).unwrap() + 1;
        let digests = prefix_digests(&self.salts[&id], &seq[..upto]);
        (0..=last)
            .map(|pos| {
                let at = usize::try_from(pos).unwrap();
                let owner = usize::try_from((pos / tpb) % cp).unwrap();
                let page = table[usize::try_from(pos / (tpb * cp)).unwrap()];
                let slot = u64::try_from(page).unwrap() * tpb + pos % tpb;
                let cell = self.pools[owner][usize::try_from(slot).unwrap()];
                match cell {
                    KvCell::Kv(kv)
                        if kv.valid
                            && kv.position == pos
                            && kv.token == seq[at]
                            && kv.prefix == digests[at]
                            && (self.config.enable_prefix_caching || kv.request == id) =>
                    {
                        Ok(kv.token)
                    }
                    other => Err(format!(
                        "rank {owner} page {page} slot {slot} holds {other:?}"
                    )),
                }
            })
            .collect()
    }

    /// Samples the tokens of a step from the KV read back from the pools: a row per
    /// `sample_ids` entry (a drafted decode's `1 + k` rows: the model at its input and at
    /// each draft, the drafts before it read back too), and each generation entry's
    /// accepted drafts (the longest prefix its rows confirm, as a greedy verifier would;
    /// an end-of-sequence among them is the scheduler's to cut).
    fn sample(&self, out: &ScheduleOutput) -> (Vec<i32>, Vec<bool>, Vec<u32>) {
        let mut tokens = Vec::new();
        let mut eos = Vec::new();
        let mut accepted = Vec::new();
        let mut sample_at = |id: RequestId, last: u64, seq: &[i32], tokens: &mut Vec<i32>| {
            let context = self.read_context(id, last, seq);
            assert_eq!(
                context,
                seq[..=usize::try_from(last).unwrap()],
                "KV read back for {id} differs from its tokens"
            );
            let token = self.model.next_token(id, &context);
            tokens.push(token);
            eos.push(self.model.eos == Some(token));
            token
        };
        let mut drafts = out.generation_draft_tokens.iter();
        for i in 0..out.generation_ids.len() {
            let (id, pos) = (out.generation_ids[i], out.generation_positions[i]);
            let count = usize::try_from(out.generation_draft_counts[i]).unwrap();
            let mine: Vec<i32> = drafts.by_ref().take(count).copied().collect();
            let mut seq = self.view(id);
            seq.extend(&mine);
            let mut confirmed = true;
            let mut took = 0;
            for j in 0..=count {
                let token = sample_at(id, pos + j as u64, &seq, &mut tokens);
                confirmed &= mine.get(j) == Some(&token);
                took += u32::from(confirmed);
            }
            accepted.push(took);
        }
        for i in 0..out.context_ids.len() {
            if out.context_completes[i] {
                let id = out.context_ids[i];
                let seq = self.view(id);
                sample_at(
                    id,
                    out.context_starts[i] + out.context_lens[i] - 1,
                    &seq,
                    &mut tokens,
                );
            }
        }
        assert_eq!(tokens.len(), out.num_samples());
        (tokens, eos, accepted)
    }

    /// Runs the step that was scheduled on the "device": executes and samples it (its
    /// prefill progress and victims are mirrored now: the next step may be planned before
    /// this one is updated).
    fn run_on_device(&mut self, outs: &[ScheduleOutput]) -> Flight {
        let draft_cells = self.execute(outs);
        let out = &outs[0];
        let (tokens, eos, accepted) = self.sample(out);
        // What the step appends to each request: a decode's accepted rows up to an
        // end-of-sequence, a completing prompt's one token.
        let mut appended = Vec::new();
        let mut row = 0;
        for (i, &id) in out.generation_ids.iter().enumerate() {
            let count = usize::try_from(out.generation_draft_counts[i]).unwrap();
            let kept = usize::try_from(accepted[i]).unwrap() + 1;
            let end = (row..row + kept)
                .find(|&r| eos[r])
                .map_or(row + kept, |r| r + 1);
            appended.push((id, tokens[row..end].to_vec()));
            row += 1 + count;
            self.result.drafts_verified += count as u64;
            self.result.drafts_accepted += u64::from(accepted[i]);
            if count > 0 && out.generation_input_refs[i] >= 0 {
                self.result.ahead_drafted_decodes += 1;
            }
        }
        for (&id, _) in out
            .context_ids
            .iter()
            .zip(&out.context_completes)
            .filter(|(_, &completes)| completes)
        {
            appended.push((id, vec![tokens[row]]));
            row += 1;
        }
        for i in 0..out.context_ids.len() {
            let id = out.context_ids[i];
            let end = out.context_starts[i] + out.context_lens[i];
            *self.prefill_progress.get_mut(&id).unwrap() =
                if out.context_completes[i] { 0 } else { end };
        }
        for (victim, requester) in out.preempted_ids.iter().zip(&out.preempted_requester_ids) {
            self.prefill_progress.insert(*victim, 0);
            self.result.victims.push((*victim, *requester));
        }
        for (victim, requester) in out.suspended_ids.iter().zip(&out.suspended_requester_ids) {
            self.result.victims.push((*victim, *requester));
        }
        Flight {
            out: out.clone(),
            tokens,
            eos,
            accepted,
            appended,
            draft_cells,
        }
    }

    /// Updates every rank with a step's sampled tokens (the oldest pending step).
    fn commit(&mut self, flight: &Flight) -> Vec<RequestId> {
        let Flight {
            out,
            tokens,
            eos,
            accepted,
            appended,
            draft_cells,
        } = flight;
        self.reject_drafts(out, accepted, draft_cells);
        let drafted = out.generation_draft_counts.iter().any(|&k| k > 0);
        let finished: Vec<Vec<RequestId>> = self
            .ranks
            .iter_mut()
            .map(|s| {
                // A step without drafts is updated as one always was.
                if drafted {
                    s.update_accepted(tokens, Some(eos), Some(accepted))
                } else {
                    s.update(tokens, Some(eos))
                }
                .expect("update")
                .to_vec()
            })
            .collect();
        assert!(
            finished.windows(2).all(|w| w[0] == w[1]),
            "ranks finish different requests"
        );
        let digests: Vec<u64> = self.ranks.iter().map(Scheduler::state_digest).collect();
        assert!(
            digests.windows(2).all(|w| w[0] == w[1]),
            "scheduler states differ after update: {digests:x?}"
        );
        // Mirror the step in what the harness knows (an aborted request's token is
        // dropped; one that finished while this step was pending is gone already).
        for (id, tokens) in appended {
            if !self.aborting.contains(id) {
                if let Some(known) = self.known.get_mut(id) {
                    known.extend_from_slice(tokens);
                }
            }
        }
        for id in &out.resumed_ids {
            self.release_host(*id); // the update frees the host pages a resume read
        }
        for id in &finished[0] {
            self.poison_slot(*id);
            self.collect(*id);
        }
        assert!(
            self.aborting.is_empty(),
            "an abort requested in the step did not finish"
        );
        // Every live request's tokens (the latest ones gathered from the token log) equal
        // a plain per-request vector.
        for (id, known) in &self.known {
            for s in &self.ranks {
                assert_eq!(&s.tokens(*id).unwrap(), known, "tokens of {id}");
            }
        }
        self.result.steps += 1;
        self.check_host_tier();
        finished[0].clone()
    }

    /// Marks the KV of the drafts the verifier rejected (those past each entry's accepted
    /// ones) not valid: written, but not the request's tokens. Only cells that still hold
    /// that write (nothing else may have written them since: the request holds them).
    fn reject_drafts(
        &mut self,
        out: &ScheduleOutput,
        accepted: &[u32],
        cells: &[(RequestId, u64, usize, usize)],
    ) {
        for &(id, pos, rank, slot) in cells {
            let entry = out.generation_ids.iter().position(|&g| g == id).unwrap();
            let kept_to = out.generation_positions[entry] + u64::from(accepted[entry]);
            if pos <= kept_to {
                continue;
            }
            match &mut self.pools[rank][slot] {
                KvCell::Kv(kv) if kv.request == id && kv.position == pos => {
                    assert!(kv.valid);
                    kv.valid = false;
                    self.result.rejected_draft_cells += 1;
                }
                other => panic!(
                    "step {}: the KV of {id}'s draft at {pos} was overwritten before its update: {other:?}",
                    out.step
                ),
            }
        }
    }

    /// Takes a finished request's output on every rank and checks it against what the
    /// harness knows.
    fn collect(&mut self, id: RequestId) {
        let outputs: Vec<RequestOutput> = self
            .ranks
            .iter_mut()
            .map(|s| s.take_output(id).unwrap())
            .collect();
        assert!(outputs.windows(2).all(|w| w[0] == w[1]));
        let output = outputs.into_iter().next().unwrap();
        assert_eq!(output.request_id, id);
        assert_eq!(
            output.metrics.generated_tokens,
            output.token_ids.len() as u64
        );
        let known = self.known.remove(&id).unwrap();
        assert!(known.ends_with(&output.token_ids));
        let was_aborting = self.aborting.remove(&id);
        match output.finish_reason {
            FinishReason::Aborted => {
                self.result.aborted.insert(id, output.token_ids);
            }
            reason => {
                assert!(!was_aborting, "{id} was aborted but finished as {reason:?}");
                let eos =
                    self.model.eos.is_some() && output.token_ids.last() == self.model.eos.as_ref();
                assert_eq!(reason == FinishReason::Eos, eos, "finish reason of {id}");
                self.result.outputs.insert(id, output.token_ids);
            }
        }
        self.prefill_progress.remove(&id);
        // Retired while a pending step resumes it, it keeps its host copy until that step
        // closes (the step's copy-in reads it).
        if !self.resumed_by_pending_step(id) {
            self.release_host(id);
        }
    }

    /// Whether a pending step (in flight, or failed and not reverted yet) resumes `id`.
    fn resumed_by_pending_step(&self, id: RequestId) -> bool {
        self.in_flight
            .as_ref()
            .map(|flight| &flight.out)
            .into_iter()
            .chain(&self.failed)
            .any(|out| out.resumed_ids.contains(&id))
    }

    /// Aborts `ids` on every rank (all must agree); between steps their outputs are
    /// taken at once, while a step is pending they are taken when it closes.
    pub fn abort(&mut self, ids: &[RequestId]) -> Result<(), CoreError> {
        let states: Vec<Option<&str>> = ids.iter().map(|&id| self.state_label(id)).collect();
        let results: Vec<_> = self.ranks.iter_mut().map(|s| s.abort_many(ids)).collect();
        assert!(
            results.windows(2).all(|w| w[0] == w[1]),
            "ranks disagree on abort: {results:?}"
        );
        let live = results[0].clone()?;
        for (&id, &live) in ids.iter().zip(&live) {
            assert_eq!(
                live,
                self.known.contains_key(&id),
                "abort of {id} finds it live"
            );
        }
        let digests: Vec<u64> = self.ranks.iter().map(Scheduler::state_digest).collect();
        assert!(
            digests.windows(2).all(|w| w[0] == w[1]),
            "scheduler states differ after abort: {digests:x?}"
        );
        let pending = self.ranks[0].is_step_pending();
        let when = if pending { " while pending" } else { "" };
        for state in states.into_iter().flatten() {
            self.result.abort_states.insert(format!("{state}{when}"));
        }
        for &id in ids {
            if !self.known.contains_key(&id) {
                continue; // finished before (its output was taken) or a repeat
            }
            if pending {
                assert!(self.ranks[0].is_abort_requested(id).unwrap());
                self.aborting.insert(id);
            } else {
                self.poison_slot(id);
                self.collect(id);
            }
        }
        if !pending {
            self.check_host_tier(); // a pending step's suspends are copied out when it runs
        }
        Ok(())
    }

    /// What state a live request is in, for `abort_states`.
    fn state_label(&self, id: RequestId) -> Option<&'static str> {
        let s = &self.ranks[0];
        let state = s.request_state(id).ok()?;
        if s.is_abort_requested(id).ok()? {
            return None;
        }
        let paused =
            state == RequestState::Waiting && s.request_metrics(id).ok()?.victim_choices > 0;
        Some(if paused {
            "recompute-paused"
        } else {
            state.as_str()
        })
    }

    /// The scheduler's host-tier use equals the pages the harness holds there, request
    /// by request.
    fn check_host_tier(&self) {
        for s in &self.ranks {
            assert_eq!(
                s.host_used_superblocks() as usize,
                self.host_owner.len(),
                "host tier leaked"
            );
            assert!(s.host_used_superblocks() <= self.config.host_tier_superblocks);
            // A request retired while a pending step resumes it is no longer live, but its
            // host copy is held until that step closes (counted in the use above).
            for (id, pages) in self
                .host
                .iter()
                .filter(|(id, _)| self.known.contains_key(id))
            {
                let held: Vec<i32> = s
                    .host_pages(*id)
                    .unwrap()
                    .iter()
                    .map(|&p| i32::try_from(p).unwrap())
                    .collect();
                assert_eq!(&held, pages, "host pages of {id}");
            }
        }
    }

    /// A reverted step's copies, as an executor makes them whether the step runs or not:
    /// its copy-outs, then its copy-ins as `reverted_copy_ins` says.
    fn copy_reverted(&mut self, out: &ScheduleOutput) {
        self.copy_out_suspended(out);
        self.copy_in_resumed(out, Some(self.reverted_copy_ins));
    }

    /// Preempted victims of a step that is being reverted still restart their prefill.
    fn note_reverted_victims(&mut self, out: &ScheduleOutput) {
        for id in out.preempted_ids.iter().chain(&out.suspended_ids) {
            self.poison_slot(*id);
        }
        for (victim, requester) in out.preempted_ids.iter().zip(&out.preempted_requester_ids) {
            self.prefill_progress.insert(*victim, 0);
            self.result.victims.push((*victim, *requester));
        }
        for (victim, requester) in out.suspended_ids.iter().zip(&out.suspended_requester_ids) {
            self.result.victims.push((*victim, *requester));
        }
    }

    /// After a revert: a request whose host pages the scheduler gave back without resuming
    /// it re-prefills (suspended by a reverted step with work of an older reverted step in
    /// its host copy, or resumed by the older step and recompute-paused by the newer).
    fn forget_released_host_copies(&mut self) {
        let holders: Vec<RequestId> = self.host.keys().copied().collect();
        for id in holders {
            if self.resumed_by_pending_step(id) {
                continue; // that step's copy-in reads it until it closes
            }
            if !self.known.contains_key(&id) {
                // Retired while the reverted step resumed it: its copy is free now.
                self.release_host(id);
                continue;
            }
            if self.ranks[0]
                .host_pages(id)
                .is_ok_and(|pages| !pages.is_empty())
            {
                continue;
            }
            assert_eq!(
                self.ranks[0].request_state(id).ok(),
                Some(RequestState::Waiting),
                "{id} lost its host copy without re-prefilling"
            );
            self.release_host(id);
            self.prefill_progress.insert(id, 0);
        }
    }

    /// Reverts the newest pending step on every rank and checks the ledger is back where it
    /// was (`before`: per-rank ledger digests and holdings before `schedule`). The executor
    /// made its copies (it may have started them before it knew the step would not run).
    pub fn revert_step(&mut self, out: &ScheduleOutput, before: &[RankSnapshot]) {
        self.copy_reverted(out);
        self.revert_newest(out, Some(before));
    }

    /// Reverts the newest pending step; `before` (per-rank snapshots before it was
    /// scheduled) when nothing closed since (the step planned last), else `None` (a failed
    /// step one step ahead: the update of the step before it came in between).
    fn revert_newest(&mut self, out: &ScheduleOutput, before: Option<&[RankSnapshot]>) {
        let mut aborted = Vec::new();
        // Abort marks (deferred while an older step stays pending) are state too.
        let marked = !self.aborting.is_empty();
        for rank in 0..self.ranks.len() {
            let closed = self.ranks[rank].revert().expect("revert").to_vec();
            assert!(
                rank == 0 || closed == aborted,
                "ranks abort different requests"
            );
            aborted = closed;
            if let Some(before) = before {
                Self::check_reverted(&self.ranks[rank], out, &before[rank], &aborted, marked);
            }
        }
        self.note_reverted_victims(out);
        // With an older step still pending, requested aborts wait for its close.
        let mut expected: Vec<RequestId> = if self.ranks[0].is_step_pending() {
            Vec::new()
        } else {
            self.aborting.iter().copied().collect()
        };
        expected.sort_by_key(|id| self.arrival[id]);
        assert_eq!(
            aborted, expected,
            "revert aborts the requested ones, in queue order"
        );
        for id in aborted {
            self.poison_slot(id);
            self.collect(id);
        }
        self.forget_released_host_copies();
        self.result.reverted_steps += 1;
        self.check_host_tier();
    }

    /// One rank after the revert of `out`: as it was before the step (`before`), except
    /// for its victims and the requests aborted by the revert, which hold nothing, and the
    /// prefixes it evicted from the pages it resumed requests onto, which are gone.
    fn check_reverted(
        s: &Scheduler,
        out: &ScheduleOutput,
        before: &RankSnapshot,
        aborted: &[RequestId],
        marked: bool,
    ) {
        let RankSnapshot {
            state_digest,
            ledger_digest,
            holdings,
            cached,
        } = before;
        // A prefix the step evicted from a page it resumed a request onto is not put
        // back (its copy-in may have overwritten the page): the one inexact undo.
        let overwritten: Vec<u32> = out
            .resumed_block_ids
            .iter()
            .map(|&page| u32::try_from(page).unwrap())
            .filter(|page| cached.contains(page))
            .collect();
        for &page in &overwritten {
            assert_eq!(
                s.ledger().prefix_cache().unwrap().key_of(page),
                None,
                "step {}: page {page} caches a prefix again after a revert of a copy-in onto it",
                out.step
            );
        }
        if !marked
            && aborted.is_empty()
            && out.preempted_ids.is_empty()
            && out.suspended_ids.is_empty()
            && overwritten.is_empty()
        {
            assert_eq!(
                s.ledger().state_digest(),
                *ledger_digest,
                "revert must restore the ledger"
            );
            assert_eq!(
                s.state_digest(),
                *state_digest,
                "revert must restore the scheduler"
            );
            return;
        }
        let now = s.ledger().holdings();
        for &(id, held) in holdings {
            let freed = out.preempted_ids.contains(&id)
                || out.suspended_ids.contains(&id)
                || aborted.contains(&id);
            let expected = if freed { 0 } else { held };
            let got = now.iter().find(|h| h.0 == id).map_or(0, |h| h.1);
            assert_eq!(got, expected, "request {id} after revert");
        }
        for &id in aborted {
            assert!(now.iter().all(|h| h.0 != id), "aborted {id} still held");
        }
    }

    /// `reset_prefix_cache()` on every rank: the same count everywhere between steps; while
    /// a step is pending, refused on every rank with nothing changed.
    fn reset_prefix_cache(&mut self) {
        let before = self.snapshot();
        let dropped: Vec<_> = self
            .ranks
            .iter_mut()
            .map(Scheduler::reset_prefix_cache)
            .collect();
        if self.in_flight.is_some() || self.failed.is_some() {
            assert!(dropped
                .iter()
                .all(|r| matches!(r, Err(CoreError::InvalidState(_)))));
            assert_eq!(self.snapshot(), before, "a refused reset changed something");
            return;
        }
        let counts: Vec<u32> = dropped.into_iter().map(Result::unwrap).collect();
        assert!(
            counts.windows(2).all(|w| w[0] == w[1]),
            "ranks dropped {counts:?}"
        );
        if !self.config.enable_prefix_caching {
            assert_eq!(counts[0], 0);
        }
        self.result.cache_resets += 1;
    }

    fn snapshot(&self) -> Vec<RankSnapshot> {
        self.ranks
            .iter()
            .map(|s| RankSnapshot {
                state_digest: s.state_digest(),
                ledger_digest: s.ledger().state_digest(),
                holdings: s.ledger().holdings(),
                cached: s
                    .ledger()
                    .prefix_cache()
                    .map_or_else(BTreeSet::new, |cache| {
                        (0..s.ledger().capacity())
                            .filter(|&page| cache.key_of(page).is_some())
                            .collect()
                    }),
            })
            .collect()
    }

    /// Runs a workload to the end, adding each request at its arrival step. By default
    /// (`RunMode::Both`) it runs plain, then in overlap mode on a fresh group of the same
    /// configuration, and checks both give the same outputs (see `assert_same_outputs`);
    /// it returns the plain run's result.
    pub fn run(&mut self, specs: &[Spec], options: RunOptions) -> Result<RunResult, CoreError> {
        match options.mode {
            RunMode::Plain => self.run_mode(specs, options, false),
            RunMode::Overlap => self.run_mode(specs, options, true),
            RunMode::Both => {
                let plain = self.run_mode(specs, options, false)?;
                let mut group = Group::new(&self.config, self.model);
                match group.run_mode(specs, options, true) {
                    Ok(overlap) => assert_same_outputs(&plain, &overlap),
                    // Planning a step ahead sees the pool one step staler (pages of
                    // requests finishing in the step in flight are not free yet, a request
                    // that may stop on EOS decodes speculatively), so a pool that plain
                    // mode just fits can stop a disaggregated server or stall (a deadlock,
                    // but only where a plain run may deadlock too: a preemption bound that
                    // ran out, e.g. a bound of 0, or a server that may not preempt): what
                    // finished by then must still match.
                    Err(CoreError::PreemptionDisabled(_)) => {
                        group.assert_finished_match(&plain);
                    }
                    Err(CoreError::Deadlock(_))
                        if group.result.max_request_victim_choices
                            >= self.config.max_preemptions_per_request
                            || self.config.serving_mode == ServingMode::DisaggregatedGeneration =>
                    {
                        group.assert_finished_match(&plain);
                    }
                    Err(err) => panic!("overlap run failed where plain ran: {err}"),
                }
                Ok(plain)
            }
        }
    }

    /// Every request this (stopped) run finished has the output it has in `plain`, or
    /// extends what it generated there before its abort (aborts land on other tokens
    /// when the runs' timing differs, as drafts accepted in other steps make it).
    fn assert_finished_match(&self, plain: &RunResult) {
        for (id, got) in &self.result.outputs {
            if let Some(prefix) = plain.aborted.get(id) {
                assert!(
                    got.starts_with(prefix),
                    "output of {id} does not extend what it generated before its abort in the plain run"
                );
                continue;
            }
            assert_eq!(
                Some(got),
                plain.outputs.get(id),
                "output of {id} differs between plain and overlap runs"
            );
        }
    }

    fn run_mode(
        &mut self,
        specs: &[Spec],
        options: RunOptions,
        overlap: bool,
    ) -> Result<RunResult, CoreError> {
        let mut rng = Rng::new(options.seed);
        self.reverted_copy_ins = options.reverted_copy_ins;
        // Drafts draw apart, so turning them on leaves the other random decisions alone.
        let mut draft_rng = Rng::new(options.seed ^ 0x6472_6166_7473);
        let max_steps = if options.max_steps == 0 {
            20_000
        } else {
            options.max_steps
        };
        let mut pending: Vec<&Spec> = specs.iter().collect();
        pending.sort_by_key(|s| s.arrival_step);
        let mut next = 0;
        let mut step = 0u64;
        loop {
            while next < pending.len() && pending[next].arrival_step <= step {
                self.add(pending[next])?;
                next += 1;
            }
            self.abort(&self.due_aborts(specs, step, false))?;
            if next == pending.len() && !self.ranks[0].has_unfinished() {
                if let Some(flight) = self.in_flight.take() {
                    self.commit(&flight);
                    continue;
                }
                if let Some(failed) = self.failed.take() {
                    self.revert_newest(&failed, None);
                    continue;
                }
                break;
            }
            assert!(step < max_steps, "run did not finish in {max_steps} steps");
            if options.reset_cache_per_mille > 0 && rng.below(1000) < options.reset_cache_per_mille
            {
                self.reset_prefix_cache();
            }
            self.propose_random(&mut draft_rng, options);
            let before = self.snapshot();
            let outs = self.schedule()?;
            assert_eq!(
                self.ranks[0].pending_steps(),
                1 + u32::from(self.in_flight.is_some() || self.failed.is_some())
            );
            self.abort(&self.due_aborts(specs, step, true))?;
            if let Some(failed) = self.failed.clone() {
                // The step before this one failed on the device: this one is reverted
                // (it cannot run without that one's tokens), then that one.
                self.revert_step(&outs[0], &before);
                self.failed = None;
                self.revert_newest(&failed, None);
                continue;
            }
            if options.revert_per_mille > 0 && rng.below(1000) < options.revert_per_mille {
                self.revert_step(&outs[0], &before);
                continue;
            }
            if overlap && options.fail_per_mille > 0 && rng.below(1000) < options.fail_per_mille {
                // It fails: its copies were made as it was launched, its KV writes never
                // happen; the step in flight before it ran and is updated.
                self.copy_reverted(&outs[0]);
                // Pending (and holding what it resumes) while the step before it closes.
                self.failed = Some(outs[0].clone());
                if let Some(older) = self.in_flight.take() {
                    self.commit(&older);
                }
                self.result.failed_steps += 1;
                continue;
            }
            let flight = self.run_on_device(&outs);
            if overlap {
                // This step ran before the one in flight is updated (its inputs in flight
                // were gathered from that step's tokens); it is in flight now.
                if let Some(older) = self.in_flight.replace(flight) {
                    self.commit(&older);
                }
            } else {
                self.commit(&flight);
            }
            step += 1;
            self.check_bound();
        }
        self.check_the_end();
        Ok(self.result.clone())
    }

    /// A run's end: nothing leaked, the ranks agree on their metrics, and the scheduler counted the copies the executor made.
    fn check_the_end(&mut self) {
        for s in &self.ranks {
            assert_eq!(
                s.ledger().free_superblocks(),
                s.ledger().capacity(),
                "superblocks leaked at the end"
            );
            assert_eq!(s.num_live(), 0);
            assert_eq!(
                s.host_used_superblocks(),
                0,
                "host superblocks leaked at the end"
            );
            assert_eq!(s.pending_steps(), 0);
        }
        assert!(self.slot_of.is_empty(), "batch slots left on the device");
        let metrics: Vec<_> = self.ranks.iter().map(Scheduler::metrics).collect();
        assert!(
            metrics.windows(2).all(|w| w[0] == w[1]),
            "metrics differ between ranks"
        );
        self.result.preemptions = metrics[0].preemptions;
        self.result.suspensions = metrics[0].suspensions;
        self.result.resumes = metrics[0].resumes;
        // The scheduler counts the host copies the executor made: every superblock copied
        // out (also by a step that was reverted: its victims stay suspended), and every one
        // copied back in (by a step that ran: a reverted resume copied nothing, and a
        // request aborted then closes from the host tier). Some never come back: those of
        // requests aborted while suspended and, one step ahead, of requests suspended by a
        // step planned ahead of one that finished them (EOS) or was reverted (they
        // re-prefill: `recompute_instead_of_resume`).
        assert_eq!(
            (
                metrics[0].suspended_superblocks,
                metrics[0].resumed_superblocks
            ),
            (self.copied_out, self.copied_in),
            "host superblocks copied out and in (scheduler, executor)"
        );
        assert!(metrics[0].resumed_superblocks <= metrics[0].suspended_superblocks);
        self.result.recomputed_tokens = metrics[0].recomputed_tokens;
        self.result.sat_out = metrics[0].sat_out;
        self.result.kv_reads = self.kv_reads.get();
        assert_eq!(metrics[0].aborts, self.result.aborted.len() as u64);
        assert_eq!(metrics[0].finished, self.result.outputs.len() as u64);
        self.check_spec_metrics(&metrics[0]);
    }

    /// Speculative decoding: the scheduler counts what it verified in steps that ran for
    /// requests that took their rows (not those aborted or finished meanwhile).
    fn check_spec_metrics(&mut self, m: &helix_kv_core::SchedulerMetrics) {
        assert!(m.spec_decode_num_draft_tokens <= self.result.drafts_verified);
        assert!(m.spec_decode_num_accepted_tokens <= self.result.drafts_accepted);
        assert!(m.spec_decode_num_accepted_tokens <= m.spec_decode_num_draft_tokens);
        assert!(m.spec_decode_returned_superblocks <= m.spec_decode_draft_superblocks);
        let per_position: u64 = self.ranks[0]
            .spec_decode_accepted_per_position()
            .iter()
            .sum();
        assert_eq!(per_position, m.spec_decode_num_accepted_tokens);
        if self.result.drafts_proposed == 0 {
            assert_eq!(m.spec_decode_num_drafts, 0);
        }
        self.result.spec_accepted = m.spec_decode_num_accepted_tokens;
        self.result.spec_trimmed = m.spec_decode_num_trimmed_tokens;
        self.result.spec_draft_superblocks = m.spec_decode_draft_superblocks;
        self.result.spec_returned_superblocks = m.spec_decode_returned_superblocks;
    }

    /// Live requests (in `specs` order) whose abort is due by `step`, between steps or
    /// while it is pending.
    fn due_aborts(&self, specs: &[Spec], step: u64, while_pending: bool) -> Vec<RequestId> {
        specs
            .iter()
            .filter(|spec| {
                spec.abort.is_some_and(|at| {
                    at.step <= step
                        && at.while_pending == while_pending
                        && at
                            .in_state
                            .is_none_or(|state| self.state_label(spec.id) == Some(state))
                }) && self.known.contains_key(&spec.id)
                    && !self.aborting.contains(&spec.id)
            })
            .map(|spec| spec.id)
            .collect()
    }

    /// Tracks the most preemptions of a request; `check_ladder` checks each preemption
    /// past the bound as it happens.
    fn check_bound(&mut self) {
        for id in self.ranks[0].queue_ids() {
            let p = self.ranks[0].request_metrics(id).unwrap().victim_choices;
            self.result.max_request_victim_choices = self.result.max_request_victim_choices.max(p);
        }
    }
}

/// Plain and overlap runs of one workload agree: a request that finished in both has the
/// same tokens and finished the same way; one aborted in either (an abort lands one step
/// earlier or later relative to the tokens in overlap mode) has a prefix of the other's.
pub fn assert_same_outputs(plain: &RunResult, overlap: &RunResult) {
    let all = |r: &RunResult| -> BTreeMap<RequestId, Vec<i32>> {
        r.outputs
            .iter()
            .chain(&r.aborted)
            .map(|(id, t)| (*id, t.clone()))
            .collect()
    };
    let (a, b) = (all(plain), all(overlap));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "plain and overlap runs finished different requests"
    );
    for (id, got) in &a {
        let other = &b[id];
        let aborted = plain.aborted.contains_key(id) || overlap.aborted.contains_key(id);
        if aborted {
            assert!(
                got.starts_with(other) || other.starts_with(got),
                "aborted {id}: plain {got:?} vs overlap {other:?}"
            );
        } else {
            assert_eq!(
                got, other,
                "output of {id} differs between plain and overlap runs"
            );
        }
    }
}

/// Outputs of the same requests with no pressure at all: one rank, a pool big enough
/// for everything, every request at once.
pub fn reference_outputs(specs: &[Spec], model: Model) -> BTreeMap<RequestId, Vec<i32>> {
    let total: u64 = specs
        .iter()
        .map(|s| s.prompt.len() as u64 + u64::from(s.max_new_tokens))
        .sum();
    let mut config =
        SchedulerConfig::new(u32::try_from(total / 4 + specs.len() as u64 + 1).unwrap());
    config.tokens_per_block = 4;
    config.max_batch_size = u32::try_from(specs.len() + 1).unwrap();
    config.max_num_tokens = u32::try_from((total + 1).max(4)).unwrap();
    let mut group = Group::new(&config, model);
    let at_once: Vec<Spec> = specs
        .iter()
        .cloned()
        .map(|mut s| {
            s.abort = None;
            s.at(0)
        })
        .collect();
    let result = group
        .run(&at_once, RunOptions::default())
        .expect("reference run");
    assert_eq!(result.preemptions + result.suspensions + result.sat_out, 0);
    result.outputs
}

/// Checks a run with aborts: every request either finished exactly as in the reference
/// (which the aborted ones are absent from), or was aborted with a strict prefix of its
/// reference output.
pub fn assert_matches_reference_with_aborts(specs: &[Spec], model: Model, result: &RunResult) {
    assert_eq!(result.outputs.len() + result.aborted.len(), specs.len());
    let survivors: Vec<Spec> = specs
        .iter()
        .filter(|s| !result.aborted.contains_key(&s.id))
        .cloned()
        .collect();
    let mut finished = result.clone();
    finished.aborted.clear();
    assert_matches_reference(&survivors, model, &finished);
    let reference = reference_outputs(specs, model);
    for (id, got) in &result.aborted {
        let full = &reference[id];
        assert!(
            got.len() < full.len() && full.starts_with(got),
            "aborted {id} generated {got:?}, not a strict prefix of {full:?}"
        );
        let spec = specs.iter().find(|s| s.id == *id).unwrap();
        assert!(spec.abort.is_some(), "{id} was aborted without asking");
    }
}

/// Checks a finished run against the reference: same tokens, each request stopped at
/// `max_new_tokens` or at eos.
pub fn assert_matches_reference(specs: &[Spec], model: Model, result: &RunResult) {
    let reference = reference_outputs(specs, model);
    assert_eq!(result.outputs.len(), specs.len());
    for spec in specs {
        let got = &result.outputs[&spec.id];
        assert_eq!(
            got, &reference[&spec.id],
            "output of {} differs from the run without pressure",
            spec.id
        );
        let ended_at_eos = model.eos.is_some() && got.last() == model.eos.as_ref();
        assert!(
            got.len() == spec.max_new_tokens as usize
                || (ended_at_eos && got.len() < spec.max_new_tokens as usize),
            "request {} generated {} of {} tokens",
            spec.id,
            got.len(),
            spec.max_new_tokens
        );
    }
}

/// The default configuration with `cp` ranks, `tpb` tokens per block and a pool of
/// `superblocks` superblocks (rank 0).
pub fn config(cp: u32, tpb: u32, superblocks: u32) -> SchedulerConfig {
    let mut config = SchedulerConfig::new(superblocks);
    config.cp_size = cp;
    config.tokens_per_block = tpb;
    config
}

/// A prompt of `len` distinct tokens (100, 101, ...).
pub fn prompt(len: usize) -> Vec<i32> {
    (0..i32::try_from(len).unwrap()).map(|t| t + 100).collect()
}

/// Runs one step of a single scheduler, feeding `token` for every sample; returns the
/// schedule.
pub fn step(s: &mut Scheduler, token: i32) -> ScheduleOutput {
    let out = s.schedule().unwrap().clone();
    let tokens = vec![token; out.num_samples()];
    s.update(&tokens, None).unwrap();
    out
}

/// What a failed call must leave unchanged: the state and ledger digests, the queue and the
/// metrics.
pub fn observable(s: &Scheduler) -> (u64, u64, Vec<RequestId>, helix_kv_core::SchedulerMetrics) {
    (
        s.state_digest(),
        s.ledger().state_digest(),
        s.queue_ids(),
        s.metrics(),
    )
}
