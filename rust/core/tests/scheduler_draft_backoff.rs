//! The draft backoff (`scheduler/draft_backoff.rs`): a request whose drafts keep being
//! rejected stops drafting for a while, by a rule over its accepted counts alone, the same
//! on every rank, untouched by a reverted step, plain and one step ahead.

mod common;

use common::{config, prompt};
use helix_kv_core::{ScheduleOutput, Scheduler, SchedulerConfig};

/// `k` drafts, the backoff after `misses` misses, pausing `tokens` tokens first.
fn backoff_config(cp: u32, k: u32, misses: u32, tokens: u32) -> SchedulerConfig {
    let mut c = config(cp, 4, 512);
    c.num_speculative_tokens = k;
    c.draft_backoff_misses = misses;
    c.draft_backoff_tokens = tokens;
    c
}

/// One scheduler per rank, fed the same calls; every step's digest and state agree.
struct Ranks(Vec<Scheduler>);

impl Ranks {
    fn new(c: &SchedulerConfig, requests: u64, max_new: u32) -> Self {
        let mut ranks: Vec<Scheduler> = (0..c.cp_size)
            .map(|r| Scheduler::new(c.with_rank(r)).unwrap())
            .collect();
        for s in &mut ranks {
            for id in 0..requests {
                s.add_request(id, &prompt(6), max_new, 0).unwrap();
            }
        }
        Self(ranks)
    }
    /// Proposes `k` drafts for every live decoding request in `ids`.
    fn propose(&mut self, ids: &[u64], k: u32) {
        let counts = vec![k; ids.len()];
        let tokens = vec![9; ids.len() * k as usize];
        for s in &mut self.0 {
            s.propose_drafts(ids, &counts, &tokens).unwrap();
        }
    }
    fn schedule(&mut self) -> ScheduleOutput {
        let outs: Vec<ScheduleOutput> = self
            .0
            .iter_mut()
            .map(|s| s.schedule().unwrap().clone())
            .collect();
        assert!(outs.iter().all(|o| o.digest == outs[0].digest));
        outs.into_iter().next().unwrap()
    }
    /// Updates the oldest pending step, `accept(entry, drafts)` drafts accepted per entry.
    fn update(&mut self, out: &ScheduleOutput, accept: &dyn Fn(usize, u32) -> u32) {
        let accepted: Vec<u32> = out
            .generation_draft_counts
            .iter()
            .enumerate()
            .map(|(e, &c)| accept(e, u32::try_from(c).unwrap()))
            .collect();
        let tokens = vec![7; out.num_samples()];
        for s in &mut self.0 {
            s.update_accepted(&tokens, None, Some(&accepted)).unwrap();
        }
        let digests: Vec<u64> = self.0.iter().map(Scheduler::state_digest).collect();
        assert!(digests.windows(2).all(|w| w[0] == w[1]));
    }
    fn revert(&mut self) {
        for s in &mut self.0 {
            s.revert().unwrap();
        }
    }
    fn s(&self) -> &Scheduler {
        &self.0[0]
    }
}

/// Runs one request (prefilled first) for `steps` drafted steps, plain, each step
/// proposing `k` drafts and accepting `accept(step, drafts)`; returns each step's
/// scheduled draft count.
fn draft_counts(c: &SchedulerConfig, steps: usize, accept: &dyn Fn(usize, u32) -> u32) -> Vec<u32> {
    let mut g = Ranks::new(c, 1, 1000);
    let out = g.schedule();
    g.update(&out, &|_, _| 0);
    let mut counts = Vec::new();
    for step in 0..steps {
        let paused = g.s().draft_paused(0).unwrap();
        g.propose(&[0], c.num_speculative_tokens);
        let out = g.schedule();
        let count = u32::try_from(out.generation_draft_counts[0]).unwrap();
        assert_eq!(
            paused,
            count == 0,
            "draft_paused() says what schedule() does"
        );
        counts.push(count);
        g.update(&out, &|_, drafts| accept(step, drafts));
    }
    counts
}

#[test]
fn rejected_drafts_pause_drafting_for_doubling_token_counts() {
    for cp in [1, 2, 4] {
        // Every draft rejected: 2 misses, a pause of 3 tokens (3 plain decodes), 2 misses,
        // a pause of 6, 2 misses, a pause of 12.
        let c = backoff_config(cp, 3, 2, 3);
        let counts = draft_counts(&c, 29, &|_, _| 0);
        let drafted = |n: usize| std::iter::repeat_n(3u32, n);
        let plain = |n: usize| std::iter::repeat_n(0u32, n);
        let expected: Vec<u32> = drafted(2)
            .chain(plain(3))
            .chain(drafted(2))
            .chain(plain(6))
            .chain(drafted(2))
            .chain(plain(12))
            .chain(drafted(2))
            .collect();
        assert_eq!(counts, expected, "cp = {cp}");
    }
}

#[test]
fn the_backoff_off_drafts_every_step() {
    let c = backoff_config(2, 3, 0, 3);
    assert_eq!(draft_counts(&c, 20, &|_, _| 0), vec![3; 20]);
}

#[test]
fn an_accepted_draft_resets_the_streak_and_the_doubling() {
    // Misses at steps 0, 1 (pause 4 tokens: steps 2..=5), misses 6, 7 (pause 8: 8..=15),
    // an accepted draft at 16 (2 tokens kept + 1), misses 17, 18 (pause 4 again, not 16).
    let c = backoff_config(1, 2, 2, 4);
    let accept = |step: usize, drafts: u32| if step == 16 { drafts.min(1) } else { 0 };
    let counts = draft_counts(&c, 24, &accept);
    let mut expected = vec![2, 2, 0, 0, 0, 0, 2, 2];
    expected.extend([0; 8]);
    expected.extend([2, 2, 2, 0, 0, 0, 0, 2]);
    assert_eq!(counts, expected);
    // A single miss between accepted drafts never pauses.
    let alternate = draft_counts(&c, 12, &|step, d| u32::from(step % 2 == 0) * d);
    assert_eq!(alternate, vec![2; 12]);
}

#[test]
fn a_pause_counts_accepted_tokens() {
    // The pause is in tokens decoded: a request stays paused for `tokens`, however many
    // steps that takes, and a decode taking several tokens (drafts of another request do
    // not count) moves it once per token. Here one request: 1 token per paused step.
    let c = backoff_config(1, 4, 1, 5);
    let counts = draft_counts(&c, 8, &|_, _| 0);
    assert_eq!(counts, vec![4, 0, 0, 0, 0, 0, 4, 0]);
}

#[test]
fn a_reverted_step_moves_nothing() {
    // Every step is scheduled, reverted and scheduled again (also the steps that stop the
    // drafting, and those that resume it): the same outputs as without the reverts.
    let c = backoff_config(2, 2, 2, 3);
    let run = |revert: bool| {
        let mut g = Ranks::new(&c, 3, 1000);
        let out = g.schedule();
        g.update(&out, &|_, _| 0);
        let mut digests = Vec::new();
        for step in 0..40usize {
            let ids = [0, 1, 2];
            if revert {
                g.propose(&ids, 2);
                let _ = g.schedule();
                g.revert();
            }
            g.propose(&ids, 2);
            let out = g.schedule();
            // (the digest names the step number, which a revert does not give back)
            digests.push((
                out.generation_ids.clone(),
                out.generation_draft_counts.clone(),
            ));
            // request 0 never accepts, 1 accepts every third step, 2 always
            g.update(&out, &|e, d| match e {
                0 => 0,
                1 => u32::from(step % 3 == 0) * d,
                _ => d,
            });
        }
        (digests, g.s().spec_decode_backoffs())
    };
    let (plain, backoffs) = run(false);
    assert!(backoffs > 0, "the workload must back off");
    assert!(
        plain.iter().any(|(_, c)| c[0] == 0 && c[1] > 0) && plain.iter().all(|(_, c)| c[2] > 0)
    );
    assert_eq!(run(true), (plain, backoffs));
}

#[test]
fn one_step_ahead_reads_the_state_the_last_update_left() {
    // One step ahead with drafts: a drafted request is planned every other step (its
    // pending decode carries drafts); the backoff stops it, after which it decodes every
    // step without drafts, and it drafts again once it has decoded the pause's tokens.
    let c = backoff_config(4, 2, 2, 4);
    let mut g = Ranks::new(&c, 1, 1000);
    let out = g.schedule();
    g.update(&out, &|_, _| 0);
    let mut pending: Option<ScheduleOutput> = None;
    let mut counts = Vec::new();
    for _ in 0..20 {
        g.propose(&[0], 2);
        let out = g.schedule();
        if let Some(older) = pending.take() {
            g.update(&older, &|_, _| 0);
        }
        counts.push(out.generation_draft_counts.first().copied());
        pending = Some(out);
    }
    // drafted, skipped (its drafts pending), drafted (2 misses: paused for 4 tokens), ...
    let drafted: Vec<usize> = counts
        .iter()
        .enumerate()
        .filter(|(_, c)| c.is_some_and(|c| c > 0))
        .map(|(i, _)| i)
        .collect();
    let plain = counts.iter().filter(|c| **c == Some(0)).count();
    assert!(plain >= 4, "paused decodes run without drafts: {counts:?}");
    assert!(
        drafted.len() >= 4,
        "it drafts again after the pause: {counts:?}"
    );
    assert!(g.s().spec_decode_backoffs() >= 2, "{counts:?}");
}

#[test]
fn a_retired_request_leaves_no_pause_to_its_index() {
    let c = backoff_config(1, 2, 1, 100);
    let mut g = Ranks::new(&c, 1, 3);
    let out = g.schedule();
    g.update(&out, &|_, _| 0);
    g.propose(&[0], 1);
    let out = g.schedule();
    assert_eq!(out.generation_draft_counts, vec![1]);
    g.update(&out, &|_, _| 0); // a miss: paused for 100 tokens
    assert!(g.s().draft_paused(0).unwrap());
    let out = g.schedule(); // its last token: it finishes
    g.update(&out, &|_, _| 0);
    for s in &mut g.0 {
        s.take_output(0).unwrap();
        s.add_request(1, &prompt(6), 10, 0).unwrap();
    }
    assert!(g.s().draft_paused(0).is_err(), "request 0 is gone");
    let out = g.schedule();
    g.update(&out, &|_, _| 0);
    assert!(!g.s().draft_paused(1).unwrap());
    g.propose(&[1], 2);
    assert_eq!(g.schedule().generation_draft_counts, vec![2]);
}

#[test]
fn the_backoff_off_keeps_the_fingerprint_of_before() {
    let base = backoff_config(2, 4, 0, 16);
    let mut other_tokens = base.clone();
    other_tokens.draft_backoff_tokens = 99;
    assert_eq!(base.fingerprint(), other_tokens.fingerprint());
    let mut on = base.clone();
    on.draft_backoff_misses = 2;
    assert_ne!(on.fingerprint(), base.fingerprint());
    let mut on_longer = on.clone();
    on_longer.draft_backoff_tokens = 32;
    assert_ne!(on.fingerprint(), on_longer.fingerprint());
    let mut bad = base;
    bad.draft_backoff_tokens = 0;
    assert!(bad.validate().is_err());
}
