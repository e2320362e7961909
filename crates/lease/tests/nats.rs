//! The lease against real `nats-server -js` processes (JetStream KV), each test starting
//! its own on a free port: what only NATS has (latency below the op timeout, a half-open
//! connection, the state bucket's fence, key expiry by the bucket's age limit, prefixes
//! that would share a bucket). The scenarios every store must pass are in `stores.rs`.

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

/// A candidate that raised the fence, then another that raised it further, won, led
/// and released, before the first created the key: the first must not start a term
/// with its lower token after a higher one already led.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_overtaken_between_fence_and_key_backs_off() {
    let server = testkit::NatsServer::start();
    let n = server.connect(Duration::from_secs(2)).await;
    let a = NatsBackend::new(&n, "race", Duration::from_secs(5));
    let b = NatsBackend::new(&n, "race", Duration::from_secs(5));
    let overtake = async {
        let got = b.acquire("b", Duration::from_secs(5), 0).await.expect("b acquires");
        assert_eq!(got, Acquire::Acquired { token: 2 });
        assert!(b.release("b").await.expect("b releases"));
    };
    let out = a.acquire_with("a", Duration::from_secs(5), 0, overtake).await;
    assert!(out.is_err(), "a backs off: {out:?}");
    assert_eq!(a.snapshot().await.expect("snapshot").holder, None, "and its key is gone");
    assert_eq!(a.acquire("a", Duration::from_secs(5), 0).await.expect("again"), Acquire::Acquired { token: 3 });
}

/// A candidate that loses the create race reports the winner with its key's expiry
/// (it was `None`, and a standby then had no expiry to wait out when NATS lost the
/// key: two leaders in issue 34's CI run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_loses_the_create_race_reports_the_winners_expiry() {
    let server = testkit::NatsServer::start();
    let n = server.connect(Duration::from_secs(2)).await;
    let ttl = Duration::from_secs(5);
    let a = NatsBackend::new(&n, "race2", ttl);
    let b = NatsBackend::new(&n, "race2", ttl);
    let win = async {
        assert_eq!(a.acquire("a", ttl, 0).await.expect("a acquires"), Acquire::Acquired { token: 2 });
    };
    let Acquire::Held { holder, expires_in } = b.acquire_with("b", ttl, 0, win).await.expect("b") else {
        panic!("b cannot have won");
    };
    assert_eq!(holder, "a:2");
    assert!(expires_in.is_some_and(|d| d > Duration::from_secs(3) && d <= ttl), "{expires_in:?}");
}
