//! Finding a start by time on a relay-sim: never later than a brute-force answer and
//! close to it, bounded by `FutureCursor`, a window that does not reach back is a gap,
//! and PDS clocks that run slow or fast at exactly the cursors the search reads do not
//! move it past the answer.

use std::time::Duration;

use relay_client::probe::{PROBE_EVENTS, ProbeError, find_start_by_time as find_start, time_ms};
use relay_client::{Frame, RelayUrl};
use relay_sim::{RelaySim, SimConfig};

/// (seq, time ms) of every event in `frames`.
fn events_of(frames: &[bytes::Bytes]) -> Vec<(u64, i64)> {
    frames
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            Frame::Message(m) => Some((m.seq()?, time_ms(m.time()?)?)),
            Frame::Error(_) => None,
        })
        .collect()
}

fn events() -> Vec<(u64, i64)> {
    events_of(&testkit::fixture_frames())
}

async fn sim(frames: Vec<bytes::Bytes>, window: Option<u64>) -> RelaySim {
    let cfg = SimConfig { window_start: window, ..SimConfig::default() };
    RelaySim::start_with(frames, cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim")
}

/// The cursor after which the first event newer than `target` comes (by true time).
fn exact(ev: &[(u64, i64)], target: i64) -> u64 {
    let last = ev.iter().rposition(|e| e.1 <= target).expect("some");
    ev[last].0 - 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finds_a_cursor_at_or_just_before_the_target_time_and_reports_gaps() {
    let ev = events();
    assert!(ev.windows(2).all(|w| w[0].1 <= w[1].1), "the fixture's times do not decrease");
    let window = 200;
    let sim = sim(testkit::fixture_frames(), Some(window)).await;
    let url = RelayUrl::parse(&sim.url()).expect("url");
    let wait = Duration::from_millis(500);
    for k in [window as usize + 5, 700, 1100, ev.len() - 1] {
        let target = ev[k].1;
        let answer = exact(&ev, target);
        let found = find_start(&url, target, 64, wait).await.expect("found");
        // Never later than the answer (that would lose events); at most a probe's
        // readings earlier (more overlap, dropped as duplicates).
        assert!(found.cursor <= answer, "target {target} (event {k}): {found:?}, answer {answer}");
        assert!(
            answer - found.cursor <= PROBE_EVENTS as u64,
            "target {target} (event {k}): {found:?}, answer {answer}"
        );
        assert!(found.probes <= 30, "{} probes", found.probes);
    }
    // Out of probes: an earlier cursor (never a later one).
    let target = ev[1100].1;
    let rough = find_start(&url, target, 3, wait).await.expect("found");
    assert!(rough.cursor < ev[1100].0, "{rough:?}");
    // Needed time before the window: a gap that says where the window starts.
    match find_start(&url, ev[10].1, 64, wait).await {
        Err(ProbeError::Gap { oldest_seq, oldest_ms, proven, shown }) => {
            assert!(!shown, "by time alone nothing is shown");
            assert!(!proven, "by time alone nothing is proven");
            assert_eq!(oldest_seq, window);
            let first = window as usize - 1;
            assert!((ev[first].1..=ev[first + PROBE_EVENTS].1).contains(&oldest_ms), "{oldest_ms}");
        }
        other => panic!("expected a gap, got {other:?}"),
    }
}

/// An adversary who knows where the search reads: the event right after every cursor it
/// probed is given a clock an hour slow (past the answer: it looks "before the target"
/// and would pull the search forward) or an hour fast (before the answer). One reading
/// per probe lost up to half the stream this way; the answer must stay at or before the
/// true one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clocks_skewed_exactly_where_the_search_reads_do_not_move_it_past_the_answer() {
    let frames = testkit::fixture_frames();
    let ev = events();
    let hour = 3_600_000;
    let wait = Duration::from_millis(500);
    for k in [300, 700, 1100] {
        let target = ev[k].1;
        let answer = exact(&ev, target);
        let clean = sim(frames.clone(), None).await;
        find_start(&RelayUrl::parse(&clean.url()).expect("url"), target, 64, wait).await.expect("found");
        let probed: Vec<u64> = clean.handle().cursors().into_iter().flatten().collect();
        drop(clean);
        let skewed = |after: bool, delta: i64| {
            relay_sim::skew_clocks(
                &frames,
                |_, m| {
                    m.seq().is_some_and(|s| {
                        probed.contains(&(s - 1)) && if after { s - 1 > answer } else { s - 1 <= answer }
                    })
                },
                delta,
            )
        };
        for (name, adversarial) in
            [("slow past the answer", skewed(true, -hour)), ("fast before it", skewed(false, hour))]
        {
            let moved = events_of(&adversarial).iter().zip(&ev).filter(|(a, b)| a.1 != b.1).count();
            assert!(moved > 0, "{name}: some probed events were skewed");
            let s = sim(adversarial, None).await;
            let found = find_start(&RelayUrl::parse(&s.url()).expect("url"), target, 64, wait).await.expect("found");
            eprintln!("event {k}, {name}: {moved} clocks skewed, found {} (answer {answer})", found.cursor);
            assert!(found.cursor <= answer, "event {k}, {name}: {found:?} is past the answer {answer}");
            assert!(answer - found.cursor <= 4 * PROBE_EVENTS as u64, "event {k}, {name}: {found:?}, answer {answer}");
        }
    }
}
