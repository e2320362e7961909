//! The shipped deployment files, checked by the tools that consume them: the alert rules
//! by `promtool test rules` (each alert fires in one case and stays quiet in another) and
//! the compose file by `docker-compose config` for both profiles. `scripts/ensure-deps.sh`
//! installs both tools (Debian `prometheus`, `docker-compose`). The Kubernetes manifests by
//! `kubernetes-validate --strict` (in `.tools/venv`, also from ensure-deps) and by the
//! binary's own `check-config` on their settings.

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

/// The `KEY: value` lines of a `ConfigMap`'s `data:` or a Secret's `stringData:` block.
fn env_block(file: &str, block: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(root().join("deploy/kubernetes").join(file)).expect(file);
    let mut out = vec![];
    let mut inside = false;
    for line in text.lines() {
        if line.trim_start().starts_with('#') {
            continue;
        }
        if line == format!("{block}:") {
            inside = true;
        } else if inside {
            let Some(entry) = line.strip_prefix("  ") else { break };
            let (k, v) = entry.split_once(": ").unwrap_or_else(|| panic!("{file}: {line}"));
            out.push((k.to_string(), v.trim_matches('"').to_string()));
        }
    }
    assert!(!out.is_empty(), "{file} has no {block}: block");
    out
}

/// The integer after `key:` in the deployment (the first occurrence).
fn deployment_number(deployment: &str, key: &str) -> u64 {
    let line = deployment.lines().find(|l| l.trim_start().starts_with(key)).unwrap_or_else(|| panic!("no {key}"));
    line.split_once(':').unwrap().1.trim().parse().unwrap_or_else(|e| panic!("{line}: {e}"))
}

#[test]
fn the_kubernetes_manifests_validate_and_agree_with_the_binary() {
    let kv = root().join(".tools/venv/bin/kubernetes-validate");
    let files = ["configmap.yaml", "secret.yaml", "deployment.yaml", "pdb.yaml", "service.yaml"];
    let mut args = vec!["--strict".to_string()];
    args.extend(files.iter().map(|f| format!("deploy/kubernetes/{f}")));
    let o = Command::new(&kv)
        .args(&args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("{} ({e}): run scripts/ensure-deps.sh to install it", kv.display()));
    assert!(o.status.success(), "kubernetes-validate --strict: {}", text(&o));

    // The settings of the ConfigMap and the Secret, with the pod name the Deployment adds,
    // are a configuration the binary accepts (no unknown or misspelt variable, no bad value).
    let config = env_block("configmap.yaml", "data");
    let secret = env_block("secret.yaml", "stringData");
    let o = Command::new(env!("CARGO_BIN_EXE_firekeeper"))
        .arg("check-config")
        .env_clear()
        .envs(config.iter().chain(&secret).map(|(k, v)| (k.as_str(), v.as_str())))
        .env("FIREKEEPER_INSTANCE_ID", "firekeeper-7d9f-abcde")
        .output()
        .expect("firekeeper check-config");
    assert!(o.status.success(), "the manifests' settings are refused: {}", text(&o));
    // Credentials only in the Secret: nothing in the ConfigMap holds a URL with a password
    // or names a credential.
    for (k, v) in &config {
        assert!(!v.contains('@') && !k.contains("URL") && !k.contains("TOKEN"), "{k} belongs in secret.yaml");
    }
    assert!(secret.iter().any(|(k, _)| k == "REDIS_URL"), "REDIS_URL belongs in secret.yaml");

    let deployment = std::fs::read_to_string(root().join("deploy/kubernetes/deployment.yaml")).unwrap();
    // The probes ask for paths the binary serves.
    let http = std::fs::read_to_string(root().join("bin/firekeeper/src/http.rs")).unwrap();
    for probe in ["readinessProbe", "livenessProbe"] {
        let after = deployment.split_once(&format!("{probe}:")).unwrap_or_else(|| panic!("no {probe}")).1;
        let path = after.lines().find_map(|l| l.trim().strip_prefix("path: ")).expect("probe path");
        assert!(http.contains(&format!("\"{path}\" =>")), "{probe} asks for {path}, which http.rs does not serve");
    }
    // SIGTERM is sent after preStop; the drain must finish before the kubelet's SIGKILL.
    let grace = deployment_number(&deployment, "terminationGracePeriodSeconds:");
    let pre_stop: u64 = deployment
        .split_once("preStop:")
        .expect("preStop")
        .1
        .split_once("command: [\"sleep\", \"")
        .expect("preStop sleeps")
        .1
        .split('"')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let drain_ms: u64 =
        config.iter().find(|(k, _)| k == "FIREKEEPER_DRAIN_BUDGET_MS").expect("drain budget").1.parse().unwrap();
    assert!(
        grace > pre_stop + drain_ms.div_ceil(1000),
        "terminationGracePeriodSeconds {grace} must exceed preStop {pre_stop} s + drain budget {drain_ms} ms"
    );
    // Standbys: at least three replicas, and a disruption budget that keeps one running.
    assert!(deployment_number(&deployment, "replicas:") >= 3);
    let pdb = std::fs::read_to_string(root().join("deploy/kubernetes/pdb.yaml")).unwrap();
    assert!(pdb.contains("maxUnavailable: 1"), "{pdb}");
}
