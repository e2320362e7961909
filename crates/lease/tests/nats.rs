//! The lease against real `nats-server -js` processes (JetStream KV), each test starting
//! its own on a free port so it can kill, pause, restart or wipe it — the Redis lease
//! tests' faults, on NATS.

mod common;

use common::{cfg, elected, next_event, no_event};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lease::backend::{Acquire, Renew};
use lease::{Backend, LeaseConfig, LeaseEvent, LossReason, NatsBackend};
use nats_op::{Nats, NatsConfig};
use testkit::{NatsServer, TcpProxy, WAIT};
use tokio::time::{sleep, timeout};

async fn nats(url: &str, op_timeout: Duration) -> Nats {
    Nats::connect(&NatsConfig { url: url.to_owned(), creds_file: None, ca_file: None, token: None, op_timeout })
        .await
        .expect("connect")
}

type Node = common::Node<NatsBackend>;

async fn node_with(url: &str, c: LeaseConfig, name: &str) -> Node {
    let n = nats(url, c.op_timeout).await;
    let backend = Arc::new(NatsBackend::new(&n, &c.key_prefix, c.ttl));
    common::spawn(backend, c, name)
}

async fn node(url: &str, prefix: &str, name: &str) -> Node {
    node_with(url, cfg(prefix), name).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_candidates_exactly_one_leader_twenty_times() {
    let server = NatsServer::start();
    for round in 0..20 {
        let prefix = format!("race{round}");
        let mut nodes = Vec::new();
        for i in 0..5 {
            nodes.push(node(&server.url(), &prefix, &format!("n{i}")).await);
        }
        let deadline = Instant::now() + WAIT;
        let mut leaders = Vec::new();
        while leaders.is_empty() && Instant::now() < deadline {
            for (i, n) in nodes.iter_mut().enumerate() {
                if let Ok(LeaseEvent::Elected(t)) = n.events.try_recv() {
                    leaders.push((i, t));
                }
            }
            sleep(Duration::from_millis(5)).await;
        }
        sleep(Duration::from_millis(300)).await;
        for (i, n) in nodes.iter_mut().enumerate() {
            while let Ok(e) = n.events.try_recv() {
                if let LeaseEvent::Elected(t) = e {
                    leaders.push((i, t));
                }
            }
        }
        assert_eq!(leaders.len(), 1, "round {round}: {leaders:?}");
        for n in &nodes {
            n.handle.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_handover_wakes_the_standby_through_the_key_watch() {
    let server = NatsServer::start();
    let mut gaps = Vec::new();
    for round in 0..5 {
        let prefix = format!("handover{round}");
        // A poll of 30 s: only the watch on the key can make the standby lead quickly.
        let slow = LeaseConfig { poll: Duration::from_secs(30), ..cfg(&prefix) };
        let mut a = node_with(&server.url(), slow.clone(), "a").await;
        let ta = elected(&mut a).await;
        let mut b = node_with(&server.url(), slow, "b").await;
        sleep(Duration::from_millis(1500)).await;
        no_event(&mut b);
        let t0 = Instant::now();
        a.handle.step_down_with(async { Ok::<(), String>(()) }, Duration::from_secs(5)).await.expect("clean step-down");
        let tb = elected(&mut b).await;
        gaps.push(t0.elapsed());
        assert!(tb.token() > ta.token());
        assert!(!ta.is_active());
        b.handle.shutdown().await;
    }
    eprintln!("handover gaps: {gaps:?}");
    // Without the wake-up the standby still tries at the key's observed expiry instead of
    // the 30 s poll: here 0.5 s after the release (it polled 1.5 s into a 2 s ttl). A
    // quarter of a second tells the two apart.
    assert!(
        gaps.iter().all(|g| *g < Duration::from_millis(250)),
        "woken at once, not at the observed expiry: {gaps:?}"
    );
}

/// A restart with the data kept, shorter than the ttl: the key and the fence survive, the
/// leader renews on the new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restarted_within_the_ttl_no_flip() {
    let mut server = NatsServer::start();
    let mut a = node(&server.url(), "r1", "a").await;
    let t = elected(&mut a).await;
    server.restart();
    sleep(Duration::from_secs(3)).await;
    assert!(t.is_active(), "the leader kept its term across the restart");
    no_event(&mut a);
    let snap = a.backend.snapshot().await.expect("snapshot");
    assert_eq!(snap.holder, Some(format!("a:{}", t.token())));
    assert_eq!(snap.fence, t.token());
}

/// NATS down longer than the ttl, then back with nothing (the buckets lost): the leader
/// loses at its deadline, and the next term's token is above every token seen although
/// the store forgot them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_past_the_ttl_and_wiped_loses_then_a_greater_token_is_issued() {
    let mut server = NatsServer::start();
    let mut a = node(&server.url(), "k2", "a").await;
    let mut b = node(&server.url(), "k2", "b").await;
    let (a_leads, t) = tokio::select! {
        e = a.events.recv() => match e { Some(LeaseEvent::Elected(t)) => (true, t), o => panic!("{o:?}") },
        e = b.events.recv() => match e { Some(LeaseEvent::Elected(t)) => (false, t), o => panic!("{o:?}") },
    };
    let first = t.token();
    // Let the standby poll once, so it has seen the leader's token.
    sleep(Duration::from_millis(600)).await;
    server.kill();
    let leader = if a_leads { &mut a } else { &mut b };
    match next_event(leader).await {
        LeaseEvent::Lost { reason: LossReason::Expired, .. } => {}
        e => panic!("{e:?}"),
    }
    assert!(!t.is_active());
    drop(t);
    server.wipe();
    let t2 = tokio::select! {
        e = a.events.recv() => e,
        e = b.events.recv() => e,
    };
    let Some(LeaseEvent::Elected(t2)) = t2 else { panic!("{t2:?}") };
    assert!(t2.token() > first, "token {} after {first}", t2.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_paused_shorter_than_the_window_no_flip_longer_loses_at_the_deadline() {
    let server = NatsServer::start();
    let mut a = node(&server.url(), "p", "a").await;
    let t = elected(&mut a).await;
    server.pause();
    sleep(Duration::from_millis(700)).await;
    server.resume();
    sleep(Duration::from_secs(2)).await;
    assert!(t.is_active());
    no_event(&mut a);
    server.pause();
    let t0 = Instant::now();
    match next_event(&mut a).await {
        LeaseEvent::Lost { reason: LossReason::Expired, .. } => {}
        e => panic!("{e:?}"),
    }
    let took = t0.elapsed();
    assert!(took <= Duration::from_millis(1500) + Duration::from_millis(400), "lost within the window: {took:?}");
    assert!(!t.is_active());
    server.resume();
    let first = t.token();
    drop(t);
    let t2 = elected(&mut a).await;
    assert!(t2.token() > first);
}

/// Latency below the op timeout (60 ms each way against 250 ms): no flip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_nats_below_the_op_timeout_does_not_flap() {
    let server = NatsServer::start();
    let proxy = TcpProxy::start(server.addr()).await;
    let url = format!("nats://{}", proxy.addr());
    let mut a = node(&url, "slow", "a").await;
    let t = elected(&mut a).await;
    proxy.set_latency(Duration::from_millis(60));
    sleep(Duration::from_secs(4)).await;
    proxy.set_latency(Duration::ZERO);
    assert!(t.is_active(), "still leading");
    no_event(&mut a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_off_from_nats_loses_and_the_standby_takes_over() {
    let server = NatsServer::start();
    let proxy = TcpProxy::start(server.addr()).await;
    let mut a = node(&format!("nats://{}", proxy.addr()), "cut", "a").await;
    let ta = elected(&mut a).await;
    let mut b = node(&server.url(), "cut", "b").await;
    sleep(Duration::from_millis(500)).await;
    no_event(&mut b);
    proxy.set_cut(true);
    match next_event(&mut a).await {
        LeaseEvent::Lost { reason: LossReason::Expired, .. } => {}
        e => panic!("{e:?}"),
    }
    let lost_at = Instant::now();
    let tb = elected(&mut b).await;
    assert!(tb.token() > ta.token());
    assert!(!ta.is_active());
    eprintln!("standby elected {:?} after the old leader stopped", lost_at.elapsed());
    proxy.set_cut(false);
    drop(ta);
    sleep(Duration::from_secs(1)).await;
    no_event(&mut a);
}

/// A half-open connection (the proxy forwards nothing and resets nothing): the op
/// timeouts end the term, and the forced reconnect brings the replica back as a standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_connection_ends_the_term_and_the_replica_comes_back() {
    let server = NatsServer::start();
    let proxy = TcpProxy::start(server.addr()).await;
    let mut a = node(&format!("nats://{}", proxy.addr()), "half", "a").await;
    let ta = elected(&mut a).await;
    proxy.set_flow(testkit::Flow::Blackhole);
    match next_event(&mut a).await {
        LeaseEvent::Lost { reason: LossReason::Expired, .. } => {}
        e => panic!("{e:?}"),
    }
    proxy.set_flow(testkit::Flow::Pass);
    let first = ta.token();
    drop(ta);
    let t2 = elected(&mut a).await;
    assert!(t2.token() > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_key_is_retaken_and_an_overwritten_key_is_lost_once() {
    let server = NatsServer::start();
    let mut a = node(&server.url(), "d", "a").await;
    let t = elected(&mut a).await;
    let admin = nats(&server.url(), Duration::from_secs(5)).await;
    let kv = admin.jetstream().get_key_value("d-lease").await.expect("bucket");
    kv.purge("leader").await.expect("purge");
    sleep(Duration::from_secs(1)).await;
    assert!(t.is_active());
    no_event(&mut a);
    let v = kv.get("leader").await.expect("get").expect("retaken");
    assert_eq!(v.as_ref(), format!("a:{}", t.token()).as_bytes());
    kv.put("leader", "intruder:99".into()).await.expect("put");
    match next_event(&mut a).await {
        LeaseEvent::Lost { reason: LossReason::TakenBy(h), .. } => assert_eq!(h, "intruder:99"),
        e => panic!("{e:?}"),
    }
    sleep(Duration::from_secs(1)).await;
    no_event(&mut a);
}

/// The fence in the state bucket: tokens above the counter, `fence-seen` and the floor;
/// a counter behind our token is retaken and raised; above it means a newer term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_fenced_by_the_state_bucket() {
    let server = NatsServer::start();
    let n = nats(&server.url(), Duration::from_millis(500)).await;
    let b = NatsBackend::new(&n, "behind", Duration::from_secs(5));
    assert_eq!(b.seed_fence(10).await.expect("seed"), 10);
    let Acquire::Acquired { token } = b.acquire("a", Duration::from_secs(5), 0).await.expect("acquire") else {
        panic!("not acquired")
    };
    assert_eq!(token, 11);
    let Acquire::Held { holder, expires_in } = b.acquire("x", Duration::from_secs(5), 0).await.expect("acquire") else {
        panic!("acquired twice")
    };
    assert_eq!(holder, "a:11");
    assert!(expires_in.is_some_and(|d| d <= Duration::from_secs(5) && d > Duration::from_secs(3)), "{expires_in:?}");
    let admin = nats(&server.url(), Duration::from_secs(5)).await;
    let lease = admin.jetstream().get_key_value("behind-lease").await.expect("bucket");
    let state = admin.jetstream().get_key_value("behind-state").await.expect("bucket");
    lease.purge("leader").await.expect("purge");
    state.put("fence", "3".into()).await.expect("lagging counter");
    assert_eq!(b.renew("a", 11, Duration::from_secs(5)).await.expect("renew"), Renew::Retaken);
    assert_eq!(state.get("fence").await.expect("get").expect("fence").as_ref(), b"11", "raised to our token");
    lease.purge("leader").await.expect("purge");
    state.put("fence-seen", "20".into()).await.expect("a commit saw 20");
    let Acquire::Acquired { token } = b.acquire("fresh", Duration::from_secs(5), 0).await.expect("acquire") else {
        panic!("not acquired")
    };
    assert_eq!(token, 21, "above what a checkpoint saw");
    assert!(matches!(b.renew("a", 11, Duration::from_secs(5)).await.expect("renew"), Renew::TakenBy { .. }));
    lease.purge("leader").await.expect("purge");
    assert_eq!(b.renew("a", 11, Duration::from_secs(5)).await.expect("renew"), Renew::Fenced { fence: Some(21) });
    let Acquire::Acquired { token } = b.acquire("floor", Duration::from_secs(5), 40).await.expect("acquire") else {
        panic!("not acquired")
    };
    assert_eq!(token, 41, "above the floor this process saw");
    assert!(!b.release("a").await.expect("release"), "only the holder releases");
    assert!(b.release("floor").await.expect("release"));
    assert!(!b.release("floor").await.expect("release"), "released once");
    assert_eq!(b.snapshot().await.expect("snapshot").holder, None);
}

/// The lease bucket's entries expire by age: a holder that stops renewing loses its key
/// after the ttl, and the next candidate wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrenewed_key_expires_after_the_ttl() {
    let server = NatsServer::start();
    let n = nats(&server.url(), Duration::from_millis(500)).await;
    let b = NatsBackend::new(&n, "age", Duration::from_secs(1));
    let t0 = Instant::now();
    assert!(matches!(b.acquire("a", Duration::from_secs(1), 0).await, Ok(Acquire::Acquired { token: 1 })));
    assert!(matches!(b.acquire("b", Duration::from_secs(1), 0).await, Ok(Acquire::Held { .. })));
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(Acquire::Acquired { token }) = b.acquire("b", Duration::from_secs(1), 0).await {
            assert_eq!(token, 2);
            break;
        }
        assert!(Instant::now() < deadline, "the key never expired");
        sleep(Duration::from_millis(50)).await;
    }
    let took = t0.elapsed();
    eprintln!("expired after {took:?}");
    assert!(took >= Duration::from_secs(1), "not before the ttl: {took:?}");
}

/// A rolling change of the ttl (10 s → 1 s): a replica that opens the lease bucket with
/// the shorter ttl must not shorten the running leader's key. Before the fix, opening the
/// bucket lowered its age limit to the opener's ttl, the leader's key expired between two
/// renewals while its own deadline still ran, and the new replica started a second term
/// (two active at once for ~0.9 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_a_shorter_ttl_never_shortens_the_leaders_key() {
    let server = NatsServer::start();
    let long = LeaseConfig {
        poll: Duration::from_millis(100),
        key_prefix: "rolling".into(),
        ..LeaseConfig::from_ttl(Duration::from_secs(10))
    };
    let short = LeaseConfig {
        poll: Duration::from_millis(100),
        key_prefix: "rolling".into(),
        ..LeaseConfig::from_ttl(Duration::from_secs(1))
    };
    let mut a = node_with(&server.url(), long.clone(), "a").await;
    let term_a = elected(&mut a).await;
    let mut b = node_with(&server.url(), short, "b").await;
    // b contends for several of its ttls, polling every 100 ms, while a renews every ~2 s:
    // a key living only 1 s would expire between a's renewals.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        assert!(term_a.is_active(), "a's term runs");
        if let Ok(LeaseEvent::Elected(t)) = b.events.try_recv() {
            panic!("b started term {} while a's term {} was active", t.token(), term_a.token());
        }
        sleep(Duration::from_millis(20)).await;
    }
    // The bucket kept the longer age, and a renewal raises it back when something lowers it.
    let n = nats(&server.url(), Duration::from_secs(1)).await;
    let js = n.jetstream();
    let mut info = js.get_stream("KV_rolling-lease").await.expect("stream").cached_info().config.clone();
    assert_eq!(info.max_age, Duration::from_secs(10), "never lowered");
    info.max_age = Duration::from_millis(500);
    info.duplicate_window = Duration::from_millis(500);
    js.update_stream(info).await.expect("an operator lowers it");
    let raised = async {
        loop {
            let age = js.get_stream("KV_rolling-lease").await.expect("stream").cached_info().config.max_age;
            if age == Duration::from_secs(10) {
                return;
            }
            sleep(Duration::from_millis(50)).await;
        }
    };
    timeout(WAIT, raised).await.expect("the replicas raised the age limit again");
    assert!(term_a.is_active(), "a still leads");
    no_event(&mut b);
    drop((a, b));
    let _ = long;
}

/// Key prefixes that NATS bucket names cannot hold are refused, never folded: `prod.eu`
/// used to share `prod_eu`'s buckets (one could not lead while the other ran).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_that_would_share_buckets_are_refused() {
    let server = NatsServer::start();
    let n = nats(&server.url(), Duration::from_millis(500)).await;
    let underscore = NatsBackend::new(&n, "prod_eu", Duration::from_secs(5));
    let dot = NatsBackend::new(&n, "prod.eu", Duration::from_secs(5));
    assert!(matches!(underscore.acquire("a", Duration::from_secs(5), 0).await, Ok(Acquire::Acquired { token: 1 })));
    let e = dot.acquire("b", Duration::from_secs(5), 0).await.expect_err("refused").to_string();
    assert!(e.contains("prod.eu") && e.contains("prefix"), "{e}");
}

/// The Redis suite's late-renewal scenario on NATS: the leader is cut off until it loses
/// its term, then its renewal lands (the key set again to its value, living a whole
/// ttl). A process that holds no term but finds its own value on the key takes it back
/// once the store answers: someone leads at once, not a ttl later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_lands_after_the_leader_stepped_down_is_released_at_once() {
    let server = NatsServer::start();
    let proxy = TcpProxy::start(server.addr()).await;
    let six = |prefix: &str| LeaseConfig {
        poll: Duration::from_millis(200),
        key_prefix: prefix.to_owned(),
        ..LeaseConfig::from_ttl(Duration::from_secs(6))
    };
    let mut a = node_with(&format!("nats://{}", proxy.addr()), six("late"), "a").await;
    let ta = elected(&mut a).await;
    let mut b = node_with(&server.url(), six("late"), "b").await;
    sleep(Duration::from_millis(300)).await;
    proxy.set_cut(true);
    match next_event(&mut a).await {
        LeaseEvent::Lost { reason: LossReason::Expired, .. } => {}
        e => panic!("{e:?}"),
    }
    drop(ta);
    // The renewal a sent before its deadline lands now.
    let admin = nats(&server.url(), Duration::from_secs(5)).await;
    let kv = admin.jetstream().get_key_value("late-lease").await.expect("bucket");
    kv.put("leader", "a:1".into()).await.expect("put");
    proxy.set_cut(false);
    common::someone_elected_at_once(&mut a, &mut b, Instant::now()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_settings_record_keeps_the_latest_terms() {
    let server = NatsServer::start();
    let n = nats(&server.url(), Duration::from_millis(500)).await;
    let b = NatsBackend::new(&n, "record", Duration::from_secs(2));
    common::the_settings_record_keeps_the_latest_terms(&b).await;
}
