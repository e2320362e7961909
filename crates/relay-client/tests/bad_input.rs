//! Every class of bad input gives a typed error and never a panic.

use relay_client::car;
use relay_client::cbor::Writer;
use relay_client::error::{CborError, CidError, DecodeError};
use relay_client::frame::{self, Frame, Message};
use relay_client::json;

/// A canonical `#commit` frame with one create op per record, all blocks in the CAR.
fn commit_frame(seq: i64, records: &[Vec<u8>], include_blocks: bool) -> Vec<u8> {
    let commit_block = {
        let mut w = Writer::new();
        w.map(1).str("did").str("did:plc:test");
        w.buf
    };
    let mut blocks = vec![commit_block.clone()];
    if include_blocks {
        blocks.extend(records.iter().cloned());
    }
    let car = car::build(&[car::cid_for(&commit_block)], &blocks);
    let mut w = Writer::new();
    w.map(2).str("t").str("#commit").str("op").int(1);
    // Canonical key order: length first, then bytewise.
    w.map(11);
    w.str("ops").array(records.len() as u64);
    for (i, r) in records.iter().enumerate() {
        w.map(3)
            .str("cid")
            .link(&car::cid_for(r))
            .str("path")
            .str(&format!("app.bsky.feed.post/{i}"))
            .str("action")
            .str("create");
    }
    w.str("rev").str("3kabc");
    w.str("seq").int(seq);
    w.str("repo").str("did:plc:test");
    w.str("time").str("2026-12-02T00:00:00.000Z");
    w.str("blobs").array(0);
    w.str("since").null();
    w.str("blocks").bytes(&car);
    w.str("commit").link(&car::cid_for(&commit_block));
    w.str("rebase").bool(false);
    w.str("tooBig").bool(false);
    w.buf
}

fn record(text: &str) -> Vec<u8> {
    let mut w = Writer::new();
    w.map(2).str("text").str(text).str("$type").str("app.bsky.feed.post");
    w.buf
}

/// Decodes and renders records: the whole path a consumer takes.
fn full(bytes: &[u8]) -> Result<String, DecodeError> {
    let f = frame::decode(bytes)?;
    let mut s = String::new();
    json::write_frame(&f, true, &mut s)?;
    Ok(s)
}

#[test]
fn a_built_commit_decodes() {
    let f = commit_frame(7, &[record("hi"), record("there")], true);
    let line = full(&f).expect("valid frame");
    assert!(line.contains(r#""record":{"text":"hi","$type":"app.bsky.feed.post"}"#), "{line}");
}

#[test]
fn truncated_frames_are_typed_errors() {
    let f = commit_frame(7, &[record("hi")], true);
    for cut in 0..f.len() {
        match frame::decode(&f[..cut]) {
            Err(DecodeError::Cbor { source: CborError::Truncated { .. }, .. } | DecodeError::MissingField { .. }) => {}
            other => panic!("cut at {cut}: expected a truncation error, got {other:?}"),
        }
    }
}

#[test]
fn trailing_bytes_are_rejected() {
    let mut f = commit_frame(7, &[], true);
    f.push(0);
    assert!(matches!(frame::decode(&f), Err(DecodeError::Cbor { source: CborError::TrailingBytes { .. }, .. })));
}

#[test]
fn non_canonical_cbor_is_rejected() {
    // Header keys in the wrong order: {"op":1,"t":"#commit"}.
    let mut w = Writer::new();
    w.map(2).str("op").int(1).str("t").str("#commit");
    assert!(matches!(
        frame::decode(&w.buf),
        Err(DecodeError::Cbor { part: "header", source: CborError::KeyOrder { .. } })
    ));
    // A non-minimal seq (0x18 0x07 instead of 0x07) in an otherwise valid frame.
    let f = commit_frame(7, &[], true);
    let span = frame::seq_span(&f).expect("seq");
    let mut bad = f[..span.start].to_vec();
    bad.extend_from_slice(&[0x18, 0x07]);
    bad.extend_from_slice(&f[span.end..]);
    assert!(matches!(
        frame::decode(&bad),
        Err(DecodeError::Cbor { part: "body", source: CborError::NonMinimal { .. } })
    ));
    // Indefinite-length map as the body.
    let mut w = Writer::new();
    w.map(2).str("t").str("#identity").str("op").int(1).raw(&[0xbf, 0xff]);
    assert!(matches!(frame::decode(&w.buf), Err(DecodeError::Cbor { source: CborError::Indefinite { .. }, .. })));
    // A record with unsorted keys inside a valid commit is caught at record level.
    let mut w = Writer::new();
    w.map(2).str("$type").str("x").str("text").str("y");
    let f = commit_frame(8, &[w.buf], true);
    assert!(frame::decode(&f).is_ok(), "the frame itself is fine");
    assert!(matches!(full(&f), Err(DecodeError::Cbor { part: "record", source: CborError::KeyOrder { .. } })));
}

#[test]
fn bad_cids_are_rejected() {
    let f = commit_frame(7, &[], true);
    // The commit CID is the last link: flip its version byte 0x01 -> 0x02.
    let needle = [0xd8, 0x2a, 0x58, 0x25, 0x00, 0x01, 0x71];
    let at = f.windows(needle.len()).rposition(|w| w == needle).expect("commit link");
    let mut bad = f.clone();
    bad[at + 5] = 0x02;
    assert!(matches!(frame::decode(&bad), Err(DecodeError::Cid { field: "commit", source: CidError::Version(2) })));
    // Missing 0x00 multibase prefix.
    let mut bad = f.clone();
    bad[at + 4] = 0x01;
    assert!(matches!(frame::decode(&bad), Err(DecodeError::Cbor { source: CborError::BadLinkPrefix { .. }, .. })));
    // A foreign tag instead of 42.
    let mut bad = f;
    bad[at + 1] = 0x2b;
    assert!(matches!(
        frame::decode(&bad),
        Err(DecodeError::Cbor { source: CborError::ForeignTag { tag: 43, .. }, .. })
    ));
}

#[test]
fn car_missing_block_is_a_typed_error() {
    let f = commit_frame(7, &[record("lost")], false);
    let decoded = frame::decode(&f).expect("frame is structurally fine");
    let Frame::Message(Message::Commit(c)) = &decoded else { panic!("commit") };
    let car = c.car(true).expect("car");
    assert!(
        matches!(c.ops[0].record(&car), Err(DecodeError::MissingBlock { path, .. }) if path == "app.bsky.feed.post/0")
    );
    assert!(matches!(full(&f), Err(DecodeError::MissingBlock { .. })));
}

#[test]
fn corrupt_car_is_a_typed_error() {
    let f = commit_frame(9, &[record("x")], true);
    // Replace the blocks byte string with garbage of the same length.
    let d = frame::decode(&f).expect("ok");
    let Frame::Message(Message::Commit(c)) = d else { panic!() };
    let start = c.blocks.as_ptr() as usize - f.as_ptr() as usize;
    let mut bad = f.clone();
    for b in &mut bad[start..start + c.blocks.len()] {
        *b = 0xff;
    }
    assert!(matches!(full(&bad), Err(DecodeError::Car(_))));
}

#[test]
fn unknown_op_and_missing_type() {
    let mut w = Writer::new();
    w.map(1).str("op").int(2).map(0);
    assert!(matches!(frame::decode(&w.buf), Err(DecodeError::UnknownOp(2))));
    let mut w = Writer::new();
    w.map(1).str("op").int(1).map(0);
    assert!(matches!(frame::decode(&w.buf), Err(DecodeError::MissingType)));
}

#[test]
fn seq_out_of_range_is_rejected() {
    for seq in [-1i64, 1 << 53] {
        let f = commit_frame(seq, &[], true);
        assert!(matches!(frame::decode(&f), Err(DecodeError::BadValue { field: "seq", .. })), "seq {seq}");
    }
    assert!(frame::decode(&commit_frame((1 << 53) - 1, &[], true)).is_ok());
}

#[test]
fn other_message_types_and_unknown_types() {
    let mut w = Writer::new();
    w.map(2).str("t").str("#account").str("op").int(1);
    w.map(5)
        .str("did")
        .str("did:plc:x")
        .str("seq")
        .int(5)
        .str("time")
        .str("t")
        .str("active")
        .bool(false)
        .str("status")
        .str("takendown");
    let line = full(&w.buf).expect("account");
    assert_eq!(
        line,
        r##"{"seq":5,"type":"#account","op":1,"did":"did:plc:x","active":false,"status":"takendown","time":"t"}"##
    );

    let mut w = Writer::new();
    w.map(2).str("t").str("#info").str("op").int(1);
    w.map(2).str("name").str("OutdatedCursor").str("message").str("too old");
    assert_eq!(full(&w.buf).expect("info"), r##"{"type":"#info","op":1,"name":"OutdatedCursor","message":"too old"}"##);

    let mut w = Writer::new();
    w.map(1).str("op").int(-1);
    w.map(2).str("error").str("FutureCursor").str("message").str("Cursor in the future.");
    assert!(matches!(frame::decode(&w.buf), Ok(Frame::Error(e)) if e.error == "FutureCursor"));

    let mut w = Writer::new();
    w.map(2).str("t").str("#labels").str("op").int(1);
    w.map(2).str("seq").int(11).str("labels").array(0);
    assert!(matches!(frame::decode(&w.buf), Ok(Frame::Message(Message::Unknown { t: "#labels", seq: Some(11) }))));
}

#[test]
fn two_hundred_ops_resolve_their_records() {
    let recs: Vec<_> = (0..200).map(|i| record(&format!("post {i}"))).collect();
    let f = commit_frame(1, &recs, true);
    let d = frame::decode(&f).expect("200 ops");
    let Frame::Message(Message::Commit(c)) = &d else { panic!() };
    let car = c.car(false).expect("car");
    for (op, r) in c.ops.iter().zip(&recs) {
        assert_eq!(op.record(&car).expect("rec").expect("some").as_bytes(), &r[..]);
    }
}

/// Tiny deterministic PRNG for mutation tests.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn fixture_frames() -> Vec<Vec<u8>> {
    let p = testkit::fixture("pds-capture.frames");
    relay_sim::capture::read(&p).expect("fixture").into_iter().map(|b| b.to_vec()).collect()
}

#[test]
fn mutated_fixture_frames_never_panic() {
    let frames = fixture_frames();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut errors = 0;
    for round in 0..20_000 {
        let mut f = frames[(rng.next() as usize) % frames.len()].clone();
        let flips = 1 + rng.next() % 4;
        for _ in 0..flips {
            let i = (rng.next() as usize) % f.len();
            f[i] = rng.next() as u8;
        }
        if round % 7 == 0 {
            let keep = (rng.next() as usize) % f.len();
            f.truncate(keep);
        }
        if full(&f).is_err() {
            errors += 1;
        }
    }
    assert!(errors > 10_000, "most mutations must be caught, only {errors} were");
}

#[test]
fn never_laxer_than_serde_ipld_dagcbor_on_records() {
    // Mutate real records; whatever the fast path accepts, the reference strict decoder
    // must accept too.
    let frames = fixture_frames();
    let mut records = Vec::new();
    for f in &frames {
        if let Ok(Frame::Message(Message::Commit(c))) = frame::decode(f) {
            let car = c.car(false).expect("car");
            for op in &c.ops {
                if let Ok(Some(r)) = op.record(&car) {
                    records.push(r.as_bytes().to_vec());
                }
            }
        }
    }
    let mut rng = Rng(42);
    let (mut ours, mut both) = (0, 0);
    for _ in 0..30_000 {
        let mut r = records[(rng.next() as usize) % records.len()].clone();
        let i = (rng.next() as usize) % r.len();
        r[i] = rng.next() as u8;
        let fast = frame::Record::new(&r).is_ok();
        let reference = serde_ipld_dagcbor::from_slice::<ipld_core::ipld::Ipld>(&r).is_ok();
        if fast {
            ours += 1;
            assert!(reference, "fast path accepted what serde_ipld_dagcbor rejects: {r:02x?}");
            both += 1;
        }
    }
    assert!(ours > 100 && both == ours, "some mutations should stay valid ({ours})");
}

#[test]
fn lossy_mode_writes_null_for_a_missing_record_and_filters_ops() {
    let f = commit_frame(7, &[record("lost"), record("also lost")], false);
    let d = frame::decode(&f).expect("frame");
    let mut out = String::new();
    let opts = json::FrameOptions { lossy_records: true, ..json::FrameOptions::default() };
    let w = json::write_frame_with(&d, &opts, &mut out).expect("lossy never fails on records");
    assert_eq!((w.ops, w.record_errors), (2, 2));
    assert!(out.contains(r#""record":null,"recordError":"missing_block""#), "{out}");
    let keep = |op: &frame::RepoOp<'_>| op.rkey() == "1";
    let opts = json::FrameOptions { lossy_records: true, keep_op: Some(&keep), ..json::FrameOptions::default() };
    out.clear();
    let w = json::write_frame_with(&d, &opts, &mut out).expect("filtered");
    assert_eq!((w.ops, w.filtered), (1, 1));
    assert!(out.contains("app.bsky.feed.post/1") && !out.contains("app.bsky.feed.post/0"), "{out}");
}
