//! Finding a start by time on a relay-sim: exact against a brute-force answer, bounded
//! by `FutureCursor`, and a window that does not reach back is a gap.

use std::time::Duration;

use relay_client::probe::{ProbeError, find_start, time_ms};
use relay_client::{Frame, RelayUrl};
use relay_sim::{RelaySim, SimConfig};

/// (seq, time ms) of every event in the fixture.
fn events() -> Vec<(u64, i64)> {
    testkit::fixture_frames()
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            Frame::Message(m) => Some((m.seq()?, time_ms(m.time()?)?)),
            Frame::Error(_) => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finds_the_newest_cursor_not_after_the_target_time_and_reports_gaps() {
    let ev = events();
    assert!(ev.windows(2).all(|w| w[0].1 <= w[1].1), "the fixture's times do not decrease");
    let window = 200;
    let cfg = SimConfig { window_start: Some(window), ..SimConfig::default() };
    let sim =
        RelaySim::start_with(testkit::fixture_frames(), cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim");
    let url = RelayUrl::parse(&sim.url()).expect("url");
    let wait = Duration::from_millis(500);
    for k in [window as usize + 5, 700, 1100, ev.len() - 1] {
        let target = ev[k].1;
        // Brute force: the last event at or before the target starts the stream.
        let last = ev.iter().rposition(|e| e.1 <= target).expect("some");
        let found = find_start(&url, target, 64, wait).await.expect("found");
        assert_eq!(found.cursor, ev[last].0 - 1, "target {target} (event {k}) in {} probes", found.probes);
        assert!(found.probes <= 30, "{} probes", found.probes);
    }
    // Out of probes: an earlier cursor (never a later one).
    let target = ev[1100].1;
    let rough = find_start(&url, target, 3, wait).await.expect("found");
    assert!(rough.cursor < ev[1100].0, "{rough:?}");
    // Needed time before the window: a gap that says where the window starts.
    match find_start(&url, ev[10].1, 64, wait).await {
        Err(ProbeError::Gap { oldest_seq, oldest_ms }) => {
            assert_eq!(oldest_seq, window);
            assert_eq!(oldest_ms, ev[window as usize - 1].1);
        }
        other => panic!("expected a gap, got {other:?}"),
    }
}
