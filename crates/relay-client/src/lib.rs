//! One AT Protocol relay subscription, from URL to records.
//!
//! # Layout
//! - [`relay_url`]: ws/wss URLs, the relay fingerprint, credential redaction.
//! - [`cbor`], [`cid`], [`car`], [`frame`], [`json`], [`capture`]: the data model, from
//!   the `atproto-data` crate (re-exported: a subscription yields its frames).
//! - [`config`] and [`item`]: what a subscription is configured with and what it yields.
//! - [`client`]: the WebSocket connection loop with reconnect, backoff, stall detection
//!   and primary/secondary failover.
//!
//! Nothing here knows about leases or checkpoints: the caller hands in a cursor and
//! gets frames back, in order, with duplicates dropped.

pub mod backoff;
pub mod client;
pub mod config;
pub mod error;
pub mod item;
pub mod jetstream;
pub mod probe;
pub mod relay_url;

pub use atproto_data::{capture, car, cbor, cid, frame, json};

pub use client::Subscription;
pub use config::{BadFramePolicy, ClientConfig, FutureCursorPolicy, Input, RelayRole};
pub use error::{CborError, CidError, ConnError, DecodeError, SubscribeError, UrlError};
pub use frame::{Frame, Kind, MAX_SEQ, Message, decode};
pub use item::{Item, Notice, OwnedFrame, Stats, SwitchReason};
pub use relay_url::RelayUrl;
