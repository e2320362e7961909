//! `make run` as a new user runs it: `make run > events.jsonl` must give JSON
//! lines and nothing else, and logs written to a file must carry no colour escapes.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testkit::{free_port, proc::firekeeper_bin, proc::wait_exit, tmpdir};

/// The directory of the binaries under test, with relay-sim built beside firekeeper.
fn bin_dir() -> PathBuf {
    let dir = firekeeper_bin().parent().expect("target dir").to_path_buf();
    if !dir.join("relay-sim").exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "-p", "relay-sim", "--bin", "relay-sim"]);
        if dir.ends_with("release") {
            build.arg("--release");
        }
        assert!(build.status().expect("cargo").success(), "building relay-sim");
    }
    dir
}

fn lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p).unwrap_or_default().lines().map(str::to_owned).collect()
}

#[test]
fn the_demo_writes_only_events_to_stdout_and_plain_logs_to_stderr() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tmpdir("demo");
    let (out, err) = (dir.join("events.jsonl"), dir.join("demo.log"));
    // `make run` exactly as a user types it (top level: no make of ours around it).
    let mut demo = Command::new("make");
    demo.arg("run")
        .current_dir(&root)
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("MAKELEVEL")
        .env("DEMO_BIN_DIR", bin_dir())
        .env("DEMO_LISTEN", format!("127.0.0.1:{}", free_port()))
        .env("RATE", "2000")
        .env("FIREKEEPER_DATA_DIR", &dir)
        .env("FIREKEEPER_HTTP_ADDR", format!("127.0.0.1:{}", free_port()))
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .process_group(0);
    let child = demo.spawn().expect("make run");
    let deadline = Instant::now() + testkit::WAIT;
    while lines(&out).len() < 300 {
        assert!(Instant::now() < deadline, "300 events within {:?}; log:\n{}", testkit::WAIT, lines(&err).join("\n"));
        std::thread::sleep(Duration::from_millis(100));
    }
    // Ctrl-C as a terminal sends it: SIGINT to the whole group.
    let group = format!("-{}", child.id());
    assert!(Command::new("kill").args(["-s", "INT", "--", &group]).status().expect("kill").success());
    let _ = wait_exit(child);
    let events = lines(&out);
    assert!(events.len() >= 300);
    for (i, line) in events.iter().enumerate() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("stdout line {} is not JSON ({e}): {line:?}", i + 1));
        assert!(v.get("seq").and_then(serde_json::Value::as_u64).is_some(), "line {} has a seq: {line}", i + 1);
    }
    let log = std::fs::read_to_string(&err).expect("log");
    assert!(log.contains("INFO"), "text logs went to stderr:\n{log}");
    assert!(!log.contains('\u{1b}'), "no colour escapes in a log file:\n{log}");
}
