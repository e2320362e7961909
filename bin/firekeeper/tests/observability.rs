//! What an operator sees: OTLP spans that really arrive, dashboard and alert rules that
//! use only metrics `/metrics` exposes, errors that name their cause, the human summary
//! line, and `/status` with its lag.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;
use testkit::free_port;
use testkit::http::http_get;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait, sim};
use testkit::{WAIT, eventually, metric_names, tmpdir};
use tokio::io::AsyncWriteExt;

const TOTAL: u64 = 1476;

/// Every `firekeeper_*` name in a text.
async fn leading_with_http(name: &str, extra: &[(&str, &str)]) -> (std::process::Child, String, std::path::PathBuf) {
    let relay = sim(None).await;
    let dir = tmpdir(name);
    let mut env = base_env(&relay.url(), &dir);
    let http = format!("127.0.0.1:{}", free_port());
    env.insert("FIREKEEPER_HTTP_ADDR".into(), http.clone());
    env.insert("FIREKEEPER_SINK".into(), "null".into());
    for (k, v) in extra {
        env.insert((*k).into(), (*v).into());
    }
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("fk.log"));
    std::mem::forget(relay); // lives until the test process ends
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some((200, body)) = http_get(&http, "/status").await
            && serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["committed"] == TOTAL)
        {
            break;
        }
        assert!(Instant::now() < deadline, "never committed the fixture");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (child, http, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboards_alerts_and_readme_agree_with_what_metrics_exposes() {
    let (child, http, _dir) = leading_with_http("names", &[]).await;
    // Everything is registered at startup except the renewal histogram, which appears
    // with the first renewal (a histogram has no zero value to start from).
    let deadline = Instant::now() + WAIT;
    let metrics = loop {
        let (code, metrics) = http_get(&http, "/metrics").await.expect("metrics");
        assert_eq!(code, 200);
        if metrics.contains("firekeeper_lease_renew_seconds") {
            break metrics;
        }
        assert!(Instant::now() < deadline, "no lease renewal recorded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let exposed = metric_names(&metrics);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for file in ["deploy/grafana/firekeeper.json", "deploy/prometheus/firekeeper-rules.yml"] {
        let text = std::fs::read_to_string(root.join(file)).expect(file);
        let used = metric_names(&text);
        assert!(used.len() >= 5, "{file} uses {used:?}");
        let missing: Vec<_> = used.difference(&exposed).collect();
        assert!(missing.is_empty(), "{file} uses metrics /metrics does not expose: {missing:?}\nexposed: {exposed:?}");
    }
    // Every name a scrape shows is documented (a histogram by its base name).
    let readme = metric_names(&std::fs::read_to_string(root.join("README.md")).expect("README.md"));
    let undocumented: Vec<_> = exposed
        .iter()
        .filter(|n| {
            let base = ["_sum", "_count", "_bucket"].iter().find_map(|s| n.strip_suffix(s)).unwrap_or(n);
            !readme.contains(*n) && !readme.contains(base)
        })
        .collect();
    assert!(undocumented.is_empty(), "/metrics shows names the README does not list: {undocumented:?}");
    let (_, status) = http_get(&http, "/status").await.expect("status");
    let status: serde_json::Value = serde_json::from_str(&status).expect("json");
    assert!(status["lag_seconds"].as_f64().is_some(), "lag_seconds is filled while events flow: {status}");
    assert!(sigterm_and_wait(child).success());
}

/// An OTLP/HTTP receiver: decodes every export request; keeps the raw bodies too.
async fn otlp_receiver() -> (String, Arc<Mutex<Vec<ExportTraceServiceRequest>>>, Arc<Mutex<Vec<Vec<u8>>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (got, raw) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let (g, r) = (got.clone(), raw.clone());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (g, r) = (g.clone(), r.clone());
            tokio::spawn(async move {
                let mut pending = Vec::new();
                while let Some((line, body)) = testkit::http::read_request_with_line(&mut s, &mut pending).await {
                    if line.contains("/v1/traces") {
                        let req = ExportTraceServiceRequest::decode(body.as_slice()).expect("a valid OTLP export");
                        g.lock().expect("got").push(req);
                        r.lock().expect("raw").push(body);
                    }
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if s.write_all(ok.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, got, raw)
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        _ => String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_spans_arrive_with_their_attributes_and_no_secrets() {
    let (endpoint, got, raw) = otlp_receiver().await;
    let relay = sim(None).await;
    let dir = tmpdir("otlp");
    // Credentials in the relay URL must never reach a span.
    let with_creds = relay.url().replace("ws://", "ws://user:hunter2@");
    let mut env = base_env(&with_creds, &dir);
    env.insert("FIREKEEPER_SINK".into(), "null".into());
    env.insert("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint);
    env.insert("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("otlp.log"));
    let spans = || -> Vec<(String, Vec<(String, String)>)> {
        got.lock()
            .expect("got")
            .iter()
            .flat_map(|r| r.resource_spans.iter())
            .flat_map(|rs| rs.scope_spans.iter())
            .flat_map(|ss| ss.spans.iter())
            .map(|s| (s.name.clone(), s.attributes.iter().map(|a| (a.key.clone(), text(a.value.as_ref()))).collect()))
            .collect()
    };
    eventually("commit and relay_connect spans", WAIT, async || {
        let s = spans();
        s.iter().any(|(n, _)| n == "commit") && s.iter().any(|(n, _)| n == "relay_connect")
    })
    .await;
    assert!(sigterm_and_wait(child).success());
    // The term span ends with the term: flushed at shutdown.
    eventually("the term span", WAIT, async || spans().iter().any(|(n, _)| n == "term")).await;
    let s = spans();
    let attrs = |name: &str| s.iter().find(|(n, _)| n == name).map(|(_, a)| a.clone()).expect(name);
    let has = |a: &[(String, String)], k: &str| a.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    assert!(has(&attrs("term"), "token").is_some_and(|t| t.parse::<u64>().is_ok()), "{:?}", attrs("term"));
    assert_eq!(has(&attrs("relay_connect"), "relay").as_deref(), Some("primary"));
    let commit = attrs("commit");
    assert!(has(&commit, "cursor").is_some() && has(&commit, "token").is_some(), "{commit:?}");
    let services: BTreeSet<String> = got
        .lock()
        .expect("got")
        .iter()
        .flat_map(|r| r.resource_spans.iter())
        .filter_map(|rs| rs.resource.as_ref())
        .flat_map(|r| r.attributes.iter())
        .filter(|a| a.key == "service.name")
        .map(|a| text(a.value.as_ref()))
        .collect();
    assert_eq!(services, BTreeSet::from(["firekeeper".to_owned()]));
    for body in raw.lock().expect("raw").iter() {
        assert!(!body.windows(7).any(|w| w == b"hunter2"), "a credential reached an exported span");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_lease_store_is_named_by_address_and_cause() {
    let relay = sim(None).await;
    let dir = tmpdir("named");
    let mut env = base_env(&relay.url(), &dir);
    let port = free_port();
    env.insert("REDIS_URL".into(), format!("redis://:s3cret@127.0.0.1:{port}/"));
    let mut child = firekeeper(&env, &[], &dir.join("named.log"));
    let log = || std::fs::read_to_string(dir.join("named.log")).unwrap_or_default();
    eventually("the lease store error", WAIT, async || log().contains("cannot use the lease store")).await;
    let _ = child.kill();
    let _ = child.wait();
    let text = log();
    assert!(text.contains(&format!("127.0.0.1:{port}")) && text.contains("connection refused"), "{text}");
    assert!(!text.contains("s3cret"), "no password in logs");
}

/// Credentials the store refuses are not a healthy standby: `/readyz` answers 503 with
/// the reason and its cause, without the secret, and the log says it once (then once a
/// minute). Written once, run on Redis (a wrong password: the lease store refuses, which
/// is also counted and shown in `/status`) and NATS (a wrong token: the start waits on
/// the store, and the client's "authorization violation" is the cause named).
async fn refused_credentials_are_not_ready(var: &str, url: &str, secret: &str, cause: &str, lease_refuses: bool) {
    let relay = sim(None).await;
    let dir = tmpdir(&format!("refused-{}", var.to_lowercase()));
    let mut env = base_env(&relay.url(), &dir);
    let http = format!("127.0.0.1:{}", free_port());
    env.insert("FIREKEEPER_HTTP_ADDR".into(), http.clone());
    env.insert("FIREKEEPER_SINK".into(), "null".into());
    env.insert("FIREKEEPER_START".into(), "oldest".into());
    env.insert(var.into(), url.into());
    let mut child = firekeeper(&env, &[], &dir.join("wrong.log"));
    let readyz = async || http_get(&http, "/readyz").await;
    eventually("/readyz to say why it is not ready, with the cause", WAIT, async || {
        readyz().await.is_some_and(|(code, body)| code == 503 && body.to_lowercase().contains(cause))
    })
    .await;
    let (_, body) = readyz().await.expect("readyz");
    assert!(!body.contains(secret), "no secret: {body}");
    if lease_refuses {
        assert!(body.contains("cannot use the lease store"), "{body}");
        let (_, metrics) = http_get(&http, "/metrics").await.expect("metrics");
        let failures: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("firekeeper_lease_store_errors_total{kind=\"unavailable\"} "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!(failures >= 1.0, "counted:\n{metrics}");
        let status: serde_json::Value =
            serde_json::from_str(&http_get(&http, "/status").await.expect("status").1).expect("json");
        assert!(status["lease_store_error"].is_string(), "{status}");
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let log = std::fs::read_to_string(dir.join("wrong.log")).unwrap_or_default();
    let said = if lease_refuses { "cannot use the lease store" } else { "cannot seed the lease fence" };
    assert_eq!(log.matches(said).count(), 1, "said once, not every poll:\n{log}");
    assert!(!log.contains(secret), "no secret in the log");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_redis_password_is_not_ready() {
    let redis = testkit::RedisServer::start_with(&["--requirepass", "right"]);
    let url = format!("redis://:wr0ngpw@{}", redis.addr());
    refused_credentials_are_not_ready("REDIS_URL", &url, "wr0ngpw", "authentication", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_nats_token_is_not_ready() {
    let nats = testkit::NatsServer::start_with(&["--auth", "r1ghttoken"]);
    let url = format!("nats://wr0ngtoken@{}", nats.addr());
    refused_credentials_are_not_ready("NATS_URL", &url, "wr0ngtoken", "authorization", false).await;
}

/// A store that can be taken down and brought back: each scenario below is written once
/// and run on every store.
trait Downable {
    fn kind(&self) -> &'static str;
    fn down(&mut self);
    fn up(&mut self);
}

impl<T: testkit::cluster::StoreServer> Downable for T {
    fn kind(&self) -> &'static str {
        testkit::cluster::StoreServer::kind(self)
    }
    fn down(&mut self) {
        self.kill();
    }
    fn up(&mut self) {
        self.restart();
    }
}

/// Postgres as the cursor store (the lease on Redis, which stays up).
struct PgStore(testkit::PgServer);

impl Downable for PgStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }
    fn down(&mut self) {
        self.0.kill();
    }
    fn up(&mut self) {
        self.0.restart();
    }
}

/// The store (lease and cursors) is down when a replica starts, then comes up: the
/// replica waits, not ready and saying why, and is ready once the store answers. One
/// scenario, run on Redis, NATS and Postgres (a NATS store down at start had made the process
/// exit 1 while a Redis one was waited for).
async fn a_store_down_at_start_is_waited_for(vars: &[(&str, String)], mut server: impl Downable) {
    let relay = sim(None).await;
    let dir = tmpdir(&format!("{}-down", server.kind()));
    let mut env = base_env(&relay.url(), &dir);
    let http = format!("127.0.0.1:{}", free_port());
    env.insert("FIREKEEPER_HTTP_ADDR".into(), http.clone());
    env.insert("FIREKEEPER_SINK".into(), "null".into());
    env.insert("FIREKEEPER_START".into(), "oldest".into());
    for (k, v) in vars {
        env.insert((*k).into(), v.clone());
    }
    server.down();
    let mut child = firekeeper(&env, &[], &dir.join("down.log"));
    let readyz = async || http_get(&http, "/readyz").await;
    eventually("not ready while the store is down, saying why", WAIT, async || {
        readyz().await.is_some_and(|(code, body)| code == 503 && body.contains("cannot"))
    })
    .await;
    assert!(child.try_wait().expect("wait").is_none(), "the replica waits for the store instead of exiting");
    server.up();
    eventually("ready once the store answers", WAIT, async || readyz().await.is_some_and(|(code, _)| code == 200))
        .await;
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_down_at_start_is_waited_for() {
    let redis = testkit::RedisServer::start();
    a_store_down_at_start_is_waited_for(&[("REDIS_URL", redis.url())], redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_down_at_start_is_waited_for() {
    let nats = testkit::NatsServer::start();
    a_store_down_at_start_is_waited_for(&[("NATS_URL", nats.url())], nats).await;
}

/// The Postgres cursor store down at start made the process exit 1 (it connected and
/// migrated before anything else); now the first use connects and migrates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_down_at_start_is_waited_for() {
    let redis = testkit::RedisServer::start();
    let pg = testkit::PgServer::start();
    let vars =
        [("REDIS_URL", redis.url()), ("FIREKEEPER_CURSOR_STORE", "postgres".to_owned()), ("DATABASE_URL", pg.url())];
    a_store_down_at_start_is_waited_for(&vars, PgStore(pg)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_get_a_human_summary_line() {
    let (child, _http, dir) = leading_with_http("summary", &[("FIREKEEPER_LOG_FORMAT", "text")]).await;
    let log = || std::fs::read_to_string(dir.join("fk.log")).unwrap_or_default();
    eventually("a summary line", WAIT, async || log().lines().any(|l| l.starts_with("firekeeper: leader token"))).await;
    let line = log().lines().find(|l| l.starts_with("firekeeper: leader token")).map(str::to_owned).expect("line");
    for part in ["relay primary", "events/s", "lag", &format!("cursor {TOTAL}")] {
        assert!(line.contains(part), "{part} missing from {line:?}");
    }
    assert!(sigterm_and_wait(child).success());
}

/// The summary says what the sink took, not what was read: with a webhook that answers
/// every POST with 500, the JSON summary shows events received from the relay and none
/// written (it used to show the intake's rate as "events/s", a failing sink looked busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_summary_counts_what_the_sink_took_not_what_was_read() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let hook = format!("http://{}/", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt as _;
                let mut pending = Vec::new();
                while testkit::http::read_request(&mut s, &mut pending).await.is_some() {
                    let no = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n";
                    if s.write_all(no).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let relay = sim(Some(200)).await;
    let dir = tmpdir("summary-sink");
    let mut env = base_env(&relay.url(), &dir);
    for (k, v) in
        [("FIREKEEPER_SINK", "webhook"), ("FIREKEEPER_WEBHOOK_URL", hook.as_str()), ("FIREKEEPER_START", "oldest")]
    {
        env.insert(k.into(), v.into());
    }
    let mut child = firekeeper(&env, &[], &dir.join("fk.log"));
    let summary = || {
        std::fs::read_to_string(dir.join("fk.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["fields"]["message"] == "summary" && v["fields"]["role"] == "leader")
    };
    eventually("a leader's summary", WAIT, async || summary().is_some()).await;
    let s = summary().expect("summary");
    assert_eq!(s["fields"]["written_per_second"], 0.0, "{s}");
    assert!(s["fields"]["received_per_second"].as_f64().is_some_and(|r| r > 0.0), "{s}");
    let _ = child.kill();
    let _ = child.wait();
}

/// A standby whose cursor store (Postgres, beside a Redis lease) stops answering could not
/// lead: it is not ready and says why, and ready again once the store answers. It used
/// to stay ready: only the lease store was watched while standing by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_whose_cursor_store_is_down_is_not_ready() {
    let redis = testkit::RedisServer::start();
    let mut pg = testkit::PgServer::start();
    let relay = sim(None).await;
    let dir = tmpdir("standby-store");
    let replica = |name: &str| {
        let mut env = base_env(&relay.url(), &dir.join(name));
        let http = format!("127.0.0.1:{}", free_port());
        for (k, v) in [
            ("REDIS_URL", redis.url()),
            ("FIREKEEPER_CURSOR_STORE", "postgres".into()),
            ("DATABASE_URL", pg.url()),
            ("FIREKEEPER_HTTP_ADDR", http.clone()),
            ("FIREKEEPER_SINK", "null".into()),
            ("FIREKEEPER_START", "oldest".into()),
        ] {
            env.insert(k.into(), v);
        }
        (firekeeper(&env, &[], &dir.join(format!("{name}.log"))), http)
    };
    let role = async |http: &str| {
        let body = http_get(http, "/status").await.map(|r| r.1).unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(&body).map(|v| v["role"].clone()).unwrap_or_default()
    };
    let (mut a, a_http) = replica("a");
    eventually("a leads", WAIT, async || role(&a_http).await == "leader").await;
    let (mut b, b_http) = replica("b");
    eventually("b stands by, ready", WAIT, async || {
        role(&b_http).await == "standby" && http_get(&b_http, "/readyz").await.is_some_and(|(c, _)| c == 200)
    })
    .await;
    pg.kill();
    eventually("b is not ready, naming the cursor store", WAIT, async || {
        http_get(&b_http, "/readyz")
            .await
            .is_some_and(|(code, body)| code == 503 && body.contains("cannot use the cursor store"))
    })
    .await;
    pg.restart();
    eventually("b is ready again", WAIT, async || http_get(&b_http, "/readyz").await.is_some_and(|(c, _)| c == 200))
        .await;
    for p in [&mut a, &mut b] {
        let _ = p.kill();
        let _ = p.wait();
    }
}
