//! Issue 34 through the binary: what an operator meets in the first week. The CLI on a
//! closed or full stdout, `cursor set` under a running leader or beside a misspelt
//! store variable, look-alike variables in `check-config`.

use std::process::{Command, Stdio};

use testkit::proc::{base_env, firekeeper_bin, firekeeper_to, run_once, sigterm_and_wait, sim};
use testkit::{WAIT, eventually, tmpdir};

fn cli(env: &std::collections::HashMap<String, String>, args: &[&str]) -> Command {
    let mut c = Command::new(firekeeper_bin());
    c.args(args).env_clear().env("PATH", std::env::var("PATH").unwrap_or_default()).envs(env);
    c
}

/// `check-config | head -1` and `settings | head -1`: the reader is gone before the
/// command writes; the command ends quietly with 0, not a panic (exit 101).
#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    let dir = tmpdir("epipe");
    let env = base_env("ws://127.0.0.1:9", &dir);
    for args in [&["check-config"][..], &["settings"], &["cursor", "show"]] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let out = cli(&env, args).stdout(writer).stderr(Stdio::piped()).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// `settings > /dev/full`: an error that names stdout and the cause, exit 1, no panic.
#[test]
fn a_full_stdout_is_an_error_not_a_panic() {
    let dir = tmpdir("enospc");
    let env = base_env("ws://127.0.0.1:9", &dir);
    for args in [&["settings"][..], &["check-config"]] {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full");
        let out = cli(&env, args).stdout(full).stderr(Stdio::piped()).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("writing to standard output") && err.contains("No space left"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "said once: {err}");
    }
}

/// `cursor set` under a running leader is refused (the leader would overwrite it within
/// a second) unless `--force`; what it wrote is said: relay, fingerprint, value before
/// and after, and the store with its path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursor_set_refuses_under_a_running_leader_and_says_what_it_wrote() {
    let relay = sim(None).await;
    let dir = tmpdir("cursor-set");
    let env = base_env(&relay.url(), &dir);
    let first = run_once(&env, &["cursor", "set", "0"]);
    let said = String::from_utf8_lossy(&first.stdout);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let cursors = std::path::absolute(dir.join("data").join("cursors")).expect("abs");
    assert!(
        said.contains("primary relay ws://127.0.0.1:")
            && said.contains("cursor set to 0 (was none)")
            && said.contains(&format!("the file store {}", cursors.display())),
        "{said}"
    );
    let a = firekeeper_to(&env, &[], &dir.join("a.log"), &dir.join("a.jsonl"));
    eventually("a leader", WAIT, async || {
        let shown = run_once(&env, &["lease", "show"]);
        shown.status.success() && !String::from_utf8_lossy(&shown.stdout).starts_with("holder none")
    })
    .await;
    let refused = run_once(&env, &["cursor", "set", "7"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(err.contains("a leader is running") && err.contains("--force"), "{err}");
    let forced = run_once(&env, &["cursor", "set", "7", "--force"]);
    assert!(forced.status.success(), "{}", String::from_utf8_lossy(&forced.stderr));
    assert!(String::from_utf8_lossy(&forced.stderr).contains("will commit over this"));
    assert!(sigterm_and_wait(a).success());
}

/// A misspelt store variable (`REDIS_ULR`) leaves the embedded file store in place:
/// `check-config` names the look-alike, and `cursor set` refuses to write the local file
/// store while it is set.
#[test]
fn a_lookalike_store_variable_is_named_and_cursor_set_refuses_the_local_fallback() {
    let dir = tmpdir("lookalike");
    let mut env = base_env("ws://127.0.0.1:9", &dir);
    env.insert("REDIS_ULR".into(), "redis://:hunter2@10.0.0.1:6379".into());
    let check = run_once(&env, &["check-config"]);
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success());
    assert!(said.contains("REDIS_ULR is set but is not a firekeeper setting: did you mean REDIS_URL?"), "{said}");
    assert!(!said.contains("hunter2"));
    let set = run_once(&env, &["cursor", "set", "0"]);
    let err = String::from_utf8_lossy(&set.stderr);
    assert_eq!(set.status.code(), Some(1), "{err}");
    assert!(err.contains("REDIS_ULR (meant REDIS_URL?)") && !err.contains("hunter2"), "{err}");
    assert!(!dir.join("data").join("cursors").exists(), "nothing written");
    env.insert("FIREKEEPER_CURSOR_STORE".into(), "file".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success(), "the file store when said so");
}

/// A JSON value whose objects, at every depth, name each key once.
struct UniqueKeys;

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<UniqueKeys, A::Error> {
                let mut seen = std::collections::BTreeSet::new();
                while let Some(k) = m.next_key::<String>()? {
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!("key {k:?} twice")));
                    }
                    m.next_value::<UniqueKeys>()?;
                }
                Ok(UniqueKeys)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut s: A) -> Result<UniqueKeys, A::Error> {
                while s.next_element::<UniqueKeys>()?.is_some() {}
                Ok(UniqueKeys)
            }
            fn visit_str<E>(self, _: &str) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_bool<E>(self, _: bool) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_i64<E>(self, _: i64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_u64<E>(self, _: u64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_f64<E>(self, _: f64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
        }
        d.deserialize_any(V)
    }
}

/// Every JSON log line of a run (a leader through a handover-free run, a term lost to a
/// frozen store, the summary) parses with each key once and no Rust `Debug` text
/// (`Some(…)`); the summary is logged in JSON mode too; an invalid `RUST_LOG` is refused;
/// CLI calls on NATS print no client INFO lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_have_one_key_per_field_and_no_debug_text() {
    let nats = testkit::NatsServer::start();
    let relay = sim(None).await;
    let dir = tmpdir("jsonlog");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("NATS_URL".into(), nats.url());
    env.insert("FIREKEEPER_LOG_FORMAT".into(), "json".into());
    env.remove("RUST_LOG");
    let set = run_once(&env, &["cursor", "set", "0"]);
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    assert!(
        set.stderr.is_empty(),
        "a CLI call on NATS says nothing on stderr: {}",
        String::from_utf8_lossy(&set.stderr)
    );
    let log = dir.join("fk.log");
    let a = firekeeper_to(&env, &[], &log, &dir.join("a.jsonl"));
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually("a summary line in JSON", WAIT, async || read().contains("\"message\":\"summary\"")).await;
    nats.pause();
    eventually("the term lost to a frozen store", WAIT, async || read().contains("leadership lost")).await;
    nats.resume();
    assert!(sigterm_and_wait(a).success());
    let text = read();
    for line in text.lines() {
        if let Err(e) = serde_json::from_str::<UniqueKeys>(line) {
            panic!("{e}: {line}");
        }
        assert!(!line.contains("Some("), "Debug text in a log line: {line}");
    }
    let mut bad = env.clone();
    bad.insert("RUST_LOG".into(), "info,consumer=loud".into());
    let refused = run_once(&bad, &["check-config"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("is not a log filter"));
}

/// Item 1: a replica whose settings differ from the deployment's does not take over.
/// A leads with no filter; B starts with `FIREKEEPER_COLLECTIONS` set: not ready, the
/// difference in `/status` and `/metrics`; A is killed and B still does not lead (it
/// would have changed what downstream receives without a word); C, with B's filter and
/// `FIREKEEPER_ALLOW_SETTINGS_CHANGE=true`, takes over and writes its settings, and B,
/// now in agreement, is ready. Written once, run on Redis and on NATS.
async fn replicas_that_disagree(var: &str, url: &str) {
    let relay = sim(None).await;
    let dir = tmpdir(&format!("disagree-{}", var.to_lowercase()));
    let replica = |name: &str, extra: &[(&str, &str)]| {
        let mut env = base_env(&relay.url(), &dir.join(name));
        let http = format!("127.0.0.1:{}", testkit::free_port());
        for (k, v) in [
            (var, url),
            ("FIREKEEPER_HTTP_ADDR", http.as_str()),
            ("FIREKEEPER_START", "oldest"),
            ("FIREKEEPER_SINK", "null"),
            ("FIREKEEPER_INSTANCE_ID", name),
            // ttl 1 s: "not taken over within three ttls" then costs 3 s.
            ("FIREKEEPER_LEASE_TTL_MS", "1000"),
            ("FIREKEEPER_LEASE_RENEW_MS", "200"),
            ("FIREKEEPER_LEASE_OP_TIMEOUT_MS", "125"),
            ("FIREKEEPER_LEASE_MARGIN_MS", "250"),
            ("FIREKEEPER_LEASE_POLL_MS", "100"),
            ("FIREKEEPER_DRAIN_BUDGET_MS", "3000"),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        {
            env.insert(k.into(), v.into());
        }
        std::fs::create_dir_all(dir.join(name)).expect("dir");
        (testkit::proc::firekeeper(&env, &[], &dir.join(format!("{name}.log"))), http)
    };
    let status = async |http: &str| {
        let body = testkit::http::http_get(http, "/status").await.map(|r| r.1).unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(&body).unwrap_or(serde_json::Value::Null)
    };
    let (mut a, a_http) = replica("a", &[]);
    eventually("a leads and wrote its settings", WAIT, async || {
        status(&a_http).await["role"] == "leader"
            && std::fs::read_to_string(dir.join("a.log")).unwrap_or_default().contains("settings record")
    })
    .await;
    let like = ("FIREKEEPER_COLLECTIONS", "app.bsky.feed.like");
    let (mut b, b_http) = replica("b", &[like]);
    eventually("b is not ready and says why", WAIT, async || {
        testkit::http::http_get(&b_http, "/readyz")
            .await
            .is_some_and(|(code, body)| code == 503 && body.contains("settings differ") && body.contains("collections"))
    })
    .await;
    let s = status(&b_http).await;
    assert_eq!(s["settings_differ"][0]["key"], "collections", "{s}");
    assert_eq!(s["settings_differ"][0]["ours"], "app.bsky.feed.like", "{s}");
    assert_eq!(s["settings_differ"][0]["leader"], "*", "{s}");
    let metrics = testkit::http::http_get(&b_http, "/metrics").await.map(|r| r.1).unwrap_or_default();
    assert!(metrics.lines().any(|l| l == "firekeeper_settings_differ 1"), "{metrics}");
    let log = std::fs::read_to_string(dir.join("b.log")).unwrap_or_default();
    assert!(log.contains("settings differ from the deployment") && log.contains("collections: here"), "{log}");
    let _ = a.kill();
    let _ = a.wait();
    // Three ttls: any standby would have taken over by now.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while std::time::Instant::now() < until {
        assert_ne!(status(&b_http).await["role"], "leader", "b took over with different settings");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let (mut c, c_http) = replica("c", &[like, ("FIREKEEPER_ALLOW_SETTINGS_CHANGE", "true")]);
    eventually("c, allowed to change the settings, takes over", WAIT, async || {
        status(&c_http).await["role"] == "leader"
    })
    .await;
    eventually("b agrees with c's settings and is ready", WAIT, async || {
        testkit::http::http_get(&b_http, "/readyz").await.is_some_and(|(code, _)| code == 200)
    })
    .await;
    assert!(status(&b_http).await["settings_differ"].is_null());
    let mut show = base_env(&relay.url(), &dir.join("show"));
    show.insert(var.into(), url.into());
    let shown = run_once(&show, &["lease", "show"]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(text.contains("settings written by term") && text.contains("  collections=app.bsky.feed.like"), "{text}");
    for p in [&mut b, &mut c] {
        let _ = p.kill();
        let _ = p.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_disagree_on_redis() {
    let redis = testkit::RedisServer::start();
    replicas_that_disagree("REDIS_URL", &redis.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_disagree_on_nats() {
    let nats = testkit::NatsServer::start();
    replicas_that_disagree("NATS_URL", &nats.url()).await;
}

/// Item 2: TLS to the store. A server with a certificate from a throw-away CA: without
/// the CA file the system's roots do not know that CA, so the replica is not ready and
/// `/readyz` names the certificate; with it, the replica leads over TLS and its cursor
/// lands in that store. Written once, run on Redis (`rediss://`) and on NATS (a server
/// that requires TLS).
async fn a_replica_leads_over_tls(url_var: &str, url: &str, ca_var: &str, ca: &testkit::TestCa, names_cause: bool) {
    let relay = sim(None).await;
    let dir = tmpdir(&format!("tls-{}", url_var.to_lowercase()));
    let mut env = base_env(&relay.url(), &dir);
    let http = format!("127.0.0.1:{}", testkit::free_port());
    for (k, v) in [
        (url_var, url.to_owned()),
        ("FIREKEEPER_HTTP_ADDR", http.clone()),
        ("FIREKEEPER_SINK", "null".into()),
        ("FIREKEEPER_START", "oldest".into()),
    ] {
        env.insert(k.into(), v);
    }
    let mut unverified = testkit::proc::firekeeper(&env, &[], &dir.join("unverified.log"));
    // The NATS client reports a refused certificate as "IO error" only, so there the
    // reason names the server and the failed call, not the certificate.
    eventually("not ready, naming the server (and, on Redis, the certificate)", WAIT, async || {
        testkit::http::http_get(&http, "/readyz").await.is_some_and(|(code, body)| {
            code == 503 && body.contains("localhost:") && (!names_cause || body.to_lowercase().contains("certificate"))
        })
    })
    .await;
    let _ = unverified.kill();
    let _ = unverified.wait();
    env.insert(ca_var.into(), ca.ca_file().to_string_lossy().into_owned());
    let check = run_once(&env, &["check-config"]);
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let child = testkit::proc::firekeeper(&env, &[], &dir.join("tls.log"));
    eventually("the leader commits its cursor over TLS", WAIT, async || {
        let shown = run_once(&env, &["cursor", "show"]);
        shown.status.success() && !String::from_utf8_lossy(&shown.stdout).trim_end().ends_with("cursor none")
    })
    .await;
    assert!(sigterm_and_wait(child).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_leads_over_tls_to_redis_and_names_a_certificate_it_cannot_verify() {
    let ca = testkit::TestCa::new();
    let redis = testkit::RedisServer::start_tls(&ca);
    a_replica_leads_over_tls("REDIS_URL", &redis.tls_url(), "FIREKEEPER_REDIS_CA_FILE", &ca, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_leads_over_tls_to_nats_and_is_not_ready_with_a_certificate_it_cannot_verify() {
    let ca = testkit::TestCa::new();
    let nats = testkit::NatsServer::start_tls(&ca);
    let url = format!("nats://localhost:{}", nats.port());
    a_replica_leads_over_tls("NATS_URL", &url, "FIREKEEPER_NATS_CA_FILE", &ca, false).await;
}
