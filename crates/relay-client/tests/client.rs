//! The subscription against a real local relay (relay-sim) with faults injected.

use std::time::Duration;

use bytes::Bytes;
use relay_client::backoff::BackoffConfig;
use relay_client::client::{BadFramePolicy, Stats, SwitchReason};
use relay_client::{
    ClientConfig, ConnError, DecodeError, Item, Notice, RelayRole, RelayUrl, SubscribeError, Subscription,
};
use relay_sim::{RelaySim, SimConfig};

use testkit::{WAIT as DEADLINE, fixture_frames as fixture};

fn cfg() -> ClientConfig {
    ClientConfig {
        connect_timeout: Duration::from_secs(2),
        ping_interval: Duration::from_millis(200),
        pong_timeout: Duration::from_secs(2),
        stall_timeout: Duration::from_secs(5),
        backoff: BackoffConfig { initial: Duration::from_millis(20), max: Duration::from_millis(200) },
        healthy_after: Duration::from_millis(100),
        ..ClientConfig::default()
    }
}

async fn sim_with(cfg: SimConfig) -> RelaySim {
    RelaySim::start_with(fixture(), cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim")
}

fn sub(sim: &RelaySim, cfg: ClientConfig) -> Subscription {
    Subscription::new(cfg, RelayUrl::parse(&sim.url()).expect("url"), None)
}

/// Everything the subscription produced until `stop` says so, within the deadline.
async fn collect(s: &mut Subscription, mut stop: impl FnMut(&[Item]) -> bool) -> Vec<Item> {
    let mut items = Vec::new();
    tokio::time::timeout(DEADLINE, async {
        while !stop(&items) {
            items.push(s.next().await.expect("subscription"));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("deadline passed; got {} items, last {:?}", items.len(), items.last()));
    items
}

fn seqs(items: &[Item]) -> Vec<u64> {
    items.iter().filter_map(|i| if let Item::Frame(f) = i { Some(f.seq) } else { None }).collect()
}

fn last_seq_is(n: u64) -> impl FnMut(&[Item]) -> bool {
    move |items| matches!(items.last(), Some(Item::Frame(f)) if f.seq >= n)
}

fn has_notice(items: &[Item], f: impl Fn(&Notice) -> bool) -> bool {
    items.iter().any(|i| matches!(i, Item::Notice(n) if f(n)))
}

#[tokio::test]
async fn replays_from_cursor_in_order() {
    let sim = sim_with(SimConfig::default()).await;
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(100));
    let items = collect(&mut s, last_seq_is(1476)).await;
    assert_eq!(seqs(&items), (101..=1476).collect::<Vec<_>>());
    assert_eq!(sim.handle().cursors(), vec![Some(100)]);
    // Every frame arrives decoded, and its message agrees with its bytes.
    for i in &items {
        if let Item::Frame(f) = i {
            assert_eq!(f.message().seq(), Some(f.seq));
            assert!(relay_client::decode(f.bytes()).is_ok());
            assert_eq!(f.relay, RelayRole::Primary);
        }
    }
}

#[tokio::test]
async fn reconnects_after_close_and_resumes_without_gap_or_duplicate() {
    let sim = sim_with(SimConfig { initial_head: Some(300), ..SimConfig::default() }).await;
    let h = sim.handle();
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(0));
    let mut items = collect(&mut s, last_seq_is(300)).await;
    h.close_all();
    h.publish_up_to(1476);
    items.extend(collect(&mut s, last_seq_is(1476)).await);
    assert_eq!(seqs(&items), (1..=1476).collect::<Vec<_>>());
    assert!(has_notice(&items, |n| matches!(
        n,
        Notice::Disconnected { error: ConnError::ClosedByRelay | ConnError::Io(_), .. }
    )));
    let cursors = h.cursors();
    assert_eq!(cursors.first(), Some(&Some(0)));
    assert!(cursors.len() >= 2, "reconnected: {cursors:?}");
    assert!(cursors[1].is_some_and(|c| c >= 300), "resumed from the last delivered seq: {cursors:?}");
}

#[tokio::test]
async fn stall_on_data_reconnects_even_though_pings_are_answered() {
    let sim = sim_with(SimConfig { initial_head: Some(10), ..SimConfig::default() }).await;
    let h = sim.handle();
    let mut c = cfg();
    c.stall_timeout = Duration::from_millis(600);
    let mut s = sub(&sim, c);
    s.start(RelayRole::Primary, None.or(Some(0)));
    let mut items = collect(&mut s, last_seq_is(10)).await;
    h.stall(true);
    items.extend(
        collect(&mut s, |i| has_notice(i, |n| matches!(n, Notice::Disconnected { error: ConnError::Stalled(_), .. })))
            .await,
    );
    h.stall(false);
    h.publish_up_to(20);
    items.extend(collect(&mut s, last_seq_is(20)).await);
    assert_eq!(seqs(&items), (1..=20).collect::<Vec<_>>());
    assert_eq!(h.cursors().last(), Some(&Some(10)));
}

#[tokio::test]
async fn garbage_and_text_frames_are_skipped_and_the_stream_goes_on() {
    let sim = sim_with(SimConfig { initial_head: Some(5), ..SimConfig::default() }).await;
    let h = sim.handle();
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(0));
    let mut items = collect(&mut s, last_seq_is(5)).await;
    h.send_raw(Bytes::from_static(&[0xa2, 0x61, 0x74, 0xff, 0x00]));
    h.send_text("hello");
    items.extend(
        collect(&mut s, |i| i.iter().filter(|x| matches!(x, Item::Notice(Notice::BadFrame { .. }))).count() == 2).await,
    );
    h.publish_up_to(8);
    items.extend(collect(&mut s, last_seq_is(8)).await);
    assert_eq!(seqs(&items), (1..=8).collect::<Vec<_>>());
    assert!(has_notice(&items, |n| matches!(n, Notice::BadFrame { error: DecodeError::Cbor { .. }, .. })));
    assert!(has_notice(&items, |n| matches!(n, Notice::BadFrame { error: DecodeError::TextMessage { len: 5 }, .. })));
    assert_eq!(h.connects(), 1, "bad frames do not drop the connection");
    assert_eq!(s.stats().bad_frames, 2);
}

/// Frame 3 of the fixture with its header's `op` replaced by 7: the seq is readable, the
/// frame is not.
fn undecodable_third_frame() -> Bytes {
    let mut bad = fixture()[2].to_vec();
    let at = bad.windows(3).position(|w| w == [0x62, b'o', b'p']).expect("op key");
    bad[at + 3] = 0x07;
    Bytes::from(bad)
}

/// The fixture with frame `i` replaced.
fn fixture_with(i: usize, frame: Bytes) -> Vec<Bytes> {
    let mut f = fixture();
    f[i] = frame;
    f
}

async fn sim_of(frames: Vec<Bytes>, head: usize) -> RelaySim {
    let cfg = SimConfig { initial_head: Some(head), ..SimConfig::default() };
    RelaySim::start_with(frames, cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim")
}

/// Reads until the subscription returns an error.
async fn until_err(s: &mut Subscription, items: &mut Vec<Item>) -> SubscribeError {
    tokio::time::timeout(DEADLINE, async {
        loop {
            match s.next().await {
                Ok(i) => items.push(i),
                Err(e) => return e,
            }
        }
    })
    .await
    .expect("deadline")
}

#[tokio::test]
async fn an_undecodable_frame_with_a_seq_stops_the_subscription_before_it_by_default() {
    let sim = sim_of(fixture_with(2, undecodable_third_frame()), 6).await;
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(0));
    let mut items = Vec::new();
    let err = until_err(&mut s, &mut items).await;
    assert!(matches!(err, SubscribeError::BadFrame { seq: 3, error: DecodeError::UnknownOp(7), .. }), "{err}");
    assert!(err.to_string().contains("`skip` policy"), "the error says what to do: {err}");
    assert_eq!(seqs(&items), vec![1, 2], "nothing after the bad frame is delivered");
    assert_eq!(s.cursor(), Some(2), "the cursor stays before it");
    assert!(matches!(s.next().await, Err(SubscribeError::Closed)), "it does not go on by itself");
}

#[tokio::test]
async fn under_the_skip_policy_an_undecodable_frame_is_reported_and_stepped_over() {
    let sim = sim_of(fixture_with(2, undecodable_third_frame()), 6).await;
    let mut c = cfg();
    c.bad_frame = BadFramePolicy::Skip;
    let mut s = sub(&sim, c);
    s.start(RelayRole::Primary, Some(0));
    let mut items = collect(&mut s, |i| has_notice(i, |n| matches!(n, Notice::BadFrame { .. }))).await;
    assert!(has_notice(&items, |n| matches!(
        n,
        Notice::BadFrame { seq: Some(3), error: DecodeError::UnknownOp(7), .. }
    )));
    // A reconnect now resumes after the skipped frame, not before it.
    assert_eq!(s.cursor(), Some(3), "skipping moves past the frame");
    items.extend(collect(&mut s, last_seq_is(6)).await);
    assert_eq!(seqs(&items), vec![1, 2, 4, 5, 6]);
}

/// Frame 4 followed by 200 KiB of padding: over a 64 KiB limit, seq still readable.
fn oversized_fourth_frame() -> Bytes {
    let mut big = fixture()[3].to_vec();
    big.resize(big.len() + (200 << 10), 0);
    Bytes::from(big)
}

#[tokio::test]
async fn an_oversized_frame_stops_the_subscription_by_default_instead_of_reconnecting_forever() {
    let sim = sim_of(fixture_with(3, oversized_fourth_frame()), 6).await;
    let h = sim.handle();
    let mut c = cfg();
    c.max_frame_bytes = 64 << 10;
    let mut s = sub(&sim, c);
    s.start(RelayRole::Primary, Some(0));
    let mut items = Vec::new();
    let err = until_err(&mut s, &mut items).await;
    assert!(matches!(err, SubscribeError::FrameTooLarge { after: Some(3), max: 65536, .. }), "{err}");
    assert!(err.to_string().contains("raise the limit"), "{err}");
    assert_eq!(seqs(&items), vec![1, 2, 3]);
    assert_eq!(h.connects(), 1, "no reconnect loop");
}

#[tokio::test]
async fn under_the_skip_policy_an_oversized_frame_is_read_once_with_a_raised_limit_and_stepped_over() {
    let sim = sim_of(fixture_with(3, oversized_fourth_frame()), 6).await;
    let h = sim.handle();
    let mut c = cfg();
    c.max_frame_bytes = 64 << 10;
    c.bad_frame = BadFramePolicy::Skip;
    let mut s = sub(&sim, c);
    s.start(RelayRole::Primary, Some(0));
    let items = collect(&mut s, last_seq_is(6)).await;
    assert!(has_notice(&items, |n| matches!(
        n,
        Notice::BadFrame { seq: Some(4), error: DecodeError::TooLarge { max: 65536, .. }, .. }
    )));
    assert_eq!(seqs(&items), vec![1, 2, 3, 5, 6]);
    assert_eq!(h.connects(), 2, "one reconnect to read it with the raised limit");
}

#[tokio::test]
async fn a_transient_oversized_message_without_a_seq_is_skipped_after_one_reconnect() {
    let sim = sim_with(SimConfig { initial_head: Some(3), ..SimConfig::default() }).await;
    let h = sim.handle();
    let mut c = cfg();
    c.max_frame_bytes = 64 << 10;
    c.bad_frame = BadFramePolicy::Skip;
    let mut s = sub(&sim, c);
    s.start(RelayRole::Primary, Some(0));
    let mut items = collect(&mut s, last_seq_is(3)).await;
    h.send_raw(Bytes::from(vec![0u8; 200 << 10]));
    items.extend(collect(&mut s, |i| has_notice(i, |n| matches!(n, Notice::Connected { cursor: Some(3), .. }))).await);
    h.publish_up_to(6);
    items.extend(collect(&mut s, last_seq_is(6)).await);
    assert_eq!(seqs(&items), (1..=6).collect::<Vec<_>>());
}

#[tokio::test]
async fn consumer_too_slow_reconnects_from_the_last_seq() {
    let sim = sim_with(SimConfig { initial_head: Some(50), ..SimConfig::default() }).await;
    let h = sim.handle();
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(0));
    let mut items = collect(&mut s, last_seq_is(50)).await;
    h.send_error("ConsumerTooSlow", "slow down");
    items.extend(collect(&mut s, |i| has_notice(i, |n| matches!(n, Notice::Connected { cursor: Some(50), .. }))).await);
    assert!(has_notice(
        &items,
        |n| matches!(n, Notice::Disconnected { error: ConnError::ErrorFrame { error, .. }, .. } if error == "ConsumerTooSlow")
    ));
}

#[tokio::test]
async fn future_cursor_fails_by_default() {
    let sim = sim_with(SimConfig::default()).await;
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(5000));
    let err = loop {
        match tokio::time::timeout(DEADLINE, s.next()).await.expect("deadline") {
            Ok(_) => {}
            Err(e) => break e,
        }
    };
    assert!(matches!(err, SubscribeError::FutureCursor { relay: RelayRole::Primary, cursor: Some(5000), .. }), "{err}");
    // It does not go on by itself.
    assert!(matches!(s.next().await, Err(SubscribeError::Closed)));
}

#[tokio::test]
async fn outdated_cursor_is_reported_then_the_window_is_replayed() {
    let sim = sim_with(SimConfig { window_start: Some(100), ..SimConfig::default() }).await;
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(5));
    let items = collect(&mut s, last_seq_is(1476)).await;
    assert!(has_notice(&items, |n| matches!(n, Notice::OutdatedCursor { .. })));
    assert_eq!(seqs(&items), (100..=1476).collect::<Vec<_>>());
}

#[tokio::test]
async fn seq_reset_and_duplicates_are_dropped_and_reported() {
    let frames = fixture();
    let sim = sim_with(SimConfig { initial_head: Some(20), ..SimConfig::default() }).await;
    let h = sim.handle();
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(0));
    let mut items = collect(&mut s, last_seq_is(20)).await;
    // A duplicate of seq 20.
    h.send_raw(relay_sim::with_seq(&frames[5], 20).expect("renumber"));
    // The relay restarts its numbering at 1.
    h.reset_seq(1);
    h.publish_up_to(40);
    items.extend(collect(&mut s, |i| has_notice(i, |n| matches!(n, Notice::SeqBackwards { .. }))).await);
    // Drain the rest of the renumbered frames (all dropped); wait until counted.
    tokio::time::timeout(DEADLINE, async {
        while s.stats().backwards + s.stats().duplicates < 21 {
            let _ = tokio::time::timeout(Duration::from_millis(100), s.next()).await;
        }
    })
    .await
    .expect("all renumbered frames seen");
    assert!(has_notice(&items, |n| matches!(n, Notice::SeqBackwards { last: 20, got: 1, .. })));
    assert_eq!(seqs(&items), (1..=20).collect::<Vec<_>>());
    let st: Stats = s.stats();
    // Renumbered 1..=20: 1..=19 went backwards, 20 equals the last seq (a duplicate).
    assert_eq!((st.duplicates, st.backwards, st.frames), (2, 19, 20));
    assert_eq!(s.cursor(), Some(20));
}

#[tokio::test]
async fn backoff_grows_while_down_and_resets_after_a_healthy_connection() {
    let sim = sim_with(SimConfig { initial_head: Some(1), rate: Some(50), ..SimConfig::default() }).await;
    let h = sim.handle();
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(0));
    let retries = |items: &[Item]| -> Vec<Duration> {
        items
            .iter()
            .filter_map(|i| {
                if let Item::Notice(Notice::Disconnected { retry_in, .. }) = i { Some(*retry_in) } else { None }
            })
            .collect()
    };
    // Healthy: frames trickle in for longer than healthy_after.
    let mut items = collect(&mut s, last_seq_is(15)).await;
    h.set_down(true);
    items.extend(collect(&mut s, |i| retries(i).len() >= 5).await);
    let r = retries(&items);
    // Nominal 20, 40, 80, 160, 200 ms, each jittered into [nominal/2, nominal].
    assert!(r[0] <= Duration::from_millis(20), "{r:?}");
    assert!(r[4] >= Duration::from_millis(100), "{r:?}");
    h.set_down(false);
    // Skip the burst of frames published while down; then frames trickle in at 50/s for
    // longer than healthy_after.
    collect(&mut s, |i| !seqs(i).is_empty()).await;
    items = collect(&mut s, last_seq_is(h.head_seq() + 10)).await;
    h.close_all();
    items.extend(collect(&mut s, |i| !retries(i).is_empty()).await);
    assert!(retries(&items)[0] <= Duration::from_millis(20), "reset after healthy: {:?}", retries(&items));
}

#[tokio::test]
async fn fails_over_to_secondary_and_back_each_with_its_own_cursor() {
    let primary = sim_with(SimConfig::default()).await;
    let secondary = sim_with(SimConfig::default()).await;
    let p = primary.handle();
    p.set_down(true);
    let mut c = cfg();
    c.failover_after = 2;
    c.probe_interval = Duration::from_millis(150);
    c.probe_successes = 2;
    c.probe_hold = Duration::from_millis(100);
    let mut s = Subscription::new(
        c,
        RelayUrl::parse(&primary.url()).expect("url"),
        Some(RelayUrl::parse(&secondary.url()).expect("url")),
    );
    s.start(RelayRole::Primary, Some(10));
    let items = collect(&mut s, |i| matches!(i.last(), Some(Item::SwitchRelay { .. }))).await;
    assert!(matches!(
        items.last(),
        Some(Item::SwitchRelay { from: RelayRole::Primary, to: RelayRole::Secondary, reason: SwitchReason::Failover })
    ));
    assert_eq!(items.iter().filter(|i| matches!(i, Item::Notice(Notice::Disconnected { .. }))).count(), 2);
    // The caller commits the primary cursor (10 here) and hands in the secondary's own.
    s.start(RelayRole::Secondary, Some(1000));
    let items = collect(&mut s, last_seq_is(1476)).await;
    assert_eq!(seqs(&items), (1001..=1476).collect::<Vec<_>>());
    assert!(items.iter().all(|i| !matches!(i, Item::Frame(f) if f.relay != RelayRole::Secondary)));
    assert_eq!(secondary.handle().cursors(), vec![Some(1000)]);
    // Primary recovers: probes pass, the subscription asks to fail back.
    p.set_down(false);
    let items = collect(&mut s, |i| matches!(i.last(), Some(Item::SwitchRelay { .. }))).await;
    assert!(matches!(
        items.last(),
        Some(Item::SwitchRelay { from: RelayRole::Secondary, to: RelayRole::Primary, reason: SwitchReason::Failback })
    ));
    s.start(RelayRole::Primary, Some(1400));
    let items = collect(&mut s, last_seq_is(1476)).await;
    assert_eq!(seqs(&items), (1401..=1476).collect::<Vec<_>>());
    assert!(p.cursors().contains(&Some(1400)));
}

/// The socket is read by a task of its own: a subscription restarted or dropped while
/// that reader waits on a quiet socket must close the connection, not leave the reader
/// holding it open.
#[tokio::test]
async fn a_restarted_or_dropped_subscription_closes_its_connection() {
    let sim = sim_with(SimConfig::default()).await;
    let h = sim.handle();
    let mut s = sub(&sim, cfg());
    s.start(RelayRole::Primary, Some(0));
    collect(&mut s, last_seq_is(1476)).await;
    assert_eq!(h.open_connections(), 1);
    // Everything was sent: the reader now waits on a socket with nothing to read.
    s.start(RelayRole::Primary, Some(1476));
    testkit::eventually("the restarted subscription's connection closed", DEADLINE, async || h.open_connections() == 0)
        .await;
    let items = collect(&mut s, |items| has_notice(items, |n| matches!(n, Notice::Connected { .. }))).await;
    assert!(seqs(&items).is_empty(), "nothing after the last seq: {items:?}");
    assert_eq!(h.open_connections(), 1);
    drop(s);
    testkit::eventually("the dropped subscription's connection closed", DEADLINE, async || h.open_connections() == 0)
        .await;
}
