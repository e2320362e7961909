//! One AT Protocol relay subscription, from URL to records.
//!
//! # Layout
//! - [`relay_url`]: ws/wss URLs, the relay fingerprint, credential redaction.
//! - [`cbor`]: a strict, borrowing DAG-CBOR reader (and a small canonical writer).
//! - [`cid`]: atproto CIDs and their string forms.
//! - [`car`]: a `CARv1` slice reader for commit `blocks`.
//! - [`frame`]: `subscribeRepos` frames decoded into borrowed structs.
//! - [`json`]: records and frames in the atproto JSON data model.
//! - [`capture`]: the capture file format (length-prefixed frames).
//! - [`config`] and [`item`]: what a subscription is configured with and what it yields.
//! - [`client`]: the WebSocket connection loop with reconnect, backoff, stall detection
//!   and primary/secondary failover.
//!
//! Nothing here knows about leases or checkpoints: the caller hands in a cursor and
//! gets frames back, in order, with duplicates dropped.

pub mod backoff;
pub mod capture;
pub mod car;
pub mod cbor;
pub mod cid;
pub mod client;
pub mod config;
pub mod error;
pub mod frame;
pub mod item;
pub mod json;
pub mod probe;
pub mod relay_url;

pub use client::Subscription;
pub use config::{BadFramePolicy, ClientConfig, FutureCursorPolicy, RelayRole};
pub use error::{CborError, CidError, ConnError, DecodeError, SubscribeError, UrlError};
pub use frame::{Frame, Kind, MAX_SEQ, Message, decode};
pub use item::{Item, Notice, OwnedFrame, Stats, SwitchReason};
pub use relay_url::RelayUrl;
