//! Issue 40 through the binary: a store with no cursor is a first start or a store that
//! lost its data, and firekeeper never guesses which; a replica keeps the highest token
//! and the cursor it saw on its own disk, so a store that lost its data neither reissues
//! a token nor loses the position. The cluster scenario (a frozen leader, the store
//! restarted empty, a replica that knows nothing) is in `chaos.rs`/`chaos_nats.rs`.

use std::collections::BTreeSet;
use std::path::Path;

use testkit::proc::{base_env, firekeeper_to, run_once, sigterm_and_wait, sim, wait_exit};
use testkit::{RedisServer, WAIT, eventually, tmpdir};

const TOTAL: u64 = 1476;

/// (seq, token) of every line of a jsonl output.
fn lines(path: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["seq"].as_u64()?, v["token"].as_u64()?)))
        .collect()
}

fn cursor_shown(env: &std::collections::HashMap<String, String>) -> String {
    String::from_utf8_lossy(&run_once(env, &["cursor", "show"]).stdout).trim().to_owned()
}

/// With no cursor, no earlier term and no `FIREKEEPER_START`, a replica refuses and says
/// what to set; `FIREKEEPER_START=oldest` starts at the relay's oldest event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_refuses_unless_told_where_to_start() {
    let redis = RedisServer::start();
    let relay = sim(None).await;
    let dir = tmpdir("first");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("REDIS_URL".into(), redis.url());
    let a = firekeeper_to(&env, &[], &dir.join("a.log"), &dir.join("a.jsonl"));
    let status = tokio::task::spawn_blocking(move || wait_exit(a)).await.expect("join");
    let log = std::fs::read_to_string(dir.join("a.log")).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("FIREKEEPER_START=oldest") && log.contains("firekeeper cursor set"),
        "says what to set:\n{log}"
    );
    assert!(log.contains("everything before is skipped, never delivered"), "and what `live` skips:\n{log}");
    assert!(lines(&dir.join("a.jsonl")).is_empty(), "nothing delivered");
    assert!(cursor_shown(&env).ends_with("cursor none"), "nothing committed");

    env.insert("FIREKEEPER_START".into(), "oldest".into());
    let b = firekeeper_to(&env, &[], &dir.join("b.log"), &dir.join("b.jsonl"));
    eventually("every event from the oldest", WAIT, async || cursor_shown(&env).ends_with(&format!("cursor {TOTAL}")))
        .await;
    assert!(sigterm_and_wait(b).success());
    let seqs: BTreeSet<u64> = lines(&dir.join("b.jsonl")).into_iter().map(|(s, _)| s).collect();
    assert_eq!(seqs, (1..=TOTAL).collect(), "the whole stream, from the relay's oldest event");
}

/// A replica that ran, stopped, and starts again on the same disk after the store lost
/// everything (Redis restarted without persistence): its token is above the one it held
/// (the store's counter starts again at 0), and it resumes where its last commit was
/// instead of refusing or skipping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_on_its_own_disk_outlives_a_store_that_lost_its_data() {
    let mut redis = RedisServer::start();
    let relay = sim(None).await;
    let dir = tmpdir("shadow");
    let mut env = base_env(&relay.url(), &dir);
    env.insert("REDIS_URL".into(), redis.url());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let a = firekeeper_to(&env, &[], &dir.join("a.log"), &dir.join("a.jsonl"));
    eventually("the first term to commit everything", WAIT, async || {
        cursor_shown(&env).ends_with(&format!("cursor {TOTAL}"))
    })
    .await;
    // The shadow file is written every second: let it catch up before the stop.
    let shadow = dir.join("data").join("shadow-firekeeper.json");
    eventually("the shadow file to hold the last commit", WAIT, async || {
        std::fs::read_to_string(&shadow).is_ok_and(|s| s.contains(&format!(":{TOTAL}")))
    })
    .await;
    assert!(sigterm_and_wait(a).success());
    let first_token = lines(&dir.join("a.jsonl")).iter().map(|(_, t)| *t).max().expect("delivered");
    redis.restart(); // empty: no fence, no cursor
    let b = firekeeper_to(&env, &[], &dir.join("b.log"), &dir.join("b.jsonl"));
    eventually("the cursor back in the store", WAIT, async || cursor_shown(&env).ends_with(&format!("cursor {TOTAL}")))
        .await;
    let log = std::fs::read_to_string(dir.join("b.log")).unwrap_or_default();
    assert!(log.contains("resuming from the last commit this process saw"), "{log}");
    assert!(sigterm_and_wait(b).success());
    let lease = String::from_utf8_lossy(&run_once(&env, &["lease", "show"]).stdout).into_owned();
    let fence: u64 = lease
        .split_whitespace()
        .skip_while(|w| *w != "fence")
        .nth(1)
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("a fence in {lease}"));
    assert!(fence > first_token, "the new term's token ({fence}) is above the one before ({first_token})");
    assert!(lines(&dir.join("b.jsonl")).is_empty(), "nothing delivered twice (it resumed at the end)");
}

/// `check-config` (and the first log lines of a run) say whether the Redis the lease and
/// cursors live on survives a restart.
#[test]
fn check_config_warns_about_a_redis_without_persistence() {
    let relay = "ws://127.0.0.1:1";
    let dir = tmpdir("persist");
    let check = |redis: &RedisServer| {
        let mut env = base_env(relay, &dir);
        env.insert("REDIS_URL".into(), redis.url());
        let out = run_once(&env, &["check-config"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let volatile = check(&RedisServer::start());
    assert!(
        volatile.contains("warning: Redis has no persistence at all") && volatile.contains("appendonly yes"),
        "{volatile}"
    );
    let durable = check(&RedisServer::start_persistent());
    assert!(
        durable.contains("Redis keeps an append-only file (appendfsync always)") && !durable.contains("warning"),
        "{durable}"
    );
}
