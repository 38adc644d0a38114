//! Victim search: the best candidate strictly behind a requester in queue order.
//!
//! Within one step the requesters of each phase come in queue order, candidates only
//! ever disappear (a victim holds nothing afterwards, a request served by preempting
//! is no candidate for the rest of the step, and nothing a step admits or resumes is a
//! candidate for a later requester), so both searches below stay linear per step however
//! many requests preempt or sit out.
//!
//! The ladder decides before it acts: it takes candidates off one by one (`remove`)
//! until they free enough, and only then preempts them. If they cannot, it puts them
//! back (`rollback` to a `checkpoint`). That happens at most once per phase with a
//! candidate taken: a decode token needs one superblock and every candidate holds at
//! least one, and a context request that cannot be served ends the context phase (under
//! priority admission an admission that cannot be served ends the admissions only: the
//! prompts already admitted behind it go on, and the first of them that cannot be served
//! ends the phase, so twice at most).

use super::config::VictimPolicy;

/// A candidate's rank for the policy; the smallest wins. Non-candidates are `None`.
pub(super) type VictimKey = Option<u64>;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct VictimFinder {
    policy: VictimPolicy,
    queue_len: usize,
    /// `NewestFirst`: every queue position at or above this is known not to be a
    /// candidate for the rest of the step.
    newest_bound: usize,
    /// Other policies: a min segment tree over queue positions, keyed by
    /// `(policy key, newest first)`, built by the first search of a step.
    tree: Vec<u128>,
    leaves: usize,
    built: bool,
    /// Candidates removed this step, with their tree leaves, for `rollback`.
    removed: Vec<(usize, u128)>,
}

/// Where a tentative run of removals began; see [`VictimFinder::rollback`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Checkpoint(usize);

const NOT_A_CANDIDATE: u128 = u128::MAX;

impl VictimFinder {
    pub fn new(policy: VictimPolicy) -> Self {
        Self {
            policy,
            queue_len: 0,
            newest_bound: 0,
            tree: Vec::new(),
            leaves: 0,
            built: false,
            removed: Vec::new(),
        }
    }

    /// Forgets the previous step; `queue_len` is this step's queue length.
    pub fn begin_step(&mut self, queue_len: usize) {
        self.queue_len = queue_len;
        self.newest_bound = queue_len;
        self.built = false;
        self.removed.clear();
    }

    /// The queue position of the victim for the requester at `requester`, or `None`.
    /// `key(pos)` says whether the request at `pos` is a candidate and how it ranks.
    pub fn find(&mut self, requester: usize, key: impl Fn(usize) -> VictimKey) -> Option<usize> {
        if self.policy == VictimPolicy::NewestFirst {
            while self.newest_bound > requester + 1 {
                let pos = self.newest_bound - 1;
                if key(pos).is_some() {
                    return Some(pos);
                }
                self.newest_bound = pos;
            }
            return None;
        }
        if !self.built {
            self.build(&key);
        }
        self.tree_min(requester + 1)
    }

    /// Marks the request at `pos` as no longer a candidate (it is about to be preempted,
    /// or it was served by preempting). `NewestFirst` relies on `key` for positions below
    /// its bound, so only a just-found candidate moves the bound.
    pub fn remove(&mut self, pos: usize) {
        let leaf = if self.policy == VictimPolicy::NewestFirst {
            if pos + 1 == self.newest_bound {
                self.newest_bound = pos;
            }
            NOT_A_CANDIDATE
        } else if self.built {
            let leaf = self.tree[self.leaves + pos];
            self.set_leaf(pos, NOT_A_CANDIDATE);
            leaf
        } else {
            return; // the tree is built later, from keys that already exclude it
        };
        self.removed.push((pos, leaf));
    }

    /// Marks the start of a tentative run of removals.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint(self.removed.len())
    }

    /// Makes the candidates removed since `checkpoint` candidates again. Positions the
    /// searches skipped as non-candidates stay skipped, so a later search does not walk
    /// them again.
    pub fn rollback(&mut self, checkpoint: Checkpoint) {
        while self.removed.len() > checkpoint.0 {
            let (pos, leaf) = self.removed.pop().expect("longer than the checkpoint");
            if self.policy == VictimPolicy::NewestFirst {
                self.newest_bound = self.newest_bound.max(pos + 1);
            } else if self.built && leaf != NOT_A_CANDIDATE {
                self.set_leaf(pos, leaf);
            }
        }
    }

    fn set_leaf(&mut self, pos: usize, value: u128) {
        let mut node = self.leaves + pos;
        self.tree[node] = value;
        while node > 1 {
            node /= 2;
            self.tree[node] = self.tree[2 * node].min(self.tree[2 * node + 1]);
        }
    }

    fn build(&mut self, key: &impl Fn(usize) -> VictimKey) {
        self.leaves = self.queue_len.next_power_of_two().max(1);
        self.tree.clear();
        self.tree.resize(2 * self.leaves, NOT_A_CANDIDATE);
        for pos in 0..self.queue_len {
            if let Some(rank) = key(pos) {
                // Ties go to the newest: the larger position gets the smaller low half.
                self.tree[self.leaves + pos] =
                    (u128::from(rank) << 64) | u128::from(u64::MAX - pos as u64);
            }
        }
        for node in (1..self.leaves).rev() {
            self.tree[node] = self.tree[2 * node].min(self.tree[2 * node + 1]);
        }
        self.built = true;
    }

    /// The best candidate at a position in `from..queue_len`.
    fn tree_min(&self, from: usize) -> Option<usize> {
        let mut lo = from + self.leaves;
        let mut hi = self.queue_len + self.leaves;
        let mut best = NOT_A_CANDIDATE;
        while lo < hi {
            if lo & 1 == 1 {
                best = best.min(self.tree[lo]);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                best = best.min(self.tree[hi]);
            }
            lo /= 2;
            hi /= 2;
        }
        #[expect(
            clippy::cast_possible_truncation,
            reason = "a key's low half is `u64::MAX - pos` for a queue position (see `build`)"
        )]
        (best != NOT_A_CANDIDATE).then(|| (u64::MAX - best as u64) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::xorshift;

    const POLICIES: [VictimPolicy; 3] = [
        VictimPolicy::NewestFirst,
        VictimPolicy::LeastComputedFirst,
        VictimPolicy::Priority,
    ];

    fn brute(policy: VictimPolicy, keys: &[VictimKey], requester: usize) -> Option<usize> {
        let behind = (requester + 1..keys.len()).filter_map(|p| keys[p].map(|k| (k, p)));
        match policy {
            VictimPolicy::NewestFirst => behind.map(|(_, p)| p).max(),
            _ => behind
                .min_by_key(|&(k, p)| (k, std::cmp::Reverse(p)))
                .map(|(_, p)| p),
        }
    }

    /// A step's finder over `len` random positions and their keys: two in three are
    /// candidates, with keys below 4 so that ties (broken by position) are common.
    fn random_step(
        policy: VictimPolicy,
        len: usize,
        next: &mut impl FnMut() -> u64,
    ) -> (VictimFinder, Vec<VictimKey>) {
        let keys = (0..len)
            .map(|_| (next() % 3 != 0).then(|| next() % 4))
            .collect();
        let mut finder = VictimFinder::new(policy);
        finder.begin_step(len);
        (finder, keys)
    }

    /// The finder's victim for `requester`, checked against a brute-force scan of `keys`.
    fn find_checked(
        finder: &mut VictimFinder,
        policy: VictimPolicy,
        keys: &[VictimKey],
        requester: usize,
        what: &str,
    ) -> Option<usize> {
        let got = finder.find(requester, |p| keys[p]);
        let expected = brute(policy, keys, requester);
        assert_eq!(got, expected, "{policy:?} {what} req={requester}");
        got
    }

    #[test]
    fn matches_a_brute_force_scan_as_candidates_disappear() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for policy in POLICIES {
            for len in [0usize, 1, 2, 5, 17, 64, 100] {
                let (mut finder, mut keys) = random_step(policy, len, &mut next);
                // Requesters arrive in queue order; each takes a few victims.
                let mut requester = 0;
                while requester < len {
                    for _ in 0..(next() % 3) {
                        let what = format!("len={len}");
                        if let Some(pos) =
                            find_checked(&mut finder, policy, &keys, requester, &what)
                        {
                            keys[pos] = None;
                            finder.remove(pos);
                        }
                    }
                    requester += 1 + (next() % 3) as usize;
                }
            }
        }
    }

    #[test]
    fn rollback_makes_tentatively_removed_candidates_candidates_again() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for policy in POLICIES {
            for len in [1usize, 3, 16, 50] {
                let (mut finder, mut keys) = random_step(policy, len, &mut next);
                let mut requester = 0;
                while requester < len {
                    // A tentative plan: take a few, then roll back or keep them.
                    let checkpoint = finder.checkpoint();
                    let mut taken = Vec::new();
                    for _ in 0..(next() % 4) {
                        let got = find_checked(&mut finder, policy, &keys, requester, "in plan");
                        let Some(pos) = got else { break };
                        finder.remove(pos);
                        taken.push((pos, keys[pos].take()));
                    }
                    if next() % 2 == 0 {
                        finder.rollback(checkpoint);
                        for (pos, key) in taken {
                            keys[pos] = key;
                        }
                    }
                    find_checked(&mut finder, policy, &keys, requester, "after plan");
                    requester += 1 + (next() % 3) as usize;
                }
            }
        }
    }
}
