//! Tuning of the work loop, with the defaults the binary's settings start from.

use std::time::Duration;

use crate::chain::ChainBreaks;
use crate::continuity::GapPolicy;
use crate::handler::CollectionFilter;
use crate::resync::ResyncOptions;
use crate::verify::VerifyOptions;

/// Where a term starts when the store holds no cursor for its relay and no earlier term
/// is known anywhere (token 1, nothing remembered): a deployment's very first start, or a
/// store that lost its data and every replica's memory with it. The two look alike, so
/// nothing is guessed unless the operator said so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Start {
    /// Refuse to start and say what to run (the default).
    #[default]
    Refuse,
    /// The relay's live tail (meant for a deployment's very first start).
    Live,
    /// The oldest event the relay still has (cursor 0).
    Oldest,
}

/// Tuning of the work loop; the defaults suit a single relay on a small machine.
#[derive(Debug, Clone)]
pub struct Options {
    /// Processing lanes (events of one repo always share a lane).
    pub lanes: usize,
    /// Events queued per lane before the socket is pushed back on.
    pub queue_depth: usize,
    /// How often the watermark is committed.
    pub commit_interval: Duration,
    /// Where a term with no stored cursor and no earlier term starts.
    pub start: Start,
    /// How long a voluntary step-down may drain before the lease is left to expire.
    pub drain_budget: Duration,
    /// When no commit landed for this long while there was something to commit (the
    /// cursor store does not take commits), intake waits: what a crash can repeat stays
    /// bounded by what was handed over in this long.
    pub uncommitted_max: Duration,
    /// Only commits touching these collections reach the handler; JSON keeps only
    /// matching ops. `None` keeps everything.
    pub collections: Option<CollectionFilter>,
    /// Check every CAR block's hash against its CID while rendering JSON.
    pub verify_blocks: bool,
    /// On a relay switch, resume this far (relay time) before the committed position
    /// and drop what was already handed over.
    pub switch_overlap: Duration,
    /// At most this many probes to find the start on the target relay.
    pub switch_max_probes: u32,
    /// How far relay (PDS) clocks may be trusted: event times are clamped to this
    /// process's clock plus it, and a target relay whose oldest events are older than
    /// the committed position less it has no gap (only a shorter overlap).
    pub switch_skew: Duration,
    /// What to do when the target relay's window does not reach back far enough.
    pub gap: GapPolicy,
    /// Check each repo's commit chain (`since` against the last rev) for this many recent
    /// repos; 0 turns the check off.
    pub chain_repos: usize,
    /// What a broken chain does besides being counted.
    pub chain_breaks: ChainBreaks,
    /// Verification of every commit against its repo's key (off by default).
    pub verify: VerifyOptions,
    /// Repo sync: desynchronised repos fetched whole from their PDS.
    pub resync: ResyncOptions,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            lanes: 4,
            queue_depth: 1024,
            commit_interval: Duration::from_secs(1),
            start: Start::Refuse,
            drain_budget: Duration::from_secs(10),
            uncommitted_max: Duration::from_secs(10),
            collections: None,
            verify_blocks: false,
            switch_overlap: Duration::from_secs(30),
            switch_max_probes: 40,
            switch_skew: Duration::from_secs(5),
            gap: GapPolicy::Fail,
            chain_repos: 1_000_000,
            chain_breaks: ChainBreaks::Count,
            verify: VerifyOptions::default(),
            resync: ResyncOptions::default(),
        }
    }
}
