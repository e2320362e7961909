//! `make bench`: one giant repo through the real binary. A repo of a million records
//! (`FK_GIANT_RECORDS`; a like each, one signed commit, ~260 MB of CAR) is built here, served
//! from disk by a local PDS, named by a local PLC, and backfilled by the release binary
//! (`FIREKEEPER_BACKFILL_DIDS`) into the null sink and into a jsonl file: records/s (from
//! the binary's own "repo resynchronised" line: fetch, verify whole, render, deliver) and
//! the binary's peak RSS, which must not grow with the repo. Beside them in the same run:
//! the verification alone in this process (index the CAR on disk, walk the tree), the
//! ceiling without HTTP, rendering or a sink.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use testkit::http::http_get;

const DID: &str = "did:plc:giantrepo00000000000000";

/// The binary's peak RSS (`VmHWM`), MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

/// One backfill of the repo through the binary into `sink`: (records/s, peak RSS MiB).
async fn backfill(plc: &str, dir: &std::path::Path, sink: &str) -> (f64, f64) {
    let relay = testkit::proc::quiet_relay().await;
    let run = dir.join(sink);
    std::fs::create_dir_all(&run).expect("dir");
    let mut env = testkit::proc::base_env(&relay.url(), &run);
    let addr = format!("127.0.0.1:{}", testkit::free_port());
    env.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
    env.insert("FIREKEEPER_PLC_URL".into(), plc.to_owned());
    env.insert("FIREKEEPER_ALLOW_PRIVATE_ADDRESSES".into(), "true".into());
    env.insert("FIREKEEPER_BACKFILL_DIDS".into(), DID.into());
    env.insert("FIREKEEPER_START".into(), "live".into());
    match sink {
        "null" => {
            env.insert("FIREKEEPER_SINK".into(), "null".into());
        }
        _ => {
            env.insert("FIREKEEPER_JSONL_PATH".into(), run.join("out.jsonl").to_string_lossy().into_owned());
        }
    }
    let log = run.join("log");
    let mut child = testkit::proc::firekeeper(&env, &[], &log);
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_mins(10);
    loop {
        if let Some((200, m)) = http_get(&addr, "/metrics").await
            && m.contains("firekeeper_resyncs_total{outcome=\"done\",reason=\"backfill\"} 1\n")
        {
            break;
        }
        assert!(Instant::now() < deadline, "the backfill did not finish; log in {}", log.display());
        assert!(matches!(child.try_wait(), Ok(None)), "the binary exited; log in {}", log.display());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss = peak_rss_mib(pid);
    assert!(testkit::proc::sigterm_and_wait(child).success());
    let text = std::fs::read_to_string(&log).expect("log");
    let line = text.lines().find(|l| l.contains("repo resynchronised from its PDS")).expect("the resync's line");
    let v: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
    let ms = v["fields"]["ms"].as_f64().or_else(|| v["ms"].as_f64()).expect("ms");
    let records = v["fields"]["records"].as_f64().or_else(|| v["records"].as_f64()).expect("records");
    let _ = std::fs::remove_dir_all(&run);
    (records * 1000.0 / ms, rss)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n: u64 = std::env::var("FK_GIANT_RECORDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let dir = testkit::tmpdir("bench-giant");
        let path = dir.join("giant.car");
        let pds = testkit::pds::start_files(HashMap::from([(DID.to_owned(), path.clone())])).await;
        let t = Instant::now();
        let built = testkit::repo::write(&path, DID, n, &pds);
        println!(
            "built a repo of {n} records ({:.0} MB of CAR) in {:.1} s",
            built.bytes as f64 / 1e6,
            t.elapsed().as_secs_f64()
        );
        let plc = testkit::plc::Plc::start(HashMap::from([(DID.to_owned(), built.doc.clone())])).await;
        // The ceiling: index and verify the CAR on disk, in this process.
        let link = dir.join(".getrepo.verify.car");
        std::fs::hard_link(&path, &link).expect("link");
        let key = atproto_crypto::PublicKey::from_verification_method(
            "EcdsaSecp256k1VerificationKey2019",
            serde_json::from_str::<serde_json::Value>(&built.doc).expect("doc")["verificationMethod"][0]
                ["publicKeyMultibase"]
                .as_str()
                .expect("key"),
        )
        .expect("a key type")
        .expect("key");
        let t = Instant::now();
        let ix = repo_sync::blocks::Indexed::open(repo_sync::fetch::Body::File { path: link, len: built.bytes })
            .expect("indexed");
        let now = i64::try_from(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_micros(),
        )
        .expect("µs");
        let head = repo_sync::check::verify_indexed(&ix, DID, &key, now).expect("verified");
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(head.collections.values().sum::<u64>(), n);
        drop(ix);
        println!("verification alone (index the CAR on disk, walk the tree): {:.0} records/s", n as f64 / secs);
        for sink in ["null", "jsonl"] {
            let (rate, rss) = backfill(&plc.url(), &dir, sink).await;
            println!("backfill through the binary, {sink} sink: {rate:.0} records/s, peak RSS {rss:.1} MiB");
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}
