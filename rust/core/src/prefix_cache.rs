//! Prefix caching: which superblocks hold the KV of which token prefix, how many block
//! tables name each, and the order unreferenced ones are evicted in.
//!
//! The unit is a full superblock (`tokens_per_block x cp` global tokens). Its key is a
//! hash chain: the key of superblock `i` of a request is BLAKE3 over the key of superblock
//! `i - 1` (or, for the first, a seed made of the request's cache salt) and the token ids
//! of superblock `i`, truncated to 128 bits ([`chain_keys`]). BLAKE3 is a cryptographic
//! hash with no per-process seed, so every rank, process and platform computes the same
//! key from the same tokens, and finding two token runs with one key (to read another
//! tenant's KV) means a 2^64 birthday search at the least; it also hashes several GB/s on
//! one core, so keying a 128k-token prompt costs well under a millisecond.
//!
//! The cache is the ledger's: [`PrefixCache`] knows pages, references and keys, and
//! nothing of requests or steps. A step's evictions are logged ([`PrefixCache::take_evictions`])
//! for the scheduler to keep with the step and undo if it is reverted.
//!
//! Decisions look keys up (`lookup`), never iterate a hash map: the evictable pages are
//! ordered by their release stamp, a counter of the ledger's releases (never a clock), so
//! the least recently released page is evicted first on every rank ([`ReleaseOrder`]).

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;

use crate::digest::Fnv64;
use crate::ids::{superblock_count, SuperblockId};

/// The key of a full superblock's token prefix (128 bits of BLAKE3).
pub type BlockKey = u128;

/// The seed of a request's key chain: BLAKE3 of a domain tag and the request's cache salt
/// (empty for none), so requests with different salts never share a key.
pub fn chain_seed(salt: &[u8]) -> BlockKey {
    let mut h = blake3::Hasher::new();
    h.update(b"helix_kv prefix cache v1\0");
    h.update(&(salt.len() as u64).to_le_bytes());
    h.update(salt);
    truncate(h.finalize())
}

fn truncate(hash: blake3::Hash) -> BlockKey {
    let bytes = hash.as_bytes();
    let mut first = [0u8; 16];
    first.copy_from_slice(&bytes[..16]);
    u128::from_le_bytes(first)
}

/// Appends to `keys` the keys of the full superblocks of `tokens` past the `keys.len()`
/// already there (`tokens_per_superblock` tokens each; a partly filled last one gets
/// none). `seed` is the chain's seed ([`chain_seed`]).
pub fn chain_keys(
    seed: BlockKey,
    tokens: &[i32],
    tokens_per_superblock: u64,
    keys: &mut Vec<BlockKey>,
) {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "a superblock's tokens fit a slice of `tokens`, so their count fits usize"
    )]
    let keyed = keys.len().saturating_mul(tokens_per_superblock as usize);
    extend_keys(
        seed,
        &tokens[keyed.min(tokens.len())..],
        tokens_per_superblock,
        keys,
    );
}

/// Appends to `keys` the keys of the full superblocks of `tail`: the tokens that follow the
/// `keys.len()` superblocks already keyed (so a caller need not gather the tokens before
/// them). `seed` is the chain's seed ([`chain_seed`]).
pub fn extend_keys(
    seed: BlockKey,
    tail: &[i32],
    tokens_per_superblock: u64,
    keys: &mut Vec<BlockKey>,
) {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "a superblock's tokens fit a slice of `tokens`, so their count fits usize"
    )]
    let per = tokens_per_superblock as usize;
    if tail.len() < per {
        return;
    }
    let mut parent = keys.last().copied().unwrap_or(seed);
    let mut bytes = Vec::with_capacity(per * 4);
    for superblock in tail.chunks_exact(per) {
        bytes.clear();
        for &token in superblock {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        let mut h = blake3::Hasher::new();
        h.update(&parent.to_le_bytes());
        h.update(&bytes);
        parent = truncate(h.finalize());
        keys.push(parent);
    }
}

/// A cached superblock evicted by an allocation: enough to put it back exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Eviction {
    pub page: SuperblockId,
    pub key: BlockKey,
    pub stamp: u64,
}

/// The evictable pages in release-stamp order, least recently released first: what one
/// ordered map of stamp -> page would hold, without its O(log n) per release and hit.
///
/// Releases stamp pages in increasing order, so almost every insert is at the end: those go
/// on `queue`; the few that are not (a revert putting a page back at its kept stamp) go in
/// `late`, an ordered map, and the first of the two is the first page. Removals are lazy:
/// an entry stands while its page is evictable under its stamp (`PrefixCache::stands`),
/// and stale ones are dropped when met at the front, or all at once when they outnumber the
/// standing ones. A page put back at the stamp it had may stand twice (a
/// stale copy come back); copies are one entry (they are equal), and taking one makes the
/// other stale.
#[derive(Debug, Clone, Default)]
struct ReleaseOrder {
    queue: VecDeque<(u64, SuperblockId)>,
    late: BTreeMap<u64, SuperblockId>,
    /// Standing entries (copies counted once).
    len: usize,
}

impl ReleaseOrder {
    /// Adds `page` at `stamp` (it is not in the order now).
    fn insert(&mut self, stamp: u64, page: SuperblockId) {
        match self.queue.back() {
            Some(&(last, _)) if stamp <= last => {
                self.late.insert(stamp, page);
            }
            _ => self.queue.push_back((stamp, page)),
        }
        self.len += 1;
    }

    /// A page left the order (the caller made its entries stale).
    fn removed(&mut self) {
        self.len -= 1;
    }

    /// Takes the first standing entry; `stands` says whether an entry stands.
    fn pop_first(
        &mut self,
        stands: impl Fn(u64, SuperblockId) -> bool,
    ) -> Option<(u64, SuperblockId)> {
        while let Some(&(stamp, page)) = self.queue.front() {
            if stands(stamp, page) {
                break;
            }
            self.queue.pop_front();
        }
        while let Some((&stamp, &page)) = self.late.first_key_value() {
            if stands(stamp, page) {
                break;
            }
            self.late.pop_first();
        }
        let first = match (self.queue.front(), self.late.first_key_value()) {
            (None, None) => return None,
            (Some(&queued), None) => queued,
            (None, Some((&stamp, &page))) => (stamp, page),
            (Some(&queued), Some((&stamp, &page))) => queued.min((stamp, page)),
        };
        if self.queue.front() == Some(&first) {
            self.queue.pop_front();
        } else {
            self.late.pop_first();
        }
        self.len -= 1;
        Some(first)
    }

    /// The standing entries in order, each once.
    fn standing(&self, stands: impl Fn(u64, SuperblockId) -> bool) -> Vec<(u64, SuperblockId)> {
        let mut late = self
            .late
            .iter()
            .map(|(&stamp, &page)| (stamp, page))
            .peekable();
        let mut merged = Vec::with_capacity(self.len);
        for &queued in &self.queue {
            while let Some(&next) = late.peek() {
                if next >= queued {
                    break;
                }
                merged.push(next);
                late.next();
            }
            merged.push(queued);
        }
        merged.extend(late);
        merged.retain(|&(stamp, page)| stands(stamp, page));
        merged.dedup();
        merged
    }

    /// Drops the stale entries once they outnumber the standing ones (so the order's memory
    /// stays within twice what stands, and each stale entry is dropped once).
    fn compact(&mut self, stands: impl Fn(u64, SuperblockId) -> bool) {
        if self.queue.len() + self.late.len() <= 2 * self.len + 64 {
            return;
        }
        let standing = self.standing(stands);
        debug_assert_eq!(standing.len(), self.len);
        self.queue = standing.into();
        self.late.clear();
    }
}

/// References, keys and the eviction order of a ledger's superblocks (see the module doc).
/// Equal when they hold the same references, keys, stamps and eviction order, however the
/// order is stored.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    /// Per page: the block tables that name it.
    refs: Vec<u32>,
    /// Per page: its key while it is registered.
    keys: Vec<Option<BlockKey>>,
    /// Per registered page: the stamp of its last release by any table (not changed by a
    /// hit, nor by a release that undoes one), its place in `evictable` once nobody
    /// references it.
    stamps: Vec<u64>,
    /// Key -> page. A key is cached while its page is registered under it (`keys`); a key
    /// whose page no longer is (taken by an eviction) was evicted by a step still pending:
    /// no hit finds it, and no registration takes it, until that step is updated (its entry
    /// goes) or reverted (its page is registered under it again). So an update of the older
    /// step, one step ahead, registers what it would have without the newer step, and the
    /// newer step's revert is exact. An eviction touches no entry; its end is one probe.
    /// Looked up, never iterated.
    lookup: FxHashMap<BlockKey, SuperblockId>,
    /// Keys in `lookup` evicted by a pending step.
    evicted_keys: u64,
    /// Registered pages no table names, by release stamp: the first is evicted first.
    evictable: ReleaseOrder,
    next_stamp: u64,
    /// Evictions since the last `take_evictions`, oldest first.
    evicted: Vec<Eviction>,
    /// Releases put pages back at their kept stamp (undoing a step) instead of a new one.
    restoring: bool,
    /// Per page: the pending steps that copy KV into it (resumes from the host tier). Its
    /// content is not known until they close: a step that runs writes the resumed KV, a
    /// reverted one may or may not have. Such a page is never registered (see
    /// [`Self::copies_in`]).
    incoming: Vec<u8>,
}

impl PrefixCache {
    pub(crate) fn new(capacity: u32) -> Self {
        let n = capacity as usize;
        Self {
            refs: vec![0; n],
            keys: vec![None; n],
            stamps: vec![0; n],
            lookup: FxHashMap::default(),
            evicted_keys: 0,
            evictable: ReleaseOrder::default(),
            next_stamp: 0,
            evicted: Vec::new(),
            restoring: false,
            incoming: vec![0; n],
        }
    }

    /// Registered superblocks no request references (free capacity, evicted on demand).
    pub fn evictable_len(&self) -> u32 {
        superblock_count(self.evictable.len)
    }

    /// Whether an entry of the eviction order stands: `page` is evictable (registered,
    /// unreferenced) under `stamp`.
    fn stands<'a>(
        refs: &'a [u32],
        keys: &'a [Option<BlockKey>],
        stamps: &'a [u64],
    ) -> impl Fn(u64, SuperblockId) -> bool + 'a {
        move |stamp, page| {
            let p = page as usize;
            refs[p] == 0 && keys[p].is_some() && stamps[p] == stamp
        }
    }

    /// The eviction order, each page once.
    fn eviction_order(&self) -> Vec<(u64, SuperblockId)> {
        self.evictable
            .standing(Self::stands(&self.refs, &self.keys, &self.stamps))
    }

    /// Takes the least recently released evictable page off the order.
    fn pop_evictable(&mut self) -> Option<(u64, SuperblockId)> {
        self.evictable
            .pop_first(Self::stands(&self.refs, &self.keys, &self.stamps))
    }

    /// Block tables naming `page` (0 for a page outside the pool).
    pub fn refs(&self, page: SuperblockId) -> u32 {
        self.refs.get(page as usize).copied().unwrap_or(0)
    }

    /// The page holding `key`'s prefix, if cached.
    pub fn lookup(&self, key: BlockKey) -> Option<SuperblockId> {
        self.lookup
            .get(&key)
            .copied()
            .filter(|&page| self.keys[page as usize] == Some(key))
    }

    /// The key `page` is registered under (`None` for a page outside the pool).
    pub fn key_of(&self, page: SuperblockId) -> Option<BlockKey> {
        self.keys.get(page as usize).copied().flatten()
    }

    /// A page taken from the free list into one table.
    #[inline]
    pub(crate) fn take_fresh(&mut self, page: SuperblockId) {
        debug_assert_eq!(self.refs[page as usize], 0);
        debug_assert!(self.keys[page as usize].is_none());
        self.refs[page as usize] = 1;
    }

    /// A cached page named by one more table (a hit), or a page another table holds that
    /// an earlier entry of the step being scheduled computes (a same-step hit).
    pub(crate) fn share(&mut self, page: SuperblockId) {
        let p = page as usize;
        if self.refs[p] == 0 {
            debug_assert!(self.keys[p].is_some(), "a hit on an unregistered page");
            self.evictable.removed(); // its entry is stale from here on (referenced)
        }
        self.refs[p] += 1;
        self.evictable
            .compact(Self::stands(&self.refs, &self.keys, &self.stamps));
    }

    /// One table lets go of `page`. Returns whether it is free now (unregistered and
    /// unreferenced: the caller puts it on the free list); a registered page nobody
    /// references becomes evictable instead.
    #[inline]
    pub(crate) fn release(&mut self, page: SuperblockId) -> bool {
        let p = page as usize;
        debug_assert!(self.refs[p] > 0, "page {page} released more than taken");
        self.refs[p] -= 1;
        if !self.restoring && self.keys[p].is_some() {
            // Every release of a registered page is stamped, the last holder's or not: when
            // a revert later drops a hit that kept it referenced, it goes where the last
            // real release put it, as if the hit had never been made.
            self.stamps[p] = self.next_stamp;
            self.next_stamp += 1;
        }
        if self.refs[p] > 0 {
            return false;
        }
        if self.keys[p].is_none() {
            return true;
        }
        self.evictable.insert(self.stamps[p], page);
        false
    }

    /// Registers `page` (referenced) under `key`, unless the key is taken (another page
    /// caches the same prefix: this one stays unregistered), the page already has one, or
    /// a pending step copies KV into it (its content is not known yet).
    pub(crate) fn register(&mut self, page: SuperblockId, key: BlockKey) {
        let p = page as usize;
        debug_assert!(self.refs[p] > 0);
        if self.keys[p].is_some() || self.incoming[p] > 0 || self.lookup.contains_key(&key) {
            return;
        }
        self.keys[p] = Some(key);
        self.lookup.insert(key, page);
    }

    /// Evicts the least recently released page (logged), for the caller to put on the
    /// free list; `None` when none is evictable.
    pub(crate) fn evict_one(&mut self) -> Option<SuperblockId> {
        let (stamp, page) = self.pop_evictable()?;
        // Its key stays in `lookup`, now evicted (its page is no longer registered under it).
        let key = self.keys[page as usize]
            .take()
            .expect("an evictable page is registered");
        debug_assert_eq!(self.lookup.get(&key), Some(&page));
        self.evicted_keys += 1;
        self.evicted.push(Eviction { page, key, stamp });
        Some(page)
    }

    /// The evictions since the last call, oldest first (moved into `out`).
    pub(crate) fn take_evictions(&mut self, out: &mut Vec<Eviction>) {
        out.append(&mut self.evicted);
    }

    /// The evictions of a step that ran: their keys are gone for good.
    pub(crate) fn forget_evictions(&mut self, evictions: &[Eviction]) {
        for eviction in evictions {
            // Only an evicted key: one restored since (a revert) is cached again.
            if let Entry::Occupied(entry) = self.lookup.entry(eviction.key) {
                if self.keys[*entry.get() as usize] != Some(eviction.key) {
                    entry.remove();
                    self.evicted_keys -= 1;
                }
            }
        }
    }

    /// Puts an evicted page back in the cache (its page was taken off the free list by
    /// the caller). Its key cannot have been registered again meanwhile (it was held as
    /// evicted); `false` only for an eviction the cache does not hold as pending.
    pub(crate) fn restore(&mut self, eviction: Eviction) -> bool {
        let p = eviction.page as usize;
        if self.lookup.get(&eviction.key) != Some(&eviction.page)
            || self.keys[p] == Some(eviction.key)
        {
            debug_assert!(false, "an eviction restored twice or never made");
            return false;
        }
        self.evicted_keys -= 1;
        debug_assert_eq!(self.refs[p], 0);
        self.keys[p] = Some(eviction.key);
        self.stamps[p] = eviction.stamp;
        self.evictable.insert(eviction.stamp, eviction.page);
        true
    }

    /// A pending step copies KV into `page` (`on`), or that step closed (`!on`).
    pub(crate) fn set_copy_in(&mut self, page: SuperblockId, on: bool) {
        let incoming = &mut self.incoming[page as usize];
        if on {
            *incoming += 1;
        } else {
            debug_assert!(*incoming > 0, "page {page}: a copy-in ended twice");
            *incoming -= 1;
        }
    }

    /// Whether a pending step copies KV into `page` (`false` for a page outside the pool).
    pub fn copies_in(&self, page: SuperblockId) -> bool {
        self.incoming.get(page as usize).is_some_and(|&n| n > 0)
    }

    /// Releases put pages back at their kept stamps while `on` (the undo of a step).
    pub(crate) fn set_restoring(&mut self, on: bool) {
        self.restoring = on;
    }

    /// Unregisters every evictable page, least recently released first, appending them to
    /// `free` in that order. Referenced pages keep their keys.
    pub(crate) fn drop_unreferenced(&mut self, free: &mut Vec<SuperblockId>) -> u32 {
        let mut dropped = 0;
        while let Some((_, page)) = self.pop_evictable() {
            let key = self.keys[page as usize]
                .take()
                .expect("an evictable page is registered");
            self.lookup.remove(&key);
            free.push(page);
            dropped += 1;
        }
        dropped
    }

    /// Hashes the cache's state (every page's references and key, the eviction order and
    /// the next stamp), for `Ledger::state_digest`.
    pub(crate) fn digest_into(&self, h: &mut Fnv64) {
        for (page, (&refs, key)) in self.refs.iter().zip(&self.keys).enumerate() {
            let incoming = self.incoming[page];
            if refs == 0 && key.is_none() && incoming == 0 {
                continue;
            }
            h.u64(page as u64);
            h.u64(u64::from(refs) | u64::from(incoming) << 32);
            let bytes = key.unwrap_or(0).to_le_bytes();
            let (low, high) = bytes.split_at(8);
            h.u64(u64::from_le_bytes(low.try_into().expect("8 bytes")));
            h.u64(u64::from_le_bytes(high.try_into().expect("8 bytes")));
        }
        h.u64(u64::MAX);
        for (stamp, page) in self.eviction_order() {
            h.u64(stamp);
            h.u64(u64::from(page));
        }
        h.u64(self.next_stamp);
        h.u64(self.evicted_keys);
    }
}

impl PartialEq for PrefixCache {
    fn eq(&self, other: &Self) -> bool {
        self.refs == other.refs
            && self.keys == other.keys
            && self.stamps == other.stamps
            && self.lookup == other.lookup
            && self.evicted_keys == other.evicted_keys
            && self.next_stamp == other.next_stamp
            && self.evicted == other.evicted
            && self.restoring == other.restoring
            && self.incoming == other.incoming
            && self.eviction_order() == other.eviction_order()
    }
}

impl Eq for PrefixCache {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_over_full_superblocks_and_differ_by_salt_and_parent() {
        let seed = chain_seed(b"");
        let mut keys = Vec::new();
        chain_keys(seed, &[1, 2, 3, 4, 5, 6, 7], 3, &mut keys);
        assert_eq!(
            keys.len(),
            2,
            "the partly filled last superblock has no key"
        );
        // Computed again incrementally: the same chain.
        let mut again = Vec::new();
        chain_keys(seed, &[1, 2, 3], 3, &mut again);
        chain_keys(seed, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 3, &mut again);
        assert_eq!(&again[..2], &keys[..]);
        // Extended from only the tokens past the keyed superblocks: the same chain again.
        let mut tail = Vec::new();
        chain_keys(seed, &[1, 2, 3, 4], 3, &mut tail);
        extend_keys(seed, &[4, 5], 3, &mut tail);
        assert_eq!(
            tail.len(),
            1,
            "a tail shorter than a superblock adds no key"
        );
        extend_keys(seed, &[4, 5, 6, 7, 8, 9, 10], 3, &mut tail);
        assert_eq!(tail, again);
        // The same tokens after another prefix: another key.
        let mut other = Vec::new();
        chain_keys(seed, &[9, 9, 9, 4, 5, 6], 3, &mut other);
        assert_ne!(other[1], keys[1]);
        let mut salted = Vec::new();
        chain_keys(chain_seed(b"tenant"), &[1, 2, 3], 3, &mut salted);
        assert_ne!(salted[0], keys[0]);
        // Fixed across processes and platforms (no seeded hasher): a pinned value.
        assert_eq!(chain_seed(b""), chain_seed(b""));
    }

    #[test]
    fn the_release_order_is_an_ordered_map_of_the_standing_entries() {
        // The oracle: one BTreeMap of stamp -> page, changed as the cache changes the
        // order; the order under test sees only whether an entry stands (`stamp_of`: the
        // stamp a page stands at, if it stands).
        let mut next = crate::test_rng::xorshift(0x5eed_0dd5);
        for round in 0..40u64 {
            let pages = 1 + (round % 7) as u32 * 5;
            let mut order = ReleaseOrder::default();
            let mut oracle: BTreeMap<u64, SuperblockId> = BTreeMap::new();
            let mut stamp_of: Vec<Option<u64>> = vec![None; pages as usize];
            let mut last_stamp: Vec<Option<u64>> = vec![None; pages as usize];
            let mut clock = 0u64;
            for _ in 0..600 {
                let page = SuperblockId::try_from(next() % u64::from(pages)).unwrap();
                let p = page as usize;
                let stands = |stamp_of: &Vec<Option<u64>>| {
                    let copy = stamp_of.clone();
                    move |stamp: u64, page: SuperblockId| copy[page as usize] == Some(stamp)
                };
                match next() % 6 {
                    // a release: a new stamp, at the end
                    0 | 1 if stamp_of[p].is_none() => {
                        clock += 1 + next() % 3;
                        order.insert(clock, page);
                        oracle.insert(clock, page);
                        stamp_of[p] = Some(clock);
                        last_stamp[p] = Some(clock);
                    }
                    // a revert: back at the stamp it had (a stale copy may come back)
                    2 if stamp_of[p].is_none() && last_stamp[p].is_some() => {
                        let stamp = last_stamp[p].unwrap();
                        order.insert(stamp, page);
                        oracle.insert(stamp, page);
                        stamp_of[p] = Some(stamp);
                    }
                    // a hit: out of the order
                    3 if stamp_of[p].is_some() => {
                        oracle.remove(&stamp_of[p].unwrap());
                        stamp_of[p] = None;
                        order.removed();
                        order.compact(stands(&stamp_of));
                    }
                    // an eviction: the first
                    4 => {
                        let got = order.pop_first(stands(&stamp_of));
                        assert_eq!(got, oracle.pop_first());
                        if let Some((_, page)) = got {
                            stamp_of[page as usize] = None;
                        }
                    }
                    _ => {}
                }
                assert_eq!(order.len, oracle.len());
                let standing = order.standing(stands(&stamp_of));
                let expected: Vec<_> = oracle.iter().map(|(&s, &p)| (s, p)).collect();
                assert_eq!(standing, expected);
            }
            assert!(order.queue.len() + order.late.len() <= 2 * order.len + 64 + pages as usize);
        }
    }

    #[test]
    fn releases_evict_in_release_order_and_restore_exactly() {
        let mut cache = PrefixCache::new(4);
        for page in 0..3 {
            cache.take_fresh(page);
            cache.register(page, u128::from(page) + 100);
        }
        cache.take_fresh(3);
        assert!(cache.release(3), "an unregistered page is free at once");
        for page in [2, 0, 1] {
            assert!(!cache.release(page));
        }
        assert_eq!(cache.evictable_len(), 3);
        let before = cache.clone();
        assert_eq!(cache.evict_one(), Some(2));
        assert_eq!(cache.lookup(102), None);
        let mut log = Vec::new();
        cache.take_evictions(&mut log);
        // A hit on page 0, then the undo of both: the cache is as before.
        cache.share(0);
        cache.set_restoring(true);
        assert!(!cache.release(0));
        cache.set_restoring(false);
        assert!(cache.restore(log[0]));
        assert_eq!(cache, before);
        let mut free = Vec::new();
        assert_eq!(cache.drop_unreferenced(&mut free), 3);
        assert_eq!(free, vec![2, 0, 1]);
        assert_eq!(cache.lookup(100), None);
    }
}
