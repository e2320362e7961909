//! The lease backend, cursor store and sink the configuration chooses.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use checkpoint::{CursorStore, FileStore, NatsStore, PostgresStore, RedisKeys, RedisStore};
use consumer::{Builder, Handler};
use lease::{LocalBackend, NatsBackend, RedisBackend, Snapshot};
use nats_op::Nats;

use crate::config::{Config, LeaseKind, SinkKind, StoreKind};

/// The lease backend (a generic trait, so one of three concrete types).
pub enum LeaseBackend {
    /// Redis (with `REDIS_URL`).
    Redis(Arc<RedisBackend>),
    /// NATS KV (with `NATS_URL`).
    Nats(Arc<NatsBackend>),
    /// A lock file (embedded).
    Local(Arc<LocalBackend>),
}

/// A NATS connection of its own (the lease's renewals never queue behind the sink's
/// publishes).
async fn nats(cfg: &Config) -> Result<Nats> {
    let n = cfg.nats.as_ref().context("NATS_URL")?;
    Nats::connect(n).await.context("NATS_URL")
}

impl LeaseBackend {
    /// Builds the backend for `cfg`.
    pub async fn new(cfg: &Config) -> Result<Self> {
        Ok(match cfg.lease_backend {
            LeaseKind::Redis => {
                let url = cfg.redis_url.as_deref().context("REDIS_URL")?;
                Self::Redis(Arc::new(
                    RedisBackend::new(url, &cfg.lease.key_prefix, cfg.lease.op_timeout).context("REDIS_URL")?,
                ))
            }
            LeaseKind::Nats => {
                Self::Nats(Arc::new(NatsBackend::new(&nats(cfg).await?, &cfg.lease.key_prefix, cfg.lease.ttl)))
            }
            LeaseKind::Local => {
                std::fs::create_dir_all(&cfg.data_dir)
                    .with_context(|| format!("creating data directory {}", cfg.data_dir.display()))?;
                Self::Local(Arc::new(LocalBackend::new(&lease_file(cfg))))
            }
        })
    }

    /// Hands the backend to the consumer.
    pub fn install(self, b: Builder, cfg: &Config) -> Builder {
        match self {
            Self::Redis(r) => b.lease(r, cfg.lease.clone()),
            Self::Nats(n) => b.lease(n, cfg.lease.clone()),
            Self::Local(l) => b.lease(l, cfg.lease.clone()),
        }
    }

    /// What the lease store holds (`lease show`).
    pub async fn snapshot(&self) -> Result<Snapshot> {
        use lease::Backend as _;
        Ok(match self {
            Self::Redis(b) => b.snapshot().await?,
            Self::Nats(b) => b.snapshot().await?,
            Self::Local(b) => b.snapshot().await?,
        })
    }
}

/// The local lease's lock file.
#[must_use]
pub fn lease_file(cfg: &Config) -> PathBuf {
    cfg.data_dir.join("lease.lock")
}

/// Opens the cursor store for `cfg`.
pub async fn open_store(cfg: &Config) -> Result<Arc<dyn CursorStore>> {
    Ok(match cfg.store {
        StoreKind::Redis => {
            let url = cfg.redis_url.as_deref().context("REDIS_URL")?;
            let keys = RedisKeys::new(&cfg.lease.key_prefix, cfg.legacy_cursor_prefix.as_deref());
            Arc::new(RedisStore::new(url, keys, cfg.lease.op_timeout)?)
        }
        StoreKind::Nats => Arc::new(NatsStore::new(&nats(cfg).await?, &cfg.lease.key_prefix)),
        StoreKind::File => Arc::new(FileStore::new(&cfg.data_dir.join("cursors"), &lease_file(cfg))?),
        StoreKind::Postgres => {
            let url = cfg.database_url.as_deref().context("DATABASE_URL")?;
            Arc::new(PostgresStore::connect(url, cfg.lease.op_timeout.max(std::time::Duration::from_secs(2))).await?)
        }
    })
}

/// Opens the sink for `cfg`.
pub async fn open_sink(cfg: &Config) -> Result<Arc<dyn Handler>> {
    Ok(match &cfg.sink {
        SinkKind::Jsonl(path) if path == "-" => Arc::new(sinks::Jsonl::stdout()),
        SinkKind::Jsonl(path) => Arc::new(sinks::Jsonl::open(path).await.context("FIREKEEPER_JSONL_PATH")?),
        SinkKind::Postgres => {
            Arc::new(sinks::Postgres::connect(cfg.database_url.as_deref().context("DATABASE_URL")?).await?)
        }
        SinkKind::Webhook { url, batch, timeout } => Arc::new(sinks::Webhook::new(url, *batch, *timeout)?),
        SinkKind::Nats(js) => {
            Arc::new(sinks::JetStream::open(&nats(cfg).await?, js.clone()).await.context("the nats sink's stream")?)
        }
        SinkKind::Null => Arc::new(sinks::Null),
    })
}
