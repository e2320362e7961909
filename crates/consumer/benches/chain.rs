//! The chain check's memory at its default capacity and its cost per commit.
//!
//! The growth of the resident set while the check sees 1, 2 and 4 times as many distinct
//! repos as it may remember (the bound must hold however many go through; the DIDs are
//! allocated before the first reading), and the time per `Chains::commit` for repos that continue their chain.

use std::time::Instant;

use consumer::chain::Chains;

/// This process's resident set, in bytes (`VmRSS` of /proc/self/status).
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// The chain check's default capacity.
const CAPACITY: usize = 1_000_000;

/// The TID of `n` (13 base32-sortable characters).
fn tid(n: u64) -> String {
    const A: &[u8; 32] = b"234567abcdefghijklmnopqrstuvwxyz";
    (0..13).rev().map(|i| char::from(A[((n >> (5 * i)) & 31) as usize])).collect()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dids: Vec<String> = (0..4 * CAPACITY).map(|i| format!("did:plc:{i:024}")).collect();
    let revs: Vec<String> = (0..41).map(|i| tid((1 << 59) + i)).collect();
    let base = rss();
    let mut c = Chains::new(CAPACITY);
    for (round, n) in [(1, CAPACITY), (2, 2 * CAPACITY), (4, 4 * CAPACITY)] {
        for d in &dids[..n] {
            c.commit(d, &revs[0], None);
        }
        let held = rss().saturating_sub(base);
        println!(
            "chain check, capacity {CAPACITY} repos, after {round}× that many distinct repos: {} remembered, \
             resident set grew {:.1} MiB ({:.1} bytes per remembered repo)",
            c.len(),
            held as f64 / 1_048_576.0,
            held as f64 / c.len() as f64,
        );
    }
    // Cost per commit: repos that continue their chain (the common case).
    let mut c = Chains::new(CAPACITY);
    let hot = &dids[..100_000];
    for d in hot {
        c.commit(d, &revs[0], None);
    }
    let t0 = Instant::now();
    let mut breaks = 0;
    for r in 1..revs.len() {
        for d in hot {
            breaks += usize::from(c.commit(d, &revs[r], Some(&revs[r - 1])).is_some());
        }
    }
    let n = (revs.len() - 1) * hot.len();
    let ns = t0.elapsed().as_nanos() as f64 / n as f64;
    assert_eq!(breaks, 0, "continuing chains never break");
    println!("chain check per #commit ({n} checks over {} repos): {ns:.0} ns", hot.len());
}
