//! The deployment's settings record: the settings that change what downstream receives
//! or where the cursor lives, written by every leader beside the lease and compared by
//! every replica before it contends, so that a replica configured differently (a filter
//! forgotten, a relay spelt another way) cannot take over and silently change the output.

use std::collections::BTreeMap;
use std::time::Duration;

use lease::{Backend, LeaseHandle, Status as LeaseStatus};
use serde::Serialize;

use crate::metrics;
use crate::status::StatusHandle;

/// Settings as `key=value` lines in key order. Only a value's first word is compared;
/// the rest explains it (a relay's fingerprint, then its URL without credentials).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Deployment(BTreeMap<String, String>);

/// One setting on which this replica and the deployment's latest leader disagree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    /// The setting (`collections`, `relay.primary`, `sink`…).
    pub key: String,
    /// This replica's value (`None`: not set here).
    pub ours: Option<String>,
    /// What the leader of term `token` wrote.
    pub leader: Option<String>,
    /// That term's token.
    pub token: u64,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "(not set)".into());
        write!(
            f,
            "{}: here {}, the leader of term {} had {}",
            self.key,
            show(&self.ours),
            self.token,
            show(&self.leader)
        )
    }
}

impl Deployment {
    /// Adds or replaces `key` (newlines in either are replaced by spaces: one line each).
    #[must_use]
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let clean = |s: String| s.replace(['\n', '\r', '='], " ");
        self.0.insert(clean(key.into()), value.into().replace(['\n', '\r'], " "));
        self
    }

    /// The record as stored: `key=value` lines in key order.
    #[must_use]
    pub fn render(&self) -> String {
        self.0.iter().fold(String::new(), |mut out, (k, v)| {
            use std::fmt::Write as _;
            let _ = writeln!(out, "{k}={v}");
            out
        })
    }

    /// A stored record; lines without `=` are ignored (written by no version of this).
    #[must_use]
    pub fn parse(text: &str) -> Self {
        Self(text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect())
    }

    /// The settings on which `self` and `leader` (written by term `token`) disagree,
    /// comparing first words only.
    #[must_use]
    pub fn differences(&self, leader: &Self, token: u64) -> Vec<Difference> {
        let first = |v: Option<&String>| v.map(|v| v.split(' ').next().unwrap_or("").to_owned());
        let keys: std::collections::BTreeSet<&String> = self.0.keys().chain(leader.0.keys()).collect();
        keys.into_iter()
            .filter(|k| first(self.0.get(*k)) != first(leader.0.get(*k)))
            .map(|k| Difference {
                key: k.clone(),
                ours: self.0.get(k).cloned(),
                leader: leader.0.get(k).cloned(),
                token,
            })
            .collect()
    }
}

/// How often a standby compares its settings with the record again, and a leader checks
/// that its own record is the one stored.
const EVERY: Duration = Duration::from_secs(2);

/// Compares `ours` with the stored record: the differences (empty when they agree or
/// nothing is stored), or `Err` when the store cannot tell.
async fn compare(backend: &dyn Backend, ours: &Deployment) -> Result<Vec<Difference>, lease::BackendError> {
    Ok(match backend.deployment().await? {
        Some((token, text)) => ours.differences(&Deployment::parse(&text), token),
        None => Vec::new(),
    })
}

/// What this replica does about a record that differs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Policy {
    /// `FIREKEEPER_ALLOW_SETTINGS_CHANGE`: contend anyway (a rolling change).
    pub(crate) allow_change: bool,
}

/// The first comparison, before the lease supervisor starts: whether it starts held back,
/// and what was found (for [`keep`]). A store that cannot tell does not hold back (the
/// lease store's trouble is reported by the supervisor, and [`keep`] compares again).
pub(crate) async fn at_start(
    backend: &dyn Backend,
    ours: &Deployment,
    policy: Policy,
    status: &StatusHandle,
) -> (bool, Option<Vec<Difference>>) {
    match compare(backend, ours).await {
        Ok(d) => (apply(d.clone(), policy, status, None), Some(d)),
        Err(e) => {
            tracing::debug!(error = %e, "could not read the deployment's settings record at start; comparing again shortly");
            (false, None)
        }
    }
}

/// Records and logs the differences; returns whether to hold back. `last` is what was
/// reported before (logged again only when it changes).
fn apply(d: Vec<Difference>, policy: Policy, status: &StatusHandle, last: Option<&[Difference]>) -> bool {
    let differs = !d.is_empty();
    ::metrics::gauge!(metrics::SETTINGS_DIFFER).set(if differs { 1.0 } else { 0.0 });
    let changed = last.is_none_or(|l| l != d.as_slice());
    if differs && changed {
        let said = d.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
        if policy.allow_change {
            tracing::warn!(
                differences = %said,
                "this replica's settings differ from the deployment's; FIREKEEPER_ALLOW_SETTINGS_CHANGE=true: contending anyway, and if elected this replica's settings become the deployment's"
            );
        } else {
            tracing::error!(
                differences = %said,
                "this replica's settings differ from the deployment's: it will not take over (not ready); fix its settings, or set FIREKEEPER_ALLOW_SETTINGS_CHANGE=true on the replicas that carry a deliberate change"
            );
        }
    } else if !differs && last.is_some_and(|l| !l.is_empty()) {
        tracing::info!("this replica's settings agree with the deployment's again");
    }
    status.settings_differ(if differs { Some(d) } else { None }, !policy.allow_change);
    differs && !policy.allow_change
}

/// Runs for the life of the consumer: a standby compares its settings with the record
/// every [`EVERY`] and holds back while they differ; a leader writes its own record once
/// per term (and again if a store that lost its data no longer has it).
pub(crate) async fn keep(
    backend: &dyn Backend,
    ours: &Deployment,
    policy: Policy,
    lease: &LeaseHandle,
    status: &StatusHandle,
    mut last: Option<Vec<Difference>>,
) -> std::convert::Infallible {
    let record = ours.render();
    let mut written: Option<u64> = None;
    loop {
        match lease.status() {
            LeaseStatus::Leader { token } | LeaseStatus::SteppingDown { token } => {
                // Written once per term, and again when the store no longer has it (it
                // lost its data); a later term's record is left alone.
                let due = match backend.deployment().await {
                    Ok(Some((t, _))) if t > token => false,
                    Ok(Some((t, _))) if t == token => written != Some(token),
                    Ok(_) => true,
                    Err(_) => written != Some(token),
                };
                if due {
                    match backend.set_deployment(token, &record).await {
                        Ok(true) => {
                            if written != Some(token) {
                                tracing::info!(token, "wrote this term's settings record beside the lease");
                            }
                            written = Some(token);
                            last = Some(Vec::new());
                            ::metrics::gauge!(metrics::SETTINGS_DIFFER).set(0.0);
                            status.settings_differ(None, false);
                        }
                        Ok(false) => written = Some(token),
                        Err(e) => tracing::debug!(token, error = %e, "writing the settings record; retrying"),
                    }
                }
            }
            _ => match compare(backend, ours).await {
                Ok(d) => {
                    let held = apply(d.clone(), policy, status, last.as_deref());
                    lease.hold_back(held);
                    last = Some(d);
                }
                Err(e) => tracing::debug!(error = %e, "reading the deployment's settings record; retrying"),
            },
        }
        tokio::time::sleep(EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_only_first_words_are_compared() {
        let a = Deployment::default()
            .with("relay.primary", "abc wss://relay.example/")
            .with("collections", "app.bsky.feed.like")
            .with("verify", "off");
        assert_eq!(Deployment::parse(&a.render()), a);
        let b = Deployment::default()
            .with("relay.primary", "abc wss://RELAY.example:443/")
            .with("collections", "*")
            .with("sink", "jsonl");
        let d = a.differences(&b, 7);
        let keys: Vec<&str> = d.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(keys, ["collections", "sink", "verify"], "{d:?}");
        assert_eq!(d[0].to_string(), "collections: here app.bsky.feed.like, the leader of term 7 had *");
        assert!(a.differences(&a, 1).is_empty());
    }

    #[test]
    fn a_value_cannot_break_the_line_format() {
        let a = Deployment::default().with("k=x\ny", "v\nw=z");
        assert_eq!(a.render(), "k x y=v w=z\n");
        assert_eq!(Deployment::parse(&a.render()), a);
    }
}
