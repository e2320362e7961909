//! Logs (JSON to stderr; stdout belongs to the jsonl sink), OTLP traces when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and the Prometheus recorder.

use anyhow::{Context, Result};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use opentelemetry::trace::TracerProvider as _;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Keeps the trace exporter alive; flushes on drop.
pub struct Guard(Option<opentelemetry_sdk::trace::SdkTracerProvider>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = p.shutdown();
        }
    }
}

/// The log filter without `RUST_LOG`: firekeeper's own crates at info, the libraries it
/// uses (NATS, Postgres, HTTP, TLS, WebSocket, Redis clients) at warn, so that every CLI
/// call does not print a NATS client's INFO lines.
const DEFAULT_FILTER: &str = "warn,firekeeper=info,consumer=info,lease=info,checkpoint=info,relay_client=info,\
     sinks=info,atproto_identity=info,atproto_repo=info,atproto_crypto=info,guarded_http=info,redis_op=info,nats_op=info";

/// Installs logging and tracing. A command other than `run` (`cursor show`, `lease show`)
/// logs only warnings unless `RUST_LOG` says otherwise: its answer is on stdout.
pub fn init(json: bool, command: bool) -> Result<Guard> {
    // RUST_LOG was validated with the configuration; unset, the libraries say only warnings.
    let filter = match std::env::var("RUST_LOG").ok().filter(|v| !v.trim().is_empty()) {
        Some(v) => EnvFilter::try_new(&v).with_context(|| format!("RUST_LOG={v:?}"))?,
        None if command => EnvFilter::new("warn"),
        None => EnvFilter::new(DEFAULT_FILTER),
    };
    let fmt = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        let ansi = colour(std::io::IsTerminal::is_terminal(&std::io::stderr()), std::env::var_os("NO_COLOR"));
        tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr).boxed()
    };
    let provider = match std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok().filter(|s| !s.is_empty()) {
        Some(_) => {
            // The exporter reads OTEL_EXPORTER_OTLP_* itself (endpoint, headers, timeout).
            let exporter = opentelemetry_otlp::SpanExporter::builder().with_http().build().context("OTLP exporter")?;
            let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "firekeeper".into());
            let resource = opentelemetry_sdk::Resource::builder().with_service_name(name).build();
            Some(
                opentelemetry_sdk::trace::SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(resource)
                    .build(),
            )
        }
        None => None,
    };
    let otel = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("firekeeper")));
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()
        .context("installing the tracing subscriber")?;
    Ok(Guard(provider))
}

/// Text logs are coloured only on a terminal, and never when `NO_COLOR` is set to
/// anything but the empty string (no-color.org): files, pipes and log shippers get plain text.
fn colour(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Installs the Prometheus recorder and returns the handle `/metrics` renders.
/// Every metric is registered (at zero) so that `/metrics`, dashboards and alert rules
/// see each name before its first event.
pub fn metrics() -> Result<PrometheusHandle> {
    // Durations are histograms with buckets (aggregatable across replicas, `histogram_quantile`),
    // not the exporter's default summary: from 1 ms to the longest sane op timeout.
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
        )
        .context("histogram buckets")?
        // A resync takes from milliseconds (a small repo) to many minutes (a giant one).
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(consumer::metrics::RESYNC_SECONDS.into()),
            &[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1800.0],
        )
        .context("histogram buckets")?
        .install_recorder()
        .context("installing the metrics recorder")?;
    consumer::metrics::register(consumer::metrics::ALL);
    consumer::metrics::register(lease::metrics::ALL);
    consumer::metrics::announce_build();
    Ok(handle)
}

/// One summary every `every`: role, relay, events/s the sink took and events/s read from
/// the relay (they differ while the sink falls behind or fails), lag and cursor; in text log mode a
/// human line on stderr (`make run` shows it beside the JSON lines on stdout), in JSON
/// mode a log line with those fields.
pub async fn summary_lines(status: consumer::StatusHandle, every: std::time::Duration, json: bool) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    let mut last = (status.events(), status.written());
    loop {
        tick.tick().await;
        let now = (status.events(), status.written());
        let per_s = |n: u64| n as f64 / every.as_secs_f64();
        let (received, written) = (per_s(now.0 - last.0), per_s(now.1 - last.1));
        last = now;
        let s = status.snapshot();
        let token = s.token.map_or_else(String::new, |t| format!(" token {t}"));
        let relay = s
            .relay
            .map_or_else(String::new, |r| format!(" · relay {r}{}", if s.connected { "" } else { " (connecting)" }));
        let sync = s.repo_sync.filter(consumer::progress::Progress::is_active);
        if json {
            let p = sync.as_ref();
            tracing::info!(
                role = s.role.as_str(),
                token = s.token,
                relay = s.relay.map(relay_client::RelayRole::as_str),
                connected = s.connected,
                written_per_second = written.round(),
                received_per_second = received.round(),
                lag_seconds = s.lag_seconds,
                committed = s.committed,
                repo_sync_queued = p.map(|p| p.queued),
                repo_sync_in_flight = p.map(|p| p.in_flight),
                repo_sync_done = p.map(|p| p.done),
                repo_sync_failed = p.map(|p| p.failed),
                repo_sync_repos_per_second = p.map(|p| p.rates.repos_per_second.round()),
                repo_sync_records_per_second = p.map(|p| p.rates.records_per_second.round()),
                repo_sync_eta_seconds = p.and_then(|p| p.eta_seconds),
                "summary"
            );
            continue;
        }
        let lag = s.lag_seconds.map_or_else(|| "-".to_owned(), |l| format!("{l:.1} s"));
        let cursor = s.committed.map_or_else(|| "none".to_owned(), |c| c.to_string());
        let sync = sync.map_or_else(String::new, |p| format!(" · repo sync {}", p.line()));
        eprintln!(
            "firekeeper: {}{token}{relay} · {written:.0} events/s written ({received:.0}/s received) · lag {lag} · cursor {cursor}{sync}",
            s.role.as_str()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::colour;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())), "an empty NO_COLOR is unset");
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None), "a file or a pipe gets no escapes");
    }

    use std::collections::BTreeSet;
    use std::path::Path;

    fn root() -> &'static Path {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
    }

    /// README's Layout lists exactly the workspace's members, in no particular order.
    #[test]
    fn the_readme_layout_is_the_workspace() {
        let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
        let manifest = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
        let members: BTreeSet<String> = manifest
            .lines()
            .find(|l| l.starts_with("members"))
            .expect("members")
            .split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect();
        let layout = readme.split("## Layout").nth(1).and_then(|l| l.split("```").nth(1)).expect("a Layout block");
        let listed: BTreeSet<String> = layout
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|w| w.starts_with("crates/") || w.starts_with("bin/"))
            .map(str::to_owned)
            .collect();
        assert_eq!(listed, members, "README's Layout and the workspace's members differ");
    }

    /// The README names exactly the metrics the crates define: none undocumented, none
    /// documented that nothing emits.
    #[test]
    fn readme_lists_every_metric_and_only_those() {
        let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
        // Names of Postgres tables (`migrations/*.sql`) are not metrics.
        let mut tables = BTreeSet::new();
        for f in std::fs::read_dir(root().join("migrations")).expect("migrations") {
            let sql = std::fs::read_to_string(f.expect("entry").path()).expect("sql");
            for t in sql.split("CREATE TABLE IF NOT EXISTS ").skip(1) {
                tables.insert(t.split_whitespace().next().unwrap_or_default().to_owned());
            }
        }
        let documented: BTreeSet<String> =
            testkit::metric_names(&readme).into_iter().filter(|n| !tables.contains(n)).collect();
        let defined: BTreeSet<String> =
            consumer::metrics::ALL.iter().chain(lease::metrics::ALL).map(|m| m.name.to_owned()).collect();
        let undocumented: Vec<_> = defined.difference(&documented).collect();
        assert!(undocumented.is_empty(), "metrics missing from the README: {undocumented:?}");
        let unknown: Vec<_> = documented.difference(&defined).collect();
        assert!(unknown.is_empty(), "the README lists metrics no crate defines: {unknown:?}");
    }

    /// A metric name written anywhere but a crate's `metrics.rs` table would bypass the
    /// registration and this README check.
    #[test]
    fn metric_names_are_written_only_in_the_metrics_tables() {
        let mut stray = Vec::new();
        for top in ["crates", "bin"] {
            for krate in std::fs::read_dir(root().join(top)).expect("dir").flatten() {
                // testkit reads metric names (in scrapes and docs); it emits none.
                if krate.file_name() == "testkit" {
                    continue;
                }
                let mut todo = vec![krate.path().join("src")];
                while let Some(d) = todo.pop() {
                    for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                        let p = e.path();
                        if p.is_dir() {
                            todo.push(p);
                        } else if p.extension().is_some_and(|x| x == "rs")
                            && p.file_name().is_some_and(|f| f != "metrics.rs" && f != "telemetry.rs")
                        {
                            let text = std::fs::read_to_string(&p).expect("source");
                            if text.contains("\"firekeeper_") {
                                stray.push(p.display().to_string());
                            }
                        }
                    }
                }
            }
        }
        assert!(stray.is_empty(), "metric names written outside a metrics.rs table: {stray:?}");
    }
}
