//! Repo sync end to end with the real binary: relay-sim replays a real PDS's firehose
//! with six commits of two repos taken out (a chain break in each), a local PDS serves
//! the repos' final CARs (`getRepo`) and a local PLC their DID documents. On default
//! settings (plus the PLC, and loopback allowed) the leader notices each break, fetches
//! the repo, verifies it and hands the jsonl sink a `#resync` and its `#record`s: folding
//! the output gives exactly the reference record set of every repo.

use std::collections::HashMap;

use testkit::http::http_get;
use testkit::pds::every_repo;
use testkit::plc::Plc;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait};
use testkit::{WAIT, eventually, free_port, tmpdir};

const RSMALL2: &str = "did:plc:okkciaiqv76a3oqr7qdledb4";
const RLARGE: &str = "did:plc:d255tkvufzfkpckokc332in6";

/// The chain-break capture (six commits of two repos taken out), and also the commit at
/// seq 506: the large repo's single delete, so that a record the repo no longer has was
/// handed over and never deleted downstream (a snapshot must drop it).
fn resync_frames() -> Vec<testkit::bytes_compat::Bytes> {
    let frames =
        relay_client::capture::read(&testkit::pds::repos_dir().join("firehose.resync.frames")).expect("capture");
    frames.into_iter().filter(|f| relay_sim::frame_seq(f) != Some(506)).collect()
}

/// `firekeeper_resyncs_total{outcome="done",reason="chain"}` in a metrics page.
fn resyncs_done(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("firekeeper_resyncs_total{outcome=\"done\",reason=\"chain\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// True once the replica at `addr` leads with no repo queued and has counted `n`
/// resyncs done for `reason`.
async fn settled(addr: &str, reason: &str, n: u64) -> bool {
    let Some((200, body)) = http_get(addr, "/status").await else { return false };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
    let Some((200, metrics)) = http_get(addr, "/metrics").await else { return false };
    v["role"] == "leader"
        && v["desynchronized"] == 0
        && metrics.contains(&format!("firekeeper_resyncs_total{{outcome=\"done\",reason=\"{reason}\"}} {n}\n"))
}

/// True once the replica at `addr` committed the whole capture (seq 508), holds no repo
/// desynchronised, and its metrics page contains `needle`.
async fn repaired(addr: &str, needle: &str) -> bool {
    let Some((200, body)) = http_get(addr, "/status").await else { return false };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
    let Some((200, metrics)) = http_get(addr, "/metrics").await else { return false };
    v["committed"] == 508 && v["desynchronized"] == 0 && metrics.contains(needle)
}

/// A local world for the binary: a PLC serving the reference DID documents with their PDS
/// at `pds`, relay-sim replaying `frames`, and the binary's environment for them (an HTTP
/// address, jsonl to `dir/out.jsonl`, loopback addresses allowed).
struct World {
    plc: Plc,
    _relay: relay_sim::RelaySim,
    env: HashMap<String, String>,
    addr: String,
    out: std::path::PathBuf,
}

async fn world(pds: &str, frames: Vec<testkit::bytes_compat::Bytes>, dir: &std::path::Path) -> World {
    world_with(pds, frames, relay_sim::SimConfig::default(), dir).await
}

/// [`world`] with relay-sim configured by `cfg`.
async fn world_with(
    pds: &str,
    frames: Vec<testkit::bytes_compat::Bytes>,
    cfg: relay_sim::SimConfig,
    dir: &std::path::Path,
) -> World {
    let plc = Plc::start(testkit::pds::docs(pds)).await;
    let relay = relay_sim::RelaySim::start_with(frames, cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim");
    let mut env = base_env(&relay.url(), dir);
    let addr = format!("127.0.0.1:{}", free_port());
    let out = dir.join("out.jsonl");
    env.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    env.extend(testkit::pds::repair_env(&plc.url()).map(|(k, v)| (k.to_owned(), v)));
    World { plc, _relay: relay, env, addr, out }
}

/// Where the run's output goes.
enum Sink {
    Jsonl,
    Postgres(testkit::PgServer),
}

/// Runs the binary over the chain-break capture until the stream is committed and no
/// repo is left desynchronised; returns the jsonl output (empty for Postgres), the
/// metrics at the end and the log.
async fn run(sink: &Sink, dir: &std::path::Path) -> (String, String, String) {
    run_with(sink, dir, &[]).await
}

/// [`run`] with more settings.
async fn run_with(sink: &Sink, dir: &std::path::Path, extra: &[(&str, &str)]) -> (String, String, String) {
    let base = testkit::pds::start(every_repo()).await;
    let World { mut env, addr, out, plc: _plc, _relay } = world(&base, resync_frames(), dir).await;
    env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    if let Sink::Postgres(pg) = sink {
        postgres_env(&mut env, pg);
    }
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    eventually("the stream committed and both repos resynchronised", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/status").await else { return false };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
        let Some((200, metrics)) = http_get(&addr, "/metrics").await else { return false };
        v["committed"] == 508 && v["desynchronized"] == 0 && resyncs_done(&metrics) >= 2
    })
    .await;
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    assert!(sigterm_and_wait(child).success());
    let log = std::fs::read_to_string(dir.join("c.log")).expect("log");
    (std::fs::read_to_string(&out).unwrap_or_default(), metrics, log)
}

/// The Postgres sink with its records table, and the cursor store in the same database.
fn postgres_env(env: &mut HashMap<String, String>, pg: &testkit::PgServer) {
    env.insert("FIREKEEPER_SINK".into(), "postgres".into());
    env.insert("FIREKEEPER_CURSOR_STORE".into(), "postgres".into());
    env.insert("FIREKEEPER_POSTGRES_RECORDS".into(), "true".into());
    env.insert("DATABASE_URL".into(), pg.url());
}

/// The rows of `firekeeper_records` at `url`, folded per repo (record path → CID).
async fn records_table(url: &str) -> testkit::fold::Folded {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("pg");
    tokio::spawn(conn);
    let rows =
        c.query("SELECT did, collection || '/' || rkey, cid FROM firekeeper_records", &[]).await.expect("records");
    let mut folded = testkit::fold::Folded::new();
    for r in rows {
        folded.entry(r.get::<_, String>(0)).or_default().insert(r.get(1), r.get(2));
    }
    folded
}

/// Every repo's records equal the reference set.
fn assert_reference(folded: &testkit::fold::Folded) {
    testkit::fold::assert_reference(folded, "the fold");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_break_is_repaired_from_the_pds_and_the_fold_equals_the_reference() {
    let dir = tmpdir("resync-e2e");
    let (text, metrics, log) = run(&Sink::Jsonl, &dir).await;
    assert!(log.contains("repo resynchronised from its PDS"), "{log}");
    assert!(resyncs_done(&metrics) >= 2, "{metrics}");
    let resyncs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON"))
        .filter(|l| l["event"]["type"] == "#resync")
        .collect();
    let repos: std::collections::BTreeSet<&str> =
        resyncs.iter().map(|l| l["event"]["repo"].as_str().expect("repo")).collect();
    assert_eq!(repos, [RLARGE, RSMALL2].into(), "only the two broken repos are resynchronised");
    for r in &resyncs {
        assert!(r["seq"].is_null(), "{r}");
        assert_eq!(r["event"]["reason"], "chain");
    }
    assert_reference(&testkit::fold::jsonl(&text));
}

/// The held-back scenario's shape: the chain-break capture with one more commit tampered
/// (a record changed under its CID: the last of its repo, so no later commit's chain
/// check repairs it), `FIREKEEPER_VERIFY=full`: the tampered commit, and
/// each commit that does not continue its repo's chain, reach the sink as `#invalid`, and
/// their repos are resynchronised; folding the output gives every repo's reference
/// records, the tampered repo's included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_commit_and_chain_breaks_are_repaired_and_the_fold_equals_the_reference() {
    let base = testkit::pds::start(every_repo()).await;
    tampered_repaired_jsonl(base, tampered_frames()).await;
}

/// The held-back scenario's shape with the Postgres sink and its records table, on the
/// binary's default verification (`full`: the test environment's `off` removed): the
/// records table equals every repo's reference records, the tampered repo's included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_records_table_equals_the_reference_after_a_tampered_commit_on_default_verification() {
    let base = testkit::pds::start(every_repo()).await;
    let dir = tmpdir("resync-tampered-pg");
    let World { mut env, addr, plc: _plc, _relay, .. } = world(&base, tampered_frames(), &dir).await;
    env.remove("FIREKEEPER_VERIFY");
    let pg = testkit::PgServer::start();
    postgres_env(&mut env, &pg);
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    let cid = "reason=\"cid\"} 1\n";
    eventually("the stream committed and every marked repo resynchronised", WAIT, async || repaired(&addr, cid).await)
        .await;
    assert!(sigterm_and_wait(child).success());
    assert_reference(&records_table(&pg.url()).await);
}

/// The chain-break capture with the last commit of rsmall1 that writes a record tampered
/// (a record changed under its CID: no later commit's chain check repairs it).
fn tampered_frames() -> Vec<testkit::bytes_compat::Bytes> {
    let rsmall1 = "did:plc:4fqcvmfbjmzuc7dzjjm6ss6q";
    let frames = resync_frames();
    let victim = frames
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            relay_client::Frame::Message(relay_client::Message::Commit(c))
                if c.repo == rsmall1 && c.ops.iter().any(|o| o.cid.is_some()) =>
            {
                Some(c.seq)
            }
            _ => None,
        })
        .last()
        .expect("a commit of rsmall1 with a record");
    frames
        .iter()
        .map(|f| if relay_sim::frame_seq(f) == Some(victim) { testkit::tamper::record_changed(f) } else { f.clone() })
        .collect()
}

/// The tampered capture through the jsonl sink with full verification, the PDS at `base`.
async fn tampered_repaired_jsonl(base: String, frames: Vec<testkit::bytes_compat::Bytes>) {
    let rsmall1 = "did:plc:4fqcvmfbjmzuc7dzjjm6ss6q";
    let dir = tmpdir("resync-tampered");
    let World { mut env, addr, out, plc: _plc, _relay } = world(&base, frames, &dir).await;
    env.insert("FIREKEEPER_VERIFY".into(), "full".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    let cid = "reason=\"cid\"} 1\n";
    eventually("the stream committed and every marked repo resynchronised", WAIT, async || repaired(&addr, cid).await)
        .await;
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    assert!(sigterm_and_wait(child).success());
    let text = std::fs::read_to_string(&out).expect("output");
    // The tampered commit is `#invalid` (cid); with verification a commit that does not
    // continue its repo's chain is `#invalid` (chain) too, not delivered as itself.
    let invalid: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.contains("\"#invalid\""))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["event"].clone())
        .collect();
    let cid: Vec<&serde_json::Value> = invalid.iter().filter(|e| e["reason"] == "cid").collect();
    assert_eq!(cid.len(), 1, "{invalid:?}");
    assert_eq!(cid[0]["repo"], rsmall1);
    assert!(invalid.iter().all(|e| e["reason"] == "cid" || e["reason"] == "chain"), "{invalid:?}");
    let resynced: std::collections::BTreeSet<String> = text
        .lines()
        .filter(|l| l.contains("\"#resync\""))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["event"]["repo"].as_str().map(str::to_owned))
        .collect();
    assert!(
        resynced.contains(rsmall1) && resynced.contains(RLARGE) && resynced.contains(RSMALL2),
        "{resynced:?}: {metrics}"
    );
    assert_reference(&testkit::fold::jsonl(&text));
}

/// The same through the Postgres sink with its records mirror: the `firekeeper_records`
/// table equals the reference record set of every repo.
/// The same with every fetched repo over the memory bound: spilled to the data directory,
/// read back by offset, handed over a part at a time (the large repo's 20,000 records in
/// five parts, one `#resync`); the fold equals the reference and no spill file is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repo_spilled_to_disk_reaches_jsonl_a_part_at_a_time_and_folds_to_the_reference() {
    let dir = tmpdir("resync-spill");
    let (text, _, log) = run_with(&Sink::Jsonl, &dir, &[("FIREKEEPER_SYNC_MEMORY_BYTES", "65536")]).await;
    assert!(log.contains("repo resynchronised from its PDS"), "{log}");
    let large: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON"))
        .filter(|l| l["event"]["repo"] == RLARGE && l["seq"].is_null())
        .collect();
    assert_eq!(large.iter().filter(|l| l["event"]["type"] == "#resync").count(), 1, "one #resync");
    assert_eq!(large.iter().filter(|l| l["event"]["type"] == "#record").count(), 20_000, "every record once");
    assert_eq!(large[0]["event"]["type"], "#resync", "the #resync first");
    assert_eq!(large[0]["event"]["records"], 20_000);
    assert_reference(&testkit::fold::jsonl(&text));
    assert_no_spill_left(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_records_table_equals_the_reference_after_a_chain_break() {
    the_postgres_records_table_equals_the_reference(&[]).await;
}

/// A repo over the memory bound is spilled to the data directory, read back by offset
/// and handed over a part at a time (20,000 records: five parts): the records table still
/// equals the reference, and no spill file is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repo_spilled_to_disk_fills_the_postgres_records_table_a_part_at_a_time() {
    let dir = the_postgres_records_table_equals_the_reference(&[("FIREKEEPER_SYNC_MEMORY_BYTES", "65536")]).await;
    assert_no_spill_left(&dir);
}

/// No `getRepo` body is left in the data directory under `dir`, where they were spilled.
fn assert_no_spill_left(dir: &std::path::Path) {
    testkit::assert_no_spill_left(&dir.join("data"));
}

async fn the_postgres_records_table_equals_the_reference(extra: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = tmpdir("resync-pg");
    let pg = testkit::PgServer::start();
    let url = pg.url();
    let sink = Sink::Postgres(pg);
    let (_, _, log) = run_with(&sink, &dir, extra).await;
    if !extra.is_empty() {
        assert!(log.contains("repo resynchronised from its PDS"), "{log}");
    }
    assert_reference(&records_table(&url).await);
    let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.expect("pg");
    tokio::spawn(conn);
    let resyncs: i64 = c
        .query_one("SELECT count(*) FROM firekeeper_events WHERE seq IS NULL AND kind = '#resync'", &[])
        .await
        .expect("count")
        .get(0);
    assert!(resyncs >= 2, "{resyncs}");
    dir
}

/// The leader lost (killed, or frozen past its ttl) while the large repo's download is in
/// flight: the next leader fetches it again and finishes; the woken one writes nothing;
/// the fold equals the reference and the repo's snapshot is in the output once.
/// Where the lease and the resync queue live in a lost-leader run.
enum Store {
    /// Both in Redis.
    Redis,
    /// Both in NATS JetStream KV.
    Nats,
    /// The lease in Redis, the cursor and the queue in Postgres.
    Postgres,
}

async fn a_leader_lost_during_a_resync(freeze: bool) {
    a_leader_lost_during_a_resync_on(freeze, &Store::Redis).await;
}

async fn a_leader_lost_during_a_resync_on(freeze: bool, store: &Store) {
    a_leader_lost_during(freeze, store, false).await;
}

/// [`a_leader_lost_during_a_resync_on`], or with `backfill` the same in the middle of a
/// backfill: the stream committed at its end, every reference repo listed in
/// `FIREKEEPER_BACKFILL_DIDS`, the leader lost while the large repo's download is in
/// flight; the next leader finishes the backfill from the kept position and queue.
async fn a_leader_lost_during(freeze: bool, store: &Store, backfill: bool) {
    let slow = HashMap::from([(RLARGE.to_owned(), std::time::Duration::from_secs(4))]);
    let base = testkit::pds::start_slow(every_repo(), slow).await;
    let dir = tmpdir(if freeze { "resync-freeze" } else { "resync-kill" });
    let World { mut env, out, plc: _plc, _relay, .. } = world(&base, resync_frames(), &dir).await;
    // A shared lease (a lock file would stay held by the frozen process).
    let (mut _redis, mut _nats, mut _pg) = (None, None, None);
    match store {
        Store::Redis | Store::Postgres => {
            let redis = testkit::RedisServer::start();
            env.insert("REDIS_URL".into(), redis.url());
            _redis = Some(redis);
        }
        Store::Nats => {
            let nats = testkit::NatsServer::start();
            env.insert("NATS_URL".into(), nats.url());
            _nats = Some(nats);
        }
    }
    if let Store::Postgres = store {
        let pg = testkit::PgServer::start();
        env.insert("DATABASE_URL".into(), pg.url());
        env.insert("FIREKEEPER_CURSOR_STORE".into(), "postgres".into());
        _pg = Some(pg);
    }
    if backfill {
        let list = dir.join("dids.txt");
        let dids: Vec<String> = testkit::fold::reference().into_keys().collect();
        std::fs::write(&list, dids.join("\n")).expect("list");
        env.insert("FIREKEEPER_BACKFILL_DIDS".into(), format!("@{}", list.display()));
    }
    let start = if backfill { "508" } else { "0" };
    assert!(run_once(&env, &["cursor", "set", start]).status.success());
    let (addr_a, addr_b) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let mut env_a = env.clone();
    env_a.insert("FIREKEEPER_HTTP_ADDR".into(), addr_a.clone());
    let mut a = firekeeper(&env_a, &[], &dir.join("a.log"));
    // The whole stream committed (the next leader will not see the break again: only
    // the queue kept in the store tells it), the large repo's download in flight.
    eventually("the stream committed and the large repo's download in flight", WAIT, async || {
        let Some((200, status)) = http_get(&addr_a, "/status").await else { return false };
        let status: serde_json::Value = serde_json::from_str(&status).unwrap_or_default();
        let Some((200, body)) = http_get(&addr_a, "/repos/invalid").await else { return false };
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        status["committed"] == 508
            && v["repos"].as_array().into_iter().flatten().any(|d| d["repo"] == RLARGE && d["state"] == "resyncing")
    })
    .await;
    testkit::lose(&mut a, freeze);
    let mut env_b = env.clone();
    env_b.insert("FIREKEEPER_HTTP_ADDR".into(), addr_b.clone());
    let b = firekeeper(&env_b, &[], &dir.join("b.log"));
    eventually("the next leader finished the resync", WAIT, async || {
        let Some((200, body)) = http_get(&addr_b, "/status").await else { return false };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
        v["role"] == "leader" && v["committed"] == 508 && v["desynchronized"] == 0
    })
    .await;
    if freeze {
        // The frozen leader wakes with its download answered: its term is over.
        testkit::sigcont(a.id());
        tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    }
    let _ = a.kill();
    let _ = a.wait();
    assert!(sigterm_and_wait(b).success());
    let text = std::fs::read_to_string(&out).expect("output");
    let large = text.lines().filter(|l| l.contains("\"#resync\"") && l.contains(RLARGE)).count();
    assert_eq!(large, 1, "the large repo's snapshot is written once (by the next leader)");
    if backfill {
        assert!(text.lines().all(|l| l.starts_with("{\"seq\":null,")), "nothing but snapshots");
    }
    assert_reference(&testkit::fold::jsonl(&text));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_during_a_backfill_is_finished_by_the_next() {
    a_leader_lost_during(false, &Store::Redis, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_frozen_during_a_backfill_writes_nothing_when_it_wakes() {
    a_leader_lost_during(true, &Store::Redis, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_during_a_resync_is_finished_by_the_next() {
    a_leader_lost_during_a_resync(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_frozen_during_a_resync_writes_nothing_when_it_wakes() {
    a_leader_lost_during_a_resync(true).await;
}

/// The same scenarios with the lease and the queue in NATS KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_nats_a_leader_killed_or_frozen_during_a_resync_loses_nothing() {
    a_leader_lost_during_a_resync_on(false, &Store::Nats).await;
    a_leader_lost_during_a_resync_on(true, &Store::Nats).await;
}

/// The kill with the queue kept in Postgres (the lease in Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_leader_killed_during_a_resync_is_finished_by_the_next() {
    a_leader_lost_during_a_resync_on(false, &Store::Postgres).await;
}

/// Backfill: a deployment that starts at the head of the stream, with the reference PDS's
/// DIDs listed, hands the sink every repo's snapshot: the fold equals every reference set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_of_listed_dids_folds_to_every_repos_records() {
    let base = testkit::pds::start(every_repo()).await;
    let dir = tmpdir("backfill");
    let World { mut env, addr, out, plc: _plc, _relay } = world(&base, resync_frames(), &dir).await;
    let list = dir.join("dids.txt");
    let dids: Vec<String> = testkit::fold::reference().into_keys().collect();
    std::fs::write(&list, dids.join("\n")).expect("list");
    env.insert("FIREKEEPER_BACKFILL_DIDS".into(), format!("@{}", list.display()));
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    eventually("every listed repo backfilled", WAIT, async || settled(&addr, "backfill", 9).await).await;
    let (_, status) = http_get(&addr, "/status").await.expect("status");
    assert!(sigterm_and_wait(child).success());
    let text = std::fs::read_to_string(&out).expect("output");
    assert_eq!(text.lines().filter(|l| l.contains("\"#resync\"")).count(), 9, "each repo once");
    assert!(text.lines().all(|l| l.starts_with("{\"seq\":null,")), "nothing but snapshots");
    let folded = testkit::fold::jsonl(&text);
    assert_reference(&folded);
    // The progress a person watches: the list worked through, every repo and record
    // counted, a rate measured, nothing left (no ETA).
    let p = &serde_json::from_str::<serde_json::Value>(&status).expect("json")["repo_sync"];
    let records: usize = folded.values().map(std::collections::BTreeMap::len).sum();
    assert_eq!((p["done"].as_u64(), p["queued"].as_u64(), p["in_flight"].as_u64()), (Some(9), Some(0), Some(0)), "{p}");
    assert_eq!(p["records"].as_u64(), Some(records as u64), "{p}");
    assert_eq!((p["backfill"]["listed"].as_u64(), p["backfill"]["listed_queued"].as_u64()), (Some(9), Some(9)), "{p}");
    assert!(p["repos_per_second"].as_f64().is_some_and(|r| r > 0.0) && p["bytes"].as_u64() > Some(0), "{p}");
    assert!(p["eta_seconds"].is_null(), "{p}");
}

/// A next leader of `env` (whose listing is done) leads two seconds without backfilling.
async fn the_next_leader_backfills_nothing(env: &HashMap<String, String>, addr: &str, dir: &std::path::Path) {
    let child = firekeeper(env, &[], &dir.join("b.log"));
    eventually("the next leader", WAIT, async || {
        let Some((200, body)) = http_get(addr, "/status").await else { return false };
        serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["role"] == "leader")
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let (_, metrics) = http_get(addr, "/metrics").await.expect("metrics");
    assert!(sigterm_and_wait(child).success());
    assert!(!metrics.contains("reason=\"backfill\"} "), "nothing backfilled again: {metrics}");
}

/// `FIREKEEPER_BACKFILL=all`: a new deployment walks the host's `listRepos` (three
/// pages here) and hands the sink every repo's snapshot: the fold equals every reference
/// set. The listing's end is kept in the store: the next leader lists nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_of_every_listed_repo_walks_the_pages_once() {
    let base = testkit::pds::start(every_repo()).await;
    let dir = tmpdir("backfill-all");
    let World { mut env, addr, out, plc: _plc, _relay } = world(&base, resync_frames(), &dir).await;
    env.insert("FIREKEEPER_BACKFILL".into(), "all".into());
    env.insert("FIREKEEPER_BACKFILL_HOST".into(), base.clone());
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("a.log"));
    eventually("every listed repo backfilled", WAIT, async || settled(&addr, "backfill", 9).await).await;
    assert!(sigterm_and_wait(child).success());
    let log = std::fs::read_to_string(dir.join("a.log")).expect("log");
    assert_eq!(log.matches("backfill: a page of the host's repos queued").count(), 3, "{log}");
    // The next leader: the listing is done, nothing is queued again.
    the_next_leader_backfills_nothing(&env, &addr, &dir).await;
    let text = std::fs::read_to_string(&out).expect("output");
    assert_eq!(text.lines().filter(|l| l.contains("\"#resync\"")).count(), 9, "each repo once");
    assert_reference(&testkit::fold::jsonl(&text));
}

/// `FIREKEEPER_BACKFILL=collections`: the repos the host lists by collection
/// (`listReposByCollection`: two hold `app.bsky.graph.block`, eight small ones
/// `app.bsky.feed.repost`, in pages of three; the large repo neither) are backfilled, each
/// with only the records of those collections; the large repo is never fetched. The
/// listing's end is kept: the next leader lists nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_by_collection_takes_the_repos_that_hold_them() {
    const COLLECTIONS: [&str; 2] = ["app.bsky.graph.block", "app.bsky.feed.repost"];
    let base = testkit::pds::start(every_repo()).await;
    let dir = tmpdir("backfill-collections");
    let World { mut env, addr, out, plc: _plc, _relay } = world(&base, resync_frames(), &dir).await;
    env.insert("FIREKEEPER_BACKFILL".into(), "collections".into());
    env.insert("FIREKEEPER_COLLECTIONS".into(), COLLECTIONS.join(","));
    env.insert("FIREKEEPER_BACKFILL_HOST".into(), base.clone());
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    let per = testkit::pds::per_collection();
    let holding: std::collections::BTreeSet<String> =
        COLLECTIONS.iter().flat_map(|c| testkit::pds::holding(c)).collect();
    assert_eq!(holding.len(), 8, "the fixture: the eight small repos");
    let child = firekeeper(&env, &[], &dir.join("a.log"));
    eventually("every repo of the collections backfilled", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/status").await else { return false };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let done: std::collections::BTreeSet<String> = testkit::fold::jsonl(&text).into_keys().collect();
        v["desynchronized"] == 0 && done == holding
    })
    .await;
    assert!(sigterm_and_wait(child).success());
    let log = std::fs::read_to_string(dir.join("a.log")).expect("log");
    assert_eq!(log.matches("backfill: a page of the host's repos queued").count(), 4, "1 + 3 pages: {log}");
    let folded = testkit::fold::jsonl(&std::fs::read_to_string(&out).expect("output"));
    assert!(!folded.contains_key(RLARGE), "the large repo holds neither collection");
    for did in &holding {
        let want: u64 = COLLECTIONS.iter().map(|c| per[did].get(*c).copied().unwrap_or(0)).sum();
        let got = &folded[did];
        assert_eq!(got.len() as u64, want, "{did}: the records of the two collections");
        assert!(got.keys().all(|k| COLLECTIONS.iter().any(|c| k.starts_with(&format!("{c}/")))), "{did}: {got:?}");
    }
    // The next leader: the listing is done, nothing is queued again.
    the_next_leader_backfills_nothing(&env, &addr, &dir).await;
}

/// Backfill by collection refuses, at start, a filter it cannot list by.
#[test]
fn a_backfill_by_collection_needs_exact_collections() {
    let dir = tmpdir("backfill-collections-config");
    let mut env = base_env("wss://relay.example", &dir);
    env.insert("FIREKEEPER_BACKFILL".into(), "collections".into());
    let out = run_once(&env, &["check-config"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && err.contains("needs FIREKEEPER_COLLECTIONS"), "{err}");
    env.insert("FIREKEEPER_COLLECTIONS".into(), "app.bsky.feed.*".into());
    let out = run_once(&env, &["check-config"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && err.contains("\"app.bsky.feed.*\""), "{err}");
}

/// A PDS that rate-limits the whole host (every repo answered 429 for two seconds after
/// the first request): the first 429 parks the host, and its other repos wait without
/// being asked (one 429 in all, with one worker), then every repo lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_host_is_parked_and_its_other_repos_wait() {
    use testkit::pds::Fault;
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let window = Fault::HostWindow { secs: 2, opened: None, answered: answered.clone() };
    let base = testkit::pds::start_faulty(
        every_repo(),
        HashMap::new(),
        HashMap::from([(testkit::pds::EVERY.to_owned(), window)]),
    )
    .await;
    let dir = tmpdir("resync-parked");
    let World { mut env, addr, out, plc: _plc, _relay } = world(&base, resync_frames(), &dir).await;
    let dids: Vec<String> = testkit::fold::reference().into_keys().collect();
    env.insert("FIREKEEPER_BACKFILL_DIDS".into(), dids.join(","));
    env.insert("FIREKEEPER_SYNC_WORKERS".into(), "1".into());
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    // While the window lasts the host shows as parked.
    eventually("the host parked", WAIT, async || {
        http_get(&addr, "/metrics").await.is_some_and(|(_, m)| m.contains("firekeeper_resync_parked_hosts 1\n"))
    })
    .await;
    eventually("every repo landed after the host's window", WAIT, async || settled(&addr, "backfill", 9).await).await;
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    assert!(sigterm_and_wait(child).success());
    assert!(metrics.contains("firekeeper_resync_parked_hosts 0\n"), "no host parked at the end: {metrics}");
    assert!(metrics.contains("firekeeper_resync_duration_seconds_count 9\n"), "each resync timed: {metrics}");
    assert_eq!(answered.load(std::sync::atomic::Ordering::Relaxed), 1, "one 429: {metrics}");
    assert!(
        metrics.contains("firekeeper_resyncs_total{outcome=\"rate_limited\",reason=\"backfill\"} 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("outcome=\"parked\""), "the others waited: {metrics}");
    assert_reference(&testkit::fold::jsonl(&std::fs::read_to_string(&out).expect("output")));
}

/// `FIREKEEPER_SYNC_SOURCE=<relay>`: `getRepo` goes to a relay that answers with a
/// redirect to the PDS (as the Bluesky relay does); the redirect is followed and the
/// repo verified against the key of its DID document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repo_fetched_through_a_redirecting_relay_is_verified_and_delivered() {
    let pds = testkit::pds::start(every_repo()).await;
    let (relay, redirected) = testkit::pds::redirecting(&pds).await;
    let dir = tmpdir("resync-via-relay");
    let World { mut env, addr, out, plc: _plc, _relay } = world(&pds, resync_frames(), &dir).await;
    env.insert("FIREKEEPER_SYNC_SOURCE".into(), relay);
    env.insert("FIREKEEPER_BACKFILL_DIDS".into(), RLARGE.into());
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    eventually("the repo landed", WAIT, async || {
        let Some((200, metrics)) = http_get(&addr, "/metrics").await else { return false };
        metrics.contains("firekeeper_resyncs_total{outcome=\"done\",reason=\"backfill\"} 1\n")
    })
    .await;
    assert!(sigterm_and_wait(child).success());
    assert!(redirected.load(std::sync::atomic::Ordering::Relaxed) >= 1, "asked through the relay");
    let folded = testkit::fold::jsonl(&std::fs::read_to_string(&out).expect("output"));
    testkit::fold::assert_repo(&folded, RLARGE, "through the relay");
}

/// The PDS's faults, with the outcome a user expects: a repo it does not host is `gone`
/// (listed, not retried until an event of it); a 429 is waited out (`Retry-After`) without
/// counting an attempt, then the repo lands; a repo that does not verify (another
/// account's CAR) is retried with backoff and, after the last attempt, listed as `failed`.
/// Nothing of a repo that failed is handed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pds_faults_end_as_gone_waited_out_or_failed() {
    use testkit::pds::Fault;
    let rsmall1 = "did:plc:4fqcvmfbjmzuc7dzjjm6ss6q";
    let mut serve = every_repo();
    // rsmall2's PDS serves rsmall1's repo: it does not verify as rsmall2's.
    serve.insert(RSMALL2.to_owned(), rsmall1.to_owned());
    // rsmall6's PDS dies half-way through its first answer (its commit at seq 52 removed).
    let rsmall6 = "did:plc:qtaboiqadpwydawai3v34mjp";
    let faults = HashMap::from([
        (RLARGE.to_owned(), Fault::RateLimited { times: 1, retry_after_s: 2 }),
        (rsmall6.to_owned(), Fault::DiesHalfway { times: 1 }),
    ]);
    let base = testkit::pds::start_faulty(serve, HashMap::new(), faults).await;
    // A repo whose PDS does not host it: rsmall5's break (its commit at seq 337 removed).
    let rsmall5 = "did:plc:uv2rvvs7zmya6xu7tosxot4q";
    let gone_base = testkit::pds::start_faulty(
        every_repo(),
        HashMap::new(),
        HashMap::from([(rsmall5.to_owned(), Fault::NotFound)]),
    )
    .await;
    let frames: Vec<_> =
        resync_frames().into_iter().filter(|f| !matches!(relay_sim::frame_seq(f), Some(337 | 52))).collect();
    let dir = tmpdir("resync-faults");
    let World { mut env, addr, out, plc, _relay } = world(&base, frames, &dir).await;
    plc.set_doc(rsmall5, testkit::pds::docs(&gone_base)[rsmall5].clone());
    env.insert("FIREKEEPER_RESYNC_RETRY_MS".into(), "300".into());
    env.insert("FIREKEEPER_RESYNC_ATTEMPTS".into(), "2".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    let state_of = |v: &serde_json::Value, repo: &str| {
        v["repos"].as_array().into_iter().flatten().find(|d| d["repo"] == repo).map(|d| d["state"].clone())
    };
    eventually("the large repo and rsmall6 landed, rsmall2 failed, rsmall5 gone", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/repos/invalid").await else { return false };
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let Some((200, metrics)) = http_get(&addr, "/metrics").await else { return false };
        state_of(&v, RLARGE).is_none()
            && state_of(&v, rsmall6).is_none()
            && state_of(&v, RSMALL2).is_some_and(|s| s == "failed")
            && state_of(&v, rsmall5).is_some_and(|s| s == "gone")
            && metrics.contains("firekeeper_resyncs_total{outcome=\"done\",reason=\"chain\"} 2\n")
    })
    .await;
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    let listed = run_once(&env, &["repos", "invalid", "--addr", &addr]);
    assert!(sigterm_and_wait(child).success());
    assert!(metrics.contains("firekeeper_resyncs_total{outcome=\"rate_limited\",reason=\"chain\"} 1\n"), "{metrics}");
    assert!(metrics.contains("firekeeper_resyncs_total{outcome=\"invalid\",reason=\"chain\"} 2\n"), "{metrics}");
    assert!(metrics.contains("firekeeper_resyncs_total{outcome=\"gone\",reason=\"chain\"} 1\n"), "{metrics}");
    // The answer cut short is a failed attempt (retried), never a short repo delivered.
    assert!(metrics.contains("firekeeper_resyncs_total{outcome=\"failed\",reason=\"chain\"} 1\n"), "{metrics}");
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(listed.contains(&format!("{RSMALL2} seq 255 chain rev 3n3ykm4kbpt2h failed attempts 2")), "{listed}");
    assert!(listed.contains(&format!("{rsmall5} ")) && listed.contains(" gone attempts 0"), "{listed}");
    let text = std::fs::read_to_string(&out).expect("output");
    let snapshots: Vec<&str> = text.lines().filter(|l| l.contains("\"#resync\"")).collect();
    assert_eq!(snapshots.len(), 2, "the large repo's and rsmall6's snapshots, once each: {snapshots:?}");
    let folded = testkit::fold::jsonl(&text);
    for did in [RLARGE, rsmall6] {
        assert!(snapshots.iter().any(|s| s.contains(did)), "{did}: {snapshots:?}");
        let (count, digest) = &testkit::fold::reference()[did];
        assert_eq!((folded[did].len() as u64, testkit::fold::digest(&folded[did])), (*count, digest.clone()), "{did}");
    }
}

/// `firekeeper repos resync`: refused without the token (said by the CLI) and with a
/// wrong one (401 from the leader); with it, each repo is queued and kept by the store
/// before the command returns, so a leader killed while one requested download is in
/// flight and another waits queued leaves both to the next, which finishes them. `repos show` says where a repo stands; `repos list
/// --state` narrows the list. The fold of what was handed over equals the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resync_is_kept_and_survives_the_leader() {
    let rsmall1 = "did:plc:4fqcvmfbjmzuc7dzjjm6ss6q";
    let slow = HashMap::from([(RSMALL2.to_owned(), std::time::Duration::from_secs(4))]);
    let base = testkit::pds::start_slow(every_repo(), slow).await;
    let dir = tmpdir("resync-operator");
    let World { mut env, addr, out, plc: _plc, _relay } = world(&base, resync_frames(), &dir).await;
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    env.insert("FIREKEEPER_SYNC_WORKERS".into(), "1".into());
    let mut cli_env = env.clone();
    env.insert("FIREKEEPER_ADMIN_TOKEN".into(), "the-token".into());
    let mut a = firekeeper(&env, &[], &dir.join("a.log"));
    let leads = async |addr: &str| {
        let Some((200, body)) = http_get(addr, "/status").await else { return false };
        serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["role"] == "leader")
    };
    eventually("a leader", WAIT, async || leads(&addr).await).await;
    let asked = run_once(&cli_env, &["repos", "resync", rsmall1, "--addr", &addr]);
    let err = String::from_utf8_lossy(&asked.stderr);
    assert_eq!(asked.status.code(), Some(1), "{err}");
    assert!(err.contains("FIREKEEPER_ADMIN_TOKEN"), "{err}");
    cli_env.insert("FIREKEEPER_ADMIN_TOKEN".into(), "not-the-token".into());
    let asked = run_once(&cli_env, &["repos", "resync", rsmall1, "--addr", &addr]);
    let err = String::from_utf8_lossy(&asked.stderr);
    assert_eq!(asked.status.code(), Some(1), "{err}");
    assert!(err.contains("401") && !err.contains("not-the-token"), "{err}");
    assert!(!std::fs::read_to_string(&out).unwrap_or_default().contains("#resync"), "nothing queued yet");
    // One worker: the slow repo's download holds it, the next request waits queued.
    let asked = run_once(&env, &["repos", "resync", RSMALL2, "--addr", &addr]);
    assert!(asked.status.success(), "{}", String::from_utf8_lossy(&asked.stderr));
    assert_eq!(String::from_utf8_lossy(&asked.stdout), format!("{RSMALL2} queued\n"));
    eventually("rsmall2's download in flight", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/repos/invalid?state=resyncing").await else { return false };
        body.contains(RSMALL2)
    })
    .await;
    let asked = run_once(&env, &["repos", "resync", rsmall1, "--addr", &addr]);
    assert!(asked.status.success(), "{}", String::from_utf8_lossy(&asked.stderr));
    assert_eq!(String::from_utf8_lossy(&asked.stdout), format!("{rsmall1} queued\n"));
    assert!(asked.stderr.is_empty(), "kept by the store: {}", String::from_utf8_lossy(&asked.stderr));
    let show_repo = |did: &str| {
        String::from_utf8_lossy(&run_once(&env, &["repos", "show", did, "--addr", &addr]).stdout).into_owned()
    };
    let shown = show_repo(rsmall1);
    assert!(shown.starts_with(&format!("{rsmall1} seq 0 operator rev - desynchronized attempts 0")), "{shown}");
    let shown = show_repo(RSMALL2);
    assert!(shown.starts_with(&format!("{RSMALL2} seq 0 operator rev - resyncing attempts 0")), "{shown}");
    assert!(show_repo(RLARGE).contains("not in the queue"));
    let listed = run_once(&env, &["repos", "list", "--state", "failed", "--addr", &addr]);
    assert!(listed.status.success() && listed.stdout.is_empty(), "{listed:?}");
    a.kill().expect("kill");
    let _ = a.wait();
    let b = firekeeper(&env, &[], &dir.join("b.log"));
    eventually("the next leader finished the requested resync", WAIT, async || settled(&addr, "operator", 2).await)
        .await;
    assert!(sigterm_and_wait(b).success());
    let text = std::fs::read_to_string(&out).expect("output");
    let snapshots: Vec<&str> = text.lines().filter(|l| l.contains("\"#resync\"")).collect();
    assert_eq!(snapshots.len(), 2, "{snapshots:?}");
    assert!(snapshots.iter().all(|l| l.contains("\"reason\":\"operator\"")), "{snapshots:?}");
    let folded = testkit::fold::jsonl(&text);
    for did in [rsmall1, RSMALL2] {
        let (count, digest) = &testkit::fold::reference()[did];
        assert_eq!((folded[did].len() as u64, testkit::fold::digest(&folded[did])), (*count, digest.clone()), "{did}");
    }
}

/// The `#resync` lines of a jsonl output: (repo, reason).
fn resyncs(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| l.contains("\"#resync\""))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            let e = &v["event"];
            (e["repo"].as_str().unwrap_or_default().to_owned(), e["reason"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

/// How the relay loses the events the leader did not read while it was away.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lost {
    /// It trimmed its log to start at seq 469: the reconnect gets `OutdatedCursor`, then
    /// 469-508 (the large repo's commits only).
    Trimmed,
    /// It restarted numbering from 1 (the rest as 1-128): the leader's cursor is in its
    /// future, and `FIREKEEPER_FUTURE_CURSOR=live` takes the live tail (nothing after).
    Renumbered,
}

/// An accepted gap: the leader handed over the stream to seq 380; while it was away the
/// relay went on to 508 and lost what the leader did not read (see [`Lost`]): the small
/// repos' last commits (381-434) fell in the gap and they have none after. The repos the
/// leader handed over are compared with the host's `listRepos` revs and those that moved
/// are resynchronised (reason `gap`); the small repo whose snapshot (a chain repair at seq
/// 255) already holds its final state is not fetched again. The fold equals every repo's
/// reference records: without the reconcile the seven small repos would stay at their
/// seq-380 state.
async fn after_a_gap(lost: Lost) {
    let frames = resync_frames();
    let total = frames.len();
    let head = frames.iter().position(|f| relay_sim::frame_seq(f) == Some(380)).expect("seq 380") + 1;
    let base = testkit::pds::start(every_repo()).await;
    let dir = tmpdir("gap-reconcile");
    let cfg = relay_sim::SimConfig { initial_head: Some(head), ..relay_sim::SimConfig::default() };
    let World { mut env, addr, out, plc: _plc, _relay: sim } = world_with(&base, frames, cfg, &dir).await;
    env.insert("FIREKEEPER_BACKFILL_HOST".into(), base.clone());
    env.insert("FIREKEEPER_FUTURE_CURSOR".into(), "live".into());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let child = firekeeper(&env, &[], &dir.join("c.log"));
    eventually("the stream to seq 380 committed, the repo broken at 255 repaired", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/status").await else { return false };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
        let Some((200, metrics)) = http_get(&addr, "/metrics").await else { return false };
        v["committed"] == 380 && v["desynchronized"] == 0 && resyncs_done(&metrics) >= 1
    })
    .await;
    let relay = sim.handle();
    relay.set_down(true);
    // The connection must be gone before the rest is published, or it streams it all.
    eventually("the relay's connection closed", WAIT, async || relay.open_connections() == 0).await;
    match lost {
        Lost::Trimmed => relay.trim(469),
        Lost::Renumbered => relay.reset_seq(1),
    }
    relay.publish_up_to(total);
    relay.set_down(false);
    if lost == Lost::Renumbered {
        // The live tail places the stream at its first event: one arrives (an identity
        // event of the first frame, numbered after the rest).
        eventually("the live tail subscribed", WAIT, async || {
            relay.open_connections() == 1 && relay.cursors().last() == Some(&None)
        })
        .await;
        let first = resync_frames().into_iter().next().expect("a frame");
        relay.publish(relay_sim::with_seq(&first, 129).expect("renumbered"));
    }
    // Renumbered, the large repo's last commits are lost too (none after the gap).
    let moved = if lost == Lost::Trimmed { 7 } else { 8 };
    eventually("the moved repos resynchronised", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/status").await else { return false };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
        let Some((200, metrics)) = http_get(&addr, "/metrics").await else { return false };
        let gap = metrics
            .lines()
            .find_map(|l| l.strip_prefix("firekeeper_resyncs_total{outcome=\"done\",reason=\"gap\"} "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let streamed = lost == Lost::Renumbered || v["committed"] == 508;
        streamed && v["desynchronized"] == 0 && gap >= moved
    })
    .await;
    assert!(sigterm_and_wait(child).success());
    let log = std::fs::read_to_string(dir.join("c.log")).expect("log");
    assert!(log.contains("accepted gap: comparing the repos handed over"), "{log}");
    let text = std::fs::read_to_string(&out).expect("output");
    let gap: std::collections::BTreeSet<String> =
        resyncs(&text).into_iter().filter(|(_, why)| why == "gap").map(|(repo, _)| repo).collect();
    let expected = testkit::fold::reference().into_keys().filter(|d| d != RSMALL2 && (d != RLARGE || moved == 8));
    for did in expected {
        assert!(gap.contains(&did), "{did} moved in the gap and was not resynchronised: {gap:?}");
    }
    assert!(!gap.contains(RSMALL2), "a repo whose snapshot holds its final state was fetched again: {gap:?}");
    assert_reference(&testkit::fold::jsonl(&text));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outdated_cursor_the_repos_that_moved_are_resynchronised() {
    after_a_gap(Lost::Trimmed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_future_cursor_taken_live_the_repos_that_moved_are_resynchronised() {
    after_a_gap(Lost::Renumbered).await;
}

/// Repo sync across replicas (`FIREKEEPER_SYNC_SHARED`): three replicas with one worker
/// each, on Redis, with the webhook sink, backfill the reference PDS's repos, each served
/// slowly so that the jobs spread: each repo's snapshot is written once, by more than one
/// replica between them, and the fold of what the webhook received equals the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_a_backfill_on_redis() {
    three_replicas_share_a_backfill(&Store::Redis).await;
}

/// What a person sees on the leader once a shared backfill of the nine repos is done
/// (`firekeeper repos progress`): the shared queue empty, and every replica that wrote
/// snapshots with how many landed (nine in all).
async fn progress_shows_every_replica(env: &HashMap<String, String>, leader: &str) {
    eventually("the leader sees the shared queue empty", WAIT, async || {
        let Some((200, body)) = http_get(leader, "/status").await else { return false };
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        v["sync_jobs"]["queued"] == 0 && v["sync_jobs"]["claimed"] == 0
    })
    .await;
    let out = run_once(env, &["repos", "progress", "--addr", leader, "--every", "1"]);
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && shown.contains("(leader)") && shown.contains("shared queue: 0 waiting, 0 claimed"),
        "{shown}"
    );
    let landed: u64 = shown
        .lines()
        .filter(|l| l.starts_with("  fk-"))
        .filter_map(|l| l.split_once(": ")?.1.split(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(landed, 9, "each replica's landed jobs: {shown:?}");
}

/// The same with the lease, the cursor store and the queue in NATS (`JetStream`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_a_backfill_on_nats() {
    three_replicas_share_a_backfill(&Store::Nats).await;
}

/// The same with the Postgres sink and its records table, the cursor store and the queue
/// in Postgres (`FOR UPDATE SKIP LOCKED`), the lease in Redis: the records table equals
/// the reference and each repo's `#resync` row is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_a_backfill_on_postgres() {
    three_replicas_share_a_backfill(&Store::Postgres).await;
}

async fn three_replicas_share_a_backfill(store: &Store) {
    let dids: Vec<String> = testkit::fold::reference().into_keys().collect();
    let slow: HashMap<String, std::time::Duration> =
        dids.iter().map(|d| (d.clone(), std::time::Duration::from_millis(600))).collect();
    let base = testkit::pds::start_slow(every_repo(), slow).await;
    let dir = tmpdir("shared-backfill");
    let World { mut env, plc: _plc, _relay, .. } = world(&base, resync_frames(), &dir).await;
    let (mut _redis, mut _nats) = (None, None);
    if let Store::Nats = store {
        let nats = testkit::NatsServer::start();
        env.insert("NATS_URL".into(), nats.url());
        _nats = Some(nats);
    } else {
        let redis = testkit::RedisServer::start();
        env.insert("REDIS_URL".into(), redis.url());
        _redis = Some(redis);
    }
    let hook = testkit::http::Collector::start().await;
    let mut pg_server = None;
    if let Store::Postgres = store {
        let pg = testkit::PgServer::start();
        postgres_env(&mut env, &pg);
        pg_server = Some(pg);
    } else {
        env.insert("FIREKEEPER_SINK".into(), "webhook".into());
        env.insert("FIREKEEPER_WEBHOOK_URL".into(), hook.url.clone());
    }
    env.insert("FIREKEEPER_SYNC_WORKERS".into(), "1".into());
    let list = dir.join("dids.txt");
    std::fs::write(&list, dids.join("\n")).expect("list");
    env.insert("FIREKEEPER_BACKFILL_DIDS".into(), format!("@{}", list.display()));
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let children: Vec<_> = addrs
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let mut e = env.clone();
            e.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
            firekeeper(&e, &[], &dir.join(format!("r{i}.log")))
        })
        .collect();
    let mut leader = None;
    eventually("the backfill done by the replicas", WAIT, async || {
        for a in &addrs {
            if settled(a, "backfill", 9).await {
                leader = Some(a.clone());
                return true;
            }
        }
        false
    })
    .await;
    progress_shows_every_replica(&env, &leader.expect("a leader")).await;
    let mut done = Vec::new();
    for a in &addrs {
        let (_, body) = http_get(a, "/status").await.expect("status");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        done.push(v["sync_jobs"]["done"].as_u64().expect("sync_jobs on every replica"));
    }
    for c in children {
        assert!(sigterm_and_wait(c).success());
    }
    assert_eq!(done.iter().sum::<u64>(), 9, "each repo's job done once: {done:?}");
    assert!(done.iter().filter(|n| **n > 0).count() >= 2, "the jobs spread over the replicas: {done:?}");
    if let Some(pg) = &pg_server {
        let (c, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("pg");
        tokio::spawn(conn);
        let rows = c
            .query("SELECT did, count(*) FROM firekeeper_events WHERE kind = '#resync' GROUP BY did", &[])
            .await
            .expect("resyncs");
        assert_eq!(rows.len(), 9, "every repo");
        assert!(rows.iter().all(|r| r.get::<_, i64>(1) == 1), "each repo's snapshot written once");
        assert_reference(&records_table(&pg.url()).await);
        return;
    }
    let text = hook.text();
    for did in &dids {
        let n = text.lines().filter(|l| l.contains("\"#resync\"") && l.contains(did.as_str())).count();
        assert_eq!(n, 1, "{did}: its snapshot written once");
    }
    assert_reference(&testkit::fold::jsonl(&text));
}

/// Waits until the replica at `addr` leads.
async fn until_leading(addr: &str) {
    eventually("the first replica leads", WAIT, async || {
        http_get(addr, "/status").await.is_some_and(|(_, b)| b.contains("\"role\":\"leader\""))
    })
    .await;
}

/// A worker lost in the middle of a shared job's download: the leader takes no jobs
/// (`FIREKEEPER_SYNC_WORKERS=0`), worker B claims the large repo (served in 4 s) and is
/// killed or frozen; worker C takes the job over once B's claim has been idle for
/// `FIREKEEPER_SYNC_CLAIM_MS` and writes the snapshot. A frozen B wakes with its
/// download answered and writes nothing. The snapshot is written once and folds to the
/// reference.
async fn a_worker_lost_mid_download(freeze: bool) {
    let slow = HashMap::from([(RLARGE.to_owned(), std::time::Duration::from_secs(4))]);
    let base = testkit::pds::start_slow(every_repo(), slow).await;
    let dir = tmpdir(if freeze { "worker-freeze" } else { "worker-kill" });
    let World { mut env, plc: _plc, _relay, .. } = world(&base, resync_frames(), &dir).await;
    let redis = testkit::RedisServer::start();
    let hook = testkit::http::Collector::start().await;
    env.insert("REDIS_URL".into(), redis.url());
    env.insert("FIREKEEPER_SINK".into(), "webhook".into());
    env.insert("FIREKEEPER_WEBHOOK_URL".into(), hook.url.clone());
    env.insert("FIREKEEPER_SYNC_CLAIM_MS".into(), "2000".into());
    env.insert("FIREKEEPER_BACKFILL_DIDS".into(), RLARGE.into());
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    let start = |name: &str, workers: &str| {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut e = env.clone();
        e.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
        e.insert("FIREKEEPER_SYNC_WORKERS".into(), workers.into());
        (firekeeper(&e, &[], &dir.join(format!("{name}.log"))), addr)
    };
    let (a, addr_a) = start("a", "0");
    until_leading(&addr_a).await;
    let (mut b, addr_b) = start("b", "1");
    eventually("b has claimed the large repo's job", WAIT, async || {
        let Some((200, body)) = http_get(&addr_b, "/status").await else { return false };
        serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["sync_jobs"]["in_flight"] == 1)
    })
    .await;
    testkit::lose(&mut b, freeze);
    let (c, _) = start("c", "1");
    eventually("the job taken over and landed", WAIT, async || settled(&addr_a, "backfill", 1).await).await;
    if freeze {
        // B wakes with its download answered (the PDS answered while it was stopped).
        testkit::sigcont(b.id());
        eventually("b's job over", WAIT, async || {
            let Some((200, body)) = http_get(&addr_b, "/status").await else { return false };
            serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["sync_jobs"]["in_flight"] == 0)
        })
        .await;
    }
    let _ = b.kill();
    let _ = b.wait();
    assert!(sigterm_and_wait(c).success());
    assert!(sigterm_and_wait(a).success());
    let text = hook.text();
    let large = text.lines().filter(|l| l.contains("\"#resync\"") && l.contains(RLARGE)).count();
    assert_eq!(large, 1, "the large repo's snapshot is written once (by the worker that took the job over)");
    if freeze {
        let log = std::fs::read_to_string(dir.join("b.log")).expect("log");
        assert!(log.contains("late: "), "b says why it writes nothing: {log}");
    }
    testkit::fold::assert_repo(&testkit::fold::jsonl(&text), RLARGE, "the large repo's fold");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_download_loses_its_job_to_another() {
    a_worker_lost_mid_download(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_frozen_past_its_claim_writes_nothing_when_it_wakes() {
    a_worker_lost_mid_download(true).await;
}

/// A shared-repo-sync world for the chain-break capture: the PDS serving the large repo
/// in `slow_s` seconds, the relay paced (80 events a second, so that the broken repos'
/// later events arrive while their jobs are out), Redis, the webhook sink, and leader A
/// running with no workers of its own (`env` is for the other replicas).
struct Shared {
    env: HashMap<String, String>,
    addr: String,
    a: std::process::Child,
    hook: testkit::http::Collector,
    _redis: testkit::RedisServer,
    _plc: Plc,
    _relay: relay_sim::RelaySim,
}

async fn shared_leader(slow_s: u64, dir: &std::path::Path) -> Shared {
    let slow = HashMap::from([(RLARGE.to_owned(), std::time::Duration::from_secs(slow_s))]);
    let base = testkit::pds::start_slow(every_repo(), slow).await;
    let paced = relay_sim::SimConfig { rate: Some(80), initial_head: Some(0), ..relay_sim::SimConfig::default() };
    let World { mut env, addr, plc, _relay: relay, .. } = world_with(&base, resync_frames(), paced, dir).await;
    let redis = testkit::RedisServer::start();
    let hook = testkit::http::Collector::start().await;
    env.insert("REDIS_URL".into(), redis.url());
    env.insert("FIREKEEPER_SINK".into(), "webhook".into());
    env.insert("FIREKEEPER_WEBHOOK_URL".into(), hook.url.clone());
    assert!(run_once(&env, &["cursor", "set", "0"]).status.success());
    let mut env_a = env.clone();
    env_a.insert("FIREKEEPER_SYNC_WORKERS".into(), "0".into());
    let a = firekeeper(&env_a, &[], &dir.join("a.log"));
    until_leading(&addr).await;
    Shared { env, addr, a, hook, _redis: redis, _plc: plc, _relay: relay }
}

/// A chain break repaired by a shared job, in its place in the stream: the leader takes no
/// jobs (`FIREKEEPER_SYNC_WORKERS=0`), a standby's worker does; the relay is paced and the
/// large repo served slowly, so the rest of the capture's events of the broken repos
/// arrive while their jobs are out. The leader holds them, drops those the snapshot covers
/// once it has landed, and commits the whole capture; the fold of what the webhook received
/// equals the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_break_is_repaired_by_another_replica_in_its_place() {
    let dir = tmpdir("shared-repair");
    let shared = shared_leader(2, &dir).await;
    let Shared { env, addr, a, hook, _redis, _plc, _relay } = shared;
    let mut env_b = env.clone();
    env_b.insert("FIREKEEPER_HTTP_ADDR".into(), format!("127.0.0.1:{}", free_port()));
    let b = firekeeper(&env_b, &[], &dir.join("b.log"));
    eventually("the capture committed and both repos repaired", WAIT, async || {
        let Some((200, body)) = http_get(&addr, "/status").await else { return false };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
        let Some((200, metrics)) = http_get(&addr, "/metrics").await else { return false };
        v["role"] == "leader" && v["committed"] == 508 && v["desynchronized"] == 0 && resyncs_done(&metrics) >= 2
    })
    .await;
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    assert!(sigterm_and_wait(b).success());
    assert!(sigterm_and_wait(a).success());
    let log_b = std::fs::read_to_string(dir.join("b.log")).expect("log");
    assert!(log_b.contains("(a shared job)"), "the standby wrote the snapshots: {log_b}");
    let covered = metrics
        .lines()
        .find_map(|l| l.strip_prefix("firekeeper_resync_covered_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let text = hook.text();
    std::fs::write(dir.join("hook.jsonl"), &text).expect("kept for a look");
    assert!(covered > 0, "events the snapshots cover were held and dropped: {metrics}");
    let lines: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line")).collect();
    let events: Vec<serde_json::Value> = lines.iter().map(|l| l["event"].clone()).collect();
    // Held while its job was out: the large repo's events from well after its break (seq
    // 468; the job's turn comes within a few events at 80 a second; 507 is one) are not written before
    // its snapshot (those it covers are never written).
    let resync = events.iter().position(|e| e["type"] == "#resync" && e["repo"] == RLARGE).expect("a snapshot");
    let early = lines[..resync].iter().filter(|l| l["event"]["repo"] == RLARGE && l["seq"].as_u64() >= Some(495));
    assert_eq!(early.count(), 0, "the large repo's events during its job are held until it lands");
    for did in [RLARGE, RSMALL2] {
        let at = events.iter().position(|e| e["type"] == "#resync" && e["repo"] == did).expect("a snapshot");
        let rev = events[at]["rev"].as_str().expect("rev").to_owned();
        let late = events[at..].iter().filter(|e| e["type"] == "#commit" && e["repo"] == did);
        assert!(
            late.clone().all(|e| e["rev"].as_str() > Some(rev.as_str())),
            "{did}: no commit the snapshot covers comes after it"
        );
    }
    assert_reference(&testkit::fold::jsonl(&text));
}

/// A 429 storm from one host, with repo sync shared by two replicas: the reference repos
/// split over two PDSs, one of which answers every request 429 for 6 s after the first.
/// The other host's repos all land while that one is still refusing, none of the
/// refusing host's before its window is over, then every repo lands and folds to the
/// reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_from_one_host_parks_that_host_only() {
    use testkit::pds::Fault;
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let window = Fault::HostWindow { secs: 6, opened: None, answered: answered.clone() };
    let stormy = testkit::pds::start_faulty(
        every_repo(),
        HashMap::new(),
        HashMap::from([(testkit::pds::EVERY.to_owned(), window)]),
    )
    .await;
    let calm = testkit::pds::start(every_repo()).await;
    let mut dids: Vec<String> = testkit::fold::reference().into_keys().collect();
    dids.sort();
    let (on_stormy, on_calm) = dids.split_at(4);
    let mut docs = testkit::pds::docs(&calm);
    docs.extend(testkit::pds::docs(&stormy).into_iter().filter(|(d, _)| on_stormy.contains(d)));
    let plc = Plc::start(docs).await;
    let dir = tmpdir("shared-storm");
    let relay = relay_sim::RelaySim::start_with(
        resync_frames(),
        relay_sim::SimConfig::default(),
        "127.0.0.1:0".parse().expect("addr"),
    )
    .await
    .expect("sim");
    let mut env = base_env(&relay.url(), &dir);
    env.extend(testkit::pds::repair_env(&plc.url()).map(|(k, v)| (k.to_owned(), v)));
    let redis = testkit::RedisServer::start();
    let hook = testkit::http::Collector::start().await;
    env.insert("REDIS_URL".into(), redis.url());
    env.insert("FIREKEEPER_SINK".into(), "webhook".into());
    env.insert("FIREKEEPER_WEBHOOK_URL".into(), hook.url.clone());
    env.insert("FIREKEEPER_BACKFILL_DIDS".into(), dids.join(","));
    assert!(run_once(&env, &["cursor", "set", "508"]).status.success());
    let addr = format!("127.0.0.1:{}", free_port());
    let mut env_a = env.clone();
    env_a.insert("FIREKEEPER_HTTP_ADDR".into(), addr.clone());
    let a = firekeeper(&env_a, &[], &dir.join("a.log"));
    until_leading(&addr).await;
    let b = firekeeper(&env, &[], &dir.join("b.log"));
    let landed = |did: &str| hook.text().lines().any(|l| l.contains("\"#resync\"") && l.contains(did));
    eventually("the calm host's repos landed", WAIT, async || on_calm.iter().all(|d| landed(d))).await;
    let early: Vec<&String> = on_stormy.iter().filter(|d| landed(d)).collect();
    assert!(early.is_empty(), "the stormy host's repos wait for its window: {early:?}");
    assert!(answered.load(std::sync::atomic::Ordering::Relaxed) > 0, "the stormy host answered 429");
    eventually("every repo landed", WAIT, async || settled(&addr, "backfill", 9).await).await;
    assert!(sigterm_and_wait(b).success());
    assert!(sigterm_and_wait(a).success());
    assert_reference(&testkit::fold::jsonl(&hook.text()));
}

/// The leader killed while a standby's worker applies a shared job of a repo with live
/// commits: leader A takes no jobs, B's worker has the large repo's job (served in 4 s)
/// when A is killed; B takes over the lease, queues the repo again (its new job replaces
/// A's, whose late apply is refused unless it already landed) and goes on with the stream
/// from A's cursor. The whole capture is committed, nothing is left queued, and the fold
/// of everything the webhook received equals the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_while_a_standby_applies_a_shared_job_loses_nothing() {
    let dir = tmpdir("shared-leader-kill");
    let shared = shared_leader(4, &dir).await;
    let Shared { env, addr, mut a, hook, _redis, _plc, _relay } = shared;
    let addr_b = format!("127.0.0.1:{}", free_port());
    let mut env_b = env.clone();
    env_b.insert("FIREKEEPER_HTTP_ADDR".into(), addr_b.clone());
    let b = firekeeper(&env_b, &[], &dir.join("b.log"));
    eventually("b's worker has the large repo's job", WAIT, async || {
        let Some((200, body)) = http_get(&addr_b, "/status").await else { return false };
        let Some((200, invalid)) = http_get(&addr, "/repos/invalid").await else { return false };
        serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["sync_jobs"]["in_flight"] == 1)
            && invalid.contains(RLARGE)
    })
    .await;
    testkit::lose(&mut a, false);
    eventually("b leads, committed the capture, nothing queued", WAIT, async || {
        let Some((200, body)) = http_get(&addr_b, "/status").await else { return false };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return false };
        v["role"] == "leader" && v["committed"] == 508 && v["desynchronized"] == 0
    })
    .await;
    assert!(sigterm_and_wait(b).success());
    let text = hook.text();
    std::fs::write(dir.join("hook.jsonl"), &text).expect("kept for a look");
    assert!(text.lines().any(|l| l.contains("\"#resync\"") && l.contains(RLARGE)), "the large repo was repaired");
    assert_reference(&testkit::fold::jsonl(&text));
}
