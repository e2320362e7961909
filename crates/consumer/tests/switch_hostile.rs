//! Relay switches against hostile and messy input: a forged rev on the relay the leader
//! leaves, and a backlog burst of old clocks where the start search probes. Whatever the
//! relays or PDS clocks say, every authentic event is handed over exactly once.

mod switching;

use std::sync::Arc;
use std::time::Duration;

use consumer::verify::ResolverConfig;
use consumer::{GapPolicy, VerifyMode, VerifyOptions};
use relay_client::{Frame, Message, RelayRole};
use relay_sim::SimConfig;
use switching::*;
use testkit::plc::Plc;
use testkit::{WAIT, eventually};

/// A CBOR text string.
fn text(s: &str) -> Vec<u8> {
    let mut w = relay_client::cbor::Writer::new();
    w.str(s);
    w.buf
}

/// The primary serves one commit of a busy repo with its event `rev` forged to the
/// highest TID (the signed commit inside keeps the real one): it is handed over as
/// `#invalid`. The leader then fails over to an honest secondary. No later authentic
/// commit of that repo may be taken for delivered because of the forged rev. (The
/// authentic copy the secondary serves is not handed over: its repo's later commits
/// already were, and a repo's events keep their order; the repo stays desynchronised.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_rev_on_the_old_relay_does_not_decide_what_the_switch_drops() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    // A commit with at least 30 more commits of its repo after it.
    let commits: Vec<(usize, String)> = frames
        .iter()
        .enumerate()
        .filter_map(|(i, f)| match relay_client::decode(f).ok()? {
            Frame::Message(Message::Commit(c)) => Some((i, c.repo.to_owned())),
            _ => None,
        })
        .collect();
    let (forged_at, repo) = commits
        .iter()
        .find(|(i, r)| *i > 150 && commits.iter().filter(|(j, s)| j > i && s == r).count() >= 30)
        .cloned()
        .expect("a busy repo");
    let mut primary = frames.clone();
    primary[forged_at] = testkit::tamper::with_fields(&frames[forged_at], &[("rev", text("7zzzzzzzzzzzz"))]);
    let secondary = secondary_copy(&frames);
    let forged = keys(&frames[forged_at..=forged_at]).remove(0);
    let want: Vec<Key> = keys(&frames).into_iter().filter(|k| *k != forged).collect();
    let (p, s) = relays_of(primary, secondary, 250, SimConfig::default()).await;
    let dir = testkit::tmpdir("switch-forged-rev");
    let oracle = Arc::new(Oracle::default());
    let c = replica_opts(&dir, &p, &s, oracle.clone(), "a", |o| {
        o.verify = VerifyOptions {
            mode: VerifyMode::Full,
            resolver: ResolverConfig {
                plc_url: plc.url(),
                request_timeout: Duration::from_millis(500),
                ..ResolverConfig::default()
            },
            ..VerifyOptions::default()
        };
        o.chain_breaks = consumer::ChainBreaks::Count;
    })
    .await;
    let (status, stop, run) = spawn(c);
    on(&status, RelayRole::Primary, "leading on the primary").await;
    eventually("the forged commit handed over as #invalid", WAIT, async || !oracle.invalid().is_empty()).await;
    let n = oracle.counts().len();
    delivered_at_least(&oracle, n + 20).await;
    p.handle().set_down(true);
    on(&status, RelayRole::Secondary, "failover to the honest secondary").await;
    eventually("every event of the secondary", WAIT, async || s.handle().head_seq() >= 1_000_000 + 959).await;
    let _ = tokio::time::timeout(WAIT, async {
        while oracle.counts().len() < want.len() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    let counts = oracle.counts();
    let theirs = want.iter().filter(|k| k.1 == repo).count();
    let lost = want.iter().filter(|k| k.1 == repo && !counts.contains_key(*k)).count();
    assert_eq!(lost, 0, "{lost} of the repo's {theirs} authentic events never delivered");
    assert_eq!(oracle.invalid().len(), 1, "only the forged commit is #invalid: {:?}", oracle.invalid());
    oracle.assert_exactly_once(&want);
}

/// Thirty consecutive commits on the secondary carry times an hour old (a PDS delivering
/// its backlog at once) exactly where the start search's first probe after the oldest
/// lands. The clocks may bound the search; only content may prove the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_burst_where_the_probe_lands_does_not_move_the_start_past_undelivered_events() {
    let frames = frames();
    let want = keys(&frames);
    let secondary = secondary_copy(&frames);
    // The search probes the oldest event, then 1024 seqs on: the burst sits there.
    let burst = 1_005..1_045;
    let secondary =
        relay_sim::skew_clocks(&secondary, |i, m| burst.contains(&i) && matches!(m, Message::Commit(_)), -3_600_000);
    let (p, s) = relays_of(frames, secondary, 250, SimConfig::default()).await;
    // The secondary kept serving while the primary fell behind: it holds everything.
    s.handle().publish_up_to(usize::MAX);
    let dir = testkit::tmpdir("switch-burst");
    let oracle = Arc::new(Oracle::default());
    let (status, stop, run) = spawn(replica(&dir, &p, &s, &oracle, GapPolicy::Fail, "a").await);
    on(&status, RelayRole::Primary, "leading on the primary").await;
    delivered_at_least(&oracle, 300).await;
    p.handle().set_down(true);
    on(&status, RelayRole::Secondary, "failover").await;
    let _ = tokio::time::timeout(WAIT, async {
        while oracle.counts().len() < want.len() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    oracle.assert_exactly_once(&want);
}
