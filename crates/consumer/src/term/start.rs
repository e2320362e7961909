//! The start of a term: announce the election to the store, find the relay and the
//! position the last leader left, and subscribe.

use std::sync::Arc;

use checkpoint::{Fence, ReadOutcome, RelayKey, StoreError};
use lease::Term;
use relay_client::{RelayRole, Subscription};

use super::{Ctx, Leader, Phase, Rewind, Stop, TermEnd, guarded, while_active};
use crate::builder::Settings;
use crate::continuity::Memory;
use crate::error::Fatal;
use crate::metrics as m;
use crate::options::Start;
use crate::pipeline::Pipeline;
use crate::status::Role;

/// Where `role`'s stream resumes. `at_term_start` applies the rule that a missing cursor
/// is only a fresh start when no earlier term existed.
pub(super) async fn resume_point(
    cx: &Ctx<'_>,
    term: &Term,
    role: RelayRole,
    at_term_start: bool,
) -> Result<Option<u64>, Stop> {
    let fp = cx.url(role).fingerprint();
    let r = while_active(cx, term, "read cursor", || cx.store.read(fp)).await?;
    let r = r.map_err(|source| Fatal::ReadCursor { role, source })?;
    let remembered = cx.remembered.lock().ok().and_then(|m| m.get(fp).copied());
    match (r, remembered) {
        (ReadOutcome::Found(c), _) => {
            tracing::info!(relay = role.as_str(), cursor = c, "resuming from stored cursor");
            Ok(Some(c))
        }
        // Something that is not a cursor is never "missing": where it should resume is
        // unknown, and guessing would skip or replay. An operator sets it.
        (ReadOutcome::Corrupt(value), remembered) if at_term_start => {
            Err(Fatal::CursorCorrupt { role, key: cx.store.cursor_key(fp), value, remembered }.into())
        }
        // On a switch the target's stored cursor is only a shortcut: the search places it.
        (ReadOutcome::Corrupt(value), _) => {
            tracing::error!(relay = role.as_str(), key = %cx.store.cursor_key(fp), %value, "stored cursor is not a cursor: finding the start by content instead");
            Ok(None)
        }
        // A lower stored value may be an operator's rewind and is honoured; a missing one
        // after this process saw a commit means the store lost data.
        (ReadOutcome::Missing, Some(mine)) => {
            tracing::error!(
                relay = role.as_str(),
                committed_here = mine,
                "the store lost this relay's cursor; resuming from the last commit this process saw"
            );
            Ok(Some(mine))
        }
        // Nothing stored, nothing remembered: a first start, or a store that lost its
        // data (with every replica's memory), which look alike; the token cannot tell them
        // apart either (a store that lost its counter issues 1 again, a refused start
        // used one up). Only the operator's start policy decides.
        (ReadOutcome::Missing, None) if at_term_start => match cx.settings.options.start {
            Start::Refuse => Err(Fatal::NoCursor { role, fingerprint: fp.to_owned(), token: term.token() }.into()),
            Start::Live => {
                tracing::warn!(
                    relay = role.as_str(),
                    token = term.token(),
                    "no stored cursor and nothing remembered: starting from the live tail, as the start policy says (meant for a first start only)"
                );
                Ok(None)
            }
            Start::Oldest => {
                tracing::warn!(
                    relay = role.as_str(),
                    token = term.token(),
                    "no stored cursor and nothing remembered: starting from the relay's oldest event, as the start policy says (meant for a first start only)"
                );
                Ok(Some(0))
            }
        },
        // On a switch the target's missing cursor is found by content.
        (ReadOutcome::Missing, None) => Ok(None),
    }
}

/// The stores' view of the configured relays.
fn relay_keys(s: &Settings) -> Vec<(String, String, bool)> {
    std::iter::once(&s.primary)
        .chain(s.secondary.as_ref())
        .map(|u| (u.fingerprint().to_owned(), u.host_port(), u.is_root()))
        .collect()
}

impl Leader<'_, '_> {
    /// A fresh pipeline (lanes and window) for `role`'s stream from `start`.
    pub(super) fn pipeline(&self, role: RelayRole, start: Option<u64>) -> Pipeline {
        let ctx = self.cx.batch_ctx(&self.term, role);
        Pipeline::new(&self.cx.shape, &self.cx.handler, ctx, start, self.memory.as_ref())
    }

    /// Subscribes to `role` from `cursor` on the current pipeline: a stream with no
    /// known position is placed by its first seq.
    pub(super) fn begin(&mut self, role: RelayRole, cursor: Option<u64>) {
        let fp = self.p.ctx().fingerprint.clone();
        self.role = role;
        self.phase = match cursor {
            None => Phase::Placing(Rewind::FreshStart),
            Some(_) => Phase::Streaming,
        };
        self.sub.start(role, cursor);
        metrics::gauge!(m::ON_SECONDARY).set(if role == RelayRole::Secondary { 1.0 } else { 0.0 });
        self.cx.status.update(|s| {
            s.relay = Some(role);
            s.fingerprint = Some(fp);
            s.committed = cursor;
        });
    }
}

/// A term from its election to its end.
pub(super) async fn run(cx: &Ctx<'_>, term: Term) -> TermEnd {
    let mut l = match start(cx, term).await {
        Ok(l) => l,
        Err(Stop::End(end)) => return end,
        Err(Stop::Shutdown) => return TermEnd::Shutdown(cx.lease.release().await),
    };
    match l.run().await {
        Some(end) => end,
        None => l.step_down().await,
    }
}

/// The start of a term: the election announced to the store, the desynchronised repos
/// and the relay the last leader was on read back, the position found and subscribed.
async fn start<'a, 'c>(cx: &'a Ctx<'c>, term: Term) -> Result<Leader<'a, 'c>, Stop> {
    let token = term.token();
    cx.status.update(|s| {
        s.role = Role::Leader;
        s.token = Some(token);
    });
    metrics::gauge!(m::LEADER).set(1.0);
    let keys = relay_keys(cx.settings);
    let keys: Vec<RelayKey<'_>> =
        keys.iter().map(|(f, h, r)| RelayKey { fingerprint: f, host_port: h, is_root: *r }).collect();
    let holder = term.holder();
    let fence = Fence { holder: &holder, token };
    match while_active(cx, &term, "on election", || cx.store.on_elected(fence, &keys)).await? {
        Err(e @ StoreError::LegacyAmbiguous { .. }) => return Err(Fatal::LegacyAmbiguous(e).into()),
        Err(e) => return Err(Fatal::Elected(e).into()),
        Ok(()) => {}
    }
    // The repos the last term knew to be desynchronised.
    if cx.store.keeps_repos() {
        match guarded(cx, &term, cx.store.repos()).await? {
            Ok(kept) => {
                if !kept.is_empty() {
                    tracing::info!(repos = kept.len(), "desynchronised repos kept by the store");
                }
                cx.status.desync().load(&kept);
            }
            Err(e) => tracing::warn!(error = %e, "reading the desynchronised repos kept by the store failed"),
        }
    }
    // Resume on the relay the last committing leader was on: its cursor is where the
    // stream stands (the other relay's is older, and numbered differently).
    let active = guarded(cx, &term, cx.store.active_relay()).await?.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "reading the active relay failed; starting on the primary");
        None
    });
    let on_secondary = cx.settings.secondary.as_ref().is_some_and(|s| active.as_deref() == Some(s.fingerprint()));
    let role = if on_secondary { RelayRole::Secondary } else { RelayRole::Primary };
    if on_secondary {
        tracing::info!("the last leader was on the secondary relay: resuming there");
    }
    let cursor = resume_point(cx, &term, role, true).await?;
    let s = cx.settings;
    let sub = Subscription::new(s.client.clone(), s.primary.clone(), s.secondary.clone());
    // What this term hands over, for the chain check and a relay switch's proof.
    let memory = (s.options.chain_repos > 0 || s.secondary.is_some()).then(|| {
        let repos =
            if s.options.chain_repos > 0 { s.options.chain_repos } else { crate::Options::default().chain_repos };
        Arc::new(Memory::new(repos, cx.shape.lanes_for(&cx.handler)))
    });
    // The position by time, as the last leader left it.
    let stored_time = guarded(cx, &term, cx.store.read_time(cx.url(role).fingerprint())).await?.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "reading the stored time of the cursor failed");
        None
    });
    let mut p = Pipeline::new(&cx.shape, &cx.handler, cx.batch_ctx(&term, role), cursor, memory.as_ref());
    p.carry_time(stored_time);
    if let Some(m) = &memory {
        // The memory holds what this term hands over: from the relay's first event it
        // holds everything; else what earlier terms handed over lies before the stored
        // position (or, without one, the first position this term commits).
        match (cursor, stored_time) {
            (Some(0), _) => m.place(i64::MIN),
            (_, Some(t)) => m.place(t),
            _ => {}
        }
    }
    let mut l = Leader {
        cx,
        term,
        role,
        sub,
        p,
        phase: Phase::Streaming,
        overlap: None,
        last_time: String::new(),
        memory,
        events: m::EventCounters::new(),
        flight: None,
        quiet_ticks: 0,
        committed_since: (cursor, std::time::Instant::now()),
        commit_stalled: false,
        resync: None,
        covered: super::resync::Covered::new(),
        inactive: std::collections::HashSet::new(),
    };
    l.begin(role, cursor);
    let (memory, lanes) = (l.memory.clone(), l.p.lane_count());
    l.resync = super::resync::start(cx, cx.batch_ctx(&l.term, role), memory, lanes);
    Ok(l)
}
