//! Relay switches through the real binary, with two relay-sims that number events
//! differently, keep short backfill windows and serve PDS clocks that run slow, fast or
//! late ([`testkit::skewed_fixture_frames`]); default switch settings.
//!
//! - The operator's run from the reliability review: the secondary's window holds less
//!   than the 30 s overlap but reaches back past the committed position; the primary dies
//!   at 40 % of the stream and returns at 70 %. It used to exit with status 1 ("cannot
//!   switch … without a gap"); now the start is proven by content inside that window,
//!   every event arrives exactly once and it never exits.
//! - A secondary whose window does not reach back: the switch is refused, the leader
//!   stays (not ready, the missing range in `/status`), and when the primary returns
//!   everything arrives exactly once.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use relay_sim::{RelaySim, SimConfig};
use testkit::http::http_get;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait};
use testkit::{WAIT, assert_exactly_once, eventually, free_port, tmpdir};

type Key = (String, String, String);

/// An event's identity whatever relay numbered it: (type, repo, rev) or (type, did, time).
fn key_of(e: &serde_json::Value) -> Option<Key> {
    let s = |k: &str| e[k].as_str().map(str::to_owned);
    let t = s("type")?;
    Some(match t.as_str() {
        "#commit" => (t, s("repo")?, s("rev")?),
        "#sync" => (t, s("did")?, s("rev")?),
        "#identity" | "#account" => (t, s("did")?, s("time")?),
        _ => return None,
    })
}

fn want() -> Vec<Key> {
    testkit::skewed_fixture_frames()
        .iter()
        .filter_map(|f| consumer::Event::from_bytes(f, relay_client::RelayRole::Primary).ok().flatten())
        .filter_map(|e| {
            let mut j = String::new();
            e.render_json(&mut j);
            key_of(&serde_json::from_str(&j).ok()?)
        })
        .collect()
}

/// Key → (count, relays it came from), over the whole lines of a jsonl file.
fn got(path: &Path) -> BTreeMap<Key, (usize, Vec<String>)> {
    let mut m: BTreeMap<Key, (usize, Vec<String>)> = BTreeMap::new();
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let whole = text.rfind('\n').map_or("", |i| &text[..=i]);
    for line in whole.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("every line is JSON");
        if let Some(k) = key_of(&v["event"]) {
            let e = m.entry(k).or_default();
            e.0 += 1;
            e.1.push(v["relay"].as_str().unwrap_or("").to_owned());
        }
    }
    m
}

/// Two relays paced at `rate`: the primary as captured, the secondary renumbered from
/// 1,000,001 and reinterleaved, keeping only its latest `window` events.
async fn relays(rate: u32, window: usize) -> (RelaySim, RelaySim) {
    let frames = testkit::skewed_fixture_frames();
    let paced = SimConfig { initial_head: Some(0), rate: Some(rate), ..SimConfig::default() };
    let addr = "127.0.0.1:0".parse().expect("addr");
    let primary = RelaySim::start_with(frames.clone(), paced.clone(), addr).await.expect("primary");
    let other = relay_sim::reseq(&frames, 1_000_000, 16, 7);
    let cfg = SimConfig { window_len: Some(window), ..paced };
    let secondary = RelaySim::start_with(other, cfg, addr).await.expect("secondary");
    (primary, secondary)
}

struct Run {
    env: HashMap<String, String>,
    out: PathBuf,
    log: PathBuf,
    http: String,
}

fn setup(name: &str, primary: &RelaySim, secondary: &RelaySim) -> Run {
    let dir = tmpdir(name);
    let mut env = base_env(&primary.url(), &dir);
    let http = format!("127.0.0.1:{}", free_port());
    let out = dir.join("events.jsonl");
    for (k, v) in [
        ("FIREKEEPER_RELAY_SECONDARY", secondary.url()),
        ("FIREKEEPER_HTTP_ADDR", http.clone()),
        ("FIREKEEPER_JSONL_PATH", out.to_string_lossy().into_owned()),
        ("FIREKEEPER_FAILOVER_AFTER", "2".into()),
        ("FIREKEEPER_PROBE_INTERVAL_MS", "300".into()),
    ] {
        env.insert(k.into(), v);
    }
    let o = run_once(&env, &["cursor", "set", "0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    Run { env, out, log: dir.join("firekeeper.log"), http }
}

async fn status(http: &str) -> serde_json::Value {
    let (_, body) = http_get(http, "/status").await.unwrap_or_default();
    serde_json::from_str(&body).unwrap_or(serde_json::Value::Null)
}

async fn ready(http: &str) -> Option<u16> {
    http_get(http, "/readyz").await.map(|r| r.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_shorter_than_the_overlap_with_the_primary_back_at_70_percent_loses_nothing_and_never_exits() {
    let want = want();
    let (primary, secondary) = relays(80, 400).await;
    let r = setup("switch-e2e-short", &primary, &secondary);
    let mut fk = firekeeper(&r.env, &[], &r.log);
    let n = want.len();
    eventually("40 % delivered", WAIT, async || got(&r.out).len() >= n * 2 / 5).await;
    primary.handle().set_down(true);
    eventually("70 % published", WAIT, async || secondary.handle().head_seq() >= 1_000_000 + (n * 7 / 10) as u64).await;
    assert!(fk.try_wait().expect("wait").is_none(), "still running while on the secondary");
    let on_secondary = status(&r.http).await;
    assert_eq!(on_secondary["relay"], "secondary", "{on_secondary}");
    primary.handle().set_down(false);
    eventually("every event", WAIT, async || got(&r.out).len() >= n).await;
    eventually("back on the primary", WAIT, async || status(&r.http).await["relay"] == "primary").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(fk.try_wait().expect("wait").is_none(), "never exited");
    let (_, metrics) = http_get(&r.http, "/metrics").await.expect("metrics");
    let exit = sigterm_and_wait(fk);
    let log = std::fs::read_to_string(&r.log).unwrap_or_default();
    assert!(exit.success(), "{exit:?}\n{log}");
    let got = got(&r.out);
    assert_exactly_once(&got, &want);
    assert!(got.values().any(|(_, relays)| relays.iter().any(|x| x == "secondary")), "the secondary served some");
    // The window reaches back into what was handed over: the start is shown by content,
    // not taken at the window's start for want of a clock.
    assert!(log.contains("the events before it shown handed over"), "{log}");
    assert!(metrics.contains("firekeeper_relay_switches_total"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_gap_under_gap_fail_refuses_the_switch_stays_leader_not_ready_and_loses_nothing() {
    let want = want();
    let (primary, secondary) = relays(80, 10).await;
    let r = setup("switch-e2e-refused", &primary, &secondary);
    let mut fk = firekeeper(&r.env, &[], &r.log);
    let n = want.len();
    eventually("ready", WAIT, async || ready(&r.http).await == Some(200)).await;
    eventually("40 % delivered", WAIT, async || got(&r.out).len() >= n * 2 / 5).await;
    primary.handle().set_down(true);
    eventually("the refused switch in /status", WAIT, async || status(&r.http).await["refused_switch"].is_string())
        .await;
    let s = status(&r.http).await;
    let refused = s["refused_switch"].as_str().unwrap_or_default().to_owned();
    assert!(refused.contains("secondary") && refused.contains("2026-12-02T"), "{refused}");
    assert_eq!((s["role"].as_str(), s["relay"].as_str()), (Some("leader"), Some("primary")), "{s}");
    assert_eq!(ready(&r.http).await, Some(503), "not ready while refused");
    // The outage goes on past several probe intervals: still leading, never exiting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(fk.try_wait().expect("wait").is_none(), "the process never exits");
    let during = got(&r.out);
    assert!(during.values().all(|(_, relays)| relays.iter().all(|x| x == "primary")), "nothing from the secondary");
    primary.handle().set_down(false);
    eventually("every event", WAIT, async || got(&r.out).len() >= n).await;
    eventually("ready again", WAIT, async || ready(&r.http).await == Some(200)).await;
    assert!(status(&r.http).await["refused_switch"].is_null());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let exit = sigterm_and_wait(fk);
    assert!(exit.success(), "{exit:?}");
    assert_exactly_once(&got(&r.out), &want);
}
