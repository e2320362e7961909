//! What the subscription does with each WebSocket message: the connection's end, a pong,
//! or a frame placed by its seq under the frame policies.

use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{self, Message as WsMessage};
use yoke::Yoke;

use super::reader::Read;
use super::{Link, Subscription, describe};
use crate::config::{BadFramePolicy, FutureCursorPolicy};
use crate::error::{ConnError, DecodeError, SubscribeError};
use crate::frame::{self, Frame, Message, peek_seq};
use crate::item::{Item, Notice, OwnedFrame};

/// A Jetstream event against the cursor.
enum Placed {
    /// Not delivered yet.
    New,
    /// Delivered already at the cursor's stamp.
    Delivered,
    /// Behind the cursor (the last delivered stamp).
    Behind(u64),
}

impl Subscription {
    /// One WebSocket message: the connection's end, a pong, or a binary frame to decode.
    pub(super) fn on_message(&mut self, msg: Read) -> Result<Option<Item>, SubscribeError> {
        match msg {
            Read::Binary(bytes) if self.jet.is_some() => self.on_jet_binary(&bytes),
            Read::Text(text) if self.jet.is_some() => self.on_json(text),
            Read::Text(text) => self.bad_frame(None, DecodeError::TextMessage { len: text.len() }),
            Read::Binary(bytes) => self.on_binary(bytes),
            // The reader hands binaries over as `Binary`; kept whole for completeness.
            Read::Other(Some(Ok(WsMessage::Binary(b)))) => self.on_binary(Vec::from(b)),
            Read::Other(Some(Err(tungstenite::Error::Capacity(_)))) => self.oversized(),
            Read::Other(Some(Ok(WsMessage::Text(t)))) => {
                self.bad_frame(None, DecodeError::TextMessage { len: t.len() })
            }
            Read::Other(Some(Ok(WsMessage::Pong(_)))) => {
                if let Link::Up(c) = &mut self.link {
                    c.pong_due = None;
                }
                Ok(None)
            }
            Read::Other(None | Some(Ok(WsMessage::Close(_)))) => {
                self.fail(ConnError::ClosedByRelay);
                Ok(None)
            }
            Read::Other(Some(Err(e))) => {
                self.fail(ConnError::Io(describe(&e)));
                Ok(None)
            }
            Read::Other(Some(Ok(WsMessage::Ping(_) | WsMessage::Frame(_)))) => Ok(None),
        }
    }

    /// A binary message: a frame to decode and place.
    fn on_binary(&mut self, bytes: Vec<u8>) -> Result<Option<Item>, SubscribeError> {
        let max = self.cfg.max_frame_bytes;
        if bytes.len() > max {
            // Only reachable while reading with the raised limit.
            self.oversize_probe = false;
            return self.bad_frame(peek_seq(&bytes), DecodeError::TooLarge { size: bytes.len(), max });
        }
        // Decoded once: the event keeps this decoding beside its bytes.
        match Yoke::<Frame<'static>, Vec<u8>>::try_attach_to_cart(bytes, |b| {
            frame::decode(b).map_err(|e| (e, peek_seq(b)))
        }) {
            Ok(decoded) => self.on_frame(decoded),
            Err((error, seq)) => self.bad_frame(seq, error),
        }
    }

    /// A compressed Jetstream frame: decompressed with the wire's dictionary, then read
    /// as its JSON.
    fn on_jet_binary(&mut self, bytes: &[u8]) -> Result<Option<Item>, SubscribeError> {
        let max = self.cfg.max_frame_bytes;
        let Some(j) = self.jet.as_mut() else { return Ok(None) };
        let z = match &mut j.z {
            Some(z) => z,
            slot => match crate::jetstream::Decompressor::new(j.opts.version) {
                Ok(z) => slot.insert(z),
                Err(e) => return self.bad_jet_frame(None, e),
            },
        };
        match z.decompress(bytes, max) {
            Ok(text) => self.on_json(text),
            Err(e) => self.bad_jet_frame(None, e),
        }
    }

    /// A Jetstream frame's JSON: decoded once, then placed by its stamp.
    fn on_json(&mut self, text: Vec<u8>) -> Result<Option<Item>, SubscribeError> {
        let max = self.cfg.max_frame_bytes;
        if text.len() > max {
            return self.bad_jet_frame(None, DecodeError::TooLarge { size: text.len(), max });
        }
        let version = self.jet.as_ref().map(|j| j.opts.version).unwrap_or_default();
        match Yoke::<Frame<'static>, Vec<u8>>::try_attach_to_cart(text, |b| crate::jetstream::decode(version, b)) {
            Ok(decoded) => self.on_frame(decoded),
            Err(e) => {
                let stamp = match &e {
                    DecodeError::UnknownKind { stamp, .. } => *stamp,
                    _ => None,
                };
                self.bad_jet_frame(stamp, e)
            }
        }
    }

    /// A Jetstream frame that does not decode. Under `skip` it is counted and stepped
    /// over **without moving the cursor**: the next good event moves it, and a stamp
    /// read from a frame that is bad anyway is not believed (a forged one far ahead
    /// would have every later event dropped as going backwards). Under `fail` one with
    /// its stamp known goes through the policy as a firehose frame with a seq does;
    /// without, it may still have been an event, so the stream stops before it too.
    fn bad_jet_frame(&mut self, stamp: Option<u64>, error: DecodeError) -> Result<Option<Item>, SubscribeError> {
        let relay = self.active;
        if self.cfg.bad_frame == BadFramePolicy::Skip {
            self.stats.bad_frames += 1;
            tracing::error!(relay = relay.as_str(), stamp, reason = error.reason(), %error, "undecodable Jetstream frame skipped under the skip policy: this event is lost");
            return Ok(Some(Item::Notice(Notice::BadFrame { relay, seq: stamp, error })));
        }
        if stamp.is_some() {
            return self.bad_frame(stamp, error);
        }
        self.stats.bad_frames += 1;
        tracing::error!(relay = relay.as_str(), reason = error.reason(), %error, cursor = self.cursor, "undecodable Jetstream frame: stopping before it");
        self.link = Link::Stopped;
        Err(SubscribeError::BadJetstreamFrame { relay, after: self.cursor, error })
    }

    /// Where a Jetstream event stands against the cursor. Stamps repeat (the ops of one
    /// commit share one), so an event at the cursor's stamp is new unless its content
    /// was delivered at that stamp.
    fn place_jet(&mut self, seq: u64, key: u64) -> Placed {
        let last = self.cursor;
        let Some(j) = self.jet.as_mut() else { return Placed::New };
        match last {
            Some(l) if seq < l => return Placed::Behind(l),
            Some(l) if seq == l => {
                if j.boundary.contains(&key) {
                    self.stats.duplicates += 1;
                    return Placed::Delivered;
                }
            }
            _ => j.boundary.clear(),
        }
        j.boundary.push(key);
        Placed::New
    }

    /// A data frame proves the connection alive; one that has lasted `healthy_after`
    /// resets the backoff and the failure count.
    pub(super) fn saw_data(&mut self) {
        let Link::Up(c) = &mut self.link else { return };
        let now = Instant::now();
        c.last_data = now;
        c.pong_due = None;
        if !c.healthy && now.duration_since(c.since) >= self.cfg.healthy_after {
            c.healthy = true;
            self.backoff.reset();
            self.failures = 0;
        }
    }

    /// A message over the socket's frame limit. Reconnecting from the same cursor would
    /// meet it forever: stop before it, or (under `skip`) read it once with a raised
    /// limit to learn its seq.
    fn oversized(&mut self) -> Result<Option<Item>, SubscribeError> {
        let relay = self.active;
        self.stats.bad_frames += 1;
        let after = self.cursor;
        if self.cfg.bad_frame == BadFramePolicy::Fail || self.oversize_probe {
            let limit = self.read_limit();
            tracing::error!(relay = relay.as_str(), max = limit, cursor = after, "oversized frame: stopping before it");
            self.link = Link::Stopped;
            self.oversize_probe = false;
            return Err(SubscribeError::FrameTooLarge { relay, after, max: limit });
        }
        let max = self.cfg.max_frame_bytes;
        tracing::error!(
            relay = relay.as_str(),
            max,
            cursor = after,
            "oversized frame: reconnecting with a raised limit to learn its seq and skip it"
        );
        self.oversize_probe = true;
        self.link = Link::Down { retry_at: None };
        Ok(None)
    }

    /// A decoded frame: an error frame, an `#info`, or a message placed by its seq.
    fn on_frame(&mut self, decoded: Yoke<Frame<'static>, Vec<u8>>) -> Result<Option<Item>, SubscribeError> {
        let relay = self.active;
        let (seq, known) = match decoded.get() {
            Frame::Error(e) => return self.on_error_frame(e.error, e.message),
            Frame::Message(Message::Jet(e)) => {
                let (seq, key) = (e.stamp, e.content_key());
                match self.place_jet(seq, key) {
                    Placed::New => {}
                    Placed::Delivered => return Ok(None),
                    Placed::Behind(last) => return Ok(self.not_after(last, seq)),
                }
                self.cursor = Some(seq);
                self.stats.frames += 1;
                let Some(frame) = OwnedFrame::from_frame(decoded, seq, relay) else { return Ok(None) };
                let clamp = self.jet.as_mut().and_then(|j| j.clamp_from.take());
                if let Some(c) = clamp.filter(|&c| seq > c.saturating_add(crate::jetstream::CLAMP_SLACK_US))
                    && let Some(j) = self.jet.as_mut()
                {
                    j.held = Some((frame, c));
                    return Ok(None);
                }
                return Ok(Some(Item::Frame(frame)));
            }
            Frame::Message(Message::Info(i)) => {
                let message = i.message.map(str::to_owned);
                let asked_time = self.cursor.is_some_and(|c| c >= crate::jetstream::TIME_CURSOR_MIN);
                if i.name == "OutdatedCursor" && self.jet.is_some() && self.cfg.refuse_gaps && asked_time {
                    let cursor = self.cursor.unwrap_or_default();
                    tracing::error!(
                        relay = relay.as_str(),
                        cursor,
                        message = message.as_deref(),
                        "the Jetstream instance no longer serves the cursor"
                    );
                    self.link = Link::Stopped;
                    return Err(SubscribeError::Gap { relay, cursor, oldest: None });
                }
                let notice = if i.name == "OutdatedCursor" {
                    tracing::warn!(
                        relay = relay.as_str(),
                        cursor = self.cursor,
                        message = message.as_deref(),
                        "relay says the cursor is outdated: events were missed"
                    );
                    Notice::OutdatedCursor { relay, message }
                } else {
                    tracing::info!(relay = relay.as_str(), name = i.name, message = message.as_deref(), "relay info");
                    Notice::Info { relay, name: i.name.to_owned(), message }
                };
                return Ok(Some(Item::Notice(notice)));
            }
            Frame::Message(m) => (m.seq(), !matches!(m, Message::Unknown { .. })),
        };
        let Some(seq) = seq else {
            self.stats.unknown_types += 1;
            return Ok(None);
        };
        if let Some(last) = self.cursor.filter(|&l| seq <= l) {
            return Ok(self.not_after(last, seq));
        }
        self.cursor = Some(seq);
        if !known {
            self.stats.unknown_types += 1;
            tracing::debug!(relay = relay.as_str(), seq, "unknown message type skipped");
            return Ok(None);
        }
        self.stats.frames += 1;
        Ok(OwnedFrame::from_frame(decoded, seq, relay).map(Item::Frame))
    }

    /// A seq at or below the last delivered one: a duplicate, or the relay going
    /// backwards (reported once per connection). Either way the frame is dropped.
    fn not_after(&mut self, last: u64, seq: u64) -> Option<Item> {
        if seq == last {
            self.stats.duplicates += 1;
            return None;
        }
        self.stats.backwards += 1;
        let Link::Up(c) = &mut self.link else { return None };
        if c.warned_backwards {
            return None;
        }
        c.warned_backwards = true;
        let relay = self.active;
        tracing::warn!(
            relay = relay.as_str(),
            last,
            got = seq,
            "relay seq went backwards; dropping frames until it passes the last seq"
        );
        Some(Item::Notice(Notice::SeqBackwards { relay, last, got: seq }))
    }

    /// Applies the bad-frame policy. A frame at or below the last delivered seq is a
    /// replay of something already handled and is dropped quietly.
    fn bad_frame(&mut self, seq: Option<u64>, error: DecodeError) -> Result<Option<Item>, SubscribeError> {
        self.stats.bad_frames += 1;
        let relay = self.active;
        let Some(seq) = seq else {
            tracing::error!(relay = relay.as_str(), reason = error.reason(), %error, "frame without a readable seq skipped");
            return Ok(Some(Item::Notice(Notice::BadFrame { relay, seq: None, error })));
        };
        if self.cursor.is_some_and(|c| seq <= c) {
            return Ok(None);
        }
        match self.cfg.bad_frame {
            BadFramePolicy::Fail => {
                tracing::error!(relay = relay.as_str(), seq, reason = error.reason(), %error, cursor = self.cursor, "undecodable frame: stopping before it");
                self.link = Link::Stopped;
                Err(SubscribeError::BadFrame { relay, seq, error })
            }
            BadFramePolicy::Skip => {
                tracing::error!(relay = relay.as_str(), seq, reason = error.reason(), %error, "undecodable frame skipped under the skip policy: this event is lost");
                self.cursor = Some(seq);
                Ok(Some(Item::Notice(Notice::BadFrame { relay, seq: Some(seq), error })))
            }
        }
    }

    fn on_error_frame(&mut self, error: &str, message: Option<&str>) -> Result<Option<Item>, SubscribeError> {
        let relay = self.active;
        let message = message.unwrap_or_default().to_owned();
        if error == "FutureCursor" {
            let cursor = self.cursor;
            tracing::error!(relay = relay.as_str(), cursor, %message, "relay rejected the cursor as FutureCursor");
            match self.cfg.future_cursor {
                FutureCursorPolicy::Fail => {
                    self.link = Link::Stopped;
                    return Err(SubscribeError::FutureCursor { relay, cursor, message });
                }
                FutureCursorPolicy::GoLive => {
                    self.cursor = None;
                    self.link = Link::Down { retry_at: None };
                    return Ok(Some(Item::Notice(Notice::WentLive { relay, rejected: cursor })));
                }
            }
        }
        self.fail(ConnError::ErrorFrame { error: error.to_owned(), message });
        Ok(None)
    }
}
