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
