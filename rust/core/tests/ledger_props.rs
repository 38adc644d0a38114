//! Ledger invariants under random operation sequences: no page held twice, free + used ==
//! capacity, tables sized to their lengths, failed calls change nothing, and two ledgers
//! fed the same sequence stay identical.

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
    let id = 0u64..6;
    let len = 0u64..90;
    prop_oneof![
        (id.clone(), len.clone()).prop_map(|(i, n)| Op::Add(i, n)),
        (id.clone(), len.clone()).prop_map(|(i, n)| Op::Grow(i, n)),
        (id.clone(), len.clone()).prop_map(|(i, n)| Op::Shrink(i, n)),
        id.clone().prop_map(Op::Free),
        (id.clone(), 0u64..3).prop_map(|(i, s)| Op::Decode(i, s)),
        (id.clone(), 0u64..3).prop_map(|(i, s)| Op::Revert(i, s)),
        (id.clone(), 0u64..3).prop_map(|(i, g)| Op::Recompute(i, g)),
        id.clone().prop_map(Op::Suspend),
        id.clone().prop_map(Op::Resume),
        prop::collection::vec((id.clone(), len), 0..4).prop_map(Op::GrowMany),
        prop::collection::vec(id, 0..3).prop_map(Op::FreeMany),
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
        assert_eq!(request.table().len() as u32, count);
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
    #![proptest_config(ProptestConfig::with_cases(256))]
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
    ledger.add(1, 0).unwrap();
    ledger.add(2, 0).unwrap();
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
    ledger.add_many(&[1, 2, 3], &[0, 0, 0]).unwrap();
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
