//! A consumer on one machine for the integration tests: relay-sim serving the given
//! frames, the local lease, a file cursor seeded at 0, and a way to stop it.
// Each test crate that includes this uses part of it.
#![allow(dead_code)]

use std::sync::Arc;

use checkpoint::CursorStore as _;
use consumer::{Builder, Handler, Options, StatusHandle};
use relay_client::RelayUrl;
use relay_sim::{RelaySim, SimConfig};
use tokio::sync::oneshot;

/// A running consumer and the relay it reads.
pub struct Local {
    /// Its status (role, committed cursor…).
    pub status: StatusHandle,
    /// The consumer's task.
    pub run: tokio::task::JoinHandle<Result<(), consumer::Error>>,
    /// The relay's fingerprint (its cursor's key).
    pub fingerprint: String,
    stop: oneshot::Sender<()>,
    _sim: RelaySim,
}

impl Local {
    /// Starts `handler` with `options` over `frames`, from seq 0; `name` names its
    /// directory.
    pub async fn start(frames: Vec<bytes::Bytes>, handler: Arc<dyn Handler>, options: Options, name: &str) -> Self {
        Self::start_with_store(frames, handler, options, name, |s| Arc::new(s)).await
    }

    /// [`Local::start`] with these client settings (the bad-frame policy, say).
    pub async fn start_with_client(
        frames: Vec<bytes::Bytes>,
        handler: Arc<dyn Handler>,
        options: Options,
        name: &str,
        client: relay_client::ClientConfig,
    ) -> Self {
        Self::start_full(frames, handler, options, name, client, |s| Arc::new(s)).await
    }

    /// [`Local::start`] with the seeded file store handed to `store`, which returns the
    /// store the consumer uses (a wrapper around it, for faults).
    pub async fn start_with_store(
        frames: Vec<bytes::Bytes>,
        handler: Arc<dyn Handler>,
        options: Options,
        name: &str,
        store: impl FnOnce(checkpoint::FileStore) -> Arc<dyn checkpoint::CursorStore>,
    ) -> Self {
        Self::start_full(frames, handler, options, name, relay_client::ClientConfig::default(), store).await
    }

    async fn start_full(
        frames: Vec<bytes::Bytes>,
        handler: Arc<dyn Handler>,
        options: Options,
        name: &str,
        client: relay_client::ClientConfig,
        store: impl FnOnce(checkpoint::FileStore) -> Arc<dyn checkpoint::CursorStore>,
    ) -> Self {
        let sim =
            RelaySim::start_with(frames, SimConfig::default(), "127.0.0.1:0".parse().expect("a")).await.expect("sim");
        let relay = RelayUrl::parse(&sim.url()).expect("url");
        let dir = testkit::tmpdir(name);
        let lock = dir.join("lease.lock");
        let file = checkpoint::FileStore::new(&dir.join("cursors"), &lock).expect("store");
        file.force(relay.fingerprint(), 0).await.expect("seed");
        let fingerprint = relay.fingerprint().to_owned();
        let consumer = Builder::new(relay)
            .client(client)
            .lease(Arc::new(lease::LocalBackend::new(&lock)), lease::LeaseConfig::default())
            .shared_store(store(file))
            .shared_handler(handler)
            .options(options)
            .build()
            .expect("build");
        let status = consumer.status();
        let (stop, stopped) = oneshot::channel::<()>();
        let run = tokio::spawn(consumer.run(async {
            let _ = stopped.await;
        }));
        Self { status, run, stop, fingerprint, _sim: sim }
    }

    /// Asks it to stop and waits for a clean stop.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.run.await.expect("join").expect("clean stop");
    }
}
