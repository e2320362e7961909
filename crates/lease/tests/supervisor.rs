//! Deterministic tests of every supervisor transition against an in-memory store,
//! with tokio's paused clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lease::backend::{Acquire, Backend, BackendError, Renew, Snapshot};
use lease::{Clock, LeaseConfig, LeaseEvent, LossReason, Status, StepDownError, TokioClock};
use tokio::sync::{Notify, mpsc};
use tokio::time::{Instant, sleep};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Normal,
    Fail,
    Hang,
}

#[derive(Debug)]
struct State {
    holder: Option<(String, Instant)>,
    fence: u64,
    mode: Mode,
    renews: u32,
    acquire_delay: Duration,
}

/// Redis semantics in memory: a key with an expiry on tokio's clock and a counter.
#[derive(Debug, Clone)]
struct Mock {
    s: Arc<Mutex<State>>,
    released: Arc<Notify>,
}

impl Mock {
    fn new() -> Self {
        Self {
            s: Arc::new(Mutex::new(State {
                holder: None,
                fence: 0,
                mode: Mode::Normal,
                renews: 0,
                acquire_delay: Duration::ZERO,
            })),
            released: Arc::new(Notify::new()),
        }
    }
    fn set_mode(&self, m: Mode) {
        self.s.lock().unwrap().mode = m;
    }
    fn holder(&self) -> Option<String> {
        let mut s = self.s.lock().unwrap();
        if s.holder.as_ref().is_some_and(|(_, exp)| *exp <= Instant::now()) {
            s.holder = None;
        }
        s.holder.as_ref().map(|(v, _)| v.clone())
    }
    fn renews(&self) -> u32 {
        self.s.lock().unwrap().renews
    }
    fn force(&self, holder: Option<&str>, fence: Option<u64>) {
        let mut s = self.s.lock().unwrap();
        s.holder = holder.map(|h| (h.to_owned(), Instant::now() + Duration::from_hours(1)));
        if let Some(f) = fence {
            s.fence = f;
        }
    }
    async fn gate(&self) -> Result<(), BackendError> {
        let mode = self.s.lock().unwrap().mode;
        match mode {
            Mode::Normal => Ok(()),
            Mode::Fail => Err(BackendError::Unavailable("injected".into())),
            Mode::Hang => std::future::pending().await,
        }
    }
}

#[lease::async_trait]
impl Backend for Mock {
    async fn acquire(&self, instance: &str, ttl: Duration, floor: u64) -> Result<Acquire, BackendError> {
        let delay = self.s.lock().unwrap().acquire_delay;
        sleep(delay).await;
        self.gate().await?;
        if let Some(h) = self.holder() {
            return Ok(Acquire::Held { holder: h, expires_in: None });
        }
        let mut s = self.s.lock().unwrap();
        s.fence = s.fence.max(floor) + 1;
        let token = s.fence;
        s.holder = Some((format!("{instance}:{token}"), Instant::now() + ttl));
        Ok(Acquire::Acquired { token })
    }
    async fn renew(&self, instance: &str, token: u64, ttl: Duration) -> Result<Renew, BackendError> {
        self.gate().await?;
        let value = format!("{instance}:{token}");
        let current = self.holder();
        let mut s = self.s.lock().unwrap();
        s.renews += 1;
        match current {
            Some(v) if v == value => {
                s.holder = Some((value, Instant::now() + ttl));
                Ok(Renew::Renewed)
            }
            Some(v) => Ok(Renew::TakenBy { holder: v }),
            None if s.fence == token || s.fence == 0 => {
                s.holder = Some((value, Instant::now() + ttl));
                Ok(Renew::Retaken)
            }
            None => Ok(Renew::Fenced { fence: Some(s.fence) }),
        }
    }
    async fn release(&self, instance: &str) -> Result<bool, BackendError> {
        self.gate().await?;
        let ours = self.holder().is_some_and(|h| h.starts_with(&format!("{instance}:")));
        if ours {
            self.s.lock().unwrap().holder = None;
            self.released.notify_waiters();
        }
        Ok(ours)
    }
    async fn seed_fence(&self, min: u64) -> Result<u64, BackendError> {
        let mut s = self.s.lock().unwrap();
        s.fence = s.fence.max(min);
        Ok(s.fence)
    }
    async fn snapshot(&self) -> Result<Snapshot, BackendError> {
        let fence = self.s.lock().unwrap().fence;
        Ok(Snapshot { holder: self.holder(), fence, fence_seen: 0, ttl: None })
    }
    fn release_signal(&self) -> Option<Arc<Notify>> {
        Some(self.released.clone())
    }
    async fn deployment(&self) -> Result<Option<(u64, String)>, BackendError> {
        Ok(None)
    }
    async fn set_deployment(&self, _token: u64, _record: &str) -> Result<bool, BackendError> {
        Ok(true)
    }
}

fn cfg() -> LeaseConfig {
    LeaseConfig::default() // ttl 10 s, renew 2 s, op timeout 1 s, margin 2.5 s, poll 1 s
}

fn start(m: &Mock, name: &str) -> (lease::LeaseHandle, mpsc::UnboundedReceiver<LeaseEvent>, Arc<dyn Clock>) {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let (h, ev) = lease::spawn_as(Arc::new(m.clone()), cfg(), clock.clone(), name).expect("valid config");
    (h, ev, clock)
}

async fn elected(ev: &mut mpsc::UnboundedReceiver<LeaseEvent>) -> lease::Term {
    match ev.recv().await {
        Some(LeaseEvent::Elected(t)) => t,
        other => panic!("expected Elected, got {other:?}"),
    }
}

/// Lets the supervisor task run without moving the clock.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn leader_renews_and_stays_leader() {
    let m = Mock::new();
    let (h, mut ev, _) = start(&m, "a");
    let t = elected(&mut ev).await;
    assert_eq!(t.token(), 1);
    assert_eq!(h.status(), Status::Leader { token: 1 });
    sleep(Duration::from_mins(1)).await;
    assert!(t.is_active());
    assert!(ev.try_recv().is_err(), "no event while renewals succeed");
    let n = m.renews();
    assert!((29..=31).contains(&n), "renewed every 2 s: {n}");
    assert_eq!(m.holder().as_deref(), Some("a:1"));
}

#[tokio::test(start_paused = true)]
async fn failing_store_keeps_the_leader_exactly_until_send_time_plus_window() {
    let m = Mock::new();
    let (_h, mut ev, clock) = start(&m, "a");
    let t = elected(&mut ev).await;
    // Let one renewal succeed at t=2 s (sent at 2 s), then fail everything.
    sleep(Duration::from_millis(2100)).await;
    assert_eq!(m.renews(), 1);
    m.set_mode(Mode::Fail);
    let failed_at = clock.now();
    // Deadline = 2 s (send time of the last good renew) + 10 s - 2.5 s = 9.5 s.
    let deadline = Duration::from_millis(9500);
    sleep(deadline.checked_sub(failed_at).unwrap().checked_sub(Duration::from_millis(1)).unwrap()).await;
    assert!(t.is_active(), "still leading 1 ms before the deadline");
    assert!(ev.try_recv().is_err());
    sleep(Duration::from_millis(2)).await;
    settle().await;
    assert!(!t.is_active(), "not leading after the deadline");
    match ev.try_recv() {
        Ok(LeaseEvent::Lost { token: 1, reason: LossReason::Expired }) => {}
        other => panic!("expected Lost(Expired), got {other:?}"),
    }
    assert!(t.cancellation().is_cancelled());
}

#[tokio::test(start_paused = true)]
async fn a_hanging_store_cannot_stretch_the_deadline() {
    let m = Mock::new();
    let (_h, mut ev, clock) = start(&m, "a");
    let t = elected(&mut ev).await;
    m.set_mode(Mode::Hang);
    let before = clock.now();
    match ev.recv().await {
        Some(LeaseEvent::Lost { reason: LossReason::Expired, .. }) => {}
        other => panic!("{other:?}"),
    }
    // Elected at ~0 (acquire sent at 0), no renewal ever answered: lost at 7.5 s sharp.
    let lost_at = clock.now();
    assert!(
        lost_at >= Duration::from_millis(7500) && lost_at < Duration::from_millis(7510),
        "lost at {lost_at:?} (from {before:?})"
    );
    assert!(!t.is_active());
}

#[tokio::test(start_paused = true)]
async fn a_short_outage_passes_without_a_flip() {
    let m = Mock::new();
    let (_h, mut ev, _) = start(&m, "a");
    let t = elected(&mut ev).await;
    m.set_mode(Mode::Fail);
    sleep(Duration::from_secs(5)).await;
    m.set_mode(Mode::Normal);
    sleep(Duration::from_secs(30)).await;
    assert!(t.is_active());
    assert!(ev.try_recv().is_err(), "no Lost, no re-election");
    assert_eq!(m.holder().as_deref(), Some("a:1"), "same term, same token");
}

#[tokio::test(start_paused = true)]
async fn deleted_key_with_unchanged_fence_is_retaken_silently() {
    let m = Mock::new();
    let (_h, mut ev, _) = start(&m, "a");
    let t = elected(&mut ev).await;
    m.force(None, None);
    sleep(Duration::from_secs(5)).await;
    assert_eq!(m.holder().as_deref(), Some("a:1"));
    assert!(t.is_active());
    assert!(ev.try_recv().is_err());
}

#[tokio::test(start_paused = true)]
async fn overwritten_key_loses_once_and_waits_for_the_term_to_drop() {
    let m = Mock::new();
    let (h, mut ev, _) = start(&m, "a");
    let t = elected(&mut ev).await;
    m.force(Some("b:7"), Some(7));
    match ev.recv().await {
        Some(LeaseEvent::Lost { token: 1, reason: LossReason::TakenBy(holder) }) => assert_eq!(holder, "b:7"),
        other => panic!("{other:?}"),
    }
    assert!(!t.is_active());
    assert_eq!(h.status(), Status::Standby);
    // The other holder goes away; while we still hold the lost term we must not contend.
    m.force(None, None);
    sleep(Duration::from_secs(30)).await;
    assert!(ev.try_recv().is_err(), "no new term while the lost one is alive");
    assert_eq!(m.holder(), None);
    drop(t);
    let t2 = elected(&mut ev).await;
    assert_eq!(t2.token(), 8, "a new term has a greater token");
}

#[tokio::test(start_paused = true)]
async fn fence_moved_on_means_lost() {
    let m = Mock::new();
    let (_h, mut ev, _) = start(&m, "a");
    let _t = elected(&mut ev).await;
    m.force(None, Some(5));
    match ev.recv().await {
        Some(LeaseEvent::Lost { reason: LossReason::Fenced(Some(5)), .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn step_down_keeps_renewing_through_a_long_drain_then_releases() {
    let m = Mock::new();
    let (h, mut ev, _) = start(&m, "a");
    let t = elected(&mut ev).await;
    let t2 = t.clone();
    let before = m.renews();
    let drain = async move {
        // Longer than the ttl: only renewals keep us leader.
        sleep(Duration::from_secs(15)).await;
        assert!(t2.is_active(), "still leading at the end of the drain");
        Ok::<(), String>(())
    };
    h.step_down_with(drain, Duration::from_mins(1)).await.expect("clean step-down");
    assert!(m.renews() >= before + 7, "renewed during the drain");
    assert_eq!(m.holder(), None, "released");
    assert!(!t.is_active());
    match ev.recv().await {
        Some(LeaseEvent::Released { token: 1 }) => {}
        other => panic!("{other:?}"),
    }
    h.join().await;
}

#[tokio::test(start_paused = true)]
async fn failed_drain_leaves_the_lease_to_expire() {
    let m = Mock::new();
    let (h, mut ev, _) = start(&m, "a");
    let t = elected(&mut ev).await;
    let r = h.step_down_with(async { Err::<(), _>("sink unreachable") }, Duration::from_secs(5)).await;
    assert!(matches!(&r, Err(StepDownError::DrainFailed(m)) if m.to_string() == "sink unreachable"), "{r:?}");
    assert!(!t.is_active(), "intake stops");
    assert_eq!(m.holder().as_deref(), Some("a:1"), "not released: left to expire");
    sleep(Duration::from_secs(11)).await;
    assert_eq!(m.holder(), None, "expired on its own");
    h.join().await;
}

#[tokio::test(start_paused = true)]
async fn drain_over_budget_leaves_the_lease_to_expire() {
    let m = Mock::new();
    let (h, mut ev, _) = start(&m, "a");
    let _t = elected(&mut ev).await;
    let r = h
        .step_down_with(
            async {
                sleep(Duration::from_secs(100)).await;
                Ok::<(), String>(())
            },
            Duration::from_secs(3),
        )
        .await;
    assert!(matches!(r, Err(StepDownError::DrainTimeout(d)) if d == Duration::from_secs(3)), "{r:?}");
    assert!(m.holder().is_some());
}

#[tokio::test(start_paused = true)]
async fn shutdown_during_acquire_releases_what_was_acquired() {
    let m = Mock::new();
    m.s.lock().unwrap().acquire_delay = Duration::from_millis(500);
    let (h, mut ev, _) = start(&m, "a");
    settle().await;
    let stop = tokio::spawn(async move {
        h.shutdown().await;
        h
    });
    sleep(Duration::from_secs(2)).await;
    let h = stop.await.expect("shutdown");
    assert_eq!(m.holder(), None, "released");
    assert!(!matches!(ev.try_recv(), Ok(LeaseEvent::Elected(_))), "never announced");
    assert_eq!(h.status(), Status::Stopped);
}

#[tokio::test(start_paused = true)]
async fn standby_takes_over_at_once_on_release() {
    let m = Mock::new();
    let (a, mut ev_a, _) = start(&m, "a");
    let _ta = elected(&mut ev_a).await;
    let (_b, mut ev_b, clock) = start(&m, "b");
    sleep(Duration::from_millis(1500)).await; // b has polled and is waiting
    let released_at = clock.now();
    a.shutdown().await;
    let tb = elected(&mut ev_b).await;
    let gap = clock.now().checked_sub(released_at).unwrap();
    assert!(gap < Duration::from_millis(50), "woken by the release signal, not the poll: {gap:?}");
    assert_eq!(tb.token(), 2);
}

#[tokio::test(start_paused = true)]
async fn standbys_contend_with_jitter_and_one_wins() {
    let m = Mock::new();
    let mut all = Vec::new();
    for i in 0..5 {
        all.push(start(&m, &format!("c{i}")));
    }
    sleep(Duration::from_secs(5)).await;
    let mut leaders = 0;
    for (_, ev, _) in &mut all {
        while let Ok(e) = ev.try_recv() {
            assert!(matches!(e, LeaseEvent::Elected(_)));
            leaders += 1;
        }
    }
    assert_eq!(leaders, 1);
}

#[test]
fn invalid_config_is_refused() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("rt");
    rt.block_on(async {
        let bad = LeaseConfig { margin: Duration::from_secs(20), ..LeaseConfig::default() };
        let r = lease::spawn(Arc::new(Mock::new()), bad, Arc::new(TokioClock::new()));
        assert!(r.is_err());
    });
}

#[tokio::test(start_paused = true)]
async fn resign_ends_the_term_without_release_and_contends_again_after_expiry() {
    let m = Mock::new();
    let (h, mut ev, _) = start(&m, "a");
    let t = elected(&mut ev).await;
    h.resign().await;
    match ev.recv().await {
        Some(LeaseEvent::Lost { token: 1, reason: LossReason::Resigned }) => {}
        other => panic!("{other:?}"),
    }
    assert!(!t.is_active());
    assert_eq!(m.holder().as_deref(), Some("a:1"), "not released: left to expire");
    drop(t);
    let t2 = elected(&mut ev).await;
    assert_eq!(t2.token(), 2, "a fresh term once the old key expired");
}

fn start_with(m: &Mock, name: &str, prior: lease::Prior) -> (lease::LeaseHandle, mpsc::UnboundedReceiver<LeaseEvent>) {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    lease::spawn_with(Arc::new(m.clone()), cfg(), clock, name, prior).expect("valid config")
}

/// Issue 40: a replica that remembers nothing does not take an empty store (a first start
/// or a store that lost its data) for a ttl, so a survivor that remembers the last term
/// (a floor above its token) takes it first.
#[tokio::test(start_paused = true)]
async fn a_cold_replica_watches_an_empty_store_for_a_ttl_while_a_survivor_takes_it() {
    let m = Mock::new();
    let started = Instant::now();
    let (cold, mut cold_ev) = start_with(&m, "cold", lease::Prior { floor: 0, cold: true, held_back: false });
    sleep(Duration::from_secs(3)).await;
    assert!(cold_ev.try_recv().is_err(), "no acquire from an empty store within the ttl");
    let (survivor, mut survivor_ev) =
        start_with(&m, "survivor", lease::Prior { floor: 7, cold: false, held_back: false });
    let t = elected(&mut survivor_ev).await;
    assert_eq!(t.token(), 8, "above the floor the survivor remembered");
    sleep(Duration::from_secs(10)).await;
    assert!(cold_ev.try_recv().is_err(), "the cold replica stands by behind the survivor");
    assert_eq!(cold.seen_token(), 8, "and remembers its token as its own floor");
    assert!(survivor.seen_token() >= 8);
    drop(t);
    let _ = started;
}

/// The wait is for one ttl only, and only while the store is empty.
#[tokio::test(start_paused = true)]
async fn a_cold_replica_acquires_after_a_ttl_or_at_once_from_a_store_with_a_fence() {
    let m = Mock::new();
    let t0 = Instant::now();
    let (_h, mut ev) = start_with(&m, "cold", lease::Prior { floor: 0, cold: true, held_back: false });
    let t = elected(&mut ev).await;
    let waited = t0.elapsed();
    assert!(waited >= cfg().ttl && waited <= cfg().ttl + Duration::from_secs(2), "waited {waited:?}");
    assert_eq!(t.token(), 1);
    let m2 = Mock::new();
    m2.force(None, Some(4));
    let t1 = Instant::now();
    let (_h2, mut ev2) = start_with(&m2, "cold", lease::Prior { floor: 0, cold: true, held_back: false });
    let t = elected(&mut ev2).await;
    assert!(t1.elapsed() < Duration::from_secs(1), "a store with a fence has not lost its data");
    assert_eq!(t.token(), 5);
}

/// A standby that saw the holder through a store that cannot say when its key expires
/// (`expires_in: None`, as this mock and a NATS candidate that lost the create race
/// report it) and then finds the key gone with the store's data must not start a term
/// within a ttl of that sighting: the holder may still be leading on its last renewal.
/// The CI run of issue 34 caught this on NATS (two leaders for 100 ms after a wiped
/// server); the mutation (ignore a `None` expiry) makes this red.
#[tokio::test(start_paused = true)]
async fn a_holder_seen_without_an_expiry_is_waited_out_when_the_store_loses_its_key() {
    let m = Mock::new();
    let (_a, mut a_ev, _) = start(&m, "a");
    let ta = elected(&mut a_ev).await;
    let (_b, mut b_ev, _) = start(&m, "b");
    sleep(Duration::from_millis(2500)).await;
    assert!(b_ev.try_recv().is_err(), "b stands by behind a");
    // The store goes away and comes back empty (a restart on a lost volume): for 3 s
    // every call fails; then the key and the fence are gone.
    m.set_mode(Mode::Fail);
    m.force(None, Some(0));
    sleep(Duration::from_secs(3)).await;
    m.set_mode(Mode::Normal);
    for _ in 0..300 {
        sleep(Duration::from_millis(100)).await;
        if let Ok(LeaseEvent::Elected(tb)) = b_ev.try_recv() {
            assert!(!ta.is_active(), "b elected (token {}) while a still leads (token {})", tb.token(), ta.token());
        }
    }
    assert!(ta.is_active(), "a retook its key once the store answered and leads on");
}
