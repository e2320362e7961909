//! The random-fault soak, written once over [`StoreServer`]: the same faults against a
//! Redis cluster and a NATS cluster, under the cluster oracle.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tokio::time::sleep;

use crate::cluster::{Cluster, Spec};

/// Random kills, pauses, partitions, half-open links, store stalls and restarts, and
/// relay drops for `FK_TEST_SOAK_SECS` (default 12), then the oracle. The seed is
/// printed; `FK_TEST_SOAK_SEED` replays a run. `nats` picks the NATS lease and cursors.
///
/// # Panics
/// When the oracle finds a fault (a seq missing, a token going back, the cursor going
/// back or not ending at the last seq, two leaders at once).
pub async fn run(name: &str, nats: bool) {
    let secs: u64 = std::env::var("FK_TEST_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    let seed: u64 = std::env::var("FK_TEST_SOAK_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    let rate = if secs <= 60 { 300 } else { 50 };
    let copies = usize::try_from(secs * u64::from(rate) / 1476 + 1).unwrap_or(1);
    let mut rng = seed;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut c = Cluster::start(name, Spec { copies, rate: Some(rate), nats, ..Spec::default() }).await;
    let store = c.store_server().kind();
    eprintln!("soak on {store}: {secs} s, seed {seed}, {rate} frames/s, {copies} copies of the fixture");
    c.start_all();
    c.wait_leader(None).await;
    let until = Instant::now() + Duration::from_secs(secs);
    let mut faults: BTreeMap<&'static str, usize> = BTreeMap::new();
    while Instant::now() < until {
        sleep(Duration::from_millis(500 + next(2000))).await;
        let Some((l, _)) = c.leader().await else { continue };
        let fault = match next(9) {
            0 => {
                c.replicas[l].sigkill();
                sleep(Duration::from_millis(500 + next(1000))).await;
                c.replicas[l].start();
                "sigkill leader"
            }
            1 => {
                c.replicas[l].sigstop();
                sleep(Duration::from_millis(2500)).await;
                c.replicas[l].sigcont();
                "sigstop leader past ttl"
            }
            2 => {
                c.proxies[l].set_cut(true);
                sleep(Duration::from_secs(3)).await;
                c.proxies[l].set_cut(false);
                "cut leader from the store"
            }
            3 => {
                c.store_server().pause();
                sleep(Duration::from_millis(300 + next(2700))).await;
                c.store_server().resume();
                "pause the store"
            }
            4 => {
                c.proxies[l].set_flow(crate::Flow::Blackhole);
                sleep(Duration::from_secs(3)).await;
                c.proxies[l].set_flow(crate::Flow::Pass);
                "half-open leader link"
            }
            5 => {
                c.relay.handle().close_all();
                "relay drops connections"
            }
            6 => {
                let _ = c.replicas[l].sigterm().await;
                c.replicas[l].start();
                "sigterm leader"
            }
            // Redis comes back empty (no persistence), NATS with its store.
            7 if nats => {
                c.store_server().restart();
                "restart the store"
            }
            _ => {
                c.proxies[l].set_latency(Duration::from_millis(400));
                sleep(Duration::from_secs(2)).await;
                c.proxies[l].set_latency(Duration::ZERO);
                "latency above the op timeout"
            }
        };
        *faults.entry(fault).or_default() += 1;
    }
    c.relay.handle().publish_up_to(usize::MAX);
    c.wait_complete().await;
    let dups = c.check();
    eprintln!("soak on {store}: seed {seed}: faults {faults:?}; {dups} seqs replayed of {}", c.total);
}
