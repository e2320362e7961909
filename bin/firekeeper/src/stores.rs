//! The lease backend and cursor store chosen by the configuration, behind one type each.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use checkpoint::{CommitOutcome, FileStore, PostgresStore, ReadOutcome, RedisKeys, RedisStore, StoreError};
use lease::{LocalBackend, RedisBackend, Term};

use crate::config::{Config, StoreKind};

/// The lease backend.
pub enum LeaseBackend {
    /// Redis (with `REDIS_URL`).
    Redis(Arc<RedisBackend>),
    /// A lock file (embedded).
    Local(Arc<LocalBackend>),
}

impl LeaseBackend {
    /// Builds the backend for `cfg`.
    pub fn new(cfg: &Config) -> Result<Self> {
        if let Some(url) = &cfg.redis_url {
            Ok(Self::Redis(Arc::new(
                RedisBackend::new(url, &cfg.lease.key_prefix, cfg.lease.op_timeout).context("REDIS_URL")?,
            )))
        } else {
            std::fs::create_dir_all(&cfg.data_dir)
                .with_context(|| format!("creating data directory {}", cfg.data_dir.display()))?;
            Ok(Self::Local(Arc::new(LocalBackend::new(&lease_file(cfg)))))
        }
    }
}

/// The local lease's lock file.
#[must_use]
pub fn lease_file(cfg: &Config) -> PathBuf {
    cfg.data_dir.join("lease.lock")
}

/// The cursor store.
pub enum Store {
    /// Redis.
    Redis(RedisStore),
    /// Files.
    File(FileStore),
    /// Postgres.
    Postgres(PostgresStore),
}

impl Store {
    /// Opens the store for `cfg`.
    pub async fn open(cfg: &Config) -> Result<Self> {
        Ok(match cfg.store {
            StoreKind::Redis => {
                let url = cfg.redis_url.as_deref().context("REDIS_URL")?;
                let keys = RedisKeys::new(&cfg.lease.key_prefix, cfg.legacy_cursor_prefix.as_deref());
                Self::Redis(RedisStore::new(url, keys, cfg.lease.op_timeout)?)
            }
            StoreKind::File => Self::File(FileStore::new(&cfg.data_dir.join("cursors"), &lease_file(cfg))?),
            StoreKind::Postgres => {
                let url = cfg.database_url.as_deref().context("DATABASE_URL")?;
                Self::Postgres(
                    PostgresStore::connect(url, cfg.lease.op_timeout.max(std::time::Duration::from_secs(2))).await?,
                )
            }
        })
    }

    /// Reads a relay's cursor.
    pub async fn read(&self, fp: &str) -> Result<ReadOutcome, StoreError> {
        match self {
            Self::Redis(s) => s.read(fp).await,
            Self::File(s) => s.read(fp).await,
            Self::Postgres(s) => s.read(fp).await,
        }
    }

    /// Fenced, monotonic commit. Redis and file stores fence on the term's whole lease
    /// value; Postgres, which cannot see the lease, on the highest token.
    pub async fn commit(&self, fp: &str, cursor: u64, term: &Term) -> Result<CommitOutcome, StoreError> {
        match self {
            Self::Redis(s) => s.commit(fp, cursor, &term.holder()).await,
            Self::File(s) => s.commit(fp, cursor, &term.holder()).await,
            Self::Postgres(s) => s.commit(fp, cursor, term.token()).await,
        }
    }

    /// Fenced rewind: may set a lower cursor (an accepted gap, or where a fresh
    /// deployment started).
    pub async fn reset(&self, fp: &str, cursor: u64, term: &Term) -> Result<CommitOutcome, StoreError> {
        match self {
            Self::Redis(s) => s.reset(fp, cursor, &term.holder()).await,
            Self::File(s) => s.reset(fp, cursor, &term.holder()).await,
            Self::Postgres(s) => s.reset(fp, cursor, term.token()).await,
        }
    }

    /// Operator override.
    pub async fn force(&self, fp: &str, cursor: u64) -> Result<(), StoreError> {
        match self {
            Self::Redis(s) => s.force(fp, cursor).await,
            Self::File(s) => s.force(fp, cursor).await,
            Self::Postgres(s) => s.force(fp, cursor).await,
        }
    }

    /// Called on election: migrates legacy cursors (Redis) or claims the fence (Postgres).
    pub async fn on_elected(&self, cfg: &Config, token: u64) -> Result<(), StoreError> {
        match self {
            Self::Redis(s) => {
                for relay in std::iter::once(&cfg.relay).chain(cfg.relay_secondary.as_ref()) {
                    s.migrate_legacy(relay.fingerprint(), &relay.host_port(), relay.is_root()).await?;
                }
                Ok(())
            }
            Self::File(_) => Ok(()),
            Self::Postgres(s) => match s.claim(token).await? {
                CommitOutcome::Fenced { current } => {
                    Err(StoreError::Protocol(format!("a newer term ({current:?}) already claimed the cursor table")))
                }
                _ => Ok(()),
            },
        }
    }
}
