//! Why a consumer stopped.

use checkpoint::StoreError;
use checkpoint::watermark::WatermarkError;
use relay_client::{RelayRole, SubscribeError};

/// Why [`crate::Consumer::run`] returned an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The builder is missing a part or holds a bad value.
    #[error("consumer not configured: {0}")]
    Config(String),
    /// A part could not be built from its settings (the DID resolver, an HTTP client).
    #[error("consumer not configured: {what}: {}", causes::Report(.source.as_ref()))]
    Setup {
        /// Which part.
        what: &'static str,
        /// Why.
        #[source]
        source: causes::Cause,
    },
    /// The lease timings are invalid.
    #[error(transparent)]
    Lease(#[from] lease::ConfigError),
    /// A condition an operator must fix; the cursor stays before it.
    #[error(transparent)]
    Fatal(#[from] Fatal),
    /// A voluntary step-down did not end in a clean release.
    #[error("step-down was not clean: {0}")]
    StepDown(#[from] lease::StepDownError),
}

/// A condition that ends the term and the consumer: retrying cannot fix it.
#[derive(Debug, thiserror::Error)]
pub enum Fatal {
    /// The relay rejected the cursor as ahead of its stream.
    #[error(
        "{0}; under the `fail` future-cursor policy nothing is skipped (the `live` policy accepts the gap; or set the cursor)"
    )]
    FutureCursor(SubscribeError),
    /// A frame could not be decoded or is over the size limit (bad-frame policy `fail`).
    #[error(transparent)]
    BadFrame(SubscribeError),
    /// The Jetstream instance no longer serves the cursor and the gap policy refuses.
    #[error(transparent)]
    Gap(SubscribeError),
    /// The subscription ended although nobody closed it.
    #[error("relay subscription closed unexpectedly")]
    Closed,
    /// The store has no cursor and this process remembers none: a first start or a store
    /// that lost its data, which look alike; the start policy is to refuse.
    #[error(
        "no stored cursor for the {role} relay ({fingerprint}) and none remembered by this replica (lease token \
         {token}): either the deployment's very first start or a cursor store that lost its data (they look \
         alike). Refusing to guess where to start: say where (the start policy, or set the cursor), then restart"
    )]
    NoCursor {
        /// Which relay.
        role: RelayRole,
        /// Its fingerprint.
        fingerprint: String,
        /// This term's token.
        token: u64,
    },
    /// The stored cursor is not a cursor.
    #[error(
        "the stored cursor of the {role} relay, in {key}, is not a cursor ({value:?}): refusing to start rather than \
         guess where to resume{}. Set the cursor, then restart",
        .remembered.map(|c| format!(" (this process last saw {c} committed)")).unwrap_or_default()
    )]
    CursorCorrupt {
        /// Which relay.
        role: RelayRole,
        /// Where it is kept.
        key: String,
        /// A short, escaped preview of what is stored.
        value: String,
        /// The last commit this process saw for it, if any.
        remembered: Option<u64>,
    },
    /// Reading a cursor failed with something other than unavailability.
    #[error("reading the {role} cursor: {source}")]
    ReadCursor {
        /// Which relay.
        role: RelayRole,
        /// The store's error.
        source: StoreError,
    },
    /// A legacy cursor cannot be migrated without an operator's decision.
    #[error(transparent)]
    LegacyAmbiguous(StoreError),
    /// The store refused the new term.
    #[error("cursor store refused the new term: {0}")]
    Elected(StoreError),
    /// A fenced rewind failed.
    #[error("resetting the cursor to {cursor}: {source}")]
    Reset {
        /// The cursor it tried to set.
        cursor: u64,
        /// The store's error.
        source: StoreError,
    },
    /// An event failed verification under the `fail` policy: everything before it was
    /// committed, and the cursor stays before it.
    #[error(
        "seq {seq} of {} failed verification ({}: {}); the invalid-event policy is fail, so everything before it is \
         committed and the cursor stays before it",
        .invalid.repo, .invalid.reason, .invalid.detail
    )]
    Invalid {
        /// The event's seq.
        seq: u64,
        /// What failed.
        invalid: Box<crate::verify::Invalid>,
    },
    /// The sink cannot go on safely (a stream it cannot cut back after a write failed
    /// part-way): everything before the failed batch was committed.
    #[error("the sink cannot go on: {0}; everything before the failed batch is committed")]
    Sink(#[source] crate::handler::HandlerError),
    /// A bug: the watermark refused a delivery (skipping it would lose the event).
    #[error("internal: the watermark refused seq {seq}: {error}")]
    Watermark {
        /// The seq.
        seq: u64,
        /// Why.
        error: WatermarkError,
    },
}
