//! Jetstream input through relay-sim's Jetstream instance: every event once on v1 and v2,
//! compressed or not; a reconnect in the middle of a commit's ops neither loses nor
//! repeats one; the filters reach the server; bad frames are typed errors under the
//! bad-frame policy; v1's silent clamp and v2's `OutdatedCursor` are gaps.

use std::time::Duration;

use relay_client::jetstream::{Options, Version};
use relay_client::{
    BadFramePolicy, ClientConfig, Input, Item, Message, Notice, RelayRole, RelayUrl, SubscribeError, Subscription,
};
use relay_sim::jetstream::Clock;
use relay_sim::{RelaySim, SimConfig};

fn cfg(opts: Options) -> ClientConfig {
    let mut c = ClientConfig {
        input: Input::Jetstream(opts),
        connect_timeout: Duration::from_secs(5),
        stall_timeout: Duration::from_secs(30),
        ..ClientConfig::default()
    };
    c.backoff.initial = Duration::from_millis(20);
    c.backoff.max = Duration::from_millis(100);
    c
}

async fn sim(cfg: SimConfig) -> RelaySim {
    RelaySim::start_jetstream(&testkit::fixture_frames(), &Clock::default(), cfg, "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("sim")
}

/// The (stamp, content key) of every event of `sub` until `n` have come.
async fn read(sub: &mut Subscription, n: usize) -> Vec<(u64, u64)> {
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while got.len() < n {
            match sub.next().await.expect("item") {
                Item::Frame(f) => {
                    let Message::Jet(e) = f.message() else { panic!("not a Jetstream event") };
                    assert_eq!(f.seq, e.stamp);
                    got.push((e.stamp, e.content_key()));
                }
                Item::Notice(_) => {}
                Item::SwitchRelay { .. } => panic!("no switch expected"),
            }
        }
    })
    .await
    .expect("events in time");
    got
}

/// The indices of the rows the v1 wire carries (it has no `#sync`).
fn v1_rows(rows: &[relay_sim::jetstream::Row]) -> Vec<usize> {
    rows.iter().enumerate().filter(|(_, r)| !r.v1.is_empty()).map(|(i, _)| i).collect()
}

fn keys_of(rows: &[relay_sim::jetstream::Row], version: Version) -> Vec<(u64, u64)> {
    rows.iter()
        .filter_map(|r| {
            let text = if version == Version::V1 { &r.v1 } else { &r.v2 };
            if text.is_empty() {
                return None;
            }
            match relay_client::jetstream::decode(version, text) {
                Ok(relay_client::Frame::Message(Message::Jet(e))) => Some((e.stamp, e.content_key())),
                _ => None,
            }
        })
        .collect()
}

#[tokio::test]
async fn every_event_arrives_once_on_both_wires_compressed_or_not() {
    let rows = relay_sim::jetstream::rows(&testkit::fixture_frames(), &Clock::default());
    for version in [Version::V1, Version::V2] {
        for compress in [false, true] {
            let s = sim(SimConfig::default()).await;
            let want = keys_of(&rows, version);
            assert!(want.len() > 100, "the capture has events");
            let opts = Options { version, compress, ..Options::default() };
            let mut sub = Subscription::new(cfg(opts), RelayUrl::parse(&s.url()).expect("url"), None);
            sub.start(RelayRole::Primary, Some(Clock::default().base_us));
            let got = read(&mut sub, want.len()).await;
            assert_eq!(got, want, "{version:?} compress={compress}");
        }
    }
}

#[tokio::test]
async fn a_reconnect_in_the_middle_of_a_commits_ops_loses_and_repeats_none() {
    let rows = relay_sim::jetstream::rows(&testkit::fixture_frames(), &Clock::default());
    let want = keys_of(&rows, Version::V1);
    // The index of an event whose stamp the next event shares: a commit with several ops.
    let split = want.windows(2).position(|w| w[0].0 == w[1].0).expect("a commit with several ops") + 1;
    let s = sim(SimConfig { initial_head: Some(0), ..SimConfig::default() }).await;
    let h = s.handle();
    // Publish through the middle of that commit's ops, read them, cut, publish the rest.
    h.publish_up_to(v1_rows(&rows)[split] + 1);
    let mut sub = Subscription::new(cfg(Options::default()), RelayUrl::parse(&s.url()).expect("url"), None);
    sub.start(RelayRole::Primary, Some(Clock::default().base_us));
    let mut got = read(&mut sub, split + 1).await;
    assert_eq!(got.len(), split + 1);
    h.close_all();
    h.publish_up_to(rows.len());
    got.extend(read(&mut sub, want.len() - got.len()).await);
    let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
    assert!(
        got.len() == want.len() && first_diff.is_none(),
        "the rest of the commit's ops arrive after the reconnect, none twice: {} events for {}, first difference at {first_diff:?}",
        got.len(),
        want.len()
    );
}

#[tokio::test]
async fn filters_go_to_the_server() {
    let rows = relay_sim::jetstream::rows(&testkit::fixture_frames(), &Clock::default());
    let did = rows.iter().find(|r| r.kind == "commit").expect("a commit").did.clone();
    for version in [Version::V1, Version::V2] {
        let s = sim(SimConfig::default()).await;
        let opts =
            Options { version, collections: vec!["app.bsky.feed.*".into()], dids: vec![did.clone()], compress: true };
        let want: Vec<(u64, u64)> = keys_of(
            &rows
                .iter()
                .filter(|r| r.did == did && r.collection.as_deref().is_none_or(|c| c.starts_with("app.bsky.feed.")))
                .cloned()
                .collect::<Vec<_>>(),
            version,
        );
        assert!(!want.is_empty());
        let mut sub = Subscription::new(cfg(opts), RelayUrl::parse(&s.url()).expect("url"), None);
        sub.start(RelayRole::Primary, Some(Clock::default().base_us));
        assert_eq!(read(&mut sub, want.len()).await, want, "{version:?}: only that repo's feed records");
    }
}

/// Reads until an error, counting the frames before it.
async fn until_error(sub: &mut Subscription) -> (usize, SubscribeError) {
    let mut n = 0;
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match sub.next().await {
                Ok(Item::Frame(_)) => n += 1,
                Ok(_) => {}
                Err(e) => return (n, e),
            }
        }
    })
    .await
    .expect("an error in time")
}

#[tokio::test]
async fn bad_frames_stop_under_fail_and_are_skipped_under_skip() {
    let rows = relay_sim::jetstream::rows(&testkit::fixture_frames(), &Clock::default());
    let on_v1 = v1_rows(&rows);
    // An event of a kind this version does not know, stamped just after the fifth; and
    // one whose stamp is forged far ahead (skipping it must not move the cursor there).
    let unknown = format!(r#"{{"did":"did:plc:a","time_us":{},"kind":"labels"}}"#, rows[on_v1[4]].stamp + 1);
    let forged = r#"{"did":"did:plc:a","time_us":9000000000000000,"kind":"labels"}"#;
    for what in ["{not json", &unknown, forged, "zstd", "huge"] {
        for policy in [BadFramePolicy::Fail, BadFramePolicy::Skip] {
            let relay = sim(SimConfig { initial_head: Some(on_v1[4] + 1), ..SimConfig::default() }).await;
            let ctl = relay.handle();
            let mut conf = cfg(Options::default());
            conf.bad_frame = policy;
            conf.max_frame_bytes = 64 << 10;
            let mut sub = Subscription::new(conf, RelayUrl::parse(&relay.url()).expect("url"), None);
            sub.start(RelayRole::Primary, Some(Clock::default().base_us));
            let first = read(&mut sub, 5).await;
            match what {
                "zstd" => ctl.send_raw(bytes::Bytes::from_static(b"\x28\xb5\x2f\xfd garbage that is no zstd frame")),
                "huge" => ctl.send_text(&format!("{{\"did\":\"{}\"}}", "x".repeat(100 << 10))),
                text => ctl.send_text(text),
            }
            // Something after it, so a skip shows as the stream going on.
            ctl.publish_up_to(on_v1[7] + 1);
            if policy == BadFramePolicy::Fail {
                let (delivered, e) = until_error(&mut sub).await;
                assert_eq!(delivered, 0, "{what}: nothing after the bad frame is delivered");
                assert!(
                    matches!(
                        e,
                        SubscribeError::BadJetstreamFrame { .. }
                            | SubscribeError::BadFrame { .. }
                            | SubscribeError::FrameTooLarge { .. }
                    ),
                    "{what}: {e}"
                );
                assert!(sub.cursor() <= first.last().map(|x| x.0), "{what}: the cursor did not pass the bad frame");
            } else {
                let mut saw_bad = false;
                let mut more = 0;
                tokio::time::timeout(Duration::from_secs(30), async {
                    // An oversized frame is counted when the socket refuses it (a fault is not
                    // sent again to the reconnection that would read it whole).
                    while !((saw_bad || sub.stats().bad_frames > 0) && more >= 3) {
                        match sub.next().await.expect("item") {
                            Item::Notice(Notice::BadFrame { .. }) => saw_bad = true,
                            Item::Frame(_) => more += 1,
                            _ => {}
                        }
                    }
                })
                .await
                .expect("the stream goes on");
                assert!(saw_bad || what == "huge", "{what}: the skip is reported");
                assert!(sub.cursor() < Some(9_000_000_000_000_000), "{what}: a skipped frame's stamp is not believed");
            }
        }
    }
}

#[tokio::test]
async fn a_cursor_older_than_the_window_is_a_gap_on_both_wires() {
    // Two seconds between upstream events: a quiet stream, where a first event well after
    // the cursor is no proof of a clamp.
    let clock = Clock { step_us: 2_000_000, ..Clock::default() };
    let rows = relay_sim::jetstream::rows(&testkit::fixture_frames(), &clock);
    let mid = rows.len() / 2;
    let window = rows[mid].stamp;
    for version in [Version::V1, Version::V2] {
        let s = RelaySim::start_jetstream(
            &testkit::fixture_frames(),
            &clock,
            SimConfig { window_start: Some(window), ..SimConfig::default() },
            "127.0.0.1:0".parse().expect("addr"),
        )
        .await
        .expect("sim");
        let opts = Options { version, ..Options::default() };
        // Refused: the subscription stops before anything is delivered.
        let mut sub = Subscription::new(cfg(opts.clone()), RelayUrl::parse(&s.url()).expect("url"), None);
        sub.start(RelayRole::Primary, Some(rows[0].stamp));
        let (n, e) = until_error(&mut sub).await;
        assert_eq!(n, 0, "{version:?}");
        assert!(matches!(e, SubscribeError::Gap { .. }), "{version:?}: {e}");
        // Accepted: reported, then the window.
        let mut c = cfg(opts.clone());
        c.refuse_gaps = false;
        let mut sub = Subscription::new(c, RelayUrl::parse(&s.url()).expect("url"), None);
        sub.start(RelayRole::Primary, Some(rows[0].stamp));
        let outdated = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match sub.next().await.expect("item") {
                    Item::Notice(Notice::OutdatedCursor { .. }) => return true,
                    Item::Frame(_) => return false,
                    _ => {}
                }
            }
        })
        .await
        .expect("in time");
        assert!(outdated, "{version:?}: the gap is reported before the first event");
        // Inside the window, two seconds before the next event: no gap (v1 asks for the
        // oldest event and finds it older than the first one sent).
        let mut sub = Subscription::new(cfg(opts), RelayUrl::parse(&s.url()).expect("url"), None);
        sub.start(RelayRole::Primary, Some(window + 1));
        let got = read(&mut sub, 1).await;
        assert!(got[0].0 > window + 1_000_000, "{version:?}: the first event is well after the cursor");
    }
}

#[tokio::test]
async fn a_retired_v2_dictionary_falls_back_to_plain_frames_and_loses_nothing() {
    let rows = relay_sim::jetstream::rows(&testkit::fixture_frames(), &Clock::default());
    let want = keys_of(&rows, Version::V2);
    // The instance knows another dictionary: it refuses the shipped one before the upgrade.
    let s = sim(SimConfig { v2_dictionary: Some(99), ..SimConfig::default() }).await;
    let opts = Options { version: Version::V2, compress: true, ..Options::default() };
    let mut sub = Subscription::new(cfg(opts), RelayUrl::parse(&s.url()).expect("url"), None);
    sub.start(RelayRole::Primary, Some(Clock::default().base_us));
    assert_eq!(read(&mut sub, want.len()).await, want, "every event, uncompressed");
    assert_eq!(s.handle().connects(), 1, "one refused handshake, then one connection");
}
