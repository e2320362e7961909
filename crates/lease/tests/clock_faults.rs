//! Clock and scheduling faults: a runtime starved by a blocking task, a suspend (the
//! boot clock runs on while timers did not), and a wall-clock jump. In each, only the
//! term's own deadline check stands between a stale leader and its next action: the
//! supervisor has not run, and the store was never asked.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lease::{BootClock, Clock, LeaseConfig, LeaseEvent, LocalBackend, OffsetClock};
use testkit::RedisServer;
use tokio::time::timeout;

use testkit::tmpdir;

async fn elect(dir: &std::path::Path, clock: Arc<dyn Clock>, ttl: Duration) -> (lease::LeaseHandle, lease::Term) {
    let cfg = LeaseConfig { poll: Duration::from_millis(50), ..LeaseConfig::from_ttl(ttl) };
    let (h, mut ev) =
        lease::spawn_as(Arc::new(LocalBackend::new(&dir.join("lease.lock"))), cfg, clock, "a").expect("cfg");
    let Some(LeaseEvent::Elected(t)) = timeout(Duration::from_secs(10), ev.recv()).await.expect("elected") else {
        panic!("not elected")
    };
    (h, t)
}

/// A blocking task holds the only runtime thread past the ttl: when it lets go, the term
/// already reads inactive although the supervisor never got to run.
#[tokio::test(flavor = "current_thread")]
async fn a_starved_runtime_knows_its_term_is_over_before_the_supervisor_runs() {
    let dir = tmpdir("starve");
    let ttl = Duration::from_secs(1);
    let (h, term) = elect(&dir, Arc::new(BootClock), ttl).await;
    assert!(term.is_active());
    let started = Instant::now();
    std::thread::sleep(ttl + Duration::from_millis(200)); // starves this runtime
    eprintln!("runtime starved for {:?}", started.elapsed());
    assert!(!term.cancellation().is_cancelled(), "the supervisor has not run: only the deadline can say no");
    assert!(!term.is_active(), "the deadline passed while the runtime was starved");
    h.abandon().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspend_past_the_deadline_ends_the_term_at_once() {
    let dir = tmpdir("suspend");
    let clock = Arc::new(OffsetClock::default());
    let (h, term) = elect(&dir, clock.clone(), Duration::from_secs(10)).await;
    assert!(term.is_active());
    let before = term.remaining();
    clock.advance(Duration::from_mins(1)); // the suspend
    assert!(!term.is_active(), "woke from a 60 s suspend with {before:?} left: the term is over");
    assert_eq!(term.remaining(), Duration::ZERO);
    h.abandon().await;
}

/// `lease-probe` under libfaketime with only the wall clock faked (`CLOCK_REALTIME`),
/// jumped an hour forward and back while it leads: no flip, no lost term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_jump_neither_ends_nor_stretches_a_term() {
    let lib =
        ["/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("libfaketime (scripts/ensure-deps.sh installs the faketime package)");
    let redis = RedisServer::start();
    let dir = tmpdir("wall");
    let stamp = dir.join("faketime");
    std::fs::write(&stamp, "+0").expect("stamp");
    let mut child = Killed(
        Command::new(env!("CARGO_BIN_EXE_lease-probe"))
            .args([redis.url().as_str(), "wall", "1000", "a"])
            .env("LD_PRELOAD", lib)
            .env("FAKETIME_TIMESTAMP_FILE", &stamp)
            .env("FAKETIME_NO_CACHE", "1")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .stdout(Stdio::piped())
            .spawn()
            .expect("probe"),
    );
    let out = child.0.stdout.take().expect("stdout");
    let lines = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let l = lines.clone();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            l.lock().expect("lines").push(line);
        }
    });
    let count = |w: &str| lines.lock().expect("lines").iter().filter(|l| *l == w).count();
    let deadline = Instant::now() + Duration::from_secs(30);
    while count("write ok 1") < 5 {
        assert!(Instant::now() < deadline, "probe never led: {:?}", lines.lock().expect("lines"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for jump in ["+3600", "-3600", "+0"] {
        std::fs::write(&stamp, jump).expect("jump");
        let before = count("write ok 1");
        // Three ttls: any deadline on the wall clock would have ended the term by now.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(count("write ok 1") > before + 20, "kept writing after a {jump} s jump");
    }
    let all = lines.lock().expect("lines").clone();
    assert!(!all.iter().any(|l| l.starts_with("lost")), "no term lost to a wall-clock jump: {all:?}");
    assert_eq!(all.iter().filter(|l| l.starts_with("elected")).count(), 1);
}

/// A child process killed when the test ends, pass or fail.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
