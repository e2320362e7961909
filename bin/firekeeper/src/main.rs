//! firekeeper: an AT Protocol firehose consumer with leader election built in.
//!
//! The binary only wires the crates: configuration, telemetry, HTTP, sinks, and the
//! leader's work loop. See `README.md` for the commands and every variable.

mod config;
mod http;
mod sink;
mod stores;
mod telemetry;
mod work;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use checkpoint::ReadOutcome;
use lease::{Backend, BootClock, LeaseEvent, LeaseHandle};
use relay_client::{Item, RelayRole, RelayUrl, Subscription};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::stores::{LeaseBackend, Store};
use crate::work::{Ctx, Shared, TermEnd};

const USAGE: &str = "usage: firekeeper [run]
       firekeeper check-config
       firekeeper cursor show [--relay primary|secondary]
       firekeeper cursor set SEQ [--relay primary|secondary]
       firekeeper lease show
       firekeeper capture FILE [--cursor SEQ] [--limit FRAMES] [--seconds S]
Configuration comes from the environment; see README.md.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("firekeeper: {e}");
            return ExitCode::from(2);
        }
    };
    if args.first().map(String::as_str) == Some("check-config") {
        println!("configuration ok: {}", cfg.summary());
        return ExitCode::SUCCESS;
    }
    if matches!(args.first().map(String::as_str), Some("-h" | "--help" | "help")) {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let guard = match telemetry::init(cfg.log_json) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("firekeeper: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("firekeeper: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(dispatch(cfg, &args));
    drop(guard);
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "firekeeper stopped with an error");
            eprintln!("firekeeper: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn relay_arg(cfg: &Config, args: &[String]) -> Result<(RelayRole, RelayUrl)> {
    let role = match args.iter().position(|a| a == "--relay").and_then(|i| args.get(i + 1)).map(String::as_str) {
        None | Some("primary") => RelayRole::Primary,
        Some("secondary") => RelayRole::Secondary,
        Some(other) => bail!("--relay {other}: expected primary or secondary"),
    };
    let url = match role {
        RelayRole::Primary => cfg.relay.clone(),
        RelayRole::Secondary => cfg.relay_secondary.clone().context("no FIREKEEPER_RELAY_SECONDARY configured")?,
    };
    Ok((role, url))
}

fn flag<T: std::str::FromStr>(args: &[String], name: &str) -> Result<Option<T>> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => {
            let v = args.get(i + 1).with_context(|| format!("{name} needs a value"))?;
            v.parse().map(Some).map_err(|_| anyhow::anyhow!("{name} {v}: not a number"))
        }
    }
}

async fn dispatch(cfg: Config, args: &[String]) -> Result<()> {
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [] | ["run"] => run(cfg).await,
        ["cursor", "show", ..] => {
            let (role, url) = relay_arg(&cfg, args)?;
            let store = Store::open(&cfg).await?;
            let out = store.read(url.fingerprint()).await?;
            let shown = match out {
                ReadOutcome::Found(c) => c.to_string(),
                ReadOutcome::Missing => "none".into(),
                ReadOutcome::Corrupt(v) => format!("corrupt ({v})"),
            };
            println!("{role} {} cursor {shown}", url.fingerprint());
            Ok(())
        }
        ["cursor", "set", seq, ..] => {
            let seq: u64 = seq.parse().with_context(|| format!("cursor set {seq}: not a non-negative integer"))?;
            let (role, url) = relay_arg(&cfg, args)?;
            let store = Store::open(&cfg).await?;
            store.force(url.fingerprint(), seq).await?;
            println!("{role} {} cursor set to {seq}", url.fingerprint());
            Ok(())
        }
        ["lease", "show"] => {
            let snap = match LeaseBackend::new(&cfg)? {
                LeaseBackend::Redis(b) => b.snapshot().await?,
                LeaseBackend::Local(b) => b.snapshot().await?,
            };
            println!(
                "holder {} fence {} fence-seen {} ttl {}",
                snap.holder.as_deref().unwrap_or("none"),
                snap.fence,
                snap.fence_seen,
                snap.ttl.map_or_else(|| "-".into(), |t| format!("{}ms", t.as_millis()))
            );
            Ok(())
        }
        ["capture", file, ..] => capture(&cfg, file, args).await,
        _ => bail!("{USAGE}"),
    }
}

/// Records frames from the primary relay into a file `relay-sim` can replay.
async fn capture(cfg: &Config, file: &str, args: &[String]) -> Result<()> {
    let cursor: Option<u64> = flag(args, "--cursor")?;
    let limit: Option<u64> = flag(args, "--limit")?;
    let seconds: Option<u64> = flag(args, "--seconds")?;
    let mut out = std::io::BufWriter::new(std::fs::File::create(file).with_context(|| format!("creating {file}"))?);
    let mut sub = Subscription::new(cfg.client.clone(), cfg.relay.clone(), None);
    sub.start(RelayRole::Primary, cursor);
    let deadline = seconds.map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
    let mut n = 0u64;
    loop {
        if limit.is_some_and(|l| n >= l) {
            break;
        }
        let next = async { sub.next().await };
        let item = if let Some(d) = deadline {
            match tokio::time::timeout_at(d, next).await {
                Ok(i) => i,
                Err(_) => break,
            }
        } else {
            tokio::select! {
                i = next => i,
                _ = tokio::signal::ctrl_c() => break,
            }
        };
        if let Item::Frame(f) = item? {
            relay_sim::capture::write_frame(&mut out, &f.bytes)?;
            n += 1;
        }
    }
    std::io::Write::flush(&mut out)?;
    eprintln!("captured {n} frames to {file}");
    Ok(())
}

/// First SIGTERM/SIGINT cancels `token` (graceful); a second exits at once.
fn signals(token: CancellationToken) {
    tokio::spawn(async move {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                return;
            }
        };
        for n in 0.. {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            if n == 0 {
                tracing::info!("shutdown requested: draining (signal again to force)");
                token.cancel();
            } else {
                tracing::warn!("second signal: exiting now without a final commit");
                std::process::exit(130);
            }
        }
    });
}

async fn run(cfg: Config) -> Result<()> {
    let prom = telemetry::metrics()?;
    telemetry::register_all();
    let shared = Arc::new(Shared::default());
    if !cfg.log_json {
        tokio::spawn(telemetry::summary_lines(shared.clone(), std::time::Duration::from_secs(5)));
    }
    let stop_http = CancellationToken::new();
    if let Some(addr) = cfg.http_addr {
        let listener =
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("FIREKEEPER_HTTP_ADDR {addr}"))?;
        tracing::info!(%addr, "http listening: /healthz /readyz /metrics /status");
        tokio::spawn(http::serve(listener, shared.clone(), prom, stop_http.clone()));
    }
    if cfg.redis_url.is_none() {
        tracing::warn!(
            "no REDIS_URL: running on embedded defaults (local lease file, file cursor); this instance is not highly available"
        );
    }
    tracing::info!(config = %cfg.summary(), "starting");
    let shutdown = CancellationToken::new();
    signals(shutdown.clone());
    let store = Store::open(&cfg).await?;
    let sink = Arc::new(sink::Sink::open(&cfg).await?);
    let backend = LeaseBackend::new(&cfg)?;
    if let Store::Postgres(pg) = &store {
        // Tokens must stay above what the cursor table has seen, even if the lease
        // store lost its counter.
        let seen = pg.fence_token().await?;
        let fence = match &backend {
            LeaseBackend::Redis(b) => b.seed_fence(seen).await?,
            LeaseBackend::Local(b) => b.seed_fence(seen).await?,
        };
        tracing::info!(seen, fence, "lease fence seeded from the cursor table");
    }
    let instance = cfg.instance_id.clone().unwrap_or_else(uuid_like);
    let clock = Arc::new(BootClock);
    let (handle, events) = match &backend {
        LeaseBackend::Redis(b) => lease::spawn_as(b.clone(), cfg.lease.clone(), clock, &instance)?,
        LeaseBackend::Local(b) => lease::spawn_as(b.clone(), cfg.lease.clone(), clock, &instance)?,
    };
    shared.update(|s| {
        s.role = "standby";
        s.instance.clone_from(&instance);
    });
    shared.ready.store(true, Ordering::Relaxed);
    tracing::info!(instance = %instance, "contending for the lease");
    // Shadow every replica's committed cursors, so that if the store loses its data this
    // process, once leading, resumes where the last leader committed.
    let remembered: Arc<Remembered> = Arc::default();
    let follower = match (&store, &cfg.redis_url) {
        (Store::Redis(s), Some(url)) => {
            let (m, channel) = (remembered.clone(), s.keys().commits_channel.clone());
            Some(tokio::spawn(checkpoint::redis_store::follow_commits(url.clone(), channel, move |p| {
                if let Ok(mut m) = m.lock() {
                    let e = m.entry(p.fingerprint.to_owned()).or_insert(p.cursor);
                    // A fenced rewind replaces; anything else only moves forward.
                    *e = if p.reset { p.cursor } else { (*e).max(p.cursor) };
                }
            })))
        }
        _ => None,
    };
    let r = lead_loop(&cfg, &store, sink, &handle, events, &shutdown, &shared, &remembered).await;
    if let Some(f) = follower {
        f.abort();
    }
    shared.update(|s| s.role = "stopped");
    stop_http.cancel();
    handle.join().await;
    r
}

/// Committed cursors per relay fingerprint, as seen by this process.
type Remembered = std::sync::Mutex<std::collections::HashMap<String, u64>>;

fn uuid_like() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    format!("fk-{:016x}", h.finish())
}

async fn lead_loop(
    cfg: &Config,
    store: &Store,
    sink: Arc<sink::Sink>,
    handle: &LeaseHandle,
    mut events: tokio::sync::mpsc::UnboundedReceiver<LeaseEvent>,
    shutdown: &CancellationToken,
    shared: &Shared,
    remembered: &Remembered,
) -> Result<()> {
    let cx = Ctx { cfg, store, sink, lease: handle, shutdown, shared, remembered };
    loop {
        let ev = tokio::select! {
            ev = events.recv() => ev,
            () = shutdown.cancelled() => {
                handle.shutdown().await;
                return Ok(());
            }
        };
        match ev {
            Some(LeaseEvent::Elected(term)) => {
                let token = term.token();
                let end = work::run_term(&cx, term).await;
                metrics::gauge!("firekeeper_leader").set(0.0);
                shared.update(|s| {
                    s.role = "standby";
                    s.token = None;
                    s.relay = None;
                    s.connected = false;
                });
                match end {
                    TermEnd::Lost => {
                        // If the work side ended the term (a store refused the token), the
                        // supervisor must stop renewing it too.
                        handle.resign().await;
                        tracing::warn!(token, "term over; standing by");
                    }
                    TermEnd::Shutdown(Ok(())) => {
                        tracing::info!(token, "drained, committed and released");
                        return Ok(());
                    }
                    TermEnd::Shutdown(Err(e)) => bail!("step-down was not clean: {e}"),
                    TermEnd::Fatal(e) => {
                        handle.shutdown().await;
                        return Err(e);
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
