//! The shared repo-sync queue on a real server: one scenario, run on every engine that
//! implements [`JobQueue`]. A claim's epoch fences what its worker may apply and finish;
//! a newer publish of the repo fences every claim of the older job; a fenced publisher
//! queues nothing.

use std::time::Duration;

use checkpoint::{CommitOutcome, Fence, JobQueue, JobSpec, JobState, NatsJobs, PostgresJobs, RedisJobs, RedisKeys};
use testkit::RedisServer;

const OP: Duration = Duration::from_secs(2);
const DID: &str = "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa";

fn job<'a>(id: &'a str, min_rev: Option<&'a str>) -> JobSpec<'a> {
    JobSpec { did: DID, id, reason: "backfill", min_rev, relay: "fp" }
}

/// The scenario; `lease(v)` makes `v` the lease value the engine fences on; a claim is
/// idle after `idle` (the engine's, or what `claim` is given).
async fn claims_are_fenced_by_epoch_and_job(q: &dyn JobQueue, lease: &dyn Fn(&str), idle: Duration) {
    let leader = Fence { holder: "a:7", token: 7 };
    lease("a:7");
    assert_eq!(q.claim("w1", 4, Duration::from_mins(1)).await.expect("claim"), vec![], "an empty queue");
    assert_eq!(q.publish(job("7-1", Some("3kabc")), leader).await.expect("publish"), CommitOutcome::Saved);
    assert_eq!(q.counts().await.expect("counts").queued, 1);
    assert_eq!(q.state(DID, "7-1").await.expect("state"), JobState::Pending);

    // The first worker claims it: epoch 1, the publisher's fence and the job's fields.
    let c1 = q.claim("w1", 4, Duration::from_mins(1)).await.expect("claim").pop().expect("a job");
    assert_eq!((c1.did.as_str(), c1.id.as_str(), c1.epoch, c1.token), (DID, "7-1", 1, 7));
    assert_eq!((c1.reason.as_str(), c1.min_rev.as_deref(), c1.holder.as_str()), ("backfill", Some("3kabc"), "a:7"));
    assert_eq!(c1.relay, "fp");
    assert_eq!(q.counts().await.expect("counts").claimed, 1);
    assert!(q.claim("w2", 4, Duration::from_mins(1)).await.expect("claim").is_empty(), "claimed, not idle");
    assert!(q.touch(&c1).await.expect("touch"));

    // It goes quiet: another worker takes the job over with epoch 2.
    tokio::time::sleep(idle * 3 / 2).await;
    let c2 = q.claim("w2", 4, idle).await.expect("claim").pop().expect("reclaimed");
    assert_eq!((c2.id.as_str(), c2.epoch), ("7-1", 2));
    // The late worker is refused at every step; the new one applies and finishes once.
    assert!(!q.touch(&c1).await.expect("touch"), "a late touch");
    assert!(!q.begin_apply(&c1, "3kzzz").await.expect("apply"), "a late apply");
    assert!(q.begin_apply(&c2, "3kzzz").await.expect("apply"));
    assert!(!q.begin_apply(&c2, "3kzzz").await.expect("apply"), "applied once per claim");
    assert!(!q.finish(&c1, "late").await.expect("finish"), "a late finish");
    assert!(q.finish(&c2, "done").await.expect("finish"));
    assert!(!q.finish(&c2, "again").await.expect("finish"), "finished once");
    assert_eq!(q.state(DID, "7-1").await.expect("state"), JobState::Done("done".into()));
    assert_eq!(q.counts().await.expect("counts"), checkpoint::JobCounts::default());
    tokio::time::sleep(idle * 3 / 2).await;
    assert!(q.claim("w3", 4, idle).await.expect("claim").is_empty(), "done is done");

    // A newer publish of the repo replaces the older job: its claim cannot apply, and
    // the older job's entry is dropped rather than worked.
    q.publish(job("7-2", None), leader).await.expect("publish");
    let old = q.claim("w1", 1, Duration::from_mins(1)).await.expect("claim").pop().expect("a job");
    q.publish(job("7-9", None), leader).await.expect("publish");
    q.publish(job("7-3", None), leader).await.expect("publish");
    assert!(!q.begin_apply(&old, "3kzzz").await.expect("apply"), "a replaced job's claim");
    assert_eq!(q.state(DID, "7-2").await.expect("state"), JobState::Unknown);
    let cur = q.claim("w1", 4, Duration::from_mins(1)).await.expect("claim");
    assert_eq!(cur.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["7-3"], "only the newest job is worked");

    // A publisher whose term is over queues nothing.
    lease("b:8");
    let fenced = q.publish(job("7-4", None), leader).await.expect("publish");
    assert!(matches!(fenced, CommitOutcome::Fenced { .. }), "{fenced:?}");
    assert_eq!(q.state(DID, "7-3").await.expect("state"), JobState::Pending, "the current job stays");
}

#[tokio::test]
async fn redis_streams_fence_claims_by_epoch_and_job() {
    let redis = RedisServer::start();
    let keys = RedisKeys::new("fk", None);
    let q = RedisJobs::new(&redis.url(), &keys, OP).expect("queue");
    let lease = |v: &str| {
        let mut c = redis.admin();
        let _: () = redis::cmd("SET").arg(&keys.lease).arg(v).query(&mut c).expect("set");
    };
    claims_are_fenced_by_epoch_and_job(&q, &lease, Duration::from_millis(100)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_jetstream_fences_claims_by_epoch_and_job() {
    let server = testkit::NatsServer::start();
    let nats = server.connect(OP).await;
    let idle = Duration::from_millis(600);
    let q = NatsJobs::new(&nats, "fk", idle);
    // The NATS store fences by the highest token a term claimed.
    let state = nats_op::Bucket::new(nats.clone(), nats_op::bucket_name("fk", "state"), Duration::ZERO);
    let rt = tokio::runtime::Handle::current();
    let lease = |v: &str| {
        let token = v.rsplit_once(':').map(|(_, t)| t.to_owned()).expect("a token");
        let st = state.clone();
        tokio::task::block_in_place(|| {
            rt.block_on(async move {
                st.op("put", |kv| async move { kv.put("fence-seen", token.into()).await }).await.expect("fence")
            })
        });
    };
    claims_are_fenced_by_epoch_and_job(&q, &lease, idle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_skip_locked_fences_claims_by_epoch_and_job() {
    let server = testkit::PgServer::start();
    let q = PostgresJobs::connect(&server.url(), OP).await.expect("queue");
    // Postgres fences by the highest token presented (`firekeeper_fence`).
    let (admin, conn) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls).await.expect("pg");
    tokio::spawn(conn);
    let rt = tokio::runtime::Handle::current();
    let lease = |v: &str| {
        let token: i64 = v.rsplit_once(':').and_then(|(_, t)| t.parse().ok()).expect("a token");
        tokio::task::block_in_place(|| {
            rt.block_on(async {
                admin
                    .execute(
                        "INSERT INTO firekeeper_fence (id, token) VALUES (true, $1)
                         ON CONFLICT (id) DO UPDATE SET token = EXCLUDED.token",
                        &[&token],
                    )
                    .await
                    .expect("fence")
            })
        });
    };
    claims_are_fenced_by_epoch_and_job(&q, &lease, Duration::from_millis(300)).await;
}
