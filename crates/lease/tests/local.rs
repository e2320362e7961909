//! The lock-file backend, and the metrics the supervisor records.

mod common;

use std::sync::Arc;
use std::time::Duration;

use lease::{Backend, LeaseConfig, LeaseEvent, LocalBackend, TokioClock};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tokio::time::timeout;

use testkit::tmpdir;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_file_lease_hands_over_with_increasing_tokens_and_records_metrics() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("recorder");

    let dir = tmpdir("handover");
    let path = dir.join("lease.lock");
    let cfg = LeaseConfig { poll: Duration::from_millis(50), ..LeaseConfig::from_ttl(Duration::from_secs(1)) };
    let (a, mut ea) =
        lease::spawn_as(Arc::new(LocalBackend::new(&path)), cfg.clone(), Arc::new(TokioClock::new()), "a").expect("a");
    let Some(LeaseEvent::Elected(ta)) = timeout(Duration::from_secs(10), ea.recv()).await.expect("elected") else {
        panic!()
    };
    assert_eq!(ta.token(), 1);
    let (b, mut eb) =
        lease::spawn_as(Arc::new(LocalBackend::new(&path)), cfg, Arc::new(TokioClock::new()), "b").expect("b");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(eb.try_recv().is_err(), "b waits while a holds the lock");
    a.step_down_with(async { Ok::<(), String>(()) }, Duration::from_secs(2)).await.expect("release");
    let Some(LeaseEvent::Elected(tb)) = timeout(Duration::from_secs(10), eb.recv()).await.expect("b elected") else {
        panic!()
    };
    assert_eq!(tb.token(), 2);
    assert_eq!(std::fs::read_to_string(&path).expect("lock file").trim(), "b:2");
    let snap = LocalBackend::new(&path).snapshot().await.expect("snapshot");
    assert_eq!((snap.holder.as_deref(), snap.fence), (Some("b:2"), 2));
    b.shutdown().await;

    // A seeded fence is never gone below.
    let backend = LocalBackend::new(&path);
    assert_eq!(backend.seed_fence(40).await.expect("seed"), 40);
    assert_eq!(backend.seed_fence(3).await.expect("seed"), 40);
    assert!(matches!(
        backend.acquire("c", Duration::from_secs(1), 0).await,
        Ok(lease::Acquire::Acquired { token: 41 })
    ));

    let metrics = snapshotter.snapshot().into_vec();
    let count = |name: &str, label: (&str, &str)| -> u64 {
        metrics
            .iter()
            .filter(|(k, _, _, _)| {
                k.key().name() == name && k.key().labels().any(|l| l.key() == label.0 && l.value() == label.1)
            })
            .map(|(_, _, _, v)| if let DebugValue::Counter(c) = v { *c } else { 0 })
            .sum()
    };
    assert_eq!(count("firekeeper_lease_transitions_total", ("reason", "acquired")), 2);
    // a stepped down, b was shut down while leading: both released.
    assert_eq!(count("firekeeper_lease_transitions_total", ("reason", "released")), 2);
    let renews = metrics.iter().find(|(k, _, _, _)| k.key().name() == "firekeeper_lease_renew_seconds");
    assert!(matches!(renews, Some((_, _, _, DebugValue::Histogram(h))) if !h.is_empty()), "renew latency recorded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_settings_record_keeps_the_latest_terms() {
    let dir = tmpdir("record");
    common::the_settings_record_keeps_the_latest_terms(&LocalBackend::new(&dir.join("lease.lock"))).await;
}
