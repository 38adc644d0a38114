//! One-step-ahead (overlap) scheduling: `schedule()` while one step is pending plans the
//! next step on the assumption that every decode of the pending step yields a token. The
//! group harness (`common::Group::run`) runs every workload in both modes and compares
//! outputs; these are the rules, one scheduler at a time.

mod common;

use common::{config, observable, prompt, Group, Model, Rng, RunMode, RunOptions, Spec};
use helix_kv_core::{
    CoreError, FinishReason, RequestId, RequestState, ScheduleOutput, Scheduler, ServingMode,
    SuspendPolicy,
};

/// The token every test samples for `id` in `step`: distinct per request and step.
fn token(id: RequestId, step: u64) -> i32 {
    i32::try_from(id * 1000 + step % 1000).unwrap()
}

fn tokens(out: &ScheduleOutput) -> Vec<i32> {
    out.sample_ids().map(|id| token(id, out.step)).collect()
}

/// Checks a step planned ahead of `older` against what the scheduler knows: inputs in
/// flight are rows of `older`'s samples (never a value), known inputs are the request's
/// last token, chunks are the request's tokens.
fn check_inputs(s: &Scheduler, older: Option<&ScheduleOutput>, out: &ScheduleOutput) {
    for i in 0..out.generation_ids.len() {
        let id = out.generation_ids[i];
        let row = out.generation_input_refs[i];
        if let Ok(row) = usize::try_from(row) {
            let older = older.expect("an input in flight needs a pending step");
            assert_eq!(
                older.sample_ids().nth(row),
                Some(id),
                "row {row} of step {}",
                older.step
            );
            assert_eq!(out.generation_input_tokens[i], -1);
        } else {
            assert_eq!(row, -1);
            assert_eq!(
                out.generation_input_tokens[i],
                *s.tokens(id).unwrap().last().unwrap()
            );
        }
    }
    let mut offset = 0;
    for i in 0..out.context_ids.len() {
        let (start, len) = (
            usize::try_from(out.context_starts[i]).unwrap(),
            usize::try_from(out.context_lens[i]).unwrap(),
        );
        assert_eq!(
            out.context_token_ids[offset..offset + len],
            s.tokens(out.context_ids[i]).unwrap()[start..start + len],
            "chunk of {}",
            out.context_ids[i]
        );
        offset += len;
    }
}

/// Every superblock and batch slot back, nothing pending, nothing live.
fn assert_no_leak(s: &Scheduler) {
    assert_eq!(s.pending_steps(), 0);
    assert_eq!(s.num_live(), 0);
    assert_eq!(s.ledger().free_superblocks(), s.ledger().capacity());
    assert!(
        s.ledger().holdings().is_empty(),
        "{:?}",
        s.ledger().holdings()
    );
}

#[test]
fn a_third_pending_step_is_refused_and_changes_nothing() {
    let mut s = Scheduler::new(config(1, 4, 16)).unwrap();
    s.add_request(1, &prompt(5), 4, 0).unwrap();
    assert_eq!(s.pending_steps(), 0);
    s.schedule().unwrap();
    assert_eq!(s.pending_steps(), 1);
    s.schedule().unwrap();
    assert_eq!(s.pending_steps(), 2);
    assert!(s.is_step_pending());
    let before = observable(&s);
    let err = s.schedule().unwrap_err();
    assert!(
        matches!(&err, CoreError::InvalidState(m) if m.contains("at most one ahead")),
        "{err}"
    );
    assert_eq!(observable(&s), before);
    assert_eq!(s.pending_steps(), 2);
}

#[test]
fn a_step_planned_ahead_decodes_on_the_token_in_flight() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(1, &prompt(5), 4, 0).unwrap();
    s.add_request(2, &prompt(3), 4, 0).unwrap();
    let t0 = s.schedule().unwrap().clone();
    assert_eq!(t0.sample_ids().collect::<Vec<_>>(), [1, 2]);
    // Both prompts complete in step 0: both decode in step 1 on their sampled token.
    let t1 = s.schedule().unwrap().clone();
    assert_eq!(t1.generation_ids, vec![1, 2]);
    assert_eq!(t1.generation_positions, vec![5, 3]);
    assert_eq!(t1.generation_input_refs, vec![0, 1]);
    assert_eq!(t1.generation_input_tokens, vec![-1, -1]);
    assert_eq!(
        t1.generation_batch_slots, t0.context_batch_slots,
        "a decode keeps the batch slot of its prompt"
    );
    // The states still say what ran: step 0 is not updated yet.
    assert_eq!(s.request_state(1).unwrap(), RequestState::Waiting);
    s.update(&tokens(&t0), None).unwrap();
    assert_eq!(s.request_state(1).unwrap(), RequestState::Decoding);
    // Step 2 is planned ahead of step 1: inputs are rows of step 1's samples again.
    let t2 = s.schedule().unwrap().clone();
    assert_eq!(t2.generation_input_refs, vec![0, 1]);
    assert_eq!(t2.generation_positions, vec![6, 4]);
    s.update(&tokens(&t1), None).unwrap();
    // Nothing ahead: inputs are known values again.
    s.update(&tokens(&t2), None).unwrap();
    let t3 = s.schedule().unwrap().clone();
    assert_eq!(t3.generation_input_refs, vec![-1, -1]);
    assert_eq!(t3.generation_input_tokens, vec![token(1, 2), token(2, 2)]);
    s.update(&tokens(&t3), None).unwrap();
    let outputs = [1, 2].map(|id| s.take_output(id).unwrap().token_ids);
    assert_eq!(
        outputs,
        [1, 2].map(|id| (0..4).map(|step| token(id, step)).collect::<Vec<_>>())
    );
    assert_no_leak(&s);
}

#[test]
fn a_request_known_to_finish_in_flight_is_not_scheduled_again() {
    let mut s = Scheduler::new(config(1, 4, 16)).unwrap();
    s.add_request(1, &prompt(4), 1, 0).unwrap(); // its prompt's token is its last
    s.add_request(2, &prompt(4), 2, 0).unwrap();
    let t0 = s.schedule().unwrap().clone();
    let t1 = s.schedule().unwrap().clone();
    assert_eq!(t1.generation_ids, vec![2], "1 finishes in step 0 by length");
    let t2_refused = s.schedule();
    assert!(t2_refused.is_err());
    assert_eq!(s.update(&tokens(&t0), None).unwrap(), [1]);
    // 2's token of step 1 is its last: step 2 has nothing for it.
    let t2 = s.schedule().unwrap().clone();
    assert!(t2.generation_ids.is_empty());
    assert_eq!(s.update(&tokens(&t1), None).unwrap(), [2]);
    s.update(&tokens(&t2), None).unwrap();
    assert_no_leak(&s);
}

#[test]
fn a_request_ended_by_eos_while_its_next_step_was_scheduled_discards_that_step() {
    let mut s = Scheduler::new(config(1, 4, 16)).unwrap();
    s.add_request(1, &prompt(4), 10, 0).unwrap();
    s.add_request(2, &prompt(4), 10, 0).unwrap();
    let t0 = s.schedule().unwrap().clone();
    let t1 = s.schedule().unwrap().clone();
    assert_eq!(t1.generation_ids, vec![1, 2], "EOS is not known ahead");
    let slot = s.batch_slot(1).unwrap().unwrap();
    // Request 1 samples EOS in step 0.
    let finished = s
        .update(&tokens(&t0), Some(&[true, false]))
        .unwrap()
        .to_vec();
    assert_eq!(finished, [1]);
    let output = s.take_output(1).unwrap();
    assert_eq!(output.token_ids, vec![token(1, 0)]);
    assert_eq!(output.finish_reason, FinishReason::Eos);
    // Step 1 may still run its decode: its KV and batch slot stay held, and so does its id.
    assert!(s.ledger().holdings().iter().any(|&(id, _)| id == 1));
    assert!(matches!(
        s.request_state(1),
        Err(CoreError::UnknownRequest(1))
    ));
    assert!(matches!(
        s.add_request(1, &prompt(4), 3, 0),
        Err(CoreError::DuplicateRequest(1))
    ));
    // Step 2 is planned ahead of step 1 without it, and does not take its slot.
    let t2 = s.schedule().unwrap().clone();
    assert_eq!(t2.generation_ids, vec![2]);
    assert!(!t2
        .generation_batch_slots
        .contains(&i32::try_from(slot).unwrap()));
    // Its token of step 1 is discarded; it is freed when step 1 closes.
    assert!(s.update(&tokens(&t1), None).unwrap().is_empty());
    assert!(s.ledger().holdings().iter().all(|&(id, _)| id != 1));
    s.add_request(1, &prompt(4), 1, 0).unwrap();
    s.update(&tokens(&t2), None).unwrap();
    while s.has_unfinished() {
        let out = s.schedule().unwrap().clone();
        s.update(&tokens(&out), None).unwrap();
    }
    assert_eq!(s.take_output(1).unwrap().token_ids.len(), 1);
    assert_eq!(s.take_output(2).unwrap().token_ids.len(), 10);
    assert_no_leak(&s);
}

#[test]
fn a_finished_request_held_by_a_reverted_step_is_freed_by_the_revert() {
    let mut s = Scheduler::new(config(1, 4, 16)).unwrap();
    s.add_request(1, &prompt(4), 10, 0).unwrap();
    let t0 = s.schedule().unwrap().clone();
    s.schedule().unwrap();
    assert_eq!(s.update(&tokens(&t0), Some(&[true])).unwrap(), [1]);
    assert_eq!(s.ledger().holdings().len(), 1, "held for step 1");
    assert!(s.revert().unwrap().is_empty());
    assert_no_leak(&s);
    assert_eq!(s.take_output(1).unwrap().token_ids, vec![token(1, 0)]);
}

#[test]
fn a_prompt_completing_in_flight_decodes_speculatively_and_chunks_continue() {
    let mut config = config(1, 4, 16);
    config.enable_chunked_prefill = true;
    config.max_num_tokens = 4;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(10), 3, 0).unwrap();
    let t0 = s.schedule().unwrap().clone();
    assert_eq!(
        (t0.context_starts.clone(), t0.context_lens.clone()),
        (vec![0], vec![4])
    );
    // Step 1 continues from step 0's scheduled progress.
    let t1 = s.schedule().unwrap().clone();
    assert_eq!(
        (t1.context_starts.clone(), t1.context_lens.clone()),
        (vec![4], vec![4])
    );
    s.update(&tokens(&t0), None).unwrap();
    let t2 = s.schedule().unwrap().clone();
    assert_eq!(
        (t2.context_starts.clone(), t2.context_lens.clone()),
        (vec![8], vec![2])
    );
    assert!(t2.context_completes[0]);
    s.update(&tokens(&t1), None).unwrap();
    // The prompt completes in step 2 (pending): step 3 decodes on its sampled token.
    let t3 = s.schedule().unwrap().clone();
    assert!(t3.context_ids.is_empty());
    assert_eq!(t3.generation_ids, vec![1]);
    assert_eq!(t3.generation_positions, vec![10]);
    assert_eq!(t3.generation_input_refs, vec![0]);
    assert_eq!(t3.generation_input_tokens, vec![-1]);
    assert_eq!(s.request_state(1).unwrap(), RequestState::Prefilling);
    s.update(&tokens(&t2), None).unwrap();
    assert_eq!(s.request_state(1).unwrap(), RequestState::Decoding);
    let t4 = s.schedule().unwrap().clone();
    s.update(&tokens(&t3), None).unwrap();
    s.update(&tokens(&t4), None).unwrap();
    assert_eq!(
        s.take_output(1).unwrap().token_ids,
        vec![token(1, 2), token(1, 3), token(1, 4)]
    );
    assert_no_leak(&s);
}

/// Drives `s` one step ahead until nothing is live: schedule, then update the older
/// step. Calls `seen(s, older, out)` after each schedule, before the update. Returns
/// every schedule.
fn run_ahead(
    s: &mut Scheduler,
    mut seen: impl FnMut(&Scheduler, Option<&ScheduleOutput>, &ScheduleOutput),
) -> Vec<ScheduleOutput> {
    let mut older: Option<ScheduleOutput> = None;
    let mut log = Vec::new();
    while s.has_unfinished() || older.is_some() {
        assert!(log.len() < 500, "did not finish");
        let out = s.schedule().unwrap().clone();
        check_inputs(s, older.as_ref(), &out);
        seen(s, older.as_ref(), &out);
        if let Some(older) = older.take() {
            s.update(&tokens(&older), None).unwrap();
        }
        older = Some(out.clone());
        log.push(out);
        if !s.has_unfinished() {
            s.update(&tokens(older.as_ref().unwrap()), None).unwrap();
            older = None;
        }
    }
    log
}

/// Drives `s` until nothing is live, plain (`ahead` false: each step is updated before the
/// next is scheduled) or one step ahead (two steps pending at most), for at most `calls`
/// calls. `scheduled(out)` sees each schedule; `updated(s, older, sampled, finished)`
/// each update, with the tokens `tokens(older)` fed and the ids that finished. `what`
/// names the run in the failure message.
fn run_steps(
    s: &mut Scheduler,
    ahead: bool,
    calls: usize,
    what: &str,
    mut scheduled: impl FnMut(&ScheduleOutput),
    mut updated: impl FnMut(&mut Scheduler, &ScheduleOutput, &[i32], &[RequestId]),
) {
    let depth = 1 + usize::from(ahead);
    let mut pending = std::collections::VecDeque::new();
    for _ in 0..calls {
        if !s.has_unfinished() && pending.is_empty() {
            break;
        }
        if s.has_unfinished() && pending.len() < depth {
            let out = s.schedule().unwrap().clone();
            scheduled(&out);
            pending.push_back(out);
            if pending.len() < depth && s.has_unfinished() {
                continue;
            }
        }
        let older = pending.pop_front().expect("a step pending");
        let sampled = tokens(&older);
        let finished = s.update(&sampled, None).unwrap().to_vec();
        updated(s, &older, &sampled, &finished);
    }
    assert!(!s.has_unfinished() && pending.is_empty(), "{what}");
}

#[test]
fn a_victim_whose_last_token_was_in_flight_folds_it_into_its_re_prefill() {
    // tpb 4, cp 1, 4 superblocks: two requests of 7 prompt tokens each take 2; their
    // decodes soon need a third each, so the younger is preempted while decoding, its
    // token of the pending step still in flight.
    let mut s = Scheduler::new(config(1, 4, 4)).unwrap();
    s.add_request(1, &prompt(7), 6, 0).unwrap();
    s.add_request(2, &prompt(7), 6, 0).unwrap();
    let mut folded = Vec::new();
    run_ahead(&mut s, |s, older, out| {
        for &victim in &out.preempted_ids {
            let older = older.unwrap();
            if let Some(row) = older.sample_ids().position(|id| id == victim) {
                // Recompute-paused with its token of the older step in flight: the
                // token is not known yet and it is not re-prefilled in this step.
                assert_eq!(s.request_state(victim).unwrap(), RequestState::Waiting);
                assert!(!out.context_ids.contains(&victim));
                assert_ne!(s.tokens(victim).unwrap().last(), Some(&tokens(older)[row]));
                folded.push((victim, tokens(older)[row]));
            }
        }
    });
    assert!(!folded.is_empty(), "no victim had a token in flight");
    // Replay stayed exact (check_inputs compared every re-prefill chunk with the request's
    // tokens): each output is the request's own tokens, the folded one among them.
    let outputs = [1, 2].map(|id| s.take_output(id).unwrap());
    for output in &outputs {
        assert_eq!(output.token_ids.len(), 6);
        let id = i32::try_from(output.request_id).unwrap();
        assert!(output.token_ids.iter().all(|&t| t / 1000 == id));
    }
    for (victim, token) in folded {
        let output = &outputs[usize::try_from(victim - 1).unwrap()];
        assert!(output.metrics.victim_choices > 0);
        assert!(
            output.token_ids.contains(&token),
            "folded {token} of {victim} lost"
        );
    }
    assert_no_leak(&s);
}

#[test]
fn a_sit_out_clears_its_slot_even_with_its_token_in_flight() {
    // tpb 4, cp 1, 4 superblocks, no preemption (bound 0). Both prompts (7 tokens) take 2
    // superblocks. Request 2's token of step 1 is its last, but step 2 is planned before
    // step 1 is updated: its pages are not free yet, so request 1, whose decode at
    // position 8 needs a third superblock, sits out with its token of step 1 in flight.
    let mut config = config(1, 4, 4);
    config.max_preemptions_per_request = 0;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(7), 6, 0).unwrap();
    s.add_request(2, &prompt(7), 2, 0).unwrap();
    let mut sat_out = Vec::new();
    let log = run_ahead(&mut s, |s, older, out| {
        for &id in &out.sat_out_ids {
            assert_eq!(s.batch_slot(id).unwrap(), None, "a sit-out holds no slot");
            assert!(!out.generation_ids.contains(&id));
            let older = older.unwrap();
            let row = older.generation_ids.iter().position(|&x| x == id).unwrap();
            sat_out.push((out.step, older.generation_batch_slots[row]));
        }
    });
    assert_eq!(sat_out.len(), 1, "request 1 sits out once: {sat_out:?}");
    // Its next decode gets a slot anew (the lowest free), never one it merely remembers.
    let (step, _) = sat_out[0];
    let next = &log[usize::try_from(step).unwrap() + 1];
    assert_eq!(next.generation_ids, vec![1]);
    assert_eq!(
        next.generation_input_refs,
        vec![-1],
        "it sat out: its token is known"
    );
    for id in [1, 2] {
        assert!(!s.take_output(id).unwrap().token_ids.is_empty());
    }
    assert_eq!(s.metrics().sat_out, 1);
    assert_no_leak(&s);
}

#[test]
fn revert_undoes_the_newest_step_only_then_the_older_one() {
    let mut config = config(2, 4, 16);
    config.enable_chunked_prefill = true;
    config.max_num_tokens = 8;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(6), 5, 0).unwrap();
    s.add_request(2, &prompt(12), 5, 0).unwrap();
    let initial = observable(&s);
    let t0 = s.schedule().unwrap().clone();
    let after_t0 = observable(&s);
    let t1 = s.schedule().unwrap().clone();
    assert_eq!(t1.generation_ids, vec![1]);
    assert!(s.revert().unwrap().is_empty());
    assert_eq!(s.pending_steps(), 1);
    assert_eq!(observable(&s).0, after_t0.0, "the state is as after step 0");
    assert_eq!(
        observable(&s).1,
        after_t0.1,
        "the ledger is as after step 0"
    );
    // Planned again ahead of step 0, with a new number.
    let t2 = s.schedule().unwrap().clone();
    assert_eq!(t2.step, t1.step + 1);
    assert_eq!(t2.generation_ids, t1.generation_ids);
    assert!(s.revert().unwrap().is_empty());
    // Then the older step itself.
    assert!(s.revert().unwrap().is_empty());
    assert_eq!(s.pending_steps(), 0);
    assert_eq!(observable(&s).0, initial.0);
    assert_eq!(observable(&s).1, initial.1);
    let _ = t0;
    while s.has_unfinished() {
        let out = s.schedule().unwrap().clone();
        s.update(&tokens(&out), None).unwrap();
    }
    assert_no_leak(&s);
}

#[test]
fn an_abort_while_two_steps_are_pending_takes_effect_at_the_older_update() {
    let mut s = Scheduler::new(config(1, 4, 16)).unwrap();
    s.add_request(1, &prompt(4), 10, 0).unwrap();
    s.add_request(2, &prompt(4), 10, 0).unwrap();
    let t0 = s.schedule().unwrap().clone();
    let t1 = s.schedule().unwrap().clone();
    s.abort(1).unwrap();
    assert!(s.is_abort_requested(1).unwrap());
    // A revert of the newer step leaves it marked: the older step is still pending.
    assert!(s.revert().unwrap().is_empty());
    assert!(s.is_abort_requested(1).unwrap());
    let t2 = s.schedule().unwrap().clone();
    assert_eq!(
        t2.generation_ids,
        vec![2],
        "an aborting request is not planned ahead"
    );
    let _ = t1;
    assert_eq!(s.update(&tokens(&t0), None).unwrap(), [1]);
    let output = s.take_output(1).unwrap();
    assert_eq!(output.finish_reason, FinishReason::Aborted);
    assert!(
        output.token_ids.is_empty(),
        "its token of step 0 is dropped"
    );
    assert!(s.ledger().holdings().iter().all(|&(id, _)| id != 1));
    s.update(&tokens(&t2), None).unwrap();
    while s.has_unfinished() {
        let out = s.schedule().unwrap().clone();
        s.update(&tokens(&out), None).unwrap();
    }
    assert_eq!(s.take_output(2).unwrap().token_ids.len(), 10);
    assert_no_leak(&s);
}

#[test]
fn the_group_runs_one_step_ahead_at_every_cp_with_identical_outputs() {
    for cp in [1, 2, 4] {
        let mut config = config(cp, 2, 32 / cp);
        config.enable_chunked_prefill = true;
        config.max_num_tokens = 16;
        config.max_batch_size = 6;
        let specs: Vec<Spec> = (0..14)
            .map(|id: u64| {
                let prompt_len = usize::try_from(3 + (id * 5) % 17).unwrap();
                let max_new = u32::try_from(4 + (id * 3) % 9).unwrap();
                Spec::new(id, prompt_len, max_new).at(id / 3)
            })
            .collect();
        let model = Model {
            eos: Some(7),
            vocab: 40,
        };
        let options = RunOptions {
            revert_per_mille: 100,
            seed: u64::from(cp),
            mode: RunMode::Overlap,
            ..RunOptions::default()
        };
        let overlap = Group::new(&config, model).run(&specs, options).unwrap();
        assert!(overlap.inputs_in_flight > 0);
        assert!(overlap.preemptions > 0, "cp {cp}: no pressure");
        let plain = Group::new(&config, model)
            .run(
                &specs,
                RunOptions {
                    mode: RunMode::Plain,
                    ..options
                },
            )
            .unwrap();
        assert!(
            overlap.outputs.values().any(|t| t.last() == Some(&7)),
            "no eos"
        );
        assert_eq!(overlap.outputs, plain.outputs, "cp {cp}");
        common::assert_matches_reference(&specs, model, &overlap);
    }
}

#[test]
fn a_request_whose_abort_is_pending_holds_back_no_newer_admission() {
    // tpb 4, cp 1, 4 superblocks, no preemption (bound 0); both prompts (7 tokens) take
    // 2 superblocks. Step 2 is planned before step 1 (request 2's last token) is
    // updated, so request 1, whose decode at position 8 needs a third superblock, sits
    // out of step 2 and gives up its batch slot: it is `Decoding` without one.
    let mut config = config(1, 4, 4);
    config.max_preemptions_per_request = 0;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(7), 6, 0).unwrap();
    s.add_request(2, &prompt(7), 2, 0).unwrap();
    let t0 = s.schedule().unwrap().clone();
    let t1 = s.schedule().unwrap().clone();
    s.update(&tokens(&t0), None).unwrap();
    let t2 = s.schedule().unwrap().clone();
    assert_eq!(t2.sat_out_ids, vec![1]);
    assert_eq!(s.update(&tokens(&t1), None).unwrap(), [2]);
    assert_eq!(s.request_state(1).unwrap(), RequestState::Decoding);
    assert_eq!(s.batch_slot(1).unwrap(), None);
    // Its client goes while step 2 is pending: it finishes when step 2 closes and never
    // decodes again, so a step planned ahead of step 2 gives it no slot claim, and the
    // newer request takes the lowest free slot and the pages request 2 left.
    s.abort(1).unwrap();
    s.add_request(3, &prompt(7), 3, 0).unwrap();
    let t3 = s.schedule().unwrap().clone();
    assert!(t3.generation_ids.is_empty());
    assert_eq!(t3.context_ids, vec![3]);
    assert_eq!(t3.context_batch_slots, vec![0]);
    assert_eq!(s.batch_slot(1).unwrap(), None, "no slot claimed for it");
    assert_eq!(s.update(&tokens(&t2), None).unwrap(), [1]);
    let output = s.take_output(1).unwrap();
    assert_eq!(output.finish_reason, FinishReason::Aborted);
    assert_eq!(output.token_ids, vec![token(1, 0), token(1, 1)]);
    s.update(&tokens(&t3), None).unwrap();
    run_ahead(&mut s, |_, _, _| {});
    assert_eq!(s.take_output(3).unwrap().token_ids.len(), 3);
    assert_no_leak(&s);
}

#[test]
fn the_group_lets_newer_requests_pass_a_slotless_decode_whose_abort_is_pending() {
    // The shrunk proptest case (`scheduler_props.proptest-regressions`, non_helix with a
    // host tier, reverts): request 5 sits out of step 30 (planned ahead), its abort
    // comes while that step is pending, and step 31, planned ahead of it, admits
    // request 7 into a free slot. Request 5 will never decode again, so the harness's
    // slot-order check must not count it as a decode left without a slot.
    let mut config = config(1, 4, 16);
    config.max_batch_size = 3;
    config.max_num_tokens = 41;
    config.enable_chunked_prefill = false;
    config.chunk_unit = Some(1);
    config.serving_mode = ServingMode::NonHelix;
    config.host_tier_superblocks = 7;
    config.suspend_policy = SuspendPolicy::SuspendFirst;
    config.max_preemptions_per_request = 1;
    config.deadlock_steps = 12;
    let specs = [
        Spec::new(1, 1, 1).at(1),
        Spec::new(2, 17, 12).at(1),
        Spec::new(3, 4, 18).at(1).abort_at(1),
        Spec::new(4, 29, 1).at(3),
        Spec::new(5, 14, 23).at(2).abort_at(20),
        Spec::new(6, 23, 15),
        Spec::new(7, 39, 3).at(2),
        Spec::new(8, 17, 16).at(1).abort_while_pending(18),
        Spec::new(9, 18, 3),
    ];
    let options = RunOptions {
        revert_per_mille: 240,
        seed: 9,
        max_steps: 5_000,
        mode: RunMode::Overlap,
        ..RunOptions::default()
    };
    let result = Group::new(&config, Model::default())
        .run(&specs, options)
        .unwrap();
    assert!(
        result.abort_states.contains("decoding while pending"),
        "{:?}",
        result.abort_states
    );
    assert!(result.reverted_steps > 0 && result.suspensions > 0);
    common::assert_matches_reference_with_aborts(&specs, Model::default(), &result);
}

#[test]
fn without_preemption_a_step_planned_ahead_may_wedge_a_pool_a_plain_run_fits() {
    // The shrunk proptest case (aggregated, bound 0, EOS model): a step planned ahead
    // admits request 3 next to a decoding request 5 with the pages of request 2 (aborted
    // while its step was pending); both then need pages nobody may give up. The plain
    // run of the same workload, whose pool is one step fresher, finishes. A bound of 0
    // may deadlock in either mode, so `Group::run` accepts the overlap deadlock as long
    // as what finished matches the plain run.
    let mut config = config(1, 1, 43);
    config.max_batch_size = 3;
    config.max_num_tokens = 43;
    config.chunk_unit = Some(1);
    config.max_preemptions_per_request = 0;
    config.deadlock_steps = 12;
    let specs = [
        Spec::new(1, 3, 9).at(1),
        Spec::new(2, 2, 16).abort_while_pending(9),
        Spec::new(3, 8, 12).at(2),
        Spec::new(4, 34, 6).at(2).abort_at(2),
        Spec::new(5, 31, 7).at(1),
        Spec::new(6, 1, 1),
        Spec::new(7, 1, 1),
        Spec::new(8, 1, 7).abort_at(0),
    ];
    let model = Model {
        vocab: 24,
        eos: Some(5),
    };
    let options = RunOptions {
        seed: 8,
        max_steps: 5_000,
        mode: RunMode::Overlap,
        ..RunOptions::default()
    };
    let overlap = Group::new(&config, model).run(&specs, options);
    assert!(
        matches!(overlap, Err(CoreError::Deadlock(_))),
        "{overlap:?}"
    );
    let both = RunOptions {
        mode: RunMode::Both,
        ..options
    };
    let plain = Group::new(&config, model).run(&specs, both).unwrap();
    common::assert_matches_reference_with_aborts(&specs, model, &plain);
}

#[test]
fn a_long_run_planned_ahead_skips_a_pending_abort_and_stops_at_the_budget() {
    // 150 one-token prompts, a budget of 130 tokens: 130 decode (more than two of the
    // fast path's chunks), 20 wait. Planned ahead with request 70's abort pending: the
    // others decode again on their rows in flight, in queue order, and the token left
    // admits the first waiting prompt.
    let mut config = config(2, 4, 600);
    config.max_batch_size = 256;
    config.max_num_tokens = 130;
    let mut s = Scheduler::new(config).unwrap();
    for id in 1..=150 {
        s.add_request(id, &prompt(1), 50, 0).unwrap();
    }
    let t0 = s.schedule().unwrap().clone();
    assert_eq!(t0.context_ids, (1..=130).collect::<Vec<_>>());
    s.update(&tokens(&t0), None).unwrap();
    let t1 = s.schedule().unwrap().clone();
    assert_eq!(t1.generation_ids, (1..=130).collect::<Vec<_>>());
    s.abort(70).unwrap();
    let after_t1 = observable(&s);
    let t2 = s.schedule().unwrap().clone();
    check_inputs(&s, Some(&t1), &t2);
    let expected: Vec<RequestId> = (1..=130).filter(|&id| id != 70).collect();
    assert_eq!(t2.generation_ids, expected);
    assert_eq!(t2.context_ids, vec![131]);
    for (i, &id) in t2.generation_ids.iter().enumerate() {
        let row = usize::try_from(t2.generation_input_refs[i]).unwrap();
        assert_eq!(t1.sample_ids().nth(row), Some(id));
        assert_eq!(
            t2.generation_positions[i], 2,
            "prompt, then one token in flight"
        );
    }
    // Reverted, the step planned again is the same, and the run finishes.
    assert!(s.revert().unwrap().is_empty());
    assert_eq!(observable(&s).0, after_t1.0, "the state is as after step 1");
    assert_eq!(
        observable(&s).1,
        after_t1.1,
        "the ledger is as after step 1"
    );
    let t3 = s.schedule().unwrap().clone();
    assert_eq!(t3.generation_ids, t2.generation_ids);
    assert_eq!(t3.generation_input_refs, t2.generation_input_refs);
    assert_eq!(s.update(&tokens(&t1), None).unwrap(), [70]);
    s.update(&tokens(&t3), None).unwrap();
    while s.has_unfinished() {
        let out = s.schedule().unwrap().clone();
        s.update(&tokens(&out), None).unwrap();
    }
    assert_no_leak(&s);
}

/// Every output's computed owner ranks are `(position // tokens_per_block) % cp_size`, in
/// plain steps and in steps planned ahead (inputs in flight), under pressure (entries of
/// requests preempted in their step dropped), for layouts whose sizes are powers of two
/// and not. (The owner ranks are not stored: each output computes them from its positions.)
#[test]
fn computed_owner_ranks_are_the_layouts_owners_plain_and_one_step_ahead() {
    for cp in [1u32, 2, 3, 4, 8] {
        for tpb in [1u32, 3, 4, 16, 48] {
            let (mut in_flight, mut preempted, mut entries) = (0, 0, 0);
            for ahead in [false, true] {
                // Room for the largest request alone (two superblocks of prompt, 11 tokens
                // more), not for all eight at once.
                let per_superblock = usize::try_from(cp * tpb).unwrap();
                let room = 4 + 12 / (cp * tpb);
                let mut s = Scheduler::new(config(cp, tpb, room)).unwrap();
                for n in 0..8u32 {
                    // Prompts that end at or just before a superblock's end: their
                    // decodes need new superblocks.
                    let i = usize::try_from(n).unwrap();
                    let len = (per_superblock * (1 + i % 2)).saturating_sub(i % 3).max(1);
                    s.add_request(u64::from(n), &prompt(len), 3 + 2 * (n % 5), 0)
                        .unwrap();
                }
                let what = format!("cp {cp} tpb {tpb}");
                let scheduled = |out: &ScheduleOutput| {
                    let owners: Vec<u32> = out.generation_owner_ranks().collect();
                    assert_eq!(owners.len(), out.generation_positions.len());
                    for (&p, &owner) in out.generation_positions.iter().zip(&owners) {
                        assert_eq!(
                            u64::from(owner),
                            (p / u64::from(tpb)) % u64::from(cp),
                            "cp {cp} tpb {tpb} ahead {ahead} position {p}"
                        );
                    }
                    entries += owners.len();
                    in_flight += out
                        .generation_input_refs
                        .iter()
                        .filter(|&&r| r >= 0)
                        .count();
                    preempted += out.preempted_ids.len();
                };
                run_steps(&mut s, ahead, 2_000, &what, scheduled, |_, _, _, _| {});
            }
            assert!(entries > 0 && in_flight > 0, "cp {cp} tpb {tpb}");
            assert!(preempted > 0, "cp {cp} tpb {tpb}: no pressure");
        }
    }
}

/// `sample_ids` is computed (generation ids, then the completing context ids) and
/// `num_samples` counts it: both match a brute-force construction over random runs, plain
/// and one step ahead, with chunked prompts completing over several steps and
/// preemptions; `update` takes the tokens in that order (each sampled request's last token
/// is its row's).
#[test]
fn computed_sample_ids_match_a_brute_force_construction_plain_and_one_step_ahead() {
    let (mut completing, mut incomplete, mut preempted, mut in_flight) = (0, 0, 0, 0);
    for seed in 0..24u64 {
        let mut rng = Rng::new(seed + 1);
        let cp = [1u32, 2, 4][usize::try_from(rng.below(3)).unwrap()];
        let tpb = [1u32, 4, 16][usize::try_from(rng.below(3)).unwrap()];
        for ahead in [false, true] {
            // Room for the largest request alone (72 tokens), not for all ten at once.
            let room = 72u32.div_ceil(cp * tpb) + 1 + u32::try_from(rng.below(4)).unwrap();
            let mut cfg = config(cp, tpb, room);
            cfg.max_num_tokens = 8 + u32::try_from(rng.below(40)).unwrap();
            cfg.enable_chunked_prefill = true;
            let mut s = Scheduler::new(cfg).unwrap();
            for id in 0..10u64 {
                let len = usize::try_from(rng.range(1, 60)).unwrap();
                let max_new = u32::try_from(rng.range(1, 12)).unwrap();
                s.add_request(id, &prompt(len), max_new, 0).unwrap();
            }
            let scheduled = |out: &ScheduleOutput| {
                let mut brute = out.generation_ids.clone();
                for (i, &id) in out.context_ids.iter().enumerate() {
                    if out.context_completes[i] {
                        brute.push(id);
                        completing += 1;
                    } else {
                        incomplete += 1;
                    }
                }
                let ids = out.sample_ids();
                assert_eq!(ids.len(), brute.len());
                assert_eq!(ids.collect::<Vec<_>>(), brute, "seed {seed} ahead {ahead}");
                assert_eq!(out.num_samples(), brute.len());
                preempted += out.preempted_ids.len();
                in_flight += out
                    .generation_input_refs
                    .iter()
                    .filter(|&&r| r >= 0)
                    .count();
            };
            let updated = |s: &mut Scheduler,
                           older: &ScheduleOutput,
                           sampled: &[i32],
                           finished: &[RequestId]| {
                for (id, &token) in older.sample_ids().zip(sampled) {
                    let held = if finished.contains(&id) {
                        s.take_output(id).unwrap().token_ids
                    } else {
                        s.tokens(id).unwrap()
                    };
                    assert_eq!(
                        held.last(),
                        Some(&token),
                        "request {id}, step {}",
                        older.step
                    );
                }
            };
            run_steps(
                &mut s,
                ahead,
                3_000,
                &format!("seed {seed}"),
                scheduled,
                updated,
            );
        }
    }
    assert!(completing > 0 && incomplete > 0, "no chunked prompts");
    assert!(preempted > 0, "no pressure");
    assert!(in_flight > 0, "no step planned ahead on a token in flight");
}

/// The fields of a step that do not depend on its number (a scheduler that reverted steps
/// numbers later ones on).
fn decisions(out: &ScheduleOutput) -> String {
    let mut out = out.clone();
    out.step = 0;
    out.digest = 0;
    format!("{out:?}")
}

#[test]
fn reverting_two_sit_outs_restores_the_batch_slot_the_older_gave_up() {
    // tpb 4, cp 1, 4 superblocks, no preemption (bound 0). Request 1 (prompt 6, slot 0)
    // and request 2 (prompt 8, slot 1) fill the pool; request 2's first decode (position 8)
    // needs a third superblock and nothing is behind it, so it sits out of step 1 and gives
    // up slot 1, and again of step 2 (planned ahead, it holds no slot now). Reverting both
    // restores the state exactly, and from then on it runs as a twin that never scheduled
    // the two steps: it decodes on slot 1 again once request 1's pages are free.
    let mut config = config(1, 4, 4);
    config.max_preemptions_per_request = 0;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(6), 2, 0).unwrap();
    s.add_request(2, &prompt(8), 3, 0).unwrap();
    let t0 = s.schedule().unwrap().clone();
    assert_eq!(t0.context_batch_slots, vec![0, 1]);
    s.update(&tokens(&t0), None).unwrap();
    let mut twin = s.clone();
    let before = observable(&s);
    assert_eq!(s.batch_slot(2).unwrap(), Some(1));
    let t1 = s.schedule().unwrap().clone();
    assert_eq!(
        (t1.generation_ids.clone(), t1.sat_out_ids.clone()),
        (vec![1], vec![2])
    );
    assert_eq!(
        s.batch_slot(2).unwrap(),
        None,
        "a sit-out gives its slot up"
    );
    let t2 = s.schedule().unwrap().clone();
    assert_eq!(
        t2.sat_out_ids,
        vec![2],
        "it sits out of the step planned ahead too"
    );
    assert_eq!(s.pending_steps(), 2);
    s.revert().unwrap();
    assert_eq!(
        s.batch_slot(2).unwrap(),
        None,
        "step 1 still holds its sit-out"
    );
    s.revert().unwrap();
    assert_eq!(
        s.batch_slot(2).unwrap(),
        Some(1),
        "both reverted: slot 1 is back"
    );
    assert_eq!(
        observable(&s),
        before,
        "reverting both pending steps restores the state"
    );
    // Every later step is the twin's but for the step numbers (which the ledger's record
    // of a request's last decode, and so the state digest, carries too).
    while s.has_unfinished() {
        let (a, b) = (
            s.schedule().unwrap().clone(),
            twin.schedule().unwrap().clone(),
        );
        assert_eq!(decisions(&a), decisions(&b));
        let samples: Vec<i32> = a.sample_ids().map(|id| token(id, b.step)).collect();
        s.update(&samples, None).unwrap();
        twin.update(&samples, None).unwrap();
    }
    let slots: Vec<_> = [1u64, 2]
        .map(|id| (s.take_output(id).unwrap(), twin.take_output(id).unwrap()))
        .into_iter()
        .map(|(a, b)| {
            assert_eq!(a.token_ids, b.token_ids);
            a.token_ids.len()
        })
        .collect();
    assert_eq!(slots, vec![2, 3]);
    assert_no_leak(&s);
}
