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

/// Installs logging and tracing.
pub fn init(json: bool) -> Result<Guard> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer().with_writer(std::io::stderr).boxed()
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

/// Installs the Prometheus recorder and returns the handle `/metrics` renders.
pub fn metrics() -> Result<PrometheusHandle> {
    PrometheusBuilder::new().install_recorder().context("installing the metrics recorder")
}

/// Every metric firekeeper emits, with its help text: registered at startup (at zero) so
/// that `/metrics`, dashboards and alert rules see each name before its first event.
/// The dashboard/rules test checks `deploy/` against what `/metrics` then shows.
pub fn register_all() {
    use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge};
    let counters: &[(&str, &str, &[(&str, &str)])] = &[
        ("firekeeper_events_total", "events handed to the sink, by type", &[("type", "#commit")]),
        ("firekeeper_commits_total", "cursor commits, by outcome", &[("outcome", "saved")]),
        ("firekeeper_reconnects_total", "relay connections that ended", &[("relay", "primary"), ("reason", "none")]),
        ("firekeeper_relay_switches_total", "relay switches", &[("to", "secondary"), ("kind", "failover")]),
        ("firekeeper_error_frames_total", "error frames from the relay", &[("error", "none")]),
        ("firekeeper_bad_frames_total", "undecodable frames", &[("reason", "none"), ("action", "skipped")]),
        ("firekeeper_gaps_total", "gaps accepted in the stream", &[("reason", "future_cursor")]),
        ("firekeeper_seq_backwards_total", "times the relay's seq went backwards", &[]),
        ("firekeeper_outdated_cursor_total", "OutdatedCursor notices (events were missed)", &[]),
        ("firekeeper_record_errors_total", "records that could not be decoded (written as null)", &[]),
        ("firekeeper_sink_errors_total", "failed sink writes (retried)", &[]),
        ("firekeeper_lease_transitions_total", "lease role changes", &[("to", "standby"), ("reason", "start")]),
        ("firekeeper_lease_renew_errors_total", "failed lease renewals", &[("reason", "timeout")]),
        ("firekeeper_lease_retakes_total", "vanished lease keys retaken with the same token", &[]),
    ];
    for (name, help, labels) in counters {
        describe_counter!(*name, *help);
        let labels: Vec<metrics::Label> = labels.iter().map(|(k, v)| metrics::Label::new(*k, *v)).collect();
        counter!(*name, labels).increment(0);
    }
    let gauges = [
        ("firekeeper_leader", "1 while this replica leads"),
        ("firekeeper_lag_seconds", "age of the newest delivered event (relay time to now)"),
        ("firekeeper_lag_seq", "delivered minus committed seq"),
        ("firekeeper_queue_depth", "events delivered and not yet done"),
        ("firekeeper_relay_on_secondary", "1 while the leader consumes from the secondary relay"),
    ];
    for (name, help) in gauges {
        describe_gauge!(name, help);
        gauge!(name).set(0.0);
    }
    describe_histogram!("firekeeper_lease_renew_seconds", "lease renewal round trips");
}

/// In text log mode, one human line on stderr every `every`: role, relay, events/s, lag
/// and cursor (`make run` shows this beside the JSON lines on stdout).
pub async fn summary_lines(shared: std::sync::Arc<crate::work::Shared>, every: std::time::Duration) {
    use std::sync::atomic::Ordering;
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    let mut last = shared.events.load(Ordering::Relaxed);
    loop {
        tick.tick().await;
        let now = shared.events.load(Ordering::Relaxed);
        let rate = (now - last) as f64 / every.as_secs_f64();
        last = now;
        let s = shared.snapshot();
        let token = s.token.map_or_else(String::new, |t| format!(" token {t}"));
        let relay = s
            .relay
            .map_or_else(String::new, |r| format!(" · relay {r}{}", if s.connected { "" } else { " (connecting)" }));
        let lag = s.lag_seconds.map_or_else(|| "-".to_owned(), |l| format!("{l:.1} s"));
        let cursor = s.committed.map_or_else(|| "none".to_owned(), |c| c.to_string());
        eprintln!("firekeeper: {}{token}{relay} · {rate:.0} events/s · lag {lag} · cursor {cursor}", s.role);
    }
}
