//! What one step decided: flat arrays, ready to hand to numpy without a per-request
//! loop, plus a digest and a line-per-field summary for cross-rank checks.

use std::fmt::Write as _;

use crate::digest::{bits, LaneDigest};
use crate::RequestId;

/// The schedule of one step. Every field is identical on every rank of a CP group except
/// the three marked *rank*.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScheduleOutput {
    /// Step number; every successful `schedule()` takes a new one, reverted or not.
    pub step: u64,

    /// Requests with a prompt chunk this step, in queue order.
    pub context_ids: Vec<RequestId>,
    /// Global position of each chunk's first token.
    pub context_starts: Vec<u64>,
    /// Tokens in each chunk.
    pub context_lens: Vec<u64>,
    /// Whether the chunk completes the prompt (its last logits are sampled).
    pub context_completes: Vec<bool>,
    /// Batch slot of each context entry.
    pub context_batch_slots: Vec<i32>,
    /// The chunks' tokens concatenated in entry order (re-prefills include the folded
    /// generated tokens).
    pub context_token_ids: Vec<i32>,

    /// Requests decoding one token this step, in queue order.
    pub generation_ids: Vec<RequestId>,
    /// Global position of the token being written.
    pub generation_positions: Vec<u64>,
    /// Rank that appends that token: `(pos // tokens_per_block) % cp_size`.
    pub generation_owner_ranks: Vec<u32>,
    /// The token fed at that position (the request's last token).
    pub generation_input_tokens: Vec<i32>,
    /// Batch slot of each generation entry.
    pub generation_batch_slots: Vec<i32>,
    /// *rank*: whether this rank is the owner (appends the token's KV).
    pub generation_active: Vec<bool>,
    /// *rank*: tokens this rank holds after the append.
    pub generation_local_lens: Vec<u64>,
    /// *rank*: tokens this rank holds before the append.
    pub generation_past_seen_lens: Vec<u64>,

    /// Requests recompute-paused this step, in the order chosen.
    pub preempted_ids: Vec<RequestId>,
    /// For each preempted request, the request that needed its pages (always ahead of
    /// it in queue order).
    pub preempted_requester_ids: Vec<RequestId>,
    /// Requests suspended to the host tier this step, in the order chosen.
    pub suspended_ids: Vec<RequestId>,
    /// For each suspended request, the request that needed its pages.
    pub suspended_requester_ids: Vec<RequestId>,
    /// The pages (superblock ids, the same on every rank) each suspended request held,
    /// concatenated in `suspended_ids` order. The executor copies them to the host tier
    /// before anything else writes KV, whether the step then runs or is reverted: the
    /// pool may hand them out again in this very step.
    pub suspended_block_ids: Vec<i32>,
    /// How many of `suspended_block_ids` belong to each suspended request.
    pub suspended_block_counts: Vec<u64>,
    /// Requests brought back from the host tier this step (they decode from the next).
    /// Their new pages are in their block tables; the executor copies their KV back in
    /// after copying this step's suspended pages out (a resume may reuse those pages).
    pub resumed_ids: Vec<RequestId>,
    /// Generation requests that found neither pages nor a victim; their batch slots were
    /// released. A request that sat out may later in the same step be preempted by an
    /// older context request and then also appears in `preempted_ids`.
    pub sat_out_ids: Vec<RequestId>,

    /// Generation ids, then the ids of context entries that complete their prompt: the
    /// order of the tokens `update` takes.
    pub sample_ids: Vec<RequestId>,
    /// Context tokens plus decode tokens scheduled.
    pub num_tokens: u64,
    /// Fingerprint of every rank-invariant field, seeded with the configuration's
    /// (see [`ScheduleOutput::compute_digest`]).
    pub digest: u64,
}

/// Two 32-bit values in one digest word.
fn pack(low: i32, high: i32) -> u64 {
    bits(low) | (bits(high) << 32)
}

impl ScheduleOutput {
    /// Empties every field, keeping the allocations for the next step.
    pub(super) fn clear(&mut self, step: u64) {
        self.step = step;
        self.context_ids.clear();
        self.context_starts.clear();
        self.context_lens.clear();
        self.context_completes.clear();
        self.context_batch_slots.clear();
        self.context_token_ids.clear();
        self.generation_ids.clear();
        self.generation_positions.clear();
        self.generation_owner_ranks.clear();
        self.generation_input_tokens.clear();
        self.generation_batch_slots.clear();
        self.generation_active.clear();
        self.generation_local_lens.clear();
        self.generation_past_seen_lens.clear();
        self.preempted_ids.clear();
        self.preempted_requester_ids.clear();
        self.suspended_ids.clear();
        self.suspended_requester_ids.clear();
        self.suspended_block_ids.clear();
        self.suspended_block_counts.clear();
        self.resumed_ids.clear();
        self.sat_out_ids.clear();
        self.sample_ids.clear();
        self.num_tokens = 0;
        self.digest = 0;
    }

    /// The fingerprint of every rank-invariant field, array by array (each with its
    /// length), seeded with the scheduler's configuration fingerprint
    /// ([`super::SchedulerConfig::fingerprint`]): two ranks built from different
    /// configurations get different digests even for a step whose fields agree. Fields that are functions of hashed ones are covered through them:
    /// `sample_ids` (generation ids, then completing context ids) and the owner ranks
    /// (positions, under the group's layout). A request's id and position share a word
    /// (`id * odd ^ position`: still any single-field difference changes it), and so do
    /// its input token and batch slot.
    pub fn compute_digest(&self, config_fingerprint: u64) -> u64 {
        let mut h = LaneDigest::new();
        h.word(config_fingerprint);
        h.word(self.step);
        h.word(self.num_tokens);
        h.words(&self.context_ids);
        h.words(&self.context_starts);
        h.words(&self.context_lens);
        h.flags(&self.context_completes);
        h.stream(self.context_batch_slots.iter().map(|&v| bits(v)));
        let tokens = self
            .context_token_ids
            .chunks(2)
            .map(|pair| pack(pair[0], pair.get(1).copied().unwrap_or(0)));
        h.word(self.context_token_ids.len() as u64);
        h.stream(tokens);
        let id_positions = self.generation_ids.iter().zip(&self.generation_positions);
        h.stream(
            id_positions.map(|(&id, &position)| id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ position),
        );
        let token_slots = self
            .generation_input_tokens
            .iter()
            .zip(&self.generation_batch_slots);
        h.stream(token_slots.map(|(&token, &slot)| pack(token, slot)));
        for ids in [
            &self.preempted_ids,
            &self.preempted_requester_ids,
            &self.suspended_ids,
            &self.suspended_requester_ids,
            &self.suspended_block_counts,
            &self.resumed_ids,
            &self.sat_out_ids,
        ] {
            h.words(ids);
        }
        h.stream(self.suspended_block_ids.iter().map(|&v| bits(v)));
        h.word(self.sample_ids.len() as u64);
        h.finish()
    }

    /// Ids of context entries whose chunk does not complete the prompt.
    pub fn incomplete_prompt_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.context_ids
            .iter()
            .zip(&self.context_completes)
            .filter(|(_, &completes)| !completes)
            .map(|(&id, _)| id)
    }

    /// One `name: value` line per field, stable text so two ranks' summaries can be
    /// diffed line by line. Rank-dependent fields are left out.
    pub fn summary(&self) -> String {
        fn ids_line(out: &mut String, name: &str, ids: impl Iterator<Item = RequestId>) {
            out.push_str(name);
            out.push(':');
            for id in ids {
                let _ = write!(out, " {id}");
            }
            out.push('\n');
        }
        fn victims_line(
            out: &mut String,
            name: &str,
            victims: &[RequestId],
            requesters: &[RequestId],
        ) {
            out.push_str(name);
            out.push(':');
            for (victim, requester) in victims.iter().zip(requesters) {
                let _ = write!(out, " {victim}(for {requester})");
            }
            out.push('\n');
        }
        let mut out = String::new();
        let _ = writeln!(out, "step: {}", self.step);
        let _ = writeln!(out, "num_tokens: {}", self.num_tokens);
        out.push_str("context:");
        for i in 0..self.context_ids.len() {
            let marker = if self.context_completes[i] { "" } else { "!" };
            let _ = write!(
                out,
                " {}:{}+{}{marker}",
                self.context_ids[i], self.context_starts[i], self.context_lens[i]
            );
        }
        out.push('\n');
        ids_line(&mut out, "incomplete_prompts", self.incomplete_prompt_ids());
        out.push_str("generation:");
        for i in 0..self.generation_ids.len() {
            let _ = write!(
                out,
                " {}@{}/r{}",
                self.generation_ids[i],
                self.generation_positions[i],
                self.generation_owner_ranks[i]
            );
        }
        out.push('\n');
        victims_line(
            &mut out,
            "preempted",
            &self.preempted_ids,
            &self.preempted_requester_ids,
        );
        victims_line(
            &mut out,
            "suspended",
            &self.suspended_ids,
            &self.suspended_requester_ids,
        );
        ids_line(&mut out, "resumed", self.resumed_ids.iter().copied());
        ids_line(&mut out, "sat_out", self.sat_out_ids.iter().copied());
        out.push_str("batch_slots:");
        let slots = self.context_ids.iter().zip(&self.context_batch_slots);
        for (id, slot) in slots.chain(self.generation_ids.iter().zip(&self.generation_batch_slots))
        {
            let _ = write!(out, " {id}={slot}");
        }
        out.push('\n');
        let _ = writeln!(out, "digest: {:016x}", self.digest);
        out
    }
}
