//! Jetstream as the input, through the real binary and relay-sim's Jetstream instances.
//!
//! - The fixture capture on v1 and v2, plain and compressed: every event once, the same
//!   repos and ops as the firehose path hands over, each in Jetstream's own JSON.
//! - Failover between two instances whose stamps differ by seconds and whose windows
//!   differ: nothing lost, nothing twice; a real gap under `GAP=fail` is refused.
//! - A leader killed mid-stream: the next resumes from the fenced stamp, nothing lost.
//! - The Postgres records mirror fed by Jetstream equals the one fed by the firehose.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use relay_sim::jetstream::Clock;
use relay_sim::{RelaySim, SimConfig};
use testkit::http::http_get;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait};
use testkit::{PgServer, RedisServer, WAIT, assert_exactly_once, eventually, free_port, tmpdir};

/// What an event is on every instance: (did, kind, and the op or the upstream time).
type Key = (String, String, String);

/// The key of a Jetstream event as a sink wrote it (v1 object or v2 payload).
fn key_of(e: &serde_json::Value) -> Option<Key> {
    let s = |v: &serde_json::Value| v.as_str().map(str::to_owned);
    let did = s(&e["did"])?;
    let kind = match (e["kind"].as_str(), e["$type"].as_str()) {
        (Some(k), _) => k.to_owned(),
        (None, Some(t)) => t.rsplit('#').next()?.to_owned(),
        _ => return None,
    };
    let rest = match kind.as_str() {
        "commit" => {
            let c = if e["commit"].is_object() { &e["commit"] } else { e };
            format!("{} {} {}/{}", s(&c["rev"])?, s(&c["operation"])?, s(&c["collection"])?, s(&c["rkey"])?)
        }
        "sync" => s(&e["sync"]["rev"])?,
        other => s(&e[other]["time"])?,
    };
    Some((did, kind, rest))
}

/// What the firehose path hands over for the capture, as Jetstream keys (`#sync` only
/// on v2, whose wire carries it).
fn want(with_sync: bool) -> Vec<Key> {
    let mut out = Vec::new();
    for f in testkit::fixture_frames() {
        let Ok(Some(e)) = consumer::Event::from_bytes(&f, relay_client::RelayRole::Primary) else { continue };
        let mut j = String::new();
        e.render_json(&mut j);
        let v: serde_json::Value = serde_json::from_str(&j).expect("json");
        let s = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
        match v["type"].as_str() {
            Some("#commit") => {
                for op in v["ops"].as_array().into_iter().flatten() {
                    let path = op["path"].as_str().unwrap_or_default();
                    let action = op["action"].as_str().unwrap_or_default();
                    out.push((s("repo"), "commit".to_owned(), format!("{} {action} {path}", s("rev"))));
                }
            }
            Some("#identity") => out.push((s("did"), "identity".into(), s("time"))),
            Some("#account") => out.push((s("did"), "account".into(), s("time"))),
            Some("#sync") if with_sync => out.push((s("did"), "sync".into(), s("rev"))),
            _ => {}
        }
    }
    out
}

/// Key → (count, relays), over the whole lines of jsonl files.
fn got(paths: &[PathBuf]) -> BTreeMap<Key, (usize, Vec<String>)> {
    let mut m: BTreeMap<Key, (usize, Vec<String>)> = BTreeMap::new();
    for path in paths {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let whole = text.rfind('\n').map_or("", |i| &text[..=i]);
        for line in whole.lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("every line is JSON");
            let k = key_of(&v["event"]).unwrap_or_else(|| panic!("a Jetstream event: {line}"));
            let e = m.entry(k).or_default();
            e.0 += 1;
            e.1.push(v["relay"].as_str().unwrap_or("").to_owned());
        }
    }
    m
}

async fn instance(clock: &Clock, cfg: SimConfig) -> RelaySim {
    RelaySim::start_jetstream(&testkit::fixture_frames(), clock, cfg, "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("jetstream sim")
}

/// A Jetstream deployment's environment, its cursor set to the first stamp.
fn setup(name: &str, url: &str, version: &str, compress: bool) -> (HashMap<String, String>, PathBuf, PathBuf, PathBuf) {
    let dir = tmpdir(name);
    let mut env = base_env(url, &dir);
    let out = dir.join("events.jsonl");
    for (k, v) in [
        ("FIREKEEPER_INPUT", "jetstream".to_owned()),
        ("FIREKEEPER_JETSTREAM_VERSION", version.to_owned()),
        ("FIREKEEPER_JETSTREAM_COMPRESS", compress.to_string()),
        ("FIREKEEPER_JSONL_PATH", out.to_string_lossy().into_owned()),
    ] {
        env.insert(k.into(), v);
    }
    env.remove("FIREKEEPER_VERIFY");
    let o = run_once(&env, &["cursor", "set", &Clock::default().base_us.to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (env, out, dir.join("firekeeper.log"), dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capture_through_jetstream_is_what_the_firehose_path_hands_over_on_both_wires() {
    for (version, compress) in [("v1", false), ("v1", true), ("v2", false), ("v2", true)] {
        let want = want(version == "v2");
        let sim = instance(&Clock::default(), SimConfig::default()).await;
        let (env, out, log, _dir) = setup(&format!("js-capture-{version}-{compress}"), &sim.url(), version, compress);
        let fk = firekeeper(&env, &[], &log);
        let files = [out.clone()];
        eventually("every event", WAIT, async || got(&files).len() >= want.len()).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let exit = sigterm_and_wait(fk);
        assert!(exit.success(), "{exit:?}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        assert_exactly_once(&got(&files), &want);
        // Jetstream's own JSON, wrapped as the firehose's events are.
        let first: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(&out).expect("out").lines().next().expect("a line"))
                .expect("json");
        assert_eq!(first["relay"], "primary");
        assert!(first["token"].is_u64() && first["seq"].is_u64(), "{first}");
        if version == "v1" {
            assert!(first["event"]["time_us"] == first["seq"] && first["event"]["kind"].is_string(), "{first}");
        } else {
            assert!(first["event"]["$type"].as_str().is_some_and(|t| t.contains("subscribeEvents#")), "{first}");
        }
        let shown = run_once(&env, &["cursor", "show"]);
        let last = sim_last_stamp(version);
        assert!(
            String::from_utf8_lossy(&shown.stdout).contains(&format!("cursor {last}")),
            "{}",
            String::from_utf8_lossy(&shown.stdout)
        );
    }
}

/// The last stamp the default instance serves on a wire.
fn sim_last_stamp(version: &str) -> u64 {
    relay_sim::jetstream::rows(&testkit::fixture_frames(), &Clock::default())
        .iter()
        .rev()
        .find(|r| version == "v2" || !r.v1.is_empty())
        .expect("rows")
        .stamp
}

#[test]
fn verification_is_refused_with_jetstream_input_and_says_why() {
    let dir = tmpdir("js-verify");
    let mut env = base_env("ws://127.0.0.1:1", &dir);
    env.insert("FIREKEEPER_INPUT".into(), "jetstream".into());
    env.insert("FIREKEEPER_VERIFY".into(), "full".into());
    let o = run_once(&env, &["check-config"]);
    assert_eq!(o.status.code(), Some(2), "refused");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("FIREKEEPER_VERIFY") && err.contains("no signatures"), "{err}");
    env.insert("FIREKEEPER_VERIFY".into(), "off".into());
    let o = run_once(&env, &["check-config"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Two instances paced at `rate`: the secondary stamps 2.5 s later with jitter and keeps
/// only its latest `window` events.
async fn instances(rate: u32, window: usize) -> (RelaySim, RelaySim) {
    let paced = SimConfig { initial_head: Some(0), rate: Some(rate), ..SimConfig::default() };
    // 100 ms of stamps between upstream events: the capture spans about a minute.
    let primary = instance(&Clock { step_us: 100_000, ..Clock::default() }, paced.clone()).await;
    let later = Clock { step_us: 100_000, offset_us: 2_500_000, jitter_us: 40_000, seed: 9, ..Clock::default() };
    let secondary = instance(&later, SimConfig { window_len: Some(window), ..paced }).await;
    (primary, secondary)
}

async fn status(http: &str) -> serde_json::Value {
    let (_, body) = http_get(http, "/status").await.unwrap_or_default();
    serde_json::from_str(&body).unwrap_or(serde_json::Value::Null)
}

fn with_secondary(env: &mut HashMap<String, String>, secondary: &RelaySim) -> String {
    let http = format!("127.0.0.1:{}", free_port());
    for (k, v) in [
        ("FIREKEEPER_RELAY_SECONDARY", secondary.url()),
        ("FIREKEEPER_HTTP_ADDR", http.clone()),
        ("FIREKEEPER_FAILOVER_AFTER", "2".into()),
        ("FIREKEEPER_PROBE_INTERVAL_MS", "300".into()),
    ] {
        env.insert(k.into(), v);
    }
    http
}

/// A replica on two instances (the secondary keeping its latest `window` events), run
/// until 40 % of the capture is delivered, the primary then taken down.
struct Pair {
    primary: RelaySim,
    /// Kept alive with the pair (bind it when taking the pair apart).
    _secondary: RelaySim,
    files: [PathBuf; 1],
    log: PathBuf,
    http: String,
    fk: std::process::Child,
}

impl Pair {
    async fn at_40_percent(name: &str, version: &str, window: usize, want: &[Key]) -> Self {
        let (primary, secondary) = instances(400, window).await;
        let (mut env, out, log, _dir) = setup(name, &primary.url(), version, true);
        let http = with_secondary(&mut env, &secondary);
        let fk = firekeeper(&env, &[], &log);
        let files = [out];
        eventually("40 % delivered", WAIT, async || got(&files).len() >= want.len() * 2 / 5).await;
        primary.handle().set_down(true);
        Self { primary, _secondary: secondary, files, log, http, fk }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_between_instances_with_other_stamps_loses_and_repeats_nothing() {
    for version in ["v1", "v2"] {
        let want = want(version == "v2");
        let Pair { primary, _secondary, files, log, http, mut fk } =
            Pair::at_40_percent(&format!("js-failover-{version}"), version, 1200, &want).await;
        let n = want.len();
        eventually("on the secondary", WAIT, async || status(&http).await["relay"] == "secondary").await;
        eventually("70 % delivered", WAIT, async || got(&files).len() >= n * 7 / 10).await;
        primary.handle().set_down(false);
        eventually("every event", WAIT, async || got(&files).len() >= n).await;
        eventually("back on the primary", WAIT, async || status(&http).await["relay"] == "primary").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(fk.try_wait().expect("wait").is_none(), "never exited");
        let (_, metrics) = http_get(&http, "/metrics").await.expect("metrics");
        let exit = sigterm_and_wait(fk);
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(exit.success(), "{exit:?}\n{text}");
        let got = got(&files);
        assert_exactly_once(&got, &want);
        assert!(got.values().any(|(_, r)| r.iter().any(|x| x == "secondary")), "{version}: the secondary served some");
        // The overlap was replayed and dropped by content, not skipped by clock.
        let dropped = metrics
            .lines()
            .find(|l| l.starts_with("firekeeper_switch_duplicates_dropped_total"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        assert!(dropped > 0.0, "{version}: {metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_gap_under_gap_fail_refuses_the_switch_and_loses_nothing() {
    let want = want(false);
    let Pair { primary, _secondary, files, http, mut fk, .. } =
        Pair::at_40_percent("js-refused", "v1", 10, &want).await;
    let n = want.len();
    eventually("the refused switch in /status", WAIT, async || status(&http).await["refused_switch"].is_string()).await;
    let s = status(&http).await;
    assert_eq!((s["role"].as_str(), s["relay"].as_str()), (Some("leader"), Some("primary")), "{s}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(fk.try_wait().expect("wait").is_none(), "the process never exits");
    assert!(got(&files).values().all(|(_, r)| r.iter().all(|x| x == "primary")), "nothing from the secondary");
    primary.handle().set_down(false);
    eventually("every event", WAIT, async || got(&files).len() >= n).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let exit = sigterm_and_wait(fk);
    assert!(exit.success(), "{exit:?}");
    assert_exactly_once(&got(&files), &want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_mid_stream_is_followed_from_the_fenced_stamp_and_nothing_is_lost() {
    let want = want(false);
    let redis = RedisServer::start();
    let sim =
        instance(&Clock::default(), SimConfig { initial_head: Some(0), rate: Some(400), ..SimConfig::default() }).await;
    let (mut env, _, _, dir) = setup("js-kill", &sim.url(), "v1", true);
    env.insert("REDIS_URL".into(), redis.url());
    let o = run_once(&env, &["cursor", "set", &Clock::default().base_us.to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (a_out, b_out) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
    let mut env_a = env.clone();
    env_a.insert("FIREKEEPER_JSONL_PATH".into(), a_out.to_string_lossy().into_owned());
    let mut a = firekeeper(&env_a, &[], &dir.join("a.log"));
    let n = want.len();
    eventually("a delivers 40 %", WAIT, async || got(std::slice::from_ref(&a_out)).len() >= n * 2 / 5).await;
    let mut env_b = env.clone();
    env_b.insert("FIREKEEPER_JSONL_PATH".into(), b_out.to_string_lossy().into_owned());
    let b = firekeeper(&env_b, &[], &dir.join("b.log"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.kill().expect("kill -9 the leader");
    let _ = a.wait();
    let files = [a_out.clone(), b_out.clone()];
    eventually("every event", WAIT, async || got(&files).len() >= n).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let exit = sigterm_and_wait(b);
    assert!(exit.success(), "{exit:?}\n{}", std::fs::read_to_string(dir.join("b.log")).unwrap_or_default());
    let got = got(&files);
    let lost: Vec<_> = want.iter().filter(|k| !got.contains_key(*k)).take(5).collect();
    assert!(lost.is_empty(), "lost {lost:?}");
    // B resumed at A's fenced stamp: what it repeats is at most what A handed over since
    // its last commit (at least once across a crash), never from the start.
    // B resumed at A's fenced stamp (at most one step after A's last line), not from the
    // start: what it repeats is what A handed over since its last commit.
    let (b_first, a_first, a_last) = (first_stamp(&b_out), first_stamp(&a_out), last_stamp(&a_out));
    assert!(b_first > a_first && b_first <= a_last + 1_000, "b started at {b_first}, a wrote {a_first}..{a_last}");
}

fn stamps(p: &Path) -> Vec<u64> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["seq"].as_u64())
        .collect()
}

fn first_stamp(p: &Path) -> u64 {
    stamps(p).first().copied().unwrap_or(0)
}

fn last_stamp(p: &Path) -> u64 {
    stamps(p).last().copied().unwrap_or(0)
}

/// The records mirror of a Postgres sink run over the capture: (did, collection, rkey,
/// cid, rev, record).
async fn records_mirror(
    env: &mut HashMap<String, String>,
    dir: &Path,
    done: u64,
) -> Vec<(String, String, String, String, String, String)> {
    let pg = PgServer::start();
    for (k, v) in [
        ("DATABASE_URL", pg.url()),
        ("FIREKEEPER_SINK", "postgres".to_owned()),
        ("FIREKEEPER_POSTGRES_RECORDS", "true".to_owned()),
    ] {
        env.insert(k.into(), v);
    }
    let cursor = env.get("FIREKEEPER_INPUT").map_or("0".to_owned(), |_| Clock::default().base_us.to_string());
    let o = run_once(env, &["cursor", "set", &cursor]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("pg");
    tokio::spawn(conn);
    let fk = firekeeper(env, &[], &dir.join("pg.log"));
    eventually("the last event committed", WAIT, async || {
        let c = client.query_one("SELECT cursor FROM firekeeper_cursors", &[]).await.map(|r| r.get::<_, i64>(0));
        c.is_ok_and(|c| u64::try_from(c).ok() == Some(done))
    })
    .await;
    assert!(sigterm_and_wait(fk).success());
    let rows = client
        .query(
            "SELECT did, collection, rkey, cid, rev, coalesce(record::text, record_text) FROM firekeeper_records
             ORDER BY did, collection, rkey",
            &[],
        )
        .await
        .expect("records");
    rows.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_records_mirror_fed_by_jetstream_equals_the_one_fed_by_the_firehose() {
    let relay =
        RelaySim::start_with(testkit::fixture_frames(), SimConfig::default(), "127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("relay");
    let dir = tmpdir("js-mirror-firehose");
    let mut env = base_env(&relay.url(), &dir);
    let last_seq = testkit::fixture_frames().iter().filter_map(|f| relay_sim::frame_seq(f)).max().expect("seqs");
    let from_firehose = records_mirror(&mut env, &dir, last_seq).await;
    assert!(from_firehose.len() > 100, "the capture leaves records: {}", from_firehose.len());
    let sim = instance(&Clock::default(), SimConfig::default()).await;
    let (mut env, _, _, dir) = setup("js-mirror", &sim.url(), "v1", true);
    let from_jetstream = records_mirror(&mut env, &dir, sim_last_stamp("v1")).await;
    let first_diff = from_jetstream.iter().zip(&from_firehose).position(|(a, b)| a != b);
    assert!(
        from_jetstream.len() == from_firehose.len() && first_diff.is_none(),
        "{} rows from Jetstream, {} from the firehose; first difference at {first_diff:?}: {:?} / {:?}",
        from_jetstream.len(),
        from_firehose.len(),
        first_diff.map(|i| &from_jetstream[i]),
        first_diff.map(|i| &from_firehose[i]),
    );
}
