//! The simulated relay as a Jetstream instance: the capture's events as Jetstream JSON
//! (one event per record op, the ops of a commit sharing one stamp), on the v1 wire
//! (`/subscribe`) and the v2 wire (`/xrpc/network.bsky.jetstream.subscribeEvents`),
//! plain or zstd-compressed with the published dictionaries, with the instance's own
//! stamps ([`Clock`]), a window, server-side filters and the usual faults.
//!
//! Cursor rules, as Jetstream's: a time cursor replays every event stamped at or after
//! it; one older than the window starts at the window's oldest event, silently on v1 and
//! after an `#info OutdatedCursor` on v2; no cursor, or one past the newest event, is the
//! live tail.

use bytes::Bytes;
use relay_client::Message;
use relay_client::jetstream::{Compressor, TIME_CURSOR_MIN, Version, format_stamp};

/// One event of the instance.
#[derive(Debug, Clone)]
pub struct Row {
    /// Its stamp (`time_us`) on this instance.
    pub stamp: u64,
    /// The repo.
    pub did: String,
    /// The collection of a commit op.
    pub collection: Option<String>,
    /// `commit`, `identity`, `account` or `sync`.
    pub kind: &'static str,
    /// The v1 frame.
    pub v1: Bytes,
    /// The v2 frame (its `seq` is the row's index plus one).
    pub v2: Bytes,
    /// The frames compressed (v1, v2), made on first use: an instance compresses each
    /// event once for all its subscribers.
    zstd: [std::sync::OnceLock<Bytes>; 2],
}

/// How an instance stamps the events: the n-th upstream event at `base_us + n *
/// step_us + offset_us`, moved by up to `jitter_us` (seeded) but never out of order.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// The first event's stamp before the offset.
    pub base_us: u64,
    /// Between upstream events.
    pub step_us: u64,
    /// This instance's offset from another's (instances stamp when they see an event).
    pub offset_us: i64,
    /// Per-event jitter, less than half the step.
    pub jitter_us: u64,
    /// The jitter's seed.
    pub seed: u64,
}

impl Default for Clock {
    fn default() -> Self {
        Self { base_us: 1_765_000_000_000_000, step_us: 1_000, offset_us: 0, jitter_us: 0, seed: 1 }
    }
}

impl Clock {
    fn stamp(&self, n: u64) -> u64 {
        let mut x = self.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^= x >> 31;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let j = if self.jitter_us == 0 { 0 } else { x % self.jitter_us.min(self.step_us / 2).max(1) };
        let t = self.base_us + n * self.step_us + j;
        t.saturating_add_signed(self.offset_us)
    }
}

fn js(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

/// An upstream event as Jetstream carries it, before an instance stamps it.
struct Upstream {
    did: String,
    collection: Option<String>,
    kind: &'static str,
    /// v1: the commit object; identity/account/sync: the wrapped upstream event.
    body: String,
}

/// The capture's events as Jetstream events, grouped by upstream event.
fn upstream(frames: &[Bytes]) -> Vec<Vec<Upstream>> {
    let mut out = Vec::new();
    for f in frames {
        let Ok(relay_client::Frame::Message(m)) = relay_client::frame::decode(f) else { continue };
        let group = match &m {
            Message::Commit(c) => {
                let Ok(car) = c.car(false) else { continue };
                c.ops
                    .iter()
                    .map(|op| {
                        let mut body = format!(
                            "{{\"rev\":{},\"operation\":\"{}\",\"collection\":{},\"rkey\":{}",
                            js(c.rev),
                            op.action.as_str(),
                            js(op.collection()),
                            js(op.rkey())
                        );
                        if let Ok(Some(rec)) = op.record(&car) {
                            body.push_str(",\"record\":");
                            rec.write_json(&mut body);
                        }
                        if let Some(cid) = op.cid.filter(|_| op.action != relay_client::frame::Action::Delete) {
                            body.push_str(",\"cid\":");
                            body.push_str(&js(&cid.to_string()));
                        }
                        body.push('}');
                        Upstream {
                            did: c.repo.to_owned(),
                            collection: Some(op.collection().to_owned()),
                            kind: "commit",
                            body,
                        }
                    })
                    .collect()
            }
            Message::Identity(i) => {
                let handle = i.handle.map(|h| format!(",\"handle\":{}", js(h))).unwrap_or_default();
                let body = format!("{{\"did\":{}{handle},\"seq\":{},\"time\":{}}}", js(i.did), i.seq, js(i.time));
                vec![Upstream { did: i.did.to_owned(), collection: None, kind: "identity", body }]
            }
            Message::Account(a) => {
                let status = a.status.map(|s| format!(",\"status\":{}", js(s))).unwrap_or_default();
                let body = format!(
                    "{{\"active\":{},\"did\":{}{status},\"seq\":{},\"time\":{}}}",
                    a.active,
                    js(a.did),
                    a.seq,
                    js(a.time)
                );
                vec![Upstream { did: a.did.to_owned(), collection: None, kind: "account", body }]
            }
            Message::Sync(s) => {
                let body = format!(
                    "{{\"did\":{},\"rev\":{},\"seq\":{},\"time\":{}}}",
                    js(s.did),
                    js(s.rev),
                    s.seq,
                    js(s.time)
                );
                vec![Upstream { did: s.did.to_owned(), collection: None, kind: "sync", body }]
            }
            _ => continue,
        };
        if !group.is_empty() {
            out.push(group);
        }
    }
    out
}

/// The capture's events as one instance serves them, stamped by `clock`.
#[must_use]
pub fn rows(frames: &[Bytes], clock: &Clock) -> Vec<Row> {
    let mut rows = Vec::new();
    for (n, group) in upstream(frames).into_iter().enumerate() {
        let stamp = clock.stamp(n as u64);
        for u in group {
            let seq = rows.len() + 1;
            let v1 = if u.kind == "commit" || u.kind == "identity" || u.kind == "account" {
                format!(
                    "{{\"did\":{},\"time_us\":{stamp},\"kind\":\"{}\",\"{}\":{}}}",
                    js(&u.did),
                    u.kind,
                    u.kind,
                    u.body
                )
            } else {
                String::new()
            };
            let head = format!(
                "{{\"$type\":\"message\",\"payload\":{{\"$type\":\"network.bsky.jetstream.subscribeEvents#{}\",\"seq\":{seq},\"did\":{},\"time\":\"{}\"",
                u.kind,
                js(&u.did),
                format_stamp(stamp)
            );
            let v2 = if u.kind == "commit" {
                format!("{head},{}}}}}", &u.body[1..u.body.len() - 1])
            } else {
                format!("{head},\"{}\":{}}}}}", u.kind, u.body)
            };
            rows.push(Row {
                stamp,
                did: u.did,
                collection: u.collection,
                kind: u.kind,
                v1: Bytes::from(v1),
                v2: Bytes::from(v2),
                zstd: Default::default(),
            });
        }
    }
    rows
}

/// What one connection asked for.
#[derive(Default)]
pub(crate) struct Ask {
    /// Its compressor, made on the first frame.
    z: Option<Compressor>,
    pub(crate) version: Option<Version>,
    pub(crate) cursor: Option<u64>,
    pub(crate) collections: Vec<String>,
    pub(crate) dids: Vec<String>,
    pub(crate) compress: bool,
}

impl Ask {
    /// Reads the path and query of a Jetstream request (`None`: not a Jetstream path).
    pub(crate) fn parse(path: &str, query: Option<&str>) -> Option<Result<Self, String>> {
        let version = if path.ends_with(relay_client::jetstream::V1_PATH) {
            Version::V1
        } else if path.ends_with(relay_client::jetstream::V2_PATH) {
            Version::V2
        } else {
            return None;
        };
        let mut a = Self { version: Some(version), ..Self::default() };
        for pair in query.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = url_decode(v);
            match (version, k) {
                (_, "cursor") => match v.parse() {
                    Ok(c) => a.cursor = Some(c),
                    Err(_) => return Some(Err("cursor must be an integer".into())),
                },
                (Version::V1, "wantedCollections") | (Version::V2, "collections") => a.collections.push(v),
                (Version::V1, "wantedDids") | (Version::V2, "dids") => a.dids.push(v),
                (Version::V1, "compress") => a.compress = v == "true",
                (Version::V2, "zstdDictionary") => a.compress = true,
                _ => {}
            }
        }
        Some(Ok(a))
    }

    /// True when the connection's filters let `row` through (identity and account
    /// events pass the collection filter, as Jetstream's do).
    pub(crate) fn wants(&self, row: &Row) -> bool {
        let did_ok = self.dids.is_empty() || self.dids.contains(&row.did);
        let col_ok = match &row.collection {
            None => true,
            Some(c) => {
                self.collections.is_empty()
                    || self.collections.iter().any(|w| match w.strip_suffix(".*") {
                        Some(p) => c.strip_prefix(p).is_some_and(|r| r.starts_with('.')),
                        None => w == c,
                    })
            }
        };
        let on_wire = self.version == Some(Version::V2) || !row.v1.is_empty();
        did_ok && col_ok && on_wire
    }

    /// The frame of `row` for this connection, and whether it goes as binary.
    pub(crate) fn frame(&mut self, row: &Row) -> (Bytes, bool) {
        let version = self.version.unwrap_or_default();
        let (text, slot) = if version == Version::V1 { (&row.v1, &row.zstd[0]) } else { (&row.v2, &row.zstd[1]) };
        if !self.compress {
            return (text.clone(), false);
        }
        if let Some(z) = slot.get() {
            return (z.clone(), true);
        }
        if self.z.is_none() {
            self.z = Compressor::new(version).ok();
        }
        let z = self.z.as_mut().and_then(|z| z.compress(text).ok()).map_or_else(|| text.clone(), Bytes::from);
        (slot.get_or_init(|| z).clone(), true)
    }

    /// Where the connection starts among `rows[..head]` given the window's oldest stamp:
    /// the index, and whether the cursor was older than the window.
    pub(crate) fn start(&self, rows: &[Row], head: usize, window: u64) -> (usize, bool) {
        let visible = &rows[..head];
        let Some(c) = self.cursor else { return (head, false) };
        if c < TIME_CURSOR_MIN && self.version == Some(Version::V2) {
            // A v2 seq cursor (the simulator serves time cursors; seqs from 1).
            return (usize::try_from(c.saturating_sub(1)).unwrap_or(head).min(head), false);
        }
        if visible.last().is_some_and(|r| c > r.stamp) {
            return (head, false);
        }
        let from = visible.partition_point(|r| r.stamp < c.max(window));
        (from, c < window)
    }
}

fn url_decode(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok());
                if let Some(h) = h {
                    out.push(h);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The dictionary id a v2 request asks for when it is not `known`.
pub(crate) fn unknown_dictionary(path: &str, query: Option<&str>, known: u32) -> Option<u32> {
    if !path.ends_with(relay_client::jetstream::V2_PATH) {
        return None;
    }
    let id = query?.split('&').find_map(|p| p.strip_prefix("zstdDictionary="))?.parse().ok()?;
    (id != known).then_some(id)
}

/// The v2 `#info OutdatedCursor` frame.
#[must_use]
pub fn info_outdated() -> Bytes {
    Bytes::from_static(
        br#"{"$type":"message","payload":{"$type":"network.bsky.jetstream.subscribeEvents#info","name":"OutdatedCursor","message":"cursor below the retention floor: resumed at the oldest event"}}"#,
    )
}

/// A v2 error frame.
#[must_use]
pub fn error_frame(error: &str, message: &str) -> Bytes {
    Bytes::from(format!("{{\"$type\":\"error\",\"error\":{},\"message\":{}}}", js(error), js(message)))
}
