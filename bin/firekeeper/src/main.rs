//! firekeeper: an AT Protocol firehose consumer with leader election built in.
//!
//! A thin shell over the `consumer` crate: environment → configuration → builder → run,
//! plus telemetry, HTTP and the operator commands. See `README.md`.

mod advice;
mod cli;
mod commands;
mod config;
mod http;
mod output;
mod settings;
mod shutdown;
mod stores;
mod telemetry;

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::cli::{Cli, Command, CursorAction, LeaseAction, ReposAction};
use crate::config::Config;

/// jemalloc: the pipeline allocates events on the thread that reads the socket and frees
/// them on the lanes' threads, which glibc's malloc serialises on its arena locks. Its
/// defaults (`.cargo/config.toml`) return freed pages within half a second, keeping the
/// resident size near glibc's; `_RJEM_MALLOC_CONF` overrides them at run time.
#[cfg(unix)]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Some(Command::Settings)) {
        return finish(output::write(&settings::markdown_table()).context("writing to standard output"), false);
    }
    let cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("firekeeper: {e}");
            return ExitCode::from(2);
        }
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Some(p) = &cfg.redis_ca_file {
        // Checked readable and PEM by the configuration; read once for every connection.
        let trusted = std::fs::read(p).map_err(|e| e.to_string()).and_then(redis_op::trust_ca_pem);
        if let Err(e) = trusted {
            eprintln!("firekeeper: FIREKEEPER_REDIS_CA_FILE {}: {e}", p.display());
            return ExitCode::from(2);
        }
    }
    if matches!(cli.command, Some(Command::CheckConfig)) {
        return finish(check_config(&cfg), false);
    }
    let json = cfg.log_json;
    let command = cli.command.unwrap_or(Command::Run);
    let r = telemetry::init(json, !matches!(command, Command::Run)).and_then(|guard| {
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")?;
        let r = rt.block_on(dispatch(cfg, command));
        drop(guard);
        r
    });
    finish(r, json)
}

/// The exit: 0, quietly when the reader of stdout went away (`| head -1`); else the
/// error once, as a JSON log line under `FIREKEEPER_LOG_FORMAT=json` or as text with
/// what to do, and 1.
fn finish(r: Result<()>, json: bool) -> ExitCode {
    let Err(e) = r else { return ExitCode::SUCCESS };
    if output::reader_gone(&e) {
        return ExitCode::SUCCESS;
    }
    let hint = advice::advice(&e);
    // The whole chain, each cause once (a library error's message already holds its own).
    let said = causes::Report(e.as_ref()).to_string();
    if json {
        tracing::error!(error = %said, hint, "firekeeper stopped with an error");
    } else {
        eprintln!("firekeeper: {said}");
        if let Some(h) = hint {
            eprintln!("  what to do: {h}");
        }
    }
    ExitCode::FAILURE
}

/// `check-config`: the summary, every setting's effective value, look-alike variables and
/// what Redis keeps across a restart.
fn check_config(cfg: &Config) -> Result<()> {
    use std::fmt::Write as _;
    let vars = std::env::vars().collect();
    let mut out = format!("configuration ok: {}\n", cfg.summary());
    for line in settings::effective(&vars, &cfg.derived()) {
        let _ = writeln!(out, "  {line}");
    }
    for (set, meant) in settings::lookalikes(&vars) {
        let _ = writeln!(out, "warning: {set} is set but is not a firekeeper setting: did you mean {meant}?");
    }
    for w in cfg.warnings(&vars) {
        let _ = writeln!(out, "warning: {w}");
    }
    if let Some(p) = check_redis(cfg) {
        match p {
            Ok(fine) => out.push_str(&fine),
            Err(warning) => {
                let _ = write!(out, "warning: {warning}");
            }
        }
        out.push('\n');
    }
    output::write(&out).context("writing to standard output")
}

/// `check-config`'s question to Redis about persistence, on a runtime of its own.
fn check_redis(cfg: &Config) -> Option<Result<String, String>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
    rt.block_on(stores::redis_persistence(cfg))
}

async fn dispatch(cfg: Config, command: Command) -> Result<()> {
    match command {
        Command::Run => Box::pin(run(cfg)).await,
        Command::CheckConfig | Command::Settings => Ok(()),
        Command::Cursor { action: CursorAction::Show { relay } } => commands::cursor_show(&cfg, relay).await,
        Command::Cursor { action: CursorAction::Set { seq, relay, force } } => {
            commands::cursor_set(&cfg, relay, seq, force).await
        }
        Command::Lease { action: LeaseAction::Show } => commands::lease_show(&cfg).await,
        Command::Repos { action: ReposAction::List { state, addr } } => commands::repos_list(&cfg, &state, addr).await,
        Command::Repos { action: ReposAction::Show { did, addr } } => commands::repos_show(&cfg, &did, addr).await,
        Command::Repos { action: ReposAction::Resync { dids, addr } } => {
            commands::repos_resync(&cfg, &dids, addr).await
        }
        Command::Repos { action: ReposAction::Progress { addr, every } } => {
            commands::repos_progress(&cfg, addr, every).await
        }
        Command::Repos { action: ReposAction::Check { did } } => commands::repo_check(&cfg, &did).await,
        Command::Capture { file, cursor, limit, seconds } => {
            commands::capture(&cfg, &file, cursor, limit, seconds).await
        }
    }
}

async fn run(cfg: Config) -> Result<()> {
    // Listen for SIGTERM before anything can make this replica visible (its lease).
    let stop = shutdown::listen();
    let prom = telemetry::metrics()?;
    if cfg.lease_backend == config::LeaseKind::Local {
        tracing::warn!(
            "no REDIS_URL or NATS_URL: running on embedded defaults (local lease file, file cursor); this instance is not highly available"
        );
    }
    tracing::info!(config = %cfg.summary(), "starting");
    for w in cfg.warnings(&std::env::vars().collect()) {
        tracing::warn!("{w}");
    }
    match stores::redis_persistence(&cfg).await {
        Some(Ok(fine)) => tracing::info!("{fine}"),
        Some(Err(warning)) => tracing::warn!("{warning}"),
        None => {}
    }
    let mut builder = consumer::Builder::new(cfg.relay.clone())
        .secondary(cfg.relay_secondary.clone())
        .client(cfg.client.clone())
        .options(cfg.options.clone())
        .shared_store(stores::open_store(&cfg).await?)
        .shared_handler(stores::open_sink(&cfg).await?)
        .jobs(stores::open_jobs(&cfg).await?)
        .shadow(Some(Arc::new(consumer::ShadowFile::new(&stores::shadow_file(&cfg)))))
        .deployment(cfg.deployment())
        .allow_settings_change(cfg.allow_settings_change);
    if let Some(id) = &cfg.instance_id {
        builder = builder.instance_id(id);
    }
    let consumer = builder.lease(stores::open_lease(&cfg).await?, cfg.lease.clone()).build()?;
    let status = consumer.status();
    tokio::spawn(telemetry::summary_lines(status.clone(), std::time::Duration::from_secs(5), cfg.log_json));
    let stop_http = CancellationToken::new();
    if let Some(addr) = cfg.http_addr {
        let listener =
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("FIREKEEPER_HTTP_ADDR {addr}"))?;
        let admin = cfg.admin_token.clone();
        let posts = if admin.is_some() { "; POST /repos/resync (token)" } else { "" };
        tracing::info!(%addr, "http listening: /healthz /readyz /metrics /status /repos/invalid{posts}");
        tokio::spawn(http::serve(listener, http::Served { status, prom, admin }, stop_http.clone()));
    }
    let r = Box::pin(consumer.run(stop)).await;
    stop_http.cancel();
    Ok(r?)
}
