//! `schedule()` and `update()` timed apart, per request, in the Python bench's steady decode
//! loop (`benches/bench_scheduler.py`: cp = 4, tpb = 32, prompt 100, nobody finishes),
//! minimum and median over 600 steps. Run with
//! `cargo run --release -p helix-kv-core --example step_split [N ...]` (default 256 1024
//! 4096); `TAKE=1` moves each output out as the binding does (`take_last_output`).
#![expect(clippy::cast_precision_loss, reason = "timings for printing")]
#![expect(
    clippy::disallowed_methods,
    reason = "a benchmark reads the clock to time itself; nothing it decides depends on it"
)]

use std::time::Instant;

use helix_kv_core::{Scheduler, SchedulerConfig};

const CP: u32 = 4;
const TOKENS_PER_BLOCK: u32 = 32;
const PROMPT: i32 = 100;
const STEPS: u32 = 600;

/// Minimum and median of `values` (sorted in place).
fn min_median(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    (values[0], values[values.len() / 2])
}

fn main() {
    let sizes: Vec<u32> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("N"))
        .collect();
    let sizes = if sizes.is_empty() {
        vec![256, 1024, 4096]
    } else {
        sizes
    };
    let take = std::env::var_os("TAKE").is_some();
    for n in sizes {
        let max_new = STEPS + 400;
        let per_request = (PROMPT.unsigned_abs() + max_new).div_ceil(CP * TOKENS_PER_BLOCK);
        let mut config = SchedulerConfig::new(n * per_request);
        config.cp_size = CP;
        config.tokens_per_block = TOKENS_PER_BLOCK;
        config.max_batch_size = n;
        config.max_num_tokens = n + 4096;
        config.max_preemptions_per_request = 1_000_000;
        let mut scheduler = Scheduler::new(config).unwrap();
        let prompt: Vec<i32> = (0..PROMPT).collect();
        for id in 0..u64::from(n) {
            scheduler.add_request(id, &prompt, max_new, 0).unwrap();
        }
        let tokens = vec![7; n as usize + 4096];
        for _ in 0..300 {
            // Warm up: every request prefilled and decoding.
            let samples = scheduler.schedule().unwrap().sample_ids.len();
            scheduler.update(&tokens[..samples], None).unwrap();
        }
        let (mut schedule, mut update) = (Vec::new(), Vec::new());
        for _ in 0..STEPS {
            let t0 = Instant::now();
            let samples = scheduler.schedule().unwrap().sample_ids.len();
            let taken = take.then(|| scheduler.take_last_output());
            let t1 = Instant::now();
            scheduler.update(&tokens[..samples], None).unwrap();
            let t2 = Instant::now();
            drop(taken);
            schedule.push((t1 - t0).as_nanos() as f64 / f64::from(n));
            update.push((t2 - t1).as_nanos() as f64 / f64::from(n));
        }
        let (schedule_min, schedule_median) = min_median(&mut schedule);
        let (update_min, update_median) = min_median(&mut update);
        println!(
            "N={n:5}  schedule min {schedule_min:6.2} median {schedule_median:6.2} ns/request   \
             update min {update_min:6.2} median {update_median:6.2} ns/request"
        );
    }
}
