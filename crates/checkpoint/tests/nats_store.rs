//! The NATS KV cursor store against real `nats-server -js` processes, with the real
//! NATS lease: the same outcomes (`Saved`, `NotNewer`, `Fenced`) and properties as the
//! Redis and Postgres stores.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use checkpoint::{CommitOutcome, CursorStore, Fence, NatsStore, ReadOutcome, RelayKey, StoreError};
use lease::{BootClock, LeaseConfig, LeaseEvent, NatsBackend, Term};
use nats_op::{Nats, NatsConfig};
use rand::{Rng, SeedableRng};
use testkit::NatsServer;
use tokio::time::timeout;

mod seam;
use seam::Writes as _;

const FP: &str = "9f2c1e0b7a6d5c4b3a29181706f5e4d3c2b1a09f8e7d6c5b4a3928170615f4e3";
const OP: Duration = Duration::from_millis(500);

async fn nats(url: &str) -> Nats {
    Nats::connect(&NatsConfig { url: url.to_owned(), creds_file: None, ca_file: None, token: None, op_timeout: OP })
        .await
        .expect("connect")
}

fn fence(holder: &str) -> Fence<'_> {
    let token = holder.rsplit_once(':').and_then(|(_, t)| t.parse().ok()).expect("holder");
    Fence { holder, token }
}

fn relays() -> [RelayKey<'static>; 1] {
    [RelayKey { fingerprint: FP, host_port: "relay:443", is_root: true }]
}

async fn leader(url: &str, prefix: &str, name: &str) -> (lease::LeaseHandle, Term) {
    let cfg = LeaseConfig {
        poll: Duration::from_millis(100),
        key_prefix: prefix.to_owned(),
        ..LeaseConfig::from_ttl(Duration::from_secs(2))
    };
    let backend = Arc::new(NatsBackend::new(&nats(url).await, prefix, cfg.ttl));
    let (h, mut ev) = lease::spawn_as(backend, cfg, Arc::new(BootClock), name).expect("config");
    let Some(LeaseEvent::Elected(t)) = timeout(Duration::from_secs(20), ev.recv()).await.expect("elected") else {
        panic!("not elected")
    };
    (h, t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_write_seam_advances_rewinds_and_fences() {
    let server = NatsServer::start();
    let s = NatsStore::new(&nats(&server.url()).await, "seam");
    seam::write_contract(&s, fence("x:3"), fence("w:2")).await;
    seam::repo_contract(&s, fence("x:3"), fence("w:2")).await;
}

/// Elected terms claim the cursors; the old one is refused from then on, also on a key
/// it committed before, and the lease issues tokens above what the store saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_token_is_refused_once_the_new_term_claimed() {
    let server = NatsServer::start();
    let s = NatsStore::new(&nats(&server.url()).await, "fk");
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Missing));
    let (a, ta) = leader(&server.url(), "fk", "a").await;
    s.on_elected(fence(&ta.holder()), &relays()).await.expect("claim");
    assert_eq!(
        s.read(FP).await.map_err(|e| e.to_string()),
        Ok(ReadOutcome::Missing),
        "a claim does not invent a cursor"
    );
    assert_eq!(s.commit(FP, 10, fence(&ta.holder())).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    a.step_down_with(async { Ok::<(), String>(()) }, Duration::from_secs(2)).await.expect("release");
    let (_b, tb) = leader(&server.url(), "fk", "b").await;
    assert!(tb.token() > ta.token());
    s.on_elected(fence(&tb.holder()), &relays()).await.expect("claim");
    assert_eq!(
        s.commit(FP, 50, fence(&ta.holder())).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(tb.token()) }),
        "old term refused"
    );
    assert!(s.on_elected(fence(&ta.holder()), &relays()).await.is_err(), "an old term cannot claim back");
    assert_eq!(s.commit(FP, 20, fence(&tb.holder())).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(20)));
    assert_eq!(s.fence_floor().await.map_err(|e| e.to_string()), Ok(Some(tb.token())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_never_move_backwards_a_rewind_may_and_time_and_active_relay_follow_saved_commits() {
    let server = NatsServer::start();
    let s = NatsStore::new(&nats(&server.url()).await, "m");
    let f = fence("a:3");
    s.on_elected(f, &relays()).await.expect("claim");
    assert_eq!(s.commit_at(FP, 100, Some(77), f).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(Some(77)));
    assert_eq!(s.active_relay().await.map_err(|e| e.to_string()), Ok(Some(FP.to_owned())));
    assert_eq!(
        s.commit_at(FP, 99, Some(99), f).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::NotNewer { stored: 100 })
    );
    assert_eq!(s.commit(FP, 100, f).await.map_err(|e| e.to_string()), Ok(CommitOutcome::NotNewer { stored: 100 }));
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(Some(77)), "a refused commit leaves the time");
    assert!(
        matches!(s.commit(FP, checkpoint::MAX_SEQ + 1, f).await, Err(StoreError::OutOfRange(n)) if n == checkpoint::MAX_SEQ + 1)
    );
    assert_eq!(
        s.commit_at("other", 5, Some(1), fence("old:2")).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(3) })
    );
    assert_eq!(
        s.active_relay().await.map_err(|e| e.to_string()),
        Ok(Some(FP.to_owned())),
        "a fenced commit moves nothing"
    );
    assert_eq!(s.commit_at("other", 5, Some(1), f).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.active_relay().await.map_err(|e| e.to_string()), Ok(Some("other".to_owned())));
    assert_eq!(s.reset(FP, 40, f).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(40)), "a fenced rewind may go lower");
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None), "and forgets the time");
    assert_eq!(s.commit_at(FP, 45, Some(5), f).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    s.force(FP, 10).await.expect("force");
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(10)));
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None), "cursor set forgets the time");
    assert_eq!(s.commit(FP, 11, f).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved), "force keeps the fence");
    assert_eq!(
        s.commit(FP, 12, fence("old:2")).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(3) })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_values_read_as_corrupt_and_are_overwritten_by_a_commit() {
    let server = NatsServer::start();
    let n = nats(&server.url()).await;
    let s = NatsStore::new(&n, "c");
    s.on_elected(fence("x:3"), &relays()).await.expect("claim");
    let admin = n.jetstream().get_key_value("c-state").await.expect("bucket");
    let key = format!("cursor.{FP}");
    for bad in [&b"abc"[..], b"-5 3 - 0", b"9007199254740992 3 - 0", b"1.5 3 - 0", &vec![b'9'; 100_000]] {
        admin.put(&key, bytes::Bytes::copy_from_slice(bad)).await.expect("put");
        match s.read(FP).await {
            Ok(ReadOutcome::Corrupt(preview)) => assert!(preview.len() < 64, "preview is short: {preview}"),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(&bad[..bad.len().min(10)])),
        }
    }
    assert_eq!(s.commit(FP, 7, fence("x:3")).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(7)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_nats_fails_closed_and_a_restart_keeps_the_cursor() {
    let mut server = NatsServer::start();
    let s = NatsStore::new(&nats(&server.url()).await, "u");
    assert_eq!(s.commit(FP, 5, fence("a:1")).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    server.pause();
    let t0 = std::time::Instant::now();
    assert!(matches!(s.read(FP).await, Err(StoreError::Unavailable(_))));
    assert!(t0.elapsed() < Duration::from_secs(3), "bounded by the op timeout");
    assert!(matches!(s.commit(FP, 6, fence("a:1")).await, Err(StoreError::Unavailable(_))));
    server.resume();
    server.kill();
    assert!(matches!(s.read(FP).await, Err(StoreError::Unavailable(_))));
    server.restart();
    testkit::eventually("reads again after the restart", testkit::WAIT, async || {
        matches!(s.read(FP).await, Ok(ReadOutcome::Found(5)))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_committers_only_the_newest_term_lands_and_the_maximum_wins() {
    let server = NatsServer::start();
    let n = nats(&server.url()).await;
    let s = Arc::new(NatsStore::new(&n, "cc"));
    s.on_elected(fence("holder:7"), &relays()).await.expect("claim");
    let mut tasks = Vec::new();
    for i in 0..120u64 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let token = if i % 3 == 0 { 6 } else { 7 };
            let h = format!("holder:{token}");
            (token, i * 10, s.commit(FP, i * 10, fence(&h)).await.expect("commit"))
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
    assert_eq!(max_saved, 1190);
}

/// Random operations of three terms (claims, commits, rewinds) against a model of what
/// a fenced, monotonic store must answer; 300 steps, fixed seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_operations_agree_with_the_model() {
    let server = NatsServer::start();
    let s = NatsStore::new(&nats(&server.url()).await, "model");
    let mut rng = rand::rngs::StdRng::seed_from_u64(20_261_203);
    // The model: the highest claim (`fence-seen`), the token kept with the cursor (the
    // last writer's, raised by claims), and the cursor.
    let (mut claimed, mut kept, mut cursor): (u64, u64, Option<u64>) = (0, 0, None);
    for step in 0..300 {
        let token = rng.random_range(1..=3u64);
        let h = format!("t:{token}");
        let f = fence(&h);
        let refused = if token < claimed {
            Some(claimed)
        } else if token < kept {
            Some(kept)
        } else {
            None
        };
        match rng.random_range(0..10) {
            0 => {
                let out = s.on_elected(f, &relays()).await;
                assert_eq!(out.is_ok(), refused.is_none(), "step {step}: claim {token} ({claimed}, {kept}): {out:?}");
                if refused.is_none() {
                    (claimed, kept) = (token, token);
                }
            }
            1 => {
                let c = rng.random_range(0..1000);
                let out = s.reset(FP, c, f).await.expect("reset");
                if let Some(current) = refused {
                    assert_eq!(out, CommitOutcome::Fenced { current: Some(current) }, "step {step}");
                } else {
                    assert_eq!(out, CommitOutcome::Saved, "step {step}");
                    (cursor, kept) = (Some(c), token);
                }
            }
            _ => {
                let c = rng.random_range(0..1000);
                let out = s.commit(FP, c, f).await.expect("commit");
                let want = if let Some(current) = refused {
                    CommitOutcome::Fenced { current: Some(current) }
                } else if let Some(stored) = cursor.filter(|&s| s >= c) {
                    CommitOutcome::NotNewer { stored }
                } else {
                    (cursor, kept) = (Some(c), token);
                    CommitOutcome::Saved
                };
                assert_eq!(out, want, "step {step}: commit {c} with token {token} ({claimed}, {kept})");
            }
        }
        let read = s.read(FP).await.expect("read");
        assert_eq!(read, cursor.map_or(ReadOutcome::Missing, ReadOutcome::Found), "step {step}");
    }
}

/// Standbys follow every saved commit through a watch on the cursor keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saved_commits_reach_followers() {
    let server = NatsServer::start();
    let s = Arc::new(NatsStore::new(&nats(&server.url()).await, "follow"));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (f, t) = (s.clone(), seen.clone());
    let follower = tokio::spawn(async move {
        f.follow_commits(Box::new(move |fp, c, reset| t.lock().expect("seen").push((fp.to_owned(), c, reset)))).await;
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(s.commit(FP, 5, fence("a:1")).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.commit(FP, 9, fence("a:1")).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.reset(FP, 2, fence("a:1")).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    testkit::eventually("three commits followed", testkit::WAIT, async || seen.lock().expect("seen").len() >= 3).await;
    let got = seen.lock().expect("seen").clone();
    assert_eq!(got, vec![(FP.to_owned(), 5, false), (FP.to_owned(), 9, false), (FP.to_owned(), 2, true)]);
    follower.abort();
}

/// An older term's commit that passed its checks, then a newer term claimed, before
/// the older one's write: the write fails its compare-and-set, and the retry is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_racing_a_newer_claim_is_refused() {
    let server = NatsServer::start();
    let s = NatsStore::new(&server.connect(Duration::from_secs(2)).await, "race");
    let fp = "ab".repeat(32);
    let keys = [RelayKey { fingerprint: &fp, host_port: "r:443", is_root: true }];
    s.on_elected(Fence { holder: "a:1", token: 1 }, &keys).await.expect("a claims");
    let advance = checkpoint::Write::advance(&fp, 10, None);
    assert_eq!(
        s.write(advance, Fence { holder: "a:1", token: 1 }).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Saved)
    );
    let claim = async {
        s.on_elected(Fence { holder: "b:2", token: 2 }, &keys).await.expect("b claims");
    };
    let out = s.write_with(checkpoint::Write::advance(&fp, 20, None), 1, claim).await;
    assert_eq!(out.map_err(|e| e.to_string()), Ok(CommitOutcome::Fenced { current: Some(2) }));
    assert_eq!(
        s.read(&fp).await.map_err(|e| e.to_string()),
        Ok(ReadOutcome::Found(10)),
        "the stale write did not land"
    );
}
