//! `make bench`: repo sync across replicas, 1 replica beside 3, in one run, through the
//! release binary. `FK_SHARED_REPOS` repos (480; `FK_SHARED_RECORDS` likes each, 50) are
//! built here, each signed, served by a local PDS that rate-limits `getRepo` per source
//! address (`FK_SHARED_RATE` a second per address, 20; `0`: no limit) the way a PDS limits
//! per IP, and named by a local PLC. Each replica fetches from its own loopback address
//! (`FIREKEEPER_SYNC_BIND`: 127.0.0.1, .2, .3), shares the Redis queue and writes to the
//! null sink. The figures are the wall time to the leader counting every repo done, from
//! the first replica's start and from the first leader's election (process start-up left
//! out), and each replica's share of the jobs.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use testkit::http::http_get;
use tokio::io::AsyncWriteExt as _;

/// A per-source-address token bucket: `rate` a second, bursts of `rate`.
struct Limits {
    rate: f64,
    buckets: Mutex<HashMap<IpAddr, (f64, Instant)>>,
    refused: std::sync::atomic::AtomicU64,
}

impl Limits {
    /// True when `ip` may be answered now.
    fn take(&self, ip: IpAddr) -> bool {
        if self.rate <= 0.0 {
            return true;
        }
        let mut b = self.buckets.lock().expect("buckets");
        let now = Instant::now();
        let (tokens, at) = b.entry(ip).or_insert((self.rate, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.rate).min(self.rate);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            false
        }
    }
}

/// The repos a PDS serves, set once they are built (their DID documents name the PDS).
type Cars = Arc<std::sync::OnceLock<HashMap<String, Vec<u8>>>>;

/// A PDS serving `cars` (`getRepo?did=`), limited per source address by `limits`.
async fn pds(cars: Cars, limits: Arc<Limits>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((mut s, peer)) = listener.accept().await {
            let _ = s.set_nodelay(true);
            let (cars, limits) = (cars.clone(), limits.clone());
            tokio::spawn(async move {
                let mut pending = Vec::new();
                while let Some((line, _)) = testkit::http::read_request_with_line(&mut s, &mut pending).await {
                    if !limits.take(peer.ip()) {
                        let refused = "HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\nratelimit-remaining: 0\r\nratelimit-reset: 1\r\ncontent-length: 0\r\n\r\n";
                        if s.write_all(refused.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let did = line.split("did=").nth(1).and_then(|d| d.split([' ', '&']).next()).unwrap_or("");
                    let Some(car) = cars.get().and_then(|c| c.get(&did.replace("%3A", ":"))) else {
                        let _ = s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await;
                        continue;
                    };
                    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", car.len());
                    if s.write_all(head.as_bytes()).await.is_err() || s.write_all(car).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    base
}

/// One backfill of every repo by `replicas` replicas: (seconds from the first start,
/// seconds from the first leader's election, jobs done by each).
async fn backfill(replicas: usize, plc: &str, dids: &[String], dir: &std::path::Path) -> (f64, f64, Vec<u64>) {
    let redis = testkit::RedisServer::start();
    let relay = testkit::proc::quiet_relay().await;
    let run = dir.join(format!("r{replicas}"));
    std::fs::create_dir_all(&run).expect("dir");
    let list = run.join("dids.txt");
    std::fs::write(&list, dids.join("\n")).expect("list");
    let mut env = testkit::proc::base_env(&relay.url(), &run);
    env.insert("REDIS_URL".into(), redis.url());
    env.insert("FIREKEEPER_PLC_URL".into(), plc.to_owned());
    env.insert("FIREKEEPER_ALLOW_PRIVATE_ADDRESSES".into(), "true".into());
    env.insert("FIREKEEPER_BACKFILL_DIDS".into(), format!("@{}", list.display()));
    env.insert("FIREKEEPER_START".into(), "live".into());
    env.insert("FIREKEEPER_SINK".into(), "null".into());
    env.insert("FIREKEEPER_SYNC_WORKERS".into(), "4".into());
    env.insert("RUST_LOG".into(), "warn".into());
    let started = Instant::now();
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for i in 0..replicas {
        let addr = format!("127.0.0.1:{}", testkit::free_port());
        let mut e = env.clone();
        e.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
        e.insert("FIREKEEPER_SYNC_BIND".into(), format!("127.0.0.{}", i + 1));
        e.insert("FIREKEEPER_DATA_DIR".into(), run.join(format!("data{i}")).to_string_lossy().into_owned());
        children.push(testkit::proc::firekeeper(&e, &[], &run.join(format!("{i}.log"))));
        addrs.push(addr);
    }
    let want = format!("firekeeper_resyncs_total{{outcome=\"done\",reason=\"backfill\"}} {}\n", dids.len());
    let deadline = Instant::now() + Duration::from_mins(20);
    let mut elected: Option<Instant> = None;
    'wait: loop {
        if elected.is_none() {
            for a in &addrs {
                if http_get(a, "/status").await.is_some_and(|(_, b)| b.contains("\"role\":\"leader\"")) {
                    elected = Some(Instant::now());
                }
            }
        }
        for a in &addrs {
            if let Some((200, m)) = http_get(a, "/metrics").await
                && m.contains(&want)
            {
                break 'wait;
            }
        }
        assert!(Instant::now() < deadline, "the backfill did not finish; logs in {}", run.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    let led = elected.map_or(secs, |t| t.elapsed().as_secs_f64());
    let mut done = Vec::new();
    for a in &addrs {
        let (_, body) = http_get(a, "/status").await.expect("status");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        done.push(v["sync_jobs"]["done"].as_u64().unwrap_or(0));
    }
    for c in children {
        assert!(testkit::proc::sigterm_and_wait(c).success());
    }
    let _ = std::fs::remove_dir_all(&run);
    (secs, led, done)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let var = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (n, records, rate) = (var("FK_SHARED_REPOS", 480), var("FK_SHARED_RECORDS", 50), var("FK_SHARED_RATE", 20));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let dir = testkit::tmpdir("bench-shared");
        let limits = Arc::new(Limits { rate: rate as f64, buckets: Mutex::default(), refused: 0.into() });
        let cars: Cars = Arc::default();
        let base = pds(cars.clone(), limits.clone()).await;
        let dids: Vec<String> = (0..n).map(|i| format!("did:plc:sharedbench{i:013}")).collect();
        let mut built = HashMap::new();
        let mut docs = HashMap::new();
        for did in &dids {
            let path = dir.join("repo.car");
            let b = testkit::repo::write(&path, did, records, &base);
            built.insert(did.clone(), std::fs::read(&path).expect("car"));
            docs.insert(did.clone(), b.doc);
        }
        cars.set(built).expect("set once");
        let plc = testkit::plc::Plc::start(docs).await;
        println!(
            "{n} repos of {records} records; getRepo limited to {} per second per source address",
            if rate == 0 { "no limit".to_owned() } else { rate.to_string() }
        );
        let (one, one_led, one_done) = backfill(1, &plc.url(), &dids, &dir).await;
        println!(
            "1 replica:  {one:.1} s from start, {one_led:.1} s from the election ({:.0} repos/s), jobs {one_done:?}",
            n as f64 / one_led
        );
        let (three, three_led, three_done) = backfill(3, &plc.url(), &dids, &dir).await;
        println!(
            "3 replicas: {three:.1} s from start, {three_led:.1} s from the election ({:.0} repos/s), jobs {three_done:?}",
            n as f64 / three_led
        );
        println!(
            "speed-up {:.2}x from start, {:.2}x from the election; 429s answered {}",
            one / three,
            one_led / three_led,
            limits.refused.load(std::sync::atomic::Ordering::Relaxed)
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}
