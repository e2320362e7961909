//! Leader leases with fencing tokens, and the supervisor that holds one.
//!
//! A *term* is one continuous leadership: an instance id (random per process), a
//! fencing token strictly greater than every earlier one, a local epoch, and a local
//! deadline on a clock that counts suspend. The leader acts only while
//! `now < deadline`; every write it makes elsewhere carries the token, so a store that
//! checks it rejects a stale leader even if that leader does not yet know it is stale.
//!
//! # Layout
//! - [`config`]: timings and their validation.
//! - [`clock`]: the deadline clock seam (`CLOCK_BOOTTIME`, or tokio's for tests).
//! - [`backend`]: the store seam and its outcomes.
//! - [`redis_backend`]: Redis, every operation one Lua script, keys under one hash tag.
//! - [`local`]: one host, a lock file.
//! - [`metrics`]: every metric the lease emits, defined once.
//! - [`supervisor`]: the state machine, its events and its handle.
//!
//! Nothing here knows about relays or cursors.

pub mod backend;
pub mod clock;
pub mod config;
pub mod local;
pub mod metrics;
pub mod nats_backend;
pub mod redis_backend;
pub mod supervisor;

/// Implementors of [`Backend`] outside this crate use the same attribute.
pub use async_trait::async_trait;
pub use backend::{Acquire, Backend, BackendError, Cause, Renew, Report, Snapshot, While};
pub use clock::{BootClock, Clock, OffsetClock, TokioClock};
pub use config::{ConfigError, LeaseConfig};
pub use local::LocalBackend;
pub use nats_backend::NatsBackend;
pub use redis_backend::{Keys, RedisBackend};
pub use supervisor::{
    LeaseEvent, LeaseHandle, LossReason, Prior, Status, StepDownError, Term, spawn, spawn_as, spawn_with,
};
