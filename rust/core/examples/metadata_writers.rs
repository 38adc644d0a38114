//! Cost of the step-metadata writers apart from scheduling: `write_last_step_metadata` and
//! `write_last_decode_rows` after each decode step of N requests at cp = 4 (tpb = 32), plain
//! and with `K` drafts per request (the drafted forms of both writers). Run with
//! `cargo run --release -p helix-kv-core --example metadata_writers [-- N ...]` (env
//! `STEPS=` steps per size, default 300; `K=` drafts, default 3); it prints the median of
//! each call in microseconds, and a checksum of what was written (equal before and after a
//! refactor of the writers).
#![expect(
    clippy::disallowed_methods,
    reason = "a timing tool: the clock times the calls and reaches no decision"
)]

use std::time::Instant;

use helix_kv_core::{Scheduler, SchedulerConfig};

const CP: u32 = 4;
const TPB: u32 = 32;
const PROMPT: usize = 100;
/// Block-table columns of the layout and of the decode rows.
const WIDTH: u32 = 16;

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples.get(samples.len() / 2).copied().unwrap_or(0.0)
}

fn fold(sum: u64, words: &[i32]) -> u64 {
    words.iter().fold(sum, |h, &w| {
        (h ^ u64::from(u32::from_ne_bytes(w.to_ne_bytes()))).wrapping_mul(0x100_0000_01b3)
    })
}

/// Medians (metadata, rows) in microseconds, and the checksum of every buffer written.
fn run(n: usize, k: u32, steps: usize) -> ([f64; 2], u64) {
    let max_new = u32::try_from(steps).expect("fits") * (1 + k) + 50;
    let mut config = SchedulerConfig::new(u32::try_from(n).expect("fits") * WIDTH);
    config.cp_size = CP;
    config.tokens_per_block = TPB;
    config.max_batch_size = u32::try_from(n).expect("fits");
    config.max_num_tokens = u32::try_from(n * PROMPT).expect("fits");
    config.max_seq_len = u64::from(WIDTH * CP * TPB);
    config.num_speculative_tokens = k;
    let mut s = Scheduler::new(config).expect("a valid configuration");
    let prompt: Vec<i32> = (0..i32::try_from(PROMPT).expect("fits")).collect();
    for id in 0..n as u64 {
        s.add_request(id, &prompt, max_new, 0).expect("fits");
    }
    let layout = s.step_metadata_layout(Some(WIDTH)).expect("a layout");
    let mut buffer = vec![0i32; layout.total_words()];
    let width = 6 + WIDTH as usize;
    let mut rows = vec![0i32; n * (1 + k as usize) * width];
    let ids: Vec<u64> = (0..n as u64).collect();
    let counts = vec![k; n];
    let draft_tokens = vec![7; n * k as usize];
    let tokens = vec![7; n * PROMPT];
    let (mut meta, mut row_times, mut sum) = (Vec::new(), Vec::new(), 0u64);
    for step in 0..steps + 20 {
        if k > 0 && step > 1 {
            s.propose_drafts(&ids, &counts, &draft_tokens)
                .expect("valid drafts");
        }
        let accept: Vec<u32> = s
            .schedule()
            .expect("schedules")
            .generation_draft_counts
            .iter()
            .map(|&c| u32::from(c > 0))
            .collect();
        let t0 = Instant::now();
        let written = s
            .write_last_step_metadata(&layout, &mut buffer)
            .expect("writes");
        let t1 = Instant::now();
        let decode_only = written.num_entries == written.num_generation;
        if decode_only {
            s.write_last_decode_rows(&mut rows, width, 0)
                .expect("writes rows");
        }
        let t2 = Instant::now();
        sum = fold(fold(sum, &buffer), &rows);
        if step >= 20 && decode_only {
            meta.push((t1 - t0).as_secs_f64() * 1e6);
            row_times.push((t2 - t1).as_secs_f64() * 1e6);
        }
        let samples = written.num_samples;
        let accepted = (k > 0).then_some(&accept[..]);
        s.update_accepted(&tokens[..samples], None, accepted)
            .expect("updates");
    }
    ([median(meta), median(row_times)], sum)
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a request count"))
        .collect();
    let sizes = if sizes.is_empty() {
        vec![64, 1024, 4096]
    } else {
        sizes
    };
    let steps = std::env::var("STEPS").map_or(300, |s| s.parse().expect("STEPS"));
    let k = std::env::var("K").map_or(3, |s| s.parse().expect("K"));
    for n in sizes {
        let ([plain_meta, plain_rows], plain_sum) = run(n, 0, steps);
        let ([draft_meta, draft_rows], draft_sum) = run(n, k, steps);
        println!(
            "N={n:5} plain: metadata {plain_meta:8.2} us, rows {plain_rows:8.2} us | \
             {k} drafts: metadata {draft_meta:8.2} us, rows {draft_rows:8.2} us | \
             checksum {plain_sum:016x} {draft_sum:016x}"
        );
    }
}
