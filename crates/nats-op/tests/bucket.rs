//! A bucket shared by callers that may stop polling their operation part-way (a commit
//! whose term loop went to wait on something else): no caller may hold what the others
//! need while it is not polled. With the bucket's handle behind an async lock held while
//! it opened, a parked opener made every other caller time out and then wait for ever to
//! forget the handle (a leader's lanes and its term loop waited on each other).

use std::time::Duration;

use nats_op::{Bucket, Nats, NatsConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_parked_while_the_bucket_opens_blocks_no_one() {
    let server = testkit::NatsServer::start();
    let cfg = NatsConfig {
        url: server.url(),
        creds_file: None,
        ca_file: None,
        token: None,
        op_timeout: Duration::from_secs(1),
    };
    let nats = Nats::connect(&cfg).await.expect("connect");
    let bucket = Bucket::new(nats, "parked".into(), Duration::ZERO);
    // The server stops answering: the first caller is polled while it opens the bucket,
    // then never again (but not dropped).
    server.pause();
    let mut parked = Box::pin(bucket.read("k".into()));
    assert!(tokio::time::timeout(Duration::from_millis(300), &mut parked).await.is_err(), "still opening");
    server.resume();
    // Another caller gets an answer (the key is absent) within a few op timeouts.
    let other = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Ok(v) = bucket.read("k".into()).await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(matches!(other, Ok(None)), "the other caller is answered: {other:?}");
    drop(parked);
}
