//! The lease against real redis-server processes, each test starting its own on a free
//! port so it can kill, pause or restart it: what only Redis has (ACLs, a probe process
//! frozen past its ttl, the fence counter behind a token). The scenarios every store must
//! pass are in `stores.rs`.

mod common;

use common::{cfg, elected, next_event, no_event};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lease::{Backend, LeaseEvent, LossReason, RedisBackend};
use testkit::{RedisServer, WAIT};
use tokio::time::sleep;

type Node = common::Node<RedisBackend>;

fn node(url: &str, prefix: &str, name: &str) -> Node {
    let c = cfg(prefix);
    let backend = Arc::new(RedisBackend::new(url, prefix, c.op_timeout).expect("backend"));
    common::spawn(backend, c, name)
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
