//! A second seq space: the same events, numbered and interleaved as another relay would.

use std::collections::HashMap;

use relay_client::Frame;

fn keys(frames: &[bytes::Bytes]) -> Vec<(u64, String, String)> {
    frames
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            Frame::Message(m) => Some((m.seq()?, m.did()?.to_owned(), m.time()?.to_owned())),
            Frame::Error(_) => None,
        })
        .collect()
}

#[test]
fn reseq_renumbers_reorders_across_repos_and_keeps_each_repos_order() {
    let frames = testkit::fixture_frames();
    let other = relay_sim::reseq(&frames, 5_000_000, 16, 7);
    let (a, b) = (keys(&frames), keys(&other));
    assert_eq!(a.len(), b.len(), "same events");
    assert!(b.windows(2).all(|w| w[0].0 < w[1].0), "seqs increase");
    assert_eq!(b[0].0, 5_000_001);
    let order = |k: &[(u64, String, String)]| {
        let mut m: HashMap<String, Vec<String>> = HashMap::new();
        for (_, did, time) in k {
            m.entry(did.clone()).or_default().push(time.clone());
        }
        m
    };
    assert_eq!(order(&a), order(&b), "each repo's events in the same order");
    let moved = a.iter().zip(&b).filter(|(x, y)| x.1 != y.1 || x.2 != y.2).count();
    assert!(moved > a.len() / 4, "the interleaving across repos differs ({moved} of {} moved)", a.len());
}

#[test]
fn without_drops_exactly_the_picked_events() {
    let frames = testkit::fixture_frames();
    let victim = match relay_client::decode(&frames[10]).expect("frame") {
        Frame::Message(relay_client::Message::Commit(c)) => c.rev.to_owned(),
        other => panic!("frame 10 is a commit in the fixture: {other:?}"),
    };
    let fewer = relay_sim::without(&frames, |m| matches!(m, relay_client::Message::Commit(c) if c.rev == victim));
    assert_eq!(fewer.len(), frames.len() - 1);
}

#[test]
fn repeat_in_time_moves_each_copy_a_day_later_and_keeps_frames_valid() {
    let frames = testkit::fixture_frames();
    let three = relay_sim::capture::repeat_in_time(&frames, 3);
    let k = keys(&three);
    assert_eq!(k.len(), 3 * keys(&frames).len(), "every frame still decodes");
    assert!(k.windows(2).all(|w| w[0].0 < w[1].0), "seqs increase");
    let n = k.len() / 3;
    assert!(k[n].2.starts_with("2026-12-03T") && k[2 * n].2.starts_with("2026-12-04T"), "{:?}", (&k[n].2, &k[2 * n].2));
    assert!(k[n - 1].2 < k[n].2, "time increases across copies");
    // Each repo's revs keep increasing across copies, and the chain continues inside a copy.
    let mut last: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut chained = 0;
    for f in &three {
        if let Ok(Frame::Message(relay_client::Message::Commit(c))) = relay_client::decode(f) {
            if let Some(prev) = last.get(c.repo) {
                assert!(c.rev > prev.as_str(), "{}: rev {} after {prev}", c.repo, c.rev);
                chained += usize::from(c.since == Some(prev.as_str()));
            }
            last.insert(c.repo.to_owned(), c.rev.to_owned());
        }
    }
    assert!(chained > 0, "since still names the previous rev within a copy");
}

#[test]
fn repeat_as_new_repos_gives_each_copy_repos_of_its_own_and_keeps_frames_valid() {
    let frames = testkit::fixture_frames();
    let repos = |fs: &[bytes::Bytes]| -> std::collections::BTreeSet<String> {
        fs.iter()
            .filter_map(|f| match relay_client::decode(f).expect("every frame still decodes") {
                Frame::Message(m) => m.did().map(str::to_owned),
                Frame::Error(_) => None,
            })
            .collect()
    };
    let one = repos(&frames);
    let three = relay_sim::capture::repeat_as_new_repos(&frames, 3);
    assert_eq!(keys(&three).len(), 3 * keys(&frames).len(), "every frame still decodes");
    let plc = one.iter().filter(|d| d.starts_with("did:plc:")).count();
    assert!(plc > 10, "the fixture names did:plc repos");
    assert_eq!(repos(&three).len(), one.len() + 2 * plc, "each copy's did:plc repos are new");
    let seqs: Vec<u64> = three.iter().filter_map(|f| relay_sim::frame_seq(f)).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "seqs renumbered without gaps");
}
