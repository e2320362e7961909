//! The command line. Configuration comes from the environment (see README.md); the
//! command line only says what to do.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use relay_client::RelayRole;

/// An AT Protocol firehose consumer with leader election built in.
#[derive(Debug, Parser)]
#[command(name = "firekeeper", version, after_help = "Configuration comes from the environment; see README.md.")]
pub struct Cli {
    /// What to do (default: run).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Contend for the lease and consume while leading.
    Run,
    /// Validate the environment and print a summary without secrets.
    CheckConfig,
    /// Print the configuration table (the README's, generated from the definitions).
    Settings,
    /// Read or set a relay's stored cursor.
    Cursor {
        /// show or set.
        #[command(subcommand)]
        action: CursorAction,
    },
    /// Inspect the lease.
    Lease {
        /// show.
        #[command(subcommand)]
        action: LeaseAction,
    },
    /// Ask a running replica about repos (from its HTTP server).
    Repos {
        /// invalid.
        #[command(subcommand)]
        action: ReposAction,
    },
    /// Record frames from the primary relay into a file relay-sim can replay.
    Capture {
        /// The capture file to write.
        file: PathBuf,
        /// Start after this seq (default: the live tail).
        #[arg(long)]
        cursor: Option<u64>,
        /// Stop after this many frames.
        #[arg(long)]
        limit: Option<u64>,
        /// Stop after this many seconds.
        #[arg(long)]
        seconds: Option<u64>,
    },
}

/// `cursor` subcommands.
#[derive(Debug, Subcommand)]
pub enum CursorAction {
    /// The stored cursor of a relay.
    Show {
        /// Which relay.
        #[arg(long, value_enum, default_value_t = Relay::Primary)]
        relay: Relay,
    },
    /// Preseed or override a cursor (operator tool; unfenced). Refused while a leader
    /// holds the lease (it would overwrite the value within a second) unless --force.
    Set {
        /// The seq to resume after.
        seq: u64,
        /// Which relay.
        #[arg(long, value_enum, default_value_t = Relay::Primary)]
        relay: Relay,
        /// Write even while a leader holds the lease.
        #[arg(long)]
        force: bool,
    },
}

/// `repos` subcommands.
#[derive(Debug, Subcommand)]
pub enum ReposAction {
    /// Fetch a repo from its PDS (its DID resolved through `FIREKEEPER_PLC_URL`) and
    /// verify it whole: signature, every block, the tree, every record. Read-only.
    Check {
        /// The repo's DID.
        did: String,
    },
    /// The resync queue as the leader knows it (repos whose event was invalid or whose
    /// chain broke, with repo sync each one's state and failed attempts): one line each,
    /// oldest first.
    #[command(alias = "invalid")]
    List {
        /// Only repos in this state (repeatable).
        #[arg(long, value_enum)]
        state: Vec<QueueState>,
        /// The replica's HTTP address (default: `FIREKEEPER_HTTP_ADDR`, on loopback
        /// when it listens on all addresses).
        #[arg(long)]
        addr: Option<std::net::SocketAddr>,
    },
    /// One repo's place in the resync queue, or that it has none (synchronized).
    Show {
        /// The repo's DID.
        did: String,
        /// The replica's HTTP address (as for `list`).
        #[arg(long)]
        addr: Option<std::net::SocketAddr>,
    },
    /// Repo sync as a person watches it: on the leader the queue, the rates, the backfill
    /// and the ETA, the shared queue and each replica's rate (two reads of `/status`,
    /// `--every` seconds apart); on another replica its own jobs.
    Progress {
        /// The replica's HTTP address (as for `list`).
        #[arg(long)]
        addr: Option<std::net::SocketAddr>,
        /// Seconds between the two reads the replicas' rates come from.
        #[arg(long, default_value_t = 2)]
        every: u64,
    },
    /// Queue resyncs of these repos on the leader (`POST /repos/resync`, with the bearer
    /// token `FIREKEEPER_ADMIN_TOKEN`): each is fetched from its PDS, verified whole and
    /// handed to the sink as a snapshot. A `gone` or `failed` repo starts over.
    Resync {
        /// The repos' DIDs.
        #[arg(required = true)]
        dids: Vec<String>,
        /// The leader's HTTP address (as for `list`).
        #[arg(long)]
        addr: Option<std::net::SocketAddr>,
    },
}

/// A state of the resync queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QueueState {
    /// Queued.
    Desynchronized,
    /// A download in flight.
    Resyncing,
    /// The PDS says it is not there.
    Gone,
    /// Every attempt failed.
    Failed,
}

impl QueueState {
    /// The spelling `/repos/invalid` uses.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Desynchronized => "desynchronized",
            Self::Resyncing => "resyncing",
            Self::Gone => "gone",
            Self::Failed => "failed",
        }
    }
}

/// `lease` subcommands.
#[derive(Debug, Subcommand)]
pub enum LeaseAction {
    /// Holder, fence counter, highest token seen, remaining ttl.
    Show,
}

/// A configured relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Relay {
    /// `FIREKEEPER_RELAY`.
    Primary,
    /// `FIREKEEPER_RELAY_SECONDARY`.
    Secondary,
}

impl From<Relay> for RelayRole {
    fn from(r: Relay) -> Self {
        match r {
            Relay::Primary => Self::Primary,
            Relay::Secondary => Self::Secondary,
        }
    }
}
