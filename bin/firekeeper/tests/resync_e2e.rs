//! Repo sync end to end with the real binary: relay-sim replays a real PDS's firehose
//! with six commits of two repos taken out (a chain break in each), a local PDS serves
//! the repos' final CARs (`getRepo`) and a local PLC their DID documents. On default
//! settings (plus the PLC, and loopback allowed) the leader notices each break, fetches
//! the repo, verifies it and hands the jsonl sink a `#resync` and its `#record`s: folding
//! the output gives exactly the reference record set of every repo.

use std::collections::HashMap;

use testkit::http::http_get;
use testkit::plc::Plc;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait};
use testkit::{WAIT, eventually, free_port, tmpdir};

const RSMALL2: &str = "did:plc:okkciaiqv76a3oqr7qdledb4";
const RLARGE: &str = "did:plc:d255tkvufzfkpckokc332in6";

fn resync_frames() -> Vec<testkit::bytes_compat::Bytes> {
    relay_client::capture::read(&testkit::pds::repos_dir().join("firehose.resync.frames")).expect("capture")
}

/// Every repo of the reference PDS, served as itself.
fn every_repo() -> HashMap<String, String> {
    testkit::fold::reference().into_keys().map(|d| (d.clone(), d)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_break_is_repaired_from_the_pds_and_the_fold_equals_the_reference() {
    let base = testkit::pds::start(every_repo()).await;
    let plc = Plc::start(testkit::pds::docs(&base)).await;
    let relay = relay_sim::RelaySim::start_with(
        resync_frames(),
        relay_sim::SimConfig::default(),
        "127.0.0.1:0".parse().expect("addr"),
    )
    .await
    .expect("sim");
    let dir = tmpdir("resync-e2e");
    let mut env = base_env(&relay.url(), &dir);
    let addr = format!("127.0.0.1:{}", free_port());
    let out = dir.join("out.jsonl");
    env.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    env.insert("FIREKEEPER_PLC_URL".into(), plc.url());
    env.insert("FIREKEEPER_ALLOW_PRIVATE_ADDRESSES".into(), "true".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    eventually("the stream committed and both repos resynchronised", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/status").await else { return false };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        v["committed"] == 508 && v["desynchronized"] == 0 && text.matches("\"#resync\"").count() >= 2
    })
    .await;
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    assert!(sigterm_and_wait(child).success());
    let log = std::fs::read_to_string(dir.join("c.log")).expect("log");
    assert!(log.contains("repo resynchronised from its PDS"), "{log}");
    assert!(metrics.contains("firekeeper_resyncs_total{outcome=\"done\",reason=\"chain\"} 2\n"), "{metrics}");

    let text = std::fs::read_to_string(&out).expect("output");
    let resyncs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON"))
        .filter(|l| l["event"]["type"] == "#resync")
        .collect();
    let mut repos: Vec<&str> = resyncs.iter().map(|l| l["event"]["repo"].as_str().expect("repo")).collect();
    repos.sort_unstable();
    assert_eq!(repos, [RLARGE, RSMALL2], "only the two broken repos are resynchronised");
    for r in &resyncs {
        assert!(r["seq"].is_null(), "{r}");
        assert_eq!(r["event"]["reason"], "chain");
    }
    let folded = testkit::fold::jsonl(&text);
    for (did, (count, digest)) in testkit::fold::reference() {
        let got = folded.get(&did).cloned().unwrap_or_default();
        assert_eq!(got.len() as u64, count, "{did}: record count");
        assert_eq!(testkit::fold::digest(&got), digest, "{did}: records");
    }
}
