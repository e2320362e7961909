//! A built consumer's run: contend for the lease, lead a term when elected, stand by
//! when it ends, and stop on shutdown or a fatal condition.

use std::pin::pin;
use std::sync::Arc;

use checkpoint::{CursorStore, ReadOutcome};
use lease::{Backend, Clock, LeaseConfig, LeaseEvent, LeaseHandle, Prior};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use crate::builder::Settings;
use crate::deployment;
use crate::error::Error;
use crate::handler::{Handler, Render};
use crate::metrics;
use crate::pipeline::Shape;
use crate::resync::Resyncer;
use crate::shadow::{Recollection, Shadow};
use crate::status::{Role, StatusHandle};
use crate::term::{self, Ctx, Remembered, TermEnd};
use crate::verify;

/// A configured consumer; [`Consumer::run`] contends for the lease and leads when elected.
pub struct Consumer {
    pub(crate) settings: Settings,
    pub(crate) lease: (Arc<dyn Backend>, LeaseConfig),
    pub(crate) store: Arc<dyn CursorStore>,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) instance: String,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) status: StatusHandle,
    pub(crate) shadow: Option<Arc<dyn Shadow>>,
    pub(crate) jobs: Option<Arc<dyn checkpoint::JobQueue>>,
}

impl Consumer {
    /// The status this consumer updates while it runs (for `/status`, readiness, logs).
    #[must_use]
    pub fn status(&self) -> StatusHandle {
        self.status.clone()
    }

    /// This process's instance id.
    #[must_use]
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Runs until `shutdown` completes (then drains, commits and releases the lease), a
    /// fatal condition, or the lease supervisor ending. Like mini-redis's `server::run`,
    /// the caller decides what shutdown means (a signal, a test's oneshot).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let Self { settings, lease: (backend, lease_cfg), store, handler, instance, clock, status, shadow, jobs } =
            self;
        let mut shutdown = pin!(shutdown);
        tokio::select! {
            () = seed_fence(&*store, &*backend, &status) => {}
            () = &mut shutdown => {
                status.update(|s| s.role = Role::Stopped);
                return Ok(());
            }
        }
        let recollection = recall(shadow.as_ref()).await;
        // A replica that remembers nothing, facing a store with no cursor either, does not
        // contend for an empty lease store before a ttl passed (see `lease::Prior`).
        let cold = recollection.is_none()
            && !matches!(
                store.read(settings.primary.fingerprint()).await,
                Ok(ReadOutcome::Found(_) | ReadOutcome::Corrupt(_))
            );
        let recollection = recollection.unwrap_or_default();
        let policy = deployment::Policy { allow_change: settings.allow_settings_change };
        let (held_back, found) = deployment::at_start(&*backend, &settings.deployment, policy, &status).await;
        let prior = Prior { floor: recollection.token, cold, held_back };
        let backend_for_record = backend.clone();
        let (handle, events) = lease::spawn_with(backend, lease_cfg, clock.clone(), &instance, prior)?;
        status.watch_lease(handle.store_trouble());
        status.update(|s| {
            s.role = Role::Standby;
            s.instance.clone_from(&instance);
        });
        status.set_ready();
        tracing::info!(instance = %instance, "contending for the lease");
        // Shadow every replica's committed cursors, so that if the store loses its data
        // this process, once leading, resumes where the last leader committed.
        let remembered: Arc<Remembered> =
            Arc::new(std::sync::Mutex::new(recollection.cursors.iter().map(|(k, v)| (k.clone(), *v)).collect()));
        let follower = tokio::spawn(follow(store.clone(), remembered.clone()));
        let stop = CancellationToken::new();
        let render = handler.wants_json().then(|| {
            Arc::new(Render {
                verify_blocks: settings.options.verify_blocks,
                filter: settings.options.collections.clone(),
            })
        });
        let lanes = if handler.commits_cursor() { 1 } else { settings.options.lanes };
        let verifier = verify::Verifier::new(&settings.options.verify, lanes, status.desync())
            .map_err(|e| Error::Setup { what: "verification", source: Box::new(e) })?
            .map(Arc::new);
        let resyncer = resyncer(&settings, &*handler, &status, jobs)?;
        let workers = spawn_workers(resyncer.as_ref(), &settings, &handler, &instance, &clock, &status);
        let desync = (verifier.is_some() || resyncer.is_some()).then(|| status.desync());
        let shape = Shape {
            lanes: settings.options.lanes,
            desync,
            resyncer,
            queue_depth: settings.options.queue_depth,
            render,
            verifier,
            chain_breaks: (settings.options.chain_repos > 0).then_some(settings.options.chain_breaks),
            status: status.clone(),
            store: store.clone(),
            unstorable: settings.client.bad_frame,
            ties: matches!(settings.client.input, relay_client::Input::Jetstream(_)),
        };
        let cx = Ctx {
            settings: &settings,
            shape,
            store: &*store,
            handler,
            lease: &handle,
            shutdown: &stop,
            status: &status,
            remembered: &remembered,
        };
        let r = {
            let mut lead = pin!(lead_loop(&cx, events));
            // What runs beside the terms for the life of the process: the shadow file, the
            // settings record, the standby's look at its cursor store.
            let mut beside = pin!(async {
                tokio::select! {
                    n = keep_shadow(shadow.as_ref(), &handle, &remembered, recollection.clone()) => n,
                    n = deployment::keep(&*backend_for_record, &settings.deployment, policy, &handle, &status, found) => n,
                    n = watch_store(&*store, settings.primary.fingerprint(), &handle, &status) => n,
                }
            });
            tokio::select! {
                r = &mut lead => r,
                () = &mut shutdown => {
                    stop.cancel();
                    lead.await
                }
                never = &mut beside => match never {},
            }
        };
        if let Some(s) = &shadow {
            let _ = save(s, recollect(&handle, &remembered)).await;
        }
        drop(cx);
        follower.abort();
        if let Some(w) = workers {
            w.abort();
        }
        status.update(|s| s.role = Role::Stopped);
        handle.join().await;
        r
    }
}

/// Follows every replica's commits into `m` until aborted (see `follow_commits`).
async fn follow(store: Arc<dyn CursorStore>, m: Arc<Remembered>) {
    store
        .follow_commits(Box::new(move |fp, cursor, reset| {
            if let Ok(mut m) = m.lock() {
                let e = m.entry(fp.to_owned()).or_insert(cursor);
                // A fenced rewind replaces; anything else only moves forward.
                *e = if reset { cursor } else { (*e).max(cursor) };
            }
        }))
        .await;
}

/// Raises the lease fence to what the cursor store has seen (tokens stay above it even if
/// the lease store lost its counter). A store that does not answer at start (down, or
/// refusing the credentials) is waited for, not ready and named on `/readyz`, logged at
/// once and then once a minute, as a standby treats its lease store: the same on every
/// backend (a NATS store had made the process exit, a Redis one waited).
async fn seed_fence(store: &dyn CursorStore, backend: &dyn Backend, status: &StatusHandle) {
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        let r = match store.fence_floor().await {
            Ok(None) => Ok(None),
            Ok(Some(seen)) => {
                backend.seed_fence(seen).await.map(|fence| Some((seen, fence))).map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        match r {
            Ok(seeded) => {
                if let Some((seen, fence)) = seeded {
                    tracing::info!(seen, fence, store = store.name(), "lease fence seeded from the cursor store");
                }
                status.starting_because(None);
                return;
            }
            Err(e) => {
                let why = format!("cannot seed the lease fence from the cursor store: {e}");
                if warned.is_none_or(|w| w.elapsed() >= std::time::Duration::from_mins(1)) {
                    tracing::warn!(store = store.name(), "{why}; retrying every second, logged once a minute");
                    warned = Some(tokio::time::Instant::now());
                }
                status.starting_because(Some(why));
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
}

/// The recollection `shadow` holds; `None` without one, or when it cannot be read (then
/// it is not trusted in part, and logged).
async fn recall(shadow: Option<&Arc<dyn Shadow>>) -> Option<Recollection> {
    let s = shadow?.clone();
    match tokio::task::spawn_blocking(move || s.load()).await {
        Ok(Ok(r)) => {
            if let Some(r) = &r {
                tracing::info!(
                    token = r.token,
                    relays = r.cursors.len(),
                    "remembering the highest token and the cursors this replica saw before"
                );
            }
            r
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "the shadow file cannot be read: starting as a replica that remembers nothing");
            None
        }
        Err(_) => None,
    }
}

/// What this process knows now.
fn recollect(lease: &LeaseHandle, remembered: &Remembered) -> Recollection {
    let cursors = remembered.lock().map(|m| m.iter().map(|(k, v)| (k.clone(), *v)).collect()).unwrap_or_default();
    Recollection { token: lease.seen_token(), cursors }
}

async fn save(shadow: &Arc<dyn Shadow>, r: Recollection) -> Result<(), String> {
    let s = shadow.clone();
    match tokio::task::spawn_blocking(move || s.save(&r)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// Saves what this process knows whenever it changed (checked every second), for as
/// long as the consumer runs.
async fn keep_shadow(
    shadow: Option<&Arc<dyn Shadow>>,
    lease: &LeaseHandle,
    remembered: &Remembered,
    mut saved: Recollection,
) -> std::convert::Infallible {
    let Some(shadow) = shadow else { return std::future::pending().await };
    let mut failing = false;
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let now = recollect(lease, remembered);
        if now == saved {
            continue;
        }
        match save(shadow, now.clone()).await {
            Ok(()) => {
                if std::mem::replace(&mut failing, false) {
                    tracing::info!("the shadow file is written again");
                }
                saved = now;
            }
            Err(e) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(error = %e, "cannot write the shadow file: a restart of this replica after the store lost its data would not know the last token and cursor");
                }
            }
        }
    }
}

/// While standing by, reads the primary relay's cursor every 5 s: a cursor store that
/// does not answer (down, refusing the credentials) means this replica could not lead, so
/// it is not ready, named on `/readyz`, and logged at once and then once a minute. The
/// lease store is watched by the supervisor; this covers a cursor store of its own
/// (Postgres beside a Redis lease). A leader's commits report their own trouble.
async fn watch_store(
    store: &dyn CursorStore,
    fingerprint: &str,
    lease: &LeaseHandle,
    status: &StatusHandle,
) -> std::convert::Infallible {
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        if !matches!(lease.status(), lease::Status::Standby) {
            status.store_trouble(None);
            continue;
        }
        match tokio::time::timeout(std::time::Duration::from_secs(5), store.read(fingerprint)).await {
            Ok(Ok(_)) => {
                if warned.take().is_some() {
                    tracing::info!(store = store.name(), "the cursor store answers again");
                }
                status.store_trouble(None);
            }
            Ok(Err(e)) => trouble(store, &e.to_string(), &mut warned, status),
            Err(_) => trouble(store, "no answer within 5 s", &mut warned, status),
        }
    }
}

/// A standby's cursor store failed: not ready, logged once a minute.
fn trouble(store: &dyn CursorStore, e: &str, warned: &mut Option<tokio::time::Instant>, status: &StatusHandle) {
    if warned.is_none_or(|w| w.elapsed() >= std::time::Duration::from_mins(1)) {
        tracing::warn!(store = store.name(), error = %e, "cannot use the cursor store: this replica could not lead (not ready); checking every 5 s, logged once a minute");
        *warned = Some(tokio::time::Instant::now());
    }
    status.store_trouble(Some(e.to_owned()));
}

async fn lead_loop(cx: &Ctx<'_>, mut events: UnboundedReceiver<LeaseEvent>) -> Result<(), Error> {
    loop {
        let ev = tokio::select! {
            ev = events.recv() => ev,
            () = cx.shutdown.cancelled() => {
                cx.lease.shutdown().await;
                return Ok(());
            }
        };
        match ev {
            Some(LeaseEvent::Elected(term)) => {
                let token = term.token();
                let end = term::run_term(cx, term).await;
                for g in metrics::LEADER_GAUGES {
                    ::metrics::gauge!(*g).set(0.0);
                }
                cx.status.term_over();
                cx.status.update(|s| {
                    s.role = Role::Standby;
                    s.token = None;
                    s.relay = None;
                    s.connected = false;
                });
                match end {
                    TermEnd::Lost => {
                        // If the work side ended the term (a store refused the token), the
                        // supervisor must stop renewing it too.
                        cx.lease.resign().await;
                        tracing::warn!(token, "term over; standing by");
                    }
                    TermEnd::Shutdown(Ok(())) => {
                        tracing::info!(token, "drained, committed and released");
                        return Ok(());
                    }
                    TermEnd::Shutdown(Err(e)) => return Err(Error::StepDown(e)),
                    TermEnd::Fatal(e) => {
                        cx.lease.shutdown().await;
                        return Err(Error::Fatal(e));
                    }
                }
            }
            Some(LeaseEvent::Lost { token, reason }) => {
                tracing::warn!(token, reason = reason.label(), "leadership lost");
            }
            Some(LeaseEvent::Released { token }) => tracing::info!(token, "lease released"),
            None => return Ok(()),
        }
    }
}

/// The resyncer, when repo sync runs: on, and a handler that takes snapshots.
/// Every replica's workers for the shared repo-sync queue (the leader's too), for the life
/// of the process; `None` when repo sync is not shared or this replica takes no jobs.
fn spawn_workers(
    resyncer: Option<&Arc<Resyncer>>,
    settings: &Settings,
    handler: &Arc<dyn Handler>,
    instance: &str,
    clock: &Arc<dyn Clock>,
    status: &StatusHandle,
) -> Option<tokio::task::JoinHandle<()>> {
    let r = resyncer?;
    let queue = r.shared_queue().filter(|_| settings.options.resync.workers > 0)?;
    let w = crate::shared::Workers {
        queue,
        resyncer: r.clone(),
        handler: handler.clone(),
        instance: instance.to_owned(),
        n: settings.options.resync.workers,
        clock: clock.clone(),
        stats: status.sync_workers(),
        idle: settings.options.resync.claim_idle,
    };
    Some(tokio::spawn(Arc::new(w).run()))
}

fn resyncer(
    settings: &Settings,
    handler: &dyn Handler,
    status: &StatusHandle,
    jobs: Option<Arc<dyn checkpoint::JobQueue>>,
) -> Result<Option<Arc<Resyncer>>, Error> {
    let r = &settings.options.resync;
    if !(r.enabled && handler.takes_snapshots()) {
        return Ok(None);
    }
    status.desync().set_resync(r.retry_first, r.retry_max, r.attempts);
    let resolver = settings.options.verify.resolver.clone();
    let mut resyncer = Resyncer::new(r.clone(), resolver, settings.options.collections.clone())?;
    match jobs.filter(|_| r.share) {
        Some(q) if handler.is_shared() => {
            tracing::info!(
                queue = q.name(),
                workers = r.workers,
                "repo sync is shared: the leader publishes repos to fetch to the shared queue, and every replica's workers take them"
            );
            resyncer.share(q, status.sync_workers());
            let _ = status.sync_workers().workers.set(r.workers);
        }
        Some(_) => tracing::info!(
            "repo sync is not shared: the sink is this process's own output, so only the leader fetches repos"
        ),
        None => {}
    }
    Ok(Some(Arc::new(resyncer)))
}

#[cfg(test)]
mod tests {
    /// An embedding service spawns `run` on its runtime: the future must be `Send`.
    /// (An `AsyncFnMut` in the store retry loop once made it not, for every caller.)
    #[test]
    fn run_is_spawnable() {
        fn assert_send<T: Send>(_: &T) {}
        fn check(c: super::Consumer) {
            let fut = c.run(std::future::pending::<()>());
            assert_send(&fut);
        }
        let _ = check;
    }
}
