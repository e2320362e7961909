//! `make bench` (second half): figures measured through the real binary.
//!
//! - end-to-end frames/s from relay-sim through firekeeper with the null sink;
//! - peak RSS of a leader feeding a slow webhook sink (backpressure must bound memory);
//! - crash failover time (SIGKILL the leader → another replica leads), ≥ 10 runs;
//! - graceful handover gap (old leader's release → new leader's election, from their
//!   logs), ≥ 10 runs.

use std::time::{Duration, Instant};

use testkit::WAIT;
use testkit::cluster::{Cluster, Spec, log_time, parse_ts};

fn stats(xs: &mut [f64]) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[xs.len() / 2], xs[xs.len() - 1])
}

async fn wait_committed(c: &Cluster, i: usize, total: u64) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(s) = c.replicas[i].status().await
            && s["committed"].as_u64() == Some(total)
        {
            return;
        }
        assert!(Instant::now() < deadline, "never committed {total}; logs in {}", c.dir.display());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn throughput() -> (u64, f64) {
    let spec = Spec { replicas: 1, copies: 70, rate: None, sink: "null", ..Spec::default() };
    let mut c = Cluster::start("bench-tput", spec).await;
    c.start_all();
    let (l, _) = c.wait_leader(None).await;
    let t0 = Instant::now();
    let total = c.total;
    wait_committed(&c, l, total).await;
    let secs = t0.elapsed().as_secs_f64();
    #[allow(clippy::cast_precision_loss)]
    (total, total as f64 / secs)
}

async fn slow_sink_rss() -> f64 {
    // A receiver that takes 20 ms per batch of 100: the relay is far faster.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut pending = Vec::new();
                while testkit::http::read_request(&mut s, &mut pending).await.is_some() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
                }
            });
        }
    });
    let spec = Spec {
        replicas: 1,
        copies: 20,
        rate: None,
        sink: "webhook",
        extra_env: vec![("FIREKEEPER_WEBHOOK_URL", url), ("FIREKEEPER_WEBHOOK_BATCH", "100".into())],
        ..Spec::default()
    };
    let mut c = Cluster::start("bench-rss", spec).await;
    c.start_all();
    let (l, _) = c.wait_leader(None).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    #[allow(clippy::cast_precision_loss)]
    let mib = c.replicas[l].peak_rss_kib().unwrap_or(0) as f64 / 1024.0;
    mib
}

async fn failover(runs: usize) -> (Vec<f64>, Vec<f64>) {
    let mut c = Cluster::start("bench-failover", Spec { copies: 40, rate: Some(2000), ..Spec::default() }).await;
    c.start_all();
    let mut crash = Vec::new();
    for _ in 0..runs {
        let (l, _) = c.wait_leader(None).await;
        tokio::time::sleep(Duration::from_millis(300 + (crash.len() as u64 * 37) % 400)).await;
        let t0 = Instant::now();
        c.replicas[l].sigkill();
        c.wait_leader(Some(l)).await;
        crash.push(t0.elapsed().as_secs_f64() * 1000.0);
        c.replicas[l].start();
    }
    let mut gaps = Vec::new();
    for _ in 0..runs {
        let (l, _) = c.wait_leader(None).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let old_logs = c.replicas[l].log_files();
        assert!(c.replicas[l].sigterm().await, "graceful exit");
        let (n, _) = c.wait_leader(Some(l)).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = log_time(&old_logs[old_logs.len() - 1..], "lease released").expect("release logged");
        let newest = c.replicas[n].log_files();
        // The new leader's most recent election in its current log.
        let elected = std::fs::read_to_string(&newest[newest.len() - 1])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["fields"]["message"] == "elected leader")
            .filter_map(|v| v["timestamp"].as_str().map(str::to_owned))
            .next_back()
            .and_then(|t| parse_ts(&t))
            .expect("election logged");
        gaps.push((elected - released) * 1000.0);
        c.replicas[l].start();
    }
    (crash, gaps)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` and test harness probes
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let (n, fps) = throughput().await;
        println!("end-to-end: {n} frames relay-sim → firekeeper (redis lease, null sink): {fps:.0} frames/s");
        let rss = slow_sink_rss().await;
        println!("peak RSS with a slow webhook sink (20 ms per 100 events): {rss:.1} MiB");
        let (mut crash, mut gaps) = failover(10).await;
        let (cm, cx) = stats(&mut crash);
        println!(
            "crash failover (SIGKILL leader, ttl 2000 ms), {} runs: median {cm:.0} ms, max {cx:.0} ms",
            crash.len()
        );
        let (gm, gx) = stats(&mut gaps);
        println!("graceful handover gap (release → election), {} runs: median {gm:.1} ms, max {gx:.1} ms", gaps.len());
    });
}
