//! Embedding the consumer: a handler of your own that counts record operations per
//! collection, elected through a lock-file lease, its cursor kept in files.
//!
//! ```text
//! cargo run -p consumer --example count_commits -- wss://bsky.network ./count-data [START]
//! ```
//!
//! With no cursor stored yet, it starts from the live tail, or from seq `START` if given.
//!
//! Start two copies on the same data directory: one leads, the other waits and takes
//! over (from the committed cursor) when you stop the first with Ctrl-C.
//!
//! `cargo test -p consumer --example count_commits` runs it against relay-sim replaying
//! the repository's fixture capture.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use consumer::{BatchCtx, Builder, Event, Handler, HandlerError, Snapshot, StatusHandle, async_trait};
use relay_client::{Message, RelayUrl};

/// Record operations per collection, and how many events of each kind were seen.
#[derive(Default)]
struct Counts {
    ops: Mutex<BTreeMap<String, u64>>,
    kinds: Mutex<BTreeMap<&'static str, u64>>,
    seqs: Mutex<Vec<u64>>,
}

#[async_trait]
impl Handler for Counts {
    async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        let mut ops = self.ops.lock().map_err(|_| HandlerError::failed("counting", "a lock was poisoned"))?;
        let mut kinds = self.kinds.lock().map_err(|_| HandlerError::failed("counting", "a lock was poisoned"))?;
        let mut seqs = self.seqs.lock().map_err(|_| HandlerError::failed("counting", "a lock was poisoned"))?;
        for e in batch {
            *kinds.entry(e.kind().as_str()).or_default() += 1;
            seqs.push(e.seq());
            // The decoded frame borrows from the event's bytes: no copy, no JSON.
            if let Message::Commit(c) = e.message() {
                for op in &c.ops {
                    *ops.entry(op.collection().to_owned()).or_default() += 1;
                }
            }
        }
        Ok(())
    }

    fn takes_snapshots(&self) -> bool {
        true
    }

    /// A repo fetched whole after its chain broke (fold semantics: it replaces what was
    /// known of the repo), a part at a time: counted as one `#resync` (the first part)
    /// and its `#record`s.
    async fn snapshot(&self, s: &Snapshot, _ctx: &BatchCtx) -> Result<(), HandlerError> {
        let mut kinds = self.kinds.lock().map_err(|_| HandlerError::failed("counting", "a lock was poisoned"))?;
        if s.is_first() {
            *kinds.entry("#resync").or_default() += 1;
        }
        *kinds.entry("#record").or_default() += s.records().len() as u64;
        Ok(())
    }
}

/// Builds a consumer of `relay` keeping its lease and cursors under `dir`; `start` is
/// where a relay without a stored cursor begins.
async fn build(
    relay: RelayUrl,
    dir: &Path,
    start: Option<u64>,
    counts: Arc<Counts>,
) -> Result<consumer::Consumer, Box<dyn std::error::Error>> {
    use checkpoint::{CursorStore as _, ReadOutcome};
    std::fs::create_dir_all(dir)?;
    let lock = dir.join("lease.lock");
    let lease = Arc::new(lease::LocalBackend::new(&lock));
    let cursors = checkpoint::FileStore::new(&dir.join("cursors"), &lock)?;
    if let Some(start) = start
        && matches!(cursors.read(relay.fingerprint()).await?, ReadOutcome::Missing)
    {
        cursors.force(relay.fingerprint(), start).await?;
    }
    // No cursor and no `START`: the live tail (this example's first start is a choice the
    // user made by running it; a service should say so in its settings: `Start::Refuse`).
    let options = consumer::Options {
        commit_interval: std::time::Duration::from_millis(200),
        start: consumer::Start::Live,
        ..Default::default()
    };
    Ok(Builder::new(relay)
        .lease(lease, lease::LeaseConfig::default())
        .store(cursors)
        .shared_handler(counts)
        .options(options)
        .build()?)
}

/// Logs the role whenever it changes, as an embedding service would expose it.
fn log_roles(status: &StatusHandle) {
    let mut rx = status.watch();
    tokio::spawn(async move {
        let mut last = None;
        while rx.changed().await.is_ok() {
            let role = rx.borrow().role;
            if last != Some(role) {
                eprintln!("role: {}", role.as_str());
                last = Some(role);
            }
        }
    });
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let relay = RelayUrl::parse(&args.next().unwrap_or_else(|| "wss://bsky.network".into()))?;
    let dir = args.next().unwrap_or_else(|| "count-data".into());
    let start = args.next().map(|s| s.parse::<u64>()).transpose()?;
    let counts = Arc::new(Counts::default());
    let consumer = build(relay, Path::new(&dir), start, counts.clone()).await?;
    log_roles(&consumer.status());
    consumer
        .run(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    for (collection, n) in counts.ops.lock().map_err(|_| "poisoned")?.iter() {
        println!("{n:>10}  {collection}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_sim::{RelaySim, SimConfig};

    /// The example, unchanged, against relay-sim replaying the fixture: every event
    /// reaches the handler exactly once, the ops are counted, the cursor is committed,
    /// and a restart on the same directory resumes after it (nothing is replayed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn counts_the_fixture_and_resumes_from_its_cursor() {
        let frames = testkit::fixture_frames();
        let total = frames.iter().filter(|f| relay_sim::frame_seq(f).is_some()).count();
        let sim = RelaySim::start_with(frames.clone(), SimConfig::default(), "127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("relay-sim");
        let relay = RelayUrl::parse(&sim.url()).expect("url");
        let dir = testkit::tmpdir("example");
        let counts = Arc::new(Counts::default());
        let consumer = build(relay.clone(), &dir, Some(0), counts.clone()).await.expect("build");
        let status = consumer.status();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(consumer.run(async {
            let _ = stopped.await;
        }));
        testkit::eventually("the whole fixture committed", testkit::WAIT, async || {
            status.snapshot().committed == Some(total as u64)
        })
        .await;
        let _ = stop.send(());
        run.await.expect("join").expect("a clean stop");

        let mut seqs = counts.seqs.lock().expect("seqs").clone();
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=total as u64).collect::<Vec<_>>(), "every event exactly once");
        let want: u64 = frames
            .iter()
            .filter_map(|f| match relay_client::decode(f) {
                Ok(relay_client::Frame::Message(Message::Commit(c))) => Some(c.ops.len() as u64),
                _ => None,
            })
            .sum();
        assert!(want > 0);
        assert_eq!(counts.ops.lock().expect("ops").values().sum::<u64>(), want, "every op counted");

        // Restarted on the same directory: it resumes after the committed cursor.
        let again = Arc::new(Counts::default());
        let consumer = build(relay, &dir, Some(0), again.clone()).await.expect("build");
        let status = consumer.status();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(consumer.run(async {
            let _ = stopped.await;
        }));
        testkit::eventually("the restarted example to lead", testkit::WAIT, async || status.snapshot().connected).await;
        let _ = stop.send(());
        run.await.expect("join").expect("a clean stop");
        assert!(again.seqs.lock().expect("seqs").is_empty(), "nothing replayed after a clean stop");
        assert_eq!(sim.handle().cursors().last(), Some(&Some(total as u64)), "resumed from the committed cursor");
    }
}
