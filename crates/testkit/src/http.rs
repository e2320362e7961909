//! Minimal HTTP/1.1 for tests: a GET against `/status` or `/metrics`, and reading the
//! requests a test webhook receiver gets.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `GET path` on `addr`: the status code and body, `None` when nothing answers in 500 ms.
pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s =
        tokio::time::timeout(Duration::from_millis(500), tokio::net::TcpStream::connect(addr)).await.ok()?.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes()).await.ok()?;
    let mut buf = String::new();
    tokio::time::timeout(Duration::from_millis(500), s.read_to_string(&mut buf)).await.ok()?.ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, buf.split_once("\r\n\r\n")?.1.to_owned()))
}

/// Reads one HTTP request from `s` and returns its body; bytes of a following request
/// stay in `pending`. `None` when the peer closed. For the test webhook receivers.
pub async fn read_request(s: &mut tokio::net::TcpStream, pending: &mut Vec<u8>) -> Option<Vec<u8>> {
    read_request_with_line(s, pending).await.map(|(_, body)| body)
}

/// [`read_request`], also returning the request line (`POST /hook HTTP/1.1`).
pub async fn read_request_with_line(s: &mut tokio::net::TcpStream, pending: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        if let Some(i) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&pending[..i]).into_owned();
            let len: usize = head
                .to_lowercase()
                .lines()
                .find_map(|l| l.strip_prefix("content-length:").map(str::to_owned))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if pending.len() >= i + 4 + len {
                let line = head.lines().next().unwrap_or_default().to_owned();
                let body = pending[i + 4..i + 4 + len].to_vec();
                pending.drain(..i + 4 + len);
                return Some((line, body));
            }
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(k) => pending.extend_from_slice(&chunk[..k]),
        }
    }
}

/// A webhook receiver that answers every request 200 and keeps the bodies, in the order
/// it took them.
#[derive(Debug, Clone)]
pub struct Collector {
    /// Where to POST.
    pub url: String,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Collector {
    /// Listens on a free loopback port.
    ///
    /// # Panics
    /// When it cannot listen.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = bodies.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    let mut pending = Vec::new();
                    while let Some(body) = read_request(&mut s, &mut pending).await {
                        kept.lock().expect("bodies").push(String::from_utf8_lossy(&body).into_owned());
                        if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { url, bodies }
    }

    /// Every body taken so far, joined (JSON lines).
    ///
    /// # Panics
    /// When a receiving task panicked.
    #[must_use]
    pub fn text(&self) -> String {
        self.bodies.lock().expect("bodies").concat()
    }
}
