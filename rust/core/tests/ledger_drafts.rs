//! The ledger's speculative positions (issue 24, its first part): drafts extend a step's
//! decode token, never evict cached superblocks, and give back exactly what they took:
//! rejected ones at update (a superblock only rejected drafts reached returns to the pool),
//! all of them at a revert (then the decode token reverts as before, to the same state).

use helix_kv_core::{CoreError, Layout, Ledger};

/// cp 2 x 2 tokens a page: a superblock is 4 global tokens; positions alternate owners
/// every 2 tokens.
fn ledger(capacity: u32) -> Ledger {
    Ledger::new(Layout::new(2, 2).unwrap(), capacity).unwrap()
}

/// A request of a 3-token prompt, prefilled, with its decode token of step 5 at position 3.
fn decoding(l: &mut Ledger, id: u64) {
    l.add(id, 3).unwrap();
    assert!(l.grow(id, 3).unwrap());
    assert_eq!(l.allocate_decode(id, 5).unwrap(), Some(3));
}

#[test]
fn drafts_cross_a_superblock_boundary_and_owner_ranks() {
    let mut l = ledger(8);
    decoding(&mut l, 1);
    assert_eq!(l.request(1).unwrap().table().len(), 1);
    // Positions 4..=8: owners 0 0 1 1 0, and two more superblocks.
    assert_eq!(l.extend_decode(1, 5, 5).unwrap(), Some(4));
    let kv = l.request(1).unwrap();
    assert_eq!((kv.len(), kv.table().len()), (9, 3));
    assert_eq!(kv.next_decode_position(), 9);
    let owners: Vec<u32> = (4..9).map(|p| l.layout().owner_rank(p)).collect();
    assert_eq!(owners, [0, 0, 1, 1, 0]);
    // Each rank holds its share of the positions.
    assert_eq!(l.view(1, 0).unwrap().local_len, 5);
    assert_eq!(l.view(1, 1).unwrap().local_len, 4);
}

#[test]
fn full_partial_and_zero_acceptance_keep_exactly_the_accepted_positions() {
    for accepted in [5u64, 2, 0] {
        let mut l = ledger(8);
        decoding(&mut l, 1);
        let len_before = l.request(1).unwrap().len();
        l.extend_decode(1, 5, 5).unwrap().unwrap();
        let rejected = 5 - accepted;
        // The decode token and the accepted drafts stay.
        let keep = 4 + accepted;
        l.retract_drafts(1, 5, rejected, keep.max(len_before))
            .unwrap();
        let kv = l.request(1).unwrap();
        assert_eq!(kv.next_decode_position(), keep, "accepted {accepted}");
        assert_eq!(kv.len(), keep);
        // A superblock that only rejected drafts reached went back.
        assert_eq!(kv.table().len() as u64, keep.div_ceil(4));
        assert_eq!(u64::from(l.free_superblocks()), 8 - keep.div_ceil(4));
        // The next decode continues after the accepted tokens.
        assert_eq!(l.allocate_decode(1, 6).unwrap(), Some(keep));
    }
}

#[test]
fn a_revert_gives_every_draft_back_and_then_the_decode_token() {
    let mut l = ledger(8);
    l.add(1, 3).unwrap();
    assert!(l.grow(1, 3).unwrap());
    let before = (l.state_digest(), l.clone());
    l.allocate_decode(1, 5).unwrap().unwrap();
    let len_before = l.request(1).unwrap().len();
    l.extend_decode(1, 5, 6).unwrap().unwrap();
    l.retract_drafts(1, 5, 6, len_before).unwrap();
    assert!(l.revert_decode(1, 5).unwrap());
    assert_eq!(l, before.1);
    assert_eq!(l.state_digest(), before.0);
}

#[test]
fn drafts_take_only_free_superblocks_and_never_evict_the_cache() {
    let mut l = ledger(3);
    l.enable_prefix_cache().unwrap();
    // Request 2 fills a superblock, registers it and lets go: it is cached, not free.
    l.add(2, 4).unwrap();
    assert!(l.grow(2, 4).unwrap());
    l.register_prefix(2, &[7]).unwrap();
    l.free(2).unwrap();
    decoding(&mut l, 1);
    // One superblock is free, one cached: drafts reaching two more are refused whole.
    assert_eq!(l.free_superblocks(), 2);
    let before = l.clone();
    assert_eq!(l.extend_decode(1, 5, 5).unwrap(), None);
    assert_eq!(l, before, "a refused extension changes nothing");
    assert_eq!(l.extend_decode(1, 5, 4).unwrap(), Some(4));
    assert!(
        l.prefix_cache().unwrap().lookup(7).is_some(),
        "the cached superblock stayed"
    );
}

#[test]
fn misuse_is_refused_and_changes_nothing() {
    let mut l = ledger(8);
    l.add(1, 3).unwrap();
    assert!(l.grow(1, 3).unwrap());
    let before = l.clone();
    assert!(matches!(
        l.extend_decode(1, 5, 2),
        Err(CoreError::InvalidState(_))
    ));
    assert!(matches!(
        l.extend_decode(9, 5, 2),
        Err(CoreError::UnknownRequest(9))
    ));
    assert_eq!(l, before);
    l.allocate_decode(1, 5).unwrap().unwrap();
    l.extend_decode(1, 5, 2).unwrap().unwrap();
    let before = l.clone();
    // More drafts than there are, a step that is not the decode's, a length that would
    // cut kept positions: refused.
    assert!(l.retract_drafts(1, 5, 3, 4).is_err());
    assert!(l.retract_drafts(1, 4, 1, 4).is_err());
    assert!(matches!(
        l.retract_drafts(1, 5, 1, 3),
        Err(CoreError::InvalidLength(_))
    ));
    assert!(matches!(
        l.extend_decode(1, 5, u64::MAX),
        Err(CoreError::InvalidLength(_))
    ));
    assert_eq!(l, before);
}
