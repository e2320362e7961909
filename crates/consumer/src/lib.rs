//! The firehose consumer as a library: one leader among replicas consumes a relay's
//! `subscribeRepos` stream, hands typed events to your [`Handler`] through per-repo
//! lanes, and commits the relay cursor, fenced by its lease token, only past batches the
//! handler accepted. Standbys take over when the leader stops, crashes, hangs or is cut
//! off; a voluntary stop drains, commits and releases.
//!
//! # Layout
//! - [`handler`]: [`Event`], [`BatchCtx`] and the [`Handler`] trait.
//! - [`status`]: the typed [`Role`] and the [`StatusHandle`] a running consumer updates.
//! - [`metrics`]: every metric the consumer emits, defined once.
//! - [`chain`]: the per-repo chain check (a commit's `since` against the repo's last rev).
//! - [`verify`]: signature, block, MST and chain verification in the lanes.
//! - [`error`]: why a consumer stopped.
//! - `pipeline` and `term` (private): the lanes and watermark, and one term's work loop.
//!
//! # Example
//!
//! A handler that counts commits, run against a relay with a lock-file lease and file
//! cursors (`examples/count_commits.rs` runs the same against relay-sim):
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//!
//! use consumer::{BatchCtx, Builder, Event, Handler, HandlerError, async_trait};
//! use relay_client::{Kind, RelayUrl};
//!
//! #[derive(Default)]
//! struct CountCommits(AtomicU64);
//!
//! #[async_trait]
//! impl Handler for CountCommits {
//!     async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
//!         let n = batch.iter().filter(|e| e.kind() == Kind::Commit).count();
//!         self.0.fetch_add(n as u64, Ordering::Relaxed);
//!         Ok(())
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new("my-data");
//! std::fs::create_dir_all(dir)?;
//! let lease = Arc::new(lease::LocalBackend::new(&dir.join("lease.lock")));
//! let cursors = checkpoint::FileStore::new(&dir.join("cursors"), &dir.join("lease.lock"))?;
//! let consumer = Builder::new(RelayUrl::parse("wss://bsky.network")?)
//!     .lease(lease, lease::LeaseConfig::default())
//!     .store(cursors)
//!     .handler(CountCommits::default())
//!     .build()?;
//! consumer.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(())
//! # }
//! ```

pub mod chain;
mod continuity;
pub mod error;
pub mod handler;
pub mod metrics;
mod pipeline;
pub mod status;
mod term;
pub mod verify;

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

pub use async_trait::async_trait;
use checkpoint::CursorStore;
use futures_util::future::BoxFuture;
use lease::{Backend, BackendError, BootClock, Clock, LeaseConfig, LeaseEvent, LeaseHandle};
use relay_client::{ClientConfig, RelayUrl};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

pub use crate::chain::{ChainBreak, ChainBreaks};
pub use crate::continuity::GapPolicy;
pub use crate::error::{Error, Fatal};
use crate::handler::Render;
pub use crate::handler::{BatchCtx, CollectionFilter, Event, Handler, HandlerError};
use crate::pipeline::Shape;
pub use crate::status::{Role, Status, StatusHandle};
use crate::term::{Ctx, Remembered, TermEnd};
pub use crate::verify::{Invalid, InvalidPolicy, Reason, VerifyMode, VerifyOptions};

/// Tuning of the work loop; the defaults suit a single relay on a small machine.
#[derive(Debug, Clone)]
pub struct Options {
    /// Processing lanes (events of one repo always share a lane).
    pub lanes: usize,
    /// Events queued per lane before the socket is pushed back on.
    pub queue_depth: usize,
    /// How often the watermark is committed.
    pub commit_interval: Duration,
    /// How long a voluntary step-down may drain before the lease is left to expire.
    pub drain_budget: Duration,
    /// Only commits touching these collections reach the handler; JSON keeps only
    /// matching ops. `None` keeps everything.
    pub collections: Option<CollectionFilter>,
    /// Check every CAR block's hash against its CID while rendering JSON.
    pub verify_blocks: bool,
    /// On a relay switch, resume this far (relay time) before the committed position
    /// and drop what was already handed over.
    pub switch_overlap: Duration,
    /// At most this many probes to find the start on the target relay.
    pub switch_max_probes: u32,
    /// How far relay (PDS) clocks may be trusted: event times are clamped to this
    /// process's clock plus it, and a target relay whose oldest events are older than
    /// the committed position less it has no gap (only a shorter overlap).
    pub switch_skew: Duration,
    /// What to do when the target relay's window does not reach back far enough.
    pub gap: GapPolicy,
    /// Check each repo's commit chain (`since` against the last rev) for this many recent
    /// repos; 0 turns the check off.
    pub chain_repos: usize,
    /// What a broken chain does besides being counted.
    pub chain_breaks: ChainBreaks,
    /// Verification of every commit against its repo's key (off by default).
    pub verify: VerifyOptions,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            lanes: 4,
            queue_depth: 1024,
            commit_interval: Duration::from_secs(1),
            drain_budget: Duration::from_secs(10),
            collections: None,
            verify_blocks: false,
            switch_overlap: Duration::from_secs(30),
            switch_max_probes: 40,
            switch_skew: Duration::from_secs(5),
            gap: GapPolicy::Fail,
            chain_repos: 1_000_000,
            chain_breaks: ChainBreaks::Count,
            verify: VerifyOptions::default(),
        }
    }
}

/// What a consumer was built with.
pub(crate) struct Settings {
    pub(crate) primary: RelayUrl,
    pub(crate) secondary: Option<RelayUrl>,
    pub(crate) client: ClientConfig,
    pub(crate) options: Options,
}

/// Starts a lease supervisor on some backend (the backend trait is generic, the
/// consumer is not).
trait LeaseFactory: Send + Sync {
    fn spawn(
        &self,
        clock: Arc<dyn Clock>,
        instance: &str,
    ) -> Result<(LeaseHandle, UnboundedReceiver<LeaseEvent>), lease::ConfigError>;
    fn seed_fence(&self, min: u64) -> BoxFuture<'_, Result<u64, BackendError>>;
}

struct LeaseParts<B> {
    backend: Arc<B>,
    cfg: LeaseConfig,
}

impl<B: Backend> LeaseFactory for LeaseParts<B> {
    fn spawn(
        &self,
        clock: Arc<dyn Clock>,
        instance: &str,
    ) -> Result<(LeaseHandle, UnboundedReceiver<LeaseEvent>), lease::ConfigError> {
        lease::spawn_as(self.backend.clone(), self.cfg.clone(), clock, instance)
    }

    fn seed_fence(&self, min: u64) -> BoxFuture<'_, Result<u64, BackendError>> {
        Box::pin(self.backend.seed_fence(min))
    }
}

/// Assembles a [`Consumer`]: relays, lease backend, cursor store and handler.
#[must_use]
pub struct Builder {
    primary: RelayUrl,
    secondary: Option<RelayUrl>,
    client: ClientConfig,
    options: Options,
    lease: Option<Box<dyn LeaseFactory>>,
    store: Option<Arc<dyn CursorStore>>,
    handler: Option<Arc<dyn Handler>>,
    instance: Option<String>,
    clock: Arc<dyn Clock>,
}

impl Builder {
    /// A consumer of `primary`, with default options and client settings.
    pub fn new(primary: RelayUrl) -> Self {
        Self {
            primary,
            secondary: None,
            client: ClientConfig::default(),
            options: Options::default(),
            lease: None,
            store: None,
            handler: None,
            instance: None,
            clock: Arc::new(BootClock),
        }
    }

    /// The relay to fail over to (it numbers its own seqs, and has its own cursor).
    pub fn secondary(mut self, relay: impl Into<Option<RelayUrl>>) -> Self {
        self.secondary = relay.into();
        self
    }

    /// Connection settings: timeouts, backoff, failover, frame policies.
    pub fn client(mut self, client: ClientConfig) -> Self {
        self.client = client;
        self
    }

    /// Work-loop tuning.
    pub fn options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }

    /// The lease backend and its timings (required).
    pub fn lease<B: Backend>(mut self, backend: Arc<B>, cfg: LeaseConfig) -> Self {
        self.lease = Some(Box::new(LeaseParts { backend, cfg }));
        self
    }

    /// Where cursors are kept (required).
    pub fn store(self, store: impl CursorStore) -> Self {
        self.shared_store(Arc::new(store))
    }

    /// [`Builder::store`] for a store chosen at run time.
    pub fn shared_store(mut self, store: Arc<dyn CursorStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Where events go (required).
    pub fn handler(self, handler: impl Handler) -> Self {
        self.shared_handler(Arc::new(handler))
    }

    /// [`Builder::handler`] for a handler chosen at run time or shared with the caller.
    pub fn shared_handler(mut self, handler: Arc<dyn Handler>) -> Self {
        self.handler = Some(handler);
        self
    }

    /// This process's instance id in the lease (a stable pod name); random by default.
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance = Some(id.into());
        self
    }

    /// The deadline clock (`CLOCK_BOOTTIME` by default, which counts suspend).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Checks the parts and returns a consumer ready to run.
    pub fn build(self) -> Result<Consumer, Error> {
        let missing = |what: &str| Error::Config(format!("no {what} given to the builder"));
        let lease = self.lease.ok_or_else(|| missing("lease backend"))?;
        let store = self.store.ok_or_else(|| missing("cursor store"))?;
        let handler = self.handler.ok_or_else(|| missing("handler"))?;
        if self.options.lanes == 0 || self.options.queue_depth == 0 {
            return Err(Error::Config("lanes and queue_depth must be at least 1".into()));
        }
        if self.secondary.as_ref().is_some_and(|s| s.fingerprint() == self.primary.fingerprint()) {
            return Err(Error::Config("the secondary relay is the same relay as the primary".into()));
        }
        let instance = self.instance.unwrap_or_else(|| format!("fk-{}", uuid::Uuid::new_v4().simple()));
        if instance.contains(':') || instance.is_empty() || instance.len() > 128 {
            return Err(Error::Config("the instance id must be 1 to 128 bytes without ':'".into()));
        }
        Ok(Consumer {
            settings: Settings {
                primary: self.primary,
                secondary: self.secondary,
                client: self.client,
                options: self.options,
            },
            lease,
            store,
            handler,
            instance,
            clock: self.clock,
            status: StatusHandle::default(),
        })
    }
}

/// A configured consumer; [`Consumer::run`] contends for the lease and leads when elected.
pub struct Consumer {
    settings: Settings,
    lease: Box<dyn LeaseFactory>,
    store: Arc<dyn CursorStore>,
    handler: Arc<dyn Handler>,
    instance: String,
    clock: Arc<dyn Clock>,
    status: StatusHandle,
}

impl Consumer {
    /// The status this consumer updates while it runs (for `/status`, readiness, logs).
    #[must_use]
    pub fn status(&self) -> StatusHandle {
        self.status.clone()
    }

    /// This process's instance id.
    #[must_use]
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Runs until `shutdown` completes (then drains, commits and releases the lease), a
    /// fatal condition, or the lease supervisor ending. Like mini-redis's `server::run`,
    /// the caller decides what shutdown means (a signal, a test's oneshot).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let Self { settings, lease, store, handler, instance, clock, status } = self;
        if let Some(seen) = store.fence_floor().await.map_err(|e| Error::SeedFence(e.to_string()))? {
            // Tokens must stay above what the cursor store has seen, even if the lease
            // store lost its counter.
            let fence = lease.seed_fence(seen).await.map_err(|e| Error::SeedFence(e.to_string()))?;
            tracing::info!(seen, fence, store = store.name(), "lease fence seeded from the cursor store");
        }
        let (handle, events) = lease.spawn(clock, &instance)?;
        status.update(|s| {
            s.role = Role::Standby;
            s.instance.clone_from(&instance);
        });
        status.set_ready();
        tracing::info!(instance = %instance, "contending for the lease");
        // Shadow every replica's committed cursors, so that if the store loses its data
        // this process, once leading, resumes where the last leader committed.
        let remembered: Arc<Remembered> = Arc::default();
        let follower = {
            let (store, m) = (store.clone(), remembered.clone());
            tokio::spawn(async move {
                store
                    .follow_commits(Box::new(move |fp, cursor, reset| {
                        if let Ok(mut m) = m.lock() {
                            let e = m.entry(fp.to_owned()).or_insert(cursor);
                            // A fenced rewind replaces; anything else only moves forward.
                            *e = if reset { cursor } else { (*e).max(cursor) };
                        }
                    }))
                    .await;
            })
        };
        let stop = CancellationToken::new();
        let render = handler.wants_json().then(|| {
            Arc::new(Render {
                verify_blocks: settings.options.verify_blocks,
                filter: settings.options.collections.clone(),
            })
        });
        let lanes = if handler.commits_cursor() { 1 } else { settings.options.lanes };
        let verifier = verify::Verifier::new(&settings.options.verify, lanes, status.desync())
            .map_err(|e| Error::Config(format!("verification: {e}")))?
            .map(Arc::new);
        let shape =
            Shape { lanes: settings.options.lanes, queue_depth: settings.options.queue_depth, render, verifier };
        let cx = Ctx {
            settings: &settings,
            shape,
            store: &*store,
            handler,
            lease: &handle,
            shutdown: &stop,
            status: &status,
            remembered: &remembered,
        };
        let r = {
            let mut lead = pin!(lead_loop(&cx, events));
            let mut shutdown = pin!(shutdown);
            tokio::select! {
                r = &mut lead => r,
                () = &mut shutdown => {
                    stop.cancel();
                    lead.await
                }
            }
        };
        drop(cx);
        follower.abort();
        status.update(|s| s.role = Role::Stopped);
        handle.join().await;
        r
    }
}

async fn lead_loop(cx: &Ctx<'_>, mut events: UnboundedReceiver<LeaseEvent>) -> Result<(), Error> {
    loop {
        let ev = tokio::select! {
            ev = events.recv() => ev,
            () = cx.shutdown.cancelled() => {
                cx.lease.shutdown().await;
                return Ok(());
            }
        };
        match ev {
            Some(LeaseEvent::Elected(term)) => {
                let token = term.token();
                let end = term::run_term(cx, term).await;
                ::metrics::gauge!(metrics::LEADER).set(0.0);
                cx.status.update(|s| {
                    s.role = Role::Standby;
                    s.token = None;
                    s.relay = None;
                    s.connected = false;
                });
                match end {
                    TermEnd::Lost => {
                        // If the work side ended the term (a store refused the token), the
                        // supervisor must stop renewing it too.
                        cx.lease.resign().await;
                        tracing::warn!(token, "term over; standing by");
                    }
                    TermEnd::Shutdown(Ok(())) => {
                        tracing::info!(token, "drained, committed and released");
                        return Ok(());
                    }
                    TermEnd::Shutdown(Err(e)) => return Err(Error::StepDown(e)),
                    TermEnd::Fatal(e) => {
                        cx.lease.shutdown().await;
                        return Err(Error::Fatal(e));
                    }
                }
            }
            Some(LeaseEvent::Lost { token, reason }) => {
                tracing::warn!(token, reason = reason.label(), "leadership lost");
            }
            Some(LeaseEvent::Released { token }) => tracing::info!(token, "lease released"),
            None => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    /// An embedding service spawns `run` on its runtime: the future must be `Send`.
    /// (An `AsyncFnMut` in the store retry loop once made it not, for every caller.)
    #[test]
    fn run_is_spawnable() {
        fn assert_send<T: Send>(_: &T) {}
        fn check(c: super::Consumer) {
            let fut = c.run(std::future::pending::<()>());
            assert_send(&fut);
        }
        let _ = check;
    }
}
