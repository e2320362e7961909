//! Repo sync: the half of "nothing lost" the firehose cannot carry. When a repo's copy is
//! wrong (a chain break, an invalid commit, a `#sync`, an account back) or missing (a
//! backfill), the repo is fetched whole with `com.atproto.sync.getRepo` and verified by
//! `atproto_repo::repo` before anything of it is delivered.
//!
//! This crate holds the fetch ([`fetch`]): bounded in time, size and transfer speed,
//! spilled to disk past a memory bound, with the host's rate-limit answers and the
//! repo's status (gone, taken down, …) as typed outcomes. Addresses come from DID
//! documents and redirects, so requests go through `guarded-http`. [`check`] puts the
//! steps together for one repo: its DID resolved to its PDS and key, the repo fetched
//! from there and verified whole.

pub mod blocks;
pub mod check;
pub mod fetch;
pub mod hosts;
pub mod list;
pub mod snapshot;
