//! `make bench` (second half): figures measured through the real binary.
//!
//! - the raw WebSocket ceiling (a client that only reads frames) and, alternated with it,
//!   end-to-end frames/s from relay-sim through firekeeper with the null, jsonl and
//!   JetStream sinks (and a baseline binary given in `FIREKEEPER_BENCH_BASELINE` beside
//!   each), with the ratios, CPU µs per frame and peak RSS of each;
//! - a scale run of over 2 million frames (each copy of the capture with repos of its
//!   own): frames/s and RSS in the first and last tenth;
//! - the signed capture through the binary with `FIREKEEPER_VERIFY` off, `signatures`
//!   and `full` (keys served by the test PLC, cached after the first commit of each DID);
//! - peak RSS of a leader feeding a slow webhook sink (backpressure must bound memory);
//! - crash failover time (SIGKILL the leader → another replica leads), ≥ 10 runs;
//! - graceful handover gap (old leader's release → new leader's election, from their
//!   logs), ≥ 10 runs.
//!
//! `FK_BENCH_ONLY=verify`, `throughput` or `scale` runs that group alone.

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

/// Copies of the fixture in the throughput runs (516,600 frames). Runs of 70 copies
/// (103,320 frames) lasted a third of a second, in which the 100 ms commit tick that ends
/// the measured span and the ramp after connecting weighed a tenth to a fifth of the
/// figure; the ceiling's run lasted an eighth of a second.
const COPIES: usize = 350;

/// Copies in the JetStream runs (103,320 frames: at under 100k events/s a run lasts over a
/// second already, and each one writes the stream to disk).
const JS_COPIES: usize = 70;

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

/// One throughput run of one replica.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// Events the relay served.
    total: u64,
    /// Steady-state frames/s, first commit to last.
    fps: f64,
    /// Peak resident set of the replica, MiB.
    rss_mib: f64,
    /// CPU seconds (user + system) the replica spent per frame over the same span, µs.
    cpu_us_per_frame: f64,
}

/// User + system CPU seconds of a process so far (`/proc/PID/stat`, 100 ticks a second).
fn cpu_secs(pid: Option<u32>) -> f64 {
    let Some(stat) = pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok()) else { return 0.0 };
    // Fields after the command name (which may hold spaces) start at `) `.
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let f: Vec<f64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}

/// Steady-state frames/s through the binary: from the first commit to the last, so the
/// figure is the pipeline's and not Redis's or the election's start-up.
async fn throughput(bin: Option<PathBuf>, sink: &'static str) -> Run {
    throughput_with(bin, sink, Vec::new()).await
}

/// [`throughput`] with more environment.
async fn throughput_with(bin: Option<PathBuf>, sink: &'static str, env: Vec<(&'static str, String)>) -> Run {
    throughput_of(Spec { replicas: 1, copies: COPIES, rate: None, sink, bin, extra_env: env, ..Spec::default() }).await
}

/// Steady-state frames/s of one replica of `spec`.
async fn throughput_of(spec: Spec) -> Run {
    let mut c = Cluster::start("bench-tput", spec).await;
    c.start_all();
    let (l, _) = c.wait_leader(None).await;
    let total = c.total;
    let deadline = Instant::now() + WAIT;
    let (c0, t0, cpu0) = loop {
        if let Some(s) = c.replicas[l].status().await
            && let Some(c0) = s["committed"].as_u64().filter(|&c| c > 0)
        {
            break (c0, Instant::now(), cpu_secs(c.replicas[l].pid()));
        }
        assert!(Instant::now() < deadline, "never committed; logs in {}", c.dir.display());
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    assert!(c0 < total / 2, "the first commit came too late to measure ({c0} of {total}): raise COPIES");
    wait_committed(&c, l, total).await;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_secs(c.replicas[l].pid()) - cpu0;
    #[allow(clippy::cast_precision_loss)]
    let rss_mib = c.replicas[l].peak_rss_kib().unwrap_or(0) as f64 / 1024.0;
    let frames = (total - c0) as f64;
    // The jsonl output of a run is half a gigabyte: removed, so its writeback does not
    // load the runs after it (and runs do not fill the disk).
    let dir = c.dir.clone();
    drop(c);
    let _ = std::fs::remove_dir_all(dir);
    Run { total, fps: frames / secs, rss_mib, cpu_us_per_frame: cpu * 1e6 / frames }
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

/// Median of a field over runs.
fn med(xs: &[Run], f: impl Fn(&Run) -> f64) -> f64 {
    median(&mut xs.iter().map(f).collect::<Vec<_>>())
}

/// One line for a set of runs: each run's frames/s, the median, CPU per frame and peak RSS.
fn report(what: &str, xs: &[Run]) -> f64 {
    let fps: Vec<f64> = xs.iter().map(|r| r.fps).collect();
    let m = med(xs, |r| r.fps);
    println!(
        "{what}, {} runs: {} → median {m:.0} frames/s; CPU {:.2} µs/frame; peak RSS {:.1} MiB",
        xs.len(),
        runs(&fps),
        med(xs, |r| r.cpu_us_per_frame),
        med(xs, |r| r.rss_mib)
    );
    m
}

/// The signed capture with verification off, `signatures` and `full`.
async fn verification(plc: &testkit::plc::Plc) {
    let (mut unverified, mut signatures, mut full) = (Vec::new(), Vec::new(), Vec::new());
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
            into.push(throughput_of(spec).await);
        }
    }
    let n = unverified[0].total;
    let u = report(&format!("signed capture, {n} frames, null sink, FIREKEEPER_VERIFY=off"), &unverified);
    report("signed capture, FIREKEEPER_VERIFY=signatures", &signatures);
    let f = report("signed capture, FIREKEEPER_VERIFY=full", &full);
    println!("ratio verified (full) / unverified: {:.2}", f / u);
}

/// The raw ceiling and, alternated with it in each run, the binary with the null, jsonl
/// and JetStream sinks (and the baseline binary beside them when given).
async fn throughput_figures(baseline: Option<&PathBuf>) {
    let (mut raw, mut null, mut jsonl, mut unchained, mut jetstream) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut no_resync = Vec::new();
    let (mut base_null, mut base_jsonl, mut base_js) = (Vec::new(), Vec::new(), Vec::new());
    let js = |bin: Option<PathBuf>| Spec {
        replicas: 1,
        copies: JS_COPIES,
        rate: None,
        sink: "nats",
        nats: true,
        bin,
        ..Spec::default()
    };
    for _ in 0..RUNS {
        raw.push(raw_ceiling().await.1);
        null.push(throughput(None, "null").await);
        jsonl.push(throughput(None, "jsonl").await);
        unchained.push(throughput_with(None, "null", vec![("FIREKEEPER_CHAIN_BREAKS", "off".into())]).await);
        no_resync.push(throughput_with(None, "null", vec![("FIREKEEPER_RESYNC", "false".into())]).await);
        jetstream.push(throughput_of(js(None)).await);
        if let Some(b) = baseline {
            base_null.push(throughput(Some(b.clone()), "null").await);
            base_jsonl.push(throughput(Some(b.clone()), "jsonl").await);
            base_js.push(throughput_of(js(Some(b.clone()))).await);
        }
    }
    let n = null[0].total;
    let r = median(&mut raw.clone());
    println!(
        "raw WebSocket ceiling (read frames only), {n} frames, {RUNS} runs: {} → median {r:.0} frames/s",
        runs(&raw)
    );
    let f = report("end-to-end relay-sim → firekeeper (redis lease, null sink)", &null);
    println!("ratio null sink / raw ceiling: {:.2}", f / r);
    let j = report("end-to-end with the jsonl sink (JSON rendered in the lanes, written to a file)", &jsonl);
    println!("ratio jsonl sink / raw ceiling: {:.2}", j / r);
    report("end-to-end without the chain check (FIREKEEPER_CHAIN_BREAKS=off, null sink)", &unchained);
    let off = report("end-to-end without repo sync (FIREKEEPER_RESYNC=false, null sink)", &no_resync);
    println!("ratio repo sync on / off (null sink): {:.2}", f / off);
    report(
        "end-to-end into JetStream (NATS lease + NATS cursor + JetStream sink, every publish acknowledged)",
        &jetstream,
    );
    if let Some(b) = baseline {
        let bn = report(&format!("baseline {} (null sink)", b.display()), &base_null);
        println!("ratio baseline null sink / raw ceiling: {:.2}", bn / r);
        let bj = report(&format!("baseline {} (jsonl sink)", b.display()), &base_jsonl);
        println!("ratio baseline jsonl sink / raw ceiling: {:.2}", bj / r);
        report(&format!("baseline {} (JetStream sink)", b.display()), &base_js);
        println!(
            "CPU per frame, null sink, this / baseline: {:.2}",
            med(&null, |r| r.cpu_us_per_frame) / med(&base_null, |r| r.cpu_us_per_frame)
        );
    }
}

/// Copies of the fixture in the scale run: 1,356 × 1,476 = 2,001,456 frames.
const SCALE_COPIES: usize = 1356;

/// Over 2 million frames, each copy of the capture with repos of its own: frames/s and
/// resident memory in the first and the last tenth of the run, so any state that grows
/// with the stream (per-repo chain check, switch dedupe) shows as a slope.
async fn scale(bin: Option<&PathBuf>) {
    for bin in std::iter::once(None).chain(bin.map(|b| Some(b.clone()))) {
        let name = bin.as_ref().map_or_else(|| "this build".to_owned(), |b| format!("baseline {}", b.display()));
        let spec = Spec {
            replicas: 1,
            copies: SCALE_COPIES,
            rate: None,
            sink: "null",
            new_repos: true,
            bin,
            ..Spec::default()
        };
        let mut c = Cluster::start("bench-scale", spec).await;
        c.start_all();
        let (l, _) = c.wait_leader(None).await;
        let total = c.total;
        // (seconds since start, committed, RSS MiB), sampled every 20 ms.
        let mut samples: Vec<(f64, u64, f64)> = Vec::new();
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_mins(30);
        loop {
            let committed = c.replicas[l].status().await.and_then(|s| s["committed"].as_u64()).unwrap_or(0);
            #[allow(clippy::cast_precision_loss)]
            let rss = c.replicas[l].rss_kib().unwrap_or(0) as f64 / 1024.0;
            samples.push((t0.elapsed().as_secs_f64(), committed, rss));
            if committed >= total {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "scale run unfinished at {committed} of {total}; logs in {}",
                c.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The first sample at or past a fraction of the stream.
        let at = |frac: f64| {
            #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let want = (total as f64 * frac) as u64;
            *samples.iter().find(|s| s.1 >= want).expect("sampled")
        };
        let rate = |a: (f64, u64, f64), b: (f64, u64, f64)| (b.1 - a.1) as f64 / (b.0 - a.0);
        let (s0, s1, s9, s10) = (at(0.0001), at(0.1), at(0.9), at(1.0));
        let peak = c.replicas[l].peak_rss_kib().unwrap_or(0) as f64 / 1024.0;
        println!(
            "scale, {name}: {total} frames ({SCALE_COPIES} copies, new repos each), null sink: first 10 % {:.0} frames/s, last 10 % {:.0} frames/s; RSS {:.1} MiB at 10 %, {:.1} MiB at 90 %, {:.1} MiB at the end, peak {peak:.1} MiB; {:.1} s in all, {:.0} frames/s",
            rate(s0, s1),
            rate(s9, s10),
            s1.2,
            s9.2,
            s10.2,
            s10.0 - s0.0,
            rate(s0, s10)
        );
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` and test harness probes
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let baseline = std::env::var_os("FIREKEEPER_BENCH_BASELINE").map(PathBuf::from);
        // FK_BENCH_ONLY=verify | throughput | scale measures one group of figures alone.
        let only = std::env::var("FK_BENCH_ONLY").unwrap_or_default();
        if only.is_empty() || only == "verify" {
            let plc = testkit::plc::Plc::signed_fixture().await;
            verification(&plc).await;
        }
        if only.is_empty() || only == "throughput" {
            throughput_figures(baseline.as_ref()).await;
        }
        if only.is_empty() || only == "scale" {
            scale(baseline.as_ref()).await;
        }
        if !only.is_empty() {
            return;
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
