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
