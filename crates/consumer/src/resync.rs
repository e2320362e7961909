//! Repo sync in the leader: a desynchronised repo (its chain broke, a commit of it was
//! invalid) is fetched whole from its PDS, verified, and handed to the handler as a
//! [`Snapshot`] in the repo's lane, so that it lands after every event of the repo
//! handed over before it and before every one after it.
//!
//! ```text
//!  lane marks repo ─▶ desynchronized (kept by the store before the cursor passes the event)
//!        ▲                 │ due
//!        │ failed: backoff ▼
//!        └──────────── resyncing ── fetch + verify (this worker, beside the lanes)
//!                          │ ready
//!                          ▼
//!   term: stale? (a newer commit was handed over) ─ yes ─▶ desynchronized, at once
//!                          │ no: staged in the repo's lane; later events at or below its
//!                          │     rev are dropped (it covers them)
//!                          ▼
//!   lane: earlier writes durable, then the snapshot written beside the lane (the
//!         lane goes on with other repos; the repo's own events are held back) ─▶
//!         synchronised (entry cleared), the held events handed over after it
//! ```
//!
//! The queue is the desync list ([`Desync`]): each entry's state is written to the cursor
//! store fenced by the term, so a new leader continues it (and queues again what an older
//! term had in flight). A crash anywhere repeats the resync: at-least-once snapshots,
//! never a lost one.

use std::sync::Arc;
use std::time::Duration;

use atproto_identity::resolver::{Resolver, ResolverConfig};
use repo_sync::check::CheckError;
use repo_sync::fetch::{FetchError, Limits};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinSet;

use crate::handler::{BatchCtx, CollectionFilter, SnapshotParts};
use crate::metrics as m;
use crate::pipeline::SnapshotDone;
use crate::verify::{Desync, Outcome, keep, now_ms};

/// Why a repo is resynchronised, besides the verifier's reasons (`signature`, `chain`, …).
pub mod reason {
    /// A `#sync` named another state than the last commit handed over.
    pub const SYNC: &str = "sync";
    /// The account turned active again.
    pub const REACTIVATED: &str = "reactivated";
    /// A `#identity` of a repo its PDS had said was gone.
    pub const IDENTITY: &str = "identity";
    /// An operator asked.
    pub const OPERATOR: &str = "operator";
    /// A backfill listed it.
    pub const BACKFILL: &str = "backfill";
    /// After an accepted gap, the host's listing showed it newer than what was handed over.
    pub const GAP: &str = "gap";
    /// Every reason of this module.
    pub const ALL: [&str; 6] = [SYNC, REACTIVATED, IDENTITY, OPERATOR, BACKFILL, GAP];
}

/// Repo sync settings.
#[derive(Debug, Clone)]
pub struct ResyncOptions {
    /// Resync desynchronised repos from their PDS (with a handler that takes snapshots).
    pub enabled: bool,
    /// Repos fetched at a time: by the leader, or with a shared queue by this replica's
    /// workers (0: this replica takes no jobs).
    pub workers: usize,
    /// The first retry of a failed resync waits this long, doubling to `retry_max`.
    pub retry_first: Duration,
    /// See `retry_first`.
    pub retry_max: Duration,
    /// Attempts before a repo is listed as `failed`.
    pub attempts: u32,
    /// The bounds of one fetch.
    pub limits: Limits,
    /// Repos to backfill (`FIREKEEPER_BACKFILL_DIDS`): each is queued once, in order, a
    /// batch at a time while the queue is short; the position is kept in the store.
    pub backfill: Vec<String>,
    /// Backfill every repo this host lists (`com.atproto.sync.listRepos`, a relay or a
    /// PDS: `https://host`), a page at a time while the queue is short, after the listed
    /// DIDs; the listing's cursor is kept in the store.
    pub backfill_list: Option<String>,
    /// With `backfill_list`: list only the repos holding records of these collections
    /// (`com.atproto.sync.listReposByCollection`, exact NSIDs, one after another) instead
    /// of every repo.
    pub backfill_collections: Vec<String>,
    /// After an accepted gap (`FIREKEEPER_GAP=live`, `FIREKEEPER_FUTURE_CURSOR=live`, a
    /// relay's `OutdatedCursor`), the repos this term handed over are compared with this
    /// host's `com.atproto.sync.listRepos` revs, and those that moved are resynchronised
    /// (`None`: no reconcile).
    pub reconcile_host: Option<String>,
    /// With a shared queue and a shared sink (see `Builder::jobs`), the leader publishes
    /// repos to fetch to the queue and every replica with `workers` > 0 works them.
    pub share: bool,
    /// The local address repo sync fetches from (`None`: the system's choice): a replica's
    /// own egress address, so that each has its own per-address budget at the PDSs.
    pub bind: Option<std::net::IpAddr>,
    /// With a shared queue: a job claim not touched for this long passes to another
    /// worker (its own died, froze or was cut off).
    pub claim_idle: Duration,
    /// Where `getRepo` is asked: `None` the repo's PDS (from its DID document), else this
    /// host (a relay, which redirects to the PDS; redirects are followed, at most 3).
    pub source: Option<String>,
}

impl Default for ResyncOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            workers: 4,
            retry_first: Duration::from_mins(1),
            retry_max: Duration::from_hours(1),
            attempts: 10,
            limits: Limits::default(),
            backfill: Vec::new(),
            backfill_list: None,
            backfill_collections: Vec::new(),
            reconcile_host: None,
            share: true,
            claim_idle: crate::shared::CLAIM_IDLE,
            bind: None,
            source: None,
        }
    }
}

pub use repo_sync::snapshot::{RepoRecord, RepoSnapshot};

/// What the lane answers when a snapshot is older than what was handed over.
pub(crate) const STALE: &str = "stale: a newer commit of the repo was handed over";

/// A verified snapshot for the term to stage in its repo's lane.
pub(crate) struct Ready {
    pub(crate) work: crate::pipeline::SnapshotWork,
    pub(crate) done: SnapshotDone,
}

/// Fetches and verifies repos for the leader; lives as long as the process.
pub(crate) struct Resyncer {
    resolver: Resolver,
    client: guarded_http::Client,
    opts: ResyncOptions,
    /// The collections a snapshot carries (the collection filter).
    wants: repo_sync::snapshot::Wants,
    /// The backfill's listing, paused after a failed page.
    listing_after: Pause,
    /// The gap reconcile's listing, paused after a failed page.
    reconcile_after: Pause,
    /// PDSs parked by their rate limits (kept across terms: the limit is the host's).
    hosts: repo_sync::hosts::Hosts,
    /// The shared queue, when every replica works repo sync: the leader publishes jobs
    /// there instead of fetching them itself (its own workers claim them like the others').
    shared: Option<Arc<dyn checkpoint::JobQueue>>,
    /// Where the leader shows the shared queue's counts.
    stats: Option<Arc<crate::shared::WorkerStats>>,
    /// Jobs published by this process (their ids: the term's token and this count).
    published: std::sync::atomic::AtomicU64,
}

impl Resyncer {
    /// A resyncer resolving DIDs with `resolver` (its `allow_private` also governs PDS
    /// addresses).
    pub(crate) fn new(
        opts: ResyncOptions,
        resolver: ResolverConfig,
        filter: Option<CollectionFilter>,
    ) -> Result<Self, crate::error::Error> {
        let allow_private = resolver.allow_private;
        // The resolver installs the process's TLS provider, which the client needs.
        let resolver = Resolver::new(resolver)
            .map_err(|e| crate::error::Error::Setup { what: "repo sync: the resolver", source: Box::new(e) })?;
        let guard = guarded_http::Guard { allow_private, max_redirects: 3 };
        let client = guarded_http::Client::new(
            guard,
            reqwest::Client::builder()
                .user_agent(concat!("firekeeper/", env!("CARGO_PKG_VERSION")))
                .local_address(opts.bind),
        )
        .map_err(|e| crate::error::Error::Setup { what: "repo sync: the HTTP client", source: Box::new(e) })?;
        Ok(Self {
            resolver,
            client,
            opts,
            wants: filter.map(|f| -> Arc<dyn Fn(&str) -> bool + Send + Sync> { Arc::new(move |c| f.wants(c)) }),
            listing_after: Pause::default(),
            reconcile_after: Pause::default(),
            hosts: repo_sync::hosts::Hosts::default(),
            shared: None,
            stats: None,
            published: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Publishes jobs to `queue` for every replica's workers instead of fetching them here.
    pub(crate) fn share(&mut self, queue: Arc<dyn checkpoint::JobQueue>, stats: Arc<crate::shared::WorkerStats>) {
        self.shared = Some(queue);
        self.stats = Some(stats);
    }

    /// The shared queue, when jobs go there.
    pub(crate) fn shared_queue(&self) -> Option<Arc<dyn checkpoint::JobQueue>> {
        self.shared.clone()
    }

    /// Fetches and verifies `did` whole (the route, bounds and collection filter of the
    /// settings): the snapshot's head and its records to come a part at a time.
    pub(crate) async fn fetch(&self, did: &str) -> Result<(RepoSnapshot, repo_sync::snapshot::Parts), CheckError> {
        let now_us = now_ms().saturating_mul(1000);
        repo_sync::snapshot::fetch_snapshot(
            &self.resolver,
            &self.client,
            repo_sync::check::Route { hosts: &self.hosts, via: self.opts.source.as_deref() },
            did,
            &self.opts.limits,
            now_us,
            self.wants.clone(),
        )
        .await
    }

    /// Works the queue for one term: takes due repos, fetches them, hands each snapshot
    /// to the term on `ready`; ends with the term. `known` answers the last rev this term
    /// handed over of a repo (for the reconcile after a gap).
    pub(crate) async fn run(
        self: Arc<Self>,
        desync: Arc<Desync>,
        store: Arc<dyn checkpoint::CursorStore>,
        ctx: BatchCtx,
        ready: mpsc::Sender<Ready>,
        known: Option<Known>,
    ) {
        // Shared jobs in flight are bounded by what the lanes keep beside them.
        let n = if self.shared.is_some() { SHARED_IN_FLIGHT } else { self.opts.workers.max(1) };
        let permits = Arc::new(Semaphore::new(n));
        let mut tasks = JoinSet::new();
        desync.plan_backfill(self.opts.backfill.len(), self.opts.backfill_list.is_some());
        let _zeroed = QueueGauges(self.stats.clone());
        let mut shown: Option<std::time::Instant> = None;
        loop {
            while tasks.try_join_next().is_some() {}
            if shown.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                QueueGauges::set(&desync, &self.hosts);
                if let (Some(q), Some(stats)) = (&self.shared, &self.stats) {
                    // Bounded like every queue call; a queue that does not answer shows
                    // its last counts.
                    if let Ok(c) = q.counts().await {
                        stats.set_queue(Some(c));
                    }
                }
                shown = Some(std::time::Instant::now());
            }
            for did in desync.take_requests() {
                if keep(store.as_ref(), &desync, &did, &ctx).await.is_err() {
                    return;
                }
            }
            if self.reconcile(&desync, store.as_ref(), &ctx, known.as_ref()).await.is_err() {
                return;
            }
            if self.backfill(&desync, store.as_ref(), &ctx).await.is_err() {
                return;
            }
            let free = permits.available_permits();
            for (did, reason) in desync.take_due(now_ms(), free) {
                let Ok(permit) = permits.clone().acquire_owned().await else { return };
                if keep(store.as_ref(), &desync, &did, &ctx).await.is_err() {
                    return;
                }
                metrics::gauge!(m::RESYNC_IN_FLIGHT).increment(1.0);
                let job = Job { r: self.clone(), desync: desync.clone(), store: store.clone(), ctx: ctx.clone() };
                let ready = ready.clone();
                tasks.spawn(async move {
                    match job.r.shared.clone() {
                        Some(queue) => job.remote(queue, did, reason, ready).await,
                        None => job.one(did, reason, ready).await,
                    }
                    metrics::gauge!(m::RESYNC_IN_FLIGHT).decrement(1.0);
                    drop(permit);
                });
            }
            let wait = desync.next_due().map_or(1_000, |t| (t - now_ms()).clamp(10, 1_000));
            tokio::select! {
                () = ctx.cancel.cancelled() => return,
                () = desync.queued.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(wait.unsigned_abs())) => {}
                Some(_) = tasks.join_next() => {}
            }
        }
    }
}

/// Shared jobs the leader has published and not seen land, at most.
const SHARED_IN_FLIGHT: usize = 512;

/// A listing that asks no page for a while after a failed one.
#[derive(Default)]
struct Pause(std::sync::Mutex<Option<std::time::Instant>>);

impl Pause {
    /// True while the pause lasts.
    fn on(&self) -> bool {
        self.0.lock().is_ok_and(|t| t.is_some_and(|t| std::time::Instant::now() < t))
    }

    /// A page of `what`'s listing failed (logged): none is asked for 30 s.
    fn after_failure(&self, what: &str, why: &FetchError) {
        tracing::warn!(error = %why, "{what}: listing the host's repos failed; asking again in 30 s");
        if let Ok(mut t) = self.0.lock() {
            *t = Some(std::time::Instant::now() + Duration::from_secs(30));
        }
    }
}

/// The last rev (a TID value) this term handed over of a repo, as far as it remembers.
pub(crate) type Known = Arc<dyn Fn(&str) -> Option<u64> + Send + Sync>;

impl Resyncer {
    /// After an accepted gap: asks the next page of the host's `listRepos` (while the queue
    /// is short) and queues each repo listed at a newer rev than this term handed over of
    /// it (its commits in the gap were missed; it may have none after). Repos the term
    /// does not remember are left to their next commit's chain check. A page that fails
    /// is asked again in 30 s.
    async fn reconcile(
        &self,
        desync: &Desync,
        store: &dyn checkpoint::CursorStore,
        ctx: &BatchCtx,
        known: Option<&Known>,
    ) -> Result<(), crate::handler::HandlerError> {
        let (Some(host), Some(known)) = (&self.opts.reconcile_host, known) else { return Ok(()) };
        let Some(at) = desync.reconcile() else { return Ok(()) };
        if desync.queued() >= BACKFILL_BATCH || self.reconcile_after.on() {
            return Ok(());
        }
        if at.cursor.is_none() {
            tracing::info!(
                why = at.why,
                "accepted gap: comparing the repos handed over with the host's listRepos revs"
            );
        }
        let page = match repo_sync::list::list_repos(&self.client, host, at.cursor.as_deref()).await {
            Ok(p) => p,
            Err(why) => {
                self.reconcile_after.after_failure("gap reconcile", &why);
                return Ok(());
            }
        };
        let mut queued = 0;
        for r in &page.active {
            let listed = r.rev.as_deref().and_then(crate::chain::tid);
            let moved = listed.zip(known(&r.did)).is_some_and(|(listed, last)| listed > last);
            if moved && desync.mark_new(&r.did, reason::GAP) {
                keep(store, desync, &r.did, ctx).await?;
                queued += 1;
            }
        }
        // A host answering the cursor it was asked with again ends the listing (no loop).
        let next = page.cursor.filter(|c| !page.empty && at.cursor.as_ref() != Some(c));
        let done = next.is_none();
        desync.reconciled(at.generation, next);
        tracing::info!(queued, listed = page.active.len(), done, "gap reconcile: a page of the host's repos compared");
        Ok(())
    }
}

/// `firekeeper_resync_queue{state}`, set by the leader's worker at most once a second and
/// zeroed when its term ends (a standby shows no queue).
struct QueueGauges(Option<Arc<crate::shared::WorkerStats>>);

impl QueueGauges {
    fn set(desync: &Desync, hosts: &repo_sync::hosts::Hosts) {
        for (state, n) in desync.by_state() {
            metrics::gauge!(m::RESYNC_QUEUE, "state" => state).set(n as f64);
        }
        metrics::gauge!(m::RESYNC_PARKED_HOSTS).set(hosts.parked_now() as f64);
    }
}

impl Drop for QueueGauges {
    fn drop(&mut self) {
        if let Some(stats) = &self.0 {
            stats.set_queue(None);
        }
        for state in crate::verify::state::ALL {
            metrics::gauge!(m::RESYNC_QUEUE, "state" => state).set(0.0);
        }
        metrics::gauge!(m::RESYNC_PARKED_HOSTS).set(0.0);
    }
}

/// Backfill entries queued at a time: the next batch is queued once fewer than this many
/// repos wait, so resyncs of broken repos are not stuck behind a long list.
const BACKFILL_BATCH: usize = 256;

impl Resyncer {
    /// Queues the next batch of the backfill list when the queue is short: each repo's
    /// entry is kept by the store first, then the list position (fenced like every repo
    /// state; a crash in between queues a few again, which is harmless).
    async fn backfill(
        &self,
        desync: &Desync,
        store: &dyn checkpoint::CursorStore,
        ctx: &BatchCtx,
    ) -> Result<(), crate::handler::HandlerError> {
        let list = &self.opts.backfill;
        let pos = desync.backfilled();
        if desync.queued() >= BACKFILL_BATCH {
            return Ok(());
        }
        if pos >= list.len() {
            return self.list_page(desync, store, ctx).await;
        }
        let end = (pos + BACKFILL_BATCH).min(list.len());
        for did in &list[pos..end] {
            if desync.mark_new(did, reason::BACKFILL) {
                keep(store, desync, did, ctx).await?;
            }
        }
        desync.set_backfilled(end);
        keep(store, desync, crate::verify::BACKFILL_KEY, ctx).await?;
        tracing::info!(queued = end, of = list.len(), "backfill: repos queued");
        Ok(())
    }

    /// Queues the next page of the host's `listRepos` (active repos only), each repo's
    /// entry kept before the listing's cursor; a page that fails is asked again in 30 s.
    async fn list_page(
        &self,
        desync: &Desync,
        store: &dyn checkpoint::CursorStore,
        ctx: &BatchCtx,
    ) -> Result<(), crate::handler::HandlerError> {
        use crate::verify::Listing;
        let Some(host) = &self.opts.backfill_list else { return Ok(()) };
        let Some(at) = ListingAt::of(&desync.listing(), &self.opts.backfill_collections) else { return Ok(()) };
        if self.listing_after.on() {
            return Ok(());
        }
        let cursor = at.cursor.as_deref();
        let listed = match at.collection {
            None => repo_sync::list::list_repos(&self.client, host, cursor).await,
            Some(c) => repo_sync::list::list_repos_by_collection(&self.client, host, c, cursor).await,
        };
        let page = match listed {
            Ok(p) => p,
            Err(why) => {
                self.listing_after.after_failure("backfill", &why);
                return Ok(());
            }
        };
        let mut queued = 0;
        for r in &page.active {
            if desync.mark_new(&r.did, reason::BACKFILL) {
                keep(store, desync, &r.did, ctx).await?;
                queued += 1;
            }
        }
        let next = at.next(page.cursor.filter(|_| !page.empty), &self.opts.backfill_collections);
        let done = next == Listing::Done;
        desync.set_listing(next);
        keep(store, desync, crate::verify::LISTING_KEY, ctx).await?;
        tracing::info!(queued, inactive = page.inactive, done, "backfill: a page of the host's repos queued");
        Ok(())
    }
}

/// Where a listing stands, read from the kept [`Listing`]: which collection
/// (`listReposByCollection`; `None` for `listRepos`) and the page cursor.
#[derive(Debug, PartialEq, Eq)]
struct ListingAt<'c> {
    collection: Option<&'c str>,
    cursor: Option<String>,
}

impl<'c> ListingAt<'c> {
    /// The position `kept` names, among `collections` (empty: every repo); `None` once
    /// done. With collections the kept cursor is `<collection> <cursor>`; one that names
    /// a collection no longer listed starts over (queuing a repo twice is harmless).
    fn of(kept: &crate::verify::Listing, collections: &'c [String]) -> Option<Self> {
        use crate::verify::Listing;
        let first = || collections.first().map(String::as_str);
        match kept {
            Listing::Done => None,
            Listing::Start => Some(Self { collection: first(), cursor: None }),
            Listing::After(c) if collections.is_empty() => Some(Self { collection: None, cursor: Some(c.clone()) }),
            Listing::After(c) => {
                let (name, cursor) = c.split_once(' ').unwrap_or((c, ""));
                Some(match collections.iter().find(|x| *x == name) {
                    Some(x) => Self { collection: Some(x), cursor: Some(cursor.to_owned()).filter(|c| !c.is_empty()) },
                    None => Self { collection: first(), cursor: None },
                })
            }
        }
    }

    /// What to keep after a page whose next cursor is `cursor` (`None`: this listing ended).
    /// A host that answers the cursor it was asked with again would be asked for the same
    /// page forever: that listing ends there (logged).
    fn next(&self, cursor: Option<String>, collections: &[String]) -> crate::verify::Listing {
        use crate::verify::Listing;
        let cursor = match cursor {
            Some(c) if self.cursor.as_deref() == Some(c.as_str()) => {
                tracing::warn!(collection = self.collection, cursor = %c, "backfill: the host answered the cursor it was asked with; ending this listing");
                None
            }
            c => c,
        };
        match (self.collection, cursor) {
            (None, Some(c)) => Listing::After(c),
            (None, None) => Listing::Done,
            (Some(col), Some(c)) => Listing::After(format!("{col} {c}")),
            (Some(col), None) => {
                let after = collections.iter().skip_while(|x| *x != col).nth(1);
                after.map_or(Listing::Done, |x| Listing::After(format!("{x} ")))
            }
        }
    }
}

/// One repo's resync within a term.
struct Job {
    r: Arc<Resyncer>,
    desync: Arc<Desync>,
    store: Arc<dyn checkpoint::CursorStore>,
    ctx: BatchCtx,
}

impl Job {
    async fn one(self, did: String, reason: &'static str, ready: mpsc::Sender<Ready>) {
        let started = std::time::Instant::now();
        let outcome = match self.r.fetch(&did).await {
            Ok((repo, parts)) => {
                let (rev, bytes, records) = (repo.rev.clone(), repo.bytes, repo.records);
                let rev_tid = crate::chain::tid(&rev);
                let snapshot = SnapshotParts::new(Arc::new(repo), reason.into(), parts);
                let (done, answer) = oneshot::channel();
                let work = crate::pipeline::SnapshotWork::Local(snapshot);
                if ready.send(Ready { work, done }).await.is_err() {
                    // The term is over: the next one queues the repo again.
                    return;
                }
                match answer.await {
                    Ok(Ok(_)) => {
                        tracing::info!(repo = %did, rev, records, bytes, reason, ms = started.elapsed().as_millis() as u64, "repo resynchronised from its PDS");
                        metrics::counter!(m::RESYNCS, "outcome" => "done", "reason" => reason).increment(1);
                        metrics::counter!(m::RESYNC_RECORDS).increment(records);
                        metrics::counter!(m::RESYNC_BYTES).increment(bytes);
                        self.desync.meter.add(now_ms().unsigned_abs() / 1000, records, bytes);
                        metrics::histogram!(m::RESYNC_SECONDS).record(started.elapsed().as_secs_f64());
                        Outcome::Done(rev_tid)
                    }
                    Ok(Err(why)) if why == STALE => {
                        tracing::info!(repo = %did, rev, "the snapshot is older than a commit already handed over: fetching again");
                        metrics::counter!(m::RESYNCS, "outcome" => "stale", "reason" => reason).increment(1);
                        Outcome::Later(now_ms())
                    }
                    Ok(Err(why)) => {
                        tracing::warn!(repo = %did, error = %why, "the repo's snapshot was not delivered; retrying later");
                        metrics::counter!(m::RESYNCS, "outcome" => "undelivered", "reason" => reason).increment(1);
                        Outcome::Failed
                    }
                    Err(_) => return,
                }
            }
            Err(e) => {
                let result = crate::shared::JobResult::of_fetch(&e);
                let (outcome, label) = result.outcome();
                if label == "parked" {
                    // Its host said to wait: one line for the 429, not one per repo it hosts.
                    tracing::debug!(repo = %did, error = %e, "resync waits for its host's rate limit");
                } else {
                    tracing::warn!(repo = %did, error = %e, outcome = label, "resync failed");
                }
                metrics::counter!(m::RESYNCS, "outcome" => label.to_owned(), "reason" => reason).increment(1);
                outcome
            }
        };
        self.desync.finish(&did, outcome);
        let _ = keep(self.store.as_ref(), &self.desync, &did, &self.ctx).await;
    }
}

impl Job {
    /// One repo's job in the shared queue: published at its turn in the repo's lane,
    /// worked by whichever replica claims it; its result decides what the queue does.
    async fn remote(
        self,
        queue: Arc<dyn checkpoint::JobQueue>,
        did: String,
        reason: &'static str,
        ready: mpsc::Sender<Ready>,
    ) {
        use crate::shared::JobResult;
        let started = std::time::Instant::now();
        let n = self.r.published.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{}-{}-{n}", self.ctx.term.instance(), self.ctx.token);
        let job = crate::pipeline::RemoteJob { queue, did: did.clone(), id, reason, min_rev: None };
        let (done, answer) = oneshot::channel();
        if ready.send(Ready { work: crate::pipeline::SnapshotWork::Remote(job), done }).await.is_err() {
            return;
        }
        let result = match answer.await {
            Ok(Ok(Some(r))) => r,
            Ok(Ok(None) | Err(_)) => JobResult::Failed { why: "not delivered".into(), label: "undelivered".into() },
            // The term ended: the next one queues the repo again.
            Err(_) => return,
        };
        match &result {
            JobResult::Done { rev, records, bytes, by, .. } => {
                if let Some(stats) = &self.r.stats {
                    stats.landed(by, *records);
                }
                tracing::info!(repo = %did, rev, records, bytes, reason, by, ms = started.elapsed().as_millis() as u64, "repo resynchronised (a shared job landed)");
                metrics::counter!(m::RESYNC_RECORDS).increment(*records);
                metrics::counter!(m::RESYNC_BYTES).increment(*bytes);
                self.desync.meter.add(now_ms().unsigned_abs() / 1000, *records, *bytes);
                metrics::histogram!(m::RESYNC_SECONDS).record(started.elapsed().as_secs_f64());
            }
            JobResult::Stale { rev } => {
                tracing::info!(repo = %did, rev, "the PDS served a repo older than a commit already handed over: fetching again");
            }
            JobResult::Failed { why, label } => {
                tracing::warn!(repo = %did, error = %why, outcome = %label, "a shared resync job failed");
            }
            JobResult::Gone | JobResult::Later { .. } => {}
        }
        let (outcome, label) = result.outcome();
        metrics::counter!(m::RESYNCS, "outcome" => label.to_owned(), "reason" => reason).increment(1);
        self.desync.finish(&did, outcome);
        let _ = keep(self.store.as_ref(), &self.desync, &did, &self.ctx).await;
    }
}

#[cfg(test)]
mod tests {
    use super::ListingAt;
    use crate::verify::Listing;

    /// A listing by collection walks each collection's pages, then the next collection,
    /// then is done; a kept position naming a collection no longer listed starts over.
    #[test]
    fn a_listing_by_collection_goes_through_each_collection_in_turn() {
        let cols: Vec<String> = vec!["a.b.c".into(), "d.e.f".into()];
        let at = ListingAt::of(&Listing::Start, &cols).expect("at");
        assert_eq!(at, ListingAt { collection: Some("a.b.c"), cursor: None });
        let kept = at.next(Some("p1".into()), &cols);
        assert_eq!(kept, Listing::After("a.b.c p1".into()));
        let at = ListingAt::of(&kept, &cols).expect("at");
        assert_eq!(at, ListingAt { collection: Some("a.b.c"), cursor: Some("p1".into()) });
        let kept = at.next(None, &cols);
        assert_eq!(kept, Listing::After("d.e.f ".into()));
        let at = ListingAt::of(&kept, &cols).expect("at");
        assert_eq!(at, ListingAt { collection: Some("d.e.f"), cursor: None });
        assert_eq!(at.next(None, &cols), Listing::Done);
        assert_eq!(ListingAt::of(&Listing::Done, &cols), None);
        let gone = ListingAt::of(&Listing::After("x.y.z p9".into()), &cols).expect("at");
        assert_eq!(gone, ListingAt { collection: Some("a.b.c"), cursor: None });
        // A host answering the cursor it was asked with: that listing ends (no loop).
        let stuck = ListingAt { collection: Some("a.b.c"), cursor: Some("p1".into()) };
        assert_eq!(stuck.next(Some("p1".into()), &cols), Listing::After("d.e.f ".into()));
        let stuck = ListingAt { collection: None, cursor: Some("p1".into()) };
        assert_eq!(stuck.next(Some("p1".into()), &[]), Listing::Done);
        // Every repo: the cursor alone.
        let every = ListingAt::of(&Listing::After("c9".into()), &[]).expect("at");
        assert_eq!(every, ListingAt { collection: None, cursor: Some("c9".into()) });
        assert_eq!(every.next(None, &[]), Listing::Done);
    }
}
