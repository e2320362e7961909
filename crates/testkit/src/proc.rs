//! Running the `firekeeper` binary from a test: its environment, start, stop, and a
//! relay-sim replaying the fixture for it to consume.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use relay_sim::{RelaySim, SimConfig};

use crate::WAIT;

/// The `firekeeper` binary under test: `$FIREKEEPER_BIN`, else the one Cargo built
/// beside the running test or bench (`target/<profile>/firekeeper`; Cargo builds a
/// package's binaries before its integration tests and benches).
///
/// # Panics
/// When neither exists.
#[must_use]
pub fn firekeeper_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FIREKEEPER_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test>-<hash> → target/<profile>/firekeeper
    let bin = exe.parent().and_then(Path::parent).map(|d| d.join("firekeeper")).expect("target dir");
    assert!(bin.exists(), "no firekeeper binary at {} (set FIREKEEPER_BIN)", bin.display());
    bin
}

/// A relay-sim with nothing to replay (a deployment started at the live tail, for
/// benches of repo sync).
///
/// # Panics
/// When it cannot listen.
pub async fn quiet_relay() -> RelaySim {
    RelaySim::start_with(Vec::new(), SimConfig::default(), "127.0.0.1:0".parse().expect("addr")).await.expect("sim")
}

/// A relay-sim replaying the fixture: all published at once (`None`) or paced.
pub async fn sim(rate: Option<u32>) -> RelaySim {
    let cfg = SimConfig { rate, initial_head: rate.map(|_| 0), ..SimConfig::default() };
    RelaySim::start_with(crate::fixture_frames(), cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim")
}

/// The environment of a single firekeeper with fast lease timings.
#[must_use]
pub fn base_env(relay: &str, dir: &Path) -> HashMap<String, String> {
    [
        ("FIREKEEPER_RELAY", relay.to_owned()),
        ("FIREKEEPER_DATA_DIR", dir.join("data").to_string_lossy().into_owned()),
        ("FIREKEEPER_HTTP_ADDR", "off".to_owned()),
        ("FIREKEEPER_LEASE_TTL_MS", "2000".to_owned()),
        ("FIREKEEPER_LEASE_RENEW_MS", "400".to_owned()),
        ("FIREKEEPER_LEASE_OP_TIMEOUT_MS", "250".to_owned()),
        ("FIREKEEPER_LEASE_MARGIN_MS", "500".to_owned()),
        ("FIREKEEPER_LEASE_POLL_MS", "200".to_owned()),
        ("FIREKEEPER_COMMIT_INTERVAL_MS", "100".to_owned()),
        // The test captures' DIDs resolve nowhere (a test that verifies serves a PLC and
        // says so): the binary's default would hold every commit waiting for a key.
        ("FIREKEEPER_VERIFY", "off".to_owned()),
        ("RUST_LOG", "info".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// Starts the binary with `env` only, stderr to `log`.
#[must_use]
pub fn firekeeper<S: std::hash::BuildHasher>(env: &HashMap<String, String, S>, args: &[&str], log: &Path) -> Child {
    Command::new(firekeeper_bin())
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("firekeeper binary")
}

/// [`firekeeper`] with its stdout (the jsonl sink's `-`) written to `stdout`.
#[must_use]
pub fn firekeeper_to<S: std::hash::BuildHasher>(
    env: &HashMap<String, String, S>,
    args: &[&str],
    log: &Path,
    stdout: &Path,
) -> Child {
    Command::new(firekeeper_bin())
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env)
        .stdout(std::fs::File::create(stdout).expect("stdout file"))
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("firekeeper binary")
}

/// Runs a subcommand to completion.
#[must_use]
pub fn run_once<S: std::hash::BuildHasher>(env: &HashMap<String, String, S>, args: &[&str]) -> Output {
    Command::new(firekeeper_bin())
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env)
        .output()
        .expect("firekeeper binary")
}

/// SIGTERM, then [`wait_exit`].
#[must_use]
pub fn sigterm_and_wait(c: Child) -> std::process::ExitStatus {
    assert!(Command::new("kill").args(["-TERM", &c.id().to_string()]).status().expect("kill").success());
    wait_exit(c)
}

/// Waits for the process to exit, failing after [`WAIT`].
#[must_use]
pub fn wait_exit(mut c: Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(s) = c.try_wait().expect("wait") {
            return s;
        }
        assert!(Instant::now() < deadline, "firekeeper did not exit in time");
        std::thread::sleep(Duration::from_millis(20));
    }
}
