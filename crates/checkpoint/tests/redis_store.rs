//! The Redis cursor store against real redis-server processes, with the real lease.

use checkpoint::CursorStore as _;
use std::sync::Arc;
use std::time::Duration;

use checkpoint::{CommitOutcome, ReadOutcome, RedisKeys, RedisStore, StoreError};
use lease::{BootClock, LeaseConfig, LeaseEvent, RedisBackend, Term};
use testkit::RedisServer;
use tokio::time::timeout;

mod seam;
use seam::Writes as _;

const FP: &str = "9f2c1e0b7a6d5c4b3a29181706f5e4d3c2b1a09f8e7d6c5b4a3928170615f4e3";
const OP: Duration = Duration::from_millis(500);

fn store(url: &str, prefix: &str) -> RedisStore {
    RedisStore::new(url, RedisKeys::new(prefix, Some("wisp:firehose-cursor")), OP).expect("store")
}

fn set(redis: &RedisServer, k: &str, v: &[u8]) {
    let mut c = redis.admin();
    let _: () = redis::cmd("SET").arg(k).arg(v).query(&mut c).expect("set");
}

fn get(redis: &RedisServer, k: &str) -> Option<String> {
    let mut c = redis.admin();
    redis::cmd("GET").arg(k).query(&mut c).expect("get")
}

async fn leader(
    url: &str,
    prefix: &str,
    name: &str,
) -> (lease::LeaseHandle, tokio::sync::mpsc::UnboundedReceiver<LeaseEvent>, Term) {
    let cfg = LeaseConfig {
        poll: Duration::from_millis(100),
        key_prefix: prefix.to_owned(),
        ..LeaseConfig::from_ttl(Duration::from_secs(2))
    };
    let backend = Arc::new(RedisBackend::new(url, prefix, cfg.op_timeout).expect("backend"));
    let (h, mut ev) = lease::spawn_as(backend, cfg, Arc::new(BootClock), name).expect("config");
    let Some(LeaseEvent::Elected(t)) = timeout(Duration::from_secs(20), ev.recv()).await.expect("elected") else {
        panic!("not elected")
    };
    (h, ev, t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_write_seam_advances_rewinds_and_fences() {
    let redis = RedisServer::start();
    let s = store(&redis.url(), "seam");
    set(&redis, "{seam}:lease", b"x:3");
    let (current, stale) =
        (checkpoint::Fence { holder: "x:3", token: 3 }, checkpoint::Fence { holder: "w:2", token: 2 });
    seam::write_contract(&s, current, stale).await;
    seam::repo_contract(&s, current, stale).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_token_is_refused_while_the_new_leaders_commit_lands() {
    let redis = RedisServer::start();
    let s = store(&redis.url(), "fk");
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Missing));
    let (a, _ea, ta) = leader(&redis.url(), "fk", "a").await;
    assert_eq!(s.commit(FP, 10, &ta.holder()).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    // a hands over; b is elected with a greater token.
    a.step_down_with(async { Ok::<(), String>(()) }, Duration::from_secs(2)).await.expect("release");
    let (_b, _eb, tb) = leader(&redis.url(), "fk", "b").await;
    assert!(tb.token() > ta.token());
    assert_eq!(
        s.commit(FP, 50, &ta.holder()).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(tb.token()) }),
        "old term refused"
    );
    assert_eq!(s.commit(FP, 20, &tb.holder()).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(20)));
    // The highest token seen is kept beside the cursor.
    assert_eq!(get(&redis, "{fk}:fence-seen"), Some(tb.token().to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_never_move_backwards_and_tokens_outlive_a_lost_fence_counter() {
    let redis = RedisServer::start();
    let s = store(&redis.url(), "m");
    let (h, _e, t) = leader(&redis.url(), "m", "a").await;
    assert_eq!(s.commit(FP, 100, &t.holder()).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(
        s.commit(FP, 99, &t.holder()).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::NotNewer { stored: 100 })
    );
    assert_eq!(
        s.commit(FP, 100, &t.holder()).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::NotNewer { stored: 100 })
    );
    assert!(
        matches!(s.commit(FP, checkpoint::MAX_SEQ + 1, &t.holder()).await, Err(StoreError::OutOfRange(n)) if n == checkpoint::MAX_SEQ + 1)
    );
    h.shutdown().await;
    // Redis loses the fence counter; the next token still exceeds every one a commit saw.
    let mut c = redis.admin();
    let _: () = redis::cmd("DEL").arg("{m}:fence").query(&mut c).expect("del");
    let (_h2, _e2, t2) = leader(&redis.url(), "m", "fresh-process").await;
    assert!(t2.token() > t.token(), "token {} reissued after {}", t2.token(), t.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_and_oversized_values_read_as_corrupt_and_are_overwritten_by_a_commit() {
    let redis = RedisServer::start();
    let s = store(&redis.url(), "c");
    let key = format!("{{c}}:cursor:{FP}");
    for bad in [&b"abc"[..], b"-5", b"007", b"9007199254740992", b"1.5", &vec![b'9'; 1 << 20]] {
        set(&redis, &key, bad);
        match s.read(FP).await {
            Ok(ReadOutcome::Corrupt(preview)) => {
                assert!(preview.len() < 64, "preview is short: {preview}");
            }
            other => panic!("{bad:.10?}: {other:?}"),
        }
    }
    set(&redis, "{c}:lease", b"x:3");
    assert_eq!(s.commit(FP, 7, "x:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(7)));
    // The script's bound is MAX_SEQ too: one above it is corrupt there as well, so a
    // commit replaces it instead of being refused as not newer.
    set(&redis, &key, (checkpoint::MAX_SEQ + 1).to_string().as_bytes());
    assert_eq!(s.commit(FP, 8, "x:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(8)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_redis_fails_closed() {
    let mut redis = RedisServer::start();
    let s = store(&redis.url(), "u");
    redis.pause();
    let t0 = std::time::Instant::now();
    assert!(matches!(s.read(FP).await, Err(StoreError::Unavailable(_))));
    assert!(t0.elapsed() < Duration::from_secs(3), "bounded by the op timeout");
    assert!(matches!(s.commit(FP, 1, "a:1").await, Err(StoreError::Unavailable(_))));
    redis.resume();
    redis.kill();
    // The cause is kept, typed: the Redis client's own (credential-safe) error, and the
    // message still says why.
    let e = s.read(FP).await.expect_err("down");
    let StoreError::Unavailable(cause) = &e else { panic!("{e:?}") };
    assert!(cause.downcast_ref::<redis_op::OpError>().is_some(), "{cause:?}");
    assert!(std::error::Error::source(&e).is_some());
    assert!(e.to_string().starts_with("cursor store unavailable: redis"), "{e}");
    redis.restart();
    assert_eq!(
        s.read(FP).await.map_err(|e| e.to_string()),
        Ok(ReadOutcome::Missing),
        "works again after a fresh connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_committers_only_the_holder_lands_and_the_maximum_wins() {
    let redis = RedisServer::start();
    set(&redis, "{cc}:lease", b"holder:7");
    let s = Arc::new(store(&redis.url(), "cc"));
    let mut tasks = Vec::new();
    for i in 0..200u64 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let token = if i % 3 == 0 { 6 } else { 7 };
            (token, i * 10, s.commit(FP, i * 10, &format!("holder:{token}")).await.expect("commit"))
        }));
    }
    let mut max_saved = 0;
    for t in tasks {
        let (token, cursor, out) = t.await.expect("task");
        match out {
            CommitOutcome::Saved => {
                assert_eq!(token, 7, "a stale token landed");
                max_saved = max_saved.max(cursor);
            }
            CommitOutcome::NotNewer { stored } => assert!(stored >= cursor),
            CommitOutcome::Fenced { current } => {
                assert_eq!(token, 6);
                assert_eq!(current, Some(7));
            }
        }
    }
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(max_saved)));
    assert_eq!(max_saved, 1990);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_cursors_migrate_for_root_urls_only() {
    let redis = RedisServer::start();
    let s = store(&redis.url(), "l");
    let new_key = format!("{{l}}:cursor:{FP}");
    // Root URL, no new key: the legacy value moves over and the old key goes.
    set(&redis, "wisp:firehose-cursor:bsky.network", b"500");
    assert_eq!(s.migrate_legacy(FP, "bsky.network", true).await.map_err(|e| e.to_string()), Ok(Some(500)));
    assert_eq!(get(&redis, &new_key).as_deref(), Some("500"));
    assert_eq!(get(&redis, "wisp:firehose-cursor:bsky.network"), None);
    // The new key is ahead: it never moves backwards, the old key still goes.
    set(&redis, &new_key, b"900");
    set(&redis, "wisp:firehose-cursor:bsky.network", b"600");
    assert_eq!(s.migrate_legacy(FP, "bsky.network", true).await.map_err(|e| e.to_string()), Ok(Some(600)));
    assert_eq!(get(&redis, &new_key).as_deref(), Some("900"));
    // A corrupt legacy value is left alone.
    set(&redis, "wisp:firehose-cursor:bsky.network", b"junk");
    assert_eq!(s.migrate_legacy(FP, "bsky.network", true).await.map_err(|e| e.to_string()), Ok(None));
    assert_eq!(get(&redis, "wisp:firehose-cursor:bsky.network").as_deref(), Some("junk"));
    // A URL with a path and a legacy key: refuse, naming the fix.
    set(&redis, "wisp:firehose-cursor:relay.example:8443", b"5");
    let e = s.migrate_legacy(FP, "relay.example:8443", false).await.expect_err("ambiguous");
    assert!(matches!(&e, StoreError::LegacyAmbiguous { host } if host == "relay.example:8443"));
    assert!(e.to_string().contains("set this relay's cursor explicitly"), "{e}");
    assert_eq!(
        s.migrate_legacy(FP, "other.example", false).await.map_err(|e| e.to_string()),
        Ok(None),
        "no legacy key: nothing to do"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_answering_nonsense_is_a_protocol_error() {
    // Answers +OK to everything, like a misconfigured proxy.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 4096];
                while let Ok(n) = sock.read(&mut buf).await {
                    if n == 0 || sock.write_all(b"+OK\r\n").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let s = RedisStore::new(&format!("redis://{addr}/"), RedisKeys::new("n", None), OP).expect("store");
    let r = s.commit(FP, 1, "a:1").await;
    // Depending on where the nonsense bites (handshake or script reply) it is a protocol
    // or an I/O error: typed, and never a saved cursor.
    assert!(matches!(r, Err(StoreError::Protocol(_) | StoreError::Unavailable(_))), "{r:?}");
    match s.read(FP).await {
        Ok(ReadOutcome::Corrupt(_)) | Err(_) => {}
        other => panic!("nonsense must not read as a cursor: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saved_commits_are_published_for_standbys_to_shadow() {
    let redis = RedisServer::start();
    set(&redis, "{pub}:lease", b"a:3");
    let s = store(&redis.url(), "pub");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let follower = tokio::spawn(checkpoint::redis_store::follow_commits(
        redis.url(),
        s.keys().commits_channel.clone(),
        move |p: checkpoint::redis_store::Published<'_>| {
            s2.lock().expect("seen").push((p.fingerprint.to_owned(), p.cursor, p.reset));
        },
    ));
    tokio::time::sleep(Duration::from_millis(300)).await; // subscribed
    assert_eq!(s.commit(FP, 10, "a:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.commit(FP, 5, "a:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::NotNewer { stored: 10 }));
    assert_eq!(
        s.commit(FP, 20, "a:2").await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(3) })
    );
    timeout(Duration::from_secs(10), async {
        while seen.lock().expect("seen").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("published");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(s.reset(FP, 4, "a:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved), "a fenced rewind");
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(4)));
    timeout(Duration::from_secs(10), async {
        while seen.lock().expect("seen").len() < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("published");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        *seen.lock().expect("seen"),
        vec![(FP.to_owned(), 10, false), (FP.to_owned(), 4, true)],
        "only saved commits are published, rewinds marked as such"
    );
    follower.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_fences_on_the_whole_holder_value_not_only_the_token_number() {
    let redis = RedisServer::start();
    // The token number 5 was re-issued to another instance (possible after total data
    // loss): the stale holder "old:5" must be refused although its number matches.
    set(&redis, "{hv}:lease", b"new:5");
    let s = store(&redis.url(), "hv");
    assert_eq!(
        s.commit(FP, 10, "old:5").await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(5) })
    );
    assert_eq!(
        s.reset(FP, 10, "old:5").await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(5) })
    );
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Missing), "nothing landed");
    assert_eq!(s.commit(FP, 10, "new:5").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.commit(FP, 3, "new:5").await.map_err(|e| e.to_string()), Ok(CommitOutcome::NotNewer { stored: 10 }));
    assert_eq!(s.reset(FP, 3, "new:5").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(3)));
    assert!(matches!(s.commit(FP, 4, "no-token").await, Err(StoreError::Protocol(_))));
}

/// The checkpoint carries the relay time at the cursor and the relay the leader is on,
/// in the same fenced write; a stale holder moves neither, and a cursor written without a
/// time (a rewind, `cursor set`) forgets the older cursor's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_at_keeps_time_and_active_relay_fenced() {
    let redis = RedisServer::start();
    let s = store(&redis.url(), "t");
    set(&redis, "{t}:lease", b"x:3");
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None), "old-format cursors have no time");
    assert_eq!(
        s.commit_at(FP, 10, Some(1_700_000_000_123), "x:3").await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Saved)
    );
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(Some(1_700_000_000_123)));
    assert_eq!(s.active_relay().await.map_err(|e| e.to_string()), Ok(Some(FP.to_owned())));
    assert!(matches!(s.commit_at("other", 11, Some(5), "x:2").await, Ok(CommitOutcome::Fenced { .. })));
    assert_eq!(
        s.active_relay().await.map_err(|e| e.to_string()),
        Ok(Some(FP.to_owned())),
        "a fenced commit moves nothing"
    );
    assert_eq!(s.read_time("other").await.map_err(|e| e.to_string()), Ok(None));
    assert_eq!(s.reset(FP, 4, "x:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None), "a rewind has no time of its own");
    assert_eq!(s.commit_at(FP, 12, Some(9), "x:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    s.force(FP, 3).await.expect("force");
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None), "cursor set has no time of its own");
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(3)));
}
