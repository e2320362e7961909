//! The lease against real redis-server processes, each test starting its own on a free
//! port so it can kill, pause or restart it.

mod common;

use common::{cfg, elected, next_event, no_event};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lease::{Backend, LeaseConfig, LeaseEvent, LossReason, RedisBackend};
use testkit::{RedisServer, TcpProxy, WAIT};
use tokio::time::sleep;

type Node = common::Node<RedisBackend>;

fn node(url: &str, prefix: &str, name: &str) -> Node {
    let c = cfg(prefix);
    let backend = Arc::new(RedisBackend::new(url, prefix, c.op_timeout).expect("backend"));
    common::spawn(backend, c, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_candidates_exactly_one_leader_fifty_times() {
    let redis = RedisServer::start();
    for round in 0..50 {
        let prefix = format!("race{round}");
        let mut nodes: Vec<Node> = (0..5).map(|i| node(&redis.url(), &prefix, &format!("n{i}"))).collect();
        // Wait until someone leads, then give the others time to (wrongly) lead too.
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
        assert_eq!(leaders[0].1.token(), 1);
        for n in &nodes {
            n.handle.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_handover_wakes_the_standby_through_the_release_message() {
    let redis = RedisServer::start();
    let mut gaps = Vec::new();
    for round in 0..5 {
        let prefix = format!("handover{round}");
        // A poll of 30 s: only the release message can make the standby lead quickly.
        let mk = |name: &str| {
            let c = LeaseConfig { poll: Duration::from_secs(30), ..cfg(&prefix) };
            let backend = Arc::new(RedisBackend::new(&redis.url(), &prefix, c.op_timeout).expect("backend"));
            common::spawn(backend, c, name)
        };
        let mut a = mk("a");
        let ta = elected(&mut a).await;
        let mut b = mk("b");
        sleep(Duration::from_millis(1500)).await; // b polled once, subscribed, and waits
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_shorter_than_ttl_no_flip() {
    let mut redis = RedisServer::start();
    let mut a = node(&redis.url(), "k1", "a");
    let t = elected(&mut a).await;
    redis.kill();
    sleep(Duration::from_millis(300)).await;
    redis.restart(); // empty: no key, no fence
    sleep(Duration::from_secs(3)).await;
    assert!(t.is_active(), "the leader retook the vanished key with its own token");
    no_event(&mut a);
    let snap = a.backend.snapshot().await.expect("snapshot");
    assert_eq!(snap.holder.as_deref(), Some("a:1"));
    assert_eq!(snap.fence, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_longer_than_ttl_loses_then_a_greater_token_is_issued() {
    let mut redis = RedisServer::start();
    let mut a = node(&redis.url(), "k2", "a");
    let mut b = node(&redis.url(), "k2", "b");
    let (leader, other, t) = tokio::select! {
        e = a.events.recv() => match e { Some(LeaseEvent::Elected(t)) => ("a", "b", t), o => panic!("{o:?}") },
        e = b.events.recv() => match e { Some(LeaseEvent::Elected(t)) => ("b", "a", t), o => panic!("{o:?}") },
    };
    let _ = other;
    let first = t.token();
    // Let the standby poll once, so it has seen the leader's token: a process that never
    // saw a token cannot floor its next one after Redis forgets everything.
    sleep(Duration::from_millis(600)).await;
    redis.kill();
    let (ln, _) = if leader == "a" { (&mut a, &mut b) } else { (&mut b, &mut a) };
    match next_event(ln).await {
        LeaseEvent::Lost { reason: LossReason::Expired, .. } => {}
        e => panic!("{e:?}"),
    }
    assert!(!t.is_active());
    drop(t);
    redis.restart(); // empty: the fence counter is gone
    // Whoever wins next gets a token above every token seen, although Redis forgot them.
    let t2 = tokio::select! {
        e = a.events.recv() => e,
        e = b.events.recv() => e,
    };
    let Some(LeaseEvent::Elected(t2)) = t2 else { panic!("{t2:?}") };
    assert!(t2.token() > first, "token {} after {first}", t2.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_shorter_than_window_no_flip_longer_loses_at_the_deadline() {
    let redis = RedisServer::start();
    let mut a = node(&redis.url(), "p", "a");
    let t = elected(&mut a).await;
    redis.pause();
    sleep(Duration::from_millis(700)).await;
    redis.resume();
    sleep(Duration::from_secs(2)).await;
    assert!(t.is_active());
    no_event(&mut a);
    // Now longer than the ttl: every call hangs; the deadline timer still fires.
    redis.pause();
    let t0 = Instant::now();
    match next_event(&mut a).await {
        LeaseEvent::Lost { reason: LossReason::Expired, token: 1 } => {}
        e => panic!("{e:?}"),
    }
    let took = t0.elapsed();
    assert!(took <= Duration::from_millis(1500) + Duration::from_millis(400), "lost within the window: {took:?}");
    assert!(!t.is_active());
    redis.resume();
    drop(t);
    let t2 = elected(&mut a).await;
    assert_eq!(t2.token(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_key_is_retaken_and_overwritten_key_is_lost_once() {
    let redis = RedisServer::start();
    let mut a = node(&redis.url(), "d", "a");
    let t = elected(&mut a).await;
    let mut admin = redis.admin();
    let _: () = redis::cmd("DEL").arg("{d}:lease").query(&mut admin).expect("del");
    sleep(Duration::from_secs(1)).await;
    assert!(t.is_active());
    no_event(&mut a);
    let v: String = redis::cmd("GET").arg("{d}:lease").query(&mut admin).expect("get");
    assert_eq!(v, "a:1");
    let _: () = redis::cmd("SET").arg("{d}:lease").arg("intruder:9").query(&mut admin).expect("set");
    match next_event(&mut a).await {
        LeaseEvent::Lost { token: 1, reason: LossReason::TakenBy(h) } => assert_eq!(h, "intruder:9"),
        e => panic!("{e:?}"),
    }
    sleep(Duration::from_secs(1)).await;
    no_event(&mut a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_denying_eval_short_is_survived_long_loses() {
    let redis = RedisServer::start();
    let mut admin = redis.admin();
    let _: () =
        redis::cmd("ACL").arg(&["SETUSER", "fk", "on", ">pw", "~*", "&*", "+@all"][..]).query(&mut admin).expect("acl");
    let url = format!("redis://fk:pw@127.0.0.1:{}/", redis.port());
    let mut a = node(&url, "acl", "a");
    let t = elected(&mut a).await;
    let deny = |admin: &mut redis::Connection, on: bool| {
        let rule = if on { ["-eval", "-evalsha"] } else { ["+eval", "+evalsha"] };
        let _: () = redis::cmd("ACL").arg("SETUSER").arg("fk").arg(&rule[..]).query(admin).expect("acl");
    };
    deny(&mut admin, true);
    sleep(Duration::from_millis(700)).await;
    deny(&mut admin, false);
    sleep(Duration::from_secs(2)).await;
    assert!(t.is_active(), "a short denial is an outage, not a loss");
    no_event(&mut a);
    deny(&mut admin, true);
    match next_event(&mut a).await {
        LeaseEvent::Lost { reason: LossReason::Expired, .. } => {}
        e => panic!("{e:?}"),
    }
    deny(&mut admin, false);
    drop(t);
    let t2 = elected(&mut a).await;
    assert!(t2.token() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_off_from_redis_loses_and_the_standby_takes_over() {
    let redis = RedisServer::start();
    let proxy = TcpProxy::start(redis.addr()).await;
    let mut a = node(&proxy.redis_url(), "cut", "a");
    let ta = elected(&mut a).await;
    let mut b = node(&redis.url(), "cut", "b");
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
    // The standby can only win after the server expired a's key, which is after a stopped.
    assert!(!ta.is_active());
    eprintln!("standby elected {:?} after the old leader stopped", lost_at.elapsed());
    proxy.set_cut(false);
    drop(ta);
    sleep(Duration::from_secs(1)).await;
    no_event(&mut a);
}

/// A `lease-probe` child process whose stdout lines are collected.
struct Probe {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Probe {
    fn start(url: &str, prefix: &str, ttl_ms: u64, name: &str) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_lease-probe"))
            .args([url, prefix, &ttl_ms.to_string(), name])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("lease-probe");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().expect("stdout");
        let l = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                l.lock().expect("lines").push(line);
            }
        });
        Self { child, lines }
    }
    fn signal(&self, sig: &str) {
        if sig == "-STOP" {
            testkit::sigstop(self.child.id());
            return;
        }
        assert!(Command::new("kill").args([sig, &self.child.id().to_string()]).status().expect("kill").success());
    }
    fn lines(&self) -> Vec<String> {
        self.lines.lock().expect("lines").clone()
    }
    async fn wait_for(&self, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(l) = self.lines().into_iter().find(|l| pred(l)) {
                return l;
            }
            assert!(Instant::now() < deadline, "probe never printed the line; got {:?}", self.lines());
            sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_frozen_past_its_ttl_is_fenced_when_it_wakes() {
    let redis = RedisServer::start();
    let a = Probe::start(&redis.url(), "frozen", 1000, "a");
    a.wait_for(|l| l == "write ok 1").await;
    let b = Probe::start(&redis.url(), "frozen", 1000, "b");
    sleep(Duration::from_millis(300)).await;
    a.signal("-STOP");
    b.wait_for(|l| l == "write ok 2").await;
    let a_lines_before = a.lines().len();
    a.signal("-CONT");
    a.wait_for(|l| l.starts_with("lost 1")).await;
    sleep(Duration::from_millis(500)).await;
    // After waking, `a` made no successful write: its deadline had passed (it checks it
    // before acting), and the store would have refused token 1 anyway. One "write ok 1"
    // may still be printed after waking: a write that landed before the freeze whose line
    // the freeze held back (the order check below proves where it landed).
    let after: Vec<String> = a.lines()[a_lines_before..].to_vec();
    let stale = after.iter().filter(|l| *l == "write ok 1").count();
    assert!(stale <= 1, "stale writes after waking: {after:?}");
    let mut admin = redis.admin();
    let writes: Vec<u64> =
        redis::cmd("LRANGE").arg("{frozen}:writes").arg(0).arg(-1).query(&mut admin).expect("lrange");
    assert!(writes.windows(2).all(|w| w[0] <= w[1]), "a token-1 write landed after token 2: {writes:?}");
    assert!(writes.contains(&1) && writes.contains(&2));
    // And the store itself refuses the stale token.
    let refused: i64 = redis::Script::new(
        "local v = redis.call('GET', KEYS[1]) if v and string.match(v, ':(%d+)$') == ARGV[1] then return 1 end return 0",
    )
    .key("{frozen}:lease")
    .arg(1)
    .invoke(&mut admin)
    .expect("script");
    assert_eq!(refused, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_steps_down_cleanly_and_the_standby_leads() {
    let redis = RedisServer::start();
    let a = Probe::start(&redis.url(), "term", 2000, "a");
    a.wait_for(|l| l == "elected 1").await;
    let b = Probe::start(&redis.url(), "term", 2000, "b");
    sleep(Duration::from_millis(300)).await;
    a.signal("-TERM");
    a.wait_for(|l| l.starts_with("stepped down Ok")).await;
    b.wait_for(|l| l == "elected 2").await;
}

/// The store loses the key (a restart without persistence, a lagging replica promoted)
/// while its holder is frozen: a standby that saw the key's remaining ttl does not start
/// a term before that ttl ran out, since the holder may still be leading until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_waits_out_the_ttl_it_observed_when_the_store_loses_the_key() {
    let redis = RedisServer::start();
    let a = Probe::start(&redis.url(), "lost-key", 2000, "a");
    a.wait_for(|l| l == "write ok 1").await;
    let b = Probe::start(&redis.url(), "lost-key", 2000, "b");
    sleep(Duration::from_millis(500)).await; // b has polled and seen a's key
    a.signal("-STOP");
    let mut admin = redis.admin();
    let pttl: i64 = redis::cmd("PTTL").arg("{lost-key}:lease").query(&mut admin).expect("pttl");
    assert!(pttl > 500, "a renewed recently: {pttl} ms left");
    let _: () = redis::cmd("DEL").arg("{lost-key}:lease").query(&mut admin).expect("del");
    let deleted = Instant::now();
    b.wait_for(|l| l.starts_with("elected")).await;
    let waited = deleted.elapsed();
    eprintln!("key lost with {pttl} ms left; standby elected after {waited:?}");
    assert!(
        waited + Duration::from_millis(100) >= Duration::from_millis(u64::try_from(pttl).unwrap_or(0)),
        "elected {waited:?} after the key vanished, though a could lead for {pttl} ms more"
    );
    a.signal("-CONT");
}

/// A lagging replica promoted after this term began: the key is gone and the counter is
/// *below* our token. No term with our token or above was issued by this store, so the
/// holder retakes and raises the counter: the store cannot issue our token again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_behind_our_token_is_retaken_and_raised_so_the_token_is_never_reissued() {
    use lease::backend::{Acquire, Renew};
    let redis = RedisServer::start();
    let b = RedisBackend::new(&redis.url(), "behind", Duration::from_millis(500)).expect("backend");
    b.seed_fence(10).await.expect("seed");
    let Acquire::Acquired { token } = b.acquire("a", Duration::from_secs(5), 0).await.expect("acquire") else {
        panic!("not acquired")
    };
    assert_eq!(token, 11);
    let mut admin = redis.admin();
    let _: () = redis::cmd("DEL").arg("{behind}:lease").query(&mut admin).expect("del");
    let _: () = redis::cmd("SET").arg("{behind}:fence").arg(3).query(&mut admin).expect("lagging counter");
    assert_eq!(b.renew("a", 11, Duration::from_secs(5)).await.expect("renew"), Renew::Retaken);
    let fence: u64 = redis::cmd("GET").arg("{behind}:fence").query(&mut admin).expect("get");
    assert_eq!(fence, 11, "the counter was raised to our token");
    // A fresh process with no memory of token 11 cannot be issued it.
    let _: () = redis::cmd("DEL").arg("{behind}:lease").query(&mut admin).expect("del");
    let Acquire::Acquired { token } = b.acquire("fresh", Duration::from_secs(5), 0).await.expect("acquire") else {
        panic!("not acquired")
    };
    assert_eq!(token, 12);
    // A counter above our token still means a newer term: lost.
    assert!(matches!(b.renew("a", 11, Duration::from_secs(5)).await.expect("renew"), Renew::TakenBy { .. }));
    let _: () = redis::cmd("DEL").arg("{behind}:lease").query(&mut admin).expect("del");
    assert_eq!(b.renew("a", 11, Duration::from_secs(5)).await.expect("renew"), Renew::Fenced { fence: Some(12) });
}

/// Issue 33: a 6 s Redis stall. The renewal the leader sent during the stall ran when
/// the store answered again, after the leader had already stepped down at its deadline,
/// and set the key for a whole ttl: the standbys waited another ttl with nobody leading
/// (16 s without progress). Here the leader is cut off from Redis until it loses its
/// term, and its late renewal is made to land (the key set again to its value, with a
/// full ttl). A process that holds no term but finds its own value on the key takes it
/// back as soon as the store answers it: someone leads at once, not a ttl later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_lands_after_the_leader_stepped_down_is_released_at_once() {
    let redis = RedisServer::start();
    let proxy = TcpProxy::start(redis.addr()).await;
    let node6 = |url: &str, name: &str| {
        let c = LeaseConfig {
            poll: Duration::from_millis(200),
            key_prefix: "late".to_owned(),
            ..LeaseConfig::from_ttl(Duration::from_secs(6))
        };
        let backend = Arc::new(RedisBackend::new(url, "late", c.op_timeout).expect("backend"));
        common::spawn(backend, c, name)
    };
    let mut a = node6(&proxy.redis_url(), "a");
    let ta = elected(&mut a).await;
    let mut b = node6(&redis.url(), "b");
    sleep(Duration::from_millis(300)).await;
    proxy.set_cut(true);
    match next_event(&mut a).await {
        LeaseEvent::Lost { reason: LossReason::Expired, .. } => {}
        e => panic!("{e:?}"),
    }
    drop(ta);
    // The renewal a sent before its deadline lands now.
    let mut admin = redis.admin();
    let _: () = redis::cmd("SET").arg("{late}:lease").arg("a:1").arg("PX").arg(6000).query(&mut admin).expect("set");
    proxy.set_cut(false);
    common::someone_elected_at_once(&mut a, &mut b, Instant::now()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_settings_record_keeps_the_latest_terms() {
    let redis = RedisServer::start();
    let b = RedisBackend::new(&redis.url(), "record", Duration::from_millis(500)).expect("backend");
    common::the_settings_record_keeps_the_latest_terms(&b).await;
}
