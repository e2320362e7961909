//! Verification end to end with the real binary: relay-sim replays the signed capture
//! with tampered frames, the test PLC serves its DID documents, and with
//! `FIREKEEPER_VERIFY=full` the jsonl sink gets exactly the tampered events as `#invalid`
//! lines (every other event as the relay sent it); `/metrics` counts them by reason and
//! `firekeeper repos invalid` lists the repos still desynchronised.

use testkit::http::http_get;
use testkit::plc::Plc;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait};
use testkit::{WAIT, eventually, free_port, tamper, tmpdir};

type Bytes = testkit::bytes_compat::Bytes;

fn seq_of(f: &[u8]) -> u64 {
    relay_sim::frame_seq(f).expect("seq")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_frames_reach_the_sink_as_invalid_lines_and_the_rest_verified() {
    let plc = Plc::signed_fixture().await;
    let frames = testkit::signed_frames();
    let commits: Vec<(u64, String)> = frames
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            relay_client::Frame::Message(relay_client::Message::Commit(c)) if c.ops.iter().any(|o| o.cid.is_some()) => {
                Some((c.seq, c.repo.to_owned()))
            }
            _ => None,
        })
        .collect();
    // The last commit of one repo (nothing chains after it: it stays listed), and two more.
    let last_of = |repo: &str| commits.iter().rev().find(|c| c.1 == repo).expect("a commit").0;
    let kept = last_of(&commits[0].1);
    let tampered: Vec<(u64, &str)> = vec![(kept, "signature"), (commits[200].0, "cid"), (commits[400].0, "mst")];
    let frames: Vec<Bytes> = frames
        .iter()
        .map(|f| match tampered.iter().find(|t| t.0 == seq_of(f)) {
            Some((_, "signature")) => tamper::sig_flipped(f),
            Some((_, "cid")) => tamper::record_changed(f),
            Some(_) => tamper::prev_data_wrong(f),
            None => f.clone(),
        })
        .collect();
    let relay = relay_sim::RelaySim::start_with(
        frames.clone(),
        relay_sim::SimConfig::default(),
        "127.0.0.1:0".parse().expect("addr"),
    )
    .await
    .expect("sim");
    let dir = tmpdir("verify-e2e");
    let mut env = base_env(&relay.url(), &dir);
    let addr = format!("127.0.0.1:{}", free_port());
    let out = dir.join("out.jsonl");
    env.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    env.insert("FIREKEEPER_VERIFY".into(), "full".into());
    // Verification's own listing: a repo whose later commits chain again is no longer
    // listed. With repo sync on (the default) it stays queued until its snapshot lands,
    // and these DID documents name no reachable PDS.
    env.insert("FIREKEEPER_RESYNC".into(), "false".into());
    env.insert("FIREKEEPER_PLC_URL".into(), plc.url());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    eventually("the whole stream committed", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/status").await else { return false };
        serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["committed"] == 959)
    })
    .await;
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    for reason in ["signature", "cid", "mst"] {
        assert!(metrics.contains(&format!("firekeeper_invalid_total{{reason=\"{reason}\"}} 1\n")), "{metrics}");
    }
    let (_, status) = http_get(&addr, "/status").await.expect("status");
    let status: serde_json::Value = serde_json::from_str(&status).expect("JSON");
    let listed = run_once(&env, &["repos", "invalid"]);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(sigterm_and_wait(child).success());

    assert!(status["desynchronized"].as_u64().is_some_and(|n| n >= 1), "{status}");
    assert!(listed.contains(&format!("{} seq {kept} signature", commits[0].1)), "{listed}");
    let text = std::fs::read_to_string(&out).expect("output");
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    assert_eq!(lines.len(), 959, "one line per event");
    for l in &lines {
        let seq = l["seq"].as_u64().expect("seq");
        assert_eq!(l["event"]["seq"], seq);
        match tampered.iter().find(|t| t.0 == seq) {
            Some((_, reason)) => {
                let e = &l["event"];
                assert_eq!((e["type"].as_str(), e["reason"].as_str()), (Some("#invalid"), Some(*reason)), "{l}");
                assert!(
                    e["repo"].is_string() && e["rev"].is_string() && e["commit"].is_string() && e["detail"].is_string()
                );
                assert_eq!(l["relay"], "primary");
                assert!(l["token"].as_u64().is_some());
            }
            None => assert_ne!(l["event"]["type"], "#invalid", "{l}"),
        }
    }
    let log = std::fs::read_to_string(dir.join("c.log")).expect("log");
    assert!(log.contains("event failed verification"), "logged");
}
