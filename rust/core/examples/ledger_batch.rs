//! Cost of the batched ledger calls the Python bench times (`grow_many` + `free_many` at
//! batch 1024, cp = 4, tpb = 32), per request, with `add_many` untimed. Run with
//! `cargo run --release -p helix-kv-core --example ledger_batch [superblocks ...]`.
#![expect(clippy::cast_precision_loss, reason = "timings for printing")]
#![expect(
    clippy::disallowed_methods,
    reason = "a benchmark reads the clock to time itself; nothing it decides depends on it"
)]

use std::time::Instant;

use helix_kv_core::{Layout, Ledger};

const BATCH: usize = 1024;

fn main() {
    let sizes: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("superblocks"))
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1, 4, 16]
    } else {
        sizes
    };
    for each in sizes {
        let layout = Layout::new(4, 32).unwrap();
        let mut ledger = Ledger::new(layout, u32::try_from(BATCH as u64 * each).unwrap()).unwrap();
        let ids: Vec<u64> = (0..BATCH as u64).collect();
        // A prompt holds at least one token.
        let prompts = vec![1; BATCH];
        let lens = vec![each * layout.tokens_per_superblock(); BATCH];
        let mut ok = Vec::new();
        let (mut add, mut grow, mut free) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
        // The best of many rounds: a shared machine adds noise, never removes it.
        for _ in 0..2000 {
            let t0 = Instant::now();
            ledger.add_many(&ids, &prompts).unwrap();
            let t1 = Instant::now();
            ledger.grow_many(&ids, &lens, &mut ok).unwrap();
            let t2 = Instant::now();
            ledger.free_many(&ids).unwrap();
            let t3 = Instant::now();
            assert!(ok.iter().all(|&o| o));
            add = add.min((t1 - t0).as_nanos() as f64);
            grow = grow.min((t2 - t1).as_nanos() as f64);
            free = free.min((t3 - t2).as_nanos() as f64);
        }
        let per = |ns: f64| ns / BATCH as f64;
        println!(
            "{each:2} superblocks each: add {:5.1}  grow {:5.1}  free {:5.1} ns/request  (grow+free {:5.1} ns/superblock)",
            per(add),
            per(grow),
            per(free),
            per(grow + free) / each as f64
        );
    }
}
