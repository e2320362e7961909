//! The safety defects of issue 9, each reproduced against the real binary: a full
//! watermark window, a redirecting webhook, `FUTURE_CURSOR=live`, an undecodable event
//! with a seq, a frozen leader with batches waiting for the jsonl lock, and a missing
//! cursor after earlier terms. Every test here failed on the code before the fix.

use std::collections::BTreeSet;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use relay_sim::{RelaySim, SimConfig, capture};
use testkit::http::http_get;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait, sim, wait_exit};
use testkit::{RedisServer, free_port};
use testkit::{WAIT, eventually, fixture_frames as fixture, tmpdir};
use tokio::io::AsyncWriteExt;

const TOTAL: u64 = 1476;

/// One HTTP request: its request line and body. `None` when the peer closed first.
async fn read_http(s: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    testkit::http::read_request_with_line(s, &mut Vec::new()).await
}

async fn answer(s: &mut tokio::net::TcpStream, status: &str, extra: &str) {
    let _ = s
        .write_all(format!("HTTP/1.1 {status}\r\n{extra}content-length: 0\r\nconnection: close\r\n\r\n").as_bytes())
        .await;
}

/// seqs in ndjson bodies.
fn seqs_of(bodies: &[String]) -> BTreeSet<u64> {
    bodies
        .iter()
        .flat_map(|b| b.lines())
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("ndjson")["seq"].as_u64().expect("seq"))
        .collect()
}

/// seqs in a jsonl file.
fn seqs_in(path: &Path) -> BTreeSet<u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["seq"].as_u64())
        .collect()
}

fn cursor_shown(env: &std::collections::HashMap<String, String>) -> String {
    String::from_utf8_lossy(&run_once(env, &["cursor", "show"]).stdout).trim().to_owned()
}

fn log_of(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_default()
}

/// A webhook that holds its first request for `hold`, then accepts everything; the
/// bodies it accepted.
async fn holding_webhook(hold: Duration) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let accepted = Arc::new(Mutex::new(Vec::<String>::new()));
    let acc = accepted.clone();
    tokio::spawn(async move {
        let mut n = 0u32;
        while let Ok((mut s, _)) = listener.accept().await {
            n += 1;
            let (acc, first) = (acc.clone(), n == 1);
            tokio::spawn(async move {
                let Some((_, body)) = read_http(&mut s).await else { return };
                if first {
                    // The slow request: intake and the other lanes go on meanwhile.
                    tokio::time::sleep(hold).await;
                }
                acc.lock().expect("lock").push(String::from_utf8_lossy(&body).into_owned());
                answer(&mut s, "200 OK", "").await;
            });
        }
    });
    (url, accepted)
}

/// Runs the binary with the webhook sink over the whole fixture until the cursor reaches
/// its end; returns the seqs the webhook accepted.
async fn webhook_run(name: &str, hold: Duration, extra: &[(&str, &str)]) -> BTreeSet<u64> {
    let (url, accepted) = holding_webhook(hold).await;
    let relay = sim(None).await;
    let dir = tmpdir(name);
    let mut env = base_env(&relay.url(), &dir);
    env.insert("FIREKEEPER_SINK".into(), "webhook".into());
    env.insert("FIREKEEPER_WEBHOOK_URL".into(), url);
    for (k, v) in extra {
        env.insert((*k).into(), (*v).into());
    }
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("run.log"));
    eventually("the cursor at the end of the fixture", WAIT, async || {
        cursor_shown(&env).ends_with(&format!("cursor {TOTAL}"))
    })
    .await;
    assert!(sigterm_and_wait(child).success(), "{}", log_of(&dir, "run.log"));

    seqs_of(&accepted.lock().expect("lock"))
}

/// Defect 1: one held request filled the watermark window with finished events behind
/// it; the refused deliveries were skipped and later commits passed them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_webhook_request_fills_the_window_and_no_event_is_skipped() {
    let small = [("FIREKEEPER_WEBHOOK_BATCH", "10"), ("FIREKEEPER_QUEUE_DEPTH", "8"), ("FIREKEEPER_LANES", "4")];
    let got = webhook_run("window", Duration::from_secs(3), &small).await;
    let all: BTreeSet<u64> = (1..=TOTAL).collect();
    assert_eq!(
        all.difference(&got).count(),
        0,
        "seqs committed past but never delivered: {:?}",
        all.difference(&got).next()
    );
}

/// The same with one lane and a collection filter: events the filter drops are done at
/// once and pile up in the window behind the held batch (the review's Postgres case).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filtered_events_piling_up_behind_a_slow_batch_do_not_push_kept_events_out() {
    let cfg = [
        ("FIREKEEPER_WEBHOOK_BATCH", "10"),
        ("FIREKEEPER_QUEUE_DEPTH", "64"),
        ("FIREKEEPER_LANES", "1"),
        ("FIREKEEPER_COLLECTIONS", "app.bsky.feed.like"),
    ];
    let want = webhook_run("filter-ref", Duration::ZERO, &cfg).await;
    assert!(!want.is_empty() && want.len() < TOTAL as usize / 2, "the filter keeps a minority: {}", want.len());
    let got = webhook_run("filter", Duration::from_secs(3), &cfg).await;
    assert_eq!(
        want.difference(&got).count(),
        0,
        "kept events never delivered (of {}): first {:?}",
        want.len(),
        want.difference(&got).next()
    );
}

/// Defect 2: a 302 turned the POST into a body-less GET whose 200 moved the cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirecting_webhook_is_a_failure_and_moves_nothing() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let url = format!("http://user:hunter2@{addr}/hook");
    let (redirected, landed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (r, l) = (redirected.clone(), landed.clone());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (r, l) = (r.clone(), l.clone());
            tokio::spawn(async move {
                let Some((line, _)) = read_http(&mut s).await else { return };
                if line.contains("/hook") {
                    r.fetch_add(1, Ordering::SeqCst);
                    answer(&mut s, "302 Found", &format!("location: http://{addr}/landing?key=secret\r\n")).await;
                } else {
                    l.fetch_add(1, Ordering::SeqCst);
                    answer(&mut s, "200 OK", "").await;
                }
            });
        }
    });
    let relay = sim(None).await;
    let dir = tmpdir("redirect");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("FIREKEEPER_SINK".into(), "webhook".into());
    env.insert("FIREKEEPER_WEBHOOK_URL".into(), url);
    env.insert("FIREKEEPER_DRAIN_BUDGET_MS".into(), "1000".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("redirect.log"));
    eventually("three redirected POSTs", WAIT, async || redirected.load(Ordering::SeqCst) >= 3).await;
    let status = tokio::task::spawn_blocking(move || sigterm_and_wait(child)).await.expect("join");
    assert_eq!(status.code(), Some(1), "the drain cannot finish: nothing was delivered");
    assert_eq!(landed.load(Ordering::SeqCst), 0, "the redirect was never followed");
    assert!(cursor_shown(&env).ends_with("cursor 0"), "nothing committed: {}", cursor_shown(&env));
    let log = log_of(&dir, "redirect.log");
    assert!(log.contains("HTTP 302"), "the log names the status:\n{log}");
    assert!(!log.contains("hunter2") && !log.contains("secret"), "no credentials or query strings in logs");
}

/// Defect 3: after going live the watermark still started at the rejected cursor and
/// refused every live seq at or below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn future_cursor_live_rewinds_the_cursor_fenced_and_delivers_the_live_events() {
    let relay = RelaySim::start(fixture()).await.expect("sim");
    let h = relay.handle();
    let dir = tmpdir("live");
    let mut env = base_env(&relay.url(), &dir);
    let out = dir.join("live.jsonl");
    let http = format!("127.0.0.1:{}", free_port());
    env.insert("FIREKEEPER_FUTURE_CURSOR".into(), "live".into());
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    env.insert("FIREKEEPER_HTTP_ADDR".into(), http.clone());
    assert!(run_once(&env, &["cursor", "set", "5000"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("live.log"));
    eventually("a live (cursor-less) connection after FutureCursor", WAIT, async || {
        let c = h.cursors();
        c.contains(&Some(5000)) && c.contains(&None) && h.open_connections() == 1
    })
    .await;
    // The relay goes on numbering from its own head, far below the rejected cursor.
    let frames = fixture();
    for (i, f) in frames.iter().take(100).enumerate() {
        h.publish(relay_sim::with_seq(f, TOTAL + 1 + i as u64).expect("renumber"));
    }
    let want: BTreeSet<u64> = (TOTAL + 1..=TOTAL + 100).collect();
    eventually("the 100 live events in the sink", WAIT, async || seqs_in(&out) == want).await;
    let (_, metrics) = http_get(&http, "/metrics").await.expect("metrics");
    assert!(metrics.contains("firekeeper_gaps_total{reason=\"future_cursor\"} 1"), "{metrics}");
    assert!(sigterm_and_wait(child).success());
    assert!(
        cursor_shown(&env).ends_with(&format!("cursor {}", TOTAL + 100)),
        "the stored cursor was rewound below the rejected 5000: {}",
        cursor_shown(&env)
    );
    let log = log_of(&dir, "live.log");
    assert!(log.contains("accepted gap") && log.contains("\"live_from\":1477"), "the gap is logged with its range");
}

/// The fixture with frame `i` made undecodable (its header's `op` set to 7) while its seq
/// stays readable.
fn with_undecodable(i: usize) -> Vec<Bytes> {
    let mut frames = fixture();
    let mut bad = frames[i].to_vec();
    let at = bad.windows(3).position(|w| w == [0x62, b'o', b'p']).expect("op key");
    bad[at + 3] = 0x07;
    frames[i] = Bytes::from(bad);
    frames
}

/// Defect 5: an event with a seq that could not be decoded was skipped and committed
/// past. The default now stops before it; `skip` is the explicit opt-in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_event_stops_the_leader_before_it_unless_skip_is_chosen() {
    let relay = RelaySim::start(with_undecodable(699)).await.expect("sim");
    let dir = tmpdir("badframe");
    let mut env = base_env(&relay.url(), &dir);
    let out = dir.join("fail.jsonl");
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("fail.log"));
    let status = tokio::task::spawn_blocking(move || wait_exit(child)).await.expect("join");
    let log = log_of(&dir, "fail.log");
    assert_eq!(status.code(), Some(1), "stops with an error:\n{log}");
    assert!(log.contains("seq 700") && log.contains("FIREKEEPER_BAD_FRAME=skip"), "names the seq and the way out");
    assert_eq!(seqs_in(&out), (1..700).collect::<BTreeSet<u64>>(), "everything before it, nothing after");
    assert!(cursor_shown(&env).ends_with("cursor 699"), "committed up to it: {}", cursor_shown(&env));

    // With skip chosen, it is counted and stepped over.
    let out = dir.join("skip.jsonl");
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    env.insert("FIREKEEPER_BAD_FRAME".into(), "skip".into());
    let child = firekeeper(&env, &[], &dir.join("skip.log"));
    let want: BTreeSet<u64> = (1..=TOTAL).filter(|&s| s != 700).collect();
    eventually("every other event", WAIT, async || seqs_in(&out).len() == want.len() - 699).await;
    assert!(sigterm_and_wait(child).success());
    let mut got = seqs_in(&dir.join("fail.jsonl"));
    got.extend(seqs_in(&out));
    assert_eq!(got, want);
    assert!(cursor_shown(&env).ends_with(&format!("cursor {TOTAL}")));
}

/// Reads a FIFO on a thread, only while `open` is set; returns the bytes read so far.
fn fifo_reader(path: PathBuf, open: Arc<AtomicBool>) -> Arc<Mutex<Vec<u8>>> {
    let data = Arc::new(Mutex::new(Vec::new()));
    let d = data.clone();
    std::thread::spawn(move || {
        let Ok(mut f) = std::fs::File::open(&path) else { return };
        let mut buf = vec![0u8; 1 << 16];
        loop {
            if !open.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            match f.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => d.lock().expect("data").extend_from_slice(&buf[..n]),
            }
        }
    });
    data
}

async fn status_of(http: &str) -> Option<serde_json::Value> {
    let (code, body) = http_get(http, "/status").await?;
    (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
}

async fn wait_role(http: &str, role: &str) -> serde_json::Value {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(s) = status_of(http).await
            && s["role"] == role
        {
            return s;
        }
        assert!(Instant::now() < deadline, "{http} never became {role}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Defect 6: lanes checked the deadline, then waited for the jsonl lock and wrote
/// without checking again, so after SIGSTOP/SIGCONT every lane's batch landed. Now only
/// the one write in progress when the process froze may complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_writes_none_of_the_batches_waiting_for_the_jsonl_lock_after_waking() {
    let redis = RedisServer::start();
    let frames = capture::repeat(&fixture(), 3);
    let relay =
        RelaySim::start_with(frames, SimConfig::default(), "127.0.0.1:0".parse().expect("addr")).await.expect("sim");
    let dir = tmpdir("frozen");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("REDIS_URL".into(), redis.url());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let fifo = dir.join("a.jsonl");
    assert!(Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
    let reading = Arc::new(AtomicBool::new(false));
    let data = fifo_reader(fifo.clone(), reading.clone());
    let (http_a, http_b) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let mut env_a = env.clone();
    env_a.insert("FIREKEEPER_JSONL_PATH".into(), fifo.to_string_lossy().into_owned());
    env_a.insert("FIREKEEPER_HTTP_ADDR".into(), http_a.clone());
    let a = firekeeper(&env_a, &[], &dir.join("a.log"));
    let t = wait_role(&http_a, "leader").await["token"].as_u64().expect("token");
    // The pipe fills; one lane blocks writing, the others queue full batches behind the
    // file lock.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut env_b = env.clone();
    env_b.insert("FIREKEEPER_JSONL_PATH".into(), dir.join("b.jsonl").to_string_lossy().into_owned());
    env_b.insert("FIREKEEPER_HTTP_ADDR".into(), http_b.clone());
    let b = firekeeper(&env_b, &[], &dir.join("b.log"));
    wait_role(&http_b, "standby").await;
    testkit::sigstop(a.id());
    let t2 = wait_role(&http_b, "leader").await["token"].as_u64().expect("token");
    assert!(t2 > t);
    // Empty the pipe while `a` is frozen: that is what it wrote before the freeze.
    reading.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = data.lock().expect("data").len();
    assert!(before > 0, "the leader had written before it froze");
    assert!(Command::new("kill").args(["-CONT", &a.id().to_string()]).status().expect("kill").success());
    wait_role(&http_a, "standby").await;
    // Let whatever it still writes arrive.
    let mut last = usize::MAX;
    while data.lock().expect("data").len() != last {
        last = data.lock().expect("data").len();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let all = data.lock().expect("data").clone();
    let after_lines = all[before..].split(|&b| b == b'\n').count() - 1;
    eprintln!("{before} bytes before the freeze; {after_lines} lines after waking");
    assert!(
        after_lines <= 512,
        "{after_lines} lines landed after waking: more than the one batch (512) whose write was in progress"
    );
    let text = String::from_utf8_lossy(&all);
    assert!(
        text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).all(|v| v["token"] == t),
        "only the frozen term's token"
    );
    assert!(sigterm_and_wait(b).success());
    // Dropping a `Child` does not kill it: a leftover process would keep dialling this
    // test's Redis port and join whatever cluster binds it next.
    assert!(sigterm_and_wait(a).success(), "the woken standby exits cleanly");
}

/// Defect 8: a missing cursor after earlier terms (the store lost it) silently started
/// from the live tail. Issue 40: the replica runs on another disk (its shadow file knows
/// nothing) and there is no `FIREKEEPER_START`: it refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_cursor_after_earlier_terms_stops_instead_of_skipping_to_the_live_tail() {
    let redis = RedisServer::start();
    let relay = sim(None).await;
    let dir = tmpdir("lost");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("REDIS_URL".into(), redis.url());
    env.insert("FIREKEEPER_SINK".into(), "null".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let a = firekeeper(&env, &[], &dir.join("a.log"));
    eventually("the first term to commit everything", WAIT, async || {
        cursor_shown(&env).ends_with(&format!("cursor {TOTAL}"))
    })
    .await;
    assert!(sigterm_and_wait(a).success());
    // The store loses the cursor (eviction, a partial restore), the fence counter stays;
    // the next replica runs on another machine (nothing in its shadow file).
    let mut admin = redis.admin();
    let fp = relay_client::RelayUrl::parse(&relay.url()).expect("url").fingerprint().to_owned();
    let _: () = redis::cmd("DEL").arg(format!("{{firekeeper}}:cursor:{fp}")).query(&mut admin).expect("del");
    env.insert("FIREKEEPER_DATA_DIR".into(), dir.join("elsewhere").to_string_lossy().into_owned());
    let b = firekeeper(&env, &[], &dir.join("b.log"));
    let status = tokio::task::spawn_blocking(move || wait_exit(b)).await.expect("join");
    let log = log_of(&dir, "b.log");
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("firekeeper cursor set"), "names the command:\n{log}");
    assert!(cursor_shown(&env).ends_with("cursor none"), "nothing was committed from the live tail");
}

/// Defect 4, the relay-switch path: the drain before a switch waited on the term alone, so
/// SIGTERM during a switch with a stuck sink was ignored and the lease held forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_relay_switch_with_a_stuck_sink_still_exits_within_the_budget() {
    // A webhook that accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let hook = format!("http://{}/", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let (primary, secondary) =
        (RelaySim::start(fixture()).await.expect("sim"), RelaySim::start(fixture()).await.expect("sim"));
    let dir = tmpdir("switch-term");
    let mut env = base_env(&primary.url(), &dir);
    for (k, v) in [
        ("FIREKEEPER_RELAY_SECONDARY", secondary.url()),
        ("FIREKEEPER_SINK", "webhook".into()),
        ("FIREKEEPER_WEBHOOK_URL", hook),
        ("FIREKEEPER_WEBHOOK_TIMEOUT_MS", "60000".into()),
        ("FIREKEEPER_QUEUE_DEPTH", "4096".into()),
        ("FIREKEEPER_LANES", "1".into()),
        ("FIREKEEPER_FAILOVER_AFTER", "1".into()),
        ("FIREKEEPER_DRAIN_BUDGET_MS", "1000".into()),
    ] {
        env.insert(k.into(), v);
    }
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("switch.log"));
    // Everything is read into the lane (the sink holds the first batch), then the primary
    // goes away: the leader drains before switching, and that drain cannot finish.
    eventually("the relay connection", WAIT, async || log_of(&dir, "switch.log").contains("relay connected")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    primary.handle().set_down(true);
    eventually("the switch to begin", WAIT, async || log_of(&dir, "switch.log").contains("switching relay")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let status = tokio::task::spawn_blocking(move || sigterm_and_wait(child)).await.expect("join");
    let log = log_of(&dir, "switch.log");
    assert_eq!(status.code(), Some(1), "the drain over budget ends the process:\n{log}");
    assert!(log.contains("drain exceeded"), "{log}");
    assert!(cursor_shown(&env).ends_with("cursor 0"), "nothing was acknowledged");
}

/// The cursor file of the only relay in `data`.
fn cursor_file(dir: &Path) -> PathBuf {
    let cursors = dir.join("data").join("cursors");
    std::fs::read_dir(&cursors)
        .expect("cursors")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("cursor-")))
        .expect("a cursor file")
}

/// Issue 33: a cursor that cannot be read was taken for missing, and in the first term
/// missing meant "start at the live tail" (`cursor set 100`, then `echo 120 >` the file:
/// about 19,200 events skipped, exit 0). Surrounding whitespace is not corruption; a
/// value that is not a cursor refuses to start, in any term, naming where it is kept and
/// the command that fixes it, and nothing is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_file_with_a_newline_is_read_and_one_that_is_not_a_cursor_refuses_to_start() {
    let relay = sim(None).await;
    let dir = tmpdir("corrupt-file");
    let mut env = base_env(&relay.url(), &dir);
    let out = dir.join("out.jsonl");
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    assert!(run_once(&env, &["cursor", "set", "100"]).status.success());
    let file = cursor_file(&dir);
    std::fs::write(&file, "120\n").expect("edit");
    let a = firekeeper(&env, &[], &dir.join("a.log"));
    eventually("every event after 120", WAIT, async || seqs_in(&out).len() as u64 == TOTAL - 120).await;
    assert!(sigterm_and_wait(a).success());
    assert_eq!(seqs_in(&out).first(), Some(&121), "resumed right after the edited cursor");
    std::fs::write(&file, "abc").expect("corrupt");
    std::fs::remove_file(&out).expect("clear");
    let b = firekeeper(&env, &[], &dir.join("b.log"));
    let status = tokio::task::spawn_blocking(move || wait_exit(b)).await.expect("join");
    let log = log_of(&dir, "b.log");
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("is not a cursor") && log.contains(&file.to_string_lossy().into_owned()),
        "names the file:\n{log}"
    );
    assert!(log.contains("firekeeper cursor set --relay primary"), "names the command:\n{log}");
    assert!(seqs_in(&out).is_empty(), "nothing was handed over");
    assert_eq!(std::fs::read_to_string(&file).expect("read"), "abc", "nothing was committed over it");
}

/// The same on Redis, in the deployment's very first term (token 1): a cursor key set to
/// `abc` refuses to start instead of starting at the live tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_redis_cursor_in_the_first_term_refuses_to_start() {
    let redis = RedisServer::start();
    let relay = sim(None).await;
    let dir = tmpdir("corrupt-redis");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("REDIS_URL".into(), redis.url());
    let out = dir.join("out.jsonl");
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    let fp = relay_client::RelayUrl::parse(&relay.url()).expect("url").fingerprint().to_owned();
    let key = format!("{{firekeeper}}:cursor:{fp}");
    let mut admin = redis.admin();
    let _: () = redis::cmd("SET").arg(&key).arg("abc").query(&mut admin).expect("set");
    let a = firekeeper(&env, &[], &dir.join("a.log"));
    let status = tokio::task::spawn_blocking(move || wait_exit(a)).await.expect("join");
    let log = log_of(&dir, "a.log");
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains(&key), "names the key:\n{log}");
    assert!(log.contains("firekeeper cursor set --relay primary"), "names the command:\n{log}");
    assert!(seqs_in(&out).is_empty(), "nothing from the live tail");
    let stored: String = redis::cmd("GET").arg(&key).query(&mut admin).expect("get");
    assert_eq!(stored, "abc");
}
