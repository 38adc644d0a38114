//! Speculative decoding in the scheduler (`scheduler/drafts.rs`): drafts proposed before
//! `schedule()`, allocated last from the free list, verified at `update_accepted` and
//! rolled back exactly; one step ahead; hostile input; prefix caching; the metadata
//! writers with drafts against a brute-force oracle.

mod common;

use common::{config, observable, prompt};
use helix_kv_core::{
    CoreError, FinishReason, RequestId, RequestState, ScheduleOutput, Scheduler, SchedulerConfig,
};

/// `config(cp, tpb, superblocks)` with `k` speculative tokens.
fn spec_config(cp: u32, tpb: u32, superblocks: u32, k: u32) -> SchedulerConfig {
    let mut c = config(cp, tpb, superblocks);
    c.num_speculative_tokens = k;
    c
}

/// One scheduler per rank of `c`, fed the same calls.
struct Ranks(Vec<Scheduler>);

impl Ranks {
    fn new(c: &SchedulerConfig) -> Self {
        Self(
            (0..c.cp_size)
                .map(|r| Scheduler::new(c.with_rank(r)).unwrap())
                .collect(),
        )
    }
    fn add(&mut self, id: RequestId, prompt_len: usize, max_new: u32) {
        for s in &mut self.0 {
            s.add_request(id, &prompt(prompt_len), max_new, 0).unwrap();
        }
    }
    fn propose(&mut self, ids: &[RequestId], counts: &[u32], tokens: &[i32]) {
        for s in &mut self.0 {
            s.propose_drafts(ids, counts, tokens).unwrap();
        }
    }
    /// Schedules on every rank; the rank-invariant outputs agree (the digests).
    fn schedule(&mut self) -> ScheduleOutput {
        let outs: Vec<ScheduleOutput> = self
            .0
            .iter_mut()
            .map(|s| s.schedule().unwrap().clone())
            .collect();
        for o in &outs {
            assert_eq!(o.digest, outs[0].digest);
        }
        outs.into_iter().next().unwrap()
    }
    fn update(&mut self, tokens: &[i32], eos: Option<&[bool]>, accepted: Option<&[u32]>) {
        let finished: Vec<Vec<RequestId>> = self
            .0
            .iter_mut()
            .map(|s| s.update_accepted(tokens, eos, accepted).unwrap().to_vec())
            .collect();
        assert!(finished.windows(2).all(|w| w[0] == w[1]));
        let digests: Vec<u64> = self.0.iter().map(Scheduler::state_digest).collect();
        assert!(digests.windows(2).all(|w| w[0] == w[1]));
    }
    /// A plain step: every sample gets `token`.
    fn step(&mut self, token: i32) -> ScheduleOutput {
        let out = self.schedule();
        self.update(&vec![token; out.num_samples()], None, None);
        out
    }
    fn s(&self) -> &Scheduler {
        &self.0[0]
    }
}

/// The ledger length and superblocks held of `id`.
fn held(s: &Scheduler, id: RequestId) -> (u64, usize) {
    let kv = s.ledger().request(id).unwrap();
    (kv.len(), kv.table().len())
}

/// Request 1 (prompt `tps - 1`, so its first decode is the last position of its first
/// superblock) prefilled on every rank, sampling token 50.
fn one_decoding(c: &SchedulerConfig, max_new: u32) -> Ranks {
    let tps = c.cp_size * c.tokens_per_block;
    let mut g = Ranks::new(c);
    g.add(1, tps as usize - 1, max_new);
    let out = g.step(50);
    assert_eq!(out.context_ids, vec![1]);
    g
}

/// The owner rank of a position (the Helix rule), by hand.
fn owner(c: &SchedulerConfig, pos: u64) -> u32 {
    u32::try_from((pos / u64::from(c.tokens_per_block)) % u64::from(c.cp_size)).unwrap()
}

/// Tokens of positions `0..n` that `rank` holds, counted one by one.
fn local_len(c: &SchedulerConfig, n: u64, rank: u32) -> u64 {
    (0..n).filter(|&p| owner(c, p) == rank).count() as u64
}

/// This rank's KV slot of `pos` in `table`, by hand (-1 where another rank owns it).
fn slot_of(c: &SchedulerConfig, table: &[i32], pos: u64, rank: u32) -> i64 {
    if owner(c, pos) != rank {
        return -1;
    }
    let tpb = u64::from(c.tokens_per_block);
    let page = table[usize::try_from(pos / (tpb * u64::from(c.cp_size))).unwrap()];
    i64::from(page) * i64::try_from(tpb).unwrap() + i64::try_from(pos % tpb).unwrap()
}

#[test]
fn drafts_span_a_superblock_boundary_and_every_owner_rank() {
    for cp in [2u32, 4] {
        let c = spec_config(cp, 2, 8, 2 * cp);
        let tps = u64::from(2 * cp);
        let mut g = one_decoding(&c, 12);
        let free_before = g.s().ledger().free_superblocks();
        // The decode token is the last of superblock 0; its drafts fill superblock 1,
        // which every rank owns a part of.
        let k = u32::try_from(tps).unwrap();
        let drafts: Vec<i32> = (60..60 + i32::try_from(k).unwrap()).collect();
        g.propose(&[1], &[k], &drafts);
        let out = g.schedule();
        assert_eq!(out.generation_ids, vec![1]);
        assert_eq!(out.generation_positions, vec![tps - 1]);
        assert_eq!(out.generation_draft_counts, vec![u64::from(k)]);
        assert_eq!(out.generation_draft_tokens, drafts);
        assert_eq!(out.num_tokens, 1 + u64::from(k));
        assert_eq!(out.num_samples(), 1 + k as usize);
        assert!(out.sample_ids().all(|id| id == 1));
        let table = g.s().block_table(&[1], None).unwrap().0;
        for s in &g.0 {
            assert_eq!(held(s, 1), (2 * tps, 2), "cp {cp}");
            assert_eq!(s.block_table(&[1], None).unwrap().0, table);
            assert_eq!(s.ledger().free_superblocks(), free_before - 1);
            let rank = s.config().cp_rank;
            let slots = s
                .slot_mapping(&[1], &[tps - 1], &[1 + u64::from(k)])
                .unwrap();
            let want: Vec<i64> = (tps - 1..2 * tps)
                .map(|pos| slot_of(&c, &table, pos, rank))
                .collect();
            assert_eq!(slots, want, "cp {cp} rank {rank}");
            // Each rank writes KV of some draft position (its share of superblock 1).
            assert!(
                slots[1..].iter().any(|&slot| slot >= 0),
                "cp {cp} rank {rank}"
            );
        }
        // Every draft accepted: the request moves on past them all.
        let rows: Vec<i32> = (70..71 + i32::try_from(k).unwrap()).collect();
        g.update(&rows, None, Some(&[k]));
        let mut want = prompt(usize::try_from(tps).unwrap() - 1);
        want.push(50);
        want.extend(&rows);
        assert_eq!(g.s().tokens(1).unwrap(), want);
        assert_eq!(held(g.s(), 1), (2 * tps, 2));
        let m = g.s().metrics();
        assert_eq!(
            (
                m.spec_decode_num_drafts,
                m.spec_decode_num_draft_tokens,
                m.spec_decode_num_accepted_tokens,
                m.spec_decode_draft_superblocks,
                m.spec_decode_returned_superblocks,
                m.spec_decode_num_trimmed_tokens,
            ),
            (1, u64::from(k), u64::from(k), 1, 0, 0)
        );
        assert_eq!(
            g.s().spec_decode_accepted_per_position(),
            vec![1; k as usize]
        );
        let out = g.step(1);
        assert_eq!(out.generation_positions, vec![2 * tps]);
        assert_eq!(out.generation_input_tokens, vec![*rows.last().unwrap()]);
        assert_eq!(out.generation_draft_counts, vec![0]);
    }
}

#[test]
fn acceptance_keeps_exactly_the_accepted_rows() {
    // cp 2, tpb 2: superblocks of 4 tokens; the decode at position 3 ends superblock 0,
    // its 4 drafts (positions 4..=7) fill superblock 1.
    let c = spec_config(2, 2, 8, 4);
    for accepted in 0..=4u32 {
        let mut g = one_decoding(&c, 12);
        let free_before = g.s().ledger().free_superblocks();
        g.propose(&[1], &[4], &[60, 61, 62, 63]);
        let out = g.schedule();
        assert_eq!(out.generation_draft_counts, vec![4]);
        let rows = [70, 71, 72, 73, 74];
        g.update(&rows, None, Some(&[accepted]));
        let kept = accepted as usize + 1;
        let mut want = prompt(3);
        want.push(50);
        want.extend(&rows[..kept]);
        for s in &g.0 {
            assert_eq!(s.tokens(1).unwrap(), want, "accepted {accepted}");
            // Positions 0..=3 + accepted hold KV; the next input is the last row.
            let len = 4 + u64::from(accepted);
            let superblocks = if accepted == 0 { 1 } else { 2 };
            assert_eq!(held(s, 1), (len, superblocks), "accepted {accepted}");
            assert_eq!(
                s.ledger().free_superblocks(),
                free_before + 1 - u32::try_from(superblocks).unwrap(),
                "accepted {accepted}"
            );
            let m = s.metrics();
            assert_eq!(m.spec_decode_num_accepted_tokens, u64::from(accepted));
            assert_eq!(m.spec_decode_num_draft_tokens, 4);
            assert_eq!(m.spec_decode_draft_superblocks, 1);
            // A superblock only rejected drafts reached went back to the pool.
            assert_eq!(
                m.spec_decode_returned_superblocks,
                u64::from(accepted == 0),
                "accepted {accepted}"
            );
            let per: Vec<u64> = (0..4).map(|j| u64::from(j < accepted)).collect();
            assert_eq!(s.spec_decode_accepted_per_position(), per);
            assert_eq!(
                s.request_metrics(1).unwrap().generated_tokens,
                1 + kept as u64
            );
        }
        let out = g.step(1);
        assert_eq!(out.generation_positions, vec![4 + u64::from(accepted)]);
        assert_eq!(out.generation_input_tokens, vec![rows[kept - 1]]);
    }
}

#[test]
fn plain_update_of_a_drafted_step_accepts_nothing() {
    let c = spec_config(1, 4, 8, 3);
    let mut g = one_decoding(&c, 12);
    g.propose(&[1], &[3], &[60, 61, 62]);
    let out = g.schedule();
    assert_eq!(out.num_samples(), 4);
    g.update(&[70, 71, 72, 73], None, None);
    assert_eq!(g.s().tokens(1).unwrap(), [100, 101, 102, 50, 70]);
    assert_eq!(held(g.s(), 1), (4, 1));
    assert_eq!(g.s().metrics().spec_decode_returned_superblocks, 1);
    assert_eq!(g.s().ledger().free_superblocks(), 7);
}

#[test]
fn drafts_give_way_under_pressure_and_never_preempt() {
    // cp 1, tpb 4, 3 superblocks: A (prompt 3) and B (prompt 2) hold one each, one free.
    let c = spec_config(1, 4, 3, 4);
    let mut g = Ranks::new(&c);
    g.add(1, 3, 8);
    g.add(2, 2, 8);
    g.step(50);
    assert_eq!(g.s().ledger().free_superblocks(), 1);
    // A's drafts take the free superblock; B's first draft fits its own superblock (its
    // decode is at position 2), the rest would need a superblock only a preemption or
    // eviction could give: trimmed, and B still decodes.
    g.propose(&[1, 2], &[4, 4], &[60, 61, 62, 63, 80, 81, 82, 83]);
    let out = g.schedule();
    assert_eq!(out.generation_ids, vec![1, 2]);
    assert_eq!(out.generation_draft_counts, vec![4, 1]);
    assert_eq!(out.generation_draft_tokens, [60, 61, 62, 63, 80]);
    assert!(out.preempted_ids.is_empty() && out.suspended_ids.is_empty());
    assert!(out.sat_out_ids.is_empty());
    assert_eq!(out.num_tokens, 2 + 5);
    assert_eq!(g.s().ledger().free_superblocks(), 0);
    g.update(&[70, 71, 72, 73, 74, 90, 91], None, Some(&[4, 1]));
    let m = g.s().metrics();
    assert_eq!(m.spec_decode_num_trimmed_tokens, 3);
    assert_eq!((m.preemptions, m.suspensions, m.sat_out), (0, 0, 0));
    assert_eq!(g.s().tokens(2).unwrap(), [100, 101, 50, 90, 91]);
    assert_eq!(held(g.s(), 2), (4, 1));

    // The token budget: decode tokens first, then drafts in queue order with what is left.
    let mut c = spec_config(1, 4, 16, 4);
    c.max_num_tokens = 5;
    let mut g = Ranks::new(&c);
    g.add(1, 1, 20);
    g.add(2, 1, 20);
    g.step(50);
    g.propose(&[1, 2], &[4, 4], &[60, 61, 62, 63, 80, 81, 82, 83]);
    let out = g.schedule();
    assert_eq!(out.generation_ids, vec![1, 2]);
    assert_eq!(out.generation_draft_counts, vec![3, 0]);
    assert_eq!(out.num_tokens, 5);
    g.update(&[1, 2, 3, 4, 5], None, Some(&[0, 0]));
    assert_eq!(g.s().metrics().spec_decode_num_trimmed_tokens, 5);
}

#[test]
fn drafts_never_evict_a_cached_superblock() {
    // Prefix caching, tpb 4, 4 superblocks: request 9's two full superblocks stay cached
    // (referenced by nobody) after it finishes. Request 1 (another prompt) then takes the
    // rest of the pool; the cached pages are the only room left for its drafts, which
    // give way instead of evicting them.
    let mut c = spec_config(1, 4, 4, 4);
    c.enable_prefix_caching = true;
    let mut g = Ranks::new(&c);
    g.add(9, 9, 1);
    g.step(5); // prefilled and done (one token): 2 full superblocks cached
    assert!(!g.s().has_unfinished());
    let other: Vec<i32> = (0..7).map(|t| 900 + t).collect();
    for s in &mut g.0 {
        s.add_request(1, &other, 6, 0).unwrap();
    }
    g.step(50);
    assert_eq!(g.s().metrics().prefix_cache_evictions, 0);
    g.propose(&[1], &[4], &[60, 61, 62, 63]);
    let out = g.schedule();
    assert_eq!(out.generation_ids, vec![1]);
    assert_eq!(out.generation_positions, vec![7]);
    assert_eq!(
        out.generation_draft_counts,
        vec![0],
        "drafts would need an eviction"
    );
    g.update(&[7], None, None);
    assert_eq!(g.s().metrics().prefix_cache_evictions, 0);
    assert_eq!(g.s().metrics().spec_decode_num_trimmed_tokens, 4);
    g.0.iter_mut().for_each(|s| {
        s.abort(1).unwrap();
    });
    // The cached prompt still hits.
    for s in &mut g.0 {
        s.add_request(3, &prompt(9), 2, 0).unwrap();
    }
    let out = g.schedule();
    assert_eq!(out.context_ids, vec![3]);
    assert_eq!(
        out.context_starts,
        vec![8],
        "the cached superblocks were kept"
    );
}

#[test]
fn drafts_never_pass_max_new_tokens() {
    let c = spec_config(2, 2, 8, 8);
    // max_new 4: 1 token sampled by the prefill, so 3 left: the decode's row and 2 drafts.
    let mut g = one_decoding(&c, 4);
    g.propose(&[1], &[8], &[60, 61, 62, 63, 64, 65, 66, 67]);
    let out = g.schedule();
    assert_eq!(out.generation_draft_counts, vec![2]);
    assert_eq!(out.generation_draft_tokens, [60, 61]);
    g.update(&[70, 71, 72], None, Some(&[2]));
    let out = g.0[0].take_output(1).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Length);
    assert_eq!(out.token_ids, [50, 70, 71, 72]);
    assert_eq!(g.s().metrics().spec_decode_num_trimmed_tokens, 6);
    assert_eq!(g.s().ledger().free_superblocks(), 8);

    // One token left: no draft at all.
    let mut g = one_decoding(&c, 2);
    g.propose(&[1], &[3], &[60, 61, 62]);
    let out = g.schedule();
    assert_eq!(out.generation_draft_counts, vec![0]);
    assert!(out.generation_draft_tokens.is_empty());
    assert_eq!(out.num_samples(), 1);
}

#[test]
fn eos_inside_the_accepted_rows_ends_the_request_there() {
    let c = spec_config(2, 2, 8, 4);
    let mut g = one_decoding(&c, 12);
    g.propose(&[1], &[3], &[60, 61, 62]);
    g.schedule();
    // Rows 0..=3; the model ended at row 1 (accepted 3: the executor did not cut).
    let eos = [false, true, false, false];
    g.update(&[70, 71, 72, 73], Some(&eos), Some(&[3]));
    for s in &mut g.0 {
        assert_eq!(s.num_live(), 0);
        let out = s.take_output(1).unwrap();
        assert_eq!(out.finish_reason, FinishReason::Eos);
        assert_eq!(out.token_ids, [50, 70, 71]);
        assert_eq!(s.ledger().free_superblocks(), 8);
    }

    // An end-of-sequence flag on a rejected row is not taken.
    let mut g = one_decoding(&c, 12);
    g.propose(&[1], &[3], &[60, 61, 62]);
    g.schedule();
    let eos = [false, false, true, false];
    g.update(&[70, 71, 72, 73], Some(&eos), Some(&[1]));
    assert_eq!(g.s().request_state(1).unwrap(), RequestState::Decoding);
    assert_eq!(g.s().tokens(1).unwrap(), [100, 101, 102, 50, 70, 71]);
}

/// Per rank: the scheduler's and the ledger's state digests and the free count.
fn digests(g: &Ranks) -> Vec<(u64, u64, u32)> {
    g.0.iter()
        .map(|s| {
            (
                s.state_digest(),
                s.ledger().state_digest(),
                s.ledger().free_superblocks(),
            )
        })
        .collect()
}

#[test]
fn revert_undoes_drafts_exactly() {
    for cp in [1u32, 2, 4] {
        let c = spec_config(cp, 2, 12, 6);
        let mut g = one_decoding(&c, 12);
        g.add(2, 1, 12);
        g.step(51);
        let before = digests(&g);
        g.propose(&[1, 2], &[6, 5], &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
        let out = g.schedule();
        assert_eq!(out.generation_draft_counts, vec![6, 5], "cp {cp}");
        for s in &mut g.0 {
            s.revert().unwrap();
        }
        assert_eq!(digests(&g), before, "cp {cp}");
        // The reverted step used the proposals: the next one has none.
        let out = g.schedule();
        assert_eq!(out.generation_draft_counts, vec![0, 0]);
        for s in &mut g.0 {
            s.revert().unwrap();
        }
        assert_eq!(digests(&g), before, "cp {cp}");
    }
}

#[test]
fn revert_of_both_steps_one_ahead_undoes_their_drafts() {
    let c = spec_config(2, 2, 12, 4);
    let mut g = one_decoding(&c, 12);
    g.add(2, 1, 12);
    g.step(51);
    let before = digests(&g);
    g.propose(&[1], &[4], &[1, 2, 3, 4]);
    g.schedule();
    g.propose(&[2], &[3], &[5, 6, 7]);
    let ahead = g.schedule();
    assert_eq!(ahead.generation_ids, vec![2]);
    assert_eq!(ahead.generation_draft_counts, vec![3]);
    for s in &mut g.0 {
        s.revert().unwrap();
        s.revert().unwrap();
    }
    assert_eq!(digests(&g), before);
}

#[test]
fn abort_while_the_drafted_step_is_pending() {
    let c = spec_config(2, 2, 8, 4);
    // Closed by update: the aborted request's rows are dropped, its drafts freed.
    let mut g = one_decoding(&c, 12);
    g.propose(&[1], &[4], &[60, 61, 62, 63]);
    g.schedule();
    for s in &mut g.0 {
        assert!(s.abort(1).unwrap());
        assert!(s.is_abort_requested(1).unwrap());
    }
    g.update(&[70, 71, 72, 73, 74], None, Some(&[4]));
    for s in &mut g.0 {
        let out = s.take_output(1).unwrap();
        assert_eq!(out.finish_reason, FinishReason::Aborted);
        assert_eq!(out.token_ids, [50]);
        assert_eq!(s.ledger().free_superblocks(), 8);
        assert_eq!(s.metrics().spec_decode_num_accepted_tokens, 0);
    }
    // Closed by revert.
    let mut g = one_decoding(&c, 12);
    g.propose(&[1], &[4], &[60, 61, 62, 63]);
    g.schedule();
    for s in &mut g.0 {
        s.abort(1).unwrap();
        assert_eq!(s.revert().unwrap(), [1]);
        assert_eq!(
            s.take_output(1).unwrap().finish_reason,
            FinishReason::Aborted
        );
        assert_eq!(s.ledger().free_superblocks(), 8);
    }
    // One step ahead: aborted while the drafted step and one planned ahead are pending.
    let mut g = one_decoding(&c, 12);
    g.add(2, 1, 12);
    g.step(51);
    g.propose(&[1], &[4], &[60, 61, 62, 63]);
    let older = g.schedule();
    let ahead = g.schedule();
    assert_eq!(ahead.generation_ids, vec![2]);
    for s in &mut g.0 {
        s.abort(1).unwrap();
    }
    g.update(&vec![3; older.num_samples()], None, Some(&[2, 0]));
    g.update(&vec![4; ahead.num_samples()], None, None);
    for s in &mut g.0 {
        assert_eq!(
            s.take_output(1).unwrap().finish_reason,
            FinishReason::Aborted
        );
        assert_eq!(s.queue_ids(), [2]);
        assert_eq!(held(s, 2).1, 1);
        assert_eq!(s.ledger().free_superblocks(), 7);
    }
}

#[test]
fn a_step_ahead_skips_a_drafted_request_and_never_takes_it_as_a_victim() {
    // cp 1, tpb 4, 4 superblocks: B (older, prompt 3) and A (prompt 3) one each.
    let c = spec_config(1, 4, 4, 8);
    let mut g = Ranks::new(&c);
    g.add(1, 3, 10); // B
    g.add(2, 3, 10); // A
    g.step(50);
    // Step t: both decode at position 3; A's drafts take the two free superblocks.
    g.propose(&[2], &[8], &[60, 61, 62, 63, 64, 65, 66, 67]);
    let t = g.schedule();
    assert_eq!(t.generation_draft_counts, vec![0, 8]);
    assert_eq!(g.s().ledger().free_superblocks(), 0);
    let a_slot = g.s().batch_slot(2).unwrap();
    // Step t+1, planned ahead: B needs a superblock for position 4. A is behind it but
    // its decode in t carries drafts: not a victim, and not decoded (its position
    // depends on t's acceptance). B waits instead.
    g.propose(&[1, 2], &[1, 1], &[7, 8]);
    let ahead = g.schedule();
    assert!(ahead.generation_ids.is_empty(), "{}", ahead.summary());
    assert!(ahead.preempted_ids.is_empty() && ahead.suspended_ids.is_empty());
    assert!(ahead.context_ids.is_empty());
    assert_eq!(
        g.s().batch_slot(2).unwrap(),
        a_slot,
        "A keeps its batch slot"
    );
    assert_eq!(g.s().request_state(2).unwrap(), RequestState::Decoding);
    // t accepts nothing of A: its superblocks go back, and both decode next.
    g.update(
        &[70, 80, 81, 82, 83, 84, 85, 86, 87, 88],
        None,
        Some(&[0, 0]),
    );
    assert_eq!(g.s().metrics().spec_decode_returned_superblocks, 2);
    g.update(&[], None, None);
    let next = g.schedule();
    assert_eq!(next.generation_ids, vec![1, 2]);
    assert_eq!(next.generation_positions, vec![4, 4]);
    assert_eq!(next.generation_input_tokens, vec![70, 80]);
    assert!(next.preempted_ids.is_empty());
}

#[test]
fn a_step_ahead_decodes_undrafted_requests_with_drafts_of_their_own() {
    let c = spec_config(2, 2, 16, 4);
    let mut g = Ranks::new(&c);
    g.add(1, 3, 20); // drafted in step t
    g.add(2, 3, 5); // decodes ahead with drafts
    g.step(50);
    g.propose(&[1], &[3], &[60, 61, 62]);
    let t = g.schedule();
    assert_eq!(t.generation_draft_counts, vec![3, 0]);
    // B (4 tokens left: 1 in flight in t) may verify at most 2 drafts ahead.
    g.propose(&[1, 2], &[4, 4], &[1, 2, 3, 4, 90, 91, 92, 93]);
    let ahead = g.schedule();
    assert_eq!(ahead.generation_ids, vec![2]);
    // B's input is its row of t: after A's 1 + 3 rows.
    assert_eq!(ahead.generation_input_refs, vec![4]);
    assert_eq!(ahead.generation_input_tokens, vec![-1]);
    assert_eq!(ahead.generation_positions, vec![4]);
    assert_eq!(ahead.generation_draft_counts, vec![2]);
    assert_eq!(ahead.generation_draft_tokens, [90, 91]);
    g.update(&[70, 71, 72, 73, 80], None, Some(&[2, 0]));
    assert_eq!(g.s().tokens(1).unwrap(), [100, 101, 102, 50, 70, 71, 72]);
    g.update(&[90, 91, 95], None, Some(&[2]));
    for s in &mut g.0 {
        let out = s.take_output(2).unwrap();
        assert_eq!(out.token_ids, [50, 80, 90, 91, 95]);
        assert_eq!(out.finish_reason, FinishReason::Length);
    }
    // A decodes again after t's update, where its accepted rows left it.
    let next = g.schedule();
    assert_eq!(next.generation_ids, vec![1]);
    assert_eq!(next.generation_positions, vec![6]);
    assert_eq!(next.generation_input_tokens, vec![72]);
}

/// A refused proposal: ids, counts, tokens, and what is wrong with it.
type Proposal<'a> = (&'a [RequestId], &'a [u32], &'a [i32], &'a str);

#[test]
fn hostile_proposals_change_nothing() {
    let c = spec_config(1, 4, 8, 3);
    let mut s = Scheduler::new(c).unwrap();
    s.add_request(1, &prompt(3), 20, 0).unwrap();
    s.add_request(2, &prompt(3), 20, 0).unwrap();
    common::step(&mut s, 50);
    s.propose_drafts(&[1, 2], &[2, 1], &[60, 61, 62]).unwrap();
    let before = observable(&s);
    let bad: [Proposal; 6] = [
        (&[1, 99], &[1, 1], &[1, 2], "unknown"),
        (&[1, 2], &[1], &[1], "lengths"),
        (&[1, 1], &[1, 1], &[1, 2], "duplicate"),
        (&[1], &[4], &[1, 2, 3, 4], "too many"),
        (&[1, 2], &[1, 1], &[1], "tokens short"),
        (&[1, 2], &[1, 1], &[1, 2, 3], "tokens long"),
    ];
    for (ids, counts, tokens, what) in bad {
        let err = s.propose_drafts(ids, counts, tokens).unwrap_err();
        if what == "unknown" {
            assert!(
                matches!(err, CoreError::UnknownRequest(_)),
                "{what}: {err:?}"
            );
        } else {
            assert!(
                matches!(err, CoreError::InvalidArgument(_)),
                "{what}: {err:?}"
            );
        }
        assert_eq!(observable(&s), before, "{what}");
    }
    // The proposal made before the refused ones still holds.
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.generation_draft_counts, vec![2, 1]);
    assert_eq!(out.generation_draft_tokens, [60, 61, 62]);
    s.revert().unwrap();

    // Drafts off: any count is refused; none is fine.
    let mut off = Scheduler::new(config(1, 4, 8)).unwrap();
    off.add_request(1, &prompt(3), 20, 0).unwrap();
    assert!(matches!(
        off.propose_drafts(&[1], &[1], &[1]),
        Err(CoreError::InvalidArgument(_))
    ));
    off.propose_drafts(&[1], &[0], &[]).unwrap();
    // A finished request is not live.
    let mut done = Scheduler::new(spec_config(1, 4, 8, 3)).unwrap();
    done.add_request(1, &prompt(3), 1, 0).unwrap();
    common::step(&mut done, 5);
    assert!(matches!(
        done.propose_drafts(&[1], &[1], &[1]),
        Err(CoreError::UnknownRequest(_))
    ));
}

/// A refused update: rows, flags, accepted counts, and what is wrong with it.
type Update<'a> = (&'a [i32], Option<&'a [bool]>, Option<&'a [u32]>, &'a str);

#[test]
fn hostile_updates_change_nothing() {
    let c = spec_config(1, 4, 8, 3);
    let mut s = Scheduler::new(c).unwrap();
    s.add_request(1, &prompt(3), 20, 0).unwrap();
    s.add_request(2, &prompt(3), 20, 0).unwrap();
    common::step(&mut s, 50);
    s.propose_drafts(&[1], &[3], &[60, 61, 62]).unwrap();
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.num_samples(), 5);
    let before = observable(&s);
    let tokens = [70, 71, 72, 73, 80];
    let eos = [false; 5];
    let bad: [Update; 6] = [
        (&tokens[..4], None, Some(&[0, 0]), "rows short"),
        (&[1, 2], None, None, "one row per entry"),
        (&tokens, Some(&eos[..4]), Some(&[0, 0]), "eos short"),
        (&tokens, None, Some(&[0]), "accepted short"),
        (&tokens, None, Some(&[4, 0]), "more than its drafts"),
        (&tokens, None, Some(&[0, 1]), "accepted without drafts"),
    ];
    for (tokens, eos, accepted, what) in bad {
        let err = s.update_accepted(tokens, eos, accepted).unwrap_err();
        assert!(
            matches!(err, CoreError::InvalidArgument(_)),
            "{what}: {err:?}"
        );
        assert_eq!(observable(&s), before, "{what}");
        assert_eq!(s.pending_steps(), 1);
    }
    s.update_accepted(&tokens, Some(&eos), Some(&[3, 0]))
        .unwrap();
    assert_eq!(s.tokens(1).unwrap(), [100, 101, 102, 50, 70, 71, 72, 73]);
    assert_eq!(s.tokens(2).unwrap(), [100, 101, 102, 50, 80]);
}

#[test]
fn only_accepted_tokens_are_cached() {
    // tpb 4: the prompt (6) and the first token end at position 6; drafts from 7 on.
    let mut c = spec_config(1, 4, 16, 3);
    c.enable_prefix_caching = true;
    let start_of = |accepted: u32, next_prompt: &[i32]| -> u64 {
        let mut s = Scheduler::new(c.clone()).unwrap();
        s.add_request(1, &prompt(6), 20, 0).unwrap();
        common::step(&mut s, 50);
        s.propose_drafts(&[1], &[3], &[60, 61, 62]).unwrap();
        s.schedule().unwrap();
        // Accepted rows equal the drafts they confirm (a greedy verifier).
        s.update_accepted(&[60, 61, 62, 63], None, Some(&[accepted]))
            .unwrap();
        s.abort(1).unwrap(); // retires it: what it computed stays cached
        s.add_request(2, next_prompt, 2, 0).unwrap();
        let out = s.schedule().unwrap().clone();
        assert_eq!(out.context_ids, vec![2]);
        out.context_starts[0]
    };
    let mut with_drafts = prompt(6);
    with_drafts.extend([50, 60, 61, 62, 9]);
    // Accepted 0: position 7 (draft 60) was written but rejected: superblock 1 (4..=7)
    // is not computed, only superblock 0 is found.
    assert_eq!(start_of(0, &with_drafts), 4);
    // Accepted 1: position 7 holds the accepted 60: superblock 1 is cached too.
    assert_eq!(start_of(1, &with_drafts), 8);
    // Accepted 1, but the next prompt differs at position 7: superblock 0 only.
    let mut other = prompt(6);
    other.extend([50, 77, 61, 62, 9]);
    assert_eq!(start_of(1, &other), 4);
}

const SENTINEL: i32 = -7777;

/// A count or position as an int64 word value.
fn w<T: TryInto<i64>>(value: T) -> i64 {
    value.try_into().ok().expect("fits an int64")
}

/// The written front of section `name` as values (int64 sections joined), and whether
/// everything past `len` values is still the sentinel.
fn section_values(
    layout: &helix_kv_core::StepMetadataLayout,
    buffer: &[i32],
    name: &str,
    len: usize,
) -> (Vec<i64>, bool) {
    let s = layout.sections().iter().find(|s| s.name == name).unwrap();
    let words = &buffer[s.offset_words..s.offset_words + if s.int64 { 2 * s.len } else { s.len }];
    if s.int64 {
        let values = words[..2 * len]
            .chunks_exact(2)
            .map(|w| {
                let low = u64::from(u32::from_ne_bytes(w[0].to_ne_bytes()));
                let high = u64::from(u32::from_ne_bytes(w[1].to_ne_bytes()));
                i64::from_ne_bytes(((high << 32) | low).to_ne_bytes())
            })
            .collect();
        (values, words[2 * len..].iter().all(|&w| w == SENTINEL))
    } else {
        let values = words[..len].iter().map(|&w| i64::from(w)).collect();
        (values, words[len..].iter().all(|&w| w == SENTINEL))
    }
}

/// One query token of the oracle: request, global position, input token, and (decode
/// rows) the input reference.
struct Query {
    id: RequestId,
    pos: u64,
    token: i32,
    input_ref: i32,
}

/// Every entry of `out` as its query tokens, generation entries (decode token, then
/// drafts) first, then context chunks, computed from the output's fields alone.
fn queries(out: &ScheduleOutput) -> Vec<Vec<Query>> {
    let mut entries = Vec::new();
    let mut drafts = out.generation_draft_tokens.iter();
    for i in 0..out.generation_ids.len() {
        let (id, pos) = (out.generation_ids[i], out.generation_positions[i]);
        let mut q = vec![Query {
            id,
            pos,
            token: out.generation_input_tokens[i],
            input_ref: out.generation_input_refs[i],
        }];
        for j in 1..=out.generation_draft_counts[i] {
            q.push(Query {
                id,
                pos: pos + j,
                token: *drafts.next().unwrap(),
                input_ref: -1,
            });
        }
        entries.push(q);
    }
    assert!(drafts.next().is_none());
    let mut tokens = out.context_token_ids.iter();
    for i in 0..out.context_ids.len() {
        let start = out.context_starts[i];
        entries.push(
            (start..start + out.context_lens[i])
                .map(|pos| Query {
                    id: out.context_ids[i],
                    pos,
                    token: *tokens.next().unwrap(),
                    input_ref: -1,
                })
                .collect(),
        );
    }
    entries
}

/// `write_last_step_metadata` of `s`'s pending step `out` against the oracle.
fn check_step_metadata(s: &Scheduler, out: &ScheduleOutput) {
    let c = s.config().clone();
    let rank = c.cp_rank;
    let layout = s.step_metadata_layout(None).unwrap();
    let width = layout.table_width();
    let mut buffer = vec![SENTINEL; layout.total_words()];
    let meta = s.write_last_step_metadata(&layout, &mut buffer).unwrap();
    let entries = queries(out);
    let g = out.generation_ids.len();
    let flat: Vec<&Query> = entries.iter().flatten().collect();
    let drafts: u64 = out.generation_draft_counts.iter().sum();
    let completes = out.context_completes.iter().filter(|&&c| c).count();
    let tables: Vec<Vec<i32>> = entries
        .iter()
        .map(|q| s.block_table(&[q[0].id], None).unwrap().0)
        .collect();
    let widest = tables.iter().map(Vec::len).max().unwrap_or(0);
    let n = flat.len();
    assert_eq!(
        (meta.num_tokens, meta.num_entries, meta.num_generation),
        (n, entries.len(), g)
    );
    assert_eq!(meta.num_draft_tokens as u64, drafts);
    assert_eq!(meta.num_samples, out.num_samples());
    assert_eq!(
        meta.num_samples,
        g + usize::try_from(drafts).unwrap() + completes
    );
    let step = i64::try_from(out.step).unwrap();
    let header = vec![
        step & 0xffff_ffff,
        step >> 32,
        w(n),
        w(entries.len()),
        w(g),
        w(meta.num_samples),
        w(widest),
        i64::try_from(drafts).unwrap(),
    ];
    let mut table_words = Vec::new();
    for t in &tables {
        table_words.extend(t.iter().map(|&p| i64::from(p)));
        table_words.extend(std::iter::repeat_n(-1, width - t.len()));
    }
    let mut query_start = vec![0i64];
    let mut samples = Vec::new();
    for (i, q) in entries.iter().enumerate() {
        let first = *query_start.last().unwrap();
        query_start.push(first + w(q.len()));
        if i < g {
            samples.push(first);
        } else if out.context_completes[i - g] {
            samples.push(first + w(q.len()) - 1);
        }
    }
    let slots: Vec<i64> = entries
        .iter()
        .zip(&tables)
        .flat_map(|(q, t)| q.iter().map(|q| slot_of(&c, t, q.pos, rank)))
        .collect();
    let batch: Vec<i64> = out
        .generation_batch_slots
        .iter()
        .chain(&out.context_batch_slots)
        .map(|&v| i64::from(v))
        .collect();
    let expected: [(&str, Vec<i64>); 10] = [
        ("header", header),
        (
            "token_ids",
            flat.iter().map(|q| i64::from(q.token)).collect(),
        ),
        ("positions", flat.iter().map(|q| w(q.pos)).collect()),
        ("slot_mapping", slots),
        ("query_start", query_start),
        (
            "local_lens",
            entries
                .iter()
                .map(|q| w(local_len(&c, q.last().unwrap().pos + 1, rank)))
                .collect(),
        ),
        (
            "past_seen_lens",
            entries
                .iter()
                .map(|q| w(local_len(&c, q[0].pos, rank)))
                .collect(),
        ),
        ("batch_slots", batch),
        ("sample_rows", samples),
        ("block_table", table_words),
    ];
    for (name, want) in expected {
        let (got, rest_untouched) = section_values(&layout, &buffer, name, want.len());
        assert_eq!(got, want, "{name} of step {} on rank {rank}", out.step);
        assert!(rest_untouched, "{name} written past its end");
    }
}

/// `write_last_decode_rows` of `s`'s pending decode-only step `out` against the oracle:
/// one row per query token.
fn check_decode_rows(s: &Scheduler, out: &ScheduleOutput) {
    use helix_kv_core::decode_row;
    let c = s.config().clone();
    let rank = c.cp_rank;
    let entries = queries(out);
    let rows: Vec<&Query> = entries.iter().flatten().collect();
    let tables: Vec<Vec<i32>> = rows
        .iter()
        .map(|q| s.block_table(&[q.id], None).unwrap().0)
        .collect();
    let width = decode_row::BLOCK_TABLE + tables.iter().map(Vec::len).max().unwrap() + 2;
    let pad_to = rows.len() + 2;
    let mut buffer = vec![SENTINEL; width * (pad_to + 1)];
    let counts = s
        .write_last_decode_rows(&mut buffer, width, pad_to)
        .unwrap();
    assert_eq!((counts.rows, counts.padded_to), (rows.len(), pad_to));
    for (r, (q, table)) in rows.iter().zip(&tables).enumerate() {
        let mut want = vec![
            q.token,
            i32::try_from(q.pos).unwrap(),
            i32::try_from(slot_of(&c, table, q.pos, rank)).unwrap(),
            i32::try_from(local_len(&c, q.pos + 1, rank)).unwrap(),
            i32::try_from(local_len(&c, q.pos, rank)).unwrap(),
            q.input_ref,
        ];
        want.extend(table);
        want.resize(width, -1);
        assert_eq!(
            &buffer[r * width..(r + 1) * width],
            &want[..],
            "decode row {r} of step {} on rank {rank}",
            out.step
        );
    }
    for r in rows.len()..pad_to {
        let row = &buffer[r * width..(r + 1) * width];
        assert_eq!(&row[..decode_row::BLOCK_TABLE], &decode_row::PADDING);
        assert!(row[decode_row::BLOCK_TABLE..]
            .iter()
            .all(|&w| w == SENTINEL));
    }
    assert!(buffer[pad_to * width..].iter().all(|&w| w == SENTINEL));
}

#[test]
fn step_metadata_and_decode_rows_with_drafts_match_the_oracle() {
    for cp in [1u32, 2, 4] {
        let c = spec_config(cp, 2, 24, 5);
        let mut g = Ranks::new(&c);
        for (id, len) in [(1, 3), (2, 5), (3, 1)] {
            g.add(id, len, 14);
        }
        g.step(50);
        // A decode-only step: drafts across superblocks, one entry without drafts.
        g.propose(&[1, 3], &[5, 2], &[1, 2, 3, 4, 5, 6, 7]);
        let out = g.schedule();
        assert_eq!(out.generation_draft_counts, vec![5, 0, 2], "cp {cp}");
        for s in &g.0 {
            check_step_metadata(s, &out);
            check_decode_rows(s, &out);
        }
        // One step ahead of it: request 2 decodes on its token in flight, with drafts.
        g.propose(&[2], &[3], &[8, 9, 10]);
        let ahead = g.schedule();
        assert_eq!(ahead.generation_ids, vec![2], "cp {cp}");
        assert_eq!(ahead.generation_input_refs, vec![6]);
        assert_eq!(ahead.generation_draft_counts, vec![3]);
        for s in &g.0 {
            check_step_metadata(s, &ahead);
            check_decode_rows(s, &ahead);
        }
        g.update(&[11; 10], None, Some(&[5, 0, 1]));
        g.update(&[12; 4], None, Some(&[2]));
        // A step with a prefill chunk and drafted decodes (the packed form only).
        for s in &mut g.0 {
            s.add_request(4, &prompt(7), 3, 0).unwrap();
        }
        g.propose(
            &[1, 2, 3],
            &[4, 5, 3],
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        );
        let mixed = g.schedule();
        assert_eq!(mixed.context_ids, vec![4]);
        assert!(
            mixed.generation_draft_counts.iter().all(|&k| k > 0),
            "cp {cp}"
        );
        for s in &g.0 {
            check_step_metadata(s, &mixed);
            let mut rows = vec![0; 1024];
            assert!(matches!(
                s.write_last_decode_rows(&mut rows, 16, 0),
                Err(CoreError::InvalidArgument(_))
            ));
        }
    }
}

#[test]
fn drafted_metadata_refuses_outputs_that_do_not_fit_and_writes_nothing() {
    let c = spec_config(2, 2, 16, 4);
    let mut g = Ranks::new(&c);
    g.add(1, 3, 12);
    g.add(2, 3, 12);
    g.step(50);
    g.propose(&[1, 2], &[4, 2], &[1, 2, 3, 4, 5, 6]);
    let out = g.schedule();
    let s = &g.0[1];
    let layout = s.step_metadata_layout(None).unwrap();
    let mut buffer = vec![SENTINEL; layout.total_words()];
    let mut rows = vec![SENTINEL; 64 * 16];
    // Counts that do not add up to the draft tokens, or one count short.
    let mut short = out.clone();
    short.generation_draft_counts[1] = 3;
    let mut missing = out.clone();
    missing.generation_draft_counts.pop();
    // Counts that add up but reach past what request 2 reserved.
    let mut moved = out.clone();
    moved.generation_draft_counts = vec![2, 4];
    for (bad, what) in [(&short, "short"), (&missing, "missing"), (&moved, "moved")] {
        let packed = s.write_step_metadata(bad.into(), &layout, &mut buffer);
        let per_row = s.write_decode_rows(bad.into(), &mut rows, 16, 0);
        for err in [packed.unwrap_err(), per_row.unwrap_err()] {
            if what == "moved" {
                assert!(
                    matches!(err, CoreError::InvalidLength(_)),
                    "{what}: {err:?}"
                );
            } else {
                assert!(
                    matches!(err, CoreError::InvalidArgument(_)),
                    "{what}: {err:?}"
                );
            }
        }
        assert!(buffer.iter().all(|&w| w == SENTINEL), "{what}");
        assert!(rows.iter().all(|&w| w == SENTINEL), "{what}");
    }
    // The output itself is written.
    s.write_step_metadata((&out).into(), &layout, &mut buffer)
        .unwrap();
    s.write_decode_rows((&out).into(), &mut rows, 16, 0)
        .unwrap();
}

#[test]
fn proposals_survive_a_failed_schedule() {
    let c = spec_config(1, 4, 16, 3);
    let mut s = Scheduler::new(c).unwrap();
    s.add_request(1, &prompt(3), 12, 0).unwrap();
    s.add_request(2, &prompt(3), 12, 0).unwrap();
    common::step(&mut s, 50);
    let t = s.schedule().unwrap().clone();
    s.schedule().unwrap();
    s.propose_drafts(&[1, 2], &[3, 2], &[1, 2, 3, 4, 5])
        .unwrap();
    // Two steps pending: refused, and the proposal is kept for the next schedule.
    assert!(matches!(s.schedule(), Err(CoreError::InvalidState(_))));
    s.update(&vec![7; t.num_samples()], None).unwrap();
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.generation_draft_counts, vec![3, 2]);
    assert_eq!(out.generation_draft_tokens, [1, 2, 3, 4, 5]);
    // Used up by that schedule.
    s.revert().unwrap();
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.generation_draft_counts, vec![0, 0]);
}

#[test]
fn num_speculative_tokens_is_bounded() {
    assert!(Scheduler::new(spec_config(1, 4, 8, 64)).is_ok());
    assert!(matches!(
        Scheduler::new(spec_config(1, 4, 8, 65)),
        Err(CoreError::Config { .. })
    ));
}

/// A change to an output's fields.
type Corruption = dyn Fn(&mut ScheduleOutput);

#[test]
fn check_lengths_covers_the_draft_columns() {
    let c = spec_config(1, 4, 16, 3);
    let mut s = Scheduler::new(c.clone()).unwrap();
    s.add_request(1, &prompt(3), 12, 0).unwrap();
    s.add_request(2, &prompt(3), 12, 0).unwrap();
    common::step(&mut s, 50);
    s.propose_drafts(&[1], &[3], &[60, 61, 62]).unwrap();
    let out = s.schedule().unwrap().clone();
    out.check_lengths().unwrap();
    let fingerprint = c.fingerprint();
    out.check_digest(fingerprint).unwrap();
    // Each corrupted output carries the digest of its own fields (as a pickled output
    // rebuilt field by field would), so only the lengths can refuse it.
    let corrupt = |f: &Corruption| {
        let mut bad = out.clone();
        f(&mut bad);
        bad.digest = bad.compute_digest(fingerprint);
        bad.check_digest(fingerprint).unwrap();
        bad.check_lengths()
    };
    let bad: [(&str, &Corruption); 4] = [
        ("counts past the tokens", &|o| {
            o.generation_draft_counts[1] = 2;
        }),
        ("tokens past the counts", &|o| {
            o.generation_draft_tokens.push(9);
        }),
        ("a count missing", &|o| {
            o.generation_draft_counts.pop();
        }),
        ("a count too many", &|o| {
            o.generation_draft_counts.push(0);
        }),
    ];
    for (what, f) in bad {
        assert!(
            matches!(corrupt(f), Err(CoreError::InvalidArgument(_))),
            "{what}"
        );
    }
    // No counts at all stands for no drafts (an output without the columns).
    corrupt(&|o| {
        o.generation_draft_counts.clear();
        o.generation_draft_tokens.clear();
    })
    .unwrap();
}

#[test]
fn the_draft_columns_are_rank_invariant_fields_of_the_digest() {
    let c = spec_config(2, 2, 16, 3);
    let mut g = Ranks::new(&c);
    g.add(1, 3, 12);
    g.step(50);
    let plain_digest = {
        let out = g.schedule();
        for s in &mut g.0 {
            s.revert().unwrap();
        }
        out.digest
    };
    g.propose(&[1], &[2], &[60, 61]);
    let out = g.schedule();
    assert_ne!(out.digest, plain_digest, "the digest covers the drafts");
    let mut other = out.clone();
    other.generation_draft_tokens[1] = 99;
    assert_eq!(other.differing_fields(&out), ["generation_draft_tokens"]);
    assert_ne!(other.compute_digest(c.fingerprint()), out.digest);
    let mut other = out.clone();
    other.generation_draft_counts[0] = 1;
    other.generation_draft_tokens.pop();
    assert!(other
        .differing_fields(&out)
        .contains(&"generation_draft_counts"));
    assert!(other.differing_fields(&out).contains(&"sample_ids"));
}

#[test]
fn a_request_finishing_under_a_drafted_step_ahead_is_held_then_freed() {
    let c = spec_config(2, 2, 16, 4);
    for revert in [false, true] {
        let mut g = Ranks::new(&c);
        g.add(1, 3, 12);
        g.add(2, 3, 12);
        g.step(50);
        assert_eq!(g.schedule().generation_ids, vec![1, 2]);
        // Request 2 decodes ahead on its token in flight, with drafts across a superblock.
        g.propose(&[2], &[4], &[1, 2, 3, 4]);
        let ahead = g.schedule();
        assert_eq!(ahead.generation_ids, vec![1, 2]);
        assert_eq!(ahead.generation_draft_counts, vec![0, 4]);
        // Step t ends request 2 (EOS): it is held by the step ahead.
        g.update(&[60, 61], Some(&[false, true]), None);
        for s in &mut g.0 {
            assert_eq!(s.take_output(2).unwrap().token_ids, [50, 61]);
            assert!(
                s.ledger().contains(2),
                "held while the step ahead is pending"
            );
            assert!(matches!(
                s.propose_drafts(&[2], &[1], &[1]),
                Err(CoreError::UnknownRequest(_))
            ));
        }
        if revert {
            for s in &mut g.0 {
                s.revert().unwrap();
            }
        } else {
            // Its rows (1 + 4) are there and dropped; an accepted count is still checked.
            let rows = vec![7; ahead.num_samples()];
            for s in &mut g.0 {
                assert!(s.update_accepted(&rows, None, Some(&[0, 5])).is_err());
            }
            g.update(&rows, None, Some(&[0, 4]));
        }
        for s in &g.0 {
            assert!(!s.ledger().contains(2));
            assert_eq!(s.queue_ids(), [1]);
            let held_by_1 = s.ledger().request(1).unwrap().table().len();
            assert_eq!(
                s.ledger().free_superblocks() as usize,
                16 - held_by_1,
                "revert {revert}"
            );
            assert_eq!(
                s.metrics().spec_decode_num_draft_tokens,
                0,
                "a dropped entry"
            );
        }
    }
}
