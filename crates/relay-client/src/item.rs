//! What a subscription yields: event frames decoded once and owning their bytes,
//! notices, and requests to switch relays.

use std::fmt;
use std::time::Duration;

use yoke::Yoke;

use crate::config::RelayRole;
use crate::error::{ConnError, DecodeError};
use crate::frame::{self, Frame, Message};

/// A validated event frame that owns its bytes and keeps the message decoded from them:
/// the frame is decoded once, here, and every later step borrows that decoding.
pub struct OwnedFrame {
    /// The decoded message, borrowing from the frame's bytes (its cart).
    message: Yoke<Message<'static>, Vec<u8>>,
    /// Its sequence number.
    pub seq: u64,
    /// The relay it came from.
    pub relay: RelayRole,
}

impl OwnedFrame {
    /// Decodes `bytes` into an owned frame; `None` unless it is a message with a seq
    /// (error frames, `#info` and seq-less frames are not events).
    pub fn decode_event(bytes: Vec<u8>, relay: RelayRole) -> Result<Option<Self>, DecodeError> {
        let frame = Yoke::<Frame<'static>, Vec<u8>>::try_attach_to_cart(bytes, frame::decode)?;
        let seq = frame.get().seq();
        Ok(seq.and_then(|seq| Self::from_frame(frame, seq, relay)))
    }

    pub(crate) fn from_frame(frame: Yoke<Frame<'static>, Vec<u8>>, seq: u64, relay: RelayRole) -> Option<Self> {
        let message = frame.try_map_project(|f, _| f.into_message().ok_or(())).ok()?;
        Some(Self { message, seq, relay })
    }

    /// The decoded message.
    #[must_use]
    pub fn message(&self) -> &Message<'_> {
        self.message.get()
    }

    /// The WebSocket message, exactly as received.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        self.message.backing_cart()
    }
}

impl fmt::Debug for OwnedFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedFrame")
            .field("seq", &self.seq)
            .field("relay", &self.relay)
            .field("kind", &self.message().kind())
            .field("len", &self.bytes().len())
            .finish_non_exhaustive()
    }
}

/// Something the caller should know about; none of these needs an answer.
#[derive(Debug, Clone)]
pub enum Notice {
    /// A connection is up.
    Connected {
        /// Which relay.
        relay: RelayRole,
        /// The cursor it was opened with.
        cursor: Option<u64>,
    },
    /// A connection ended; the next one is tried after `retry_in`.
    Disconnected {
        /// Which relay.
        relay: RelayRole,
        /// Why.
        error: ConnError,
        /// Delay before the next attempt.
        retry_in: Duration,
    },
    /// A frame could not be decoded and was skipped. With `seq: None` it had no place in
    /// the sequence (garbage, text) and the cursor is unaffected; with a seq it was
    /// skipped under [`BadFramePolicy::Skip`] and the cursor moves past it (under
    /// [`BadFramePolicy::Fail`] the subscription stops instead and no notice is sent).
    BadFrame {
        /// Which relay.
        relay: RelayRole,
        /// Its seq, if the body got that far.
        seq: Option<u64>,
        /// What was wrong.
        error: DecodeError,
    },
    /// seq went backwards within a connection (relay reset or misbehaving). Frames at or
    /// below the last delivered seq are dropped.
    SeqBackwards {
        /// Which relay.
        relay: RelayRole,
        /// The last delivered seq.
        last: u64,
        /// The seq received.
        got: u64,
    },
    /// `#info OutdatedCursor`: the cursor is older than the relay's backfill window, so
    /// events between the cursor and the relay's oldest were missed.
    OutdatedCursor {
        /// Which relay.
        relay: RelayRole,
        /// The relay's message.
        message: Option<String>,
    },
    /// Some other `#info`.
    Info {
        /// Which relay.
        relay: RelayRole,
        /// Its name.
        name: String,
        /// Its message.
        message: Option<String>,
    },
    /// The relay went live after `FutureCursor` under [`FutureCursorPolicy::GoLive`].
    WentLive {
        /// Which relay.
        relay: RelayRole,
        /// The cursor that was rejected.
        rejected: Option<u64>,
    },
}

/// Why the subscription asks to switch relays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwitchReason {
    /// The current relay failed `failover_after` times in a row.
    Failover,
    /// The primary passed its health probes again.
    Failback,
}

/// One thing from the subscription.
#[derive(Debug)]
pub enum Item {
    /// The next event, seq strictly greater than every earlier one from this relay.
    Frame(OwnedFrame),
    /// Informational.
    Notice(Notice),
    /// Commit `from`'s cursor, then call [`Subscription::start`] with `to` and its cursor.
    SwitchRelay {
        /// The relay being left.
        from: RelayRole,
        /// The relay to go to.
        to: RelayRole,
        /// Why.
        reason: SwitchReason,
    },
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Frames delivered.
    pub frames: u64,
    /// Frames that failed to decode.
    pub bad_frames: u64,
    /// Frames with a seq equal to the last one, dropped.
    pub duplicates: u64,
    /// Frames with a seq below the last one, dropped.
    pub backwards: u64,
    /// Frames of unknown type, skipped.
    pub unknown_types: u64,
    /// Connections that ended.
    pub disconnects: u64,
    /// Relay switches requested.
    pub switches: u64,
}
