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
//! - `builder`, `options` and `run` (private, re-exported): [`Builder`], [`Options`] and
//!   [`Consumer::run`] with its lead loop.
//! - `pipeline` and `term` (private): the lanes and watermark, and one term's work loop
//!   (a state machine with its diagram in `term/mod.rs`).
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

mod builder;
pub mod chain;
mod continuity;
pub mod deployment;
pub mod error;
pub mod handler;
pub mod metrics;
mod options;
mod pipeline;
pub mod progress;
pub mod resync;
mod run;
pub mod shadow;
pub mod shared;
pub mod status;
mod term;
pub mod verify;

pub use async_trait::async_trait;
/// Which configured relay an event came from (primary or secondary).
pub use relay_client::RelayRole;

pub use crate::builder::Builder;
pub use crate::chain::{ChainBreak, ChainBreaks};
pub use crate::continuity::GapPolicy;
pub use crate::deployment::Deployment;
pub use crate::error::{Error, Fatal};
pub use crate::handler::{BatchCtx, CollectionFilter, CursorHold, Event, Handler, HandlerError, Pending, Snapshot};
pub use crate::options::{Options, Start};
pub use crate::resync::ResyncOptions;
pub use crate::run::Consumer;
pub use crate::shadow::{Recollection, Shadow, ShadowError, ShadowFile};
pub use crate::status::{NotNow, Role, SinkFailing, Status, StatusHandle};
pub use crate::verify::{Invalid, InvalidPolicy, Reason, Requested, VerifyMode, VerifyOptions};
