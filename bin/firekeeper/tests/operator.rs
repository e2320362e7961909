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
