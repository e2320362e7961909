//! Relay continuity with two relays of different seq spaces (the secondary serves the
//! same events renumbered and reinterleaved): failover, failback and failover again, a
//! standby taking over while the leader was on the secondary, and a secondary whose
//! window does not reach back. The oracle keys events by (repo, rev) — (type, did,
//! time) for identity and account — and finds none lost and none delivered twice, and
//! the per-repo chain check finds no chain broken across the switches.
//!
//! The relays serve the world's clocks, not the capture's tidy ones: every tenth event
//! comes from a PDS lagging 60 s, every tenth (offset) from one an hour fast, every
//! fiftieth from one an hour slow — on both relays, as a relay passes a PDS's time on.

mod switching;

use std::sync::Arc;
use std::time::Duration;

use checkpoint::CursorStore as _;
use consumer::{BatchCtx, Event, GapPolicy, Handler, HandlerError, async_trait};
use relay_client::{RelayRole, RelayUrl};
use relay_sim::{RelaySim, SimConfig};
use switching::*;
use testkit::{WAIT, eventually};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_failback_and_failover_again_lose_nothing_and_duplicate_nothing() {
    let want = keys(&frames());
    let (primary, secondary) = relays(250, None).await;
    let dir = testkit::tmpdir("switch-3");
    let oracle = Arc::new(Oracle::default());
    let (status, stop, run) = spawn(replica(&dir, &primary, &secondary, &oracle, GapPolicy::Fail, "a").await);
    on(&status, RelayRole::Primary, "leading on the primary").await;
    delivered_at_least(&oracle, 300).await;
    let t0 = std::time::Instant::now();
    primary.handle().set_down(true);
    on(&status, RelayRole::Secondary, "failover to the secondary").await;
    eprintln!("failover: primary down → connected to the secondary at the found cursor in {:?}", t0.elapsed());
    delivered_at_least(&oracle, 650).await;
    primary.handle().set_down(false);
    let t0 = std::time::Instant::now();
    on(&status, RelayRole::Primary, "failback to the primary").await;
    eprintln!("failback: primary up → connected to it at the found cursor in {:?}", t0.elapsed());
    delivered_at_least(&oracle, 950).await;
    primary.handle().set_down(true);
    on(&status, RelayRole::Secondary, "failover again").await;
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    // Let anything duplicated after the last switch arrive before judging.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    assert!(oracle.taken_from_secondary() > 0, "the secondary served part of the stream");
    oracle.assert_exactly_once(&want);
}

/// Commits the cursor itself, in the same step as its writes (as the Postgres sink does):
/// the oracle's records, then a fenced advance with the time of the batch's last event.
struct SelfCommitting {
    oracle: Arc<Oracle>,
    store: checkpoint::FileStore,
}

#[async_trait]
impl Handler for SelfCommitting {
    async fn handle(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), HandlerError> {
        let Some(last) = batch.last() else { return Ok(()) };
        self.oracle.handle(batch, ctx).await?;
        let time = last.time().and_then(relay_client::probe::time_ms);
        let holder = ctx.term.holder();
        let fence = checkpoint::Fence { holder: &holder, token: ctx.token };
        match checkpoint::CursorStore::write(
            &self.store,
            checkpoint::Write::advance(&ctx.fingerprint, last.seq(), time),
            fence,
        )
        .await
        {
            Ok(checkpoint::CommitOutcome::Fenced { .. }) => Err(HandlerError::Fenced),
            Ok(_) => Ok(()),
            Err(e) => Err(HandlerError::failed("cursor store", e)),
        }
    }

    fn commits_cursor(&self) -> bool {
        true
    }
}

/// A handler that commits its own cursor still switches by time: the consumer keeps the
/// time at the cursor for the switch although it never commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_commits_its_own_cursor_switches_without_loss_or_duplicates() {
    let want = keys(&frames());
    let (primary, secondary) = relays(250, None).await;
    let dir = testkit::tmpdir("switch-self");
    let oracle = Arc::new(Oracle::default());
    let store = checkpoint::FileStore::new(&dir.join("cursors"), &dir.join("lease.lock")).expect("store");
    let handler = Arc::new(SelfCommitting { oracle: oracle.clone(), store });
    let (status, stop, run) = spawn(replica_with(&dir, &primary, &secondary, handler, GapPolicy::Fail, "a").await);
    on(&status, RelayRole::Primary, "leading on the primary").await;
    delivered_at_least(&oracle, 300).await;
    primary.handle().set_down(true);
    on(&status, RelayRole::Secondary, "failover to the secondary").await;
    delivered_at_least(&oracle, 650).await;
    primary.handle().set_down(false);
    on(&status, RelayRole::Primary, "failback to the primary").await;
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    assert!(oracle.taken_from_secondary() > 0, "the secondary served part of the stream");
    oracle.assert_exactly_once(&want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_taking_over_resumes_on_the_secondary_the_leader_was_on() {
    let want = keys(&frames());
    let (primary, secondary) = relays(250, None).await;
    let dir = testkit::tmpdir("switch-takeover");
    let oracle = Arc::new(Oracle::default());
    let (a_status, a_stop, a_run) = spawn(replica(&dir, &primary, &secondary, &oracle, GapPolicy::Fail, "a").await);
    on(&a_status, RelayRole::Primary, "a leads on the primary").await;
    let (b_status, b_stop, b_run) = spawn(replica(&dir, &primary, &secondary, &oracle, GapPolicy::Fail, "b").await);
    delivered_at_least(&oracle, 300).await;
    primary.handle().set_down(true);
    on(&a_status, RelayRole::Secondary, "a fails over").await;
    delivered_at_least(&oracle, 600).await;
    // a stops (drains, commits on the secondary, releases); b takes over there, although
    // the primary is back by then.
    primary.handle().set_down(false);
    let _ = a_stop.send(());
    a_run.await.expect("join").expect("a stops cleanly");
    assert_eq!(relay_once_leading(&b_status).await, RelayRole::Secondary, "b resumed on the secondary");
    on(&b_status, RelayRole::Primary, "b fails back to the primary").await;
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = b_stop.send(());
    b_run.await.expect("join").expect("b stops cleanly");
    oracle.assert_exactly_once(&want);
}

/// The leader crashes (its task is dropped: no drain, no final commit, no release) while
/// on the secondary; the standby takes over there after the ttl. Nothing is lost, and the
/// only events handed over twice are the crashed leader's uncommitted tail on the
/// secondary (at-least-once across a crash): none come from the relay switches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_crashing_on_the_secondary_loses_nothing_and_repeats_only_its_uncommitted_tail() {
    let want = keys(&frames());
    let (primary, secondary) = relays(250, None).await;
    let dir = testkit::tmpdir("switch-crash");
    let oracle = Arc::new(Oracle::default());
    let (a_status, _a_stop, a_run) = spawn(replica(&dir, &primary, &secondary, &oracle, GapPolicy::Fail, "a").await);
    on(&a_status, RelayRole::Primary, "a leads on the primary").await;
    let (b_status, b_stop, b_run) = spawn(replica(&dir, &primary, &secondary, &oracle, GapPolicy::Fail, "b").await);
    delivered_at_least(&oracle, 300).await;
    primary.handle().set_down(true);
    on(&a_status, RelayRole::Secondary, "a fails over").await;
    delivered_at_least(&oracle, 600).await;
    a_run.abort();
    let _ = a_run.await;
    let store = checkpoint::FileStore::new(&dir.join("cursors"), &dir.join("lease.lock")).expect("store");
    let fp = RelayUrl::parse(&secondary.url()).expect("url").fingerprint().to_owned();
    let Ok(checkpoint::ReadOutcome::Found(committed)) = store.read(&fp).await else {
        panic!("a committed on the secondary")
    };
    primary.handle().set_down(false);
    assert_eq!(relay_once_leading(&b_status).await, RelayRole::Secondary, "b resumed on the secondary");
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = b_stop.send(());
    b_run.await.expect("join").expect("b stops cleanly");
    let counts = oracle.counts();
    let lost: Vec<_> = want.iter().filter(|k| !counts.contains_key(*k)).take(5).collect();
    assert!(lost.is_empty(), "lost {lost:?}");
    let got = oracle.got.lock().expect("got").clone();
    let a_tail: std::collections::BTreeSet<&Key> = got
        .iter()
        .filter(|(_, r, seq, who, _)| who.starts_with("a:") && *r == RelayRole::Secondary && *seq > committed)
        .map(|(k, ..)| k)
        .collect();
    let twice: Vec<&Key> = counts.iter().filter(|(_, n)| **n > 1).map(|(k, _)| k).collect();
    assert!(counts.values().all(|n| *n <= 2), "nothing three times");
    let outside: Vec<&&Key> = twice.iter().filter(|k| !a_tail.contains(**k)).take(5).collect();
    assert!(outside.is_empty(), "handed over twice beyond a's uncommitted tail: {outside:?}");
    eprintln!("crash on the secondary: {} events repeated, a's uncommitted tail was {}", twice.len(), a_tail.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secondary_window_too_short_is_refused_until_the_primary_returns_or_accepted_under_live() {
    let want = keys(&frames());
    for gap in [GapPolicy::Fail, GapPolicy::Live] {
        // The secondary keeps only its last ~300 events.
        let (primary, secondary) = relays(250, Some(1_000_000 + 1_150)).await;
        let dir = testkit::tmpdir("switch-gap");
        let oracle = Arc::new(Oracle::default());
        let (status, stop, run) = spawn(replica(&dir, &primary, &secondary, &oracle, gap, "a").await);
        on(&status, RelayRole::Primary, "leading on the primary").await;
        delivered_at_least(&oracle, 300).await;
        primary.handle().set_down(true);
        match gap {
            GapPolicy::Fail => {
                // The switch is refused: the leader stays, is not ready, shows what is
                // missing, takes nothing from the secondary, and never exits.
                eventually("the refused switch shown", WAIT, async || status.snapshot().refused_switch.is_some()).await;
                let s = status.snapshot();
                let refused = s.refused_switch.clone().expect("shown");
                assert!(refused.contains("secondary") && refused.contains("2026-12-02T"), "{refused}");
                assert!(refused.contains("FIREKEEPER_GAP=live"), "{refused}");
                assert_eq!(s.role, consumer::Role::Leader, "still leading");
                assert!(!status.is_ready(), "not ready while refused");
                tokio::time::sleep(Duration::from_millis(1500)).await;
                assert!(!run.is_finished(), "the service does not stop");
                assert_eq!(oracle.taken_from_secondary(), 0, "nothing taken from the secondary");
                // The primary returns: everything, once, from the primary.
                primary.handle().set_down(false);
                eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
                assert!(status.snapshot().refused_switch.is_none() && status.is_ready(), "ready again");
                tokio::time::sleep(Duration::from_millis(300)).await;
                let _ = stop.send(());
                run.await.expect("join").expect("clean stop");
                oracle.assert_exactly_once(&want);
            }
            GapPolicy::Live => {
                on(&status, RelayRole::Secondary, "on the secondary despite the gap").await;
                eventually("the secondary's window delivered", WAIT, async || oracle.taken_from_secondary() > 250)
                    .await;
                let last_gap = status.snapshot().last_gap.expect("the gap is shown in the status");
                assert!(last_gap.contains("secondary") && last_gap.contains("2026-12-02T"), "{last_gap}");
                let _ = stop.send(());
                run.await.expect("join").expect("clean stop");
                let counts = oracle.counts();
                assert!(counts.values().all(|n| *n == 1), "still nothing twice");
                assert!(counts.len() < want.len(), "the gap is real: some events are missing");
                // The chain check sees it too: exactly the repos whose delivered commits
                // have a hole (a missing commit between two delivered ones) break, once.
                // Which repos span the gap depends on where the primary stopped.
                let mut holed = std::collections::BTreeSet::new();
                let repos: std::collections::BTreeSet<&String> =
                    want.iter().filter(|k| k.0 == "commit").map(|k| &k.1).collect();
                for r in repos {
                    let got: Vec<bool> =
                        want.iter().filter(|k| k.0 == "commit" && &k.1 == r).map(|k| counts.contains_key(k)).collect();
                    let (Some(first), Some(last)) = (got.iter().position(|d| *d), got.iter().rposition(|d| *d)) else {
                        continue;
                    };
                    if got[first..=last].iter().any(|d| !d) {
                        holed.insert(r.clone());
                    }
                }
                let mut broke = oracle.breaks.lock().expect("breaks").clone();
                broke.sort();
                eprintln!(
                    "gap accepted: {} events missing, {} repos with a hole",
                    want.len() - counts.len(),
                    holed.len()
                );
                assert_eq!(broke, holed.into_iter().collect::<Vec<_>>(), "one break per repo with a hole, no other");
            }
        }
    }
}

/// The secondary keeps fewer events than the overlap asks for, but still reaches back
/// past the committed position: no gap (the operator run exited with status 1
/// here). The overlap is shortened and counted; nothing is lost or repeated; the primary
/// comes back and the leader fails back to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_shorter_than_the_overlap_but_past_the_position_is_no_gap() {
    let want = keys(&frames());
    // 300 events of ~1476 behind the head: less than the 60 s overlap asked for, more
    // than the primary's outage.
    let (primary, secondary) = relays_with(250, SimConfig { window_len: Some(300), ..SimConfig::default() }).await;
    let dir = testkit::tmpdir("switch-short");
    let oracle = Arc::new(Oracle::default());
    let c = replica_opts(&dir, &primary, &secondary, oracle.clone(), "a", |o| {
        o.switch_overlap = Duration::from_mins(1);
    })
    .await;
    let (status, stop, run) = spawn(c);
    on(&status, RelayRole::Primary, "leading on the primary").await;
    delivered_at_least(&oracle, 590).await;
    primary.handle().set_down(true);
    on(&status, RelayRole::Secondary, "failover despite the short window").await;
    assert!(status.snapshot().refused_switch.is_none());
    delivered_at_least(&oracle, 1030).await;
    primary.handle().set_down(false);
    on(&status, RelayRole::Primary, "failback").await;
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    assert!(oracle.taken_from_secondary() > 0, "the secondary served part of the stream");
    oracle.assert_exactly_once(&want);
}

/// `cursor set` stores no time; with the primary down from the start, nothing places the
/// position on the secondary. The switch is refused (never the secondary's live tail,
/// which delivered 0 of the backlog before), and when the primary comes up everything
/// after the cursor arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_with_no_known_time_is_refused_instead_of_jumping_to_the_live_tail() {
    let want = keys(&frames());
    let (primary, secondary) = relays(250, None).await;
    primary.handle().set_down(true);
    let dir = testkit::tmpdir("switch-unplaced");
    let oracle = Arc::new(Oracle::default());
    let (status, stop, run) = spawn(replica(&dir, &primary, &secondary, &oracle, GapPolicy::Fail, "a").await);
    eventually("the refused switch shown", WAIT, async || status.snapshot().refused_switch.is_some()).await;
    let refused = status.snapshot().refused_switch.expect("shown");
    assert!(refused.contains("cursor set --relay secondary"), "{refused}");
    assert!(!status.is_ready());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(oracle.taken_from_secondary(), 0, "nothing from the secondary's live tail");
    primary.handle().set_down(false);
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    oracle.assert_exactly_once(&want);
}

/// Two relays over the fixture, paced from the test in step once the leader is connected
/// (paced from their start, a slow first connection on a loaded machine would already
/// find the first events out of a short window); the primary keeps only its latest
/// `primary_window` events. After `ahead` is set, the primary publishes everything at
/// once while the secondary keeps its pace.
async fn stepped(
    primary_window: usize,
) -> (RelaySim, RelaySim, Arc<std::sync::atomic::AtomicBool>, impl FnOnce() -> tokio::task::JoinHandle<()>) {
    let frames = frames();
    let addr = "127.0.0.1:0".parse().expect("addr");
    let unpaced = SimConfig { initial_head: Some(0), ..SimConfig::default() };
    let window = SimConfig { window_len: Some(primary_window), ..unpaced.clone() };
    let primary = RelaySim::start_with(frames.clone(), window, addr).await.expect("primary");
    let secondary = RelaySim::start_with(secondary_copy(&frames), unpaced, addr).await.expect("secondary");
    let ahead = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (p, s, total, a) = (primary.handle(), secondary.handle(), frames.len(), ahead.clone());
    let pace = move || {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(4));
            for n in 1..=total {
                tick.tick().await;
                let jump = a.load(std::sync::atomic::Ordering::Relaxed);
                p.publish_up_to(if jump { total } else { n });
                s.publish_up_to(n);
            }
        })
    };
    (primary, secondary, ahead, pace)
}

/// The primary comes back keeping only its latest 200 events, less than the outage but
/// reaching back into what the leader handed over from the secondary: its window starts
/// with events shown delivered by content, so nothing is missing and the failback goes
/// through (by clocks alone it was refused). Nothing is lost or repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failback_to_a_short_window_that_starts_in_delivered_events_goes_through() {
    let want = keys(&frames());
    let (primary, secondary, _, pace) = stepped(200).await;
    let dir = testkit::tmpdir("switch-failback-short");
    let oracle = Arc::new(Oracle::default());
    let (status, stop, run) = spawn(replica(&dir, &primary, &secondary, &oracle, GapPolicy::Fail, "a").await);
    on(&status, RelayRole::Primary, "leading on the primary").await;
    let pacer = pace();
    delivered_at_least(&oracle, 300).await;
    primary.handle().set_down(true);
    on(&status, RelayRole::Secondary, "failover").await;
    delivered_at_least(&oracle, 900).await;
    primary.handle().set_down(false);
    on(&status, RelayRole::Primary, "failback to the short window").await;
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    oracle.assert_exactly_once(&want);
    pacer.abort();
}

/// The primary comes back keeping only its latest 20 events, far ahead of where the
/// leader stands on the secondary: its window starts with events known undelivered, so
/// a failback would skip what it no longer serves. It is refused; the leader stays on the
/// secondary, which still serves, stays ready and shows no refusal, and loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failback_to_a_primary_whose_window_is_past_the_position_is_refused_quietly() {
    let want = keys(&frames());
    let (primary, secondary, ahead, pace) = stepped(20).await;
    let dir = testkit::tmpdir("switch-failback-refused");
    let oracle = Arc::new(Oracle::default());
    let (status, stop, run) = spawn(replica(&dir, &primary, &secondary, &oracle, GapPolicy::Fail, "a").await);
    on(&status, RelayRole::Primary, "leading on the primary").await;
    let pacer = pace();
    delivered_at_least(&oracle, 300).await;
    primary.handle().set_down(true);
    on(&status, RelayRole::Secondary, "failover").await;
    ahead.store(true, std::sync::atomic::Ordering::Relaxed);
    delivered_at_least(&oracle, 600).await;
    primary.handle().set_down(false);
    let mut sampled = 0;
    eventually("all but the primary's window", WAIT, async || {
        let s = status.snapshot();
        assert!(s.refused_switch.is_none() && status.is_ready(), "a refused failback is not shown: {s:?}");
        assert_eq!(s.relay, Some(RelayRole::Secondary), "no failback past the position");
        sampled += 1;
        oracle.counts().len() >= want.len() - 60
    })
    .await;
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    oracle.assert_exactly_once(&want);
    assert!(sampled > 1);
    pacer.abort();
}

/// The leader crashes right after failing over to a secondary whose window is shorter
/// than the overlap (so the switch started at its oldest event): the standby takes over
/// on the secondary from the last commit. Nothing is lost; what repeats is the crashed
/// leader's uncommitted tail and, because the successor does not inherit the switch's
/// dedupe memory, events inside the overlap (counted, not asserted away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_crashing_during_a_short_window_switch_loses_nothing() {
    let want = keys(&frames());
    let (primary, secondary) = relays_with(250, SimConfig { window_len: Some(300), ..SimConfig::default() }).await;
    let dir = testkit::tmpdir("switch-crash-short");
    let oracle = Arc::new(Oracle::default());
    let a = replica_opts(&dir, &primary, &secondary, oracle.clone(), "a", |o| {
        o.switch_overlap = Duration::from_mins(1);
    })
    .await;
    let (a_status, _a_stop, a_run) = spawn(a);
    on(&a_status, RelayRole::Primary, "a leads on the primary").await;
    let b = replica_opts(&dir, &primary, &secondary, oracle.clone(), "b", |o| {
        o.switch_overlap = Duration::from_mins(1);
    })
    .await;
    let (b_status, b_stop, b_run) = spawn(b);
    delivered_at_least(&oracle, 590).await;
    primary.handle().set_down(true);
    on(&a_status, RelayRole::Secondary, "a fails over").await;
    let n = oracle.counts().len();
    delivered_at_least(&oracle, n + 30).await;
    a_run.abort();
    let _ = a_run.await;
    assert_eq!(relay_once_leading(&b_status).await, RelayRole::Secondary, "b resumed on the secondary");
    eventually("every event", WAIT, async || oracle.counts().len() >= want.len()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = b_stop.send(());
    b_run.await.expect("join").expect("b stops cleanly");
    let counts = oracle.counts();
    let lost: Vec<_> = want.iter().filter(|k| !counts.contains_key(*k)).take(5).collect();
    assert!(lost.is_empty(), "lost {lost:?}");
    assert!(counts.values().all(|n| *n <= 2), "nothing three times");
    let got = oracle.got.lock().expect("got").clone();
    let twice: Vec<&Key> = counts.iter().filter(|(_, n)| **n > 1).map(|(k, _)| k).collect();
    // Repeats that a had handed over from the primary: the successor did not know the
    // switch had handed them over already.
    let from_primary = twice
        .iter()
        .filter(|k| got.iter().any(|(g, r, _, who, _)| g == **k && *r == RelayRole::Primary && who.starts_with("a:")))
        .count();
    eprintln!(
        "crash during a short-window switch: {} events repeated, {from_primary} of them first handed over from the primary",
        twice.len()
    );
}
