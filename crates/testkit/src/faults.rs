//! The fault scenarios both store backends share, written once: each runs a three-process
//! cluster on Redis or on NATS (`nats`) and drives the lease and cursor store's server
//! through [`crate::cluster::StoreServer`] and the per-replica proxies. `chaos.rs` and
//! `chaos_nats.rs` call them, so every scenario runs once per backend.

use std::time::{Duration, Instant};

use tokio::time::sleep;

use crate::cluster::{Cluster, Spec};

/// `FK_TEST_CHAOS_SCALE` (default 1): repetitions and stream length for `make chaos`.
#[must_use]
pub fn scale() -> usize {
    std::env::var("FK_TEST_CHAOS_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1)
}

/// A cluster of `copies` fixture copies on Redis or NATS.
#[must_use]
pub fn spec(copies: usize, nats: bool) -> Spec {
    Spec { copies, nats, ..Spec::default() }
}

/// Starts `spec`, every replica, and waits for a leader: (cluster, leader, token).
pub async fn started(name: &str, spec: Spec) -> (Cluster, usize, u64) {
    let mut c = Cluster::start(name, spec).await;
    c.start_all();
    let (l, t) = c.wait_leader(None).await;
    (c, l, t)
}

/// Waits until the output holds at least `n` distinct seqs.
///
/// # Panics
/// When there is no progress within [`crate::WAIT`].
pub async fn progress(c: &Cluster, n: usize) {
    let deadline = Instant::now() + crate::WAIT;
    while c.seen().len() < n {
        assert!(Instant::now() < deadline, "no progress; logs in {}", c.dir.display());
        sleep(Duration::from_millis(20)).await;
    }
}

/// The leader killed (`SIGKILL`): a new term with a greater token, nothing lost (the crashed
/// leader's uncommitted tail replayed), `scale()` rounds.
///
/// # Panics
/// On any oracle failure.
pub async fn sigkill_leader(name: &str, nats: bool) {
    for round in 0..scale() {
        let (mut c, l, t) = started(&format!("{name}{round}"), spec(2, nats)).await;
        progress(&c, 500).await;
        c.replicas[l].sigkill();
        let (l2, t2) = c.wait_leader(Some(l)).await;
        assert_ne!(l2, l);
        assert!(t2 > t, "new term, greater token");
        c.replicas[l].start(); // back as a standby
        c.wait_complete().await;
        let dups = c.check();
        eprintln!("{name} round {round}: {dups} seqs replayed after the crash");
    }
}

/// The leader stopped (`SIGTERM`): a graceful handover with no duplicates. Returns the cluster and
/// the new leader and token for backend-specific checks.
///
/// # Panics
/// On any oracle failure, or a duplicate.
pub async fn sigterm_hands_over(name: &str, nats: bool) -> (Cluster, usize, u64) {
    let (mut c, l, _) = started(name, spec(2, nats)).await;
    progress(&c, 500).await;
    assert!(c.replicas[l].sigterm().await, "graceful exit 0");
    let (l2, t2) = c.wait_leader(Some(l)).await;
    c.wait_complete().await;
    assert_eq!(c.check(), 0, "a graceful handover duplicates nothing");
    (c, l2, t2)
}

/// The leader frozen (`SIGSTOP`) past the ttl, then resumed (`SIGCONT`): a new term; the woken replica is
/// a standby. Returns (cluster, old token, new token, lines the old token wrote after
/// waking) before the final oracle run by the caller.
///
/// # Panics
/// When the woken replica still says it leads.
pub async fn sigstop_past_ttl(name: &str, nats: bool) -> (Cluster, u64, u64, usize) {
    let (c, l, t) = started(name, spec(2, nats)).await;
    progress(&c, 400).await;
    c.replicas[l].sigstop();
    let (_, t2) = c.wait_leader(Some(l)).await;
    assert!(t2 > t);
    let before = c.seen().values().flatten().filter(|(_, tok)| *tok == t).count();
    c.replicas[l].sigcont();
    sleep(Duration::from_secs(1)).await;
    let after = c.seen().values().flatten().filter(|(_, tok)| *tok == t).count();
    let status = c.replicas[l].status().await.expect("woken replica answers");
    assert_eq!(status["role"], "standby", "the woken replica knows it lost");
    // An ex-leader shows no leader's figures: a `max()` over replicas (the lag alert)
    // must not keep seeing its last lag.
    let metrics = c.replicas[l].metrics().await.expect("woken replica answers /metrics");
    for g in [
        "firekeeper_leader",
        "firekeeper_lag_seconds",
        "firekeeper_uncommitted_seq",
        "firekeeper_committed_seq",
        "firekeeper_relay_connected",
        "firekeeper_queue_depth",
    ] {
        assert!(metrics.lines().any(|line| line == format!("{g} 0")), "a standby's {g} is not 0:\n{metrics}");
    }
    c.wait_complete().await;
    c.check();
    (c, t, t2, after - before)
}

/// The leader cut off from the store by its proxy while standbys are not: a standby
/// takes over with a greater token; the old leader is a standby afterwards.
///
/// # Panics
/// On any oracle failure.
pub async fn leader_cut_off(name: &str, nats: bool) {
    let (c, l, t) = started(name, spec(2, nats)).await;
    progress(&c, 400).await;
    c.proxies[l].set_cut(true);
    let (l2, t2) = c.wait_leader(Some(l)).await;
    assert!(t2 > t && l2 != l);
    c.proxies[l].set_cut(false);
    c.wait_complete().await;
    c.check();
    let s = c.replicas[l].status().await.expect("status");
    assert_eq!(s["role"], "standby");
}

/// 60 ms each way on the leader's store link (120 ms per round trip against a 250 ms op
/// timeout; 80 ms each way once used up the slack under a full parallel run): no flip,
/// no duplicates.
///
/// # Panics
/// On a flip or any oracle failure.
pub async fn latency_below_the_op_timeout(name: &str, nats: bool) {
    let (c, l, t) = started(name, spec(2, nats)).await;
    progress(&c, 300).await;
    c.proxies[l].set_latency(Duration::from_millis(60));
    sleep(Duration::from_secs(2)).await;
    c.proxies[l].set_latency(Duration::ZERO);
    c.wait_complete().await;
    assert_eq!(c.leader().await, Some((l, t)));
    assert_eq!(c.check(), 0);
}

/// Renewals and commits reach the store, their answers never come back: the leader
/// stops at its deadline, and nothing is lost.
///
/// # Panics
/// When the leader never stops, or on any oracle failure.
pub async fn lost_replies(name: &str, nats: bool) {
    let (c, l, _) = started(name, spec(2, nats)).await;
    progress(&c, 300).await;
    c.proxies[l].set_flow(crate::Flow::DropReplies);
    let t0 = Instant::now();
    let deadline = Instant::now() + crate::WAIT;
    while c.replicas[l].status().await.is_some_and(|s| s["role"] == "leader") {
        assert!(Instant::now() < deadline, "the leader never noticed its replies were lost");
        sleep(Duration::from_millis(20)).await;
    }
    eprintln!("{name}: the leader stopped after {:?}", t0.elapsed());
    c.proxies[l].set_flow(crate::Flow::Pass);
    c.wait_leader(None).await;
    c.wait_complete().await;
    c.check();
}

/// No reset, no answer on the leader's store link: it hands over at its deadline.
///
/// # Panics
/// On any oracle failure.
pub async fn half_open_link(name: &str, nats: bool) {
    let (c, l, t) = started(name, spec(2, nats)).await;
    progress(&c, 300).await;
    c.proxies[l].set_flow(crate::Flow::Blackhole);
    let t0 = Instant::now();
    let (l2, t2) = c.wait_leader(Some(l)).await;
    eprintln!("{name}: half-open link, handover after {:?}", t0.elapsed());
    assert!(t2 > t && l2 != l);
    let s = c.replicas[l].status().await.expect("status");
    assert_ne!(s["role"], "leader", "the cut-off leader stopped");
    c.proxies[l].set_flow(crate::Flow::Pass);
    c.wait_complete().await;
    c.check();
}

/// The store paused (`SIGSTOP`, data kept) past the ttl: nobody leads meanwhile; after
/// the resume a term (new or retaken) finishes the stream.
///
/// # Panics
/// When a replica leads while the store is unreachable, or on any oracle failure.
pub async fn store_paused_past_the_ttl(name: &str, nats: bool) {
    let (mut c, _, _) = started(name, spec(3, nats)).await;
    progress(&c, 400).await;
    c.store_server().pause();
    sleep(Duration::from_secs(3)).await;
    for r in &c.replicas {
        if let Some(s) = r.status().await {
            assert_ne!(s["role"], "leader", "nobody leads while the lease store is unreachable past the ttl");
        }
    }
    c.store_server().resume();
    c.wait_leader(None).await;
    c.wait_complete().await;
    c.check();
}

/// Issue 40, the review's scenario: three replicas, ttl 4 s, 250 events/s. The leader
/// freezes (SIGSTOP), the lease and cursor store comes back with no data, and one second
/// later a third replica starts knowing nothing. Nothing may go undelivered, and no two
/// live terms may both deliver under one token. `start` is the replicas'
/// `FIREKEEPER_START` (`live`: a manifest that kept its first-start setting).
///
/// # Panics
/// On any oracle failure.
pub async fn store_lost_while_leader_frozen(name: &str, nats: bool, start: Option<&str>) {
    let mut extra_env = Vec::new();
    if let Some(s) = start {
        extra_env.push(("FIREKEEPER_START", s.to_owned()));
    }
    let spec = Spec { replicas: 3, copies: 2, rate: Some(250), ttl_ms: 4000, nats, extra_env, ..Spec::default() };
    let mut c = Cluster::start(name, spec).await;
    c.replicas[0].start();
    let (l, t) = c.wait_leader(None).await;
    c.replicas[1].start();
    let deadline = Instant::now() + crate::WAIT;
    while c.replicas[1].status().await.is_none_or(|s| s["role"] != "standby") {
        assert!(Instant::now() < deadline, "r1 never stood by");
        sleep(Duration::from_millis(20)).await;
    }
    progress(&c, 500).await;
    c.replicas[l].sigstop();
    // What the frozen leader wrote before it froze; what it writes after it wakes was
    // never committed and delivers nothing (`undelivered` does not count it).
    let frozen = c.replicas[l].out_files().last().cloned().expect("an output file");
    let frozen_len = std::fs::metadata(&frozen).map_or(0, |m| m.len());
    c.store_server().lose_data();
    sleep(Duration::from_secs(1)).await;
    c.replicas[2].start();
    let (l2, t2) = c.wait_leader(Some(l)).await;
    c.replicas[l].sigcont();
    c.wait_cursor_end().await;
    let missing = undelivered(&c, &frozen, frozen_len);
    assert!(
        missing.is_empty(),
        "{} seqs never delivered, from {:?}; logs in {}",
        missing.len(),
        missing.first(),
        c.dir.display()
    );
    c.check();
    let shared: Vec<_> = c.writers_by_token().into_iter().filter(|(_, w)| w.len() > 1).collect();
    assert!(shared.is_empty(), "terms of different replicas delivered under one token: {shared:?}");
    eprintln!("{name}: leader r{l} token {t} frozen; r{l2} took over with token {t2}");
}

/// The seqs in no output, where `cut`'s output counts only its first `len` bytes.
fn undelivered(c: &Cluster, cut: &std::path::Path, len: u64) -> Vec<u64> {
    let mut delivered = std::collections::BTreeSet::new();
    for f in c.replicas.iter().flat_map(crate::cluster::Replica::out_files) {
        let Ok(mut bytes) = std::fs::read(&f) else { continue };
        if f == cut {
            bytes.truncate(usize::try_from(len).unwrap_or(usize::MAX));
        }
        for line in String::from_utf8_lossy(&bytes).lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line)
                && let Some(seq) = v["seq"].as_u64()
            {
                delivered.insert(seq);
            }
        }
    }
    (1..=c.total).filter(|s| !delivered.contains(s)).collect()
}
