//! `abort` / `abort_many`: valid in every state of a request, frees everything it held,
//! keeps what it generated, is deferred to the close of a pending step, and leaves the
//! ranks identical. Whole-group runs with aborts are in `scheduler_group.rs` and
//! `scheduler_props.rs`.

mod common;

use common::{config, observable, prompt, step};

use helix_kv_core::{
    CoreError, FinishReason, RequestId, RequestState, Scheduler, ServingMode, VictimPolicy,
};

/// Every superblock is either free or held by a live request, and the host tier holds
/// exactly the suspended requests' superblocks.
fn assert_balanced(s: &Scheduler) {
    let ledger = s.ledger();
    let held: u32 = ledger.holdings().iter().map(|&(_, n)| n).sum();
    assert_eq!(held + ledger.free_superblocks(), ledger.capacity());
    assert_eq!(ledger.num_requests(), s.num_live());
    if s.num_suspended() == 0 {
        assert_eq!(s.host_used_superblocks(), 0, "host tier leaked");
    }
}

/// Aborts `id` between steps and checks what must hold afterwards; returns its tokens.
fn abort_now(s: &mut Scheduler, id: RequestId, state: RequestState) -> Vec<i32> {
    assert_eq!(s.request_state(id).unwrap(), state);
    let generated = s.request_metrics(id).unwrap().generated_tokens;
    let (digest, aborts, live) = (s.state_digest(), s.metrics().aborts, s.num_live());
    s.abort(id).unwrap();
    assert_ne!(
        s.state_digest(),
        digest,
        "an abort changes the state digest"
    );
    assert_eq!(s.metrics().aborts, aborts + 1);
    assert_eq!(s.num_live(), live - 1);
    assert!(!s.queue_ids().contains(&id));
    assert!(!s.ledger().contains(id), "its superblocks are freed");
    assert!(matches!(
        s.request_state(id),
        Err(CoreError::UnknownRequest(_))
    ));
    assert_balanced(s);
    assert_eq!(s.untaken_outputs(), vec![id]);
    let output = s.take_output(id).unwrap();
    assert_eq!(output.request_id, id);
    assert_eq!(output.finish_reason, FinishReason::Aborted);
    assert_eq!(output.token_ids.len() as u64, generated);
    assert_eq!(output.metrics.generated_tokens, generated);
    output.token_ids
}

#[test]
fn abort_of_a_waiting_request() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(1, &prompt(9), 4, 0).unwrap();
    s.add_request(2, &prompt(5), 4, 0).unwrap();
    assert_eq!(
        abort_now(&mut s, 1, RequestState::Waiting),
        Vec::<i32>::new()
    );
    // The survivor is scheduled as if the aborted one had never been added.
    let out = s.schedule().unwrap();
    assert_eq!(out.context_ids, vec![2]);
    assert_eq!(out.context_batch_slots, vec![0]);
}

#[test]
fn abort_of_a_part_prefilled_request() {
    let mut config = config(1, 4, 16);
    config.max_num_tokens = 8;
    config.chunk_unit = Some(4);
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(20), 4, 0).unwrap();
    let out = step(&mut s, 0);
    assert_eq!(out.context_lens, vec![8]);
    assert_eq!(s.ledger().used_superblocks(), 2);
    assert_eq!(
        abort_now(&mut s, 1, RequestState::Prefilling),
        Vec::<i32>::new()
    );
    assert_eq!(s.ledger().free_superblocks(), 16);
}

#[test]
fn abort_of_a_decoding_request_keeps_its_tokens_and_frees_its_slot() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(1, &prompt(5), 10, 0).unwrap();
    s.add_request(2, &prompt(5), 10, 0).unwrap();
    for token in [11, 12, 13] {
        step(&mut s, token);
    }
    assert_eq!(
        abort_now(&mut s, 1, RequestState::Decoding),
        vec![11, 12, 13]
    );
    // Its batch slot (0) is the lowest free one again.
    s.add_request(3, &prompt(3), 2, 0).unwrap();
    let out = step(&mut s, 14);
    assert_eq!(
        (out.context_ids, out.context_batch_slots),
        (vec![3], vec![0])
    );
    assert_eq!(out.generation_ids, vec![2]);
    assert_balanced(&s);
}

#[test]
fn abort_of_a_recompute_paused_request_keeps_the_tokens_it_generated() {
    // tpb 4, cp 1: prompt lengths 4, 8, 4, 12, 8 fill the 9 superblocks exactly.
    let mut config = config(1, 4, 9);
    config.victim_policy = VictimPolicy::NewestFirst;
    let mut s = Scheduler::new(config).unwrap();
    for (id, len) in [4, 8, 4, 12, 8].into_iter().enumerate() {
        s.add_request(id as u64, &prompt(len), 10, 0).unwrap();
    }
    step(&mut s, 7);
    let out = step(&mut s, 8);
    assert_eq!(out.preempted_ids[0], 4);
    assert_eq!(
        s.tokens(4).unwrap().len(),
        8 + 1,
        "its token is folded into the prompt"
    );
    assert_eq!(abort_now(&mut s, 4, RequestState::Waiting), vec![7]);
}

#[test]
fn abort_of_a_suspended_request_releases_its_host_tier_share() {
    let mut config = config(1, 4, 40);
    config.serving_mode = ServingMode::NonHelix;
    config.host_tier_superblocks = 6;
    let mut s = Scheduler::new(config).unwrap();
    for id in 0..8 {
        s.add_request(id, &prompt(10), 30, 0).unwrap();
    }
    let out = loop {
        let out = step(&mut s, 1);
        if !out.suspended_ids.is_empty() {
            break out;
        }
    };
    let victim = out.suspended_ids[0];
    let held = s.host_used_superblocks();
    assert!(held > 0);
    let generated = usize::try_from(s.request_metrics(victim).unwrap().generated_tokens).unwrap();
    assert_eq!(
        abort_now(&mut s, victim, RequestState::Suspended),
        vec![1; generated]
    );
    assert_eq!(s.num_suspended(), out.suspended_ids.len() - 1);
    assert!(s.host_used_superblocks() < held);
    if s.num_suspended() == 0 {
        assert_eq!(s.host_used_superblocks(), 0);
    }
    // The rest still runs to the end with nothing left behind.
    while s.has_unfinished() {
        let out = step(&mut s, 1);
        assert!(!out.resumed_ids.contains(&victim));
    }
    assert_eq!(s.host_used_superblocks(), 0);
    assert_eq!(s.ledger().free_superblocks(), 40);
    assert_eq!(s.metrics().aborts, 1);
    assert_eq!(s.metrics().finished, 7);
}

#[test]
fn abort_of_a_finished_untaken_request_changes_nothing() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(1, &prompt(5), 2, 0).unwrap();
    step(&mut s, 3);
    assert!(s.untaken_outputs().is_empty());
    let finished = {
        s.schedule().unwrap();
        s.update(&[4], None).unwrap().to_vec()
    };
    assert_eq!(finished, vec![1]);
    let before = (s.state_digest(), s.ledger().state_digest(), s.metrics());
    s.abort(1).unwrap();
    s.abort_many(&[1, 1]).unwrap();
    assert_eq!(
        (s.state_digest(), s.ledger().state_digest(), s.metrics()),
        before
    );
    let output = s.take_output(1).unwrap();
    assert_eq!(output.token_ids, vec![3, 4]);
    assert_eq!(
        output.finish_reason,
        FinishReason::Length,
        "it keeps its own reason"
    );
    assert_eq!(s.metrics().aborts, 0);
    // Once taken it is no request at all: still a no-op.
    let before = observable(&s);
    assert_eq!(s.abort(1), Ok(false));
    assert_eq!(observable(&s), before);
}

#[test]
fn unknown_ids_are_no_ops_that_answer_false() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(1, &prompt(5), 4, 0).unwrap();
    s.add_request(2, &prompt(5), 4, 0).unwrap();
    step(&mut s, 3);
    let before = observable(&s);
    assert_eq!(s.abort_many(&[9]), Ok(vec![false]));
    assert_eq!(s.abort(9), Ok(false));
    assert_eq!(s.abort_many(&[]), Ok(vec![]));
    assert_eq!(observable(&s), before, "an unknown id changes nothing");
    // The live ones around an unknown id are aborted; each answer says whether the id was
    // live when the call was made (a repeat too).
    assert_eq!(
        s.abort_many(&[9, 2, 7, 2]),
        Ok(vec![false, true, false, true])
    );
    assert_eq!(s.metrics().aborts, 1);
    assert_eq!(s.queue_ids(), vec![1]);
    assert_eq!(s.untaken_outputs(), vec![2]);
    // While a step is pending a live request stays live (marked) until the step closes:
    // a repeat is `true`, and the mark changes nothing more.
    s.schedule().unwrap();
    assert_eq!(
        s.abort_many(&[1, 1, 2, 5]),
        Ok(vec![true, true, false, false])
    );
    assert!(s.is_abort_requested(1).unwrap());
    let marked = observable(&s);
    assert_eq!(s.abort(1), Ok(true));
    assert_eq!(observable(&s), marked);
}

#[test]
fn abort_many_retires_in_queue_order_whatever_the_order_given() {
    // Between steps the marked requests retire in queue order, as a step's close retires
    // the aborts requested while it was pending: so an abort deferred to a step that is then
    // reverted leaves the state an immediate one would have (pages and ledger entries come
    // back in one order).
    let mut s = Scheduler::new(config(2, 4, 32)).unwrap();
    for id in 0..6u64 {
        s.add_request(id, &prompt(5 + 3 * usize::try_from(id).unwrap()), 8, 0)
            .unwrap();
    }
    step(&mut s, 1);
    step(&mut s, 2);
    let mut one_by_one = s.clone();
    let mut deferred = s.clone();
    for id in [1, 4, 5] {
        one_by_one.abort(id).unwrap();
    }
    assert_eq!(
        s.abort_many(&[4, 1, 5, 4]),
        Ok(vec![true, true, true, true])
    );
    deferred.schedule().unwrap();
    assert_eq!(deferred.abort_many(&[5, 4, 1]), Ok(vec![true; 3]));
    assert_eq!(deferred.revert().unwrap(), [1, 4, 5], "queue order");
    for other in [&one_by_one, &deferred] {
        assert_eq!(s.state_digest(), other.state_digest());
        assert_eq!(s.ledger().state_digest(), other.ledger().state_digest());
    }
    assert_eq!(s.queue_ids(), vec![0, 2, 3]);
    assert_eq!(s.untaken_outputs(), vec![1, 4, 5]);
    // The next steps run identically too (same pages reused in the same order).
    for token in 3..8 {
        let out = step(&mut s, token);
        assert_eq!(out, step(&mut one_by_one, token));
        let other = step(&mut deferred, token);
        assert_eq!(out.generation_ids, other.generation_ids);
        assert_eq!(out.generation_positions, other.generation_positions);
    }
}

#[test]
fn an_abort_while_a_step_is_pending_takes_effect_at_update() {
    let mut config = config(1, 4, 32);
    config.max_num_tokens = 10;
    config.chunk_unit = Some(4);
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(1, &prompt(5), 10, 0).unwrap();
    s.add_request(2, &prompt(5), 10, 0).unwrap();
    step(&mut s, 11); // both prefilled: 1 and 2 decode from now on
    s.add_request(3, &prompt(30), 4, 0).unwrap(); // prefills in chunks
    s.add_request(4, &prompt(30), 4, 0).unwrap(); // waits behind it
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.generation_ids, vec![1, 2]);
    assert_eq!(out.context_ids, vec![3]);
    assert!(!out.context_completes[0]);
    let digest = s.state_digest();
    // A decoding request, a part-prefilled one in the step, a waiting one not in it.
    s.abort_many(&[1, 3, 4]).unwrap();
    assert_ne!(
        s.state_digest(),
        digest,
        "a requested abort changes the digest"
    );
    assert!(s.is_abort_requested(1).unwrap() && !s.is_abort_requested(2).unwrap());
    assert_eq!(s.num_live(), 4, "nothing changes before the step closes");
    assert_eq!(s.metrics().aborts, 0);
    assert!(matches!(s.take_output(1), Err(CoreError::InvalidState(_))));
    assert_eq!(s.request_state(3).unwrap(), RequestState::Waiting);
    s.abort(1).unwrap(); // a repeat is a no-op
    let finished = s.update(&[21, 22], None).unwrap().to_vec();
    assert_eq!(
        finished,
        vec![1, 3, 4],
        "aborted ones finish, in queue order"
    );
    assert_eq!(s.queue_ids(), vec![2]);
    assert_eq!(s.metrics().aborts, 3);
    assert_eq!(
        s.metrics().computed_tokens,
        10 + 2 + 8,
        "the step's work ran"
    );
    let output = s.take_output(1).unwrap();
    assert_eq!(
        output.token_ids,
        vec![11],
        "its token of the pending step is dropped"
    );
    assert_eq!(output.finish_reason, FinishReason::Aborted);
    for id in [3, 4] {
        let output = s.take_output(id).unwrap();
        assert_eq!(
            (output.token_ids, output.finish_reason),
            (vec![], FinishReason::Aborted)
        );
    }
    assert_eq!(s.tokens(2).unwrap()[5..], [11, 22]);
    assert_balanced(&s);
    assert_eq!(s.ledger().num_requests(), 1);
}

#[test]
fn an_abort_while_a_step_is_pending_takes_effect_after_revert() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(1, &prompt(5), 10, 0).unwrap();
    s.add_request(2, &prompt(5), 10, 0).unwrap();
    step(&mut s, 11);
    step(&mut s, 12);
    let mut twin = s.clone();
    twin.abort(2).unwrap();

    s.schedule().unwrap();
    s.abort(2).unwrap();
    assert_eq!(s.revert().unwrap(), &[2]);
    // As if it had been aborted before the step was scheduled.
    assert_eq!(s.state_digest(), twin.state_digest());
    assert_eq!(s.ledger().holdings(), twin.ledger().holdings());
    assert_eq!(s.take_output(2).unwrap(), twin.take_output(2).unwrap());
    assert_eq!(s.metrics().aborts, 1);
    assert_balanced(&s);
    // A revert with no abort requested returns nothing.
    s.schedule().unwrap();
    assert_eq!(s.revert().unwrap(), &[] as &[u64]);
}

#[test]
fn a_request_added_and_aborted_during_a_pending_step_finishes_when_it_closes() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(1, &prompt(5), 10, 0).unwrap();
    s.schedule().unwrap();
    s.add_request(2, &prompt(5), 10, 0).unwrap();
    s.abort(2).unwrap();
    assert_eq!(s.update(&[5], None).unwrap(), &[2]);
    assert_eq!(s.take_output(2).unwrap().token_ids, Vec::<i32>::new());
    assert_eq!(s.queue_ids(), vec![1]);
}

#[test]
fn an_abort_that_frees_pages_ends_a_deadlock() {
    // Two decoding requests outgrow the pool and nobody may be a victim (bound 0).
    let mut config = config(1, 2, 8);
    config.max_preemptions_per_request = 0;
    config.deadlock_steps = 3;
    let mut s = Scheduler::new(config).unwrap();
    s.add_request(0, &prompt(4), 8, 0).unwrap();
    s.add_request(1, &prompt(4), 8, 0).unwrap();
    let err = loop {
        match s.schedule() {
            Ok(out) => {
                let n = out.num_samples();
                s.update(&vec![1; n], None).unwrap();
            }
            Err(err) => break err,
        }
    };
    assert!(matches!(err, CoreError::Deadlock(_)), "{err}");
    s.abort(1).unwrap();
    while s.has_unfinished() {
        step(&mut s, 2);
    }
    let output = s.take_output(0).unwrap();
    assert_eq!(
        (output.token_ids.len(), output.finish_reason),
        (8, FinishReason::Length)
    );
    assert_eq!(
        s.take_output(1).unwrap().finish_reason,
        FinishReason::Aborted
    );
}

#[test]
fn finish_reasons_say_length_or_eos_and_eos_wins_a_tie() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    s.add_request(1, &prompt(5), 3, 0).unwrap();
    s.add_request(2, &prompt(5), 3, 0).unwrap();
    s.add_request(3, &prompt(5), 2, 0).unwrap();
    s.schedule().unwrap();
    s.update(&[1, 1, 1], Some(&[false, false, false])).unwrap();
    s.schedule().unwrap();
    // 2 ends at eos; 3 reaches max_new_tokens and is flagged eos in the same token.
    let finished = s
        .update(&[2, 2, 2], Some(&[false, true, true]))
        .unwrap()
        .to_vec();
    assert_eq!(finished, vec![2, 3]);
    s.schedule().unwrap();
    assert_eq!(s.update(&[3], None).unwrap(), &[1]);
    let reasons: Vec<FinishReason> = [1, 2, 3]
        .iter()
        .map(|&id| s.take_output(id).unwrap().finish_reason)
        .collect();
    assert_eq!(
        reasons,
        [FinishReason::Length, FinishReason::Eos, FinishReason::Eos]
    );
    assert_eq!(FinishReason::Aborted.as_str(), "aborted");
    assert_eq!(s.metrics().finished, 3);
}
