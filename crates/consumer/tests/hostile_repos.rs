//! Four hostile repos at once under `FIREKEEPER_VERIFY=full`, in the real signed capture:
//! one whose DID resolves slowly (3 s), one whose DID the directory does not know (404),
//! one on a `did:web` host that answers 500, and one that rotates its key twice within
//! 10 s right after a bad signature made its DID be refreshed (the directory answering
//! it in 300 ms). Every other repo's events are delivered as themselves, every event of
//! the four ends verified or `#invalid` with the right reason, and the cursor never
//! stands still for long: an unresolvable DID holds its first event for the resolve
//! timeout once, not each of its events.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use consumer::verify::ResolverConfig;
use consumer::{BatchCtx, Builder, Event, Handler, HandlerError, Options, Reason, VerifyMode, VerifyOptions};
use relay_client::{Frame, Message, RelayUrl};
use relay_sim::{RelaySim, SimConfig};
use testkit::plc::{Mode, Plc};
use testkit::tamper;
use testkit::{WAIT, eventually};

type Bytes = testkit::bytes_compat::Bytes;

/// Per seq: the reason when handed over as `#invalid`, and how often.
#[derive(Default)]
struct Seen(Mutex<BTreeMap<u64, (Option<Reason>, usize)>>);

#[consumer::async_trait]
impl Handler for Seen {
    async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        let mut m = self.0.lock().expect("lock");
        for e in batch {
            let entry = m.entry(e.seq()).or_insert((e.invalid().map(|i| i.reason), 0));
            entry.1 += 1;
        }
        Ok(())
    }
}

const SLOW: &str = "did:plc:7de3mzxqfsxcovmrazyzw2s7";
const GONE_FROM: &str = "did:plc:hq4gwjhafikpntutc64kfak2";
const GONE: &str = "did:plc:nobodynobodynobodynobody";
const WEB_FROM: &str = "did:plc:bopr7i3xymte3xnjnkgrelhn";
const ROTATES: &str = "did:plc:hugvji3hxaf7isnhzgd4lplg";

fn message(f: &[u8]) -> Message<'_> {
    match relay_client::decode(f).expect("frame") {
        Frame::Message(m) => m,
        Frame::Error(_) => panic!("an event"),
    }
}

fn is_commit_of(f: &[u8], did: &str) -> bool {
    matches!(message(f), Message::Commit(c) if c.repo == did)
}

/// The capture with the four hostile repos built in, renumbered from 1, the expected
/// verdict per seq, and the seqs where the rotating repo's `#identity` events are.
fn hostile(web: &str) -> (Vec<Bytes>, BTreeMap<u64, Option<Reason>>, [u64; 2]) {
    let frames = testkit::signed_frames();
    // Its handle change (its first #identity is its creation).
    let identity =
        frames.iter().position(|f| matches!(message(f), Message::Identity(i) if i.did == ROTATES && i.seq > 100));
    let identity = identity.expect("the rotating repo's #identity");
    let commits = |did: &str, after: usize| {
        (after..frames.len()).filter(|&i| is_commit_of(&frames[i], did)).collect::<Vec<usize>>()
    };
    // A bad signature shortly before the first rotation: the DID is refreshed, which
    // starts the 10 s refresh limit.
    let bad = (0..identity).rev().find(|&i| is_commit_of(&frames[i], ROTATES)).expect("a commit before the rotation");
    // The second rotation, a few of its commits after the first.
    let second = commits(ROTATES, identity)[3] + 1;
    let mut out: Vec<(Bytes, Option<Reason>)> = Vec::new();
    let (k2, k3) = (tamper::test_key(7), tamper::test_key(8));
    for (i, f) in frames.iter().enumerate() {
        if i == second {
            out.push((frames[identity].clone(), None));
        }
        let f = match message(f) {
            Message::Commit(c) if c.repo == GONE_FROM => (tamper::repo_changed(f, GONE), Some(Reason::Unresolved)),
            Message::Commit(c) if c.repo == WEB_FROM => (tamper::repo_changed(f, web), Some(Reason::Unresolved)),
            Message::Commit(c) if c.repo == ROTATES && i == bad => (tamper::sig_flipped(f), Some(Reason::Signature)),
            Message::Commit(c) if c.repo == ROTATES && i > second => (tamper::resigned(f, &k3), None),
            Message::Commit(c) if c.repo == ROTATES && i > identity => (tamper::resigned(f, &k2), None),
            _ => (f.clone(), None),
        };
        out.push(f);
    }
    let (frames, reasons): (Vec<Bytes>, Vec<Option<Reason>>) = out.into_iter().unzip();
    let frames = relay_sim::reseq(&frames, 0, 1, 0);
    let want = reasons.into_iter().enumerate().map(|(i, r)| (i as u64 + 1, r)).collect();
    let first = identity as u64 + 1;
    (frames, want, [first, second as u64 + 1])
}

/// Samples how long the committed cursor stood still while published events waited: the
/// longest such stretch so far, and the sampling task.
fn stall_sampler(
    status: consumer::StatusHandle,
    head: relay_sim::SimHandle,
) -> (Arc<Mutex<Duration>>, tokio::task::JoinHandle<()>) {
    let stall = Arc::new(Mutex::new(Duration::ZERO));
    let longest = stall.clone();
    let task = tokio::spawn(async move {
        let (mut last, mut since) = (None, Instant::now());
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let c = status.snapshot().committed;
            if c != last || c >= Some(head.head_seq()) {
                (last, since) = (c, Instant::now());
            }
            let mut s = longest.lock().expect("stall");
            *s = (*s).max(since.elapsed());
        }
    });
    (stall, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_hostile_repos_at_once_hold_no_one_else_and_end_verified_or_invalid_with_their_reason() {
    let _ = tracing_subscriber::fmt().with_env_filter("info").with_writer(std::io::stderr).try_init();
    let plc = Plc::signed_fixture().await;
    plc.set_delay(SLOW, Duration::from_secs(3));
    plc.set_delay(ROTATES, Duration::from_millis(300));
    let web_host = Plc::start(std::collections::HashMap::new()).await;
    web_host.set_mode(Mode::Error);
    let web = format!("did:web:{}", web_host.url().trim_start_matches("http://").replace(':', "%3A"));
    let (frames, want, [rotation1, rotation2]) = hostile(&web);
    let total = frames.len() as u64;
    let at = |seq: u64| usize::try_from(seq - 1).expect("small");
    let sim = RelaySim::start_with(
        frames,
        SimConfig { initial_head: Some(at(rotation1)), ..SimConfig::default() },
        "127.0.0.1:0".parse().expect("a"),
    )
    .await
    .expect("sim");
    let relay = RelayUrl::parse(&sim.url()).expect("url");
    let dir = testkit::tmpdir("hostile-repos");
    let lock = dir.join("lease.lock");
    let store = checkpoint::FileStore::new(&dir.join("cursors"), &lock).expect("store");
    checkpoint::CursorStore::force(&store, relay.fingerprint(), 0).await.expect("seed");
    let resolve_timeout = Duration::from_secs(2);
    let options = Options {
        verify: VerifyOptions {
            mode: VerifyMode::Full,
            resolver: ResolverConfig {
                plc_url: plc.url(),
                request_timeout: Duration::from_secs(5),
                allow_private: true,
                web_http: true,
                ..ResolverConfig::default()
            },
            resolve_timeout,
            ..VerifyOptions::default()
        },
        commit_interval: Duration::from_millis(50),
        ..Options::default()
    };
    let seen = Arc::new(Seen::default());
    let c = Builder::new(relay)
        .lease(Arc::new(lease::LocalBackend::new(&lock)), lease::LeaseConfig::default())
        .store(store)
        .shared_handler(seen.clone())
        .options(options)
        .build()
        .expect("build");
    let status = c.status();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(c.run(async {
        let _ = stopped.await;
    }));
    let (stall, sampler) = stall_sampler(status.clone(), sim.handle());
    let committed = |seq: u64| {
        let status = status.clone();
        async move { eventually(&format!("committed {seq}"), WAIT, async || status.snapshot().committed >= Some(seq)).await }
    };
    let t0 = Instant::now();
    // The first rotation: the directory has the new key before the repo says so.
    committed(rotation1 - 1).await;
    plc.set_doc(ROTATES, tamper::did_doc(ROTATES, &tamper::test_key(7)));
    sim.handle().publish_up_to(at(rotation2));
    committed(rotation2 - 1).await;
    plc.set_doc(ROTATES, tamper::did_doc(ROTATES, &tamper::test_key(8)));
    sim.handle().publish_up_to(usize::MAX);
    committed(total).await;
    let took = t0.elapsed();
    sampler.abort();
    let _ = stop.send(());
    run.await.expect("join").expect("clean stop");
    let seen = std::mem::take(&mut *seen.0.lock().expect("lock"));
    let stall = *stall.lock().expect("stall");
    eprintln!("hostile repos: all {total} committed in {took:?}; the cursor stood still at most {stall:?}");
    let wrong: Vec<_> = want
        .iter()
        .filter(|(seq, r)| seen.get(seq).map(|s| s.0) != Some(**r))
        .map(|(seq, r)| (*seq, *r, seen.get(seq).map(|s| s.0)))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} events not as expected, e.g. (seq, wanted, got) {:?}; rotations at {rotation1} and {rotation2}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );
    assert!(seen.values().all(|(_, n)| *n == 1), "each once");
    assert_eq!(seen.len() as u64, total);
    // One hold per unresolvable DID, not one per event (its 90-odd commits held 2 s each
    // would stand the cursor still for minutes).
    assert!(stall < resolve_timeout * 5, "the cursor stood still {stall:?}");
}
