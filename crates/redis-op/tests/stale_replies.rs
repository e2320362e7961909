//! A reply that arrives after its call timed out must never be taken for the answer to
//! a later call (a late `OK` read as the answer to the next renewal would be a lie).

use std::time::Duration;

use redis_op::{Conn, OpError};
use testkit::{RedisServer, TcpProxy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_arrives_after_its_timeout_is_never_taken_for_the_next_answer() {
    let redis = RedisServer::start();
    let mut admin = redis.admin();
    for (k, v) in [("a", "reply-to-a"), ("b", "reply-to-b")] {
        let _: () = redis::cmd("SET").arg(k).arg(v).query(&mut admin).expect("set");
    }
    let proxy = TcpProxy::start(redis.addr()).await;
    let conn = Conn::open(&proxy.redis_url(), Duration::from_millis(250)).expect("conn");
    let get = |k: &'static str| {
        let conn = &conn;
        async move { conn.run(|mut c| async move { redis::cmd("GET").arg(k).query_async::<String>(&mut c).await }).await }
    };
    assert_eq!(get("b").await, Ok("reply-to-b".to_owned()));
    for round in 0..5 {
        // The request goes out, its reply comes back after the op timeout.
        proxy.set_latency(Duration::from_millis(200));
        // Our timeout or redis-rs's response timeout, whichever fires first.
        let r = get("a").await;
        assert!(matches!(r, Err(OpError::Timeout(_) | OpError::Unavailable(_))), "round {round}: {r:?}");
        proxy.set_latency(Duration::ZERO);
        // Whatever arrives late for `a`, every later call gets its own answer.
        for _ in 0..10 {
            assert_eq!(get("b").await, Ok("reply-to-b".to_owned()), "round {round}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(get("b").await, Ok("reply-to-b".to_owned()), "round {round}, after the late reply landed");
    }
}
