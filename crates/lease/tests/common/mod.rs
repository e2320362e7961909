//! What the lease's store tests share (Redis and NATS run the same scenarios): a
//! supervised node, its events and the test timings.

#![allow(dead_code)] // each test binary uses its part

use std::sync::Arc;
use std::time::{Duration, Instant};

use lease::{Backend, BootClock, LeaseConfig, LeaseEvent, LeaseHandle, Term};
use testkit::WAIT;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::timeout;

/// ttl 2 s: renew every 400 ms, op timeout 250 ms, margin 500 ms, poll 200 ms.
pub fn cfg(prefix: &str) -> LeaseConfig {
    LeaseConfig {
        poll: Duration::from_millis(200),
        key_prefix: prefix.to_owned(),
        ..LeaseConfig::from_ttl(Duration::from_secs(2))
    }
}

/// One supervised contender and the backend it uses.
pub struct Node<B> {
    pub handle: LeaseHandle,
    pub events: UnboundedReceiver<LeaseEvent>,
    pub backend: Arc<B>,
}

/// Starts a supervisor named `name` on `backend`.
pub fn spawn<B: Backend>(backend: Arc<B>, c: LeaseConfig, name: &str) -> Node<B> {
    let (handle, events) = lease::spawn_as(backend.clone(), c, Arc::new(BootClock), name).expect("config");
    Node { handle, events, backend }
}

/// The node's next event, within [`WAIT`].
pub async fn next_event<B>(n: &mut Node<B>) -> LeaseEvent {
    timeout(WAIT, n.events.recv()).await.expect("an event before the deadline").expect("supervisor alive")
}

/// The node's next event, which must be an election.
pub async fn elected<B>(n: &mut Node<B>) -> Term {
    match next_event(n).await {
        LeaseEvent::Elected(t) => t,
        other => panic!("expected Elected, got {other:?}"),
    }
}

/// No event is waiting.
pub fn no_event<B>(n: &mut Node<B>) {
    if let Ok(e) = n.events.try_recv() {
        panic!("unexpected event {e:?}");
    }
}

/// After the store answered a leader whose late renewal set the key again (at `back`):
/// one of `a` and `b` is elected within 3 s, not a whole ttl later.
pub async fn someone_elected_at_once<B>(a: &mut Node<B>, b: &mut Node<B>, back: Instant) {
    let winner = tokio::select! {
        e = next_event(b) => ("b", e),
        e = next_event(a) => ("a", e),
    };
    let took = back.elapsed();
    assert!(matches!(winner.1, LeaseEvent::Elected(_)), "{winner:?}");
    eprintln!("{} was elected {took:?} after the store answered the old leader again", winner.0);
    assert!(took < Duration::from_secs(3), "{took:?}: the late renewal kept the key for another ttl");
}

/// The settings record beside the lease: absent at first, written, read back, replaced
/// by a later term's and never by an earlier one's (a stale leader cannot overwrite its
/// successor's settings). Run on every backend.
pub async fn the_settings_record_keeps_the_latest_terms(b: &dyn Backend) {
    assert_eq!(b.deployment().await.expect("read"), None);
    assert!(b.set_deployment(3, "collections=*\nverify=off\n").await.expect("write"));
    assert_eq!(b.deployment().await.expect("read"), Some((3, "collections=*\nverify=off\n".to_owned())));
    assert!(b.set_deployment(5, "collections=app.bsky.feed.like\n").await.expect("later"));
    assert!(!b.set_deployment(4, "collections=*\n").await.expect("earlier"), "an earlier term's is refused");
    assert_eq!(b.deployment().await.expect("read"), Some((5, "collections=app.bsky.feed.like\n".to_owned())));
    assert!(b.set_deployment(5, "collections=app.bsky.feed.post\n").await.expect("same term"));
}
