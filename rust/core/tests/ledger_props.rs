//! Ledger invariants under random operation sequences: no page held twice, free + used ==
//! capacity, tables sized to their lengths, failed calls change nothing, and two ledgers
//! fed the same sequence stay identical.

mod common;

use common::gate_config;
use helix_kv_core::{Layout, Ledger};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add(u64, u64),
    Grow(u64, u64),
    Shrink(u64, u64),
    Free(u64),
    Decode(u64, u64),
    Revert(u64, u64),
    Recompute(u64, u64),
    Suspend(u64),
    Resume(u64),
    GrowMany(Vec<(u64, u64)>),
    FreeMany(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    // Few ids and steps, so sequences often revisit one request (grow, decode, shrink,
    // revert on the same id is what found issue 9).
    let id = 0u64..3;
    let len = 0u64..90;
    prop_oneof![
        2 => (id.clone(), len.clone()).prop_map(|(i, n)| Op::Add(i, n)),
        3 => (id.clone(), len.clone()).prop_map(|(i, n)| Op::Grow(i, n)),
        3 => (id.clone(), len.clone()).prop_map(|(i, n)| Op::Shrink(i, n)),
        1 => id.clone().prop_map(Op::Free),
        3 => (id.clone(), 0u64..3).prop_map(|(i, s)| Op::Decode(i, s)),
        3 => (id.clone(), 0u64..3).prop_map(|(i, s)| Op::Revert(i, s)),
        1 => (id.clone(), 0u64..3).prop_map(|(i, g)| Op::Recompute(i, g)),
        1 => id.clone().prop_map(Op::Suspend),
        1 => id.clone().prop_map(Op::Resume),
        1 => prop::collection::vec((id.clone(), len), 0..4).prop_map(Op::GrowMany),
        1 => prop::collection::vec(id, 0..3).prop_map(Op::FreeMany),
    ]
}

/// Applies `op`; returns a printable outcome so two ledgers' answers can be compared.
fn apply(ledger: &mut Ledger, op: &Op) -> String {
    let outcome = match op {
        Op::Add(i, n) => ledger.add(*i, *n).map(|()| String::new()),
        Op::Grow(i, n) => ledger.grow(*i, *n).map(|ok| ok.to_string()),
        Op::Shrink(i, n) => ledger.shrink(*i, *n).map(|()| String::new()),
        Op::Free(i) => ledger.free(*i).map(|()| String::new()),
        Op::Decode(i, s) => ledger.allocate_decode(*i, *s).map(|p| format!("{p:?}")),
        Op::Revert(i, s) => ledger.revert_decode(*i, *s).map(|b| b.to_string()),
        Op::Recompute(i, g) => ledger.reset_for_recompute(*i, *g).map(|()| String::new()),
        Op::Suspend(i) => ledger.suspend(*i).map(|n| n.to_string()),
        Op::Resume(i) => ledger.resume(*i).map(|b| b.to_string()),
        Op::GrowMany(pairs) => {
            let (ids, lens): (Vec<u64>, Vec<u64>) = pairs.iter().copied().unzip();
            let mut ok = Vec::new();
            ledger
                .grow_many(&ids, &lens, &mut ok)
                .map(|()| format!("{ok:?}"))
        }
        Op::FreeMany(ids) => ledger.free_many(ids).map(|()| String::new()),
    };
    match outcome {
        Ok(s) => format!("ok {s}"),
        Err(e) => format!("err {e}"),
    }
}

fn check_invariants(ledger: &Ledger) {
    let layout = ledger.layout();
    let mut seen = vec![false; ledger.capacity() as usize];
    let mut used = 0u32;
    for (id, count) in ledger.holdings() {
        let request = ledger.request(id).unwrap();
        assert_eq!(request.table().len(), count as usize);
        let expected = if request.is_suspended() {
            0
        } else {
            layout.superblocks_for(request.len())
        };
        assert_eq!(
            u64::from(count),
            expected,
            "table of {id} does not match its length"
        );
        if !request.is_suspended() {
            // Every reserved token maps to a slot on its owner rank (this walks the table
            // through the length, so a length the table does not back fails here).
            let mut slots = Vec::new();
            for rank in 0..layout.cp() {
                ledger
                    .slot_mapping_into(&[id], &[0], &[request.len()], rank, &mut slots)
                    .unwrap();
            }
            assert_eq!(
                slots.iter().filter(|&&s| s >= 0).count() as u64,
                request.len()
            );
        }
        for &page in request.table() {
            assert!(!seen[page as usize], "page {page} held twice");
            seen[page as usize] = true;
        }
        used += count;
    }
    assert_eq!(used, ledger.used_superblocks());
    assert_eq!(
        ledger.free_superblocks() + ledger.used_superblocks(),
        ledger.capacity()
    );
}

proptest! {
    #![proptest_config(gate_config(512))]
    #[test]
    fn random_sequences_keep_invariants(
        cp in 1u32..5,
        tpb in 1u32..9,
        capacity in 1u32..12,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let layout = Layout::new(cp, tpb).unwrap();
        let mut a = Ledger::new(layout, capacity).unwrap();
        let mut b = Ledger::new(layout, capacity).unwrap();
        for op in &ops {
            let before = a.clone();
            let out_a = apply(&mut a, op);
            let out_b = apply(&mut b, op);
            prop_assert_eq!(&out_a, &out_b);
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(a.state_digest(), b.state_digest());
            if out_a.starts_with("err") || out_a == "ok false" || out_a == "ok None" {
                prop_assert_eq!(&a, &before, "failed call {:?} changed the ledger", op);
            }
            check_invariants(&a);
        }
    }
}

#[test]
fn decode_counter_advances_only_on_success_and_retries_are_idempotent() {
    let layout = Layout::new(2, 2).unwrap();
    let mut ledger = Ledger::new(layout, 3).unwrap();
    ledger.add(9, 4).unwrap();
    assert!(ledger.grow(9, 4).unwrap());
    ledger.add(7, 6).unwrap();
    assert!(ledger.grow(7, 6).unwrap());
    assert_eq!(ledger.allocate_decode(7, 1).unwrap(), Some(6));
    assert_eq!(
        ledger.allocate_decode(7, 1).unwrap(),
        Some(6),
        "retry in the same step"
    );
    assert_eq!(ledger.allocate_decode(7, 2).unwrap(), Some(7));
    // Position 8 needs a third superblock and request 9 holds the last one: refused,
    // counter unchanged.
    assert_eq!(ledger.allocate_decode(7, 3).unwrap(), None);
    assert_eq!(ledger.request(7).unwrap().decode_count(), 2);
    assert!(ledger.revert_decode(7, 2).unwrap());
    assert_eq!(ledger.request(7).unwrap().next_decode_position(), 7);
    assert!(
        !ledger.revert_decode(7, 2).unwrap(),
        "nothing left to revert"
    );
    let view = ledger.view(7, 1).unwrap();
    assert_eq!(
        (view.next_position, view.owner_rank, view.inactive),
        (7, 1, false)
    );
    ledger.reset_for_recompute(7, 2).unwrap();
    let request = ledger.request(7).unwrap();
    assert_eq!(
        (request.prompt_len(), request.decode_count(), request.len()),
        (8, 0, 0)
    );
    assert_eq!(ledger.free_superblocks(), 2);
    assert_eq!(ledger.used_superblocks(), 1);
}

#[test]
fn free_list_order_is_deterministic() {
    let layout = Layout::new(4, 16).unwrap();
    let mut ledger = Ledger::new(layout, 8).unwrap();
    ledger.add(1, 1).unwrap();
    ledger.add(2, 1).unwrap();
    assert!(ledger.grow(1, 130).unwrap());
    assert!(ledger.grow(2, 64).unwrap());
    assert_eq!(ledger.request(1).unwrap().table(), &[0, 1, 2]);
    assert_eq!(ledger.request(2).unwrap().table(), &[3]);
    ledger.free(1).unwrap();
    assert!(ledger.grow(2, 64 * 3).unwrap());
    assert_eq!(ledger.request(2).unwrap().table(), &[3, 0, 1]);
}

#[test]
fn a_refused_free_many_changes_nothing_and_names_the_first_bad_id() {
    let layout = Layout::new(2, 4).unwrap();
    let mut ledger = Ledger::new(layout, 8).unwrap();
    ledger.add_many(&[1, 2, 3], &[1, 1, 1]).unwrap();
    let mut ok = Vec::new();
    ledger.grow_many(&[1, 2, 3], &[8, 9, 17], &mut ok).unwrap();
    let (before, digest) = (ledger.clone(), ledger.state_digest());
    let repeated = ledger.free_many(&[2, 1, 2, 9]).unwrap_err().to_string();
    assert!(repeated.contains("request 2 appears twice"), "{repeated}");
    let unknown = ledger.free_many(&[3, 9, 3]).unwrap_err().to_string();
    assert!(unknown.contains('9'), "{unknown}");
    assert_eq!(ledger, before);
    assert_eq!(ledger.state_digest(), digest);
    // Every id is still found after the roll-back.
    ledger.free_many(&[3, 1, 2]).unwrap();
    assert_eq!(ledger.free_superblocks(), 8);
}

#[test]
fn revert_decode_after_a_shrink_keeps_the_length_and_the_table_together() {
    // Issue 9: the revert used to restore the 60 tokens of before the decode while the
    // shrink had already given back all but 3 superblocks; slot_mapping then indexed
    // past the table.
    let layout = Layout::new(2, 4).unwrap();
    let mut ledger = Ledger::new(layout, 8).unwrap();
    ledger.add(4, 12).unwrap();
    assert!(ledger.grow(4, 60).unwrap());
    assert_eq!(ledger.allocate_decode(4, 11).unwrap(), Some(12));
    ledger.shrink(4, 21).unwrap();
    assert!(ledger.revert_decode(4, 11).unwrap());
    let request = ledger.request(4).unwrap();
    assert_eq!((request.len(), request.decode_count()), (21, 0));
    assert_eq!(request.table().len(), 3);
    check_invariants(&ledger);
    let mut out = Vec::new();
    assert!(ledger
        .slot_mapping_into(&[4], &[0], &[60], 0, &mut out)
        .is_err());
    ledger
        .slot_mapping_into(&[4], &[0], &[21], 0, &mut out)
        .unwrap();
    assert_eq!(out.len(), 21);
}

#[test]
fn revert_decode_keeps_a_grow_made_after_the_decode() {
    let layout = Layout::new(2, 4).unwrap();
    let mut ledger = Ledger::new(layout, 8).unwrap();
    ledger.add(1, 8).unwrap();
    assert!(ledger.grow(1, 8).unwrap());
    assert_eq!(ledger.allocate_decode(1, 0).unwrap(), Some(8));
    assert!(ledger.grow(1, 30).unwrap());
    assert!(ledger.revert_decode(1, 0).unwrap());
    assert_eq!(ledger.request(1).unwrap().len(), 30);
    assert_eq!(ledger.request(1).unwrap().next_decode_position(), 8);
    check_invariants(&ledger);
    // Undone in reverse order (the scheduler's journal), the revert is exact again.
    assert_eq!(ledger.allocate_decode(1, 1).unwrap(), Some(8));
    let before_grow = ledger.clone();
    assert!(ledger.grow(1, 40).unwrap());
    ledger.shrink(1, 30).unwrap();
    assert_eq!(ledger, before_grow);
    assert!(ledger.revert_decode(1, 1).unwrap());
    assert_eq!(ledger.request(1).unwrap().len(), 30);
    check_invariants(&ledger);
}

#[test]
fn a_decode_retry_after_its_token_was_shrunk_away_is_refused() {
    let layout = Layout::new(1, 4).unwrap();
    let mut ledger = Ledger::new(layout, 4).unwrap();
    ledger.add(1, 4).unwrap();
    assert!(ledger.grow(1, 4).unwrap());
    assert_eq!(ledger.allocate_decode(1, 3).unwrap(), Some(4));
    ledger.shrink(1, 2).unwrap();
    let before = ledger.clone();
    let err = ledger.allocate_decode(1, 3).unwrap_err().to_string();
    assert!(err.contains("given back by a shrink"), "{err}");
    assert_eq!(ledger, before);
}

#[test]
fn an_empty_prompt_is_refused_and_changes_nothing() {
    let layout = Layout::new(2, 4).unwrap();
    let mut ledger = Ledger::new(layout, 4).unwrap();
    let before = ledger.clone();
    assert!(matches!(
        ledger.add(1, 0),
        Err(helix_kv_core::CoreError::InvalidLength(_))
    ));
    assert!(matches!(
        ledger.add_many(&[1, 2], &[3, 0]),
        Err(helix_kv_core::CoreError::InvalidLength(_))
    ));
    assert_eq!(ledger, before);
}

#[test]
fn oversized_outputs_are_errors_not_aborts() {
    let layout = Layout::new(1, 1 << 20).unwrap();
    let mut ledger = Ledger::new(layout, 1).unwrap();
    ledger.add(1, 1 << 20).unwrap();
    assert!(ledger.grow(1, 1 << 20).unwrap());
    // 2^20 tokens named 2^40 times: 2^60 slots, far more than can be allocated.
    let ids = vec![1u64; 1 << 20];
    let starts = vec![0u64; 1 << 20];
    let counts = vec![1u64 << 20; 1 << 20];
    let mut out = Vec::new();
    let err = ledger
        .slot_mapping_into(&ids, &starts, &counts, 0, &mut out)
        .unwrap_err();
    assert!(
        matches!(err, helix_kv_core::CoreError::InvalidLength(_)),
        "{err}"
    );
    assert!(out.is_empty());
}

#[test]
fn a_pool_whose_page_ids_do_not_fit_int32_is_refused() {
    let layout = Layout::new(1, 1).unwrap();
    let err = Ledger::new(layout, (1 << 31) + 1).unwrap_err();
    assert!(
        matches!(err, helix_kv_core::CoreError::Config { .. }),
        "{err}"
    );
}
