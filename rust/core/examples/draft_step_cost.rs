//! Where a speculative step's host time goes: `propose_drafts`, `schedule` and
//! `update_accepted` timed apart at N decoding requests, cp = 4, k drafts each with
//! `accepted` of them accepted, against the same loop without drafts. Run with
//! `cargo run --release -p helix-kv-core --example draft_step_cost [-- N K ACCEPTED]`; it
//! prints the median of each call over 300 steps, in microseconds.
#![expect(
    clippy::disallowed_methods,
    reason = "a timing tool: the clock times the calls and reaches no decision"
)]

use std::time::Instant;

use helix_kv_core::{Scheduler, SchedulerConfig};

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn run(n: usize, k: u32, accepted: u32) -> [f64; 3] {
    let (cp, tpb, prompt, max_new) = (4, 32, 100u64, 4000u32);
    let per_request = (prompt + u64::from(max_new) + u64::from(k)).div_ceil(cp * tpb);
    let mut config = SchedulerConfig::new(u32::try_from(n as u64 * per_request).expect("fits"));
    config.cp_size = u32::try_from(cp).expect("fits");
    config.tokens_per_block = u32::try_from(tpb).expect("fits");
    config.max_batch_size = u32::try_from(n).expect("fits");
    config.max_num_tokens = u32::try_from(n).expect("fits") * (1 + k) + 4096;
    config.num_speculative_tokens = k;
    let mut s = Scheduler::new(config).expect("a valid configuration");
    let prompt: Vec<i32> = (0..100).collect();
    for id in 0..n as u64 {
        s.add_request(id, &prompt, max_new, 0).expect("fits");
    }
    let ids: Vec<u64> = (0..n as u64).collect();
    let counts = vec![k; n];
    let draft_tokens = vec![7; n * k as usize];
    let tokens = vec![7; n * (1 + k as usize) + 4096];
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for step in 0..340 {
        let t0 = Instant::now();
        if k > 0 && step > 0 {
            s.propose_drafts(&ids, &counts, &draft_tokens)
                .expect("valid drafts");
        }
        let t1 = Instant::now();
        let out = s.schedule().expect("schedules");
        let samples = out.num_samples();
        let accept: Vec<u32> = out
            .generation_draft_counts
            .iter()
            .map(|&c| u32::try_from(c).expect("small").min(accepted))
            .collect();
        let t2 = Instant::now();
        s.update_accepted(&tokens[..samples], None, Some(&accept))
            .expect("updates");
        let t3 = Instant::now();
        if step >= 40 {
            times[0].push((t1 - t0).as_secs_f64() * 1e6);
            times[1].push((t2 - t1).as_secs_f64() * 1e6);
            times[2].push((t3 - t2).as_secs_f64() * 1e6);
        }
    }
    times.map(median)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: N K ACCEPTED"))
        .collect();
    let (n, k, accepted) = match args.as_slice() {
        [n, k, a] => (*n, *k, *a),
        _ => (1024, 4, 2),
    };
    let k = u32::try_from(k).expect("a small k");
    let accepted = u32::try_from(accepted).expect("a small count");
    for (label, k) in [("k = 0", 0), ("drafts", k)] {
        let [propose, schedule, update] = run(n, k, accepted);
        println!(
            "{label:>6} (k={k}, accepted={accepted}, N={n}): propose {propose:.1} us, schedule {schedule:.1} us, update {update:.1} us, total {:.1} us",
            propose + schedule + update
        );
    }
}
