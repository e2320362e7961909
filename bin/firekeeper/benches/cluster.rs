//! `make bench` (second half): figures measured through the real binary.
//!
//! - the raw WebSocket ceiling (a client that only reads frames) and, in the same run,
//!   end-to-end frames/s from relay-sim through firekeeper with the null and jsonl sinks
//!   (and a baseline binary given in `FIREKEEPER_BENCH_BASELINE`), with the ratio;
//! - the signed capture through the binary with `FIREKEEPER_VERIFY` off, `signatures`
//!   and `full` (keys served by the test PLC, cached after the first commit of each DID);
//! - peak RSS of a leader feeding a slow webhook sink (backpressure must bound memory);
//! - crash failover time (SIGKILL the leader → another replica leads), ≥ 10 runs;
//! - graceful handover gap (old leader's release → new leader's election, from their
//!   logs), ≥ 10 runs.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use relay_sim::{RelaySim, SimConfig, capture};

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

/// Copies of the fixture in the throughput runs (103,320 frames).
const COPIES: usize = 70;

/// Copies of the signed capture in the verification runs (100,695 frames).
const SIGNED_COPIES: usize = 105;

/// Runs of each throughput figure (the VM is noisy; medians are reported).
const RUNS: usize = 3;

/// The ceiling: a client that only reads frames off the socket (no decode, no lease, no
/// sink) from the same relay-sim with the same frames, first frame to last.
async fn raw_ceiling() -> (u64, f64) {
    use futures_util::StreamExt as _;
    let frames = capture::repeat(&testkit::fixture_frames(), COPIES);
    let total = frames.iter().filter(|f| relay_sim::frame_seq(f).is_some()).count() as u64;
    let sim = RelaySim::start_with(frames, SimConfig::default(), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("relay-sim");
    let url = format!("{}{}?cursor=0", sim.url(), relay_client::relay_url::SUBSCRIBE_PATH);
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await.expect("connect");
    let (mut n, mut t0) = (0u64, None);
    while n < total {
        match ws.next().await {
            Some(Ok(tokio_tungstenite::tungstenite::Message::Binary(_))) => {
                n += 1;
                t0.get_or_insert_with(Instant::now);
            }
            Some(Ok(_)) => {}
            other => panic!("the raw reader lost the stream after {n} frames: {other:?}"),
        }
    }
    let secs = t0.expect("a frame").elapsed().as_secs_f64();
    (total, (total - 1) as f64 / secs)
}

/// Steady-state frames/s through the binary: from the first commit to the last, so the
/// figure is the pipeline's and not Redis's or the election's start-up.
async fn throughput(bin: Option<PathBuf>, sink: &'static str) -> (u64, f64) {
    throughput_with(bin, sink, Vec::new()).await
}

/// [`throughput`] with more environment.
async fn throughput_with(bin: Option<PathBuf>, sink: &'static str, env: Vec<(&'static str, String)>) -> (u64, f64) {
    throughput_of(Spec { replicas: 1, copies: COPIES, rate: None, sink, bin, extra_env: env, ..Spec::default() }).await
}

/// Steady-state frames/s of one replica of `spec`.
async fn throughput_of(spec: Spec) -> (u64, f64) {
    let mut c = Cluster::start("bench-tput", spec).await;
    c.start_all();
    let (l, _) = c.wait_leader(None).await;
    let total = c.total;
    let deadline = Instant::now() + WAIT;
    let (c0, t0) = loop {
        if let Some(s) = c.replicas[l].status().await
            && let Some(c0) = s["committed"].as_u64().filter(|&c| c > 0)
        {
            break (c0, Instant::now());
        }
        assert!(Instant::now() < deadline, "never committed; logs in {}", c.dir.display());
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    assert!(c0 < total / 2, "the first commit came too late to measure ({c0} of {total}): raise COPIES");
    wait_committed(&c, l, total).await;
    let secs = t0.elapsed().as_secs_f64();
    (total, (total - c0) as f64 / secs)
}

fn median(xs: &mut [f64]) -> f64 {
    stats(xs).0
}

fn runs(xs: &[f64]) -> String {
    xs.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(" · ")
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
        // Alternated, so drift in the VM's speed hits every figure alike.
        let baseline = std::env::var_os("FIREKEEPER_BENCH_BASELINE").map(PathBuf::from);
        let (mut raw, mut null, mut jsonl, mut base) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut unchained, mut jetstream) = (Vec::new(), Vec::new());
        let (mut unverified, mut signatures, mut full) = (Vec::new(), Vec::new(), Vec::new());
        let plc = testkit::plc::Plc::signed_fixture().await;
        let mut signed_n = 0;
        let mut n = 0;
        // FK_BENCH_ONLY=verify measures the verification figures alone.
        let only_verify = std::env::var("FK_BENCH_ONLY").is_ok_and(|v| v == "verify");
        for _ in 0..RUNS {
            for (mode, into) in [("off", &mut unverified), ("signatures", &mut signatures), ("full", &mut full)] {
                let env = vec![("FIREKEEPER_VERIFY", mode.to_owned()), ("FIREKEEPER_PLC_URL", plc.url())];
                let spec = Spec {
                    replicas: 1,
                    copies: SIGNED_COPIES,
                    rate: None,
                    sink: "null",
                    extra_env: env,
                    signed: true,
                    ..Spec::default()
                };
                let (total, fps) = throughput_of(spec).await;
                signed_n = total;
                into.push(fps);
            }
            if only_verify {
                continue;
            }
            raw.push(raw_ceiling().await.1);
            let (total, fps) = throughput(None, "null").await;
            n = total;
            null.push(fps);
            jsonl.push(throughput(None, "jsonl").await.1);
            unchained.push(throughput_with(None, "null", vec![("FIREKEEPER_CHAIN_BREAKS", "off".into())]).await.1);
            let js = Spec { replicas: 1, copies: COPIES, rate: None, sink: "nats", nats: true, ..Spec::default() };
            jetstream.push(throughput_of(js).await.1);
            if let Some(b) = &baseline {
                base.push(throughput(Some(b.clone()), "null").await.1);
            }
        }
        let (u, fu) = (median(&mut unverified.clone()), median(&mut full.clone()));
        println!(
            "signed capture, {signed_n} frames, null sink, FIREKEEPER_VERIFY=off, {RUNS} runs: {} → median {u:.0} frames/s",
            runs(&unverified)
        );
        println!(
            "signed capture, FIREKEEPER_VERIFY=signatures, {RUNS} runs: {} → median {:.0} frames/s",
            runs(&signatures),
            median(&mut signatures.clone())
        );
        println!("signed capture, FIREKEEPER_VERIFY=full, {RUNS} runs: {} → median {fu:.0} frames/s", runs(&full));
        println!("ratio verified (full) / unverified: {:.2}", fu / u);
        if only_verify {
            return;
        }
        let (r, f) = (median(&mut raw.clone()), median(&mut null.clone()));
        println!("raw WebSocket ceiling (read frames only), {n} frames, {RUNS} runs: {} → median {r:.0} frames/s", runs(&raw));
        println!(
            "end-to-end relay-sim → firekeeper (redis lease, null sink), {RUNS} runs: {} → median {f:.0} frames/s",
            runs(&null)
        );
        println!("ratio end-to-end / raw ceiling: {:.2}", f / r);
        println!(
            "end-to-end without the chain check (FIREKEEPER_CHAIN_BREAKS=off, null sink), {RUNS} runs: {} → median {:.0} frames/s",
            runs(&unchained),
            median(&mut unchained.clone())
        );
        println!(
            "end-to-end with the jsonl sink (JSON rendered in the lanes, written to a file), {RUNS} runs: {} → median {:.0} frames/s",
            runs(&jsonl),
            median(&mut jsonl.clone())
        );
        println!(
            "end-to-end into JetStream (NATS lease + NATS cursor + JetStream sink, every publish acknowledged), {RUNS} runs: {} → median {:.0} frames/s",
            runs(&jetstream),
            median(&mut jetstream.clone())
        );
        if let Some(b) = &baseline {
            println!(
                "baseline {} (null sink), {RUNS} runs: {} → median {:.0} frames/s",
                b.display(),
                runs(&base),
                median(&mut base.clone())
            );
        }
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
