//! The host tier: a mirrored ledger of host superblocks. One host superblock is one host
//! page on every rank of the group (each rank keeps its own share of a page's tokens in
//! it), so, like the GPU ledger, its state is a function of the rank-invariant calls
//! alone and every rank hands out the same host page ids in the same order.
//!
//! A suspended request holds its host pages until the step that resumed it is updated:
//! the executor reads them (copy-in) during that step, so a suspend in the same step must
//! not get them, and a `revert` finds them where they were.

use super::pending::{JournalEntry, StepRecord};
use super::request::{RequestIndex, RequestState};
use super::Scheduler;
use crate::digest::Fnv64;

/// Host pages in use, per request, with a deterministic free list.
#[derive(Debug, Clone, Default)]
pub(super) struct HostTier {
    capacity: u32,
    used: u32,
    /// Ids never handed out yet start here (the free list stays small: no allocation
    /// proportional to the tier at construction).
    next_fresh: u32,
    /// Returned ids, taken last-in first-out.
    free: Vec<u32>,
    /// Host pages of each request index, in block-table order (empty for most).
    pages: Vec<Vec<u32>>,
}

impl HostTier {
    pub(super) fn new(capacity: u32) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    pub(super) fn used(&self) -> u32 {
        self.used
    }

    pub(super) fn free_count(&self) -> u32 {
        self.capacity - self.used
    }

    /// Host pages of `req` (empty unless it is suspended or resumed in the pending step).
    pub(super) fn pages(&self, req: RequestIndex) -> &[u32] {
        self.pages.get(req as usize).map_or(&[], Vec::as_slice)
    }

    /// Takes `count` host pages for `req`; the caller checked `free_count`.
    pub(super) fn take(&mut self, req: RequestIndex, count: u32) -> &[u32] {
        debug_assert!(count <= self.free_count());
        let index = req as usize;
        if self.pages.len() <= index {
            self.pages.resize_with(index + 1, Vec::new);
        }
        let held = &mut self.pages[index];
        debug_assert!(held.is_empty(), "a request holds one set of host pages");
        for _ in 0..count {
            let page = self.free.pop().unwrap_or_else(|| {
                self.next_fresh += 1;
                self.next_fresh - 1
            });
            held.push(page);
        }
        self.used += count;
        held
    }

    /// Gives the host pages of `req` back (none held: nothing happens).
    pub(super) fn release(&mut self, req: RequestIndex) {
        let Some(held) = self.pages.get_mut(req as usize) else {
            return;
        };
        #[expect(
            clippy::cast_possible_truncation,
            reason = "a request holds at most `capacity` (a u32) host pages"
        )]
        let count = held.len() as u32;
        // Reversed, so the next `take` hands them out in the order they had.
        self.free.extend(held.drain(..).rev());
        self.used -= count;
    }

    /// Mixes the tier's state into a state digest, in queue order of the holders.
    pub(super) fn digest_into(&self, h: &mut Fnv64, queue: &[RequestIndex]) {
        h.u64(u64::from(self.used));
        h.u64(u64::from(self.next_fresh));
        h.u64(self.free.len() as u64);
        for &page in &self.free {
            h.u64(u64::from(page));
        }
        for &req in queue {
            let pages = self.pages(req);
            h.u64(pages.len() as u64);
            for &page in pages {
                h.u64(u64::from(page));
            }
        }
    }
}

impl Scheduler {
    /// Gives back the host pages of the requests the updated step (`record`) resumed
    /// (their KV was copied in while the step ran).
    pub(super) fn release_resumed_host_pages(&mut self, record: &StepRecord) {
        if !self.has_host_tier() {
            return; // nothing was ever suspended, so nothing resumed
        }
        for &entry in &record.journal {
            if let JournalEntry::Resume(req) = entry {
                self.release_host_pages(req);
            }
        }
    }

    /// Whether requests can be suspended at all (and so resumed): without a host tier a
    /// step's journal holds no resume, and the per-step scans for them are skipped.
    pub(super) fn has_host_tier(&self) -> bool {
        self.config.host_tier_superblocks > 0
    }

    /// Gives back the host pages `req` holds (none: nothing happens). A request that is not
    /// `Suspended` and still holds some was resumed by the step being updated: its pages were
    /// copied in, and count as such (also when the update retires it).
    pub(super) fn release_host_pages(&mut self, req: RequestIndex) {
        if self.requests[req as usize].state != RequestState::Suspended {
            self.metrics.resumed_superblocks += self.host.pages(req).len() as u64;
        }
        self.host.release(req);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_come_back_in_the_order_they_were_handed_out() {
        let mut tier = HostTier::new(5);
        assert_eq!(tier.take(0, 2), [0, 1]);
        assert_eq!(tier.take(3, 2), [2, 3]);
        assert_eq!((tier.used(), tier.free_count()), (4, 1));
        tier.release(0);
        assert_eq!(tier.pages(0), [] as [u32; 0]);
        assert_eq!(tier.take(1, 3), [0, 1, 4]);
        assert_eq!(tier.free_count(), 0);
        tier.release(7); // holds nothing
        tier.release(3);
        tier.release(1);
        assert_eq!((tier.used(), tier.free_count()), (0, 5));
    }
}
