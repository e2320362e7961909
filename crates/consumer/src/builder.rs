//! Assembles a [`Consumer`]: relays, lease backend, cursor store and handler, checked
//! once before anything runs.

use std::sync::Arc;

use checkpoint::CursorStore;
use lease::{Backend, BootClock, Clock, LeaseConfig};
use relay_client::{ClientConfig, RelayUrl};

use crate::deployment::Deployment;
use crate::error::Error;
use crate::handler::Handler;
use crate::options::Options;
use crate::run::Consumer;
use crate::shadow::Shadow;
use crate::status::StatusHandle;

/// What a consumer was built with.
pub(crate) struct Settings {
    pub(crate) primary: RelayUrl,
    pub(crate) secondary: Option<RelayUrl>,
    pub(crate) client: ClientConfig,
    pub(crate) options: Options,
    /// The settings record this replica writes when it leads and compares before it
    /// contends (see [`crate::deployment`]).
    pub(crate) deployment: Deployment,
    /// Contend even when the record differs (a rolling change).
    pub(crate) allow_settings_change: bool,
}

/// Assembles a [`Consumer`]: relays, lease backend, cursor store and handler.
#[must_use]
pub struct Builder {
    primary: RelayUrl,
    secondary: Option<RelayUrl>,
    client: ClientConfig,
    options: Options,
    lease: Option<(Arc<dyn Backend>, LeaseConfig)>,
    store: Option<Arc<dyn CursorStore>>,
    handler: Option<Arc<dyn Handler>>,
    instance: Option<String>,
    clock: Arc<dyn Clock>,
    shadow: Option<Arc<dyn Shadow>>,
    jobs: Option<Arc<dyn checkpoint::JobQueue>>,
    deployment: Deployment,
    allow_settings_change: bool,
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
            shadow: None,
            jobs: None,
            deployment: Deployment::default(),
            allow_settings_change: false,
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
    pub fn lease(mut self, backend: Arc<dyn Backend>, cfg: LeaseConfig) -> Self {
        self.lease = Some((backend, cfg));
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

    /// Where this replica keeps the highest token and the cursors it saw (on its own
    /// disk), so that a store that lost its data neither reissues a token nor loses the
    /// position: see [`crate::shadow`]. Without one, only what this process saw counts.
    pub fn shadow(mut self, shadow: Option<Arc<dyn Shadow>>) -> Self {
        self.shadow = shadow;
        self
    }

    /// The deployment's shared repo-sync queue (Redis Streams, NATS `JetStream`): with a
    /// shared sink ([`Handler::is_shared`]) and `ResyncOptions::share`, the leader
    /// publishes each repo to fetch there and every replica's workers claim them
    /// ([`crate::shared`]). Without one, the leader fetches repos itself.
    pub fn jobs(mut self, queue: Option<Arc<dyn checkpoint::JobQueue>>) -> Self {
        self.jobs = queue;
        self
    }

    /// Settings of the caller's that change what downstream receives (the sink and its
    /// target, the key prefix), added to the consumer's own (relays, collections,
    /// verification) in the record compared between replicas.
    pub fn deployment(mut self, extra: Deployment) -> Self {
        self.deployment = extra;
        self
    }

    /// Contend for the lease even when this replica's settings differ from those the
    /// deployment's latest leader wrote (a deliberate, rolling change).
    pub fn allow_settings_change(mut self, allow: bool) -> Self {
        self.allow_settings_change = allow;
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
        let deployment = own_settings(&self.primary, self.secondary.as_ref(), &self.options, self.deployment);
        Ok(Consumer {
            settings: Settings {
                primary: self.primary,
                secondary: self.secondary,
                client: self.client,
                options: self.options,
                deployment,
                allow_settings_change: self.allow_settings_change,
            },
            lease,
            store,
            handler,
            instance,
            clock: self.clock,
            status: StatusHandle::default(),
            shadow: self.shadow,
            jobs: self.jobs,
        })
    }
}

/// The consumer's settings that change what downstream receives or where the cursor
/// lives, over `extra`: each relay by its cursor key (fingerprint) with its URL shown
/// without credentials, the collection filter, the verification mode.
fn own_settings(primary: &RelayUrl, secondary: Option<&RelayUrl>, options: &Options, extra: Deployment) -> Deployment {
    let relay = |r: &RelayUrl| format!("{} {}", r.fingerprint(), r.redacted());
    let collections = options.collections.as_ref().map_or_else(
        || "*".to_owned(),
        |c| {
            let mut e = c.entries().to_vec();
            e.sort();
            e.dedup();
            e.join(",")
        },
    );
    extra
        .with("relay.primary", relay(primary))
        .with("relay.secondary", secondary.map_or_else(|| "none".to_owned(), relay))
        .with("collections", collections)
        .with("verify", format!("{:?}", options.verify.mode).to_lowercase())
}
