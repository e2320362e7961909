//! One sink contract, every sink, through the binary: each scenario is written once and
//! run against jsonl (a file, and stdout to a file), the webhook, Postgres, JetStream and
//! the null sink. What a downstream holds afterwards is read back and compared with what
//! the relay served:
//!
//! - **a relay that renumbered** (`FIREKEEPER_FUTURE_CURSOR=live`: 200 events committed,
//!   then the relay numbers from 1 and serves 100 live events under seqs 51–150): every
//!   event is stored, the live ones too (the Postgres sink stored 0 of the 100);
//! - **the downstream restarted** mid-stream (Postgres, NATS, the webhook's receiver):
//!   every event is stored, once where the sink promises it (the Postgres sink wrote
//!   nothing again after a restart, 201 of 1476 rows after 25 s, and kept the lease);
//! - **a record the downstream cannot store as is** (a NUL character in a handle): nothing
//!   stalls; Postgres keeps it as text, a webhook that refuses it (HTTP 400) gets it as
//!   `#invalid` (`unstorable`) under `FIREKEEPER_BAD_FRAME=skip` (a stream of retries
//!   stalled everything before);
//! - **the downstream gone longer than a write's timeout** (killed for 8 s; a webhook
//!   answering after its timeout for 4 s): every event stored, once where promised;
//! - **a huge record** (1.5 MiB): stored, or refused by JetStream (above its server's
//!   `max_payload`) and handed over as `#invalid` (`unstorable`) instead of retried for ever;
//! - **the downstream refused every write for a while** (a webhook receiver answering 401
//!   or 400 to everything, Postgres refusing the sink's role): every event is stored as
//!   itself, nothing is taken for a bad record;
//! - **Jetstream as the input** (v2, compressed), the downstream restarting mid-stream:
//!   every event stored as Jetstream's JSON, once where promised;
//! - **a repo repaired from its PDS** (chain breaks; the large repo's 20,000 records in five
//!   parts, the webhook's receiver dying in the middle of them): folding what the
//!   downstream holds gives every repo's reference records (Postgres: its records table,
//!   in `resync_e2e`).
//!
//! What each sink promises (README, "Sinks"): Postgres and JetStream store each event
//! once; jsonl and the webhook at least once (a crash repeats what the last commit did
//! not cover; not exercised here); null stores nothing and only moves the cursor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use relay_sim::{RelaySim, SimConfig};
use testkit::http::http_get;
use testkit::proc::{base_env, firekeeper_to, run_once, sigterm_and_wait};
use testkit::{NatsServer, PgServer, WAIT, eventually, free_port, tmpdir};
use tokio::io::AsyncWriteExt;

type Bytes = testkit::bytes_compat::Bytes;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sink {
    JsonlFile,
    JsonlStdout,
    Webhook,
    Postgres,
    JetStream,
    Null,
}

impl Sink {
    /// The downstream drops a replay of an event it holds.
    fn exactly_once(self) -> bool {
        matches!(self, Self::Postgres | Self::JetStream)
    }
}

/// How the test webhook answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HookMode {
    Up,
    /// Connections are closed unanswered (the receiver is down).
    Down,
    /// A batch holding this seq as itself gets HTTP 400.
    Refuse(u64),
    /// Every request gets this status (401: credentials; 400: a receiver broken for a while).
    Answer(u16),
    /// Every request is kept and answered 200 only after 1.5 s (past the sink's timeout).
    Slow,
    /// The next this many requests that carry snapshot records of this repo are dropped
    /// unanswered (a receiver that died in the middle of its snapshot), then `Up`.
    DropRecords(&'static str, u32),
    /// Requests that carry snapshot records of this repo are kept and answered only
    /// after this many ms (a slow downstream for one giant repo).
    SlowRecords(&'static str, u64),
}

/// A webhook receiver that keeps the bodies it accepted.
struct Hook {
    url: String,
    bodies: Arc<Mutex<Vec<String>>>,
    mode: Arc<Mutex<HookMode>>,
}

impl Hook {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let mode = Arc::new(Mutex::new(HookMode::Up));
        let (b, m) = (bodies.clone(), mode.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (b, m) = (b.clone(), m.clone());
                tokio::spawn(async move {
                    let mut pending = Vec::new();
                    while let Some((_, body)) = testkit::http::read_request_with_line(&mut s, &mut pending).await {
                        let body = String::from_utf8_lossy(&body).into_owned();
                        let mode = *m.lock().expect("mode");
                        let status = match mode {
                            HookMode::Down => return,
                            HookMode::SlowRecords(did, ms) if body.contains("\"#record\"") && body.contains(did) => {
                                b.lock().expect("bodies").push(body);
                                tokio::time::sleep(Duration::from_millis(ms)).await;
                                "200 OK".into()
                            }
                            HookMode::DropRecords(did, n) if body.contains("\"#record\"") && body.contains(did) => {
                                let next = if n > 1 { HookMode::DropRecords(did, n - 1) } else { HookMode::Up };
                                *m.lock().expect("mode") = next;
                                return;
                            }
                            HookMode::Refuse(seq) if holds_itself(&body, seq) => "400 Bad Request".into(),
                            HookMode::Answer(code) => format!("{code} Refused"),
                            HookMode::Slow => {
                                b.lock().expect("bodies").push(body);
                                tokio::time::sleep(Duration::from_millis(1500)).await;
                                "200 OK".into()
                            }
                            _ => {
                                b.lock().expect("bodies").push(body);
                                "200 OK".into()
                            }
                        };
                        let head = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
                        if s.write_all(head.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { url, bodies, mode }
    }

    fn set(&self, mode: HookMode) {
        *self.mode.lock().expect("mode") = mode;
    }
}

/// A batch body holds `seq` as itself (not as `#invalid`).
fn holds_itself(body: &str, seq: u64) -> bool {
    body.lines().any(|l| {
        serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| v["seq"] == seq && v["event"]["type"] != "#invalid")
    })
}

/// The downstream a sink writes to, and what it holds.
struct Downstream {
    sink: Sink,
    dir: PathBuf,
    pg: Option<PgServer>,
    nats: Option<NatsServer>,
    hook: Option<Hook>,
}

/// (seq, what the event is) of one stored event.
type Stored = (u64, String);

/// What names an event whatever its seq: type and repo/rev, or DID and time; `#invalid`
/// by repo and seq.
fn key_of(e: &serde_json::Value) -> String {
    let s = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
    // A Jetstream v2 event (Jetstream input): by repo and op, or repo and upstream time.
    if let Some(kind) = e["$type"].as_str().and_then(|t| t.strip_prefix("network.bsky.jetstream.subscribeEvents#")) {
        let inner = |k: &str| e[kind][k].as_str().unwrap_or_default().to_owned();
        return match kind {
            "commit" => {
                format!("jet {kind} {} {} {} {}/{}", s("did"), s("rev"), s("operation"), s("collection"), s("rkey"))
            }
            "sync" => format!("jet {kind} {} {}", s("did"), inner("rev")),
            _ => format!("jet {kind} {} {}", s("did"), inner("time")),
        };
    }
    match e["type"].as_str().unwrap_or_default() {
        t @ "#commit" => format!("{t} {} {}", s("repo"), s("rev")),
        t @ "#sync" => format!("{t} {} {}", s("did"), s("rev")),
        t @ "#invalid" => format!("{t} {} {} {}", s("repo"), e["seq"], s("reason")),
        t => format!("{t} {} {}", s("did"), s("time")),
    }
}

fn from_lines(text: &str) -> Vec<Stored> {
    let whole = text.rfind('\n').map_or("", |i| &text[..=i]);
    whole
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("every line is JSON"))
        .filter(|v| v["event"]["type"] != "#chain-break")
        .map(|v| (v["seq"].as_u64().expect("seq"), key_of(&v["event"])))
        .collect()
}

impl Downstream {
    async fn start(sink: Sink, dir: &Path) -> Self {
        let pg = (sink == Sink::Postgres).then(PgServer::start);
        let nats = (sink == Sink::JetStream).then(NatsServer::start);
        let hook = if sink == Sink::Webhook { Some(Hook::start().await) } else { None };
        Self { sink, dir: dir.to_owned(), pg, nats, hook }
    }

    fn out(&self) -> PathBuf {
        self.dir.join("out.jsonl")
    }

    /// The settings that point the binary at this downstream.
    fn env(&self) -> Vec<(&'static str, String)> {
        match self.sink {
            Sink::JsonlFile => vec![("FIREKEEPER_JSONL_PATH", self.out().to_string_lossy().into_owned())],
            Sink::JsonlStdout => vec![],
            Sink::Webhook => vec![
                ("FIREKEEPER_SINK", "webhook".into()),
                ("FIREKEEPER_WEBHOOK_URL", self.hook.as_ref().expect("hook").url.clone()),
            ],
            Sink::Postgres => vec![
                ("FIREKEEPER_SINK", "postgres".into()),
                ("FIREKEEPER_CURSOR_STORE", "postgres".into()),
                ("DATABASE_URL", self.pg.as_ref().expect("pg").url()),
            ],
            Sink::JetStream => {
                vec![("FIREKEEPER_SINK", "nats".into()), ("NATS_URL", self.nats.as_ref().expect("nats").url())]
            }
            Sink::Null => vec![("FIREKEEPER_SINK", "null".into())],
        }
    }

    /// Restarts the downstream (a failover, an upgrade, an OOM kill), keeping its data.
    async fn restart(&mut self) {
        match self.sink {
            Sink::Postgres => self.pg.as_mut().expect("pg").restart(),
            Sink::JetStream => self.nats.as_mut().expect("nats").restart(),
            Sink::Webhook => {
                let hook = self.hook.as_ref().expect("hook");
                hook.set(HookMode::Down);
                tokio::time::sleep(Duration::from_secs(2)).await;
                hook.set(HookMode::Up);
            }
            Sink::JsonlFile | Sink::JsonlStdout | Sink::Null => {}
        }
    }

    /// Every event the downstream holds, as JSON, in the order it was stored (jsonl, the
    /// webhook and JetStream: what a downstream folds).
    async fn events(&self) -> Vec<serde_json::Value> {
        let lines = |text: &str| -> Vec<serde_json::Value> {
            text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["event"].clone()).collect()
        };
        match self.sink {
            Sink::JsonlFile | Sink::JsonlStdout => lines(&std::fs::read_to_string(self.out()).unwrap_or_default()),
            Sink::Webhook => lines(&self.hook.as_ref().expect("hook").bodies.lock().expect("bodies").concat()),
            Sink::JetStream => {
                let s = self.jetstream().await.expect("the stream");
                let last = s.get_info().await.expect("info").state.last_sequence;
                let mut out = Vec::new();
                for i in 1..=last {
                    let Ok(m) = s.get_raw_message(i).await else { continue };
                    out.push(serde_json::from_slice(&m.payload).expect("JSON body"));
                }
                out
            }
            Sink::Postgres | Sink::Null => unreachable!("{:?} keeps no order to fold", self.sink),
        }
    }

    /// The sink's JetStream stream (`None` before the sink created it).
    async fn jetstream(&self) -> Option<nats_op::async_nats::jetstream::stream::Stream> {
        let cfg = nats_op::NatsConfig {
            url: self.nats.as_ref().expect("nats").url(),
            creds_file: None,
            ca_file: None,
            token: None,
            op_timeout: Duration::from_secs(5),
        };
        let n = nats_op::Nats::connect(&cfg).await.expect("connect");
        n.jetstream().get_stream("FIREKEEPER").await.ok()
    }

    /// Every event the downstream holds.
    async fn stored(&self) -> Vec<Stored> {
        match self.sink {
            Sink::JsonlFile | Sink::JsonlStdout => from_lines(&std::fs::read_to_string(self.out()).unwrap_or_default()),
            Sink::Webhook => from_lines(&self.hook.as_ref().expect("hook").bodies.lock().expect("bodies").concat()),
            Sink::Postgres => {
                let (c, conn) = tokio_postgres::connect(&self.pg.as_ref().expect("pg").url(), tokio_postgres::NoTls)
                    .await
                    .expect("pg");
                tokio::spawn(conn);
                let rows = c
                    .query("SELECT seq, coalesce(body::text, body_text) FROM firekeeper_events", &[])
                    .await
                    .expect("rows");
                rows.iter()
                    .map(|r| {
                        let body: String = r.get(1);
                        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON body");
                        (u64::try_from(r.get::<_, i64>(0)).expect("seq"), key_of(&v))
                    })
                    .collect()
            }
            Sink::JetStream => {
                let Some(s) = self.jetstream().await else { return Vec::new() };
                let last = s.get_info().await.expect("info").state.last_sequence;
                let mut out = Vec::new();
                for i in 1..=last {
                    let Ok(m) = s.get_raw_message(i).await else { continue };
                    let v: serde_json::Value = serde_json::from_slice(&m.payload).expect("JSON body");
                    out.push((v["seq"].as_u64().expect("seq"), key_of(&v)));
                }
                out
            }
            Sink::Null => Vec::new(),
        }
    }
}

/// The binary running against a relay and a downstream.
struct Run {
    http: String,
    child: std::process::Child,
    log: PathBuf,
}

impl Run {
    fn start(relay: &RelaySim, down: &Downstream, extra: &[(&str, &str)]) -> Self {
        let mut env = base_env(&relay.url(), &down.dir);
        let http = format!("127.0.0.1:{}", free_port());
        env.insert("FIREKEEPER_HTTP_ADDR".into(), http.clone());
        for (k, v) in down.env() {
            env.insert(k.into(), v);
        }
        for (k, v) in extra {
            env.insert((*k).into(), (*v).into());
        }
        let o = run_once(&env, &["cursor", "set", "0"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let log = down.dir.join("fk.log");
        let child = firekeeper_to(&env, &[], &log, &down.out());
        Self { http, child, log }
    }

    async fn status(&self) -> serde_json::Value {
        let body = http_get(&self.http, "/status").await.map(|r| r.1).unwrap_or_default();
        serde_json::from_str(&body).unwrap_or(serde_json::Value::Null)
    }

    async fn committed(&self, seq: u64, what: &str) {
        eventually(what, WAIT, async || self.status().await["committed"].as_u64() >= Some(seq)).await;
    }

    fn stop(self) -> String {
        let exit = sigterm_and_wait(self.child);
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        assert!(exit.success(), "{exit:?}\n{log}");
        log
    }
}

/// Checks what the downstream holds against the events the relay served (`want`): every
/// one, and each once where the sink promises it.
fn assert_holds(sink: Sink, got: &[Stored], want: &[Stored]) {
    if sink == Sink::Null {
        return;
    }
    let mut counts: BTreeMap<&Stored, usize> = BTreeMap::new();
    for g in got {
        *counts.entry(g).or_default() += 1;
    }
    let lost: Vec<&Stored> = want.iter().filter(|w| !counts.contains_key(w)).collect();
    assert!(lost.is_empty(), "{sink:?}: {} of {} lost, e.g. {:?}", lost.len(), want.len(), &lost[..lost.len().min(3)]);
    if sink.exactly_once() {
        let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).take(3).collect();
        assert!(twice.is_empty(), "{sink:?}: stored twice {twice:?}");
    }
}

/// (seq, key) of frames as the relay serves them.
fn served(frames: &[Bytes]) -> Vec<Stored> {
    frames
        .iter()
        .filter_map(|f| consumer::Event::from_bytes(f, relay_client::RelayRole::Primary).ok().flatten())
        .map(|e| {
            let mut j = String::new();
            e.render_json(&mut j);
            (e.seq(), key_of(&serde_json::from_str(&j).expect("JSON")))
        })
        .collect()
}

/// 200 events committed, then the relay restarts its numbering: the 50 it publishes while
/// down are a gap (accepted under `live`), the next 100 come as seqs 51–150.
async fn a_relay_that_renumbered(sink: Sink) {
    let frames = testkit::fixture_frames();
    let relay = RelaySim::start_with(
        frames.clone(),
        SimConfig { initial_head: Some(200), ..SimConfig::default() },
        "127.0.0.1:0".parse().expect("addr"),
    )
    .await
    .expect("sim");
    let h = relay.handle();
    let dir = tmpdir(&format!("contract-renumber-{sink:?}"));
    let down = Downstream::start(sink, &dir).await;
    let run = Run::start(&relay, &down, &[("FIREKEEPER_FUTURE_CURSOR", "live")]);
    run.committed(200, "the first 200 committed").await;
    h.set_down(true);
    h.reset_seq(1);
    h.publish_up_to(250);
    h.set_down(false);
    eventually("a live connection after FutureCursor", WAIT, async || h.cursors().contains(&None)).await;
    h.publish_up_to(350);
    eventually("the 100 live events committed", WAIT, async || {
        let s = run.status().await;
        s["committed"].as_u64() == Some(150) && s["in_flight"] == 0
    })
    .await;
    run.stop();
    let mut want = served(&frames[..200]);
    let live: Vec<Bytes> =
        frames[250..350].iter().zip(51..).map(|(f, seq)| relay_sim::with_seq(f, seq).expect("seq")).collect();
    want.extend(served(&live));
    assert_holds(sink, &down.stored().await, &want);
}

/// The fixture, and a relay serving it at 300 events a second from its first event.
async fn paced_relay() -> (Vec<Bytes>, RelaySim) {
    let frames = testkit::fixture_frames();
    let relay = RelaySim::start_with(
        frames.clone(),
        SimConfig { initial_head: Some(0), rate: Some(300), ..SimConfig::default() },
        "127.0.0.1:0".parse().expect("addr"),
    )
    .await
    .expect("sim");
    (frames, relay)
}

/// The downstream restarts while the relay serves 300 events a second.
async fn the_downstream_restarted(sink: Sink) {
    let (frames, relay) = paced_relay().await;
    let dir = tmpdir(&format!("contract-restart-{sink:?}"));
    let mut down = Downstream::start(sink, &dir).await;
    let run = Run::start(&relay, &down, &[]);
    run.committed(400, "400 committed").await;
    down.restart().await;
    run.committed(frames.len() as u64, "every event committed after the restart").await;
    run.stop();
    assert_holds(sink, &down.stored().await, &served(&frames));
}

/// The downstream refuses every write for 3 s while the relay serves 300 events a second:
/// the webhook's receiver answers `code` to every request (401: its credentials changed;
/// 400: a broken deploy), Postgres refuses the sink's role (`NOLOGIN`, its connections
/// ended). Under `FIREKEEPER_BAD_FRAME=skip` nothing may be taken for a bad record: every
/// event is stored as itself (a webhook answering 401 had every event of those seconds
/// handed over as `#invalid` and, refused again, dropped).
async fn the_downstream_refused_every_write_for_a_while(sink: Sink, code: u16) {
    let (frames, relay) = paced_relay().await;
    let dir = tmpdir(&format!("contract-refusing-{sink:?}-{code}"));
    let down = Downstream::start(sink, &dir).await;
    let admin = down.pg.as_ref().map(|pg| {
        let url = pg.url();
        let sink_role = url.replace("postgres://postgres@", "postgres://fksink@");
        (url, sink_role)
    });
    let mut extra = vec![("FIREKEEPER_BAD_FRAME", "skip")];
    if let Some((url, sink_role)) = &admin {
        pg_exec(url, "CREATE ROLE fksink LOGIN SUPERUSER").await;
        extra.push(("DATABASE_URL", sink_role.as_str()));
    }
    let run = Run::start(&relay, &down, &extra);
    run.committed(300, "300 committed").await;
    if let Some(h) = &down.hook {
        h.set(HookMode::Answer(code));
    }
    if let Some((url, _)) = &admin {
        pg_exec(url, "ALTER ROLE fksink NOLOGIN").await;
        pg_exec(url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'fksink'").await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    if let Some(h) = &down.hook {
        h.set(HookMode::Up);
    }
    if let Some((url, _)) = &admin {
        pg_exec(url, "ALTER ROLE fksink LOGIN").await;
    }
    run.committed(frames.len() as u64, "every event committed after the refusals").await;
    run.stop();
    assert_holds(sink, &down.stored().await, &served(&frames));
}

/// Runs one statement as the superuser.
async fn pg_exec(url: &str, sql: &str) {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("pg");
    tokio::spawn(conn);
    c.batch_execute(sql).await.expect(sql);
}

/// The downstream is gone for 8 s, longer than a write's timeout, while the relay serves
/// 300 events a second: Postgres and NATS killed and started again after it, the
/// webhook's receiver answering only after 1.5 s (its timeout set to 1 s) for 4 s. Every
/// event is stored, once where the sink promises it.
async fn the_downstream_was_gone_longer_than_a_write_timeout(sink: Sink) {
    let (frames, relay) = paced_relay().await;
    let dir = tmpdir(&format!("contract-gone-{sink:?}"));
    let mut down = Downstream::start(sink, &dir).await;
    let run = Run::start(&relay, &down, &[("FIREKEEPER_WEBHOOK_TIMEOUT_MS", "1000")]);
    run.committed(300, "300 committed").await;
    match sink {
        Sink::Postgres => down.pg.as_mut().expect("pg").kill(),
        Sink::JetStream => down.nats.as_mut().expect("nats").kill(),
        Sink::Webhook => down.hook.as_ref().expect("hook").set(HookMode::Slow),
        Sink::JsonlFile | Sink::JsonlStdout | Sink::Null => {}
    }
    tokio::time::sleep(Duration::from_secs(if sink == Sink::Webhook { 4 } else { 8 })).await;
    match sink {
        Sink::Postgres => down.pg.as_mut().expect("pg").restart(),
        Sink::JetStream => down.nats.as_mut().expect("nats").restart(),
        Sink::Webhook => down.hook.as_ref().expect("hook").set(HookMode::Up),
        Sink::JsonlFile | Sink::JsonlStdout | Sink::Null => {}
    }
    run.committed(frames.len() as u64, "every event committed after the outage").await;
    run.stop();
    assert_holds(sink, &down.stored().await, &served(&frames));
}

/// The fixture with an `#identity` at seq 700 whose handle is `handle`.
fn with_identity(handle: &str) -> Vec<Bytes> {
    let mut frames = testkit::fixture_frames();
    let mut w = relay_client::cbor::Writer::new();
    w.map(2).str("t").str("#identity").str("op").int(1);
    w.map(4).str("did").str("did:plc:nulnulnulnulnulnulnulnul").str("seq").int(700);
    w.str("time").str("2026-12-02T10:18:24.747Z").str("handle").str(handle);
    frames.insert(699, Bytes::from(w.buf));
    relay_sim::reseq(&frames, 0, 1, 0)
}

/// The fixture with an `#identity` whose handle holds a NUL character at seq 700.
fn with_poison() -> Vec<Bytes> {
    with_identity("bad\u{0}handle.test")
}

/// An event of 1.5 MiB (a handle that long) at seq 700: larger than a NATS server takes
/// in one message by default (1 MiB). Every sink stores it but JetStream, which refuses
/// it: handed over as `#invalid` (`unstorable`) under `FIREKEEPER_BAD_FRAME=skip` (the
/// sink retried its publish for ever before, and every lane behind it waited).
async fn a_huge_record(sink: Sink) {
    let frames = with_identity(&"h".repeat(3 << 19));
    let relay = RelaySim::start_with(frames.clone(), SimConfig::default(), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("sim");
    let dir = tmpdir(&format!("contract-huge-{sink:?}"));
    let down = Downstream::start(sink, &dir).await;
    let run = Run::start(&relay, &down, &[("FIREKEEPER_BAD_FRAME", "skip")]);
    run.committed(frames.len() as u64, "every event committed past the huge record").await;
    run.stop();
    let mut want = served(&frames);
    if sink == Sink::JetStream {
        let i = want.iter().position(|w| w.0 == 700).expect("the huge record");
        want[i].1 = "#invalid did:plc:nulnulnulnulnulnulnulnul 700 unstorable".into();
    }
    assert_holds(sink, &down.stored().await, &want);
}

/// A record with a NUL character: Postgres cannot keep it as jsonb, and the test webhook
/// refuses it (HTTP 400). Nothing stalls.
async fn a_record_the_downstream_cannot_store(sink: Sink) {
    let frames = with_poison();
    let relay = RelaySim::start_with(frames.clone(), SimConfig::default(), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("sim");
    let dir = tmpdir(&format!("contract-poison-{sink:?}"));
    let down = Downstream::start(sink, &dir).await;
    if let Some(h) = &down.hook {
        h.set(HookMode::Refuse(700));
    }
    let run = Run::start(&relay, &down, &[("FIREKEEPER_BAD_FRAME", "skip")]);
    run.committed(frames.len() as u64, "every event committed past the poison record").await;
    run.stop();
    let mut want = served(&frames);
    if sink == Sink::Webhook {
        // Refused as itself: handed over as `#invalid`, reason `unstorable`.
        let i = want.iter().position(|w| w.0 == 700).expect("the poison record");
        want[i].1 = "#invalid did:plc:nulnulnulnulnulnulnulnul 700 unstorable".into();
    }
    assert_holds(sink, &down.stored().await, &want);
}

/// A repo repaired from its PDS: the chain-break capture (commits of two repos taken out)
/// with a local PDS serving every repo's final state; the large repo (20,000 records)
/// reaches the sink as a `#resync` and five parts of records. Folding what the downstream
/// holds gives every repo's reference records. The webhook's receiver drops the first two
/// requests that carry the large repo's records (it died in the middle of the snapshot):
/// the parts are written again, none is lost.
async fn a_repo_repaired_from_its_pds(sink: Sink) {
    let dir = tmpdir(&format!("contract-resync-{sink:?}"));
    let (frames, plc) = repair_world().await;
    let last = frames.iter().filter_map(|f| relay_sim::frame_seq(f)).max().expect("a seq");
    let relay = RelaySim::start(frames).await.expect("sim");
    let down = Downstream::start(sink, &dir).await;
    if let Some(h) = &down.hook {
        h.set(HookMode::DropRecords("did:plc:d255tkvufzfkpckokc332in6", 2));
    }
    let env = testkit::pds::repair_env(&plc.url());
    let run = Run::start(&relay, &down, &repair_settings(&env));
    eventually("the stream committed and both broken repos resynchronised", WAIT, async || {
        let v = run.status().await;
        let Some((200, metrics)) = http_get(&run.http, "/metrics").await else { return false };
        let done = metrics
            .lines()
            .find_map(|l| l.strip_prefix("firekeeper_resyncs_total{outcome=\"done\",reason=\"chain\"} "))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        v["committed"].as_u64() == Some(last) && v["desynchronized"] == 0 && done >= 2
    })
    .await;
    run.stop();
    if sink == Sink::Null {
        return;
    }
    folds_to_the_reference(sink, down.events().await);
}

/// The chain-break capture (commits of two repos taken out), and a PLC naming a local PDS
/// that serves every reference repo's final state: what a repair needs.
async fn repair_world() -> (Vec<Bytes>, testkit::plc::Plc) {
    let frames =
        relay_client::capture::read(&testkit::pds::repos_dir().join("firehose.resync.frames")).expect("capture");
    let pds = testkit::pds::start(testkit::pds::every_repo()).await;
    (frames, testkit::plc::Plc::start(testkit::pds::docs(&pds)).await)
}

/// The settings that point the binary at [`repair_world`]'s PLC (see
/// [`testkit::pds::repair_env`]).
fn repair_settings<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Folding `events` gives every reference repo's records.
fn folds_to_the_reference(sink: Sink, events: Vec<serde_json::Value>) {
    let mut folded = testkit::fold::Folded::new();
    for e in events {
        testkit::fold::apply(&mut folded, &e);
    }
    testkit::fold::assert_reference(&folded, &format!("{sink:?}"));
}

/// A giant repo's snapshot holds back only its own repo: with one lane for every repo
/// and a webhook that takes 25 ms for each request of the large repo's records (its five
/// parts take some 200 requests), events of another repo published while they are written
/// reach the webhook before the last of them does (written beside the lane; in it, they
/// waited for the whole snapshot).
/// The fold still equals every repo's reference records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_giant_snapshot_holds_back_only_its_own_repo() {
    const LARGE: &str = "did:plc:d255tkvufzfkpckokc332in6";
    let dir = tmpdir("contract-beside");
    let (frames, plc) = repair_world().await;
    let first = frames[0].clone();
    let relay = RelaySim::start(frames).await.expect("sim");
    let down = Downstream::start(Sink::Webhook, &dir).await;
    let hook = down.hook.as_ref().expect("hook");
    hook.set(HookMode::SlowRecords(LARGE, 25));
    let env = testkit::pds::repair_env(&plc.url());
    let mut settings = repair_settings(&env);
    settings.push(("FIREKEEPER_LANES", "1"));
    let run = Run::start(&relay, &down, &settings);
    let large_records = || {
        let b = hook.bodies.lock().expect("bodies");
        b.iter().filter(|x| x.contains("\"#record\"") && x.contains(LARGE)).count()
    };
    let holds = |seq: &str| hook.bodies.lock().expect("bodies").iter().any(|b| b.contains(seq));
    eventually("the large repo's first records at the webhook", WAIT, async || large_records() >= 1).await;
    // Ten events of another repo (the capture's first identity event, numbered after it),
    // and between them three identity events of the large repo itself.
    for seq in 509..519 {
        let frame = if [511, 514, 517].contains(&seq) {
            relay_sim::identity_frame(seq, LARGE, "2025-11-23T10:00:00.000Z")
        } else {
            relay_sim::with_seq(&first, seq).expect("renumbered")
        };
        relay.handle().publish(frame);
    }
    eventually("the other repo's later events at the webhook", WAIT, async || holds("\"seq\":518")).await;
    let parts_then = large_records();
    // The large repo's own events are held back until its snapshot lands, and the cursor
    // with them.
    assert!(!holds("\"seq\":511,"), "an event of the repo went ahead of its snapshot");
    let committed = run.status().await["committed"].as_u64();
    assert!(committed < Some(511), "the cursor passed an event held back: {committed:?}");
    eventually("the stream committed and the large repo resynchronised", WAIT, async || {
        let v = run.status().await;
        v["committed"].as_u64() == Some(518) && v["desynchronized"] == 0
    })
    .await;
    run.stop();
    let all = large_records();
    assert!(all >= 5, "the large repo's record requests: {all}");
    assert!(
        parts_then < all,
        "the later events waited for the whole snapshot ({parts_then} of {all} record requests first)"
    );
    // Held back, then handed over after the snapshot, in order.
    let order: Vec<usize> = {
        let b = hook.bodies.lock().expect("bodies");
        let last_record = b.iter().rposition(|x| x.contains("\"#record\"") && x.contains(LARGE)).expect("records");
        [511, 514, 517]
            .iter()
            .map(|s| b.iter().position(|x| x.contains(&format!("\"seq\":{s},"))).expect("delivered"))
            .inspect(|i| assert!(*i > last_record, "held events go after the snapshot"))
            .collect()
    };
    assert!(order.is_sorted(), "held events in order: {order:?}");
    folds_to_the_reference(Sink::Webhook, down.events().await);
}

/// Jetstream as the input (v2, compressed, 1,000 events a second), the downstream
/// restarting in the middle: every event stored, once where the sink promises it, as
/// Jetstream's own JSON.
async fn jetstream_input(sink: Sink) {
    let frames = testkit::fixture_frames();
    let clock = relay_sim::jetstream::Clock::default();
    let cfg = SimConfig { initial_head: Some(0), rate: Some(1000), ..SimConfig::default() };
    let relay =
        RelaySim::start_jetstream(&frames, &clock, cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim");
    let rows = relay_sim::jetstream::rows(&frames, &clock);
    let dir = tmpdir(&format!("contract-jetstream-{sink:?}"));
    let mut down = Downstream::start(sink, &dir).await;
    let input = [("FIREKEEPER_INPUT", "jetstream"), ("FIREKEEPER_JETSTREAM_VERSION", "v2")];
    let run = Run::start(&relay, &down, &input);
    run.committed(rows[rows.len() / 3].stamp, "a third committed").await;
    down.restart().await;
    run.committed(rows[rows.len() - 1].stamp, "every event committed after the restart").await;
    run.stop();
    if sink == Sink::Null {
        return;
    }
    let want: Vec<String> = rows
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_slice(&r.v2).expect("JSON");
            key_of(&v["payload"])
        })
        .collect();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for (_, k) in down.stored().await {
        *counts.entry(k).or_default() += 1;
    }
    let lost: Vec<&String> = want.iter().filter(|w| !counts.contains_key(*w)).take(3).collect();
    assert!(lost.is_empty(), "{sink:?}: lost {lost:?}");
    assert_eq!(counts.len(), want.len(), "{sink:?}: nothing else");
    if sink.exactly_once() {
        let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).take(3).collect();
        assert!(twice.is_empty(), "{sink:?}: stored twice {twice:?}");
    }
}

macro_rules! contract {
    ($($name:ident: $scenario:ident($($arg:expr),*);)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $scenario($($arg),*).await;
            }
        )*
    };
}

contract! {
    renumbered_jsonl_file: a_relay_that_renumbered(Sink::JsonlFile);
    renumbered_jsonl_stdout: a_relay_that_renumbered(Sink::JsonlStdout);
    renumbered_webhook: a_relay_that_renumbered(Sink::Webhook);
    renumbered_postgres: a_relay_that_renumbered(Sink::Postgres);
    renumbered_jetstream: a_relay_that_renumbered(Sink::JetStream);
    renumbered_null: a_relay_that_renumbered(Sink::Null);
    restarted_webhook: the_downstream_restarted(Sink::Webhook);
    restarted_postgres: the_downstream_restarted(Sink::Postgres);
    restarted_jetstream: the_downstream_restarted(Sink::JetStream);
    gone_webhook: the_downstream_was_gone_longer_than_a_write_timeout(Sink::Webhook);
    gone_postgres: the_downstream_was_gone_longer_than_a_write_timeout(Sink::Postgres);
    gone_jetstream: the_downstream_was_gone_longer_than_a_write_timeout(Sink::JetStream);
    refusing_credentials_webhook: the_downstream_refused_every_write_for_a_while(Sink::Webhook, 401);
    refusing_everything_webhook: the_downstream_refused_every_write_for_a_while(Sink::Webhook, 400);
    refusing_credentials_postgres: the_downstream_refused_every_write_for_a_while(Sink::Postgres, 0);
    poison_jsonl_file: a_record_the_downstream_cannot_store(Sink::JsonlFile);
    poison_jsonl_stdout: a_record_the_downstream_cannot_store(Sink::JsonlStdout);
    poison_webhook: a_record_the_downstream_cannot_store(Sink::Webhook);
    poison_postgres: a_record_the_downstream_cannot_store(Sink::Postgres);
    poison_jetstream: a_record_the_downstream_cannot_store(Sink::JetStream);
    poison_null: a_record_the_downstream_cannot_store(Sink::Null);
    huge_jsonl_file: a_huge_record(Sink::JsonlFile);
    huge_webhook: a_huge_record(Sink::Webhook);
    huge_postgres: a_huge_record(Sink::Postgres);
    huge_jetstream: a_huge_record(Sink::JetStream);
    repaired_jsonl_file: a_repo_repaired_from_its_pds(Sink::JsonlFile);
    repaired_jsonl_stdout: a_repo_repaired_from_its_pds(Sink::JsonlStdout);
    repaired_webhook: a_repo_repaired_from_its_pds(Sink::Webhook);
    repaired_jetstream: a_repo_repaired_from_its_pds(Sink::JetStream);
    repaired_null: a_repo_repaired_from_its_pds(Sink::Null);
    jetstream_input_jsonl_file: jetstream_input(Sink::JsonlFile);
    jetstream_input_webhook: jetstream_input(Sink::Webhook);
    jetstream_input_postgres: jetstream_input(Sink::Postgres);
    jetstream_input_jetstream: jetstream_input(Sink::JetStream);
    jetstream_input_null: jetstream_input(Sink::Null);
}
