//! Cost of `schedule()` and of `update()` apart, per running decode request, plain and one
//! step ahead (two steps pending). Run with
//! `cargo run --release -p helix-kv-core --example scheduler_phases [N ...]`
//! (env `WORK=` request-steps per run, `MAX_NEW=` tokens per request, default: nobody
//! finishes; `PRESSURE=1`: a pool of 2 superblocks per request, steady preemption, e.g.
//! with `MAX_NEW=300`).
#![expect(clippy::cast_precision_loss, reason = "timings for printing")]
#![expect(
    clippy::disallowed_methods,
    reason = "a benchmark reads the clock to time itself; nothing it decides depends on it"
)]

use std::time::{Duration, Instant};

use helix_kv_core::{Scheduler, SchedulerConfig};

const CP: u32 = 4;
const TOKENS_PER_BLOCK: u32 = 32;
const PROMPT: u32 = 100;

struct Loop {
    scheduler: Scheduler,
    prompt: Vec<i32>,
    max_new: u32,
    next_id: u64,
    tokens: Vec<i32>,
    in_flight: Option<usize>,
}

impl Loop {
    fn new(n: u32, superblocks: u32, max_new: u32) -> Self {
        let mut config = SchedulerConfig::new(superblocks);
        config.cp_size = CP;
        config.tokens_per_block = TOKENS_PER_BLOCK;
        config.max_batch_size = n;
        config.max_num_tokens = n + 4096;
        config.max_preemptions_per_request = 1_000_000;
        let mut this = Self {
            scheduler: Scheduler::new(config).unwrap(),
            prompt: (0..i32::try_from(PROMPT).unwrap()).collect(),
            max_new,
            next_id: 0,
            tokens: vec![7; (n + 4096) as usize],
            in_flight: None,
        };
        for _ in 0..n {
            this.add();
        }
        this
    }

    fn add(&mut self) {
        self.scheduler
            .add_request(self.next_id, &self.prompt, self.max_new, 0)
            .unwrap();
        self.next_id += 1;
    }

    /// One step; adds the time spent in `schedule()` and `update()` to `times`.
    fn step(&mut self, ahead: bool, times: &mut [Duration; 2]) {
        let start = Instant::now();
        let samples = self.scheduler.schedule().unwrap().num_samples();
        let scheduled = Instant::now();
        let closing = if ahead {
            self.in_flight.replace(samples)
        } else {
            Some(samples)
        };
        let Some(samples) = closing else {
            times[0] += scheduled - start;
            return;
        };
        let finished = self
            .scheduler
            .update(&self.tokens[..samples], None)
            .unwrap()
            .to_vec();
        let updated = Instant::now();
        times[0] += scheduled - start;
        times[1] += updated - scheduled;
        for id in finished {
            self.scheduler.take_output(id).unwrap();
            self.add();
        }
    }
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
    let work: u32 = std::env::var("WORK").map_or(2_000_000, |w| w.parse().expect("WORK"));
    let pressure = std::env::var("PRESSURE").is_ok();
    for n in sizes {
        for ahead in [false, true] {
            let steps = work / n;
            let max_new =
                std::env::var("MAX_NEW").map_or(steps + 400, |m| m.parse().expect("MAX_NEW"));
            let per_request = (PROMPT + max_new).div_ceil(CP * TOKENS_PER_BLOCK);
            let superblocks = if pressure { n * 2 } else { n * per_request };
            let mut run = Loop::new(n, superblocks, max_new);
            let mut times = [Duration::ZERO; 2];
            for _ in 0..200 {
                run.step(ahead, &mut times);
            }
            // The best of several windows: a shared machine adds noise, never removes it.
            let windows = 10;
            let mut best = [f64::INFINITY; 2];
            for _ in 0..windows {
                let mut times = [Duration::ZERO; 2];
                for _ in 0..steps / windows {
                    run.step(ahead, &mut times);
                }
                for (b, t) in best.iter_mut().zip(times) {
                    *b = b.min(t.as_nanos() as f64 / f64::from(steps / windows) / f64::from(n));
                }
            }
            println!(
                "N={n:5} {:5}  schedule {:6.2} ns/req  update {:6.2} ns/req  total {:6.2}",
                if ahead { "ahead" } else { "plain" },
                best[0],
                best[1],
                best[0] + best[1]
            );
        }
    }
}
