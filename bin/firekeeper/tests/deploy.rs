//! The shipped deployment files, checked by the tools that consume them: the alert rules
//! by `promtool test rules` (each alert fires in one case and stays quiet in another) and
//! the compose file by `docker-compose config` for both profiles. `scripts/ensure-deps.sh`
//! installs both tools (Debian `prometheus`, `docker-compose`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("{program} ({e}): run scripts/ensure-deps.sh to install it"))
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn every_alert_fires_when_it_should_and_stays_quiet_otherwise() {
    let rules = std::fs::read_to_string(root().join("deploy/prometheus/firekeeper-rules.yml")).expect("rules");
    let tests = std::fs::read_to_string(root().join("deploy/prometheus/firekeeper-rules.test.yml")).expect("tests");
    let alerts: Vec<&str> = rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert!(alerts.len() >= 11, "{alerts:?}");
    for a in &alerts {
        let cases = tests.matches(&format!("alertname: {a}\n")).count();
        assert!(
            cases >= 2,
            "{a} has {cases} case(s) in firekeeper-rules.test.yml: one that fires and one that stays quiet"
        );
    }
    let o = run("promtool", &["check", "rules", "deploy/prometheus/firekeeper-rules.yml"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run("promtool", &["test", "rules", "deploy/prometheus/firekeeper-rules.test.yml"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run("promtool", &["check", "config", "deploy/prometheus/prometheus.yml"]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn the_compose_file_is_valid_for_both_profiles() {
    for profile in [None, Some("nats")] {
        let mut args = vec![];
        if let Some(p) = profile {
            args.extend(["--profile", p]);
        }
        args.extend(["config", "--services"]);
        let o = run("docker-compose", &args);
        assert!(o.status.success(), "profile {profile:?}: {}", text(&o));
        let services = String::from_utf8_lossy(&o.stdout);
        let want: &[&str] = match profile {
            None => &["redis", "relay", "firekeeper-1", "firekeeper-2", "firekeeper-3", "prometheus"],
            Some(_) => &["nats", "firekeeper-nats-1", "firekeeper-nats-2", "firekeeper-nats-3"],
        };
        for s in want {
            assert!(services.lines().any(|l| l == *s), "profile {profile:?} lacks {s}: {services}");
        }
    }
}
