//! Cost of one scheduler step (`schedule()` + `update()`) per running decode request,
//! without and with steady KV pressure. Run with
//! `cargo run --release -p helix-kv-core --example scheduler_step [N ...]` (env `ONLY=free`
//! or `ONLY=pressure`, `WORK=` request-steps per run; `PRIORITY_LEVELS=K` runs priority
//! admission with request `i` at priority `i * 7 % K`, so under pressure replacements are
//! placed all along the queue).
#![expect(clippy::cast_precision_loss, reason = "timings and rates for printing")]
#![expect(
    clippy::disallowed_methods,
    reason = "a benchmark reads the clock to time itself; nothing it decides depends on it"
)]

use std::time::Instant;

use helix_kv_core::{AdmissionPolicy, Scheduler, SchedulerConfig};

const CP: u32 = 4;
const TOKENS_PER_BLOCK: u32 = 32;
const PROMPT: u32 = 100;

/// `n` requests decoding in a pool of `superblocks`; finished requests are replaced, so
/// `n` stay live. Returns nanoseconds per live request per step, and preemptions.
fn measure(n: u32, superblocks: u32, max_new: u32, steps: u32) -> (f64, u64) {
    let mut config = SchedulerConfig::new(superblocks);
    config.cp_size = CP;
    config.tokens_per_block = TOKENS_PER_BLOCK;
    config.max_batch_size = n;
    config.max_num_tokens = n + 4096;
    config.max_preemptions_per_request = 1_000_000;
    let levels: u64 = std::env::var("PRIORITY_LEVELS").map_or(0, |k| k.parse().expect("K"));
    if levels > 0 {
        config.admission_policy = AdmissionPolicy::Priority;
    }
    let priority = |id: u64| i32::try_from((id * 7) % levels.max(1)).expect("a small level");
    let mut scheduler = Scheduler::new(config).unwrap();
    let prompt: Vec<i32> = (0..i32::try_from(PROMPT).unwrap()).collect();
    let mut next_id = 0u64;
    for _ in 0..n {
        scheduler
            .add_request(next_id, &prompt, max_new, priority(next_id))
            .unwrap();
        next_id += 1;
    }
    let mut tokens = Vec::new();
    let mut run = |scheduler: &mut Scheduler, steps: u32| {
        for _ in 0..steps {
            let samples = scheduler.schedule().unwrap().num_samples();
            tokens.clear();
            tokens.resize(samples, 7);
            let finished = scheduler.update(&tokens, None).unwrap().to_vec();
            for id in finished {
                scheduler.take_output(id).unwrap();
                scheduler
                    .add_request(next_id, &prompt, max_new, priority(next_id))
                    .unwrap();
                next_id += 1;
            }
        }
    };
    run(&mut scheduler, 200); // warm up: everyone prefilled and decoding
    let preempted_before = scheduler.metrics().preemptions;
    // The best of several windows: a shared machine adds noise, never removes it.
    let windows = 10;
    let mut best = f64::INFINITY;
    for _ in 0..windows {
        let start = Instant::now();
        run(&mut scheduler, steps / windows);
        best = best.min(start.elapsed().as_nanos() as f64 / f64::from(steps / windows));
    }
    let preemptions = scheduler.metrics().preemptions - preempted_before;
    (best / f64::from(n), preemptions)
}

fn main() {
    // Optional arguments: the N values to run (default 256 1024 4096).
    let sizes: Vec<u32> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("N"))
        .collect();
    let sizes = if sizes.is_empty() {
        vec![256, 1024, 4096]
    } else {
        sizes
    };
    for n in sizes {
        let work: u32 = std::env::var("WORK").map_or(2_000_000, |w| w.parse().expect("WORK"));
        let steps = work / n;
        // Nobody finishes: pure decode.
        let max_new = steps + 400;
        let per_request = (PROMPT + max_new).div_ceil(CP * TOKENS_PER_BLOCK);
        let only = std::env::var("ONLY").unwrap_or_default();
        let (free, _) = if only == "pressure" {
            (0.0, 0)
        } else {
            measure(n, n * per_request, max_new, steps)
        };
        // About two thirds of what the live set needs: steady preemption.
        let (pressed, preemptions) = if only == "free" {
            (0.0, 0)
        } else {
            measure(n, n * 2, 300, steps)
        };
        println!(
            "N={n:5}  no pressure: {free:6.1} ns/request/step   steady pressure: {pressed:6.1} ns/request/step \
             ({:.2} preemptions/step)",
            preemptions as f64 / f64::from(steps)
        );
    }
}
