//! The draft backoff (docs/internals/speculative-decoding.md#the-draft-backoff): a request
//! whose drafts keep being rejected stops drafting for a while, so that a drafter that
//! guesses badly for a request costs it no verification work it does not pay back.
//!
//! The rule reads only what `update` verified: per drafted decode of a request, whether any
//! of its drafts was accepted. Accepted counts are identical on every rank (the sampled
//! tokens are combined across the group before `update`), and so is `computed`, so the
//! rule is rank-invariant; it reads no clock and measures "a while" in the request's own
//! tokens.
//!
//! - After `draft_backoff_misses` consecutive drafted decodes with no draft accepted, the
//!   request drafts again only once it has decoded `draft_backoff_tokens` more tokens
//!   (its proposals are ignored until then, as for a request that does not decode).
//! - Each further pause without an accepted draft in between doubles (up to
//!   [`MAX_DOUBLINGS`] times); an accepted draft resets the streak and the doubling.
//!
//! Its state changes only in `update` (which never reverts) and when a request is retired,
//! so a reverted step moves nothing: `revert` needs no undo here. `schedule` only reads it
//! ([`DraftBackoff::paused`]).

use super::config::SchedulerConfig;
use super::request::RequestIndex;

/// The most times a pause doubles: the longest pause is `draft_backoff_tokens << 6`.
pub const MAX_DOUBLINGS: u32 = 6;

/// The backoff state of every request, dense by request index (a decode touches one entry of
/// each column, not the request's cold record).
#[derive(Debug, Clone, Default)]
pub(super) struct DraftBackoff {
    /// Consecutive verified drafted decodes with no draft accepted.
    misses: Vec<u32>,
    /// Pauses since its last accepted draft (the next one lasts `tokens << pauses`).
    pauses: Vec<u32>,
    /// The `computed` length from which it drafts again (0: it is not paused).
    resume_at: Vec<u64>,
}

impl DraftBackoff {
    /// Whether `req`, with `computed` tokens computed, ignores its proposals now.
    #[inline]
    pub fn paused(&self, req: RequestIndex, computed: u64) -> bool {
        self.resume_at
            .get(req as usize)
            .is_some_and(|&resume_at| computed < resume_at)
    }

    /// Records a verified drafted decode of `req` (at `update`): `accepted` of its drafts
    /// accepted, `computed` its length after the tokens it kept. Returns whether this
    /// started a pause. Does nothing while the backoff is off (`draft_backoff_misses = 0`).
    #[inline]
    pub fn verified(
        &mut self,
        config: &SchedulerConfig,
        req: RequestIndex,
        accepted: u32,
        computed: u64,
    ) -> bool {
        let after = config.draft_backoff_misses;
        if after == 0 {
            return false;
        }
        let r = req as usize;
        if self.misses.len() <= r {
            let len = r + 1;
            self.misses.resize(len, 0);
            self.pauses.resize(len, 0);
            self.resume_at.resize(len, 0);
        }
        if accepted > 0 {
            self.misses[r] = 0;
            self.pauses[r] = 0;
            return false;
        }
        self.misses[r] += 1;
        if self.misses[r] < after {
            return false;
        }
        let pause = u64::from(config.draft_backoff_tokens) << self.pauses[r].min(MAX_DOUBLINGS);
        self.misses[r] = 0;
        self.pauses[r] = self.pauses[r].saturating_add(1);
        self.resume_at[r] = computed.saturating_add(pause);
        true
    }

    /// Clears the state of `req` (retired: its index may be handed to a new request).
    pub fn forget(&mut self, req: RequestIndex) {
        let r = req as usize;
        if r < self.misses.len() {
            self.misses[r] = 0;
            self.pauses[r] = 0;
            self.resume_at[r] = 0;
        }
    }
}
