//! A small HTTP/1.1 server for `/healthz`, `/readyz`, `/metrics` and `/status`: GET only,
//! one request per connection, bounded request size and read time.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::work::Shared;

/// Serves until `stop` fires.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>, prom: PrometheusHandle, stop: CancellationToken) {
    loop {
        let (mut sock, _) = tokio::select! {
            r = listener.accept() => match r { Ok(s) => s, Err(_) => continue },
            () = stop.cancelled() => return,
        };
        let (shared, prom) = (shared.clone(), prom.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while n < buf.len() {
                    match sock.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => n += k,
                    }
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            })
            .await;
            if read.is_err() {
                return;
            }
            let req = String::from_utf8_lossy(&buf[..n]);
            let mut parts = req.split_whitespace();
            let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let (status, ctype, body) = respond(method, path, &shared, &prom);
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

fn respond(method: &str, path: &str, shared: &Shared, prom: &PrometheusHandle) -> (&'static str, &'static str, String) {
    if method != "GET" {
        return ("405 Method Not Allowed", "text/plain", "GET only\n".into());
    }
    match path.split('?').next().unwrap_or("") {
        "/healthz" => ("200 OK", "text/plain", "ok\n".into()),
        "/readyz" => {
            if shared.ready.load(Ordering::Relaxed) {
                ("200 OK", "text/plain", "ready\n".into())
            } else {
                ("503 Service Unavailable", "text/plain", "not ready\n".into())
            }
        }
        "/metrics" => ("200 OK", "text/plain; version=0.0.4", prom.render()),
        "/status" => {
            let s = shared.snapshot();
            ("200 OK", "application/json", serde_json::to_string(&s).unwrap_or_default() + "\n")
        }
        _ => ("404 Not Found", "text/plain", "not found\n".into()),
    }
}
