//! Per-repo chain checks against relay-sim: a relay that drops one commit of a repo
//! breaks that repo's chain at its next commit, and with `ChainBreaks::Emit` the handler
//! gets the break on that commit (even when the collection filter drops the commit).

use std::sync::{Arc, Mutex};

use consumer::{BatchCtx, ChainBreak, ChainBreaks, CollectionFilter, Event, Handler, HandlerError, Options};
use relay_client::Message;
use testkit::{WAIT, eventually};

mod local;

/// Records the seqs handed over and the chain breaks with their seqs.
#[derive(Default)]
struct Seen {
    seqs: Mutex<Vec<u64>>,
    breaks: Mutex<Vec<(u64, ChainBreak)>>,
}

#[consumer::async_trait]
impl Handler for Seen {
    async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        for e in batch {
            self.seqs.lock().expect("lock").push(e.seq());
            if let Some(b) = e.chain_break() {
                self.breaks.lock().expect("lock").push((e.seq(), b.clone()));
            }
        }
        Ok(())
    }
}

/// A `#sync` in place of a repo's commit states the rev the next commit builds on: the
/// chain goes on unbroken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_restarts_the_chain_at_its_rev() {
    let frames = testkit::fixture_frames();
    let all = commits(&frames);
    let replaced = (0..all.len())
        .find(|&i| all[..i].iter().any(|c| c.1 == all[i].1) && all[i + 1..].iter().any(|c| c.1 == all[i].1))
        .expect("a repo with three commits");
    let (seq, repo, rev, _) = &all[replaced];
    let synced: Vec<bytes::Bytes> = frames
        .iter()
        .map(|f| {
            if relay_sim::frame_seq(f) == Some(*seq) {
                relay_sim::sync_frame(*seq, repo, rev, "2026-12-02T10:20:00.000Z")
            } else {
                f.clone()
            }
        })
        .collect();
    let seen = consume(synced, emitting(), "chain-sync").await;
    assert!(seen.seqs.lock().expect("lock").contains(seq), "the #sync was handed over");
    assert_eq!(seen.breaks.lock().expect("lock").len(), 0, "no break after the #sync");
}

/// The commits of the fixture: (seq, repo, rev, ops).
fn commits(frames: &[bytes::Bytes]) -> Vec<(u64, String, String, usize)> {
    frames
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            relay_client::Frame::Message(Message::Commit(c)) => {
                Some((c.seq, c.repo.to_owned(), c.rev.to_owned(), c.ops.len()))
            }
            _ => None,
        })
        .collect()
}

/// Runs a consumer over `frames` until every seq was handed over or passed, and returns
/// what the handler saw.
async fn consume(frames: Vec<bytes::Bytes>, options: Options, name: &str) -> Arc<Seen> {
    let last = frames.iter().filter_map(|f| relay_sim::frame_seq(f)).max().expect("seqs");
    let seen = Arc::new(Seen::default());
    let c = local::Local::start(frames, seen.clone(), options, name).await;
    eventually("the whole stream committed", WAIT, async || c.status.snapshot().committed >= Some(last)).await;
    c.stop().await;
    seen
}

fn emitting() -> Options {
    Options { chain_breaks: ChainBreaks::Emit, ..Options::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_commit_breaks_its_repos_chain_and_the_handler_gets_the_break() {
    let frames = testkit::fixture_frames();
    let all = commits(&frames);
    // The middle commit of a repo with at least three.
    let (dropped, next, before) = (0..all.len())
        .find_map(|i| {
            let before = all[..i].iter().rposition(|c| c.1 == all[i].1)?;
            let next = all[i + 1..].iter().position(|c| c.1 == all[i].1)? + i + 1;
            Some((i, next, before))
        })
        .expect("a repo with three commits");
    let seen = consume(frames.clone(), emitting(), "chain-whole").await;
    assert_eq!(seen.breaks.lock().expect("lock").len(), 0, "the capture's chains are whole");
    let gone = all[dropped].0;
    let holed = relay_sim::without(&frames, |m| m.seq() == Some(gone));
    let seen = consume(holed, emitting(), "chain-holed").await;
    let breaks = seen.breaks.lock().expect("lock").clone();
    assert_eq!(breaks.len(), 1, "{breaks:?}");
    let (seq, b) = &breaks[0];
    assert_eq!(*seq, all[next].0, "on the repo's next commit");
    assert_eq!(b.repo, all[dropped].1);
    assert_eq!((&b.last_rev, &b.since, &b.rev), (&all[before].2, &all[dropped].2, &all[next].2));
    // Counting only: no break reaches the handler.
    let holed = relay_sim::without(&frames, |m| m.seq() == Some(gone));
    let seen = consume(holed, Options::default(), "chain-count").await;
    assert!(seen.breaks.lock().expect("lock").is_empty());
    // The check can be turned off.
    let holed = relay_sim::without(&frames, |m| m.seq() == Some(gone));
    let seen = consume(holed, Options { chain_repos: 0, ..emitting() }, "chain-off").await;
    assert!(seen.breaks.lock().expect("lock").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_on_a_commit_the_filter_drops_still_reaches_the_handler() {
    let frames = testkit::fixture_frames();
    let all = commits(&frames);
    let (dropped, next) = (0..all.len())
        .find_map(|i| {
            all[..i].iter().rposition(|c| c.1 == all[i].1)?;
            Some((i, all[i + 1..].iter().position(|c| c.1 == all[i].1)? + i + 1))
        })
        .expect("a repo with three commits");
    let gone = all[dropped].0;
    let holed = relay_sim::without(&frames, |m| m.seq() == Some(gone));
    let nothing = CollectionFilter::new(["no.such.collection"]).expect("filter");
    let seen = consume(holed, Options { collections: nothing, ..emitting() }, "chain-filtered").await;
    let breaks = seen.breaks.lock().expect("lock").clone();
    assert_eq!(breaks.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![all[next].0]);
    let seqs = seen.seqs.lock().expect("lock").clone();
    let with_ops: Vec<u64> = all.iter().filter(|c| c.3 > 0 && seqs.contains(&c.0)).map(|c| c.0).collect();
    assert_eq!(with_ops, vec![all[next].0], "the filter still drops every other commit with ops");
}
