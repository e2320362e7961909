//! `cargo bench -p firekeeper --bench jetstream`: Jetstream input through the real binary
//! beside a raw client, in one run.
//!
//! relay-sim serves the capture as a Jetstream instance (`COPIES` copies, each event a
//! stamp of its own instance clock). Alternated in each run:
//! - **raw client**: one WebSocket reading every frame off the socket (and, compressed,
//!   decompressing it with the dictionary: what any client must do), nothing else;
//! - **firekeeper**: one replica with the file store and the null sink: each event
//!   decoded, placed by its stamp, laned by repo, handed over, the cursor committed;
//!   events/s from its first commit to its last.
//!
//! Both for v1 plain and v1 compressed, and v2 compressed. The instance compresses each
//! event once for every subscriber (a warm-up run, not counted, fills it), as Jetstream
//! does. `FK_JS_COPIES` sets the size.

use std::time::{Duration, Instant};

use relay_client::jetstream::{Decompressor, Version};
use relay_sim::jetstream::Clock;
use relay_sim::{RelaySim, SimConfig, capture};
use testkit::http::http_get;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait};
use testkit::{WAIT, free_port, tmpdir};

const RUNS: usize = 3;

fn copies() -> usize {
    std::env::var("FK_JS_COPIES").ok().and_then(|v| v.parse().ok()).unwrap_or(120)
}

/// User + system CPU seconds of a process so far.
fn cpu_secs(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let f: Vec<f64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}

struct Stream {
    sim: RelaySim,
    /// The stamps of the events on the wire, in order.
    stamps: Vec<u64>,
    total: u64,
    first: u64,
    last: u64,
}

async fn stream(version: Version) -> Stream {
    let frames = capture::repeat(&testkit::fixture_frames(), copies());
    let clock = Clock::default();
    let rows = relay_sim::jetstream::rows(&frames, &clock);
    let on_wire: Vec<_> = rows.iter().filter(|r| version == Version::V2 || !r.v1.is_empty()).collect();
    let (first, last) = (on_wire[0].stamp, on_wire[on_wire.len() - 1].stamp);
    let total = on_wire.len() as u64;
    let sim = RelaySim::start_jetstream(&frames, &clock, SimConfig::default(), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("relay-sim");
    let stamps = on_wire.iter().map(|r| r.stamp).collect();
    Stream { sim, stamps, total, first, last }
}

/// A client that reads (and decompresses) every frame, first to last: events/s, and the
/// bytes on the wire per byte of JSON.
async fn raw(s: &Stream, version: Version, compress: bool) -> (f64, f64) {
    use futures_util::StreamExt as _;
    let opts = relay_client::jetstream::Options { version, compress, ..Default::default() };
    let base = relay_client::RelayUrl::parse(&s.sim.url()).expect("url");
    let url = opts.url(&base, Some(s.first));
    let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str()).await.expect("connect");
    let mut z = Decompressor::new(version).expect("dictionary");
    let (mut n, mut t0, mut bytes, mut wire) = (0u64, None, 0usize, 0usize);
    while n < s.total {
        match ws.next().await {
            Some(Ok(tokio_tungstenite::tungstenite::Message::Text(t))) => {
                bytes += t.len();
                wire += t.len();
            }
            Some(Ok(tokio_tungstenite::tungstenite::Message::Binary(b))) => {
                bytes += z.decompress(&b, 1 << 24).expect("decompresses").len();
                wire += b.len();
            }
            Some(Ok(_)) => continue,
            other => panic!("the raw reader lost the stream after {n} frames: {other:?}"),
        }
        n += 1;
        t0.get_or_insert_with(Instant::now);
    }
    assert!(bytes > 0);
    #[allow(clippy::cast_precision_loss)]
    let ratio = wire as f64 / bytes as f64;
    ((s.total - 1) as f64 / t0.expect("a frame").elapsed().as_secs_f64(), ratio)
}

/// firekeeper with the null sink: (events/s from its first commit to its last, CPU µs
/// per event).
async fn binary(s: &Stream, version: Version, compress: bool) -> (f64, f64) {
    let dir = tmpdir("bench-js");
    let mut env = base_env(&s.sim.url(), &dir);
    let http = format!("127.0.0.1:{}", free_port());
    for (k, v) in [
        ("FIREKEEPER_INPUT", "jetstream".to_owned()),
        ("FIREKEEPER_JETSTREAM_VERSION", version.as_str().to_owned()),
        ("FIREKEEPER_JETSTREAM_COMPRESS", compress.to_string()),
        ("FIREKEEPER_SINK", "null".to_owned()),
        ("FIREKEEPER_HTTP_ADDR", http.clone()),
        ("RUST_LOG", "warn".to_owned()),
    ] {
        env.insert(k.into(), v);
    }
    env.remove("FIREKEEPER_VERIFY");
    let o = run_once(&env, &["cursor", "set", &s.first.to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let fk = firekeeper(&env, &[], &dir.join("fk.log"));
    let pid = fk.id();
    let committed = async || {
        let (_, body) = http_get(&http, "/status").await.unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(&body).ok()?["committed"].as_u64()
    };
    let deadline = Instant::now() + WAIT;
    let (c0, t0, cpu0) = loop {
        if let Some(c) = committed().await.filter(|&c| c > s.first) {
            break (c, Instant::now(), cpu_secs(pid));
        }
        assert!(Instant::now() < deadline, "never committed; log in {}", dir.display());
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    while committed().await != Some(s.last) {
        assert!(Instant::now() < deadline, "never committed the last stamp; log in {}", dir.display());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_secs(pid) - cpu0;
    let _ = sigterm_and_wait(fk);
    let _ = std::fs::remove_dir_all(&dir);
    // The events after the first commit.
    #[allow(clippy::cast_precision_loss)]
    let events = (s.stamps.len() - s.stamps.partition_point(|&t| t <= c0)) as f64;
    (events / secs, cpu * 1e6 / events)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        for (version, compress) in [(Version::V1, false), (Version::V1, true), (Version::V2, true)] {
            let s = stream(version).await;
            // Warm-up, not counted: the instance compresses each event once, for all.
            let _ = raw(&s, version, compress).await;
            let (mut r, mut f, mut cpu, mut ratio) = (Vec::new(), Vec::new(), Vec::new(), 1.0);
            for _ in 0..RUNS {
                let (eps, wire) = raw(&s, version, compress).await;
                r.push(eps);
                ratio = wire;
                let (eps, us) = binary(&s, version, compress).await;
                f.push(eps);
                cpu.push(us);
            }
            let (rm, fm, cm) = (median(&mut r), median(&mut f), median(&mut cpu));
            println!(
                "jetstream {} compress={compress}, {} events, {RUNS} runs: raw client {:.0} events/s (runs {:?}); \
                 firekeeper null sink {:.0} events/s (runs {:?}), {:.2} CPU µs/event; ratio {:.2}; wire bytes per \
                 JSON byte {ratio:.3}",
                version.as_str(),
                s.total,
                rm,
                r.iter().map(|x| x.round()).collect::<Vec<_>>(),
                fm,
                f.iter().map(|x| x.round()).collect::<Vec<_>>(),
                cm,
                fm / rm
            );
        }
    });
}
