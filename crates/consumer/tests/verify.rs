//! Verification end to end against relay-sim and the test PLC: the real signed capture
//! verifies completely; tampered copies built here are handed over as `#invalid` with
//! the right reason while every other event arrives unchanged; the `fail` policy commits
//! up to the invalid event and stops; key rotation; a directory that is down holds
//! events (the cursor never passes them) and everything is delivered once it returns.

use checkpoint::CursorStore as _;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use consumer::verify::ResolverConfig;
use consumer::{
    BatchCtx, Builder, Event, Handler, HandlerError, InvalidPolicy, Options, Reason, VerifyMode, VerifyOptions,
};
use relay_client::{Frame, Message, RelayUrl};
use relay_sim::{RelaySim, SimConfig};
use testkit::plc::{Mode, Plc};
use testkit::tamper;
use testkit::{WAIT, eventually};

type Bytes = testkit::bytes_compat::Bytes;

/// What the handler got for one seq: the frame bytes, the reason when it was `#invalid`,
/// and how many times.
type Got = (Vec<u8>, Option<Reason>, usize);

/// A commit with ops: seq, repo, ops with a record, ops with a prev.
type CommitInfo = (u64, String, usize, usize);

/// A tampering: the seq, how, and what it must be handed over as.
type Tampering = (u64, Box<dyn Fn(&[u8]) -> Bytes>, Option<Reason>);

/// What the handler got per seq.
#[derive(Default)]
struct Seen(Mutex<BTreeMap<u64, Got>>);

#[consumer::async_trait]
impl Handler for Seen {
    async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        let mut m = self.0.lock().expect("lock");
        for e in batch {
            let entry = m.entry(e.seq()).or_insert_with(|| (e.bytes().to_vec(), e.invalid().map(|i| i.reason), 0));
            entry.2 += 1;
            if let Some(i) = e.invalid() {
                let mut json = String::new();
                e.render_json(&mut json);
                let v: serde_json::Value = serde_json::from_str(&json).expect("#invalid is JSON");
                assert_eq!(v["type"], "#invalid");
                assert_eq!(v["seq"], e.seq());
                assert_eq!(v["repo"], i.repo.as_str());
                assert_eq!(v["reason"], i.reason.as_str());
            }
        }
        Ok(())
    }
}

fn options(plc: &Plc, mode: VerifyMode) -> Options {
    Options {
        verify: VerifyOptions {
            mode,
            resolver: ResolverConfig {
                plc_url: plc.url(),
                request_timeout: Duration::from_millis(500),
                ..ResolverConfig::default()
            },
            resolve_timeout: Duration::from_mins(1),
            ..VerifyOptions::default()
        },
        ..Options::default()
    }
}

struct Run {
    seen: Arc<Seen>,
    status: consumer::status::StatusHandle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), consumer::Error>>,
    sim: RelaySim,
    store: checkpoint::FileStore,
    relay: RelayUrl,
}

async fn start(frames: Vec<Bytes>, options: Options, name: &str, head: Option<usize>) -> Run {
    let sim = RelaySim::start_with(
        frames,
        SimConfig { initial_head: head, ..SimConfig::default() },
        "127.0.0.1:0".parse().expect("a"),
    )
    .await
    .expect("sim");
    let relay = RelayUrl::parse(&sim.url()).expect("url");
    let dir = testkit::tmpdir(name);
    let lock = dir.join("lease.lock");
    let store = checkpoint::FileStore::new(&dir.join("cursors"), &lock).expect("store");
    store.force(relay.fingerprint(), 0).await.expect("seed");
    let seen = Arc::new(Seen::default());
    let c = Builder::new(relay.clone())
        .lease(Arc::new(lease::LocalBackend::new(&lock)), lease::LeaseConfig::default())
        .store(checkpoint::FileStore::new(&dir.join("cursors"), &lock).expect("store"))
        .shared_handler(seen.clone())
        .options(options)
        .build()
        .expect("build");
    let status = c.status();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(c.run(async {
        let _ = stopped.await;
    }));
    Run { seen, status, stop: Some(stop), task: run, sim, store, relay }
}

impl Run {
    async fn until_committed(&self, seq: u64) {
        eventually("the stream committed", WAIT, async || self.status.snapshot().committed >= Some(seq)).await;
    }

    async fn stop(mut self) -> BTreeMap<u64, Got> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.expect("join").expect("clean stop");
        std::mem::take(&mut *self.seen.0.lock().expect("lock"))
    }
}

fn seq_of(f: &[u8]) -> u64 {
    relay_sim::frame_seq(f).expect("seq")
}

/// Commits with ops (seq, repo, ops that carry a record, ops that carry a prev).
fn commits(frames: &[Bytes]) -> Vec<CommitInfo> {
    frames
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            Frame::Message(Message::Commit(c)) if !c.ops.is_empty() => Some((
                c.seq,
                c.repo.to_owned(),
                c.ops.iter().filter(|o| o.cid.is_some()).count(),
                c.ops.iter().filter(|o| o.prev.is_some()).count(),
            )),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_signed_capture_verifies_completely_and_each_did_resolves_once() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    let run = start(frames.clone(), options(&plc, VerifyMode::Full), "verify-whole", None).await;
    run.until_committed(959).await;
    assert_eq!(run.status.snapshot().desynchronized, 0);
    let seen = run.stop().await;
    assert_eq!(seen.len(), 959, "every event handed over");
    for f in &frames {
        let (bytes, invalid, n) = &seen[&seq_of(f)];
        assert_eq!((bytes.as_slice(), *invalid, *n), (&f[..], None, 1), "seq {}", seq_of(f));
    }
    // The reference verifier agrees: every signature in the capture is valid.
    let verdicts = std::fs::read_to_string(testkit::fixture("signed/signed-b.verify.jsonl")).expect("verdicts");
    for l in verdicts.lines() {
        let v: serde_json::Value = serde_json::from_str(l).expect("JSON");
        if let Some(sig) = v["direct"]["sig"].as_str() {
            assert_eq!(sig, "valid", "{l}");
            assert_eq!(seen[&v["seq"].as_u64().expect("seq")].1, None);
        }
    }
    // One request per DID, every later commit from the cache; the two handle changes
    // (`#identity` at 501 and 511) make their DIDs be asked again.
    assert_eq!(plc.requests(), 12);
}

/// One tampered copy per kind, at distinct seqs; what each must be handed over as.
fn tampered(frames: &[Bytes]) -> (Vec<Bytes>, HashMap<u64, Option<Reason>>) {
    let cs = commits(frames);
    let other = cs.iter().map(|c| &c.1).find(|d| *d != &cs[0].1).expect("two repos").clone();
    let pick = |n: usize, want: &dyn Fn(&CommitInfo) -> bool| -> u64 {
        cs.iter().filter(|c| want(c)).nth(n).expect("a commit to tamper with").0
    };
    let key = tamper::test_key(9);
    let with_record = |c: &CommitInfo| c.2 > 0;
    let kinds: Vec<Tampering> = vec![
        (pick(3, &with_record), Box::new(tamper::sig_flipped), Some(Reason::Signature)),
        (pick(40, &with_record), Box::new(tamper::sig_flipped_old_cid), Some(Reason::Cid)),
        (pick(80, &with_record), Box::new(tamper::record_changed), Some(Reason::Cid)),
        (pick(120, &with_record), Box::new(tamper::op_cid_changed), Some(Reason::Cid)),
        (pick(160, &with_record), Box::new(tamper::prev_data_wrong), Some(Reason::Mst)),
        (pick(200, &with_record), Box::new(tamper::high_s), Some(Reason::Signature)),
        (
            pick(240, &|c| c.1 != other),
            Box::new(move |f| tamper::commit_did_changed(f, &other)),
            Some(Reason::DidMismatch),
        ),
        (pick(280, &with_record), Box::new(move |f| tamper::resigned(f, &key)), Some(Reason::Signature)),
        (pick(320, &with_record), Box::new(tamper::tree_node_removed), None),
        (pick(10, &|c| c.3 > 0), Box::new(tamper::prev_data_wrong), Some(Reason::Mst)),
    ];
    let mut out = frames.to_vec();
    let mut want = HashMap::new();
    for (seq, f, reason) in kinds {
        let i = out.iter().position(|x| seq_of(x) == seq).expect("frame");
        out[i] = f(&out[i]);
        assert!(want.insert(seq, reason).is_none(), "distinct seqs");
    }
    (out, want)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_events_are_invalid_with_their_reason_and_all_others_arrive_unchanged() {
    let plc = Plc::signed_fixture().await;
    let (frames, want) = tampered(&testkit::signed_frames());
    for strict in [false, true] {
        let mut o = options(&plc, VerifyMode::Full);
        o.verify.strict = strict;
        let run = start(frames.clone(), o, "verify-tampered", None).await;
        run.until_committed(959).await;
        let desync = run.status.desynchronized();
        let seen = run.stop().await;
        assert_eq!(seen.len(), 959);
        let mut invalid = 0;
        for f in &frames {
            let seq = seq_of(f);
            let (bytes, reason, n) = &seen[&seq];
            assert_eq!(*n, 1, "seq {seq} once");
            let expected = match want.get(&seq) {
                Some(None) if strict => Some(Reason::Mst),
                Some(r) => *r,
                None => None,
            };
            assert_eq!(*reason, expected, "seq {seq} (strict {strict})");
            assert_eq!(bytes.as_slice(), &f[..], "seq {seq}: handed over as the relay sent it");
            invalid += usize::from(reason.is_some());
        }
        assert_eq!(invalid, if strict { 10 } else { 9 });
        // Only repos with an invalid commit are listed (the rest chained again since).
        assert!(desync.iter().all(|d| want.contains_key(&d.seq)), "{desync:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fail_policy_commits_everything_before_the_invalid_event_and_stops() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    let bad = commits(&frames)[100].0;
    let frames: Vec<Bytes> =
        frames.iter().map(|f| if seq_of(f) == bad { tamper::sig_flipped(f) } else { f.clone() }).collect();
    let mut o = options(&plc, VerifyMode::Signatures);
    o.verify.invalid = InvalidPolicy::Fail;
    let run = start(frames, o, "verify-fail", None).await;
    let err = tokio::time::timeout(WAIT, run.task).await.expect("stops").expect("join").expect_err("an error");
    let text = err.to_string();
    assert!(text.contains(&format!("seq {bad}")) && text.contains("signature"), "{text}");
    let cursor = checkpoint::CursorStore::read(&run.store, run.relay.fingerprint()).await.expect("read");
    assert_eq!(cursor, checkpoint::ReadOutcome::Found(bad - 1), "committed up to just before the invalid event");
    let seen = run.seen.0.lock().expect("lock");
    assert!((1..bad).all(|s| seen.contains_key(&s)), "everything before it was handed over");
    assert!(!seen.contains_key(&bad), "the invalid event was not");
    drop(run.sim);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_verifies_after_one_refresh_and_the_old_key_is_refused_after_identity() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    // The account whose #identity is seq 501.
    let did = "did:plc:hugvji3hxaf7isnhzgd4lplg";
    let theirs: Vec<u64> = commits(&frames).iter().filter(|c| c.1 == did).map(|c| c.0).collect();
    let rotate_at = *theirs.iter().find(|s| **s > 100).expect("a commit after 100");
    let old_key_after = *theirs.iter().find(|s| **s > 501).expect("a commit after the #identity");
    let new = tamper::test_key(7);
    let frames: Vec<Bytes> = frames
        .iter()
        .map(|f| {
            let s = seq_of(f);
            if theirs.contains(&s) && s >= rotate_at && s != old_key_after {
                tamper::resigned(f, &new)
            } else {
                f.clone()
            }
        })
        .collect();
    let head = frames.iter().position(|f| seq_of(f) == rotate_at).expect("frame");
    let mut o = options(&plc, VerifyMode::Full);
    o.verify.resolver.min_refresh = Duration::from_mins(1);
    let run = start(frames, o, "verify-rotation", Some(head)).await;
    run.until_committed(rotate_at - 1).await;
    plc.set_doc(did, tamper::did_doc(did, &new));
    run.sim.handle().publish_up_to(usize::MAX);
    run.until_committed(959).await;
    let seen = run.stop().await;
    for s in &theirs {
        let want = (*s == old_key_after).then_some(Reason::Signature);
        assert_eq!(seen[s].1, want, "seq {s}");
    }
    assert_eq!(seen.values().filter(|v| v.1.is_some()).count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_outage_holds_events_and_everything_arrives_once_when_it_returns() {
    let plc = Plc::signed_fixture().await;
    plc.set_mode(Mode::Down);
    let frames = testkit::signed_frames();
    let first_commit = commits(&frames)[0].0.min(3);
    let run = start(frames.clone(), options(&plc, VerifyMode::Full), "verify-outage", None).await;
    for mode in [Mode::Down, Mode::Error, Mode::Garbage, Mode::Slow(Duration::from_secs(2))] {
        plc.set_mode(mode);
        let asked = plc.requests();
        eventually("the directory is asked again", WAIT, async || plc.requests() > asked + 1).await;
        let committed = run.status.snapshot().committed.unwrap_or(0);
        assert!(committed < first_commit, "{mode:?}: the cursor passed an unverified event ({committed})");
        assert!(run.seen.0.lock().expect("lock").keys().all(|s| *s < first_commit || !is_commit(&frames, *s)));
    }
    plc.set_mode(Mode::Up);
    run.until_committed(959).await;
    let seen = run.stop().await;
    assert_eq!(seen.len(), 959);
    assert!(seen.values().all(|(_, r, n)| r.is_none() && *n == 1), "all verified, each once");
}

fn is_commit(frames: &[Bytes], seq: u64) -> bool {
    frames.iter().any(|f| {
        seq_of(f) == seq && matches!(relay_client::decode(f), Ok(Frame::Message(Message::Commit(_) | Message::Sync(_))))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_did_that_never_resolves_is_unresolved_after_the_timeout() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    let bad = commits(&frames)[50].0;
    let unknown = "did:plc:nobodynobodynobodynobody";
    let frames: Vec<Bytes> =
        frames.iter().map(|f| if seq_of(f) == bad { tamper::repo_changed(f, unknown) } else { f.clone() }).collect();
    let mut o = options(&plc, VerifyMode::Signatures);
    o.verify.resolve_timeout = Duration::from_millis(800);
    let run = start(frames, o, "verify-unresolved", None).await;
    run.until_committed(959).await;
    let seen = run.stop().await;
    assert_eq!(seen[&bad].1, Some(Reason::Unresolved));
    assert_eq!(seen.values().filter(|v| v.1.is_some()).count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repo_stays_desynchronised_until_a_commit_chains_again() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    let cs = commits(&frames);
    // A commit followed by at least two more of its repo.
    let (bad, repo, after) = cs
        .iter()
        .enumerate()
        .find_map(|(i, c)| {
            let later: Vec<u64> = cs[i + 1..].iter().filter(|d| d.1 == c.1).map(|d| d.0).collect();
            (c.0 > 100 && later.len() >= 2).then(|| (c.0, c.1.clone(), later))
        })
        .expect("a repo with commits after one");
    let frames: Vec<Bytes> =
        frames.iter().map(|f| if seq_of(f) == bad { tamper::sig_flipped(f) } else { f.clone() }).collect();
    let upto = |seq: u64| frames.iter().position(|f| seq_of(f) == seq).expect("frame") + 1;
    let run = start(frames.clone(), options(&plc, VerifyMode::Full), "verify-desync", Some(upto(after[0]))).await;
    run.until_committed(after[0]).await;
    let listed = run.status.desynchronized();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!((listed[0].repo.as_str(), listed[0].seq, listed[0].reason), (repo.as_str(), bad, "signature"));
    assert_eq!(run.status.snapshot().desynchronized, 1);
    // The first commit after it starts a new chain (it is not invalid); the next one
    // chains onto that, and the repo is trusted again.
    run.sim.handle().publish_up_to(usize::MAX);
    run.until_committed(959).await;
    assert_eq!(run.status.desynchronized(), vec![]);
    let seen = run.stop().await;
    assert_eq!(seen.values().filter(|v| v.1.is_some()).count(), 1);
}

/// A relay that drops a commit of a repo: under `full` the repo's next commit does not
/// continue the last verified one and is `#invalid` (`chain`); the commit after it chains
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_relay_dropped_makes_the_next_one_a_chain_failure() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    let cs = commits(&frames);
    let (gone, next) = cs
        .iter()
        .enumerate()
        .find_map(|(i, c)| {
            let later: Vec<u64> = cs[i + 1..].iter().filter(|d| d.1 == c.1).map(|d| d.0).collect();
            (i > 20 && later.len() >= 2).then(|| (c.0, later[0]))
        })
        .expect("a repo with two commits after one");
    let holed = relay_sim::without(&frames, |m| m.seq() == Some(gone));
    let run = start(holed, options(&plc, VerifyMode::Full), "verify-dropped", None).await;
    run.until_committed(959).await;
    let seen = run.stop().await;
    assert_eq!(seen[&next].1, Some(Reason::Chain));
    assert_eq!(seen.values().filter(|v| v.1.is_some()).count(), 1, "only the commit that revealed it");
}

/// With a collection filter the commits it drops are still verified (the chain needs
/// them: none of the kept ones fails for a missing predecessor), and an invalid one is
/// handed over as `#invalid` whatever its collection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filtered_commits_are_verified_and_an_invalid_one_is_still_handed_over() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    let like = frames
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            Frame::Message(Message::Commit(c))
                if c.ops.len() == 1 && c.ops[0].collection() == "app.bsky.feed.like" && c.ops[0].cid.is_some() =>
            {
                Some(c.seq)
            }
            _ => None,
        })
        .nth(5)
        .expect("a like");
    let frames: Vec<Bytes> =
        frames.iter().map(|f| if seq_of(f) == like { tamper::sig_flipped(f) } else { f.clone() }).collect();
    let mut o = options(&plc, VerifyMode::Full);
    o.collections = consumer::CollectionFilter::new(["app.bsky.feed.post"]).expect("filter");
    let run = start(frames, o, "verify-filtered", None).await;
    run.until_committed(959).await;
    let seen = run.stop().await;
    assert_eq!(seen.get(&like).map(|v| v.1), Some(Some(Reason::Signature)), "the invalid like is handed over");
    assert_eq!(seen.values().filter(|v| v.1.is_some()).count(), 1, "no kept commit failed its chain");
    assert!(seen.len() < 900, "the filter dropped the rest of the likes and follows: {}", seen.len());
}

/// A relay that serves the capture twice (renumbered, as after a restart from an older
/// position): the second copy's commits are replays of verified ones, not chain breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_commits_are_not_chain_failures() {
    let plc = Plc::signed_fixture().await;
    let frames = relay_sim::capture::repeat(&testkit::signed_frames(), 2);
    let total = frames.len() as u64;
    let run = start(frames, options(&plc, VerifyMode::Full), "verify-replay", None).await;
    run.until_committed(total).await;
    let seen = run.stop().await;
    assert_eq!(seen.len() as u64, total);
    assert_eq!(seen.values().filter(|v| v.1.is_some()).count(), 0);
}

/// A consumer over the shared directory of a test (file lease, file store).
fn consumer_in(dir: &std::path::Path, relay: &RelayUrl, plc: &Plc, seen: Arc<Seen>) -> consumer::Consumer {
    let lock = dir.join("lease.lock");
    Builder::new(relay.clone())
        .lease(Arc::new(lease::LocalBackend::new(&lock)), lease::LeaseConfig::default())
        .store(checkpoint::FileStore::new(&dir.join("cursors"), &lock).expect("store"))
        .shared_handler(seen)
        .options(options(plc, VerifyMode::Full))
        .build()
        .expect("build")
}

/// Issue 33: the desynchronised repos lived in the leader's memory only; a new leader
/// knew none of them. Now each is kept in the cursor store (fenced like a commit) before
/// the cursor passes the event that desynchronised it: the next term lists it at once,
/// and when the repo chains again the store forgets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn desynchronised_repos_survive_a_leader_change_and_are_forgotten_when_they_chain_again() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    let cs = commits(&frames);
    let (bad, repo) = cs
        .iter()
        .enumerate()
        .find_map(|(i, c)| {
            (c.0 > 100 && cs[i + 1..].iter().filter(|d| d.1 == c.1).count() >= 2).then(|| (c.0, c.1.clone()))
        })
        .expect("a repo with commits after one");
    let frames: Vec<Bytes> =
        frames.iter().map(|f| if seq_of(f) == bad { tamper::sig_flipped(f) } else { f.clone() }).collect();
    let head = frames.iter().position(|f| seq_of(f) == bad).expect("frame") + 1;
    let sim = RelaySim::start_with(
        frames,
        SimConfig { initial_head: Some(head), ..SimConfig::default() },
        "127.0.0.1:0".parse().expect("a"),
    )
    .await
    .expect("sim");
    let relay = RelayUrl::parse(&sim.url()).expect("url");
    let dir = testkit::tmpdir("verify-desync-kept");
    let store = checkpoint::FileStore::new(&dir.join("cursors"), &dir.join("lease.lock")).expect("store");
    checkpoint::CursorStore::force(&store, relay.fingerprint(), 0).await.expect("seed");
    let run = |seen| {
        let c = consumer_in(&dir, &relay, &plc, seen);
        let status = c.status();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        (
            status,
            stop,
            tokio::spawn(c.run(async move {
                let _ = stopped.await;
            })),
        )
    };
    let (status, stop, task) = run(Arc::new(Seen::default()));
    eventually("the invalid commit committed", WAIT, async || status.snapshot().committed >= Some(bad)).await;
    let _ = stop.send(());
    task.await.expect("join").expect("clean stop");
    let kept = checkpoint::CursorStore::repos(&store).await.expect("repos");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].0, repo);
    assert!(kept[0].1.contains("signature"), "{kept:?}");
    // The next term lists it before any event of the repo arrives.
    let (status, stop, task) = run(Arc::new(Seen::default()));
    eventually("leading", WAIT, async || status.snapshot().role == consumer::Role::Leader).await;
    eventually("the kept repo listed", WAIT, async || {
        status.desynchronized().iter().any(|d| d.repo == repo && d.seq == bad)
    })
    .await;
    // The repo chains again: the store forgets it.
    sim.handle().publish_up_to(usize::MAX);
    eventually("every event committed", WAIT, async || status.snapshot().committed >= Some(959)).await;
    assert!(status.desynchronized().is_empty());
    let _ = stop.send(());
    task.await.expect("join").expect("clean stop");
    assert_eq!(checkpoint::CursorStore::repos(&store).await.expect("repos"), vec![], "cleared in the store too");
}
