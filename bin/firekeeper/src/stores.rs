//! The lease backend, cursor store and sink the configuration chooses.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use checkpoint::{CursorStore, FileStore, NatsStore, PostgresStore, RedisKeys, RedisStore};
use consumer::Handler;
use lease::{Backend, LocalBackend, NatsBackend, RedisBackend};
use nats_op::Nats;

use crate::config::{Config, LeaseKind, SinkKind, StoreKind};

/// A NATS connection of its own (the lease's renewals never queue behind the sink's
/// publishes).
async fn nats(cfg: &Config) -> Result<Nats> {
    let n = cfg.nats.as_ref().context("NATS_URL")?;
    Nats::connect(n).await.context("NATS_URL")
}

/// Opens the lease backend for `cfg`.
pub async fn open_lease(cfg: &Config) -> Result<Arc<dyn Backend>> {
    Ok(match cfg.lease_backend {
        LeaseKind::Redis => {
            let url = cfg.redis_url.as_deref().context("REDIS_URL")?;
            Arc::new(RedisBackend::new(url, &cfg.lease.key_prefix, cfg.lease.op_timeout).context("REDIS_URL")?)
        }
        LeaseKind::Nats => Arc::new(NatsBackend::new(&nats(cfg).await?, &cfg.lease.key_prefix, cfg.lease.ttl)),
        LeaseKind::Local => {
            std::fs::create_dir_all(&cfg.data_dir)
                .with_context(|| format!("creating data directory {}", cfg.data_dir.display()))?;
            Arc::new(LocalBackend::new(&lease_file(cfg)))
        }
    })
}

/// The local lease's lock file.
#[must_use]
pub fn lease_file(cfg: &Config) -> PathBuf {
    cfg.data_dir.join("lease.lock")
}

/// This replica's shadow file: the highest token and the cursors it saw, per lease key
/// prefix (one data directory may serve replicas of several deployments).
#[must_use]
pub fn shadow_file(cfg: &Config) -> PathBuf {
    let prefix: String = cfg
        .lease
        .key_prefix
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .collect();
    cfg.data_dir.join(format!("shadow-{prefix}.json"))
}

/// What the Redis the lease or cursors live on keeps across a restart, as a sentence
/// (`Ok`: fine, `Err`: a risk to warn about); `None` when Redis holds neither.
pub async fn redis_persistence(cfg: &Config) -> Option<Result<String, String>> {
    let uses_redis = cfg.lease_backend == LeaseKind::Redis || cfg.store == StoreKind::Redis;
    let url = cfg.redis_url.as_deref().filter(|_| uses_redis)?;
    let advice = "the lease fence and the cursors should survive a restart: set `appendonly yes` with \
                  `appendfsync everysec` (or `always`) on it (docs/RELIABILITY.md, \"A store that loses its data\")";
    let conn = match redis_op::Conn::open(url, cfg.lease.op_timeout.max(std::time::Duration::from_secs(2))) {
        Ok(c) => c,
        Err(e) => return Some(Err(format!("cannot ask Redis how it persists ({e})"))),
    };
    Some(match conn.persistence().await {
        Ok(Some(p)) => match p.risk() {
            None => Ok(format!("Redis keeps an append-only file (appendfsync {})", p.fsync)),
            Some(risk) => Err(format!("Redis has {risk}; {advice}")),
        },
        Ok(None) => Err(format!("Redis does not say how it persists (CONFIG GET refused); {advice}")),
        Err(e) => Err(format!("cannot ask Redis how it persists ({e})")),
    })
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

/// Opens the shared repo-sync queue of `cfg`'s store, where it keeps one.
pub async fn open_jobs(cfg: &Config) -> Result<Option<Arc<dyn checkpoint::JobQueue>>> {
    let op = cfg.lease.op_timeout.max(std::time::Duration::from_secs(2));
    Ok(match cfg.store {
        StoreKind::Redis => {
            let url = cfg.redis_url.as_deref().context("REDIS_URL")?;
            let keys = RedisKeys::new(&cfg.lease.key_prefix, None);
            Some(Arc::new(checkpoint::RedisJobs::new(url, &keys, op)?))
        }
        StoreKind::Nats => {
            let idle = cfg.options.resync.claim_idle;
            Some(Arc::new(checkpoint::NatsJobs::new(&nats(cfg).await?, &cfg.lease.key_prefix, idle)))
        }
        StoreKind::Postgres => {
            let url = cfg.database_url.as_deref().context("DATABASE_URL")?;
            Some(Arc::new(checkpoint::PostgresJobs::connect(url, op).await?))
        }
        StoreKind::File => None,
    })
}

/// Opens the sink for `cfg`.
pub async fn open_sink(cfg: &Config) -> Result<Arc<dyn Handler>> {
    Ok(match &cfg.sink {
        SinkKind::Jsonl(path) if path == "-" => Arc::new(sinks::Jsonl::stdout()),
        SinkKind::Jsonl(path) => Arc::new(sinks::Jsonl::open(path).await.context("FIREKEEPER_JSONL_PATH")?),
        SinkKind::Postgres => {
            let pg = sinks::Postgres::connect(cfg.database_url.as_deref().context("DATABASE_URL")?).await?;
            Arc::new(pg.with_records(cfg.postgres_records))
        }
        SinkKind::Webhook { url, batch, timeout } => Arc::new(sinks::Webhook::new(url, *batch, *timeout)?),
        SinkKind::Nats(js) => {
            Arc::new(sinks::JetStream::open(&nats(cfg).await?, js.clone()).await.context("the nats sink's stream")?)
        }
        SinkKind::Null => Arc::new(sinks::Null),
    })
}
