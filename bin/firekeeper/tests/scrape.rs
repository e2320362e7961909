//! A real Prometheus (Debian's `prometheus`, installed by `scripts/ensure-deps.sh`) on
//! loopback, running the shipped scrape config and alert rules against three replicas on
//! one Redis: the leader gauge follows a handover, the no-leader alert stays quiet through
//! a clean one and fires once no replica is left.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testkit::cluster::{Cluster, Spec};
use testkit::{WAIT, eventually, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The lease ttl of the test cluster; the no-leader alert's `for:` is scaled to 2 × ttl as
/// the rules file tells operators to do.
const TTL_MS: u64 = 2000;

/// A Prometheus process, killed when dropped.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

/// Starts Prometheus with the shipped `prometheus.yml` and rules, changed only where a
/// deployment changes them: the targets, the rule file's path, a 1 s scrape and
/// evaluation interval (so the test is short) and the no-leader `for:` scaled to the ttl.
fn start_prometheus(dir: &Path, targets: &[String]) -> Prometheus {
    let shipped = std::fs::read_to_string(repo("deploy/prometheus/prometheus.yml")).expect("prometheus.yml");
    let rules = std::fs::read_to_string(repo("deploy/prometheus/firekeeper-rules.yml")).expect("rules");
    let no_leader_for = format!("for: {}s", 2 * TTL_MS / 1000);
    let (head, tail) = rules.split_once("- alert: FirekeeperNoLeader").expect("FirekeeperNoLeader");
    let rules = format!("{head}- alert: FirekeeperNoLeader{}", tail.replacen("for: 20s", &no_leader_for, 1));
    std::fs::write(dir.join("rules.yml"), rules).unwrap();
    let list = targets.iter().map(|t| format!("\"{t}\"")).collect::<Vec<_>>().join(", ");
    let mut config = String::new();
    for line in shipped.lines() {
        let line = if line.trim_start().starts_with("- targets:") {
            format!("      - targets: [{list}]")
        } else if line.trim_start().starts_with("- /etc/prometheus/rules/") {
            format!("  - {}", dir.join("rules.yml").display())
        } else if line.trim_start().starts_with("scrape_interval:") {
            "  scrape_interval: 1s".to_owned()
        } else if line.trim_start().starts_with("evaluation_interval:") {
            "  evaluation_interval: 1s".to_owned()
        } else {
            line.to_owned()
        };
        config.push_str(&line);
        config.push('\n');
    }
    assert!(config.contains(&list) && config.contains("rules.yml"), "the shipped config changed shape:\n{config}");
    std::fs::write(dir.join("prometheus.yml"), &config).unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("prometheus ({e}): run scripts/ensure-deps.sh to install it"));
    Prometheus { child, addr }
}

/// GET on Prometheus' HTTP API (HTTP/1.0: the body ends when the connection closes).
async fn api(addr: &str, path_and_query: &str) -> Option<serde_json::Value> {
    let io = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET {path_and_query} HTTP/1.0\r\nhost: {addr}\r\n\r\n").as_bytes()).await.ok()?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.ok()?;
        serde_json::from_str(buf.split_once("\r\n\r\n")?.1).ok()
    };
    tokio::time::timeout(Duration::from_secs(5), io).await.ok()?
}

/// The result vector of an instant query.
async fn query(addr: &str, promql: &str) -> Vec<serde_json::Value> {
    let encoded: String = promql
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect();
    api(addr, &format!("/api/v1/query?query={encoded}"))
        .await
        .and_then(|v| v["data"]["result"].as_array().cloned())
        .unwrap_or_default()
}

/// Waits until `promql` returns exactly the given `instance` labels.
async fn wait_instances(prom: &Prometheus, promql: &str, want: &[&str], dir: &Path) {
    let what = format!("{promql} to return instances {want:?}; logs in {}", dir.display());
    eventually(&what, WAIT, async || {
        let got: Vec<String> = query(&prom.addr, promql)
            .await
            .iter()
            .filter_map(|s| s["metric"]["instance"].as_str().map(str::to_owned))
            .collect();
        got.len() == want.len() && want.iter().all(|w| got.iter().any(|g| g == w))
    })
    .await;
}

/// True when Prometheus has evaluated `FirekeeperNoLeader` without error.
async fn no_leader_rule_evaluated(prom: &Prometheus) -> bool {
    let rules = api(&prom.addr, "/api/v1/rules").await.unwrap_or_default();
    rules["data"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .find(|r| r["name"] == "FirekeeperNoLeader")
        .is_some_and(|r| r["health"] == "ok" && r["lastEvaluation"].as_str().is_some_and(|t| !t.starts_with("0001")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_follows_a_handover_and_the_no_leader_alert_fires_only_without_one() {
    let mut c = Cluster::start("scrape", Spec { copies: 20, ttl_ms: TTL_MS, ..Spec::default() }).await;
    c.start_all();
    let (first, _) = c.wait_leader(None).await;
    let targets: Vec<String> = c.replicas.iter().map(|r| r.http.clone()).collect();
    let prom = start_prometheus(&c.dir, &targets);
    let all: Vec<&str> = targets.iter().map(String::as_str).collect();
    wait_instances(&prom, "up == 1", &all, &c.dir).await;
    wait_instances(&prom, "firekeeper_leader == 1", &[&targets[first]], &c.dir).await;

    // The shipped rules loaded and are evaluated (an alert that is never evaluated never fires).
    let logs = format!("logs in {}", c.dir.display());
    eventually(&format!("FirekeeperNoLeader evaluated; {logs}"), WAIT, async || no_leader_rule_evaluated(&prom).await)
        .await;

    // Prometheus' first evaluations, before its first scrape, see no leader (a fresh
    // Prometheus knows none): wait until the alert is quiet with the leader in view.
    eventually(&format!("FirekeeperNoLeader quiet with a leader; {logs}"), WAIT, async || {
        query(&prom.addr, "ALERTS{alertname=\"FirekeeperNoLeader\"}").await.is_empty()
    })
    .await;

    // A clean handover: the leader drains and releases; a standby leads.
    let handover = Instant::now();
    assert!(c.replicas[first].sigterm().await, "the leader exits 0 after SIGTERM");
    let (second, _) = c.wait_leader(Some(first)).await;
    wait_instances(&prom, "firekeeper_leader == 1", &[&targets[second]], &c.dir).await;
    // Past the alert's `for:` and a few evaluations more, it never fired.
    tokio::time::sleep(Duration::from_millis(2 * TTL_MS + 3000)).await;
    let since = handover.elapsed().as_secs() + 1;
    let fired = query(
        &prom.addr,
        &format!("count_over_time(ALERTS{{alertname=\"FirekeeperNoLeader\",alertstate=\"firing\"}}[{since}s])"),
    )
    .await;
    let leaders = query(&prom.addr, &format!("sum(firekeeper_leader)[{since}s:1s]")).await;
    assert!(fired.is_empty(), "FirekeeperNoLeader fired during a clean handover: {fired:?}; leaders seen: {leaders:?}");

    // No replica left: the alert fires (its series are gone, not 0).
    for i in 0..c.replicas.len() {
        if c.replicas[i].child.is_some() {
            assert!(c.replicas[i].sigterm().await);
        }
    }
    eventually(&format!("FirekeeperNoLeader to fire with every replica down; {logs}"), WAIT, async || {
        !query(&prom.addr, "ALERTS{alertname=\"FirekeeperNoLeader\",alertstate=\"firing\"}").await.is_empty()
    })
    .await;
}
