//! What a subscription is configured with: the relay roles, the frame policies and the
//! connection settings, shared by the client, the probe and their callers.

use std::fmt;
use std::time::Duration;

use crate::backoff::BackoffConfig;

/// Which configured relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RelayRole {
    /// The preferred relay.
    Primary,
    /// The fallback relay.
    Secondary,
}

impl RelayRole {
    /// `primary` or `secondary`: how relays are named in logs and metrics.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Primary => "primary",
            Self::Secondary => "secondary",
        }
    }

    pub(crate) fn other(self) -> Self {
        match self {
            Self::Primary => Self::Secondary,
            Self::Secondary => Self::Primary,
        }
    }
}

impl fmt::Display for RelayRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do when a relay answers `FutureCursor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FutureCursorPolicy {
    /// Stop with [`SubscribeError::FutureCursor`]: an operator must look.
    #[default]
    Fail,
    /// Reconnect without a cursor (live tail), accepting that events may be missed.
    GoLive,
}

/// What to do with a frame that carries a seq but cannot be decoded (or is over the
/// frame limit). Frames without a readable seq (garbage, text) have no place in the
/// sequence and are always counted and skipped: they cannot move the cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BadFramePolicy {
    /// Stop with [`SubscribeError::BadFrame`] / [`SubscribeError::FrameTooLarge`]: the
    /// cursor stays before the frame until an operator decides.
    #[default]
    Fail,
    /// Count it ([`Notice::BadFrame`] with `skipped: true`) and move past it: the caller
    /// accepts that this one event is lost.
    Skip,
}

/// When skipping an oversized frame, the next connection reads with this limit (or four
/// times the configured one, if larger) only to learn the frame's seq.
pub const OVERSIZE_PROBE_BYTES: usize = 64 << 20;

/// What the subscription reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Input {
    /// `com.atproto.sync.subscribeRepos`: DAG-CBOR frames with seqs.
    #[default]
    Firehose,
    /// A Jetstream instance: JSON events placed by their stamp (`time_us`).
    Jetstream(crate::jetstream::Options),
}

/// Connection settings. The defaults suit the public Bluesky relays.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// TCP + TLS + WebSocket handshake budget.
    pub connect_timeout: Duration,
    /// How often to ping the relay.
    pub ping_interval: Duration,
    /// How long a ping may go unanswered.
    pub pong_timeout: Duration,
    /// Reconnect when no data frame arrived for this long (pongs do not count: a relay
    /// that answers pings but sends nothing is stuck).
    pub stall_timeout: Duration,
    /// Largest WebSocket message accepted (relays send up to 5 MB).
    pub max_frame_bytes: usize,
    /// Reconnect delays.
    pub backoff: BackoffConfig,
    /// A connection that has lasted this long and delivered a frame resets the backoff.
    pub healthy_after: Duration,
    /// Consecutive failed connections on one relay before switching to the other.
    pub failover_after: u32,
    /// While on the secondary, how often to probe the primary.
    pub probe_interval: Duration,
    /// Consecutive good probes before failing back to the primary.
    pub probe_successes: u32,
    /// How long a probe connection must stay open to count as good.
    pub probe_hold: Duration,
    /// What to do on `FutureCursor`.
    pub future_cursor: FutureCursorPolicy,
    /// What to do with an undecodable or oversized frame that has a seq.
    pub bad_frame: BadFramePolicy,
    /// Firehose or Jetstream.
    pub input: Input,
    /// Jetstream only: stop with [`SubscribeError::Gap`](crate::SubscribeError::Gap)
    /// when the instance no longer serves the cursor (else report it and go on).
    pub refuse_gaps: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(20),
            pong_timeout: Duration::from_secs(15),
            stall_timeout: Duration::from_mins(1),
            max_frame_bytes: 5 << 20,
            backoff: BackoffConfig::default(),
            healthy_after: Duration::from_secs(10),
            failover_after: 3,
            probe_interval: Duration::from_secs(30),
            probe_successes: 2,
            probe_hold: Duration::from_secs(1),
            future_cursor: FutureCursorPolicy::Fail,
            bad_frame: BadFramePolicy::Fail,
            input: Input::Firehose,
            refuse_gaps: true,
        }
    }
}
