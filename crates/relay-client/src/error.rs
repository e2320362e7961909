//! Typed errors for every way a relay connection or a URL can be wrong (the data's own
//! errors live in `atproto-data` and are re-exported here).

use std::time::Duration;

pub use atproto_data::error::{CborError, CidError, DecodeError};

/// A relay URL that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not a URL at all. The input is not echoed: it may hold credentials.
    #[error("relay URL does not parse: {0}")]
    Parse(url::ParseError),
    /// Only `ws` and `wss` are subscribed to.
    #[error("relay URL scheme `{0}` is not ws or wss")]
    Scheme(String),
    /// A URL without a host.
    #[error("relay URL has no host")]
    NoHost,
    /// A query or fragment would be clobbered by the cursor parameter.
    #[error("relay URL must not carry a query or fragment")]
    QueryOrFragment,
}

/// Why a subscription stopped for good (as opposed to reconnecting).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeError {
    /// The relay says our cursor is ahead of its sequence: it probably lost data or is a
    /// different relay. Going live silently would skip events, so the caller decides.
    #[error("{relay} relay rejected cursor {cursor:?} as FutureCursor: {message}")]
    FutureCursor {
        /// Which relay.
        relay: crate::RelayRole,
        /// The cursor sent.
        cursor: Option<u64>,
        /// The relay's message.
        message: String,
    },
    /// A frame carrying seq `seq` could not be decoded and the policy is
    /// [`BadFramePolicy::Fail`](crate::client::BadFramePolicy): the cursor must not move
    /// past an event nobody processed, so the subscription stops at the frame before it.
    #[error(
        "{relay} relay sent seq {seq} that cannot be decoded ({error}); under the `fail` bad-frame policy the \
         cursor stays before it (the `skip` policy steps over such frames; or move the cursor past seq {seq})"
    )]
    BadFrame {
        /// Which relay.
        relay: crate::RelayRole,
        /// The seq of the undecodable frame.
        seq: u64,
        /// What was wrong with it.
        error: DecodeError,
    },
    /// The frame after `after` is larger than the frame limit. Under the fail policy, or
    /// when even the raised limit could not read its seq, the subscription stops there.
    #[error(
        "{relay} relay sent a frame after seq {after:?} larger than the {max}-byte frame limit; the cursor stays \
         before it (raise the limit, or use the `skip` bad-frame policy)"
    )]
    FrameTooLarge {
        /// Which relay.
        relay: crate::RelayRole,
        /// The last seq delivered before it.
        after: Option<u64>,
        /// The limit it exceeded.
        max: usize,
    },
    /// A Jetstream frame that could not be decoded, under the `fail` policy: every
    /// Jetstream frame may be an event, so the subscription stops before it.
    #[error(
        "{relay} Jetstream instance sent a frame after position {after:?} that cannot be decoded ({error}); under \
         the `fail` bad-frame policy the cursor stays before it (the `skip` policy steps over such frames)"
    )]
    BadJetstreamFrame {
        /// Which instance.
        relay: crate::RelayRole,
        /// The last position delivered before it.
        after: Option<u64>,
        /// What was wrong with it.
        error: DecodeError,
    },
    /// The Jetstream instance no longer serves events from the cursor (it said so, or
    /// v1 silently started at its oldest event), and the gap policy refuses gaps.
    #[error(
        "{relay} Jetstream instance no longer serves events from cursor {cursor} (time_us; its oldest is {oldest:?}): \
         events in between would be lost; set FIREKEEPER_GAP=live to accept the gap, or choose the start with \
         `firekeeper cursor set`"
    )]
    Gap {
        /// Which instance.
        relay: crate::RelayRole,
        /// The cursor asked for.
        cursor: u64,
        /// The stamp it started at instead, when known.
        oldest: Option<u64>,
    },
    /// The subscription was closed by the caller.
    #[error("subscription closed")]
    Closed,
}

/// Why one connection ended; the client reconnects after each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnError {
    /// TCP/TLS/WebSocket handshake did not finish in time.
    #[error("connect timed out after {0:?}")]
    ConnectTimeout(Duration),
    /// The handshake failed. A description, not the WebSocket client's error: that one
    /// can echo the relay URL, which may carry credentials.
    #[error("connect failed: {0}")]
    Connect(String),
    /// No data frame arrived for the stall timeout.
    #[error("no frame for {0:?}")]
    Stalled(Duration),
    /// A ping went unanswered.
    #[error("no pong within {0:?}")]
    PongTimeout(Duration),
    /// The relay closed the connection.
    #[error("relay closed the connection")]
    ClosedByRelay,
    /// A read or write failed (a description, for the reason given at `Connect`).
    #[error("websocket error: {0}")]
    Io(String),
    /// A message exceeded the maximum frame size; the socket is unusable after that.
    #[error("message over the {0}-byte frame limit")]
    TooLarge(usize),
    /// The relay sent an error frame that means "reconnect" (e.g. `ConsumerTooSlow`).
    #[error("relay error frame {error}: {message}")]
    ErrorFrame {
        /// The error name.
        error: String,
        /// The message.
        message: String,
    },
}

impl ConnError {
    /// A short stable label for metrics (`reason` label).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ConnectTimeout(_) => "connect_timeout",
            Self::Connect(_) => "connect_failed",
            Self::Stalled(_) => "stalled",
            Self::PongTimeout(_) => "pong_timeout",
            Self::ClosedByRelay => "closed_by_relay",
            Self::Io(_) => "io",
            Self::TooLarge(_) => "too_large",
            Self::ErrorFrame { error, .. } if error == "ConsumerTooSlow" => "consumer_too_slow",
            Self::ErrorFrame { .. } => "error_frame",
        }
    }
}
