//! The operator commands: `cursor show|set`, `lease show`, `repos list|show|resync|check`, `capture`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use checkpoint::ReadOutcome;
use relay_client::{Item, RelayRole, RelayUrl, Subscription};

use crate::cli::{QueueState, Relay};
use crate::config::{Config, StoreKind};
use crate::output::say;
use crate::stores::{open_lease, open_store};

fn relay(cfg: &Config, r: Relay) -> Result<(RelayRole, &RelayUrl)> {
    let role = RelayRole::from(r);
    let url = match role {
        RelayRole::Primary => &cfg.relay,
        RelayRole::Secondary => cfg.relay_secondary.as_ref().context("no FIREKEEPER_RELAY_SECONDARY configured")?,
    };
    Ok((role, url))
}

/// A stored cursor as the commands print it: the seq, `none` or `corrupt (…)`.
fn shown(o: ReadOutcome) -> String {
    match o {
        ReadOutcome::Found(c) => c.to_string(),
        ReadOutcome::Missing => "none".into(),
        ReadOutcome::Corrupt(v) => format!("corrupt ({v})"),
    }
}

/// Prints a relay's stored cursor.
pub async fn cursor_show(cfg: &Config, r: Relay) -> Result<()> {
    let (role, url) = relay(cfg, r)?;
    let shown = shown(open_store(cfg).await?.read(url.fingerprint()).await?);
    say!("{role} {} cursor {shown}", url.fingerprint())
}

/// Sets a relay's cursor, unfenced: says which store, relay and value it wrote, and
/// refuses to write under a running leader (which would overwrite it within a second)
/// unless `force`, or into the embedded file store while a variable that looks like
/// another store's is set (`REDIS_ULR`).
pub async fn cursor_set(cfg: &Config, r: Relay, seq: u64, force: bool) -> Result<()> {
    let (role, url) = relay(cfg, r)?;
    let vars: std::collections::HashMap<String, String> = std::env::vars().collect();
    if cfg.store == StoreKind::File && !vars.contains_key("FIREKEEPER_CURSOR_STORE") {
        let near = crate::settings::lookalikes(&vars);
        if !near.is_empty() {
            let named: Vec<String> = near.iter().map(|(set, meant)| format!("{set} (meant {meant}?)")).collect();
            bail!(
                "no REDIS_URL, NATS_URL or FIREKEEPER_CURSOR_STORE, so this would write the local file store in {},                  but {} is set: fix the variable's name, or set FIREKEEPER_CURSOR_STORE=file to mean the file store",
                absolute(&cfg.data_dir),
                named.join(", ")
            );
        }
    }
    let lease = open_lease(cfg).await?.snapshot().await?;
    let running = lease.holder.as_deref();
    if let Some(holder) = running
        && !force
    {
        bail!(
            "a leader is running ({holder}, fence {}): it commits its own cursor within a second and would              overwrite this one; stop every replica first (or pass --force to write anyway)",
            lease.fence
        );
    }
    let store = open_store(cfg).await?;
    let before = shown(store.read(url.fingerprint()).await?);
    store.force(url.fingerprint(), seq).await?;
    say!(
        "{role} relay {} (fingerprint {}): cursor set to {seq} (was {before}) in {}",
        url.redacted(),
        url.fingerprint(),
        describe_store(cfg)
    )?;
    if let Some(holder) = running {
        eprintln!("warning: the running leader {holder} will commit over this unless it stops first");
    }
    Ok(())
}

/// Where the cursors live, for an operator: the store kind and its address without
/// credentials (or the file store's absolute path).
pub fn describe_store(cfg: &Config) -> String {
    let prefix = &cfg.lease.key_prefix;
    match cfg.store {
        StoreKind::Redis => {
            format!(
                "the redis store {} (key prefix {prefix})",
                cfg.redis_url.as_deref().map_or_else(String::new, address)
            )
        }
        StoreKind::Nats => format!(
            "the nats store {} (key prefix {prefix})",
            cfg.nats.as_ref().map_or_else(String::new, |n| nats_op::redact(&n.url))
        ),
        StoreKind::File => format!("the file store {}", absolute(&cfg.data_dir.join("cursors"))),
        StoreKind::Postgres => {
            format!("the postgres store {}", cfg.database_url.as_deref().map_or_else(String::new, address))
        }
    }
}

/// A URL shown with scheme, host, port and path: no user, password or query.
fn address(raw: &str) -> String {
    crate::settings::address(raw).unwrap_or_else(|| "(not a URL)".into())
}

fn absolute(p: &Path) -> String {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string()
}

/// Prints the lease state.
pub async fn lease_show(cfg: &Config) -> Result<()> {
    let lease = open_lease(cfg).await?;
    let snap = lease.snapshot().await?;
    say!(
        "holder {} fence {} fence-seen {} ttl {}",
        snap.holder.as_deref().unwrap_or("none"),
        snap.fence,
        snap.fence_seen,
        snap.ttl.map_or_else(|| "-".into(), |t| format!("{}ms", t.as_millis()))
    )?;
    // The deployment's settings record, as the last leader wrote it (replicas whose own
    // differ do not take over).
    match lease.deployment().await? {
        Some((token, record)) => {
            say!("settings written by term {token}:")?;
            for line in record.lines() {
                say!("  {line}")?;
            }
            Ok(())
        }
        None => say!("settings: none written yet"),
    }
}

/// One request to a replica's HTTP endpoint: the status code and the body.
async fn ask(
    cfg: &Config,
    addr: Option<std::net::SocketAddr>,
    method: &str,
    target: &str,
    token: Option<&str>,
) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut addr = addr.or(cfg.http_addr).context("no --addr and FIREKEEPER_HTTP_ADDR is off")?;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let mut s = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .context("connecting timed out")?
        .with_context(|| format!("connecting to {addr}"))?;
    let auth = token.map(|t| format!("authorization: Bearer {t}\r\n")).unwrap_or_default();
    let req = format!("{method} {target} HTTP/1.1\r\nhost: firekeeper\r\n{auth}connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut buf = String::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut buf)).await.context("reading timed out")??;
    let (head, body) = buf.split_once("\r\n\r\n").context("not an HTTP answer")?;
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).context("not an HTTP answer")?;
    Ok((code, body.to_owned()))
}

/// The repos a replica lists at `/repos/invalid?<query>`, after saying which role it has.
async fn listed(cfg: &Config, addr: Option<std::net::SocketAddr>, query: &str) -> Result<Vec<serde_json::Value>> {
    let (_, body) = ask(cfg, addr, "GET", &format!("/repos/invalid?{query}"), None).await?;
    let v: serde_json::Value = serde_json::from_str(&body).context("not the JSON of /repos/invalid")?;
    let role = v["role"].as_str().unwrap_or("unknown");
    if role != "leader" {
        eprintln!("that replica is {role}: only the leader works the resync queue; ask the leader");
    }
    Ok(v["repos"].as_array().cloned().unwrap_or_default())
}

/// One queue entry as the commands print it.
fn entry_line(r: &serde_json::Value) -> String {
    format!(
        "{} seq {} {} rev {} {} attempts {}",
        r["repo"].as_str().unwrap_or("?"),
        r["seq"],
        r["reason"].as_str().unwrap_or("?"),
        r["rev"].as_str().unwrap_or("-"),
        r["state"].as_str().unwrap_or("desynchronized"),
        r["attempts"]
    )
}

/// Percent-encodes a query value (a DID's `:` and `%` survive the trip).
fn encoded(v: &str) -> String {
    url::form_urlencoded::byte_serialize(v.as_bytes()).collect()
}

/// Prints the resync queue a running replica lists at `/repos/invalid`, optionally only
/// the repos in some states.
pub async fn repos_list(cfg: &Config, states: &[QueueState], addr: Option<std::net::SocketAddr>) -> Result<()> {
    let query: Vec<String> = states.iter().map(|s| format!("state={}", s.as_str())).collect();
    for r in listed(cfg, addr, &query.join("&")).await? {
        say!("{}", entry_line(&r))?;
    }
    Ok(())
}

/// Prints one repo's entry in the resync queue, or that it has none.
pub async fn repos_show(cfg: &Config, did: &str, addr: Option<std::net::SocketAddr>) -> Result<()> {
    let found = listed(cfg, addr, &format!("did={}", encoded(did))).await?;
    match found.first() {
        Some(r) => {
            say!("{}", entry_line(r))?;
            let due = r["due"].as_i64().unwrap_or(0);
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            let wait = due - now;
            if r["state"] == "desynchronized" && wait > 0 {
                say!("  next attempt in {}s", (wait + 999) / 1000)?;
            }
            Ok(())
        }
        None => say!("{did}: not in the queue (synchronized, as far as this replica knows)"),
    }
}

/// Prints repo sync's progress as a replica shows it at `/status` (see `repos progress`).
pub async fn repos_progress(cfg: &Config, addr: Option<std::net::SocketAddr>, every: u64) -> Result<()> {
    let status = async || -> Result<serde_json::Value> {
        let (_, body) = ask(cfg, addr, "GET", "/status", None).await?;
        serde_json::from_str(&body).context("not the JSON of /status")
    };
    let first = status().await?;
    let role = first["role"].as_str().unwrap_or("unknown").to_owned();
    say!("{} ({role})", first["instance"].as_str().unwrap_or("?"))?;
    match consumer::progress::Progress::from_json(&first["repo_sync"]) {
        Some(p) if role == "leader" => say!("repo sync: {}", p.line())?,
        Some(_) => say!("repo sync: the leader works the queue; ask it for the whole of it")?,
        None => say!("repo sync: off on this replica")?,
    }
    let jobs = &first["sync_jobs"];
    if !jobs.is_object() {
        return say!("repo sync is not shared: the leader fetches every repo itself");
    }
    say!(
        "this replica's workers: {} ({} in flight, {} done, {} records, {} late)",
        jobs["workers"],
        jobs["in_flight"],
        jobs["done"],
        jobs["records"],
        jobs["late"]
    )?;
    if role != "leader" {
        return Ok(());
    }
    say!("shared queue: {} waiting, {} claimed", jobs["queued"], jobs["claimed"])?;
    tokio::time::sleep(Duration::from_secs(every.max(1))).await;
    let second = status().await?;
    let (before, after) = (&first["sync_jobs"]["by_replica"], &second["sync_jobs"]["by_replica"]);
    for (instance, now) in after.as_object().into_iter().flatten() {
        let done = now["done"].as_u64().unwrap_or(0);
        let delta = done.saturating_sub(before[instance]["done"].as_u64().unwrap_or(0));
        let records = now["records"].as_u64().unwrap_or(0);
        let rate = delta as f64 / every.max(1) as f64;
        say!("  {instance}: {done} repos ({records} records) landed, {rate:.1} repos/s now")?;
    }
    Ok(())
}

/// Asks the leader to resync repos (`POST /repos/resync`, bearer `FIREKEEPER_ADMIN_TOKEN`).
pub async fn repos_resync(cfg: &Config, dids: &[String], addr: Option<std::net::SocketAddr>) -> Result<()> {
    let token =
        cfg.admin_token.as_ref().context("set FIREKEEPER_ADMIN_TOKEN to the token the leader was started with")?;
    for chunk in dids.chunks(crate::http::RESYNC_MAX_DIDS) {
        let query: Vec<String> = chunk.iter().map(|d| format!("did={}", encoded(d))).collect();
        let target = format!("/repos/resync?{}", query.join("&"));
        let (code, body) = ask(cfg, addr, "POST", &target, Some(&token.0)).await?;
        if !(200..300).contains(&code) {
            bail!("the replica refused ({code}): {}", body.trim());
        }
        let v: serde_json::Value = serde_json::from_str(&body).context("not the JSON of /repos/resync")?;
        for r in v["repos"].as_array().into_iter().flatten() {
            say!("{} {}", r["repo"].as_str().unwrap_or("?"), r["outcome"].as_str().unwrap_or("?"))?;
        }
        if v["kept"] != true {
            eprintln!("queued, but the store has not confirmed it yet (the leader keeps retrying)");
        }
    }
    Ok(())
}

/// Fetches `did`'s repo from its PDS and verifies it whole; prints what it holds.
pub async fn repo_check(cfg: &Config, did: &str) -> Result<()> {
    let resolver_cfg = cfg.options.verify.resolver.clone();
    let guard = guarded_http::Guard { allow_private: resolver_cfg.allow_private, max_redirects: 3 };
    let resolver = atproto_identity::resolver::Resolver::new(resolver_cfg).context("the DID resolver")?;
    let client = guarded_http::Client::new(guard, reqwest::Client::builder().user_agent("firekeeper"))
        .context("the HTTP client")?;
    std::fs::create_dir_all(&cfg.data_dir).with_context(|| format!("creating {}", cfg.data_dir.display()))?;
    let limits = repo_sync::fetch::Limits { spill_dir: cfg.data_dir.clone(), ..repo_sync::fetch::Limits::default() };
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    let c = repo_sync::check::check_repo(&resolver, &client, did, &limits, now_us)
        .await
        .with_context(|| format!("{did}: not a verified repo"))?;
    let host = url::Url::parse(&c.pds).ok().and_then(|u| u.host_str().map(str::to_owned)).unwrap_or_default();
    say!("{did} verified: rev {}, commit {}, {} records, {} bytes from {host}", c.rev, c.commit, c.records(), c.bytes)?;
    for (collection, n) in &c.collections {
        say!("  {collection} {n}")?;
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
    let mut out = std::io::BufWriter::new(
        std::fs::File::create_new(file)
            .with_context(|| format!("creating {shown} (an existing file is never overwritten)"))?,
    );
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
