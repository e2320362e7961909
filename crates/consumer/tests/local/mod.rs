//! A consumer on one machine for the integration tests: relay-sim serving the given
//! frames, the local lease, a file cursor seeded at 0, and a way to stop it.

use std::sync::Arc;

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
    stop: oneshot::Sender<()>,
    _sim: RelaySim,
}

impl Local {
    /// Starts `handler` with `options` over `frames`, from seq 0; `name` names its
    /// directory.
    pub async fn start(frames: Vec<bytes::Bytes>, handler: Arc<dyn Handler>, options: Options, name: &str) -> Self {
        let sim =
            RelaySim::start_with(frames, SimConfig::default(), "127.0.0.1:0".parse().expect("a")).await.expect("sim");
        let relay = RelayUrl::parse(&sim.url()).expect("url");
        let dir = testkit::tmpdir(name);
        let lock = dir.join("lease.lock");
        let store = checkpoint::FileStore::new(&dir.join("cursors"), &lock).expect("store");
        store.force(relay.fingerprint(), 0).await.expect("seed");
        let consumer = Builder::new(relay)
            .lease(Arc::new(lease::LocalBackend::new(&lock)), lease::LeaseConfig::default())
            .store(store)
            .shared_handler(handler)
            .options(options)
            .build()
            .expect("build");
        let status = consumer.status();
        let (stop, stopped) = oneshot::channel::<()>();
        let run = tokio::spawn(consumer.run(async {
            let _ = stopped.await;
        }));
        Self { status, run, stop, _sim: sim }
    }

    /// Asks it to stop and waits for a clean stop.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.run.await.expect("join").expect("clean stop");
    }
}
