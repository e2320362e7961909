//! The NATS JetStream KV cursor store, beside the NATS lease (same state bucket,
//! `<prefix>-state`, entries never expire).
//!
//! Keys: `cursor.<fingerprint>` = `<cursor|-> <token> <time_ms|-> <0|1>` (the last field:
//! the write was a rewind), `active-relay` = `<fingerprint> <token>`, and `fence-seen`
//! = the highest token any term claimed (the lease issues tokens above it).
//!
//! **Fencing** is by token, with compare-and-set on each key's revision (KV has no
//! multi-key transactions): a new term first raises `fence-seen` and rewrites every
//! configured relay's cursor key with its token ([`CursorStore::on_elected`]); a commit
//! reads `fence-seen` and the cursor key, refuses a token below either (`Fenced`), refuses
//! a cursor not above the stored one (`NotNewer`), and writes only if the key is still at
//! the revision it read. A commit of an older term that raced the claim therefore either
//! landed before the claim rewrote the key (and the new term reads it) or fails its
//! compare-and-set and is refused on the retry.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use nats_op::async_nats::jetstream::kv::Operation;
use nats_op::{Bucket, Nats, NatsError, bucket_name};

use crate::cursor::{self, CommitOutcome, ReadOutcome, StoreError};
use crate::store::{Fence, OnCommit, RelayKey};

const FENCE_SEEN: &str = "fence-seen";
const ACTIVE: &str = "active-relay";
/// Attempts at a compare-and-set before reporting the store as contended.
const CAS_TRIES: usize = 8;

impl From<NatsError> for StoreError {
    fn from(e: NatsError) -> Self {
        Self::Unavailable(Box::new(e))
    }
}

/// A stored cursor value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stored {
    cursor: Option<u64>,
    token: u64,
    time_ms: Option<i64>,
    reset: bool,
}

impl Stored {
    fn encode(&self) -> Bytes {
        let c = self.cursor.map_or_else(|| "-".to_owned(), |c| c.to_string());
        let t = self.time_ms.map_or_else(|| "-".to_owned(), |t| t.to_string());
        Bytes::from(format!("{c} {} {t} {}", self.token, u8::from(self.reset)))
    }

    /// `Err(preview)` for anything this store did not write.
    fn decode(value: &[u8]) -> Result<Self, String> {
        let bad = || cursor::preview(value);
        let text = std::str::from_utf8(value).map_err(|_| bad())?;
        let mut fields = text.split(' ');
        let (c, t, time, reset) = (fields.next(), fields.next(), fields.next(), fields.next());
        if fields.next().is_some() {
            return Err(bad());
        }
        let cursor = match c.ok_or_else(bad)? {
            "-" => None,
            c => Some(c.parse::<u64>().ok().filter(|&c| c <= cursor::MAX_SEQ).ok_or_else(bad)?),
        };
        let token = t.ok_or_else(bad)?.parse().map_err(|_| bad())?;
        let time_ms = match time.ok_or_else(bad)? {
            "-" => None,
            t => Some(t.parse().map_err(|_| bad())?),
        };
        let reset = match reset.ok_or_else(bad)? {
            "0" => false,
            "1" => true,
            _ => return Err(bad()),
        };
        Ok(Self { cursor, token, time_ms, reset })
    }
}

/// Cursors in NATS KV.
#[derive(Debug)]
pub struct NatsStore {
    state: Bucket,
}

impl NatsStore {
    /// The store in the state bucket under `prefix` (the lease's key prefix).
    #[must_use]
    pub fn new(nats: &Nats, prefix: &str) -> Self {
        Self { state: Bucket::new(nats.clone(), bucket_name(prefix, "state"), Duration::ZERO) }
    }

    fn key(fingerprint: &str) -> String {
        format!("cursor.{fingerprint}")
    }

    /// The key of a repo's state: `repo.` and the DID with every character a KV key
    /// cannot hold written `=XX` (hex).
    pub(crate) fn repo_key(did: &str) -> String {
        use std::fmt::Write as _;
        let mut k = String::with_capacity(5 + did.len());
        k.push_str("repo.");
        for b in did.bytes() {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
                k.push(char::from(b));
            } else {
                let _ = write!(k, "={b:02X}");
            }
        }
        k
    }

    /// The DID of a repo key.
    pub(crate) fn repo_did(key: &str) -> Option<String> {
        let enc = key.strip_prefix("repo.")?.as_bytes();
        let mut out = Vec::with_capacity(enc.len());
        let mut i = 0;
        while i < enc.len() {
            if enc[i] == b'=' {
                out.push(u8::from_str_radix(std::str::from_utf8(enc.get(i + 1..i + 3)?).ok()?, 16).ok()?);
                i += 3;
            } else {
                out.push(enc[i]);
                i += 1;
            }
        }
        String::from_utf8(out).ok()
    }

    async fn entry(&self, key: String) -> Result<Option<(Bytes, u64)>, StoreError> {
        Ok(self.state.read(key).await?)
    }

    /// Compare-and-set on a key's revision: `false` when another writer got there first.
    async fn cas(&self, key: String, value: Bytes, rev: Option<u64>) -> Result<bool, StoreError> {
        Ok(self.state.cas(key, value, rev).await?.is_some())
    }

    async fn fence_seen(&self) -> Result<(u64, Option<u64>), StoreError> {
        match self.entry(FENCE_SEEN.to_owned()).await? {
            Some((v, rev)) => {
                let n = std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok()).ok_or_else(|| {
                    StoreError::Protocol(format!("fence-seen {} is not a number", cursor::preview(&v)))
                })?;
                Ok((n, Some(rev)))
            }
            None => Ok((0, None)),
        }
    }

    /// Raises `fence-seen` to `token`; `Some(current)` if a newer term already claimed.
    async fn raise_fence(&self, token: u64) -> Result<Option<u64>, StoreError> {
        for _ in 0..CAS_TRIES {
            let (seen, rev) = self.fence_seen().await?;
            if seen > token {
                return Ok(Some(seen));
            }
            if seen == token && rev.is_some() {
                return Ok(None);
            }
            if self.cas(FENCE_SEEN.to_owned(), Bytes::from(token.to_string()), rev).await? {
                return Ok(None);
            }
        }
        Err(StoreError::Unavailable("fence-seen kept changing while raising it".into()))
    }

    /// The one fenced cursor write ([`crate::CursorStore::write`]), running `between`
    /// once, after the checks and before the first compare-and-set: the seam where a
    /// newer term's claim can interleave, for tests of that race (`write` runs nothing
    /// there). A saved advance records the active relay.
    pub async fn write_with(
        &self,
        w: crate::Write<'_>,
        token: u64,
        between: impl std::future::Future<Output = ()>,
    ) -> Result<CommitOutcome, StoreError> {
        let crate::Write { fingerprint, cursor, time_ms, kind } = w;
        let reset = kind == crate::WriteKind::Rewind;
        cursor::check(cursor)?;
        let mut between = Some(between);
        let key = Self::key(fingerprint);
        for _ in 0..CAS_TRIES {
            let (seen, _) = self.fence_seen().await?;
            if token < seen {
                return Ok(CommitOutcome::Fenced { current: Some(seen) });
            }
            let current = self.entry(key.clone()).await?;
            let stored = current.as_ref().and_then(|(v, _)| Stored::decode(v).ok());
            if let Some(s) = stored {
                if token < s.token {
                    return Ok(CommitOutcome::Fenced { current: Some(s.token) });
                }
                if let Some(c) = s.cursor.filter(|&c| !reset && c >= cursor) {
                    return Ok(CommitOutcome::NotNewer { stored: c });
                }
            }
            if let Some(b) = between.take() {
                b.await;
            }
            let value = Stored { cursor: Some(cursor), token, time_ms, reset }.encode();
            if self.cas(key.clone(), value, current.map(|(_, r)| r)).await? {
                if !reset {
                    self.set_active(fingerprint, token).await?;
                }
                return Ok(CommitOutcome::Saved);
            }
        }
        Err(StoreError::Unavailable(format!("cursor of {fingerprint} kept changing while committing").into()))
    }

    /// Sets or clears a repo's state as `<token> <value>`: refused for a token below
    /// `fence-seen` or below the key's own; written at the revision read.
    async fn put_repo(&self, did: &str, value: Option<&str>, token: u64) -> Result<CommitOutcome, StoreError> {
        let key = Self::repo_key(did);
        for _ in 0..CAS_TRIES {
            let (seen, _) = self.fence_seen().await?;
            if token < seen {
                return Ok(CommitOutcome::Fenced { current: Some(seen) });
            }
            let current = self.entry(key.clone()).await?;
            let theirs = current.as_ref().and_then(|(v, _)| {
                std::str::from_utf8(v).ok()?.split_once(' ').and_then(|(t, _)| t.parse::<u64>().ok())
            });
            if let Some(t) = theirs.filter(|&t| t > token) {
                return Ok(CommitOutcome::Fenced { current: Some(t) });
            }
            let rev = current.as_ref().map(|(_, r)| *r);
            let body = match value {
                Some(v) => Bytes::from(format!("{token} {v}")),
                // A cleared state is a tombstone with the token (so an older term's CAS
                // at the revision it read still fails).
                None => Bytes::from(format!("{token} ")),
            };
            if current.is_none() && value.is_none() {
                return Ok(CommitOutcome::Saved);
            }
            if self.cas(key.clone(), body, rev).await? {
                return Ok(CommitOutcome::Saved);
            }
        }
        Err(StoreError::Unavailable(format!("the state of {did} kept changing while writing it").into()))
    }

    /// Records the relay the leader is on (after a saved commit), fenced the same way.
    async fn set_active(&self, fingerprint: &str, token: u64) -> Result<(), StoreError> {
        for _ in 0..CAS_TRIES {
            let current = self.entry(ACTIVE.to_owned()).await?;
            let theirs = current.as_ref().and_then(|(v, _)| {
                std::str::from_utf8(v).ok()?.split_once(' ').and_then(|(_, t)| t.parse::<u64>().ok())
            });
            if theirs.is_some_and(|t| t > token) {
                return Ok(());
            }
            let value = Bytes::from(format!("{fingerprint} {token}"));
            if self.cas(ACTIVE.to_owned(), value, current.map(|(_, r)| r)).await? {
                return Ok(());
            }
        }
        Err(StoreError::Unavailable("the active relay kept changing".into()))
    }

    /// Rewrites a relay's cursor key with `token` (cursor and time unchanged; `-` when
    /// none is stored), so no older term's compare-and-set on it can succeed any more.
    async fn claim_key(&self, fingerprint: &str, token: u64) -> Result<Option<u64>, StoreError> {
        let key = Self::key(fingerprint);
        for _ in 0..CAS_TRIES {
            let current = self.entry(key.clone()).await?;
            let stored = match &current {
                Some((v, _)) => Stored::decode(v).ok(),
                None => None,
            };
            let mut next = stored.unwrap_or(Stored { cursor: None, token, time_ms: None, reset: false });
            if next.token > token {
                return Ok(Some(next.token));
            }
            if current.is_some() && stored.is_some() && next.token == token {
                return Ok(None);
            }
            next.token = token;
            next.reset = false;
            if self.cas(key.clone(), next.encode(), current.map(|(_, r)| r)).await? {
                return Ok(None);
            }
        }
        Err(StoreError::Unavailable(format!("cursor of {fingerprint} kept changing while claiming it").into()))
    }
}

#[async_trait]
impl crate::CursorStore for NatsStore {
    fn name(&self) -> &'static str {
        "nats"
    }

    fn keeps_repos(&self) -> bool {
        true
    }

    async fn write_repo(&self, w: crate::RepoWrite<'_>, fence: Fence<'_>) -> Result<CommitOutcome, StoreError> {
        self.put_repo(w.did, w.value, fence.token).await
    }

    async fn repos(&self) -> Result<Vec<(String, String)>, StoreError> {
        let keys = self.state.keys_with("repo.").await?;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(did) = Self::repo_did(&key) else { continue };
            if let Some((v, _)) = self.entry(key).await? {
                let text = String::from_utf8_lossy(&v);
                if let Some((_, value)) = text.split_once(' ').filter(|(_, v)| !v.is_empty()) {
                    out.push((did, value.to_owned()));
                }
            }
        }
        Ok(out)
    }

    fn cursor_key(&self, fingerprint: &str) -> String {
        format!("key {} of the NATS KV bucket {}", Self::key(fingerprint), self.state.name())
    }

    async fn read(&self, fingerprint: &str) -> Result<ReadOutcome, StoreError> {
        match self.entry(Self::key(fingerprint)).await? {
            None => Ok(ReadOutcome::Missing),
            Some((v, _)) => match Stored::decode(&v) {
                Ok(Stored { cursor: Some(c), .. }) => Ok(ReadOutcome::Found(c)),
                Ok(Stored { cursor: None, .. }) => Ok(ReadOutcome::Missing),
                Err(preview) => Ok(ReadOutcome::Corrupt(preview)),
            },
        }
    }

    async fn write(&self, w: crate::Write<'_>, fence: Fence<'_>) -> Result<CommitOutcome, StoreError> {
        self.write_with(w, fence.token, async {}).await
    }

    async fn read_time(&self, fingerprint: &str) -> Result<Option<i64>, StoreError> {
        Ok(self.entry(Self::key(fingerprint)).await?.and_then(|(v, _)| Stored::decode(&v).ok()?.time_ms))
    }

    async fn active_relay(&self) -> Result<Option<String>, StoreError> {
        Ok(self
            .entry(ACTIVE.to_owned())
            .await?
            .and_then(|(v, _)| Some(std::str::from_utf8(&v).ok()?.split_once(' ')?.0.to_owned())))
    }

    async fn force(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        cursor::check(cursor)?;
        let key = Self::key(fingerprint);
        for _ in 0..CAS_TRIES {
            let current = self.entry(key.clone()).await?;
            let token = current.as_ref().and_then(|(v, _)| Stored::decode(v).ok()).map_or(0, |s| s.token);
            let value = Stored { cursor: Some(cursor), token, time_ms: None, reset: true }.encode();
            if self.cas(key.clone(), value, current.map(|(_, r)| r)).await? {
                return Ok(());
            }
        }
        Err(StoreError::Unavailable(format!("cursor of {fingerprint} kept changing while setting it").into()))
    }

    async fn on_elected(&self, fence: Fence<'_>, relays: &[RelayKey<'_>]) -> Result<(), StoreError> {
        if let Some(current) = self.raise_fence(fence.token).await? {
            return Err(StoreError::Protocol(format!("a newer term ({current}) already claimed the cursors")));
        }
        for r in relays {
            if let Some(current) = self.claim_key(r.fingerprint, fence.token).await? {
                return Err(StoreError::Protocol(format!(
                    "a newer term ({current}) already claimed the cursor of {}",
                    r.fingerprint
                )));
            }
        }
        Ok(())
    }

    async fn fence_floor(&self) -> Result<Option<u64>, StoreError> {
        Ok(Some(self.fence_seen().await?.0))
    }

    async fn follow_commits(&self, mut seen: OnCommit) {
        self.state
            .follow("cursor.>", |e| {
                let Some(fp) = e.key.strip_prefix("cursor.").filter(|_| e.operation == Operation::Put) else { return };
                if let Ok(Stored { cursor: Some(c), reset, .. }) = Stored::decode(&e.value) {
                    seen(fp, c, reset);
                }
            })
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_anything_else_is_corrupt() {
        for s in [
            Stored { cursor: Some(42), token: 3, time_ms: Some(1_764_000_000_000), reset: false },
            Stored { cursor: None, token: 9, time_ms: None, reset: true },
        ] {
            assert_eq!(Stored::decode(&s.encode()), Ok(s));
        }
        for bad in
            [&b""[..], b"42", b"42 3", b"42 3 - 2", b"x 3 - 0", b"42 3 - 0 extra", b"99999999999999999 1 - 0", b"\xff"]
        {
            assert!(Stored::decode(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
