//! Relay cursors: where each relay's stream was processed up to, stored so that only the
//! current lease holder can move it, and only forward.
//!
//! # Layout
//! - [`store`]: the [`CursorStore`] seam every store implements.
//! - [`cursor`]: the stored form (a decimal string ≤ 2^53-1) and read outcomes.
//! - [`redis_store`]: one Lua script per commit that checks the lease token.
//! - [`file_store`]: the embedded default (temp file, fsync, rename, fsync dir), fenced by
//!   the local lease file.
//! - [`nats_store`]: NATS JetStream KV, fenced by token with compare-and-set per key.
//! - [`postgres_store`]: a table from `migrations/`, usable inside a caller's transaction.
//! - [`jobs`]: the shared repo-sync work queue ([`JobQueue`]), on Redis Streams
//!   ([`redis_jobs`]), NATS `JetStream` ([`nats_jobs`]) and Postgres ([`postgres_jobs`]).
//! - [`watermark`]: the highest seq at or below which every delivered event is done.
//!
//! Keys are scoped to a relay *fingerprint*, never a URL: every relay numbers its own
//! sequence, and URLs may carry credentials. Nothing here knows about `WebSockets`.

pub mod cursor;
pub mod file_store;
pub mod jobs;
pub mod nats_jobs;
pub mod nats_store;
pub mod postgres_jobs;
pub mod postgres_store;
pub mod redis_jobs;
pub mod redis_store;
pub mod store;
pub mod watermark;

pub use cursor::{CommitOutcome, MAX_SEQ, ReadOutcome, StoreError};
pub use file_store::FileStore;
pub use jobs::{Claim, JobCounts, JobQueue, JobSpec, JobState};
pub use nats_jobs::NatsJobs;
pub use nats_store::NatsStore;
pub use postgres_jobs::PostgresJobs;
pub use postgres_store::PostgresStore;
pub use redis_jobs::RedisJobs;
pub use redis_store::{RedisKeys, RedisStore};
pub use store::{CursorStore, Fence, OnCommit, RelayKey, RepoWrite, Write, WriteKind};
pub use watermark::Watermark;
