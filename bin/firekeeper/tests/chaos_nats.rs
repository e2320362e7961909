//! The fault suite on NATS: three real replicas with the NATS JetStream KV lease and
//! cursor store, `nats-server -js`, relay-sim and a TCP proxy per replica in front of
//! NATS, under the same oracle as the Redis suite (`chaos.rs`): no seq missing, tokens
//! never go down within a process, the stored cursor never regresses and ends at the last
//! seq, never two leaders at once. And the JetStream sink end to end: leader killed every
//! few seconds, the stream holds every event exactly once, in order per repo.
//!
//! The scenarios both backends share are written once in `testkit::faults` (the Redis
//! suite calls the same functions); the rest are NATS's own.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use testkit::cluster::{Cluster, Spec};
use testkit::faults::{self, progress, started};
use tokio::time::sleep;

fn nats_spec(copies: usize) -> Spec {
    faults::spec(copies, true)
}

fn server(c: &mut Cluster) -> &mut testkit::NatsServer {
    c.nats.as_mut().expect("a NATS cluster")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sigkill_leader() {
    faults::sigkill_leader("nkill", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sigterm_leader_hands_over_without_duplicates() {
    let (c, l2, t2) = faults::sigterm_hands_over("nterm", true).await;
    // `lease show` reads the NATS lease: the new leader's holder value and the fence.
    let out = testkit::proc::run_once(&c.replicas[l2].env, &["lease", "show"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The fence may be ahead of the holder's token: a standby that lost the race for
    // the key had already raised it (a burned token), which is how fencing works.
    let fence: u64 = text
        .split_whitespace()
        .skip_while(|w| *w != "fence")
        .nth(1)
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("a fence in {text}"));
    assert!(text.starts_with("holder ") && text.contains(&format!(":{t2} fence ")) && fence >= t2, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sigstop_leader_past_ttl_then_sigcont() {
    let (_, _, _, stale) = faults::sigstop_past_ttl("nstop", true).await;
    assert!(stale <= 512, "{stale} stale lines after waking");
}

/// NATS restarts (its data kept) while the leader leads: within the ttl nothing flips;
/// the stream completes with the cursor never going back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restarted_under_the_cluster_loses_nothing() {
    let (mut c, _, t) = started("nrestart", nats_spec(3)).await;
    progress(&c, 400).await;
    server(&mut c).restart();
    c.wait_complete().await;
    let (_, t2) = c.wait_leader(None).await;
    assert!(t2 >= t, "token {t2} after {t}");
    c.check();
}

/// NATS paused (SIGSTOP) past the ttl: the leader stops at its deadline; after the
/// resume a term (new or retaken) finishes the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_paused_past_the_ttl_loses_nothing() {
    faults::store_paused_past_the_ttl("npause", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_off_from_nats_while_standbys_are_not() {
    faults::leader_cut_off("ncut", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_on_the_leaders_nats_link_below_the_op_timeout_does_not_flap() {
    faults::latency_below_the_op_timeout("nslow", true).await;
}

/// Renewals and commits reach NATS, their answers never come back: the leader stops at
/// its deadline, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_on_the_leaders_nats_link_lose_nothing() {
    faults::lost_replies("nlost", true).await;
}

/// No reset, no answer on the leader's NATS link: it hands over at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_nats_link_to_the_leader_hands_over_at_its_deadline() {
    faults::half_open_link("nhalf", true).await;
}

/// Every message of the `FIREKEEPER` stream: (subject, `Nats-Msg-Id`, body).
async fn stream(url: &str) -> Vec<(String, String, serde_json::Value)> {
    let cfg = nats_op::NatsConfig {
        url: url.to_owned(),
        creds_file: None,
        ca_file: None,
        token: None,
        op_timeout: Duration::from_secs(5),
    };
    let n = nats_op::Nats::connect(&cfg).await.expect("connect");
    let s = n.jetstream().get_stream("FIREKEEPER").await.expect("the stream");
    let last = s.get_info().await.expect("info").state.last_sequence;
    let mut out = Vec::with_capacity(usize::try_from(last).unwrap_or(0));
    for seq in 1..=last {
        let m = s.get_raw_message(seq).await.expect("message");
        let id = m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned()).unwrap_or_default();
        out.push((m.subject.to_string(), id, serde_json::from_slice(&m.payload).expect("JSON body")));
    }
    out
}

/// Three replicas, NATS lease, NATS cursors and the JetStream sink; the leader is
/// killed (SIGKILL) every few seconds. The stream ends with every event of the relay exactly
/// once (the new leader's replays are dropped by message id) and each repo's events in
/// relay order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_sink_holds_every_event_exactly_once_in_order_per_repo_under_leader_kills() {
    let spec = Spec { copies: 3, nats: true, sink: "nats", rate: Some(250), ..Spec::default() };
    let (mut c, _, _) = started("njs", spec).await;
    let url = c.nats.as_ref().expect("nats").url();
    let total = c.total;
    let mut kills = 0;
    let deadline = Instant::now() + testkit::WAIT * 2;
    loop {
        sleep(Duration::from_secs(3)).await;
        let Some((l, _)) = c.leader().await else { continue };
        let done = c.replicas[l].status().await.and_then(|s| s["committed"].as_u64()).unwrap_or(0);
        if done >= total {
            break;
        }
        assert!(Instant::now() < deadline, "the stream never completed; logs in {}", c.dir.display());
        if kills < 4 {
            c.replicas[l].sigkill();
            kills += 1;
            c.wait_leader(Some(l)).await;
            c.replicas[l].start();
        }
    }
    assert!(kills >= 2, "the leader was killed {kills} times");
    let msgs = stream(&url).await;
    let mut ids: HashMap<&str, usize> = HashMap::new();
    for (_, id, _) in &msgs {
        *ids.entry(id.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = ids.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(twice.is_empty(), "stored twice: {twice:?}");
    let mut seqs: Vec<u64> = msgs.iter().filter_map(|(_, _, b)| b["seq"].as_u64()).collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=total).collect::<Vec<_>>(), "every seq once ({} messages, {total} events)", msgs.len());
    // Per repo, the stream's order is the relay's (seq) order.
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    for (subject, _, b) in &msgs {
        assert!(subject.starts_with("firekeeper.events."), "{subject}");
        let did = b["repo"].as_str().or_else(|| b["did"].as_str()).unwrap_or("").to_owned();
        let seq = b["seq"].as_u64().expect("seq");
        if let Some(prev) = last.insert(did.clone(), seq) {
            assert!(prev < seq, "repo {did}: seq {seq} stored after {prev}");
        }
    }
    eprintln!("jetstream under {kills} leader kills: {} messages, each once", msgs.len());
    c.check_terms_and_cursor(0);
}

/// NATS-only faults: the lease and state buckets deleted under a running cluster (an
/// operator's `nats kv rm`): the fence, the cursors and the lease key are gone at once.
/// Replicas recreate the buckets; the leader retakes its key or a new term starts above
/// every token any replica saw; the cursor comes back from what the replicas shadowed;
/// nothing is lost and the stored cursor never goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_buckets_deleted_under_the_cluster_lose_nothing() {
    let (c, _, t) = started("nbuckets", nats_spec(3)).await;
    progress(&c, 400).await;
    let n = c.nats.as_ref().expect("nats").connect(Duration::from_secs(2)).await;
    for bucket in ["KV_firekeeper-lease", "KV_firekeeper-state"] {
        n.jetstream().delete_stream(bucket).await.expect("deleted");
    }
    c.wait_complete().await;
    let (_, t2) = c.wait_leader(None).await;
    assert!(t2 >= t, "token {t2} after {t}");
    c.check();
}

/// NATS restarted with its store directory lost (a new volume): every bucket and its
/// fence are gone. As above, nothing is lost, tokens never go back within a process, the
/// stored cursor ends at the last seq.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restarted_with_its_store_lost_loses_nothing() {
    let (mut c, _, t) = started("nwiped", nats_spec(3)).await;
    progress(&c, 400).await;
    server(&mut c).wipe();
    c.wait_complete().await;
    let (_, t2) = c.wait_leader(None).await;
    assert!(t2 >= t, "token {t2} after {t}");
    c.check();
}

/// The soak on NATS: the Redis suite's random faults (the same [`testkit::soak::run`])
/// plus NATS restarts, against the NATS lease and cursors. `make soak` runs it for 30
/// minutes beside the Redis one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_soak_random_faults_under_the_oracle() {
    testkit::soak::run("nsoak", true).await;
}

/// `/status` of a replica at `http` as JSON (null when it does not answer).
async fn status_at(http: &str) -> serde_json::Value {
    let body = testkit::http::http_get(http, "/status").await.map(|r| r.1).unwrap_or_default();
    serde_json::from_str(&body).unwrap_or(serde_json::Value::Null)
}

/// The review's reproduction, through the binary: the relay restarts its numbering
/// under `FIREKEEPER_FUTURE_CURSOR=live`, and the live events reuse seqs the stream
/// already holds. With `Nats-Msg-Id = <fingerprint>:<seq>` the server acknowledged them
/// as duplicates and the cursor moved past them: `/status` committed 100, 0 of 100 live
/// events in the stream. Now every live event is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_stores_the_live_events_of_a_relay_that_renumbered() {
    let nats = testkit::NatsServer::start();
    let relay = relay_sim::RelaySim::start_with(
        testkit::fixture_frames(),
        relay_sim::SimConfig { initial_head: Some(200), ..relay_sim::SimConfig::default() },
        "127.0.0.1:0".parse().expect("addr"),
    )
    .await
    .expect("sim");
    let h = relay.handle();
    let dir = testkit::tmpdir("js-renumber");
    let mut env = testkit::proc::base_env(&relay.url(), &dir);
    let http = format!("127.0.0.1:{}", testkit::free_port());
    for (k, v) in [
        ("NATS_URL", nats.url()),
        ("FIREKEEPER_SINK", "nats".into()),
        ("FIREKEEPER_FUTURE_CURSOR", "live".into()),
        ("FIREKEEPER_HTTP_ADDR", http.clone()),
    ] {
        env.insert(k.into(), v);
    }
    let o = testkit::proc::run_once(&env, &["cursor", "set", "0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let child = testkit::proc::firekeeper(&env, &[], &dir.join("fk.log"));
    let committed = |n: u64| {
        let http = http.clone();
        async move { status_at(&http).await["committed"].as_u64() == Some(n) }
    };
    testkit::eventually("the first 200 committed", testkit::WAIT, async || committed(200).await).await;
    // The relay restarts with a fresh sequence: what it had not yet published is
    // numbered from 1 (50 of them while it is down: a gap accepted under `live`).
    h.set_down(true);
    h.reset_seq(1);
    h.publish_up_to(250);
    h.set_down(false);
    testkit::eventually("a live (cursor-less) connection after FutureCursor", testkit::WAIT, async || {
        h.cursors().contains(&None)
    })
    .await;
    h.publish_up_to(350);
    testkit::eventually("the 100 live events committed", testkit::WAIT, async || committed(150).await).await;
    assert!(testkit::proc::sigterm_and_wait(child).success());
    let msgs = stream(&nats.url()).await;
    let seqs: Vec<u64> = msgs.iter().filter_map(|(_, _, b)| b["seq"].as_u64()).collect();
    let mut live = seqs[seqs.len().min(200)..].to_vec();
    live.sort_unstable();
    assert_eq!(msgs.len(), 300, "200 from the first numbering and the 100 live ones: {} stored", msgs.len());
    assert_eq!(live, (51..=150).collect::<Vec<u64>>(), "the live events, renumbered, each once (lanes interleave)");
}

/// The review's rolling change of `FIREKEEPER_LEASE_TTL_MS` (10 s → 1 s) on NATS, through
/// the binary: a replica started with the shorter ttl opened the lease bucket and lowered
/// its age limit, the leader's key expired between its renewals, and the new replica led
/// too (two terms active for ~0.9 s). Both replicas' `/status` are sampled every 20 ms
/// for 6 s: never two leaders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_ttl_change_never_gives_two_leaders() {
    let nats = testkit::NatsServer::start();
    let relay = testkit::proc::sim(Some(100)).await;
    let dir = testkit::tmpdir("n-rolling-ttl");
    let mut base = testkit::proc::base_env(&relay.url(), &dir);
    base.insert("NATS_URL".into(), nats.url());
    base.insert("FIREKEEPER_SINK".into(), "null".into());
    assert!(testkit::proc::run_once(&base, &["cursor", "set", "0"]).status.success());
    let replica = |name: &str, ttl: &str, renew: &str, margin: &str| {
        let mut env = base.clone();
        let http = format!("127.0.0.1:{}", testkit::free_port());
        for (k, v) in [
            ("FIREKEEPER_HTTP_ADDR", http.clone()),
            ("FIREKEEPER_INSTANCE_ID", name.to_owned()),
            ("FIREKEEPER_LEASE_TTL_MS", ttl.to_owned()),
            ("FIREKEEPER_LEASE_RENEW_MS", renew.to_owned()),
            ("FIREKEEPER_LEASE_MARGIN_MS", margin.to_owned()),
            ("FIREKEEPER_LEASE_POLL_MS", "100".to_owned()),
            ("FIREKEEPER_DRAIN_BUDGET_MS", "1000".to_owned()),
        ] {
            env.insert(k.into(), v);
        }
        (testkit::proc::firekeeper(&env, &[], &dir.join(format!("{name}.log"))), http)
    };
    let (a, a_http) = replica("old", "10000", "3000", "2000");
    testkit::eventually("the old replica leads", testkit::WAIT, async || status_at(&a_http).await["role"] == "leader")
        .await;
    let (b, b_http) = replica("new", "1000", "200", "300");
    testkit::eventually("the new replica stands by", testkit::WAIT, async || {
        status_at(&b_http).await["role"] == "standby"
    })
    .await;
    let until = Instant::now() + Duration::from_secs(6);
    let mut samples = 0;
    while Instant::now() < until {
        let (sa, sb) = (status_at(&a_http).await, status_at(&b_http).await);
        assert!(
            !(sa["role"] == "leader" && sb["role"] == "leader"),
            "two leaders at once: old token {} and new token {}",
            sa["token"],
            sb["token"]
        );
        samples += 1;
        sleep(Duration::from_millis(20)).await;
    }
    assert!(samples > 50);
    assert_eq!(status_at(&a_http).await["role"], "leader", "the old replica kept its term");
    assert!(testkit::proc::sigterm_and_wait(b).success());
    assert!(testkit::proc::sigterm_and_wait(a).success());
}

/// Issue 40 on NATS: the server comes back with no data while the leader is frozen and a
/// replica that knows nothing starts, with `FIREKEEPER_START=live` in its settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_lost_its_data_while_the_leader_was_frozen_loses_nothing() {
    faults::store_lost_while_leader_frozen("nlost", true, Some("live")).await;
}
