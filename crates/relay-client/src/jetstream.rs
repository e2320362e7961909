//! Jetstream as the input: the subscription URL with its server-side filters, zstd
//! frames with the published dictionaries, and the check that tells a v1 instance's
//! silent clamp (a cursor older than its window starts at its oldest event) from a quiet
//! stream.
//!
//! A Jetstream event's position is its stamp (`time_us`): the ops of one commit share
//! one, so positions repeat. The subscription delivers every event of a stamp, drops
//! those it delivered already on a reconnect by their content, and a resume from a
//! stored cursor hands the events at exactly that stamp over again (at least once:
//! nothing at the stamp can be lost when only some of them were done).

use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::timeout;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use url::Url;

pub use atproto_data::jetstream::{DICT_V1, DICT_V2, DICT_V2_ID, TIME_CURSOR_MIN, Version, format_stamp, stamp_of};

use crate::error::DecodeError;
use crate::frame::{Frame, Message};
use crate::relay_url::RelayUrl;

/// Jetstream caps `wantedCollections` at this many.
pub const MAX_COLLECTIONS: usize = 100;
/// Jetstream caps `wantedDids` at this many.
pub const MAX_DIDS: usize = 10_000;
/// A v1 stream whose first event is this much after the cursor is checked for a clamp.
pub const CLAMP_SLACK_US: u64 = 1_000_000;

/// The v1 path.
pub const V1_PATH: &str = "/subscribe";
/// The v2 path.
pub const V2_PATH: &str = "/xrpc/network.bsky.jetstream.subscribeEvents";

/// What to ask a Jetstream instance for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Options {
    /// v1 or v2.
    pub version: Version,
    /// Collections (NSIDs or `prefix.*`) the server filters commits by; empty: all.
    pub collections: Vec<String>,
    /// Repos the server filters every event by; empty: all.
    pub dids: Vec<String>,
    /// zstd frames with the published dictionary.
    pub compress: bool,
}

impl Options {
    /// The URL to open on `base` from `cursor` (a stamp, or 0 for the oldest event). It
    /// carries the credentials of `base`, so it must never be logged.
    #[must_use]
    pub fn url(&self, base: &RelayUrl, cursor: Option<u64>) -> Url {
        let path = match self.version {
            Version::V1 => V1_PATH,
            Version::V2 => V2_PATH,
        };
        let mut u = base.url().clone();
        if !u.path().ends_with(path) {
            let p = format!("{}{}", u.path().trim_end_matches('/'), path);
            u.set_path(&p);
        }
        {
            let (cols, dids) = match self.version {
                Version::V1 => ("wantedCollections", "wantedDids"),
                Version::V2 => ("collections", "dids"),
            };
            let mut q = u.query_pairs_mut();
            for c in &self.collections {
                q.append_pair(cols, c);
            }
            for d in &self.dids {
                q.append_pair(dids, d);
            }
            // v2 reads a cursor below 1e15 as its own sequence number: the oldest event
            // is asked for by the earliest time instead.
            let cursor = match self.version {
                Version::V1 => cursor,
                Version::V2 => cursor.map(|c| c.max(TIME_CURSOR_MIN)),
            };
            if let Some(c) = cursor {
                q.append_pair("cursor", &c.to_string());
            }
            if self.compress {
                match self.version {
                    Version::V1 => q.append_pair("compress", "true"),
                    Version::V2 => q.append_pair("zstdDictionary", &DICT_V2_ID.to_string()),
                };
            }
        }
        u
    }
}

/// Decompresses zstd frames with the dictionary of one wire.
pub struct Decompressor {
    inner: zstd::bulk::Decompressor<'static>,
    out: Vec<u8>,
}

impl std::fmt::Debug for Decompressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decompressor").finish_non_exhaustive()
    }
}

impl Decompressor {
    /// A decompressor for `version`'s dictionary.
    pub fn new(version: Version) -> Result<Self, DecodeError> {
        let dict = match version {
            Version::V1 => DICT_V1,
            Version::V2 => DICT_V2,
        };
        let inner = zstd::bulk::Decompressor::with_dictionary(dict)
            .map_err(|e| DecodeError::Zstd { detail: format!("loading the dictionary: {e}") })?;
        Ok(Self { inner, out: Vec::new() })
    }

    /// The decompressed frame, at most `max` bytes.
    pub fn decompress(&mut self, frame: &[u8], max: usize) -> Result<Vec<u8>, DecodeError> {
        // The content size is in the frame header when the encoder wrote it; else the
        // limit bounds the buffer.
        let want = zstd::zstd_safe::get_frame_content_size(frame).ok().flatten();
        if let Some(n) = want
            && usize::try_from(n).map_or(true, |n| n > max)
        {
            return Err(DecodeError::TooLarge { size: usize::try_from(n).unwrap_or(usize::MAX), max });
        }
        let cap = want.and_then(|n| usize::try_from(n).ok()).unwrap_or(max);
        self.out.clear();
        self.out.reserve(cap);
        self.inner
            .decompress_to_buffer(frame, &mut self.out)
            .map_err(|e| DecodeError::Zstd { detail: e.to_string() })?;
        Ok(std::mem::take(&mut self.out))
    }
}

/// Compresses frames as an instance does: one zstd frame each, with the wire's
/// dictionary (for relay-sim and tests).
pub struct Compressor(zstd::bulk::Compressor<'static>);

impl Compressor {
    /// A compressor for `version`'s dictionary.
    pub fn new(version: Version) -> std::io::Result<Self> {
        let dict = match version {
            Version::V1 => DICT_V1,
            Version::V2 => DICT_V2,
        };
        let mut c = zstd::bulk::Compressor::with_dictionary(3, dict)?;
        c.include_contentsize(true)?;
        Ok(Self(c))
    }

    /// `text` as one zstd frame.
    pub fn compress(&mut self, text: &[u8]) -> std::io::Result<Vec<u8>> {
        self.0.compress(text)
    }
}

/// Decodes a frame's text (after decompression).
pub fn decode(version: Version, text: &[u8]) -> Result<Frame<'_>, DecodeError> {
    atproto_data::jetstream::decode(version, text)
}

/// What a connection opened from a cursor starts with: whether v2 said
/// `OutdatedCursor`, and the first event's stamp (`None`: nothing within the wait).
async fn first(url: &Url, opts: &Options, wait: Duration) -> Result<(bool, Option<u64>), String> {
    let connect = timeout(wait, tokio_tungstenite::connect_async(url.as_str())).await;
    let (mut ws, _) = match connect {
        Ok(Ok(ok)) => ok,
        Ok(Err(e)) => return Err(crate::client::describe(&e)),
        Err(_) => return Err(format!("connect timed out after {wait:?}")),
    };
    let mut z = if opts.compress { Decompressor::new(opts.version).ok() } else { None };
    let mut outdated = false;
    let read = async {
        while let Some(Ok(msg)) = ws.next().await {
            let text = match msg {
                WsMessage::Text(t) => t.as_bytes().to_vec(),
                WsMessage::Binary(b) => match z.as_mut().map(|z| z.decompress(&b, 64 << 20)) {
                    Some(Ok(t)) => t,
                    _ => b.to_vec(),
                },
                WsMessage::Close(_) => return None,
                _ => continue,
            };
            match decode(opts.version, &text) {
                Ok(Frame::Message(Message::Jet(e))) => return Some(e.stamp),
                Ok(Frame::Message(Message::Info(i))) if i.name == "OutdatedCursor" => outdated = true,
                _ => {}
            }
        }
        None
    };
    let got = timeout(wait, read).await.ok().flatten();
    let _ = timeout(Duration::from_secs(1), ws.close(None)).await;
    Ok((outdated, got))
}

/// The stamp of the oldest event `base` serves under `opts`' filters: a connection
/// from cursor 1, which every instance clamps to its oldest event. `None` when nothing
/// arrived within `wait`.
pub async fn oldest_stamp(base: &RelayUrl, opts: &Options, wait: Duration) -> Option<u64> {
    first(&opts.url(base, Some(1)), opts, wait).await.ok()?.1
}

/// Whether `base` still serves events from `cursor` (a stamp): `Ok(None)` when it does,
/// `Ok(Some(oldest))` with the stamp it starts at instead (v2 says `OutdatedCursor`; v1's
/// first event is its oldest and well after the cursor), `Err` when it cannot be asked.
/// A stream with nothing to send within `wait` is taken to serve the cursor (nothing can
/// be missing from it).
pub async fn serves_from(base: &RelayUrl, opts: &Options, cursor: u64, wait: Duration) -> Result<Option<u64>, String> {
    match first(&opts.url(base, Some(cursor)), opts, wait).await? {
        (_, None) => Ok(None),
        (true, Some(s)) => Ok(Some(s)),
        (false, Some(s)) if s <= cursor.saturating_add(CLAMP_SLACK_US) || opts.version == Version::V2 => Ok(None),
        (false, Some(s)) => match oldest_stamp(base, opts, wait).await {
            Some(o) if o >= s => Ok(Some(s)),
            _ => Ok(None),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_carries_the_filters_the_cursor_and_the_dictionary() {
        let base = RelayUrl::parse("wss://user:pw@js.example").expect("url");
        let v1 = Options {
            version: Version::V1,
            collections: vec!["app.bsky.feed.post".into(), "app.bsky.graph.*".into()],
            dids: vec!["did:plc:a".into()],
            compress: true,
        };
        let u = v1.url(&base, Some(1_725_911_162_329_308));
        assert_eq!(u.path(), "/subscribe");
        assert_eq!(
            u.query(),
            Some(
                "wantedCollections=app.bsky.feed.post&wantedCollections=app.bsky.graph.*&wantedDids=did%3Aplc%3Aa&\
                 cursor=1725911162329308&compress=true"
            )
        );
        let v2 = Options { version: Version::V2, ..v1 };
        let u = v2.url(&base, None);
        assert_eq!(u.path(), V2_PATH);
        assert!(u.query().is_some_and(|q| q.starts_with("collections=") && q.ends_with("zstdDictionary=20260811")));
    }

    #[test]
    fn a_compressed_frame_round_trips_and_garbage_is_a_typed_error() {
        for v in [Version::V1, Version::V2] {
            let text = br#"{"did":"did:plc:a","time_us":1,"kind":"identity","identity":{}}"#;
            let z = Compressor::new(v).and_then(|mut c| c.compress(text)).expect("compresses");
            let mut d = Decompressor::new(v).expect("dictionary");
            assert_eq!(d.decompress(&z, 1 << 20).expect("decompresses"), text);
            assert!(matches!(d.decompress(b"not zstd at all", 1 << 20), Err(DecodeError::Zstd { .. })));
            assert!(matches!(d.decompress(&z, 10), Err(DecodeError::TooLarge { .. })));
        }
    }
}
