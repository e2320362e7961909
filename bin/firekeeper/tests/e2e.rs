//! End to end: the real binary, relay-sim replaying the real capture, real redis-server
//! and `PostgreSQL`, and a webhook receiver that fails sometimes.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use relay_sim::capture;
use testkit::http::http_get;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait, sim, wait_exit};
use testkit::{PgServer, RedisServer, free_port};
use testkit::{WAIT, eventually, fixture_frames as fixture, tmpdir};
use tokio::io::AsyncWriteExt;

const TOTAL: u64 = 1476;

/// seq → how many lines carry it, over all the given jsonl files. Only whole lines
/// count: a file read while its writer is mid-write ends in a partial line.
fn seqs_in(files: &[PathBuf]) -> BTreeMap<u64, usize> {
    let mut m = BTreeMap::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        let whole = text.rfind('\n').map_or("", |i| &text[..=i]);
        for line in whole.lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("every line is JSON");
            assert_eq!(v["seq"], v["event"]["seq"], "envelope and event agree");
            *m.entry(v["seq"].as_u64().expect("seq")).or_insert(0) += 1;
        }
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_land_exactly_once_across_a_graceful_restart() {
    let redis = RedisServer::start();
    let relay = sim(Some(800)).await;
    let dir = tmpdir("restart");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("REDIS_URL".into(), redis.url());
    // Start from the beginning of the capture.
    let out = run_once(&env, &["cursor", "set", "0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (a_out, b_out) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
    let mut env_a = env.clone();
    env_a.insert("FIREKEEPER_JSONL_PATH".into(), a_out.to_string_lossy().into_owned());
    let a = firekeeper(&env_a, &[], &dir.join("a.log"));
    eventually("a to write 300 events", WAIT, async || seqs_in(std::slice::from_ref(&a_out)).len() >= 300).await;
    let mut env_b = env.clone();
    env_b.insert("FIREKEEPER_JSONL_PATH".into(), b_out.to_string_lossy().into_owned());
    let b = firekeeper(&env_b, &[], &dir.join("b.log"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let status = sigterm_and_wait(a);
    assert!(
        status.success(),
        "graceful stop exits 0: {status:?}\n{}",
        std::fs::read_to_string(dir.join("a.log")).unwrap_or_default()
    );
    let files = [a_out.clone(), b_out.clone()];
    eventually("every seq", WAIT, async || seqs_in(&files).keys().next_back() == Some(&TOTAL)).await;
    let status = sigterm_and_wait(b);
    assert!(status.success());
    let seen = seqs_in(&files);
    assert_eq!(seen.len() as u64, TOTAL, "no seq missing");
    let dups: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(dups.is_empty(), "graceful handover must not duplicate: {dups:?}");
    let a_max = seqs_in(&[a_out]).keys().next_back().copied().expect("a wrote");
    let b_min = seqs_in(&[b_out]).keys().next().copied().expect("b wrote");
    assert_eq!(b_min, a_max + 1, "b resumed right after a's final commit");
    let out = run_once(&env, &["cursor", "show"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("cursor {TOTAL}")),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sink_writes_rows_and_cursor_in_one_transaction_and_is_idempotent() {
    let pg = PgServer::start();
    let relay = sim(None).await;
    let dir = tmpdir("pg");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("DATABASE_URL".into(), pg.url());
    env.insert("FIREKEEPER_SINK".into(), "postgres".into());
    env.insert("FIREKEEPER_CURSOR_STORE".into(), "postgres".into());
    let out = run_once(&env, &["cursor", "set", "1000"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("pg");
    tokio::spawn(conn);
    let count = || async {
        let n: i64 = client.query_one("SELECT count(*) FROM firekeeper_events", &[]).await.map_or(0, |r| r.get(0));
        n
    };
    let child = firekeeper(&env, &[], &dir.join("pg.log"));
    let deadline = Instant::now() + WAIT;
    while count().await < 476 {
        assert!(
            Instant::now() < deadline,
            "rows never arrived: {}",
            std::fs::read_to_string(dir.join("pg.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(sigterm_and_wait(child).success());
    let cursor: i64 = client.query_one("SELECT cursor FROM firekeeper_cursors", &[]).await.expect("cursor").get(0);
    assert_eq!(cursor, 1476);
    let (min, max): (i64, i64) = client
        .query_one("SELECT min(seq), max(seq) FROM firekeeper_events", &[])
        .await
        .map(|r| (r.get(0), r.get(1)))
        .expect("range");
    assert_eq!((min, max), (1001, 1476));
    let body: serde_json::Value = client
        .query_one("SELECT body::text FROM firekeeper_events WHERE seq = 1001", &[])
        .await
        .map(|r| serde_json::from_str(r.get::<_, &str>(0)).expect("json"))
        .expect("row");
    assert_eq!(body["seq"], 1001);
    // Replay the same range: nothing inserted twice.
    let out = run_once(&env, &["cursor", "set", "1000"]);
    assert!(out.status.success());
    let child = firekeeper(&env, &[], &dir.join("pg2.log"));
    let deadline = Instant::now() + WAIT;
    loop {
        let c: i64 = client.query_one("SELECT cursor FROM firekeeper_cursors", &[]).await.expect("cursor").get(0);
        if c == 1476 {
            break;
        }
        assert!(Instant::now() < deadline, "replay never finished");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(sigterm_and_wait(child).success());
    assert_eq!(count().await, 476, "idempotent on replay");
    // The lease loses its counter (data dir wiped): tokens are seeded above what the
    // cursor table saw, so the new leader is not refused forever.
    std::fs::remove_dir_all(dir.join("data")).expect("wipe lease state");
    assert!(run_once(&env, &["cursor", "set", "1400"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("pg3.log"));
    let deadline = Instant::now() + WAIT;
    loop {
        let c: i64 = client.query_one("SELECT cursor FROM firekeeper_cursors", &[]).await.expect("cursor").get(0);
        if c == 1476 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a fresh lease store must not lock the leader out: {}",
            std::fs::read_to_string(dir.join("pg3.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(sigterm_and_wait(child).success());
}

/// A webhook receiver that answers 500 to every third request; returns accepted bodies.
async fn flaky_webhook() -> (String, Arc<Mutex<Vec<String>>>, Arc<Mutex<u32>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let failures = Arc::new(Mutex::new(0u32));
    let (acc, fails) = (accepted.clone(), failures.clone());
    tokio::spawn(async move {
        let mut n = 0u32;
        loop {
            let Ok((mut s, _)) = listener.accept().await else { return };
            n += 1;
            let fail = n.is_multiple_of(3);
            let (acc, fails) = (acc.clone(), fails.clone());
            tokio::spawn(async move {
                let Some(body) = testkit::http::read_request(&mut s, &mut Vec::new()).await else { return };
                let status = if fail {
                    *fails.lock().expect("lock") += 1;
                    "500 Internal Server Error"
                } else {
                    acc.lock().expect("lock").push(String::from_utf8_lossy(&body).into_owned());
                    "200 OK"
                };
                let _ = s
                    .write_all(
                        format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").as_bytes(),
                    )
                    .await;
            });
        }
    });
    (url, accepted, failures)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_sink_retries_failures_and_commits_only_after_2xx() {
    let (url, accepted, failures) = flaky_webhook().await;
    let relay = sim(None).await;
    let dir = tmpdir("hook");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("FIREKEEPER_SINK".into(), "webhook".into());
    env.insert("FIREKEEPER_WEBHOOK_URL".into(), url);
    env.insert("FIREKEEPER_WEBHOOK_BATCH".into(), "50".into());
    let out = run_once(&env, &["cursor", "set", "0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let child = firekeeper(&env, &[], &dir.join("hook.log"));
    let got = || -> BTreeMap<u64, usize> {
        let mut m = BTreeMap::new();
        for body in accepted.lock().expect("lock").iter() {
            for line in body.lines() {
                let v: serde_json::Value = serde_json::from_str(line).expect("ndjson");
                *m.entry(v["seq"].as_u64().expect("seq")).or_insert(0) += 1;
            }
        }
        m
    };
    eventually("all events accepted by the webhook", WAIT, async || got().len() as u64 == TOTAL).await;
    assert!(sigterm_and_wait(child).success());
    assert!(*failures.lock().expect("lock") > 0, "the receiver did fail some requests");
    let out = run_once(&env, &["cursor", "show"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("cursor {TOTAL}")));
}

#[test]
fn config_errors_name_every_bad_variable_and_exit_2() {
    let env: HashMap<String, String> = [
        ("FIREKEEPER_RELAY", "ftp://u:secret@host"),
        ("FIREKEEPER_LEASE_TTL_MS", "-4"),
        ("FIREKEEPER_SINK", "webhook"),
        ("FIREKEEPER_TYPO", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let out = run_once(&env, &["check-config"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for name in ["FIREKEEPER_RELAY", "FIREKEEPER_LEASE_TTL_MS", "FIREKEEPER_WEBHOOK_URL", "FIREKEEPER_TYPO"] {
        assert!(err.contains(name), "{name} not named in:\n{err}");
    }
    assert!(!err.contains("secret"), "credentials leaked:\n{err}");
    let ok = run_once(&HashMap::new(), &["check-config"]);
    assert!(ok.status.success());
    assert!(String::from_utf8_lossy(&ok.stdout).contains("configuration ok"));
}

/// The binary runs on jemalloc with the settings of `.cargo/config.toml` (freed pages back
/// within 500 ms: without them resident memory doubles under load; one arena: less CPU
/// and memory when events are freed on another thread than the one that allocated them).
#[test]
fn the_binary_allocates_through_jemalloc_with_the_shipped_settings() {
    let env: HashMap<String, String> = [("_RJEM_MALLOC_CONF".to_owned(), "stats_print:true".to_owned())].into();
    let out = run_once(&env, &["settings"]);
    assert!(out.status.success());
    let stats = String::from_utf8_lossy(&out.stderr);
    for want in ["opt.dirty_decay_ms: 500", "opt.muzzy_decay_ms: 0", "opt.narenas: 1"] {
        assert!(stats.contains(want), "{want} not in jemalloc's statistics:\n{}", &stats[..stats.len().min(2000)]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_status_are_scraped_while_leading() {
    let relay = sim(None).await;
    let dir = tmpdir("metrics");
    let mut env = base_env(&relay.url(), &dir);
    let addr = format!("127.0.0.1:{}", free_port());
    env.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
    env.insert("FIREKEEPER_SINK".into(), "null".into());
    let out = run_once(&env, &["cursor", "set", "0"]);
    assert!(out.status.success());
    let child = firekeeper(&env, &[], &dir.join("m.log"));
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some((200, body)) = http_get(&addr, "/status").await {
            let v: serde_json::Value = serde_json::from_str(&body).expect("status json");
            if v["committed"] == TOTAL {
                break v;
            }
        }
        assert!(Instant::now() < deadline, "status never showed the full cursor");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status["role"], "leader");
    assert_eq!(status["relay"], "primary");
    assert!(status["token"].as_u64().is_some());
    let (code, mut metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    assert_eq!(code, 200);
    // The committed-seq gauge follows the status at the next tick.
    let deadline = Instant::now() + WAIT;
    let renewed = "firekeeper_lease_renew_seconds_bucket{le=\"0.005\"}";
    while !(metrics.contains("firekeeper_committed_seq 1476") && metrics.contains(renewed)) && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        metrics = http_get(&addr, "/metrics").await.expect("metrics").1;
    }
    for m in [
        "firekeeper_events_total{type=\"#commit\"} 1374",
        "firekeeper_leader 1",
        "firekeeper_commits_total{outcome=\"saved\"}",
        "firekeeper_uncommitted_seq 0",
        "firekeeper_committed_seq 1476",
        "firekeeper_relay_connected 1",
        "# TYPE firekeeper_lease_renew_seconds histogram",
        renewed,
        concat!("firekeeper_build_info{version=\"", env!("CARGO_PKG_VERSION"), "\"} 1"),
    ] {
        assert!(metrics.contains(m), "{m} missing from /metrics:\n{metrics}");
    }
    assert_eq!(http_get(&addr, "/healthz").await.map(|r| r.0), Some(200));
    assert_eq!(http_get(&addr, "/readyz").await.map(|r| r.0), Some(200));
    assert!(sigterm_and_wait(child).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_records_frames_relay_sim_can_replay() {
    let relay = sim(None).await;
    let dir = tmpdir("capture");
    let env = base_env(&relay.url(), &dir);
    let file = dir.join("cap.frames");
    let file_s = file.to_string_lossy().into_owned();
    let out =
        tokio::task::spawn_blocking(move || run_once(&env, &["capture", &file_s, "--cursor", "10", "--limit", "100"]))
            .await
            .expect("join");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = capture::read(&file).expect("a valid capture file");
    let want = fixture();
    assert_eq!(got.len(), 100);
    assert_eq!(&got[..], &want[10..110], "byte for byte the relay's frames after the cursor");
}

/// A webhook that accepts connections and never answers.
async fn black_hole() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_over_budget_exits_1_and_a_second_signal_forces_exit() {
    let url = black_hole().await;
    let relay = sim(None).await;
    let dir = tmpdir("stuck");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("FIREKEEPER_SINK".into(), "webhook".into());
    env.insert("FIREKEEPER_WEBHOOK_URL".into(), url);
    env.insert("FIREKEEPER_WEBHOOK_TIMEOUT_MS".into(), "60000".into());
    env.insert("FIREKEEPER_DRAIN_BUDGET_MS".into(), "1000".into());
    // A lane holding one event: intake is blocked on a full lane when the signal comes,
    // and that wait must end on shutdown too.
    env.insert("FIREKEEPER_QUEUE_DEPTH".into(), "1".into());
    env.insert("FIREKEEPER_LANES".into(), "1".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    // One signal: the drain cannot finish, the budget runs out, exit 1, nothing committed.
    let c = firekeeper(&env, &[], &dir.join("stuck.log"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(Command::new("kill").args(["-TERM", &c.id().to_string()]).status().expect("kill").success());
    let s = tokio::task::spawn_blocking(move || wait_exit(c)).await.expect("join");
    assert_eq!(s.code(), Some(1), "{}", std::fs::read_to_string(dir.join("stuck.log")).unwrap_or_default());
    let log = std::fs::read_to_string(dir.join("stuck.log")).unwrap_or_default();
    assert!(log.contains("drain exceeded"), "{log}");
    let out = run_once(&env, &["cursor", "show"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("cursor 0"), "no event was acknowledged, so nothing moved");
    // Two signals: the second exits at once with 130.
    let mut env2 = env.clone();
    env2.insert("FIREKEEPER_DRAIN_BUDGET_MS".into(), "15000".into());
    env2.insert("FIREKEEPER_DATA_DIR".into(), dir.join("data2").to_string_lossy().into_owned());
    assert!(run_once(&env2, &["cursor", "set", "0"]).status.success());
    let c = firekeeper(&env2, &[], &dir.join("forced.log"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let pid = c.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let s = tokio::task::spawn_blocking(move || wait_exit(c)).await.expect("join");
    assert_eq!(s.code(), Some(130));
}

/// A stop asked while the replica is still starting (its jsonl output is a FIFO nobody
/// reads yet, so opening it blocks) is a graceful stop once the start is done: exit 0,
/// not death by the signal's default action. Before the listeners were installed first,
/// a replica sent SIGTERM between its lease becoming visible and its first poll of the
/// shutdown future died of SIGTERM (`operator::cursor_set_refuses…`, with repo sync on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_asked_while_starting_is_graceful() {
    let relay = sim(None).await;
    let dir = tmpdir("stop-starting");
    let mut env = base_env(&relay.url(), &dir);
    let fifo = dir.join("out.fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
    env.insert("FIREKEEPER_JSONL_PATH".into(), fifo.to_string_lossy().into_owned());
    let log = dir.join("starting.log");
    let c = firekeeper(&env, &[], &log);
    eventually("the replica says it is starting", WAIT, async || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("\"starting\""))
    })
    .await;
    assert!(Command::new("kill").args(["-TERM", &c.id().to_string()]).status().expect("kill").success());
    // Now let it open its output, and read what it writes until it closes it.
    let reader = std::thread::spawn(move || std::fs::read(&fifo).expect("read the fifo"));
    let s = tokio::task::spawn_blocking(move || wait_exit(c)).await.expect("join");
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(s.code(), Some(0), "{s:?}: {said}");
    assert!(said.contains("shutdown requested"), "{said}");
    drop(reader.join());
}

/// A relay that skipped one commit of a repo: with `FIREKEEPER_CHAIN_BREAKS=emit` the
/// jsonl sink gets one `#chain-break` line naming the repo and the revs, right before the
/// repo's next commit, and `/metrics` counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_commit_reaches_the_sink_as_a_chain_break_and_is_counted() {
    let frames = fixture();
    let commits: Vec<(u64, String, String)> = frames
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            relay_client::Frame::Message(relay_client::Message::Commit(c)) => {
                Some((c.seq, c.repo.to_owned(), c.rev.to_owned()))
            }
            _ => None,
        })
        .collect();
    let (before, gone, next) = (1..commits.len())
        .find_map(|i| {
            let b = commits[..i].iter().rposition(|c| c.1 == commits[i].1)?;
            Some((b, i, commits[i + 1..].iter().position(|c| c.1 == commits[i].1)? + i + 1))
        })
        .expect("a repo with three commits");
    let skipped = commits[gone].0;
    let holed = relay_sim::without(&frames, |m| m.seq() == Some(skipped));
    let relay =
        relay_sim::RelaySim::start_with(holed, relay_sim::SimConfig::default(), "127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("sim");
    let dir = tmpdir("chain-break");
    let mut env = base_env(&relay.url(), &dir);
    let addr = format!("127.0.0.1:{}", free_port());
    let out = dir.join("out.jsonl");
    env.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    env.insert("FIREKEEPER_CHAIN_BREAKS".into(), "emit".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    eventually("the whole stream committed", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/status").await else { return false };
        serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["committed"] == TOTAL)
    })
    .await;
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    assert!(metrics.contains("firekeeper_repo_chain_breaks_total 1\n"), "{metrics}");
    assert!(sigterm_and_wait(child).success());
    let text = std::fs::read_to_string(&out).expect("output");
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    let at: Vec<usize> = (0..lines.len()).filter(|&i| lines[i]["event"]["type"] == "#chain-break").collect();
    assert_eq!(at.len(), 1, "one break");
    let (b, c) = (&lines[at[0]], &lines[at[0] + 1]);
    assert_eq!(b["seq"], commits[next].0);
    assert_eq!(c["seq"], commits[next].0, "the commit that revealed it follows");
    assert_eq!(c["event"]["type"], "#commit");
    let e = &b["event"];
    assert_eq!(
        (e["repo"].as_str(), e["lastRev"].as_str(), e["since"].as_str(), e["rev"].as_str()),
        (Some(&*commits[gone].1), Some(&*commits[before].2), Some(&*commits[gone].2), Some(&*commits[next].2))
    );
    let log = std::fs::read_to_string(dir.join("c.log")).expect("log");
    assert!(log.contains("repo chain broken"), "logged");
}
