//! A small HTTP/1.1 server for `/healthz`, `/readyz`, `/metrics`, `/status` and
//! `/repos/invalid`: GET only,
//! one request per connection, bounded request size and read time.

use std::time::Duration;

use consumer::StatusHandle;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves until `stop` fires.
pub async fn serve(listener: TcpListener, status: StatusHandle, prom: PrometheusHandle, stop: CancellationToken) {
    loop {
        let (mut sock, _) = tokio::select! {
            r = listener.accept() => match r { Ok(s) => s, Err(_) => continue },
            () = stop.cancelled() => return,
        };
        let (status, prom) = (status.clone(), prom.clone());
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
            let (code, ctype, body) = respond(method, path, &status, &prom);
            let head = format!(
                "HTTP/1.1 {code}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

fn respond(
    method: &str,
    path: &str,
    status: &StatusHandle,
    prom: &PrometheusHandle,
) -> (&'static str, &'static str, String) {
    if method != "GET" {
        return ("405 Method Not Allowed", "text/plain", "GET only\n".into());
    }
    match path.split('?').next().unwrap_or("") {
        "/healthz" => ("200 OK", "text/plain", "ok\n".into()),
        "/readyz" => match status.not_ready_reason() {
            None => ("200 OK", "text/plain", "ready\n".into()),
            Some(why) => ("503 Service Unavailable", "text/plain", format!("not ready: {why}\n")),
        },
        "/metrics" => ("200 OK", "text/plain; version=0.0.4", prom.render()),
        "/status" => {
            ("200 OK", "application/json", serde_json::to_string(&status.snapshot()).unwrap_or_default() + "\n")
        }
        "/repos/invalid" => {
            let v = serde_json::json!({ "role": status.snapshot().role, "repos": status.desynchronized() });
            ("200 OK", "application/json", v.to_string() + "\n")
        }
        _ => ("404 Not Found", "text/plain", "not found\n".into()),
    }
}
