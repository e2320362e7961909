//! A small HTTP/1.1 server for `/healthz`, `/readyz`, `/metrics`, `/status` and
//! `/repos/invalid` (GET, read-only), and `POST /repos/resync`, the one endpoint that
//! changes state: it demands `FIREKEEPER_ADMIN_TOKEN` and is off without it. One request
//! per connection, bounded request size and read time.

use std::time::Duration;

use consumer::StatusHandle;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The bearer token of the state-changing endpoint (never printed: `Debug` redacts it).
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(pub String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

impl AdminToken {
    /// Compares in time independent of where the first difference is.
    fn admits(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
    }
}

/// DIDs taken by one `POST /repos/resync` at most.
pub const RESYNC_MAX_DIDS: usize = 100;

/// How long `POST /repos/resync` waits for the store to keep what it queued.
const KEPT_WAIT: Duration = Duration::from_secs(10);

/// What the server answers from.
#[derive(Clone)]
pub struct Served {
    /// The consumer's status (and its resync queue).
    pub status: StatusHandle,
    /// The metrics.
    pub prom: PrometheusHandle,
    /// `FIREKEEPER_ADMIN_TOKEN`.
    pub admin: Option<AdminToken>,
}

/// Serves until `stop` fires.
pub async fn serve(listener: TcpListener, served: Served, stop: CancellationToken) {
    loop {
        let (mut sock, _) = tokio::select! {
            r = listener.accept() => match r { Ok(s) => s, Err(_) => continue },
            () = stop.cancelled() => return,
        };
        let served = served.clone();
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
            let (code, ctype, body) = respond(&req, &served).await;
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

/// An answer: status line, content type, body.
type Answer = (&'static str, &'static str, String);

async fn respond(req: &str, served: &Served) -> Answer {
    let mut parts = req.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    match (method, path) {
        ("POST", "/repos/resync") => resync(req, query, served).await,
        (_, "/repos/resync") => ("405 Method Not Allowed", "text/plain", "POST only\n".into()),
        ("GET", _) => get(path, query, served),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
    }
}

fn get(path: &str, query: &str, served: &Served) -> Answer {
    let status = &served.status;
    match path {
        "/healthz" => ("200 OK", "text/plain", "ok\n".into()),
        "/readyz" => match status.not_ready_reason() {
            None => ("200 OK", "text/plain", "ready\n".into()),
            Some(why) => ("503 Service Unavailable", "text/plain", format!("not ready: {why}\n")),
        },
        "/metrics" => ("200 OK", "text/plain; version=0.0.4", served.prom.render()),
        "/status" => {
            ("200 OK", "application/json", serde_json::to_string(&status.snapshot()).unwrap_or_default() + "\n")
        }
        "/repos/invalid" => {
            // `?state=` and `?did=` (repeatable) narrow the list.
            let (mut wanted_states, mut wanted_dids) = (Vec::new(), Vec::new());
            for (k, v) in params(query) {
                match k.as_str() {
                    "state" => wanted_states.push(v),
                    "did" => wanted_dids.push(v),
                    _ => {}
                }
            }
            let repos: Vec<_> = status
                .desynchronized()
                .into_iter()
                .filter(|d| wanted_states.is_empty() || wanted_states.iter().any(|s| s == d.state))
                .filter(|d| wanted_dids.is_empty() || wanted_dids.contains(&d.repo))
                .collect();
            let v = serde_json::json!({ "role": status.snapshot().role, "repos": repos });
            ("200 OK", "application/json", v.to_string() + "\n")
        }
        _ => ("404 Not Found", "text/plain", "not found\n".into()),
    }
}

/// `POST /repos/resync?did=…&did=…` with `authorization: Bearer <FIREKEEPER_ADMIN_TOKEN>`:
/// queues each repo's resync on the leader and answers once the store keeps them.
async fn resync(req: &str, query: &str, served: &Served) -> Answer {
    let Some(admin) = &served.admin else {
        return (
            "403 Forbidden",
            "text/plain",
            "state-changing endpoints are off on this replica: set FIREKEEPER_ADMIN_TOKEN to use them\n".into(),
        );
    };
    let presented = req
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
        .and_then(|(_, v)| v.trim().strip_prefix("Bearer ").map(str::trim));
    if !presented.is_some_and(|p| admin.admits(p)) {
        tracing::warn!("POST /repos/resync refused: no or a wrong bearer token");
        return ("401 Unauthorized", "text/plain", "a bearer token (FIREKEEPER_ADMIN_TOKEN) is needed\n".into());
    }
    let dids: Vec<String> = params(query).into_iter().filter(|(k, _)| k == "did").map(|(_, v)| v).collect();
    if dids.is_empty() || dids.len() > RESYNC_MAX_DIDS {
        return (
            "400 Bad Request",
            "text/plain",
            format!("name 1 to {RESYNC_MAX_DIDS} repos: ?did=<did>&did=<did>…\n"),
        );
    }
    if let Some(bad) = dids.iter().find(|d| !is_did(d)) {
        return ("400 Bad Request", "text/plain", format!("not a did:plc or did:web DID: {bad:?}\n"));
    }
    let done = match served.status.request_resync(&dids) {
        Ok(done) => done,
        Err(e) => return ("409 Conflict", "text/plain", format!("{e}\n")),
    };
    for (did, d) in dids.iter().zip(&done) {
        tracing::info!(repo = did, outcome = d.as_str(), "an operator asked for a resync of the repo");
    }
    let kept = served.status.kept(&dids, KEPT_WAIT).await;
    let repos: Vec<_> =
        dids.iter().zip(&done).map(|(did, d)| serde_json::json!({ "repo": did, "outcome": d.as_str() })).collect();
    let v = serde_json::json!({ "kept": kept, "repos": repos });
    let code = if kept { "200 OK" } else { "202 Accepted" };
    (code, "application/json", v.to_string() + "\n")
}

/// A DID firekeeper can resolve: `did:plc:` or `did:web:`, printable, bounded.
fn is_did(s: &str) -> bool {
    (s.starts_with("did:plc:") || s.starts_with("did:web:"))
        && s.len() <= 2048
        && s.len() > 8
        && s.bytes().all(|b| b.is_ascii_graphic())
}

/// The query's `key=value` pairs, percent-decoded.
fn params(query: &str) -> Vec<(String, String)> {
    url::form_urlencoded::parse(query.as_bytes()).into_owned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_admits_only_itself() {
        let t = AdminToken("s3cret".into());
        assert!(t.admits("s3cret"));
        for wrong in ["", "s3cre", "s3crex", "S3cret", "s3cret "] {
            assert!(!t.admits(wrong), "{wrong:?}");
        }
        assert!(!format!("{t:?}").contains("s3cret"));
    }

    fn served(admin: Option<&str>) -> Served {
        let prom = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder().handle();
        Served { status: StatusHandle::default(), prom, admin: admin.map(|t| AdminToken(t.into())) }
    }

    /// The state-changing endpoint: off without a token (403), 401 without the right
    /// one, 400 for what is not a DID, 409 on a replica that does not lead; POST only,
    /// and every other endpoint GET only.
    #[tokio::test]
    async fn resync_requests_are_refused_unless_authorised_and_on_the_leader() {
        let post = |auth: &str, q: &str| format!("POST /repos/resync?{q} HTTP/1.1\r\nhost: x\r\n{auth}\r\n");
        let ok = "authorization: Bearer tok\r\n";
        let (code, _, body) = respond(&post(ok, "did=did:plc:a"), &served(None)).await;
        assert_eq!(code, "403 Forbidden");
        assert!(body.contains("FIREKEEPER_ADMIN_TOKEN"), "{body}");
        for auth in ["", "authorization: Bearer tok2\r\n", "authorization: tok\r\n"] {
            let (code, _, _) = respond(&post(auth, "did=did:plc:a"), &served(Some("tok"))).await;
            assert_eq!(code, "401 Unauthorized", "{auth:?}");
        }
        let (code, _, body) = respond(&post(ok, "did=at%3A%2F%2Fx"), &served(Some("tok"))).await;
        assert_eq!(code, "400 Bad Request", "{body}");
        assert_eq!(respond(&post(ok, ""), &served(Some("tok"))).await.0, "400 Bad Request");
        let (code, _, body) = respond(&post(ok, "did=did:plc:a"), &served(Some("tok"))).await;
        assert_eq!(code, "409 Conflict");
        assert!(body.contains("starting, not the leader"), "{body}");
        let get = "GET /repos/resync?did=did:plc:a HTTP/1.1\r\n\r\n";
        assert_eq!(respond(get, &served(Some("tok"))).await.0, "405 Method Not Allowed");
        assert_eq!(respond("POST /status HTTP/1.1\r\n\r\n", &served(Some("tok"))).await.0, "405 Method Not Allowed");
    }

    #[test]
    fn query_params_are_percent_decoded() {
        assert_eq!(
            params("did=did%3Aweb%3Alocalhost%253A8080&state=gone&x"),
            vec![
                ("did".into(), "did:web:localhost%3A8080".into()),
                ("state".into(), "gone".into()),
                ("x".into(), String::new())
            ]
        );
        assert_eq!(params("x=a%2"), vec![("x".into(), "a%2".into())], "a malformed escape is kept as it is");
        assert!(is_did("did:plc:abc") && !is_did("did:key:z") && !is_did("did:plc:a b"));
    }
}
