//! Each sink writes nothing once the term's deadline has passed, even when it passed
//! while the write waited (for a lock, a table lock).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use consumer::RelayRole;
use consumer::{BatchCtx, Event, Handler, HandlerError};
use lease::{LeaseConfig, LeaseEvent, LocalBackend, OffsetClock};

use super::*;

async fn term_with(clock: Arc<OffsetClock>, dir: &std::path::Path) -> (lease::LeaseHandle, BatchCtx) {
    let backend = Arc::new(LocalBackend::new(&dir.join("lease.lock")));
    let (h, mut ev) =
        lease::spawn_as(backend, LeaseConfig::from_ttl(Duration::from_secs(10)), clock, "t").expect("cfg");
    let Some(LeaseEvent::Elected(term)) = ev.recv().await else { panic!("not elected") };
    let ctx = BatchCtx {
        token: term.token(),
        relay: RelayRole::Primary,
        fingerprint: "fp".into(),
        cancel: term.cancellation(),
        term,
        cursor_hold: consumer::CursorHold::default(),
    };
    (h, ctx)
}

/// Two events of the fixture.
fn events(n: usize) -> Vec<Event> {
    testkit::fixture_frames()
        .iter()
        .filter_map(|b| Event::from_bytes(b, RelayRole::Primary).expect("fixture decodes"))
        .take(n)
        .collect()
}

fn jsonl(path: &std::path::Path) -> Jsonl {
    let f = std::fs::File::create(path).expect("create");
    Jsonl::to(Box::new(tokio::fs::File::from_std(f)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_waited_for_the_jsonl_lock_past_the_deadline_writes_nothing() {
    let dir = testkit::tmpdir("sink-lock");
    let clock = Arc::new(OffsetClock::default());
    let (h, ctx) = term_with(clock.clone(), &dir).await;
    let out = dir.join("out.jsonl");
    let sink = Arc::new(jsonl(&out));
    // Another lane holds the file lock.
    let guard = sink.0.lock().await;
    let (s, c) = (sink.clone(), ctx.clone());
    let write = tokio::spawn(async move { s.handle(&events(2), &c).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!write.is_finished(), "the write passed its first check and waits for the lock");
    // The deadline passes while it waits (the supervisor has not run yet).
    clock.advance(Duration::from_hours(1));
    assert!(!ctx.term.is_active());
    drop(guard);
    let r = write.await.expect("join");
    assert!(matches!(r, Err(HandlerError::Cancelled)), "{r:?}");
    assert_eq!(std::fs::read(&out).expect("read").len(), 0, "nothing written after the deadline");
    h.abandon().await;
}

/// A destination that fails (the pipe's reader is gone) fails every batch, small ones
/// (failing in the flush) and one larger than the writer's buffer (failing in the
/// write): none is taken as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_jsonl_destination_fails_every_batch() {
    let dir = testkit::tmpdir("sink-broken");
    let (h, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let (w, r) = tokio::io::duplex(64);
    drop(r);
    let sink = Jsonl::to(Box::new(w));
    let (small, large) = (events(2), events(1200));
    for batch in [&small, &large, &small] {
        let r = sink.handle(batch, &ctx).await;
        assert!(matches!(r, Err(HandlerError::Failed { .. })), "{r:?}");
    }
    h.abandon().await;
}

/// A stream that takes `room` bytes, then fails as a full disk does.
struct Filling {
    room: usize,
    got: Vec<u8>,
}

impl AsyncWrite for Filling {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let n = buf.len().min(self.room - self.got.len());
        if n == 0 {
            return std::task::Poll::Ready(Err(std::io::Error::from_raw_os_error(28)));
        }
        self.got.extend_from_slice(&buf[..n]);
        std::task::Poll::Ready(Ok(n))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// A stream that cannot be cut back (a pipe): a batch that fails after part of it was
/// written stops the consumer (a retry would leave a torn line before the batch); one
/// that fails before a byte is written is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_fails_part_way_through_a_batch_is_fatal_and_one_that_fails_at_once_is_retried() {
    let dir = testkit::tmpdir("sink-stream-full");
    let (h, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let full = Jsonl::to(Box::new(Filling { room: 0, got: Vec::new() }));
    let r = full.handle(&events(3), &ctx).await;
    assert!(matches!(r, Err(HandlerError::Failed { .. })), "nothing written: retried: {r:?}");
    let part = Jsonl::to(Box::new(Filling { room: 100, got: Vec::new() }));
    let r = part.handle(&events(3), &ctx).await;
    assert!(matches!(&r, Err(HandlerError::Fatal { .. })), "part written: fatal: {r:?}");
    assert!(r.expect_err("fatal").to_string().contains("after 100 of"), "says how much was written");
    h.abandon().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_webhook_request_is_sent_after_the_deadline() {
    let dir = testkit::tmpdir("sink-hook");
    let clock = Arc::new(OffsetClock::default());
    let (h, ctx) = term_with(clock.clone(), &dir).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/", listener.local_addr().expect("addr"));
    let accepted = Arc::new(AtomicU64::new(0));
    let a = accepted.clone();
    tokio::spawn(async move {
        while let Ok((_s, _)) = listener.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
        }
    });
    let _ = rustls::crypto::ring::default_provider().install_default();
    let sink = Webhook::new(&url, 10, Duration::from_secs(5)).expect("client");
    clock.advance(Duration::from_hours(1));
    assert!(matches!(sink.handle(&events(1), &ctx).await, Err(HandlerError::Cancelled)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "no request was sent");
    h.abandon().await;
}

/// The review's locked table: the batch's INSERT waits on a lock past the deadline; the
/// store's fence alone would accept it (no newer term claimed yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_batch_that_waited_on_a_lock_past_the_deadline_is_rolled_back() {
    let pg = testkit::PgServer::start();
    let dir = testkit::tmpdir("sink-pg");
    let clock = Arc::new(OffsetClock::default());
    let (lease, ctx) = term_with(clock.clone(), &dir).await;
    let sink = Arc::new(Postgres::connect(&pg.url()).await.expect("pg"));
    let (mut locker, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("pg");
    tokio::spawn(conn);
    let tx = locker.transaction().await.expect("tx");
    tx.batch_execute("LOCK TABLE firekeeper_events IN ACCESS EXCLUSIVE MODE").await.expect("lock");
    let (writer, wctx) = (sink.clone(), ctx.clone());
    let write = tokio::spawn(async move { writer.handle(&events(2), &wctx).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!write.is_finished(), "the INSERT waits for the lock");
    clock.advance(Duration::from_hours(1));
    tx.rollback().await.expect("unlock");
    let outcome = write.await.expect("join");
    assert!(matches!(outcome, Err(HandlerError::Cancelled)), "{outcome:?}");
    let db = pg_client(&pg).await;
    let rows: i64 = db.query_one("SELECT count(*) FROM firekeeper_events", &[]).await.expect("count").get(0);
    let cursors: i64 = db.query_one("SELECT count(*) FROM firekeeper_cursors", &[]).await.expect("count").get(0);
    assert_eq!((rows, cursors), (0, 0), "neither rows nor cursor landed");
    lease.abandon().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sink_write_starts_after_the_deadline() {
    let dir = testkit::tmpdir("sink-start");
    let clock = Arc::new(OffsetClock::default());
    let (h, ctx) = term_with(clock.clone(), &dir).await;
    let out = dir.join("out.jsonl");
    let sink = jsonl(&out);
    let evs = events(2);
    sink.handle(&evs[..1], &ctx).await.expect("written while active");
    let written = std::fs::read(&out).expect("read").len();
    assert!(written > 0);
    clock.advance(Duration::from_hours(1));
    assert!(matches!(sink.handle(&evs[1..], &ctx).await, Err(HandlerError::Cancelled)));
    assert_eq!(std::fs::read(&out).expect("read").len(), written);
    h.abandon().await;
}

#[test]
fn a_line_renders_the_event_when_the_lane_did_not() {
    let evs = events(1);
    let ctx_line = |e: &Event| {
        let mut s = String::new();
        e.render_json(&mut s);
        s
    };
    let body = ctx_line(&evs[0]);
    assert!(body.starts_with(&format!("{{\"seq\":{},", evs[0].seq())), "{body}");
}

fn a_break() -> consumer::ChainBreak {
    consumer::ChainBreak {
        repo: "did:plc:a".into(),
        last_rev: "3jzfcijpj2z2c".into(),
        since: "3jzfcijpj2z2e".into(),
        rev: "3jzfcijpj2z2g".into(),
    }
}

/// A chain break goes out as a `#chain-break` line of the same seq, before its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_break_is_written_as_its_own_line_before_the_commit() {
    let dir = testkit::tmpdir("sink-chain");
    let (h, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let out = dir.join("out.jsonl");
    let sink = jsonl(&out);
    let mut evs = events(2);
    let second = evs.pop().expect("two").with_chain_break(a_break());
    let seq = second.seq();
    evs.push(second);
    sink.handle(&evs, &ctx).await.expect("written");
    let text = std::fs::read_to_string(&out).expect("read");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[1].starts_with(&format!("{{\"seq\":{seq},")), "{}", lines[1]);
    let want = format!(
        r##""event":{{"seq":{seq},"type":"#chain-break","repo":"did:plc:a","lastRev":"3jzfcijpj2z2c","since":"3jzfcijpj2z2e","rev":"3jzfcijpj2z2g"}}}}"##
    );
    assert!(lines[1].ends_with(&want), "{}", lines[1]);
    assert!(lines[2].starts_with(&format!("{{\"seq\":{seq},")) && !lines[2].contains("#chain-break"), "{}", lines[2]);
    h.abandon().await;
}

/// The Postgres sink keeps chain breaks in their own table, in the batch's transaction,
/// and commits the cursor with its time and the active relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_sink_records_chain_breaks_beside_the_events() {
    let pg = testkit::PgServer::start();
    let dir = testkit::tmpdir("sink-pg-chain");
    let (lease, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let sink = Postgres::connect(&pg.url()).await.expect("pg");
    let mut evs = events(3);
    let last = evs.pop().expect("three").with_chain_break(a_break());
    let seq = i64::try_from(last.seq()).expect("seq");
    evs.push(last);
    sink.handle(&evs, &ctx).await.expect("written");
    let db = pg_client(&pg).await;
    let rows: i64 = db.query_one("SELECT count(*) FROM firekeeper_events", &[]).await.expect("count").get(0);
    assert_eq!(rows, 3, "every event, the one with the break included");
    let b = db
        .query_one("SELECT seq, did, last_rev, since, rev FROM firekeeper_chain_breaks", &[])
        .await
        .expect("one chain break");
    assert_eq!(b.get::<_, i64>(0), seq);
    let revs: (String, String, String, String) = (b.get(1), b.get(2), b.get(3), b.get(4));
    assert_eq!(revs, ("did:plc:a".into(), "3jzfcijpj2z2c".into(), "3jzfcijpj2z2e".into(), "3jzfcijpj2z2g".into()));
    // The cursor carries the time of the batch's last event and the relay it came from.
    let want_time = evs[2].time().and_then(atproto_data::time::time_ms);
    assert!(want_time.is_some());
    let c =
        db.query_one("SELECT cursor, time_ms FROM firekeeper_cursors WHERE relay = 'fp'", &[]).await.expect("cursor");
    assert_eq!((c.get::<_, i64>(0), c.get::<_, Option<i64>>(1)), (seq, want_time));
    let active: String =
        db.query_one("SELECT relay FROM firekeeper_active_relay", &[]).await.expect("active relay").get(0);
    assert_eq!(active, "fp");
    lease.abandon().await;
}

/// A client of the test's Postgres (its connection runs in a task of its own).
async fn pg_client(pg: &testkit::PgServer) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("pg");
    tokio::spawn(conn);
    c
}

/// `n` fixture events from the `skip`th on, renumbered from `first`: new events under
/// seqs another batch already used (a relay that restarted its numbering).
fn renumbered(skip: usize, n: usize, first: u64) -> Vec<Event> {
    testkit::fixture_frames()
        .iter()
        .skip(skip)
        .take(n)
        .zip(first..)
        .filter_map(|(f, seq)| {
            Event::from_bytes(&relay_sim::with_seq(f, seq).expect("seq"), RelayRole::Primary).ok()?
        })
        .collect()
}

/// An `#identity` event whose handle holds a NUL character (valid in atproto JSON; any
/// account can send one): Postgres cannot keep it as jsonb.
fn identity_with_nul(seq: u64) -> Event {
    let mut w = atproto_data::cbor::Writer::new();
    w.map(2).str("t").str("#identity").str("op").int(1);
    w.map(4).str("did").str("did:plc:nulnulnulnulnulnulnulnul").str("seq").int(i64::try_from(seq).expect("seq"));
    w.str("time").str("2026-12-02T10:17:24.747Z").str("handle").str("bad\u{0}handle.test");
    Event::from_bytes(&w.buf, RelayRole::Primary).expect("decodes").expect("an event")
}

/// Issue 39: rows were keyed by (relay, seq) and inserted ON CONFLICT DO NOTHING, so a
/// relay that restarted its numbering had its new events taken for replays (0 of 100
/// stored). Now a row is named by its event: a replay is still not stored twice, a new
/// event under an old seq is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_sink_stores_new_events_under_old_seqs_and_not_a_replay_twice() {
    let pg = testkit::PgServer::start();
    let dir = testkit::tmpdir("sink-pg-renumbered");
    let (lease, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let sink = Postgres::connect(&pg.url()).await.expect("pg");
    let first = renumbered(0, 50, 1);
    sink.handle(&first, &ctx).await.expect("written");
    sink.handle(&first, &ctx).await.expect("a replay");
    let db = pg_client(&pg).await;
    let count =
        async || -> i64 { db.query_one("SELECT count(*) FROM firekeeper_events", &[]).await.expect("count").get(0) };
    assert_eq!(count().await, 50, "a replay is not stored twice");
    sink.handle(&renumbered(100, 50, 1), &ctx).await.expect("renumbered");
    assert_eq!(count().await, 100, "new events under old seqs are stored");
    lease.abandon().await;
}

/// While a lane holds a repo's events back behind its snapshot (written beside the lane),
/// the batches it writes do not hold every event before their last seq: the Postgres sink
/// writes them, fenced, and leaves the cursor where it was; once the hold is over the next
/// batch moves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_sink_leaves_the_cursor_while_the_lane_holds_events_back() {
    let pg = testkit::PgServer::start();
    let dir = testkit::tmpdir("sink-pg-hold");
    let (lease, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let sink = Postgres::connect(&pg.url()).await.expect("pg");
    let db = pg_client(&pg).await;
    let cursor = async || -> i64 {
        db.query_one("SELECT cursor FROM firekeeper_cursors WHERE relay = 'fp'", &[]).await.expect("cursor").get(0)
    };
    let rows =
        async || -> i64 { db.query_one("SELECT count(*) FROM firekeeper_events", &[]).await.expect("count").get(0) };
    sink.handle(&renumbered(0, 10, 1), &ctx).await.expect("written");
    assert_eq!(cursor().await, 10);
    ctx.cursor_hold.set(true);
    sink.handle(&renumbered(10, 10, 11), &ctx).await.expect("written while held");
    assert_eq!((rows().await, cursor().await), (20, 10), "written, the cursor left");
    ctx.cursor_hold.set(false);
    sink.handle(&renumbered(20, 10, 21), &ctx).await.expect("written");
    assert_eq!(cursor().await, 30);
    lease.abandon().await;
}

/// Issue 39: a record holding a NUL character failed its batch on every retry and the one
/// Postgres lane waited behind it for ever. Now it is kept as its JSON text in
/// `body_text`, beside the batch's other rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_postgres_cannot_keep_as_jsonb_is_kept_as_text_and_stalls_nothing() {
    let pg = testkit::PgServer::start();
    let dir = testkit::tmpdir("sink-pg-nul");
    let (lease, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let sink = Postgres::connect(&pg.url()).await.expect("pg");
    let mut batch = renumbered(0, 3, 1);
    batch.push(identity_with_nul(4));
    sink.handle(&batch, &ctx).await.expect("the batch lands");
    let db = pg_client(&pg).await;
    let row = db
        .query_one("SELECT body IS NULL, body_text FROM firekeeper_events WHERE seq = 4", &[])
        .await
        .expect("the NUL event's row");
    let (no_json, text): (bool, Option<String>) = (row.get(0), row.get(1));
    assert!(no_json, "not as jsonb");
    let text = text.expect("as text");
    let v: serde_json::Value = serde_json::from_str(&text).expect("the text is the event's JSON");
    assert_eq!(v["handle"], "bad\u{0}handle.test");
    let jsonb: i64 =
        db.query_one("SELECT count(*) FROM firekeeper_events WHERE body IS NOT NULL", &[]).await.expect("n").get(0);
    assert_eq!(jsonb, 3, "the others as jsonb");
    lease.abandon().await;
}

/// Issue 39: the sink held one client and never replaced it: after a Postgres restart
/// every write failed ("connection closed") for ever. Now the connection is made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_sink_writes_again_after_postgres_restarts() {
    let mut pg = testkit::PgServer::start();
    let dir = testkit::tmpdir("sink-pg-restart");
    let (lease, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let sink = Postgres::connect(&pg.url()).await.expect("pg");
    sink.handle(&renumbered(0, 10, 1), &ctx).await.expect("before");
    pg.restart();
    let next = renumbered(10, 10, 11);
    testkit::eventually("a write lands after the restart", testkit::WAIT, async || {
        sink.handle(&next, &ctx).await.is_ok()
    })
    .await;
    assert!(sink.reconnects() >= 1);
    let db = pg_client(&pg).await;
    let rows: i64 = db.query_one("SELECT count(*) FROM firekeeper_events", &[]).await.expect("count").get(0);
    assert_eq!(rows, 20);
    lease.abandon().await;
}

/// A JetStream sink on a NATS server of its own, and a term to write in.
struct Js {
    server: testkit::NatsServer,
    lease: lease::LeaseHandle,
    ctx: BatchCtx,
    nats: nats_op::Nats,
    sink: JetStream,
}

async fn js(name: &str, clock: Arc<OffsetClock>, cfg: JetStreamConfig) -> Js {
    let server = testkit::NatsServer::start();
    let dir = testkit::tmpdir(name);
    let (lease, ctx) = term_with(clock, &dir).await;
    let nats = nats_op::Nats::connect(&nats_op::NatsConfig {
        url: server.url(),
        creds_file: None,
        ca_file: None,
        token: None,
        op_timeout: Duration::from_secs(2),
    })
    .await
    .expect("connect");
    let sink = JetStream::open(&nats, cfg).await.expect("open");
    Js { server, lease, ctx, nats, sink }
}

/// Every message of the stream: (subject, Nats-Msg-Id, body).
async fn stream_messages(nats: &nats_op::Nats) -> Vec<(String, String, String)> {
    let stream = nats.jetstream().get_stream("FIREKEEPER").await.expect("stream");
    let last = stream.get_info().await.expect("info").state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        let m = stream.get_raw_message(seq).await.expect("message");
        let id = m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned()).unwrap_or_default();
        out.push((m.subject.to_string(), id, String::from_utf8_lossy(&m.payload).into_owned()));
    }
    out
}

/// A batch lands once per event, by collection; the same batch handed over again (a new
/// leader replaying after the last commit) adds nothing: the server drops it by id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_publishes_each_event_once_and_a_replay_is_deduplicated() {
    let Js { server: _server, lease, ctx, nats, sink } =
        js("sink-js", Arc::default(), JetStreamConfig::default()).await;
    let mut evs = events(40);
    let last = evs.pop().expect("40").with_chain_break(a_break());
    evs.push(last);
    sink.handle(&evs, &ctx).await.expect("published");
    sink.handle(&evs[10..], &ctx).await.expect("replayed");
    let got = stream_messages(&nats).await;
    assert_eq!(got.len(), evs.len() + 1, "every event once, and the chain break");
    for (e, (subject, id, body)) in evs.iter().zip(got.iter().filter(|m| !m.0.ends_with("chain-break"))) {
        assert_eq!(id, &crate::jetstream::message_id("fp", e));
        assert!(id.starts_with(&format!("fp:{}:", e.seq())), "{id}");
        let mut want = String::new();
        e.render_json(&mut want);
        assert_eq!(body, &want);
        match e.message() {
            atproto_data::Message::Commit(c) if !c.ops.is_empty() => {
                assert_eq!(subject, &format!("firekeeper.events.{}", c.ops[0].collection()));
            }
            m => assert_eq!(subject, &format!("firekeeper.events.{}", m.kind().as_str().trim_start_matches('#'))),
        }
    }
    let cb = got.iter().find(|m| m.0 == "firekeeper.events.chain-break").expect("the chain break");
    assert!(cb.2.contains("\"type\":\"#chain-break\"") && cb.1.ends_with(":chain-break"), "{cb:?}");
    lease.abandon().await;
}

/// A relay that restarted its numbering serves new events under seqs already stored:
/// they are stored, not acknowledged as duplicates and dropped (all 40 were lost before,
/// with the cursor moving past them), while the same events handed over again still are
/// dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_stores_new_events_that_reuse_old_seqs_after_a_renumbering() {
    let Js { server: _server, lease, ctx, nats, sink } =
        js("sink-js-renumber", Arc::default(), JetStreamConfig::default()).await;
    let first = events(40);
    sink.handle(&first, &ctx).await.expect("published");
    // The next 40 events of the capture, numbered again from the first batch's seqs.
    let later: Vec<Event> = testkit::fixture_frames()
        .iter()
        .skip(40)
        .take(40)
        .zip(&first)
        .map(|(f, old)| {
            let b = relay_sim::with_seq(f, old.seq()).expect("renumbered");
            Event::from_bytes(&b, RelayRole::Primary).expect("decodes").expect("an event")
        })
        .collect();
    sink.handle(&later, &ctx).await.expect("published");
    sink.handle(&later[..20], &ctx).await.expect("replayed after a failover");
    let got = stream_messages(&nats).await;
    assert_eq!(got.len(), 80, "both numberings' events, each once");
    let bodies: std::collections::HashSet<&str> = got.iter().map(|m| m.2.as_str()).collect();
    for e in &later {
        let mut body = String::new();
        e.render_json(&mut body);
        assert!(bodies.contains(body.as_str()), "seq {} of the new numbering is stored", e.seq());
    }
    lease.abandon().await;
}

/// The stream deleted under the sink (an operator, a server that lost its store): the
/// batch fails (the cursor does not pass it), the sink creates the stream again, and the
/// retried batch lands. Before, every publish failed until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_creates_a_deleted_stream_again_and_the_retried_batch_lands() {
    let Js { server: _server, lease, ctx, nats, sink } =
        js("sink-js-deleted", Arc::default(), JetStreamConfig::default()).await;
    let evs = events(30);
    sink.handle(&evs[..10], &ctx).await.expect("published");
    nats.jetstream().delete_stream("FIREKEEPER").await.expect("deleted under the sink");
    let e = sink.handle(&evs[10..], &ctx).await.expect_err("the batch fails while the stream is missing");
    assert!(e.to_string().contains("missing"), "{e}");
    sink.handle(&evs[10..], &ctx).await.expect("the retry lands");
    let got = stream_messages(&nats).await;
    let ids: Vec<&str> = got.iter().map(|m| m.1.as_str()).collect();
    let want: Vec<String> = evs[10..].iter().map(|e| crate::jetstream::message_id("fp", e)).collect();
    assert_eq!(ids, want, "the new stream holds the retried batch, once, in order");
    lease.abandon().await;
}

/// A duplicate window shorter than a failover: a replay after the window is stored
/// again (duplicates, said in the README), never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_with_a_duplicate_window_shorter_than_the_outage_duplicates_but_loses_nothing() {
    let Js { server: _server, lease, ctx, nats, sink } = js(
        "sink-js-window",
        Arc::default(),
        JetStreamConfig { duplicate_window: Duration::from_millis(300), ..JetStreamConfig::default() },
    )
    .await;
    let evs = events(20);
    sink.handle(&evs, &ctx).await.expect("published");
    tokio::time::sleep(Duration::from_millis(800)).await;
    sink.handle(&evs[10..], &ctx).await.expect("replayed after the window");
    let got = stream_messages(&nats).await;
    let ids: std::collections::HashSet<&str> = got.iter().map(|m| m.1.as_str()).collect();
    assert!(evs.iter().all(|e| ids.contains(crate::jetstream::message_id("fp", e).as_str())), "nothing lost");
    assert_eq!(got.len(), 30, "the replay past the window is stored again");
    lease.abandon().await;
}

/// With partitions, every repo's events share one partition subject.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_partitions_keep_each_repo_in_one_subject() {
    let Js { server: _server, lease, ctx, nats, sink } =
        js("sink-js-p", Arc::default(), JetStreamConfig { partitions: 4, ..JetStreamConfig::default() }).await;
    let evs = events(200);
    sink.handle(&evs, &ctx).await.expect("published");
    let got = stream_messages(&nats).await;
    assert_eq!(got.len(), evs.len());
    let mut by_repo: std::collections::HashMap<&str, std::collections::BTreeSet<&str>> =
        std::collections::HashMap::default();
    for (e, (subject, ..)) in evs.iter().zip(&got) {
        assert!(subject.starts_with("firekeeper.events.p"), "{subject}");
        by_repo.entry(e.did().unwrap_or("")).or_default().insert(subject);
    }
    assert!(by_repo.values().all(|s| s.len() == 1), "{by_repo:?}");
    lease.abandon().await;
}

/// Past the term's deadline nothing is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_publishes_nothing_after_the_deadline() {
    let clock = Arc::new(OffsetClock::default());
    let Js { server: _server, lease, ctx, nats, sink } =
        js("sink-js-d", clock.clone(), JetStreamConfig::default()).await;
    clock.advance(Duration::from_hours(1));
    assert!(matches!(sink.handle(&events(5), &ctx).await, Err(HandlerError::Cancelled)));
    assert!(stream_messages(&nats).await.is_empty());
    lease.abandon().await;
}

/// A failed write keeps its cause: the webhook's transport error is the `source`, not a
/// string, so callers and logs can walk the chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_webhook_write_keeps_the_transport_error_as_its_source() {
    let dir = testkit::tmpdir("sink-cause");
    let (h, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    // A port nobody listens on: the connection is refused.
    let port = testkit::free_port();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let sink = Webhook::new(&format!("http://127.0.0.1:{port}/"), 10, Duration::from_secs(5)).expect("client");
    let err = sink.handle(&events(1), &ctx).await.expect_err("nobody listens");
    assert!(matches!(&err, HandlerError::Failed { what, .. } if what == "webhook"), "{err:?}");
    let source = std::error::Error::source(&err).expect("a source");
    assert!(source.downcast_ref::<reqwest::Error>().is_some_and(reqwest::Error::is_connect), "{source:?}");
    h.abandon().await;
}

/// Publishing ahead: a second batch is sent while the first is unacknowledged; when the
/// server stalls past `publish_timeout` the first's acknowledgement fails (the lane would
/// hold the cursor), and publishing it again with the same ids stores each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_batch_fails_and_its_republication_stores_each_event_once() {
    let Js { server, lease, ctx, nats, sink } = js(
        "sink-js-ahead",
        Arc::default(),
        JetStreamConfig { publish_timeout: Duration::from_millis(500), ..JetStreamConfig::default() },
    )
    .await;
    assert_eq!(sink.write_ahead(), 1024, "publishes kept in flight across batches by default");
    let evs = events(40);
    server.pause();
    let first = sink.submit(&evs[..20], &ctx).await.expect("sent without waiting for the server");
    let second = sink.submit(&evs[20..], &ctx).await.expect("sent ahead of the first's acknowledgement");
    let err = first.await.expect_err("no acknowledgement from a stalled server");
    assert!(matches!(err, HandlerError::Failed { .. }), "{err}");
    server.resume();
    // The second batch's publishes may have reached the server late; either way the lane
    // publishes every failed batch again with the same ids.
    if second.await.is_err() {
        sink.submit(&evs[20..], &ctx).await.expect("sent").await.expect("acknowledged");
    }
    sink.submit(&evs[..20], &ctx).await.expect("sent").await.expect("acknowledged");
    let got = stream_messages(&nats).await;
    let ids: Vec<&str> = got.iter().map(|m| m.1.as_str()).collect();
    let want: Vec<String> = evs.iter().map(|e| crate::jetstream::message_id("fp", e)).collect();
    assert_eq!(ids.len(), want.len(), "each event stored once: {ids:?}");
    assert!(want.iter().all(|w| ids.contains(&w.as_str())), "nothing lost");
    lease.abandon().await;
}

/// Lanes writing ahead hold many acknowledgements they read only later: more than the
/// NATS client's own bound on unacknowledged publishes (5,000 by default) must not make
/// the next publish wait for a permit that only those unread acknowledgements free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_unread_acknowledgements_than_the_clients_default_bound_do_not_stall_publishing() {
    let Js { server: _server, lease, ctx, nats, sink } = js(
        "sink-js-permits",
        Arc::default(),
        JetStreamConfig { publish_timeout: Duration::from_secs(3), ..JetStreamConfig::default() },
    )
    .await;
    let evs = events(1000);
    assert_eq!(evs.len(), 1000);
    let mut pending = Vec::new();
    for i in 0..6 {
        // 6,000 publishes with no acknowledgement read yet.
        let p = sink.submit(&evs, &ctx).await.unwrap_or_else(|e| panic!("submission {i} stalled: {e}"));
        pending.push(p);
    }
    for p in pending {
        p.await.expect("acknowledged");
    }
    assert_eq!(stream_messages(&nats).await.len(), 1000, "the same events six times, stored once");
    lease.abandon().await;
}

/// A webhook answer is taken as refusing a record only for 400, 413 and 422; every other
/// 4xx (credentials, address, method, media type, conflict) is a failure retried, so a
/// misconfigured receiver never turns events into `#invalid` placeholders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_400_413_and_422_are_taken_as_refusing_a_record() {
    use tokio::io::AsyncWriteExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let status = Arc::new(AtomicU64::new(200));
    let answer = status.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut pending = Vec::new();
                while testkit::http::read_request(&mut s, &mut pending).await.is_some() {
                    let code = answer.load(Ordering::SeqCst);
                    let head = format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\n\r\n");
                    if s.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let dir = testkit::tmpdir("sink-statuses");
    let (h, ctx) = term_with(Arc::new(OffsetClock::default()), &dir).await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let sink = Webhook::new(&url, 10, Duration::from_secs(5)).expect("client");
    for code in [400u16, 401, 403, 404, 405, 408, 409, 410, 413, 415, 422, 425, 429, 500, 503] {
        status.store(u64::from(code), Ordering::SeqCst);
        let err = sink.handle(&events(1), &ctx).await.expect_err("not a 2xx");
        let refused = matches!(err, HandlerError::Refused { .. });
        assert_eq!(refused, [400, 413, 422].contains(&code), "HTTP {code}: {err}");
        assert!(refused || matches!(err, HandlerError::Failed { .. }), "HTTP {code}: {err}");
    }
    status.store(200, Ordering::SeqCst);
    sink.handle(&events(1), &ctx).await.expect("a 2xx");
    h.abandon().await;
}
