//! The operator commands: `cursor show|set`, `lease show`, `repos invalid`, `capture`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use checkpoint::ReadOutcome;
use relay_client::{Item, RelayRole, RelayUrl, Subscription};

use crate::cli::Relay;
use crate::config::Config;
use crate::stores::{open_lease, open_store};

fn relay(cfg: &Config, r: Relay) -> Result<(RelayRole, &RelayUrl)> {
    let role = RelayRole::from(r);
    let url = match role {
        RelayRole::Primary => &cfg.relay,
        RelayRole::Secondary => cfg.relay_secondary.as_ref().context("no FIREKEEPER_RELAY_SECONDARY configured")?,
    };
    Ok((role, url))
}

/// Prints a relay's stored cursor.
pub async fn cursor_show(cfg: &Config, r: Relay) -> Result<()> {
    let (role, url) = relay(cfg, r)?;
    let shown = match open_store(cfg).await?.read(url.fingerprint()).await? {
        ReadOutcome::Found(c) => c.to_string(),
        ReadOutcome::Missing => "none".into(),
        ReadOutcome::Corrupt(v) => format!("corrupt ({v})"),
    };
    println!("{role} {} cursor {shown}", url.fingerprint());
    Ok(())
}

/// Sets a relay's cursor, unfenced.
pub async fn cursor_set(cfg: &Config, r: Relay, seq: u64) -> Result<()> {
    let (role, url) = relay(cfg, r)?;
    open_store(cfg).await?.force(url.fingerprint(), seq).await?;
    println!("{role} {} cursor set to {seq}", url.fingerprint());
    Ok(())
}

/// Prints the lease state.
pub async fn lease_show(cfg: &Config) -> Result<()> {
    let snap = open_lease(cfg).await?.snapshot().await?;
    println!(
        "holder {} fence {} fence-seen {} ttl {}",
        snap.holder.as_deref().unwrap_or("none"),
        snap.fence,
        snap.fence_seen,
        snap.ttl.map_or_else(|| "-".into(), |t| format!("{}ms", t.as_millis()))
    );
    Ok(())
}

/// Prints the desynchronised repos a running replica lists at `/repos/invalid`.
pub async fn repos_invalid(cfg: &Config, addr: Option<std::net::SocketAddr>) -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut addr = addr.or(cfg.http_addr).context("no --addr and FIREKEEPER_HTTP_ADDR is off")?;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let mut s = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .context("connecting timed out")?
        .with_context(|| format!("connecting to {addr}"))?;
    s.write_all(b"GET /repos/invalid HTTP/1.1\r\nhost: firekeeper\r\nconnection: close\r\n\r\n").await?;
    let mut buf = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut buf)).await.context("reading timed out")??;
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b).context("not an HTTP answer")?;
    let v: serde_json::Value = serde_json::from_str(body).context("not the JSON of /repos/invalid")?;
    let role = v["role"].as_str().unwrap_or("unknown");
    if role != "leader" {
        eprintln!("that replica is {role}: only the leader verifies; ask the leader");
    }
    for r in v["repos"].as_array().into_iter().flatten() {
        println!(
            "{} seq {} {} rev {}",
            r["repo"].as_str().unwrap_or("?"),
            r["seq"],
            r["reason"].as_str().unwrap_or("?"),
            r["rev"].as_str().unwrap_or("-")
        );
    }
    Ok(())
}

/// Records frames from the primary relay into a file `relay-sim` can replay.
pub async fn capture(
    cfg: &Config,
    file: &Path,
    cursor: Option<u64>,
    limit: Option<u64>,
    seconds: Option<u64>,
) -> Result<()> {
    let shown = file.display();
    let mut out = std::io::BufWriter::new(std::fs::File::create(file).with_context(|| format!("creating {shown}"))?);
    let mut sub = Subscription::new(cfg.client.clone(), cfg.relay.clone(), None);
    sub.start(RelayRole::Primary, cursor);
    let deadline = seconds.map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
    let mut n = 0u64;
    while limit.is_none_or(|l| n < l) {
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
            relay_client::capture::write_frame(&mut out, f.bytes())?;
            n += 1;
        }
    }
    std::io::Write::flush(&mut out)?;
    eprintln!("captured {n} frames to {shown}");
    Ok(())
}
