//! The AT Protocol data model, with no network in it: what a relay client, a repo
//! fetcher, a verifier, a cursor store and a sink all read. Kept apart from the WebSocket
//! client (as indigo keeps `atproto/atdata` and rsky `rsky-common`), so that reading a CAR
//! never pulls in a connection.
//!
//! # Layout
//! - [`cbor`]: a strict, borrowing DAG-CBOR reader (and a small canonical writer).
//! - [`cid`]: atproto CIDs and their string forms.
//! - [`car`]: a `CARv1` slice reader (commit `blocks`, whole repos).
//! - [`frame`]: `subscribeRepos` frames decoded into borrowed structs, and [`MAX_SEQ`].
//! - [`jetstream`]: Jetstream's JSON events (v1 and v2) and its zstd dictionaries.
//! - [`json`]: records and frames in the atproto JSON data model.
//! - [`capture`]: the capture file format (length-prefixed frames), read by `relay-sim`.
//! - [`time`]: relay (RFC 3339) times as Unix milliseconds.
//! - [`hash`]: the FNV-1a hash that places a repo (lanes, partitions, event keys).
//! - [`error`]: what each of them refuses, typed.

pub mod capture;
pub mod car;
pub mod cbor;
pub mod cid;
pub mod error;
pub mod frame;
pub mod hash;
pub mod jetstream;
pub mod json;
pub mod tid;
pub mod time;

pub use error::{CborError, CidError, DecodeError};
pub use frame::{Frame, Kind, MAX_SEQ, Message, decode};
