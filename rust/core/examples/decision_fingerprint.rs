//! A differential fingerprint of every decision the core makes: seeded workloads driven
//! through the public API only, each folded into one 64-bit hash. A refactor that must not
//! change behaviour keeps every hash; the first workload whose hash moves names where to
//! look. Run with
//! `cargo run --release -p helix-kv-core --example decision_fingerprint [-- --check FILE]`:
//! it prints one line per workload and a total; with `--check FILE` (a saved print, e.g.
//! `rust/core/examples/decision_fingerprint.expected`) it also compares the two and exits
//! with status 1 naming the first workload that differs.
//!
//! The scheduler workloads cover cp 1/2/4, several `tokens_per_block` and chunk units,
//! pools under pressure and not, aggregated Helix, non-Helix with host tiers and
//! disaggregated generation, every victim and suspend policy, both capacity policies and
//! chunked prefill on and off, each driven plain and one step ahead. Between and during
//! steps they add requests (duplicates and reused ids too), abort live and finished ones,
//! revert the newest pending step (and both), update with random tokens and end-of-sequence
//! flags, and make calls that must fail. After every call the hash takes every
//! `ScheduleOutput`, its digest and computed columns, `state_digest()`,
//! `ledger().state_digest()`, `metrics()`, the bytes both metadata writers write
//! (`write_step_metadata` and `write_decode_rows`, from the held output and from a copy or
//! a taken one), the finished ids and outputs, what `revert` returns, every live request's
//! state, slot, tokens, counters and ledger holdings, block tables and slot mappings, and
//! every error's message. The ledger workloads drive a bare `Ledger` the same way. The
//! speculative shapes (appended, so the others keep their hashes) also propose random drafts
//! before each schedule and update with random accepted counts (some refused); the shapes of
//! priority admission and the prefill cap are appended after them.
//!
//! Only the public API is used, so the same file runs before and after a refactor.
#![expect(
    clippy::cast_possible_truncation,
    reason = "random draws are reduced below small bounds before the casts"
)]

use std::collections::VecDeque;
use std::fmt::{self, Debug};
use std::process::ExitCode;

use helix_kv_core::{
    decode_row, AdmissionPolicy, CapacityPolicy, Layout, Ledger, RequestId, ScheduleOutput,
    Scheduler, SchedulerConfig, ServingMode, SuspendPolicy, VictimPolicy,
};

/// FNV-1a over 64-bit words (bytes packed little-endian, eight to a word; text is fed
/// through `fmt::Write`, so nothing is formatted into a string first): stable on every
/// platform and release, and independent of how a `Debug` impl splits its writes.
struct Fnv {
    hash: u64,
    /// Bytes not yet mixed in (`filled` of them, the first in the low byte).
    word: u64,
    filled: u32,
}

impl Fnv {
    fn new() -> Self {
        Self {
            hash: 0xcbf2_9ce4_8422_2325,
            word: 0,
            filled: 0,
        }
    }
    fn mix(&mut self, v: u64) {
        self.hash = (self.hash ^ v).wrapping_mul(0x0100_0000_01b3);
        self.hash ^= self.hash >> 29;
    }
    /// Mixes in the bytes not yet mixed, and marks the end of a value.
    fn flush(&mut self) {
        let (word, filled) = (self.word, self.filled);
        self.mix(word ^ (u64::from(filled) << 60));
        (self.word, self.filled) = (0, 0);
    }
    fn u64(&mut self, v: u64) {
        if self.filled > 0 {
            self.flush();
        }
        self.mix(v);
    }
    fn str(&mut self, s: &str) {
        fmt::Write::write_str(self, s).expect("hashing never fails");
        self.flush();
    }
    fn debug<T: Debug + ?Sized>(&mut self, v: &T) {
        fmt::Write::write_fmt(self, format_args!("{v:?}")).expect("hashing never fails");
        self.flush();
    }
    fn words(&mut self, words: &[i32]) {
        self.u64(words.len() as u64);
        for &w in words {
            self.mix(u64::from(u32::from_le_bytes(w.to_le_bytes())));
        }
    }
    fn finish(&mut self) -> u64 {
        self.flush();
        self.hash
    }
}

impl fmt::Write for Fnv {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut bytes = s.as_bytes();
        // Whole words straight from the text once the pending word is full.
        while self.filled != 0 {
            let Some((&b, rest)) = bytes.split_first() else {
                return Ok(());
            };
            self.push(b);
            bytes = rest;
        }
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
        for &b in chunks.remainder() {
            self.push(b);
        }
        Ok(())
    }
}

impl Fnv {
    fn push(&mut self, b: u8) {
        self.word |= u64::from(b) << (8 * self.filled);
        self.filled += 1;
        if self.filled == 8 {
            let word = self.word;
            self.mix(word);
            (self.word, self.filled) = (0, 0);
        }
    }
}

/// xorshift64*: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn range(&mut self, lo: u64, hi_inclusive: u64) -> u64 {
        lo + self.below(hi_inclusive - lo + 1)
    }
    /// True with probability `percent` / 100.
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> Option<T> {
        (!items.is_empty()).then(|| items[self.below(items.len() as u64) as usize])
    }
}

/// One scheduler workload's shape: its configuration and its request sizes.
struct Shape {
    name: &'static str,
    config: SchedulerConfig,
    max_prompt: u64,
    max_new: u64,
    /// Percent chance per iteration that requests arrive (while arrivals last).
    arrival: u64,
    iterations: u32,
    /// Tokens of a system prompt every prompt starts with (0: none), so that requests
    /// admitted in one step share it (same-step prefix sharing).
    shared_prefix: u64,
}

#[expect(
    clippy::too_many_arguments,
    reason = "one row of the shape table per call"
)]
fn config(
    cp: u32,
    tokens_per_block: u32,
    capacity: u32,
    batch: u32,
    max_tokens: u32,
    chunked: bool,
    mode: ServingMode,
    host: u32,
) -> SchedulerConfig {
    let mut c = SchedulerConfig::new(capacity);
    c.cp_size = cp;
    c.tokens_per_block = tokens_per_block;
    c.max_batch_size = batch;
    c.max_num_tokens = max_tokens;
    c.enable_chunked_prefill = chunked;
    c.serving_mode = mode;
    c.host_tier_superblocks = host;
    c.deadlock_steps = 16;
    // Short rows of block table in the metadata (its default width is the widest request).
    c.max_seq_len = 160;
    c
}

#[expect(
    clippy::too_many_lines,
    reason = "the shape table, one row per workload"
)]
fn shapes() -> Vec<Shape> {
    use ServingMode::{AggregatedHelix as Agg, DisaggregatedGeneration as Disagg, NonHelix};
    let mut shapes = Vec::new();
    let mut add = |name, config: SchedulerConfig, max_prompt, max_new, arrival, iterations| {
        shapes.push(Shape {
            name,
            config,
            max_prompt,
            max_new,
            arrival,
            iterations,
            shared_prefix: 0,
        });
    };
    add(
        "agg-cp1-tpb4-newest",
        config(1, 4, 12, 8, 64, true, Agg, 0),
        30,
        24,
        40,
        300,
    );
    let mut c = config(2, 2, 10, 6, 24, true, Agg, 0);
    c.victim_policy = VictimPolicy::LeastComputedFirst;
    add("agg-cp2-tpb2-least-computed", c, 20, 20, 45, 300);
    let mut c = config(4, 1, 16, 10, 40, true, Agg, 8);
    c.victim_policy = VictimPolicy::Priority;
    c.suspend_policy = SuspendPolicy::SuspendFirst;
    c.cp_rank = 3;
    add("agg-cp4-tpb1-priority-host", c, 24, 16, 45, 300);
    let mut c = config(4, 8, 6, 8, 48, true, Agg, 6);
    c.chunk_unit = Some(4);
    c.suspend_policy = SuspendPolicy::RecomputeFirst;
    c.cp_rank = 1;
    add(
        "agg-cp4-tpb8-unit4-recompute-first-host",
        c,
        60,
        30,
        40,
        300,
    );
    let mut c = config(1, 4, 14, 8, 32, true, NonHelix, 10);
    c.suspend_policy = SuspendPolicy::Cost;
    c.victim_policy = VictimPolicy::LeastComputedFirst;
    add("nonhelix-tpb4-cost-host", c, 30, 24, 45, 300);
    let mut c = config(1, 16, 8, 6, 96, false, NonHelix, 20);
    c.victim_policy = VictimPolicy::Priority;
    add("nonhelix-tpb16-unchunked-host", c, 50, 40, 40, 300);
    let mut c = config(1, 1, 40, 8, 20, true, NonHelix, 3);
    c.suspend_policy = SuspendPolicy::RecomputeFirst;
    c.admit_after_preemption = true;
    add("nonhelix-tpb1-tiny-host-admit", c, 16, 16, 45, 300);
    let mut c = config(1, 2, 30, 10, 40, true, NonHelix, 12);
    c.suspend_policy = SuspendPolicy::Cost;
    c.suspend_cost_per_token = 3;
    c.recompute_cost_per_token = 1;
    c.max_preemptions_per_request = 2;
    add("nonhelix-tpb2-cost-bound2", c, 20, 20, 50, 300);
    let mut c = config(2, 4, 20, 8, 48, true, Disagg, 0);
    c.cp_rank = 1;
    add("disagg-cp2-tpb4", c, 30, 30, 40, 300);
    let mut c = config(4, 2, 24, 8, 48, true, Disagg, 0);
    c.capacity_policy = CapacityPolicy::GuaranteedNoEvict;
    c.cp_rank = 2;
    add("disagg-cp4-no-evict", c, 24, 24, 40, 300);
    let mut c = config(2, 4, 16, 8, 80, false, Agg, 0);
    c.capacity_policy = CapacityPolicy::GuaranteedNoEvict;
    add("agg-cp2-no-evict-unchunked", c, 30, 30, 40, 300);
    let c = config(1, 4, 400, 100, 512, true, Agg, 0);
    add("agg-cp1-steady-decode-wide", c, 12, 60, 70, 200);
    let mut c = config(2, 4, 10, 8, 32, true, Agg, 0);
    c.max_preemptions_per_request = 0;
    c.deadlock_steps = 4;
    add("agg-cp2-preemption-off", c, 20, 16, 40, 250);
    let mut c = config(4, 2, 8, 8, 32, true, Agg, 4);
    c.max_preemptions_per_request = 1;
    c.deadlock_steps = 8;
    c.suspend_policy = SuspendPolicy::Cost;
    c.victim_policy = VictimPolicy::LeastComputedFirst;
    add("agg-cp4-tpb2-bound1-cost-host", c, 24, 20, 45, 300);
    let mut c = config(2, 3, 18, 12, 30, true, Agg, 0);
    c.chunk_unit = Some(5);
    c.admit_after_preemption = true;
    c.victim_policy = VictimPolicy::Priority;
    add("agg-cp2-tpb3-unit5-admit-priority", c, 40, 20, 45, 300);
    let mut c = config(1, 8, 60, 70, 200, true, NonHelix, 30);
    c.victim_policy = VictimPolicy::LeastComputedFirst;
    add("nonhelix-tpb8-wide-pressure-host", c, 20, 40, 70, 250);
    // Speculative decoding (appended: the shapes above keep their hashes).
    let mut c = config(2, 4, 14, 8, 40, true, Agg, 0);
    c.num_speculative_tokens = 3;
    add("agg-cp2-tpb4-drafts3", c, 24, 24, 45, 300);
    let mut c = config(4, 2, 12, 8, 24, true, Agg, 6);
    c.num_speculative_tokens = 4;
    c.enable_prefix_caching = true;
    c.cp_rank = 2;
    add("agg-cp4-tpb2-drafts4-caching-host", c, 20, 20, 45, 300);
    let mut c = config(1, 4, 10, 6, 16, true, NonHelix, 8);
    c.num_speculative_tokens = 2;
    c.suspend_policy = SuspendPolicy::Cost;
    add(
        "nonhelix-tpb4-drafts2-host-tight-budget",
        c,
        20,
        24,
        50,
        300,
    );
    // Priority admission and the prefill cap (appended: the shapes above keep their hashes).
    let mut c = config(2, 4, 12, 8, 40, true, Agg, 0);
    c.admission_policy = AdmissionPolicy::Priority;
    add("agg-cp2-tpb4-priority-admission", c, 30, 24, 45, 300);
    let mut c = config(1, 4, 14, 8, 32, true, NonHelix, 10);
    c.admission_policy = AdmissionPolicy::Priority;
    c.victim_policy = VictimPolicy::LeastComputedFirst;
    c.suspend_policy = SuspendPolicy::Cost;
    add(
        "nonhelix-tpb4-priority-admission-least-computed-host",
        c,
        30,
        24,
        45,
        300,
    );
    let mut c = config(2, 2, 16, 10, 48, true, Agg, 0);
    c.chunk_unit = Some(4);
    c.long_prefill_token_threshold = 10;
    add("agg-cp2-tpb2-unit4-long-prefill", c, 60, 20, 45, 300);
    let mut c = config(4, 2, 12, 8, 48, true, Agg, 6);
    c.admission_policy = AdmissionPolicy::Priority;
    c.long_prefill_token_threshold = 6;
    c.long_prefill_token_threshold_adaptive = true;
    c.enable_prefix_caching = true;
    c.num_speculative_tokens = 2;
    c.cp_rank = 1;
    add(
        "agg-cp4-tpb2-priority-long-prefill-adaptive-caching-drafts-host",
        c,
        40,
        20,
        45,
        300,
    );
    // Bursts behind one system prompt (same-step prefix sharing; appended: the shapes above
    // keep their hashes).
    let mut c = config(2, 2, 24, 8, 64, true, Agg, 0);
    c.enable_prefix_caching = true;
    shapes.push(Shape {
        name: "agg-cp2-tpb2-caching-system-prompt",
        config: c,
        max_prompt: 12,
        max_new: 16,
        arrival: 30,
        iterations: 300,
        shared_prefix: 20,
    });
    let mut c = config(4, 2, 16, 8, 48, true, Agg, 8);
    c.enable_prefix_caching = true;
    c.num_speculative_tokens = 2;
    c.victim_policy = VictimPolicy::Priority;
    c.cp_rank = 1;
    shapes.push(Shape {
        name: "agg-cp4-tpb2-caching-system-prompt-drafts-host",
        config: c,
        max_prompt: 16,
        max_new: 20,
        arrival: 40,
        iterations: 300,
        shared_prefix: 24,
    });
    shapes
}

/// How a workload drives its scheduler.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Drive {
    /// Schedule, then update or revert, one step at a time.
    Plain,
    /// Up to two steps pending: the next one is scheduled before the older is closed.
    Ahead,
}

/// A scheduler, its workload's generator, and what the driver knows of the pending steps.
struct Run {
    s: Scheduler,
    rng: Rng,
    h: Fnv,
    next_id: RequestId,
    /// Ids whose output was taken (may be added again).
    reusable: Vec<RequestId>,
    /// Copies of the pending outputs, oldest first.
    pending: VecDeque<ScheduleOutput>,
    /// A taken output, to hand back later with `recycle_output`.
    spare: Option<ScheduleOutput>,
    layout: helix_kv_core::StepMetadataLayout,
    narrow: helix_kv_core::StepMetadataLayout,
    max_prompt: u64,
    max_new: u64,
    shared_prefix: u64,
}

const SENTINEL: i32 = -7777;

impl Run {
    fn add_requests(&mut self) {
        for _ in 0..self.rng.range(1, 3) {
            let id = if self.rng.chance(10) {
                match self.rng.pick(&self.reusable) {
                    Some(id) => {
                        self.reusable.retain(|&r| r != id);
                        id
                    }
                    None => self.fresh_id(),
                }
            } else if self.rng.chance(3) && self.next_id > 0 {
                self.rng.below(self.next_id) // often a duplicate: refused
            } else {
                self.fresh_id()
            };
            let len = self.rng.range(1, self.max_prompt);
            let system = (0..self.shared_prefix).map(|i| ((i * 13 + 5) % 997) as i32);
            let prompt: Vec<i32> = system
                .chain((0..len).map(|i| ((id * 7919 + i * 31) % 997) as i32))
                .collect();
            let max_new = self.rng.range(1, self.max_new) as u32;
            let priority = self.rng.range(0, 6) as i32 - 3;
            let added = self.s.add_request(id, &prompt, max_new, priority);
            self.h.str("add");
            self.h.u64(id);
            self.h.debug(&added);
        }
        if self.rng.chance(2) {
            let refused = self.s.add_request(self.next_id + 1000, &[], 4, 0);
            self.h.debug(&refused);
        }
    }

    fn fresh_id(&mut self) -> RequestId {
        self.next_id += 1;
        self.next_id - 1
    }

    /// Aborts a few live or finished-untaken requests.
    fn abort_some(&mut self) {
        let live = self.s.queue_ids();
        let untaken = self.s.untaken_outputs();
        let mut ids = Vec::new();
        for _ in 0..self.rng.range(1, 3) {
            let pool = if self.rng.chance(80) { &live } else { &untaken };
            if let Some(id) = self.rng.pick(pool) {
                ids.push(id);
            }
        }
        self.h.str("abort");
        self.h.debug(&ids);
        let ok = if ids.len() == 1 && self.rng.chance(50) {
            self.s.abort(ids[0]).is_ok()
        } else {
            self.s.abort_many(&ids).is_ok()
        };
        self.h.u64(u64::from(ok));
        for &id in &ids {
            self.h.debug(&self.s.is_abort_requested(id).ok());
        }
    }

    fn take_some_outputs(&mut self, percent: u64) {
        for id in self.s.untaken_outputs() {
            if self.rng.chance(percent) {
                self.h.debug(&self.s.request_metrics(id));
                let output = self.s.take_output(id);
                self.h.debug(&output);
                if output.is_ok() {
                    self.reusable.push(id);
                }
            }
        }
    }

    fn schedule(&mut self) {
        if self.s.config().num_speculative_tokens > 0 {
            self.propose_drafts();
        }
        let scheduled = self.s.schedule().cloned();
        match scheduled {
            Ok(out) => {
                self.h.str("schedule");
                hash_output(&mut self.h, &out);
                self.write_metadata(&out, true);
                self.pending.push_back(out);
                if self.rng.chance(25) {
                    // Hand the schedule out (zero copy) and write from the taken one.
                    let taken = self.s.take_last_output();
                    self.h.debug(self.s.last_output());
                    self.write_metadata(&taken, false);
                    if let Some(old) = self.spare.replace(taken) {
                        self.s.recycle_output(old);
                    }
                }
                if self.rng.chance(30) {
                    if let Some(spare) = self.spare.take() {
                        self.s.recycle_output(spare);
                    }
                }
            }
            Err(err) => {
                self.h.str("schedule failed");
                self.h.str(&err.to_string());
                // Unblock a stalled or refused run: the oldest live request goes.
                if let Some(&id) = self.s.queue_ids().first() {
                    self.h.u64(u64::from(self.s.abort(id).is_ok()));
                }
            }
        }
    }

    /// Both metadata writers for `out`: from the output the scheduler holds (`held`), or
    /// from `out` itself; always also from `out` through the source form.
    fn write_metadata(&mut self, out: &ScheduleOutput, held: bool) {
        for layout in [&self.layout, &self.narrow] {
            let mut buffer = vec![SENTINEL; layout.total_words()];
            let written = if held {
                self.s.write_last_step_metadata(layout, &mut buffer)
            } else {
                self.s.write_step_metadata(out.into(), layout, &mut buffer)
            };
            self.h.debug(&written);
            self.h.words(&buffer);
        }
        let columns = decode_row::BLOCK_TABLE + self.layout.table_width();
        let rows = self.s.config().max_batch_size as usize + 2;
        let pad_to = self.rng.below(rows as u64 + 1) as usize;
        for width in [columns, decode_row::BLOCK_TABLE + 1] {
            let mut buffer = vec![SENTINEL; rows * width];
            let written = if held {
                self.s.write_last_decode_rows(&mut buffer, width, pad_to)
            } else {
                self.s
                    .write_decode_rows(out.into(), &mut buffer, width, pad_to)
            };
            self.h.debug(&written);
            self.h.words(&buffer);
        }
        let mut buffer = vec![SENTINEL; rows * columns];
        let written = self
            .s
            .write_decode_rows(out.into(), &mut buffer, columns, pad_to);
        self.h.debug(&written);
        self.h.words(&buffer);
    }

    /// Speculative shapes only: drafts for a random subset of the live requests (some
    /// counts past the limit, a refused call), each result hashed.
    fn propose_drafts(&mut self) {
        let most = u64::from(self.s.config().num_speculative_tokens);
        let mut ids = Vec::new();
        let mut counts = Vec::new();
        for id in self.s.queue_ids() {
            if self.rng.chance(70) {
                ids.push(id);
                let over = u64::from(self.rng.chance(1));
                counts.push(self.rng.range(0, most + over) as u32);
            }
        }
        let total: u32 = counts.iter().sum();
        let tokens: Vec<i32> = (0..total).map(|_| self.rng.below(1000) as i32).collect();
        let proposed = self.s.propose_drafts(&ids, &counts, &tokens);
        self.h.str("propose_drafts");
        self.h.debug(&proposed);
    }

    fn update(&mut self) {
        if self.s.config().num_speculative_tokens > 0 {
            self.update_accepted();
            return;
        }
        let samples = self.pending.front().map_or(0, ScheduleOutput::num_samples);
        if self.rng.chance(2) {
            let wrong = self
                .s
                .update(&vec![1; samples + 1], None)
                .map(<[_]>::to_vec);
            self.h.debug(&wrong);
        }
        let tokens: Vec<i32> = (0..samples).map(|_| self.rng.below(1000) as i32).collect();
        let eos: Option<Vec<bool>> = self
            .rng
            .chance(50)
            .then(|| (0..samples).map(|_| self.rng.chance(6)).collect());
        let updated = self.s.update(&tokens, eos.as_deref()).map(<[_]>::to_vec);
        self.h.str("update");
        self.h.debug(&updated);
        if updated.is_ok() {
            self.pending.pop_front();
        }
        self.take_some_outputs(70);
    }

    /// [`Self::update`] of a speculative shape: random accepted counts (now and then one too
    /// many: a refused call, hashed), random tokens and end-of-sequence flags per row.
    fn update_accepted(&mut self) {
        let (samples, counts) = self.pending.front().map_or((0, Vec::new()), |out| {
            (out.num_samples(), out.generation_draft_counts.clone())
        });
        let accepted: Vec<u32> = counts
            .iter()
            .map(|&count| self.rng.range(0, count) as u32)
            .collect();
        if self.rng.chance(3) && !accepted.is_empty() {
            let mut wrong = accepted.clone();
            wrong[0] += 1 + counts[0] as u32;
            let tokens = vec![1; samples];
            let refused = self
                .s
                .update_accepted(&tokens, None, Some(&wrong))
                .map(<[_]>::to_vec);
            self.h.debug(&refused);
        }
        let tokens: Vec<i32> = (0..samples).map(|_| self.rng.below(1000) as i32).collect();
        let eos: Option<Vec<bool>> = self
            .rng
            .chance(50)
            .then(|| (0..samples).map(|_| self.rng.chance(6)).collect());
        let updated = self
            .s
            .update_accepted(&tokens, eos.as_deref(), Some(&accepted))
            .map(<[_]>::to_vec);
        self.h.str("update");
        self.h.debug(&updated);
        self.h.debug(&self.s.spec_decode_accepted_per_position());
        if updated.is_ok() {
            self.pending.pop_front();
        }
        self.take_some_outputs(70);
    }

    fn revert(&mut self) {
        let reverted = self.s.revert().map(<[_]>::to_vec);
        self.h.str("revert");
        self.h.debug(&reverted);
        if reverted.is_ok() {
            self.pending.pop_back();
        }
    }

    /// Everything observable of the scheduler now.
    fn observe(&mut self) {
        let s = &self.s;
        let h = &mut self.h;
        h.u64(s.state_digest());
        h.u64(s.ledger().state_digest());
        h.debug(&s.metrics());
        h.u64(u64::from(s.pending_steps()));
        h.u64(u64::from(s.is_step_pending()));
        h.u64(s.num_live() as u64);
        h.u64(s.num_waiting() as u64);
        h.u64(s.num_running() as u64);
        h.u64(s.num_suspended() as u64);
        h.u64(u64::from(s.host_used_superblocks()));
        h.u64(u64::from(s.has_unfinished()));
        h.debug(&s.untaken_outputs());
        let ids = s.queue_ids();
        h.debug(&ids);
        let rank = s.config().cp_rank;
        let ledger = s.ledger();
        h.u64(u64::from(ledger.free_superblocks()));
        h.u64(u64::from(ledger.used_superblocks()));
        h.debug(&ledger.holdings());
        for &id in &ids {
            h.debug(&s.request_state(id));
            h.debug(&s.batch_slot(id));
            match s.tokens(id) {
                Ok(tokens) => h.words(&tokens),
                Err(err) => h.str(&err.to_string()),
            }
            h.debug(&s.request_metrics(id));
            h.debug(&s.host_pages(id));
            h.debug(&s.is_abort_requested(id));
            match ledger.request(id) {
                Ok(kv) => {
                    h.u64(kv.len());
                    h.u64(kv.prompt_len());
                    h.u64(kv.decode_count());
                    h.u64(kv.next_decode_position());
                    h.u64(u64::from(kv.is_suspended()));
                    h.debug(&kv.suspended_len());
                    h.debug(kv.table());
                }
                Err(err) => h.str(&err.to_string()),
            }
            h.debug(&ledger.view(id, rank));
        }
        h.debug(&s.block_table(&ids, None));
        let out = s.last_output();
        h.debug(out);
        let entries: Vec<RequestId> = out
            .generation_ids
            .iter()
            .chain(&out.context_ids)
            .copied()
            .collect();
        let starts: Vec<u64> = out
            .generation_positions
            .iter()
            .chain(&out.context_starts)
            .copied()
            .collect();
        let counts: Vec<u64> = std::iter::repeat_n(1, out.generation_ids.len())
            .chain(out.context_lens.iter().copied())
            .collect();
        h.debug(&s.slot_mapping(&entries, &starts, &counts));
        // The oldest pending step's copy: refused by the writers unless it is the newest.
        if let Some(oldest) = self.pending.front() {
            let mut buffer = vec![SENTINEL; self.layout.total_words()];
            let written = s.write_step_metadata(oldest.into(), &self.layout, &mut buffer);
            h.debug(&written);
            h.words(&buffer);
        }
    }
}

/// The output's stored fields, digest and computed columns.
fn hash_output(h: &mut Fnv, out: &ScheduleOutput) {
    h.debug(out);
    h.u64(out.digest);
    h.u64(out.num_samples() as u64);
    h.debug(&out.sample_ids().collect::<Vec<_>>());
    h.debug(&out.generation_owner_ranks().collect::<Vec<_>>());
    h.debug(&out.generation_active().collect::<Vec<_>>());
    h.debug(&out.generation_local_lens().collect::<Vec<_>>());
    h.debug(&out.generation_past_seen_lens().collect::<Vec<_>>());
    h.debug(&out.check_lengths());
}

fn run_scheduler(shape: &Shape, drive: Drive, seed: u64) -> u64 {
    let s = Scheduler::new(shape.config.clone()).expect("the shape's configuration is valid");
    let layout = s.step_metadata_layout(None).expect("a metadata layout");
    let narrow = s.step_metadata_layout(Some(1)).expect("a metadata layout");
    let mut run = Run {
        s,
        rng: Rng::new(seed),
        h: Fnv::new(),
        next_id: 0,
        reusable: Vec::new(),
        pending: VecDeque::new(),
        spare: None,
        layout,
        narrow,
        max_prompt: shape.max_prompt,
        max_new: shape.max_new,
        shared_prefix: shape.shared_prefix,
    };
    let arrivals_end = shape.iterations * 7 / 10;
    for iteration in 0..shape.iterations {
        if iteration < arrivals_end && run.rng.chance(shape.arrival) {
            run.add_requests();
        }
        if run.rng.chance(6) {
            run.abort_some();
        }
        if run.rng.chance(5) {
            run.take_some_outputs(50);
        }
        let pending = run.s.pending_steps();
        match (drive, pending) {
            (_, 0) => {
                if run.rng.chance(2) {
                    let refused = run.s.update(&[], None).map(<[_]>::to_vec);
                    run.h.debug(&refused);
                    let refused = run.s.revert().map(<[_]>::to_vec);
                    run.h.debug(&refused);
                }
                run.schedule();
            }
            (Drive::Plain, _) => {
                if run.rng.chance(15) {
                    run.revert();
                } else {
                    run.update();
                }
            }
            (Drive::Ahead, 1) => {
                let roll = run.rng.below(100);
                if roll < 60 {
                    run.schedule();
                } else if roll < 90 {
                    run.update();
                } else {
                    run.revert();
                }
            }
            (Drive::Ahead, _) => {
                let roll = run.rng.below(100);
                if roll < 3 {
                    let refused = run.s.schedule().map(|out| out.step);
                    run.h.debug(&refused);
                }
                if roll < 10 {
                    run.revert();
                } else if roll < 16 {
                    run.revert();
                    run.observe();
                    run.revert();
                } else {
                    run.update();
                }
            }
        }
        run.observe();
    }
    // Close what is pending, then finish everything that is left.
    while run.s.pending_steps() > 0 {
        run.update();
        run.observe();
    }
    run.take_some_outputs(100);
    run.observe();
    if std::env::var_os("FINGERPRINT_STATS").is_some() {
        eprintln!("{} {:?}: {:?}", shape.name, seed, run.s.metrics());
    }
    run.h.finish()
}

/// A bare ledger driven by random calls, each result and the state after it hashed.
fn run_ledger(cp: u32, tokens_per_block: u32, capacity: u32, seed: u64) -> u64 {
    let layout = Layout::new(cp, tokens_per_block).expect("a valid layout");
    let mut ledger = Ledger::new(layout, capacity).expect("a valid ledger");
    let mut rng = Rng::new(seed);
    let mut h = Fnv::new();
    let mut step = 0u64;
    let ids = 12u64;
    for _ in 0..3000 {
        let id = rng.below(ids);
        let len = rng.range(0, u64::from(capacity) * layout.tokens_per_superblock() / 3);
        let op = rng.below(16);
        h.u64(op);
        match op {
            0 => h.debug(&ledger.add(id, rng.range(1, 40))),
            1 => {
                let batch: Vec<u64> = (0..rng.range(1, 3)).map(|_| rng.below(ids)).collect();
                let lens: Vec<u64> = batch.iter().map(|_| rng.range(1, 30)).collect();
                h.debug(&ledger.add_many(&batch, &lens));
            }
            2 => h.debug(&ledger.grow(id, len)),
            3 => h.debug(&ledger.shrink(id, len)),
            4 => h.debug(&ledger.free(id)),
            5 => {
                let batch: Vec<u64> = (0..rng.range(1, 4)).map(|_| rng.below(ids)).collect();
                let lens: Vec<u64> = batch.iter().map(|_| rng.range(0, 60)).collect();
                let mut grown = Vec::new();
                h.debug(&ledger.grow_many(&batch, &lens, &mut grown));
                h.debug(&grown);
            }
            6 => {
                let batch: Vec<u64> = (0..rng.range(1, 3)).map(|_| rng.below(ids)).collect();
                h.debug(&ledger.free_many(&batch));
            }
            7..=9 => {
                if rng.chance(60) {
                    step += 1;
                }
                h.debug(&ledger.allocate_decode(id, step));
            }
            10 | 11 => h.debug(&ledger.revert_decode(id, step.saturating_sub(rng.below(2)))),
            12 => h.debug(&ledger.reset_for_recompute(id, rng.below(3))),
            13 => h.debug(&ledger.suspend(id)),
            14 => h.debug(&ledger.resume(id)),
            _ => {
                h.debug(&ledger.view(id, rng.below(u64::from(cp)) as u32));
                h.debug(&ledger.can_allocate(len));
            }
        }
        h.u64(ledger.state_digest());
        h.u64(u64::from(ledger.free_superblocks()));
        h.debug(&ledger.holdings());
        let live: Vec<u64> = (0..ids).filter(|&i| ledger.contains(i)).collect();
        for &id in &live {
            if let Ok(kv) = ledger.request(id) {
                h.u64(kv.len());
                h.u64(kv.decode_count());
                h.debug(&kv.suspended_len());
                h.debug(kv.table());
            }
        }
        if let Ok(width) = ledger.max_table_len(&live) {
            let mut table = vec![0; live.len() * width];
            h.debug(&ledger.block_table_into(&live, width, &mut table));
            h.words(&table);
        }
        let starts: Vec<u64> = live.iter().map(|_| rng.below(8)).collect();
        let counts: Vec<u64> = live.iter().map(|_| rng.range(0, 3)).collect();
        let mut slots = Vec::new();
        let mapped = ledger.slot_mapping_into(
            &live,
            &starts,
            &counts,
            rng.below(u64::from(cp)) as u32,
            &mut slots,
        );
        h.debug(&mapped);
        h.debug(&slots);
    }
    h.finish()
}

/// Every workload's name and hash, in a fixed order.
fn fingerprints() -> Vec<(String, u64)> {
    let mut lines = Vec::new();
    for (cp, tpb, capacity) in [(1, 4, 24), (2, 2, 16), (4, 1, 40), (4, 8, 6)] {
        for seed in 1..=2 {
            lines.push((
                format!("ledger-cp{cp}-tpb{tpb}-cap{capacity}-seed{seed}"),
                run_ledger(cp, tpb, capacity, seed),
            ));
        }
    }
    for shape in shapes() {
        for (drive, label) in [(Drive::Plain, "plain"), (Drive::Ahead, "ahead")] {
            for seed in 1..=2 {
                lines.push((
                    format!("{}-{label}-seed{seed}", shape.name),
                    run_scheduler(&shape, drive, seed * 1_000_003),
                ));
            }
        }
    }
    lines
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = match args.as_slice() {
        [] => None,
        [flag, file] if flag == "--check" => Some(file.clone()),
        _ => {
            eprintln!("usage: decision_fingerprint [--check FILE]");
            return ExitCode::from(2);
        }
    };
    let lines = fingerprints();
    let mut total = Fnv::new();
    let mut printed = Vec::new();
    for (name, hash) in &lines {
        total.str(name);
        total.u64(*hash);
        total.flush();
        printed.push(format!("{name} {hash:016x}"));
    }
    printed.push(format!("total {:016x}", total.finish()));
    for line in &printed {
        println!("{line}");
    }
    let Some(file) = check else {
        return ExitCode::SUCCESS;
    };
    let expected = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(err) => {
            eprintln!("cannot read {file}: {err}");
            return ExitCode::from(2);
        }
    };
    let expected: Vec<&str> = expected.lines().filter(|l| !l.trim().is_empty()).collect();
    for (i, line) in printed.iter().enumerate() {
        if expected.get(i) != Some(&line.as_str()) {
            let name = line.split(' ').next().unwrap_or_default();
            eprintln!(
                "fingerprint differs at workload {name}: got `{line}`, expected `{}`",
                expected.get(i).unwrap_or(&"<nothing>")
            );
            return ExitCode::from(1);
        }
    }
    if expected.len() != printed.len() {
        eprintln!(
            "fingerprint differs: {} lines expected, {} printed",
            expected.len(),
            printed.len()
        );
        return ExitCode::from(1);
    }
    eprintln!("fingerprint matches {file}");
    ExitCode::SUCCESS
}
