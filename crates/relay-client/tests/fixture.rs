//! The real PDS capture decodes to exactly the reference decoding, line for line.

use std::path::PathBuf;

use relay_client::frame::{self, Frame, Message};
use relay_client::json;

fn fixtures() -> PathBuf {
    testkit::fixture("")
}

#[test]
fn capture_matches_reference_decoding_line_for_line() {
    let frames = relay_sim::capture::read(&fixtures().join("pds-capture.frames")).expect("fixture frames");
    let expected = std::fs::read_to_string(fixtures().join("pds-capture.expected.jsonl")).expect("fixture jsonl");
    let expected: Vec<&str> = expected.lines().collect();
    assert_eq!(frames.len(), 1476);
    assert_eq!(frames.len(), expected.len());
    let (mut commits, mut ops, mut records) = (0, 0, 0);
    for (i, (f, want)) in frames.iter().zip(&expected).enumerate() {
        let decoded = frame::decode(f).unwrap_or_else(|e| panic!("frame {i}: {e}"));
        let mut line = String::new();
        json::write_frame(&decoded, true, &mut line).unwrap_or_else(|e| panic!("frame {i}: {e}"));
        assert_eq!(&line, want, "frame {i} differs");
        if let Frame::Message(Message::Commit(c)) = &decoded {
            commits += 1;
            ops += c.ops.len();
            let car = c.car(true).expect("car");
            records += c.ops.iter().filter(|o| o.record(&car).expect("record").is_some()).count();
        }
    }
    assert_eq!(commits, 1374);
    assert_eq!(ops, 3711 + 257);
    assert_eq!(records, 3711);
}
