//! `relay-sim --capture FILE [--listen ADDR] [--rate N] [--initial N] [--window-start SEQ] [--copies N]
//! [--jetstream true]`: serve a capture file (repeated `N` times, renumbered) as a local relay, or
//! with `--jetstream true` as a Jetstream instance (`/subscribe` and
//! `/xrpc/network.bsky.jetstream.subscribeEvents`, plain or zstd), until interrupted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use relay_sim::{RelaySim, SimConfig, capture};

fn usage() -> ExitCode {
    eprintln!(
        "usage: relay-sim --capture FILE [--listen 127.0.0.1:2470] [--rate FRAMES_PER_S] [--initial N] [--window-start SEQ] [--copies N] [--jetstream true]"
    );
    ExitCode::from(2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut path, mut listen, mut cfg) = (None::<PathBuf>, "127.0.0.1:2470".to_owned(), SimConfig::default());
    let mut copies = 1usize;
    let mut jetstream = false;
    while let Some(a) = args.next() {
        let Some(v) = args.next() else { return usage() };
        let ok = match a.as_str() {
            "--capture" => {
                path = Some(PathBuf::from(&v));
                true
            }
            "--listen" => {
                listen.clone_from(&v);
                true
            }
            "--rate" => v.parse().map(|r| cfg.rate = Some(r)).is_ok(),
            "--initial" => v.parse().map(|n| cfg.initial_head = Some(n)).is_ok(),
            "--window-start" => v.parse().map(|s| cfg.window_start = Some(s)).is_ok(),
            "--copies" => v.parse().map(|n| copies = n).is_ok_and(|()| copies > 0),
            "--jetstream" => v.parse().map(|j| jetstream = j).is_ok(),
            _ => false,
        };
        if !ok {
            eprintln!("relay-sim: bad argument {a} {v}");
            return usage();
        }
    }
    let Some(path) = path else { return usage() };
    let Ok(addr) = listen.parse::<SocketAddr>() else {
        eprintln!("relay-sim: --listen {listen} is not an address");
        return ExitCode::from(2);
    };
    let frames = match capture::read(&path) {
        Ok(f) if copies > 1 => capture::repeat(&f, copies),
        Ok(f) => f,
        Err(e) => {
            eprintln!("relay-sim: {}: {e}", path.display());
            return ExitCode::from(1);
        }
    };
    let n = frames.len();
    let started = if jetstream {
        let clock = relay_sim::jetstream::Clock { base_us: now_us(), ..relay_sim::jetstream::Clock::default() };
        RelaySim::start_jetstream(&frames, &clock, cfg, addr).await
    } else {
        RelaySim::start_with(frames, cfg, addr).await
    };
    let sim = match started {
        Ok(s) => s,
        Err(e) => {
            eprintln!("relay-sim: cannot listen on {addr}: {e}");
            return ExitCode::from(1);
        }
    };
    let what = if jetstream { "as a Jetstream instance" } else { "as a relay" };
    eprintln!("relay-sim: serving {n} frames from {} {what} on {}", path.display(), sim.url());
    tokio::select! {
        () = sim.wait() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    ExitCode::SUCCESS
}

/// Now, Unix microseconds (a Jetstream instance stamps from its clock).
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(0))
}
