//! Decode throughput on the real PDS capture: frames/s for the structural decode alone and
//! for the full decode (CAR parse, record look-up and validation, JSON of every record).

#![allow(missing_docs)] // criterion_group! generates an undocumented fn

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use relay_client::frame::{self, Frame, Message};
use relay_client::json;

fn load() -> Vec<Vec<u8>> {
    let path = testkit::fixture("pds-capture.frames");
    relay_sim::capture::read(&path).expect("fixture").into_iter().map(|b| b.to_vec()).collect()
}

/// Full decode: structure, CAR, every record validated and rendered as JSON.
fn full(frames: &[Vec<u8>], out: &mut String, verify: bool) -> usize {
    let mut n = 0;
    for f in frames {
        out.clear();
        let decoded = frame::decode(f).expect("decode");
        if let Frame::Message(Message::Commit(c)) = &decoded {
            let car = c.car(verify).expect("car");
            for op in &c.ops {
                if let Some(r) = op.record(&car).expect("record") {
                    r.write_json(out);
                }
            }
        }
        n += out.len();
    }
    n
}

fn bench(c: &mut Criterion) {
    let frames = load();
    let mut g = c.benchmark_group("pds-capture");
    g.throughput(Throughput::Elements(frames.len() as u64));
    g.bench_function("structure", |b| {
        b.iter(|| {
            for f in &frames {
                black_box(frame::decode(black_box(f)).expect("decode"));
            }
        });
    });
    let mut out = String::with_capacity(64 << 10);
    g.bench_function("full (records as JSON)", |b| b.iter(|| black_box(full(&frames, &mut out, false))));
    g.bench_function("full + sha256 block verify", |b| b.iter(|| black_box(full(&frames, &mut out, true))));
    g.bench_function("full frame JSON lines", |b| {
        b.iter(|| {
            for f in &frames {
                out.clear();
                let d = frame::decode(f).expect("decode");
                json::write_frame(&d, false, &mut out).expect("json");
                black_box(out.len());
            }
        });
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
